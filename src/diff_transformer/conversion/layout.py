"""Tensor-level maps from Llama / DiffLlama state dicts to Diff (V1, V2) state dicts.

Every map is a pure function of one source tensor (plus, for the first tensor of a layer, the new parameters of that
layer), so the converter can stream a checkpoint tensor by tensor. Head layouts (docs/design.md, "Head
layouts"; rows of a projection weight are grouped in blocks of `head_dim` = d):

* Llama (H query heads, H_kv key/value heads, n = H / H_kv): query head j attends with kv head j // n.
* Diff V2 (H differential heads, H_kv kv heads): query block j in [0, 2H) attends with kv head j // (2n);
  differential head h = blocks (2h, 2h+1).
* Diff V1 (H' differential heads, H'_kv groups): q block 2h+c is q_{c+1} of head h (c in {0, 1}), k block 2g+c is
  k_{c+1} of group g, v blocks (2g, 2g+1) are the 2d-wide v of group g; head h attends with group g(h) = h // n'.
  o_proj's input block 2h+c multiplies the c-th d-wide half of O_h. Two ways to fill it from a Llama:
  - paired (`LlamaToV1`, even H and H_kv): H' = H/2, H'_kv = H_kv/2, n' = n; Llama heads become each other's second
    map, every weight reused, none added;
  - expanded (`LlamaToV1Expanded`, any head count): H' = H, H'_kv = H_kv, n' = n; Llama head h is q1 of head h and
    its kv head g is k1 and the first half of v_g; q2, k2 (copies of q1, k1: A2 = A1 at step 0) and the second half of
    v (small noise, read by zero columns of o_proj) are new.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ..errors import check_seed
from ..families import Family
from .errors import ConversionError


_ATTN = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(q_proj|k_proj|v_proj|o_proj)\.(weight|bias)$")
# DiffLlama's and Motif's λ vectors (both store them under these names)
_DIFFLLAMA_LAMBDA = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(lambda_q1|lambda_k1|lambda_q2|lambda_k2)$")
# Non-persistent buffers that some old checkpoints still carry; never part of the model's state.
IGNORED_SOURCE_TENSORS = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")


@dataclass(frozen=True)
class Geometry:
    """The shapes of a Llama-family source model."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    attention_bias: bool
    mlp_bias: bool
    tie_word_embeddings: bool
    # Llama-family variants (conversion/families.py sets them): o_proj's bias (Qwen2: none while q/k/v have one),
    # q_norm/k_norm (Qwen3), the head on top of the decoder and the prefix the source stores the decoder under
    # (`transformer.` for Llama's and Qwen's question-answering heads).
    attention_out_bias: bool | None = None
    qk_norm: bool = False
    head: tuple[tuple[str, tuple[int, ...]], ...] | None = None
    prefix: str = "model."
    # Motif (conversion/motif.py): the number of query-head groups, each of signal heads then one noise head
    # (`num_noise_heads`; num_heads / 2 for Motif-2.6B's stripe pairs). None for every other family.
    motif_groups: int | None = None

    @classmethod
    def from_config(cls, config) -> Geometry:
        num_heads = int(config.num_attention_heads)
        num_kv_heads = int(config.num_key_value_heads or num_heads)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        return cls(
            vocab_size=int(config.vocab_size),
            hidden_size=int(config.hidden_size),
            intermediate_size=int(config.intermediate_size),
            num_layers=int(config.num_hidden_layers),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=int(head_dim),
            attention_bias=bool(getattr(config, "attention_bias", False)),
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        )

    @property
    def out_bias(self) -> bool:
        return self.attention_bias if self.attention_out_bias is None else self.attention_out_bias

    def canonical(self, name: str) -> str:
        """A source tensor's name with the decoder under `model.`, as Diff models (and the maps below) name it."""
        if self.prefix != "model." and name.startswith(self.prefix):
            return "model." + name[len(self.prefix) :]
        return name

    def expected_source_tensors(self, family: Family) -> tuple[dict[str, tuple[int, ...]], set[str]]:
        """(required name -> shape, optional names) of a checkpoint of `family` with this geometry (a causal LM, or
        `self.head` on top), under the canonical names (see `canonical`)."""
        D, I, V, d = self.hidden_size, self.intermediate_size, self.vocab_size, self.head_dim
        H, H_kv = self.num_heads, self.num_kv_heads
        expected: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,)}
        optional: set[str] = set()
        if self.head is not None:
            expected.update(self.head)
        else:
            expected["lm_head.weight"] = (V, D)
            if self.tie_word_embeddings:
                optional.add("lm_head.weight")
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            expected[p + "input_layernorm.weight"] = (D,)
            expected[p + "post_attention_layernorm.weight"] = (D,)
            expected[p + "self_attn.q_proj.weight"] = (H * d, D)
            expected[p + "self_attn.k_proj.weight"] = (H_kv * d, D)
            expected[p + "self_attn.v_proj.weight"] = (H_kv * d, D)
            out_width = H * d if self.motif_groups is None else 2 * (H - self.motif_groups) * d
            expected[p + "self_attn.o_proj.weight"] = (D, out_width)
            if self.attention_bias:
                expected[p + "self_attn.q_proj.bias"] = (H * d,)
                expected[p + "self_attn.k_proj.bias"] = (H_kv * d,)
                expected[p + "self_attn.v_proj.bias"] = (H_kv * d,)
            if self.out_bias:
                expected[p + "self_attn.o_proj.bias"] = (D,)
            if self.qk_norm:
                expected[p + "self_attn.q_norm.weight"] = (d,)
                expected[p + "self_attn.k_norm.weight"] = (d,)
            expected[p + "mlp.gate_proj.weight"] = (I, D)
            expected[p + "mlp.up_proj.weight"] = (I, D)
            expected[p + "mlp.down_proj.weight"] = (D, I)
            if self.mlp_bias:  # never for a family whose MLP has none (`families.attention_flags`)
                expected[p + "mlp.gate_proj.bias"] = (I,)
                expected[p + "mlp.up_proj.bias"] = (I,)
                expected[p + "mlp.down_proj.bias"] = (D,)
            if family.exact_v1:  # differential already: its λ vectors
                for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
                    expected[p + f"self_attn.{name}"] = (d,)
            if self.motif_groups is not None:  # Motif: the per-head RMSNorm over 2d and PolyNorm's (w0, w1, w2) and b
                expected[p + "self_attn.subln.weight"] = (2 * d,)
                expected[p + "mlp.act_fn.weight"] = (3,)
                expected[p + "mlp.act_fn.bias"] = (1,)
        return expected, optional


def permute_row_blocks(tensor: torch.Tensor, perm: list[int], block: int) -> torch.Tensor:
    """Rows regrouped in blocks of `block`: output block b is input block perm[b] (weights (out, in) and biases)."""
    rest = tensor.shape[1:]
    index = torch.tensor(perm, dtype=torch.long)
    return tensor.reshape(len(perm), block, *rest).index_select(0, index).reshape(tensor.shape).contiguous()


def permute_column_blocks(tensor: torch.Tensor, perm: list[int], block: int) -> torch.Tensor:
    """Columns of an (out, in) weight regrouped in blocks of `block`: output block b is input block perm[b]."""
    index = torch.tensor(perm, dtype=torch.long)
    rows = tensor.shape[0]
    return tensor.reshape(rows, len(perm), block).index_select(1, index).reshape(tensor.shape).contiguous()


def llama_to_v1_query_permutation(num_heads: int, num_kv_heads: int) -> list[int]:
    """Llama query head feeding each V1 (head, component) slot: perm[2h + c] for differential head h, c in {0, 1}.

    The pairing must respect Llama's GQA, otherwise a query would be paired with a key it was never trained with.
    Llama: query head j uses kv head j // n (n = H / H_kv). V1 (H' = H/2 heads, H'_kv = H_kv/2 groups, so
    H' / H'_kv = n as well): head h uses group g = h // n, whose k1 / k2 / v halves are Llama kv heads 2g / 2g+1
    (kv pairing (2g, 2g+1), blocks kept in place). For q_{c+1} of head h to meet the key its Llama query head used,
    that Llama query head must have kv head 2g + c, i.e. lie in [(2g+c) n, (2g+c+1) n). Taking the r-th one,
    r = h % n (each of the n heads of group g takes a different r, so every Llama head is used exactly once):

        perm[2h + c] = (2 (h // n) + c) n + h % n

    For MHA (n = 1) this is the identity: q1 of head h = Llama head 2h, q2 = head 2h+1 (docs/design.md's pairing), and
    q_proj / k_proj / v_proj / o_proj are reused exactly as stored. The naive pairing (2h, 2h+1) is NOT right under
    GQA: with n = 2, Llama heads 2h and 2h+1 both use kv head h, yet V1 needs two kv heads per differential head,
    and head h = 1 (group 0, kv heads 0 and 1) would take Llama heads 2 and 3, trained against kv head 1 only.
    o_proj's input blocks follow the same permutation, so O_h's half c (computed over v = Llama kv head 2g + c)
    goes through the output columns of the Llama head that read that kv head.
    """
    n = num_heads // num_kv_heads
    return [(2 * (h // n) + c) * n + h % n for h in range(num_heads // 2) for c in range(2)]


def diffllama_query_permutation(num_heads: int) -> list[int]:
    """DiffLlama query head feeding each V1 slot: differential head h pairs DiffLlama heads (h, h + H/2).

    DiffLlama (H heads of size d, H_kv kv heads, n = H / H_kv) runs standard attention over H query heads, then
    subtracts head h + H/2 from head h (torch.chunk over heads). Head h < H/2 uses kv head h // n, head h + H/2 uses
    (h + H/2) // n = h // n + H_kv/2 (H/2 is a multiple of n since H_kv is even). Its value for head h is
    cat(v[c(h)], v[c(h) + H_kv/2]) with c(h) = (h // n) mod (H_kv/2) = h // n for both maps (`chunk` + `repeat`
    over kv heads). So with H' = H/2 heads and g = h // n (our V1 group, H'/H'_kv = n):
      q1 = DL q head h, q2 = DL q head h + H/2; k1 = DL k head g, k2 = DL k head g + H_kv/2;
      v = cat(DL v head g, DL v head g + H_kv/2); o_proj unchanged (DL's output block h is already [half 0, half 1]);
      DL's RMSNorm has no weight (subln := 1); its λ_init schedule equals ours with lambda_init=None.
    """
    half = num_heads // 2
    return [h + c * half for h in range(half) for c in range(2)]


def diffllama_kv_permutation(num_kv_heads: int) -> list[int]:
    half = num_kv_heads // 2
    return [g + c * half for g in range(half) for c in range(2)]


def stored_as(view: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Mark a view whose row-major bytes are a tensor of `shape` (one that reshaping would have to copy): the
    ShardWriter stores it under `shape` and streams its bytes without materialising it."""
    view.stored_shape = tuple(shape)
    return view


class TensorMap:
    """Maps one source tensor to the output tensors it becomes (the converter streams through this)."""

    def __init__(self, geometry: Geometry):
        self.geometry = geometry

    def __call__(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        name = self.geometry.canonical(name)
        match = _ATTN.match(name)
        if match is None:
            yield name, tensor
            return
        layer, proj, kind = int(match.group(1)), match.group(2), match.group(3)
        yield from self.attention(name, layer, proj, kind, tensor)

    def attention(self, name, layer, proj, kind, tensor) -> Iterator[tuple[str, torch.Tensor]]:  # pragma: no cover
        raise NotImplementedError


class LlamaToV2(TensorMap):
    """Function-preserving: query head i -> (2i, 2i+1) with q_{2i+1} := q_{2i}; W_λ := 0 (λ = 0.5); o_proj x 2.

    O_i = a_{2i} - 0.5 a_{2i+1} = 0.5 llama_head_i, and 2 o_proj (0.5 concat_i llama_head_i) = Llama's attention
    output (o_proj's bias is added once, so it is not doubled). Block 2i attends with kv head 2i // (2n) = i // n,
    the one Llama head i used.
    """

    def attention(self, name, layer, proj, kind, tensor):
        g = self.geometry
        if proj == "q_proj":
            rest = tensor.shape[1:]
            heads = tensor.reshape(g.num_heads, 1, g.head_dim, *rest)  # (H, 1, d, ...)
            # (H, 2, d, ...) view, rows of head i twice: the writer streams it without materialising the copy
            doubled = heads.expand(g.num_heads, 2, g.head_dim, *rest)
            yield name, stored_as(doubled, (2 * g.num_heads * g.head_dim, *rest))
            if kind == "weight":
                # Zero is safe here: dL/dW_λ[h] = -0.25 (dL/dO_h · a_{2h+1}) x is non-zero.
                yield (
                    f"model.layers.{layer}.self_attn.diff_lambda.proj.weight",
                    torch.zeros(g.num_heads, g.hidden_size, dtype=tensor.dtype),
                )
        elif proj == "o_proj" and kind == "weight":
            yield name, tensor * 2  # exact in every float format (power of two)
        else:
            yield name, tensor


class LlamaToV1(TensorMap):
    """Paper layout, reusing every Llama weight (not function-preserving); new λ vectors ~ N(0, lambda_std),
    subln 1.

    `mirrored_lambda` draws only λq1 and λk1 and sets λq2 = λq1, λk2 = λk1, so that with λ_init = 0 the layer's
    λ = exp(λq1·λk1) − exp(λq2·λk2) is exactly 0 yet has a gradient (zeroing q2 and k2 instead would leave them at a
    saddle with none). `output_weights` ({layer: (D, H'·2d)}, fitted by `calibrate.calibrate_v1_start`) replace
    o_proj's weight (the sub-layer norm's own gain stays 1)."""

    def __init__(self, geometry: Geometry, lambda_std: float = 0.1, seed: int = 0, mirrored_lambda: bool = False):
        super().__init__(geometry)
        self.lambda_std = float(lambda_std)
        self.seed = check_seed(seed, "seed", ConversionError)
        self.mirrored_lambda = mirrored_lambda
        self.output_weights: dict[int, torch.Tensor] | None = None
        self.lambda_q2: dict[int, torch.Tensor] | None = None
        self.perm = llama_to_v1_query_permutation(geometry.num_heads, geometry.num_kv_heads)

    def new_parameters(self, layer: int, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        d = self.geometry.head_dim
        # Seeded per layer, so the result does not depend on the order in which shards are streamed.
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + layer)
        prefix = f"model.layers.{layer}.self_attn."
        drawn = {}
        for lam in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
            if lam == "lambda_q2" and self.lambda_q2 is not None:
                values = self.lambda_q2[layer].clone()
            elif self.mirrored_lambda and lam.endswith("2"):
                values = drawn[lam[:-1] + "1"].clone()
            else:
                values = torch.randn(d, generator=generator, dtype=torch.float32) * self.lambda_std
            drawn[lam] = values
            yield prefix + f"diff_lambda.{lam}", values  # fp32 whatever the model dtype (they feed an exp)
        yield prefix + "subln.weight", torch.ones(2 * d, dtype=dtype)

    def output_weight(self, layer: int, o_proj: torch.Tensor) -> torch.Tensor:
        """o_proj's weight (D, H'·2d) as mapped into V1's column order, or the one the calibration fitted."""
        if self.output_weights is None:
            return o_proj
        return self.output_weights[layer].to(o_proj.dtype)

    def attention(self, name, layer, proj, kind, tensor):
        d = self.geometry.head_dim
        if proj == "q_proj":
            yield name, permute_row_blocks(tensor, self.perm, d)
            if kind == "weight":
                yield from self.new_parameters(layer, tensor.dtype)
        elif proj == "o_proj" and kind == "weight":
            yield name, self.output_weight(layer, permute_column_blocks(tensor, self.perm, d))
        else:  # k_proj, v_proj: kv heads (2g, 2g+1) are group g's k1/k2 and v halves, already in place
            yield name, tensor


class LlamaToV1Expanded(LlamaToV1):
    """V1 for any head count: one differential head per Llama head, a second map and half a value added.

    Head h's q1 is Llama query head h and q2 a copy of it; group g's k1 is Llama kv head g and k2 a copy, so A2 = A1
    at step 0 and (A1 − λA2) v = (1 − λ) A1 v for every λ < 1: the sub-layer norm removes the factor, so λ can start
    at the paper's λ_init > 0 (mirrored vectors: exactly λ_init, with gradients) and the layer already subtracts.
    The q2/k2 gradients differ from q1/k1's (−λ times theirs), so the copies separate as training goes. v_g's first
    half is Llama's v_g; the second half is noise of 1/100 of v's scale (the calibrated start then sets its channel 0,
    `value_weights`, see calibrate._steady_second_half), read by o_proj columns that start at zero
    (a zero on both sides would be a saddle with no gradient). o_proj's first-half columns are Llama's.

    Cost per layer against the source: q_proj, k_proj and v_proj grow by H·d·D, H_kv·d·D and H_kv·d·D (+ biases),
    o_proj by D·H·d, plus 6d for λ and subln; attention work doubles (two maps, v twice as wide); the KV cache
    doubles (keys 2 H_kv d, values 2 H_kv d per token)."""

    def __init__(self, geometry: Geometry, lambda_std: float = 0.1, seed: int = 0):
        super().__init__(geometry, lambda_std=lambda_std, seed=seed, mirrored_lambda=True)
        self.perm = None
        self.value_weights: dict[int, torch.Tensor] | None = None  # {layer: v_proj weight} of the calibrated start

    def attention(self, name, layer, proj, kind, tensor):
        g, d = self.geometry, self.geometry.head_dim
        if proj in ("q_proj", "k_proj"):
            heads = g.num_heads if proj == "q_proj" else g.num_kv_heads
            rest = tensor.shape[1:]
            blocks = tensor.reshape(heads, 1, d, *rest)  # (heads, 1, d, ...)
            # (heads, 2, d, ...): block 2h + c = c-th copy of head h; streamed without materialising the copy
            yield name, stored_as(blocks.expand(heads, 2, d, *rest), (2 * heads * d, *rest))
            if proj == "q_proj" and kind == "weight":
                yield from self.new_parameters(layer, tensor.dtype)
        elif proj == "v_proj" and kind == "weight" and self.value_weights:  # calibrate._steady_second_half's
            yield name, self.value_weights[layer].to(tensor.dtype)
        elif proj == "v_proj":
            rest = tensor.shape[1:]
            first = tensor.reshape(g.num_kv_heads, 1, d, *rest)  # (H_kv, 1, d, ...)
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + 500_009 + layer)
            scale = 0.01 * float(tensor.float().std()) if tensor.numel() > 1 else 0.0
            second = torch.randn(first.shape, generator=generator, dtype=torch.float32).mul_(scale).to(tensor.dtype)
            yield name, torch.cat((first, second), dim=1).reshape(2 * g.num_kv_heads * d, *rest)
        elif proj == "o_proj" and kind == "weight":
            columns = tensor.reshape(tensor.shape[0], g.num_heads, 1, d)  # (D, H, 1, d)
            zeros = torch.zeros_like(columns)
            widened = torch.cat((columns, zeros), dim=2).reshape(tensor.shape[0], 2 * g.num_heads * d)
            yield name, self.output_weight(layer, widened)
        else:  # o_proj's bias
            yield name, tensor


class DiffLlamaToV1(TensorMap):
    """Exact import of transformers' DiffLlama into V1 (see `diffllama_query_permutation`)."""

    def __init__(self, geometry: Geometry):
        H, H_kv = geometry.num_heads, geometry.num_kv_heads
        if H_kv % 2 or H % 2:
            raise ConversionError(
                f"this DiffLlama checkpoint has num_attention_heads={H}, "
                f"num_key_value_heads={H_kv}; DiffLlama needs both "
                "even, so the checkpoint is inconsistent: check its config.json."
            )
        super().__init__(geometry)
        self.q_perm = diffllama_query_permutation(geometry.num_heads)
        self.kv_perm = diffllama_kv_permutation(geometry.num_kv_heads)

    def __call__(self, name, tensor):
        match = _DIFFLLAMA_LAMBDA.match(name)
        if match is not None:
            yield f"model.layers.{match.group(1)}.self_attn.diff_lambda.{match.group(2)}", tensor.to(torch.float32)
            return
        yield from super().__call__(name, tensor)

    def attention(self, name, layer, proj, kind, tensor):
        d = self.geometry.head_dim
        if proj == "q_proj":
            yield name, permute_row_blocks(tensor, self.q_perm, d)
            if kind == "weight":  # DiffLlama's RMSNorm over 2d has no weight
                yield f"model.layers.{layer}.self_attn.subln.weight", torch.ones(2 * d, dtype=tensor.dtype)
        elif proj in ("k_proj", "v_proj"):
            yield name, permute_row_blocks(tensor, self.kv_perm, d)
        else:
            yield name, tensor


class MotifToV1(TensorMap):
    """Exact import of Motif (Motif-2.6B's stripe pairs and grouped differential attention) into V1: every tensor
    keeps its rows and columns, since Motif's head layout is V1's (conversion/motif.py derives it: q blocks per
    group [signal..., noise] = `DiffConfig.num_noise_heads`'s layout, [q1 | q2] per head for Motif-2.6B; k and v
    blocks (2g, 2g + 1) = group g's [k1 | k2] and [v1 | v2]; o_proj's input block 2h + c = half c of head h). The
    λ vectors move under `diff_lambda` in fp32; `subln` and PolyNorm's `mlp.act_fn` keep their names."""

    def __call__(self, name, tensor):
        match = _DIFFLLAMA_LAMBDA.match(name)
        if match is not None:
            yield f"model.layers.{match.group(1)}.self_attn.diff_lambda.{match.group(2)}", tensor.to(torch.float32)
            return
        yield name, tensor


# The exact V1 imports of the families differential already, by `Family.tensor_map`.
_EXACT_V1_MAPS = {cls.__name__: cls for cls in (DiffLlamaToV1, MotifToV1)}
V1_LAYOUTS = ("paired", "expanded")


def pairable(geometry: Geometry) -> bool:
    """Whether the paired V1 layout exists: even H and H_kv, and H/2 heads over H_kv/2 groups."""
    H, H_kv = geometry.num_heads, geometry.num_kv_heads
    return not (H % 2 or H_kv % 2 or (H // 2) % (H_kv // 2))


def choose_v1_layout(geometry: Geometry, layout: str | None) -> str:
    """LAYOUT, or where none is asked, paired when the head counts allow it and expanded otherwise."""
    if layout is None:
        return "paired" if pairable(geometry) else "expanded"
    if layout not in V1_LAYOUTS:
        raise ConversionError(f"v1_layout={layout!r} is not one of {', '.join(V1_LAYOUTS)} (--v1-layout).")
    if layout == "paired" and not pairable(geometry):
        H, H_kv = geometry.num_heads, geometry.num_kv_heads
        raise ConversionError(
            f"the paired V1 layout needs even num_attention_heads and num_key_value_heads (got {H} and {H_kv}): "
            "use --v1-layout expanded (one differential head per Llama head, any count), or drop --v1-layout."
        )
    return layout


def make_tensor_map(
    family: Family,
    diff_version: int,
    geometry: Geometry,
    *,
    lambda_std: float = 0.1,
    seed: int = 0,
    mirrored_lambda: bool = False,
    v1_layout: str = "paired",
) -> TensorMap:
    """The map of a `family` checkpoint into `diff_version`: its own exact V1 import (`Family.tensor_map`), or
    Llama's maps."""
    if family.exact_v1:
        if diff_version != 1:
            raise ConversionError(
                f"{family.name} checkpoints import into diff_version=1 only (got diff_version={diff_version}): their "
                "attention is V1's; pass diff_version=1 (or leave it out)."
            )
        return _EXACT_V1_MAPS[family.tensor_map](geometry)
    if diff_version == 2:
        return LlamaToV2(geometry)
    if diff_version == 1:
        if choose_v1_layout(geometry, v1_layout) == "expanded":
            return LlamaToV1Expanded(geometry, lambda_std=lambda_std, seed=seed)
        return LlamaToV1(geometry, lambda_std=lambda_std, seed=seed, mirrored_lambda=mirrored_lambda)
    raise ConversionError(
        f"diff_version={diff_version!r} is not supported: use 2 (function-preserving, default) or 1 (paper layout)."
    )


__all__ = [
    "Geometry",
    "IGNORED_SOURCE_TENSORS",
    "DiffLlamaToV1",
    "LlamaToV1",
    "LlamaToV1Expanded",
    "LlamaToV2",
    "MotifToV1",
    "V1_LAYOUTS",
    "choose_v1_layout",
    "TensorMap",
    "diffllama_kv_permutation",
    "diffllama_query_permutation",
    "llama_to_v1_query_permutation",
    "make_tensor_map",
    "permute_column_blocks",
    "pairable",
    "permute_row_blocks",
]
