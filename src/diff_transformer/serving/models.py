"""The models `diff-transformer serve` answers for, as clients see them: `/v1/models`, a model that does not exist
(404) or does not load (400) answered at once with one line, a pinned server's other names refused, a model loaded
in a worker thread, each Diff model loaded through the one road from a name to a model (`checkpoints.open`)."""

from pathlib import Path

from ..errors import UserError, one_line


def model_http_error(status: int, message: str, **fields):
    from .requests import http_error

    if status == 404:
        fields = {"param": "model", "code": "model_not_found", **fields}
    return http_error(status, message, **fields)


def display_name(model_id_and_revision: str) -> str:
    model, _, revision = model_id_and_revision.partition("@")
    return model if revision in ("", "main") else model_id_and_revision


def local_revision_problem(model_id_and_revision: str, shown: str = "model") -> str | None:
    """Why MODEL@REVISION cannot be loaded when MODEL is a local directory: a directory has no revisions (transformers
    ignores the revision for one, and loaded another copy of it for each revision string a request made up). Refused
    rather than read as the directory: a client that asks for a revision expects that revision's weights. `@main`, the
    name transformers gives every model without a revision, is the directory itself."""
    from ..checkpoints.names import resolve_model

    model, _, revision = model_id_and_revision.partition("@")
    if revision in ("", "main") or model == "":
        return None
    try:
        _, local = resolve_model(model, name=shown)
    except UserError:
        return None  # not a directory: the Hub's revision
    if local is None:
        return None
    return (
        f"{shown} {model_id_and_revision!r} names a revision of a local directory, which has none: name the "
        f"directory alone ({model!r})."
    )


def check_loadable(model_id_and_revision: str) -> None:
    """A model a request names, checked in well under a second before transformers tries to load it: 404 when it
    does not exist (no directory, not in the Hub cache offline, not on the Hub), 400 when it is not a model."""
    from ..checkpoints.names import resolve_model

    model, _, revision = model_id_and_revision.partition("@")
    try:
        _, local = resolve_model(model, name="model")
    except UserError as error:
        raise model_http_error(404, str(error)) from None
    if local is not None:
        if not (local / "config.json").is_file():
            raise model_http_error(
                400, f"model {model!r} is a directory without config.json: name a saved model's directory."
            )
        check_model_directory(local, f"model {model!r}", 400)
        return
    import huggingface_hub
    from huggingface_hub.utils import HFValidationError

    try:
        cached = huggingface_hub.try_to_load_from_cache(model, "config.json", revision=revision or None)
    except HFValidationError:
        cached = None
    if isinstance(cached, str):
        check_model_directory(Path(cached).parent, f"model {model!r}", 400, tokenizer=False)
        return
    if huggingface_hub.constants.HF_HUB_OFFLINE:
        raise model_http_error(
            404,
            f"model {model!r} is neither a local directory nor in the Hub cache, and the Hub is offline "
            "(HF_HUB_OFFLINE): name a local model directory, or download it first.",
        )
    try:  # one request, no retries: transformers' download retries for ~2 minutes when the Hub is unreachable
        huggingface_hub.HfApi().model_info(model, revision=revision or None, timeout=10)
    except (huggingface_hub.errors.RepositoryNotFoundError, huggingface_hub.errors.RevisionNotFoundError):
        raise model_http_error(
            404, f"model {model!r} is not a local directory and not a model on the Hub: check the name."
        ) from None
    except Exception as exc:
        raise model_http_error(
            404,
            f"model {model!r} is not a local directory, and the Hub cannot be reached to look it up "
            f"({one_line(exc)[:120]}): name a local model directory.",
        ) from None


def check_model_directory(directory: Path, shown: str, status: int | None, *, tokenizer: bool = True) -> None:
    """A model directory opened through the one road from a name to a model (`checkpoints.open`) before transformers
    loads it: its config asks for no more model than its weights hold (a config.json claiming 10^5 layers took minutes
    to build), its generation_config.json is in range, and it has a tokenizer (the server answers text). An HTTP error
    with STATUS, or a `UserError` (start-up) when STATUS is None."""
    from .. import checkpoints
    from ..checkpoints.adapters import has_tokenizer

    try:
        checkpoints.open(directory, tokenizer=False, label=shown.split(" ", 1)[0])
        weights = any(directory.glob("*.safetensors"))  # none: transformers says what the directory lacks
        if tokenizer and weights and not has_tokenizer(directory):
            raise UserError(
                f"{shown} has no tokenizer (tokenizer.json, tokenizer_config.json): the server answers text; save "
                "the tokenizer with the model (tokenizer.save_pretrained)."
            )
    except UserError as error:
        if status is None:
            raise
        raise model_http_error(status, str(error)) from None


def diff_model_manager(settings=None):
    """transformers' `ModelManager` with what clients rely on: `/v1/models` lists what this server answers for, a
    model that does not exist or does not load is a 404/400 with one line, at once, and every build and drop of a model
    is serialised (see `DiffModelManager`)."""
    import collections
    import sys
    import threading
    import time

    from transformers.cli.serving.model_manager import ModelManager, TimedModel

    from .patches import ServeSettings

    ModelManager = getattr(ModelManager, "_diff_original", ModelManager)  # transformers', not a previous install's
    settings = settings or ServeSettings()
    served_models = settings.served

    class ManagedModel(TimedModel):
        """transformers' `TimedModel` whose idle timeout (--model-timeout) unloads through the manager's lock, and
        never while a request uses the model (transformers' timer thread deleted it under a request's feet:
        "'TimedModel' object has no attribute 'model'", "Unknown modality for: NoneType")."""

        def __init__(self, model, timeout_seconds, processor, *, manager, key):
            self._manager, self._key = manager, key
            super().__init__(model, timeout_seconds, processor=processor)

        def _timeout_reached(self) -> None:
            if self.timeout_seconds > 0:
                self._manager._expire(self._key, self)

    class DiffModelManager(ModelManager):
        """Loads under one lock (`_build`) around everything that builds or drops a model: transformers' manager locks
        per model, so two models loaded at once, and `from_pretrained` is not thread-safe (4 threads loading at once
        left the tied lm_head uninitialised: answers off by 1e30, or NaN, with HTTP 200). A request pins its model
        (`acquire` ... `release`) from before its handler runs to the last byte of its answer; making room for another
        model (--max-loaded-models) and the idle timeout unload only unpinned models, so no request answers from a
        half-loaded or unloaded one. The bookkeeping (`loaded_models`, pins, last uses) has its own lock
        (`_state`), held for microseconds, so a loaded model is handed out on the event loop without waiting for
        another model's load."""

        def __init__(self, *args, **kwargs):
            self.settings = settings
            self._build = threading.Lock()  # held while a model is built or dropped
            self._state = threading.Condition()  # loaded_models, _pins, _uses; notified when a pin or model goes
            self._pins: collections.Counter[str] = collections.Counter()  # requests using each model
            self._uses: collections.OrderedDict[str, None] = collections.OrderedDict()  # loaded, least recent first
            super().__init__(*args, **kwargs)

        def get_gen_models(self, cache_dir=None) -> list[dict]:
            if self.force_model is not None:  # pinned: the one name requests may use
                names = [self.force_model]
            elif served_models:  # `serve A B`: the names requests may use, loaded or not
                names = list(served_models)
            else:
                names = [display_name(key) for key in list(self.loaded_models)]
            listed = [{"id": name, "object": "model", "created": 0, "owned_by": "diff-transformer"} for name in names]
            if self.force_model is None and not served_models:
                try:  # transformers' scan of the Hub cache raises when the cache folder does not exist
                    listed += [m for m in ModelManager.get_gen_models(cache_dir) if m["id"] not in names]
                except Exception:
                    pass
            return listed

        def load_model_and_processor(
            self, model_id_and_revision, progress_callback=None, tqdm_class=None, gguf_file=None
        ):
            """transformers' entry point (its handlers' `_resolve_model`, `/load_model`, a pinned model at start):
            the model, loaded if it is not, without a pin (a request's handler runs under the pin `acquire` took)."""
            model, processor, _ = self.acquire(
                model_id_and_revision,
                gguf_file=gguf_file,
                pin=False,
                progress_callback=progress_callback,
                tqdm_class=tqdm_class,
            )
            return model, processor

        def acquire(self, model_id_and_revision, *, gguf_file=None, pin=True, progress_callback=None, tqdm_class=None):
            """(model, processor, release): the model loaded (once, under `_build`), pinned when PIN until `release()`
            (idempotent) is called."""
            problem = local_revision_problem(model_id_and_revision)
            if problem:
                raise model_http_error(400, problem, param="model")
            key = model_id_and_revision if gguf_file is None else f"{model_id_and_revision}:{gguf_file}"
            found = self._loaded(key, pin, progress_callback)
            if found is not None:
                return found
            if gguf_file is None:
                check_loadable(model_id_and_revision)
            with self._build:
                found = self._loaded(key, pin, progress_callback)  # loaded while this thread waited
                if found is not None:
                    return found
                self._make_room()
                if progress_callback is not None:
                    progress_callback({"status": "loading", "model": key, "stage": "processor"})
                started = time.monotonic()
                self._say(f"loading model {display_name(key)!r}")
                try:
                    processor = self._load_processor(model_id_and_revision, gguf_file=gguf_file)
                    model = self._load_model(
                        model_id_and_revision,
                        tqdm_class=tqdm_class,
                        progress_callback=progress_callback,
                        gguf_file=gguf_file,
                    )
                except Exception as exc:
                    if getattr(exc, "status_code", None):
                        raise
                    if isinstance(exc, UserError):  # the road's line names the model and the fix
                        raise model_http_error(400, str(exc)) from None
                    raise model_http_error(
                        400, f"model {display_name(model_id_and_revision)!r} cannot be loaded: {one_line(exc)[:300]}"
                    ) from None
                self._say(f"loaded model {display_name(key)!r} in {time.monotonic() - started:.1f} s")
                timed = ManagedModel(model, self.model_timeout, processor, manager=self, key=key)
                with self._state:
                    self.loaded_models[key] = timed
                    self._uses[key] = None
                    release = self._pin(key) if pin else _nothing
            if progress_callback is not None:
                progress_callback({"status": "ready", "model": key, "cached": False})
            return model, processor, release

        def _load_model(self, model_id_and_revision, tqdm_class=None, progress_callback=None, gguf_file=None):
            """A Diff checkpoint through the one road from a name to a model (`checkpoints.open(...).load()`, as every
            command loads one) with the server's options: safetensors only (transformers' loader unpickled a Hub
            repo's pytorch_model.bin), the package's classes, the generation fields as `generate` has them. Any other
            model (a Llama, a decision or speech model, a GGUF file) loads as transformers' server loads it."""
            from transformers import PretrainedConfig

            model_id, _, revision = model_id_and_revision.partition("@")
            revision = revision or None
            raw = {} if gguf_file else PretrainedConfig.get_config_dict(model_id, revision=revision)[0]
            if raw.get("model_type") != "diff":
                return ModelManager._load_model(self, model_id_and_revision, tqdm_class, progress_callback, gguf_file)
            from .. import checkpoints

            checkpoint = checkpoints.open(model_id, tokenizer=False, label="model", revision=revision)
            options = {"tqdm_class": tqdm_class, "device_map": self.device}
            options |= {"dtype": self.dtype, "attn_implementation": self.attn_implementation}
            options["trust_remote_code"] = self.trust_remote_code  # the Auto classes still pick the package's Diff
            quantization = self.get_quantization_config()
            if quantization is not None:
                options["quantization_config"] = quantization
            if progress_callback is not None:
                progress_callback({"status": "loading", "model": model_id_and_revision, "stage": "weights"})
            return checkpoint.load(**options)

        def _say(self, line: str) -> None:
            """One line on stderr, flushed (a log file shows it when it happens), unless --quiet: a load takes from
            seconds to minutes, during which the server would otherwise print nothing."""
            if not settings.quiet:
                print(f"diff-transformer serve: {line}", file=sys.stderr, flush=True)

        def _loaded(self, key, pin, progress_callback):
            with self._state:
                timed = self.loaded_models.get(key)
                if timed is None:
                    return None
                timed.reset_timer()
                self._uses.move_to_end(key)
                found = timed.model, timed.processor, self._pin(key) if pin else _nothing
            if progress_callback is not None:
                progress_callback({"status": "ready", "model": key, "cached": True})
            return found

        def _pin(self, key):
            """One more request using KEY (under `_state`); the function that ends its use."""
            self._pins[key] += 1
            released = False

            def release() -> None:
                nonlocal released
                with self._state:
                    if released:
                        return
                    released = True
                    self._pins[key] -= 1
                    if self._pins[key] <= 0:
                        del self._pins[key]
                    self._state.notify_all()

            return release

        def _make_room(self) -> None:
            """Under `_build`: unload the least recently used unpinned models until one more fits in
            --max-loaded-models, waiting for requests to end their use when every loaded model is pinned: at most
            `model_wait_s` (a stream whose client stopped reading holds its pin), then a 503 the client may retry."""
            deadline = time.monotonic() + settings.model_wait_s
            while True:
                with self._state:
                    while len(self.loaded_models) >= settings.max_loaded_models:
                        victim = next((key for key in self._uses if not self._pins[key]), None)
                        if victim is not None:
                            break
                        if not self._state.wait(timeout=max(0.0, deadline - time.monotonic())):
                            raise model_http_error(
                                503,
                                f"every loaded model is in use (--max-loaded-models {settings.max_loaded_models}) "
                                f"and none was free within {settings.model_wait_s:g} s: retry later.",
                                code="models_busy",
                            )
                    else:
                        return
                    timed = self.loaded_models.pop(victim)
                    del self._uses[victim]
                timed.delete_model()
                name, bound = display_name(victim), settings.max_loaded_models
                self._say(f"unloaded model {name!r}, the least recently used (--max-loaded-models {bound})")

        def _expire(self, key, timed) -> None:
            """--model-timeout passed with KEY idle (transformers' timer thread): unloaded unless a request uses it."""
            with self._build:
                with self._state:
                    if self.loaded_models.get(key) is not timed:
                        return
                    if self._pins[key]:
                        timed.reset_timer()
                        return
                    del self.loaded_models[key]
                    del self._uses[key]
                timed.delete_model()
                self._say(f"unloaded model {display_name(key)!r} after {timed.timeout_seconds} s idle")

        def shutdown(self) -> None:
            """Every model unloaded (`/reset`, the server's end); a request generating keeps its own reference."""
            with self._build:
                with self._state:
                    dropped = list(self.loaded_models.values())
                    self.loaded_models.clear()
                    self._uses.clear()
                    self._state.notify_all()
                for timed in dropped:
                    timed.delete_model()

    return DiffModelManager


def _nothing() -> None:
    """The release of a model taken without a pin."""


async def load_off_the_loop(handler, body: dict):
    """The model a request names, loaded in a worker thread and pinned before transformers' handler runs (the handler
    loads it synchronously on the event loop, so every other request, /health included, waited for the load): the
    function that unpins it, or None when there is nothing to pin. A request transformers will refuse anyway (422,
    400) is left to it; a pinned server's model is loaded at start-up and never unloaded."""
    import asyncio
    import threading

    from transformers.cli.serving.utils import split_model_id

    manager = handler.model_manager
    requested = body.get("model")
    if manager.force_model is not None or not isinstance(requested, str) or not requested:
        return None
    handler._validate_request(body)
    model, gguf_file = split_model_id(requested)
    key = manager.process_model_name(model)
    loop = asyncio.get_running_loop()
    acquired = loop.create_future()

    def answer(outcome, error) -> None:
        if acquired.cancelled():  # the request was cancelled while it waited: its pin goes at once
            if error is None:
                outcome[2]()
        elif error is None:
            acquired.set_result(outcome[2])
        else:
            acquired.set_exception(error)

    def acquire() -> None:
        try:
            outcome = manager.acquire(key, gguf_file=gguf_file)
        except BaseException as error:
            loop.call_soon_threadsafe(answer, None, error)
        else:
            loop.call_soon_threadsafe(answer, outcome, None)

    # A thread of its own, not asyncio's shared pool: a request waiting here for another model's load, or for a place
    # (--max-loaded-models), would otherwise hold a pool thread that the requests it waits for need to finish (their
    # renders run there): 6 waiting requests on a 2-core machine's 6 pool threads deadlocked the server. The threads
    # are bounded by --max-queued-requests.
    threading.Thread(target=acquire, name=f"load {key}", daemon=True).start()
    return await acquired


def check_pinned(manager, body: dict) -> None:
    """A pinned server (`serve MODEL`, `serve A B`) answers for those models alone: another name is a 404 (the model
    is not served here), as for a model that does not exist (transformers answered 400)."""
    requested = body.get("model")
    pinned = manager.force_model
    served_models = manager.settings.served
    if pinned is not None and requested is not None and requested != pinned:
        raise model_http_error(
            404,
            f"model {requested!r} is not served here: this server is pinned to {pinned!r}; name it, or omit model.",
        )
    if served_models and requested not in served_models:
        served = ", ".join(repr(name) for name in served_models)
        if requested is None:
            raise model_http_error(400, f"name the model: this server answers for {served}.", param="model")
        raise model_http_error(404, f"model {requested!r} is not served here: this server answers for {served}.")
