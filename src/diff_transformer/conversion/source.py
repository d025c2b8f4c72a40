"""The converter's view of SRC (local directory or Hub id): what a Hub download fetches, its config, which files
beside the weights are copied, and its tensor headers (`checkpoints.weights`), without loading any tensor data.
Tensors are read one at a time later by the converter.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from ..checkpoints.configs import check_model_type, read_json
from ..checkpoints.names import hub_id
from ..checkpoints.weights import SAFETENSORS_INDEX, TensorInfo, find_shards, read_headers
from .errors import ConversionError, one_line


_FLOAT_DTYPES = {"F32", "F16", "BF16"}

# The files of SRC that are copied into OUT beside the converted weights (OUT is what users push): tokenizer, chat
# template, generation config, licence. Anything else (secrets.env, id_rsa, notes...) is not copied, and is named.
SIDE_FILE_PATTERNS = [
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "*.model",
    "*.tiktoken",
    "*.jinja",
    "chat_template.json",
    "generation_config.json",
    "LICENSE*",
    "LICENCE*",
    "NOTICE*",
    "COPYING*",
    "USE_POLICY*",
]
# What a Hub download fetches: transformers' safetensors weights only (not pickles, nor e.g. a duplicate
# consolidated.safetensors), the config and index, the card (for its licence) and the side files.
HUB_ALLOW_PATTERNS = ["model*.safetensors", "config.json", SAFETENSORS_INDEX, "README.md", *SIDE_FILE_PATTERNS]
HUB_IGNORE_PATTERNS = ["original/*", "*/original/*"]


@dataclass
class SourceCheckpoint:
    """A validated-on-read view of a checkpoint directory: config and tensor headers, no tensor data."""

    path: Path
    repo_id: str | None
    config: dict
    shards: list[Path]
    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    revision: str | None = None
    token: str | bool | None = field(default=None, repr=False)

    @property
    def model_type(self) -> str | None:
        return self.config.get("model_type")

    def tensors_in(self, shard: Path) -> list[str]:
        return [name for name, info in self.tensors.items() if info.shard == shard]


def resolve_source(
    src: str | os.PathLike, *, revision: str | None = None, token: str | bool | None = None, config_only: bool = False
) -> tuple[Path, str | None]:
    """A local directory as is, or a Hub model id downloaded (or found in the HF cache) with `snapshot_download`.

    Returns the local directory and the Hub id (None for a local directory). Honours `HF_HOME`, `HF_HUB_CACHE` and
    `HF_HUB_OFFLINE` through huggingface_hub. With `config_only`, a Hub id only fetches config.json (into the
    snapshot directory that a later full download completes), so a wrong model is refused before gigabytes arrive.
    """
    text = os.fspath(src)
    if not text.strip():  # Path("") is the current directory: an unset shell variable would convert whatever is here
        raise ConversionError("SRC is empty (an unset shell variable?): pass a checkpoint directory or a Hub id.")
    path = Path(text).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ConversionError(
                f"SRC {path} is a file, not a checkpoint directory: pass the directory that holds config.json and the "
                "*.safetensors shards, or a Hub model id."
            )
        return path.resolve(), None
    if isinstance(src, Path):
        raise ConversionError(
            f"SRC {text!r} is neither an existing directory nor a valid Hub model id: check the path."
        )
    text = hub_id(text, name="SRC")  # a mistyped path is refused here, not after Hub retries
    if config_only:
        return _hub_config_dir(text, revision=revision, token=token), text
    return download_snapshot(text, revision=revision, token=token), text


def download_snapshot(repo_id: str, *, revision: str | None = None, token: str | bool | None = None) -> Path:
    """`snapshot_download` of the files a conversion needs: safetensors weights (never pickles), JSON configs,
    tokenizer files, chat templates, the card and licence files."""
    from huggingface_hub import snapshot_download

    return Path(
        _hub_call(
            snapshot_download,
            repo_id,
            revision=revision,
            token=token,
            allow_patterns=HUB_ALLOW_PATTERNS,
            ignore_patterns=HUB_IGNORE_PATTERNS,
        )
    )


def _hub_config_dir(repo_id: str, *, revision: str | None, token: str | bool | None) -> Path:
    from huggingface_hub import hf_hub_download

    return Path(_hub_call(hf_hub_download, repo_id, filename="config.json", revision=revision, token=token)).parent


def _hub_call(function, repo_id: str, *, revision: str | None, **kwargs):
    from huggingface_hub import errors

    try:
        return function(repo_id, revision=revision, **kwargs)
    except errors.GatedRepoError as exc:
        raise ConversionError(
            f"Hub model {repo_id!r} is gated: "
            "accept its licence on huggingface.co and log in (`hf auth login` or HF_TOKEN)."
        ) from exc
    except errors.RepositoryNotFoundError as exc:
        raise ConversionError(
            f"{repo_id!r} is not a local directory and no Hub model of that id was found "
            "(or it is private): check the "
            "path or id, or log in with `hf auth login` / HF_TOKEN."
        ) from exc
    except errors.RevisionNotFoundError as exc:
        raise ConversionError(
            f"revision {revision!r} of Hub model {repo_id!r} does not exist: pass an existing branch, tag or commit."
        ) from exc
    except errors.RemoteEntryNotFoundError as exc:
        raise ConversionError(
            f"Hub model {repo_id!r} has no config.json: "
            "it is not a transformers checkpoint; pick a transformers model repository."
        ) from exc
    except errors.LocalEntryNotFoundError as exc:
        raise ConversionError(
            f"Hub model {repo_id!r} is not in the local HF cache and cannot be downloaded "
            "(offline or HF_HUB_OFFLINE=1): "
            "download it once while online, or pass a local directory."
        ) from exc
    except Exception as exc:  # network errors, HTTP errors, disk errors
        raise ConversionError(
            f"downloading Hub model {repo_id!r} failed: {one_line(exc)}; retry, or pass a local directory."
        ) from exc


def load_config(path: Path) -> dict:
    config_file = path / "config.json"
    if not config_file.is_file() and (path / "adapter_config.json").is_file():
        raise ConversionError(
            f"{path} is a PEFT adapter, not a model: merge it into its base first (diff-transformer merge ADAPTER OUT)"
        )
    if not config_file.is_file():
        raise ConversionError(
            f"no config.json in {path}: SRC must be a transformers checkpoint directory "
            "(config.json + *.safetensors); "
            "save the model with `save_pretrained` or download the full repository."
        )
    config = read_json(config_file)
    if not isinstance(config, dict):
        raise ConversionError(f"{config_file} does not hold a JSON object: restore or re-download it.")
    check_model_type(config, str(config_file))
    return config


def open_source(
    src: str | os.PathLike, *, revision: str | None = None, token: str | bool | None = None
) -> SourceCheckpoint:
    """Resolve SRC and read its config (for a Hub id, only config.json is fetched: see `read_weights_headers`)."""
    path, repo_id = resolve_source(src, revision=revision, token=token, config_only=True)
    source = SourceCheckpoint(path=path, repo_id=repo_id, config=load_config(path), shards=[])
    source.revision, source.token = revision, token
    return source


def is_causal_lm(source_path: Path) -> bool:
    """Whether SRC's config.json names only causal-LM architectures (none named: a causal LM): something the
    calibration can sample text from and score a next-token loss with."""
    import json

    try:
        config = json.loads((Path(source_path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return all(name.endswith("ForCausalLM") for name in config.get("architectures") or ["ForCausalLM"])


def read_weights_headers(source: SourceCheckpoint) -> None:
    """Download the rest of a Hub snapshot if needed, then read every shard's header."""
    if source.repo_id is not None:
        source.path = download_snapshot(source.repo_id, revision=source.revision, token=source.token)
    source.shards = find_shards(source.path)
    source.tensors = read_headers(source.path, source.shards)


def check_float_dtypes(source: SourceCheckpoint) -> None:
    for name, info in source.tensors.items():
        if info.dtype not in _FLOAT_DTYPES:
            raise ConversionError(
                f"tensor {name} has dtype {info.dtype}: "
                "only float32/float16/bfloat16 checkpoints convert; dequantize the "
                "model first."
            )


__all__ = [
    "HUB_ALLOW_PATTERNS",
    "SIDE_FILE_PATTERNS",
    "HUB_IGNORE_PATTERNS",
    "SourceCheckpoint",
    "check_float_dtypes",
    "download_snapshot",
    "is_causal_lm",
    "load_config",
    "open_source",
    "read_weights_headers",
    "resolve_source",
]
