import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def test_scratch_demo_end_to_end(tmp_path, capsys):
    from diff_transformer import cli

    assert cli.main(["demo", "--scratch", "--output", str(tmp_path)]) == 0
    assert capsys.readouterr().out.count("logits identical after reload: True") == 2
    for version in (1, 2):
        assert (tmp_path / f"diff-v{version}" / "model.safetensors").exists()
        assert (tmp_path / f"diff-v{version}" / "modeling_diff.py").exists()


def test_generate_command_with_token_ids(tmp_path, capsys):
    import torch

    from diff_transformer import cli
    from tests.helpers.tiny import tiny_model

    model = tiny_model(2)
    model.save_pretrained(tmp_path)
    assert cli.main(["generate", str(tmp_path), "5 6 7", "--max-new-tokens", "4"]) == 0
    expected = model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, do_sample=False)[0, 3:].tolist()
    assert capsys.readouterr().out.split() == [str(t) for t in expected]
    # sampling among the one most likely token is greedy, whatever the seed and temperature
    argv = ["generate", str(tmp_path), "5 6 7", "--max-new-tokens", "4", "--temperature", "1.5", "--top-k", "1"]
    assert cli.main([*argv, "--seed", "3"]) == 0 and cli.main([*argv, "--seed", "4"]) == 0
    assert capsys.readouterr().out.split() == [str(t) for t in expected] * 2
    # and so is a nucleus so small that it keeps only the most likely token
    assert cli.main([*argv[:-2], "--top-p", "1e-6", "--seed", "5"]) == 0
    assert capsys.readouterr().out.split() == [str(t) for t in expected]


def test_generate_compile_decodes_the_eager_tokens(tmp_path, capsys, monkeypatch, refused):
    import torch

    from diff_transformer import cli
    from tests.helpers.tiny import tiny_model

    model = tiny_model(1)
    model.save_pretrained(tmp_path)
    expected = model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=6, do_sample=False)[0, 3:].tolist()
    compiles, compile_ = [], torch.compile

    def dynamo_only(fn, **kwargs):  # inductor's code is tests/model/test_generation.py's (slow); dynamo traces here
        compiles.append(kwargs)
        return compile_(fn, **{**kwargs, "backend": "eager", "mode": None})

    monkeypatch.setattr(torch, "compile", dynamo_only)
    assert cli.main(["generate", str(tmp_path), "5 6 7", "--max-new-tokens", "6", "--compile", "--device", "cpu"]) == 0
    assert capsys.readouterr().out.split() == [str(t) for t in expected]
    assert len(compiles) == 1 and compiles[0]["fullgraph"], compiles  # generate compiled the decoding step
    refused(["generate", str(tmp_path), "--chat", "--compile"], "--compile", "interactive chat", "pass a PROMPT")


def test_python_dash_m_diff_transformer_is_the_command():
    import subprocess
    import sys

    from diff_transformer._version import __version__

    result = subprocess.run([sys.executable, "-m", "diff_transformer", "--version"], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip() == f"diff-transformer {__version__}", result


COMMANDS = ("demo", "convert", "generate", "inspect", "merge", "train", "serve", "niah", "plan")


@pytest.mark.parametrize(
    "argv", [["--version"], ["--help"], *([name, "--help"] for name in COMMANDS)], ids=lambda argv: " ".join(argv)
)
def test_version_and_help_import_neither_torch_nor_transformers(argv):
    """Issue 32: `--version` took 4-6 s (torch and transformers). `-X importtime` lists every module the command
    imports; neither is among them (measured: 0.08-0.24 s wall on 2 cores, against 7 s at load average 5)."""
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "diff_transformer", *argv], capture_output=True, text=True
    )
    assert result.returncode == 0 and result.stdout.strip(), result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("import time:")]
    imported = {line.rsplit("|", 1)[1].strip() for line in lines}
    assert "diff_transformer.cli" in imported  # the importtime lines were read
    heavy = {name.split(".")[0] for name in imported} & {"torch", "transformers", "numpy", "safetensors"}
    assert not heavy, heavy


def test_the_command_still_registers_the_auto_classes(tmp_path):
    """Outside `--version`/`--help`, the command loads what `import diff_transformer` loads before a subcommand runs:
    a Diff checkpoint resolves through the Auto classes (no trust_remote_code) in a fresh `python -m` process."""
    from tests.helpers.tiny import tiny_model

    tiny_model(2).save_pretrained(tmp_path)
    (tmp_path / "modeling_diff.py").unlink()  # no custom code to fall back on
    result = subprocess.run(
        [sys.executable, "-m", "diff_transformer", "generate", str(tmp_path), "5 6 7", "--max-new-tokens", "2"],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0 and len(result.stdout.split()) == 2, result.stderr[-2000:]


@pytest.mark.slow  # end to end (a command, a training run): in the whole suite, not the quick loop
def test_other_programs_get_the_registered_package(tmp_path):
    """Only the command itself starts lazily: a module run with `python -m` that imports diff_transformer, or a
    script whose name merely starts like the command's, gets the Auto classes registered on import, as always."""
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("import diff_transformer\n")
    check = "from transformers import AutoConfig\nprint(AutoConfig.for_model('diff').__class__.__name__)\n"
    (tmp_path / "mypkg" / "__main__.py").write_text(check)
    (tmp_path / "diff-transformer-notes.py").write_text("import diff_transformer\n" + check)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    for command in ([sys.executable, "-m", "mypkg"], [sys.executable, str(tmp_path / "diff-transformer-notes.py")]):
        result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path)
        assert result.returncode == 0 and result.stdout.strip() == "DiffConfig", result.stderr[-2000:]


def _tiny_llama(path, **overrides):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    values = dict(
        vocab_size=97,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
    )
    values.update(overrides)
    LlamaForCausalLM(LlamaConfig(**values)).save_pretrained(path)


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "diff_transformer.cli", *map(str, args)], capture_output=True, text=True, timeout=300
    )


def test_convert_command_verifies_v2(tmp_path, capsys):
    import json

    from diff_transformer import cli

    _tiny_llama(tmp_path / "llama")
    assert cli.main(["convert", str(tmp_path / "llama"), str(tmp_path / "diff"), "--verify", "--quiet"]) == 0
    assert "greedy continuations match: True" in capsys.readouterr().out
    config = json.loads((tmp_path / "diff" / "config.json").read_text())
    assert config["model_type"] == "diff" and config["diff_version"] == 2


def test_convert_verify_of_v1_is_informational(tmp_path, capsys):
    """Issue 57: a V1 conversion, which is not function-preserving, prints the comparison, says it is informational
    and exits 0."""
    from diff_transformer import cli

    _tiny_llama(tmp_path / "llama")
    argv = ["convert", tmp_path / "llama", tmp_path / "v1", "--diff-version", "1", "--v1-init", "paper", "--verify"]
    assert cli.main([str(a) for a in [*argv, "--quiet"]]) == 0
    out = capsys.readouterr().out
    assert "greedy continuations match:" in out and "informational" in out and "not function-preserving" in out


def test_convert_verify_exit_status_says_whether_an_exact_conversion_is_exact(tmp_path, capsys, monkeypatch):
    """Issue 57: V2 (function-preserving) exits 1 with one error line when the converted model differs from its
    source (here a real wrong weight: one tensor scaled by 1.01 as it is written)."""
    from diff_transformer import cli
    from diff_transformer.conversion.writer import ShardWriter

    _tiny_llama(tmp_path / "llama")
    add = ShardWriter.add

    def wrong(self, name, tensor, dtype=None):
        return add(self, name, tensor * 1.01 if name.endswith("layers.0.mlp.down_proj.weight") else tensor, dtype)

    monkeypatch.setattr(ShardWriter, "add", wrong)
    assert cli.main(["convert", str(tmp_path / "llama"), str(tmp_path / "v2"), "--verify", "--quiet"]) == 1
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "not exact" in errors[0] and "informational" not in captured.out


@pytest.mark.slow  # end to end (a command, a training run): in the whole suite, not the quick loop
def test_convert_command_v1_odd_heads_says_it_uses_the_expanded_layout(tmp_path):
    _tiny_llama(tmp_path / "llama", num_attention_heads=3, num_key_value_heads=3)
    before = sorted((p.name, p.read_bytes()) for p in (tmp_path / "llama").iterdir())
    result = _cli("convert", tmp_path / "llama", tmp_path / "diff", "--diff-version", "1", "--quiet")
    assert result.returncode == 0, result.stderr
    notes = [line for line in result.stdout.splitlines() if line.startswith("V1 layout:")]
    assert notes == [notes[0]] and "expanded" in notes[0] and "cannot be paired" in notes[0]
    calibrated = [line for line in result.stdout.splitlines() if line.startswith("V1 calibrated on")]
    assert len(calibrated) == 1 and "A2 = A1 at step 0" in calibrated[0]
    assert "second half reads the input's steadiest direction at 10x" in calibrated[0]
    assert json.loads((tmp_path / "diff" / "config.json").read_text())["num_attention_heads"] == 3
    assert sorted((p.name, p.read_bytes()) for p in (tmp_path / "llama").iterdir()) == before
    refused = _cli("convert", tmp_path / "llama", tmp_path / "d2", "--diff-version", "1", "--v1-layout", "paired")
    assert refused.returncode == 2 and "--v1-layout expanded" in refused.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "d2").exists()


# --- one clear line instead of a traceback (exit 2, the input named, the fix given) -------------------------------


@pytest.fixture
def no_hub(monkeypatch):
    """Any attempt to reach the Hub fails the test (a mistyped path must be refused before that)."""
    import huggingface_hub

    def hub(*args, **kwargs):
        raise AssertionError(f"the Hub was asked for {args[:1]}")

    for name in ("snapshot_download", "hf_hub_download"):
        monkeypatch.setattr(huggingface_hub, name, hub)


def test_generate_bad_inputs_are_one_line(refused, tmp_path, capsys, monkeypatch, no_hub):
    import json

    from tests.helpers.tiny import tiny_model

    model = tmp_path / "model"
    tiny_model(2).save_pretrained(model)  # no tokenizer: prompts are token ids
    monkeypatch.chdir(tmp_path)
    refused(["generate", "./no-such-model", "5 6"], "'./no-such-model' is neither an existing directory")
    refused(["generate", "no-such-model", "5 6"], "'no-such-model' does not exist", "hf://no-such-model")
    refused(["generate", "model/typo", "5 6"], "'model/typo' does not exist", "hf://model/typo")
    refused(["generate", model, "hello"], "has no tokenizer", "'hello'", "token ids")
    refused(["generate", model, "5 97"], "token id 97", "from 0 to 96")
    refused(["generate", model, "5 -1"], "token id -1", "from 0 to 96")
    refused(["generate", model, "5 6", "--max-new-tokens", "0"], "--max-new-tokens 0", "at least 1")
    refused(["generate", model, "5 6", "--temperature", "-0.5"], "--temperature -0.5", ">= 0")
    refused(["generate", model, "5 6", "--temperature", "nan"], "--temperature nan")
    sampled = ["generate", model, "5 6", "--temperature", "1"]
    refused([*sampled, "--top-p", "0"], "--top-p 0.0", "(0, 1]")
    refused([*sampled, "--top-p", "nan"], "--top-p nan")
    refused([*sampled, "--top-k", "0"], "--top-k 0", "at least 1")
    refused(["generate", model, "5 6", "--top-k", "5"], "add --temperature > 0")

    mismatched = tmp_path / "mismatched"  # V2 weights under a config edited to say V1
    tiny_model(2).save_pretrained(mismatched)
    config = json.loads((mismatched / "config.json").read_text())
    (mismatched / "config.json").write_text(json.dumps({**config, "diff_version": 1}))
    refused(["generate", mismatched, "5 6"], "config.json says diff_version=1", '"diff_version": 2')

    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    refused(["generate", model, "5 6"], "model.safetensors", "corrupt or truncated", "re-download")


def test_convert_mistyped_path_and_nested_config(refused, tmp_path, capsys, monkeypatch, no_hub):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    refused(["convert", "tiny-lama", "out"], "SRC 'tiny-lama' does not exist", "hf://tiny-lama")
    refused(["convert", "models/tiny-lama", "out"], "SRC 'models/tiny-lama' does not exist", "hf://models/tiny-lama")
    _tiny_llama(tmp_path / "llama")
    (tmp_path / "llama" / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    refused(["convert", tmp_path / "llama", "out"], "config.json is nested too deeply")
    assert not (tmp_path / "out").exists()


def test_an_empty_model_name_is_refused_not_taken_for_the_current_directory(refused, tmp_path, monkeypatch):
    """Issue 56: `Path("")` is the current directory, so an unset shell variable ran every command on whatever model
    the current directory held."""
    from diff_transformer import checkpoints
    from diff_transformer.checkpoints import CheckpointError
    from tests.helpers.tiny import tiny_model

    tiny_model(2).save_pretrained(tmp_path)  # a model in the current directory: what "" used to load
    _tiny_llama(tmp_path / "llama")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match="MODEL is empty"):
        checkpoints.open("")
    refused(["generate", "", "5 6 7"], "MODEL is empty")
    refused(["inspect", " ", "5 6 7", "--json", "maps.json"], "MODEL is empty")
    refused(["niah", "", "--out", "niah"], "MODEL is empty")
    refused(["train", "", "--data", "llama/config.json", "--output", "run"], "MODEL is empty")
    refused(["merge", "", "merged"], "ADAPTER is empty")
    refused(["convert", "", "out"], "SRC is empty")
    assert not {"maps.json", "niah", "run", "merged", "out"} & {p.name for p in tmp_path.iterdir()}


def test_a_directory_without_config_json_is_named_as_such(refused, tmp_path, monkeypatch):
    """A new user's walk: `generate emptydir hi` answered transformers' "Should have a `model_type` key in its
    config.json" for a directory with no config.json at all; every loading command now says what convert says."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "emptydir").mkdir()
    for argv in (["generate", "emptydir", "5 6"], ["inspect", "emptydir", "5 6", "--json", "maps.json"]):
        refused(argv, "no config.json in emptydir", "save_pretrained")
    assert not (tmp_path / "maps.json").exists()


@pytest.mark.parametrize("version", [1, 2])
def test_a_diff_checkpoint_relabelled_llama_is_named_as_such(refused, tmp_path, version):
    """Issue 56: `model_type: llama` in a Diff config was reported as a head-count mismatch; the fix is the
    model_type. Named from the config's diff_version, or, without it, from Diff's λ tensors."""
    import json

    from tests.helpers.tiny import tiny_model

    model = tmp_path / "model"
    tiny_model(version).save_pretrained(model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    for argv in (["generate", model, "5 6 7"], ["inspect", model, "5 6", "--json", tmp_path / "m.json"]):
        refused(argv, "model_type='llama'", "Diff Transformer checkpoint", '"model_type": "diff"')
    del config["diff_version"]
    (model / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    refused(["generate", model, "5 6 7"], "Diff's λ tensors", '"model_type": "diff"')


def test_top_level_help_names_every_command(capsys):
    from diff_transformer import cli

    with pytest.raises(SystemExit):
        cli.main(["--help"])
    description = capsys.readouterr().out.split("\n\n")[1]  # after the usage line
    for command in ("demo", "convert", "generate", "train", "serve"):
        assert command in description, description


@pytest.mark.parametrize(
    "failure,code,words",
    [
        (OSError(28, "No space left on device", "out/model.safetensors"), 2, ["no space left", "out/model.safe"]),
        (PermissionError(13, "Permission denied", "/x/y"), 2, ["Permission denied: /x/y", "permissions"]),
        (json.JSONDecodeError("Expecting value", "{x", 1), 2, ["not valid JSON", "Expecting value"]),
        (MemoryError(), 2, ["out of memory"]),
        (RuntimeError("boom\nsecond line"), 1, ["unexpected RuntimeError: boom second line", "--traceback"]),
    ],
    ids=["disk-full", "permission", "json", "memory", "bug"],
)
def test_one_error_boundary_for_what_is_not_a_user_error(monkeypatch, capsys, failure, code, words):
    """Known failures of the machine or a file: one line naming the file and the fix, exit 2; anything else is a bug:
    one line and "rerun with --traceback", exit 1; `--traceback` shows the chain."""
    from diff_transformer import cli
    from diff_transformer.cli import inspect as inspect_command

    def fail(args):
        raise failure

    monkeypatch.setattr(inspect_command, "run", fail)
    assert cli.main(["inspect", "org/some-model", "hello", "--json", "maps.json"]) == code
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    for word in words:
        assert word in err[0]
    with pytest.raises(type(failure)):
        cli.main(["inspect", "org/some-model", "hello", "--json", "maps.json", "--traceback"])


def test_safetensors_errors_are_one_line(tmp_path, refused, monkeypatch):
    """A real SafetensorError (a file cut short), reached where the package does not wrap it itself."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    import diff_transformer.cli.inspect as inspect_command

    path = tmp_path / "cut.safetensors"
    save_file({"w": torch.zeros(64)}, str(path))
    path.write_bytes(path.read_bytes()[:40])

    def read(args):
        with safe_open(str(path), "pt") as f:
            f.keys()

    monkeypatch.setattr(inspect_command, "run", read)
    refused(["inspect", "org/m", "hi", "--json", "maps.json"], "a safetensors file is corrupt")


def _run_command(argv, terminal=False):
    """`python -m diff_transformer ARGV` in a fresh process: (status, stdout, stderr), stderr a pipe or, with
    `terminal`, a pseudo-terminal 100 columns wide (where tqdm draws its bars)."""
    import fcntl
    import pty
    import struct
    import termios

    command = [sys.executable, "-m", "diff_transformer", *map(str, argv)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if not terminal:
        result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
        return result.returncode, result.stdout, result.stderr
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=slave, stdin=subprocess.DEVNULL, env=env)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    out = process.stdout.read().decode()
    process.wait(timeout=300)
    os.close(master)
    return process.returncode, out, b"".join(chunks).decode(errors="replace")


def test_every_command_has_quiet():
    from diff_transformer import cli
    from diff_transformer.cli.serve import help_parser

    commands = next(a for a in cli.build_parser()._actions if a.dest == "command").choices
    assert set(commands) == set(COMMANDS)
    for name, parser in commands.items():
        text = help_parser().format_help() if name == "serve" else parser.format_help()
        assert "--quiet" in text, name


@pytest.mark.slow  # end to end (a command, a training run): in the whole suite, not the quick loop
def test_quiet_silences_warnings_and_bars_show_only_on_a_terminal(tmp_path):
    """Issue 32: `convert --verify` printed loading bars, V1 conversion a tokenizer warning. Piped: no bar (and, since
    the calibration samples from the model, no warning); --quiet: nothing on stderr. On a terminal: the bars (our
    own and transformers' weight loading); --quiet: none there either."""
    import diff_transformer

    tiny_llama = Path(diff_transformer.__file__).parent / "assets" / "tiny-llama"
    out = tmp_path / "v1"
    convert = ["convert", tiny_llama, out, "--diff-version", "1", "--verify"]
    status, stdout, stderr = _run_command(convert)
    assert status == 0 and "held-out perplexity" in stdout, stderr
    # the V1 calibration samples from the model now (issue 47): no long text is tokenized, so no tokenizer warning
    assert "Token indices sequence length is longer" not in stderr and "%|" not in stderr, stderr
    status, stdout, stderr = _run_command([*convert, "--overwrite", "--quiet"])
    assert status == 0 and "held-out perplexity" in stdout and stderr == "", stderr

    generate = ["generate", out, "Who is Mr. Darcy?", "--max-new-tokens", "3"]
    status, stdout, stderr = _run_command(generate, terminal=True)
    assert status == 0 and stdout.strip(), stderr
    assert "Loading weights: 100%|" in stderr, stderr
    status, quiet_stdout, stderr = _run_command([*generate, "--quiet"], terminal=True)
    assert status == 0 and quiet_stdout == stdout and stderr == "", stderr


def test_quiet_hides_the_bitsandbytes_kernel_notice():
    """Issue 56 item 5: under --quiet, `train --load-in-4bit` (anything importing peft, hence bitsandbytes) printed
    bitsandbytes' "... Please make sure you already `pip install kernels`": its own Python logger, which neither
    transformers' verbosity nor the warnings filter reach. A fresh interpreter imports bitsandbytes inside the CLI's
    --quiet settings; the notice is logged only on CPUs with AVX512-BF16 and without `kernels` (checked, else skip)."""
    pytest.importorskip("bitsandbytes")
    script = (
        "import importlib.util, sys\n"
        "from diff_transformer.cli.options import output_settings\n"
        "with output_settings(quiet=True):\n"
        "    from bitsandbytes.backends.cpu import ops\n"
        "fires = ops.has_avx512bf16() and importlib.util.find_spec('kernels') is None\n"
        "print('fires' if fires else 'silent')\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    if result.stdout.strip() != "fires":
        pytest.skip("bitsandbytes logs no kernel notice on this CPU")
    assert "pip install kernels" not in result.stderr and "kernels-community" not in result.stderr, result.stderr


def test_every_option_s_help_shows_its_default():
    """Issue 32: help hid defaults (train's batch size, epochs, LoRA r/alpha). Every option of every command says its
    default: the help formatter appends it, and options whose default is None say what happens without them."""
    from diff_transformer import cli
    from diff_transformer.cli.options import options_without_default
    from diff_transformer.cli.serve import help_parser

    commands = next(a for a in cli.build_parser()._actions if a.dest == "command").choices
    for name, parser in commands.items():
        assert options_without_default(help_parser() if name == "serve" else parser) == [], name
    text = " ".join(commands["train"].format_help().split())
    for shown in ("--batch-size BATCH_SIZE blocks per device per micro-batch (default: 8)", "(default: 1.0)"):
        assert shown in text, shown
    for shown in ("--epochs EPOCHS passes over --data (fractions allowed) (default: 1.0)", "LoRA rank r (default: 8)"):
        assert shown in text, shown
    generate = " ".join(commands["generate"].format_help().split())
    assert "--temperature TEMPERATURE 0 = greedy; sampling: at least 1e-4 (default: 0.0)" in generate
    assert "--device DEVICE" in generate and "(default: auto)" in generate


def test_attn_implementation_is_one_option_of_every_loading_command(refused, tmp_path, capsys):
    """generate, inspect, niah and train take the same --attn-implementation (serve passes it to transformers'
    server): an unknown or unavailable backend is refused in one line before anything loads or listens; the package's
    own backends work (diff_map_first: V2's map first, the same greedy tokens as sdpa on this model)."""
    import torch

    from diff_transformer import cli
    from tests.helpers.tiny import tiny_model

    model = str(tmp_path / "model")
    tiny_model(2).save_pretrained(model)
    (tmp_path / "data.txt").write_text("5 6 7 8 9 10 11 12 " * 40)
    bases = {
        "generate": ["generate", model, "5 6 7"],
        "inspect": ["inspect", model, "5 6 7 8", "--json", str(tmp_path / "maps.json")],
        "niah": ["niah", model, "--out", str(tmp_path / "niah"), "--lengths", "4", "--depths", "0", "--needles", "1"],
        "train": ["train", model, "--data", str(tmp_path / "data.txt"), "--output", str(tmp_path / "run")],
        "serve": ["serve", model, "--port", "0"],  # the option serve passes on to transformers' server
    }
    refused([*bases["serve"], "--attn-implementation=fast"], "--attn-implementation 'fast'")
    for argv in bases.values():
        refused([*argv, "--attn-implementation", "fast"], "--attn-implementation 'fast'", "sdpa", "diff_map_first")
        if not torch.cuda.is_available():
            refused([*argv, "--attn-implementation", "flash_attention_2"], "needs a CUDA GPU", "use sdpa")
    tokens = {}
    for backend in ("sdpa", "diff_map_first"):
        capsys.readouterr()
        assert cli.main([*bases["generate"], "--max-new-tokens", "4", "--attn-implementation", backend]) == 0
        tokens[backend] = capsys.readouterr().out
    assert tokens["sdpa"].strip() and tokens["sdpa"] == tokens["diff_map_first"]
