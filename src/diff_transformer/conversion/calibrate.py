"""Calibrated initialisation of a Llama -> Diff V1 conversion (docs/design.md, "Starting V1 close to its source").

V1 cannot reuse a Llama's weights and compute the same function (see the design note), but three of the errors it
starts with can be reduced before the first step:

* λ starts where the fit puts it while still learning: λ_init = 0 and mirrored vectors (λq2 = λq1, λk2 = λk1), so
  λ = exp(λq1·λk1) − exp(λq2·λk2) = 0 and ∂λ/∂λq1 = exp(λq1·λk1) λk1 ≠ 0 (`LlamaToV1(mirrored_lambda=True)`); with
  a `lambda_grid` each layer's λ is then chosen from it, the value whose fitted projection (below) leaves the least
  residual, and set by moving λq2 along λk2 (`_set_lambda`). `--v1-init calibrated` (the default) fits over
  DIFFERENTIAL_GRID (λ > 0: the layer subtracts, and `lambda_floor` keeps it so); `calibrated-additive` over
  ADDITIVE_GRID, where the fit picks λ < 0 (the second map added, not subtracted: the pair's second half is then read
  through A2 as well as A1, closer to the source's A2 v2); `calibrated-lambda0` keeps λ = 0. The expanded layout
  (`LlamaToV1Expanded`) has A2 = A1 at step 0, so λ has no effect there and is not fitted: it starts at λ_init;
* with λ_init = 0 the output factor (1 − λ_init) is 1;
* o_proj is refitted by least squares (`least_squares_projection`, a small ridge) so that o_proj(y / rms(y) · (1 −
  λ_init)) ≈ the source's attention output o_proj_src(t), over the calibration tokens, where y is the V1 heads'
  pre-norm output (A1 − λA2)[v1 | v2] and t what the source's heads computed from the same layer input: the pair
  [A1 v1 | A2 v2] (paired layout), or A1 v1 on the first half (expanded layout, whose second-half columns stay zero
  and the value half they read stays noise). The sub-layer norm's weight stays 1: a shared gain cannot match heads
  whose outputs differ in scale, a projection over every head's channels can, and it also undoes what the
  normalisation mixes across a head's channels on average.

Layers are fitted in order: layer l is fitted on the hidden states that the already calibrated layers 0..l-1 of the
V1 model produce, so each fit corrects what reaches it. Only one decoder layer is in memory at a time (its source
tensors mapped by the same `TensorMap` that writes the checkpoint), plus the hidden states of the calibration blocks
(blocks x block_size x hidden_size floats) and, once, the embedding matrix to look the tokens up.
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import check_seed
from .errors import ConversionError, one_line
from .layout import IGNORED_SOURCE_TENSORS, Geometry, TensorMap


# The built-in calibration text: public domain, and not the held-out text (assets/heldout.txt) the demo evaluates on.
BUILTIN_TEXT = Path(__file__).resolve().parent.parent / "assets" / "calibration.txt"
BUILTIN_DESCRIPTION = (
    "built-in: Jane Austen, Persuasion (1817), chapters 1-2 (public domain; assets/calibration.txt, not the "
    "held-out text)"
)
MAX_TEXT_BYTES = 4 << 20  # only the head of a --calibration-data file is read: 16 blocks need far less
MIN_TOKENS = 64
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CalibrationPlan:
    """What the calibration reads: token blocks (B, L) and how they were obtained (for config.json and the card)."""

    blocks: torch.Tensor
    description: str


def least_squares_projection(features: torch.Tensor, target: torch.Tensor, ridge: float = 1e-4) -> torch.Tensor:
    """argmin_W ‖features Wᵀ − target‖² + ρ‖W‖² (rows: tokens), ρ = RIDGE × the mean squared feature, in float64:
    the output projection (target width × feature width) that best maps the normalised heads onto the source's
    attention output. The small ridge keeps features that never vary (or repeat another) from blowing W up."""
    features, target = features.double(), target.double()
    gram = features.T @ features
    rho = ridge * float(gram.diagonal().mean()) + 1e-12
    identity = torch.eye(gram.shape[0], dtype=gram.dtype)
    return torch.linalg.solve(gram + rho * identity, features.T @ target).T


def read_calibration_text(path) -> str:
    """The first MAX_TEXT_BYTES of a UTF-8 text file (an incomplete character at the cut is dropped)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ConversionError(f"--calibration-data {path} is not a file: pass a UTF-8 text file.")
    try:
        with open(path, "rb") as handle:
            data = handle.read(MAX_TEXT_BYTES)
    except OSError as exc:
        raise ConversionError(f"--calibration-data {path} cannot be read ({one_line(exc)}).") from exc
    if b"\0" in data:
        raise ConversionError(f"--calibration-data {path} is not text (it holds NUL bytes): pass a UTF-8 text file.")
    try:
        text = data.decode("utf-8", errors="strict" if len(data) < MAX_TEXT_BYTES else "ignore")
    except UnicodeDecodeError as exc:
        raise ConversionError(f"--calibration-data {path} is not UTF-8 text ({exc.reason}): convert it.") from exc
    if not text.strip():
        raise ConversionError(f"--calibration-data {path} is empty: pass a file with some text.")
    return text


def plan_calibration(
    source_path: Path,
    vocab_size: int,
    context: int,
    calibration_data=None,
    num_blocks: int = 16,
    block_size: int = 256,
    seed: int = 0,
) -> CalibrationPlan:
    """Token blocks for the calibration: `num_blocks` blocks of `block_size` tokens (capped by the context), each
    starting with the tokenizer's bos token, spread evenly over the text. The text is `calibration_data` or the
    built-in one; a source without a tokenizer is calibrated on seeded random token ids (stated as such)."""
    seed = check_seed(seed, "seed", ConversionError)
    if num_blocks < 1 or block_size < 2:
        raise ConversionError(f"calibration needs >= 1 block of >= 2 tokens (got {num_blocks} x {block_size}).")
    block_size = min(block_size, context)
    text = read_calibration_text(calibration_data) if calibration_data is not None else None
    description = f"--calibration-data {Path(calibration_data).name}" if text is not None else BUILTIN_DESCRIPTION
    tokenizer = _tokenizer(source_path)
    if tokenizer is None and text is not None:
        raise ConversionError(
            f"--calibration-data needs SRC's tokenizer, but {source_path} has none that loads: add its tokenizer "
            "files, or convert without --calibration-data."
        )
    ids = (
        tokenizer(text or BUILTIN_TEXT.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
        if (tokenizer is not None)
        else []
    )
    if text is None and len(ids) < MIN_TOKENS:  # no tokenizer, or one that does not read English text
        reason = (
            "SRC has no tokenizer" if tokenizer is None else "SRC's tokenizer reads the built-in text as no tokens"
        )
        logger.warning(f"note: {reason}: V1 calibration runs on seeded random token ids.")
        generator = torch.Generator().manual_seed(seed)
        blocks = torch.randint(0, vocab_size, (num_blocks, block_size), generator=generator)
        return CalibrationPlan(blocks, f"random token ids (seed {seed}; {reason})")
    bos = tokenizer.bos_token_id
    body = block_size - (bos is not None)
    if len(ids) < MIN_TOKENS:
        raise ConversionError(
            f"the calibration text ({description}) is {len(ids)} tokens long: give at least {MIN_TOKENS} tokens."
        )
    if len(ids) < body:  # one short block
        body, block_size = len(ids), len(ids) + (bos is not None)
    count = min(num_blocks, len(ids) // body)
    starts = torch.linspace(0, len(ids) - body, count).round().long().tolist()  # evenly spread, the last one ends it
    rows = [([bos] if bos is not None else []) + ids[s : s + body] for s in starts]
    blocks = torch.tensor(rows, dtype=torch.long)  # (count, block_size)
    if int(blocks.max()) >= vocab_size:
        raise ConversionError(
            f"SRC's tokenizer produces token id {int(blocks.max())}, beyond its vocab_size {vocab_size}: the "
            "tokenizer does not belong to these weights."
        )
    return CalibrationPlan(blocks, description)


def _tokenizer(path: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception:  # no tokenizer files, or ones that do not load: the caller says what it does instead
        return None


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


# The λ values tried per layer when λ is fitted: 0.05 apart, from −1 to 0.5 (additive start), or from 0.1 to 0.5
# (differential start: above the 0.05 floor, where the floor's softplus still moves λ a little).
ADDITIVE_GRID = tuple(round(-1.0 + 0.05 * i, 2) for i in range(31))
DIFFERENTIAL_GRID = tuple(value for value in ADDITIVE_GRID if value >= 0.1)


@torch.no_grad()
def calibrate_v1_start(
    source,
    config,
    geometry: Geometry,
    tensor_map: TensorMap,
    plan: CalibrationPlan,
    micro_batch: int = 4,
    lambda_grid: tuple[float, ...] | None = None,
) -> CalibratedStart:
    """Least-squares output projections of every layer, fitted in layer order (see the module docstring). With
    `lambda_grid`, each layer's λ is also chosen from it, the one whose fit leaves the smallest residual, and set
    through λq2 (still trainable)."""
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
    with contextlib.ExitStack() as stack:
        reader = _SourceReader(source, stack)
        hidden = reader.get(prefix + "embed_tokens.weight")[plan.blocks].float()  # (B, L, D)
        rotary = DiffRotaryEmbedding(config)
        positions = torch.arange(plan.blocks.shape[1])[None]
        position_embeddings = rotary(hidden[:1], positions)  # cos, sin: (1, L, d)
        weights, residuals, lambdas, q2 = {}, [], {}, {}
        for layer_idx in range(geometry.num_layers):
            layer = _load_layer(DiffDecoderLayer, config, layer_idx, layer_names[layer_idx], reader, tensor_map)
            attn = layer.self_attn
            scale = 1.0 - float(config.lambda_init_for_layer(layer_idx))
            maps = [
                _map_outputs(attn, layer.input_layernorm(chunk), position_embeddings)
                for chunk in hidden.split(micro_batch)
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
            columns = torch.arange(heads * 2 * d).reshape(heads, 2 * d)[:, :fitted].reshape(-1)
            source_o_proj = attn.o_proj.weight.detach().double()[:, columns]  # (D, H·fitted): the source's, reordered
            # the source's attention output (before o_proj's bias): rows are tokens, the heads last but one
            source_output = target.reshape(-1, heads * fitted).double() @ source_o_proj.T  # (tokens, D)
            best = None
            for lam in candidates:
                pre_norm = out1 - lam * out2
                normed = pre_norm * pre_norm.square().mean(-1, keepdim=True).add(attn.subln.variance_epsilon).rsqrt()
                features = scale * normed.reshape(-1, heads, 2 * d)[..., :fitted].reshape(-1, heads * fitted)
                o_proj = least_squares_projection(features, source_output)  # (D, H·fitted)
                error = features.double() @ o_proj.T - source_output
                residual = float(error.square().sum() / source_output.square().sum())
                if best is None or residual < best[0]:
                    best = (residual, lam, o_proj)
            residual, lam, o_proj = best
            del out1, out2, target, source_output
            weight = attn.o_proj.weight.detach().clone()
            weight[:, columns] = o_proj.to(weight.dtype)  # the others (expanded: the second half's) stay as mapped
            weights[layer_idx] = weight
            residuals.append(round(residual, 4))
            attn.o_proj.weight.copy_(weight)
            if lambda_grid:
                lambdas[layer_idx] = round(lam, 4)
                q2[layer_idx] = _set_lambda(attn.diff_lambda, lam)
            chunks = hidden.split(micro_batch)
            hidden = torch.cat([_layer_output(layer, chunk, position_embeddings) for chunk in chunks])
            del layer
    return CalibratedStart(weights, residuals, lambdas, q2)


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


__all__ = [
    "ADDITIVE_GRID",
    "BUILTIN_TEXT",
    "DIFFERENTIAL_GRID",
    "CalibratedStart",
    "CalibrationPlan",
    "calibrate_v1_start",
    "least_squares_projection",
    "plan_calibration",
]
