"""The attention backends the package adds to transformers' `AttentionInterface`, registered in one place
(`register_attention_backends`, run by `import diff_transformer`):

* `"differential:sdpa:cpu"`: the differential attention function of transformers' default backend, sdpa, on CPU:
  the CPU paths of `cpu_attention` (other devices have none: the layer's plain sdpa calls, on the layout they want).
* `"diff_map_first"`: sdpa, with V2's differential map formed before V in eval mode too (CPU, fp32; opt-in: logits
  then differ from the fused call's in the last bits).
* `"diff_triton"`: V1's fused Triton kernel (`diff_transformer.kernels`) where it runs (CUDA with triton), else
  what "sdpa" does. Every call without a λ (V2 layers, any other model) is plain sdpa, so a model set to it runs on
  any machine.

The model file asks for a backend's differential attention function under `"differential:<name>:<device type>"`,
else `"differential:<name>"` (`modeling_diff.differential_attention_function`); each name is also registered as a
plain backend (its calls without a λ are sdpa's) and with sdpa's mask builder, so it works in `from_pretrained`,
`from_config` and `set_attn_implementation` like any backend.
"""

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from .. import kernels
from .cpu_attention import cpu_differential_attention, map_first_differential_attention


DIFF_TRITON = "diff_triton"
DIFF_MAP_FIRST = "diff_map_first"


def diff_triton_differential_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    differential_lambda: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None] | None:
    """V1's (A1 - λ A2) V in one fused call where the kernel runs: query (B, 2H, N, d) = [q1 | q2], key
    (B, 2H_kv, L, d) = [k1 | k2], value (B, 2H_kv, L, d) = v's two halves -> (B, N, H, 2d). Elsewhere, and for V2
    (λ per token), what "sdpa" does."""
    if differential_lambda.dim() or not diff_triton_differential_attention.runs_on(query.device):
        lam = differential_lambda
        return cpu_differential_attention(module, query, key, value, attention_mask, scaling, lam, **kwargs)
    # transformers' sdpa mask is None exactly when plain causal attention over the last N of L keys is right.
    output = kernels.triton_v1_attention(
        query,
        key,
        value,
        differential_lambda,
        scaling=scaling,
        causal=attention_mask is None,
        attention_mask=attention_mask,
    )  # (B, N, H, 2d)
    return output, None


diff_triton_differential_attention.runs_on = kernels.is_available  # devices where the fused call is possible


def plain_sdpa(*args, differential_lambda=None, **kwargs):
    """A package backend's calls without a λ: sdpa."""
    return sdpa_attention_forward(*args, **kwargs)


DIFFERENTIAL_ATTENTION_FUNCTIONS = {  # (backend name, device type or None: every device) -> its function
    ("sdpa", "cpu"): cpu_differential_attention,
    (DIFF_MAP_FIRST, None): map_first_differential_attention,
    (DIFF_TRITON, None): diff_triton_differential_attention,
}


def register_attention_backends() -> None:
    for (name, device), differential in DIFFERENTIAL_ATTENTION_FUNCTIONS.items():
        if name != "sdpa":  # transformers' own backend; the package's names are sdpa for calls without a λ
            AttentionInterface.register(name, plain_sdpa)
            AttentionMaskInterface.register(name, sdpa_mask)
        AttentionInterface.register(f"differential:{name}" + (f":{device}" if device else ""), differential)
