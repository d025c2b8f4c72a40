"""Calibrated initialisation of a Llama -> Diff V1 conversion (docs/design.md, "Starting V1 close to its source"):
what the start is fitted on (`plan_calibration`), and `calibrate_conversion`, which the converter calls to fit it
(fit.py) and to record how in the conversion's provenance.

V1 cannot reuse a Llama's weights and compute the same function (see the design note), but three of the errors it
starts with can be reduced before the first step:

* λ starts where the fit puts it while still learning: λ_init = 0 and mirrored vectors (λq2 = λq1, λk2 = λk1), so
  λ = exp(λq1·λk1) − exp(λq2·λk2) = 0 and ∂λ/∂λq1 = exp(λq1·λk1) λk1 ≠ 0 (`LlamaToV1(mirrored_lambda=True)`); with
  a λ grid each layer's λ is then chosen from it (fit.py). `--v1-init calibrated` (the default) fits over
  DIFFERENTIAL_GRID (λ > 0: the layer subtracts, and `lambda_floor` keeps it so); `calibrated-additive` over
  ADDITIVE_GRID, where the fit picks λ < 0 (the second map added, not subtracted: the pair's second half is then read
  through A2 as well as A1, closer to the source's A2 v2); `calibrated-lambda0` keeps λ = 0. The expanded layout
  (`LlamaToV1Expanded`) has A2 = A1 at step 0, so λ has no effect there and is not fitted: it starts at λ_init, and
  each value group's second half gets a steady channel at STEADY_VALUE times the first half's norm;
* with λ_init = 0 the output factor (1 − λ_init) is 1;
* o_proj is refitted by least squares so that the normalised V1 heads reproduce the source's attention output
  (fit.py).

The calibration data (`plan_calibration`) is, by default, text sampled from the source itself: 16 + 4 blocks of
256 tokens from the bos token at temperature 1 (`sample_calibration_blocks`, seeded). The start has to hold on
whatever the source will read, and the source's own distribution is the one text that is about every domain the
source knows; fitting on one shipped novel made the start 2.5-3.1x the source's perplexity on technical text and
code for SmolLM2-135M (docs/converting.md, "Step 0 on other domains"). `--calibration-data FILE` fits on the file's
first four fifths instead. The held-out blocks (the last 4 sampled, or the file's last fifth) are never fitted on:
they give the step-0 perplexity ratio the converter prints and records. The constrained fits measured against the
plain one (held-out ridges, shrinking towards the source's o_proj) are the experiment's, not the converter's
(experiments/v1_calibration/fits.py).

Sampling the calibration text loads the whole source once, before the fit. `device` (`convert --device`): where the
sampling and the fits run, "cpu" by default; on a GPU the sampled text (its RNG) and the rounding of every sum
differ, so the start is an equally good one, not the same bytes.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..errors import check_seed
from ..progress import Progress
from .errors import ConversionError, one_line
from .fit import calibrate_v1_start
from .layout import LlamaToV1Expanded
from .source import is_causal_lm


if TYPE_CHECKING:
    from .options import ConvertOptions

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
# Expanded layout: the steady second value half's norm, as a multiple of the first half's (`fit._steady_second_half`).
STEADY_VALUE = 10.0
# The λ values tried per layer when λ is fitted: 0.05 apart, from −1 to 0.5 (additive start), or from 0.1 to 0.5
# (differential start: above the 0.05 floor, where the floor's softplus still moves λ a little).
ADDITIVE_GRID = tuple(round(-1.0 + 0.05 * i, 2) for i in range(31))
DIFFERENTIAL_GRID = tuple(value for value in ADDITIVE_GRID if value >= 0.1)
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CalibrationPlan:
    """What the calibration reads: token blocks (B, L) and how they were obtained (for config.json and the card)."""

    blocks: torch.Tensor
    description: str
    heldout_blocks: torch.Tensor | None = None  # (B', L'): never fitted on; the step-0 perplexity is measured on them


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
    device: str = "cpu",
    progress: bool = False,
) -> CalibrationPlan:
    """Token blocks for the calibration: `num_blocks` blocks of `block_size` tokens (capped by the context). Without
    `calibration_data`, sampled from the source itself (`sample_calibration_blocks`, seeded); a source that is not a
    causal LM (a classifier: nothing to sample from) reads the built-in text instead, and one without a tokenizer
    as well seeded random token ids (stated as such). With `calibration_data` (a text file), blocks that start with
    the tokenizer's bos token, spread evenly over the text. `device`: where the source samples (the blocks come back
    on the CPU). `progress`: report the sampling (`progress.Progress`)."""
    seed = check_seed(seed, "seed", ConversionError)
    if num_blocks < 1 or block_size < 2:
        raise ConversionError(f"calibration needs >= 1 block of >= 2 tokens (got {num_blocks} x {block_size}).")
    block_size = min(block_size, context)
    if calibration_data is None and is_causal_lm(source_path):
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


def calibrate_conversion(source, config, tensor_map, options: ConvertOptions) -> None:
    """Fit V1's o_proj (and choose λ) on calibration data (`calibrate_v1_start`), set what was fitted on
    TENSOR_MAP, and record how, and the step-0 perplexity on the data's held-out part, in its provenance."""
    v1_init = options.v1_init
    plan = plan_calibration(
        source.path,
        config.vocab_size,
        config.max_position_embeddings,
        options.calibration_data,
        num_blocks=options.calibration_blocks,
        block_size=options.calibration_block_size,
        seed=options.seed,
        device=options.device,
        progress=options.progress,
    )
    expanded = isinstance(tensor_map, LlamaToV1Expanded)
    grid = None if expanded else {"calibrated": DIFFERENTIAL_GRID, "calibrated-additive": ADDITIVE_GRID}.get(v1_init)
    steady = STEADY_VALUE if expanded else 0.0
    start = calibrate_v1_start(
        source,
        config,
        tensor_map.geometry,
        tensor_map,
        plan,
        lambda_grid=grid,
        steady_value=steady,
        device=options.device,
        progress=options.progress,
    )
    tensor_map.output_weights = start.output_weights
    tensor_map.value_weights = start.value_weights
    tensor_map.lambda_q2 = start.lambda_q2 or None
    if expanded:
        lambda_text = (
            "the paper's λ_init per layer, λq2 = λq1 and λk2 = λk1 (λ = λ_init at step 0, trainable); A2 = A1 at step "
            "0 (q2, k2 copied), so each head computes (1 − λ)·A1·V until training moves q2, k2 apart"
        )
    elif grid is None:
        lambda_text = "λ_init = 0, λq2 = λq1 and λk2 = λk1 (λ = 0 at step 0, trainable)"
    else:
        low, high = min(grid), max(grid)
        lambda_text = (
            f"λ_init = 0; per layer the λ in [{low:g}, {high:g}] (steps of 0.05) whose fitted gains leave the least "
            "residual, set through λq2 (trainable)"
        )
    tensor_map.provenance = {
        "v1_init": v1_init,
        "v1_layout": "expanded" if expanded else "paired",
        "lambda": lambda_text,
        "subln": (
            "unit gains; o_proj refitted per layer, in layer order, by least squares so that o_proj(y/rms(y)) ≈ the "
            "source's attention output"
            + (
                f"; channel 0 of each value group's second half reads the input along its steadiest direction, "
                f"{steady:g}x the first half's norm, so rms(y) is nearly the same at every token and y/rms(y) "
                "nearly linear in the source head's output"
                if steady
                else ""
            )
        ),
        **({"steady_value": steady} if steady else {}),
        "calibration_text": plan.description,
        "calibration_tokens": list(plan.blocks.shape),
        "subln_relative_residual": start.residuals,
        # where the fits ran, when not on the CPU (whose output stays what it always was, byte for byte)
        **({"calibration_device": options.device.partition(":")[0]} if options.device != "cpu" else {}),
    }
    if grid is not None:
        tensor_map.provenance["lambda_start"] = [start.lambdas[i] for i in sorted(start.lambdas)]
    if start.heldout_loss is not None:  # measured on calibration blocks no fit saw
        source_loss, converted_loss = start.heldout_loss["source"], start.heldout_loss["converted"]
        tensor_map.provenance["step0_heldout"] = {
            "tokens": start.heldout_loss["tokens"],
            "blocks": start.heldout_loss["blocks"],
            "block_tokens": start.heldout_loss["block_tokens"],
            "source_perplexity": round(math.exp(source_loss), 4),
            "converted_perplexity": round(math.exp(converted_loss), 4),
            "ratio": round(math.exp(converted_loss - source_loss), 4),
        }


__all__ = [
    "ADDITIVE_GRID",
    "BUILTIN_TEXT",
    "DIFFERENTIAL_GRID",
    "STEADY_VALUE",
    "CalibrationPlan",
    "calibrate_conversion",
    "plan_calibration",
    "read_calibration_text",
    "sample_calibration_blocks",
]
