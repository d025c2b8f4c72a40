"""`diff-transformer train` (diff_transformer.training): packing, Trainer runs on tiny Diff models, λ logging,
--diff-only-steps, exact resume, LoRA, CLI errors. Runs train in-process (cli.main / build_trainer) on a 2-layer
model with the shipped tokenizer; a few steps each."""

import contextlib
import io
import json
import math
import os
import re
import shutil
import stat
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

from diff_transformer import DiffForCausalLM, cli
from diff_transformer.evaluation import format_perplexity
from diff_transformer.training.args import parse_train_args
from diff_transformer.training.data import build_datasets, held_out_indices, pack, tokenize_files
from diff_transformer.training.freeze import differential_parameters
from diff_transformer.training.train import build_trainer
from tests.helpers import REPOSITORY
from tests.helpers.checkpoints import save_trainable_checkpoint
from tests.helpers.training import BLOCK, QUIET


ASSETS = REPOSITORY / "src" / "diff_transformer" / "assets"
TOKENIZER = ASSETS / "tiny-llama"
HELDOUT = (ASSETS / "heldout.txt").read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """Tiny random Diff V1 and V2 checkpoints with the shipped tokenizer, and two text files."""
    root = tmp_path_factory.mktemp("train")
    for version in (1, 2):
        save_trainable_checkpoint(root / f"v{version}", version)
    (root / "text.txt").write_text(HELDOUT[:2500], encoding="utf-8")  # ~25 blocks of 32 tokens
    (root / "repeat.txt").write_text(HELDOUT[:300] * 8, encoding="utf-8")
    return root


def train(workdir, version, output, *extra):
    argv = [
        "train",
        str(workdir / f"v{version}"),
        "--data",
        str(workdir / "text.txt"),
        "--output",
        str(output),
        *QUIET,
        *extra,
    ]
    assert cli.main(argv) == 0


def trainer_for(workdir, version, output, *extra):
    argv = [str(workdir / f"v{version}"), "--data", str(workdir / "text.txt"), "--output", str(output), *QUIET, *extra]
    return build_trainer(parse_train_args(argv)).trainer


def history(output):
    return json.loads((Path(output) / "trainer_state.json").read_text())["log_history"]


def train_logs(output):
    return {entry["step"]: entry for entry in history(output) if "loss" in entry}


# --- data -------------------------------------------------------------------------------------------------------


def test_packing_gives_the_exact_token_stream(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)  # bos <s> = 0, eos </s> = 1
    (tmp_path / "a.txt").write_text("Emma was handsome.", encoding="utf-8")
    (tmp_path / "b.jsonl").write_text('{"text": "It is"}\n\n{"text": "a truth.\\n", "id": 7}\n', encoding="utf-8")
    stream = tokenize_files(tokenizer, [tmp_path / "a.txt", tmp_path / "b.jsonl"])
    # E m m a Ġwas Ġhandsome . </s> | It Ġis </s> | a Ġtruth . Ċ </s>
    assert stream == [42, 82, 82, 70, 311, 1580, 19, 1, 1165, 372, 1, 70, 2029, 19, 204, 1]
    assert pack(stream, 6, bos_token_id=0).tolist() == [
        [0, 42, 82, 82, 70, 311],
        [0, 1580, 19, 1, 1165, 372],
        [0, 1, 70, 2029, 19, 204],
    ]  # the last eos does not fill a block: dropped
    assert pack(stream, 6).tolist() == [[42, 82, 82, 70, 311, 1580], [19, 1, 1165, 372, 1, 70]]


def test_held_out_split_is_even_and_disjoint(tmp_path):
    assert held_out_indices(10, 0.2).tolist() == [2, 7]
    assert held_out_indices(10, 0.01).tolist() == [5] and held_out_indices(10, 0).tolist() == []
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    (tmp_path / "t.txt").write_text(HELDOUT[:3000], encoding="utf-8")
    blocks = pack(tokenize_files(tokenizer, [tmp_path / "t.txt"]), 16, 0)
    train, held = build_datasets(tokenizer, [tmp_path / "t.txt"], 16, eval_fraction=0.2)
    index = held_out_indices(len(blocks), 0.2)
    assert torch.equal(held.blocks, blocks[index])
    rest = torch.ones(len(blocks), dtype=torch.bool)
    rest[index] = False
    assert torch.equal(train.blocks, blocks[rest])
    assert train[0]["input_ids"] is train[0]["labels"] or torch.equal(train[0]["input_ids"], train[0]["labels"])


# --- one full run: loss, perplexity, saved model, TensorBoard, exact resume ---------------------------------------


@pytest.fixture(scope="module")
def v2_run(workdir):
    """12 steps on repeated text, checkpoints at 6 and 12, eval at 0, 6 and 12, TensorBoard on."""
    output = workdir / "run-v2"
    argv = ["train", str(workdir / "v2"), "--data", str(workdir / "repeat.txt"), "--output", str(output), "--quiet"]
    argv += ["--block-size", str(BLOCK), "--batch-size", "4", "--eval-batch-size", "3", "--eval-fraction", "0.25"]
    argv += [
        "--max-steps",
        "12",
        "--lr",
        "1e-2",
        "--warmup-steps",
        "2",
        "--weight-decay",
        "0.1",
        "--logging-steps",
        "1",
    ]
    argv += ["--save-steps", "6", "--eval-steps", "6", "--eval-on-start", "--report-to", "tensorboard"]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert cli.main(argv) == 0
    (workdir / "run-v2.stdout").write_text(printed.getvalue())  # what the run printed, for the tests that read it
    return argv, output


def test_the_final_perplexity_names_what_it_scored(workdir, v2_run):
    """Issue 57: every printed perplexity names its text and token count; train's last line says which blocks."""
    metrics = json.loads((v2_run[1] / "eval_results.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(v2_run[1])
    _, held = build_datasets(tokenizer, [workdir / "repeat.txt"], BLOCK, eval_fraction=0.25)
    expected = (
        f"perplexity {metrics['eval_perplexity']:.3f} on {len(held):,} blocks of {BLOCK} tokens held out of --data "
        "(--eval-fraction 0.25)"
    )
    assert expected in (workdir / "run-v2.stdout").read_text()


def test_perplexity_prints_readably_however_large():
    assert format_perplexity(1.5) == "1.500" and format_perplexity(52.049) == "52.049"
    assert format_perplexity(52.049, 2) == "52.05" and format_perplexity(999_999.5) == "999999.500"
    assert format_perplexity(1e12) == "1.000e+12"
    assert format_perplexity(math.exp(700)) == "1.014e+304"  # printed as 305 digits before
    assert format_perplexity(float("inf")) == "inf"


def test_a_diverged_run_prints_its_perplexity_in_a_few_characters(workdir, tmp_path, capsys):
    """--lr 10 takes the loss past 709, where exp overflows: the perplexity is inf, not exp(700)'s 305 digits."""
    train(workdir, 2, tmp_path, "--max-steps", "3", "--lr", "10")
    loss = json.loads((tmp_path / "eval_results.json").read_text())["eval_loss"]
    printed = re.search(r"perplexity (\S+) on", capsys.readouterr().out).group(1)
    assert printed == ("inf" if loss > 709.78 else format_perplexity(math.exp(loss))) and len(printed) <= 10


def test_loss_decreases_on_repeated_text(v2_run):
    logs = train_logs(v2_run[1])
    assert sorted(logs) == list(range(1, 13))
    assert logs[12]["loss"] < logs[1]["loss"] - 1.0, (logs[1]["loss"], logs[12]["loss"])
    evals = [entry for entry in history(v2_run[1]) if "eval_loss" in entry]
    assert [entry["step"] for entry in evals] == [0, 6, 12] and evals[2]["eval_loss"] < evals[0]["eval_loss"]
    # the evaluation at the last step is the final one: reused, not run (and printed) a second time
    final = json.loads((v2_run[1] / "eval_results.json").read_text())
    assert final["eval_loss"] == evals[2]["eval_loss"]
    assert (v2_run[1].parent / "run-v2.stdout").read_text().count("'eval_loss'") == 3


def test_eval_perplexity_is_mean_token_nll_of_the_saved_model(workdir, v2_run):
    output = v2_run[1]
    metrics = json.loads((output / "eval_results.json").read_text())
    assert metrics["eval_perplexity"] == pytest.approx(math.exp(metrics["eval_loss"]), rel=1e-12)
    model = AutoModelForCausalLM.from_pretrained(output).eval()  # the saved final model and tokenizer reload
    assert type(model).__name__ == "DiffForCausalLM"
    tokenizer = AutoTokenizer.from_pretrained(output)
    _, held = build_datasets(tokenizer, [workdir / "repeat.txt"], BLOCK, eval_fraction=0.25)
    assert len(held) % 3 != 0  # eval batches of 3 with a shorter last one: weighting is exercised
    with torch.no_grad():
        logits = model(held.blocks).logits
    nll = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), held.blocks[:, 1:].reshape(-1)
    )
    assert metrics["eval_loss"] == pytest.approx(nll.item(), rel=1e-5)


def test_tensorboard_events_hold_lambda_scalars(v2_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    runs = list((v2_run[1] / "runs").iterdir())
    assert len(runs) == 1
    events = EventAccumulator(str(runs[0]))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "eval/perplexity", "train/lambda/layer_00", "train/lambda_std/layer_01"} <= tags
    logged = {e.step: e.value for e in events.Scalars("train/lambda/layer_01")}
    logs = train_logs(v2_run[1])
    assert sorted(logged) == list(range(1, 13))
    assert all(logged[s] == pytest.approx(logs[s]["lambda/layer_01"], rel=1e-6) for s in logged)
    assert logs[1]["lambda_std/layer_01"] > 0  # sigmoid of a random projection: per-token values differ


def test_resume_reproduces_the_uninterrupted_run(workdir, v2_run):
    argv, full = v2_run
    resumed = workdir / "run-v2-resumed"
    resumed.mkdir()
    shutil.copytree(full / "checkpoint-6", resumed / "checkpoint-6")  # as if the run had stopped after step 6
    argv = [resumed if a == str(full) else a for a in argv]
    assert cli.main([str(a) for a in argv] + ["--resume"]) == 0
    expected, got = train_logs(full), train_logs(resumed)
    assert sorted(got) == list(range(1, 13))  # steps 1-6 come from the checkpoint's trainer_state.json
    for step in range(7, 13):
        for key, value in expected[step].items():
            if key.startswith(("loss", "grad_norm", "learning_rate", "lambda")):
                assert got[step][key] == value, (step, key)
    a, b = load_file(full / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert a.keys() == b.keys()
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst == 0.0, worst  # bit for bit on CPU: same data order, RNG, optimizer and scheduler state


def test_resume_inside_the_diff_only_phase_is_exact(workdir, tmp_path):
    common = (
        "--diff-only-steps",
        "3",
        "--max-steps",
        "4",
        "--save-steps",
        "2",
        "--lr",
        "1e-2",
        "--weight-decay",
        "0.1",
    )
    common += ("--logging-steps", "1", "--eval-fraction", "0", "--batch-size", "2")
    train(workdir, 2, tmp_path / "full", *common)
    (tmp_path / "resumed").mkdir()
    shutil.copytree(tmp_path / "full" / "checkpoint-2", tmp_path / "resumed" / "checkpoint-2")
    train(workdir, 2, tmp_path / "resumed", *common, "--resume")  # freezes again, unfreezes after step 3
    for step in (3, 4):
        assert train_logs(tmp_path / "resumed")[step]["loss"] == train_logs(tmp_path / "full")[step]["loss"]
    a, b = load_file(tmp_path / "full" / "model.safetensors"), load_file(tmp_path / "resumed" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


# --- λ logging ----------------------------------------------------------------------------------------------------


def test_lambda_v1_logs_equal_the_scalar_from_the_weights(workdir, tmp_path):
    train(
        workdir,
        1,
        tmp_path,
        "--max-steps",
        "4",
        "--lr",
        "1e-2",
        "--logging-steps",
        "1",
        "--save-steps",
        "2",
        "--eval-fraction",
        "0",
    )
    logs = train_logs(tmp_path)
    for step, weights in (
        (2, load_file(tmp_path / "checkpoint-2" / "model.safetensors")),
        (4, load_file(tmp_path / "model.safetensors")),
    ):
        for layer in (0, 1):
            p = f"model.layers.{layer}.self_attn.diff_lambda."
            dot = lambda a, b: torch.sum(weights[p + a].double() * weights[p + b].double())  # noqa: E731
            lambda_init = 0.8 - 0.6 * math.exp(-0.3 * layer)
            expected = math.exp(dot("lambda_q1", "lambda_k1")) - math.exp(dot("lambda_q2", "lambda_k2")) + lambda_init
            assert logs[step][f"lambda/layer_{layer:02d}"] == pytest.approx(expected, abs=1e-6)
    assert logs[4]["lambda/layer_00"] != logs[2]["lambda/layer_00"]


def test_lambda_v2_logs_equal_a_manual_forward(workdir, tmp_path):
    # One step whose single batch holds every training block: the statistics are those of all blocks under the
    # initial weights (the forward runs before the update).
    trainer = trainer_for(
        workdir, 2, tmp_path, "--max-steps", "1", "--batch-size", "64", "--eval-fraction", "0", "--logging-steps", "1"
    )
    blocks = trainer.train_dataset.blocks
    model = AutoModelForCausalLM.from_pretrained(workdir / "v2", attn_implementation="eager").eval()
    with torch.no_grad():
        hidden = model(blocks, output_hidden_states=True).hidden_states  # hidden[i] = input of layer i
    expected = {}
    for i, layer in enumerate(model.model.layers):
        lam = torch.sigmoid(layer.self_attn.diff_lambda.proj(layer.input_layernorm(hidden[i]))).double()
        expected[i] = (lam.mean().item(), lam.std(unbiased=False).item())
    trainer.train()
    log = trainer.state.log_history[0]
    for i, (mean, std) in expected.items():
        assert log[f"lambda/layer_{i:02d}"] == pytest.approx(mean, abs=1e-6)
        assert log[f"lambda_std/layer_{i:02d}"] == pytest.approx(std, abs=1e-6)
    assert expected[0][1] > 1e-3  # random projections: a non-trivial spread to compare


# --- gradient accumulation ----------------------------------------------------------------------------------------


class RecordGrads(TrainerCallback):
    def __init__(self):
        self.grads = None

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_grad_accumulation_matches_a_larger_batch(workdir, tmp_path):
    (tmp_path / "two.txt").write_text(HELDOUT[:300], encoding="utf-8")  # 2 blocks: the step sees both either way
    results = []
    for batch, accum in ((2, 1), (1, 2)):
        argv = [
            str(workdir / "v2"),
            "--data",
            str(tmp_path / "two.txt"),
            "--output",
            str(tmp_path / f"b{batch}"),
            *QUIET,
        ]
        argv += ["--batch-size", str(batch), "--grad-accum", str(accum), "--max-steps", "1", "--eval-fraction", "0"]
        argv += ["--max-grad-norm", "0", "--logging-steps", "1", "--seed", "3"]
        run = build_trainer(parse_train_args(argv))
        assert run.resume is None and run.block_size == BLOCK
        trainer = run.trainer
        assert len(trainer.train_dataset) == 2
        record = RecordGrads()
        trainer.add_callback(record)
        trainer.train()
        results.append((trainer.state.log_history[0]["loss"], record.grads))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert loss_a == pytest.approx(loss_b, rel=1e-6)
    assert grads_a.keys() == grads_b.keys() and len(grads_a) > 10
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=1e-5, atol=1e-7, msg=name)


def test_gradient_checkpointing_changes_nothing_but_memory(workdir, tmp_path):
    results = []
    for extra in ((), ("--gradient-checkpointing",)):
        trainer = trainer_for(
            workdir,
            2,
            tmp_path / str(len(extra)),
            "--max-steps",
            "1",
            "--eval-fraction",
            "0",
            "--logging-steps",
            "1",
            *extra,
        )
        assert trainer.args.activation_checkpointing == bool(extra)
        record = RecordGrads()
        trainer.add_callback(record)
        trainer.train()
        assert trainer.model.is_activation_checkpointing == bool(extra)
        results.append((trainer.state.log_history[0], record.grads))
    (log_a, grads_a), (log_b, grads_b) = results
    for key in ("loss", "lambda/layer_00", "lambda_std/layer_00", "lambda/layer_01", "lambda_std/layer_01"):
        assert log_b[key] == pytest.approx(log_a[key], rel=1e-6), key  # the recomputed forward does not skew λ stats
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.slow  # inductor generates and compiles C++ for the forward and the backward (~20 s per model here)
@pytest.mark.parametrize("version", [1, 2])
def test_train_compile_with_inductor(workdir, tmp_path, version):
    """`train --compile`: Trainer compiles the model with inductor (the default backend), which trains as the eager
    model does within fp32 reassociation (inductor fuses and reorders sums: the project's fp32 path tolerance, 1e-4),
    and the final checkpoint has the eager run's tensor names (no `_orig_mod.` prefix) and loads with the Auto class.
    The traced-graph checks (one graph, no recompiles, every model kind) are tests/training/test_numerics.py's."""
    steps = ["--max-steps", "2", "--eval-fraction", "0", "--logging-steps", "1", "--batch-size", "2"]
    runs = {}
    for name, extra in (("eager", []), ("compiled", ["--compile"])):
        trainer = trainer_for(workdir, version, tmp_path / name, *steps, *extra)
        assert trainer.args.torch_compile == bool(extra)
        assert trainer.args.torch_compile_backend == ("inductor" if extra else None)
        trainer.train()
        trainer.save_model()
        runs[name] = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(runs["eager"]) == 2
    assert runs["compiled"] == pytest.approx(runs["eager"], rel=1e-4)
    eager, compiled = (load_file(tmp_path / name / "model.safetensors") for name in ("eager", "compiled"))
    assert compiled.keys() == eager.keys()
    for name, tensor in eager.items():
        torch.testing.assert_close(compiled[name], tensor, rtol=1e-4, atol=1e-6, msg=name)
    assert isinstance(AutoModelForCausalLM.from_pretrained(tmp_path / "compiled"), DiffForCausalLM)


@pytest.mark.slow  # two torchrun launches; test_distributed.py runs `train` under torchrun too (also slow)
@pytest.mark.parametrize("version, extra", [(2, []), (1, ["--diff-only-steps", "1"])], ids=["v2", "v1-diff-only"])
def test_torchrun_ddp_equals_one_process_with_the_global_batch(workdir, tmp_path, version, extra):
    """The unchanged command under torchrun: 2 processes x 1 block = 1 process x 2 blocks (loss, λ, weights). With
    --diff-only-steps DDP starts with frozen parameters (no gradient) and must still average them once unfrozen."""
    import os
    import subprocess
    import sys

    (tmp_path / "t.txt").write_text(HELDOUT[:600], encoding="utf-8")  # 5 blocks
    common = ["train", str(workdir / f"v{version}"), "--data", str(tmp_path / "t.txt"), *QUIET, "--eval-fraction", "0"]
    common += ["--max-steps", "2", "--logging-steps", "1", "--lr", "1e-2", "--seed", "1", *extra]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_"))}
    # CPU + gloo even on a GPU machine: two ranks cannot share one GPU under NCCL.
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", CUDA_VISIBLE_DEVICES="")
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "-m", "diff_transformer.cli"]
        + common + ["--output", str(tmp_path / "ddp"), "--batch-size", "1"],
        capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "1 x 1 accumulation x 2 process(es)" in result.stdout and result.stdout.count("done:") == 1  # rank 0 prints
    assert cli.main(common + ["--output", str(tmp_path / "one"), "--batch-size", "2"]) == 0
    ddp, one = train_logs(tmp_path / "ddp"), train_logs(tmp_path / "one")
    for step in (1, 2):  # λ statistics are gathered over both processes' tokens
        keys = ("loss", "grad_norm", "lambda/layer_00", "lambda/layer_01")
        keys += ("lambda_std/layer_00", "lambda_std/layer_01") if version == 2 else ()
        for key in keys:
            assert ddp[step][key] == pytest.approx(one[step][key], rel=1e-5), (step, key)
    a, b = load_file(tmp_path / "ddp" / "model.safetensors"), load_file(tmp_path / "one" / "model.safetensors")
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5


# --- --diff-only-steps --------------------------------------------------------------------------------------------


class Snapshots(TrainerCallback):
    def __init__(self, model):
        self.model = model
        self.at = {0: self.take()}

    def take(self):
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}

    def on_step_end(self, args, state, control, **kwargs):
        self.at[state.global_step] = self.take()


@pytest.mark.parametrize("version", [1, 2])
def test_diff_only_steps_freezes_exactly_the_old_parameters(workdir, tmp_path, version):
    trainer = trainer_for(
        workdir, version, tmp_path, "--diff-only-steps", "2", "--max-steps", "4", "--lr", "1e-2",
        "--weight-decay", "0.1", "--eval-fraction", "0", "--batch-size", "2",
    )  # fmt: skip
    model = trainer.model
    new = differential_parameters(model)
    d, H = model.config.head_dim, model.config.num_attention_heads
    if version == 1:
        assert sorted(new) == sorted(
            f"model.layers.{i}.self_attn.{n}"
            for i in (0, 1)
            for n in ("diff_lambda.lambda_q1", "diff_lambda.lambda_k1", "diff_lambda.lambda_q2",
                      "diff_lambda.lambda_k2", "subln.weight")
        )  # fmt: skip
    else:
        assert sorted(new) == sorted(
            f"model.layers.{i}.self_attn.{n}" for i in (0, 1) for n in ("diff_lambda.proj.weight", "q_proj.weight")
        )
        odd = torch.tensor([(r // d) % 2 == 1 for r in range(2 * H * d)])
        assert all(torch.equal(new[f"model.layers.{i}.self_attn.q_proj.weight"].cpu(), odd) for i in (0, 1))
    snaps = Snapshots(model)
    trainer.add_callback(snaps)
    trainer.train()
    at = snaps.at
    assert all(p.requires_grad for p in model.parameters())  # unfrozen again
    for name in at[0]:
        mask = new.get(name, "frozen")
        for step in (1, 2):
            if mask == "frozen":
                assert torch.equal(at[step][name], at[0][name]), (name, step)
            elif mask is None:
                assert not torch.equal(at[step][name], at[step - 1][name]), (name, step)
            else:  # V2 q_proj: the source's query heads (even blocks) stay, the copies (odd blocks) move
                assert torch.equal(at[step][name][~mask], at[0][name][~mask]), (name, step)
                assert not torch.equal(at[step][name][mask], at[step - 1][name][mask]), (name, step)
        assert not torch.equal(at[4][name], at[3][name]), name  # every parameter trains after step 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CI has none; run on a lent H100)")
def test_diff_only_steps_v2_on_gpu_in_bf16(workdir, tmp_path):
    """The row masks must live where Trainer moves the model (they were built on the CPU once, and the first backward
    on the GPU failed). bf16 autocast; the old rows are restored exactly."""
    trainer = trainer_for(
        workdir, 2, tmp_path, "--diff-only-steps", "3", "--max-steps", "3", "--lr", "1e-2", "--eval-fraction", "0",
        "--logging-steps", "1", "--bf16", "on",
    )  # fmt: skip
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert trainer.args.bf16 and next(trainer.model.parameters()).is_cuda
    new = differential_parameters(trainer.model)
    for name, param in trainer.model.named_parameters():
        param, old = param.detach().cpu(), before[name].cpu()
        if name not in new:
            assert torch.equal(param, old), name
        elif new[name] is None:
            assert not torch.equal(param, old), name
        else:
            rows = new[name].cpu()
            assert torch.equal(param[~rows], old[~rows]) and not torch.equal(param[rows], old[rows]), name
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 3 and all(math.isfinite(entry["loss"]) and 0 < entry["lambda/layer_01"] < 1 for entry in logs)


# --- LoRA ---------------------------------------------------------------------------------------------------------


def test_lora_trains_adapters_and_lambda_and_saves_the_adapter(workdir, tmp_path):
    from peft import PeftModel

    train(
        workdir, 2, tmp_path, "--lora", "--lora-r", "4", "--max-steps", "3",
        "--lr", "1e-2", "--eval-fraction", "0",
    )  # fmt: skip
    assert {"lambda/layer_00", "lambda_std/layer_01"} <= set(train_logs(tmp_path)[1])  # hooks sit on the running copy
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    # No --lora-target-modules: PEFT's default for model_type "diff" (registered by `import diff_transformer`:
    # Llama's).
    assert (
        config["r"] == 4
        and sorted(config["target_modules"]) == ["q_proj", "v_proj"]
        and config["modules_to_save"] == ["diff_lambda"]
    )
    adapter = load_file(tmp_path / "adapter_model.safetensors")
    assert any("lora_A" in k for k in adapter) and any("diff_lambda" in k for k in adapter)
    assert not any("mlp" in k or "embed" in k for k in adapter)
    base = AutoModelForCausalLM.from_pretrained(workdir / "v2")
    lam = next(v for k, v in adapter.items() if "layers.0.self_attn.diff_lambda" in k)
    assert not torch.equal(lam, base.model.layers[0].self_attn.diff_lambda.proj.weight)  # λ trained
    frozen = trainer_for(
        workdir, 2, tmp_path / "frozen", "--lora", "--lora-freeze-lambda"
    ).model  # the flag that turns λ off
    assert frozen.peft_config["default"].modules_to_save is None
    assert not any(p.requires_grad for n, p in frozen.named_parameters() if "diff_lambda" in n)
    tuned = PeftModel.from_pretrained(base, tmp_path).eval()
    ids = torch.tensor([[0, 42, 82, 82, 70]])
    with torch.no_grad():
        assert not torch.allclose(tuned(ids).logits, AutoModelForCausalLM.from_pretrained(workdir / "v2")(ids).logits)


def test_every_file_train_and_merge_write_follows_the_umask(workdir, tmp_path):
    """safetensors writes each file as a private (0600) temporary renamed into place: the weights of train, of its
    checkpoints, of a LoRA run and of merge get the umask's mode instead, as convert's and every other file do."""
    previous = os.umask(0o022)
    try:
        train(workdir, 2, tmp_path / "full", "--max-steps", "2", "--save-steps", "1")
        train(workdir, 2, tmp_path / "lora", "--max-steps", "1", "--save-steps", "1", "--lora", "--lora-r", "4")
        assert cli.main(["merge", str(tmp_path / "lora"), str(tmp_path / "merged"), "--quiet"]) == 0
    finally:
        os.umask(previous)
    modes = {p.relative_to(tmp_path).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in tmp_path.rglob("*")}
    weights = {f"full/{d}model.safetensors" for d in ("", "checkpoint-1/", "checkpoint-2/")}
    weights |= {"lora/adapter_model.safetensors", "lora/checkpoint-1/adapter_model.safetensors"}
    assert weights | {"merged/model.safetensors", "full/config.json", "lora/tokenizer.json"} <= modes.keys()
    wrong = {p: oct(m) for p, m in modes.items() if m != (0o755 if (tmp_path / p).is_dir() else 0o644)}
    assert wrong == {}


def test_lora_all_linear_shorthand_reaches_peft(workdir, tmp_path):
    """`--lora-target-modules all-linear` is PEFT's shorthand (every linear layer but the LM head); argparse gives a
    one-item list, which PEFT would read as a module name and target nothing."""
    model = trainer_for(workdir, 1, tmp_path, "--lora", "--lora-target-modules", "all-linear").model
    adapted = {
        name.split(".")[-4] for name, _ in model.named_parameters() if "lora_A" in name
    }  # ...q_proj.lora_A.default.weight
    assert {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"} <= adapted
    assert "lm_head" not in adapted


def test_qlora_cli_trains_4bit_base_with_lora_and_lambda(workdir, tmp_path):
    """--lora --load-in-4bit: NF4 base through transformers' bitsandbytes integration (bitsandbytes runs it on CPU),
    PEFT's k-bit preparation, adapters and λ trained and saved, the 4-bit weights themselves untouched."""
    import bitsandbytes as bnb

    trainer = trainer_for(
        workdir,
        2,
        tmp_path,
        "--lora",
        "--load-in-4bit",
        "--max-steps",
        "3",
        "--lr",
        "1e-2",
        "--eval-fraction",
        "0",
        "--logging-steps",
        "1",
    )
    model = trainer.model
    q_proj = model.base_model.model.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj.base_layer, bnb.nn.Linear4bit)
    packed = {n: p.detach().clone() for n, p in model.named_parameters() if isinstance(p, bnb.nn.Params4bit)}
    assert packed and not any(p.requires_grad for n, p in model.named_parameters() if n in packed)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 3 and all(math.isfinite(loss) for loss in losses)
    assert all(torch.equal(p, packed[n]) for n, p in model.named_parameters() if n in packed)
    trainer.save_model(tmp_path / "adapter")
    adapter = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert any("lora_A" in k for k in adapter) and any("diff_lambda" in k for k in adapter)
    lam = next(v for k, v in adapter.items() if "layers.0.self_attn.diff_lambda" in k)
    base = AutoModelForCausalLM.from_pretrained(workdir / "v2")
    assert lam.dtype == torch.float32 and not torch.equal(lam, base.model.layers[0].self_attn.diff_lambda.proj.weight)


def test_qlora_cli_keeps_learning_after_evaluations(workdir, tmp_path):
    """Evaluations between QLoRA steps on CPU: bitsandbytes repacks 4-bit layers for inference on the first forward in
    eval mode without gradients, and its repacked kernel has no autograd. The model keeps the differentiable kernel,
    so every step after an evaluation still has a gradient and λ keeps moving (grad_norm was 0 and λ frozen before)."""
    trainer = trainer_for(
        workdir,
        2,
        tmp_path,
        "--lora",
        "--load-in-4bit",
        "--max-steps",
        "3",
        "--lr",
        "1e-2",
        "--logging-steps",
        "1",
        "--eval-fraction",
        "0.2",
        "--eval-on-start",
        "--eval-steps",
        "1",
    )
    lam = trainer.model.base_model.model.model.layers[0].self_attn.diff_lambda
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "grad_norm" in entry]
    evals = [entry for entry in trainer.state.log_history if "eval_loss" in entry]
    assert len(logs) == 3 and len(evals) >= 3  # step 0, then after every step
    assert all(entry["grad_norm"] > 0 for entry in logs), logs
    trained = lam.modules_to_save["default"].proj.weight
    assert not torch.equal(trained, lam.original_module.proj.weight)


# --- errors -------------------------------------------------------------------------------------------------------


def test_cli_errors_name_the_problem(workdir, tmp_path, capsys):
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(
        LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    ).save_pretrained(tmp_path / "llama")
    (tmp_path / "empty.txt").write_text("", encoding="utf-8")
    (tmp_path / "bad.jsonl").write_text('{"content": "x"}\n', encoding="utf-8")
    (tmp_path / "has-ckpt" / "checkpoint-5").mkdir(parents=True)
    model, text = str(workdir / "v2"), str(workdir / "text.txt")
    cases = [
        ([str(tmp_path / "llama"), "--data", text], "convert it first"),
        ([model, "--data", str(tmp_path / "missing.txt")], "does not exist"),
        ([model, "--data", str(tmp_path)], f"is a directory: name its files (e.g. {tmp_path / '*.txt'}, which"),
        ([model, "--data", str(tmp_path / "empty.txt")], "fewer than one block"),
        ([model, "--data", str(tmp_path / "bad.jsonl")], "no string field 'text'"),
        ([model, "--data", text, "--block-size", "65"], "exceeds the model's context (64"),
        ([model, "--data", text, "--block-size", "0"], "--block-size 0 must be at least 2"),
        ([model, "--data", text, "--eval-steps", "0"], "--eval-steps 0 must be at least 1"),
        ([model, "--data", text, "--load-in-4bit"], "needs --lora"),
        ([model, "--data", text, "--lora", "--diff-only-steps", "2"], "do not combine"),
        ([model, "--data", text, "--lora", "--lora-r", "0"], "error: --lora-r 0 must be at least 1"),  # alone
        ([model, "--data", text, "--text-field", "content"], "--text-field content names a field of .jsonl records"),
        (
            [model, "--data", text, "--lora", "--lora-target-modules", "nosuch"],
            "matches no module of the model: name some of down_proj, gate_proj, k_proj",
        ),
        ([model, "--data", text, "--resume"], "no checkpoint-N directory"),
        ([model, "--data", text, "--compile-backend", "inductr"], "--compile-backend inductr is not a torch.compile"),
        # torch registers it, accelerate (through which Trainer compiles) does not take it
        ([model, "--data", text, "--compile-backend", "aot_eager_decomp_partition"], "use inductor (the default)"),
    ]
    for argv, message in cases:
        assert cli.main(["train", *argv, "--output", str(tmp_path / "out"), "--quiet"]) == 2, argv
        assert message in capsys.readouterr().err, argv
    assert cli.main(["train", model, "--data", text, "--output", str(tmp_path / "has-ckpt")]) == 2
    assert "pass --resume" in capsys.readouterr().err
    # A checkpoint no run record proves ours is never deleted, even with --overwrite: refused, named, kept (before the
    # model loads: a LoRA option that would fail later is not reached).
    argv = [
        "train",
        model,
        "--data",
        text,
        "--output",
        str(tmp_path / "has-ckpt"),
        "--overwrite",
        "--lora",
        "--lora-target-modules",
        "no_such_proj",
    ]
    assert cli.main(argv) == 2 and "holds checkpoint-5" in capsys.readouterr().err
    assert (tmp_path / "has-ckpt" / "checkpoint-5").is_dir()
    assert not (tmp_path / "out").exists()  # nothing written on failure


def test_bad_inputs_are_one_line_and_leave_nothing(refused, workdir, tmp_path, capsys):
    model, text, out = workdir / "v2", workdir / "text.txt", tmp_path / "out"
    common = ["--data", text, "--output", out, "--quiet", "--report-to", "none", "--block-size", str(BLOCK)]
    (tmp_path / "latin1.txt").write_bytes("Caf\xe9 au lait, na\xefve.\n".encode("latin-1") * 20)
    (tmp_path / "blob.txt").write_bytes(b"\x00\x01\x02 binary \x00" * 50)
    refused(
        ["train", model, *common, "--data", tmp_path / "latin1.txt"],
        tmp_path / "latin1.txt",
        "not UTF-8",
        "byte 3",
        notes=True,
    )
    refused(["train", model, *common, "--data", tmp_path / "blob.txt"], tmp_path / "blob.txt", "binary", notes=True)
    for lr in ("-1e-4", "nan", "inf"):
        refused(["train", model, *common, f"--lr={lr}"], f"--lr {float(lr)}", ">= 0", notes=True)
    refused(["train", model, *common, "--weight-decay", "-0.1"], "--weight-decay -0.1", notes=True)
    assert not out.exists()  # no empty output directory left behind
    (tmp_path / "a-file").write_text("mine")
    refused(
        ["train", model, *common, "--output", tmp_path / "a-file"],
        "a-file is a file",
        "pass a directory",
        notes=True,
    )
    assert (tmp_path / "a-file").read_text() == "mine"

    mismatched = tmp_path / "mismatched"
    shutil.copytree(model, mismatched)
    config = json.loads((mismatched / "config.json").read_text())
    (mismatched / "config.json").write_text(json.dumps({**config, "diff_version": 1}))
    refused(["train", mismatched, *common], "config.json says diff_version=1", '"diff_version": 2', notes=True)


def test_resume_refuses_incomplete_checkpoints_other_blocks_and_finished_runs(
    refused, workdir, v2_run, tmp_path, capsys
):
    argv, full = v2_run
    run = tmp_path / "run"
    run.mkdir()
    shutil.copytree(full / "checkpoint-6", run / "checkpoint-6")
    options = argv[argv.index("--quiet") :]  # the same options as the run, less its model, data and output
    resume = [workdir / "v2", "--data", workdir / "repeat.txt", "--output", run, *options, "--resume"]

    (run / "checkpoint-9").mkdir()  # created by a run killed before it wrote anything
    refused(
        ["train", *resume],
        "checkpoint-9 is incomplete (no trainer_state.json)",
        f"resume from {run / 'checkpoint-6'}",
        notes=True,
    )
    shutil.rmtree(run / "checkpoint-9")
    shutil.copytree(full / "checkpoint-6", run / "checkpoint-9")
    weights = run / "checkpoint-9" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    refused(
        ["train", *resume],
        "checkpoint-9 is incomplete (model.safetensors is truncated or corrupt)",
        "delete it",
        notes=True,
    )
    shutil.rmtree(run / "checkpoint-9")

    (tmp_path / "mine").mkdir()  # not a checkpoint at all: never advise deleting it
    err = refused(
        ["train", *resume[:-1], "--resume", tmp_path / "mine"],
        "not a Trainer checkpoint (no trainer_state.json)",
        notes=True,
    )
    assert "delete" not in err
    refused(["train", *resume, "--block-size", "16"], "blocks of 32 tokens, not 16", "--block-size 32", notes=True)
    shutil.copytree(full / "checkpoint-12", run / "checkpoint-12")
    refused(["train", *resume], "already complete (12 of --max-steps 12 steps)", "raise --max-steps", notes=True)
    assert sorted(p.name for p in run.iterdir()) == ["checkpoint-12", "checkpoint-6"]


@pytest.mark.parametrize("missing", ["optimizer.pt", "scheduler.pt", "rng_state.pth"])
def test_resume_refuses_a_checkpoint_without_its_optimizer_scheduler_or_rng_state(
    refused, workdir, v2_run, tmp_path, capsys, missing
):
    """Trainer would resume without them (fresh Adam moments, the schedule from its start): another run."""
    argv, full = v2_run
    run = tmp_path / "run"
    shutil.copytree(full / "checkpoint-6", run / "checkpoint-6")
    (run / "checkpoint-6" / missing).unlink()
    resume = [workdir / "v2", "--data", workdir / "repeat.txt", "--output", run, *argv[argv.index("--quiet") :]]
    refused(["train", *resume, "--resume"], f"checkpoint-6 is incomplete (no {missing})", notes=True)


def test_resume_with_overwrite_is_refused_and_other_settings_are_said(refused, workdir, v2_run, tmp_path, capsys):
    argv, full = v2_run
    run = tmp_path / "run"
    shutil.copytree(full / "checkpoint-6", run / "checkpoint-6")
    resume = [workdir / "v2", "--data", workdir / "repeat.txt", "--output", run, *argv[argv.index("--quiet") :]]
    refused(["train", *resume, "--resume", "--overwrite"], "--resume continues the run", "--overwrite starts it over")
    assert sorted(p.name for p in run.iterdir()) == ["checkpoint-6"]
    resume[resume.index("--max-steps") + 1] = "7"
    capsys.readouterr()
    assert cli.main(["train", *map(str, resume), "--resume"]) == 0  # the same settings: nothing to say
    assert "note: --resume" not in capsys.readouterr().err
    shutil.rmtree(run)
    shutil.copytree(full / "checkpoint-6", run / "checkpoint-6")
    changed = [*resume, "--resume", "--batch-size", "2", "--seed", "7", "--eval-fraction", "0.5"]
    assert cli.main(["train", *map(str, changed)]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note: --resume")]
    assert len(notes) == 1, notes
    for said in ("global batch (--batch-size x --grad-accum x processes) (4, now 2)", "--seed (42, now 7)"):
        assert said in notes[0], notes[0]
    assert "--eval-fraction (0.25, now 0.5)" in notes[0] and "--data" not in notes[0]


@pytest.mark.parametrize("flag", [["--eval-steps", "1"], ["--eval-on-start"]])
def test_evaluation_options_without_a_held_out_set_are_refused(refused, workdir, tmp_path, capsys, flag):
    argv = ["train", workdir / "v2", "--data", workdir / "text.txt", "--output", tmp_path / "run", *QUIET]
    refused([*argv, "--eval-fraction", "0", *flag], f"{flag[0]} evaluates on held-out blocks", "--eval-fraction 0")
    assert not (tmp_path / "run").exists()


def test_resume_of_a_tied_model_reports_no_missing_lm_head(workdir, tmp_path, monkeypatch):
    import transformers.trainer

    tied = tmp_path / "tied"
    model = DiffForCausalLM.from_pretrained(workdir / "v1")
    model.config.tie_word_embeddings = True
    DiffForCausalLM._from_config(model.config).save_pretrained(tied)
    AutoTokenizer.from_pretrained(workdir / "v1").save_pretrained(tied)
    warnings = []
    monkeypatch.setattr(transformers.trainer.logger, "warning", lambda message, *a, **k: warnings.append(str(message)))
    argv = ["train", str(tied), "--data", str(workdir / "text.txt"), "--output", str(tmp_path / "run"), *QUIET]
    argv += ["--max-steps", "2", "--save-steps", "1", "--eval-fraction", "0", "--batch-size", "2"]
    assert cli.main(argv) == 0
    shutil.rmtree(tmp_path / "run" / "checkpoint-2")
    assert cli.main([*argv, "--resume"]) == 0
    assert not [w for w in warnings if "missing keys" in w], warnings
    final = load_file(tmp_path / "run" / "model.safetensors")
    assert "lm_head.weight" not in final  # still tied: saved once, as the embedding


@pytest.mark.canary
def test_trainer_warns_about_missing_keys_on_resume(monkeypatch):
    """Canary for transformers' `Trainer._issue_warnings_after_load` and its "missing keys" warning, which
    `CausalLMTrainer` silences for a tied lm_head: if the wording changes, the test above can no longer fail."""
    from types import SimpleNamespace

    import transformers.trainer

    warnings = []
    monkeypatch.setattr(transformers.trainer.logger, "warning", lambda message, *a, **k: warnings.append(str(message)))
    trainer = SimpleNamespace(model=SimpleNamespace(_keys_to_ignore_on_save=None))
    load_result = SimpleNamespace(missing_keys=["lm_head.weight"], unexpected_keys=[])
    transformers.Trainer._issue_warnings_after_load(trainer, load_result)
    assert len(warnings) == 1 and "missing keys" in warnings[0] and "lm_head.weight" in warnings[0]


def test_bitsandbytes_kernel_notice_is_hidden_outside_4bit(caplog):
    import logging

    from diff_transformer.checkpoints.adapters import hide_bitsandbytes_kernel_notice

    logger = logging.getLogger("bitsandbytes.backends.cpu.ops")
    hide_bitsandbytes_kernel_notice()
    with caplog.at_level(logging.WARNING, logger=logger.name):
        logger.warning("Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please ...", "no kernels")
        logger.warning("another bitsandbytes warning")
    assert caplog.messages == ["another bitsandbytes warning"]


# --- λ warm-up (--lambda-warmup-steps) ----------------------------------------------------------------------------


def _v1_lambda(weights: dict, layer: int) -> float:
    """V1's λ from saved weights, by the paper's formula (independent of the model code)."""
    p = f"model.layers.{layer}.self_attn.diff_lambda."
    dot = lambda a, b: torch.sum(weights[p + a].double() * weights[p + b].double())  # noqa: E731
    return (
        math.exp(dot("lambda_q1", "lambda_k1"))
        - math.exp(dot("lambda_q2", "lambda_k2"))
        + 0.8
        - 0.6 * math.exp(-0.3 * layer)
    )


def test_lambda_warmup_ramps_the_logged_lambda_and_saves_plain_weights(workdir, tmp_path):
    common = ("--max-steps", "6", "--lr", "1e-2", "--logging-steps", "1", "--save-steps", "2", "--eval-fraction", "0")
    train(workdir, 1, tmp_path, *common, "--lambda-warmup-steps", "4")
    logs = train_logs(tmp_path)
    # m = min(1, step / 4) after each step (what the next step and an evaluation there use); exactly 1 from step 4
    assert [logs[step]["lambda_warmup"] for step in range(1, 7)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    checkpoint = load_file(tmp_path / "checkpoint-2" / "model.safetensors")
    final = load_file(tmp_path / "model.safetensors")
    plain = load_file(workdir / "v1" / "model.safetensors")
    assert checkpoint.keys() == final.keys() == plain.keys()  # no multiplier (parameter or buffer) is saved
    for layer in (0, 1):
        key = f"lambda/layer_{layer:02d}"
        # the logged λ is the one used: 0.5 x the λ of the saved weights at step 2, that λ itself after the ramp
        assert logs[2][key] == pytest.approx(0.5 * _v1_lambda(checkpoint, layer), abs=1e-6)
        assert logs[6][key] == pytest.approx(_v1_lambda(final, layer), abs=1e-6)


def test_lambda_warmup_on_a_converted_v2_is_said(workdir, tmp_path, capsys):
    """A converted V2 starts exactly as its source only with λ as converted: the ramp gives that up (a note)."""
    from tests.helpers.checkpoints import TINY_LLAMA

    assert cli.main(["convert", str(TINY_LLAMA), str(tmp_path / "v2"), "--quiet"]) == 0
    argv = ["train", str(tmp_path / "v2"), "--data", str(workdir / "text.txt"), "--output", str(tmp_path / "run")]
    argv += [*QUIET, "--max-steps", "1", "--eval-fraction", "0", "--batch-size", "2", "--lambda-warmup-steps", "1"]
    capsys.readouterr()
    assert cli.main(argv) == 0
    assert "note: --lambda-warmup-steps on a converted V2" in capsys.readouterr().err
    train(workdir, 2, tmp_path / "plain", "--max-steps", "1", "--eval-fraction", "0", "--lambda-warmup-steps", "1")
    assert "note: --lambda-warmup-steps" not in capsys.readouterr().err  # a V2 made as such (no conversion)


@pytest.mark.parametrize("version", [1, 2])
def test_lambda_warmup_multiplier_leaves_weights_unchanged_and_ends_at_exactly_one(workdir, tmp_path, version):
    from diff_transformer.training.callbacks import LambdaWarmupCallback, lambda_modules

    model = AutoModelForCausalLM.from_pretrained(workdir / f"v{version}", attn_implementation="eager").eval()
    reference = AutoModelForCausalLM.from_pretrained(workdir / f"v{version}", attn_implementation="eager").eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randint(3, 500, (2, 16), generator=torch.Generator().manual_seed(0))
    hidden = torch.randn(2, 16, model.config.hidden_size, generator=torch.Generator().manual_seed(1))

    def lam(m):
        module = lambda_modules(m)[0]
        with torch.no_grad():
            return module() if version == 1 else module(hidden)

    warmup = LambdaWarmupCallback(model, steps=4)
    warmup.set_step(1)
    assert warmup.multiplier == 0.25 and torch.equal(lam(model), 0.25 * lam(reference))
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    model.save_pretrained(tmp_path / "saved")  # mid-ramp
    saved = load_file(tmp_path / "saved" / "model.safetensors")
    assert saved.keys() == load_file(workdir / f"v{version}" / "model.safetensors").keys()
    assert all(torch.equal(saved[k], before[k]) for k in saved)
    with torch.no_grad():
        assert not torch.equal(model(ids).logits, reference(ids).logits)  # the ramp does change the forward
    warmup.set_step(4)
    assert warmup.multiplier == 1.0 and warmup.handles == []  # exactly 1: hooks gone, the model is what it saves
    assert all(not m._forward_hooks for m in lambda_modules(model).values())
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)


def test_lambda_warmup_is_refused_where_it_cannot_end_or_has_no_lambda(refused, workdir, tmp_path, capsys):
    model, text = workdir / "v1", workdir / "text.txt"
    common = ["--data", text, "--output", tmp_path / "out", *QUIET, "--eval-fraction", "0"]
    refused(
        ["train", model, *common, "--max-steps", "3", "--lambda-warmup-steps", "4"],
        "exceeds --max-steps 3",
        notes=True,
    )
    refused(
        ["train", model, *common, "--lambda-warmup-steps", "-1"], "--lambda-warmup-steps -1 must be >= 0", notes=True
    )
    # no --max-steps: the run's length is known once the data is; the ramp must still end within it
    refused(
        ["train", model, *common, "--epochs", "1", "--lambda-warmup-steps", "1000"],
        "longer than the run",
        notes=True,
    )
    llama = tmp_path / "llama"
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(
        LlamaConfig(
            vocab_size=2048,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=64,
        )
    ).save_pretrained(llama)
    AutoTokenizer.from_pretrained(TOKENIZER).save_pretrained(llama)
    refused(["train", llama, *common, "--any-model", "--lambda-warmup-steps", "2"], "needs a Diff model", notes=True)


def test_overwrite_removes_what_the_old_run_wrote_and_keeps_the_users_files(workdir, tmp_path):
    """A full-model run with --overwrite over a LoRA run: no adapter_config.json (every command would then load the
    old adapter) and no adapter card or base record of the old run; a file of the user's stays, and so does one the
    old run wrote but the user changed since is theirs now: never removed, and, since a loader would read it beside the
    new model, refused by name until the user moves it (issue 56)."""
    out = tmp_path / "run"
    lora = ["--lora", "--lora-r", "4", "--max-steps", "1", "--eval-fraction", "0", "--report-to", "tensorboard"]
    train(workdir, 2, out, *lora)
    assert (out / "adapter_config.json").is_file() and (out / ".diff-transformer-run.json").is_file()
    (out / "notes.txt").write_text("mine")
    (out / "runs" / "mine.txt").write_text("mine")  # inside a directory the run made: the directory is not all its
    with open(out / "adapter_model.safetensors", "ab") as f:
        f.write(b" ")  # changed since the old run wrote it: no longer provably the run's
    before = sorted(p.name for p in out.iterdir())
    argv = [str(a) for a in ["train", workdir / "v2", "--data", workdir / "text.txt", "--output", out, *QUIET]]
    assert cli.main([*argv, "--max-steps", "1", "--eval-fraction", "0", "--overwrite"]) == 2
    assert sorted(p.name for p in out.iterdir()) == before  # refused before anything was removed
    (out / "adapter_model.safetensors").rename(tmp_path / "kept.safetensors")
    train(workdir, 2, out, "--max-steps", "1", "--eval-fraction", "0", "--overwrite")
    left = {p.name for p in out.iterdir()}
    assert not {"adapter_config.json", "base_model.json", "adapter_model.safetensors"} & left
    assert {"config.json", "model.safetensors", "notes.txt"} <= left
    assert (out / "notes.txt").read_text() == "mine" and (out / "runs" / "mine.txt").read_text() == "mine"
    assert type(AutoModelForCausalLM.from_pretrained(out)).__name__ == "DiffForCausalLM"
    assert "README.md" in json.loads((out / ".diff-transformer-run.json").read_text())  # this run's, recorded
