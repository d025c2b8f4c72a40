"""Writing safetensors shards as tensors arrive, with an index when there is more than one shard."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import torch

from ..checkpoints.weights import SAFETENSORS_INDEX, SAFETENSORS_SINGLE
from ..outputs.files import write_new_file
from .dtypes import SAFETENSORS_CODES
from .errors import ConversionError


_HEADER_BYTES_PER_TENSOR = 192  # a header entry is ~120 bytes for the longest Llama tensor names


def _check_fits_float16(name: str, tensor: torch.Tensor) -> None:
    """A cast to float16 turns values beyond ±65504 into inf (and the model's logits into NaN), silently: refused.
    `aminmax` reduces over views (V2's expanded query heads) without materialising them."""
    low, high = (float(v) for v in torch.aminmax(tensor.detach()))
    limit = torch.finfo(torch.float16).max
    if not (math.isfinite(low) and math.isfinite(high)) or max(-low, high) > limit:
        raise ConversionError(
            f"tensor {name} holds values in [{low:.4g}, {high:.4g}], beyond float16's range (±{limit:g}): the cast "
            "would make them inf; convert with --dtype bfloat16 (or float32, or keep the stored dtype)."
        )


class ShardWriter:
    """Streams tensors into safetensors shards as they arrive: each tensor's bytes go to disk at once, so memory holds
    one tensor, not one shard. The JSON header, whose offsets are known only at the end, goes into space reserved at
    the start of the file and padded with spaces (the safetensors format allows trailing header whitespace); if the
    reservation is too small the shard is rewritten once with a larger header. A shard is closed when told (or when it
    would exceed `max_shard_bytes`). Shards get their final `model-XXXXX-of-YYYYY.safetensors` names in `finish()`."""

    def __init__(self, directory: Path, max_shard_bytes: int | None = None, expected_tensors: int = 1024):
        self.directory = Path(directory)
        self.max_shard_bytes = max_shard_bytes
        self.header_reserve = 8 * (((expected_tensors + 8) * _HEADER_BYTES_PER_TENSOR) // 8)
        self._file = None
        self._path: Path | None = None
        self._entries: dict[str, dict] = {}
        self._pending_bytes = 0  # bytes written to the open shard
        self._written: list[tuple[Path, list[str]]] = []
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.total_bytes = 0
        self.total_parameters = 0

    def add(self, name: str, tensor: torch.Tensor, dtype: torch.dtype | None = None) -> None:
        """Append `tensor` to the open shard, cast to `dtype` (if given) slice by slice as it is written."""
        if name in self.shapes:
            raise ConversionError(f"internal error: output tensor {name} produced twice; please report this bug.")
        dtype = dtype or tensor.dtype
        if dtype not in SAFETENSORS_CODES:
            raise ConversionError(f"tensor {name} has dtype {dtype}, which safetensors cannot store.")
        if dtype == torch.float16 and tensor.dtype != torch.float16 and tensor.numel():
            _check_fits_float16(name, tensor)
        shape = tuple(getattr(tensor, "stored_shape", tensor.shape))  # see layout.stored_as
        size = tensor.numel() * dtype.itemsize
        if self.max_shard_bytes is not None and self._entries and self._pending_bytes + size > self.max_shard_bytes:
            self.close_shard()
        try:
            if self._file is None:
                self._open_shard()
            self._write(tensor.detach(), dtype)
        except OSError as exc:
            raise self._write_error(exc) from exc
        self._entries[name] = {
            "dtype": SAFETENSORS_CODES[dtype],
            "shape": list(shape),
            "data_offsets": [self._pending_bytes, self._pending_bytes + size],
        }
        self._pending_bytes += size
        self.shapes[name] = shape
        self.total_bytes += size
        self.total_parameters += tensor.numel()

    def _write(self, tensor: torch.Tensor, dtype: torch.dtype) -> None:
        """Write a tensor's bytes in row-major order without copying where its leading slices are contiguous: an
        expanded view (e.g. V2's duplicated query heads) goes out as views of the source, with no new allocation
        (a cast allocates one slice at a time)."""
        if tensor.is_contiguous():
            self._file.write(tensor.to(dtype).reshape(-1).view(torch.uint8).numpy())
        elif tensor.dim() > 1 and tensor.shape[0] <= 4096:
            for row in tensor:
                self._write(row, dtype)
        else:
            self._file.write(tensor.to(dtype).contiguous().reshape(-1).view(torch.uint8).numpy())

    def _write_error(self, exc: OSError) -> ConversionError:
        return ConversionError(
            f"writing shard {self._path.name} in {self.directory} failed ({exc}): "
            "check free disk space and permissions."
        )

    def _open_shard(self) -> None:
        self._path = self.directory / f".shard-{len(self._written):05d}.safetensors.part"
        self._file = _create(self._path)
        self._file.write(b" " * (8 + self.header_reserve))

    def close_shard(self) -> None:
        """Finish the open shard: write its header (no-op when nothing is open)."""
        if self._file is None:
            return
        header = json.dumps({"__metadata__": {"format": "pt"}, **self._entries}, separators=(",", ":")).encode()
        try:
            if len(header) <= self.header_reserve:
                self._file.seek(0)
                self._file.write(self.header_reserve.to_bytes(8, "little"))  # the rest of the reservation is spaces
                self._file.write(header)
                self._file.close()
            else:
                self._file.close()
                self._rewrite_with_header(header)
        except OSError as exc:
            raise self._write_error(exc) from exc
        self._written.append((self._path, list(self._entries)))
        self._file, self._entries, self._pending_bytes = None, {}, 0

    def _rewrite_with_header(self, header: bytes) -> None:
        header += b" " * (-len(header) % 8)  # keep the data 8-byte aligned
        rewritten = self._path.with_suffix(".rewrite")
        with open(self._path, "rb") as old, _create(rewritten) as new:
            new.write(len(header).to_bytes(8, "little"))
            new.write(header)
            old.seek(8 + self.header_reserve)
            shutil.copyfileobj(old, new, 16 << 20)
        os.replace(rewritten, self._path)

    def finish(self) -> list[str]:
        """Name the shards, write the index when sharded; returns the shard file names."""
        self.close_shard()
        count = len(self._written)
        if count == 0:
            raise ConversionError("internal error: no tensors were written; please report this bug.")
        names = (
            [SAFETENSORS_SINGLE]
            if count == 1
            else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
        )
        weight_map: dict[str, str] = {}
        for (path, tensors), name in zip(self._written, names, strict=True):
            os.replace(path, self.directory / name)
            weight_map.update(dict.fromkeys(tensors, name))
        if count > 1:
            index = {
                "metadata": {"total_size": self.total_bytes, "total_parameters": self.total_parameters},
                "weight_map": dict(sorted(weight_map.items())),
            }
            write_new_file(self.directory / SAFETENSORS_INDEX, json.dumps(index, indent=2) + "\n")
        return names


def _create(path: Path):
    """PATH opened for writing as a new file: never an existing one, nor through a link planted at its name."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0)
    return os.fdopen(os.open(path, flags, 0o666), "wb")


__all__ = ["ShardWriter"]
