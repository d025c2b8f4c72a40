import math
import re

import pytest
import torch

from diff_transformer import DifferentialAttention, differential_attention


Q = [[1, 0, 1, 0], [0, 2, 0, 1], [1, 1, 1, 0], [0, 0, 1, 1], [1, 0, 0, 1]]
K = [[0, 1, 0, 1], [1, 0, 1, 0], [1, 1, 0, 0], [0, 0, 1, 1], [1, 0, 0.5, 0.5]]
V = [[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1], [0.5, 0.5, 0.5, 0.5]]


def by_hand(lam=0.4, clamp=True):
    """Plain-Python version of the worked example: halves of width 2, logits / sqrt(2)."""

    def softmax(row):
        exps = [math.exp(x) for x in row]
        return [e / sum(exps) for e in exps]

    out = []
    for q in Q:
        a1 = softmax([(q[0] * k[0] + q[1] * k[1]) / math.sqrt(2) for k in K])
        a2 = softmax([(q[2] * k[2] + q[3] * k[3]) / math.sqrt(2) for k in K])
        w = [x - lam * y for x, y in zip(a1, a2)]
        if clamp:
            w = [max(x, 0.0) for x in w]
            w = [x / sum(w) for x in w]
        out.append([sum(w[j] * V[j][c] for j in range(5)) for c in range(4)])
    return out


def tensors():
    return (torch.tensor(x, dtype=torch.float64)[None, None] for x in (Q, K, V))  # (1, 1, 5, 4)


def test_textbook_worked_example():
    q, k, v = tensors()
    out = differential_attention(q, k, v, 0.4, scale=1 / math.sqrt(2), clamp_negatives=True)[0, 0]
    # the textbook's published rows for "cat" (row 1) and "sat" (row 2)
    assert out[1].tolist() == pytest.approx([0.4269, 0.0679, 0.5156, 0.0104], abs=1e-4)
    assert out[2].tolist() == pytest.approx([0.2909, 0.2021, 0.5917, 0.0848], abs=1e-4)
    # every row against the plain-Python computation; rows 0, 3, 4 checked by hand too:
    assert out.tolist() == [pytest.approx(row, abs=1e-12) for row in by_hand()]
    assert out[0].tolist() == pytest.approx([0.2626, 0.3830, 0.4746, 0.1710], abs=1e-4)
    assert out[3].tolist() == pytest.approx([0.3189, 0.3189, 0.3801, 0.1947], abs=1e-4)
    assert out[4].tolist() == pytest.approx([0.1710, 0.4746, 0.4746, 0.1710], abs=1e-4)
    # default scale is d^-0.5 with d = 2, the same as the example's sqrt(2)
    assert torch.allclose(differential_attention(q, k, v, 0.4, clamp_negatives=True)[0, 0], out)


def test_signed_mode_keeps_negative_weights():
    q, k, v = tensors()
    out, weights = differential_attention(q, k, v, 0.4, return_weights=True)
    assert out[0, 0].tolist() == [pytest.approx(r, abs=1e-12) for r in by_hand(clamp=False)]
    assert weights.min() < 0
    assert torch.allclose(weights.sum(-1), torch.full((1, 1, 5), 0.6, dtype=torch.float64))


def test_cross_attention_masks_and_lambda_shapes():
    torch.manual_seed(0)
    B, H, n_q, n_k, d = 2, 3, 4, 7, 4
    q, k, v = torch.randn(B, H, n_q, 2 * d), torch.randn(B, H, n_k, 2 * d), torch.randn(B, H, n_k, 5)

    def manual(lam, visible):
        a1 = (q[..., :d] @ k[..., :d].transpose(-1, -2) / d**0.5).masked_fill(~visible, -math.inf).softmax(-1)
        a2 = (q[..., d:] @ k[..., d:].transpose(-1, -2) / d**0.5).masked_fill(~visible, -math.inf).softmax(-1)
        return (a1 - lam * a2) @ v

    all_visible = torch.ones(n_q, n_k, dtype=torch.bool)
    per_head = torch.tensor([0.1, 0.5, 0.9])
    per_token = torch.rand(B, H, n_q)
    assert torch.allclose(differential_attention(q, k, v, 0.3), manual(0.3, all_visible), atol=1e-6)
    assert torch.allclose(
        differential_attention(q, k, v, per_head), manual(per_head.view(H, 1, 1), all_visible), atol=1e-6
    )
    assert torch.allclose(
        differential_attention(q, k, v, per_token), manual(per_token[..., None], all_visible), atol=1e-6
    )

    keep = torch.rand(B, 1, n_q, n_k) > 0.3
    keep[..., 0] = True
    assert torch.allclose(differential_attention(q, k, v, 0.3, attn_mask=keep), manual(0.3, keep), atol=1e-6)
    additive = torch.zeros(B, 1, n_q, n_k).masked_fill(~keep, -math.inf)
    assert torch.allclose(differential_attention(q, k, v, 0.3, attn_mask=additive), manual(0.3, keep), atol=1e-6)
    causal = torch.ones(n_q, n_k, dtype=torch.bool).tril(n_k - n_q)  # queries are the last n_q positions
    assert torch.allclose(differential_attention(q, k, v, 0.3, is_causal=True), manual(0.3, causal), atol=1e-6)

    with pytest.raises(ValueError, match="per-head lambda"):
        differential_attention(q, k, v, torch.ones(5))
    with pytest.raises(ValueError, match="per-token lambda"):
        differential_attention(q, k, v, torch.ones(B, H, n_q + 1))
    with pytest.raises(ValueError, match="same length"):
        differential_attention(q, k, v[:, :, :3], 0.3)


@pytest.mark.parametrize("mode", ["scalar", "head", "token"])
def test_module_self_and_cross_attention(mode):
    torch.manual_seed(0)
    layer = DifferentialAttention(32, 4, kdim=24, lambda_mode=mode, clamp_negatives=(mode == "head"))
    x, memory = torch.randn(2, 5, 32), torch.randn(2, 9, 24)
    out, weights = layer(x, memory, return_weights=True)
    assert out.shape == (2, 5, 32) and weights.shape == (2, 4, 5, 9)
    out.sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in layer.parameters())
    self_layer = DifferentialAttention(32, 4, lambda_mode=mode)
    causal = self_layer(x, is_causal=True)
    # causal self-attention: the first position's output ignores later tokens
    x2 = x.clone()
    x2[:, 1:] = torch.randn(2, 4, 32)
    assert torch.allclose(self_layer(x2, is_causal=True)[:, 0], causal[:, 0], atol=1e-6)


def test_module_scalar_mode_matches_paper_formula():
    torch.manual_seed(0)
    layer = DifferentialAttention(16, 2, lambda_mode="scalar", lambda_init=0.5)
    x = torch.randn(1, 6, 16)
    H, d = 2, 4
    q = layer.q_proj(x).view(1, 6, H, 2 * d).transpose(1, 2)
    k = layer.k_proj(x).view(1, 6, H, 2 * d).transpose(1, 2)
    v = layer.v_proj(x).view(1, 6, H, 2 * d).transpose(1, 2)
    lam = (
        math.exp((layer.lambda_q1 * layer.lambda_k1).sum().item())
        - math.exp((layer.lambda_q2 * layer.lambda_k2).sum().item())
        + 0.5
    )
    a1 = (q[..., :d] @ k[..., :d].transpose(-1, -2) / 2).softmax(-1)
    a2 = (q[..., d:] @ k[..., d:].transpose(-1, -2) / 2).softmax(-1)
    o = (a1 - lam * a2) @ v
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + 1e-6) * 0.5
    expected = layer.o_proj(o.transpose(1, 2).reshape(1, 6, 16))
    assert torch.allclose(layer(x), expected, atol=1e-5)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(lambda_std=math.nan), "lambda_std=nan must be a finite number >= 0.0"),
        (dict(lambda_std=math.inf), "lambda_std=inf must be a finite number >= 0.0"),
        (dict(lambda_std=-0.1), "lambda_std=-0.1 must be a finite number >= 0.0"),
        (dict(lambda_init=math.nan, lambda_mode="head"), "lambda_init=nan must be a finite number"),
        (dict(eps=0.0), "eps=0.0 must be a finite number > 0"),
        (dict(eps=-1e-6), "eps=-1e-06 must be a finite number > 0"),
    ],
)
def test_module_refuses_non_finite_settings(kwargs, message):
    """These used to build a module whose every output was NaN."""
    with pytest.raises(ValueError, match=re.escape(message)):
        DifferentialAttention(16, 2, **kwargs)


@pytest.mark.parametrize("lam", [math.nan, math.inf, -math.inf])
def test_op_refuses_non_finite_float_lambda(lam):
    q, k, v = tensors()
    with pytest.raises(ValueError, match=r"^lambda=(nan|inf|-inf) must be a finite number: pass"):
        differential_attention(q, k, v, lam)
