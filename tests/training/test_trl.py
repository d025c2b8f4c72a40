"""TRL's `SFTTrainer` and `GRPOTrainer` with their default configs, one step on CPU, on tiny V1, V2 and Motif-shaped V1
checkpoints, and on a Llama of the same sizes as the baseline (issue 55: GRPO's defaults crashed on our model where
Llama trained).

TRL's defaults kept: bf16 (mixed precision: fp32 weights under autocast, TRL loads models in fp32), gradient
checkpointing, the optimizer (fused AdamW), learning rate, scheduler, gradient clipping, GRPO's loss ("dapo"), β = 0,
sampling (temperature 1) through transformers' `generate` (`use_vllm` is off by default: no vLLM needed).
Overridden, and why:
- `use_cpu=True`: with bf16 on (TRL's default) transformers refuses to build the arguments on a machine without a bf16
  GPU ("You need to assign use_cpu if you want to train the model on CPU"); it is what a CPU user must pass.
- `max_steps=1` (not 3 epochs), `per_device_train_batch_size=2` (not 8); GRPO: `num_generations=2` (not 8, 2 is the
  least a group's advantage needs) and `max_completion_length=8` (not 512): one small step.
- Reporting: nothing to change (`report_to` defaults to none in transformers 5).

Asserted: the arguments TRL built have bf16 on, and every training forward of every decoder layer ran under CPU
autocast in bf16 (the precision TRL chose); the package's CPU attention took the path the batch implies: for GRPO's
group (one prompt, completions of full length, no mask) the blocked differential attention, whose backward crashed
under autocast (these GRPO cases fail with issue 55's error before commit c90bbf4, the Llama ones pass); for SFT's
padded batch V1's padded sdpa calls and V2's plain calls. The loss is finite; every attention parameter got a non-zero
finite gradient and changed in the step; GRPO called the reward function defined here with each prompt's completions
(strings, grouped by prompt, distinct so that the group's advantages are not zero).
"""

import math
import zlib

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, TrainerCallback

import diff_transformer.integrations.cpu_attention as cpu
from diff_transformer.integrations.cpu_attention import CpuStrategy
from tests.helpers import REPOSITORY
from tests.helpers.checkpoints import TINY_LLAMA, save_trainable_checkpoint


trl = pytest.importorskip("trl")

SIZES = dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1)  # the checkpoints'
MODELS = {
    "v1": dict(version=1),
    "v2": dict(version=2),
    "motif-v1": dict(
        version=1, num_attention_heads=4, num_key_value_heads=2, num_noise_heads=2, head_dim=8, hidden_act="poly_norm"
    ),
    "llama": None,  # transformers' LlamaForCausalLM, the same sizes: the baseline
}
QUICK = {("sft", "v2"), ("grpo", "v1")}
HELDOUT = (REPOSITORY / "src" / "diff_transformer" / "assets" / "heldout.txt").read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("trl")
    for name, spec in MODELS.items():
        if spec is not None:
            spec = dict(spec)
            save_trainable_checkpoint(root / name, spec.pop("version"), **spec)
    tokenizer = AutoTokenizer.from_pretrained(TINY_LLAMA)
    torch.manual_seed(0)
    config = LlamaConfig(
        **SIZES,
        num_hidden_layers=2,
        vocab_size=len(tokenizer),
        max_position_embeddings=64,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    LlamaForCausalLM(config).save_pretrained(root / "llama")
    tokenizer.save_pretrained(root / "llama")
    return root


def lines(n, words):
    """n short passages of the held-out text (a few words each: well inside the tiny models' 64 positions)."""
    text = HELDOUT.split()
    return [" ".join(text[i * words : (i + 1) * words]) for i in range(n)]


class Record(TrainerCallback):
    """The gradients the optimizer is about to apply."""

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}


def run_one_step(trainer, monkeypatch):
    """Train `trainer` one step; what its training forwards ran under (autocast, padded masks, CPU strategies), its
    loss, its gradients and weights."""
    model = trainer.model
    autocast, padded, strategies, losses = [], [], [], []

    def layer_hook(module, args, output):
        if torch.is_grad_enabled():  # a training forward (generation and GRPO's log-probabilities run without grad)
            autocast.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))

    def model_hook(module, args, kwargs):
        mask = kwargs.get("attention_mask")
        if torch.is_grad_enabled():
            padded.append(mask is not None and not bool(mask.all()))

    handles = [layer.register_forward_hook(layer_hook) for layer in model.model.layers]
    handles.append(model.register_forward_pre_hook(model_hook, with_kwargs=True))
    select = cpu.select_cpu_strategy

    def recording_select(*args, **kwargs):
        strategy = select(*args, **kwargs)
        if torch.is_grad_enabled():
            strategies.append(strategy)
        return strategy

    monkeypatch.setattr(cpu, "select_cpu_strategy", recording_select)
    compute_loss = trainer.compute_loss

    def recording_compute_loss(*args, **kwargs):
        loss = compute_loss(*args, **kwargs)
        losses.append((loss[0] if isinstance(loss, tuple) else loss).detach().float().item())
        return loss

    monkeypatch.setattr(trainer, "compute_loss", recording_compute_loss)
    record = Record()
    trainer.add_callback(record)
    before = {n: p.detach().float().clone() for n, p in model.named_parameters() if p.requires_grad}
    try:
        trainer.train()
    finally:
        for handle in handles:
            handle.remove()
    after = {n: p.detach().float().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    return dict(
        dtypes={p.dtype for p in trainer.model.parameters()},
        autocast=autocast,
        padded=padded,
        strategies=strategies,
        losses=losses,
        grads=record.grads,
        before=before,
        after=after,
    )


def check_step(name, args, result, layers):
    assert args.bf16 and not args.fp16, "TRL's CPU default is bf16 mixed precision"
    assert result["dtypes"] == {torch.float32}, "mixed precision: fp32 weights"
    assert result["autocast"] and len(result["autocast"]) % layers == 0
    assert set(result["autocast"]) == {(True, torch.bfloat16)}, "every training forward under bf16 autocast"
    assert len(set(result["padded"])) == 1, result["padded"]
    if name == "llama":
        assert result["strategies"] == []
    elif not result["padded"][0]:  # fp32 q and k (RoPE) under autocast, no mask: the blocked function
        assert set(result["strategies"]) == {CpuStrategy.BLOCKED_DIFF_MAP}
    else:  # a padded batch: V1's padded sdpa calls, V2's plain calls
        assert set(result["strategies"]) == {CpuStrategy.PADDED_WIDE_VALUE if name != "v2" else None}
    assert len(result["losses"]) == 1 and math.isfinite(result["losses"][0]), result["losses"]
    attention = [n for n in result["before"] if ".self_attn." in n]
    assert len(attention) >= 4 * layers, attention
    for n in attention:
        grad = result["grads"][n]
        assert torch.isfinite(grad).all() and grad.abs().max() > 0, f"gradient of {n}"
        assert not torch.equal(result["after"][n], result["before"][n]), f"{n} unchanged by the step"
    for n, grad in result["grads"].items():
        assert torch.isfinite(grad).all(), f"gradient of {n}"


def cases(kind):
    return [pytest.param(m, marks=() if (kind, m) in QUICK else pytest.mark.slow, id=m) for m in MODELS]


@pytest.mark.parametrize("name", cases("sft"))
def test_sft_default_config_one_step(workdir, tmp_path, monkeypatch, name):
    from datasets import Dataset

    config = trl.SFTConfig(output_dir=str(tmp_path), use_cpu=True, max_steps=1, per_device_train_batch_size=2)
    dataset = Dataset.from_list([{"text": t} for t in lines(4, 12)])
    trainer = trl.SFTTrainer(model=str(workdir / name), train_dataset=dataset, args=config)
    assert trainer.args.gradient_checkpointing  # TRL's default, kept
    result = run_one_step(trainer, monkeypatch)
    check_step(name, trainer.args, result, len(trainer.model.model.layers))
    assert result["padded"][0], "passages of different lengths: a padded batch"


@pytest.mark.parametrize("name", cases("grpo"))
def test_grpo_default_config_one_step(workdir, tmp_path, monkeypatch, name):
    from datasets import Dataset

    calls = []

    def reward_distinct(completions, prompts, **kwargs):
        """A reward that differs for different texts, so that a group's advantages are not all zero."""
        calls.append((list(prompts), list(completions)))
        return [zlib.crc32(c.encode()) / 2**32 for c in completions]

    config = trl.GRPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        max_steps=1,
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=8,
    )
    dataset = Dataset.from_list([{"prompt": t} for t in lines(4, 6)])
    model = str(workdir / name)
    trainer = trl.GRPOTrainer(model=model, reward_funcs=reward_distinct, train_dataset=dataset, args=config)
    assert not trainer.args.use_vllm and trainer.args.gradient_checkpointing  # TRL's defaults, kept
    result = run_one_step(trainer, monkeypatch)
    check_step(name, trainer.args, result, len(trainer.model.model.layers))
    # one prompt, two completions of max_completion_length (no EOS drawn at seed 42): no mask, the blocked function
    assert not result["padded"][0]
    assert len(calls) == 1, "one generation round for one step"
    prompts, completions = calls[0]
    assert len(completions) == 2 and all(isinstance(c, str) for c in completions)
    assert prompts[0] == prompts[1] and prompts[0] in dataset["prompt"], "one prompt's group of 2"
    assert completions[0] != completions[1], "a group of equal completions has no advantage to train on"
