"""Where a conversion computes (`convert --device`): V1's calibration (sampling the text, fitting each layer) and
`verify_conversion`. The CPU unless asked otherwise: a GPU samples other calibration text (its RNG) and rounds the
fits differently, so the result would change with the machine the converter happens to run on."""

from __future__ import annotations

from ..errors import UserError
from .errors import ConversionError


def check_device(device: str | None, option: str = "--device") -> str:
    """DEVICE checked before anything loads: None -> "cpu"; "cpu", "cuda", "cuda:N" (present here) or "auto" (CUDA
    when torch sees a GPU, else the CPU). MPS is refused: the fits solve float64 systems, which MPS has no kernels
    for. A `ConversionError` of one line otherwise."""
    from ..checkpoints.backends import resolve_device  # the check every other command's --device goes through

    name = "cpu" if device is None else str(device).strip().lower()
    if name.partition(":")[0] == "mps":
        raise ConversionError(
            f"{option} {name}: the conversion fits in float64, which Apple's MPS cannot run: use {option} cpu."
        )
    try:
        resolved = resolve_device(name, option)
    except UserError as exc:
        raise ConversionError(str(exc)) from exc
    return "cpu" if resolved == "mps" else resolved  # auto on a Mac without CUDA


__all__ = ["check_device"]
