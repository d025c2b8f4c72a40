"""Every command's options and a checkpoint's config fields, driven with any value (Hypothesis): huge, negative,
NaN, infinite, empty, non-numeric, shell and markup metacharacters, control characters, wrong JSON types. Whatever
the value, a command ends with exit 0 (it was a valid value), or exit 2 and one error line (argparse's own refusals
print their usage first), never a traceback; and nothing outside its working directory changes.

Also: any chat template (hostile ones and random text) ends every command that renders one the same way, a symbolic
or hard link planted at any name `train`, `convert` or `merge` writes in OUT is never written through, and any value
of any field that the package reads from a metadata file (adapter_config.json, base_model.json, a Motif or Llama
config.json, a Diff V1 config.json, generation_config.json) ends the same way, with no NaN logits or weights behind
an exit 0.

The default profile keeps CI short; `pytest tests/cli/test_option_values.py --hypothesis-profile long` runs the long
search (profiles in tests/conftest.py)."""

import hashlib
import json
import os
from pathlib import Path

import pytest


hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from diff_transformer import cli  # noqa: E402


SPECIAL = [
    "-1", "0", "-0", "1", "nan", "NaN", "inf", "-inf", "1e309", "-1e309", "1e-320", "99999999999999999999999",
    str(2**64), str(2**63), "1.5", "0x10", " 3", "", " ", "abc", "$(touch PWNED)", "`id`", "; rm -rf ~", "../..",
    "/", "~", "{{ 7*7 }}", "<script>", "$x$", "%s%n", "\x1b[31m", "\u202e", "😀", "a\nb", "None", "null", "[]",
]  # fmt: skip
VALUES = st.one_of(st.sampled_from(SPECIAL), st.text(min_size=0, max_size=12), st.integers().map(str))

# command -> (arguments before the fuzzed option, options to fuzz). MODEL is the saved tiny V2 model; each base is
# cheap when every value is valid (one step, a few tokens).
COMMANDS = {
    "generate": (
        ["generate", "{model}", "5 6 7", "--max-new-tokens", "2"],
        ["--max-new-tokens", "--temperature", "--repetition-penalty", "--seed", "--top-p", "--top-k", "--system"]
        + ["--attn-implementation"],
    ),
    "inspect": (
        ["inspect", "{model}", "5 6 7 8", "--json", "out/maps.json"],
        ["--layer", "--head", "--span", "--dpi", "--max-memory-gb", "--metric", "--attn-implementation"],
    ),
    "niah": (
        ["niah", "{model}", "--out", "out/niah", "--lengths", "4", "--depths", "0", "--needles", "1"],
        [
            "--lengths",
            "--depths",
            "--needles",
            "--seed",
            "--batch-size",
            "--max-new-tokens",
            "--device",
            "--dtype",
            "--backend",
            "--haystack",
            "--attn-implementation",
        ],
    ),
    "train": (
        [
            "train",
            "{model}",
            "--data",
            "{data}",
            "--output",
            "out/run",
            "--max-steps",
            "1",
            "--block-size",
            "8",
            "--report-to",
            "none",
            "--quiet",
        ],  # fmt: skip
        [
            "--block-size",
            "--lr",
            "--warmup-steps",
            "--warmup-ratio",
            "--weight-decay",
            "--max-grad-norm",
            "--batch-size",
            "--grad-accum",
            "--seed",
            "--eval-fraction",
            "--lora-r",
            "--lora-alpha",
            "--lora-dropout",
            "--save-total-limit",
            "--logging-steps",
            "--text-field",
            "--attn-implementation",
            "--compile-backend",
        ],  # fmt: skip
    ),
    "plan": (
        ["plan", "{model}", "--quiet"],
        ["--nodes", "--gpus-per-node", "--micro-batch", "--seq-len", "--gpu-memory", "--attn-implementation"],
    ),
    "train-chat": (  # the shipped tiny Llama: it has a tokenizer and a chat template
        ["train", "{source}", "--any-model", "--chat-data", "{chat}", "--output", "out/run", "--max-steps", "1"]
        + ["--block-size", "64", "--report-to", "none", "--quiet"],
        ["--chat-data", "--block-size", "--eval-fraction", "--eval-data"],
    ),
    "convert": (["convert", "{source}", "out/converted", "--quiet"], ["--diff-version", "--dtype", "--v1-layout"]),
    "demo": (["demo", "--scratch", "--output", "out/demo"], ["--seed", "--prompt"]),
}
BASE_SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def digest(root: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        h.update(str(path.relative_to(root)).encode())
        if path.is_file():
            h.update(path.read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """The user's files the commands read: a tiny V2 model (token ids, no tokenizer), a text, a tiny Llama source."""
    from tests.helpers.tiny import tiny_model

    root = tmp_path_factory.mktemp("user")
    tiny_model(2).save_pretrained(root / "model")
    (root / "data.txt").write_text("5 6 7 8 9 10 11 12 " * 40)
    source = Path(__file__).parents[2] / "src" / "diff_transformer" / "assets" / "tiny-llama"
    chat = '{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}\n'
    (root / "chat.jsonl").write_text(chat * 8)
    files = {"model": root / "model", "data": root / "data.txt", "source": source, "chat": root / "chat.jsonl"}
    return {name: str(path) for name, path in files.items()} | {"root": root}


def run_once(argv, tmp_path_factory, inputs, capsys):
    work = tmp_path_factory.mktemp("work")
    before = digest(inputs["root"])
    cwd = os.getcwd()
    os.chdir(work)
    capsys.readouterr()
    try:
        try:
            status = cli.main(argv)
        except SystemExit as exit_:  # argparse: usage, then one "error:" line
            status = exit_.code
        err = capsys.readouterr().err
    finally:
        os.chdir(cwd)
    lines = [line for line in err.splitlines() if line.strip()]
    assert status in (0, 2), (argv, status, err[-2000:])
    assert not any("Traceback" in line for line in lines), (argv, err[-2000:])
    if status == 2:
        errors = [line for line in lines if "error:" in line]
        assert len(errors) == 1 and errors[0] == lines[-1], (argv, err[-2000:])
    assert digest(inputs["root"]) == before, argv  # the user's files are never touched
    assert not (Path(cwd) / "PWNED").exists() and not (work / "PWNED").exists()
    return status, lines[-1] if lines else ""


@pytest.mark.parametrize("command", list(COMMANDS))
def test_any_option_value_ends_in_a_result_or_one_line(command, inputs, tmp_path_factory, capsys):
    base, options = COMMANDS[command]
    base = [part.format(**inputs) for part in base]

    @settings(**BASE_SETTINGS)
    @given(option=st.sampled_from(options), value=VALUES)
    def check(option, value):
        argv = [*base, option, value] if value[:1] != "-" else [*base, f"{option}={value}"]
        run_once(argv, tmp_path_factory, inputs, capsys)

    check()


SERVE_COUNTS = ["--max-new-tokens-limit", "--max-queued-requests", "--max-loaded-models"]


@settings(**BASE_SETTINGS)
@given(option=st.sampled_from(SERVE_COUNTS), value=VALUES | st.sampled_from(["²", "٣", "1" * 5000]))
def test_any_value_of_serve_s_own_options_is_a_count_or_one_line(option, value):
    """serve's own options (read before transformers' server starts, so parsed here without starting one): any value
    is a whole number >= 1 kept as such, or one `UserError` line; never another exception."""
    from diff_transformer.cli.serve import _own_options
    from diff_transformer.errors import UserError

    try:
        _, counts, _, _ = _own_options([f"{option}={value}"])
    except UserError as error:
        assert "\n" not in str(error) and option in str(error), error
        return
    key = option.removeprefix("--").replace("-", "_")
    assert counts["limit" if key == "max_new_tokens_limit" else key] == int(value) >= 1


CONFIG_VALUES = st.one_of(
    st.sampled_from([None, True, -1, 0, 2**64, 1e-300, 1e308, "8", "", [], {}, [1, 2], {"a": 1}]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(min_value=-(2**70), max_value=2**70),
)
CONFIG_FIELDS = [
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "vocab_size", "max_position_embeddings", "rms_norm_eps", "rope_parameters", "lambda_init",
    "lambda_std", "lambda_floor", "attention_dropout", "hidden_act", "pad_token_id", "eos_token_id", "diff_version",
    "tie_word_embeddings", "initializer_range", "torch_dtype", "architectures", "map_first_inference",
]  # fmt: skip


def test_any_config_field_value_ends_in_a_result_or_one_line(inputs, tmp_path_factory, capsys):
    """A hand-edited config.json of the user's model, read by `generate`."""
    import shutil

    @settings(**BASE_SETTINGS)
    @given(field=st.sampled_from(CONFIG_FIELDS), value=CONFIG_VALUES)
    def check(field, value):
        model = tmp_path_factory.mktemp("edited") / "model"
        shutil.copytree(inputs["model"], model)
        config = json.loads((model / "config.json").read_text())
        config[field] = value
        (model / "config.json").write_text(json.dumps(config))
        run_once(["generate", str(model), "5 6 7", "--max-new-tokens", "2"], tmp_path_factory, inputs, capsys)

    check()


MESSAGE_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=8), st.sampled_from(SPECIAL)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)),
    max_leaves=6,
)
MESSAGES = st.lists(
    st.fixed_dictionaries(
        {"role": st.one_of(st.sampled_from(["system", "user", "assistant"]), MESSAGE_VALUES)},
        optional={"content": st.one_of(st.text(max_size=20), MESSAGE_VALUES)},
    ),
    max_size=4,
)


def test_any_chat_data_ends_in_a_result_or_one_line(inputs, tmp_path_factory, capsys):
    """`train --chat-data` on hostile conversations: wrong JSON types, roles, contents, empty or no messages."""
    base = COMMANDS["train-chat"][0]

    @settings(**BASE_SETTINGS)
    @given(lines=st.lists(st.one_of(MESSAGES.map(lambda m: {"messages": m}), MESSAGE_VALUES), min_size=1, max_size=3))
    def check(lines):
        chat = tmp_path_factory.mktemp("chat") / "chat.jsonl"
        chat.write_text("".join(json.dumps(line) + "\n" for line in lines))
        argv = [part.format(**inputs | {"chat": str(chat)}) for part in base]
        run_once(argv, tmp_path_factory, inputs, capsys)

    check()


# Chat templates a model may come with: past a bound, raising, broken, or writing the messages other than once.
HOSTILE_TEMPLATES = [
    "{% for a in range(10**5) %}{% for b in range(10**5) %}{% endfor %}{% endfor %}",
    "{{ 'x' * 10**10 }}",
    "{{ range(10**6)|list }}",
    "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "{{ raise_exception('no') }}",
    "{{ messages[0]['nothing'].strip() }}",
    "{{ 1 / 0 }}",
    "{{ messages[0]['content'] }}{{ messages[0]['content'] }}",
    "{% for m in messages %}{{ m['content'][:3] }}{% endfor %}",
    "{{ messages|length }}{% for m in messages %}{{ m['content'] }}{% endfor %}",
    "{% for m in messages %}",
    "",
    # one C call building gigabytes while holding the GIL (issue 56 item 2): stopped by the forked render's bounds
    "{{ [[0] * 4000000] * 4000000 }}",
    "{{ {'a': ['x'] * 100000} | tojson(indent=4000) }}",
    "{{ ('x\\n' * 1000000) | indent(4000) }}",
    "{{ ('x ' * 1000000) | wordwrap(1, wrapstring='y' * 4000) }}",
]
TEMPLATE_COMMANDS = {  # the shipped tiny Llama with the template, as {model}
    "train-chat": ["train", "{model}", "--any-model", "--chat-data", "{chat}", "--output", "out/run"]
    + ["--max-steps", "1", "--block-size", "64", "--report-to", "none", "--quiet"],
    "niah": ["niah", "{model}", "--out", "out/niah", "--lengths", "96", "--depths", "0", "--needles", "1"]
    + ["--no-figure", "--max-new-tokens", "1", "--quiet"],
    "generate-chat": ["generate", "{model}", "Hi", "--chat", "--max-new-tokens", "1"],
}


@pytest.mark.parametrize("command", list(TEMPLATE_COMMANDS))
def test_any_chat_template_ends_in_a_result_or_one_line(command, inputs, tmp_path_factory, capsys):
    """Issue 46: every command renders through the one bounded renderer, so a hostile template (or random text as
    one) ends each of them in a result or one line, within the render bounds."""
    import shutil

    @settings(**BASE_SETTINGS)
    @given(template=st.one_of(st.sampled_from(HOSTILE_TEMPLATES), st.text(st.characters(exclude_categories=["Cs"]))))
    def check(template):
        model = tmp_path_factory.mktemp("templated") / "model"
        shutil.copytree(inputs["source"], model)
        (model / "chat_template.jinja").write_text(template, encoding="utf-8")
        argv = [part.format(**inputs | {"model": str(model)}) for part in TEMPLATE_COMMANDS[command]]
        run_once(argv, tmp_path_factory, inputs, capsys)

    check()


@pytest.mark.parametrize("name", ["x\ny", "x\x85y", "x\u2028y", "x\ry"])
def test_a_line_break_in_a_refused_name_stays_on_the_one_line(name, inputs, tmp_path_factory, capsys):
    """Found by the long profile: a data file named with U+0085 made `train --chat-data`'s refusal two lines; the
    CLI's boundary now escapes every line break of a refusal (whoever wrote the message)."""
    for option in ("--chat-data", "--eval-data"):
        argv = [part.format(**inputs) for part in COMMANDS["train-chat"][0]] + [option, name]
        run_once(argv, tmp_path_factory, inputs, capsys)
    run_once(["train", inputs["model"], "--data", name, "--output", "out/run"], tmp_path_factory, inputs, capsys)


# ---- links planted in OUT (tests/outputs/test_links.py lists the names each command writes) ----


@pytest.fixture(scope="module")
def adapter(inputs):
    """A LoRA adapter on the user's model (PEFT's save, and the base record `train --lora` writes), with a random B
    so that a merge changes the weights."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from diff_transformer.checkpoints.adapters import record_base

    path = inputs["root"] / "adapter"
    model = AutoModelForCausalLM.from_pretrained(inputs["model"])
    peft_model = get_peft_model(model, LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.02)
    peft_model.save_pretrained(path)
    record_base(path, Path(inputs["model"]))
    return path


def _links():
    from tests.outputs.test_links import CONVERT_FILES, MERGE_FILES, TRAIN_DIRECTORIES, TRAIN_FILES

    return TRAIN_FILES, TRAIN_DIRECTORIES, CONVERT_FILES, MERGE_FILES


def test_a_link_planted_in_out_is_never_written_through(inputs, adapter, tmp_path_factory, capsys):
    """A link at a name the command writes, to a file (or directory) outside OUT: `train` (in place) refuses it in one
    line, with or without --overwrite; `convert` and `merge` (staged, then renamed) refuse to replace what no record
    proves theirs (issue 56), naming it, and leave it alone."""
    train_files, train_directories, convert_files, merge_files = _links()
    names = {"train": train_files + train_directories, "convert": convert_files, "merge": merge_files}
    cases = st.sampled_from(list(names)).flatmap(lambda c: st.tuples(st.just(c), st.sampled_from(names[c])))

    @settings(**BASE_SETTINGS)
    @given(case=cases, hard=st.booleans(), overwrite=st.booleans())
    def check(case, hard, overwrite):
        command, name = case
        root = tmp_path_factory.mktemp("planted")
        out, victim = root / "out", root / "victim" / "trainer_state.json"
        victim.parent.mkdir()
        victim.write_text("the user's\n")
        directory = name in train_directories
        link = out / name
        link.parent.mkdir(parents=True)
        if hard and not directory:
            os.link(victim, link)
        else:
            link.symlink_to(victim.parent if directory else victim)
        overwrite = overwrite or command != "train"  # convert and merge refuse a non-empty OUT without it
        flag = ["--overwrite"] if overwrite else []
        argv = {
            "train": [part.format(**inputs) for part in COMMANDS["train"][0]],
            "convert": ["convert", inputs["source"], "out/converted", "--quiet"],
            "merge": ["merge", str(adapter), "out/merged"],
        }[command]
        argv = [str(out) if part.startswith("out/") else part for part in argv] + flag
        status, line = run_once(argv, tmp_path_factory, inputs, capsys)
        assert victim.read_text() == "the user's\n" and os.listdir(victim.parent) == ["trainer_state.json"]
        if command == "train":  # refused for the link, named (not for some other reason)
            assert status == 2 and name in line and ("symbolic link" in line or "hard links" in line), line
        else:
            assert status == 2 and name in line and "--overwrite removes only what" in line, (command, name, line)
            assert link.is_symlink() or os.stat(link).st_nlink == 2  # left as it was

    check()


# ---- any value in any field of a metadata file the package reads ----


def _metadata_targets():
    from diff_transformer.checkpoints.schema import (
        ADAPTER_FIELDS,
        BASE_RECORD_FIELDS,
        FINGERPRINT_FIELDS,
        GENERATION_FIELDS,
        MOTIF_FIELDS,
    )
    from diff_transformer.generation.config import GENERATION_RANGES

    targets = [("adapter_config.json", field) for field in ADAPTER_FIELDS]
    targets += [("base_model.json", field) for field in BASE_RECORD_FIELDS]
    targets += [("base_model.json", f"fingerprint.{field}") for field in FINGERPRINT_FIELDS]
    targets += [("motif", field) for field in MOTIF_FIELDS]
    targets += [("v1", field) for field in V1_CONFIG_FIELDS]
    targets += [("llama", field) for field in LLAMA_CONFIG_FIELDS]
    generation = dict.fromkeys([*GENERATION_RANGES, *GENERATION_FIELDS, "bad_words_ids", "suppress_tokens"])
    targets += [("generation_config.json", field) for field in generation]
    return targets


# The fields of a Diff V1 config.json that CONFIG_FIELDS (a V2 model) does not reach.
V1_CONFIG_FIELDS = [
    "subln_eps", "lambda_init_depth_offset", "num_noise_heads", "use_qk_norm", "attention_out_bias", "lambda_floor",
    "lambda_init", "conversion",
]  # fmt: skip


# The fields of a Llama config.json that the converter reads (SRC of `convert`).
LLAMA_CONFIG_FIELDS = [
    "architectures", "model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings", "rms_norm_eps", "rope_theta",
    "rope_scaling", "rope_parameters", "attention_bias", "mlp_bias", "tie_word_embeddings", "hidden_act",
    "bos_token_id", "eos_token_id", "pad_token_id", "torch_dtype", "attention_dropout",
]  # fmt: skip


def test_any_metadata_field_value_ends_in_a_result_or_one_line(inputs, adapter, tmp_path_factory, capsys):
    """A hand-edited field of any metadata file the package reads: the command (generate, merge or convert) ends in a
    result or one line, and a result is finite (generate refuses NaN logits; a merge's weights are checked here)."""
    import shutil

    from safetensors.torch import load_file

    from tests.helpers.motif import write_motif_checkpoint
    from tests.helpers.tiny import tiny_model

    root = tmp_path_factory.mktemp("originals")
    tiny_model(1).save_pretrained(root / "v1")
    write_motif_checkpoint(root / "motif")

    @settings(**BASE_SETTINGS)
    @given(target=st.sampled_from(_metadata_targets()), value=CONFIG_VALUES, merge=st.booleans())
    def check(target, value, merge):
        import torch

        kind, field = target
        work = tmp_path_factory.mktemp("edited")
        source = {"adapter_config.json": adapter, "base_model.json": adapter, "motif": root / "motif"}
        source |= {"v1": root / "v1", "generation_config.json": Path(inputs["model"]), "llama": inputs["source"]}
        copy = work / "copy"
        shutil.copytree(source[kind], copy)
        file = copy / (kind if kind.endswith(".json") else "config.json")
        content = json.loads(file.read_text()) if file.is_file() else {}
        parent, _, leaf = field.rpartition(".")
        (content.setdefault(parent, {}) if parent and isinstance(content.get(parent), dict) else content)[leaf] = value
        file.write_text(json.dumps(content))
        if kind in ("motif", "llama"):
            argv = ["convert", str(copy), str(work / "out"), "--diff-version", "1", "--quiet"]
        elif merge and source[kind] == adapter:
            argv = ["merge", str(copy), str(work / "out")]
        else:
            argv = ["generate", str(copy), "5 6 7", "--max-new-tokens", "2"]
        status, _ = run_once(argv, tmp_path_factory, inputs, capsys)
        if status == 0 and argv[0] == "merge":
            weights = load_file(work / "out" / "model.safetensors")
            assert all(torch.isfinite(w).all() for w in weights.values()), (field, value)

    check()


# ---------------------------------------------------------------------------------------------------------------
# Issue 57: option values that need no model are refused before torch and transformers load


def _heavy_imports_before_refusal(*argv):
    """(exit status, stderr's error line, which of torch / transformers / numpy / safetensors the command imported)
    for `diff-transformer ARGV`, read from `-X importtime`."""
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "diff_transformer", *argv], capture_output=True, text=True
    )
    lines = result.stderr.splitlines()
    imported = {line.rsplit("|", 1)[1].strip() for line in lines if line.startswith("import time:")}
    assert "diff_transformer.cli" in imported  # the importtime lines were read
    heavy = {name.split(".")[0] for name in imported} & {"torch", "transformers", "numpy", "safetensors"}
    errors = [line for line in lines if line.startswith("error:")]
    return result.returncode, errors, heavy


TRAIN = ["train", "no-such-model", "--data", "d", "--output", "o"]


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["generate", "no-such-model", "5 6", "--attn-implementation", "sdpaa"], ["'sdpaa'", "sdpa"]),
        (["generate", "no-such-model", "5 6", "--max-new-tokens", "-3"], ["--max-new-tokens -3"]),
        (["generate", "no-such-model", "5 6", "--top-p", "2"], ["--top-p 2"]),
        (["generate", "no-such-model"], ["PROMPT is missing", "--chat"]),
        (["niah", "no-such-model", "--out", "x", "--attn-implementation", "sdpaa"], ["'sdpaa'"]),
        (["inspect", "no-such-model", "5 6", "--attn-implementation", "flash"], ["'flash'"]),
        ([*TRAIN, "--attn-implementation", "sdpaa"], ["'sdpaa'"]),
        # niah: the grid and its bounds (`cli.niah._check_options`)
        (["niah", "no-such-model", "--out", "x", "--lengths", "0"], ["--lengths must be positive"]),
        (["niah", "no-such-model", "--out", "x", "--depths", "1.5"], ["--depths must be fractions"]),
        (["niah", "no-such-model", "--out", "x", "--needles", "0"], ["--needles 0"]),
        (["niah", "no-such-model", "--out", "x", "--batch-size", "0"], ["--batch-size 0"]),
        (["niah", "no-such-model", "--out", "x", "--max-new-tokens", "0"], ["--max-new-tokens 0"]),
        (["niah", "no-such-model", "--out", "x", "--lengths", "99999", "--needles", "999"], ["67,108,864 in one run"]),
        # inspect: numbers and the option combinations (`cli.inspect._check_inspect_options`)
        (["inspect", "no-such-model", "5 6", "--json", "m.json", "--dpi", "0"], ["--dpi 0"]),
        (["inspect", "no-such-model", "5 6", "--json", "m.json", "--max-memory-gb", "nan"], ["--max-memory-gb nan"]),
        (["inspect", "no-such-model", "5 6", "--json", "m.json", "--layer", "-1"], ["--layer -1"]),
        (["inspect", "no-such-model", "5 6", "--json", "m.json", "--head", "-2"], ["--head -2"]),
        (["inspect", "no-such-model", "5 6", "--json", "m.json", "--span", "3:1"], ["--span 3:1", "START:STOP"]),
        (["inspect", "no-such-model", "5 6", "--grid", "g.png", "--metric", "noise"], ["needs --span"]),
        (["inspect", "no-such-model", "5 6"], ["--out", "--json", "--grid"]),
        # train: `training.args.check_option_values`
        ([*TRAIN, "--max-steps", "0"], ["--max-steps 0"]),
        ([*TRAIN, "--lr", "-1"], ["--lr -1"]),
        ([*TRAIN, "--lr", "inf"], ["--lr inf"]),
        ([*TRAIN, "--block-size", "1"], ["--block-size 1"]),
        ([*TRAIN, "--save-steps", "0"], ["--save-steps 0"]),
        ([*TRAIN, "--batch-size", "0"], ["--batch-size 0"]),
        ([*TRAIN, "--eval-fraction", "1"], ["--eval-fraction 1"]),
        ([*TRAIN, "--seed", "-1"], ["--seed -1"]),
        ([*TRAIN, "--warmup-ratio", "2"], ["--warmup-ratio 2"]),
        ([*TRAIN, "--load-in-4bit"], ["--load-in-4bit needs --lora"]),
        ([*TRAIN, "--lora", "--lora-dropout", "1"], ["--lora-dropout"]),
        (["demo", "--seed", "-1"], ["--seed -1"]),
        (["serve", "no-such-model", "--max-queued-requests", "0"], ["--max-queued-requests '0'"]),
        (["serve", "no-such-model", "--max-new-tokens-limit=x"], ["--max-new-tokens-limit 'x'"]),
    ],
)
def test_a_mistyped_option_value_is_refused_before_torch_loads(argv, words):
    """`--attn-implementation sdpaa` or `--max-new-tokens -3` took 19-23 s (torch and transformers imported, 4.4 s
    CPU) before the one-line error; now neither is imported before it (the MODEL does not even exist). Each
    command's checks of values that need no model are one function (its `early_check`), run by `cli.main` first."""
    status, errors, heavy = _heavy_imports_before_refusal(*argv)
    assert status == 2 and len(errors) == 1 and all(word in errors[0] for word in words), errors
    assert not heavy, heavy


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["convert", "no-such-model", "o"], "error: SRC 'no-such-model' does not exist: check the path"),
        (["generate", "no-such-model", "5 6"], "error: MODEL 'no-such-model' does not exist: check the path"),
        (["inspect", "no-such-model", "5 6", "--json", "m.json"], "error: MODEL 'no-such-model' does not exist"),
        (["merge", "no-such-model", "o"], "error: ADAPTER 'no-such-model' does not exist: check the path"),
        (["niah", "no-such-model", "--out", "x"], "error: MODEL 'no-such-model' does not exist: check the path"),
        (TRAIN, "error: MODEL 'no-such-model' does not exist: check the path"),
        (["generate", "", "5 6"], "error: MODEL is empty (an unset shell variable?)"),
        (["convert", "a/../b", "o"], "error: SRC 'a/../b' is neither an existing directory nor a valid Hub model id"),
        (["train", "pyproject.toml", "--data", "d", "--output", "o"], "error: MODEL 'pyproject.toml' is a file"),
    ],
)
def test_a_mistyped_model_path_is_refused_before_torch_loads(argv, line):
    """A new user's walk: `convert nothere OUT` waited ~5 s (torch and transformers imported) for "SRC 'nothere' does
    not exist". The name each command reads is resolved first (`cli.MODEL_ARGUMENTS`), with the line
    `checkpoints.open` or the converter gives later."""
    status, errors, heavy = _heavy_imports_before_refusal(*argv)
    assert status == 2 and len(errors) == 1 and errors[0].startswith(line), errors
    assert not heavy, heavy


def test_the_backends_known_without_transformers_are_those_it_registers():
    from diff_transformer.checkpoints.backends import KNOWN_BACKENDS, attention_backends

    assert sorted(KNOWN_BACKENDS) == attention_backends()


def test_an_unknown_option_after_a_command_shows_that_command_s_usage():
    """`convert SRC OUT --diff-verison 1` printed the top-level usage (`diff-transformer [-h] [--version] ...`), which
    does not list the option the user meant; the command's own usage does."""
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "diff_transformer", "convert", "src", "out", "--diff-verison", "1"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert result.stderr.startswith("usage: diff-transformer convert "), result.stderr
    assert "--diff-version" in result.stderr and "unrecognized arguments: --diff-verison 1" in result.stderr
