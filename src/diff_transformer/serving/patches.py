"""Every change `diff-transformer serve` makes to transformers' server (`transformers serve`) and to uvicorn, in one
table (`PATCHES`): what each replaces, the internal of the pinned transformers it relies on, and the test that fails
when that internal changes. `install(settings)` applies them all from one `ServeSettings`; applying again (another
settings object, a test) replaces the previous patch, never stacks on it.

Per-request state goes explicitly where transformers passes it: its handlers hand their `request_id` to the generate
managers, so what a generation tells its response (a stop string met) is kept under that id (`RequestStates`). Only
the chat-template render (`chat_templates.prerendered`) still rides in a ContextVar: transformers'
`apply_chat_template` passes nothing of the request to the template it compiles."""

import functools
from dataclasses import dataclass, field


# --max-queued-requests: transformers' plain server runs one `generate` at a time per model (its `InferenceThread`
# takes them first come, first served), so the last of N admitted requests waits for the N - 1 before it: 8 bounds
# that wait to 7 generations, each bounded by the context and --max-new-tokens-limit.
MAX_QUEUED_REQUESTS = 8
MAX_LOADED_MODELS = 4  # --max-loaded-models: transformers only unloads a model after --model-timeout (300 s) idle
GRACEFUL_SHUTDOWN_S = 5
# --max-request-bytes: a request body is buffered whole before it is parsed, and --max-queued-requests of them may be
# in the server at once. 16 MiB holds the largest text a render takes (1 Mi characters, up to 6 bytes each escaped in
# JSON) with room for a few images.
MAX_REQUEST_BYTES = 16 << 20
# Chat-template render processes (`render_pool`): a render takes milliseconds, so two cover the requests a server
# admits; a hostile one holds its worker at most RENDER_SECONDS + 1 s.
RENDER_WORKERS = 2


@dataclass(frozen=True)
class ServeSettings:
    """What `diff-transformer serve` was asked for (`cli/serve.py` builds it; `install` hands it to every patch)."""

    max_new_tokens_limit: int | None = None  # --max-new-tokens-limit
    quiet: bool = False  # --quiet: uvicorn's log level "warning" (transformers' `Serve` asks for "info")
    served: tuple[str, ...] = ()  # `serve A B ...`: the models this server answers for
    max_queued_requests: int = MAX_QUEUED_REQUESTS
    max_loaded_models: int = MAX_LOADED_MODELS  # at least len(served): `install` raises it
    max_request_bytes: int = MAX_REQUEST_BYTES
    model_wait_s: float = 60.0  # how long a load waits for a loaded model to be free (all pinned), then 503
    render_workers: int = RENDER_WORKERS  # chat-template render processes (0: render in the server's process)
    graceful_shutdown_s: float = GRACEFUL_SHUTDOWN_S
    requests: "RequestStates" = field(default_factory=lambda: RequestStates(), compare=False)


@dataclass
class RequestState:
    """What one request's generation tells its response (`requests.as_openai`): the stop strings met."""

    stopped: bool = False


class RequestStates(dict):
    """{request_id: RequestState} of the requests in flight: the handler wrapper registers a request under the id
    transformers gives it (`handle_request(body, request_id)`), the generate managers find it by the `request_id`
    transformers passes them. Touched on the event loop only."""


@dataclass(frozen=True)
class Patch:
    """One change to someone else's code: where, what it replaces, what it relies on, which test guards it."""

    name: str
    target: str  # the attribute replaced (or added)
    replaces: str  # what the original did that we change, and why
    relies_on: str  # the internal of the pinned transformers (or uvicorn) it needs
    guarded_by: str  # pytest node id of the test that fails when that internal changes
    apply: object  # apply(settings)


def replace(owner, name: str, make) -> None:
    """`owner.name = make(original)`, where the original is the attribute before any of our patches: applying again
    replaces the previous patch (new settings) instead of wrapping it."""
    current = getattr(owner, name)
    original = getattr(current, "_diff_original", current)
    patched = make(original)
    patched._diff_original = original
    setattr(owner, name, patched)


def _model_manager(settings: ServeSettings) -> None:
    from transformers.cli.serving import model_manager

    from .models import diff_model_manager

    replace(model_manager, "ModelManager", lambda original: diff_model_manager(settings))


def _app(settings: ServeSettings) -> None:
    from transformers.cli.serving import server as transformers_server

    from .server import client_app

    def make(build):
        @functools.wraps(build)
        def build_server(*args, **kwargs):
            return client_app(build(*args, **kwargs), settings)

        return build_server

    replace(transformers_server, "build_server", make)


def _handlers(settings: ServeSettings) -> None:
    from transformers.cli.serving import chat_completion, completion, response, systemone

    from .server import handled

    for handler_class in (
        chat_completion.ChatCompletionHandler,
        completion.CompletionHandler,
        response.ResponseHandler,
        systemone.SystemOneHandler,
    ):
        replace(handler_class, "handle_request", lambda handle, cls=handler_class: handled(handle, cls, settings))


def _request_checks(settings: ServeSettings) -> None:
    from transformers.cli.serving import utils

    from .requests import check_request

    def make(validate):
        @functools.wraps(validate)
        def validate_request(self, body: dict) -> None:
            validate(self, body)
            check_request(body)

        return validate_request

    replace(utils.BaseHandler, "_validate_request", make)


def _generation(settings: ServeSettings) -> None:
    from transformers.cli.serving import utils

    from .server import bounded_generation

    for manager in (utils.GenerateManager, utils.CBGenerateManager):
        for name in ("generate_streaming", "generate_non_streaming"):
            replace(manager, name, lambda method, name=name: bounded_generation(method, name, settings))


def _uvicorn(settings: ServeSettings) -> None:
    import uvicorn

    def make(init):
        @functools.wraps(init)
        def bounded(self, *args, **kwargs):
            kwargs.setdefault("timeout_graceful_shutdown", settings.graceful_shutdown_s)
            if settings.quiet:
                kwargs["log_level"] = "warning"
            init(self, *args, **kwargs)

        return bounded

    replace(uvicorn.Config, "__init__", make)


def _chat_templates(settings: ServeSettings) -> None:
    from ..generation.chat_templates import bound_chat_templates, isolate
    from .render_pool import RenderPool

    bound_chat_templates()
    if settings.render_workers:
        pool = RenderPool(settings.render_workers)
        pool.warm()
        isolate(pool.render)
    else:
        isolate(None)


GUARD = "tests/serving/test_patches.py::"

PATCHES = (
    Patch(
        "model manager",
        "transformers.cli.serving.model_manager.ModelManager",
        "per-model locks (two models built at once corrupt each other), unload under a request's feet, no bound on "
        "loaded models, 500s for a missing model, /v1/models without our models; models loaded by class name from "
        "the transformers package (no custom-code class) and from pickles: a Diff model loads through "
        "`checkpoints.open`",
        "Serve imports ModelManager from its module when it starts; ModelManager.__init__'s keywords and the "
        "attributes it keeps them in (device, dtype, attn_implementation, trust_remote_code, "
        "get_quantization_config()), _load_processor(id, gguf_file), _load_model(id, tqdm_class, progress_callback, "
        "gguf_file), loaded_models, TimedModel(model, timeout_seconds, processor, on_unload) with "
        "_timeout_reached/reset_timer/delete_model",
        GUARD + "test_model_manager_internals",
        _model_manager,
    ),
    Patch(
        "app",
        "transformers.cli.serving.server.build_server",
        "errors in FastAPI's and Starlette's bodies; no queue bound, no body-size bound, unknown routes FastAPI's 404",
        "Serve imports build_server from its module when it starts and serves the FastAPI app it returns",
        GUARD + "test_build_server_returns_the_app_serve_runs",
        _app,
    ),
    Patch(
        "handlers",
        "handle_request of ChatCompletionHandler, CompletionHandler, ResponseHandler, SystemOneHandler",
        "loads and renders on the event loop; pinned-model refusals as 400; responses named 'model@main', no [DONE]",
        "handle_request(self, body, request_id); self.model_manager; _resolve_model(body) loads through the manager",
        GUARD + "test_handlers_take_body_and_request_id",
        _handlers,
    ),
    Patch(
        "request checks",
        "transformers.cli.serving.utils.BaseHandler._validate_request",
        "out-of-range or malformed fields reach generation and fail there as plain-text 500s",
        "every handler calls self._validate_request(body) before it loads or generates",
        GUARD + "test_handlers_validate_first",
        _request_checks,
    ),
    Patch(
        "generation",
        "generate_streaming and generate_non_streaming of GenerateManager and CBGenerateManager",
        "max_tokens unbounded past the context; stop strings kept in the text, ignored under continuous batching",
        "(model, processor, inputs, gen_config, request_id=...) with inputs['input_ids']; streaming returns "
        "(queue, streamer) with streamer.cancel(); non-streaming returns (text, input_len, generated_ids)",
        GUARD + "test_generate_managers_take_request_id",
        _generation,
    ),
    Patch(
        "uvicorn",
        "uvicorn.Config.__init__",
        "SIGTERM waits for requests in flight without limit; --quiet still logs a line per request",
        "uvicorn.Config's timeout_graceful_shutdown and log_level keywords; Serve builds uvicorn.Config(app, ...)",
        GUARD + "test_uvicorn_config_keywords",
        _uvicorn,
    ),
    Patch(
        "chat templates",
        "transformers.utils.chat_template_utils._compile_jinja_template",
        "templates render without bound in steps, time or size, on the event loop; here they render in worker "
        "processes (`render_pool`: address space capped, killed past their time)",
        "_cached_compile_jinja_template(template) -> a jinja2 Template whose environment we rebind",
        GUARD + "test_chat_template_compiler",
        _chat_templates,
    ),
)


def patch_table() -> str:
    """`PATCHES` as the Markdown table docs/serving.md shows (a test holds the page to it)."""
    rows = ["| patch | replaces | why | relies on (pinned transformers 5.23) | guarded by |", "|---|---|---|---|---|"]
    for patch in PATCHES:
        cells = (patch.name, f"`{patch.target}`", patch.replaces, patch.relies_on, f"`{patch.guarded_by}`")
        rows.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(rows) + "\n"


def install(settings: ServeSettings) -> ServeSettings:
    """Every patch of `PATCHES`, before transformers' `Serve` starts; the settings they were given (at least one
    loaded model per MODEL served)."""
    import dataclasses

    if settings.max_loaded_models < len(settings.served):
        settings = dataclasses.replace(settings, max_loaded_models=len(settings.served))
    for patch in PATCHES:
        patch.apply(settings)
    return settings
