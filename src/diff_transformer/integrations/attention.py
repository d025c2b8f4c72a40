"""`attn_implementation="diff_triton"`: V1's fused Triton kernel (`diff_transformer.kernels`) as a backend name that
transformers accepts in `from_pretrained`, `from_config` and `set_attn_implementation`."""

from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask


DIFF_TRITON = "diff_triton"


def register_diff_triton() -> None:
    """V1 layers recognise the name and call the fused kernel themselves (`DiffAttentionV1._select_strategy`). Every
    other call made under it (V2 layers, V1 layers on a device the kernel does not run on, any other model) is plain
    sdpa, and masks are built as for sdpa: the form the kernel reads."""
    AttentionInterface.register(DIFF_TRITON, sdpa_attention_forward)
    AttentionMaskInterface.register(DIFF_TRITON, sdpa_mask)
