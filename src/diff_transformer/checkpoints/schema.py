"""The fields this package reads from metadata files, each checked for its JSON type and range before it is used, so
that a hand-edited or corrupt file is one line naming the file, the field and the fix instead of a TypeError deep in
the code (or a value silently cast: `bool("no")` is True). One table per file: Motif's config.json fields (the
converter), an adapter's `base_model.json` (`adapters.record_base`) and the `adapter_config.json` fields this
package and PEFT compute with. A Diff config.json is checked by `DiffConfig` itself (typed, `@strict`, its
`validate_*` methods), generation_config.json by `configs.check_generation_config`, run records by
`safe_output._run_record` (anything unexpected proves nothing)."""

from __future__ import annotations

import json
import math

from .configs import FP32_TINY


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

_KIND_NAMES = {
    "int": "a whole number",
    "number": "a finite number",
    "bool": "true or false",
    "str": "a string",
    "str-list": "a list of strings",
    "str-or-list": "a string or a list of strings",
    "int-or-list": "a whole number or a list of them",
    "object": "a JSON object",
}


def _shown(value) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


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
        if kind in ("int", "number") and ((low is not None and value < low) or (high is not None and value > high)):
            bound = f">= {low:g}" if high is None else f"in [{low:g}, {high:g}]" if low is not None else f"<= {high:g}"
            return f"{name} is {_shown(value)}, not {bound}"
    return None


__all__ = [
    "ADAPTER_FIELDS",
    "BASE_RECORD_FIELDS",
    "FINGERPRINT_FIELDS",
    "MOTIF_FIELDS",
    "field_problem",
]
