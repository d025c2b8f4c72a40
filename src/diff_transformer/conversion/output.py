"""What the converter puts in OUT beside the config and the card: the tensors streamed from SRC through the tensor
map into shards (`stream_tensors`), checked against the model class that will load them
(`check_output_against_model`), the custom code, and the side files of SRC that a model needs (tokenizer, chat
template, generation config, licence), nothing else."""

from __future__ import annotations

import fnmatch
import logging
import re
import shutil
from pathlib import Path

import torch

from ..checkpoints import CUSTOM_CODE_FILES
from .errors import ConversionError, one_line
from .layout import IGNORED_SOURCE_TENSORS
from .source import SIDE_FILE_PATTERNS, SourceCheckpoint
from .writer import ShardWriter


# SRC files the converter writes anew in OUT, and SRC's weights (any format, never copied): not named as skipped.
_REWRITTEN = ("config.json", "README.md", "model.safetensors.index.json")
_WEIGHT_FILES = re.compile(r"\.(safetensors|bin|pth|pt|ckpt|pkl|h5|msgpack|onnx|gguf)$", re.IGNORECASE)
# V1's λ vectors feed an exp() and stay float32 whatever `dtype` asks (DiffPreTrainedModel keeps them in fp32 too).
_FP32_PARAMETERS = re.compile(r"\.diff_lambda\.lambda_[qk][12]$")
logger = logging.getLogger(__name__)


def stream_tensors(
    source: SourceCheckpoint, tensor_map, writer: ShardWriter, target_dtype, progress: bool, desc: str
) -> None:
    """Every tensor of SRC, shard by shard, through TENSOR_MAP into WRITER (cast to TARGET_DTYPE, V1's λ vectors
    apart), reporting the tensors done (`progress.Progress`, titled DESC)."""
    from safetensors import safe_open

    from ..progress import Progress

    bar = Progress(desc, total=len(source.tensors), unit="tensor", enabled=progress, leave=True)
    try:
        for shard in source.shards:
            names = source.tensors_in(shard)
            try:
                handle_cm = safe_open(shard, framework="pt")
            except Exception as exc:
                raise ConversionError(
                    f"shard {shard.name} is corrupt or truncated ({one_line(exc)}): re-download it."
                ) from exc
            with handle_cm as handle:
                for name in names:
                    bar.update(1)
                    if IGNORED_SOURCE_TENSORS.match(name):
                        continue
                    try:
                        tensor = handle.get_tensor(name)
                    except Exception as exc:
                        raise ConversionError(
                            f"reading tensor {name} from shard {shard.name} failed ({one_line(exc)}): "
                            "the shard is corrupt; re-download it."
                        ) from exc
                    for out_name, out_tensor in tensor_map(name, tensor):
                        keep = target_dtype is None or _FP32_PARAMETERS.search(out_name)
                        writer.add(out_name, out_tensor, dtype=None if keep else target_dtype)
                    del tensor
            if writer.max_shard_bytes is None:
                writer.close_shard()  # mirror the input sharding
    finally:
        bar.close()


def check_output_against_model(config, writer: ShardWriter) -> None:
    """The written state dict must be exactly what `DiffForCausalLM(config)` (or the task head's class) expects
    (names and shapes)."""
    from .. import modeling_diff

    with torch.device("meta"):
        model = getattr(modeling_diff, config.architectures[0])(config)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if config.tie_word_embeddings and "lm_head.weight" not in writer.shapes:
        expected.pop("lm_head.weight", None)
    if expected != writer.shapes:
        missing = sorted(set(expected) - set(writer.shapes))
        extra = sorted(set(writer.shapes) - set(expected))
        wrong = sorted(n for n in set(expected) & set(writer.shapes) if expected[n] != writer.shapes[n])
        raise ConversionError(
            f"internal error: converted tensors do not match {type(model).__name__} (missing {missing[:3]}, "
            f"unexpected {extra[:3]}, wrong shapes {wrong[:3]}); please report this bug."
        )


def copy_side_files(source: SourceCheckpoint, target: Path) -> list[str]:
    """The top-level files of SRC that `SIDE_FILE_PATTERNS` allows (tokenizer, chat template, generation config,
    licence...); every other file is named in a note, never copied (OUT is what users push: a secrets.env or id_rsa
    in SRC must not end up on the Hub). A symbolic link is followed only to a file inside SRC (for a Hub id: inside
    its cache folder, where snapshots link to blobs). Returns the names copied."""
    root = (source.path.parent.parent if source.repo_id is not None else source.path).resolve()
    copied, skipped = [], []
    for path in sorted(source.path.iterdir()):
        if path.name in _REWRITTEN or path.name.startswith(".") or path.is_dir():
            continue
        if not any(fnmatch.fnmatchcase(path.name, pattern) for pattern in SIDE_FILE_PATTERNS):
            skipped.append(path.name)
            continue
        if path.is_symlink() and root not in path.resolve().parents:
            logger.warning(f"note: not copying {path.name}: it is a symbolic link to {path.resolve()}, outside SRC.")
            continue
        if not path.is_file():  # a FIFO, a device, a dangling link: never opened
            logger.warning(f"note: not copying {path.name}: it is not a regular file.")
            continue
        shutil.copyfile(path, target / path.name)
        copied.append(path.name)
    weights = [name for name in skipped if _WEIGHT_FILES.search(name)]
    others = [name for name in skipped if name not in weights]
    if others:
        shown = ", ".join(others[:8]) + (f" and {len(others) - 8} more" if len(others) > 8 else "")
        logger.warning(
            f"note: not copied from SRC into OUT (not a tokenizer, chat template, generation config or licence file): "
            f"{shown}; copy what the converted model needs yourself."
        )
    return copied


def copy_custom_code(target: Path) -> None:
    package = Path(__file__).resolve().parent.parent
    for name in CUSTOM_CODE_FILES:
        shutil.copyfile(package / name, target / name)


__all__ = ["check_output_against_model", "copy_custom_code", "copy_side_files", "stream_tensors"]
