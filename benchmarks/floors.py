"""The physical floor of each benchmark row: the ratio to Llama that the work alone implies.

* Prefill and training: multiply-adds. Every `nn.Linear` costs its weight's size per token (projections, MLP, the LM
  head when the row has one); causal attention costs, per layer, (query width x P) for QKᵀ plus (the summed width of
  every map's V x P) for AV, with P = N(N+1)/2 query-key pairs. A training step is taken as 3x its forward (the
  backward does twice the forward's products), so its floor ratio is the forward's with the LM head.
* Decode: bytes read per generated token: every weight once per step (the embedding table only where it is also the
  LM head) plus each sequence's KV cache at the context length, in the model's dtype. The floor of a tokens/s ratio
  is the inverse of the bytes ratio.

The floor counts what attention kernels compute: each softmax map multiplied by V. Forming a differential map first,
(A1 - λ A2) V, needs less (V1: Llama's attention work; V2: QKᵀ 2H·d, AV H·d); on CPU in fp32 V1's prefill and
training, V2's training (train mode) and V2's prefill with `attn_implementation="diff_map_first"` do that
(`blocked_differential_attention`), so those rows can sit below this floor.

Per model type (d = head_dim):
    llama      QKᵀ Hq·d,      AV Hq·d            (Hq query heads)
    diffllama  QKᵀ Hq·d,      AV 2·Hq·d          (Hq maps, each over a 2d-wide value)
    diff V1    QKᵀ 2H·d,      AV 2·H·2d = 4H·d   (2 maps per differential head, each over the 2d-wide value)
    diff V2    QKᵀ 2H·d,      AV 2H·d            (2H query heads, a d-wide value each)
"""

from __future__ import annotations


def _attention_widths(config) -> tuple[int, int, int]:
    """(QKᵀ width, AV width, cached K+V width per token) of one layer."""
    d = config.head_dim
    if config.model_type == "diff":
        H, H_kv = config.num_attention_heads, config.num_key_value_heads
        if config.diff_version == 1:
            return 2 * H * d, 4 * H * d, 4 * H_kv * d  # K: 2 H_kv sub-heads, V: 2 H_kv halves
        return 2 * H * d, 2 * H * d, 2 * H_kv * d
    Hq, H_kv = config.num_attention_heads, config.num_key_value_heads
    av = 2 * Hq * d if config.model_type == "diffllama" else Hq * d
    return Hq * d, av, 2 * H_kv * d


def _linear_weights(model, lm_head: bool) -> int:
    import torch

    total = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and (lm_head or not name.endswith("lm_head")):
            total += module.weight.numel()
    return total


def forward_macs(model, tokens: int, *, lm_head: bool = False, causal: bool = True) -> float:
    """Multiply-adds of one forward over `tokens` tokens (batch 1); `causal=False` counts every query-key pair, as an
    eager implementation computes them."""
    config = model.config
    qk, av, _ = _attention_widths(config)
    pairs = tokens * (tokens + 1) / 2 if causal else tokens * tokens
    return tokens * _linear_weights(model, lm_head) + config.num_hidden_layers * (qk + av) * pairs


def decode_bytes(model, context: int, batch: int = 1, dtype_bytes: int = 4) -> float:
    """Bytes read per decode step: the weights (without a separate embedding table) plus `batch` KV caches."""
    config = model.config
    _, _, kv = _attention_widths(config)
    weights = sum(p.numel() for p in model.parameters())
    embed = model.get_input_embeddings().weight
    output = model.get_output_embeddings()
    if output is None or output.weight is not embed:
        weights -= embed.numel()  # a lookup reads B rows, not the table
    return dtype_bytes * (weights + batch * config.num_hidden_layers * kv * context)


def meta_model(cls, config):
    """The model without memory (sizes only), for the floors."""
    import torch

    with torch.device("meta"):
        return cls._from_config(config)


__all__ = ["decode_bytes", "forward_macs", "meta_model"]
