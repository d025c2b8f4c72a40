"""Motif Technologies' differential-attention LLMs as a source family (docs/motif.md).

`architectures: ["MotifForCausalLM"]` checkpoints come in two layouts, both read here:

* Motif-2.6B (arXiv 2508.09148): V1 differential attention over `num_attention_heads` = 2H query heads and
  `num_key_value_heads` = 2H_kv key/value heads of `head_dim` d, paired in a *stripe*: q1/k1/v1 are the even heads,
  q2/k2/v2 the odd ones, each map attends [v1 | v2] (2d wide), per-head RMSNorm `subln` (eps `attn_rms_norm_eps`)
  scaled by 1 - λ_init, the 2d output of pair i written back to heads (2i, 2i+1) before `o_proj`.
* Grouped differential attention (GDA, arXiv 2510.06949; Motif-2-12.7B), `num_noise_heads` = n: the query heads form
  n groups of G = num_attention_heads / n, the first G - 1 of each group signal (q1), the last noise (q2), each
  noise head's map serving the G - 1 signal heads of its group; K/V stripe-split as above; `o_proj` takes
  2 (num_attention_heads - n) d inputs. Motif-2.6B is the case G = 2.

Both use λ = exp(λq1·λk1) - exp(λq2·λk2) + λ_init with λ_init = 0.8 - 0.6 exp(-0.3 (i - 1)) for the 0-based layer
index i, and PolyNorm in the gated MLP (`hidden_act: "poly_norm"`, `mlp.act_fn.weight` (3) and `.bias` (1)).
The conventions are those of vLLM's `vllm/model_executor/models/motif.py` and its differential attention backends
(`differential_flash_attn.py`, V0; `grouped_diff_attn.py`, V1), read, not copied.

In Diff V1 terms (`DiffConfig`): H = num_attention_heads - n differential (signal) heads, H_kv = num_key_value_heads
/ 2 key/value groups, `num_noise_heads` = n (None for Motif-2.6B, where n = H), `hidden_act="poly_norm"`,
`lambda_init_depth_offset=-1`, `subln_eps=attn_rms_norm_eps`. The stripe layout *is* Diff V1's head-major layout:
q block 2h + c of Motif-2.6B is q_(c+1) of pair h, exactly where V1 keeps q_(c+1) of head h; a GDA group's G
query blocks (G - 1 signal, 1 noise) are where `DiffConfig.num_noise_heads` keeps them; k and v blocks (2g, 2g + 1)
are group g's [k1 | k2] and [v1 | v2]; o_proj's input block 2h + c is half c of head h's output in both. So every
tensor keeps its rows and columns (the permutation is the identity) and only the λ vectors are renamed
(`self_attn.lambda_q1` -> `self_attn.diff_lambda.lambda_q1`).

`MotifReference` is this package's own forward of a Motif checkpoint, written from the semantics above (plain torch,
one head at a time, by state-dict name, sharing no code with `modeling_diff`): what `verify_conversion` compares a
converted Motif checkpoint with, since transformers has no Motif class.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import torch

from ..families import MOTIF_ARCHITECTURE, is_motif
from .errors import ConversionError, one_line


# Config keys of Motif models this converter cannot express (Motif-3's latent attention, MoE, hyper-connections and
# multi-token prediction share the architecture name): refused in one line rather than converted wrongly.
_UNSUPPORTED_KEYS = (
    "kv_lora_rank",
    "q_lora_rank",
    "mhc_enabled",
    "num_experts",
    "n_routed_experts",
    "num_local_experts",
    "moe_intermediate_size",
)
_LAMBDA_NAMES = ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")


def motif_config(raw: dict, where: str):
    """A Motif config.json read as a `LlamaConfig` (shared fields, RoPE in transformers' current form) with the Motif
    fields checked: `num_noise_heads` (None for Motif-2.6B), `attn_rms_norm_eps`, the biases (`use_bias`,
    `attention_bias`, `qkv_bias`). Raises `ConversionError` for what a Diff model cannot compute."""
    from transformers import LlamaConfig

    from ..checkpoints.schema import MOTIF_FIELDS, field_problem

    problem = field_problem(raw, MOTIF_FIELDS)
    if problem:
        raise ConversionError(f"config.json of {where}: {problem}: fix it, or re-download the checkpoint's config.")
    architectures = raw.get("architectures") or [MOTIF_ARCHITECTURE]
    if architectures != [MOTIF_ARCHITECTURE]:
        raise ConversionError(
            f"{where} holds a {', '.join(map(str, architectures))} checkpoint; only {MOTIF_ARCHITECTURE} converts "
            "from Motif: pick the causal LM checkpoint."
        )
    present = [key for key in _UNSUPPORTED_KEYS if raw.get(key)]
    if present or int(raw.get("num_nextn_predict_layers") or 0) > 0:
        features = ", ".join(present or ["num_nextn_predict_layers"])
        raise ConversionError(
            f"{where} is a Motif model with {features} (latent attention, experts or multi-token prediction, e.g. "
            "Motif-3), which Diff models do not implement: only the dense Motif-2 line (Motif-2.6B, Motif-2-12.7B) "
            "converts."
        )
    if raw.get("hidden_act", "poly_norm") != "poly_norm":
        raise ConversionError(
            f"{where} has hidden_act={raw.get('hidden_act')!r}; Motif checkpoints use 'poly_norm': check config.json."
        )
    k_ratio = raw.get("k_ratio", 1)
    if k_ratio not in (None, 1):
        raise ConversionError(
            f"{where} has k_ratio={k_ratio!r}: only Motif's stripe key layout (k_ratio 1: keys and values split into "
            "even and odd heads) converts; no released Motif model uses another."
        )
    if raw.get("attn_rms_norm_eps") is None:
        raise ConversionError(
            f"config.json of {where} has no attn_rms_norm_eps (the eps of Motif's per-head subln), which every Motif "
            "config sets: restore it (Motif-2.6B: 1e-5)."
        )
    skipped = ("model_type", "architectures", "auto_map", "transformers_version", "hidden_act")
    fields = {k: v for k, v in raw.items() if k not in skipped}
    try:
        heads = int(fields.pop("num_attention_heads"))
        kv_heads = int(fields.pop("num_key_value_heads", None) or heads)
        fields["head_dim"] = int(fields.get("head_dim") or int(fields["hidden_size"]) // heads)
        # LlamaConfig wants hidden_size = heads x head_dim, which GDA's query heads need not meet: built with one head,
        # then given Motif's counts (it only reads RoPE and the shared fields here)
        config = LlamaConfig.from_dict({**fields, "num_attention_heads": 1, "num_key_value_heads": 1})
    except Exception as exc:
        raise ConversionError(
            f"config.json of {where} is not a valid Motif config ({one_line(exc)}): fix or re-download it."
        ) from exc
    config.num_attention_heads, config.num_key_value_heads = heads, kv_heads
    config.hidden_act = "poly_norm"  # not an activation LlamaConfig knows
    noise = raw.get("num_noise_heads")
    groups = heads // 2 if noise is None else noise
    if isinstance(groups, bool) or not isinstance(groups, int) or groups <= 0 or heads % groups or heads // groups < 2:
        raise ConversionError(
            f"{where} has num_attention_heads={heads} and num_noise_heads={noise!r}: the query heads must form "
            "num_noise_heads groups of at least two (signal heads, then one noise head): check config.json."
        )
    signal = heads - groups
    if kv_heads % 2 or signal % (kv_heads // 2) or groups % (kv_heads // 2):
        raise ConversionError(
            f"{where} has num_attention_heads={heads}, num_noise_heads={groups} and num_key_value_heads={kv_heads}: "
            "Motif's stripe layout needs an even number of key/value heads, whose halves divide both the signal "
            f"heads ({signal}) and the noise heads ({groups}): check config.json."
        )
    window = raw.get("sliding_window")
    if raw.get("use_sliding_window") and window is not None and window < config.max_position_embeddings:
        raise ConversionError(
            f"{where} uses sliding-window attention (use_sliding_window=true, sliding_window={window} < "
            f"max_position_embeddings={config.max_position_embeddings}), which Diff models do not implement: set it "
            "to false in a copy of SRC to accept attention over the whole context (what vLLM's Motif model computes)."
        )
    if raw.get("attention_dropout"):
        config.attention_dropout = 0.0  # training only; V1 refuses dropout, and inference never applies it
    bias = bool(raw.get("attention_bias", False) or raw.get("use_bias", False))
    config.motif = SimpleNamespace(
        num_noise_heads=None if noise is None else int(noise),
        groups=groups,
        attn_rms_norm_eps=float(raw["attn_rms_norm_eps"]),
        qkv_bias=bool(raw["qkv_bias"]) if "qkv_bias" in raw else bias,
        out_bias=bias,
        mlp_bias=bool(raw.get("use_bias", False)),
    )
    return config


def motif_lambda_init(layer_idx: int) -> float:
    """Motif's λ_init of a 0-based layer: the paper's schedule at depth layer_idx - 1."""
    return 0.8 - 0.6 * math.exp(-0.3 * (layer_idx - 1))


class MotifReference:
    """A Motif checkpoint's forward in plain torch, from the semantics in this module's docstring: one sequence at a
    time, one head at a time, weights by state-dict name. For `verify_conversion`: `model(input_ids).logits`, greedy
    `generate`, and `named_parameters()` (the weights, for casting them as the converter did)."""

    def __init__(self, path: Path, config, dtype: torch.dtype = torch.float32):
        from safetensors.torch import load_file

        from ..checkpoints.weights import find_shards

        self.config = config
        self.dtype = dtype
        self.weights: dict[str, torch.Tensor] = {}
        for shard in find_shards(path):
            for name, tensor in load_file(shard).items():
                self.weights[name] = tensor if name.endswith(_LAMBDA_NAMES) else tensor.to(dtype)

    def eval(self):
        return self

    def named_parameters(self):
        return iter(self.weights.items())

    def _w(self, name: str) -> torch.Tensor:
        return self.weights[name].to(self.dtype)

    def _linear(self, name: str, x: torch.Tensor) -> torch.Tensor:
        out = x @ self._w(name + ".weight").T
        return out + self._w(name + ".bias") if name + ".bias" in self.weights else out

    def _rms_norm(self, x: torch.Tensor, name: str, eps: float) -> torch.Tensor:
        x32 = x.float()
        return (self._w(name).float() * x32 / torch.sqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(self.dtype)

    def _rope(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        d, rope = int(self.config.head_dim), self.config.rope_parameters
        if rope.get("rope_type", "default") == "default":
            inv_freq, scale = 1.0 / (rope["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float) / d)), 1.0
        else:
            inv_freq, scale = ROPE_INIT_FUNCTIONS[rope["rope_type"]](self.config, None)
        angles = torch.arange(n, dtype=torch.float)[:, None] * inv_freq[None, :]  # (N, d/2)
        angles = torch.cat((angles, angles), dim=-1)  # (N, d): rotate-half convention
        return angles.cos() * scale, angles.sin() * scale

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return (x.float() * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1).float() * sin).to(x.dtype)

    def _attention(self, p: str, layer: int, x: torch.Tensor, cos, sin) -> torch.Tensor:
        c, m = self.config, self.config.motif
        n, d = x.shape[0], int(c.head_dim)
        heads, kv_heads = int(c.num_attention_heads), int(c.num_key_value_heads)
        group_size = heads // m.groups  # G: G - 1 signal heads, then the noise head
        q = self._linear(p + "q_proj", x).view(n, heads, d)
        k = self._linear(p + "k_proj", x).view(n, kv_heads, d)
        v = self._linear(p + "v_proj", x).view(n, kv_heads, d)
        lq1, lk1, lq2, lk2 = (self.weights[p + name].float() for name in _LAMBDA_NAMES)
        lambda_init = motif_lambda_init(layer)
        lam = torch.exp((lq1 * lk1).sum()) - torch.exp((lq2 * lk2).sum()) + lambda_init
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        signal_heads = [g * group_size + i for g in range(m.groups) for i in range(group_size - 1)]
        pairs = kv_heads // 2  # stripe: k1/v1 = even kv heads, k2/v2 = odd ones
        outputs = []
        for j, head in enumerate(signal_heads):
            group = head // group_size
            noise_head = group * group_size + group_size - 1
            kv = j // (len(signal_heads) // pairs)  # GQA of the signal heads over the k1 (even) heads
            noise_kv = group // (m.groups // pairs)  # and of the noise heads over the k2 (odd) heads
            maps = []
            for query_head, key_head in ((head, 2 * kv), (noise_head, 2 * noise_kv + 1)):
                scores = self._rotate(q[:, query_head], cos, sin) @ self._rotate(k[:, key_head], cos, sin).T
                scores = (scores.float() * d**-0.5).masked_fill(~causal, float("-inf"))
                maps.append(torch.softmax(scores, dim=-1))
            values = [torch.cat((v[:, 2 * g], v[:, 2 * g + 1]), dim=-1).float() for g in (kv, noise_kv)]  # [v1 | v2]
            out = maps[0] @ values[0] - lam * (maps[1] @ values[1])  # (N, 2d)
            out = self._rms_norm(out, p + "subln.weight", m.attn_rms_norm_eps).float() * (1 - lambda_init)
            outputs.append(out.to(self.dtype))
        return self._linear(p + "o_proj", torch.cat(outputs, dim=-1))  # signal head j -> o_proj inputs [2jd, 2(j+1)d)

    def _poly_norm(self, p: str, x: torch.Tensor) -> torch.Tensor:
        w, b = self._w(p + "act_fn.weight").float(), self._w(p + "act_fn.bias").float()
        x = x.float()

        def norm(u):
            return u / torch.sqrt(u.pow(2).mean(-1, keepdim=True) + 1e-6)

        return (w[0] * norm(x**3) + w[1] * norm(x**2) + w[2] * norm(x) + b).to(self.dtype)

    @torch.no_grad()
    def logits_of(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits (N, V) of one sequence (N,)."""
        c = self.config
        cos, sin = self._rope(ids.shape[0])
        x = self._w("model.embed_tokens.weight")[ids]
        for i in range(int(c.num_hidden_layers)):
            p = f"model.layers.{i}."
            h = self._rms_norm(x, p + "input_layernorm.weight", c.rms_norm_eps)
            x = x + self._attention(p + "self_attn.", i, h, cos, sin)
            h = self._rms_norm(x, p + "post_attention_layernorm.weight", c.rms_norm_eps)
            gate, up = self._linear(p + "mlp.gate_proj", h), self._linear(p + "mlp.up_proj", h)
            x = x + self._linear(p + "mlp.down_proj", self._poly_norm(p + "mlp.", gate) * up)
        x = self._rms_norm(x, "model.norm.weight", c.rms_norm_eps)
        head = self.weights.get("lm_head.weight", self.weights["model.embed_tokens.weight"])
        return x @ head.to(self.dtype).T

    def __call__(self, input_ids: torch.Tensor, **kwargs):
        return SimpleNamespace(logits=torch.stack([self.logits_of(row) for row in input_ids]))

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, **kwargs) -> torch.Tensor:
        """Greedy continuation (argmax, no cache) of one row, stopping after an end-of-sequence token as
        transformers' `generate` does."""
        eos = self.config.eos_token_id
        eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        ids = input_ids
        for _ in range(max_new_tokens):
            ids = torch.cat((ids, self(ids).logits[:, -1].argmax(-1, keepdim=True)), dim=-1)
            if int(ids[0, -1]) in eos:
                break
        return ids


__all__ = ["MOTIF_ARCHITECTURE", "MotifReference", "is_motif", "motif_config", "motif_lambda_init"]
