"""What OpenAI clients send to `diff-transformer serve` and read back, in one place.

* `check_request`: every request field transformers' handlers would turn into a 500 (an int() or a torch call deep
  inside generation) or silently ignore, checked before anything runs; a bad one is a 400 with OpenAI's error body
  (`{"error": {"message", "type": "invalid_request_error", "param", "code"}}`, written by `server.openai_errors`).
* `stop`: transformers maps it to `generation_config.stop_strings`, keeps the stop text in the answer, ignores it under
  continuous batching, and builds a `StopStringCriteria` whose set-up scans the whole vocabulary for each stop
  character (0.96 s for four 256-character stops on the tiny model's 2,048 tokens, 2 shared CPU cores; it grows with
  the vocabulary). Here the stop
  strings leave the generation config (`stop_generation`): `StopOnText` ends `generate` at the token that completes
  one (incremental decoding, a few microseconds per token), `StopText` cuts the text before it, holding back while
  streaming only what could still begin one, and continuous batching's request is cancelled there.
* `as_openai`: a response names the model as the client did (transformers answered "model@main"), finish_reason is
  "stop" when a stop string ended the answer, and an SSE stream ends with `data: [DONE]` (OpenAI's and vLLM's end
  marker, which raw SSE clients wait for).
"""

import asyncio
import json
import math

from ..text_input import TextInputError, check_strings


MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_STOP_CHARS = 256  # per stop string: the text a stream holds back while it could still be one
MAX_LOGIT_BIAS = 1024  # entries: each one is a bias on one token at every step
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.manual_seed accepts


def http_error(status: int, message: str, *, param: str | None = None, code: str | None = None):
    """An HTTPException `server.openai_errors` writes as OpenAI's error body, its message on one line."""
    from fastapi import HTTPException

    detail = {"message": " ".join(message.split()), "param": param, "code": code}
    return HTTPException(status_code=status, detail=detail)


def _invalid(param: str | None, message: str):
    return http_error(400, message, param=param, code="invalid_value")


def _number(body: dict, field: str, low: float, high: float, *, open_low: bool = False, integer: bool = False):
    value = body.get(field)
    if value is None:
        return
    kind = "an integer" if integer else "a number"
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        raise _invalid(field, f"{field}={value!r} must be {kind}.")
    if not math.isfinite(value) or (value <= low if open_low else value < low) or value > high:
        bound = f"{'>' if open_low else '>='} {low}" + ("" if high == math.inf else f" and <= {high}")
        raise _invalid(field, f"{field}={value!r} must be {kind} {bound}.")


def check_request(body: dict) -> None:
    """A request's fields, checked before transformers' handler runs (it calls `_validate_request` first): a 400
    naming the field and the fix, instead of a plain-text 500 or a field silently ignored."""
    _check_shapes(body)
    try:
        check_strings(body, "the request")  # JSON's "\ud800" reaches the tokenizer as a lone surrogate
    except TextInputError as error:
        raise _invalid(None, str(error)) from None
    n = body.get("n")
    if n is not None and n != 1:
        raise _invalid("n", f"n={n!r}: this server answers one choice per request: omit n (or send 1).")
    for field in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        _number(body, field, 1, math.inf, integer=True)
    _number(body, "seed", *SEED_RANGE, integer=True)
    _number(body, "temperature", 0, 2)
    _number(body, "top_p", 0, 1, open_low=True)
    _number(body, "presence_penalty", -2, 2)
    # transformers turns frequency_penalty into repetition_penalty = 1 + frequency_penalty, which must stay > 0
    _number(body, "frequency_penalty", -1, 2, open_low=True)
    if body.get("stream") is not None and not isinstance(body["stream"], bool):
        raise _invalid("stream", f"stream={body['stream']!r} must be true or false.")
    _check_logit_bias(body.get("logit_bias"))
    _check_generation_config(body.get("generation_config"))
    body_stop = body.get("stop")
    if body_stop in ([], ""):  # no stop string (transformers' generate fails on an empty list)
        del body["stop"]
    elif body_stop is not None:
        body["stop"] = stop_strings(body_stop)


def _check_shapes(body: dict) -> None:
    """The structured fields, of the types the handlers index into (a wrong one was a TypeError, a 500)."""
    if "model" in body and not (body["model"] is None or isinstance(body["model"], str)):
        raise _invalid("model", f"model={body['model']!r} must be a string: a model directory or Hub id.")
    if isinstance(body.get("model"), str) and body["model"].partition("@")[0].strip() == "":
        raise _invalid(
            "model", f"model={body['model']!r} names no model: name a model directory or Hub id, or omit it."
        )
    for field in ("chat_template_kwargs",):
        if body.get(field) is not None and not isinstance(body[field], dict):
            raise _invalid(field, f"{field} must be an object.")
    if body.get("tools") is not None and not (
        isinstance(body["tools"], list) and all(isinstance(tool, dict) for tool in body["tools"])
    ):
        raise _invalid("tools", "tools must be a list of objects.")
    messages = body.get("messages")
    if messages is None:
        return
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise _invalid("messages", "messages must be a list of objects, each with a role and a content.")
    for index, message in enumerate(messages):
        content = message.get("content")
        parts_ok = isinstance(content, list) and all(isinstance(p, dict) and "type" in p for p in content)
        if not isinstance(message.get("role"), str):
            raise _invalid(f"messages[{index}].role", f'messages[{index}] needs a role (a string, e.g. "user").')
        if not (content is None or isinstance(content, str) or parts_ok or "tool_calls" in message):
            raise _invalid(
                f"messages[{index}].content",
                f"messages[{index}].content must be a string or a list of content parts (objects with a type).",
            )


def stop_strings(stop) -> list[str]:
    """`stop` as OpenAI takes it (a string or a list of up to 4), as a list; anything else is a 400."""
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise _invalid("stop", "stop must be a string or a list of strings.")
    if len(stops) > MAX_STOP_STRINGS:
        raise _invalid("stop", f"stop has {len(stops)} strings: at most {MAX_STOP_STRINGS}.")
    for s in stops:
        if not s or len(s) > MAX_STOP_CHARS:
            raise _invalid("stop", f"each stop string must have 1 to {MAX_STOP_CHARS} characters (got {len(s)}).")
    return stops


def _check_logit_bias(bias) -> None:
    if bias is None:
        return
    if not isinstance(bias, dict):
        raise _invalid("logit_bias", "logit_bias must be an object mapping token ids to biases from -100 to 100.")
    if len(bias) > MAX_LOGIT_BIAS:
        raise _invalid("logit_bias", f"logit_bias has {len(bias)} entries: at most {MAX_LOGIT_BIAS}.")
    for key, value in bias.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 12):
            raise _invalid("logit_bias", f"logit_bias key {key!r} must be a token id (a whole number >= 0).")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise _invalid("logit_bias", f"logit_bias[{key!r}]={value!r} must be a number from -100 to 100.")


def _check_generation_config(text) -> None:
    """transformers' extension field: a JSON object of generation settings, read with GenerationConfig(**...)."""
    if text is None:
        return
    from transformers import GenerationConfig

    from ..generation.config import generation_value_problem

    try:
        settings = json.loads(text) if isinstance(text, str) else None
    except ValueError:
        settings = None
    if not isinstance(settings, dict):
        raise _invalid("generation_config", "generation_config must be a string holding a JSON object.")
    try:
        GenerationConfig(**settings)
    except Exception as exc:
        message = " ".join(str(exc).split())[:200].rstrip(".")
        raise _invalid("generation_config", f"generation_config is invalid: {message}.")
    if settings.get("stop_strings") is not None:  # honoured as `stop` is (`_stops_of`), so bounded as it is
        try:
            stop_strings(settings["stop_strings"])
        except Exception as exc:
            raise _invalid("generation_config", f"in generation_config, stop_strings: {exc.detail['message']}")
    for field, value in settings.items():
        problem = generation_value_problem(field, value)
        if problem:
            raise _invalid("generation_config", f"in generation_config, {problem}.")


def check_token_ids(gen_config, vocab_size: int | None) -> None:
    """logit_bias's token ids (transformers' `sequence_bias`) inside the model's vocabulary."""
    bias = getattr(gen_config, "sequence_bias", None) or {}
    outside = [ids[0] for ids in bias if vocab_size is not None and ids[0] >= vocab_size]
    if outside:
        raise _invalid("logit_bias", f"logit_bias names token {outside[0]}: the model's vocabulary has {vocab_size}.")


# ---- stop strings ----


class StopText:
    """Text cut before the first stop string to be completed, fed piece by piece: `feed` returns what may be shown now
    (holding back a tail that could still begin a stop string), `stopped` says a stop string was met, `flush` the held
    tail."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.held = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        if self.stopped:
            return ""
        text = self.held + text
        # the stop string completed first ends the answer (as generation stops there); of two completed by the same
        # character, the longer
        found = [(i + len(s), i) for s, i in ((s, text.find(s)) for s in self.stops) if i >= 0]
        if found:
            self.stopped, self.held = True, ""
            return text[: min(found)[1]]
        # the longest tail of `text` that is a proper prefix of a stop string: it may yet complete one
        keep = max(
            (j for s in self.stops for j in range(min(len(s) - 1, len(text)), 0, -1) if text.endswith(s[:j])),
            default=0,
        )
        self.held = text[len(text) - keep :]
        return text[: len(text) - keep]

    def flush(self) -> str:
        held, self.held = self.held, ""
        return held


def stop_on_text_criteria():
    """`StopOnText` (a transformers StoppingCriteria), built on first use: transformers imports torch."""
    import torch
    from tokenizers.decoders import DecodeStream
    from transformers import StoppingCriteria

    class StopOnText(StoppingCriteria):
        """Ends `generate` (batch of one) at the token whose text completes a stop string: the new tokens are decoded
        incrementally and only the last characters are searched, so a step costs microseconds whatever the vocabulary
        (transformers' StopStringCriteria pre-scans the vocabulary per stop character)."""

        def __init__(self, tokenizer, stops: list[str], prompt_length: int):
            self.tokenizer = getattr(tokenizer, "tokenizer", tokenizer)._tokenizer  # the Rust tokenizer
            self.decoder = DecodeStream([], skip_special_tokens=True)
            self.stops = stops
            self.longest = max(len(s) for s in stops)
            self.seen = prompt_length
            self.tail = ""

        def __call__(self, input_ids, scores, **kwargs):
            new = input_ids[0, self.seen :].tolist()
            self.seen = input_ids.shape[-1]
            for token in new:
                self.tail += self.decoder.step(self.tokenizer, token) or ""
            hit = any(s in self.tail for s in self.stops)
            self.tail = self.tail[-(self.longest - 1) :] if self.longest > 1 else ""
            return torch.full((input_ids.shape[0],), hit, dtype=torch.bool, device=input_ids.device)

    return StopOnText


class StopQueue:
    """The queue a streaming handler reads (`get`, `get_nowait`), with the text cut at the first stop string: the
    generation is cancelled there and the stream ends (None), held-back text is released at the end."""

    def __init__(self, queue: asyncio.Queue, streamer, stops: list[str], state):
        self.queue, self.streamer, self.state = queue, streamer, state
        self.text = StopText(stops)
        self.ready: list = []

    def _take(self, item) -> None:
        from transformers.cli.serving.utils import ReasoningText, ToolCall

        if self.text.stopped:
            return
        if item is None or isinstance(item, ToolCall):
            held = self.text.flush()
            self.ready += [held] if held else []
            self.ready.append(item)
        elif isinstance(item, str) and not isinstance(item, ReasoningText):
            shown = self.text.feed(item)
            self.ready += [shown] if shown else []
            if self.text.stopped:
                if self.state is not None:
                    self.state.stopped = True
                self.streamer.cancel()  # model.generate raises at its next token; continuous batching drops it
                self.ready.append(None)
        else:
            self.ready.append(item)

    async def get(self):
        while not self.ready:
            self._take(await self.queue.get())
        return self.ready.pop(0)

    def get_nowait(self):
        while not self.ready:
            self._take(self.queue.get_nowait())  # raises asyncio.QueueEmpty as the handler expects
        return self.ready.pop(0)


def _stops_of(gen_config) -> list[str] | None:
    """The request's stop strings, taken out of its generation config (where transformers put them: its
    StopStringCriteria would pre-scan the vocabulary, and the text would keep the stop string)."""
    stops = getattr(gen_config, "stop_strings", None)
    if not stops:
        return None
    gen_config.stop_strings = None
    return [stops] if isinstance(stops, str) else list(stops)


def _state_of(states, args, kwargs):
    """The state of the request a generate manager's call serves: transformers passes its `request_id` (keyword)."""
    request_id = kwargs.get("request_id", args[0] if args else None)
    return states.get(request_id) if states is not None else None


def stop_streaming(manager_method, states=None):
    """`generate_streaming` of transformers' generate managers, honouring the request's stop strings (and marking
    them met in the request's state, from STATES)."""

    def generate_streaming(self, model, processor, inputs, gen_config, *args, **kwargs):
        stops = _stops_of(gen_config)
        if stops is None:
            return manager_method(self, model, processor, inputs, gen_config, *args, **kwargs)
        inputs = _with_stop_criteria(self, processor, inputs, stops)
        queue, streamer = manager_method(self, model, processor, inputs, gen_config, *args, **kwargs)
        return StopQueue(queue, streamer, stops, _state_of(states, args, kwargs)), streamer

    return generate_streaming


def stop_non_streaming(manager_method, states=None):
    """`generate_non_streaming`, honouring the request's stop strings: the text cut before the first one, and the
    token ids cut after the token that completed it (what `usage` counts and the response parser reads)."""

    async def generate_non_streaming(self, model, processor, inputs, gen_config, *args, **kwargs):
        stops = _stops_of(gen_config)
        if stops is None:
            return await manager_method(self, model, processor, inputs, gen_config, *args, **kwargs)
        inputs = _with_stop_criteria(self, processor, inputs, stops)
        answer = await manager_method(self, model, processor, inputs, gen_config, *args, **kwargs)
        text, input_length, generated = answer
        cut = StopText(stops)
        shown = cut.feed(text)
        if not cut.stopped:
            return answer
        state = _state_of(states, args, kwargs)
        if state is not None:
            state.stopped = True
        return shown, input_length, _through_stop(processor, generated, stops)

    return generate_non_streaming


def _with_stop_criteria(manager, processor, inputs, stops: list[str]):
    """`inputs` with a `stopping_criteria` for `model.generate` (transformers' GenerateManager passes every key of
    `inputs` to it); continuous batching takes no criteria: its streams are cancelled at the stop string instead."""
    from transformers.cli.serving.utils import GenerateManager

    if not isinstance(manager, GenerateManager):
        return inputs
    from transformers import StoppingCriteriaList

    input_ids = inputs["input_ids"]
    prompt_length = len(input_ids) if isinstance(input_ids, list) else input_ids.shape[-1]
    criteria = StoppingCriteriaList([stop_on_text_criteria()(processor, stops, prompt_length)])
    return {**inputs, "stopping_criteria": criteria}


def _through_stop(processor, generated, stops: list[str]):
    """The shortest prefix of the token ids GENERATED whose text holds a stop string (binary search: a longer prefix's
    text extends a shorter one's)."""
    tokens = list(generated.tolist() if hasattr(generated, "tolist") else generated)

    def holds(k: int) -> bool:
        text = processor.decode(tokens[:k], skip_special_tokens=True)
        return any(s in text for s in stops)

    low, high = 1, len(tokens)
    if not tokens or not holds(high):
        return generated
    while low < high:
        middle = (low + high) // 2
        low, high = (low, middle) if holds(middle) else (middle + 1, high)
    return generated[:low]


# ---- responses as OpenAI's ----


def model_name(manager, body: dict) -> str | None:
    """The model a response names: the one the request named, else the pinned one (what /v1/models lists)."""
    requested = body.get("model")
    if isinstance(requested, str) and requested:
        return requested
    return manager.force_model


def as_openai(response, manager, body: dict, state, *, sse_done: bool):
    """transformers' handler's RESPONSE made what OpenAI clients read (see the module docstring); STATE is what the
    request's generation marked (`patches.RequestState`), read as the stream is sent."""
    from fastapi.responses import JSONResponse, StreamingResponse

    name = model_name(manager, body)
    if isinstance(response, StreamingResponse):
        response.body_iterator = _openai_stream(response.body_iterator, name, state, sse_done)
    elif isinstance(response, JSONResponse) and response.status_code == 200:
        content = json.loads(response.body)
        _rename_and_finish(content, name, state)
        response = JSONResponse(content, status_code=200, media_type=response.media_type)
    return response


def _rename_and_finish(event: dict, name: str | None, state) -> None:
    if name is not None and "model" in event:
        event["model"] = name
    if state.stopped:
        for choice in event.get("choices") or []:
            if choice.get("finish_reason") == "length":  # the stop string came with the last allowed token
                choice["finish_reason"] = "stop"


def _sse_event(event: str, name: str | None, state) -> str:
    """One `data: ...` event, renamed; transformers' error event (`{"error": "<text, unescaped>"}`) as OpenAI's."""
    payload = event[len("data: ") :]
    try:
        content = json.loads(payload)
    except ValueError:
        content = None
    if isinstance(content, dict) and "error" not in content:
        _rename_and_finish(content, name, state)
        return "data: " + json.dumps(content, ensure_ascii=False, separators=(",", ":"))
    if payload.startswith('{"error": "') and payload.endswith('"}') or isinstance(content, dict):
        message = content["error"] if isinstance(content, dict) else payload[len('{"error": "') : -2]
        error = {"message": " ".join(str(message).split()), "type": "server_error", "param": None, "code": None}
        return "data: " + json.dumps({"error": error}, ensure_ascii=False)
    return event


async def _openai_stream(events, name: str | None, state, sse_done: bool):
    buffered = ""
    try:
        async for piece in events:
            buffered += piece if isinstance(piece, str) else piece.decode()
            *complete, buffered = buffered.split("\n\n")
            out = [_sse_event(e, name, state) if e.startswith("data: ") else e for e in complete]
            if out:
                yield "".join(e + "\n\n" for e in out)
        if buffered:
            yield buffered
        if sse_done:
            yield "data: [DONE]\n\n"
    finally:
        if hasattr(events, "aclose"):
            await events.aclose()  # the client left: transformers' generator cancels the generation
