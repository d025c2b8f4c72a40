"""What the server admits and how it refuses (issue 56 items 3 and 5, issue 57 item 1): a request body over
--max-request-bytes is a 413 before it is buffered, the queue bound counts a request from its arrival, Retry-After
covers the work ahead so the openai client's own retries get a burst served, and every refusal (an unknown route or
method, a body that is not JSON, malformed messages, an empty model name) is OpenAI's error body naming the cause."""

import asyncio
import concurrent.futures
import json
import urllib.error
import urllib.request

import openai
import pytest

from diff_transformer.serving.server import RETRY_AFTER_MAX_S, RETRY_SERVICE_PRIOR_S, QueueBound
from tests.helpers.server import Server
from tests.serving import fixtures
from tests.serving.fixtures import CHATS, NEW_TOKENS


models, references = fixtures.models, fixtures.references
pytestmark = pytest.mark.usefixtures("one_torch_thread")

QUEUE = 2  # --max-queued-requests of the module's server
MAX_BYTES = 65536  # --max-request-bytes of the module's server


def asgi_call(bound, method, pieces, headers=(), sending=False):
    """Start one request through BOUND (an ASGI app): (task, received pieces list, sent messages list). SENDING: the
    body's last piece says more is coming, which never comes."""
    messages = [
        {"type": "http.request", "body": p, "more_body": sending or i < len(pieces) - 1} for i, p in enumerate(pieces)
    ]
    pulled, sent = [], []

    async def receive():
        if messages:
            pulled.append(messages[0]["body"])
            return messages.pop(0)
        await asyncio.Event().wait()  # the client stays connected

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": method, "path": "/v1/chat/completions", "headers": list(headers)}
    return asyncio.ensure_future(bound(scope, receive, send)), pulled, sent


def answer(sent):
    return sent[0]["status"], dict(sent[0]["headers"]), json.loads(b"".join(m.get("body", b"") for m in sent[1:]))


def test_bodies_over_the_limit_are_413_before_they_are_buffered_and_places_count_from_arrival():
    """A declared Content-Length over the bound is refused without reading a byte; a body sent in pieces without one
    is refused as soon as what arrived passes the bound (the rest is never read); a request whose body is still
    arriving already holds its place, so the next one is a 429 (before, 3 x 200 MB bodies were buffered first)."""
    reached = []

    async def app(scope, receive, send):
        reached.append(scope["method"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def scenario():
        bound = QueueBound(app, limit=1, max_bytes=100)
        task, pulled, sent = asgi_call(bound, "POST", [b"x" * 50] * 4, headers=[(b"content-length", b"200")])
        await task
        status, headers, body = answer(sent)
        assert status == 413 and pulled == [] and bound.in_flight == 0
        assert body["error"]["code"] == "request_too_large" and "at most 100" in body["error"]["message"]
        assert set(body["error"]) == {"message", "type", "param", "code"}

        task, pulled, sent = asgi_call(bound, "POST", [b"x" * 60] * 5)  # chunked: no Content-Length
        await task
        assert answer(sent)[0] == 413 and len(pulled) == 2  # refused at 120 bytes, three pieces never read

        slow, pulled, _ = asgi_call(bound, "POST", [b'{"a":'], sending=True)  # more_body never ends: still sending
        await asyncio.sleep(0)
        task, _, sent = asgi_call(bound, "POST", [b"{}"])
        await task
        assert answer(sent)[0] == 429 and bound.in_flight == 1
        slow.cancel()
        assert reached == []  # nothing refused reached the app

    asyncio.run(scenario())


def test_retry_after_is_the_work_ahead_bounded():
    """Retry-After = 1.5 x requests in the server x the recent service time per request (a request's time over the
    requests it found there), 1 to RETRY_AFTER_MAX_S; RETRY_SERVICE_PRIOR_S per request before any was served."""
    bound = QueueBound(None, limit=8)
    bound.in_flight = 8
    assert bound.retry_after() == int(1.5 * 8 * RETRY_SERVICE_PRIOR_S)
    bound.recent_service.extend([0.5, 3.0, 1.0])  # median 1.0
    assert bound.retry_after() == 12
    bound.in_flight = 1
    bound.recent_service.clear()
    bound.recent_service.extend([0.01])
    assert bound.retry_after() == 1  # never 0
    bound.in_flight = 8
    bound.recent_service.extend([100.0, 100.0])
    assert bound.retry_after() == RETRY_AFTER_MAX_S


def test_serve_refuses_an_empty_model_and_a_missing_directory_with_a_revision(refused):
    refused(["serve", "./nonexistent-dir@v1"], "'./nonexistent-dir'", "neither an existing directory")
    refused(["serve", "@main"], "'@main' names no model")
    refused(["serve", "--max-request-bytes", "0"], "--max-request-bytes '0' must be a whole number >= 1")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    logs = tmp_path_factory.mktemp("serve")
    options = ("--max-queued-requests", str(QUEUE), "--max-request-bytes", str(MAX_BYTES))
    started = Server(logs / "serve.log", *options)
    try:
        started.wait_healthy()
        yield started
    finally:
        started.stop()


def call(server, method, path, data: bytes | None = None):
    """(status, JSON body) of one request, errors included."""
    request = urllib.request.Request(
        f"{server.url}{path}", data=data, method=method, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as error:
        return error.code, json.load(error)


@pytest.mark.slow
def test_refusals_are_openai_s_error_body_naming_the_cause(server, models):
    """Unknown routes and methods, a body that is not JSON, a body over the bound, malformed messages and an empty
    model name: each a 4xx whose body is OpenAI's `{"error": {"message", "type", "param", "code"}}`, one line."""
    chat = {"model": str(models["v2"]), "messages": CHATS[0], "max_tokens": 2}
    cases = [
        ("GET", "/v1/nothing", None, 404, "no route /v1/nothing"),
        ("DELETE", "/v1/chat/completions", None, 405, "DELETE is not allowed on /v1/chat/completions"),
        ("POST", "/v1/chat/completions", b"{not json", 400, "not a JSON object"),
        ("POST", "/v1/chat/completions", b"[1, 2]", 400, "not a JSON object"),
        ("POST", "/v1/chat/completions", json.dumps({**chat, "pad": "x" * MAX_BYTES}).encode(), 413, "at most 65536"),
        ("POST", "/v1/chat/completions", json.dumps({**chat, "model": "@main"}).encode(), 400, "names no model"),
    ]
    malformed = {**chat, "messages": [{"role": "user", "content": [{"type": "text"}]}]}
    cases.append(("POST", "/v1/chat/completions", json.dumps(malformed).encode(), 400, "messages are malformed"))
    for method, path, data, status, words in cases:
        got, body = call(server, method, path, data)
        assert got == status, (method, path, got, body)
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
        message = body["error"]["message"]
        assert words in message and "\n" not in message, (path, message)
        assert "chat template" not in message and "'None'" not in message, message
    assert call(server, "GET", "/health")[0] == 200  # the server answers on


@pytest.mark.slow
def test_the_openai_client_s_own_retries_get_a_burst_of_three_queues_served(server, models, references):
    """3 x --max-queued-requests concurrent chats through the openai client with its default retries (2, honouring
    Retry-After): every request is answered, with greedy `generate`'s answer (12 against a queue of 8 lost 3 when
    Retry-After was the median request time)."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="not-needed", timeout=300)  # default max_retries
    assert client.max_retries == 2

    def chat(messages):
        response = client.chat.completions.create(
            model=str(models["v2"]), messages=messages, max_tokens=NEW_TOKENS, temperature=0
        )
        return response.choices[0].message.content, response.usage.completion_tokens

    jobs = [CHATS[i % 3] for i in range(3 * QUEUE)]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(chat, jobs))
    assert answers == [references("v2", messages) for messages in jobs]
