"""Issue 56 item 2: chat templates rendered in worker processes (`serving.render_pool`). A builder that makes
gigabytes in one C call (`{{ [[0] * 4000000] * 4000000 }}`, `indent(...)`) held the GIL of the server's process, so
nothing else ran and the step and time bounds never fired; in a worker it is stopped (memory cap or wall-clock kill)
while the calling process runs on, and the next render is served by a fresh worker. Ordinary renders equal the
in-process render."""

import threading
import time

import pytest
from transformers import AutoTokenizer

from diff_transformer.generation import chat_templates
from diff_transformer.generation.chat_templates import ChatRenderError, ChatTemplateBoundError, render_chat
from diff_transformer.serving.render_pool import RenderPool
from tests.serving import fixtures
from tests.serving.fixtures import CHATS, TINY_LLAMA


models = fixtures.models


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


@pytest.mark.slow
def test_the_server_answers_health_and_other_models_while_a_hostile_render_is_stopped(models, tmp_path):
    """A request naming a model whose template builds gigabytes in one call: a 400 naming the bound, and meanwhile
    /health and a chat with another model answer (the render held the server's GIL before: /health timed out)."""
    import concurrent.futures
    import json
    import shutil
    import urllib.request

    from tests.helpers.server import Server

    hostile = tmp_path / "hostile"
    shutil.copytree(models["v2"], hostile)
    config = json.loads((hostile / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (hostile / "tokenizer_config.json").write_text(json.dumps(config))
    (hostile / "chat_template.jinja").write_text(HOSTILE[0])
    server = Server(tmp_path / "serve.log")
    try:
        server.wait_healthy()
        client = server.client()
        normal = dict(model=str(models["v2"]), messages=CHATS[0], max_tokens=4, temperature=0)
        client.chat.completions.create(**normal)  # both render workers up, the model loaded
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            refused = pool.submit(client.chat.completions.create, **{**normal, "model": str(hostile)})
            health = []
            while not refused.done():
                with urllib.request.urlopen(f"{server.url}/health", timeout=2) as response:
                    health.append(response.status)
                time.sleep(0.2)
            with pytest.raises(Exception) as caught:
                refused.result()
        assert caught.value.status_code == 400, caught.value
        assert "went past a bound" in str(caught.value), caught.value
        assert health and set(health) == {200}, health
        assert client.chat.completions.create(**normal).choices[0].message.content is not None
    finally:
        server.stop()
