"""Every command's options and a checkpoint's config fields, driven with any value (Hypothesis): huge, negative,
NaN, infinite, empty, non-numeric, shell and markup metacharacters, control characters, wrong JSON types. Whatever
the value, a command ends with exit 0 (it was a valid value), or exit 2 and one error line (argparse's own refusals
print their usage first), never a traceback; and nothing outside its working directory changes.

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
        ],  # fmt: skip
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


@pytest.mark.parametrize("name", ["x\ny", "x\x85y", "x\u2028y", "x\ry"])
def test_a_line_break_in_a_refused_name_stays_on_the_one_line(name, inputs, tmp_path_factory, capsys):
    """Found by the long profile: a data file named with U+0085 made `train --chat-data`'s refusal two lines; the
    CLI's boundary now escapes every line break of a refusal (whoever wrote the message)."""
    for option in ("--chat-data", "--eval-data"):
        argv = [part.format(**inputs) for part in COMMANDS["train-chat"][0]] + [option, name]
        run_once(argv, tmp_path_factory, inputs, capsys)
    run_once(["train", inputs["model"], "--data", name, "--output", "out/run"], tmp_path_factory, inputs, capsys)
