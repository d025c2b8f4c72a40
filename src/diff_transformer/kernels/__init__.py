"""Optional fused Triton kernels. Importing this package needs neither triton nor CUDA; ask is_available() first.

from diff_transformer import kernels
if kernels.is_available(query.device):
    out = kernels.differential_attention_v1(query, key, value, lam, scaling=d**-0.5)  # (B, N, H, 2d)
"""

import torch

from .diff_attention_v1 import differential_attention_v1, select_path, triton_available


__all__ = ["differential_attention_v1", "is_available", "select_path", "triton_available"]


def is_available(device: torch.device | str | None = None) -> bool:
    """True when differential_attention_v1 runs compiled GPU kernels for tensors on `device` (default: the current
    CUDA device): triton is installed and the device is a CUDA (or ROCm) GPU."""
    device = torch.device("cuda") if device is None else torch.device(device)
    return device.type == "cuda" and torch.cuda.is_available() and triton_available()
