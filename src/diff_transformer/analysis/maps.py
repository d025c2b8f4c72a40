"""Attention maps of Diff (V1, V2), transformers' DiffLlama and Llama models, and metrics on them.

`attention_maps(model, input_ids)` returns one `LayerMaps` per layer: the two softmax maps of every differential head
(`first`, `second`), λ and the differential map `first - λ second` (what eager `output_attentions=True` returns for a
Diff model). The maps are recomputed from what each attention module receives during one ordinary forward (forward
pre-hooks capture its `hidden_states` and `position_embeddings`; the module's own `q_proj`/`k_proj`/`q_norm`/`k_norm`
and λ module are then applied), so the forward itself, its backend (sdpa, flash, the fused kernel...) and its outputs
are untouched, and the same code reads saved, converted and Hub custom-code models: modules are found by attribute
names and `config.model_type`, never by class.

Which maps are paired (docs/design.md has the layouts):

* Diff V1 (`model_type="diff"`, `diff_version=1`): q_proj is laid out per head as [q1 | q2] (d each), k_proj per
  key head as [k1 | k2]: `first` = softmax(q1 k1ᵀ/√d), `second` = softmax(q2 k2ᵀ/√d); λ is one scalar per layer.
  With grouped differential attention (`num_noise_heads`, Motif-2-12.7B) the H signal heads of one noise group share
  one noise query: `second` holds that noise map once per signal head, so heads h and h' of the same group
  (h // r = h' // r, r = H / num_noise_heads) have equal `second` maps.
* Diff V2 (`diff_version=2`): 2H query heads over Llama's K; head h pairs query heads (2h, 2h+1); λ = sigmoid(W x),
  one value per token and head, shaped (B, H, N).
* DiffLlama (`model_type="diffllama"`): H query heads; the first H/2 are A1, the last H/2 are A2 (transformers chunks
  its output along the head axis); λ = exp(λq1·λk1) - exp(λq2·λk2) + λ_init per layer.
* Llama (`model_type="llama"`): `first` is its softmax map, `second` and `lam` are None and `differential` is `first`.

Every `LayerMaps` also holds `logits`, the scaled q·kᵀ before softmax of every query (sub-)head: the paper's
"attention logits", whose outliers it compares (Table 5).

Metrics (per layer and head; the paper, §3.4 Table 3, does not publish its aggregation, so these are ours):

* `span_mass(maps, span, queries)`: "attention to answer": the weights of the chosen query rows on the key positions
  in `span`, summed over the span, divided by the row's total absolute weight Σ_l |w_nl| over its unmasked keys, and
  averaged over the chosen query rows and the batch. A softmax row has Σ|w| = 1, so this is the plain attention mass;
  the differential row sums to 1 - λ (and may have negative weights), so the division makes it a fraction comparable
  with Llama's. Signed: negative weights on the span lower it.
* `noise_mass(maps, span, queries)`: "attention noise": Σ |w_nl| over the unmasked keys outside `span`, with the same
  division and averaging: for a softmax map `span_mass + noise_mass = 1`.
* `entropy(maps)`: Shannon entropy (nats) of each unmasked row, averaged over valid query rows. A softmax map is used
  as is; for the differential map the entropy is that of |w| / Σ|w| (the distribution of absolute weight), since its
  signed weights are no distribution.
* `negative_fraction(maps)`: the fraction of unmasked (query, key) entries with a weight < 0 (0 for a softmax map).
* `lambda_per_layer(entries)`: (layers, H): V1/DiffLlama's scalar repeated over heads; V2's λ averaged over the batch
  and valid query tokens; NaN for Llama.

Query rows that see no key (left-padding positions) are all-zero and left out of every average.
"""

from dataclasses import dataclass

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from ..modeling_diff import gda_pairs, v1_component_major, v1_lambda


SUPPORTED_MODEL_TYPES = ("diff", "diffllama", "llama")
# What each kind of model (`model_kind`) is called in titles.
KIND_NAMES = {"diff-v1": "Diff V1", "diff-v2": "Diff V2", "diffllama": "DiffLlama", "llama": "Llama"}


@dataclass
class LayerMaps:
    """One layer's attention maps, as `attention_maps` returns them (H differential heads, N queries, L keys).

    Attributes:
        first: `(B, H, N, L)` fp32, A1 (V1: `softmax(q1 k1ᵀ/√d)`; V2: query head 2h; Llama: the head's map).
        second: `(B, H, N, L)` fp32, A2 (V1: `softmax(q2 k2ᵀ/√d)`; V2: query head 2h+1); None for Llama.
        lam: λ, 0-d (V1, DiffLlama) or `(B, H, N)` (V2); None for Llama.
        differential: `(B, H, N, L)` fp32, `first - lam * second` (`first` for Llama).
        mask: `(B, N, L)` bool, True where query n may attend key l.
        kind: `"diff-v1"`, `"diff-v2"`, `"diffllama"` or `"llama"`.
        logits: `(B, Hq, N, L)` fp32, the scaled `q·kᵀ` of every query (sub-)head before softmax, -inf where masked
            (the paper's "attention logits", Table 5); None where not computed.

    For a layer outside `iter_attention_maps`' `maps_for`, `first`, `second` and `differential` are None (only λ).
    """

    first: torch.Tensor
    second: torch.Tensor | None
    lam: torch.Tensor | None
    differential: torch.Tensor
    mask: torch.Tensor
    kind: str  # "diff-v1", "diff-v2", "diffllama" or "llama"
    # (B, Hq, N, L) fp32: the scaled q·kᵀ of every query (sub-)head before softmax, -inf where masked; the paper's
    # "attention logits" (Table 5). Heads in the order of `first` then `second` (V1, DiffLlama), or the model's
    # query-head order (V2: pairs (2h, 2h+1); Llama).
    logits: torch.Tensor | None = None


def model_kind(model) -> str:
    """Which maps `model` has: `"diff-v1"`, `"diff-v2"`, `"diffllama"` or `"llama"`.

    Raises:
        ValueError: any other `model_type`.
    """
    config = model.config
    model_type = getattr(config, "model_type", None)
    if model_type == "diff":
        return f"diff-v{config.diff_version}"
    if model_type in ("diffllama", "llama"):
        return model_type
    raise ValueError(
        f"attention maps are read from Diff, DiffLlama and Llama models, not model_type={model_type!r}: convert it "
        "first (`diff-transformer convert`)."
    )


def heads_per_layer(kind: str, config) -> int:
    """The heads a layer's maps are read for: the differential heads (DiffLlama pairs head h with h + H/2)."""
    return config.num_attention_heads // (2 if kind == "diffllama" else 1)


def _layers(model):
    """The decoder layers of a causal LM, a base model or a PEFT-wrapped one."""
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    base = getattr(model, getattr(model, "base_model_prefix", "model"), model)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no decoder layers at `.{model.base_model_prefix}.layers`.")
    return list(layers)


def _allowed(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """(B, N, L) bool: causal, and the key is not padding (no cache, so L = N)."""
    B, N = input_ids.shape
    causal = torch.ones(N, N, dtype=torch.bool, device=input_ids.device).tril()  # (N, L)
    keys = torch.ones(B, N, dtype=torch.bool, device=input_ids.device)  # (B, L)
    if attention_mask is not None:
        keys = attention_mask.bool()
    return causal.unsqueeze(0) & keys.unsqueeze(1)  # (B, N, L)


def _scores(module, query: torch.Tensor, key: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """q kᵀ · scaling, fp32, -inf where not allowed; query (B, Hq, N, d), key (B, Hk, L, d) -> (B, Hq, N, L)."""
    key = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)  # (B, Hq, L, d): GQA, as repeat_kv
    scores = torch.matmul(query.float(), key.float().transpose(2, 3)) * module.scaling  # (B, Hq, N, L)
    return scores.masked_fill(~allowed.unsqueeze(1), float("-inf"))


def _softmax(scores: torch.Tensor) -> torch.Tensor:
    return torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows with no allowed key: all zero


def _project(module, hidden_states):
    """The module's q and k after its norms, (B, N, Hq, d) and (B, N, Hk, d) before rotary."""
    B, N, _ = hidden_states.shape
    d = module.head_dim
    q_norm = getattr(module, "q_norm", None) or (lambda x: x)
    k_norm = getattr(module, "k_norm", None) or (lambda x: x)
    query = q_norm(module.q_proj(hidden_states).view(B, N, -1, d))  # (B, N, Hq, d)
    key = k_norm(module.k_proj(hidden_states).view(B, N, -1, d))  # (B, N, Hk, d)
    return query, key


def _layer_maps(kind: str, module, hidden_states, position_embeddings, allowed) -> LayerMaps:
    B, N, _ = hidden_states.shape
    d = module.head_dim
    cos, sin = position_embeddings
    query, key = _project(module, hidden_states)  # (B, N, Hq, d), (B, N, Hk, d)
    if kind == "diff-v1":
        H_kv, noise_heads = key.shape[2] // 2, getattr(module, "num_noise_heads", None)
        if noise_heads is None:
            H = query.shape[2] // 2
            query = v1_component_major(query.view(B, N, H, 2, d))  # (B, 2H, N, d): [q1 | q2]
        else:  # GDA: per noise group, r signal queries then the noise query; q2 of each signal head is its group's
            groups = query.view(B, N, -1, module.num_heads // noise_heads + 1, d)  # (B, N, n, r + 1, d)
            query = v1_component_major(gda_pairs(groups))  # (B, 2H, N, d)
            H = query.shape[1] // 2
        key = v1_component_major(key.view(B, N, H_kv, 2, d))  # (B, 2H_kv, N, d): [k1 | k2]
        query, key = apply_rotary_pos_emb(query, key, cos, sin)
        queries, keys = query.view(B, 2, H, N, d), key.view(B, 2, H_kv, N, d)  # (B, 2, H, N, d): [q1 | q2]
        logits = torch.cat([_scores(module, queries[:, i], keys[:, i], allowed) for i in (0, 1)], 1)  # (B, 2H, N, L)
        first, second = _softmax(logits).chunk(2, dim=1)  # (B, H, N, L) each
        lam = _layer_lambda(kind, module, hidden_states)  # ()
        differential = first - lam * second
    else:
        query, key = apply_rotary_pos_emb(query.transpose(1, 2), key.transpose(1, 2), cos, sin)  # (B, Hq/Hk, N, d)
        logits = _scores(module, query, key, allowed)  # (B, Hq, N, L)
        maps = _softmax(logits)
        if kind == "llama":
            return LayerMaps(maps, None, None, maps, allowed, kind, logits)
        if kind == "diff-v2":
            pairs = maps.view(B, -1, 2, N, maps.shape[-1])  # (B, H, 2, N, L): query heads (2h, 2h+1)
            first, second = pairs[:, :, 0], pairs[:, :, 1]
            lam = _layer_lambda(kind, module, hidden_states)  # (B, H, N)
            differential = first - lam.unsqueeze(-1) * second
        else:  # diffllama: the first half of the query heads against the second half
            first, second = maps.chunk(2, dim=1)  # (B, H/2, N, L) each
            lam = _layer_lambda(kind, module, hidden_states)  # ()
            differential = first - lam * second
    return LayerMaps(first, second, lam, differential, allowed, kind, logits)


@torch.no_grad()
def attention_maps(
    model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, layers: list[int] | None = None
) -> list[LayerMaps]:
    """The two softmax maps, λ and the differential map of every head, per decoder layer, for a prompt.

    The model runs one ordinary forward (its backend unchanged, no cache); hooks only read each attention module's
    inputs, and are removed afterwards; the maps are recomputed from them. Diff (V1, V2), transformers' DiffLlama
    and Llama models give the same entries, so the three compare directly. Each layer holds three fp32
    `(B, H, N, N)` maps, so for long prompts on large models pick the `layers` you need, or use `iter_attention_maps`.
    λ at left-padding positions is what the model computed there.

    Args:
        model: a Diff, DiffLlama or Llama causal LM or base model (native or `trust_remote_code`).
        input_ids: `(B, N)` token ids.
        attention_mask: `(B, N)`, 1 for tokens and 0 for padding; None attends everywhere (causally).
        layers: indices of the layers to return (negative counts from the end); None for all.

    Returns:
        One `LayerMaps` per chosen layer, in layer order.

    Raises:
        ValueError: `input_ids` is not 2-D, a layer index is out of range, or the model is not a Diff, DiffLlama or
            Llama model.

    Example:
        ```python
        entries = attention_maps(model, input_ids)
        entries[0].differential.shape  # (B, H, N, N)
        ```
    """
    return list(iter_attention_maps(model, input_ids, attention_mask, layers))


@torch.no_grad()
def iter_attention_maps(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    layers: list[int] | None = None,
    maps_for: set[int] | None = None,
):
    """`attention_maps`, one layer at a time (its maps are computed when it is reached: memory holds one layer's
    maps, not every layer's). Layers outside `maps_for` (None: all) yield only λ: their `first`, `second` and
    `differential` are None (λ per layer costs no N x N map)."""
    kind = model_kind(model)
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (batch, length), got shape {tuple(input_ids.shape)}.")
    captured, handles = {}, []

    def capture(index):
        def hook(module, args, kwargs):
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            position_embeddings = kwargs["position_embeddings"] if "position_embeddings" in kwargs else args[1]
            captured[index] = (module, hidden, position_embeddings)

        return hook

    all_layers = _layers(model)
    chosen = range(len(all_layers)) if layers is None else layers
    for index in chosen:
        if not -len(all_layers) <= index < len(all_layers):
            raise ValueError(f"layer {index} is out of range: the model has layers 0 to {len(all_layers) - 1}.")
    for index, layer in enumerate(all_layers):
        if index not in chosen and index - len(all_layers) not in chosen:
            continue
        handles.append(layer.self_attn.register_forward_pre_hook(capture(index), with_kwargs=True))
    try:
        model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    allowed = _allowed(input_ids, attention_mask)
    for i in sorted(captured):
        module, hidden, position_embeddings = captured.pop(i)
        if maps_for is None or i in maps_for:
            yield _layer_maps(kind, module, hidden, position_embeddings, allowed)
        else:
            yield LayerMaps(None, None, _layer_lambda(kind, module, hidden), None, allowed, kind)


def _layer_lambda(kind: str, module, hidden_states) -> torch.Tensor | None:
    """λ of one layer as `_layer_maps` computes it: 0-d (V1, DiffLlama), (B, H, N) (V2), None (Llama)."""
    if kind == "diff-v1":
        return module.diff_lambda().detach().float()
    if kind == "diff-v2":
        return module.diff_lambda(hidden_states).detach().float().transpose(1, 2)
    if kind == "diffllama":
        lam = v1_lambda(module.lambda_q1, module.lambda_k1, module.lambda_q2, module.lambda_k2, module.lambda_init)
        return lam.detach()  # DiffLlama's λ is the paper's, as V1's
    return None


# ---- Metrics: each takes one map (B, H, N, L) and its mask (B, N, L) and returns (H,) ----


def _rows(mask: torch.Tensor, queries) -> torch.Tensor:
    """(B, N) bool: the chosen query rows (an int, a slice, a list of positions, or None = all) that see a key."""
    chosen = torch.zeros(mask.shape[:2], dtype=torch.bool, device=mask.device)
    chosen[:, slice(None) if queries is None else queries] = True
    return chosen & mask.any(-1)


def _row_average(values: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """values (B, H, N) averaged over the chosen rows -> (H,)."""
    weights = rows.unsqueeze(1).float()  # (B, 1, N)
    return (values * weights).sum((0, 2)) / weights.sum((0, 2)).clamp_min(1)


def _span_keys(mask: torch.Tensor, span: tuple[int, int]) -> torch.Tensor:
    start, stop = span
    keys = torch.zeros(mask.shape[-1], dtype=torch.bool, device=mask.device)
    keys[start:stop] = True
    return keys  # (L,)


def span_mass(weights: torch.Tensor, mask: torch.Tensor, span: tuple[int, int], queries=-1) -> torch.Tensor:
    """ "Attention to answer": `Σ_{l in span} w_nl / Σ_l |w_nl|`, averaged over the `queries` rows and the batch.

    Args:
        weights: one map, `(B, H, N, L)`.
        mask: `(B, N, L)` bool, True where query n may attend key l.
        span: `(start, stop)` key positions of the answer, stop exclusive.
        queries: the query rows: an int, a slice, a list of positions, or None for all (default: the last).

    Returns:
        `(H,)`.
    """
    keys = _span_keys(mask, span)
    w = weights * mask.unsqueeze(1)  # (B, H, N, L)
    mass = (w * keys).sum(-1) / w.abs().sum(-1).clamp_min(1e-30)  # (B, H, N)
    return _row_average(mass, _rows(mask, queries))


def noise_mass(weights: torch.Tensor, mask: torch.Tensor, span: tuple[int, int], queries=-1) -> torch.Tensor:
    """ "Attention noise": `Σ_{l unmasked, not in span} |w_nl| / Σ_l |w_nl|`, averaged as in `span_mass`.

    Args:
        weights: one map, `(B, H, N, L)`.
        mask: `(B, N, L)` bool.
        span: `(start, stop)` key positions of the answer, stop exclusive.
        queries: the query rows, as in `span_mass` (default: the last).

    Returns:
        `(H,)`.
    """
    keys = _span_keys(mask, span)
    w = (weights * mask.unsqueeze(1)).abs()  # (B, H, N, L)
    mass = (w * ~keys).sum(-1) / w.sum(-1).clamp_min(1e-30)  # (B, H, N)
    return _row_average(mass, _rows(mask, queries))


def entropy(weights: torch.Tensor, mask: torch.Tensor, queries=None) -> torch.Tensor:
    """Entropy (nats) of each row's `|w| / Σ|w|` over its unmasked keys, averaged over the rows.

    Args:
        weights: one map, `(B, H, N, L)` (signed maps are made a distribution through `|w|`).
        mask: `(B, N, L)` bool.
        queries: the query rows, as in `span_mass` (default: all).

    Returns:
        `(H,)`.
    """
    w = (weights * mask.unsqueeze(1)).abs()  # (B, H, N, L)
    p = w / w.sum(-1, keepdim=True).clamp_min(1e-30)
    ent = -(p * p.clamp_min(1e-30).log()).sum(-1)  # (B, H, N)
    return _row_average(ent, _rows(mask, queries))


def negative_fraction(weights: torch.Tensor, mask: torch.Tensor, queries=None) -> torch.Tensor:
    """Fraction of the unmasked (query, key) entries with a negative weight, over the chosen rows.

    Args:
        weights: one map, `(B, H, N, L)`.
        mask: `(B, N, L)` bool.
        queries: the query rows, as in `span_mass` (default: all).

    Returns:
        `(H,)`.
    """
    allowed = (mask & _rows(mask, queries).unsqueeze(-1)).unsqueeze(1)  # (B, 1, N, L)
    negative = ((weights < 0) & allowed).float().sum((0, 2, 3))
    return negative / allowed.float().sum((0, 2, 3)).clamp_min(1)


def lambda_per_layer(entries: list[LayerMaps]) -> torch.Tensor:
    """Each layer's λ per head (V2: averaged over the batch and the valid tokens).

    Args:
        entries: `attention_maps`'s result.

    Returns:
        `(layers, H)`; NaN for Llama.
    """
    rows = []
    for entry in entries:
        H = entry.first.shape[1]
        if entry.lam is None:
            rows.append(torch.full((H,), float("nan")))
        elif entry.lam.dim() == 0:
            rows.append(entry.lam.expand(H).cpu())
        else:
            rows.append(_row_average(entry.lam, entry.mask.any(-1)).cpu())
    return torch.stack(rows)


def layer_metrics(entries: list[LayerMaps], span: tuple[int, int] | None = None, queries=-1, which="differential"):
    """Every metric of every layer and head, from one of the maps.

    Args:
        entries: `attention_maps`'s result.
        span: `(start, stop)` key positions of the answer; adds `answer` (`span_mass`) and `noise` (`noise_mass`).
        queries: the query rows of `answer` and `noise` (default: the last position).
        which: the map the metrics read: `"first"`, `"second"` or `"differential"`.

    Returns:
        A dict of `(layers, H)` tensors: `entropy`, `negative_fraction`, `lambda`, and with a span `answer` and
        `noise`.

    Raises:
        ValueError: `which="second"` on a Llama.
    """

    def per_layer(metric, *args, **kwargs):
        return torch.stack([metric(getattr(e, which), e.mask, *args, **kwargs).cpu() for e in entries])

    if which == "second" and entries[0].second is None:
        raise ValueError("a Llama layer has one softmax map: use which='first' or 'differential'.")
    metrics = {
        "entropy": per_layer(entropy),
        "negative_fraction": per_layer(negative_fraction),
        "lambda": lambda_per_layer(entries),
    }
    if span is not None:
        metrics["answer"] = per_layer(span_mass, span, queries)
        metrics["noise"] = per_layer(noise_mass, span, queries)
    return metrics


def maps_and_metrics(model, ids, layer: int, span, need_metrics: bool):
    """`inspect`'s maps: (entries for head_figure: the plotted layer's maps, every layer's λ; the (layers, heads)
    metrics or None), one layer's maps in memory at a time; without metrics only the plotted layer's maps are
    computed."""
    from dataclasses import replace

    entries, rows = [], []
    for index, entry in enumerate(iter_attention_maps(model, ids, maps_for=None if need_metrics else {layer})):
        if need_metrics:
            rows.append(layer_metrics([entry], span=span))  # (1, heads) each; answer/noise at the last position
        entries.append(entry if index == layer else replace(entry, first=None, second=None, differential=None))
    if not need_metrics:
        return entries, None
    return entries, {key: torch.cat([row[key] for row in rows]) for key in rows[0]}


def maps_bytes(config, kind: str, tokens: int, all_layers: bool) -> int:
    """The memory `maps_and_metrics` needs for TOKENS tokens, about. Each layer's maps are (query heads, N, N) fp32,
    several at once (two softmaxes, their difference, the metrics' temporaries): about 10 of them for the layer being
    measured plus the plotted layer's 3 when metrics run over every layer (ALL_LAYERS: inspect --grid/--json), 6 for
    the plotted layer alone."""
    query_heads = config.num_attention_heads * (2 if kind in ("diff-v1", "diff-v2") else 1)
    return (13 if all_layers else 6) * query_heads * tokens * tokens * 4


def head_record(entry: LayerMaps, head: int, metrics: dict) -> dict:
    """One head's maps and λ from ENTRY and every (layers, heads) metric as plain lists for JSON (`inspect --json`),
    NaN (Llama's λ) as null."""

    def plain(tensor):
        return None if tensor is None else [[None if v != v else v for v in row] for row in tensor.tolist()]

    return {
        "first": plain(entry.first[0, head]),
        "second": plain(None if entry.second is None else entry.second[0, head]),
        "differential": plain(entry.differential[0, head]),
        "lambda": None if entry.lam is None else (entry.lam if entry.lam.dim() == 0 else entry.lam[0, head]).tolist(),
        "metrics": {key: plain(value) for key, value in metrics.items()},  # (layers, heads) each
    }


def lambda_summary(entries, kind: str) -> str | None:
    """λ per layer of ENTRIES (`maps_and_metrics`) and how many layers have λ < 0 (they add their second map instead
    of subtracting it), as `inspect` prints it; None for a model without λ."""
    lambdas = [float(entry.lam.float().mean()) for entry in entries if entry.lam is not None]
    if not lambdas:
        return None
    each = "mean over tokens and heads" if kind == "diff-v2" else "one per layer"
    negative = sum(value < 0 for value in lambdas)
    return (
        f"λ per layer ({each}): {', '.join(f'{value:+.3f}' for value in lambdas)}; {negative} of "
        f"{len(lambdas)} layers have λ < 0 (they add their second map instead of subtracting it)"
    )


__all__ = [
    "KIND_NAMES",
    "LayerMaps",
    "attention_maps",
    "entropy",
    "heads_per_layer",
    "iter_attention_maps",
    "lambda_per_layer",
    "layer_metrics",
    "model_kind",
    "negative_fraction",
    "noise_mass",
    "span_mass",
]
