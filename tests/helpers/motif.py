"""Tiny random Motif checkpoints in Motif's exact key layout, and an independent reference forward of them.

Real Motif weights cannot be downloaded here, so `write_motif_checkpoint` writes what a Motif repository holds:
config.json (`architectures: ["MotifForCausalLM"]`, `hidden_act: "poly_norm"`, `attn_rms_norm_eps`, `head_dim`,
`num_noise_heads` for grouped differential attention), safetensors under Llama's names plus per layer
`self_attn.lambda_{q1,k1,q2,k2}`, `self_attn.subln.weight` and `mlp.act_fn.{weight,bias}`, and a card with a licence.

`motif_reference_logits` is written from the semantics in issue 36 (plain torch, over the *source* weights, by
state-dict name; it shares no code with `modeling_diff` nor with `diff_transformer.conversion.motif`): all query heads
are attended first, each against its own key head (the stripe: even key/value heads are k1/v1, odd ones k2/v2), then
each group's signal heads subtract the group's noise head.
"""

import json
import math

import torch
from safetensors.torch import save_file


# Motif-2.6B's head layout (stripe pairs) and Motif-2-12.7B's (grouped differential attention), narrowed.
LAYOUTS = {
    # 8 query heads (4 pairs) over 8 key/value heads (4 pairs): multi-head, tied embeddings (Motif-2.6B ties them)
    "motif-2.6b-mha": dict(num_attention_heads=8, num_key_value_heads=8, tie_word_embeddings=True),
    # 8 query heads (4 pairs) over 4 key/value heads (2 pairs): GQA, untied lm_head
    "motif-2.6b-gqa": dict(num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False),
    # Motif-2-12.7B's topology (40 heads, 8 noise heads, 16 key/value heads) / 4: groups of 4 signal + 1 noise
    "motif-gda": dict(num_attention_heads=10, num_noise_heads=2, num_key_value_heads=4, tie_word_embeddings=False),
    # groups of 2 signal + 1 noise over 4 key/value groups (every noise head its own key pair), tied
    "motif-gda-tied": dict(num_attention_heads=12, num_noise_heads=4, num_key_value_heads=8, tie_word_embeddings=True),
}
LICENSE_CARD = "---\nlicense: other\nlicense_name: motif-test-license\nlanguage:\n- en\n- ko\n---\n# a tiny Motif\n"


def motif_config(layout="motif-2.6b-gqa", **overrides):
    values = dict(
        architectures=["MotifForCausalLM"],
        model_type="motif",
        vocab_size=103,
        hidden_size=64,
        intermediate_size=80,
        num_hidden_layers=3,
        head_dim=16,
        hidden_act="poly_norm",
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        attn_rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=None,
        use_bias=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=None,
        initializer_range=0.02,
        use_cache=True,
        torch_dtype="float32",
        auto_map={
            "AutoConfig": "configuration_motif.MotifConfig",
            "AutoModelForCausalLM": "modeling_motif.MotifForCausalLM",
        },
    )
    values.update(LAYOUTS[layout])
    values.update(overrides)
    if values["head_dim"] is None:  # as Motif-2.6B's config may: head_dim = hidden_size / num_attention_heads
        del values["head_dim"]
    return values


def head_dim(config: dict) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def motif_state_dict(config: dict, seed: int = 0) -> dict:
    """Random weights under Motif's names and shapes (spread enough that mixed-up heads change the argmax)."""
    g = torch.Generator().manual_seed(seed)
    D, I, V, d = config["hidden_size"], config["intermediate_size"], config["vocab_size"], head_dim(config)
    H, H_kv = config["num_attention_heads"], config["num_key_value_heads"]
    noise = config.get("num_noise_heads") or H // 2
    bias = config.get("use_bias", False)

    def rand(*shape, scale=1.0, mean=0.0):
        return torch.randn(*shape, generator=g) * scale + mean

    # embeddings and lm_head of std 0.1 and D^-0.5: logits of order 1, where fp32 agreement to 1e-5 is meaningful
    sd = {"model.embed_tokens.weight": rand(V, D, scale=0.1), "model.norm.weight": rand(D, scale=0.1, mean=1.0)}
    if not config["tie_word_embeddings"]:
        sd["lm_head.weight"] = rand(V, D, scale=D**-0.5)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = rand(D, scale=0.1, mean=1.0)
        sd[p + "post_attention_layernorm.weight"] = rand(D, scale=0.1, mean=1.0)
        sd[p + "self_attn.q_proj.weight"] = rand(H * d, D, scale=1.5 * D**-0.5)
        sd[p + "self_attn.k_proj.weight"] = rand(H_kv * d, D, scale=1.5 * D**-0.5)
        sd[p + "self_attn.v_proj.weight"] = rand(H_kv * d, D, scale=D**-0.5)
        sd[p + "self_attn.o_proj.weight"] = rand(D, 2 * (H - noise) * d, scale=(2 * (H - noise) * d) ** -0.5)
        if bias:
            for name, rows in (("q_proj", H * d), ("k_proj", H_kv * d), ("v_proj", H_kv * d), ("o_proj", D)):
                sd[p + f"self_attn.{name}.bias"] = rand(rows, scale=0.1)
        for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
            sd[p + f"self_attn.{name}"] = rand(d, scale=0.1)
        sd[p + "self_attn.subln.weight"] = rand(2 * d, scale=0.1, mean=1.0)
        sd[p + "mlp.gate_proj.weight"] = rand(I, D, scale=D**-0.5)
        sd[p + "mlp.up_proj.weight"] = rand(I, D, scale=D**-0.5)
        sd[p + "mlp.down_proj.weight"] = rand(D, I, scale=I**-0.5)
        if bias:
            sd[p + "mlp.gate_proj.bias"], sd[p + "mlp.up_proj.bias"] = rand(I, scale=0.1), rand(I, scale=0.1)
            sd[p + "mlp.down_proj.bias"] = rand(D, scale=0.1)
        sd[p + "mlp.act_fn.weight"] = rand(3, scale=0.1, mean=1.0 / 3.0)
        sd[p + "mlp.act_fn.bias"] = rand(1, scale=0.05)
    return sd


def write_motif_checkpoint(path, layout="motif-2.6b-gqa", seed=0, dtype=torch.float32, **overrides):
    """A Motif repository's files at `path` (config.json, model.safetensors, README.md with a licence); returns the
    config dict and the fp32 state dict."""
    path.mkdir(parents=True, exist_ok=True)
    config = motif_config(layout, **overrides)
    sd = motif_state_dict(config, seed)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    stored = {
        k: (v if k.endswith(("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")) else v.to(dtype))
        for k, v in sd.items()
    }
    save_file(
        {k: v.contiguous() for k, v in stored.items()}, str(path / "model.safetensors"), metadata={"format": "pt"}
    )
    (path / "README.md").write_text(LICENSE_CARD)
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    return config, {k: v.float() for k, v in stored.items()}


# ---- the reference, from the semantics ----


def _rms(x, weight, eps):
    return weight * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def _poly_norm(x, weight, bias):
    def n(u):
        return u / torch.sqrt((u * u).mean(-1, keepdim=True) + 1e-6)

    return weight[0] * n(x * x * x) + weight[1] * n(x * x) + weight[2] * n(x) + bias


def _rope(x, position, theta):
    """Rotate-half RoPE of one head (N, d) at positions (N,)."""
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angle = position[:, None].double() * inv[None, :]
    cos, sin = torch.cat((angle.cos(), angle.cos()), -1).float(), torch.cat((angle.sin(), angle.sin()), -1).float()
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat((-x2, x1), -1) * sin


def _motif_attention(sd, p, config, layer, x, positions):
    n, d = x.shape[0], head_dim(config)
    H, H_kv = config["num_attention_heads"], config["num_key_value_heads"]
    groups = config.get("num_noise_heads") or H // 2  # Motif-2.6B: pairs (signal, noise) = (even, odd) heads
    G = H // groups

    def proj(name):
        y = x @ sd[p + name + ".weight"].T
        return y + sd[p + name + ".bias"] if p + name + ".bias" in sd else y

    q = proj("q_proj").view(n, H, d).transpose(0, 1)  # (H, N, d)
    k = proj("k_proj").view(n, H_kv, d).transpose(0, 1)  # (H_kv, N, d)
    v = proj("v_proj").view(n, H_kv, d).transpose(0, 1)
    k1, k2, v1, v2 = k[0::2], k[1::2], v[0::2], v[1::2]  # stripe: even heads are map 1's, odd ones map 2's
    v_wide = [torch.cat((v1, v2), -1), torch.cat((v1, v2), -1)]  # both maps read [v1 | v2], (H_kv/2, N, 2d)
    signal = [h for h in range(H) if h % G != G - 1]  # q1: every head but the last of its group
    noise = [h for h in range(H) if h % G == G - 1]  # q2: the last head of each group
    mask = torch.tril(torch.ones(n, n, dtype=torch.bool))

    def attend(heads, keys, values):  # GQA: query head j of this map uses key head j // (len(heads) / len(keys))
        out = []
        for j, h in enumerate(heads):
            kv = j * keys.shape[0] // len(heads)
            s = _rope(q[h], positions, config["rope_theta"]) @ _rope(keys[kv], positions, config["rope_theta"]).T
            a = torch.softmax((s / math.sqrt(d)).masked_fill(~mask, -math.inf), -1)
            out.append(a @ values[kv])
        return torch.stack(out)  # (heads, N, 2d)

    o1 = attend(signal, k1, v_wide[0])  # (H - groups, N, 2d)
    o2 = attend(noise, k2, v_wide[1]).repeat_interleave(G - 1, dim=0)  # each noise output for its G - 1 signal heads
    lq1, lk1, lq2, lk2 = (sd[p + f"lambda_{c}"] for c in ("q1", "k1", "q2", "k2"))
    lambda_init = 0.8 - 0.6 * math.exp(-0.3 * (layer - 1))
    lam = torch.exp(torch.dot(lq1, lk1)) - torch.exp(torch.dot(lq2, lk2)) + lambda_init
    o = _rms(o1 - lam * o2, sd[p + "subln.weight"], config["attn_rms_norm_eps"]) * (1 - lambda_init)
    o = o.transpose(0, 1).reshape(n, -1)  # signal head j's 2d output goes to heads (2j, 2j + 1) of o_proj's input
    y = o @ sd[p + "o_proj.weight"].T
    return y + sd[p + "o_proj.bias"] if p + "o_proj.bias" in sd else y


@torch.no_grad()
def motif_reference_logits(config: dict, sd: dict, ids: torch.Tensor) -> torch.Tensor:
    """Logits (N, V) of one sequence (N,) of a Motif checkpoint (config.json dict, fp32 state dict)."""
    eps = config["rms_norm_eps"]
    positions = torch.arange(ids.shape[0])
    x = sd["model.embed_tokens.weight"][ids]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        x = x + _motif_attention(
            sd, p + "self_attn.", config, i, _rms(x, sd[p + "input_layernorm.weight"], eps), positions
        )
        h = _rms(x, sd[p + "post_attention_layernorm.weight"], eps)

        def mlp(name, h=h, p=p):
            y = h @ sd[p + f"mlp.{name}.weight"].T
            return y + sd[p + f"mlp.{name}.bias"] if p + f"mlp.{name}.bias" in sd else y

        act = _poly_norm(mlp("gate_proj"), sd[p + "mlp.act_fn.weight"], sd[p + "mlp.act_fn.bias"])
        down = (act * mlp("up_proj")) @ sd[p + "mlp.down_proj.weight"].T
        x = x + (down + sd[p + "mlp.down_proj.bias"] if p + "mlp.down_proj.bias" in sd else down)
    x = _rms(x, sd["model.norm.weight"], eps)
    return x @ sd.get("lm_head.weight", sd["model.embed_tokens.weight"]).T


def motif_reference_greedy(config: dict, sd: dict, ids: torch.Tensor, steps: int) -> torch.Tensor:
    """Greedy continuation (N + steps,) of one sequence: the reference's argmax, recomputed from scratch each step."""
    for _ in range(steps):
        ids = torch.cat((ids, motif_reference_logits(config, sd, ids)[-1].argmax().view(1)))
    return ids
