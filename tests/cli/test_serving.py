"""Serving: transformers' `pipeline("text-generation")`, and transformers' OpenAI-compatible server
(`diff-transformer serve`, i.e. `transformers serve` with the Diff classes) answering real HTTP requests on loopback.

Every answer is compared with `model.generate` (greedy) on the same prompt, in this process."""

import concurrent.futures
import json
import urllib.error
import urllib.request

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

from diff_transformer import DiffConfig, DiffForCausalLM
from tests.helpers.server import Server
from tests.serving import fixtures
from tests.serving.fixtures import CHATS, NEW_TOKENS, TINY_LLAMA


PROMPT = "It is a truth universally acknowledged"
# A small paged cache: the default sizes it from the device's memory, which on CPU costs ~20 s at start-up.
CB_OPTIONS = [
    "--continuous-batching",
    "--cb-block-size",
    "16",
    "--cb-num-blocks",
    "64",
    "--cb-max-batch-tokens",
    "256",
]


models, references = fixtures.models, fixtures.references  # the models served, and greedy `generate`'s answers

# One intra-op thread here too (see `Server`), restored afterwards.
pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ---- pipeline ----


@pytest.mark.parametrize("name", ["v2", "v1", "saved"])
def test_text_generation_pipeline_matches_generate(models, references, name):
    pipe = pipeline("text-generation", model=str(models[name]))
    assert type(pipe.model) is DiffForCausalLM and pipe.model.config.diff_version == (2 if name == "v2" else 1)

    model = AutoModelForCausalLM.from_pretrained(models[name]).eval()
    tokenizer = AutoTokenizer.from_pretrained(models[name])
    inputs = tokenizer(PROMPT, return_tensors="pt")
    expected = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)[0, inputs["input_ids"].shape[1] :]
    text = pipe(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False, return_full_text=False)[0]["generated_text"]
    assert text == tokenizer.decode(expected, skip_special_tokens=True)
    assert len(expected) > 5 and text.strip()

    # chat input: the pipeline applies the chat template and appends the assistant's reply
    reply = pipe(CHATS[0], max_new_tokens=NEW_TOKENS, do_sample=False)[0]["generated_text"][-1]
    assert reply == {"role": "assistant", "content": references(name, CHATS[0])[0]}


# ---- transformers serve ----


@pytest.mark.canary
def test_plain_transformers_serve_cannot_load_custom_code_models(models):
    """Why `diff-transformer serve` exists: transformers 5.23's server resolves `getattr(transformers,
    config.architectures[0])`, so `transformers serve --trust-remote-code` fails on any custom-code checkpoint.
    Canary for transformers' `ModelManager.load_model_and_processor`: when this starts failing, transformers fixed it
    and the plain command works too (update docs/serving.md)."""
    from transformers.cli.serving import model_manager

    assert not hasattr(model_manager.transformers, "DiffForCausalLM")  # nothing in this process patched it
    manager = model_manager.ModelManager(device="cpu", trust_remote_code=True)
    with pytest.raises(AttributeError, match="has no attribute DiffForCausalLM"):
        manager.load_model_and_processor(manager.process_model_name(str(models["v2"])))


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Two servers started together (start-up dominates): plain `generate`, and continuous batching."""
    logs = tmp_path_factory.mktemp("serve")
    started = {"plain": Server(logs / "plain.log"), "cb": Server(logs / "cb.log", *CB_OPTIONS)}
    try:
        for server in started.values():
            server.wait_healthy()
        yield started
    finally:
        for server in started.values():
            server.stop()


def chat(server, model_dir, messages, stream=False):
    """One greedy chat completion through the openai client: (text, completion_tokens, number of content chunks)."""
    kwargs = dict(model=str(model_dir), messages=messages, max_tokens=NEW_TOKENS, temperature=0)
    client = server.client()
    if not stream:
        response = client.chat.completions.create(**kwargs)
        assert response.choices[0].message.role == "assistant"
        return response.choices[0].message.content, response.usage.completion_tokens, 1
    pieces, usage = [], None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        usage = chunk.usage or usage
    return "".join(pieces), usage.completion_tokens, len(pieces)


@pytest.mark.parametrize("name", ["v2", "v1"])
def test_chat_completions_match_generate(servers, models, references, name):
    """Non-streaming and streaming (SSE) answers of the plain server equal greedy `generate` with the model's own
    generation config (the shipped one has repetition_penalty=1.3, which `generate` applies)."""
    expected, length = references(name, CHATS[0])
    assert chat(servers["plain"], models[name], CHATS[0]) == (expected, length, 1)
    text, tokens, chunks = chat(servers["plain"], models[name], CHATS[0], stream=True)
    assert (text, tokens) == (expected, length) and chunks > 1


def test_streaming_is_server_sent_events(servers, models, references):
    """The wire format, read with urllib: `text/event-stream`, `data: {json}` events, role first, finish last."""
    body = {
        "model": str(models["v2"]),
        "messages": CHATS[1],
        "max_tokens": NEW_TOKENS,
        "temperature": 0,
        "stream": True,
    }
    request = urllib.request.Request(
        f"{servers['plain'].url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        assert response.headers["Content-Type"].startswith("text/event-stream")
        lines = [line.decode() for line in response if line.strip()]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1].strip() == "data: [DONE]"  # OpenAI's end of stream, which raw SSE clients wait for
    events = [json.loads(line[len("data: ") :]) for line in lines[:-1]]
    assert {e["model"] for e in events} == {str(models["v2"])}
    assert events[0]["choices"][0]["delta"] == {"role": "assistant"}
    assert events[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
    assert text == references("v2", CHATS[1])[0]


@pytest.mark.parametrize("name", ["v2", "v1"])
def test_continuous_batching_matches_generate(servers, models, references, name):
    """Concurrent requests, batched together in the paged cache, each answer what greedy `generate` answers.
    transformers' continuous batching drops the repetition penalty (it logs "RepetitionPenaltyLogitsProcessor isn't
    supported by CB"), so the reference runs without it."""
    server = servers["cb"]
    with concurrent.futures.ThreadPoolExecutor(len(CHATS)) as pool:
        answers = list(pool.map(lambda messages: chat(server, models[name], messages), CHATS))
    for messages, (text, tokens, _) in zip(CHATS, answers):
        assert (text, tokens) == references(name, messages, repetition_penalty=1.0)
    text, tokens, chunks = chat(server, models[name], CHATS[2], stream=True)
    assert (text, tokens) == references(name, CHATS[2], repetition_penalty=1.0) and chunks > 1


@pytest.mark.slow  # 10-25 s (server starts, subprocesses): the full suite runs it, the quick loop does not
def test_max_tokens_is_bounded_and_sigterm_stops_a_busy_server(models, tmp_path):
    """Issue 21: `max_tokens: 100000000` generated without end (past the context, after the client left, through
    SIGTERM). Now every generation stops at the model's context, and SIGTERM ends the server within seconds."""
    import signal
    import threading

    server = Server(tmp_path / "serve.log")
    try:
        server.wait_healthy()
        messages = [{"role": "user", "content": "Tell me everything."}]
        client = server.client()
        response = client.chat.completions.create(
            model=str(models["v2"]), messages=messages, max_tokens=100_000_000, temperature=0
        )
        context = DiffConfig.from_pretrained(models["v2"]).max_position_embeddings
        usage = response.usage
        assert usage.prompt_tokens + usage.completion_tokens <= context, usage
        assert response.choices[0].finish_reason in ("length", "stop")

        started = threading.Event()

        def stream():
            try:
                for _ in client.chat.completions.create(
                    model=str(models["v2"]), messages=messages, max_tokens=100_000_000, temperature=0, stream=True
                ):
                    started.set()
            except Exception:
                pass

        threading.Thread(target=stream, daemon=True).start()
        assert started.wait(60)
        server.process.send_signal(signal.SIGTERM)
        server.process.wait(timeout=30)  # the old server kept generating the 10^8 tokens
    finally:
        if server.process.poll() is None:
            server.process.kill()
            server.process.wait()


def test_generation_limit_clamps_to_the_context_and_the_flag():
    from types import SimpleNamespace

    from fastapi import HTTPException

    from diff_transformer.serving.server import _generation_limit

    model = SimpleNamespace(
        config=DiffConfig(max_position_embeddings=64, hidden_size=32, num_attention_heads=2, diff_version=1)
    )
    inputs = {"input_ids": torch.zeros(1, 10, dtype=torch.long)}
    for asked, limit, expected in ((10**8, None, 54), (10**8, 7, 7), (5, 7, 5), (None, None, 54)):
        config = SimpleNamespace(max_new_tokens=asked)
        _generation_limit(model, inputs, config, limit)
        assert config.max_new_tokens == expected
    with pytest.raises(HTTPException, match="64 positions"):
        _generation_limit(model, {"input_ids": list(range(64))}, SimpleNamespace(max_new_tokens=1), None)
    with pytest.raises(HTTPException, match="num_beams=-3 must be >= 1"):  # a request's generation_config
        _generation_limit(model, inputs, SimpleNamespace(max_new_tokens=1, num_beams=-3), None)
    with pytest.raises(HTTPException, match="temperature=1e-30 is below 0.0001"):  # NaN probabilities otherwise
        _generation_limit(model, inputs, SimpleNamespace(max_new_tokens=1, temperature=1e-30), None)


def test_serve_refuses_a_missing_model_and_a_bad_limit(capsys):
    from diff_transformer import cli

    assert cli.main(["serve", "/nonexistent"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: MODEL '/nonexistent' is neither an existing directory nor a valid Hub model id: check the path, or "
        "pass an id like 'org/model'."
    )
    for option in ("--max-new-tokens-limit", "--max-queued-requests", "--max-loaded-models"):
        assert cli.main(["serve", option, "0"]) == 2
        assert f"{option} '0' must be a whole number >= 1" in capsys.readouterr().err
    # a local directory has no revisions (issue 46): one line before the server starts
    assert cli.main(["serve", f"{TINY_LLAMA}@rev1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"error: MODEL '{TINY_LLAMA}@rev1' names a revision of a local directory, which has none: name the directory "
        f"alone ('{TINY_LLAMA}')."
    )


# ---- what clients see: the model list, unknown models, refused fields (issue 32) ----


def test_models_list_unknown_models_and_refused_fields(servers, models, tmp_path):
    """`client.models.list()` works without a Hub cache folder (transformers answered 500) and lists what was loaded;
    a model that does not exist answers 404 at once, one that does not load 400 (transformers retried the Hub for
    ~2 minutes, then answered 500); `n` > 1 and `stop` are refused with 400. Every error is OpenAI's
    `{"error": {"message": ...}}` with a one-line message."""

    server = servers["plain"]
    client = server.client()
    listed = [m.id for m in client.models.list()]  # HF_HOME points to a folder that does not exist
    chat(server, models["v2"], CHATS[0])
    assert [m.id for m in client.models.list()] == [*dict.fromkeys([*listed, str(models["v2"])])]

    (tmp_path / "empty").mkdir()
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text('{"model_type": "no-such-family"}')
    cases = {
        str(tmp_path / "missing"): (openai.NotFoundError, "neither an existing directory nor a valid Hub model id"),
        "no-such-org/no-such-model": (openai.NotFoundError, "nor in the Hub cache, and the Hub is offline"),
        str(tmp_path / "empty"): (openai.BadRequestError, "a directory without config.json"),
        str(tmp_path / "broken"): (openai.BadRequestError, "cannot be loaded"),
    }
    for name, (error, words) in cases.items():  # the message says which check answered (not the Hub's retries)
        with pytest.raises(error) as caught:
            client.chat.completions.create(model=name, messages=CHATS[0], max_tokens=4)
        message = caught.value.body["message"]
        assert words in message and "\n" not in message, message
        assert caught.value.body["type"] in ("not_found_error", "invalid_request_error")

    with pytest.raises(openai.BadRequestError, match="n=2"):
        client.chat.completions.create(model=str(models["v2"]), messages=CHATS[0], max_tokens=4, n=2)
    with pytest.raises(openai.BadRequestError, match="n=2"):
        client.completions.create(model=str(models["v2"]), prompt=PROMPT, max_tokens=4, n=2)
    # n=1 and an empty stop are what the server does anyway: accepted
    response = client.chat.completions.create(
        model=str(models["v2"]), messages=CHATS[0], max_tokens=4, temperature=0, n=1, stop=[]
    )
    assert response.choices[0].message.content


@pytest.mark.slow  # 10-25 s (server starts, subprocesses): the full suite runs it, the quick loop does not
def test_pinned_servers_list_their_models_and_refuse_others(models, references, tmp_path):
    """`serve MODEL` answers for MODEL (requests may omit it); `serve A B` for A and B, both listed by /v1/models
    before any request has loaded them. Any other name is a 404 (as `serve --help` says; the pinned server answered
    400), and a response names the model as /v1/models lists it (transformers said "MODEL@main")."""
    one = Server(tmp_path / "one.log", str(models["v1"]))
    two = Server(tmp_path / "two.log", str(models["v2"]), str(models["saved"]))
    try:
        one.wait_healthy()
        two.wait_healthy()
        client = one.client()
        assert [m.id for m in client.models.list()] == [str(models["v1"])]
        text, _, _ = chat(one, models["v1"], CHATS[0])
        assert text == references("v1", CHATS[0])[0]
        response = client.chat.completions.create(model=str(models["v1"]), messages=CHATS[0], max_tokens=4)
        assert response.model == str(models["v1"])
        with pytest.raises(openai.NotFoundError, match="pinned") as caught:
            client.chat.completions.create(model=str(models["v2"]), messages=CHATS[0], max_tokens=4)
        assert caught.value.body["param"] == "model" and caught.value.body["code"] == "model_not_found"

        client = two.client()
        served = [str(models["v2"]), str(models["saved"])]
        assert [m.id for m in client.models.list()] == served  # nothing loaded yet
        for name in ("v2", "saved"):
            response = client.chat.completions.create(
                model=str(models[name]), messages=CHATS[0], max_tokens=NEW_TOKENS, temperature=0
            )
            assert response.model == str(models[name])
            assert response.choices[0].message.content == references(name, CHATS[0])[0]
        assert [m.id for m in client.models.list()] == served
        with pytest.raises(openai.NotFoundError, match="not served here: this server answers for"):
            client.chat.completions.create(model=str(models["v1"]), messages=CHATS[0], max_tokens=4)
        with pytest.raises(openai.BadRequestError, match="name the model"):
            client.chat.completions.create(model=None, messages=CHATS[0], max_tokens=4)
    finally:
        one.stop()
        two.stop()


def test_serve_help_is_the_package_s_own(capsys, monkeypatch):
    """`serve --help`: our options first, then a short note of what goes to transformers (every option the note names
    is one of transformers' `Serve`: a canary for renames), its paragraphs filled to the terminal's width (they were
    the source's 116-column lines)."""
    import inspect
    import re

    from transformers.cli.serve import Serve

    from diff_transformer import cli

    monkeypatch.setenv("COLUMNS", "72")  # argparse reads the width from the terminal, else from COLUMNS
    with pytest.raises(SystemExit) as exit_:
        cli.main(["serve", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: diff-transformer serve [MODEL ...] [--max-new-tokens-limit N]")
    assert out.index("--max-new-tokens-limit N") < out.index("Every other option goes to transformers' server")
    assert "POST /v1/responses" not in out  # transformers' help listed endpoints this package does not test
    named = set(re.findall(r"--([a-z][a-z-]+)", out.split("Every other option")[1])) - {"transformers-help"}
    accepted = {name.replace("_", "-") for name in inspect.signature(Serve.__init__).parameters} - {"self"}
    assert named and named <= accepted, named - accepted
    note = out.split("Every other option")[1]
    assert max(map(len, note.splitlines())) <= 72 - 2 and note.count("\n\n") >= 1  # argparse keeps 2 columns free


def test_a_model_loads_off_the_event_loop():
    """transformers' handlers load the requested model on the event loop, so /health and every other request waited
    for it; `load_off_the_loop` (run first by each handler) loads it in a worker thread while the loop runs on."""
    import asyncio
    import threading
    import time
    from types import SimpleNamespace

    from diff_transformer.serving.models import load_off_the_loop

    loaded, released = [], []

    class Manager:
        force_model = None

        def process_model_name(self, model):
            return f"{model}@main"

        def acquire(self, key, gguf_file=None):
            time.sleep(0.5)
            loaded.append((key, gguf_file, threading.current_thread() is threading.main_thread()))
            return None, None, lambda: released.append(key)

    handler = SimpleNamespace(model_manager=Manager(), _validate_request=lambda body: None)

    async def ticks_during_the_load():
        ticks = 0

        async def tick():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticker = asyncio.create_task(tick())
        release = await load_off_the_loop(handler, {"model": "org/model"})
        ticker.cancel()
        release()  # the pin it took
        return ticks

    assert asyncio.run(ticks_during_the_load()) >= 10  # the loop ran on during the 0.5 s load
    assert loaded == [("org/model@main", None, False)] and released == ["org/model@main"]  # in a worker thread
    Manager.force_model = "pinned"  # loaded at start-up: nothing to do
    assert asyncio.run(load_off_the_loop(handler, {"model": "org/model"})) is None
    assert len(loaded) == 1


# ---- stop strings, [DONE], model names, request fields (issues 45 and 46) ----


def sse(server, path, body):
    """A raw SSE client: the `data:` payloads of a streamed request, read until `data: [DONE]` (which must come)."""
    request = urllib.request.Request(
        f"{server.url}{path}", data=json.dumps({**body, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    events = []
    with urllib.request.urlopen(request, timeout=120) as response:
        for line in response:
            line = line.decode().strip()
            if not line:
                continue
            assert line.startswith("data: "), line
            if line == "data: [DONE]":
                return events
            events.append(json.loads(line[len("data: ") :]))
    pytest.fail(f"the stream ended without data: [DONE] after {len(events)} events")


def tokens_through(tokenizer, text_tokens, stop):
    """How many of the tokens TEXT_TOKENS it takes for their text to contain STOP (what `generate` produced)."""
    texts = (tokenizer.decode(text_tokens[:k], skip_special_tokens=True) for k in range(1, len(text_tokens) + 1))
    return 1 + next(k for k, text in enumerate(texts) if stop in text)


@pytest.mark.parametrize("server_name", ["plain", "cb"])
def test_stop_strings_cut_the_answer_where_openai_does(servers, models, server_name):
    """`stop` (a string or a list): the answer is greedy `generate`'s text cut before the first stop string (which
    is not in it) and finish_reason is "stop", through the openai client and a raw SSE client, chat and completions,
    streaming or not; a stop string the answer never reaches leaves it whole ("length"). The plain server ends the
    generation at the token that completes the stop string (`usage` counts exactly those tokens)."""
    server = servers[server_name]
    client = server.client()
    model = AutoModelForCausalLM.from_pretrained(models["v2"]).eval()
    tokenizer = AutoTokenizer.from_pretrained(models["v2"])
    penalty = {"repetition_penalty": 1.0} if server_name == "cb" else {}  # continuous batching drops it
    chat_ids = tokenizer.apply_chat_template(
        CHATS[0], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    plain_ids = tokenizer(PROMPT, return_tensors="pt")
    for kind, inputs in (("chat", chat_ids), ("completion", plain_ids)):
        out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False, **penalty)
        generated = out[0, inputs["input_ids"].shape[1] :].tolist()
        full = tokenizer.decode(generated, skip_special_tokens=True)
        words = full.split()
        assert len(words) > 6, full
        stop = f" {words[4]}"  # the fifth word: its first occurrence cuts the answer
        expected = full[: full.find(stop)]
        for asked in (stop, ["never in the answer", stop]):
            body = {"model": str(models["v2"]), "max_tokens": NEW_TOKENS, "temperature": 0, "stop": asked}
            if kind == "chat":
                body["messages"] = CHATS[0]
                response = client.chat.completions.create(**body)
                text = response.choices[0].message.content
                streamed = "".join(
                    chunk.choices[0].delta.content or ""
                    for chunk in client.chat.completions.create(**body, stream=True)
                    if chunk.choices
                )
                raw = sse(server, "/v1/chat/completions", body)
                raw_text = "".join(e["choices"][0]["delta"].get("content") or "" for e in raw)
            else:
                body["prompt"] = PROMPT
                response = client.completions.create(**body)
                text = response.choices[0].text
                streamed = "".join(c.choices[0].text for c in client.completions.create(**body, stream=True))
                raw = sse(server, "/v1/completions", body)
                raw_text = "".join(e["choices"][0]["text"] for e in raw)
            assert text == streamed == raw_text == expected, (kind, asked, full)
            assert response.choices[0].finish_reason == "stop" == raw[-1]["choices"][0]["finish_reason"]
            assert response.model == str(models["v2"]) and {e["model"] for e in raw} == {str(models["v2"])}
            if server_name == "plain":
                assert response.usage.completion_tokens == tokens_through(tokenizer, generated, stop)
        body = {"model": str(models["v2"]), "max_tokens": NEW_TOKENS, "temperature": 0, "stop": "never in it"}
        if kind == "chat":
            response = client.chat.completions.create(messages=CHATS[0], **body)
            assert response.choices[0].message.content == full
        else:
            response = client.completions.create(prompt=PROMPT, **body)
            assert response.choices[0].text == full
        assert response.choices[0].finish_reason == "length"


def test_stop_text_holds_back_only_what_could_begin_a_stop_string():
    """`StopText` against a direct reference: fed in any pieces, it shows the text before the stop string completed
    first (where generation stops, as vLLM and OpenAI do), and
    at every point it holds back exactly the longest tail that is a proper prefix of a stop string."""
    import random

    from diff_transformer.serving.requests import StopText

    rng = random.Random(0)
    for _ in range(2000):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 20)))
        # where the answer ends: at the first character that completes a stop string (the longest one ending there)
        starts = (
            min((e - len(s) for s in stops if text[:e].endswith(s)), default=None) for e in range(1, len(text) + 1)
        )
        first = next((start for start in starts if start is not None), None)
        cut, shown, fed = StopText(stops), "", 0
        while fed < len(text) and not cut.stopped:
            step = rng.randint(1, 4)
            shown += cut.feed(text[fed : fed + step])
            fed += step
            if not cut.stopped:
                so_far = text[:fed]
                held = max(
                    (j for s in stops for j in range(1, len(s)) if so_far.endswith(s[:j])),
                    default=0,
                )
                assert shown == so_far[: len(so_far) - held], (stops, text, fed)
        if first is None:
            assert not cut.stopped and shown + cut.flush() == text
        else:
            assert cut.stopped and shown == text[:first], (stops, text)


@pytest.mark.parametrize(
    "extra, param, words",
    [
        ({"max_tokens": 0}, "max_tokens", "max_tokens=0 must be an integer >= 1"),
        ({"max_tokens": -5}, "max_tokens", "max_tokens=-5 must be an integer >= 1"),
        ({"max_tokens": "5"}, "max_tokens", "must be an integer"),
        ({"seed": 10**30}, "seed", "seed=1000000000000000000000000000000 must be an integer >= -9223372036854775808"),
        ({"logit_bias": {"abc": 1}}, "logit_bias", "logit_bias key 'abc' must be a token id"),
        ({"logit_bias": {"5": 1000}}, "logit_bias", "must be a number from -100 to 100"),
        ({"logit_bias": {"99999": 1}}, "logit_bias", "logit_bias names token 99999: the model's vocabulary has"),
        ({"logit_bias": [1]}, "logit_bias", "logit_bias must be an object"),
        ({"temperature": "hot"}, "temperature", "temperature='hot' must be a number"),
        ({"top_p": 0}, "top_p", "top_p=0 must be a number > 0"),
        ({"frequency_penalty": -1}, "frequency_penalty", "frequency_penalty=-1 must be a number > -1"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "stop has 5 strings: at most 4"),
        ({"stop": ["x" * 257]}, "stop", "each stop string must have 1 to 256 characters (got 257)"),
        ({"stop": [""]}, "stop", "each stop string must have 1 to 256 characters (got 0)"),
        ({"stop": 5}, "stop", "stop must be a string or a list of strings"),
        ({"stream": "yes"}, "stream", "stream='yes' must be true or false"),
        ({"messages": "hi"}, "messages", "messages must be a list of objects"),
        ({"messages": [{"content": "hi"}]}, "messages[0].role", "messages[0] needs a role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "must be a string or a list"),
        ({"generation_config": "nope"}, "generation_config", "generation_config must be a string holding a JSON"),
        ({"generation_config": '{"stop_strings": ["a", "b", "c", "d", "e"]}'}, "generation_config", "at most 4"),
        ({"model": 5}, "model", "model=5 must be a string"),
        ({"messages": [{"role": "user", "content": "a \ud800 b"}]}, None, "lone surrogate (U+D800)"),  # Trust 4 (3)
    ],
)
def test_bad_request_fields_are_400s_with_openai_s_error_body(servers, models, extra, param, words):
    """Issue 46: max_tokens 0 or -5, a huge seed, a bad logit_bias answered a plain-text 500. Every field is now
    checked in one place (`serving.requests.check_request`) and answered like OpenAI's API: a 400 whose body is
    `{"error": {"message", "type": "invalid_request_error", "param", "code"}}`."""
    body = {"model": str(models["v2"]), "messages": CHATS[0], "max_tokens": 4, **extra}
    request = urllib.request.Request(
        f"{servers['plain'].url}/v1/chat/completions", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=60)
    assert caught.value.code == 400
    error = json.load(caught.value)["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["code"] == "invalid_value"
    assert words in error["message"] and "\n" not in error["message"], error


# ---- the server's work budget: queued requests, loaded models (issue 46, Trust 4 item 5) ----


def post(server, path, body):
    """(status, headers, JSON body) of one POST, errors included."""
    request = urllib.request.Request(
        f"{server.url}{path}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.headers, json.load(response)
    except urllib.error.HTTPError as error:
        return error.code, error.headers, json.load(error)


def post_when_free(server, path, body):
    """POST, and again after Retry-After while the server answers 429 (a place frees when a request's answer has
    gone out, which the client may see a moment before the server counts it)."""
    import time

    for _ in range(100):
        status, headers, answer = post(server, path, body)
        if status != 429:
            return status, headers, answer
        time.sleep(int(headers["Retry-After"]))
    pytest.fail(f"still 429 after 100 tries: {answer}")


def test_the_queue_bound_answers_429_past_its_requests_and_frees_places():
    """`QueueBound` (the ASGI middleware of --max-queued-requests) on a stand-in app that holds each request until
    told: with the bound at 1, a POST that arrives while one is held is answered at once with 429, a Retry-After
    header and OpenAI's error body, without reaching the app; GETs (/health, /v1/models) pass; when the held request
    ends its place is free again, and a body sent in pieces reaches the app whole."""
    import asyncio

    from diff_transformer.serving.server import QueueBound

    async def scenario():
        release, reached = asyncio.Event(), asyncio.Queue()

        async def app(scope, receive, send):
            body = b""
            while True:
                message = await receive()
                body += message.get("body", b"")
                if not message.get("more_body"):
                    break
            await reached.put((scope["method"], body))
            if scope["method"] == "POST":
                await release.wait()
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})

        bound = QueueBound(app, limit=1)

        async def call(method, *pieces):
            messages = [
                {"type": "http.request", "body": p, "more_body": i < len(pieces) - 1} for i, p in enumerate(pieces)
            ]
            sent = []

            async def receive():
                if messages:
                    return messages.pop(0)
                await asyncio.Event().wait()  # the client stays connected

            async def send(message):
                sent.append(message)

            await bound({"type": "http", "method": method, "path": "/v1/chat/completions"}, receive, send)
            status = sent[0]["status"]
            return status, dict(sent[0]["headers"]), b"".join(m.get("body", b"") for m in sent[1:])

        first = asyncio.create_task(call("POST", b'{"a": 1}'))
        assert await reached.get() == ("POST", b'{"a": 1}')
        status, headers, body = await call("POST", b'{"b": 2}')
        assert status == 429 and int(headers[b"retry-after"]) >= 1
        error = json.loads(body)["error"]
        assert error["code"] == "rate_limit_exceeded" and "--max-queued-requests 1" in error["message"]
        assert "\n" not in error["message"]
        assert reached.empty()  # the refused request never reached the app
        assert (await call("GET", b""))[0] == 200 and await reached.get() == ("GET", b"")
        release.set()
        assert (await first)[0] == 200
        assert (await call("POST", b'{"c":', b" 3}"))[0] == 200
        assert await reached.get() == ("POST", b'{"c": 3}')
        assert bound.in_flight == 0

    asyncio.run(scenario())


def test_one_copy_per_local_model_and_at_most_max_loaded_models(models, tmp_path):
    """transformers' model manager keys a model by "name@revision": every made-up revision of one local directory
    loaded another copy (30 requests, 33 models listed, +280 MB), and nothing bounded how many models stay loaded
    (until --model-timeout, 300 s idle). `DIR@rev` is now refused (a directory has no revisions), `DIR@main` is DIR,
    and loading past --max-loaded-models unloads the least recently used model."""
    import shutil

    from diff_transformer.serving import models as serving_models
    from diff_transformer.serving.patches import ServeSettings

    third = tmp_path / "v2-copy"
    shutil.copytree(models["v2"], third)
    manager = serving_models.diff_model_manager(ServeSettings(max_loaded_models=2))(device="cpu", model_timeout=-1)
    loads = []
    original = type(manager)._load_model  # the class `diff_model_manager` made for this manager alone

    def counted(self, model_id_and_revision, *args, **kwargs):
        loads.append(model_id_and_revision)
        return original(self, model_id_and_revision, *args, **kwargs)

    type(manager)._load_model = counted
    try:
        v2, v1 = str(models["v2"]), str(models["v1"])
        for name in (v2, f"{v2}@main", v2):
            manager.load_model_and_processor(manager.process_model_name(name))
        for revision in ("rev1", "0123abc", "v2"):
            with pytest.raises(Exception) as caught:
                manager.load_model_and_processor(f"{v2}@{revision}")
            assert caught.value.status_code == 400
            message = caught.value.detail["message"]
            assert "names a revision of a local directory, which has none" in message and repr(v2) in message
        assert loads == [f"{v2}@main"]
        assert [m["id"] for m in manager.get_gen_models() if m["owned_by"] == "diff-transformer"] == [v2]

        manager.load_model_and_processor(f"{v1}@main")
        manager.load_model_and_processor(f"{v2}@main")  # v2 used last: v1 is the least recently used
        manager.load_model_and_processor(f"{third}@main")
        assert sorted(manager.loaded_models) == sorted([f"{v2}@main", f"{third}@main"])
        assert loads == [f"{v2}@main", f"{v1}@main", f"{third}@main"]
        manager.load_model_and_processor(f"{v1}@main")  # loaded again, the least recently used (v2) unloaded
        assert sorted(manager.loaded_models) == sorted([f"{third}@main", f"{v1}@main"])
        assert len(loads) == 4
    finally:
        type(manager)._load_model = original
        manager.shutdown()


@pytest.mark.slow  # 10-25 s (server starts, subprocesses): the full suite runs it, the quick loop does not
def test_a_busy_server_answers_429_and_serves_one_copy_of_a_local_model(models, tmp_path):
    """Issue 46: a 3-token request waited 101 s behind 16 long ones. With --max-queued-requests 1, a request that
    arrives while a stream is generating is answered at once with 429, Retry-After and OpenAI's error body, and is
    answered once that stream's client has gone; `DIR@rev1` is a 400 naming the directory, DIR and `DIR@main` are one
    model, and with --max-loaded-models 1 a request for another model unloads the first (/v1/models lists one)."""
    server = Server(tmp_path / "serve.log", "--max-queued-requests", "1", "--max-loaded-models", "1")
    try:
        server.wait_healthy()
        v2, v1 = str(models["v2"]), str(models["v1"])
        short = {"model": v2, "messages": CHATS[0], "max_tokens": 3, "temperature": 0}
        long = {**short, "max_tokens": 100_000, "stream": True}  # to the end of the 512-position context
        request = urllib.request.Request(
            f"{server.url}/v1/chat/completions", data=json.dumps(long).encode(),
            headers={"Content-Type": "application/json"},
        )  # fmt: skip
        stream = urllib.request.urlopen(request, timeout=120)
        try:
            assert stream.readline().startswith(b"data: ")  # generating: the one place is taken
            status, headers, answer = post(server, "/v1/chat/completions", short)
        finally:
            stream.close()  # the client leaves: the generation stops at its next token
        assert status == 429, answer
        assert int(headers["Retry-After"]) >= 1
        assert answer["error"]["code"] == "rate_limit_exceeded", answer
        assert "--max-queued-requests 1" in answer["error"]["message"]
        with urllib.request.urlopen(f"{server.url}/health", timeout=30) as health:  # GETs are not counted
            assert health.status == 200
        status, _, answer = post_when_free(server, "/v1/chat/completions", short)
        assert status == 200 and answer["usage"]["completion_tokens"] <= 3, answer

        status, _, answer = post_when_free(server, "/v1/chat/completions", {**short, "model": f"{v2}@rev1"})
        assert status == 400 and "names a revision of a local directory" in answer["error"]["message"], answer
        assert answer["error"]["param"] == "model"
        assert post_when_free(server, "/v1/chat/completions", {**short, "model": f"{v2}@main"})[0] == 200
        listed = server.client().models.list()
        assert [m.id for m in listed] == [v2]
        assert post_when_free(server, "/v1/chat/completions", {**short, "model": v1})[0] == 200
        assert [m.id for m in server.client().models.list()] == [v1]  # v2 unloaded: one model at a time
    finally:
        server.stop()
