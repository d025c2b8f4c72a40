"""Issue 56 item 2 for the CLI: a chat template that builds gigabytes in one C call (holding the GIL, so the step and
time bounds checked between Python steps never fire) is rendered in a forked child (`chat_templates.render_in_fork`)
with an address-space cap and a wall-clock kill: `generate --chat` ends in one line, exit 2, within the kill time
and the memory cap, instead of hanging while it grows. Ordinary renders equal the in-process render."""

import json
import resource
import subprocess
import sys
import time

import pytest
from transformers import AutoTokenizer

from diff_transformer.generation import chat_templates
from diff_transformer.generation.chat_templates import (
    FORK_KILL_S,
    WORKER_MEMORY_BYTES,
    ChatRenderError,
    ChatTemplateBoundError,
    render_chat,
)
from tests.serving.fixtures import CHATS, TINY_LLAMA


HOSTILE = {
    "nested-list": "{{ [[0] * 4000000] * 4000000 }}",  # a list of 16e12 items printed: one str() call
    "tojson-indent": "{{ {'a': ['x'] * 100000} | tojson(indent=4000) }}",  # json.dumps: 400 MB in one call
    "indent": "{{ ('x\\n' * 1000000) | indent(4000) }}",  # 1e6 lines indented by 4,000: 4 GB
    "wordwrap": "{{ ('x ' * 1000000) | wordwrap(1, wrapstring='y' * 4000) }}",  # 1e6 breaks of 4,000: 4 GB
}
pytestmark = pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="no fork: renders stay in process")


def _children_peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss << 10  # Linux reports KiB


def test_forked_renders_equal_the_in_process_render():
    tokenizer = AutoTokenizer.from_pretrained(TINY_LLAMA)
    assert chat_templates._ISOLATED is None and chat_templates._FORK is chat_templates.render_in_fork
    for messages in CHATS:
        forked = render_chat(tokenizer, messages, add_generation_prompt=True)
        chat_templates.isolate(chat_templates.in_process)
        try:
            assert forked == render_chat(tokenizer, messages, add_generation_prompt=True)
        finally:
            chat_templates.isolate(None)
    tokenizer.chat_template = "{{ raise_exception('no system messages') }}"
    with pytest.raises(ChatRenderError, match="no system messages"):  # the template's own refusal, whole
        render_chat(tokenizer, CHATS[0], add_generation_prompt=True)


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_render_building_gigabytes_in_one_call_is_stopped_in_its_child(name):
    """One line, within the kill time (plus a margin for a loaded machine), and the child never held more than what
    this process maps plus the child's cap."""
    tokenizer = AutoTokenizer.from_pretrained(TINY_LLAMA)
    tokenizer.chat_template = HOSTILE[name]
    with open("/proc/self/statm") as statm:
        mapped = int(statm.read().split()[0]) * resource.getpagesize()
    start = time.monotonic()
    with pytest.raises(ChatTemplateBoundError) as refused:
        render_chat(tokenizer, CHATS[0], add_generation_prompt=True)
    assert time.monotonic() - start < FORK_KILL_S + 10
    assert "\n" not in str(refused.value)
    assert _children_peak_bytes() < mapped + WORKER_MEMORY_BYTES + (64 << 20)
    tokenizer.chat_template = None
    plain = AutoTokenizer.from_pretrained(TINY_LLAMA)  # this process renders on afterwards
    assert render_chat(plain, CHATS[0], add_generation_prompt=True)


@pytest.mark.slow  # 10-25 s (server starts, subprocesses): the full suite runs it, the quick loop does not
def test_the_kill_grows_with_the_conversation_and_still_stops_a_hostile_template(monkeypatch):
    """Issue 56: a forked render was killed at a fixed 3 s, so a long legitimate conversation on a loaded machine
    could be killed for its length. Its bound is now RENDER_SECONDS plus FORK_SECONDS_PER_MI_CHARS per Mi characters
    given, the kill FORK_KILL_MARGIN_S later. A loaded machine is stood in for by a child that gets no CPU for 4 s
    before it renders (past the fixed 3 s): a conversation of ~1 Mi characters renders (the same text as in process),
    a short one is killed at its 3 s, and a hostile template with the long conversation is still stopped."""
    long = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i} " + "w" * 1990} for i in range(500)]
    size = chat_templates.check_input(long)
    assert size > 0.98 * chat_templates.MAX_INPUT_CHARS
    assert chat_templates.fork_seconds(0) == chat_templates.RENDER_SECONDS == FORK_KILL_S - 1
    allowance = chat_templates.FORK_SECONDS_PER_MI_CHARS * size / (1 << 20)
    assert chat_templates.fork_seconds(size) == pytest.approx(chat_templates.RENDER_SECONDS + allowance)
    tokenizer = AutoTokenizer.from_pretrained(TINY_LLAMA)
    with chat_templates.isolation(chat_templates.in_process):
        expected = render_chat(tokenizer, long, add_generation_prompt=True)
    stall = FORK_KILL_S + 1.0
    assert chat_templates.fork_seconds(size) + chat_templates.FORK_KILL_MARGIN_S > stall + 2  # room to render
    cap = chat_templates._cap_memory
    monkeypatch.setattr(chat_templates, "_cap_memory", lambda: (time.sleep(stall), cap()))  # runs in the child
    assert render_chat(tokenizer, long, add_generation_prompt=True) == expected
    start = time.monotonic()
    with pytest.raises(ChatTemplateBoundError, match="took over 2 s"):
        render_chat(tokenizer, CHATS[0], add_generation_prompt=True)
    assert FORK_KILL_S - 0.1 < time.monotonic() - start < stall
    monkeypatch.setattr(chat_templates, "_cap_memory", cap)
    tokenizer.chat_template = HOSTILE["nested-list"] + "{% for m in messages %}{{ m.content }}{% endfor %}"
    start = time.monotonic()
    with pytest.raises(ChatTemplateBoundError):
        render_chat(tokenizer, long, add_generation_prompt=True)
    assert time.monotonic() - start < chat_templates.fork_seconds(size) + chat_templates.FORK_KILL_MARGIN_S + 10


@pytest.mark.slow
def test_generate_chat_with_each_hostile_template_exits_with_one_line(tmp_path):
    """The CLI end to end (~20 s per run: torch's imports): exit 2, one `error:` line naming the bound, in bounded
    time and memory (the command and its children together, from RUSAGE_CHILDREN of this test's process)."""
    import shutil

    for name, template in HOSTILE.items():
        model = tmp_path / name
        shutil.copytree(TINY_LLAMA, model)
        (model / "chat_template.jinja").write_text(template, encoding="utf-8")
        start = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", "diff_transformer", "generate", str(model), "Hi", "--chat"]
            + ["--max-new-tokens", "1"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        elapsed = time.monotonic() - start
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        assert done.returncode == 2, done.stderr[-2000:]
        assert len(lines) == 1 and lines[0].startswith("error: --chat: MODEL ") and "went past a bound" in lines[0]
        assert elapsed < 120, elapsed  # without the fork: no end (it grew ~25 MB/s until killed)
        assert _children_peak_bytes() < 4 << 30  # the CLI (~0.5 GB with torch) and its capped child


def test_train_chat_data_forks_its_first_conversation_only(tmp_path, monkeypatch):
    """`train --chat-data` renders its first conversation in a forked child (a template that builds gigabytes
    whatever the data is stopped there, one line) and the rest in process (a fork per render would cost tens of
    milliseconds, several renders a conversation); the tokens are the same either way."""
    from diff_transformer.training import TrainingError
    from diff_transformer.training.chat import tokenize_conversations

    tokenizer = AutoTokenizer.from_pretrained(TINY_LLAMA)
    data = tmp_path / "chats.jsonl"
    answered = [[*m, {"role": "assistant", "content": "Yes."}] for m in CHATS if m[-1]["role"] == "user"]
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in answered * 2), encoding="utf-8")
    forks = []

    def counting(source, args, kwargs):
        forks.append(len(forks))
        return chat_templates.render_in_fork(source, args, kwargs)

    monkeypatch.setattr(chat_templates, "_FORK", counting)
    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps({"messages": answered[0]}) + "\n", encoding="utf-8")
    tokenize_conversations(tokenizer, [one], 4096, "training")
    renders_of_one = len(forks)  # the renders a conversation takes
    assert renders_of_one >= 1 and len(answered) * 2 > 1
    forks.clear()
    forked = tokenize_conversations(tokenizer, [data], 4096, "training")
    assert len(forks) == renders_of_one  # the later conversations rendered in process
    chat_templates.isolate(chat_templates.in_process)
    try:
        plain = tokenize_conversations(tokenizer, [data], 4096, "training")
    finally:
        chat_templates.isolate(None)
    assert [forked.example(i) for i in range(len(forked))] == [plain.example(i) for i in range(len(plain))]
    tokenizer.chat_template = HOSTILE["nested-list"]
    start = time.monotonic()
    with pytest.raises(TrainingError) as refused:
        tokenize_conversations(tokenizer, [data], 4096, "training")
    assert time.monotonic() - start < FORK_KILL_S + 10 and "\n" not in str(refused.value)
