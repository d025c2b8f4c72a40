"""The models `diff-transformer serve` answers for, as clients see them: `/v1/models`, a model that does not exist
(404) or does not load (400) answered at once with one line, a pinned server's other names refused, a model loaded
in a worker thread, and the Diff classes made resolvable where transformers' model manager looks them up."""

import functools
from pathlib import Path

from ..errors import UserError, one_line


served_models: tuple[str, ...] = ()  # `serve A B ...`: the models this server answers for, listed from the start
max_loaded_models = 4  # --max-loaded-models (`server.install` sets it)


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
        raise model_http_error(status, str(error)) from None


@functools.cache
def diff_model_manager():
    """transformers' `ModelManager` with what clients rely on: `/v1/models` lists what this server answers for, and a
    model that does not exist or does not load is a 404/400 with one line, at once."""
    import collections
    import threading

    from transformers.cli.serving.model_manager import ModelManager

    class DiffModelManager(ModelManager):
        def __init__(self, *args, **kwargs):
            self._room = threading.Lock()  # one new model loads at a time, so the count holds
            self._uses: collections.OrderedDict[str, None] = collections.OrderedDict()  # least recent first
            self._uses_lock = threading.Lock()  # requests load from worker threads
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

        def load_model_and_processor(self, model_id_and_revision, *args, **kwargs):
            problem = local_revision_problem(model_id_and_revision)
            if problem:
                raise model_http_error(400, problem, param="model")
            gguf_file = kwargs.get("gguf_file")
            key = model_id_and_revision if gguf_file is None else f"{model_id_and_revision}:{gguf_file}"
            if key in self.loaded_models:
                loaded = self._load(model_id_and_revision, *args, **kwargs)
            else:
                if gguf_file is None:
                    check_loadable(model_id_and_revision)
                with self._room:
                    if key not in self.loaded_models:
                        self._make_room()
                    loaded = self._load(model_id_and_revision, *args, **kwargs)
            with self._uses_lock:
                self._uses[key] = None
                self._uses.move_to_end(key)
            return loaded

        def _load(self, model_id_and_revision, *args, **kwargs):
            try:
                return super().load_model_and_processor(model_id_and_revision, *args, **kwargs)
            except Exception as exc:
                if getattr(exc, "status_code", None):
                    raise
                raise model_http_error(
                    400, f"model {display_name(model_id_and_revision)!r} cannot be loaded: {one_line(exc)[:300]}"
                ) from None

        def _make_room(self) -> None:
            """Unload the least recently used models until one more fits in --max-loaded-models (transformers holds
            every model it loaded until --model-timeout passes idle). A request generating with an unloaded model
            keeps its reference: its memory is freed when that generation ends."""
            while len(self.loaded_models) >= max_loaded_models:
                with self._uses_lock:
                    for key in [key for key in self._uses if key not in self.loaded_models]:
                        del self._uses[key]  # unloaded after --model-timeout
                    if not self._uses:
                        return
                    victim, _ = self._uses.popitem(last=False)
                timed = self.loaded_models.get(victim)
                if timed is not None:
                    timed.delete_model()  # removes it from loaded_models (transformers' on_unload)
                    self.loaded_models.pop(victim, None)

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


def check_pinned(manager, body: dict) -> None:
    """A pinned server (`serve MODEL`, `serve A B`) answers for those models alone: another name is a 404 (the model
    is not served here), as for a model that does not exist (transformers answered 400)."""
    requested = body.get("model")
    pinned = manager.force_model
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


def expose_to_transformers_serve() -> None:
    """Make `getattr(transformers, "DiffForCausalLM")` (and DiffModel) resolve for transformers' model manager."""
    from transformers.cli.serving import model_manager

    from ..modeling_diff import DiffForCausalLM, DiffModel

    # The module object the model manager imported (transformers can swap `sys.modules["transformers"]` for a
    # fresh lazy module while importing its submodules, so `import transformers` here could be a different one).
    for cls in (DiffModel, DiffForCausalLM):
        setattr(model_manager.transformers, cls.__name__, cls)
