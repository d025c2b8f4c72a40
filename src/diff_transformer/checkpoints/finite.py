"""Non-finite numbers never pass silently: generation refuses NaN or +inf logits (`FiniteLogits`, one line instead of
an empty or all-token-0 answer with exit 0), and a merge refuses to write NaN or inf weights unless told to
(`non_finite_tensors`). Such numbers come from values that overflow: an adapter's `lora_alpha` (W + (alpha / r)·B·A),
float16 weights out of range, a config value outside what the model computes in."""

from __future__ import annotations

from . import CheckpointError


def _processor_base():
    from transformers import LogitsProcessor

    return LogitsProcessor


class FiniteLogits(_processor_base()):
    """A logits processor (last in `generate`'s list, after temperature, top-k and top-p, which only set -inf) that
    raises `CheckpointError` when a row of scores holds NaN or +inf, or no finite score at all: sampling or argmax
    would then pick token 0 or fail deep in torch."""

    def __init__(self, model_name: str):
        self.model_name, self.step = model_name, 0

    def __call__(self, input_ids, scores):
        import torch

        self.step += 1
        bad = torch.isnan(scores).any() or torch.isposinf(scores).any() or not torch.isfinite(scores).any(-1).all()
        if bad:
            raise CheckpointError(
                f"MODEL {self.model_name} gave non-finite logits (NaN or inf) for generated token {self.step}: its "
                "weights or config overflow (an adapter's lora_alpha, float16 weights out of range, a config value): "
                "check them, or load it with --dtype float32."
            )
        return scores


def non_finite_tensors(state_dict) -> list[str]:
    """The names of the floating-point tensors of STATE_DICT that hold NaN or inf (shared storage checked once)."""
    import torch

    found, seen = [], set()
    for name, tensor in state_dict.items():
        if not torch.is_floating_point(tensor) or tensor.device.type == "meta":
            continue
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key not in seen:
            seen.add(key)
            if not bool(torch.isfinite(tensor).all()):
                found.append(name)
    return found


__all__ = ["FiniteLogits", "non_finite_tensors"]
