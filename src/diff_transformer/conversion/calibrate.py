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
* o_proj is refitted by least squares (`least_squares_projection`, a small ridge towards 0) so that o_proj(y / rms(y) ·
  (1 − λ_init)) ≈ the source's attention output o_proj_src(t), over the calibration tokens, where y is the V1 heads'
  pre-norm output (A1 − λA2)[v1 | v2] and t what the source's heads computed from the same layer input: the pair
  [A1 v1 | A2 v2] (paired layout), or A1 v1 on the first half (expanded layout, whose second-half columns stay zero;
  the value half they read first gets a steady channel, `_steady_second_half`, which makes y / rms(y) nearly linear
  in the source head's output, so the fit holds off the calibration's domain). The sub-layer norm's weight stays 1:
  a shared gain cannot match heads whose outputs differ in scale, a projection over every head's channels can, and it
  also undoes what the normalisation mixes across a head's channels on average.

The calibration data (`plan_calibration`) is, by default, text sampled from the source itself: 16 + 4 blocks of
256 tokens from the bos token at temperature 1 (`sample_calibration_blocks`, seeded). The start has to hold on
whatever the source will read, and the source's own distribution is the one text that is about every domain the
source knows; fitting on one shipped novel made the start 2.5-3.1x the source's perplexity on technical text and
code for SmolLM2-135M (docs/converting.md, "Step 0 on other domains"). `--calibration-data FILE` fits on the file's
first four fifths instead. The held-out blocks (the last 4 sampled, or the file's last fifth) are never fitted on:
the same pass that fits the layers runs them through the source's layers and the calibrated V1 layers, and the mean
next-token losses of both (the source's final norm and LM head) give the step-0 perplexity ratio the converter prints
and records. Two constrained fits were measured against the plain one and are kept as options of
`calibrate_v1_start` for the experiment (experiments/v1_calibration/step0.py), not used by the converter: a ridge
chosen per layer on held-out blocks (`ridges`, `heldout`: it shrinks o_proj towards 0, worse on every domain) and a
ridge towards the source's o_proj with one least-squares gain per head (`shrink_to_source`,
`scaled_source_projection`; at its limit, the gains alone, worse still; intermediate ridges are not measured yet).

Layers are fitted in order: layer l is fitted on the hidden states that the already calibrated layers 0..l-1 of the
V1 model produce, so each fit corrects what reaches it. Only one decoder layer is in memory at a time (its source
tensors mapped by the same `TensorMap` that writes the checkpoint), plus the hidden states of the calibration blocks
(blocks x block_size x hidden_size floats), once, the embedding matrix to look the tokens up (and, for the held-out
score, the final norm and LM head), and the fitted o_proj (and, expanded, v_proj) of the layers done, kept on the CPU
in the dtype they are written in. Sampling the calibration text loads the whole source once, before any of this.

`device` (`convert --device`): where the sampling and the fits run, "cpu" by default. Each layer is read on the CPU,
moved there, fitted, and its fitted weights brought back to the CPU; on the CPU nothing moves, so the output is the
same byte for byte whether or not `device="cpu"` is passed. On a GPU the sampled text (its RNG) and the rounding of
every sum differ, so the start is an equally good one, not the same bytes.
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import check_seed
from ..progress import Progress
from .errors import ConversionError, one_line
from .layout import IGNORED_SOURCE_TENSORS, Geometry, TensorMap


# The built-in calibration text: public domain, and not the held-out text (assets/heldout.txt) the demo evaluates on.
BUILTIN_TEXT = Path(__file__).resolve().parent.parent / "assets" / "calibration.txt"
BUILTIN_DESCRIPTION = (
    "built-in: Jane Austen, Persuasion (1817), chapters 1-2 (public domain; assets/calibration.txt, not the "
    "held-out text)"
)
SAMPLED_DESCRIPTION = "text sampled from SRC itself (temperature 1, from the bos token)"
HELDOUT_BLOCKS = 4  # blocks never fitted on, for the step-0 perplexity ratio the converter reports
MAX_TEXT_BYTES = 4 << 20  # only the head of a --calibration-data file is read: 16 blocks need far less
MIN_TOKENS = 64
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CalibrationPlan:
    """What the calibration reads: token blocks (B, L) and how they were obtained (for config.json and the card)."""

    blocks: torch.Tensor
    description: str
    heldout_blocks: torch.Tensor | None = None  # (B', L'): never fitted on; the step-0 perplexity is measured on them


RIDGE = 1e-4
# Expanded layout: the steady second value half's norm, as a multiple of the first half's (`_steady_second_half`).
STEADY_VALUE = 10.0


def least_squares_projection(
    features: torch.Tensor, target: torch.Tensor, ridge: float = RIDGE, prior: torch.Tensor | None = None
) -> torch.Tensor:
    """argmin_W ‖features Wᵀ − target‖² + ρ‖W − prior‖² (rows: tokens; prior 0 if None), ρ = RIDGE × the mean
    squared feature, in float64: the output projection (target width × feature width) that best maps the normalised
    heads onto the source's attention output. The ridge keeps features that never vary (or repeat another) from
    blowing W up, and a larger one keeps W near PRIOR where the calibration tokens cannot tell."""
    features, target = features.double(), target.double()
    gram = features.T @ features
    rho = ridge * float(gram.diagonal().mean()) + 1e-12
    identity = torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device)
    right = features.T @ target
    if prior is not None:
        right = right + rho * prior.double().T
    return torch.linalg.solve(gram + rho * identity, right).T


def scaled_source_projection(
    features: torch.Tensor, target: torch.Tensor, source_o_proj: torch.Tensor, heads: int
) -> torch.Tensor:
    """The source's o_proj (D, H·w) with one least-squares gain per head: the projection with H free parameters
    that best maps the normalised heads onto TARGET (the normalisation divides each head by its size, which one gain
    per head undoes on average). Solved from the same Gram matrices as the full fit."""
    features, target, weight = features.double(), target.double(), source_o_proj.double()
    width = features.shape[1] // heads
    gram, cross = features.T @ features, features.T @ target  # (n, n), (n, D)
    # ⟨F_h W_hᵀ, F_g W_gᵀ⟩ = Σ (F_hᵀF_g ∘ W_hᵀW_g) and ⟨F_h W_hᵀ, T⟩ = Σ (F_hᵀT ∘ W_hᵀ), per pair of heads
    pairs = (gram * (weight.T @ weight)).reshape(heads, width, heads, width).sum(dim=(1, 3))  # (H, H)
    right = (cross * weight.T).reshape(heads, -1).sum(dim=1)  # (H,)
    scale = 1e-12 * float(pairs.diagonal().mean()) + 1e-30
    gains = torch.linalg.solve(pairs + scale * torch.eye(heads, dtype=pairs.dtype, device=pairs.device), right)
    return weight * gains.repeat_interleave(width)[None]


def read_calibration_text(path) -> str:
    """The first MAX_TEXT_BYTES of a UTF-8 text file (an incomplete character at the cut is dropped)."""
    import codecs

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
        # One rule for every size: strict UTF-8. A file cut at MAX_TEXT_BYTES may end inside a character; the
        # incremental decoder (final=False) holds back only that incomplete tail, and still refuses a bad byte.
        cut = len(data) == MAX_TEXT_BYTES
        text = codecs.getincrementaldecoder("utf-8")("strict").decode(data, final=not cut)
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
    sample: bool = True,
    device: str = "cpu",
    progress: bool = False,
) -> CalibrationPlan:
    """Token blocks for the calibration: `num_blocks` blocks of `block_size` tokens (capped by the context). Without
    `calibration_data`, sampled from the source itself (`sample_calibration_blocks`, seeded); a source that is not a
    causal LM (a classifier: nothing to sample from) reads the built-in text instead, and one without a tokenizer
    as well seeded random token ids (stated as such). With `calibration_data` (a text file), blocks that start with
    the tokenizer's bos token, spread evenly over the text. `sample=False`: the built-in text (the former default,
    kept for comparison). `device`: where the source samples (the blocks come back on the CPU). `progress`: report
    the sampling (`progress.Progress`)."""
    seed = check_seed(seed, "seed", ConversionError)
    if num_blocks < 1 or block_size < 2:
        raise ConversionError(f"calibration needs >= 1 block of >= 2 tokens (got {num_blocks} x {block_size}).")
    block_size = min(block_size, context)
    if calibration_data is None and sample and _is_causal_lm(source_path):
        blocks = sample_calibration_blocks(
            source_path, num_blocks + HELDOUT_BLOCKS, block_size, seed, device, progress=progress
        )
        if int(blocks.max()) < vocab_size:
            return CalibrationPlan(blocks[:num_blocks], f"{SAMPLED_DESCRIPTION}, seed {seed}", blocks[num_blocks:])
    text = read_calibration_text(calibration_data) if calibration_data is not None else None
    description = f"--calibration-data {Path(calibration_data).name}" if text is not None else BUILTIN_DESCRIPTION
    tokenizer = _tokenizer(source_path)
    if tokenizer is None and text is not None:
        raise ConversionError(
            f"--calibration-data needs SRC's tokenizer, but {source_path} has none that loads: add its tokenizer "
            "files, or convert without --calibration-data."
        )
    # verbose=False: the text is cut into blocks of at most the context below, never run through the model whole, so
    # the tokenizer's "longer than the specified maximum ... will result in indexing errors" does not apply (it is
    # logged only when verbose; tests/conversion/test_calibration_text.py::test_long_text_tokenizes_without_the_
    # indexing_errors_warning guards it).
    ids = (
        tokenizer(text or BUILTIN_TEXT.read_text(encoding="utf-8"), add_special_tokens=False, verbose=False)[
            "input_ids"
        ]
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
    # the text's last fifth is held out (the step-0 perplexity is measured there), unless that leaves too little
    cut = len(ids) - len(ids) // 5 if len(ids) // 5 >= MIN_TOKENS else len(ids)
    blocks = _spread_blocks(ids[:cut], bos, body, num_blocks)
    heldout = _spread_blocks(ids[cut:], bos, body, HELDOUT_BLOCKS) if cut < len(ids) else None
    for part in (blocks, heldout if heldout is not None else blocks):
        if int(part.max()) >= vocab_size:
            raise ConversionError(
                f"SRC's tokenizer produces token id {int(part.max())}, beyond its vocab_size {vocab_size}: the "
                "tokenizer does not belong to these weights."
            )
    return CalibrationPlan(blocks, description, heldout)


def _spread_blocks(ids: list[int], bos: int | None, body: int, count: int) -> torch.Tensor:
    """Up to COUNT blocks of BODY tokens (fewer and shorter for a short text), bos first, evenly spread over IDS,
    the last one ending it."""
    body = min(body, len(ids))
    count = min(count, len(ids) // body)
    starts = torch.linspace(0, len(ids) - body, count).round().long().tolist()
    rows = [([bos] if bos is not None else []) + ids[s : s + body] for s in starts]
    return torch.tensor(rows, dtype=torch.long)  # (count, body + 1 with a bos token)


def _is_causal_lm(source_path: Path) -> bool:
    import json

    try:
        config = json.loads((Path(source_path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return all(name.endswith("ForCausalLM") for name in config.get("architectures") or ["ForCausalLM"])


def sample_calibration_blocks(
    source_path: Path,
    num_blocks: int = 16,
    block_size: int = 256,
    seed: int = 0,
    device: str = "cpu",
    progress: bool = False,
) -> torch.Tensor:
    """(num_blocks, block_size) token ids sampled from the source model itself, each block its own sequence from
    the bos token (token 0 if the config names none): plain ancestral sampling at temperature 1, no top-k/top-p, the
    end-of-text token suppressed so every block is full. The model's own distribution is what a start that should
    hold on any text has to reproduce; no text is needed, and the same seed gives the same blocks (on the same
    kind of device: a GPU draws other numbers). Off the CPU the model is loaded straight onto DEVICE. `progress`:
    tokens sampled so far (`progress.Progress`)."""
    from transformers import AutoModelForCausalLM, StoppingCriteria, StoppingCriteriaList

    class _Count(StoppingCriteria):  # never stops generation: counts its steps for the progress line
        def __call__(self, input_ids, scores, **kwargs):
            report.update(1)
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    from transformers.utils import logging as transformers_logging

    device = torch.device(device)
    on_cpu = device.type == "cpu"
    gpus = [] if on_cpu else [device.index if device.index is not None else torch.cuda.current_device()]
    what = f"sampling V1 calibration text ({num_blocks} blocks)"
    report = Progress(what, total=block_size - 1, unit="token", enabled=progress, detail="loading SRC")
    with report, torch.random.fork_rng(devices=gpus):  # seeded without touching the caller's global RNG
        torch.manual_seed(seed)
        bars = transformers_logging.is_progress_bar_enabled()
        transformers_logging.disable_progress_bar()  # the converter reports its own progress; no loading bar
        try:
            placement = {} if on_cpu else {"device_map": device}  # the CPU call as it always was: same bytes
            model = AutoModelForCausalLM.from_pretrained(source_path, dtype="auto", **placement).eval()  # as stored
        finally:
            if bars:
                transformers_logging.enable_progress_bar()
        eos = model.generation_config.eos_token_id
        bos = model.config.bos_token_id
        start = torch.full((num_blocks, 1), bos if bos is not None else 0, dtype=torch.long, device=device)  # (B, 1)
        report.detail = "generating"
        with torch.no_grad():
            blocks = model.generate(
                start,
                attention_mask=torch.ones_like(start),
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                repetition_penalty=1.0,  # the plain distribution, whatever SRC's generation_config.json asks
                no_repeat_ngram_size=0,
                max_new_tokens=block_size - 1,
                min_new_tokens=block_size - 1,  # suppresses eos until the block is full
                pad_token_id=eos[0] if isinstance(eos, list) else eos,
                stopping_criteria=StoppingCriteriaList([_Count()]),
            )
    del model
    return blocks.cpu()  # (num_blocks, block_size)


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
    ridges: list[float] = ()
    heldout_loss: dict | None = None  # {"source", "converted": mean loss, "tokens"} on the plan's held-out blocks
    value_weights: dict | None = None  # expanded, `steady_value`: {layer: v_proj weight (2 H_kv d, D)}


# The λ values tried per layer when λ is fitted: 0.05 apart, from −1 to 0.5 (additive start), or from 0.1 to 0.5
# (differential start: above the 0.05 floor, where the floor's softplus still moves λ a little).
ADDITIVE_GRID = tuple(round(-1.0 + 0.05 * i, 2) for i in range(31))
DIFFERENTIAL_GRID = tuple(value for value in ADDITIVE_GRID if value >= 0.1)


@dataclass
class _LayerFit:
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

    def best(self, candidates, ridges, split: int | None, *, refit: bool, shrink_to_source: bool) -> tuple:
        """(residual, λ, o_proj, ridge, features) of the λ in CANDIDATES and ridge in RIDGES whose fit leaves the
        smallest residual: on the rows from SPLIT on (the held-out blocks) when SPLIT is given, fitted on the rows
        before it (then, with REFIT, fitted again on every row), else fitted and measured on every row."""
        d = self.out1.shape[-1] // 2
        heads = self.source_o_proj.shape[1] // self.fitted
        source_output, source_o_proj, fitted = self.source_output, self.source_o_proj, self.fitted
        best = None
        for lam in candidates:
            pre_norm = self.out1 - lam * self.out2
            normed = pre_norm * pre_norm.square().mean(-1, keepdim=True).add(self.epsilon).rsqrt()
            features = self.scale * normed.reshape(-1, heads, 2 * d)[..., :fitted].reshape(-1, heads * fitted)
            fit_rows = slice(0, split) if split is not None else slice(None)
            check_rows = slice(split, None) if split is not None else slice(None)
            prior = None
            if shrink_to_source:
                prior = scaled_source_projection(features[fit_rows], source_output[fit_rows], source_o_proj, heads)
            for rho in ridges:
                o_proj = least_squares_projection(features[fit_rows], source_output[fit_rows], rho, prior)
                error = features[check_rows].double() @ o_proj.T - source_output[check_rows]
                residual = float(error.square().sum() / source_output[check_rows].square().sum())
                if best is None or residual < best[0]:
                    best = (residual, lam, o_proj, rho, features)
        if split is not None and refit:  # the chosen λ and ridge, fitted again on every block
            prior = None
            if shrink_to_source:
                prior = scaled_source_projection(best[4], source_output, source_o_proj, heads)
            o_proj = least_squares_projection(best[4], source_output, best[3], prior)
            best = (best[0], best[1], o_proj, best[3], best[4])
        return best


@torch.no_grad()
def calibrate_v1_start(
    source,
    config,
    geometry: Geometry,
    tensor_map: TensorMap,
    plan: CalibrationPlan,
    micro_batch: int = 4,
    lambda_grid: tuple[float, ...] | None = None,
    ridges: tuple[float, ...] = (RIDGE,),
    heldout: int = 0,
    refit: bool = True,
    shrink_to_source: bool = False,
    steady_value: float = 0.0,
    device: str = "cpu",
    progress: bool = False,
) -> CalibratedStart:
    """Least-squares output projections of every layer, fitted in layer order (see the module docstring). With
    `lambda_grid`, each layer's λ is also chosen from it, the one whose fit leaves the smallest residual, and set
    through λq2 (still trainable). `device`: where each layer is fitted (the module docstring); what is returned is
    on the CPU, o_proj and v_proj in the dtype SRC stores them in (what the writer writes). `progress`: layers
    fitted so far (`progress.Progress`)."""
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
        weights, residuals, lambdas, q2, chosen_ridges, values = {}, [], {}, {}, [], {}
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
            columns = torch.arange(heads * 2 * d, device=device).reshape(heads, 2 * d)[:, :fitted].reshape(-1)
            source_o_proj = attn.o_proj.weight.detach().double()[:, columns]  # (D, H·fitted): the source's, reordered
            # the source's attention output (before o_proj's bias): rows are tokens, the heads last but one
            source_output = target.reshape(-1, heads * fitted).double() @ source_o_proj.T  # (tokens, D)
            # rows of out1/out2/target are (block, position, head) in order: the last `heldout` blocks are held out
            split = (plan.blocks.shape[0] - heldout) * plan.blocks.shape[1] if heldout else None
            fit = _LayerFit(out1, out2, source_output, source_o_proj, attn.subln.variance_epsilon, scale, fitted)
            best = fit.best(candidates, ridges, split, refit=refit, shrink_to_source=shrink_to_source)
            chosen_ridges.append(best[3])
            residual, lam, o_proj = best[:3]
            del out1, out2, target, source_output
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
            chunks = hidden.split(micro_batch)
            hidden = torch.cat([_layer_output(layer, chunk, position_embeddings) for chunk in chunks])
            if scored:
                eval_v1 = _layer_output(layer, eval_v1, eval_positions)
            del layer
            report.update(1)
        report.detail = "scoring the held-out blocks"
        quality = _heldout_losses(reader, source, geometry, config, eval_source, eval_v1, plan) if scored else None
    return CalibratedStart(weights, residuals, lambdas, q2, chosen_ridges, quality, values or None)


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
    if not _is_causal_lm(source.path):
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
