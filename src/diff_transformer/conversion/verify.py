"""Numerical check of a conversion: source and converted model on the same random sequences."""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from ..checkpoints.weights import find_shards, read_headers
from ..errors import check_seed
from ..evaluation import HELDOUT_TOKENS
from ..families import MOTIF, Family, family_of_config
from ..progress import Progress
from .device import check_device
from .dtypes import dtype_name, from_safetensors_code, parse_dtype
from .errors import ConversionError, conversion_boundary
from .families import CAUSAL_LM, Task, task_of
from .motif import MotifReference, motif_config
from .source import load_config, resolve_source


# Source parameters that the converter never casts (DiffLlama's λ vectors; `_FP32_PARAMETERS` on the output side).
_UNCAST_SOURCE_PARAMETERS = re.compile(r"\.lambda_[qk][12]$")


@conversion_boundary
def verify_conversion(
    src: str | os.PathLike,
    out: str | os.PathLike,
    *,
    num_sequences: int = 3,
    seq_len: int = 32,
    max_new_tokens: int = 8,
    seed: int = 0,
    dtype: str | torch.dtype = torch.float32,
    atol: float = 1e-4,
    revision: str | None = None,
    token: str | bool | None = None,
    heldout_text: str | None = None,
    heldout_tokens: int = HELDOUT_TOKENS,
    progress: bool = False,
    device: str | None = None,
) -> dict:
    """Load SRC (a Llama-family model, DiffLlama or Motif) and OUT (Diff), run `num_sequences` random sequences of
    `seq_len` tokens through both (in `dtype`, float32 by default, on `device`, the CPU by default) and greedily
    continue the first half of each sequence by `max_new_tokens` tokens. A task head (sequence/token
    classification, question answering) is compared on its outputs over a batch in which every sequence after the
    first is right-padded with `pad_token_id` (when the config has one), and `greedy_match` is None.

    Loads both models whole: meant for checkpoints that fit in memory twice.

    transformers has no Motif class: a Motif source is run by `conversion.motif.MotifReference`, this package's
    plain-torch forward written from Motif's semantics (one head at a time, no cache; slow, meant for small
    checkpoints), and has no held-out score; it runs on the CPU whatever `device` says (only the converted model
    moves).

    When OUT stores its weights in another dtype than SRC (`convert --dtype bfloat16`), the reference is the source
    with every weight cast the way the converter cast it (then to `dtype`), so a correct conversion still agrees
    within `atol`: what is checked is the conversion, not the precision lost by the requested cast.

    Args:
        src: the source checkpoint (directory or Hub id), as given to the converter.
        out: the converted checkpoint directory.
        num_sequences: random sequences to compare.
        seq_len: tokens per sequence.
        max_new_tokens: greedy continuation length (0: compare logits only).
        seed: seeds the random tokens.
        dtype: the dtype both models run in.
        atol: the largest |Δlogit| that passes.
        revision: Hub revision of a Hub-id `src`.
        token: Hub token for a Hub-id `src`.
        heldout_text: with it, a causal LM whose source has a tokenizer is also scored on the first `heldout_tokens`
            tokens of that text as the demo scores it (`evaluation.heldout_perplexity`).
        heldout_tokens: how many tokens of `heldout_text` to score (default: the demo's, `evaluation.HELDOUT_TOKENS`,
            in windows of `evaluation.EVAL_BLOCK_SIZE`, so the shipped text gives the demo's number).
        progress: report each stage (loading, logits, continuations, held-out windows): a bar on a terminal, a
            line at least every 30 s in a log (`progress.Progress`).
        device: where both models run: "cpu" (None), "cuda", "cuda:N" or "auto" (`conversion.device.check_device`,
            checked before anything loads); the logits are compared on the CPU.

    Returns:
        A dict with `max_abs_logit_diff` (max |Δlogit| over all positions), `greedy_match` (token-identical
        continuations), `expected_exact` (True for Llama -> V2 and DiffLlama -> V1, where the logits must agree;
        False for Llama -> V1, which is not function-preserving), `passed` (expected_exact and both checks hold,
        else None when not expected exact), `reference` (what the converted model was compared with), `heldout`
        (`{"source": perplexity, "converted": perplexity, "tokens": n}` with `heldout_text`, else None), plus the
        settings used.

    Raises:
        ConversionError: bad settings, OUT is not a Diff checkpoint, or SRC is not a family the converter reads.
    """
    if num_sequences < 1 or seq_len < 2 or max_new_tokens < 0:
        raise ConversionError("verify_conversion needs num_sequences >= 1, seq_len >= 2 and max_new_tokens >= 0.")
    seed = check_seed(seed, "seed", ConversionError)
    device = check_device(device)
    torch_dtype = parse_dtype(dtype) or torch.float32
    src_path, _ = resolve_source(src, revision=revision, token=token)
    out_path = Path(out).expanduser()
    family, task, diff_version = _check_pair(src_path, out_path)
    expected_exact = family.function_preserving(diff_version)
    with Progress("verifying", enabled=progress, detail="loading both models", bar=False) as report:
        reference, converted = _load_pair(src_path, out_path, family, task, torch_dtype)
        reference_name = _cast_like_output(reference, src_path, out_path)  # on the CPU, as the converter cast
        if device != "cpu":
            converted.to(device)
            if family is not MOTIF:  # MotifReference is plain torch on the CPU
                reference.to(device)

        vocab = min(reference.config.vocab_size, converted.config.vocab_size)
        generator = torch.Generator().manual_seed(seed)
        input_ids = torch.randint(0, vocab, (num_sequences, seq_len), generator=generator)
        report.detail = f"comparing logits on {num_sequences} random sequences"
        if task is CAUSAL_LM:
            with torch.no_grad():
                logits = [_on(model, input_ids).logits.float().cpu() for model in (reference, converted)]
                max_diff = (logits[0] - logits[1]).abs().max().item()
            prompts = input_ids[:, : max(1, seq_len // 2)]
            report.detail = "comparing greedy continuations"
            greedy_match = _same_greedy_continuations(reference, converted, prompts, max_new_tokens)
        else:  # a task head: its outputs on a padded batch, nothing to generate
            per_token = task.suffix != "ForSequenceClassification"
            max_diff = _head_difference(reference, converted, input_ids, per_token)
            greedy_match, max_new_tokens = None, 0
        heldout = None
        if heldout_text is not None and task is CAUSAL_LM and family is not MOTIF:
            report.detail = f"held-out perplexity of both models ({heldout_tokens:,} tokens)"
            heldout = _heldout(reference, converted, src_path, heldout_text, heldout_tokens, progress)
    passed = (max_diff <= atol and greedy_match is not False) if expected_exact else None
    return {
        "max_abs_logit_diff": max_diff,
        "greedy_match": greedy_match,
        "expected_exact": expected_exact,
        "passed": passed,
        "atol": atol,
        "reference": reference_name,
        "source_model_type": family.model_type,
        "diff_version": diff_version,
        "num_sequences": num_sequences,
        "seq_len": seq_len,
        "max_new_tokens": max_new_tokens,
        "dtype": dtype_name(torch_dtype),
        "heldout": heldout,
    }


def _heldout(reference, converted, src_path: Path, text: str, max_tokens: int, progress: bool) -> dict | None:
    """Held-out perplexity of both models on TEXT with the source's tokenizer; None when the source has none."""
    from transformers import AutoTokenizer

    from ..evaluation import heldout_perplexity

    try:
        tokenizer = AutoTokenizer.from_pretrained(src_path)
    except Exception:  # no tokenizer files (transformers raises OSError, ValueError, TypeError...)
        return None
    if tokenizer.bos_token_id is None:
        return None
    tokens = min(max_tokens, len(tokenizer(text, add_special_tokens=False, verbose=False).input_ids))
    scores = {
        name: heldout_perplexity(model, tokenizer, text, max_tokens=max_tokens, progress=progress, desc=name)
        for name, model in (("source", reference), ("converted", converted))
    }
    return {**scores, "tokens": tokens}


def _check_pair(src_path: Path, out_path: Path) -> tuple[Family, Task, int]:
    """SRC's family and task, and OUT's diff_version, once SRC is a source the converter reads and OUT a Diff
    checkpoint."""
    if not out_path.is_dir():
        raise ConversionError(f"OUT {out_path} is not a directory: convert first, then verify.")
    src_config = load_config(src_path)
    source_type = src_config.get("model_type")
    out_config = load_config(out_path)
    out_type = out_config.get("model_type")
    if out_type != "diff":
        raise ConversionError(f"OUT {out_path} is not a Diff checkpoint (model_type {out_type!r}).")
    family = family_of_config(src_config)
    if family is MOTIF:
        return family, CAUSAL_LM, int(out_config.get("diff_version", 1))
    if family is None:
        raise ConversionError(
            f"SRC {src_path} has model_type {source_type!r}: only the families the converter reads can be verified."
        )
    task = task_of(family, src_config.get("architectures") or [], str(src_path))
    return family, task, int(out_config.get("diff_version", 1))


def _load_pair(src_path: Path, out_path: Path, family: Family, task: Task, dtype: torch.dtype):
    """The source model and the converted one (transformers' and this package's class for the task), in `dtype`,
    in eval mode."""
    import transformers

    from .. import modeling_diff

    diff_class = getattr(modeling_diff, task.diff_class)
    try:
        if family is MOTIF:
            reference = MotifReference(src_path, motif_config(load_config(src_path), str(src_path)), dtype)
        else:
            reference = (
                getattr(transformers, family.prefix + task.suffix).from_pretrained(src_path, dtype=dtype).eval()
            )
        converted = diff_class.from_pretrained(out_path, dtype=dtype).eval()
    except Exception as exc:
        raise ConversionError(f"loading the checkpoints failed ({' '.join(str(exc).split())[:300]}).") from exc
    return reference, converted


def _cast_like_output(reference, src_path: Path, out_path: Path) -> str:
    """When OUT stores another dtype than SRC, round `reference`'s weights through it as the converter did; returns
    what the converted model is then compared with."""
    cast = _stored_dtype(out_path)
    if cast is None or cast == _stored_dtype(src_path):
        return "the source"
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if param.is_floating_point() and not _UNCAST_SOURCE_PARAMETERS.search(name):
                param.copy_(param.to(cast).to(param.dtype))
    return f"the source with its weights cast to {dtype_name(cast)} as in OUT"


def _same_greedy_continuations(reference, converted, prompts: torch.Tensor, max_new_tokens: int) -> bool:
    """Whether both models continue every prompt (one at a time, no padding) with the same greedy tokens."""
    if max_new_tokens == 0:
        return True
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, num_beams=1, pad_token_id=0)
    for row in prompts.split(1):  # (1, L)
        with torch.no_grad():
            ref_tokens = _on(reference, row, "generate", **kwargs).cpu()
            new_tokens = _on(converted, row, "generate", **kwargs).cpu()
        if not torch.equal(ref_tokens, new_tokens):
            return False
    return True


def _head_difference(reference, converted, input_ids: torch.Tensor, per_token: bool) -> float:
    """max |Δ| of a task head's outputs on `input_ids`, every row after the first right-padded by a different number
    of `pad_token_id`s (masked out; sequence classification then scores an earlier token). Without a pad token the
    rows run one at a time, as the generic heads require."""
    pad = reference.config.pad_token_id
    mask = torch.ones_like(input_ids)
    if pad is None:
        rows = [(input_ids[i : i + 1], mask[i : i + 1]) for i in range(input_ids.shape[0])]
    else:
        input_ids = input_ids.masked_fill(input_ids == pad, (pad + 1) % reference.config.vocab_size)
        for row in range(1, input_ids.shape[0]):
            padding = row * input_ids.shape[1] // (2 * input_ids.shape[0])
            if padding:
                input_ids[row, -padding:], mask[row, -padding:] = pad, 0
        rows = [(input_ids, mask)]
    worst = 0.0
    with torch.no_grad():
        for ids, row_mask in rows:
            ref = _on(reference, ids, attention_mask=row_mask)
            new = _on(converted, ids, attention_mask=row_mask)
            for key in ("logits", "start_logits", "end_logits"):
                if getattr(ref, key, None) is not None:
                    difference = (ref[key].float().cpu() - new[key].float().cpu()).abs()
                    if per_token:  # token classification, question answering: the unpadded positions
                        difference = difference[row_mask.bool()]
                    worst = max(worst, difference.max().item())
    return worst


def _on(model, input_ids: torch.Tensor, method: str = "__call__", **kwargs):
    """MODEL's METHOD on INPUT_IDS (and an attention mask: all ones for `generate`) moved to where MODEL is."""
    device = getattr(model, "device", torch.device("cpu"))
    mask = kwargs.pop("attention_mask", None)
    if method == "generate":
        mask = torch.ones_like(input_ids)
    if mask is not None:
        kwargs["attention_mask"] = mask.to(device)
    return getattr(model, method)(input_ids.to(device), **kwargs)


def _stored_dtype(path: Path) -> torch.dtype | None:
    """The dtype a checkpoint stores its embedding matrix in (every weight the converter casts has it)."""
    headers = read_headers(path, find_shards(path))
    info = headers.get("model.embed_tokens.weight") or headers.get("transformer.embed_tokens.weight")
    return from_safetensors_code(info.dtype) if info is not None else None


__all__ = ["verify_conversion"]
