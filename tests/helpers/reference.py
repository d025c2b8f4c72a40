"""An independent reference of both Diff variants, written straight from docs/design.md's formulas (and docs/motif.md's
options: grouped noise queries, PolyNorm, λ_init's depth offset, subln's eps).

Loops over heads, builds every mask and softmax by hand, and reads the model's weights by state-dict name only, so
it shares no code with `modeling_diff.py` beyond the weights. Computes in float64, marking where fp32 arithmetic rounds
(`fl`, `fl_dot`, `fl_sum`, tests/helpers/rounding.py): `reference_logits` also gives the fp32 rounding scale.
"""

import math

import torch
import torch.nn.functional as F
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from tests.helpers.rounding import fl, fl_dot, fl_sum, rounding_scale


def rms_norm(x, weight, eps):
    mean_square = fl(fl_sum(fl(x * x), -1) / x.shape[-1])
    return fl(weight * fl(x * fl(torch.rsqrt(fl(mean_square + eps)), ulps=2)))


def rope_cos_sin(config, positions, dtype=torch.float64):
    d = config.head_dim
    rope = config.rope_parameters
    if rope["rope_type"] == "default":
        inv_freq = 1.0 / (rope["rope_theta"] ** (torch.arange(0, d, 2, dtype=dtype) / d))
        scaling = 1.0
    else:  # transformers' own scaled frequencies, computed in fp32 (the model's, to the bit)
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config, None)
    freqs = fl(positions[:, None].to(dtype) * fl(inv_freq.to(dtype)[None, :]))  # (N, d/2)
    emb = torch.cat((freqs, freqs), dim=-1)
    return fl(fl(emb.cos(), ulps=2) * scaling), fl(fl(emb.sin(), ulps=2) * scaling)


def rotate(x, cos, sin):  # rotate-half convention, x (N, d)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return fl(fl(x * cos) + fl(rotated * sin))


def linear(sd, name, x):
    out = fl_dot(x, sd[name + ".weight"].T)
    if name + ".bias" in sd:
        out = fl(out + sd[name + ".bias"])
    return out


def softmax_rows(logits, mask):
    logits = logits.masked_fill(~mask, float("-inf"))
    e = fl(torch.exp(fl(logits - logits.amax(-1, keepdim=True))), ulps=2)
    return fl(e / fl_sum(e, -1))


def qk_norm(sd, name, x, config):
    """Qwen3's q_norm / k_norm: an RMSNorm over every d-wide query or key (sub-)head, when the checkpoint has one."""
    return rms_norm(x, sd[name + ".weight"], config.rms_norm_eps) if name + ".weight" in sd else x


def attention_v1(sd, p, config, layer_idx, x, cos, sin, mask):
    H, H_kv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    n = x.shape[0]
    noise = getattr(config, "num_noise_heads", None)
    if noise is None:  # [q1 | q2] per head
        q = qk_norm(sd, p + "q_norm", linear(sd, p + "q_proj", x).view(n, H, 2, d), config)
        queries = [(q[:, h, 0], q[:, h, 1]) for h in range(H)]
    else:  # per noise group: r signal queries, then the noise query every one of them uses as q2
        r = H // noise
        q = qk_norm(sd, p + "q_norm", linear(sd, p + "q_proj", x).view(n, noise, r + 1, d), config)
        queries = [(q[:, h // r, h % r], q[:, h // r, r]) for h in range(H)]
    k = qk_norm(sd, p + "k_norm", linear(sd, p + "k_proj", x).view(n, H_kv, 2, d), config)
    v = linear(sd, p + "v_proj", x).view(n, H_kv, 2 * d)
    lq1, lk1, lq2, lk2 = (sd[p + f"diff_lambda.lambda_{n_}"] for n_ in ("q1", "k1", "q2", "k2"))
    depth = layer_idx + getattr(config, "lambda_init_depth_offset", 0)
    lambda_init = config.lambda_init if config.lambda_init is not None else 0.8 - 0.6 * math.exp(-0.3 * depth)
    subln_eps = getattr(config, "subln_eps", None) or config.rms_norm_eps
    lam = fl(fl(fl(torch.exp(fl_dot(lq1, lk1)), 2) - fl(torch.exp(fl_dot(lq2, lk2)), 2)) + lambda_init)
    floor = getattr(config, "lambda_floor", None)
    if floor is not None:  # m + (1/100) log(1 + exp(100 (λ − m))), written out (logaddexp(0, x) = log(1 + e^x))
        softplus = fl(torch.logaddexp(torch.zeros((), dtype=lam.dtype), fl(100.0 * fl(lam - floor))), ulps=2)
        lam = fl(floor + fl(softplus / 100.0))
    heads, maps = [], []
    for h in range(H):
        g = h // (H // H_kv)
        q1, q2 = rotate(queries[h][0], cos, sin), rotate(queries[h][1], cos, sin)
        k1, k2 = rotate(k[:, g, 0], cos, sin), rotate(k[:, g, 1], cos, sin)
        a1 = softmax_rows(fl(fl_dot(q1, k1.T) * d**-0.5), mask)
        a2 = softmax_rows(fl(fl_dot(q2, k2.T) * d**-0.5), mask)
        diff = fl(a1 - fl(lam * a2))
        o = fl(rms_norm(fl_dot(diff, v[:, g]), sd[p + "subln.weight"], subln_eps) * (1 - lambda_init))
        heads.append(o)
        maps.append(diff)
    return linear(sd, p + "o_proj", torch.cat(heads, dim=-1)), torch.stack(maps)


def attention_v2(sd, p, config, layer_idx, x, cos, sin, mask):
    H, H_kv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    n = x.shape[0]
    q = qk_norm(sd, p + "q_norm", linear(sd, p + "q_proj", x).view(n, 2 * H, d), config)
    k = qk_norm(sd, p + "k_norm", linear(sd, p + "k_proj", x).view(n, H_kv, d), config)
    v = linear(sd, p + "v_proj", x).view(n, H_kv, d)
    lam = fl(torch.sigmoid(fl_dot(x, sd[p + "diff_lambda.proj.weight"].T)), ulps=2)  # (N, H)
    group = lambda j: j // (2 * H // H_kv)  # noqa: E731
    a, probs = [], []
    for j in range(2 * H):
        kj = rotate(k[:, group(j)], cos, sin)
        pr = softmax_rows(fl(fl_dot(rotate(q[:, j], cos, sin), kj.T) * d**-0.5), mask)
        probs.append(pr)
        a.append(fl_dot(pr, v[:, group(j)]))
    heads = [fl(a[2 * h] - fl(lam[:, h : h + 1] * a[2 * h + 1])) for h in range(H)]
    maps = [fl(probs[2 * h] - fl(lam[:, h : h + 1] * probs[2 * h + 1])) for h in range(H)]
    return linear(sd, p + "o_proj", torch.cat(heads, dim=-1)), torch.stack(maps)


def activation(sd, name, config, x):
    """SiLU (Llama's), or PolyNorm: w0 n(x³) + w1 n(x²) + w2 n(x) + b, n(u) = u / sqrt(mean(u²) + 1e-6)."""
    if config.hidden_act != "poly_norm":
        return fl(F.silu(x), ulps=2)
    w, b = sd[name + ".weight"], sd[name + ".bias"]

    def n(u):
        return fl(u / fl(torch.sqrt(fl(fl(fl_sum(fl(u * u), -1) / u.shape[-1]) + 1e-6))))

    square = fl(x * x)
    return fl(fl(fl(fl(w[0] * n(fl(square * x))) + fl(w[1] * n(square))) + fl(w[2] * n(x))) + b)


@torch.no_grad()
def reference_forward(model, input_ids, attention_mask_1d=None, dtype=torch.float64):
    """Logits (and differential maps per layer) of one sequence (N,) of a DiffForCausalLM, from its state dict.

    `attention_mask_1d` (N,) marks real tokens; masked-out keys are never attended and positions count real tokens only
    (transformers' left-padding convention). `dtype` float64: the value fp32 arithmetic approximates."""
    config = model.config
    sd = {k: v.detach().to(dtype) for k, v in model.state_dict().items()}
    n = input_ids.shape[0]
    keep = torch.ones(n, dtype=torch.bool) if attention_mask_1d is None else attention_mask_1d.bool()
    positions = (keep.long().cumsum(0) - 1).clamp_min(0)
    cos, sin = rope_cos_sin(config, positions, dtype)
    mask = torch.ones(n, n, dtype=torch.bool).tril() & keep[None, :]
    mask = mask | torch.eye(n, dtype=torch.bool)  # padded query rows attend themselves only (their output is unused)
    x = sd["model.embed_tokens.weight"][input_ids]
    attention = attention_v1 if config.diff_version == 1 else attention_v2
    all_maps = []
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        h = rms_norm(x, sd[p + "input_layernorm.weight"], config.rms_norm_eps)
        attn, maps = attention(sd, p + "self_attn.", config, i, h, cos, sin, mask)
        all_maps.append(maps)
        x = fl(x + attn)
        h = rms_norm(x, sd[p + "post_attention_layernorm.weight"], config.rms_norm_eps)
        gate, up = linear(sd, p + "mlp.gate_proj", h), linear(sd, p + "mlp.up_proj", h)
        x = fl(x + linear(sd, p + "mlp.down_proj", fl(activation(sd, p + "mlp.act_fn", config, gate) * up)))
    x = rms_norm(x, sd["model.norm.weight"], config.rms_norm_eps)
    # the LM head (or the tied embedding); a sequence classifier's score, which reads the last real token's row
    lm_head = sd.get("lm_head.weight", sd.get("score.weight", sd["model.embed_tokens.weight"]))
    return fl_dot(x, lm_head.T), all_maps


def reference_logits(model, input_ids, attention_mask_1d=None, **kwargs):
    """(logits, σ) of one sequence: the float64 reference and the scale of fp32's rounding error on it, per logit
    (tests/helpers/rounding.py; assert_within_rounding(model_logits, logits, σ) checks a model's fp32 logits)."""
    return rounding_scale(lambda: reference_forward(model, input_ids, attention_mask_1d)[0], **kwargs)
