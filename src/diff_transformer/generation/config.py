"""generation_config.json's settings as this package uses them: the value ranges outside which `generate` fails deep
inside, runs out of memory or silently misuses a value (`GENERATION_RANGES`, `MIN_TEMPERATURE`), the float fields a
JSON file holds as whole numbers (`float_generation_fields`, applied by `Checkpoint.load`), and the token ids that
must lie within the vocabulary (`check_generation_tokens`). Read by `checkpoints.open` (which checks the file and
the types of its fields: `checkpoints.schema.GENERATION_FIELDS`), the `generate` command and the server."""

from __future__ import annotations

import json
import math

from . import GenerationError


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


# The generation settings transformers' logits processors take as floats only (`RepetitionPenaltyLogitsProcessor`
# refuses the int 2 that a hand-written `"repetition_penalty": 2` loads as).
_FLOAT_FIELDS = ("temperature", "top_p", "typical_p", "min_p", "epsilon_cutoff", "eta_cutoff", "repetition_penalty")
_FLOAT_FIELDS += ("diversity_penalty", "length_penalty", "guidance_scale", "max_time")


def float_generation_fields(generation) -> None:
    """Set GENERATION's (a `GenerationConfig`, checked by `checkpoints.open`) float-valued settings that a
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
        return  # none (or invalid: `checkpoints.open` said so first)
    problem = generation_token_problem(generation.to_dict(), vocab)
    if problem:
        raise GenerationError(f"{where}: in generation_config.json, {problem}: fix it or remove the field.")
