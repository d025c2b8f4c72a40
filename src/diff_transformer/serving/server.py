"""transformers' server (`transformers serve`) made into `diff-transformer serve`'s: what clients rely on installed
where its `Serve` picks it up (`client_facing`: request checks, errors as OpenAI's bodies, models and templates off
the event loop, at most --max-queued-requests requests at once: `QueueBound`), every generation bounded
(`limit_generation`) and shutdown bounded (`graceful_shutdown`). `install` does it all; the package docstring says why
each is needed."""

import functools

from ..errors import one_line
from .models import check_pinned, diff_model_manager, display_name, load_off_the_loop, model_http_error


GRACEFUL_SHUTDOWN_S = 5
# --max-queued-requests: transformers' plain server runs one `generate` at a time per model (its `InferenceThread`
# takes them first come, first served), so the last of N admitted requests waits for the N - 1 before it: 8 bounds
# that wait to 7 generations, each bounded by the context and --max-new-tokens-limit.
MAX_QUEUED_REQUESTS = 8
MAX_LOADED_MODELS = 4  # --max-loaded-models: transformers only unloads a model after --model-timeout (300 s) idle
RETRY_AFTER_MAX_S = 60  # OpenAI's client waits for a Retry-After up to 60 s, and backs off on its own above that

_max_queued_requests = MAX_QUEUED_REQUESTS  # what `install` was given

_uvicorn_log_level = None  # --quiet: "warning" (transformers' `Serve` asks uvicorn for "info": a line per request)

HTTP_ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 422: "invalid_request_error"}


async def render_off_the_loop(handler, body: dict) -> None:
    """A chat request's template rendered in a worker thread, within the bounds of `..chat_templates`: one
    past them answers 400. transformers' handler renders it on the event loop; its render then returns this one's
    text (`prerendered`, matched on the template and every value it is rendered with), so a slow template
    never holds up the loop (and /health, other models, other requests)."""
    import asyncio

    from transformers.cli.serving.utils import Modality

    from ..chat_templates import ChatRenderError, prerendered, render_capturing

    if not isinstance(body.get("messages"), list):
        return  # transformers' validation answers
    handler._validate_request(body)

    def render():
        _, model, processor = handler._resolve_model(dict(body))
        modality = handler.model_manager.get_model_modality(model, processor=processor)
        messages = handler.get_processor_inputs_from_messages(body["messages"], modality)
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

    name = display_name(str(body.get("model")))
    try:
        rendered = await asyncio.to_thread(render)
    except ChatRenderError as error:  # too large a request, or a bound: one line
        raise model_http_error(400, f"model {name!r}: {error}.") from None
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
    from fastapi import HTTPException
    from fastapi.responses import JSONResponse

    async def handler(request, exc: HTTPException):
        detail = exc.detail if isinstance(exc.detail, dict) else {"message": str(exc.detail)}
        error = {
            "message": detail.get("message", ""),
            "type": HTTP_ERROR_TYPES.get(exc.status_code, "error"),
            "param": detail.get("param"),
            "code": detail.get("code"),
        }
        return JSONResponse({"error": error}, status_code=exc.status_code, headers=exc.headers)

    async def unforeseen(request, exc: Exception):
        message = f"the server failed on this request ({type(exc).__name__}: {one_line(exc)[:300]})"
        error = {"message": message, "type": "server_error", "param": None, "code": None}
        return JSONResponse({"error": error}, status_code=500)

    app.add_exception_handler(HTTPException, handler)
    app.add_exception_handler(Exception, unforeseen)


class QueueBound:
    """ASGI middleware: at most `limit` POST requests (completions, chat, responses, model loads) in the server at
    once, from their whole body's arrival to the last byte of their answer (a stream included, and a non-streaming
    generation whose client left, which runs to its end); one more is answered at once with 429, a Retry-After header
    (the median time the recent requests took, 1 to 60 s) and OpenAI's error body, instead of waiting behind them.

    Counting requests bounds the queued work: each request's is clamped (`limit_generation`: the context and
    --max-new-tokens-limit). The count lives on the event loop (one thread), so it needs no lock."""

    def __init__(self, app, limit: int):
        import collections

        self.app = app
        self.limit = limit
        self.in_flight = 0
        self.recent_seconds = collections.deque(maxlen=16)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        # Counted once its body is in: a client that sends its body slowly holds a connection, not a place.
        received = []
        while not received or received[-1]["type"] == "http.request" and received[-1].get("more_body"):
            received.append(await receive())

        async def replay():
            return received.pop(0) if received else await receive()

        if received[-1]["type"] != "http.request":  # the client left while sending
            return await self.app(scope, replay, send)
        if self.in_flight >= self.limit:
            return await self.refuse()(scope, replay, send)
        import time

        self.in_flight += 1
        start = time.monotonic()
        try:
            await self.app(scope, replay, send)
        finally:
            self.in_flight -= 1
            self.recent_seconds.append(time.monotonic() - start)

    def retry_after(self) -> int:
        import math
        import statistics

        if not self.recent_seconds:
            return 1
        return min(RETRY_AFTER_MAX_S, max(1, math.ceil(statistics.median(self.recent_seconds))))

    def refuse(self):
        from fastapi.responses import JSONResponse

        seconds = self.retry_after()
        message = (
            f"the server is busy: {self.in_flight} requests are in flight, --max-queued-requests {self.limit}; "
            f"retry after {seconds} s."
        )
        error = {"message": message, "type": "requests", "param": None, "code": "rate_limit_exceeded"}
        return JSONResponse({"error": error}, status_code=429, headers={"Retry-After": str(seconds)})


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


def client_facing() -> None:
    """Install `diff_model_manager`, `check_request`, `load_off_the_loop` and `openai_errors` where transformers'
    `Serve` picks them up (it imports `ModelManager` and `build_server` when it starts, every handler validates
    through `BaseHandler._validate_request`, and each model handler's `handle_request` is wrapped)."""
    from transformers.cli.serving import model_manager, server, utils

    from .requests import as_openai, check_request

    model_manager.ModelManager = diff_model_manager()
    build = server.build_server
    if not getattr(build, "_diff_errors", False):

        @functools.wraps(build)
        def build_server(*args, **kwargs):
            from starlette.middleware import Middleware

            app = build(*args, **kwargs)
            openai_errors(app)
            # Innermost of the app's middleware (transformers' request id and CORS headers go on a 429 too).
            app.user_middleware.append(Middleware(QueueBound, limit=_max_queued_requests))
            return app

        build_server._diff_errors = True
        server.build_server = build_server
    from transformers.cli.serving import chat_completion, completion, response, systemone

    for handler_class in (
        chat_completion.ChatCompletionHandler,
        completion.CompletionHandler,
        response.ResponseHandler,
        systemone.SystemOneHandler,
    ):
        handle = handler_class.handle_request
        if getattr(handle, "_diff_off_the_loop", False):
            continue

        def make(handle, handler_class=handler_class):
            chat = handler_class is chat_completion.ChatCompletionHandler
            openai_shaped = chat or handler_class is completion.CompletionHandler

            @functools.wraps(handle)
            async def handle_request(self, body: dict, *args, **kwargs):
                if openai_shaped:
                    check_pinned(self.model_manager, body)
                release = await load_off_the_loop(self, body)
                try:
                    if chat:
                        await render_off_the_loop(self, body)
                    if openai_shaped:
                        response = await as_openai(handle, self, body, *args, sse_done=True, **kwargs)
                    else:
                        response = await handle(self, body, *args, **kwargs)
                except BaseException:
                    if release is not None:
                        release()
                    raise
                return held_until_sent(response, release)

            handle_request._diff_off_the_loop = True
            return handle_request

        handler_class.handle_request = make(handle)
    validate = utils.BaseHandler._validate_request
    if not getattr(validate, "_diff_checked", False):

        @functools.wraps(validate)
        def validate_request(self, body: dict) -> None:
            validate(self, body)
            check_request(body)

        validate_request._diff_checked = True
        utils.BaseHandler._validate_request = validate_request


def _generation_limit(model, inputs: dict, gen_config, limit: int | None) -> None:
    """Clamp `gen_config.max_new_tokens` to the context left after the prompt (and to `limit`); a request's
    settings outside their range (`num_beams: -3` in its generation_config) are an HTTP 400, not a 500 mid-run."""
    from fastapi import HTTPException

    from ..checkpoints.configs import generation_value_problem
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


def limit_generation(limit: int | None = None) -> None:
    """Every generation of transformers' server (plain and continuous batching, streaming or not) bounded by the
    model's context and `limit` (see the module docstring), and ended at the request's stop strings
    (`requests.stop_streaming`)."""
    from transformers.cli.serving import utils

    from .requests import stop_non_streaming, stop_streaming

    for manager in (utils.GenerateManager, utils.CBGenerateManager):
        for name in ("generate_streaming", "generate_non_streaming"):
            method = getattr(manager, name)
            if getattr(method, "_diff_limited", False):
                continue

            def make(method):
                if name == "generate_non_streaming":
                    stopping = stop_non_streaming(method)

                    @functools.wraps(method)
                    async def bounded(self, model, processor, inputs, gen_config, *args, **kwargs):
                        _generation_limit(model, inputs, gen_config, limit)
                        return await stopping(self, model, processor, inputs, gen_config, *args, **kwargs)

                else:
                    stopping = stop_streaming(method)

                    @functools.wraps(method)
                    def bounded(self, model, processor, inputs, gen_config, *args, **kwargs):
                        _generation_limit(model, inputs, gen_config, limit)
                        return stopping(self, model, processor, inputs, gen_config, *args, **kwargs)

                bounded._diff_limited = True
                return bounded

            setattr(manager, name, make(method))


def graceful_shutdown(seconds: float = GRACEFUL_SHUTDOWN_S) -> None:
    """uvicorn servers created from now on wait at most `seconds` for requests in flight after SIGTERM/SIGINT."""
    import uvicorn

    init = uvicorn.Config.__init__
    if getattr(init, "_diff_bounded", False):
        return

    @functools.wraps(init)
    def bounded(self, *args, **kwargs):
        kwargs.setdefault("timeout_graceful_shutdown", seconds)
        if _uvicorn_log_level is not None:
            kwargs["log_level"] = _uvicorn_log_level
        init(self, *args, **kwargs)

    bounded._diff_bounded = True
    uvicorn.Config.__init__ = bounded


def install(
    limit: int | None,
    quiet: bool,
    served: tuple[str, ...],
    *,
    max_queued_requests: int = MAX_QUEUED_REQUESTS,
    max_loaded_models: int = MAX_LOADED_MODELS,
) -> None:
    """All of the above, before transformers' `Serve` starts: the models a `serve A B` server answers for and how many
    it holds at once, uvicorn's log level under --quiet, chat templates within bounds, the Diff classes where
    transformers looks, what clients see, at most MAX_QUEUED_REQUESTS requests at once, every generation bounded by
    the context and LIMIT, and a bounded shutdown."""
    global _uvicorn_log_level, _max_queued_requests
    from ..chat_templates import bound_chat_templates
    from . import models

    models.served_models = served
    models.max_loaded_models = max(max_loaded_models, len(served))
    _max_queued_requests = max_queued_requests
    _uvicorn_log_level = "warning" if quiet else None
    bound_chat_templates()
    models.expose_to_transformers_serve()
    client_facing()
    limit_generation(limit)
    graceful_shutdown()
