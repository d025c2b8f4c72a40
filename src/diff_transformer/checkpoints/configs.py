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


# Beams and returned sequences are rows of one batch, each with its own KV cache and vocabulary-sized logits:
# num_beams 10^6 asked generate() for a million caches (an out-of-memory after the model had loaded). Published uses
# of beam search take 4 to 12 beams; 64 leaves room and refuses the absurd before any weights load.
MAX_BEAMS = 64

# generation_config.json fields -> (lowest, highest, lowest excluded): what generate() would otherwise fail on deep
# inside (num_beams -3: "negative dimension"), run out of memory on (num_beams 10^6), or silently misuse (top_p 2, a
# negative repetition penalty).
GENERATION_RANGES = {
    "max_new_tokens": (1, None, False),
    "max_length": (1, None, False),
    "min_new_tokens": (0, None, False),
    "min_length": (0, None, False),
    "num_beams": (1, MAX_BEAMS, False),
    "num_beam_groups": (1, MAX_BEAMS, False),
    "num_return_sequences": (1, MAX_BEAMS, False),
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


# The smallest sampling temperature: sampling divides the (float32) logits by it, and a temperature near float32's
# smallest numbers (1e-30 with large logits, 1e-40 with any) turns them into inf and the probabilities into NaN, a
# crash in the middle of generate(). Any temperature below this one is greedy decoding in all but name: 0 says so.
MIN_TEMPERATURE = 1e-4


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
        if high == MAX_BEAMS:
            bound += " (each is a row of the batch, with its own KV cache)"
        return f"{field}={value} must be {bound}"
    if field == "temperature" and 0 < value < MIN_TEMPERATURE:
        return (
            f"temperature={value} is below {MIN_TEMPERATURE:g}, where sampling's probabilities overflow to NaN: use 0 "
            f"(greedy decoding, what such a temperature amounts to) or a temperature >= {MIN_TEMPERATURE:g}"
        )
    return None


def check_generation_config(location: str, where: str) -> None:
    """MODEL's generation_config.json (if any), range-checked before the weights load."""
    from transformers import GenerationConfig

    if Path(location).is_dir():
        refuse_special_files(Path(location))
    try:
        generation = GenerationConfig.from_pretrained(location)
    except OSError:
        return  # none: generate() uses the model config's defaults
    except Exception as exc:
        message = " ".join(str(exc).split())[:200] or type(exc).__name__
        raise CheckpointError(f"{where}: generation_config.json is invalid ({message}): fix it.") from None
    from .schema import GENERATION_FIELDS, field_problem

    fields = generation.to_dict()
    problem = None
    for field, value in fields.items():  # the ranges first (their messages say the bound), then the types
        problem = problem or generation_value_problem(field, value)
    problem = problem or field_problem(fields, GENERATION_FIELDS)
    if problem:
        raise CheckpointError(f"{where}: in generation_config.json, {problem}: fix it or remove the field.")


# The generation settings transformers' logits processors take as floats only (`RepetitionPenaltyLogitsProcessor`
# refuses the int 2 that a hand-written `"repetition_penalty": 2` loads as).
_FLOAT_FIELDS = ("temperature", "top_p", "typical_p", "min_p", "epsilon_cutoff", "eta_cutoff", "repetition_penalty")
_FLOAT_FIELDS += ("diversity_penalty", "length_penalty", "guidance_scale", "max_time")


def float_generation_fields(generation) -> None:
    """Set GENERATION's (a `GenerationConfig`, checked by `check_generation_config`) float-valued settings that a
    JSON file holds as whole numbers to floats, the type transformers' processors require."""
    for field in _FLOAT_FIELDS:
        value = getattr(generation, field, None)
        if isinstance(value, int) and not isinstance(value, bool):
            setattr(generation, field, float(value))


# generation_config.json fields that name token ids: one outside the vocabulary fails deep inside generate() (a
# ValueError for bad_words_ids, an IndexError for forced_eos_token_id) or is silently ignored (suppress_tokens).
_TOKEN_LIST_FIELDS = ("suppress_tokens", "begin_suppress_tokens")
_TOKEN_FIELDS = ("forced_bos_token_id", "forced_eos_token_id")


def generation_token_problem(generation: dict, vocab: int) -> str | None:
    """Why the token ids of a generation config (`GenerationConfig.to_dict()`) do not fit a vocabulary of VOCAB ids
    (None: they do)."""

    def bad(value) -> bool:
        return isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab

    def shown(value) -> str:
        text = json.dumps(value)
        return text if len(text) <= 60 else text[:57] + "..."

    words = generation.get("bad_words_ids")
    if words is not None:
        if not isinstance(words, list) or not all(isinstance(ids, list) and ids for ids in words):
            return f"bad_words_ids={shown(words)} must be a list of token-id lists, e.g. [[17], [42, 7]]"
        for ids in words:
            for token in ids:
                if bad(token):
                    return f"bad_words_ids holds {shown(token)}, not a token id of this model (0 to {vocab - 1})"
    for field in _TOKEN_LIST_FIELDS:
        value = generation.get(field)
        if value is None:
            continue
        if not isinstance(value, list):
            return f"{field}={shown(value)} must be a list of token ids"
        for token in value:
            if bad(token):
                return f"{field} holds {shown(token)}, not a token id of this model (0 to {vocab - 1})"
    for field in _TOKEN_FIELDS:
        value = generation.get(field)
        for token in value if isinstance(value, list) else [] if value is None else [value]:
            if bad(token):
                return f"{field}={shown(value)} is not a token id of this model (0 to {vocab - 1})"
    return None


def check_generation_tokens(location: str, where: str, vocab: int) -> None:
    """MODEL's generation_config.json (if any): its token ids within the vocabulary (`generation_token_problem`)."""
    from transformers import GenerationConfig

    try:
        generation = GenerationConfig.from_pretrained(location)
    except Exception:
        return  # none (or invalid: `check_generation_config` says so first)
    problem = generation_token_problem(generation.to_dict(), vocab)
    if problem:
        raise CheckpointError(f"{where}: in generation_config.json, {problem}: fix it or remove the field.")


def _model_class(config, architecture: str | None):
    """The class a Diff config's `architectures` names (task heads included), else None (the Auto class decides)."""
    if getattr(config, "model_type", None) != "diff":
        return None
    from .. import modeling_diff

    return getattr(modeling_diff, architecture or "DiffForCausalLM", modeling_diff.DiffForCausalLM)
