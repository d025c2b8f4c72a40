"""The fields this package reads from metadata files, each checked for its JSON type and range before it is used, so
that a hand-edited or corrupt file is one line naming the file, the field and the fix instead of a TypeError deep in
the code (or a value silently cast: `bool("no")` is True). One table per file: Motif's config.json fields (the
converter), an adapter's `base_model.json` (`adapters.record_base`) and the `adapter_config.json` fields this
package and PEFT compute with, and the generation_config.json fields whose types transformers leaves unchecked
(their ranges: `generation.config.GENERATION_RANGES`). A Diff config.json is checked by `DiffConfig` itself (typed,
`@strict`, its `validate_*` methods), run records by `outputs.records._run_record` (anything unexpected proves
nothing)."""

from __future__ import annotations

import json
import math


FP32_TINY = 1.1754943508222875e-38  # the smallest normal float32 (as configuration_diff.py; here without importing it)


# A field's kind: "int" (a whole number, not a bool), "number" (finite), "bool", "str", "str-list" (a list of
# strings), "str-or-list", "object". Each entry: (kind, lowest, highest, None allowed).
def _spec(kind: str, low=None, high=None, *, null: bool = True) -> tuple:
    return kind, low, high, null


MOTIF_FIELDS = {
    "attn_rms_norm_eps": _spec("number", FP32_TINY, None),  # subln's eps in float32: 0 below its smallest normal
    "num_nextn_predict_layers": _spec("int", 0),
    "sliding_window": _spec("int", 1),
    "use_sliding_window": _spec("bool"),
    "num_noise_heads": _spec("int", 1),
    "k_ratio": _spec("int", 1),
    "qkv_bias": _spec("bool"),
    "use_bias": _spec("bool"),
    "attention_bias": _spec("bool"),
    "num_attention_heads": _spec("int", 1, null=False),
    "num_key_value_heads": _spec("int", 1),
    "head_dim": _spec("int", 1),
    "hidden_size": _spec("int", 1, null=False),
    "hidden_act": _spec("str"),
}

BASE_RECORD_FIELDS = {
    "relative": _spec("str"),
    "absolute": _spec("str"),
    "hub_id": _spec("str"),
    "fingerprint": _spec("object"),
}
FINGERPRINT_FIELDS = {
    "tensors": _spec("int", 0, null=False),
    "parameters": _spec("int", 0, null=False),
    "sha256": _spec("str", null=False),
}

# What PEFT's LoraConfig and this package compute with; lora_alpha's size is not bounded here (whether alpha / r
# overflows depends on the weights: a merge and generate check the numbers they get).
ADAPTER_FIELDS = {
    "base_model_name_or_path": _spec("str"),
    "peft_type": _spec("str"),
    "r": _spec("int", 1),
    "lora_alpha": _spec("number", None, None),
    "lora_dropout": _spec("number", 0.0, 1.0),
    "target_modules": _spec("str-or-list"),
    "modules_to_save": _spec("str-list"),
    "layers_to_transform": _spec("int-or-list"),
    "fan_in_fan_out": _spec("bool"),
    "use_rslora": _spec("bool"),
    "use_dora": _spec("bool"),
    "inference_mode": _spec("bool"),
    "bias": _spec("str"),
}

# generation_config.json: the fields whose type transformers does not check when it loads the file, and that fail
# deep inside generate() (a TypeError or an overflow) or are silently misread (`"use_cache": "x"` is truthy); value
# ranges are `generation.config.GENERATION_RANGES`'. Token ids are int64 in torch.
_TOKEN_ID = _spec("int-or-list", 0, 2**63 - 1)
GENERATION_FIELDS = {
    **dict.fromkeys(("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id"), _TOKEN_ID),
    **dict.fromkeys(
        (
            "do_sample",
            "use_cache",
            "output_scores",
            "output_logits",
            "output_attentions",
            "output_hidden_states",
            "return_dict_in_generate",
            "renormalize_logits",
            "remove_invalid_values",
            "low_memory",
            "token_healing",
        ),
        _spec("bool"),
    ),
    "num_beams": _spec("int", 1, 2**31 - 1),
    "num_return_sequences": _spec("int", 1, 2**31 - 1),
    "top_k": _spec("int", 0, 2**63 - 1),
    "prefill_chunk_size": _spec("int", 1, 2**31 - 1),
    "max_time": _spec("number", 0.0, None),
    "length_penalty": _spec("number"),
    "guidance_scale": _spec("number", 0.0, None),
    "stop_strings": _spec("str-or-list"),
    "exponential_decay_length_penalty": _spec("decay"),
    "sequence_bias": _spec("sequence-bias"),
}
GENERATION_FIELDS |= dict.fromkeys(  # lengths, int64 in torch
    ("max_new_tokens", "max_length", "min_new_tokens", "min_length"), _spec("int", 0, 2**63 - 1)
)

_KIND_NAMES = {
    "int": "a whole number",
    "number": "a finite number",
    "bool": "true or false",
    "str": "a string",
    "str-list": "a list of strings",
    "str-or-list": "a string or a list of strings",
    "int-or-list": "a whole number or a list of them",
    "object": "a JSON object",
    "decay": "a [start index, decay factor] pair (a whole number >= 0, a finite number)",
    "sequence-bias": "a list of [token-id list, bias] pairs",
}


def _shown(value) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _number(value) -> str | None:
    """A bound as the message shows it: whole numbers in full (2**31 - 1, not 2.14748e+09)."""
    return None if value is None else str(value) if isinstance(value, int) else f"{value:g}"


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _has_kind(value, kind: str) -> bool:
    if kind == "int":
        return _is_int(value)
    if kind == "number":
        return (isinstance(value, (int, float)) and not isinstance(value, bool)) and math.isfinite(value)
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "str":
        return isinstance(value, str)
    if kind == "str-list":
        return isinstance(value, list) and all(isinstance(item, str) for item in value)
    if kind == "str-or-list":
        return isinstance(value, str) or _has_kind(value, "str-list")
    if kind == "int-or-list":
        return _is_int(value) or (isinstance(value, list) and all(_is_int(item) for item in value))
    if kind == "decay":
        return (isinstance(value, list) and len(value) == 2 and _is_int(value[0]) and value[0] >= 0) and _has_kind(
            value[1], "number"
        )
    if kind == "sequence-bias":
        return isinstance(value, list) and all(
            isinstance(pair, list)
            and len(pair) == 2
            and _has_kind(pair[0], "int-or-list")
            and isinstance(pair[0], list)
            and pair[0]
            and all(0 <= token < 2**63 for token in pair[0])
            and _has_kind(pair[1], "number")
            for pair in value
        )
    return isinstance(value, dict)  # "object"


def field_problem(fields, schema: dict) -> str | None:
    """What is wrong with FIELDS (a JSON file's content) against SCHEMA: not a JSON object, or its first field that
    breaks SCHEMA, as "NAME is VALUE, not ..."; None when nothing is. Fields SCHEMA does not name are not looked at.
    The caller raises its own error with the file's name and the fix."""
    if not isinstance(fields, dict):
        return f"holds a JSON {type(fields).__name__}, not an object"
    for name, (kind, low, high, null) in schema.items():
        if name not in fields:
            continue
        value = fields[name]
        if value is None and null:
            continue
        wanted = _KIND_NAMES[kind] + (", or null" if null else "")
        if value is None or not _has_kind(value, kind):
            return f"{name} is {_shown(value)}, not {wanted}"
        numbers = value if kind == "int-or-list" and isinstance(value, list) else [value]
        if kind in ("int", "number", "int-or-list") and any(
            (low is not None and number < low) or (high is not None and number > high) for number in numbers
        ):
            low, high = _number(low), _number(high)
            bound = f">= {low}" if high is None else f"in [{low}, {high}]" if low is not None else f"<= {high}"
            return f"{name} is {_shown(value)}, not {bound}"
    return None


__all__ = [
    "ADAPTER_FIELDS",
    "GENERATION_FIELDS",
    "BASE_RECORD_FIELDS",
    "FINGERPRINT_FIELDS",
    "MOTIF_FIELDS",
    "field_problem",
]
