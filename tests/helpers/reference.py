"""An independent reference of both Diff variants, written straight from docs/design.md's formulas (and docs/motif.md's
options: grouped noise queries, PolyNorm, λ_init's depth offset, subln's eps).

Loops over heads, builds every mask and softmax by hand, and reads the model's weights by state-dict name only, so
it shares no code with `modeling_diff.py` beyond the weights.
"""

import math

import torch
import torch.nn.functional as F
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS


def rms_norm(x, weight, eps):
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))


def rope_cos_sin(config, positions):
    d = config.head_dim
    rope = config.rope_parameters
    if rope["rope_type"] == "default":
        inv_freq = 1.0 / (rope["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float) / d))
        scaling = 1.0
    else:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config, None)
    freqs = positions[:, None].float() * inv_freq[None, :]  # (N, d/2)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


def rotate(x, cos, sin):  # rotate-half convention, x (N, d)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def linear(sd, name, x):
    out = x @ sd[name + ".weight"].T
    if name + ".bias" in sd:
        out = out + sd[name + ".bias"]
    return out


def softmax_rows(logits, mask):
    logits = logits.masked_fill(~mask, float("-inf"))
    return torch.softmax(logits, dim=-1)


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
    lq1, lk1, lq2, lk2 = (sd[p + f"diff_lambda.lambda_{n_}"].float() for n_ in ("q1", "k1", "q2", "k2"))
    depth = layer_idx + getattr(config, "lambda_init_depth_offset", 0)
    lambda_init = config.lambda_init if config.lambda_init is not None else 0.8 - 0.6 * math.exp(-0.3 * depth)
    subln_eps = getattr(config, "subln_eps", None) or config.rms_norm_eps
    lam = torch.exp((lq1 * lk1).sum()) - torch.exp((lq2 * lk2).sum()) + lambda_init
    floor = getattr(config, "lambda_floor", None)
    if floor is not None:  # m + (1/100) log(1 + exp(100 (λ − m))), written out (logaddexp(0, x) = log(1 + e^x))
        lam = floor + torch.logaddexp(torch.zeros(()), 100.0 * (lam - floor)) / 100.0
    heads, maps = [], []
    for h in range(H):
        g = h // (H // H_kv)
        q1, q2 = rotate(queries[h][0], cos, sin), rotate(queries[h][1], cos, sin)
        k1, k2 = rotate(k[:, g, 0], cos, sin), rotate(k[:, g, 1], cos, sin)
        a1 = softmax_rows(q1 @ k1.T * d**-0.5, mask)
        a2 = softmax_rows(q2 @ k2.T * d**-0.5, mask)
        diff = a1 - lam * a2
        o = rms_norm(diff @ v[:, g], sd[p + "subln.weight"], subln_eps) * (1 - lambda_init)
        heads.append(o)
        maps.append(diff)
    return linear(sd, p + "o_proj", torch.cat(heads, dim=-1)), torch.stack(maps)


def attention_v2(sd, p, config, layer_idx, x, cos, sin, mask):
    H, H_kv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    n = x.shape[0]
    q = qk_norm(sd, p + "q_norm", linear(sd, p + "q_proj", x).view(n, 2 * H, d), config)
    k = qk_norm(sd, p + "k_norm", linear(sd, p + "k_proj", x).view(n, H_kv, d), config)
    v = linear(sd, p + "v_proj", x).view(n, H_kv, d)
    lam = torch.sigmoid(x @ sd[p + "diff_lambda.proj.weight"].T)  # (N, H)
    group = lambda j: j // (2 * H // H_kv)  # noqa: E731
    a, probs = [], []
    for j in range(2 * H):
        kj = rotate(k[:, group(j)], cos, sin)
        pr = softmax_rows(rotate(q[:, j], cos, sin) @ kj.T * d**-0.5, mask)
        probs.append(pr)
        a.append(pr @ v[:, group(j)])
    heads = [a[2 * h] - lam[:, h : h + 1] * a[2 * h + 1] for h in range(H)]
    maps = [probs[2 * h] - lam[:, h : h + 1] * probs[2 * h + 1] for h in range(H)]
    return linear(sd, p + "o_proj", torch.cat(heads, dim=-1)), torch.stack(maps)


def activation(sd, name, config, x):
    """SiLU (Llama's), or PolyNorm: w0 n(x³) + w1 n(x²) + w2 n(x) + b, n(u) = u / sqrt(mean(u²) + 1e-6)."""
    if config.hidden_act != "poly_norm":
        return F.silu(x)
    w, b = sd[name + ".weight"], sd[name + ".bias"]

    def n(u):
        return u / torch.sqrt(u.pow(2).mean(-1, keepdim=True) + 1e-6)

    return w[0] * n(x**3) + w[1] * n(x**2) + w[2] * n(x) + b


@torch.no_grad()
def reference_forward(model, input_ids, attention_mask_1d=None):
    """Logits (and differential maps per layer) of one sequence (N,) of a DiffForCausalLM, from its state dict.

    `attention_mask_1d` (N,) marks real tokens; masked-out keys are never attended and positions count real tokens only
    (transformers' left-padding convention)."""
    config = model.config
    sd = {k: v.detach().float() for k, v in model.state_dict().items()}
    n = input_ids.shape[0]
    keep = torch.ones(n, dtype=torch.bool) if attention_mask_1d is None else attention_mask_1d.bool()
    positions = (keep.long().cumsum(0) - 1).clamp_min(0)
    cos, sin = rope_cos_sin(config, positions)
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
        x = x + attn
        h = rms_norm(x, sd[p + "post_attention_layernorm.weight"], config.rms_norm_eps)
        gate, up = linear(sd, p + "mlp.gate_proj", h), linear(sd, p + "mlp.up_proj", h)
        x = x + linear(sd, p + "mlp.down_proj", activation(sd, p + "mlp.act_fn", config, gate) * up)
    x = rms_norm(x, sd["model.norm.weight"], config.rms_norm_eps)
    lm_head = sd.get("lm_head.weight", sd["model.embed_tokens.weight"])
    return x @ lm_head.T, all_maps
