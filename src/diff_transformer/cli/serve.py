"""`diff-transformer serve`: transformers' own OpenAI-compatible server (`transformers serve`) for Diff models.

transformers 5.23's server looks the model class up by name on the `transformers` package
(`getattr(transformers, config.architectures[0])` in `transformers/cli/serving/model_manager.py`), so it only loads
architectures that transformers ships: `transformers serve --trust-remote-code` fails on every custom-code
checkpoint with "module transformers has no attribute DiffForCausalLM". This command imports diff_transformer (which
registers the Auto classes), makes the Diff classes resolvable where the server looks, and then runs transformers'
`serve` command in this process with the same options (`diff-transformer serve --help`).

What transformers' server does not bound, this command does (`limit_generation`, `graceful_shutdown`):

* `max_tokens` (`max_completion_tokens`, `max_output_tokens`): transformers generates as many tokens as a request
  asks (and 1024 by default). Here every generation is clamped to the model's context (`max_position_embeddings`
  minus the prompt) and to `--max-new-tokens-limit N` when given; the answer then ends with finish_reason "length".
  A prompt that already fills the context is refused (HTTP 400).
* A client that disconnects: transformers cancels a *streaming* generation at its next token; a non-streaming one
  runs to its end, which the clamp above bounds.
* SIGTERM: uvicorn then waits for the requests in flight without limit; here for 5 s, after which they are cancelled
  and the process exits (the generation thread is a daemon).
* `serve MODEL` with a MODEL that does not exist: one line, exit status 2, before the server starts.
* A model's config.json is held against its weights before it is built (`check_config_against_weights`; a config
  claiming 10^5 layers kept transformers building for minutes), and a model directory with weights but no tokenizer
  is refused: one line at start-up (`serve MODEL`), else a 400 when a request names it (`_check_model_directory`).
* Chat templates render within bounds (`..chat_templates`: 2 s, 5,000,000 steps, 4 Mi characters), in a
  worker thread (`render_off_the_loop`): transformers renders on the event loop, where a template with nested loops
  held up every request, /health included. One past its bound answers 400.

What clients rely on and transformers' server gets wrong, this command fixes (`DiffModelManager`, `openai_errors`,
`check_pinned`, and `serve_requests`: request fields, `stop`, response names, `[DONE]`):

* `GET /v1/models` lists the pinned model (`serve MODEL`), else the loaded ones and the Hub cache's LLMs; transformers
  answers 500 when the Hub cache folder does not exist, and never lists a Diff model.
* A request naming a model that does not exist (or, on a pinned server, another model) answers 404 at once, one
  that cannot be loaded 400 (transformers retried the Hub for ~2 minutes, then answered a bare 500); the error body is
  OpenAI's `{"error": {"message", "type", "param", "code"}}`, also for a 500.
* Request fields are checked before anything runs (`serve_requests.check_request`): `max_tokens: 0`, a seed torch
  cannot take, a malformed `logit_bias` or `messages` were plain-text 500s; `n` > 1 is refused (transformers ignores
  it).
* `stop` ends the answer before the stop string, finish_reason "stop" (transformers kept the stop text, and ignored
  `stop` under continuous batching); a response names the model as the request did (not "model@main"); a stream ends
  with `data: [DONE]`.
* A model is loaded in a worker thread (`load_off_the_loop`): transformers loads it on the event loop, where every
  other request, /health included, waits for it.
* `--help` is this command's own: its options, then a note of what goes to transformers (`--transformers-help`).
"""

import argparse
import functools
import sys
from pathlib import Path

from ..errors import UserError, one_line, require
from .options import output_settings


GRACEFUL_SHUTDOWN_S = 5
_served_models: tuple[str, ...] = ()  # `serve A B ...`: the models this server answers for, listed from the start
_uvicorn_log_level = None  # --quiet: "warning" (transformers' `Serve` asks uvicorn for "info": a line per request)

PASSED_THROUGH = """\
Every other option goes to transformers' server (`transformers serve`) unchanged, e.g. --host (default localhost),
--port (default 8000), --device (default auto), --dtype (default auto), --attn-implementation,
--continuous-batching with --cb-block-size/--cb-num-blocks/--cb-max-batch-tokens, --compile, --quantization,
--model-timeout, --log-level, --enable-cors, --default-seed: --transformers-help lists them all.

Endpoints: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health. `stop` (up to 4 strings
of 1-256 characters) ends the answer before the stop string, streaming or not; n > 1 and out-of-range fields are
refused (HTTP 400, OpenAI's error body); a model that does not exist, or other than a pinned server's MODEL, answers
404, one that cannot be loaded 400."""


def help_parser() -> argparse.ArgumentParser:
    """The options of `diff-transformer serve` as `--help` shows them (`_own_options` parses them: everything else in
    ARGV goes to transformers, so argparse must not take a value of theirs for MODEL)."""
    parser = argparse.ArgumentParser(
        prog="diff-transformer serve",
        usage="%(prog)s [MODEL ...] [--max-new-tokens-limit N] [--quiet] [transformers serve options]",
        description="OpenAI-compatible server for Diff models: transformers' own server (transformers serve) with\n"
        "the Diff classes, every generation bounded by the model's context, and errors clients can read.",
        epilog=PASSED_THROUGH,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        add_help=False,
    )
    parser.add_argument(
        "model",
        nargs="*",
        metavar="MODEL",
        help="model directory or Hub id, loaded at start and pinned: requests name it as given here, or omit model. "
        "Several: the models this server answers for, listed by /v1/models from the start, each loaded when a "
        "request first names it (default: none; any model a request names is loaded on first use, and /v1/models "
        "lists those loaded and the Hub cache's)",
    )
    parser.add_argument(
        "--max-new-tokens-limit",
        metavar="N",
        type=int,
        help="at most N new tokens per request, whatever max_tokens asks (default: none; the model's context "
        "bounds every request)",
    )
    parser.add_argument(
        "--quiet",
        action="store_true",
        help="no progress bars, no per-request log lines: transformers' log level error (unless --log-level), "
        "uvicorn's warning",
    )
    parser.add_argument("--transformers-help", action="store_true", help="show transformers' own options and exit")
    parser.add_argument("-h", "--help", action="help", help="show this help and exit")
    return parser


class _Help(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        help_parser().print_help()
        parser.exit()


def add_parser(commands) -> None:
    # Our options are parsed by `_own_options`; every other option after `serve` goes to transformers' server.
    serve = commands.add_parser(
        "serve", add_help=False, help="OpenAI-compatible server (transformers serve) for Diff models"
    )
    serve.add_argument("-h", "--help", action=_Help, nargs=0, help=argparse.SUPPRESS)
    serve.set_defaults(func=run)


def run(args) -> int:
    require(["fastapi", "uvicorn", "openai", "pydantic"], "serve", "diff-transformer serve")
    return main(args.serve_args)


# ---- what clients see: the model list, unknown models, refused fields, error bodies ----

HTTP_ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 422: "invalid_request_error"}


def _http_error(status: int, message: str, **fields):
    from .serve_requests import http_error

    if status == 404:
        fields = {"param": "model", "code": "model_not_found", **fields}
    return http_error(status, message, **fields)


def _display_name(model_id_and_revision: str) -> str:
    model, _, revision = model_id_and_revision.partition("@")
    return model if revision in ("", "main") else model_id_and_revision


def check_loadable(model_id_and_revision: str) -> None:
    """A model a request names, checked in well under a second before transformers tries to load it: 404 when it
    does not exist (no directory, not in the Hub cache offline, not on the Hub), 400 when it is not a model."""
    from ..checkpoints.names import resolve_model

    model, _, revision = model_id_and_revision.partition("@")
    try:
        _, local = resolve_model(model, name="model")
    except UserError as error:
        raise _http_error(404, str(error)) from None
    if local is not None:
        if not (local / "config.json").is_file():
            raise _http_error(
                400, f"model {model!r} is a directory without config.json: name a saved model's directory."
            )
        _check_model_directory(local, f"model {model!r}", 400)
        return
    import huggingface_hub
    from huggingface_hub.utils import HFValidationError

    try:
        cached = huggingface_hub.try_to_load_from_cache(model, "config.json", revision=revision or None)
    except HFValidationError:
        cached = None
    if isinstance(cached, str):
        _check_model_directory(Path(cached).parent, f"model {model!r}", 400, tokenizer=False)
        return
    if huggingface_hub.constants.HF_HUB_OFFLINE:
        raise _http_error(
            404,
            f"model {model!r} is neither a local directory nor in the Hub cache, and the Hub is offline "
            "(HF_HUB_OFFLINE): name a local model directory, or download it first.",
        )
    try:  # one request, no retries: transformers' download retries for ~2 minutes when the Hub is unreachable
        huggingface_hub.HfApi().model_info(model, revision=revision or None, timeout=10)
    except (huggingface_hub.errors.RepositoryNotFoundError, huggingface_hub.errors.RevisionNotFoundError):
        raise _http_error(
            404, f"model {model!r} is not a local directory and not a model on the Hub: check the name."
        ) from None
    except Exception as exc:
        raise _http_error(
            404,
            f"model {model!r} is not a local directory, and the Hub cannot be reached to look it up "
            f"({one_line(exc)[:120]}): name a local model directory.",
        ) from None


def _check_model_directory(directory: Path, shown: str, status: int | None, *, tokenizer: bool = True) -> None:
    """A model directory checked before transformers loads it: its config asks for no more model than its weights hold
    (`check_diff_checkpoint`: a config.json claiming 10^5 layers took minutes to build), and it has a tokenizer (the
    server answers text). An HTTP error with STATUS, or a `UserError` (start-up) when STATUS is None."""
    from ..checkpoints.adapters import has_tokenizer
    from ..checkpoints.loading import check_diff_checkpoint

    try:
        check_diff_checkpoint(directory, name=shown.split(" ", 1)[0])
        weights = any(directory.glob("*.safetensors"))  # none: transformers says what the directory lacks
        if tokenizer and weights and not has_tokenizer(directory):
            raise UserError(
                f"{shown} has no tokenizer (tokenizer.json, tokenizer_config.json): the server answers text; save "
                "the tokenizer with the model (tokenizer.save_pretrained)."
            )
    except UserError as error:
        if status is None:
            raise
        raise _http_error(status, str(error)) from None


@functools.cache
def diff_model_manager():
    """transformers' `ModelManager` with what clients rely on: `/v1/models` lists what this server answers for, and a
    model that does not exist or does not load is a 404/400 with one line, at once."""
    from transformers.cli.serving.model_manager import ModelManager

    class DiffModelManager(ModelManager):
        def get_gen_models(self, cache_dir=None) -> list[dict]:
            if self.force_model is not None:  # pinned: the one name requests may use
                names = [self.force_model]
            elif _served_models:  # `serve A B`: the names requests may use, loaded or not
                names = list(_served_models)
            else:
                names = [_display_name(key) for key in list(self.loaded_models)]
            listed = [{"id": name, "object": "model", "created": 0, "owned_by": "diff-transformer"} for name in names]
            if self.force_model is None and not _served_models:
                try:  # transformers' scan of the Hub cache raises when the cache folder does not exist
                    listed += [m for m in ModelManager.get_gen_models(cache_dir) if m["id"] not in names]
                except Exception:
                    pass
            return listed

        def load_model_and_processor(self, model_id_and_revision, *args, **kwargs):
            key = model_id_and_revision if kwargs.get("gguf_file") is None else None
            if key is not None and key not in self.loaded_models:
                check_loadable(model_id_and_revision)
            try:
                return super().load_model_and_processor(model_id_and_revision, *args, **kwargs)
            except Exception as exc:
                if getattr(exc, "status_code", None):
                    raise
                raise _http_error(
                    400, f"model {_display_name(model_id_and_revision)!r} cannot be loaded: {one_line(exc)[:300]}"
                ) from None

    return DiffModelManager


async def load_off_the_loop(handler, body: dict) -> None:
    """The model a request names, loaded in a worker thread before transformers' handler runs: the handler loads it
    synchronously on the event loop, so every other request (another model's, /health) waited for the load. A
    request transformers will refuse anyway (422, 400) is left to it; a pinned model is loaded at start-up."""
    import asyncio

    from transformers.cli.serving.utils import split_model_id

    manager = handler.model_manager
    requested = body.get("model")
    if manager.force_model is not None or not isinstance(requested, str) or not requested:
        return
    handler._validate_request(body)
    model, gguf_file = split_model_id(requested)
    await asyncio.to_thread(manager.load_model_and_processor, manager.process_model_name(model), gguf_file=gguf_file)


async def render_off_the_loop(handler, body: dict) -> None:
    """A chat request's template rendered in a worker thread, within the bounds of `..chat_templates`: one
    past them answers 400. transformers' handler renders it on the event loop; its render then returns this one's
    text (`templates.prerendered`, matched on the template and every value it is rendered with), so a slow template
    never holds up the loop (and /health, other models, other requests)."""
    import asyncio

    from transformers.cli.serving.utils import Modality

    from .. import chat_templates as templates

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
        return templates.render_capturing(
            processor.apply_chat_template,
            messages,
            add_generation_prompt=True,
            tools=body.get("tools"),
            tokenize=False,
            return_dict=False,
            load_audio_from_video=modality == Modality.MULTIMODAL and has_video,
            **kwargs,
        )

    name = _display_name(str(body.get("model")))
    try:
        rendered = await asyncio.to_thread(render)
    except templates.ChatRenderError as error:  # too large a request, or a bound: one line
        raise _http_error(400, f"model {name!r}: {error}.") from None
    except Exception as exc:
        if getattr(exc, "status_code", None):
            raise
        raise _http_error(400, f"the chat template of model {name!r} failed: {one_line(exc)[:300]}") from None
    if rendered is not None:
        templates.prerendered(rendered)


def openai_errors(app) -> None:
    """Errors as OpenAI's API returns them (`{"error": {"message", "type", "param", "code"}}`), which its clients
    read: ours (`serve_requests.http_error`), transformers' HTTPExceptions, and anything unforeseen (a 500 whose
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


def check_pinned(manager, body: dict) -> None:
    """A pinned server (`serve MODEL`, `serve A B`) answers for those models alone: another name is a 404 (the model
    is not served here), as for a model that does not exist (transformers answered 400)."""
    requested = body.get("model")
    pinned = manager.force_model
    if pinned is not None and requested is not None and requested != pinned:
        raise _http_error(
            404,
            f"model {requested!r} is not served here: this server is pinned to {pinned!r}; name it, or omit model.",
        )
    if _served_models and requested not in _served_models:
        served = ", ".join(repr(name) for name in _served_models)
        if requested is None:
            raise _http_error(400, f"name the model: this server answers for {served}.", param="model")
        raise _http_error(404, f"model {requested!r} is not served here: this server answers for {served}.")


def client_facing() -> None:
    """Install `diff_model_manager`, `check_request`, `load_off_the_loop` and `openai_errors` where transformers'
    `Serve` picks them up (it imports `ModelManager` and `build_server` when it starts, every handler validates
    through `BaseHandler._validate_request`, and each model handler's `handle_request` is wrapped)."""
    from transformers.cli.serving import model_manager, server, utils

    from .serve_requests import as_openai, check_request

    model_manager.ModelManager = diff_model_manager()
    build = server.build_server
    if not getattr(build, "_diff_errors", False):

        @functools.wraps(build)
        def build_server(*args, **kwargs):
            app = build(*args, **kwargs)
            openai_errors(app)
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
                await load_off_the_loop(self, body)
                if chat:
                    await render_off_the_loop(self, body)
                if openai_shaped:
                    return await as_openai(handle, self, body, *args, sse_done=True, **kwargs)
                return await handle(self, body, *args, **kwargs)

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


def expose_to_transformers_serve() -> None:
    """Make `getattr(transformers, "DiffForCausalLM")` (and DiffModel) resolve for transformers' model manager."""
    from transformers.cli.serving import model_manager

    from ..modeling_diff import DiffForCausalLM, DiffModel

    # The module object the model manager imported (transformers can swap `sys.modules["transformers"]` for a
    # fresh lazy module while importing its submodules, so `import transformers` here could be a different one).
    for cls in (DiffModel, DiffForCausalLM):
        setattr(model_manager.transformers, cls.__name__, cls)


def _generation_limit(model, inputs: dict, gen_config, limit: int | None) -> None:
    """Clamp `gen_config.max_new_tokens` to the context left after the prompt (and to `limit`); a request's
    settings outside their range (`num_beams: -3` in its generation_config) are an HTTP 400, not a 500 mid-run."""
    from fastapi import HTTPException

    from ..checkpoints.configs import generation_value_problem
    from .serve_requests import check_token_ids

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
    (`serve_requests.stop_streaming`)."""
    from transformers.cli.serving import utils

    from .serve_requests import stop_non_streaming, stop_streaming

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


def _transformers_flags() -> set[str]:
    """The options of transformers' `Serve` that take no value (its bool parameters, `--x` and `--no-x`): any other
    option's next argument is its value, not a MODEL."""
    import inspect
    import typing

    from transformers.cli.serve import Serve

    flags = {"--help"}
    for name, parameter in inspect.signature(Serve.__init__).parameters.items():
        annotation = parameter.annotation
        kind = typing.get_args(annotation)[0] if hasattr(annotation, "__metadata__") else annotation
        if kind is bool or kind == (bool | None):
            flags |= {f"--{name.replace('_', '-')}", f"--no-{name.replace('_', '-')}"}
    return flags


def _own_options(argv: list[str]) -> tuple[list[str], int | None, bool, tuple[str, ...]]:
    """(ARGV less our options, --max-new-tokens-limit's N, --quiet, the MODELs when several), each MODEL checked to
    exist. One MODEL goes to transformers (its pinned `force_model`); several stay here (`_served_models`)."""
    from ..checkpoints.names import resolve_model

    rest, limit, quiet, index = [], None, False, 0
    while index < len(argv):
        arg = argv[index]
        if arg == "--quiet":
            quiet = True
            index += 1
            continue
        if arg == "--transformers-help":
            rest.append("--help")
            index += 1
            continue
        if arg == "--max-new-tokens-limit" or arg.startswith("--max-new-tokens-limit="):
            value = arg.partition("=")[2] if "=" in arg else (argv[index + 1] if index + 1 < len(argv) else "")
            index += 1 if "=" in arg else 2
            if not value.isdigit() or int(value) < 1:
                raise UserError(f"--max-new-tokens-limit {value!r} must be a whole number >= 1.")
            limit = int(value)
            continue
        rest.append(arg)
        index += 1
    _check_device_options(rest)
    flags = _transformers_flags()
    positions = [
        i
        for i, arg in enumerate(rest)
        if not arg.startswith("-")
        and (i == 0 or not rest[i - 1].startswith("-") or "=" in rest[i - 1] or rest[i - 1] in flags)
    ]
    models = [rest[i] for i in positions]
    for model in models:
        if ":" in model or "@" in model:  # GGUF "<repo>:<file>", revisions: the Hub's
            continue
        _, local = resolve_model(model, name="MODEL")  # a mistyped path: one line, before the server starts
        if local is not None and not (local / "config.json").is_file():
            raise UserError(f"MODEL {model!r} is a directory without config.json: pass a saved model's directory.")
        if local is not None:
            _check_model_directory(local, f"MODEL {model}", None)
    if len(set(models)) < len(models):
        raise UserError(f"MODEL {next(m for m in models if models.count(m) > 1)!r} is named twice: name it once.")
    served = tuple(models) if len(models) > 1 else ()
    if served:
        rest = [arg for i, arg in enumerate(rest) if i not in positions]
    if quiet and not any(arg == "--log-level" or arg.startswith("--log-level=") for arg in rest):
        rest += ["--log-level", "error"]
    return rest, limit, quiet, served


def _check_device_options(argv: list[str]) -> None:
    """transformers' --device and --dtype, checked as the other commands check theirs (`options.resolve_device`,
    `options.DTYPES`) before the server starts: transformers takes any string and fails at the first request."""
    from .options import DTYPES, resolve_device

    for index, arg in enumerate(argv):
        option, equals, value = arg.partition("=")
        if option not in ("--device", "--dtype"):
            continue
        if not equals:
            value = argv[index + 1] if index + 1 < len(argv) else ""
            if value.startswith("--"):
                raise UserError(f"{option} needs a value, e.g. {option} {'cpu' if option == '--device' else 'auto'}.")
        if option == "--dtype" and value not in DTYPES:
            raise UserError(f"--dtype {value!r} is not a dtype for the weights: use one of {', '.join(DTYPES)}.")
        if option == "--device" and value != "auto":
            resolve_device(f"cuda:{value}" if value.isdigit() else value)  # transformers reads "N" as cuda:N


def main(argv=None):
    """Run `transformers serve` with ARGV (its options: model, --continuous-batching, --port, ...)."""
    import typer
    from transformers.cli.serve import Serve

    global _uvicorn_log_level, _served_models
    argv, limit, quiet, _served_models = _own_options(sys.argv[1:] if argv is None else list(argv))
    _uvicorn_log_level = "warning" if quiet else None
    from ..chat_templates import bound_chat_templates

    bound_chat_templates()
    expose_to_transformers_serve()
    client_facing()
    limit_generation(limit)
    graceful_shutdown()
    app = typer.Typer(add_completion=False)
    app.command(help=Serve.__doc__)(Serve)
    with output_settings(quiet):
        return app(argv, prog_name="diff-transformer serve")


if __name__ == "__main__":
    main()
