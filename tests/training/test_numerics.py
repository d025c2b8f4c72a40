"""One training step of `diff-transformer train` under each option that changes the numerics (`--bf16`, `--dtype`,
`--gradient-checkpointing`, `--lora`, `--attn-implementation`), V1, V2 and a Motif-shaped V1 (grouped noise heads,
PolyNorm): loss, every gradient and every updated weight through the package's CPU attention functions (as shipped)
against the layer's plain calls (`differential_attention_function` off: what Hub custom code without the package and
a GPU's sdpa run), the same options otherwise. In-process `build_trainer`, a 2-layer model, 2 blocks of 32 tokens.

Tolerances. fp32 against fp32: the project's path-comparison tolerances (tests/model/test_cpu_attention.py). bf16
(autocast or bf16 weights): the unit is the bf16 error the plain path itself makes, measured in the same test as its
distance from the fp32 plain step (C). The shipped step A rounds where the plain step B does, or less (the blocked
function computes attention in fp32), so |A - C| is at most about |B - C| and |A - B| ≤ |A - C| + |B - C|; the bound
allows |A - C| twice B's error (the maxima of two same-scale errors over a tensor differ by well under 2x), so
3 |B - C| per tensor, plus an fp32 floor; 4 |B - C| for eager, which rounds more than sdpa (its probabilities, to
bf16). Updated weights: AdamW's first step moves each weight by lr g / (|g| + ε), whose difference for two
gradients is at most 2 lr |gA - gB| / (max(|gA|, |gB|) + ε); plus 4 ulps of the weight.
"""

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import TrainerCallback

import diff_transformer.integrations.cpu_attention as cpu
import diff_transformer.modeling_diff as modeling
from diff_transformer.integrations.cpu_attention import CpuStrategy
from diff_transformer.training.args import parse_train_args
from diff_transformer.training.train import build_trainer
from tests.helpers import REPOSITORY
from tests.helpers.checkpoints import save_trainable_checkpoint
from tests.helpers.training import QUIET


HELDOUT = (REPOSITORY / "src" / "diff_transformer" / "assets" / "heldout.txt").read_text(encoding="utf-8")
LR, EPS = 1e-3, 1e-8  # AdamW's ε (Trainer's default adam_epsilon)
STEP = ["--max-steps", "1", "--eval-fraction", "0", "--logging-steps", "1", "--max-grad-norm", "0"]
STEP += ["--batch-size", "2", "--seed", "3", "--lr", str(LR), "--lr-scheduler", "constant"]
MODELS = {
    "v1": dict(version=1),
    "v2": dict(version=2),
    "motif-v1": dict(
        version=1, num_attention_heads=4, num_key_value_heads=2, num_noise_heads=2, head_dim=8, hidden_act="poly_norm"
    ),
}
BF16 = ["--bf16", "on"]
OPTIONS = {  # id -> train options; the bf16 ones are compared within the bf16 bound
    "bf16": BF16,
    "fp32": [],
    "bf16-checkpointing": [*BF16, "--gradient-checkpointing"],
    "checkpointing": ["--gradient-checkpointing"],
    "bf16-lora": [*BF16, "--lora"],
    "lora": ["--lora"],
    "dtype-bf16": ["--dtype", "bfloat16"],
    "bf16-eager": [*BF16, "--attn-implementation", "eager"],
    "bf16-map-first": [*BF16, "--attn-implementation", "diff_map_first"],
    "eager": ["--attn-implementation", "eager"],
    # torch.compile through Trainer; aot_eager traces forward and backward as inductor would and runs the traced ops
    # (inductor itself: tests/training/test_train.py::test_train_compile_with_inductor)
    "compile": ["--compile-backend", "aot_eager"],
    "bf16-compile": [*BF16, "--compile-backend", "aot_eager"],
    "compile-lora": ["--lora", "--compile-backend", "aot_eager"],
}
QUICK = {("v1", "bf16"), ("v2", "bf16"), ("motif-v1", "bf16"), ("v1", "compile")}  # bf16: the crash it was written for


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("numerics")
    for name, spec in MODELS.items():
        spec = dict(spec)
        save_trainable_checkpoint(root / name, spec.pop("version"), **spec)
    (root / "text.txt").write_text(HELDOUT[:600], encoding="utf-8")  # a few blocks; the step reads the first 2
    return root


class RecordGrads(TrainerCallback):
    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}


_steps = {}  # (model, options, plain) -> result: the fp32 plain step is shared by the rows of one model


def one_step(workdir, tmp_path_factory, monkeypatch, model, options, plain):
    key = (model, tuple(options), plain)
    if key in _steps:
        return _steps[key]
    ran, select = [], cpu.select_cpu_strategy
    with monkeypatch.context() as patch:
        patch.setattr(cpu, "select_cpu_strategy", lambda *a, **k: ran.append(select(*a, **k)) or ran[-1])
        if plain:
            patch.setattr(modeling, "differential_attention_function", lambda *args: None)
        output = tmp_path_factory.mktemp("step")
        argv = [str(workdir / model), "--data", str(workdir / "text.txt"), "--output", str(output), *QUIET, *STEP]
        trainer = build_trainer(parse_train_args(argv + list(options))).trainer
        record = RecordGrads()
        trainer.add_callback(record)
        before = {n: p.detach().float().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
        torch._dynamo.reset()  # each compiled run starts from no graphs (dynamo's recompile limit is per code object)
        counters.clear()
        trainer.train()
    graphs = counters["stats"]["unique_graphs"]
    after = {n: p.detach().float().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    dtype = next(p.dtype for p in trainer.model.parameters() if p.requires_grad and p.dim() == 2)
    loss = torch.tensor([trainer.state.log_history[0]["loss"]], dtype=torch.float64)
    _steps[key] = result = dict(
        loss=loss,
        grads=record.grads,
        before=before,
        after=after,
        ran=ran,
        dtype=dtype,
        graphs=graphs,
        lambdas={k: v for k, v in trainer.state.log_history[0].items() if k.startswith("lambda")},
    )
    return result


def max_abs(x):
    return x.abs().max().item()


@pytest.mark.parametrize(
    "model, option",
    [
        pytest.param(m, o, marks=() if (m, o) in QUICK else pytest.mark.slow, id=f"{m}-{o}")
        for m in MODELS
        for o in OPTIONS
    ],
)
def test_one_step_equals_the_plain_path(workdir, tmp_path_factory, monkeypatch, model, option):
    options = OPTIONS[option]
    shipped = one_step(workdir, tmp_path_factory, monkeypatch, model, options, plain=False)
    plain = one_step(workdir, tmp_path_factory, monkeypatch, model, options, plain=True)
    assert plain["ran"] == []
    # compiled: the whole forward as one graph (a graph break would make more); otherwise nothing compiled
    assert shipped["graphs"] == plain["graphs"] == (1 if "--compile-backend" in options else 0)
    # λ's log, which V2 gathers by forward hooks (traced into the graph when compiled): the same keys, and in fp32 the
    # same values within the fp32 path tolerance (bf16 rounds λ's statistics too)
    assert shipped["lambdas"].keys() == plain["lambdas"].keys() and len(shipped["lambdas"]) >= 5
    for key, value in plain["lambdas"].items():
        in_fp32 = "--bf16" not in options and "bfloat16" not in options
        assert not in_fp32 or shipped["lambdas"][key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    eager = "eager" in options
    in_bf16 = options[:2] == BF16 or "bfloat16" in options
    if eager:  # no differential function: the plain calls are the path; compared with sdpa's plain calls below
        assert shipped["ran"] == []
        plain = one_step(workdir, tmp_path_factory, monkeypatch, model, options[:-2], plain=True)
    elif "bfloat16" in options or "--compile-backend" in options:
        # bf16 weights, or a compiled graph (transformers then builds the causal mask instead of sdpa's is_causal):
        # V1 attends through the padded sdpa calls, V2 through its plain ones
        assert set(shipped["ran"]) == ({CpuStrategy.PADDED_WIDE_VALUE} if model != "v2" else {None})
    else:  # fp32 q and k, under autocast too: the blocked function, the one this matrix guards
        assert set(shipped["ran"]) == {CpuStrategy.BLOCKED_DIFF_MAP}
    assert shipped["grads"].keys() == plain["grads"].keys() and shipped["after"].keys() == plain["after"].keys()
    assert len(shipped["grads"]) >= (4 if "--lora" in options else 20)
    fp32 = None
    if in_bf16:
        lora = ["--lora"] if "--lora" in options else []
        fp32 = one_step(workdir, tmp_path_factory, monkeypatch, model, lora, plain=True)
    factor = 4 if eager else 3  # eager rounds its probabilities to bf16 before the product with V (sdpa does not)
    checked = [("loss", shipped["loss"], plain["loss"], fp32 and fp32["loss"])]
    checked += [(f"grad {n}", g, plain["grads"][n], fp32 and fp32["grads"][n]) for n, g in shipped["grads"].items()]
    for name, a, b, c in checked:
        if c is None:  # fp32 against fp32
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)
        else:
            bound = factor * max_abs(b - c) + 1e-5 * max_abs(c)
            assert max_abs(a - b) <= bound, f"{name}: |A - B| = {max_abs(a - b):.3g} > {bound:.3g} ({factor} |B - C|)"
    ulp = torch.finfo(shipped["dtype"]).eps
    for name, after in shipped["after"].items():
        g_a, g_b = shipped["grads"].get(name), plain["grads"].get(name)
        moved = 0 if g_a is None else 2 * LR * (g_a - g_b).abs() / (g_a.abs().max(g_b.abs()) + EPS)
        bound = moved + 4 * ulp * shipped["before"][name].abs().max(after.abs()) + 4 * 2**-24 * LR
        assert ((after - plain["after"][name]).abs() <= bound).all(), f"updated {name}"


@pytest.mark.parametrize("model", [pytest.param(m, marks=() if m == "v2" else pytest.mark.slow) for m in MODELS])
def test_a_compiled_step_equals_the_uncompiled_one(workdir, tmp_path_factory, monkeypatch, model):
    """`--compile-backend aot_eager` against the same step uncompiled, both through the package's functions: loss,
    every gradient and λ's log within the fp32 path tolerance (the compiled graph gets an explicit causal mask, so V1
    attends through its padded sdpa calls instead of the blocked function: a different summation order, no more)."""
    compiled = one_step(workdir, tmp_path_factory, monkeypatch, model, OPTIONS["compile"], plain=False)
    eager = one_step(workdir, tmp_path_factory, monkeypatch, model, [], plain=False)
    assert compiled["graphs"] == 1 and eager["graphs"] == 0
    torch.testing.assert_close(compiled["loss"], eager["loss"], rtol=1e-4, atol=1e-5)
    assert compiled["grads"].keys() == eager["grads"].keys()
    for name, grad in eager["grads"].items():
        torch.testing.assert_close(compiled["grads"][name], grad, rtol=1e-4, atol=1e-5, msg=name)
    assert compiled["lambdas"].keys() == eager["lambdas"].keys()
    for key, value in eager["lambdas"].items():
        assert compiled["lambdas"][key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
