"""Optional fused Triton kernels. Importing this package needs neither triton nor CUDA; ask is_available() first.

from diff_transformer import kernels
if kernels.is_available(query.device):
    out = kernels.triton_v1_attention(query, key, value, lam, scaling=d**-0.5)  # (B, N, H, 2d)
"""

import torch

from .diff_attention_v1 import select_path, triton_available, triton_v1_attention


# The op's name before the model's V1 executor became `modeling_diff.v1_attention_forward`: the two differed only in
# word order. Kept so code written against the old name still imports.
differential_attention_v1 = triton_v1_attention

__all__ = ["triton_v1_attention", "differential_attention_v1", "is_available", "select_path", "triton_available"]


def is_available(device: torch.device | str | None = None) -> bool:
    """True when triton_v1_attention runs compiled GPU kernels for tensors on `device` (default: the current
    CUDA device): triton is installed and the device is a CUDA (or ROCm) GPU."""
    device = torch.device("cuda") if device is None else torch.device(device)
    return device.type == "cuda" and torch.cuda.is_available() and triton_available()
