"""What one conversion is asked for (`ConvertOptions`: the public converters' arguments past SRC and OUT) and its
checks before anything is read or downloaded (`checked_options`: one line naming the option and the fix)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace

import torch

from ..errors import check_seed
from ..families import Family
from .dtypes import parse_dtype
from .errors import ConversionError


V1_INITS = ("calibrated", "calibrated-additive", "calibrated-lambda0", "paper")
CALIBRATED_INITS = ("calibrated", "calibrated-additive", "calibrated-lambda0")


@dataclass(frozen=True)
class ConvertOptions:
    """What one conversion was asked for: the arguments of `convert_llama_to_diff` (see there) past SRC and OUT,
    passed down the converter's chain as one object. `checked_options` returns it with `dtype` parsed into a torch
    dtype, `max_shard_size` into bytes, `seed` checked and `v1_init` the start to use (None: there is none to
    choose)."""

    diff_version: int
    dtype: str | torch.dtype | None = None
    overwrite: bool = False
    progress: bool = True
    lambda_std: float = 0.1
    seed: int = 0
    v1_init: str | None = None
    v1_layout: str | None = None
    calibration_data: str | os.PathLike | None = None
    calibration_blocks: int = 16
    calibration_block_size: int = 256
    max_shard_size: int | str | None = None
    revision: str | None = None
    token: str | bool | None = None
    device: str | None = None


def parse_size(size: int | str | None) -> int | None:
    """Bytes from an int or a string like "5GB" (10^9), "500MiB" (2^20 each), "2000000"."""
    if size is None:
        return None
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    if isinstance(size, str):
        match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMGT]?)(IB|B)?", size.strip().upper())
        if match:
            number, prefix, unit = float(match.group(1)), match.group(2), match.group(3)
            base = 1024 if unit == "IB" else 1000
            value = int(number * base ** "_KMGT".index(prefix or "_")) if prefix else int(number)
            if value > 0:
                return value
    raise ConversionError(
        f"max_shard_size={size!r} is not a size: pass bytes as an int or a string like '5GB' / '500MB'."
    )


def checked_options(options: ConvertOptions, expected: Family) -> ConvertOptions:
    """`options` checked before anything is read, with `dtype`, `max_shard_size`, `seed` and `v1_init` resolved."""
    dtype, max_shard_size = parse_dtype(options.dtype), parse_size(options.max_shard_size)
    if options.lambda_std < 0:
        raise ConversionError(f"lambda_std={options.lambda_std} must be >= 0.")
    seed = check_seed(options.seed, "seed", ConversionError)
    v1_init = _check_v1_init(expected, options.diff_version, options.v1_init, options.calibration_data)
    if options.v1_layout is not None and v1_init is None:
        raise ConversionError("--v1-layout chooses how Llama heads map onto V1: add --diff-version 1, or drop it.")
    from .device import check_device

    device = check_device(options.device)
    return replace(options, dtype=dtype, max_shard_size=max_shard_size, seed=seed, v1_init=v1_init, device=device)


def _check_v1_init(expected: Family, diff_version: int, v1_init: str | None, calibration_data) -> str | None:
    """The V1 initialisation to use ("calibrated" / "paper"), None where there is none to choose (V2, a family
    imported exactly)."""
    if v1_init not in (None, *V1_INITS):
        raise ConversionError(f"v1_init={v1_init!r} is not one of {', '.join(V1_INITS)} (--v1-init).")
    if not expected.llama_shaped or diff_version != 1:
        if v1_init is not None or calibration_data is not None:
            raise ConversionError(
                "--v1-init / --calibration-data choose how a Llama -> Diff V1 conversion starts: add "
                "--diff-version 1, or drop them (V2 is function-preserving, nothing to calibrate)."
            )
        return None
    v1_init = v1_init or "calibrated"
    if v1_init == "paper" and calibration_data is not None:
        raise ConversionError("--calibration-data calibrates --v1-init calibrated, not paper: drop one of them.")
    return v1_init


__all__ = ["CALIBRATED_INITS", "V1_INITS", "ConvertOptions", "checked_options", "parse_size"]
