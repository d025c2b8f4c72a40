"""Numerical check of a conversion: source and converted model on the same random sequences."""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from .dtypes import dtype_name, from_safetensors_code, parse_dtype
from .errors import ConversionError
from .families import CAUSAL_LM, family_of, task_of
from .source import find_shards, load_config, read_headers, resolve_source


# Source parameters that the converter never casts (DiffLlama's λ vectors; `_FP32_PARAMETERS` on the output side).
_UNCAST_SOURCE_PARAMETERS = re.compile(r"\.lambda_[qk][12]$")


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
) -> dict:
    """Load SRC (a Llama-family model or DiffLlama) and OUT (Diff), run `num_sequences` random sequences of
    `seq_len` tokens through both (in `dtype`, float32 by default, on CPU) and greedily continue the first half of
    each sequence by `max_new_tokens` tokens. A task head (sequence/token classification, question answering) is
    compared on its outputs over a batch in which every sequence after the first is right-padded with
    `pad_token_id` (when the config has one), and `greedy_match` is None.

    Loads both models whole: meant for checkpoints that fit in memory twice.

    When OUT stores its weights in another dtype than SRC (`convert --dtype bfloat16`), the reference is the source
    with every weight cast the way the converter cast it (then to `dtype`), so a correct conversion still agrees
    within `atol`: what is checked is the conversion, not the precision lost by the requested cast.

    Returns a dict with `max_abs_logit_diff` (max |Δlogit| over all positions), `greedy_match` (token-identical
    continuations), `expected_exact` (True for Llama -> V2 and DiffLlama -> V1, where the logits must agree; False
    for Llama -> V1, which is not function-preserving), `passed` (expected_exact and both checks hold, else None
    when not expected exact), `reference` (what the converted model was compared with), plus the settings used.
    """
    import transformers

    from .. import modeling_diff

    if num_sequences < 1 or seq_len < 2 or max_new_tokens < 0:
        raise ConversionError("verify_conversion needs num_sequences >= 1, seq_len >= 2 and max_new_tokens >= 0.")
    torch_dtype = parse_dtype(dtype) or torch.float32
    src_path, _ = resolve_source(src, revision=revision, token=token)
    out_path = Path(out).expanduser()
    if not out_path.is_dir():
        raise ConversionError(f"OUT {out_path} is not a directory: convert first, then verify.")
    src_config = load_config(src_path)
    source_type = src_config.get("model_type")
    out_config = load_config(out_path)
    if out_config.get("model_type") != "diff":
        raise ConversionError(f"OUT {out_path} is not a Diff checkpoint (model_type {out_config.get('model_type')!r}).")
    family = family_of(source_type)
    if family is None:
        raise ConversionError(
            f"SRC {src_path} has model_type {source_type!r}: only the families the converter reads can be verified."
        )
    task = task_of(family, src_config.get("architectures") or [], str(src_path))
    source_class = getattr(transformers, family.prefix + task.suffix)
    diff_class = getattr(modeling_diff, task.diff_class)
    diff_version = int(out_config.get("diff_version", 1))
    expected_exact = source_type == "diffllama" or diff_version == 2

    try:
        reference = source_class.from_pretrained(src_path, dtype=torch_dtype).eval()
        converted = diff_class.from_pretrained(out_path, dtype=torch_dtype).eval()
    except Exception as exc:
        raise ConversionError(f"loading the checkpoints failed ({' '.join(str(exc).split())[:300]}).") from exc
    reference_name = "the source"
    cast = _stored_dtype(out_path)
    if cast is not None and cast != _stored_dtype(src_path):
        with torch.no_grad():
            for name, param in reference.named_parameters():
                if param.is_floating_point() and not _UNCAST_SOURCE_PARAMETERS.search(name):
                    param.copy_(param.to(cast).to(param.dtype))
        reference_name = f"the source with its weights cast to {dtype_name(cast)} as in OUT"

    vocab = min(reference.config.vocab_size, converted.config.vocab_size)
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab, (num_sequences, seq_len), generator=generator)
    if task is not CAUSAL_LM:
        per_token = task.suffix != "ForSequenceClassification"
        max_diff = _head_difference(reference, converted, input_ids, per_token)
        greedy_match = None
        max_new_tokens = 0
    else:
        with torch.no_grad():
            ref_logits = reference(input_ids).logits.float()
            new_logits = converted(input_ids).logits.float()
        max_diff = (ref_logits - new_logits).abs().max().item()
        greedy_match = True

    prompt = input_ids[:, : max(1, seq_len // 2)]
    if max_new_tokens:
        for row in prompt:
            row = row.unsqueeze(0)
            kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, num_beams=1, pad_token_id=0)
            with torch.no_grad():
                ref_tokens = reference.generate(row, attention_mask=torch.ones_like(row), **kwargs)
                new_tokens = converted.generate(row, attention_mask=torch.ones_like(row), **kwargs)
            greedy_match = greedy_match and torch.equal(ref_tokens, new_tokens)
    passed = (max_diff <= atol and greedy_match is not False) if expected_exact else None
    return {
        "max_abs_logit_diff": max_diff,
        "greedy_match": None if greedy_match is None else bool(greedy_match),
        "expected_exact": expected_exact,
        "passed": passed,
        "atol": atol,
        "reference": reference_name,
        "source_model_type": source_type,
        "diff_version": diff_version,
        "num_sequences": num_sequences,
        "seq_len": seq_len,
        "max_new_tokens": max_new_tokens,
        "dtype": dtype_name(torch_dtype),
    }


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
            ref, new = reference(ids, attention_mask=row_mask), converted(ids, attention_mask=row_mask)
            for key in ("logits", "start_logits", "end_logits"):
                if getattr(ref, key, None) is not None:
                    difference = (ref[key].float() - new[key].float()).abs()
                    if per_token:  # token classification, question answering: the unpadded positions
                        difference = difference[row_mask.bool()]
                    worst = max(worst, difference.max().item())
    return worst


def _stored_dtype(path: Path) -> torch.dtype | None:
    """The dtype a checkpoint stores its embedding matrix in (every weight the converter casts has it)."""
    headers = read_headers(path, find_shards(path))
    info = headers.get("model.embed_tokens.weight") or headers.get("transformer.embed_tokens.weight")
    return from_safetensors_code(info.dtype) if info is not None else None


__all__ = ["verify_conversion"]
