"""Local text for causal-LM training: read, tokenise, pack into fixed-size blocks, hold out a split.

* A `.jsonl` file holds one document per line (a JSON object; its `text_field` is the text); any other file is one
  document, read as UTF-8.
* Every document is tokenised without special tokens and followed by the eos token; the documents of all files are
  concatenated into one stream, in the order given.
* The stream is cut into consecutive blocks of `block_size` tokens. With a bos token, each block is bos followed by
  `block_size - 1` stream tokens (every window then looks like the start of a sequence, as in the shipped tiny
  Llama's training); the tail shorter than a block is dropped. Labels are the inputs (the model shifts them).
* The held-out split takes evenly spaced whole blocks (no randomness), so train and eval never share a token.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from ..text_input import parse_json_line
from . import TrainingError


def _read_text(path: Path) -> str:
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise TrainingError(
            f"data file {path} is not UTF-8 text (byte {error.start} cannot be decoded): convert it to UTF-8 "
            "(e.g. iconv -t UTF-8) or leave it out"
        ) from None
    if "\x00" in text:
        raise TrainingError(f"data file {path} is binary (it holds NUL bytes), not text: pass .txt or .jsonl files")
    return text.replace("\r\n", "\n").replace("\r", "\n")  # universal newlines, as open() in text mode reads


def require_files(paths, kind: str = "data") -> None:
    """Refuse the first of `paths` that is not a file, before any time goes into tokenising the others."""
    for path in paths:
        if Path(path).is_dir():
            example = Path(path) / ("*.jsonl" if kind == "chat data" else "*.txt")
            raise TrainingError(
                f"{kind} file {path} is a directory: name its files (e.g. {example}, which the shell expands)"
            )
        if not Path(path).is_file():
            raise TrainingError(f"{kind} file {path} does not exist (or is not a file)")


def read_documents(path: str | Path, text_field: str = "text") -> Iterator[str]:
    path = Path(path)
    require_files([path])
    text = _read_text(path)
    if path.suffix.lower() != ".jsonl":
        yield text
        return
    for number, line in enumerate(text.split("\n"), 1):  # not splitlines(): JSON strings may hold U+2028
        if not line.strip():
            continue
        record = parse_json_line(line, f"{path}:{number}")
        if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
            raise TrainingError(
                f"{path}:{number}: no string field {text_field!r} (choose the field with --text-field)"
            )
        yield record[text_field]


def tokenize_files(tokenizer, paths: Sequence[str | Path], text_field: str = "text") -> list[int]:
    """The token stream of all documents of `paths`: tokens of each document followed by eos."""
    stream: list[int] = []
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    for path in paths:
        for text in read_documents(path, text_field):
            if text:
                stream.extend(tokenizer(text, add_special_tokens=False, verbose=False).input_ids)
                stream.extend(eos)
    return stream


def pack(stream: Sequence[int], block_size: int, bos_token_id: int | None = None) -> torch.Tensor:
    """(n_blocks, block_size) LongTensor: consecutive slices of `stream`, each after `bos_token_id` if given."""
    span = block_size - (bos_token_id is not None)
    if span < 1:
        raise TrainingError(f"block size {block_size} is too small")
    n = len(stream) // span
    blocks = torch.tensor(stream[: n * span], dtype=torch.long).view(n, span)
    if bos_token_id is not None:
        blocks = torch.cat([torch.full((n, 1), bos_token_id, dtype=torch.long), blocks], dim=1)
    return blocks


def held_out_indices(n_blocks: int, fraction: float) -> torch.Tensor:
    """round(fraction * n) block indices spread evenly over [0, n) (at least one when fraction > 0)."""
    if fraction <= 0:
        return torch.empty(0, dtype=torch.long)
    n_eval = max(1, round(fraction * n_blocks))
    return ((torch.arange(n_eval, dtype=torch.float64) + 0.5) * n_blocks / n_eval).long()


class BlockDataset(torch.utils.data.Dataset):
    """Packed blocks as the dicts Trainer's default collator stacks."""

    def __init__(self, blocks: torch.Tensor):
        self.blocks = blocks

    def __len__(self) -> int:
        return self.blocks.shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.blocks[i], "labels": self.blocks[i]}


def build_datasets(
    tokenizer,
    data: Sequence[str | Path],
    block_size: int,
    *,
    eval_data: Sequence[str | Path] | None = None,
    eval_fraction: float = 0.05,
    text_field: str = "text",
    bos: bool = True,
) -> tuple[BlockDataset, BlockDataset | None]:
    """(train, eval) datasets; eval is `eval_data` packed alike, else a `eval_fraction` split of `data` (or None)."""
    require_files([*data, *(eval_data or [])])
    if not 0 <= eval_fraction < 1:
        raise TrainingError(f"--eval-fraction {eval_fraction} must be in [0, 1)")
    bos_id = tokenizer.bos_token_id if bos else None

    def blocks_of(paths, role):
        stream = tokenize_files(tokenizer, paths, text_field)
        blocks = pack(stream, block_size, bos_id)
        if len(blocks) == 0:
            names = ", ".join(str(p) for p in paths)
            raise TrainingError(
                f"{role} data ({names}) has {len(stream)} tokens, fewer than one block of {block_size}: "
                "add text or lower --block-size"
            )
        return blocks

    blocks = blocks_of(data, "training")
    if eval_data:
        return BlockDataset(blocks), BlockDataset(blocks_of(eval_data, "eval"))
    held = held_out_indices(len(blocks), eval_fraction)
    if len(held) == 0:
        return BlockDataset(blocks), None
    keep = torch.ones(len(blocks), dtype=torch.bool)
    keep[held] = False
    if not keep.any():
        raise TrainingError(
            f"only {len(blocks)} block(s) of {block_size} tokens: nothing left to train on after holding out "
            f"{len(held)}; add text, lower --block-size or --eval-fraction, or pass --eval-data"
        )
    return BlockDataset(blocks[keep]), BlockDataset(blocks[held])
