"""What `diff-transformer serve` adds to transformers' server, as `patches.PATCHES` installs it: the app's error bodies
and queue bound (`client_app`: `openai_errors`, `QueueBound`), each handler's request checked, its model loaded and
its template rendered off the event loop and its model pinned until its answer is sent (`handled`), and every
generation bounded (`bounded_generation`). The package docstring says why each is needed."""

import functools

from ..errors import one_line
from .models import check_pinned, display_name, load_off_the_loop, model_http_error


# The openai client (3.54, pinned in constraints.txt) waits for a Retry-After of up to 120 s and does not retry above
# it (`MAX_RETRY_AFTER_DELAY`); older clients waited up to 60 s and backed off on their own above. 60 suits both.
RETRY_AFTER_MAX_S = 60
RETRY_SERVICE_PRIOR_S = 2.0  # seconds per request assumed before any request has been served

HTTP_ERROR_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    503: "server_error",
}
ROUTES = "POST /v1/chat/completions, POST /v1/completions, POST /v1/responses, GET /v1/models, GET /health"


class MalformedMessages(Exception):
    """transformers could not read a request's messages (before any template ran)."""


async def render_off_the_loop(handler, body: dict) -> None:
    """A chat request's template rendered in a worker thread, within the bounds of `..chat_templates`: one
    past them answers 400. transformers' handler renders it on the event loop; its render then returns this one's
    text (`prerendered`, matched on the template and every value it is rendered with), so a slow template
    never holds up the loop (and /health, other models, other requests)."""
    import asyncio

    from transformers.cli.serving.utils import Modality

    from ..generation.chat_templates import ChatRenderError, prerendered, render_capturing

    if not isinstance(body.get("messages"), list):
        return  # transformers' validation answers
    handler._validate_request(body)

    def render():
        _, model, processor = handler._resolve_model(dict(body))
        modality = handler.model_manager.get_model_modality(model, processor=processor)
        try:
            messages = handler.get_processor_inputs_from_messages(body["messages"], modality)
        except (KeyError, TypeError, ValueError, AttributeError) as error:  # a part without its text, bad tool_calls
            raise MalformedMessages(error) from None
        has_video = any(
            part.get("type") == "video"
            for message in messages
            for part in (message.get("content") if isinstance(message.get("content"), list) else [])
        )
        kwargs: dict = {"num_frames": 32} if has_video else {}
        kwargs.update(handler.chat_template_kwargs)
        kwargs.update(body.get("chat_template_kwargs", {}))
        return render_capturing(
            processor.apply_chat_template,
            messages,
            add_generation_prompt=True,
            tools=body.get("tools"),
            tokenize=False,
            return_dict=False,
            load_audio_from_video=modality == Modality.MULTIMODAL and has_video,
            **kwargs,
        )

    name = display_name(str(body.get("model") or handler.model_manager.force_model))
    try:
        rendered = await asyncio.to_thread(render)
    except ChatRenderError as error:  # too large a request, or a bound: one line
        raise model_http_error(400, f"model {name!r}: {error}.") from None
    except MalformedMessages as malformed:
        error = malformed.args[0]
        what = f"{type(error).__name__}: {one_line(error)[:200]}"
        raise model_http_error(
            400,
            f"messages are malformed ({what}): each content part needs its fields (a text part its text, an "
            "image_url part its url), and each tool call a function with JSON arguments.",
            param="messages",
        ) from None
    except Exception as exc:
        if getattr(exc, "status_code", None):
            raise
        raise model_http_error(400, f"the chat template of model {name!r} failed: {one_line(exc)[:300]}") from None
    if rendered is not None:
        prerendered(rendered)


def openai_errors(app) -> None:
    """Errors as OpenAI's API returns them (`{"error": {"message", "type", "param", "code"}}`), which its clients
    read: ours (`requests.http_error`), transformers' HTTPExceptions, and anything unforeseen (a 500 whose
    body says so in JSON, where Starlette answered "Internal Server Error" in plain text)."""
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException

    async def handler(request, exc: HTTPException):
        detail = exc.detail if isinstance(exc.detail, dict) else {"message": str(exc.detail)}
        message = detail.get("message", "")
        if exc.status_code == 404 and message == "Not Found":  # Starlette's: no route
            message = f"no route {request.url.path}: this server answers {ROUTES}."
        elif exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}: this server answers {ROUTES}."
        error = {
            "message": message,
            "type": HTTP_ERROR_TYPES.get(exc.status_code, "error"),
            "param": detail.get("param"),
            "code": detail.get("code") or {404: "unknown_url", 405: "method_not_allowed"}.get(exc.status_code),
        }
        return JSONResponse({"error": error}, status_code=exc.status_code, headers=exc.headers)

    async def invalid_body(request, exc: RequestValidationError):
        first = (exc.errors() or [{}])[0]
        where = ".".join(str(part) for part in first.get("loc", ()) if part != "body")
        message = (
            f"the request body is not a JSON object ({first.get('msg', 'invalid')}{' at ' + where if where else ''})"
        )
        error = {"message": message + ".", "type": "invalid_request_error", "param": None, "code": "invalid_json"}
        return JSONResponse({"error": error}, status_code=400)

    async def unforeseen(request, exc: Exception):
        message = f"the server failed on this request ({type(exc).__name__}: {one_line(exc)[:300]})"
        error = {"message": message, "type": "server_error", "param": None, "code": None}
        return JSONResponse({"error": error}, status_code=500)

    app.add_exception_handler(HTTPException, handler)
    app.add_exception_handler(RequestValidationError, invalid_body)
    app.add_exception_handler(Exception, unforeseen)


class QueueBound:
    """ASGI middleware admitting POST requests (completions, chat, responses, model loads): at most `limit` in the
    server at once, counted from their arrival (before their body is read) to the last byte of their answer (a stream
    included, and a non-streaming generation whose client left, which runs to its end); one more is answered at once
    with 429, a Retry-After header (`retry_after`) and OpenAI's error body, instead of waiting behind them. A body over
    `max_bytes` is answered 413 before it is buffered: at once when its Content-Length says so, else as soon as what
    has arrived passes it. So the server holds at most `limit` bodies of at most `max_bytes` each.

    Counting requests bounds the queued work: each request's is clamped (`bounded_generation`: the context and
    --max-new-tokens-limit). The count lives on the event loop (one thread), so it needs no lock."""

    def __init__(self, app, limit: int, max_bytes: int = 16 << 20):
        import collections

        self.app = app
        self.limit = limit
        self.max_bytes = max_bytes
        self.in_flight = 0
        # Seconds of service per request: a request's time in the server over the requests it found there (itself
        # included), as transformers serves a model's requests one after another.
        self.recent_service = collections.deque(maxlen=16)
        self.arrivals: dict[object, float] = {}  # when each request in the server arrived

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            return await self.too_large(int(declared))(scope, receive, send)
        if self.in_flight >= self.limit:
            return await self.refuse()(scope, receive, send)
        import time

        self.in_flight += 1
        found, start, answered, key = self.in_flight, time.monotonic(), False, object()
        try:
            received, size = [], 0
            while True:
                message = await receive()
                if message["type"] != "http.request":
                    return  # the client left while sending: nobody to answer
                received.append(message)
                size += len(message.get("body", b""))
                if size > self.max_bytes:
                    return await self.too_large(size)(scope, receive, send)
                if not message.get("more_body"):
                    break

            async def replay():
                return received.pop(0) if received else await receive()

            async def sending(message):
                nonlocal answered
                if message["type"] == "http.response.start":
                    answered = 200 <= message["status"] < 300  # a refusal (400, 404) costs no generation
                await send(message)

            self.arrivals[key] = start
            await self.app(scope, replay, sending)
        finally:
            self.in_flight -= 1
            self.arrivals.pop(key, None)
            if answered:
                self.recent_service.append((time.monotonic() - start) / found)

    def retry_after(self) -> int:
        """Seconds until the requests in the server now have been served: their number times the recent service time
        per request (the median of the last 16 answered; before any, RETRY_SERVICE_PRIOR_S, or the time the oldest
        request in the server has spent there if longer), with a margin of half, 1 to RETRY_AFTER_MAX_S. A client
        that waits that long (OpenAI's does, up to its cap) finds the queue drained, so a burst of (retries + 1) x
        limit requests is served in full."""
        import math
        import statistics
        import time

        if self.recent_service:
            service = statistics.median(self.recent_service)
        else:
            oldest = min(self.arrivals.values(), default=time.monotonic())
            service = max(RETRY_SERVICE_PRIOR_S, time.monotonic() - oldest)
        return min(RETRY_AFTER_MAX_S, max(1, math.ceil(1.5 * self.in_flight * service)))

    def refuse(self):
        from fastapi.responses import JSONResponse

        seconds = self.retry_after()
        message = (
            f"the server is busy: {self.in_flight} requests are in flight, --max-queued-requests {self.limit}; "
            f"retry after {seconds} s."
        )
        error = {"message": message, "type": "requests", "param": None, "code": "rate_limit_exceeded"}
        return JSONResponse({"error": error}, status_code=429, headers={"Retry-After": str(seconds)})

    def too_large(self, size: int):
        from fastapi.responses import JSONResponse

        message = (
            f"the request body has {'at least ' if size <= self.max_bytes else ''}{size} bytes: this server takes at "
            f"most {self.max_bytes} (--max-request-bytes); send a shorter request."
        )
        error = {"message": message, "type": "invalid_request_error", "param": None, "code": "request_too_large"}
        return JSONResponse({"error": error}, status_code=413, headers={"Connection": "close"})


def held_until_sent(response, release):
    """RESPONSE, its model pinned (`release` not yet called) until its last byte is sent: a stream generates while it
    is sent. A stream never sent (its client left first) lets go when it is collected."""
    if release is None:
        return response
    from fastapi.responses import StreamingResponse

    if not isinstance(response, StreamingResponse):
        release()
        return response
    import weakref

    events = response.body_iterator

    async def sent():
        try:
            async for event in events:
                yield event
        finally:
            release()
            if hasattr(events, "aclose"):
                await events.aclose()

    response.body_iterator = sent()
    weakref.finalize(response, release)
    return response


def client_app(app, settings):
    """transformers' FastAPI APP as clients need it: OpenAI's error bodies, and at most --max-queued-requests
    requests in the server at once (innermost of the app's middleware, so transformers' request id and CORS headers
    go on a 429 too)."""
    from starlette.middleware import Middleware

    openai_errors(app)
    app.user_middleware.append(
        Middleware(QueueBound, limit=settings.max_queued_requests, max_bytes=settings.max_request_bytes)
    )
    return app


def handled(handle, handler_class, settings):
    """HANDLER_CLASS's `handle_request(self, body, request_id)` with the request checked against the models served
    (`check_pinned`), its model loaded off the event loop and pinned until the answer is sent (`load_off_the_loop`,
    `held_until_sent`), a chat's template rendered off the loop (`render_off_the_loop`), and the answer made OpenAI's
    (`requests.as_openai`), its per-request state registered under REQUEST_ID (`patches.RequestStates`)."""
    from transformers.cli.serving import chat_completion, completion

    from .patches import RequestState
    from .requests import as_openai, http_error

    chat = handler_class is chat_completion.ChatCompletionHandler
    openai_shaped = chat or handler_class is completion.CompletionHandler
    states = settings.requests

    @functools.wraps(handle)
    async def handle_request(self, body: dict, request_id: str, *args, **kwargs):
        if openai_shaped:
            check_pinned(self.model_manager, body)
        if request_id in states:
            raise http_error(
                400, f"X-Request-ID {request_id!r} is already in flight: send a unique one, or none.", code="duplicate"
            )
        state = states[request_id] = RequestState()
        release = None
        try:
            release = await load_off_the_loop(self, body)
            if chat:
                await render_off_the_loop(self, body)
            response = await handle(self, body, request_id, *args, **kwargs)
        except BaseException:
            states.pop(request_id, None)
            if release is not None:
                release()
            raise
        if openai_shaped:
            response = as_openai(response, self.model_manager, body, state, sse_done=True)

        def done():
            states.pop(request_id, None)
            if release is not None:
                release()

        return held_until_sent(response, done)

    return handle_request


def _generation_limit(model, inputs: dict, gen_config, limit: int | None) -> None:
    """Clamp `gen_config.max_new_tokens` to the context left after the prompt (and to `limit`); a request's
    settings outside their range (`num_beams: -3` in its generation_config) are an HTTP 400, not a 500 mid-run."""
    from fastapi import HTTPException

    from ..generation.config import generation_value_problem
    from .requests import check_token_ids

    for field in ("num_beams", "num_return_sequences", "top_k", "top_p", "temperature", "repetition_penalty"):
        problem = generation_value_problem(field, getattr(gen_config, field, None))
        if problem:
            raise HTTPException(status_code=400, detail=f"{problem}.")

    check_token_ids(gen_config, getattr(model.config.get_text_config(), "vocab_size", None))
    input_ids = inputs["input_ids"]
    prompt = len(input_ids) if isinstance(input_ids, list) else input_ids.shape[-1]
    context = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    room = None if context is None else context - prompt
    if room is not None and room < 1:
        raise HTTPException(
            status_code=400, detail=f"the prompt has {prompt} tokens: the model's context is {context} positions."
        )
    bound = min(x for x in (room, limit) if x is not None) if (room, limit) != (None, None) else None
    if bound is not None and (gen_config.max_new_tokens is None or gen_config.max_new_tokens > bound):
        gen_config.max_new_tokens = bound


def bounded_generation(method, name: str, settings):
    """A generate manager's METHOD (`generate_streaming` or `generate_non_streaming`, NAME) bounded by the model's
    context and --max-new-tokens-limit, and ended at the request's stop strings (`requests.stop_streaming`), which
    mark the request's state (found by the `request_id` transformers passes)."""
    from .requests import stop_non_streaming, stop_streaming

    limit, states = settings.max_new_tokens_limit, settings.requests
    if name == "generate_non_streaming":
        stopping = stop_non_streaming(method, states)

        @functools.wraps(method)
        async def bounded(self, model, processor, inputs, gen_config, *args, **kwargs):
            _generation_limit(model, inputs, gen_config, limit)
            return await stopping(self, model, processor, inputs, gen_config, *args, **kwargs)

    else:
        stopping = stop_streaming(method, states)

        @functools.wraps(method)
        def bounded(self, model, processor, inputs, gen_config, *args, **kwargs):
            _generation_limit(model, inputs, gen_config, limit)
            return stopping(self, model, processor, inputs, gen_config, *args, **kwargs)

    return bounded
