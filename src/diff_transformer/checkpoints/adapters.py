"""PEFT adapter directories (what `diff-transformer train --lora` writes) as MODEL on the command line.

An adapter directory holds `adapter_config.json` and the adapter's weights, not a model: its base model is named by
`base_model_name_or_path` in adapter_config.json, or by `--base`. What this package's runs save names the base there
so that PEFT itself finds it from any directory (`name_base`: the base's absolute directory, or its Hub id), and also
holds `base_model.json` (`record_base`): the base's directory relative to the adapter and absolute (or its Hub id), the
name it was given, and a fingerprint of its weights, so that the base resolves the same from any directory, also
after adapter and base moved together, and a base with other weights (another model under the same name) is refused
in one line. `generate`,
`inspect` and `train` load the base and put the adapter on it (PEFT's `PeftModel.from_pretrained`); `merge` folds
it into the base weights (`merge_and_unload`) and writes a full Diff checkpoint. `adapter_card` replaces the blank
template PEFT writes as the adapter's README.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import struct
import warnings
from pathlib import Path
from typing import NamedTuple

from ..errors import require
from ..outputs.files import write_new_file
from . import CheckpointError
from .configs import read_json
from .names import HUB_PREFIX, resolve_model
from .schema import ADAPTER_FIELDS, BASE_RECORD_FIELDS, FINGERPRINT_FIELDS, field_problem


ADAPTER_CONFIG = "adapter_config.json"
MERGE_MARK = "diff-transformer merge"  # `written_by` of the manifest in what merge writes
BASE_RECORD = "base_model.json"
FINGERPRINT_SAMPLE_BYTES = 1 << 16  # per tensor: the start of its data (different training differs everywhere)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


class Source(NamedTuple):
    """A command-line MODEL, resolved: where the model (for an adapter: its base) and the tokenizer load from."""

    location: str  # what `from_pretrained` of the model (an adapter's base) takes
    local: Path | None  # its local directory, None for a Hub id
    adapter: Path | None  # the adapter directory, None when MODEL is a model
    base: str | None  # an adapter's base model as named (adapter_config.json or --base)
    tokenizer: str  # where the tokenizer loads from: the adapter directory when it has one, else the model
    tokenizer_local: Path | None  # its local directory, None for a Hub id


def is_adapter(local: Path | None) -> bool:
    return local is not None and (local / ADAPTER_CONFIG).is_file()


def read_adapter_config(directory: Path) -> dict:
    """DIRECTORY's adapter_config.json, checked to be a JSON object whose base model (if named) is a string: else a
    `CheckpointError` naming the file (PEFT and this module would fail on it in a traceback)."""
    path = Path(directory) / ADAPTER_CONFIG
    config = read_json(path)
    if not isinstance(config, dict):
        raise CheckpointError(
            f"{path} holds a JSON {type(config).__name__}, not an object (a PEFT adapter's config): restore it, or "
            "re-save the adapter."
        )
    base = config.get("base_model_name_or_path")
    if base is not None and not isinstance(base, str):
        raise CheckpointError(
            f"{path}: base_model_name_or_path is {json.dumps(base)[:40]}, not a model name: fix it, or pass --base."
        )
    problem = field_problem(config, ADAPTER_FIELDS)
    if problem:
        raise CheckpointError(f"{path}: {problem}: fix it, or re-save the adapter.")
    return config


def has_tokenizer(local: Path | None) -> bool:
    return local is not None and any((local / name).is_file() for name in _TOKENIZER_FILES)


def resolve(text, base: str | None = None, *, name: str = "MODEL") -> Source:
    """MODEL as `Source`; for an adapter directory, its base (checked to exist, or one line saying how to name it)."""
    location, local = resolve_model(text, name=name)
    if not is_adapter(local):
        if base is not None:
            raise CheckpointError(
                f"--base {base} is for a PEFT adapter directory, but {name} {text} is a model: drop --base."
            )
        return Source(location, local, None, None, location, local)
    require(["peft"], "peft", f"{name} {text} (a PEFT adapter)")
    read_adapter_config(local)
    record = read_json(local / BASE_RECORD) if (local / BASE_RECORD).is_file() else None
    if record is not None:  # written by `record_base`; a hand-edited one is refused in one line
        problem = field_problem(record, BASE_RECORD_FIELDS)
        if problem is None and record.get("fingerprint") is not None:
            problem = field_problem(record["fingerprint"], FINGERPRINT_FIELDS)
            problem = problem and f"fingerprint: {problem}"
        if problem:
            raise CheckpointError(
                f"{local / BASE_RECORD}: {problem}: fix it, or delete it and pass --base PATH (the model the adapter "
                "was trained on)."
            )
    named = shown = base
    if named is None and isinstance(record, dict):
        named = _recorded_base(record, local, f"{name} {text}")
        # shown as the training run was given it (the card, merge's card): where it is now is what loads
        shown = record.get("named") or read_adapter_config(local).get("base_model_name_or_path") or named
    if named is None:
        named = read_adapter_config(local).get("base_model_name_or_path")
        if not named:
            raise CheckpointError(
                f"{name} {text} is a PEFT adapter whose {ADAPTER_CONFIG} names no base model: pass --base MODEL."
            )
        shown = named
    try:
        base_location, base_local = resolve_model(named, name="base model")
    except CheckpointError:
        where = "--base" if base is not None else f"base_model_name_or_path in {local / ADAPTER_CONFIG}"
        raise CheckpointError(
            f"{name} {text} is a PEFT adapter for the base model {named!r} ({where}), which does not exist here: "
            f"pass --base PATH (the model it was trained on), or {HUB_PREFIX}ID for a Hub model."
        ) from None
    if isinstance(record, dict) and base_local is not None:
        _check_fingerprint(record, base_local, f"{name} {text}")
    if base_local is not None and is_adapter(base_local):
        raise CheckpointError(
            f"the base model {named} of {name} {text} is itself an adapter: pass --base with the model."
        )
    if has_tokenizer(local):
        return Source(base_location, base_local, local, str(shown), location, local)
    return Source(base_location, base_local, local, str(shown), base_location, base_local)


# --- the base an adapter was trained on ------------------------------------------------------------------------------


def weights_fingerprint(directory: Path) -> dict | None:
    """Size, shape and a content hash of DIRECTORY's safetensors weights, read from the headers and the start of each
    tensor's data (a few MB for any model): {"tensors", "parameters", "sha256"}; None without safetensors files."""
    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        return None
    tensors, digest = {}, hashlib.sha256()
    for file in files:
        with open(file, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
            header.pop("__metadata__", None)
            for key, info in header.items():
                handle.seek(8 + length + info["data_offsets"][0])
                size = min(FINGERPRINT_SAMPLE_BYTES, info["data_offsets"][1] - info["data_offsets"][0])
                tensors[key] = (info["dtype"], info["shape"], hashlib.sha256(handle.read(size)).hexdigest())
    parameters = 0
    for key in sorted(tensors):
        dtype, shape, sample = tensors[key]
        digest.update(json.dumps([key, dtype, shape, sample]).encode())
        count = 1
        for size in shape:
            count *= size
        parameters += count
    return {"tensors": len(tensors), "parameters": parameters, "sha256": digest.hexdigest()}


def record_base(adapter_dir, base: Path | str, named: str | None = None) -> None:
    """Write ADAPTER_DIR/base_model.json: BASE (the local directory the adapter was trained on, or a Hub id) as a path
    relative to the adapter directory and as an absolute one, the fingerprint of its weights, and NAMED, the base as
    the user gave it (what cards show: an absolute path would tell the Hub about the trainer's disk)."""
    adapter_dir = Path(adapter_dir)
    if isinstance(base, Path):
        absolute = base.resolve()
        record = {
            "relative": os.path.relpath(absolute, adapter_dir.resolve()),
            "absolute": str(absolute),
            "fingerprint": weights_fingerprint(absolute),
        }
    else:
        record = {"hub_id": str(base)}
    if named is not None:
        record["named"] = str(named)
    write_new_file(adapter_dir / BASE_RECORD, json.dumps(record, indent=2) + "\n")  # never through a link


def peft_base_name(base: Path | str) -> str:
    """What adapter_config.json's `base_model_name_or_path` says for BASE (a local directory, or a Hub id) so that
    PEFT (`AutoPeftModelForCausalLM`, `PeftConfig`) loads it from any working directory: the absolute directory, or
    the Hub id without `hf://`."""
    return str(base.resolve()) if isinstance(base, Path) else str(base).removeprefix(HUB_PREFIX)


def name_base(model, base: Path | str) -> None:
    """Make every adapter of the PEFT MODEL name BASE the way `peft_base_name` says, in memory, so that each save
    (the run's checkpoints and its end) writes it. PEFT takes the name from the base's `name_or_path`, which is the
    name as typed ("tiny-diff"): from another directory it is another model or none, and PEFT then asks the Hub."""
    for config in model.peft_config.values():
        config.base_model_name_or_path = peft_base_name(base)


def _recorded_base(record: dict, adapter: Path, shown: str) -> str | None:
    """The base the record names: the first of (relative to the adapter, absolute) that exists and has the recorded
    weights, else the Hub id; None for a record that names neither (the caller falls back to adapter_config.json)."""
    if record.get("hub_id"):
        return HUB_PREFIX + str(record["hub_id"]).removeprefix(HUB_PREFIX)
    candidates = []
    for key in ("relative", "absolute"):
        if record.get(key):
            path = (adapter / record[key]) if key == "relative" else Path(record[key])
            if (path / "config.json").is_file() and path.resolve() not in candidates:
                candidates.append(path.resolve())
    if not candidates:
        if not (record.get("relative") or record.get("absolute")):
            return None
        raise CheckpointError(
            f"{shown} is a PEFT adapter whose base model is not where it was ({record.get('absolute')}, "
            f"{record.get('relative')} from the adapter): pass --base PATH (the model it was trained on)."
        )
    for path in candidates:
        if _fingerprint_problem(record, path) is None:
            return str(path)
    _check_fingerprint(record, candidates[0], shown)  # raises
    return None


def _fingerprint_problem(record: dict, base: Path) -> str | None:
    recorded = record.get("fingerprint")
    if not recorded:
        return None
    here = weights_fingerprint(base)
    if here == recorded:
        return None
    if here is None:
        return "it has no safetensors weights"
    if (here["tensors"], here["parameters"]) != (recorded["tensors"], recorded["parameters"]):
        return (
            f"{here['tensors']} tensors, {here['parameters']:,} parameters where the adapter's base had "
            f"{recorded['tensors']}, {recorded['parameters']:,}"
        )
    return f"other weights: sha256 {here['sha256'][:12]}, the adapter's base {recorded['sha256'][:12]}"


def _check_fingerprint(record: dict, base: Path, shown: str) -> None:
    problem = _fingerprint_problem(record, base)
    if problem is not None:
        raise CheckpointError(
            f"{shown} was trained on another base than {base} ({problem}, {BASE_RECORD}): pass --base with the "
            "model it was trained on."
        )


def load_tokenizer(auto_tokenizer, location: str, local: Path | None, shown: str):
    """The model's tokenizer; None when it has none (prompts are then token ids)."""
    has_files = has_tokenizer(local)
    try:
        return auto_tokenizer.from_pretrained(location)
    except Exception as exc:  # transformers raises OSError, ValueError, TypeError... for a missing or broken tokenizer
        if has_files:
            message = " ".join(str(exc).split())[:200]
            raise CheckpointError(
                f"the tokenizer files of MODEL {shown} cannot be loaded ({message}): restore them."
            ) from None
        return None


def _not_the_kernel_notice(record) -> bool:
    return "gemm_4bit_forward from kernels-community" not in record.getMessage()


def hide_bitsandbytes_kernel_notice() -> None:
    """transformers' Trainer imports peft, which imports bitsandbytes, whose CPU backend then logs (its own Python
    logger, which neither transformers' verbosity nor --quiet's warning filter reach) that the optional `kernels`
    package is missing, advising `pip install kernels` (a kernel fetched from the Hub at run time). That only concerns
    4-bit weights: other runs and --quiet do not show it. Relies on bitsandbytes (0.50) logging it at import through
    `logging.getLogger("bitsandbytes.backends.cpu.ops")` with that text; guarded by tests/training/test_train.py::
    test_bitsandbytes_kernel_notice_is_hidden_outside_4bit and tests/cli/test_cli.py::
    test_quiet_hides_the_bitsandbytes_kernel_notice. Idempotent (one filter object)."""
    logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_not_the_kernel_notice)


@contextlib.contextmanager
def quiet_peft_wrapping():
    """PEFT (0.21) asks every model it wraps for `is_gradient_checkpointing`, which transformers 5 deprecated with a
    FutureWarning: not ours to act on, so it is not shown (any other warning is)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


def put_adapter_on(base, source: Source, *, merge: bool = False, trainable: bool = False, prepare=None):
    """BASE (the loaded base model of SOURCE, an adapter) with the adapter on it: merged into the weights with
    `merge`, trainable with `trainable`; `prepare(base)`, e.g. for 4-bit training, runs before the adapter goes on."""
    hide_bitsandbytes_kernel_notice()  # peft imports bitsandbytes, whose notice concerns 4-bit weights only
    from peft import PeftModel

    if prepare is not None:
        base = prepare(base)
    try:
        with quiet_peft_wrapping(), warnings.catch_warnings(record=True) as caught:
            warnings.filterwarnings("always", message="Found missing adapter keys")  # seen every time, not once
            model = PeftModel.from_pretrained(base, source.adapter, is_trainable=trainable)
    except Exception as exc:
        message = " ".join(str(exc).split())[:300] or type(exc).__name__
        raise CheckpointError(
            f"cannot put the adapter {source.adapter} on the base model {source.base} ({message}): "
            "pass --base with the model it was trained on."
        ) from None
    for warning in caught:
        missing = _MISSING_KEYS.search(str(warning.message))
        if missing is None:
            warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
            continue
        # PEFT fills what the file lacks with its initial values and goes on (a warning): e.g. adapter_config.json
        # says use_dora but the file holds no lora_magnitude_vector, and the "adapter" computes something else.
        names = re.findall(r"'([^']+)'", missing.group(1))
        raise CheckpointError(
            f"the adapter {source.adapter} lacks {len(names)} weight(s) its adapter_config.json asks for, e.g. "
            f"{names[0] if names else missing.group(1)[:120]} (use_dora needs lora_magnitude_vector): save the "
            "adapter again with PEFT, or fix adapter_config.json."
        )
    return model.merge_and_unload() if merge else model


_MISSING_KEYS = re.compile(r"Found missing adapter keys while loading the checkpoint: \[(.*)\]", re.S)


# --- the adapter's card ------------------------------------------------------------------------------------------


def _lambda_text(config, lora: dict) -> str:
    trained = "diff_lambda" in (lora.get("modules_to_save") or [])
    if getattr(config, "model_type", None) != "diff":
        return "The base model has no λ (not a Diff model)."
    if config.diff_version == 1:
        what = "λ = exp(λ_q1·λ_k1) − exp(λ_q2·λ_k2) + λ_init, one learned scalar per layer"
    else:
        what = "λ = sigmoid(W_λ x), one value per token and differential head (`diff_lambda.proj`)"
    how = (
        'trained in full and saved with the adapter (`modules_to_save=["diff_lambda"]`)'
        if trained
        else "frozen: the base model's λ is used"
    )
    return f"Diff Transformer V{config.diff_version}: {what}; {how}."


def adapter_card(base: str, config, lora: dict, name: str, lambda_summary: str | None = None):
    """The README.md of an adapter trained on BASE (named as the user gave it), as a `huggingface_hub.ModelCard`:
    the base, λ and the LoRA settings, and how to use or merge it. `base_model` metadata only for a Hub id (a local
    path means nothing on the Hub)."""
    from huggingface_hub import ModelCard, ModelCardData

    local = Path(base.removeprefix(HUB_PREFIX)).expanduser().exists() and not base.startswith(HUB_PREFIX)
    hub_id = None if local else base.removeprefix(HUB_PREFIX)
    version = getattr(config, "diff_version", None)
    tags = ["diff-transformer", "differential-attention", "lora", "peft"]
    tags += [f"diff-transformer-v{version}"] if version else []
    data = ModelCardData(base_model=hub_id, library_name="peft", pipeline_tag="text-generation", tags=tags)
    targets = lora.get("target_modules") or []
    targets = ", ".join(f"`{t}`" for t in (sorted(targets) if isinstance(targets, list | set) else [targets]))
    rows = [
        ("base model", f"`{base}`" + (" (a local directory)" if local else "")),
        ("LoRA rank r", lora.get("r")),
        ("lora_alpha", lora.get("lora_alpha")),
        ("scaling alpha / r", f"{lora['lora_alpha'] / lora['r']:g}" if lora.get("r") else "?"),
        ("lora_dropout", lora.get("lora_dropout")),
        ("target modules", targets),
        ("modules_to_save", ", ".join(f"`{m}`" for m in lora.get("modules_to_save") or []) or "none"),
    ]
    table = "\n".join(f"| {key} | {value} |" for key, value in rows)
    summary = ""
    if lambda_summary:
        summary = f"\n\nλ at the end of training (mean / min / max over layers): {lambda_summary}."
    body = f"""
# {name}

A LoRA adapter (PEFT) for the differential-attention model `{base}`, trained with `diff-transformer train --lora`.

## LoRA

| | |
|---|---|
{table}

## λ (differential weight)

{_lambda_text(config, lora)}{summary}

## Usage

```bash
diff-transformer generate {name} "Once upon a time"    # the base is read from base_model.json (or --base)
diff-transformer merge {name} {name}-merged              # a full Diff checkpoint, no PEFT needed to load it
```

```python
import diff_transformer  # registers the Diff classes with transformers' Auto classes
from peft import AutoPeftModelForCausalLM
from transformers import AutoTokenizer

model = AutoPeftModelForCausalLM.from_pretrained("{name}")  # the base adapter_config.json names, + the adapter
tokenizer = AutoTokenizer.from_pretrained("{name}")
```
"""
    return ModelCard(f"---\n{data.to_yaml()}\n---\n{body}")


def write_adapter_card(directory, base: str, config, lambda_summary: str | None = None) -> None:
    """Replace the README.md PEFT wrote into DIRECTORY (an adapter this run saved on BASE, of CONFIG) with
    `adapter_card`."""
    directory = Path(directory)
    lora = read_adapter_config(directory)
    card = adapter_card(base, config, lora, directory.name, lambda_summary)
    write_new_file(directory / "README.md", str(card))  # replaces PEFT's card; never written through a link


# --- merge ---------------------------------------------------------------------------------------------------------


__all__ = [
    "ADAPTER_CONFIG",
    "hide_bitsandbytes_kernel_notice",
    "load_tokenizer",
    "read_adapter_config",
    "Source",
    "adapter_card",
    "record_base",
    "weights_fingerprint",
    "is_adapter",
    "put_adapter_on",
    "name_base",
    "peft_base_name",
    "quiet_peft_wrapping",
    "resolve",
    "write_adapter_card",
]
