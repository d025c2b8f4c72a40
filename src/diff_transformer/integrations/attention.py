"""`attn_implementation="diff_triton"`: V1's fused Triton kernel (`diff_transformer.kernels`) as an attention function
registered with transformers' `AttentionInterface`, so the name works in `from_pretrained`, `from_config` and
`set_attn_implementation` like any backend.

A V1 layer calls it once with both maps' queries and keys and its λ (`differential_lambda`), where `runs_on` says the
kernel runs (`modeling_diff.select_v1_strategy`); every other call made under the name (V2 layers, V1 layers on a
device the kernel does not run on, any other model) has no λ and is plain sdpa. Masks are built as for sdpa: the form
the kernel reads.
"""

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from .. import kernels


DIFF_TRITON = "diff_triton"


def diff_triton_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    differential_lambda: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """With `differential_lambda`: V1's (A1 - λ A2) V, query (B, 2H, N, d) = [q1 | q2], key (B, 2H_kv, L, d) =
    [k1 | k2], value (B, 2H_kv, L, d) = v's two halves -> (B, N, H, 2d). Without: sdpa."""
    if differential_lambda is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
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


diff_triton_attention_forward.runs_on = kernels.is_available  # devices where the fused call is possible


def register_diff_triton() -> None:
    AttentionInterface.register(DIFF_TRITON, diff_triton_attention_forward)
    AttentionMaskInterface.register(DIFF_TRITON, sdpa_mask)
