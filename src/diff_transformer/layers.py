"""Differential attention as a standalone op and `nn.Module`, for people who build their own models.

`differential_attention` works for self- and cross-attention (query length != key length), with boolean or additive
masks, and λ given as a scalar, per head, or per query token and head. The optional `clamp_negatives` mode zeroes the
negative entries of the differential map and renormalises each row to sum to 1 (a variant some write-ups use to keep a
probability interpretation; the paper itself keeps the signed map).
"""

import math

import torch
from torch import nn

from .modeling_diff import v1_lambda  # the paper's λ formula, written once


def _check_finite(name: str, value: float, minimum: float | None = None, fix: str = "") -> None:
    """Refuse a NaN/inf (or too small) Python number, which would otherwise only show up as NaN outputs."""
    if not (math.isfinite(value) and (minimum is None or value >= minimum)):
        bound = "" if minimum is None else f" >= {minimum}"
        raise ValueError(f"{name}={value} must be a finite number{bound}: {fix}")


def _check_inputs(query, key, value, attn_mask) -> None:
    """Floating q/k/v (integer ones give an all-zero output) and a bool or float mask: an integer 0/1 mask would be
    added to the scores as if additive. SDPA refuses both; so does this op."""
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        if not tensor.is_floating_point():
            raise ValueError(f"{name} has dtype {tensor.dtype}: pass floating-point tensors (e.g. .float()).")
    if attn_mask is not None and attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
        raise ValueError(
            f"attn_mask has dtype {attn_mask.dtype}: pass a bool mask (True = attend; e.g. mask.bool() for a 0/1 "
            "mask) or an additive float mask (0 or -inf), as scaled_dot_product_attention requires."
        )


def _broadcast_lambda(lam: float | torch.Tensor, num_heads: int, query_len: int, ref: torch.Tensor) -> torch.Tensor:
    """λ as a tensor broadcastable to attention maps (B, H, Nq, Nk)."""
    if isinstance(lam, (int, float)):
        _check_finite("lambda", lam, fix="pass the weight of the second map, e.g. 0.8 (the paper's lambda_init).")
    lam = torch.as_tensor(lam, dtype=torch.promote_types(ref.dtype, torch.float32), device=ref.device)
    if lam.dim() == 0:
        return lam
    if lam.dim() == 1:
        if lam.shape[0] != num_heads:
            raise ValueError(f"per-head lambda has {lam.shape[0]} entries, expected num_heads={num_heads}.")
        return lam.view(num_heads, 1, 1)  # (H, 1, 1)
    if lam.dim() == 3:
        if lam.shape[1:] != (num_heads, query_len):
            raise ValueError(
                f"per-token lambda must have shape (batch, num_heads={num_heads}, query_len={query_len}), "
                f"got {tuple(lam.shape)}."
            )
        return lam.unsqueeze(-1)  # (B, H, Nq, 1)
    raise ValueError(
        f"lambda must be a float, a 0-d tensor, a (num_heads,) tensor or a (batch, num_heads, query_len) tensor; "
        f"got shape {tuple(lam.shape)}."
    )


def differential_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    lam: float | torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    clamp_negatives: bool = False,
    return_weights: bool = False,
):
    """Differential attention: `(softmax(q1 k1ᵀ s) - λ softmax(q2 k2ᵀ s)) v`, the two maps in one call.

    The softmax runs in at least float32; the output has `value`'s dtype. No RMSNorm or output projection: see
    `DifferentialAttention` for a whole block.

    Args:
        query: `(B, H, Nq, 2d)`; its last dimension holds `[q1 | q2]`.
        key: `(B, H, Nk, 2d)`, holding `[k1 | k2]`.
        value: `(B, H, Nk, dv)`; V1 uses `dv = 2d`, but any width works.
        lam: λ as a float, a 0-d tensor, `(H,)` (per head) or `(B, H, Nq)` (per query token and head). A float must
            be finite; a tensor is used as given (checking its values would synchronise with the device on every
            call).
        attn_mask: bool (True = attend) or additive float mask, broadcastable to `(B, H, Nq, Nk)`.
        is_causal: causal mask aligned to the end of the keys (query i sees keys up to `i + Nk - Nq`).
        scale: logit scale; defaults to `d ** -0.5`, d being the half width.
        clamp_negatives: zero the negative entries of the differential map, then renormalise rows to sum to 1.
        return_weights: also return the differential map.

    Returns:
        The output, `(B, H, Nq, dv)`; with `return_weights`, the tuple `(output, weights)` where `weights` is the
        differential map `A1 - λ A2`, `(B, H, Nq, Nk)`, whose rows sum to `1 - λ` (1 when clamped).

    Raises:
        ValueError: `query` and `key` differ in width or have an odd one, `key` and `value` differ in length, or
            `lam` has another shape.

    Example:
        ```python
        q, k, v = torch.randn(2, 4, 10, 32), torch.randn(2, 4, 12, 32), torch.randn(2, 4, 12, 64)
        out = differential_attention(q, k, v, lam=0.5)  # (2, 4, 10, 64)
        ```
    """
    if query.shape[-1] != key.shape[-1] or query.shape[-1] % 2:
        raise ValueError(
            f"query and key must share an even last dimension 2d holding both halves; got {query.shape[-1]} and "
            f"{key.shape[-1]}."
        )
    if key.shape[-2] != value.shape[-2]:
        raise ValueError(f"key and value must have the same length, got {key.shape[-2]} and {value.shape[-2]}.")
    _check_inputs(query, key, value, attn_mask)
    half = query.shape[-1] // 2
    if scale is not None and not isinstance(scale, torch.Tensor):
        _check_finite("scale", scale, fix="pass the logit scale, e.g. head_dim ** -0.5, or None for that default.")
    scale = half**-0.5 if scale is None else scale
    q1, q2 = query.split(half, dim=-1)  # (B, H, Nq, d) each
    k1, k2 = key.split(half, dim=-1)  # (B, H, Nk, d) each
    softmax_dtype = torch.promote_types(query.dtype, torch.float32)  # at least fp32, fp64 stays fp64
    logits = (
        torch.stack((q1 @ k1.transpose(-1, -2), q2 @ k2.transpose(-1, -2))).to(softmax_dtype) * scale
    )  # (2, B, H, Nq, Nk)

    n_q, n_k = query.shape[-2], key.shape[-2]
    if is_causal:
        visible = torch.ones(n_q, n_k, dtype=torch.bool, device=query.device).tril(diagonal=n_k - n_q)
        logits = logits.masked_fill(~visible, float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            logits = logits.masked_fill(~attn_mask, float("-inf"))
        else:
            logits = logits + attn_mask.to(softmax_dtype)
    maps = logits.softmax(dim=-1)
    weights = maps[0] - _broadcast_lambda(lam, query.shape[-3], n_q, query) * maps[1]  # (B, H, Nq, Nk)
    if clamp_negatives:
        weights = weights.clamp_min(0.0)
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(weights.dtype).tiny)
    output = weights.to(value.dtype) @ value  # (B, H, Nq, dv)
    return (output, weights) if return_weights else output


class DifferentialAttention(nn.Module):
    """Multi-head differential attention block for your own models (V1 layout: q/k of width 2d per head, v of width
    2d, per-head RMSNorm, output projection), self- or cross-attention.

    Args:
        embed_dim: model width of the query input (and of the output).
        num_heads: number of differential heads H; each uses q/k halves of size `d = embed_dim // (2H)`.
        kdim: width of the key/value input for cross-attention (defaults to `embed_dim`).
        lambda_mode: `"scalar"` (the paper's re-parameterised per-layer λ), `"head"` (one learnable λ per head) or
            `"token"` (V2's per-token, per-head `sigmoid(W x)`).
        lambda_init: λ_init of the scalar and head modes (the paper's depth schedule gives `0.8 - 0.6 exp(-0.3 l)`).
        lambda_std: standard deviation of the scalar mode's four re-parameterisation vectors at initialisation.
        clamp_negatives: use the clamp-and-renormalise variant of the map.
        bias: add biases to the q/k/v/o projections.
        eps: epsilon of the per-head RMSNorm.

    Raises:
        ValueError: `embed_dim` is not divisible by `2 * num_heads`, an unknown `lambda_mode`, or a non-finite
            `lambda_init`, `lambda_std` or `eps`.

    Example:
        ```python
        layer = DifferentialAttention(embed_dim=512, num_heads=4, lambda_mode="scalar")
        out = layer(torch.randn(2, 10, 512), is_causal=True)  # (2, 10, 512)
        ```
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        kdim: int | None = None,
        lambda_mode: str = "scalar",
        lambda_init: float = 0.8,
        lambda_std: float = 0.1,
        clamp_negatives: bool = False,
        bias: bool = False,
        eps: float = 1e-6,
    ):
        super().__init__()
        if embed_dim % (2 * num_heads):
            raise ValueError(f"embed_dim={embed_dim} must be divisible by 2 * num_heads={2 * num_heads}.")
        if lambda_mode not in ("scalar", "head", "token"):
            raise ValueError(f"lambda_mode={lambda_mode!r}: use 'scalar', 'head' or 'token'.")
        _check_finite("lambda_init", lambda_init, fix="use e.g. 0.8, or the paper's 0.8 - 0.6 exp(-0.3 layer_idx).")
        if lambda_mode == "scalar" and not 0.0 <= lambda_init < 1.0:
            # The scalar mode scales the output by 1 - λ_init (as DiffConfig, which refuses the same values).
            raise ValueError(
                f"lambda_init={lambda_init} must lie in [0, 1) in the scalar mode (the output is scaled by "
                "1 - lambda_init: 1 gives an all-zero output): use e.g. 0.8, or 0.8 - 0.6 exp(-0.3 layer_idx)."
            )
        _check_finite("lambda_std", lambda_std, 0.0, fix="use e.g. 0.1, the paper's value.")
        if not 0.0 < eps < math.inf:
            raise ValueError(
                f"eps={eps} must be a finite number > 0 (RMSNorm divides by sqrt(mean(x²) + eps)): use e.g. 1e-6."
            )
        kdim = embed_dim if kdim is None else kdim
        self.num_heads, self.head_dim = num_heads, embed_dim // (2 * num_heads)
        self.lambda_mode, self.lambda_init, self.clamp_negatives = lambda_mode, lambda_init, clamp_negatives
        inner = 2 * num_heads * self.head_dim
        self.q_proj = nn.Linear(embed_dim, inner, bias=bias)
        self.k_proj = nn.Linear(kdim, inner, bias=bias)
        self.v_proj = nn.Linear(kdim, inner, bias=bias)
        self.o_proj = nn.Linear(inner, embed_dim, bias=bias)
        self.subln = nn.RMSNorm(2 * self.head_dim, eps=eps)
        if lambda_mode == "scalar":
            self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2 = (
                nn.Parameter(torch.randn(self.head_dim) * lambda_std) for _ in range(4)
            )
        elif lambda_mode == "head":
            self.lambda_head = nn.Parameter(torch.full((num_heads,), float(lambda_init)))
        else:
            self.lambda_proj = nn.Linear(embed_dim, num_heads, bias=False)

    def current_lambda(self, query_input: torch.Tensor) -> torch.Tensor:
        """λ for `query_input` `(B, Nq, embed_dim)`: 0-d (scalar mode), `(H,)` (head) or `(B, H, Nq)` (token)."""
        if self.lambda_mode == "scalar":
            return v1_lambda(self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2, self.lambda_init)
        if self.lambda_mode == "head":
            return self.lambda_head
        return torch.sigmoid(self.lambda_proj(query_input)).transpose(1, 2)  # (B, H, Nq)

    def forward(
        self,
        query: torch.Tensor,
        key_value: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
        is_causal: bool = False,
        return_weights: bool = False,
    ):
        """Attend from `query` to `key_value` (or to itself).

        Args:
            query: `(B, Nq, embed_dim)`.
            key_value: `(B, Nk, kdim)` for cross-attention; None for self-attention.
            attn_mask: bool (True = attend) or additive float mask, broadcastable to `(B, H, Nq, Nk)`.
            is_causal: causal mask aligned to the end of the keys.
            return_weights: also return the differential map.

        Returns:
            `(B, Nq, embed_dim)`; with `return_weights`, `(output, weights)`, weights `(B, H, Nq, Nk)`.
        """
        key_value = query if key_value is None else key_value
        B, n_q, _ = query.shape
        n_k = key_value.shape[1]
        H, d = self.num_heads, self.head_dim
        q = self.q_proj(query).view(B, n_q, H, 2 * d).transpose(1, 2)  # (B, H, Nq, 2d)
        k = self.k_proj(key_value).view(B, n_k, H, 2 * d).transpose(1, 2)  # (B, H, Nk, 2d)
        v = self.v_proj(key_value).view(B, n_k, H, 2 * d).transpose(1, 2)  # (B, H, Nk, 2d)
        out, weights = differential_attention(
            q,
            k,
            v,
            self.current_lambda(query),
            attn_mask,
            is_causal,
            clamp_negatives=self.clamp_negatives,
            return_weights=True,
        )
        # The scalar mode reproduces the paper: per-head RMSNorm, then (1 - λ_init) to keep the gradient scale.
        out = self.subln(out) * (1.0 - self.lambda_init if self.lambda_mode == "scalar" else 1.0)
        out = self.o_proj(out.transpose(1, 2).reshape(B, n_q, H * 2 * d))  # (B, Nq, embed_dim)
        return (out, weights) if return_weights else out


__all__ = ["differential_attention", "DifferentialAttention"]
