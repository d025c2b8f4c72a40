"""Configs checked before anything is built from them or written: `config.json` (size, model_type, what a model
can be built from) and `generation_config.json` (value ranges). Shared by the converter, the commands that load a
model (`checkpoints.loading`) and the server, so each problem is one line naming the file and the fix."""

from __future__ import annotations

import json
import math
from pathlib import Path

from . import CheckpointError
from .schema import FP32_TINY


CONFIG_MAX_BYTES = 16 << 20  # a config.json is kilobytes; anything near this is not one (and is not read whole)


def read_json(path: Path):
    """A JSON file's content, or a `CheckpointError` naming the file (also for nesting too deep for the parser, or a
    file far larger than any config)."""
    try:
        if path.stat().st_size > CONFIG_MAX_BYTES:
            raise CheckpointError(
                f"{path} is over {CONFIG_MAX_BYTES >> 20} MB, not a config: restore or re-download it."
            )
        return json.loads(path.read_text(encoding="utf-8"))
    except RecursionError:
        raise CheckpointError(f"{path} is nested too deeply to be a config: restore or re-download it.") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(
            f"{path} is not valid JSON ({' '.join(str(exc).split())[:200]}): restore or re-download it."
        ) from None


def refuse_special_files(directory: Path) -> None:
    """A checkpoint's JSON files are never opened when they are not regular files (a FIFO would block a read)."""
    import stat

    for name in ("config.json", "generation_config.json", "tokenizer_config.json", "tokenizer.json"):
        try:
            mode = (directory / name).stat().st_mode
        except OSError:
            continue
        if not stat.S_ISREG(mode):
            raise CheckpointError(
                f"{directory / name} is not a regular file: restore it (reading it could block forever)."
            )


def check_model_type(raw, where: str) -> None:
    """A config.json's `model_type` must be a string (transformers would hash a list, or ask to run custom code), and
    its `architectures` a list of class names or null (what picks the model class, and Motif's converter)."""
    if isinstance(raw, dict) and "model_type" in raw and not isinstance(raw["model_type"], str):
        raise CheckpointError(
            f'{where}: model_type {raw["model_type"]!r} is not a string: set it to the model\'s type, e.g. "llama" '
            'or "diff".'
        )
    architectures = raw.get("architectures") if isinstance(raw, dict) else None
    if architectures is not None and not (
        isinstance(architectures, list) and all(isinstance(name, str) for name in architectures)
    ):
        shown = json.dumps(architectures)
        raise CheckpointError(
            f"{where}: architectures {shown if len(shown) <= 40 else shown[:37] + '...'} is not a list of class "
            'names: set it to e.g. ["LlamaForCausalLM"], or remove it.'
        )


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_model_config(config, where: str, *, build: bool = True) -> None:
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
        raise CheckpointError(
            f"{where}: pad_token_id={pad} is not a token id of the vocabulary (0 to {vocab - 1}): set it to a token "
            "id below vocab_size, or to null (no padding token), in config.json."
        )
    rope = getattr(text_config, "rope_parameters", None)
    theta = rope.get("rope_theta") if isinstance(rope, dict) else None
    if theta is not None and not (_is_number(theta) and 1.0 < theta < math.inf):
        raise CheckpointError(
            f"{where}: rope_parameters.rope_theta={theta!r} must be a finite number > 1 (RoPE's frequencies are "
            "theta^(-2i/d)): use the value the model was trained with, e.g. 10000.0, in config.json."
        )
    eps = getattr(text_config, "rms_norm_eps", None)
    if eps is not None and not (_is_number(eps) and FP32_TINY <= eps < math.inf):
        raise CheckpointError(
            f"{where}: rms_norm_eps={eps!r} must be a finite number >= {FP32_TINY:.3g} (below that it is 0 in float32 "
            "and an all-zero hidden state gives NaN): use the model's value, e.g. 1e-6, in config.json."
        )
    rope_type = rope.get("rope_type", "default") if isinstance(rope, dict) else "default"
    if rope_type != "default" and rope_type not in ROPE_INIT_FUNCTIONS:
        known = ", ".join(["default", *ROPE_INIT_FUNCTIONS])
        raise CheckpointError(
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
            raise CheckpointError(
                f"{where}: _attn_implementation={backend!r} cannot be used here ({message}): remove it from "
                "config.json, or install its package."
            ) from None
        raise CheckpointError(
            f"{where}: config.json does not describe a model transformers can build ({message}): fix it."
        ) from None


def check_generation_config(location: str, where: str, revision: str | None = None) -> None:
    """MODEL's generation_config.json (if any; a Hub model's at REVISION), its types (`schema.GENERATION_FIELDS`) and
    ranges (`generation.config.GENERATION_RANGES`) checked before the weights load."""
    from transformers import GenerationConfig

    if Path(location).is_dir():
        refuse_special_files(Path(location))
    try:
        generation = GenerationConfig.from_pretrained(location, revision=revision or "main")
    except OSError:
        return  # none: generate() uses the model config's defaults
    except Exception as exc:
        message = " ".join(str(exc).split())[:200] or type(exc).__name__
        raise CheckpointError(f"{where}: generation_config.json is invalid ({message}): fix it.") from None
    from ..generation.config import generation_value_problem
    from .schema import GENERATION_FIELDS, field_problem

    fields = generation.to_dict()
    problem = None
    for field, value in fields.items():  # the ranges first (their messages say the bound), then the types
        problem = problem or generation_value_problem(field, value)
    problem = problem or field_problem(fields, GENERATION_FIELDS)
    if problem:
        raise CheckpointError(f"{where}: in generation_config.json, {problem}: fix it or remove the field.")


def _model_class(config, architecture: str | None):
    """The class a Diff config's `architectures` names (task heads included), else None (the Auto class decides)."""
    if getattr(config, "model_type", None) != "diff":
        return None
    from .. import modeling_diff

    return getattr(modeling_diff, architecture or "DiffForCausalLM", modeling_diff.DiffForCausalLM)
