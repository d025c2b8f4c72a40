"""Writing safetensors shards as tensors arrive, with an index when there is more than one shard."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from .errors import ConversionError


INDEX_NAME = "model.safetensors.index.json"


class ShardWriter:
    """Accumulates tensors for one output shard at a time and writes it when told (or when it would exceed
    `max_shard_bytes`). Shards get their final `model-XXXXX-of-YYYYY.safetensors` names in `finish()`."""

    def __init__(self, directory: Path, max_shard_bytes: int | None = None):
        self.directory = Path(directory)
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._written: list[tuple[Path, list[str]]] = []
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, torch.dtype] = {}
        self.total_bytes = 0
        self.total_parameters = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.shapes:
            raise ConversionError(f"internal error: output tensor {name} produced twice; please report this bug.")
        size = tensor.numel() * tensor.element_size()
        if self.max_shard_bytes is not None and self._pending and self._pending_bytes + size > self.max_shard_bytes:
            self.close_shard()
        self._pending[name] = tensor.detach().contiguous()
        self._pending_bytes += size
        self.shapes[name] = tuple(tensor.shape)
        self.dtypes[name] = tensor.dtype
        self.total_bytes += size
        self.total_parameters += tensor.numel()

    def close_shard(self) -> None:
        """Write what is pending as one shard (no-op when nothing is)."""
        if not self._pending:
            return
        from safetensors.torch import save_file

        path = self.directory / f".shard-{len(self._written):05d}.safetensors.part"
        try:
            save_file(self._pending, str(path), metadata={"format": "pt"})
        except Exception as exc:
            raise ConversionError(
                f"writing shard {path.name} in {self.directory} failed ({exc}): check free disk space and permissions."
            ) from exc
        self._written.append((path, list(self._pending)))
        self._pending = {}
        self._pending_bytes = 0

    def finish(self) -> list[str]:
        """Name the shards, write the index when sharded; returns the shard file names."""
        self.close_shard()
        count = len(self._written)
        if count == 0:
            raise ConversionError("internal error: no tensors were written; please report this bug.")
        names = (
            ["model.safetensors"]
            if count == 1
            else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
        )
        weight_map: dict[str, str] = {}
        for (path, tensors), name in zip(self._written, names, strict=True):
            os.replace(path, self.directory / name)
            weight_map.update({tensor: name for tensor in tensors})
        if count > 1:
            index = {
                "metadata": {"total_size": self.total_bytes, "total_parameters": self.total_parameters},
                "weight_map": dict(sorted(weight_map.items())),
            }
            (self.directory / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
        return names


__all__ = ["INDEX_NAME", "ShardWriter"]
