"""The converter's one dtype table: torch dtypes, the codes safetensors headers store them under, and the names
`dtype=` / `--dtype` accept."""

from __future__ import annotations

import torch

from .errors import ConversionError


# Every dtype a shard may store, with its safetensors header code.
SAFETENSORS_CODES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
# The dtypes a conversion can cast to; besides their own names they answer to these short ones.
CAST_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_SHORT_NAMES = {"fp32": "float32", "float": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16"}


def dtype_name(dtype: torch.dtype) -> str:
    """ "bfloat16" for torch.bfloat16: the name config.json and the reports use."""
    return str(dtype).removeprefix("torch.")


def from_safetensors_code(code: str) -> torch.dtype | None:
    """The torch dtype of a safetensors header code ("BF16" -> torch.bfloat16), None for an unknown code."""
    return next((dtype for dtype, known in SAFETENSORS_CODES.items() if known == code), None)


def cast_dtype(name: str) -> torch.dtype | None:
    """The cast dtype called `name` ("bfloat16", "bf16", "torch.float16"...), None when there is none."""
    key = name.strip().lower().removeprefix("torch.")
    key = _SHORT_NAMES.get(key, key)
    return next((dtype for dtype in CAST_DTYPES if dtype_name(dtype) == key), None)


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """A `dtype=` argument as a torch dtype; None (or "auto", "none", "") keeps the stored dtypes."""
    if dtype is None or isinstance(dtype, torch.dtype) and dtype in CAST_DTYPES:
        return dtype
    if isinstance(dtype, str):
        key = dtype.strip().lower().removeprefix("torch.")
        if key in ("auto", "none", ""):
            return None
        if cast_dtype(key) is not None:
            return cast_dtype(key)
    raise ConversionError(
        f"dtype={dtype!r} is not supported: use float32, float16 or bfloat16 (or None to keep the stored dtypes)."
    )


__all__ = ["CAST_DTYPES", "SAFETENSORS_CODES", "cast_dtype", "dtype_name", "from_safetensors_code", "parse_dtype"]
