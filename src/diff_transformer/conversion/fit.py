"""The least-squares fit of a calibrated Llama -> Diff V1 start, layer by layer (`calibrate_v1_start`; what it is
fitted on, and how the converter records it: calibrate.py; why: docs/design.md, "Starting V1 close to its source").

* o_proj is refitted by least squares (`least_squares_projection`, a small ridge towards 0) so that o_proj(y / rms(y) ·
  (1 − λ_init)) ≈ the source's attention output o_proj_src(t), over the calibration tokens, where y is the V1 heads'
  pre-norm output (A1 − λA2)[v1 | v2] and t what the source's heads computed from the same layer input: the pair
  [A1 v1 | A2 v2] (paired layout), or A1 v1 on the first half (expanded layout, whose second-half columns stay zero;
  the value half they read first gets a steady channel, `_steady_second_half`, which makes y / rms(y) nearly linear
  in the source head's output, so the fit holds off the calibration's domain). The sub-layer norm's weight stays 1:
  a shared gain cannot match heads whose outputs differ in scale, a projection over every head's channels can, and it
  also undoes what the normalisation mixes across a head's channels on average.
* With a `lambda_grid`, each layer's λ is chosen from it, the value whose fitted projection leaves the least residual
  (`LayerFit.best`), and set by moving λq2 along λk2 (`_set_lambda`), still trainable.
* The plan's held-out blocks are never fitted on: the same pass runs them through the source's layers and the
  calibrated V1 layers, and the mean next-token losses of both (the source's final norm and LM head) give the step-0
  perplexity ratio the converter prints and records.

Layers are fitted in order: layer l is fitted on the hidden states that the already calibrated layers 0..l-1 of the
V1 model produce, so each fit corrects what reaches it. Only one decoder layer is in memory at a time (its source
tensors mapped by the same `TensorMap` that writes the checkpoint), plus the hidden states of the calibration blocks
(blocks x block_size x hidden_size floats), once, the embedding matrix to look the tokens up (and, for the held-out
score, the final norm and LM head), and the fitted o_proj (and, expanded, v_proj) of the layers done, kept on the CPU
in the dtype they are written in.

`device`: where the fits run, "cpu" by default. Each layer is read on the CPU, moved there, fitted, and its fitted
weights brought back to the CPU; on the CPU nothing moves, so the output is the same byte for byte whether or not
`device="cpu"` is passed. On a GPU the rounding of every sum differs, so the start is an equally good one, not the
same bytes.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..progress import Progress
from .errors import ConversionError, one_line
from .layout import IGNORED_SOURCE_TENSORS, Geometry, TensorMap
from .source import is_causal_lm


if TYPE_CHECKING:
    from .calibrate import CalibrationPlan

RIDGE = 1e-4
MICRO_BATCH = 4  # calibration blocks per forward pass: bounds the activations one fit holds


def least_squares_projection(features: torch.Tensor, target: torch.Tensor, ridge: float = RIDGE) -> torch.Tensor:
    """argmin_W ‖features Wᵀ − target‖² + ρ‖W‖² (rows: tokens), ρ = RIDGE × the mean squared feature, in float64:
    the output projection (target width × feature width) that best maps the normalised heads onto the source's
    attention output. The ridge keeps features that never vary (or repeat another) from blowing W up."""
    features, target = features.double(), target.double()
    gram = features.T @ features
    rho = ridge * float(gram.diagonal().mean()) + 1e-12
    identity = torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device)
    return torch.linalg.solve(gram + rho * identity, features.T @ target).T


class _SourceReader:
    """Reads source tensors by name from their shards (one handle per shard, opened on first use)."""

    def __init__(self, source, stack: contextlib.ExitStack):
        from safetensors import safe_open

        self.source, self.stack, self.safe_open, self.handles = source, stack, safe_open, {}

    def get(self, name: str) -> torch.Tensor:
        shard = self.source.tensors[name].shard
        if shard not in self.handles:
            try:
                self.handles[shard] = self.stack.enter_context(self.safe_open(shard, framework="pt"))
            except Exception as exc:
                raise ConversionError(f"shard {shard.name} is corrupt or truncated ({one_line(exc)}).") from exc
        try:
            return self.handles[shard].get_tensor(name)
        except Exception as exc:
            raise ConversionError(f"reading tensor {name} from shard {shard.name} failed ({one_line(exc)}).") from exc


@dataclass(frozen=True)
class CalibratedStart:
    """What `calibrate_v1_start` fitted: {layer: o_proj weight (D, H'·2d)}, the relative residual of the attention
    output ‖o_proj(ŷ) − o_proj_src(t)‖² / ‖o_proj_src(t)‖² per layer and, when λ was fitted too, {layer: λ} and
    {layer: the λq2 vector that gives it}."""

    output_weights: dict[int, torch.Tensor]
    residuals: list[float]
    lambdas: dict[int, float]
    lambda_q2: dict[int, torch.Tensor]
    heldout_loss: dict | None = None  # {"source", "converted": mean loss, "tokens"} on the plan's held-out blocks
    value_weights: dict | None = None  # expanded, `steady_value`: {layer: v_proj weight (2 H_kv d, D)}


@dataclass
class LayerFit:
    """One layer's o_proj fit (`calibrate_v1_start`): the maps' outputs OUT1 and OUT2 ((tokens x heads, 2d): A1 [v1|v2]
    and A2 [v1|v2]), what the source computed (SOURCE_OUTPUT, (tokens, D), through SOURCE_O_PROJ), subln's epsilon,
    the layer's output scale 1 - λ_init, and the channels of each head that are fitted (FITTED: d or 2d)."""

    out1: torch.Tensor
    out2: torch.Tensor
    source_output: torch.Tensor
    source_o_proj: torch.Tensor
    epsilon: float
    scale: float
    fitted: int

    @property
    def heads(self) -> int:
        return self.source_o_proj.shape[1] // self.fitted

    def features(self, lam: float) -> torch.Tensor:
        """(tokens, heads x fitted): the fitted channels of the normalised heads at λ = LAM, times the output scale."""
        d, heads, fitted = self.out1.shape[-1] // 2, self.heads, self.fitted
        pre_norm = self.out1 - lam * self.out2
        normed = pre_norm * pre_norm.square().mean(-1, keepdim=True).add(self.epsilon).rsqrt()
        return self.scale * normed.reshape(-1, heads, 2 * d)[..., :fitted].reshape(-1, heads * fitted)

    def best(self, candidates) -> tuple[float, float, torch.Tensor]:
        """(residual, λ, o_proj) of the λ in CANDIDATES whose least-squares fit leaves the smallest residual."""
        best = None
        for lam in candidates:
            features = self.features(lam)
            o_proj = least_squares_projection(features, self.source_output)
            error = features.double() @ o_proj.T - self.source_output
            residual = float(error.square().sum() / self.source_output.square().sum())
            if best is None or residual < best[0]:
                best = (residual, lam, o_proj)
        return best


@torch.no_grad()
def calibrate_v1_start(
    source,
    config,
    geometry: Geometry,
    tensor_map: TensorMap,
    plan: CalibrationPlan,
    lambda_grid: tuple[float, ...] | None = None,
    steady_value: float = 0.0,
    device: str = "cpu",
    progress: bool = False,
) -> CalibratedStart:
    """Least-squares output projections of every layer, fitted in layer order on PLAN's blocks (see the module
    docstring). With `lambda_grid`, each layer's λ is also chosen from it, the one whose fit leaves the smallest
    residual, and set through λq2 (still trainable). Expanded layout with `steady_value` > 0: the steady second value
    half at that multiple of the first half's norm (`_steady_second_half`). `device`: where each layer is fitted (the
    module docstring); what is returned is on the CPU, o_proj and v_proj in the dtype SRC stores them in (what the
    writer writes). `progress`: layers fitted so far (`progress.Progress`)."""
    from ..modeling_diff import DiffDecoderLayer, DiffRotaryEmbedding
    from .layout import LlamaToV1Expanded

    expanded = isinstance(tensor_map, LlamaToV1Expanded)
    config = type(config).from_dict(config.to_dict())
    config._attn_implementation = "sdpa"  # causal without a mask; never the eager path that needs one
    prefix = geometry.prefix
    layer_names: dict[int, list[str]] = {}
    for name in source.tensors:
        canonical = geometry.canonical(name)
        if canonical.startswith("model.layers.") and not IGNORED_SOURCE_TENSORS.match(name):
            layer_names.setdefault(int(canonical.split(".")[2]), []).append(name)
    d = geometry.head_dim
    device = torch.device(device)
    with contextlib.ExitStack() as stack:
        report = stack.enter_context(
            Progress("calibrating V1", total=geometry.num_layers, unit="layer", enabled=progress)
        )
        reader = _SourceReader(source, stack)
        embedding = reader.get(prefix + "embed_tokens.weight")
        hidden = embedding[plan.blocks].float().to(device)  # (B, L, D)
        rotary = DiffRotaryEmbedding(config).to(device)
        scored = plan.heldout_blocks is not None and plan.heldout_blocks.numel() > 0
        length = max(plan.blocks.shape[1], plan.heldout_blocks.shape[1] if scored else 0)
        cos, sin = rotary(hidden[:1], torch.arange(length, device=device)[None])  # (1, length, d)
        position_embeddings = (cos[:, : plan.blocks.shape[1]], sin[:, : plan.blocks.shape[1]])
        if scored:  # the held-out blocks, through the source's layers and through the calibrated V1 layers
            eval_positions = (cos[:, : plan.heldout_blocks.shape[1]], sin[:, : plan.heldout_blocks.shape[1]])
            eval_v1 = embedding[plan.heldout_blocks].float().to(device)  # (B', L', D)
            eval_source = eval_v1.clone()
        del embedding
        weights, residuals, lambdas, q2, values = {}, [], {}, {}, {}
        for layer_idx in range(geometry.num_layers):
            names = layer_names[layer_idx]
            layer = _load_layer(DiffDecoderLayer, config, layer_idx, names, reader, tensor_map).to(device)
            attn = layer.self_attn
            scale = 1.0 - float(config.lambda_init_for_layer(layer_idx))
            if expanded and steady_value:
                value = _steady_second_half(attn, layer.input_layernorm(hidden), steady_value)
                values[layer_idx] = value.to(_stored_dtype(source, names, "v_proj.weight")).cpu()
            maps = [
                _map_outputs(attn, layer.input_layernorm(chunk), position_embeddings)
                for chunk in hidden.split(MICRO_BATCH)
            ]
            out1 = torch.cat([m[0] for m in maps])  # (tokens x heads, 2d): A1 [v1|v2]
            out2 = torch.cat([m[1] for m in maps])  # A2 [v1|v2]
            del maps
            # what the source computed: the pair [A1 v1 | A2 v2], or (expanded) its one head A1 v1 = the first half
            fitted = d if expanded else 2 * d
            target = out1[:, :d] if expanded else torch.cat((out1[:, :d], out2[:, d:]), dim=-1)
            candidates = _reachable(attn.diff_lambda, lambda_grid) if lambda_grid else (float(attn.diff_lambda()),)
            heads = attn.num_heads
            # o_proj's input columns that read the fitted channels (head h's channel j is column 2d·h + j)
            columns = torch.arange(heads * 2 * d, device=device).reshape(heads, 2 * d)[:, :fitted].reshape(-1)
            source_o_proj = attn.o_proj.weight.detach().double()[:, columns]  # (D, H·fitted): the source's, reordered
            # the source's attention output (before o_proj's bias): rows are tokens, the heads last but one
            source_output = target.reshape(-1, heads * fitted).double() @ source_o_proj.T  # (tokens, D)
            fit = LayerFit(out1, out2, source_output, source_o_proj, attn.subln.variance_epsilon, scale, fitted)
            residual, lam, o_proj = fit.best(candidates)
            del out1, out2, target, source_output, fit
            if scored:
                eval_source = _source_layer_output(layer, eval_source, eval_positions, source_o_proj, fitted)
            weight = attn.o_proj.weight.detach().clone()
            weight[:, columns] = o_proj.to(weight.dtype)  # the others (expanded: the second half's) stay as mapped
            # the dtype the tensor map writes it in (`output_weight` casts to it): the same single rounding, less kept
            weights[layer_idx] = weight.to(_stored_dtype(source, names, "o_proj.weight")).cpu()
            residuals.append(round(residual, 4))
            attn.o_proj.weight.copy_(weight)
            if lambda_grid:
                lambdas[layer_idx] = round(lam, 4)
                q2[layer_idx] = _set_lambda(attn.diff_lambda, lam).cpu()
            chunks = hidden.split(MICRO_BATCH)
            hidden = torch.cat([_layer_output(layer, chunk, position_embeddings) for chunk in chunks])
            if scored:
                eval_v1 = _layer_output(layer, eval_v1, eval_positions)
            del layer
            report.update(1)
        report.detail = "scoring the held-out blocks"
        quality = _heldout_losses(reader, source, geometry, config, eval_source, eval_v1, plan) if scored else None
    return CalibratedStart(weights, residuals, lambdas, q2, quality, values or None)


def _steady_second_half(attn, normed: torch.Tensor, ratio: float) -> torch.Tensor:
    """Expanded layout: channel 0 of each group's second value half reads x along u = C⁻¹m (m, C: the mean and
    covariance of the layer's normalised input x over the calibration tokens), the direction whose projection varies
    least against its mean, scaled to RATIO times the first half's mean norm. Its maps' average is then nearly the
    same at every token, so subln's per-head divisor is nearly constant and the normalised first half nearly linear
    in the source head's output. Returns the new v_proj weight (set in ATTN too)."""
    flat = normed.reshape(-1, normed.shape[-1]).double()  # (tokens, D)
    mean, cov = flat.mean(0), torch.cov(flat.T)
    cov = cov + 1e-3 * cov.diagonal().mean() * torch.eye(cov.shape[0], dtype=cov.dtype, device=cov.device)
    direction = torch.linalg.solve(cov, mean)
    direction = direction / direction.norm()
    projection = flat @ direction  # (tokens,): nearly constant
    d, groups = attn.head_dim, attn.num_key_value_heads
    weight = attn.v_proj.weight.detach().clone()  # (2 H_kv d, D): per group [first half | second half]
    first = weight.view(groups, 2, d, -1)[:, 0].double()  # (H_kv, d, D)
    first_norm = torch.einsum("gjD,tD->tgj", first, flat).norm(dim=-1).mean(0)  # (H_kv,) mean |v1| per token
    scale = ratio * first_norm / projection.abs().mean()  # (H_kv,)
    weight.view(groups, 2, d, -1)[:, 1, 0] = (scale[:, None] * direction[None]).to(weight.dtype)
    attn.v_proj.weight.copy_(weight)
    return weight


def _source_layer_output(layer, hidden: torch.Tensor, position_embeddings, source_o_proj, fitted: int):
    """What the source's decoder layer computes from HIDDEN (B, L, D): its heads are the V1 layer's maps read as the
    calibration reads them (`target` above) through the source's o_proj, and the rest of the layer is shared."""
    attn = layer.self_attn
    d = attn.head_dim
    batch, length, width = hidden.shape
    out1, out2 = _map_outputs(attn, layer.input_layernorm(hidden), position_embeddings)  # (B·L·H, 2d) each
    target = out1[:, :d] if fitted == d else torch.cat((out1[:, :d], out2[:, d:]), dim=-1)
    output = (target.reshape(batch * length, -1).double() @ source_o_proj.T).float().reshape(batch, length, width)
    if attn.o_proj.bias is not None:
        output = output + attn.o_proj.bias
    hidden = hidden + output
    return hidden + layer.mlp(layer.post_attention_layernorm(hidden))


def _heldout_losses(reader, source, geometry, config, eval_source, eval_v1, plan) -> dict | None:
    """Mean next-token loss of the source and of the calibrated V1 on the held-out blocks: the final norm and the
    LM head are the source's (V1 keeps both). None for a source without an LM head (a classifier)."""
    prefix = geometry.prefix
    if not is_causal_lm(source.path):
        return None
    head = "lm_head.weight" if "lm_head.weight" in source.tensors else prefix + "embed_tokens.weight"  # or tied
    device = eval_v1.device
    norm, head = reader.get(prefix + "norm.weight").float().to(device), reader.get(head).float().to(device)
    labels = plan.heldout_blocks[:, 1:].to(device)
    losses = {}
    for name, hidden in (("source", eval_source), ("converted", eval_v1)):
        total = 0.0
        for row, target in zip(hidden, labels):  # one block's logits (L', vocab) at a time
            normed = row * row.square().mean(-1, keepdim=True).add(config.rms_norm_eps).rsqrt() * norm
            logits = normed[:-1] @ head.T
            total += float(torch.nn.functional.cross_entropy(logits, target, reduction="sum"))
        losses[name] = total / labels.numel()
    return {**losses, "tokens": labels.numel(), "blocks": labels.shape[0], "block_tokens": labels.shape[1]}


def _reachable(module, grid: tuple[float, ...]) -> tuple[float, ...]:
    """The GRID values `_set_lambda` can give this λ module (all of them for the converter's small vectors)."""
    if float(module.lambda_k2 @ module.lambda_k2) == 0:  # λq2 cannot move λ: keep the mirrored start
        return (float(module()),)
    ceiling = math.exp(float(module.lambda_q1 @ module.lambda_k1)) + module.lambda_init
    floor = module.lambda_floor
    return tuple(v for v in grid if v < ceiling - 1e-3 and (floor is None or v > floor)) or (float(module()),)


def _unfloored(module, value: float) -> float:
    """The paper's λ that the module's floor m turns into VALUE (> m): m + softplus₁₀₀⁻¹(value − m)."""
    floor = module.lambda_floor
    if floor is None:
        return value
    return floor + math.log(math.expm1(100.0 * (value - floor))) / 100.0


def _set_lambda(module, value: float) -> torch.Tensor:
    """Move λq2 along λk2 (= λk1) so that the module's λ (exp(λq1·λk1) − exp(λq2·λk2) + λ_init, through its floor)
    is VALUE, keeping the other three vectors; returns the new λq2 (`_reachable` keeps VALUE within reach)."""
    s1 = float(module.lambda_q1 @ module.lambda_k1)
    k2 = module.lambda_k2.double()
    value = _unfloored(module, value)
    shift = math.log(math.exp(s1) + module.lambda_init - value) - float(module.lambda_q2.double() @ k2)
    module.lambda_q2.copy_(module.lambda_q2 + (shift * k2 / (k2 @ k2)).float())
    return module.lambda_q2.detach().clone()


def _stored_dtype(source, names: list[str], suffix: str) -> torch.dtype:
    """The dtype SRC stores the layer's tensor ending in SUFFIX in (one of NAMES)."""
    from .dtypes import from_safetensors_code

    return from_safetensors_code(source.tensors[next(n for n in names if n.endswith(suffix))].dtype)


def _load_layer(layer_class, config, layer_idx: int, names: list[str], reader: _SourceReader, tensor_map: TensorMap):
    """One V1 decoder layer holding exactly what the converter writes for it (float32)."""
    state = {}
    for name in names:
        for out_name, tensor in tensor_map(name, reader.get(name)):
            shape = getattr(tensor, "stored_shape", tensor.shape)  # a view the writer streams (`layout.stored_as`)
            state[out_name.split(f"layers.{layer_idx}.", 1)[1]] = tensor.float().reshape(shape)
    with torch.device("meta"):
        layer = layer_class(config, layer_idx)
    layer.load_state_dict(state, strict=True, assign=True)
    return layer.float().eval()


def _layer_output(layer, hidden: torch.Tensor, position_embeddings) -> torch.Tensor:
    output = layer(hidden, position_embeddings=position_embeddings)
    return output[0] if isinstance(output, tuple) else output  # (B, L, D) whether or not the layer returns a tuple


def _map_outputs(attn, normed: torch.Tensor, position_embeddings) -> tuple[torch.Tensor, torch.Tensor]:
    """(A1 [v1|v2], A2 [v1|v2]) of every head, as (tokens x heads, 2d): the attention run twice with λ forced to 0
    and to 1, its sub-layer norm's input captured (λ = 0 gives A1 V; λ = 1 gives A1 V − A2 V). Only the module names
    `diff_lambda` and `subln` are relied on, not how the forward computes the maps."""
    captured = []
    forced = {"value": 0.0}
    width = attn.subln.weight.shape[0]

    def force_lambda(module, inputs, output):
        return torch.full_like(output, forced["value"])

    def capture(module, inputs):
        captured.append(inputs[0].detach().float().reshape(-1, width))

    handles = [attn.diff_lambda.register_forward_hook(force_lambda), attn.subln.register_forward_pre_hook(capture)]
    try:
        for value in (0.0, 1.0):
            forced["value"] = value
            attn(hidden_states=normed, position_embeddings=position_embeddings, attention_mask=None)
    finally:
        for handle in handles:
            handle.remove()
    out1, difference = captured
    return out1, out1 - difference


__all__ = ["RIDGE", "CalibratedStart", "LayerFit", "calibrate_v1_start", "least_squares_projection"]
