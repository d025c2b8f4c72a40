"""Issue 56 item 2: chat templates rendered in worker processes (`serving.render_pool`). A builder that makes
gigabytes in one C call (`{{ [[0] * 4000000] * 4000000 }}`, `indent(...)`) held the GIL of the server's process, so
nothing else ran and the step and time bounds never fired; in a worker it is stopped (memory cap or wall-clock kill)
while the calling process runs on, and the next render is served by a fresh worker. Ordinary renders equal the
in-process render."""

import threading
import time

import pytest
from transformers import AutoTokenizer

from diff_transformer import chat_templates
from diff_transformer.chat_templates import ChatRenderError, ChatTemplateBoundError, render_chat
from diff_transformer.serving.render_pool import RenderPool
from tests.serving.fixtures import CHATS, TINY_LLAMA


HOSTILE = [
    "{{ [[0] * 4000000] * 4000000 }}",  # a list of 16e12 items printed: one str() call
    "{{ ('x\\n' * 1000000) | indent(4000) }}",  # 1e6 lines, each indented by 4,000: one C call of 4 GB
]


@pytest.fixture(scope="module")
def pool():
    started = RenderPool(1)
    chat_templates.isolate(started.render)
    try:
        yield started
    finally:
        chat_templates.isolate(None)
        started.close()


def test_renders_in_the_worker_equal_the_in_process_render(pool):
    tokenizer = AutoTokenizer.from_pretrained(TINY_LLAMA)
    for messages in CHATS:
        isolated = render_chat(tokenizer, messages, add_generation_prompt=True)
        chat_templates.isolate(None)
        try:
            assert isolated == render_chat(tokenizer, messages, add_generation_prompt=True)
        finally:
            chat_templates.isolate(pool.render)
    assert pool.started == 1 and pool.idle.qsize() == 1  # one worker, reused
    tokenizer.chat_template = "{{ raise_exception('no system messages') }}"
    with pytest.raises(ChatRenderError, match="no system messages"):  # the template's own refusal, whole
        render_chat(tokenizer, CHATS[0], add_generation_prompt=True)


@pytest.mark.slow
@pytest.mark.parametrize("template", HOSTILE)
def test_a_render_building_gigabytes_in_one_call_is_stopped_while_this_process_runs_on(pool, template):
    """Each hostile template ends in a one-line bound error, this process's other threads run meanwhile (a thread
    ticking every 10 ms ticks), and an ordinary render works afterwards."""
    tokenizer = AutoTokenizer.from_pretrained(TINY_LLAMA)
    ticks, stop = [0], threading.Event()

    def tick():
        while not stop.wait(0.01):
            ticks[0] += 1

    ticker = threading.Thread(target=tick)
    ticker.start()
    start = time.monotonic()
    try:
        tokenizer.chat_template = template
        with pytest.raises(ChatTemplateBoundError) as refused:
            render_chat(tokenizer, CHATS[0], add_generation_prompt=True)
    finally:
        stop.set()
        ticker.join()
    elapsed = time.monotonic() - start
    assert "\n" not in str(refused.value)
    assert ticks[0] >= elapsed * 100 / 4, (ticks[0], elapsed)  # the GIL was free: at least a quarter of the ticks
    plain = AutoTokenizer.from_pretrained(TINY_LLAMA)
    assert render_chat(plain, CHATS[0], add_generation_prompt=True).strip()  # a fresh worker answers
