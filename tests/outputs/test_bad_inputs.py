"""Issue 21 ("Trust 2"): a hostile or careless user's inputs. Nothing the user owns is lost, inputs cannot demand
unbounded resources, bad values are refused instead of giving silently wrong results, and every bad input is one
`error:` line with exit status 2 before anything is written. Commands run in-process on tiny checkpoints."""

import json
import os
import re
import threading
from pathlib import Path

import pytest
import torch

from diff_transformer import cli
from diff_transformer.outputs.records import write_manifest, wrote_this
from tests.helpers import REPOSITORY
from tests.helpers.checkpoints import make_pickle_only, tree_digest
from tests.helpers.training import train_argv


# ---------------------------------------------------------------------------------------------------------------
# Data loss and the hang: the demo's manifest covers every entry and never opens what is not a regular file


def test_manifest_covers_directories_and_other_entries(tmp_path):
    out = tmp_path / "out"
    (out / "diff-v1").mkdir(parents=True)
    (out / "diff-v1" / "config.json").write_text("{}")
    write_manifest(out, "demo")
    assert wrote_this(out, "demo")
    (out / "my-run").mkdir()  # an empty directory of the user's: the old manifest hashed files only
    assert not wrote_this(out, "demo")
    (out / "my-run").rmdir()
    (out / "diff-v1" / "empty").mkdir()
    assert not wrote_this(out, "demo")
    (out / "diff-v1" / "empty").rmdir()
    assert wrote_this(out, "demo")


def test_demo_rerun_keeps_a_directory_the_user_added(refused, tmp_path, capsys):
    out = tmp_path / "d"
    assert cli.main(["demo", "--scratch", "--output", str(out)]) == 0
    (out / "my-experiments").mkdir()
    refused(["demo", "--scratch", "--output", out], str(out), "--overwrite", notes=True)
    assert (out / "my-experiments").is_dir()


def test_demo_rerun_does_not_hang_on_a_fifo(tmp_path, capsys):
    out = tmp_path / "d"
    assert cli.main(["demo", "--scratch", "--output", str(out)]) == 0
    os.mkfifo(out / "f")
    status = []
    worker = threading.Thread(target=lambda: status.append(cli.main(["demo", "--scratch", "--output", str(out)])))
    worker.daemon = True
    worker.start()
    worker.join(timeout=60)
    if worker.is_alive():  # the old code blocks in open(): unblock it by opening the FIFO's other end
        with open(out / "f", "wb"):
            pass
        worker.join(timeout=60)
        pytest.fail("demo --output blocked reading a FIFO")
    assert status == [2] and "--overwrite" in capsys.readouterr().err
    assert (out / "f").exists()
    os.mkfifo(out / "diff-v1" / ".diff-transformer-output.json.fifo")
    manifest = out / ".diff-transformer-output.json"
    manifest.unlink()
    os.mkfifo(manifest)  # a FIFO in place of the manifest: not read either
    assert not wrote_this(out, "diff-transformer demo --scratch")


# ---------------------------------------------------------------------------------------------------------------
# train: one run per --output, resuming into another run, a user's checkpoint-mynotes/, option ranges


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A tiny random Diff V2 checkpoint with the shipped tokenizer (`v2`) and a text file, as test_train's."""
    from tests.helpers.checkpoints import HELDOUT, save_trainable_checkpoint

    root = tmp_path_factory.mktemp("train")
    save_trainable_checkpoint(root / "v2", 2)
    (root / "text.txt").write_text(HELDOUT[:2500], encoding="utf-8")
    return root


def test_second_train_into_the_same_output_is_refused(refused, workdir, tmp_path, capsys):
    from diff_transformer.outputs.staging import OutputLock

    out = tmp_path / "run"
    with OutputLock(out, name="--output"):  # a first run, still alive
        argv = train_argv(workdir, out, "--max-steps", "1")
        refused(argv, f"--output {out} is being written by another run", notes=True)
        assert sorted(p.name for p in out.iterdir()) == [".diff-transformer.lock"]  # the first run's lock only
    assert not out.exists()  # the lock's directory, created for it, goes with it


@pytest.mark.slow  # a training run in a fresh process, killed, then one more run: ~1 min on a busy machine
def test_a_train_killed_before_its_first_checkpoint_does_not_lock_its_output(workdir, tmp_path, capsys):
    """Issue 56 item 5: a train SIGKILLed before its first checkpoint left a run record (and its lock file) that made
    every later run refuse the directory. The rerun, without --overwrite, trains into it; a file of the user's put
    there meanwhile is still refused (the killed run's bookkeeping proves nothing of it)."""
    import signal
    import subprocess
    import sys
    import time

    from diff_transformer.outputs.files import RUN_RECORD

    out = tmp_path / "run"
    argv = [str(a) for a in train_argv(workdir, out, "--max-steps", "100000", "--save-steps", "100000")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen([sys.executable, "-m", "diff_transformer", *argv], env=env, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 300
        while not (out / RUN_RECORD).exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)  # the record exists once training has begun (Trainer's on_train_begin)
        assert process.poll() is None, process.stderr.read()
        assert (out / RUN_RECORD).exists(), "the run never began"
        time.sleep(1)  # a few steps in, still far from a checkpoint
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=60)
        process.stderr.close()
    assert not any(p.name.startswith("checkpoint-") for p in out.iterdir()), sorted(out.iterdir())
    left = sorted(p.name for p in out.iterdir())
    assert RUN_RECORD in left, left

    (out / "notes.txt").write_text("mine")
    capsys.readouterr()
    assert cli.main([*argv[:-4], "--max-steps", "1"]) == 2  # the user's file: refused by name, kept
    assert "notes.txt" in capsys.readouterr().err
    (out / "notes.txt").unlink()
    assert cli.main([*argv[:-4], "--max-steps", "1"]) == 0, capsys.readouterr().err
    assert (out / "model.safetensors").is_file()


def test_resume_into_another_run_needs_overwrite_and_keeps_users_directories(refused, workdir, tmp_path, capsys):
    import shutil

    run_x, run_y = tmp_path / "rX", tmp_path / "rY"
    assert cli.main([str(a) for a in train_argv(workdir, run_x, "--max-steps", "2", "--save-steps", "1")]) == 0
    run_y.mkdir()
    shutil.copytree(run_x / "checkpoint-1", run_y / "checkpoint-1")  # another run's checkpoint
    (run_x / "checkpoint-mynotes").mkdir()
    (run_x / "checkpoint-mynotes" / "notes.txt").write_text("mine")
    digest = tree_digest(run_x)
    argv = train_argv(workdir, run_x, "--max-steps", "3", "--save-steps", "1", "--resume", run_y / "checkpoint-1")
    refused(argv, f"--output {run_x} holds another training run (checkpoint-1, checkpoint-2", "--overwrite")
    assert tree_digest(run_x) == digest
    assert cli.main([str(a) for a in [*argv, "--overwrite"]]) == 0
    assert sorted(p.name for p in run_x.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3", "checkpoint-mynotes"]
    assert (run_x / "checkpoint-mynotes" / "notes.txt").read_text() == "mine"
    # --overwrite starting over deletes Trainer's checkpoints only
    assert cli.main([str(a) for a in train_argv(workdir, run_x, "--max-steps", "1", "--overwrite")]) == 0
    assert sorted(p.name for p in run_x.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-mynotes"]
    assert (run_x / "checkpoint-mynotes" / "notes.txt").read_text() == "mine"


def test_checkpoint_rotation_deletes_only_the_runs_own_checkpoints(workdir, tmp_path, refused):
    """--save-total-limit: Trainer's rotation would delete the oldest checkpoint-* directory whoever wrote it; only the
    checkpoints the run record proves are the run's (unchanged) rotate, a resumed run's included."""
    run = tmp_path / "run"
    argv = train_argv(workdir, run, "--max-steps", "3", "--save-steps", "1", "--eval-fraction", "0")
    assert cli.main([str(a) for a in argv]) == 0
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
    for name in ("checkpoint-0", "checkpoint-mynotes"):
        (run / name).mkdir()
        (run / name / "notes.txt").write_text("mine")
    (run / "checkpoint-0" / "trainer_state.json").write_text("{}")  # even one that looks like Trainer's
    (run / "checkpoint-2" / "notes.txt").write_text("mine")  # one of the run's, changed since: the user's now
    resume = [*argv[:-4], "--max-steps", "5", "--save-steps", "1", "--save-total-limit", "1", "--resume"]
    assert cli.main([str(a) for a in resume]) == 0
    left = sorted(p.name for p in run.glob("checkpoint-*"))
    assert left == ["checkpoint-0", "checkpoint-2", "checkpoint-5", "checkpoint-mynotes"]
    for name in ("checkpoint-0", "checkpoint-2", "checkpoint-mynotes"):
        assert (run / name / "notes.txt").read_text() == "mine"
    record = json.loads((run / ".diff-transformer-run.json").read_text())
    assert sorted(name for name in record if name.startswith("checkpoint-")) == ["checkpoint-5"]
    # --overwrite, starting over, deletes what the record proves, and nothing else either: a checkpoint-N that is
    # not the run's (Trainer would write into it, `--resume auto` read it) is refused by name, never removed
    overwrite = [*argv[:-4], "--max-steps", "1", "--overwrite"]
    refused(overwrite, "checkpoint-0, checkpoint-2", "--overwrite removes only what")
    for name in ("checkpoint-0", "checkpoint-2"):
        (run / name).rename(tmp_path / name)
    assert cli.main([str(a) for a in overwrite]) == 0
    left = sorted(p.name for p in run.glob("checkpoint-*"))
    assert left == ["checkpoint-1", "checkpoint-mynotes"]  # 5 went, 1 is the new run's
    for path in (tmp_path / "checkpoint-0", tmp_path / "checkpoint-2", run / "checkpoint-mynotes"):
        assert (path / "notes.txt").read_text() == "mine"


@pytest.fixture(scope="module")
def finished_runs(workdir):
    """One-step runs with a checkpoint each: a V1 model, a V2 model and a LoRA adapter on the V2 model."""
    from tests.helpers.checkpoints import save_trainable_checkpoint

    save_trainable_checkpoint(workdir / "v1", 1)
    runs = {}
    for name, model, extra in (("v1", "v1", []), ("v2", "v2", []), ("lora", "v2", ["--lora", "--lora-r", "4"])):
        runs[name] = workdir / f"run-{name}"
        argv = train_argv(workdir, runs[name], "--max-steps", "1", "--eval-fraction", "0", *extra)
        argv[1] = workdir / model
        assert cli.main([str(a) for a in argv]) == 0
    return runs


def _corrupt_copy(checkpoint, out, *, state=None, adapter_config=None):
    import shutil

    shutil.copytree(checkpoint, out / checkpoint.name)
    path = out / checkpoint.name / "trainer_state.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **(state or {})}))
    if adapter_config is not None:
        (out / checkpoint.name / "adapter_config.json").write_text(adapter_config)
    return out / checkpoint.name


@pytest.mark.parametrize(
    "state, words",
    [
        ({"global_step": "1"}, ['global_step is "1", not a whole number']),
        ({"global_step": True}, ["global_step is true"]),
        ({"stateful_callbacks": [1]}, ["stateful_callbacks is [1], not an object"]),
        ({"stateful_callbacks": {"RunSettingsCallback": 3}}, ["stateful_callbacks.RunSettingsCallback is 3"]),
        ({"log_history": {"loss": 1}}, ["log_history is not a list"]),
        ({"epoch": "one"}, ['epoch is "one", not a number']),
    ],
)
def test_resume_refuses_a_corrupt_trainer_state(refused, workdir, finished_runs, tmp_path, capsys, state, words):
    out = tmp_path / "run"
    checkpoint = _corrupt_copy(finished_runs["v2"] / "checkpoint-1", out, state=state)
    before = tree_digest(out)
    argv = train_argv(workdir, out, "--max-steps", "3", "--eval-fraction", "0", "--resume")
    refused(argv, f"{checkpoint / 'trainer_state.json'} is corrupt", *words, "restore it", notes=True)
    assert tree_digest(out) == before


def test_resume_refuses_a_checkpoint_of_another_model_or_kind(refused, workdir, finished_runs, tmp_path, capsys):
    common = ["--max-steps", "3", "--eval-fraction", "0", "--overwrite"]
    v1, v2, lora = (finished_runs[name] / "checkpoint-1" for name in ("v1", "v2", "lora"))
    out = tmp_path / "out"
    refused(
        train_argv(workdir, out, *common, "--resume", v1),
        f"--resume {v1} does not fit this model",
        "a Diff V1 checkpoint, a V2 model",
        "resume with the MODEL",
        notes=True,
    )
    refused(
        train_argv(workdir, out, *common, "--resume", lora),
        "is a checkpoint of a LoRA adapter (adapter_config.json), but this run trains the full model",
        "--lora",
        notes=True,
    )
    refused(
        train_argv(workdir, out, *common, "--lora", "--lora-r", "4", "--resume", v2),
        "is a checkpoint of a full-model run",
        "without --lora",
        notes=True,
    )
    refused(
        train_argv(workdir, out, *common, "--lora", "--lora-r", "8", "--resume", lora),
        "lora_A.weight is [4, 32] there, [8, 32] in this model",
        notes=True,
    )
    assert not out.exists()
    corrupt = _corrupt_copy(lora, tmp_path / "corrupt", adapter_config="[1, 2]")
    refused(
        train_argv(workdir, out, *common, "--lora", "--lora-r", "4", "--resume", corrupt),
        f"{corrupt / 'adapter_config.json'} holds a JSON list, not an object",
        notes=True,
    )
    # the right kind and model still resumes
    assert (
        cli.main([str(a) for a in train_argv(workdir, out, *common, "--lora", "--lora-r", "4", "--resume", lora)]) == 0
    )


def test_an_adapter_config_that_is_no_object_is_one_line(refused, finished_runs, tmp_path, capsys):
    import shutil

    adapter = tmp_path / "adapter"
    shutil.copytree(finished_runs["lora"], adapter, ignore=shutil.ignore_patterns("checkpoint-*"))
    config = adapter / "adapter_config.json"
    config.write_text("[1, 2]")
    refused(["generate", adapter, "hello", "--max-new-tokens", "2"], f"{config} holds a JSON list")
    refused(["merge", adapter, tmp_path / "merged"], f"{config} holds a JSON list")
    assert not (tmp_path / "merged").exists()
    config.write_text(json.dumps({"base_model_name_or_path": 5}))
    refused(["generate", adapter, "hello"], "base_model_name_or_path is 5, not a model name")


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--warmup-steps", "-5"], ["--warmup-steps -5", ">= 0"]),
        (["--seed", "-1"], ["--seed -1", "[0, 2**32)", "from 0 to 4294967295"]),
        (["--seed", str(2**32)], [f"--seed {2**32}"]),
        (["--save-total-limit", "0"], ["--save-total-limit 0"]),
        (["--eval-batch-size", "0"], ["--eval-batch-size 0"]),
        (["--eval-fraction", "nan"], ["--eval-fraction nan"]),
        (["--report-to", "wandb"], ["--report-to wandb", "pip install wandb"]),
        (["--report-to", "bogus"], ["--report-to bogus", "tensorboard"]),
        (["--report-to", "none", "tensorboard"], ["--report-to none", "alone"]),
    ],
)
def test_train_option_ranges(refused, workdir, tmp_path, capsys, extra, words):
    pytest.importorskip("tensorboard")
    if "wandb" in extra:
        pytest.importorskip("importlib").util.find_spec("wandb") is None or pytest.skip("wandb is installed")
    out = tmp_path / "out"
    refused([*train_argv(workdir, out), *extra], *words, notes=True)
    assert not out.exists()


def test_train_into_an_unwritable_output_is_one_line(refused, workdir, capsys):
    out = "/sys/diff-transformer-run"  # not creatable, even by root
    refused(train_argv(workdir, out), f"cannot write --output {out}", notes=True)


# ---------------------------------------------------------------------------------------------------------------
# convert: side files from an allowlist, bounded card metadata, configs validated before anything is written


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from tests.helpers.checkpoints import make_llama

    return make_llama(tmp_path_factory.mktemp("src") / "llama")


def _copy_with(src, dst, **config_changes):
    import shutil

    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(config_changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_convert_copies_side_files_from_an_allowlist_and_names_the_rest(llama, tmp_path, capsys):
    src = _copy_with(llama, tmp_path / "src")
    for name in ("secrets.env", "credentials", "id_rsa", "notes.txt", "training_args.json"):
        (src / name).write_text("hf_SECRET\n")
    (src / "merges.txt").write_text("a b\n")
    os.mkfifo(src / "tokenizer.model")  # an allowed name, but no regular file: never opened
    out = tmp_path / "out"
    assert cli.main(["convert", str(src), str(out), "--quiet"]) == 0
    copied = {p.name for p in out.iterdir()}
    assert {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "merges.txt", "LICENSE"} <= copied
    assert {"chat_template.jinja"} <= copied and not copied & {"secrets.env", "credentials", "id_rsa", "notes.txt"}
    assert "training_args.json" not in copied and "tokenizer.model" not in copied
    err = capsys.readouterr().err
    assert "not copied from SRC into OUT" in err and "credentials, id_rsa, notes.txt, secrets.env" in err


def test_convert_bounds_what_the_source_card_puts_in_the_config(llama, tmp_path):
    src = _copy_with(llama, tmp_path / "src")
    levels = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    levels += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 5)]
    (src / "README.md").write_text("---\n" + "\n".join(levels) + "\nlicense: mit\nlanguage: *a4\n---\n# bomb\n")
    out = tmp_path / "out"
    assert cli.main(["convert", str(src), str(out), "--quiet"]) == 0
    assert (out / "config.json").stat().st_size < 20_000  # 10^5 aliased strings were copied into it
    assert json.loads((out / "config.json").read_text())["conversion"]["card_data"] == {}

    (src / "README.md").write_text("---\nlicense: mit\nlanguage: [en, [nested]]\ntags: [x]\n---\n")
    out2 = tmp_path / "out2"
    assert cli.main(["convert", str(src), str(out2), "--quiet"]) == 0
    assert json.loads((out2 / "config.json").read_text())["conversion"]["card_data"] == {"license": "mit"}


@pytest.mark.parametrize(
    "changes, words",
    [
        ({"pad_token_id": 500}, ["pad_token_id=500", "0 to 100"]),
        ({"pad_token_id": -1}, ["pad_token_id=-1"]),
        ({"rope_parameters": {"rope_type": "bogus", "rope_theta": 1e4}}, ["rope_type 'bogus'", "llama3"]),
        ({"model_type": ["llama"]}, ["model_type ['llama'] is not a string"]),
    ],
)
def test_convert_refuses_bad_configs_before_writing(refused, llama, tmp_path, capsys, changes, words):
    src = _copy_with(llama, tmp_path / "src", **changes)
    refused(["convert", src, tmp_path / "out", "--quiet", "--verify"], *words, notes=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_task_head_with_a_negative_pad_token_is_refused_before_writing(refused, tmp_path, capsys):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=97, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, num_labels=3, pad_token_id=-1,
    )  # fmt: skip
    LlamaForSequenceClassification(config).save_pretrained(tmp_path / "cls")
    refused(["convert", tmp_path / "cls", tmp_path / "out", "--quiet", "--verify"], "pad_token_id=-1", notes=True)
    assert not (tmp_path / "out").exists()


def _diff_checkpoint(tmp_path, **config_changes):
    from tests.helpers.tiny import tiny_model

    path = tmp_path / "diff"
    tiny_model(2).save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    config.update(config_changes)
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize(
    "changes, words",
    [
        ({"pad_token_id": 500}, ["pad_token_id=500"]),
        ({"rope_parameters": {"rope_type": "bogus", "rope_theta": 1e4}}, ["rope_type 'bogus'"]),
        ({"_attn_implementation": "flash_attention_2"}, ["_attn_implementation='flash_attention_2'", "install"]),
        ({"model_type": 5}, ["model_type 5 is not a string"]),
        ({"conversion": {"card_data": {"tags": ["x"], "license": "mit"}}}, ["card_data holds 'tags'"]),
        ({"conversion": {"card_data": {"base_model": "a/b"}}}, ["card_data holds 'base_model'"]),
        ({"conversion": {"card_data": {"pipeline_tag": "x"}}}, ["card_data holds 'pipeline_tag'"]),
    ],
)
def test_generate_inspect_train_refuse_bad_configs_before_loading(refused, tmp_path, capsys, changes, words):
    if changes.get("_attn_implementation") == "flash_attention_2":
        from transformers.utils import is_flash_attn_2_available

        if is_flash_attn_2_available():
            pytest.skip("flash-attn is installed")
    model = _diff_checkpoint(tmp_path, **changes)
    refused(["generate", model, "5 6 7"], *words, notes=True)
    refused(["inspect", model, "5 6 7", "--out", tmp_path / "f.png"], *words, notes=True)
    text = tmp_path / "t.txt"
    text.write_text("hello world " * 50)
    refused(["train", model, "--data", text, "--output", tmp_path / "run", "--report-to", "none"], *words, notes=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["diff", "t.txt"]


def test_every_loading_command_refuses_pickle_only_weights_without_unpickling(refused, tmp_path, capsys):
    """Issue 56: a checkpoint whose weights are only pytorch_model.bin is one line of ours naming the problem and the
    fix, for every command that loads a model; nothing is unpickled (torch's refusal of such a pickle advised
    `weights_only=False`)."""
    model = _diff_checkpoint(tmp_path)
    marker = tmp_path / "unpickled"
    make_pickle_only(model, marker)
    text = tmp_path / "t.txt"
    text.write_text("hello world " * 50)
    words = ["pytorch_model.bin", "refusing to unpickle", "safetensors only", "save_pretrained", "trusted"]
    for argv in (
        ["generate", model, "5 6 7"],
        ["inspect", model, "5 6 7", "--out", tmp_path / "f.png"],
        ["niah", model, "--out", tmp_path / "niah", "--lengths", "256", "--depths", "0.5", "--no-figure"],
        ["train", model, "--data", text, "--output", tmp_path / "run", "--report-to", "none"],
    ):
        line = refused(argv, *words)
        assert "weights_only" not in line, line
    assert not marker.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["diff", "t.txt"]


# ---------------------------------------------------------------------------------------------------------------
# Silent wrong results in the layer and the kernel; the kernel's cu_seqlens


def test_differential_attention_refuses_what_sdpa_refuses():
    from diff_transformer.layers import DifferentialAttention, differential_attention

    q = torch.randn(1, 2, 4, 8)
    mask = torch.ones(4, 4, dtype=torch.bool).tril()
    expected = differential_attention(q, q, q[..., :4], 0.5, attn_mask=mask)
    for dtype in (torch.int64, torch.uint8):
        with pytest.raises(ValueError, match=f"attn_mask has dtype {dtype}: pass a bool mask"):
            differential_attention(q, q, q[..., :4], 0.5, attn_mask=mask.to(dtype))
        for sdpa_mask in (mask.to(dtype),):  # SDPA refuses the same masks
            with pytest.raises(RuntimeError):
                torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=sdpa_mask)
    additive = torch.zeros(4, 4).masked_fill(~mask, float("-inf"))  # the float mask still equals the bool one
    torch.testing.assert_close(differential_attention(q, q, q[..., :4], 0.5, attn_mask=additive), expected)
    with pytest.raises(ValueError, match="query has dtype torch.int64"):
        differential_attention(q.long(), q.long(), q.long(), 0.5)
    for scale in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match=f"scale={scale} must be a finite number"):
            differential_attention(q, q, q, 0.5, scale=scale)
    for lambda_init in (1.0, 1.5, -0.1):
        with pytest.raises(ValueError, match=f"lambda_init={lambda_init} must lie in \\[0, 1\\)"):
            DifferentialAttention(16, 2, lambda_init=lambda_init)
    DifferentialAttention(16, 2, lambda_mode="head", lambda_init=1.0)  # no (1 - λ_init) factor there


@pytest.mark.parametrize(
    "offsets, words",
    [
        ([0, 100], "end at N=6"),
        ([0, -4, 6], "never decrease"),
        ([0, 6, 12], "end at N=6"),
        ([2, 6], "start at 0"),
        ([0, 4], "end at N=6"),
    ],
)
def test_kernel_refuses_cu_seqlens_outside_the_packed_rows(offsets, words):
    pytest.importorskip("triton")
    from diff_transformer.kernels import triton_v1_attention

    q, kv = torch.randn(1, 4, 6, 16), torch.randn(1, 4, 6, 16)
    with pytest.raises(ValueError, match=words):
        triton_v1_attention(q, kv, kv, 0.5, scaling=0.25, cu_seqlens=torch.tensor(offsets, dtype=torch.int32))


def test_kernel_refuses_integer_masks_and_bad_offsets_types():
    pytest.importorskip("triton")
    from diff_transformer.kernels import triton_v1_attention

    q, kv = torch.randn(1, 4, 5, 16), torch.randn(1, 4, 5, 16)
    mask = torch.ones(1, 1, 5, 5, dtype=torch.bool).tril()
    for dtype in (torch.int64, torch.uint8):
        with pytest.raises(ValueError, match=f"attention_mask has dtype {dtype}"):
            triton_v1_attention(q, kv, kv, 0.5, scaling=0.25, attention_mask=mask.to(dtype))
    with pytest.raises(ValueError, match="int32 or int64"):
        triton_v1_attention(q, kv, kv, 0.5, scaling=0.25, cu_seqlens=torch.tensor([0.0, 5.0]))
    with pytest.raises(ValueError, match="below the longest packed sequence"):
        triton_v1_attention(q, kv, kv, 0.5, scaling=0.25, cu_seqlens=torch.tensor([0, 5]), max_seqlen=2)
    out = triton_v1_attention(q, kv, kv, 0.5, scaling=0.25, cu_seqlens=torch.tensor([0, 2, 5]))  # int64 is fine
    assert out.shape == (1, 5, 2, 32) and out.isfinite().all()


# ---------------------------------------------------------------------------------------------------------------
# inspect: bounded memory, only the plotted layer's maps, options, outputs


def test_inspect_refuses_texts_beyond_the_context_or_the_memory_budget(refused, tmp_path, capsys):
    model = _diff_checkpoint(tmp_path, max_position_embeddings=16)
    out = tmp_path / "f.png"
    refused(["inspect", model, " ".join(["5"] * 17), "--out", out], "17 tokens", "context (16 positions)", notes=True)
    argv = ["inspect", model, " ".join(["5"] * 16), "--out", out, "--max-memory-gb", "1e-6"]
    refused(argv, "16 tokens", "over --max-memory-gb 1e-06", notes=True)
    assert not out.exists()


def test_inspect_computes_only_the_plotted_layers_maps(tmp_path, monkeypatch):
    from diff_transformer.analysis import maps as analysis

    model = _diff_checkpoint(tmp_path)
    computed = []
    layer_maps = analysis._layer_maps
    monkeypatch.setattr(analysis, "_layer_maps", lambda *a: computed.append(a[1]) or layer_maps(*a))
    assert cli.main(["inspect", str(model), "5 6 7 8", "--layer", "1", "--out", str(tmp_path / "f.png")]) == 0
    assert len(computed) == 1  # the old code computed (and held) every layer's maps for one plot
    computed.clear()
    assert (
        cli.main(
            ["inspect", str(model), "5 6 7 8", "--out", str(tmp_path / "g.png"), "--grid", str(tmp_path / "h.png")]
        )
        == 0
    )
    assert len(computed) == 2  # the grid needs every layer, one at a time


def test_inspect_options_and_outputs(refused, tmp_path, capsys):
    model = _diff_checkpoint(tmp_path)
    out = tmp_path / "f.png"
    for dpi in ("0", "-5", "100000"):
        refused(["inspect", model, "5 6", "--out", out, "--dpi", dpi], f"--dpi {dpi}", "between 1 and 600", notes=True)
    refused(["inspect", model, "5 6", "--out", "/sys/f.png"], "--out /sys/f.png", "cannot write", notes=True)
    refused(["inspect", model, "5 6", "--out", out, "--json", "/sys/m.json"], "--json /sys/m.json", notes=True)
    config = (model / "config.json").read_bytes()
    argv = ["inspect", model, "5 6", "--out", out, "--json", model / "config.json", "--overwrite"]
    refused(argv, f"--json {model / 'config.json'} lies inside MODEL", "never modified", notes=True)
    refused(["inspect", model, "5 6", "--out", model / "f.png"], "lies inside MODEL", notes=True)
    assert (model / "config.json").read_bytes() == config and not out.exists() and not (model / "f.png").exists()


def test_inspect_refuses_figure_formats_it_cannot_write_here(refused, tmp_path, capsys):
    import shutil

    model = _diff_checkpoint(tmp_path)
    if shutil.which("xelatex") is None:  # pgf needs a TeX program: refused before anything loads, not at the end
        err = refused(["inspect", model, "5 6", "--out", tmp_path / "x.pgf"], "--out", "x.pgf", ".png", ".svg")
        assert ".pgf" not in err.replace("x.pgf", "")
    refused(["inspect", model, "5 6", "--out", tmp_path / "x.xyz"], "x.xyz", "one of", ".pdf", ".png")
    refused(["inspect", model, "5 6", "--grid", tmp_path / "g", "--out", tmp_path / "x.png"], "--grid", ".png")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["diff"]


def test_inspect_writes_no_file_when_one_of_them_fails(refused, tmp_path, capsys, monkeypatch):
    """--out, --grid and --json go into place together: a figure matplotlib fails on leaves none of them."""
    from diff_transformer.analysis import plotting

    model = _diff_checkpoint(tmp_path)
    outputs = tmp_path / "outputs"
    outputs.mkdir()
    metric_grid = plotting.metric_grid

    def failing_grid(*args, **kwargs):
        figure = metric_grid(*args, **kwargs)
        figure.savefig = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("cannot render this"))
        return figure

    monkeypatch.setattr(plotting, "metric_grid", failing_grid)
    argv = ["inspect", model, "5 6 7", "--out", outputs / "f.png", "--grid", outputs / "g.png"]
    refused([*argv, "--json", outputs / "m.json"], f"writing {outputs / 'g.png'} failed (cannot render this)")
    assert list(outputs.iterdir()) == []


def test_inspect_draws_mathtext_characters_of_a_model_path_literally(tmp_path, capsys):
    """A `$...$` in the model's name (the figure title) or in the text's tokens is drawn as it is, not parsed as
    mathtext (`$\\foo$` failed when the figure was saved)."""
    model = _diff_checkpoint(tmp_path)
    named = tmp_path / "my$\\foo_x^{2}$ model"
    model.rename(named)
    out = tmp_path / "f.png"
    argv = [str(named), "5 6 7", "--out", str(out), "--grid", str(tmp_path / "g.svg"), "--metric", "lambda"]
    assert cli.main(["inspect", *argv]) == 0
    assert out.stat().st_size > 0 and "my$\\foo_x^{2}$ model" in (tmp_path / "g.svg").read_text()


@pytest.mark.parametrize("command", ["convert", "merge", "demo", "train"])
def test_a_non_utf8_output_path_is_one_line(refused, workdir, finished_runs, tmp_path, capsys, command):
    """safetensors takes only UTF-8 paths and the model card names the directory: refused before anything runs."""
    out = tmp_path / os.fsdecode(b"caf\xe9")
    tiny = REPOSITORY / "src" / "diff_transformer" / "assets" / "tiny-llama"
    argv = {
        "convert": ["convert", tiny, out],
        "merge": ["merge", finished_runs["lora"], out],
        "demo": ["demo", "--scratch", "--output", out],
        "train": train_argv(workdir, out, "--max-steps", "1"),
    }[command]
    refused(argv, "is not valid UTF-8", "choose a path of UTF-8 characters", notes=True)
    assert not os.path.lexists(out)


def test_a_non_utf8_path_reaching_a_file_is_one_line_at_the_boundary():
    from diff_transformer.errors import library_failure

    try:
        os.fsdecode(b"caf\xe9").encode("utf-8")
    except UnicodeEncodeError as exc:
        assert "not valid UTF-8" in library_failure(exc)


# ---------------------------------------------------------------------------------------------------------------
# generate: generation_config.json and the length asked for


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("num_beams", -3, "num_beams=-3 must be >= 1"),
        # issue 46: a million beams ran out of memory after the model had loaded; refused before it loads
        ("num_beams", 10**6, "num_beams=1000000 must be >= 1 and <= 64 (each is a row of the batch, with its own KV"),
        ("top_p", 2.0, "top_p=2.0 must be > 0.0 and <= 1.0"),
        ("top_k", -1, "top_k=-1 must be >= 0"),
        ("repetition_penalty", 0.0, "repetition_penalty=0.0 must be > 0.0"),
        ("num_return_sequences", 0, "num_return_sequences=0"),
        ("temperature", -1.0, "temperature=-1.0"),
        ("temperature", 1e-30, "temperature=1e-30 is below 0.0001"),
        ("bad_words_ids", [[5000]], "bad_words_ids holds 5000, not a token id of this model (0 to 96)"),
        ("bad_words_ids", [[-3]], "bad_words_ids holds -3"),
        ("bad_words_ids", [5], "bad_words_ids=[5] must be a list of token-id lists"),
        ("suppress_tokens", [97], "suppress_tokens holds 97"),
        ("forced_eos_token_id", 99999, "forced_eos_token_id=99999 is not a token id"),
    ],
)
def test_generate_refuses_a_bad_generation_config(refused, tmp_path, capsys, field, value, words):
    model = _diff_checkpoint(tmp_path)
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**config, field: value}))
    refused(["generate", model, "5 6 7", "--max-new-tokens", "2"], "generation_config.json", words, notes=True)


@pytest.mark.parametrize("temperature", ["1e-30", "1e-45", "5e-5"])
def test_generate_refuses_a_temperature_that_overflows_sampling(refused, tmp_path, capsys, temperature):
    """logits / 1e-45 is inf and the probabilities NaN (a RuntimeError inside generate()); below the documented
    minimum a temperature is refused, with 0 (greedy: what it amounts to) as the fix."""
    model = _diff_checkpoint(tmp_path)
    refused(["generate", model, "5 6 7", "--temperature", temperature], "is below 0.0001", "pass 0 for greedy")
    assert cli.main(["generate", str(model), "5 6 7", "--max-new-tokens", "2", "--temperature", "1e-4"]) == 0


@pytest.mark.parametrize("seed", [2**64, 2**32, -1, 1.5, True, "7"])
def test_python_api_seeds_out_of_range_are_one_clear_error(tmp_path, seed):
    from diff_transformer.conversion import ConversionError, convert_llama_to_diff, convert_to_diff, verify_conversion

    tiny = REPOSITORY / "src" / "diff_transformer" / "assets" / "tiny-llama"
    message = f"seed {seed!r} must be a whole number in [0, 2**32)"
    for convert in (convert_llama_to_diff, convert_to_diff):
        with pytest.raises(ConversionError, match=re.escape(message)):
            convert(tiny, tmp_path / "out", diff_version=1, seed=seed, progress=False)
        assert not (tmp_path / "out").exists()
    with pytest.raises(ConversionError, match=re.escape(message)):
        verify_conversion(tiny, tiny, seed=seed)


@pytest.mark.parametrize("seed", [str(2**64), "-1"])
def test_cli_seeds_out_of_range_are_one_line(refused, tmp_path, capsys, seed):
    model = _diff_checkpoint(tmp_path)
    refused(["generate", model, "5 6", "--temperature", "1", f"--seed={seed}"], f"--seed {seed}", "[0, 2**32)")
    refused(["demo", "--scratch", "--output", tmp_path / "d", f"--seed={seed}"], f"--seed {seed}", "[0, 2**32)")
    assert not (tmp_path / "d").exists()


def test_generate_length_stays_within_the_context(refused, tmp_path, capsys):
    model = _diff_checkpoint(tmp_path, max_position_embeddings=8)
    argv = ["generate", model, "5 6 7", "--max-new-tokens", "100000000"]
    refused(argv, "context (8 positions)", "at most 5", notes=True)
    refused(["generate", model, " ".join(["5"] * 8)], "8 tokens", "shorten it", notes=True)
    assert cli.main(["generate", str(model), "5 6 7", "--max-new-tokens", "5"]) == 0


# ---------------------------------------------------------------------------------------------------------------
# Examples follow the CLI's rules


def _example(name):
    import importlib.util

    path = REPOSITORY / "experiments" / name / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"example_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_continued_pretraining_keeps_a_non_empty_workdir(tmp_path, capsys, monkeypatch):
    example = _example("continued_pretraining")
    monkeypatch.setattr(example, "train", lambda *a: pytest.fail("trained into a non-empty --workdir"))
    work = tmp_path / "W"
    (work / "tiny-diff-v2").mkdir(parents=True)
    (work / "tiny-diff-v2" / "my-notes.txt").write_text("mine")
    (work / "run-v2").mkdir()
    digest = tree_digest(work)
    argv = ["--workdir", str(work), "--models", "v2", "--steps", "1", "--docs", str(tmp_path / "docs")]
    argv += ["--results", str(tmp_path / "results")]
    assert example.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: --workdir {work} is not empty: pass --overwrite to replace the converted models and runs " \
        "in it, or choose another directory"  # fmt: skip
    assert tree_digest(work) == digest and not (tmp_path / "docs").exists() and not (tmp_path / "results").exists()
    assert example.main(["--workdir", str(Path.cwd()), "--steps", "1"]) == 2
    assert "is the current directory" in capsys.readouterr().err
    assert example.main(["--steps", "0"]) == 2 and "--steps 0 must be at least 1" in capsys.readouterr().err


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--models", "llama,bogus"], "--models llama,bogus"),
        (["--models", "v1,v1"], "distinct names"),
        (["--seeds", "0"], "--seeds 0 must be at least 1"),
        (["--log-every", "0"], "--log-every 0 must be at least 1"),
        (["--threads", "-1"], "--threads -1 must be at least 1"),
        (["--lr", "nan"], "--lr nan"),
        (["--length", "100", "--min-length", "100", "--max-needles", "1"], "up to 6 needles"),
        (["--max-needles", "100", "--length", "4000", "--min-length", "3000"], "--max-needles 100"),
        (["--vocab-size", "10"], "--vocab-size 10"),
        (["--heads", "3"], "--heads 3 even"),
        (["--intermediate-size", "10"], "too small for V2"),
    ],
)
def test_multi_needle_arguments_are_checked_before_training(tmp_path, capsys, extra, words):
    example = _example("multi_needle")
    with pytest.raises(SystemExit) as exit_:
        example.parse_args(["--output", str(tmp_path / "out"), *extra])
    assert exit_.value.code == 2 and words in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------------------------
# New hostile cases (found while fixing the above)


def test_a_config_claiming_many_layers_is_refused_before_anything_is_built(refused, tmp_path, capsys):
    model = _diff_checkpoint(tmp_path, num_hidden_layers=20_000)  # the old code built all of them on meta first
    refused(["generate", model, "5 6 7"], "num_hidden_layers=20000", "the weights hold 2 layers", notes=True)


def test_float16_conversion_refuses_values_it_would_make_inf(refused, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    from tests.helpers.checkpoints import make_llama

    src = make_llama(tmp_path / "llama")
    weights = load_file(src / "model.safetensors")
    weights["model.layers.0.mlp.down_proj.weight"][0, 0] = 1e5  # fine in float32 and bfloat16, inf in float16
    save_file(weights, src / "model.safetensors", metadata={"format": "pt"})
    argv = ["convert", src, tmp_path / "out", "--dtype", "float16", "--quiet"]
    refused(argv, "model.layers.0.mlp.down_proj.weight", "beyond float16's range", "bfloat16", notes=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["llama"]
    assert cli.main(["convert", str(src), str(tmp_path / "out"), "--dtype", "bfloat16", "--quiet"]) == 0


def test_train_does_not_write_over_a_directory_of_the_users(refused, workdir, tmp_path, capsys):
    out = tmp_path / "notes"
    out.mkdir()
    (out / "README.md").write_text("my notes")  # the final save writes a model card README.md
    argv = train_argv(workdir, out, "--max-steps", "1")
    # the run writes a README.md: --overwrite would be refused too, so the line says to move it, and not --overwrite
    err = refused(argv, "holds README.md, which no training run wrote and the run writes", "move them", notes=True)
    assert "--overwrite" not in err
    refused([*argv, "--overwrite"], "README.md", "Move them out", notes=True)
    assert (out / "README.md").read_text() == "my notes" and sorted(p.name for p in out.iterdir()) == ["README.md"]
    (out / "README.md").rename(out / "notes.txt")  # a name the run never writes: --overwrite trains beside it
    refused(argv, "holds files that no training run wrote (notes.txt)", "--overwrite to train beside them", notes=True)
    assert cli.main([str(a) for a in argv] + ["--overwrite"]) == 0
    assert (out / "notes.txt").read_text() == "my notes" and (out / "model.safetensors").is_file()


def test_overwrite_never_follows_a_checkpoint_link(refused, workdir, tmp_path, capsys):
    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    (elsewhere / "checkpoint-3").mkdir(parents=True)
    (elsewhere / "checkpoint-3" / "trainer_state.json").write_text("{}")  # looks like a checkpoint, is not ours
    run.mkdir()
    (run / "trainer_state.json").write_text("{}")
    (run / "checkpoint-3").symlink_to(elsewhere / "checkpoint-3")
    # A third step would save checkpoint-3 through the link: refused before anything (tests/outputs/test_links.py).
    refused(train_argv(workdir, run, "--max-steps", "1", "--overwrite"), "checkpoint-3, a symbolic link")
    assert (elsewhere / "checkpoint-3" / "trainer_state.json").read_text() == "{}"
    assert sorted(p.name for p in (elsewhere / "checkpoint-3").iterdir()) == ["trainer_state.json"]


def test_convert_does_not_block_on_a_fifo_card_and_checks_the_generation_config(refused, llama, tmp_path, capsys):
    src = _copy_with(llama, tmp_path / "src")
    (src / "README.md").unlink()
    os.mkfifo(src / "README.md")  # the old code opened it to read the licence: blocked forever
    status = []
    worker = threading.Thread(target=lambda: status.append(cli.main(["convert", str(src), str(tmp_path / "o")])))
    worker.daemon = True
    worker.start()
    worker.join(timeout=60)
    if worker.is_alive():
        with open(src / "README.md", "wb"):
            pass
        worker.join(timeout=60)
        pytest.fail("convert blocked reading a FIFO README.md")
    assert status == [0]
    (src / "generation_config.json").write_text(json.dumps({"num_beams": -3}))
    refused(["convert", src, tmp_path / "o2", "--quiet"], "num_beams=-3 must be >= 1", notes=True)
    assert not (tmp_path / "o2").exists()


def test_oversized_config_is_not_read(refused, tmp_path, capsys):
    model = _diff_checkpoint(tmp_path)
    with open(model / "config.json", "a") as handle:
        handle.write(" " * (17 << 20))  # whitespace: still valid JSON, but no config is 17 MB
    refused(["generate", model, "5 6 7"], "is over 16 MB, not a config", notes=True)


def test_a_full_disk_during_training_is_one_line(refused, workdir, tmp_path, capsys, monkeypatch):
    import errno

    from diff_transformer.training import train as train_module

    out = tmp_path / "run"

    def full(self, output_dir=None, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(out / "model.safetensors"))

    monkeypatch.setattr(train_module.CausalLMTrainer, "save_model", full)
    refused(train_argv(workdir, out, "--max-steps", "1"), "No space left on device", "--resume", notes=True)


def test_a_fifo_in_the_model_directory_is_never_opened(tmp_path, capsys):
    model = _diff_checkpoint(tmp_path)
    (model / "generation_config.json").unlink()
    os.mkfifo(model / "generation_config.json")  # refused, not opened (transformers happened to skip it)
    status = []
    worker = threading.Thread(target=lambda: status.append(cli.main(["generate", str(model), "5 6 7"])))
    worker.daemon = True
    worker.start()
    worker.join(timeout=60)
    if worker.is_alive():
        with open(model / "generation_config.json", "wb"):
            pass
        worker.join(timeout=60)
        pytest.fail("generate blocked reading a FIFO generation_config.json")
    assert status == [2] and "generation_config.json is not a regular file" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------------
# merge --overwrite, demo --overwrite: the new output is installed whole; of the old one only the user's files stay


def _stale_entries(out, mark):
    """Into a command's output OUT: files of an old model (a shard index, an adapter config) and a file the command
    "wrote" (in its manifest), then the user's own file and directory."""
    (out / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    (out / "adapter_config.json").write_text("{}")
    (out / "old-output.txt").write_text("written by the command")
    write_manifest(out, mark)  # proves old-output.txt (and the rest) is the command's
    (out / "notes.txt").write_text("mine")
    (out / "mine").mkdir()
    (out / "mine" / "data.txt").write_text("mine")


def _check_only_the_users_stayed(out):
    left = {p.name for p in out.iterdir()}
    assert not {"model.safetensors.index.json", "adapter_config.json", "old-output.txt"} & left
    assert (out / "notes.txt").read_text() == "mine" and (out / "mine" / "data.txt").read_text() == "mine"
    manifest = json.loads((out / ".diff-transformer-output.json").read_text())["entries"]
    assert not {"notes.txt", "mine", "mine/data.txt"} & set(manifest)  # kept, not claimed as the command's
    assert not [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]  # nothing left beside


def test_merge_overwrite_keeps_only_the_users_files(finished_runs, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "merged"
    assert cli.main(["merge", str(finished_runs["lora"]), str(out)]) == 0
    assert wrote_this(out, "diff-transformer merge")
    _stale_entries(out, "diff-transformer merge")
    assert cli.main(["merge", str(finished_runs["lora"]), str(out), "--overwrite"]) == 0
    assert "kept what no diff-transformer command wrote" in capsys.readouterr().err
    _check_only_the_users_stayed(out)
    assert type(AutoModelForCausalLM.from_pretrained(out)).__name__ == "DiffForCausalLM"


def test_merge_overwrite_of_a_foreign_model_is_refused_naming_its_files(finished_runs, tmp_path, refused):
    """A directory no command of the package wrote: its model files are the user's (no record proves otherwise), and
    the new model would replace or read them: refused, naming them, nothing removed (issue 56: they were deleted by
    their names)."""
    out = tmp_path / "foreign"
    out.mkdir()
    (out / "adapter_model.safetensors").write_bytes(b"old")
    (out / "tokenizer.model").write_bytes(b"old")
    (out / "notes.txt").write_text("mine")
    refused(["merge", finished_runs["lora"], out, "--overwrite"], "adapter_model.safetensors", "tokenizer.model")
    assert {p.name for p in out.iterdir()} == {"adapter_model.safetensors", "tokenizer.model", "notes.txt"}


def test_demo_overwrite_keeps_only_the_users_files(tmp_path, capsys):
    from diff_transformer.cli.demo import DEMO_MARK, SCRATCH_MARK

    out = tmp_path / "scratch"
    assert cli.main(["demo", "--scratch", "--output", str(out)]) == 0
    _stale_entries(out, SCRATCH_MARK)
    assert cli.main(["demo", "--scratch", "--output", str(out), "--overwrite"]) == 0
    _check_only_the_users_stayed(out)
    assert (out / "diff-v1" / "model.safetensors").is_file()

    out = tmp_path / "demo"
    assert cli.main(["demo", "--output", str(out)]) == 0
    _stale_entries(out, DEMO_MARK)
    assert cli.main(["demo", "--output", str(out), "--overwrite"]) == 0
    _check_only_the_users_stayed(out)
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
