"""Issue "Trust 3": what a request can make us compute is bounded. A config.json that claims more model than the
safetensors weights next to it hold (10^5 or 10^7 layers, a huge hidden size or vocabulary, heads that do not fit) is
refused in one line by every entry point before anything is built from it (`check_config_against_weights`); chat
templates render within bounds (`diff_transformer.generation.chat_templates`)."""

import json
import re
import shutil
import time
from pathlib import Path

import pytest

import diff_transformer
from diff_transformer.checkpoints import CheckpointError


TINY_LLAMA = Path(diff_transformer.__file__).parent / "assets" / "tiny-llama"
# field -> (hostile value, words of the refusal)
HOSTILE = {
    "layers_1e5": (
        "num_hidden_layers",
        100_000,
        "config.json says num_hidden_layers=100000, but the weights hold 4 layers",
    ),
    "layers_1e7": (
        "num_hidden_layers",
        10_000_000,
        "config.json says num_hidden_layers=10000000, but the weights hold 4 layers",
    ),
    "hidden": ("hidden_size", 1_000_000, "hidden_size=1000000, but the embedding is 192 wide"),
    "vocab": ("vocab_size", 1_000_000_000, "vocab_size=1000000000, but the embedding holds 2048 tokens"),
    "heads": ("num_attention_heads", 5, "num_attention_heads=5 x head_dim 32 = 160, but q_proj has 192 rows"),
    "intermediate": ("intermediate_size", 10**9, "config.json implies about"),
}


@pytest.fixture
def nothing_built(monkeypatch):
    """Building any transformers model fails the test: a refusal must come before the model is built (what it
    replaces built 10^5 layers for minutes). The error boundary turns the RuntimeError into a bug line (exit 1),
    which `refused` does not accept."""
    import transformers

    def build(self, *args, **kwargs):
        raise RuntimeError(f"a {type(self).__name__} was built")

    monkeypatch.setattr(transformers.PreTrainedModel, "__init__", build)


def hostile_copy(root: Path, case: str) -> Path:
    field, value, _ = HOSTILE[case]
    path = root / f"hostile-{case}"
    shutil.copytree(TINY_LLAMA, path)
    config = json.loads((path / "config.json").read_text())
    config[field] = value
    (path / "config.json").write_text(json.dumps(config))
    return path


def adapter_on(base: Path, path: Path) -> Path:
    """A PEFT adapter directory (config only) whose base is BASE: merge's way to a base model."""
    path.mkdir()
    (path / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "task_type": "CAUSAL_LM",
                "base_model_name_or_path": str(base),
                "r": 2,
                "lora_alpha": 4,
                "target_modules": ["q_proj"],
            }
        )
    )
    return path


ENTRY_POINTS = {
    "convert": lambda model, tmp: ["convert", model, tmp / "out"],
    "generate": lambda model, tmp: ["generate", model, "Hello"],
    "generate-chat": lambda model, tmp: ["generate", model, "Hello", "--chat"],
    "inspect": lambda model, tmp: ["inspect", model, "Hello", "--json", tmp / "maps.json"],
    "train": lambda model, tmp: ["train", model, "--data", tmp / "data.jsonl", "--output", tmp / "run", "--any-model"],
    "merge": lambda model, tmp: ["merge", adapter_on(model, tmp / "adapter"), tmp / "merged"],
    "serve": lambda model, tmp: ["serve", model],
    "niah": lambda model, tmp: ["niah", model, "--out", tmp / "niah", "--lengths", "64"],
    "plan": lambda model, tmp: ["plan", model],
}


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_every_entry_point_refuses_a_config_larger_than_its_weights(entry, refused, tmp_path, nothing_built):
    (tmp_path / "data.jsonl").write_text('{"text": "Hello there."}\n')
    model = hostile_copy(tmp_path, "layers_1e5")
    refused(ENTRY_POINTS[entry](model, tmp_path), HOSTILE["layers_1e5"][2], str(model))


@pytest.mark.parametrize("case", HOSTILE)
def test_each_hostile_field_is_refused_before_the_model_is_built(case, refused, tmp_path, nothing_built):
    model = hostile_copy(tmp_path, case)
    refused(["generate", model, "Hello"], HOSTILE[case][2])
    refused(["convert", model, tmp_path / "out"], HOSTILE[case][2])


def test_the_package_s_one_road_refuses_it_too(tmp_path, nothing_built):
    """`checkpoints.open`, the road every command and serve take from a name to a model, refuses it when opened."""
    from diff_transformer import checkpoints

    model = hostile_copy(tmp_path, "layers_1e7")
    with pytest.raises(
        CheckpointError, match="config.json says num_hidden_layers=10000000, but the weights hold 4 layers"
    ):
        checkpoints.open(str(model), tokenizer=False)


def test_honest_checkpoints_pass(tmp_path):
    """The check refuses nothing real: the shipped Llama, its Diff conversions, a DiffLlama and a sharded Llama."""
    from diff_transformer.checkpoints.configs import read_json
    from diff_transformer.checkpoints.loading import check_config_against_weights
    from diff_transformer.conversion import convert_to_diff
    from tests.helpers.checkpoints import make_diffllama, make_llama

    paths = [
        TINY_LLAMA,
        convert_to_diff(TINY_LLAMA, tmp_path / "v1", diff_version=1, progress=False),
        convert_to_diff(TINY_LLAMA, tmp_path / "v2", diff_version=2, progress=False),
        make_diffllama(tmp_path / "diffllama"),
        make_llama(tmp_path / "sharded", max_shard_size="20KB"),
    ]
    for path in paths:
        check_config_against_weights(Path(path), read_json(Path(path) / "config.json"), str(path))


# ---- chat templates ----

# 10^10 steps of nothing: jinja2's sandbox caps each range() at 10^5 items, not what nested loops make of them.
NESTED_LOOPS = "{% for a in range(10**5) %}{% for b in range(10**5) %}{% endfor %}{% endfor %}"
TEMPLATES = {
    "nested loops": (NESTED_LOOPS, "rendering it"),  # over 5,000,000 steps or 2 s, whichever comes first
    "nested output": (NESTED_LOOPS.replace("{% endfor %}", "x{% endfor %}", 1), "over"),
    "a huge string": ("{{ 'x' * 10**10 }}", "a repeated value of 10,000,000,000 characters"),
    "a doubled string": (
        "{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
        "a concatenation (~) of 8,388,608 characters",
    ),
    "a wide filter": ("{{ 'x'|center(10**9) }}", "it passes 1,000,000,000 to the center filter"),
    "a wide method": ("{{ 'x'.ljust(10**9) }}", "it passes 1,000,000,000 to str.ljust"),
    "a wide format": ("{{ '%1000000000s'|format('x') }}", "width of a million or more"),
    "a huge join": ("{{ range(10**3)|join('x' * 100000) }}", "a joined string of"),
    "a huge replace": ("{% set s = 'x' * 3000 %}{{ s.replace('x', s) }}", "a replaced string of 9,000,000"),
    "a width from an argument": ("{{ '{:{}}'.format('a', 10**9) }}", "width of a million or more"),
    "a printf width from an argument": ("{{ '%*s' % (10**9, 'x') }}", "width of a million or more"),
}
# What templates do, rendered as before: the bounds refuse none of it.
ORDINARY = {
    "{{ '**%s**' % 'x' }}": "**x**",
    "{{ '{} * {}'.format(1, 2) }}": "1 * 2",
    "{{ '%5.2f'|format(3.14159) }}": " 3.14",
    "{{ '{:>5}'.format('a') }}": "    a",
    "{{ '%*s' % (4, 'x') }}": "   x",
    "{{ ['a', 'b']|join(', ') }}": "a, b",
    "{{ 'a-b'.replace('-', '+') ~ 'c' * 3 }}": "a+bccc",
    "{% for i in range(3) %}{{ i }}{% endfor %}": "012",
    "{{ messages[0]['content']|center(6) }}": "  Hi  ",
}


def with_template(root: Path, template: str, name: str = "hostile-template") -> Path:
    path = root / name
    shutil.copytree(TINY_LLAMA, path)
    (path / "chat_template.jinja").write_text(template)
    return path


@pytest.mark.parametrize("case", TEMPLATES)
def test_a_chat_template_renders_within_bounds(case):
    from transformers import AutoTokenizer

    from diff_transformer.generation.chat_templates import ChatTemplateBoundError, bound_chat_templates

    bound_chat_templates()
    tokenizer = AutoTokenizer.from_pretrained(TINY_LLAMA)
    template, words = TEMPLATES[case]
    with pytest.raises(ChatTemplateBoundError, match=re.escape(words)):
        tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], chat_template=template, tokenize=False)
    # the shipped template renders as before
    assert tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False) == (
        "<s><|user|>\nHi</s>\n"
    )


def test_ordinary_templates_render_as_before():
    from transformers import AutoTokenizer

    from diff_transformer.generation.chat_templates import bound_chat_templates

    bound_chat_templates()
    tokenizer = AutoTokenizer.from_pretrained(TINY_LLAMA)
    messages = [{"role": "user", "content": "Hi"}]
    rendered = {t: tokenizer.apply_chat_template(messages, chat_template=t, tokenize=False) for t in ORDINARY}
    assert rendered == ORDINARY


def test_generate_chat_refuses_a_template_past_its_bounds(refused, tmp_path):
    model = with_template(tmp_path, NESTED_LOOPS)
    refused(["generate", model, "Hello", "--chat"], f"--chat: MODEL {model}: the chat template went past a bound")
    # jinja2's own cap on range() (10^5 items), for the issue's 10^6 x 10^6 loops
    model = with_template(tmp_path, NESTED_LOOPS.replace("10**5", "10**6"), "range")
    refused(["generate", model, "Hello", "--chat"], "MAX_RANGE (100000)")


# Hostile only for some messages: "loop" runs nested loops, "boom" raises; the rest renders as the shipped template.
SOMETIMES_HOSTILE = (
    "{{ bos_token }}{% for m in messages %}{% if m['content'] == 'loop' %}" + NESTED_LOOPS + "{% endif %}"
    "{% if m['content'] == 'boom' %}{{ raise_exception('no boom here') }}{% endif %}"
    "{{ '<|' + m['role'] + '|>\\n' + m['content'] + eos_token + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def test_an_interactive_chat_survives_a_bad_turn(tmp_path, monkeypatch, capsys):
    """Issue 46: one template error or one over-long message ended the whole session. Each is now one error line,
    the message is not sent, and the chat goes on with its history as it was: the answers are those of the same chat
    without the bad turns."""
    import io
    import sys

    from diff_transformer import cli

    model = with_template(tmp_path, SOMETIMES_HOSTILE)

    def chat(lines):
        monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(lines) + "\n"))
        status = cli.main(["generate", str(model), "--chat", "--max-new-tokens", "3"])
        out, err = capsys.readouterr()
        assert status == 0, err
        return out, [line for line in err.splitlines() if "error" in line]

    huge = "x" * (1 << 20)
    out, errors = chat(["Hi", "loop", "boom", huge, "Hi again"])
    assert (out, []) == chat(["Hi", "Hi again"])
    assert len(errors) == 3, errors
    assert "the chat template went past a bound: rendering it" in errors[0]
    assert "the chat template refuses these messages (no boom here)" in errors[1]
    assert "come to more than 1,048,576 characters" in errors[2] and "fix the template" not in errors[2]
    assert all(e.endswith("this message was not sent.") for e in errors)


def test_serve_refuses_a_model_without_tokenizer_or_with_a_hostile_config(refused, tmp_path):
    bare = tmp_path / "no-tokenizer"
    shutil.copytree(TINY_LLAMA, bare, ignore=shutil.ignore_patterns("tokenizer*", "chat_template*"))
    refused(["serve", bare], f"MODEL {bare} has no tokenizer")
    model = hostile_copy(tmp_path, "vocab")
    refused(["serve", model], HOSTILE["vocab"][2])


@pytest.mark.slow  # 10-25 s (server starts, subprocesses): the full suite runs it, the quick loop does not
def test_serve_answers_400_for_what_it_cannot_bound_and_stays_responsive(tmp_path):
    """A model whose chat template runs without end answers 400 (one line) after the bound, while /health answers at
    once throughout; a hostile config and a missing tokenizer answer 400; SIGTERM during a render ends the server
    within seconds."""
    import concurrent.futures
    import signal
    import urllib.request

    import openai

    from tests.helpers.server import Server

    slow = with_template(tmp_path, NESTED_LOOPS)
    config = hostile_copy(tmp_path, "layers_1e5")
    bare = tmp_path / "no-tokenizer"
    shutil.copytree(TINY_LLAMA, bare, ignore=shutil.ignore_patterns("tokenizer*", "chat_template*"))
    server = Server(tmp_path / "serve.log")
    try:
        server.wait_healthy()
        client = server.client()
        messages = [{"role": "user", "content": "Hi"}]
        # a model that works: answered (its template rendered off the loop, then reused)
        answer = client.chat.completions.create(model=str(TINY_LLAMA), messages=messages, max_tokens=4)
        assert answer.choices[0].message.content is not None

        def health():
            with urllib.request.urlopen(f"{server.url}/health", timeout=5) as response:  # a blocked loop: no answer
                return response.status

        def hostile():
            with pytest.raises(openai.BadRequestError) as caught:
                client.chat.completions.create(model=str(slow), messages=messages, max_tokens=4)
            return caught.value.body["message"]

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(hostile)
            answers = []
            while not pending.done():
                answers.append(health())
                time.sleep(0.1)
            message = pending.result()
        assert "rendering it" in message and "\n" not in message, message
        assert len(answers) >= 3 and set(answers) == {200}, answers  # the loop answered throughout the render

        for model, words in ((config, HOSTILE["layers_1e5"][2]), (bare, "has no tokenizer")):
            with pytest.raises(openai.BadRequestError, match=re.escape(words)):
                client.chat.completions.create(model=str(model), messages=messages, max_tokens=4)

        # SIGTERM while a render runs: the server ends within seconds
        pool = concurrent.futures.ThreadPoolExecutor(1)
        pool.submit(lambda: client.chat.completions.create(model=str(slow), messages=messages, max_tokens=4))
        time.sleep(0.5)
        server.process.send_signal(signal.SIGTERM)
        server.process.wait(timeout=15)  # ends (uvicorn alone would wait for the render without limit)
        pool.shutdown(wait=False)
    finally:
        if server.process.poll() is None:
            server.process.kill()
            server.process.wait()


def test_serve_renders_a_chat_template_once_off_the_event_loop():
    """transformers' chat handler renders the template on the event loop; `render_off_the_loop` renders it first in a
    worker thread, and the handler's render then returns that text: the template runs once, never on the loop."""
    import asyncio
    import threading

    from jinja2 import Template
    from transformers.cli.serving.chat_completion import ChatCompletionHandler
    from transformers.cli.serving.model_manager import ModelManager
    from transformers.cli.serving.utils import GenerationState

    from diff_transformer.generation.chat_templates import bound_chat_templates
    from diff_transformer.serving import server

    bound_chat_templates()
    manager = ModelManager(device="cpu")
    handler = ChatCompletionHandler(model_manager=manager, generation_state=GenerationState())
    renders = []
    generate = Template.generate

    def counting(self, *args, **kwargs):
        renders.append(threading.current_thread() is threading.main_thread())
        return generate(self, *args, **kwargs)

    body = {"model": str(TINY_LLAMA), "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    from diff_transformer.generation import chat_templates

    try:
        Template.generate = counting
        chat_templates.isolate(chat_templates.in_process)  # counted here, not in a forked child (render_in_fork)

        async def handle():  # what `client_facing`'s wrapper of the handler does, without patching transformers here
            await server.render_off_the_loop(handler, body)
            return await handler.handle_request(body, "request-1")

        response = asyncio.run(handle())
    finally:
        Template.generate = generate
        chat_templates.isolate(None)
    assert response.status_code == 200
    assert renders == [False]  # once, in a worker thread (asyncio.run's loop runs in the main thread)


def test_a_hub_source_s_config_is_bounded_before_its_weights_are_fetched(tmp_path, monkeypatch):
    """A Hub id's weights are downloaded only after its config passed, so the config alone is bounded first (an
    offline HF cache stands in for the Hub): the refusal names the config's bound, not the weights' layer count,
    which only the download would have let us compare."""
    from huggingface_hub import constants

    from diff_transformer.conversion import ConversionError, convert_to_diff

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "cache" / "models--evil-org--tiny-llama"
    snapshot = repo / "snapshots" / commit
    shutil.copytree(TINY_LLAMA, snapshot)
    config = json.loads((TINY_LLAMA / "config.json").read_text()) | {"num_hidden_layers": 100_000}
    (snapshot / "config.json").write_text(json.dumps(config))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises((CheckpointError, ConversionError), match="num_hidden_layers=100000 is beyond any model"):
        convert_to_diff("evil-org/tiny-llama", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_the_config_bound_names_the_field_it_read():
    """The bound reads the sizes where the weights check does (text_config when it is an object) and names that
    field: a text_config that is no object is ignored, not a crash."""
    from diff_transformer.checkpoints.loading import check_config_sizes_plausible

    with pytest.raises(CheckpointError, match="config.json's n_layer=100000 is beyond any model"):
        check_config_sizes_plausible({"text_config": "not an object", "n_layer": 100_000}, "m")
    with pytest.raises(CheckpointError, match="config.json's num_hidden_layers=100000 is beyond"):
        check_config_sizes_plausible({"num_hidden_layers": 2, "text_config": {"num_hidden_layers": 100_000}}, "m")
    check_config_sizes_plausible({"num_hidden_layers": 100_000, "text_config": {"num_hidden_layers": 2}}, "m")


def test_serve_s_render_refuses_a_huge_request_as_the_request_s_size():
    """serve renders through transformers' apply_chat_template, bounded by `bound_chat_templates` (the renderer every
    command uses): a request over the input limit is refused as too large, before the template runs, and not blamed
    on the template; media (a base64 image) is not counted."""
    from transformers import AutoTokenizer

    from diff_transformer.generation.chat_templates import (
        MAX_INPUT_CHARS,
        ChatInputTooLargeError,
        bound_chat_templates,
    )

    bound_chat_templates()
    tokenizer = AutoTokenizer.from_pretrained(TINY_LLAMA)
    huge = [{"role": "user", "content": "x" * MAX_INPUT_CHARS}]
    with pytest.raises(ChatInputTooLargeError, match="send a shorter conversation") as caught:
        tokenizer.apply_chat_template(huge, chat_template=NESTED_LOOPS, tokenize=False)
    assert "fix the template" not in str(caught.value)
    many = [{"role": "user", "content": ""}] * (MAX_INPUT_CHARS // 32)  # 16 for a message, 16 for each entry
    with pytest.raises(ChatInputTooLargeError):
        tokenizer.apply_chat_template(many, tokenize=False)
    image = [{"role": "user", "content": [{"type": "image", "url": "data:image/png;base64," + "A" * MAX_INPUT_CHARS}]}]
    tokenizer.apply_chat_template(image, chat_template="{{ messages|length }}", tokenize=False)
