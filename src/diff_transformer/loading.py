"""Models named on the command line (`generate`, `train`, and SRC of `convert`): a local path or a Hub id, checked
before transformers tries it, so that every problem is one line naming the input and the fix.

* A name that does not exist locally is a Hub id only when it reads as one (`org/name`), or when forced with
  `hf://` (`hf://gpt2`); otherwise it is a mistyped path and is reported as such at once, instead of after the Hub
  client's retries.
* A local Diff checkpoint is compared with its config before loading: a `diff_version` that disagrees with the
  weights (an edited config.json) is named as such, not as transformers' size mismatch.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

from .errors import UserError


HUB_PREFIX = "hf://"
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[\w.\-]+)?$")


def hub_id(text: str, *, name: str = "MODEL", error: type[UserError] = UserError) -> str:
    """`text`, which is not an existing path, as a Hub model id; `error` when it reads as a mistyped local path."""
    repo = text.removeprefix(HUB_PREFIX)
    if not _REPO_ID.match(repo) or ".." in repo:
        raise error(
            f"{name} {text!r} is neither an existing directory nor a valid Hub model id: check the path, or pass an "
            "id like 'org/model'."
        )
    if text.startswith(HUB_PREFIX):
        return repo
    first = repo.split("/")[0]
    if "/" not in repo:
        raise error(
            f"{name} {text!r} does not exist: check the path (for the Hub model {repo!r}, pass {HUB_PREFIX}{repo})."
        )
    if Path(first).is_dir():
        raise error(
            f"{name} {text!r} does not exist (the directory {first} does): check the path (for the Hub model "
            f"{repo!r}, pass {HUB_PREFIX}{repo})."
        )
    return repo


def resolve_model(text, *, name: str = "MODEL", error: type[UserError] = UserError) -> tuple[str, Path | None]:
    """(what to pass to `from_pretrained`, the local directory or None for a Hub id)."""
    text = str(text)
    path = Path(text).expanduser()
    if path.exists():
        if not path.is_dir():
            raise error(
                f"{name} {text!r} is a file: pass the checkpoint directory (config.json + weights) or a Hub id."
            )
        return str(path), path
    return hub_id(text, name=name, error=error), None


CONFIG_MAX_BYTES = 16 << 20  # a config.json is kilobytes; anything near this is not one (and is not read whole)


def read_json(path: Path, *, error: type[UserError] = UserError):
    """A JSON file's content, or `error` naming the file (also for nesting too deep for the parser, or a file far
    larger than any config)."""
    try:
        if path.stat().st_size > CONFIG_MAX_BYTES:
            raise error(f"{path} is over {CONFIG_MAX_BYTES >> 20} MB, not a config: restore or re-download it.")
        return json.loads(path.read_text(encoding="utf-8"))
    except RecursionError:
        raise error(f"{path} is nested too deeply to be a config: restore or re-download it.") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise error(
            f"{path} is not valid JSON ({' '.join(str(exc).split())[:200]}): restore or re-download it."
        ) from None


def _refuse_special(directory: Path, error: type[UserError]) -> None:
    """A checkpoint's JSON files are never opened when they are not regular files (a FIFO would block a read)."""
    import stat

    for name in ("config.json", "generation_config.json", "tokenizer_config.json", "tokenizer.json"):
        try:
            mode = (directory / name).stat().st_mode
        except OSError:
            continue
        if not stat.S_ISREG(mode):
            raise error(f"{directory / name} is not a regular file: restore it (reading it could block forever).")


def check_model_type(raw, where: str, *, error: type[UserError] = UserError) -> None:
    """A config.json's `model_type` must be a string (transformers would hash a list, or ask to run custom code)."""
    if isinstance(raw, dict) and "model_type" in raw and not isinstance(raw["model_type"], str):
        raise error(
            f'{where}: model_type {raw["model_type"]!r} is not a string: set it to the model\'s type, e.g. "llama" '
            'or "diff".'
        )


def check_model_config(config, where: str, *, error: type[UserError] = UserError, build: bool = True) -> None:
    """The values a model is built from, checked before any weight is read or written, each as one line naming the
    field and the fix: token ids inside the vocabulary, a RoPE type transformers knows, an attention backend that is
    installed; then (`build`) the model itself is built on the meta device (no memory for weights), so that whatever
    else transformers or torch would refuse while building it is refused here too. Building costs time in the number
    of layers: callers check that count against the weights first (a config.json claiming 10^5 layers)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = getattr(text_config, "vocab_size", None)
    pad = getattr(text_config, "pad_token_id", None)
    if isinstance(vocab, int) and isinstance(pad, int) and not 0 <= pad < vocab:
        raise error(
            f"{where}: pad_token_id={pad} is not a token id of the vocabulary (0 to {vocab - 1}): set it to a token "
            "id below vocab_size, or to null (no padding token), in config.json."
        )
    rope = getattr(text_config, "rope_parameters", None)
    rope_type = rope.get("rope_type", "default") if isinstance(rope, dict) else "default"
    if rope_type != "default" and rope_type not in ROPE_INIT_FUNCTIONS:
        known = ", ".join(["default", *ROPE_INIT_FUNCTIONS])
        raise error(
            f"{where}: rope_parameters.rope_type {rope_type!r} is not one transformers knows: use one of {known}."
        )
    if not build:
        return
    backend = getattr(config, "_attn_implementation", None)
    try:
        with torch.device("meta"):
            architecture = (getattr(config, "architectures", None) or [None])[0]
            model_class = _model_class(config, architecture)
            model_class._from_config(config) if model_class is not None else AutoModelForCausalLM.from_config(config)
    except Exception as exc:  # ImportError (backend), ValueError, AssertionError, KeyError... from the constructors
        message = " ".join(str(exc).split())[:200] or type(exc).__name__
        if backend not in (None, "eager", "sdpa") and isinstance(exc, (ImportError, ValueError)):
            raise error(
                f"{where}: _attn_implementation={backend!r} cannot be used here ({message}): remove it from "
                "config.json, or install its package."
            ) from None
        raise error(
            f"{where}: config.json does not describe a model transformers can build ({message}): fix it."
        ) from None


# generation_config.json fields -> (lowest, highest, lowest excluded): what generate() would otherwise fail on deep
# inside (num_beams -3: "negative dimension") or silently misuse (top_p 2, a negative repetition penalty).
GENERATION_RANGES = {
    "max_new_tokens": (1, None, False),
    "max_length": (1, None, False),
    "min_new_tokens": (0, None, False),
    "min_length": (0, None, False),
    "num_beams": (1, None, False),
    "num_beam_groups": (1, None, False),
    "num_return_sequences": (1, None, False),
    "top_k": (0, None, False),
    "no_repeat_ngram_size": (0, None, False),
    "top_p": (0.0, 1.0, True),
    "typical_p": (0.0, 1.0, True),
    "min_p": (0.0, 1.0, False),
    "epsilon_cutoff": (0.0, 1.0, False),
    "eta_cutoff": (0.0, 1.0, False),
    "temperature": (0.0, None, False),
    "repetition_penalty": (0.0, None, True),
    "diversity_penalty": (0.0, None, False),
}
_INTEGER_FIELDS = {"max_new_tokens", "max_length", "min_new_tokens", "min_length", "num_beams", "num_beam_groups"}
_INTEGER_FIELDS |= {"num_return_sequences", "top_k", "no_repeat_ngram_size"}


def generation_value_problem(field: str, value) -> str | None:
    """Why `value` cannot be generation setting `field` (None: it can, or the field is not range-checked)."""
    if field not in GENERATION_RANGES or value is None:
        return None
    low, high, open_low = GENERATION_RANGES[field]
    integer = field in _INTEGER_FIELDS
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not math.isfinite(value):
        return f"{field}={value!r} must be a{'n integer' if integer else ' finite number'}"
    if (value <= low if open_low else value < low) or (high is not None and value > high):
        bound = f"{'>' if open_low else '>='} {low}" + ("" if high is None else f" and <= {high}")
        return f"{field}={value} must be {bound}"
    return None


def check_generation_config(location: str, where: str, *, error: type[UserError] = UserError) -> None:
    """MODEL's generation_config.json (if any), range-checked before the weights load."""
    from transformers import GenerationConfig

    if Path(location).is_dir():
        _refuse_special(Path(location), error)
    try:
        generation = GenerationConfig.from_pretrained(location)
    except OSError:
        return  # none: generate() uses the model config's defaults
    except Exception as exc:
        message = " ".join(str(exc).split())[:200] or type(exc).__name__
        raise error(f"{where}: generation_config.json is invalid ({message}): fix it.") from None
    for field, value in generation.to_dict().items():
        problem = generation_value_problem(field, value)
        if problem:
            raise error(f"{where}: in generation_config.json, {problem}: fix it or remove the field.")


def _model_class(config, architecture: str | None):
    """The class a Diff config's `architectures` names (task heads included), else None (the Auto class decides)."""
    if getattr(config, "model_type", None) != "diff":
        return None
    from . import modeling_diff

    return getattr(modeling_diff, architecture or "DiffForCausalLM", modeling_diff.DiffForCausalLM)


def _weight_shapes(directory: Path, error: type[UserError]) -> dict[str, tuple[int, ...]] | None:
    """Tensor name -> shape from the safetensors headers, or None when the checkpoint has no safetensors weights."""
    from .conversion.errors import ConversionError
    from .conversion.source import SAFETENSORS_INDEX, SAFETENSORS_SINGLE, find_shards, read_headers

    if not ((directory / SAFETENSORS_INDEX).is_file() or (directory / SAFETENSORS_SINGLE).is_file()):
        return None
    try:
        return {name: info.shape for name, info in read_headers(directory, find_shards(directory)).items()}
    except ConversionError as exc:
        raise error(str(exc)) from None


def _stored_layers(shapes: dict) -> int:
    """How many decoder layers the weights hold (`model.layers.<i>.` names)."""
    indices = {int(m.group(1)) for name in shapes if (m := re.match(r"model\.layers\.(\d+)\.", name))}
    return max(indices) + 1 if indices else 0


def _mismatch(config, shapes: dict) -> str | None:
    """The first way the weights disagree with `DiffForCausalLM(config)`, or None."""
    import torch

    from .modeling_diff import DiffForCausalLM

    with torch.device("meta"):
        expected = {n: tuple(t.shape) for n, t in DiffForCausalLM(config).state_dict().items()}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    for key, shape in expected.items():
        if key not in shapes:
            return f"tensor {key} is missing"
        if tuple(shapes[key]) != shape:
            return f"tensor {key} has shape {list(shapes[key])}, but config.json implies {list(shape)}"
    return None


def check_diff_checkpoint(directory: Path, *, name: str = "MODEL", error: type[UserError] = UserError) -> None:
    """For a local Diff checkpoint: its config.json parses and its weights are those the config describes; a
    `diff_version` that disagrees with the weights is named with the fix."""
    config_file = directory / "config.json"
    _refuse_special(directory, error)
    if not config_file.is_file():
        return  # e.g. a PEFT adapter directory: transformers reports what is missing
    raw = read_json(config_file, error=error)
    check_model_type(raw, f"{name} {directory}", error=error)
    if not isinstance(raw, dict) or raw.get("model_type") != "diff":
        return
    shapes = _weight_shapes(directory, error)
    if shapes is None:
        return
    from .configuration_diff import DiffConfig

    try:
        config = DiffConfig.from_pretrained(directory)
    except Exception as exc:
        raise error(
            f"{config_file} is not a valid Diff config ({' '.join(str(exc).split())[:200]}): fix it."
        ) from None
    check_model_config(config, f"{name} {directory}", error=error, build=False)
    layers = _stored_layers(shapes)
    if layers != config.num_hidden_layers:  # before anything is built: a config can claim any number of layers
        raise error(
            f"{name} {directory}: config.json says num_hidden_layers={config.num_hidden_layers}, but the weights hold "
            f"{layers} layers: fix config.json or re-download the checkpoint."
        )
    check_model_config(config, f"{name} {directory}", error=error)
    problem = _mismatch(config, shapes)
    if problem is None:
        return
    version = config.diff_version
    other = 2 if version == 1 else 1
    try:
        fits_other = _mismatch(DiffConfig.from_dict({**config.to_dict(), "diff_version": other}), shapes) is None
    except Exception:
        fits_other = False
    if fits_other:
        raise error(
            f"{name} {directory}: config.json says diff_version={version}, but the weights are those of a "
            f'diff_version={other} model: set "diff_version": {other} in config.json.'
        )
    raise error(
        f"{name} {directory}: {problem}: config.json does not describe these weights; fix it or re-download the "
        "checkpoint."
    )


def load_causal_lm(text, *, name: str = "MODEL", error: type[UserError] = UserError, **kwargs):
    """`AutoModelForCausalLM.from_pretrained` of a command-line MODEL, with every failure as one `error` line."""
    from transformers import AutoModelForCausalLM

    import diff_transformer  # noqa: F401  (registers the Auto classes)

    location, local = resolve_model(text, name=name, error=error)
    if local is not None:
        check_diff_checkpoint(local, name=name, error=error)
    try:
        return AutoModelForCausalLM.from_pretrained(location, **kwargs)
    except Exception as exc:
        message = " ".join(str(exc).split())[:300] or type(exc).__name__
        raise error(
            f"cannot load {name} {text!r} ({message}): check that it is a complete checkpoint, or re-download it."
        ) from None


__all__ = [
    "HUB_PREFIX",
    "GENERATION_RANGES",
    "check_diff_checkpoint",
    "check_generation_config",
    "check_model_config",
    "check_model_type",
    "generation_value_problem",
    "hub_id",
    "load_causal_lm",
    "read_json",
    "resolve_model",
]
