"""The user's journey on the command line (issue 22): convert -> generate --chat -> train --lora -> generate with the
adapter -> merge -> serve, on the shipped tiny Llama, and what a plain install (no extras) says on the way.

Every output is compared with an independent reference: `model.generate` on a prompt built by hand, PEFT's own
`PeftModel`, W + (alpha / r)·B·A from the saved adapter tensors, the demo's perplexity function, log_history."""

import contextlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed

import diff_transformer
from diff_transformer import cli
from diff_transformer.conversion import convert_to_diff
from tests.helpers import REPOSITORY
from tests.helpers.processes import run_json


REPO = REPOSITORY
ASSETS = Path(diff_transformer.__file__).parent / "assets"
TINY_LLAMA = ASSETS / "tiny-llama"
HELDOUT = (ASSETS / "heldout.txt").read_text(encoding="utf-8")
QUESTION = "Who is Mr. Darcy?"
SYSTEM = "You are a novelist."
# The adapter's training run (few steps, a large lr so that the adapter changes the model visibly).
LORA_RUN = ["--lora", "--max-steps", "3", "--block-size", "32", "--batch-size", "4", "--lr", "1e-2"]
LORA_RUN += ["--eval-fraction", "0", "--logging-steps", "1", "--save-steps", "2", "--quiet", "--bf16", "off"]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Terminal(io.StringIO):
    """A captured stderr that says it is a terminal (progress bars are drawn on terminals only)."""

    def isatty(self):
        return True


def run_cli(*argv, terminal=False):
    """`diff-transformer ARGV` in this process: (exit status, stdout, stderr); `terminal`: stderr is a terminal."""
    out, err = io.StringIO(), (Terminal() if terminal else io.StringIO())
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = cli.main([str(a) for a in argv])
    return status, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def journey(tmp_path_factory):
    """In one directory: `diff` (the tiny Llama converted to V2), `data.txt`, and `lora`: an adapter trained on
    `diff` named relatively, as a user in that directory would (so adapter_config.json says "diff")."""
    root = tmp_path_factory.mktemp("journey")
    convert_to_diff(TINY_LLAMA, root / "diff", progress=False)
    (root / "data.txt").write_text(HELDOUT[:3000], encoding="utf-8")
    here = os.getcwd()
    os.chdir(root)
    try:
        status, out, err = run_cli("train", "diff", "--data", "data.txt", "--output", "lora", *LORA_RUN)
    finally:
        os.chdir(here)
    assert status == 0, err
    return root, out


def peft_model(root):
    from peft import PeftModel

    from diff_transformer.checkpoints.adapters import quiet_peft_wrapping

    base = AutoModelForCausalLM.from_pretrained(root / "diff")
    with quiet_peft_wrapping():
        return PeftModel.from_pretrained(base, root / "lora").eval()


def greedy(model, ids, new_tokens, **kwargs):
    """What `generate` continues IDS (a list) with, greedily."""
    ids = torch.tensor([ids])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False, **kwargs
    )
    return out[0, ids.shape[1] :]


# --- a plain install: every command works, or names its extra in one line ------------------------------------------

PLAIN_INSTALL = """
import contextlib, io, json, sys

# A plain `pip install -e .`: none of the extras' packages. `None` in sys.modules makes `import x` fail and
# `importlib.util.find_spec(x)` answer None, as for a package that is not installed.
for name in ("peft", "tensorboard", "tensorboardX", "fastapi", "uvicorn", "openai", "matplotlib", "bitsandbytes"):
    sys.modules[name] = None
from diff_transformer import cli

results = {}
for key, argv in json.loads(sys.argv[1]).items():
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = cli.main(argv)
    results[key] = [status, out.getvalue(), err.getvalue()]
print(json.dumps(results))
"""


def test_plain_install_refuses_in_one_line_and_trains_without_tensorboard(journey, tmp_path):
    root, _ = journey
    model, adapter, data = str(root / "diff"), str(root / "lora"), str(root / "data.txt")
    small = ["--max-steps", "1", "--block-size", "32", "--eval-fraction", "0", "--quiet"]
    commands = {
        "lora": ["train", model, "--data", data, "--output", str(tmp_path / "a"), "--lora", *small],
        "tensorboard": ["train", model, "--data", data, "--output", str(tmp_path / "b"), "--report-to", "tensorboard"],
        "console": ["train", model, "--data", data, "--output", str(tmp_path / "run"), *small],
        "serve": ["serve", model],
        "generate": ["generate", adapter, "hello"],
        "merge": ["merge", adapter, str(tmp_path / "merged")],
        "inspect": ["inspect", model, "hello", "--out", str(tmp_path / "maps.png")],
    }
    result = subprocess.run(
        [sys.executable, "-c", PLAIN_INSTALL, json.dumps(commands)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        cwd=root,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads(result.stdout.strip().splitlines()[-1])
    expected = {
        "lora": ("--lora needs peft", "train"),
        "tensorboard": ("--report-to tensorboard needs tensorboard", "train"),
        "serve": ("diff-transformer serve needs fastapi, uvicorn and openai", "serve"),
        "generate": (f"MODEL {adapter} (a PEFT adapter) needs peft", "peft"),
        "merge": (f"ADAPTER {adapter} (a PEFT adapter) needs peft", "peft"),
        "inspect": ("plotting needs matplotlib", "analysis"),
    }
    for key, (what, extra) in expected.items():
        status, _, err = results[key]
        assert status == 2 and err.count("\n") == 1, (key, err)
        assert err.startswith(f"error: {what}, ") and f'pip install -e ".[{extra}]" in a source checkout' in err, err
        assert f'pip install "diff-transformer[{extra}]"' in err, err
    assert not any((tmp_path / name).exists() for name in ("a", "b", "merged", "maps.png"))

    status, out, err = results["console"]  # trains, logs to the console, says how to get TensorBoard
    assert status == 0, err
    assert (
        'TensorBoard logs are off: TensorBoard needs tensorboard, which is not installed: pip install -e ".[train]"'
        in out
    )
    assert "'loss'" in out and "done: 1 step," in out
    assert (tmp_path / "run" / "trainer_state.json").is_file() and not (tmp_path / "run" / "runs").exists()


# --- generate: --chat, --system, --seed, --dtype, --repetition-penalty; --version ---------------------------------


def test_generate_chat_is_the_template_prompt_continued(journey):
    root, _ = journey
    tokenizer = AutoTokenizer.from_pretrained(root / "diff")
    model = AutoModelForCausalLM.from_pretrained(root / "diff").eval()
    # The shipped template (chat_template.jinja), written out by hand: <s><|role|>\ncontent</s>\n ... <|assistant|>\n
    prompt = f"<s><|system|>\n{SYSTEM}</s>\n<|user|>\n{QUESTION}</s>\n<|assistant|>\n"
    ids = tokenizer(prompt, add_special_tokens=False).input_ids
    expected = tokenizer.decode(greedy(model, ids, 12), skip_special_tokens=True)
    status, out, err = run_cli(
        "generate", root / "diff", QUESTION, "--chat", "--system", SYSTEM, "--max-new-tokens", 12
    )
    assert status == 0, err
    assert out == expected + "\n" and len(expected.split()) > 3

    ids = tokenizer(f"<s><|user|>\n{QUESTION}</s>\n<|assistant|>\n", add_special_tokens=False).input_ids
    no_system = tokenizer.decode(greedy(model, ids, 12), skip_special_tokens=True)
    assert run_cli("generate", root / "diff", QUESTION, "--chat", "--max-new-tokens", 12)[1] == no_system + "\n"


def test_generate_chat_without_prompt_is_an_interactive_chat(refused, journey, monkeypatch):
    """Issue 32: every call reloaded the model. `generate MODEL --chat` without PROMPT reads messages from stdin and
    streams each answer with the model loaded once: the second answer is greedy `generate` on the template of the
    whole history, /reset starts over (the first answer again), and a history that would not leave --max-new-tokens
    of the context loses its oldest exchange; a message that alone does not fit is refused and the chat goes on."""
    root, _ = journey
    tokenizer = AutoTokenizer.from_pretrained(root / "diff")
    model = AutoModelForCausalLM.from_pretrained(root / "diff").eval()
    first = run_cli("generate", root / "diff", QUESTION, "--chat", "--max-new-tokens", 12)[1]
    follow = "And what of Elizabeth?"
    history = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": first.removesuffix("\n")},
        {"role": "user", "content": follow},
    ]
    ids = tokenizer.apply_chat_template(history, add_generation_prompt=True, return_dict=True)["input_ids"]
    second = tokenizer.decode(greedy(model, ids, 12), skip_special_tokens=True) + "\n"
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"{QUESTION}\n{follow}\n/reset\n\n{QUESTION}\n"))
    status, out, err = run_cli("generate", root / "diff", "--chat", "--max-new-tokens", 12)
    assert status == 0, err
    assert out == first + second + first and first != second
    assert err.count("> ") == 6 and "(history cleared)" in err and "/reset starts over" in err

    long = (
        "Elizabeth walked to Netherfield. " * 30
    ).strip()  # 248 tokens templated: one exchange fits in 512, two not
    alone = tokenizer.apply_chat_template(
        [{"role": "user", "content": long}], add_generation_prompt=True, return_dict=True
    )["input_ids"]
    expected = tokenizer.decode(greedy(model, alone, 100), skip_special_tokens=True) + "\n"
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"{long}\n{long}\n{long * 3}\n/exit\n{QUESTION}\n"))
    status, out, err = run_cli("generate", root / "diff", "--chat", "--max-new-tokens", 100)
    assert status == 0, err
    assert out == expected + expected  # the second answer saw only its own message: the first exchange was dropped
    assert err.count("(the oldest exchange was dropped to fit the model's context)") == 1
    assert "exceed the model's context (512 positions): send a shorter one." in err
    assert "Mr. Darcy" not in out  # /exit ended the chat before the last line
    refused(["generate", root / "diff"], "PROMPT is missing", "add --chat without PROMPT for an interactive chat")


class TypedInput(io.StringIO):
    """Lines typed at a terminal: it echoes each one, its Enter included (Ctrl-D echoes nothing)."""

    def isatty(self):
        return True


@pytest.mark.parametrize(
    ("stdin", "ending"),
    [
        (io.StringIO("/exit\n"), "> \n"),  # piped: nothing echoed the Enter
        (io.StringIO(""), "> \n"),  # end of input
        (TypedInput("/exit\n"), "> "),  # the terminal's echo ended the line
        (TypedInput(""), "> \n"),  # Ctrl-D at a terminal: nothing echoed
    ],
    ids=["piped-exit", "piped-eof", "typed-exit", "typed-ctrl-d"],
)
def test_interactive_chat_ends_its_prompt_line(journey, monkeypatch, stdin, ending):
    """Issue 45: /exit or end of input left the "> " prompt without a newline, so the shell's prompt followed it on
    the same line."""
    root, _ = journey
    monkeypatch.setattr(sys, "stdin", stdin)
    status, out, err = run_cli("generate", root / "diff", "--chat", "--max-new-tokens", 4)
    assert status == 0 and out == "", err
    assert err.endswith("Ctrl-D ends.\n" + ending), repr(err[-80:])


def test_generate_chat_refusals(refused, journey, tmp_path):
    root, _ = journey
    plain = tmp_path / "no-template"
    shutil.copytree(root / "diff", plain)
    (plain / "chat_template.jinja").unlink()
    refused(["generate", plain, QUESTION, "--chat"], "has no chat template", "drop --chat")
    refused(["generate", root / "diff", QUESTION, "--system", SYSTEM], "--system", "add --chat")
    refused(["generate", root / "diff", QUESTION, "--repetition-penalty", "0"], "--repetition-penalty 0.0", "> 0")
    refused(["generate", root / "diff", QUESTION, "--repetition-penalty", "nan"], "--repetition-penalty nan")
    refused(["generate", root / "diff", QUESTION, "--seed", "-1"], "--seed -1")


def test_generate_seed_dtype_and_repetition_penalty(journey):
    root, _ = journey
    tokenizer = AutoTokenizer.from_pretrained(root / "diff")
    ids = tokenizer("Elizabeth could not help smiling at").input_ids
    model = AutoModelForCausalLM.from_pretrained(root / "diff").eval()
    prompt = ["generate", root / "diff", "Elizabeth could not help smiling at", "--max-new-tokens", 16]

    def sampled(seed):
        set_seed(seed)
        tokens = torch.tensor([ids])
        out = model.generate(tokens, attention_mask=torch.ones_like(tokens), max_new_tokens=16, do_sample=True)
        return tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True) + "\n"

    first = run_cli(*prompt, "--temperature", 1, "--seed", 3)[1]
    assert first == sampled(3) == run_cli(*prompt, "--temperature", 1, "--seed", 3)[1]
    assert {run_cli(*prompt, "--temperature", 1, "--seed", seed)[1] for seed in (4, 5)} != {first}

    # The shipped generation_config.json has repetition_penalty=1.3: the option overrides it.
    assert model.generation_config.repetition_penalty == 1.3
    for penalty in (1.0, 2.0):
        expected = tokenizer.decode(greedy(model, ids, 16, repetition_penalty=penalty), skip_special_tokens=True)
        assert run_cli(*prompt, "--repetition-penalty", penalty)[1] == expected + "\n"
    assert run_cli(*prompt, "--repetition-penalty", 1.0)[1] != run_cli(*prompt)[1]

    bf16 = AutoModelForCausalLM.from_pretrained(root / "diff", dtype=torch.bfloat16).eval()
    expected = tokenizer.decode(greedy(bf16, ids, 16), skip_special_tokens=True)
    assert run_cli(*prompt, "--dtype", "bfloat16")[1] == expected + "\n"


def test_device_is_cuda_then_mps_then_cpu_and_checked(monkeypatch):
    """`resolve_device` (generate, inspect, merge; niah imports it) with availability monkeypatched."""
    from diff_transformer.cli.options import resolve_device
    from diff_transformer.errors import UserError

    def machine(cuda, mps, count=1):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count if cuda else 0)
        monkeypatch.setattr(torch.backends.mps, "is_available", lambda: mps)

    preferred = ((True, True, "cuda"), (True, False, "cuda"), (False, True, "mps"), (False, False, "cpu"))
    for cuda, mps, expected in preferred:
        machine(cuda, mps)
        assert resolve_device() == resolve_device("auto") == resolve_device(None) == expected
    machine(True, False, count=2)
    assert resolve_device("cuda:1") == "cuda:1" and resolve_device("CPU") == "cpu"
    for name, words in (
        ("cuda:2", "there are 2 CUDA device(s) here: use cuda:0 to cuda:1"),
        ("gpu", "'gpu' is not a device: use auto, cpu, cuda, cuda:N or mps"),
        ("mps", "torch sees no Apple MPS device here: use --device cpu"),
    ):
        with pytest.raises(UserError, match=re.escape(words)):
            resolve_device(name)
    machine(False, True)
    with pytest.raises(UserError, match=re.escape("torch sees no CUDA GPU here (torch.cuda.is_available() is False)")):
        resolve_device("cuda")


def test_generate_inspect_merge_take_device_dtype_and_stream(refused, journey, tmp_path, monkeypatch):
    """--device and --dtype on generate, inspect and merge (this machine: the CPU; a device torch does not see is
    refused in one line before anything loads), and generate --stream prints what the plain run prints."""
    from safetensors import safe_open

    from tests.helpers.tiny import tiny_model

    root, _ = journey
    monkeypatch.chdir(root)
    prompt = ["generate", "diff", "Elizabeth could not help smiling at", "--max-new-tokens", 16]
    plain = run_cli(*prompt)
    assert plain[0] == 0 and len(plain[1].split()) > 3, plain
    assert run_cli(*prompt, "--device", "cpu", "--dtype", "float32") == plain
    assert run_cli(*prompt, "--device", "auto", "--dtype", "auto") == plain  # auto here: no GPU in CI
    assert run_cli(*prompt, "--stream") == plain
    assert run_cli(*prompt, "--stream", "--chat")[1] == run_cli(*prompt, "--chat")[1]
    bf16 = run_cli(*prompt, "--dtype", "bfloat16", "--stream")
    assert bf16 == run_cli(*prompt, "--dtype", "bfloat16")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for command in (prompt, ["inspect", "diff", "Elizabeth", "--json", tmp_path / "x.json"], ["merge", "lora", "m"]):
        refused([*command, "--device", "cuda"], "--device cuda: torch sees no CUDA GPU here", "--device cpu")
    refused([*prompt, "--device", "tpu"], "--device 'tpu' is not a device")
    tiny_model(2).save_pretrained(tmp_path / "ids-only")
    refused(["generate", tmp_path / "ids-only", "5 6 7", "--stream"], "has no tokenizer: drop --stream")
    assert not (tmp_path / "x.json").exists() and not (root / "m").exists()

    text = "Elizabeth could not help smiling"
    for name, options in (("default", []), ("cpu", ["--device", "cpu", "--dtype", "float32"])):
        assert run_cli("inspect", "diff", text, "--json", tmp_path / f"{name}.json", *options)[0] == 0
    assert (tmp_path / "default.json").read_text() == (tmp_path / "cpu.json").read_text()

    status, _, err = run_cli("merge", "lora", tmp_path / "merged-bf16", "--device", "cpu", "--dtype", "bfloat16")
    assert status == 0, err
    with safe_open(tmp_path / "merged-bf16" / "model.safetensors", "pt") as merged:
        dtypes = {merged.get_tensor(key).dtype for key in merged.keys()}
    assert dtypes == {torch.bfloat16}
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "merged-bf16").dtype == torch.bfloat16


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"diff-transformer {diff_transformer.__version__}\n"
    setup = (REPO / "setup.cfg").read_text()
    assert "version = attr: diff_transformer._version.__version__" in setup  # one version for both


# --- adapters: generate, inspect, train further, merge, card --------------------------------------------------------


def test_generate_with_an_adapter_is_peft_on_its_base(refused, journey, monkeypatch):
    root, _ = journey
    tokenizer = AutoTokenizer.from_pretrained(root / "lora")
    prompt = f"<s><|user|>\n{QUESTION}</s>\n<|assistant|>\n"
    ids = tokenizer(prompt, add_special_tokens=False).input_ids
    tuned = tokenizer.decode(greedy(peft_model(root), ids, 12), skip_special_tokens=True)
    base = tokenizer.decode(greedy(AutoModelForCausalLM.from_pretrained(root / "diff"), ids, 12))
    assert tuned != base  # the adapter changes the answer, so the comparison below tells them apart

    # adapter_config.json names the base absolute (PEFT finds it from anywhere, test below); base_model.json records
    # it relative to the adapter and absolute, as given ("diff"), with its weights' fingerprint.
    config = json.loads((root / "lora" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str((root / "diff").resolve()) and config["revision"] is None
    record = json.loads((root / "lora" / "base_model.json").read_text())
    assert record["relative"] == "../diff" and record["absolute"] == str((root / "diff").resolve())
    assert record["named"] == "diff"
    assert record["fingerprint"]["parameters"] == AutoModelForCausalLM.from_pretrained(root / "diff").num_parameters()
    monkeypatch.chdir(root.parent)
    assert run_cli("generate", root / "lora", QUESTION, "--chat", "--max-new-tokens", 12)[1] == tuned + "\n"
    status, out, err = run_cli(
        "generate", root / "lora", QUESTION, "--chat", "--max-new-tokens", 12, "--base", root / "diff"
    )
    assert status == 0 and out == tuned + "\n", err
    monkeypatch.chdir(root)
    assert run_cli("generate", "lora", QUESTION, "--chat", "--max-new-tokens", 12)[1] == tuned + "\n"
    refused(["generate", "diff", QUESTION, "--base", "diff"], "--base diff is for a PEFT adapter", "drop --base")


PEFT_ELSEWHERE = """
import json, sys
import torch
import diff_transformer  # registers model_type "diff" with the Auto classes
from peft import AutoPeftModelForCausalLM

torch.set_num_threads(1)
model = AutoPeftModelForCausalLM.from_pretrained(sys.argv[1]).eval()
with torch.no_grad():
    logits = model(torch.tensor(json.loads(sys.argv[2]))).logits
print(json.dumps({"base": model.peft_config["default"].base_model_name_or_path, "logits": logits.tolist()}))
"""


@pytest.mark.slow  # end to end (a command, a training run): in the whole suite, not the quick loop
def test_peft_loads_the_adapter_from_another_directory(journey, tmp_path):
    """Issue 45: adapter_config.json kept the base as typed ("diff"), so PEFT's own AutoPeftModelForCausalLM, run
    anywhere but the training directory, looked "diff" up on the Hub and failed with a connection error. From an
    empty directory (a fresh interpreter) it now loads base + adapter; its logits are those of the package's load
    (`checkpoints.open`, what generate and merge use), and those of the adapter and not of the base alone."""
    from diff_transformer.checkpoints.opening import open_checkpoint

    root, _ = journey
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    ids = [AutoTokenizer.from_pretrained(root / "lora")(HELDOUT[:200]).input_ids]
    for adapter in (root / "lora", root / "lora" / "checkpoint-2"):  # a run's checkpoints are adapters too
        args = (adapter, json.dumps(ids))
        report = run_json(PEFT_ELSEWHERE, *args, env={}, block_diff_transformer=False, cwd=elsewhere)
        assert report["base"] == str((root / "diff").resolve())
        with torch.no_grad():
            ours = open_checkpoint(adapter).load().eval()(torch.tensor(ids)).logits
        assert torch.equal(torch.tensor(report["logits"]), ours), adapter
    base = AutoModelForCausalLM.from_pretrained(root / "diff")
    with torch.no_grad():
        assert not torch.allclose(base(torch.tensor(ids)).logits, ours)  # the adapter is on


def test_an_adapter_s_base_resolves_from_anywhere_and_other_weights_are_refused(
    refused, journey, tmp_path, monkeypatch
):
    """Issue 32: an adapter recorded its base as typed ("diff") and generate/merge looked it up in the current
    directory, so from a directory holding another "diff" they silently used the wrong base. Now base_model.json
    finds the trained-on base (relative to the adapter, else absolute), and a base whose weights differ from the
    recorded fingerprint is refused in one line."""
    from safetensors.torch import save_file

    root, _ = journey
    chat = [QUESTION, "--chat", "--max-new-tokens", 12]
    monkeypatch.chdir(root)
    tuned = run_cli("generate", "lora", *chat)[1]
    elsewhere = tmp_path / "elsewhere"
    convert_to_diff(TINY_LLAMA, elsewhere / "diff", diff_version=1, progress=False)  # another "diff": other shapes
    monkeypatch.chdir(elsewhere)
    assert run_cli("generate", root / "lora", *chat)[1] == tuned  # the base it was trained on, not ./diff
    refused(
        ["generate", root / "lora", *chat, "--base", "diff"],
        f"MODEL {root / 'lora'} was trained on another base than diff",
        "where the adapter's base had",
        "pass --base with the model it was trained on",
    )

    # moved together (the recorded absolute path made stale): found relative to the adapter
    moved = tmp_path / "moved"
    shutil.copytree(root / "diff", moved / "diff")
    shutil.copytree(root / "lora", moved / "lora")
    record = json.loads((moved / "lora" / "base_model.json").read_text())
    record["absolute"] = str(tmp_path / "gone")
    (moved / "lora" / "base_model.json").write_text(json.dumps(record))
    assert run_cli("generate", moved / "lora", *chat)[1] == tuned
    # the same shapes, other weights (one tensor changed): refused
    weights = load_file(moved / "diff" / "model.safetensors")
    name = sorted(weights)[-1]
    weights[name] = weights[name] + 0.01
    save_file(weights, moved / "diff" / "model.safetensors", metadata={"format": "pt"})
    refused(["merge", moved / "lora", tmp_path / "out"], "was trained on another base than", "other weights: sha256")
    shutil.rmtree(moved / "diff")
    refused(["generate", moved / "lora", *chat], "whose base model is not where it was", "--base PATH")
    assert not (tmp_path / "out").exists()


def test_merge_writes_a_full_checkpoint_equal_to_base_plus_adapter(journey, tmp_path, monkeypatch):
    root, _ = journey
    monkeypatch.chdir(root)
    status, out, err = run_cli("merge", "lora", tmp_path / "merged")
    assert status == 0 and out == f"wrote {tmp_path / 'merged'}\n", err
    merged_dir = tmp_path / "merged"
    for name in ("config.json", "model.safetensors", "configuration_diff.py", "modeling_diff.py"):
        assert (merged_dir / name).is_file(), name
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (merged_dir / name).read_bytes() == (root / "lora" / name).read_bytes(), name
    card = (merged_dir / "README.md").read_text()
    assert card.startswith("---") and "# merged" in card and "The LoRA adapter `lora` merged into `diff`" in card

    # Weights: W + (alpha / r)·B·A for every adapted matrix, computed here from the saved tensors (bit for bit: the
    # same fp32 product and sum PEFT's merge computes); λ is the adapter's trained copy; everything else is the base.
    lora_config = json.loads((root / "lora" / "adapter_config.json").read_text())
    scale = lora_config["lora_alpha"] / lora_config["r"]
    adapter = {
        k.removeprefix("base_model.model."): v
        for k, v in load_file(root / "lora" / "adapter_model.safetensors").items()
    }
    base, merged = load_file(root / "diff" / "model.safetensors"), load_file(merged_dir / "model.safetensors")
    assert merged.keys() == base.keys()
    adapted = 0
    for key, weight in base.items():
        module = key.removesuffix(".weight")
        if f"{module}.lora_A.weight" in adapter:
            expected = weight + (adapter[f"{module}.lora_B.weight"] @ adapter[f"{module}.lora_A.weight"]) * scale
            adapted += 1
        elif ".diff_lambda." in key:
            expected = adapter[key]  # PEFT saves the trained copy under the original name
        else:
            expected = weight
        assert torch.equal(merged[key], expected), key
    assert adapted == 2 * 4  # q_proj and v_proj (PEFT's Llama defaults) in 4 layers

    # Logits: the merged model against base + adapter unmerged. The adapter path computes x·Wᵀ + s·(x·Aᵀ)·Bᵀ, the
    # merged one x·(W + s·B·A)ᵀ: equal in exact arithmetic, within fp32 rounding here (|logits| ~ 10, eps 1.2e-7).
    ids = torch.tensor([tokenizer_ids(root)])
    with torch.no_grad():
        reference = peft_model(root)(ids).logits
        logits = AutoModelForCausalLM.from_pretrained(merged_dir).eval()(ids).logits
    assert (logits - reference).abs().max().item() < 1e-4
    assert torch.equal(logits.argmax(-1), reference.argmax(-1))


def tokenizer_ids(root):
    return AutoTokenizer.from_pretrained(root / "diff")(HELDOUT[:400]).input_ids


def test_merge_refusals_leave_nothing(refused, journey, tmp_path, monkeypatch):
    root, _ = journey
    monkeypatch.chdir(root)
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "mine.txt").write_text("mine")
    refused(["merge", "lora", tmp_path / "taken"], "is not empty", "--overwrite")
    assert [p.name for p in (tmp_path / "taken").iterdir()] == ["mine.txt"]
    refused(["merge", "diff", tmp_path / "out"], "ADAPTER diff is a model, not a PEFT adapter directory")
    refused(["convert", "lora", tmp_path / "out"], "is a PEFT adapter, not a model", "diff-transformer merge")
    refused(["merge", "lora", "lora/inside"], "overlaps ADAPTER")
    # an adapter without base_model.json (PEFT's own, or older runs', which named the base as typed): its base as
    # named, from the current directory
    shutil.copytree(root / "lora", tmp_path / "legacy", ignore=shutil.ignore_patterns("base_model.json"))
    config = json.loads((tmp_path / "legacy" / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = "diff"
    (tmp_path / "legacy" / "adapter_config.json").write_text(json.dumps(config))
    monkeypatch.chdir(tmp_path)
    refused(["merge", tmp_path / "legacy", tmp_path / "out"], "'diff'", "--base PATH")
    assert not (tmp_path / "out").exists()


def test_inspect_an_adapter_shows_the_merged_model(journey, tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    root, _ = journey
    monkeypatch.chdir(root)
    assert run_cli("merge", "lora", tmp_path / "merged")[0] == 0
    text = "Elizabeth could not help smiling"
    for name, model in (("adapter", "lora"), ("merged", tmp_path / "merged")):
        status, _, err = run_cli(
            "inspect", model, text, "--out", tmp_path / f"{name}.png", "--json", tmp_path / f"{name}.json"
        )
        assert status == 0, err
    adapter, merged = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("adapter", "merged"))
    assert adapter["tokens"] == merged["tokens"]
    difference = torch.tensor(adapter["differential"]) - torch.tensor(merged["differential"])
    assert difference.abs().max().item() < 1e-5
    # and not the base's maps: the adapter trained λ
    assert run_cli("inspect", "diff", text, "--out", tmp_path / "base.png", "--json", tmp_path / "base.json")[0] == 0
    base = json.loads((tmp_path / "base.json").read_text())
    assert torch.tensor(base["lambda"]).ne(torch.tensor(adapter["lambda"])).any()


def test_adapter_card_names_the_base_as_given_with_lambda_and_lora_settings(journey):
    from huggingface_hub import ModelCard

    from diff_transformer.checkpoints.adapters import adapter_card

    root, _ = journey
    card = ModelCard.load(root / "lora" / "README.md")
    assert "More Information Needed" not in card.text  # not PEFT's blank template
    assert card.data.library_name == "peft" and {"lora", "diff-transformer-v2"} <= set(card.data.tags)
    assert card.data.base_model is None  # a local directory is no Hub id
    assert "for the differential-attention model `diff`" in card.text and str(root) not in card.text
    config = json.loads((root / "lora" / "adapter_config.json").read_text())
    for row in (f"| LoRA rank r | {config['r']} |", f"| lora_alpha | {config['lora_alpha']} |", "`q_proj`, `v_proj`"):
        assert row in card.text, row
    assert "λ = sigmoid(W_λ x)" in card.text and "trained in full and saved with the adapter" in card.text
    # The λ summary is that of the run's last log (log_history), mean/min/max over the layers.
    last = [e for e in json.loads((root / "lora" / "trainer_state.json").read_text())["log_history"] if "loss" in e][
        -1
    ]
    layers = [v for k, v in last.items() if k.startswith("lambda/layer_")]
    summary = " / ".join(f"{v:.4g}" for v in (sum(layers) / len(layers), min(layers), max(layers)))
    assert f"(mean / min / max over layers): {summary}." in card.text

    checkpoint = ModelCard.load(root / "lora" / "checkpoint-2" / "README.md")  # every checkpoint is an adapter too
    assert "# checkpoint-2" in checkpoint.text and "| LoRA rank r | 8 |" in checkpoint.text

    hub = adapter_card("hf://org/tiny-diff", AutoModelForCausalLM.from_pretrained(root / "diff").config, config, "x")
    assert hub.data.base_model == "org/tiny-diff"


def test_train_an_adapter_further(refused, journey, tmp_path, monkeypatch):
    root, _ = journey
    monkeypatch.chdir(root)
    before = load_file(root / "lora" / "adapter_model.safetensors")
    # lr 0: the run starts from the adapter's weights (a fresh LoRA would start from B = 0) and keeps them.
    run = [
        "train",
        "lora",
        "--data",
        "data.txt",
        "--output",
        tmp_path / "more",
        *LORA_RUN,
        "--lr",
        "0",
        "--max-steps",
        1,
    ]
    status, out, err = run_cli(*run)
    assert status == 0, err
    after = load_file(tmp_path / "more" / "adapter_model.safetensors")
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    assert any(k.endswith("lora_B.weight") and v.abs().max() > 0 for k, v in after.items())
    # trained further: the base is where lora's record found it, named in the card as lora's run named it
    assert json.loads((tmp_path / "more" / "base_model.json").read_text())["absolute"] == str(
        (root / "diff").resolve()
    )
    assert "for the differential-attention model `diff`" in (tmp_path / "more" / "README.md").read_text()
    refused([*run[:5], tmp_path / "other", "--lora-r", "4"], "--lora-r 4", "LoRA adapter with r=8", "drop the option")


def test_resume_summary_counts_only_this_runs_steps(journey, tmp_path, monkeypatch):
    root, _ = journey
    monkeypatch.chdir(root)
    run = ["train", "diff", "--data", "data.txt", "--output", tmp_path / "run", *LORA_RUN]
    assert run_cli(*run)[0] == 0
    shutil.rmtree(tmp_path / "run" / "checkpoint-3")
    status, out, err = run_cli(*run, "--resume")
    assert status == 0, err
    losses = [
        e["loss"]
        for e in json.loads((tmp_path / "run" / "trainer_state.json").read_text())["log_history"]
        if "loss" in e
    ]
    assert f"done: 1 step (step 3, resumed), mean training loss of this run {losses[-1]:.4f}" in out


def test_console_shows_one_lambda_summary_and_the_logs_keep_every_layer(journey):
    root, out = journey  # the fixture's run: --quiet, so Trainer's printer wrote each log as a line
    logs = [e for e in json.loads((root / "lora" / "trainer_state.json").read_text())["log_history"] if "loss" in e]
    printed = [line for line in out.splitlines() if line.startswith("{'loss'")]
    assert len(printed) == len(logs) == 3
    for line, entry in zip(printed, logs):
        layers = [entry[f"lambda/layer_{i:02d}"] for i in range(4)]
        assert all(f"lambda_std/layer_{i:02d}" in entry for i in range(4))
        assert "lambda/" not in line and "lambda_std" not in line
        assert f"'loss': '{entry['loss']:.4g}'" in line and "'grad_norm'" in line and "'learning_rate'" in line
        summary = " / ".join(f"{v:.4g}" for v in (sum(layers) / len(layers), min(layers), max(layers)))
        assert f"'lambda mean/min/max': '{summary}'" in line
        negative = sum(value < 0 for value in layers)  # the sign: layers that add their second map
        assert entry["lambda_negative_layers"] == negative and f"'layers with lambda < 0': '{negative} of 4'" in line


def test_lora_runs_show_no_upstream_deprecation_warning(journey, tmp_path, monkeypatch):
    root, _ = journey
    monkeypatch.chdir(root)

    def upstream(caught):
        return [w for w in caught if issubclass(w.category, FutureWarning) and "checkpointing" in str(w.message)]

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        status = run_cli(
            "train", "diff", "--data", "data.txt", "--output", tmp_path / "run", *LORA_RUN, "--max-steps", 1
        )
    assert status[0] == 0 and not upstream(caught)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        status = run_cli("generate", "lora", QUESTION, "--max-new-tokens", 2)
    assert status[0] == 0 and not upstream(caught)


# --- convert: progress, timing, held-out perplexity ----------------------------------------------------------------


def test_convert_verify_is_timed_and_reports_held_out_perplexity(tmp_path):
    from diff_transformer.cli.demo import heldout_perplexity

    status, out, err = run_cli("convert", TINY_LLAMA, tmp_path / "diff", "--verify", terminal=True)
    assert status == 0, err
    assert "llama -> diff v2: 100%" in err and "38/38" in err  # the conversion's bar (tensors)
    assert re.search(r"greedy continuations match: True  \(\d+\.\d s\)", out), out
    match = re.search(
        r"held-out perplexity on the shipped held-out Austen text \(4,080 tokens, 16 windows of 256\), as the demo "
        r"scores it: source (\S+), converted (\S+)",
        out,
    )
    assert match, out
    tokenizer = AutoTokenizer.from_pretrained(TINY_LLAMA)
    source = AutoModelForCausalLM.from_pretrained(TINY_LLAMA).eval()
    expected = heldout_perplexity(source, tokenizer, HELDOUT, max_tokens=4080)
    assert float(match.group(1)) == float(match.group(2)) == float(f"{expected:.4f}")
    # The perplexity's bars (over 16 windows each; tqdm redraws at most every 0.1 s, and leave=False clears them, so
    # a fast run may show only their first frame).
    assert re.search(r"source: +\d+%\|.*\| \d+/16 ", err) and re.search(r"converted: +\d+%\|.*\| \d+/16 ", err), err
    quiet = run_cli("convert", TINY_LLAMA, tmp_path / "quiet", "--verify", "--quiet", terminal=True)
    assert quiet[0] == 0 and "tensor/s" not in quiet[2] and "window/s" not in quiet[2]
    piped = run_cli("convert", TINY_LLAMA, tmp_path / "piped", "--verify")  # not a terminal: no bars either
    assert piped[0] == 0 and "held-out perplexity" in piped[1] and "%|" not in piped[2], piped


# --- packaging ------------------------------------------------------------------------------------------------------


def journey_block(text: str) -> str:
    return text.split("<!-- journey -->", 1)[1].split("<!-- /journey -->", 1)[0].strip()


def test_long_description_has_no_relative_links_and_the_readmes_journey():
    setup = (REPO / "setup.cfg").read_text()
    name = re.search(r"^long_description = file: (\S+)$", setup, re.M).group(1)
    description = (REPO / name).read_text()
    links = re.findall(r"\]\(([^)]+)\)", description) + re.findall(r'src="([^"]+)"', description)
    assert links and all(link.startswith("https://") for link in links), links
    assert journey_block(description) == journey_block((REPO / "README.md").read_text())
    manifest = (REPO / "MANIFEST.in").read_text().splitlines()
    assert f"include {name}" in manifest and "include constraints.txt" in manifest


def test_model_card_links_no_package_index_page():
    from diff_transformer.integrations.hub import diff_model_card
    from tests.helpers.tiny import tiny_config

    card = diff_model_card(tiny_config(2), "x").text
    assert "pypi.org" not in card and "pip install diff-transformer" not in card
    assert "`pip install -e .`" in card


@pytest.mark.slow  # builds an sdist and collects its test suite in a fresh interpreter (~30 s)
def test_sdist_holds_what_its_tests_need(tmp_path):
    ignore = shutil.ignore_patterns(".git", ".venv*", "*.egg-info", "__pycache__", "build", "dist", ".pytest_cache")
    tree = tmp_path / "tree"
    shutil.copytree(REPO, tree, ignore=ignore)
    build = "from setuptools import build_meta; import sys; print(build_meta.build_sdist(sys.argv[1]))"
    result = subprocess.run(
        [sys.executable, "-c", build, str(tmp_path / "dist")], cwd=tree, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    name = result.stdout.strip().splitlines()[-1]
    with tarfile.open(tmp_path / "dist" / name) as sdist:
        sdist.extractall(tmp_path / "unpacked", filter="data")
    unpacked = next((tmp_path / "unpacked").iterdir())
    for path in ("constraints.txt", "tests/conftest.py", "tests/helpers/reference.py", "tests/helpers/hub_server.py",
                 "tests/helpers/processes.py", "tests/distributed/dist_common.py", "tests/evaluation/lm_eval_tasks",
                 "benchmarks/bench_gpu.py", "experiments/multi_needle/multi_needle.py", "data/heldout.txt",
                 "src/diff_transformer/assets/tiny-llama/model.safetensors"):  # fmt: skip
        assert (unpacked / path).exists(), path
    assert not list(unpacked.rglob("__pycache__")) and not list(unpacked.rglob(".venv*"))
    collect = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
        cwd=unpacked,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(unpacked / "src")},
    )
    assert collect.returncode == 0 and "error" not in collect.stdout.splitlines()[-1], collect.stdout[-3000:]


# --- the whole journey, as a user types it ---------------------------------------------------------------------------


@pytest.mark.slow  # six commands in fresh interpreters, then a server start (~2 min on 2 cores)
def test_the_journey_end_to_end(tmp_path):
    """convert -> generate --chat -> train --lora -> generate with the adapter -> merge -> serve answers a chat
    request with the merged model: each step the console command, as the README's journey block runs it."""
    from tests.helpers.server import Server

    (tmp_path / "data.txt").write_text(HELDOUT[:6000], encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")

    def command(*argv):
        result = subprocess.run(
            [sys.executable, "-m", "diff_transformer.cli", *map(str, argv)],
            capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
        return result.stdout

    assert "greedy continuations match: True" in command("convert", TINY_LLAMA, "tiny-diff", "--verify", "--quiet")
    chat = command("generate", "tiny-diff", QUESTION, "--chat", "--system", SYSTEM, "--max-new-tokens", 16)
    assert len(chat.split()) > 3
    trained = command("train", "tiny-diff", "--data", "data.txt", "--output", "tiny-lora", "--lora", "--max-steps", 4,
                      "--block-size", 64, "--lr", "1e-2", "--eval-fraction", "0", "--quiet")  # fmt: skip
    assert "done: 4 steps" in trained and "lambda mean/min/max" in trained
    with_adapter = command("generate", "tiny-lora", QUESTION, "--chat", "--max-new-tokens", 16)
    assert "wrote" in command("merge", "tiny-lora", "tiny-merged")
    merged = command("generate", "tiny-merged", QUESTION, "--chat", "--max-new-tokens", 16)
    assert merged == with_adapter  # greedy tokens of base + adapter and of the merged model agree

    server = Server(tmp_path / "serve.log")
    try:
        server.wait_healthy()
        model = str(tmp_path / "tiny-merged")
        response = server.client().chat.completions.create(
            model=model, messages=[{"role": "user", "content": QUESTION}], max_tokens=16, temperature=0
        )
    finally:
        server.stop()
    # The server runs greedy `generate` with the model's generation config, as `generate --chat` does.
    assert response.choices[0].message.content + "\n" == merged
