"""The weights of a checkpoint directory: which safetensors files hold them (an index, one file, or shards by name)
and what their headers say (every tensor's shard, shape and dtype), read without loading any tensor data. Pickle
weights (`*.bin`, `*.pth`, ...) are never opened: a checkpoint that has only those is refused."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import one_line
from . import CheckpointError


SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"
PICKLE_SUFFIXES = (".bin", ".pth", ".pt", ".ckpt", ".pkl")
# What every refusal of pickled weights says (a local directory here, a Hub repo in `loading.from_pretrained`).
PICKLE_REFUSAL = (
    "refusing to unpickle them (this package loads safetensors only): convert them in a trusted environment (load the "
    "model there with transformers and `save_pretrained(DIR)`, which writes model.safetensors) or use a revision that "
    "ships *.safetensors."
)


@dataclass(frozen=True)
class TensorInfo:
    shard: Path
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype code: "F32", "BF16", ...


def find_shards(path: Path) -> list[Path]:
    """The safetensors files holding the weights, in a stable order. Refuses pickle-only checkpoints."""
    index_file = path / SAFETENSORS_INDEX
    if index_file.is_file():
        weight_map = read_index(index_file)
        shards: list[Path] = []
        for name in sorted(set(weight_map.values())):
            shard = path / name
            if not shard.is_file():
                raise CheckpointError(
                    f"shard {name} listed in {SAFETENSORS_INDEX} is missing from {path}: re-download the checkpoint "
                    "(all shards are needed)."
                )
            shards.append(shard)
        return shards
    if (path / SAFETENSORS_SINGLE).is_file():
        return [path / SAFETENSORS_SINGLE]
    candidates = sorted(p for p in path.glob("model*.safetensors") if p.is_file())
    if candidates:
        return candidates
    pickles = sorted(p.name for p in path.iterdir() if p.is_file() and p.name.endswith(PICKLE_SUFFIXES))
    if pickles:
        raise CheckpointError(
            f"{path} holds only pickle weights "
            f"({', '.join(pickles[:3])}{', ...' if len(pickles) > 3 else ''}); {PICKLE_REFUSAL}"
        )
    raise CheckpointError(
        f"no model weights (*.safetensors) in {path}: download the full checkpoint, "
        "or point SRC at the directory that "
        "holds the shards."
    )


def read_index(index_file: Path) -> dict[str, str]:
    try:
        index = json.loads(index_file.read_text(encoding="utf-8"))
        weight_map = index["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise TypeError("weight_map is not a mapping of tensor names to file names")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{index_file} is corrupt ({one_line(exc)}): restore or re-download it.") from exc
    for name in weight_map.values():
        if Path(name).name != name or name in ("", ".", ".."):
            raise CheckpointError(
                f"{index_file} refers to {name!r}, "
                "which is not a file in the checkpoint directory: restore or re-download it."
            )
    return weight_map


def read_headers(path: Path, shards: list[Path]) -> dict[str, TensorInfo]:
    """Every tensor's shard, shape and dtype, from the safetensors headers (validates that each file is complete)."""
    from safetensors import safe_open

    tensors: dict[str, TensorInfo] = {}
    for shard in shards:
        try:
            with safe_open(shard, framework="pt") as handle:
                for name in handle.keys():
                    view = handle.get_slice(name)
                    info = TensorInfo(
                        shard=shard, shape=tuple(int(s) for s in view.get_shape()), dtype=str(view.get_dtype())
                    )
                    if name in tensors:
                        raise CheckpointError(
                            f"tensor {name} appears in both {tensors[name].shard.name} and {shard.name}: "
                            "the checkpoint mixes "
                            "two saves; re-download it."
                        )
                    tensors[name] = info
        except CheckpointError:
            raise
        except Exception as exc:  # SafetensorError, OSError
            raise CheckpointError(
                f"shard {shard.name} in {path} is corrupt or truncated ({one_line(exc)}): re-download it."
            ) from exc
    index_file = path / SAFETENSORS_INDEX
    if index_file.is_file():
        for name, file_name in read_index(index_file).items():
            info = tensors.get(name)
            if info is None or info.shard.name != file_name:
                raise CheckpointError(
                    f"{SAFETENSORS_INDEX} places tensor {name} in {file_name}, "
                    "but that shard does not hold it: the index "
                    "and the shards disagree; re-download the checkpoint."
                )
    return tensors


__all__ = [
    "PICKLE_REFUSAL",
    "PICKLE_SUFFIXES",
    "SAFETENSORS_INDEX",
    "SAFETENSORS_SINGLE",
    "TensorInfo",
    "find_shards",
    "read_headers",
    "read_index",
]
