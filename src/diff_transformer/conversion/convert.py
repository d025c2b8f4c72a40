"""Streaming conversion of Llama / DiffLlama checkpoints into Diff checkpoints (docs/design.md, "Converting a Llama
checkpoint").

The source is read tensor by tensor from its safetensors shards and the output is written shard by shard, so peak
memory stays near one shard. Everything is written into a temporary directory next to OUT and renamed into place only
once complete (`staging.Staging`); on any error the temporary directory is removed and OUT (and SRC, which is only
ever read) is left as it was.
"""

from __future__ import annotations

import fnmatch
import logging
import math
import os
import re
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..checkpoints import CUSTOM_CODE_FILES
from ..checkpoints.configs import check_generation_config, check_model_config
from ..checkpoints.loading import check_config_against_weights, check_config_sizes_plausible
from ..configuration_diff import AUTO_MAP
from ..errors import check_seed
from ..families import DIFFLLAMA, FAMILIES, LLAMA, MOTIF, Family, family_of_config
from ..integrations.hub import diff_model_card
from ..outputs.files import check_target
from ..outputs.records import write_manifest
from ..outputs.staging import Staging
from .dtypes import cast_dtype, from_safetensors_code, parse_dtype
from .errors import ConversionError, conversion_boundary, one_line
from .families import CAUSAL_LM, check_supported, source_geometry, task_of
from .layout import (
    IGNORED_SOURCE_TENSORS,
    Geometry,
    LlamaToV1Expanded,
    choose_v1_layout,
    make_tensor_map,
    pairable,
)
from .motif import motif_config
from .provenance import conversion_provenance
from .source import SIDE_FILE_PATTERNS, SourceCheckpoint, check_float_dtypes, open_source, read_weights_headers
from .writer import ShardWriter


CONVERT_MARK = "diff-transformer convert"
# The names OUT may get (Staging refuses an --overwrite over a user's entry of such a name before any work).
WRITES = ("README.md", "config.json", *CUSTOM_CODE_FILES, *SIDE_FILE_PATTERNS)

# Llama / DiffLlama config fields that DiffConfig shares with the same meaning (the head geometry is set separately).
_COPIED_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "hidden_act",
    "max_position_embeddings",
    "initializer_range",
    "rms_norm_eps",
    "use_cache",
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
    "tie_word_embeddings",
    "rope_parameters",
    "attention_bias",
    "attention_dropout",
    "mlp_bias",
)
# SRC files the converter writes anew in OUT, and SRC's weights (any format, never copied): not named as skipped.
_REWRITTEN = ("config.json", "README.md", "model.safetensors.index.json")
_WEIGHT_FILES = re.compile(r"\.(safetensors|bin|pth|pt|ckpt|pkl|h5|msgpack|onnx|gguf)$", re.IGNORECASE)
# V1's λ vectors feed an exp() and stay float32 whatever `dtype` asks (DiffPreTrainedModel keeps them in fp32 too).
_FP32_PARAMETERS = re.compile(r"\.diff_lambda\.lambda_[qk][12]$")
V1_INITS = ("calibrated", "calibrated-additive", "calibrated-lambda0", "paper")
CALIBRATED_INITS = ("calibrated", "calibrated-additive", "calibrated-lambda0")
# The least λ of the default (differential) V1 start, kept throughout training (`DiffConfig.lambda_floor`).
DIFFERENTIAL_LAMBDA_FLOOR = 0.05
# What `convert_to_diff` drops for a family imported exactly into V1: nothing to initialise or calibrate.
_V1_START_OPTIONS = (
    "lambda_std",
    "seed",
    "v1_init",
    "v1_layout",
    "calibration_data",
    "calibration_blocks",
    "calibration_block_size",
    "device",
)
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ConvertOptions:
    """What one conversion was asked for: the arguments of `convert_llama_to_diff` (see there) past SRC and OUT,
    passed down the converter's chain as one object. `_checked` returns it with `dtype` parsed into a torch dtype,
    `max_shard_size` into bytes, `seed` checked and `v1_init` the start to use (None: there is none to choose)."""

    diff_version: int
    dtype: str | torch.dtype | None = None
    overwrite: bool = False
    progress: bool = True
    lambda_std: float = 0.1
    seed: int = 0
    v1_init: str | None = None
    v1_layout: str | None = None
    calibration_data: str | os.PathLike | None = None
    calibration_blocks: int = 16
    calibration_block_size: int = 256
    max_shard_size: int | str | None = None
    revision: str | None = None
    token: str | bool | None = None
    device: str | None = None


@conversion_boundary
def convert_llama_to_diff(
    src: str | os.PathLike,
    out: str | os.PathLike,
    diff_version: int = 2,
    dtype: str | torch.dtype | None = None,
    overwrite: bool = False,
    progress: bool = True,
    *,
    lambda_std: float = 0.1,
    seed: int = 0,
    v1_init: str | None = None,
    v1_layout: str | None = None,
    calibration_data: str | os.PathLike | None = None,
    calibration_blocks: int = 16,
    calibration_block_size: int = 256,
    max_shard_size: int | str | None = None,
    revision: str | None = None,
    token: str | bool | None = None,
    device: str | None = None,
) -> Path:
    """Convert a Llama-family checkpoint (local directory or Hub id) into a Diff checkpoint at `out`.

    Accepts `llama`, `mistral`, `qwen2` and `qwen3` checkpoints, causal LMs and their sequence classification, token
    classification and question-answering heads. Tensors stream one at a time; OUT is written to a temporary
    directory renamed into place only when complete, with the tokenizer, chat template, generation config, the two
    custom-code files and a model card.

    Args:
        src: checkpoint directory (config.json + *.safetensors) or Hub model id (downloaded with `snapshot_download`,
            cached; honours HF_HUB_OFFLINE). Never modified.
        out: output directory; must not exist or be empty unless `overwrite`.
        diff_version: 2 (default) is function-preserving: the result's logits equal the source's at step 0.
            1 is the paper layout, not function-preserving; see `v1_layout` for how Llama heads map onto it.
        dtype: cast floating tensors to this dtype ("bfloat16", torch.float16, ...); None keeps the stored dtypes.
            V1's λ vectors are always stored in float32.
        overwrite: replace a non-empty `out` (only once the new checkpoint is complete).
        progress: report the work (tensors written, V1's calibration): a bar on a terminal, a line at least every
            30 s in a log (`progress.Progress`).
        lambda_std: std of V1's fresh λ vectors (ignored for V2).
        seed: seeds V1's fresh λ vectors (per layer) and the sampled calibration text.
        v1_init: V1 only. "calibrated" (the default for V1): differential, λ > 0 in every layer from step 0 and
            throughout training (`lambda_floor` 0.05); o_proj is refitted by least squares, layer by layer, so that
            the normalised heads reproduce the source's attention output on `calibration_blocks` blocks of
            `calibration_block_size` tokens (`calibrate.py`; the sub-layer norm weight stays 1); paired layout:
            λ_init = 0 and each layer's λ chosen from [0.1, 0.5]; expanded layout: λ = the paper's λ_init (A2 = A1
            at step 0: the maps differ only once training moves q2, k2) and a steady channel in each second value
            half, so the sub-layer norm starts nearly linear (`calibrate._steady_second_half`).
            "calibrated-additive": the paired fit over [-1, 0.5], which picks λ < 0: the second map is ADDED at
            the start (no floor; closest to the source).
            "calibrated-lambda0": λ = 0 at the start (mirrored λ vectors). "paper": the paper's λ_init schedule,
            λ vectors ~ N(0, lambda_std), unit gains.
        v1_layout: V1 only. "paired": pairs of Llama heads become differential heads, every weight reused, none
            added (needs even numbers of attention and key/value heads). "expanded": one differential head per Llama
            head, with a second map (q2, k2 copied from q1, k1) and a second value half added (any head count).
            None (default): paired where the head counts allow it, expanded otherwise.
        calibration_data: a UTF-8 text file to calibrate on (its first 4 MiB; the last fifth held out to measure
            the start). Default: text sampled from the source itself (seeded by `seed`; no data needed); a source
            that is not a causal LM reads a built-in public-domain text (assets/calibration.txt) instead.
        calibration_blocks: how many blocks of text the V1 calibration fits the gains on.
        calibration_block_size: tokens per calibration block.
        max_shard_size: bytes (int) or "5GB"-style string for the output shards; None mirrors the input shards.
        revision: Hub revision (branch, tag or commit) of a Hub id, forwarded to `snapshot_download`.
        token: Hub token for a Hub id, forwarded to `snapshot_download`.
        device: where a calibrated V1 start samples its text and fits its layers (`calibrate.py`): "cpu" (None, the
            default), "cuda", "cuda:N" or "auto"; checked before anything is read. Nothing else uses it (the
            weights stream through the CPU).

    Returns:
        The output directory.

    Raises:
        ConversionError: any problem with the inputs or the output (one line: what is wrong, then the fix).

    Example:
        ```python
        convert_llama_to_diff("meta-llama/Llama-3.2-1B", "llama-3.2-1b-diff")  # V2, same logits
        ```
    """
    options = ConvertOptions(
        diff_version,
        dtype,
        overwrite,
        progress,
        lambda_std=lambda_std,
        seed=seed,
        v1_init=v1_init,
        v1_layout=v1_layout,
        calibration_data=calibration_data,
        calibration_blocks=calibration_blocks,
        calibration_block_size=calibration_block_size,
        max_shard_size=max_shard_size,
        revision=revision,
        token=token,
        device=device,
    )
    return _convert(src, out, LLAMA, options)


@conversion_boundary
def convert_diffllama_to_diff(
    src: str | os.PathLike,
    out: str | os.PathLike,
    diff_version: int = 1,
    dtype: str | torch.dtype | None = None,
    overwrite: bool = False,
    progress: bool = True,
    *,
    max_shard_size: int | str | None = None,
    revision: str | None = None,
    token: str | bool | None = None,
) -> Path:
    """Import a transformers `DiffLlamaForCausalLM` checkpoint into Diff V1 with the weight permutation that
    reproduces DiffLlama's logits exactly (see `layout.diffllama_query_permutation`).

    Same arguments as `convert_llama_to_diff`; only `diff_version=1` is possible.

    Returns:
        The output directory.

    Raises:
        ConversionError: any problem with the inputs or the output.
    """
    options = ConvertOptions(
        diff_version, dtype, overwrite, progress, max_shard_size=max_shard_size, revision=revision, token=token
    )
    return _convert(src, out, DIFFLLAMA, options)


@conversion_boundary
def convert_motif_to_diff(
    src: str | os.PathLike,
    out: str | os.PathLike,
    diff_version: int = 1,
    dtype: str | torch.dtype | None = None,
    overwrite: bool = False,
    progress: bool = True,
    *,
    max_shard_size: int | str | None = None,
    revision: str | None = None,
    token: str | bool | None = None,
) -> Path:
    """Import a Motif checkpoint (`architectures: ["MotifForCausalLM"]`: Motif-2.6B's differential attention, or
    grouped differential attention with `num_noise_heads` as in Motif-2-12.7B) into Diff V1, exactly: the stripe
    head layout is V1's, so every weight keeps its rows and columns; PolyNorm, the grouped noise heads, Motif's λ_init
    schedule and subln eps become `DiffConfig` options (conversion/motif.py, docs/motif.md).

    Same arguments as `convert_llama_to_diff`; only `diff_version=1` is possible.

    Returns:
        The output directory.

    Raises:
        ConversionError: any problem with the inputs or the output.
    """
    options = ConvertOptions(
        diff_version, dtype, overwrite, progress, max_shard_size=max_shard_size, revision=revision, token=token
    )
    return _convert(src, out, MOTIF, options)


@conversion_boundary
def convert_to_diff(
    src: str | os.PathLike,
    out: str | os.PathLike,
    diff_version: int | None = None,
    dtype: str | torch.dtype | None = None,
    overwrite: bool = False,
    progress: bool = True,
    **kwargs,
) -> Path:
    """Dispatch on SRC's family (`diff_transformer.families`): "llama", "mistral", "qwen2", "qwen3" ->
    `convert_llama_to_diff` (diff_version defaults to 2), "diffllama" -> `convert_diffllama_to_diff` (diff_version 1);
    `architectures: ["MotifForCausalLM"]` -> `convert_motif_to_diff` (diff_version 1)."""
    if kwargs.get("device") is not None:  # refused before a Hub download
        from .device import check_device

        kwargs["device"] = check_device(kwargs["device"])
    source = open_source(src, revision=kwargs.get("revision"), token=kwargs.get("token"))
    family = family_of_config(source.config)
    if family is None:
        raise _model_type_error(source, expected=None)
    version = family.default_version if diff_version is None else diff_version
    if family.exact_v1:
        if (
            kwargs.get("calibration_data") is not None
            or kwargs.get("v1_init") not in (None, *CALIBRATED_INITS)
            or kwargs.get("v1_layout") is not None
        ):
            raise ConversionError(
                f"{src} is a {family.name} checkpoint, imported exactly: there is no V1 initialisation to choose or "
                "calibrate; drop --v1-init / --v1-layout / --calibration-data."
            )
        kwargs = {k: v for k, v in kwargs.items() if k not in _V1_START_OPTIONS}
    convert = _CONVERTERS[family.converter]
    return convert(source.path if source.repo_id is None else src, out, version, dtype, overwrite, progress, **kwargs)


def parse_size(size: int | str | None) -> int | None:
    """Bytes from an int or a string like "5GB" (10^9), "500MiB" (2^20 each), "2000000"."""
    if size is None:
        return None
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    if isinstance(size, str):
        match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMGT]?)(IB|B)?", size.strip().upper())
        if match:
            number, prefix, unit = float(match.group(1)), match.group(2), match.group(3)
            base = 1024 if unit == "IB" else 1000
            value = int(number * base ** "_KMGT".index(prefix or "_")) if prefix else int(number)
            if value > 0:
                return value
    raise ConversionError(
        f"max_shard_size={size!r} is not a size: pass bytes as an int or a string like '5GB' / '500MB'."
    )


def _accepted(converter: str) -> str:
    """The families `converter` reads, as messages name them."""
    return ", ".join(family.describe() for family in FAMILIES.values() if family.converter == converter)


def _model_type_error(source: SourceCheckpoint, expected: Family | None) -> ConversionError:
    """SRC is not of a family the converter reads, or (`expected`) not of one that `expected`'s converter reads."""
    family = family_of_config(source.config)
    model_type = family.model_type if family is not None else source.model_type
    where = source.repo_id or str(source.path)
    if model_type == "diff":
        return ConversionError(
            f"{where} is already a Diff checkpoint (model_type 'diff'): load it directly, no conversion is needed."
        )
    if expected is not None and family is not None:
        return ConversionError(
            f"{where} has model_type {model_type!r}, "
            f"but this converter expects {expected.model_type!r}: use {family.converter}."
        )
    if expected is not None:
        accepted = _accepted(expected.converter)
    else:
        groups = [_accepted(converter) for converter in dict.fromkeys(f.converter for f in FAMILIES.values())]
        accepted = ", ".join(groups[:-1]) + " or " + groups[-1]
    return ConversionError(
        f"{where} has model_type {model_type!r}; only {accepted} checkpoints convert: pick a checkpoint of one of "
        "these families (config.json's model_type says which)."
    )


def _source_config(source: SourceCheckpoint, expected: Family):
    """SRC's parsed config, family and task. SRC may be of any family that `expected`'s converter reads (LLAMA: every
    Llama-shaped family)."""
    where = source.repo_id or str(source.path)
    family = family_of_config(source.config)
    if family is None or family.converter != expected.converter:
        raise _model_type_error(source, expected=expected)
    if source.config.get("quantization_config"):
        method = (
            source.config["quantization_config"].get("quant_method", "?")
            if isinstance(source.config["quantization_config"], dict)
            else "?"
        )
        raise ConversionError(
            f"{where} is a quantized checkpoint ({method}): convert the unquantized (float) weights instead."
        )
    if family is MOTIF:  # no transformers class: read as a LlamaConfig, Motif's fields checked (motif.py)
        return motif_config(source.config, where), family, CAUSAL_LM
    task = task_of(family, source.config.get("architectures") or [], where)
    import transformers

    config_class = getattr(transformers, family.config_class)
    try:
        config = config_class.from_dict(dict(source.config))
    except Exception as exc:
        raise ConversionError(
            f"config.json of {where} is not a valid {config_class.__name__} ({one_line(exc)}): fix or re-download it."
        ) from exc
    check_supported(family, config, where)
    return config, family, task


def _diff_config(
    source_config,
    family: Family,
    task,
    geometry: Geometry,
    options: ConvertOptions,
    where: str,
    lambda_init: float | None = None,
    v1_layout: str | None = None,
    lambda_floor: float | None = None,
):
    """The Diff config of SRC converted as `options` ask (`v1_layout` the layout chosen, `lambda_init` and
    `lambda_floor` the V1 start's)."""
    from ..configuration_diff import DiffConfig

    diff_version, lambda_std = options.diff_version, options.lambda_std

    fields = {name: getattr(source_config, name) for name in _COPIED_FIELDS if hasattr(source_config, name)}
    # What the family hard-codes or configures (`attention_flags`); o_proj's bias is written only where it differs
    # from q/k/v's (Qwen2), so Llama conversions keep the config they always had.
    out_bias = None if geometry.out_bias == geometry.attention_bias else geometry.out_bias
    fields.update(attention_bias=geometry.attention_bias, attention_out_bias=out_bias, mlp_bias=geometry.mlp_bias)
    fields.update(use_qk_norm=geometry.qk_norm)
    if task is not CAUSAL_LM:  # the head's labels
        fields.update(id2label=source_config.id2label, label2id=source_config.label2id)
        fields.update(problem_type=getattr(source_config, "problem_type", None))
    if family.lambda_std_field:  # differential already: its λ vectors' init std
        lambda_std = getattr(source_config, family.lambda_std_field, None)
        lambda_std = 0.1 if lambda_std is None else float(lambda_std)
    if family is MOTIF:  # H = the signal heads; GDA's noise heads, λ_init at depth i - 1, subln's own eps
        motif = source_config.motif
        heads, kv_heads = geometry.num_heads - geometry.motif_groups, geometry.num_kv_heads // 2
        fields.update(num_noise_heads=None if motif.num_noise_heads is None else motif.groups)
        fields.update(lambda_init_depth_offset=-1, subln_eps=motif.attn_rms_norm_eps, hidden_act="poly_norm")
    elif diff_version == 2 or v1_layout == "expanded":
        heads, kv_heads = geometry.num_heads, geometry.num_kv_heads
    else:
        heads, kv_heads = geometry.num_heads // 2, geometry.num_kv_heads // 2
    try:
        config = DiffConfig(
            **fields,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=geometry.head_dim,
            diff_version=diff_version,
            lambda_init=lambda_init,  # None: the paper's depth schedule (also DiffLlama's); 0.0: calibrated V1
            lambda_std=float(lambda_std),
            lambda_floor=lambda_floor,
        )
    except Exception as exc:
        hint = " or use diff_version=2" if diff_version == 1 and family.llama_shaped else ""
        raise ConversionError(
            f"{where} cannot be expressed as a Diff V{diff_version} config ({one_line(exc)}): fix config.json{hint}."
        ) from exc
    config.architectures = [task.diff_class]
    config.auto_map = dict(AUTO_MAP)
    return config


def _validate_tensors(source: SourceCheckpoint, geometry: Geometry, family: Family) -> None:
    where = source.repo_id or str(source.path)
    expected, optional = geometry.expected_source_tensors(family)
    for name, info in source.tensors.items():
        if geometry.canonical(name) in expected:
            if info.shape != expected[geometry.canonical(name)]:
                raise ConversionError(
                    f"tensor {name} in {info.shard.name} has shape {list(info.shape)}, but config.json implies "
                    f"{list(expected[geometry.canonical(name)])}: config.json does not describe these weights; fix "
                    "it or re-download the checkpoint."
                )
        elif not IGNORED_SOURCE_TENSORS.match(name):
            raise ConversionError(
                f"unexpected tensor {name} in {info.shard.name} of {where}: not part of a {source.model_type} model "
                "with this config (unsupported feature or wrong model); convert a plain checkpoint."
            )
    present = {geometry.canonical(name) for name in source.tensors}
    missing = [name for name in expected if name not in present and name not in optional]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ConversionError(
            f"tensor {missing[0]}{more} is missing from {where}: the checkpoint is incomplete; re-download it."
        )
    check_float_dtypes(source)


def _check_output_against_model(config, writer: ShardWriter) -> None:
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


def _copy_side_files(source: SourceCheckpoint, target: Path) -> list[str]:
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


def _copy_custom_code(target: Path) -> None:
    package = Path(__file__).resolve().parent.parent
    for name in CUSTOM_CODE_FILES:
        shutil.copyfile(package / name, target / name)


def _convert(src, out, expected: Family, options: ConvertOptions) -> Path:
    """Convert SRC, of a family `expected`'s converter reads, into OUT as `options` ask."""
    options = _checked(options, expected)
    # A local SRC is held against OUT first: `convert SRC SRC` is "OUT is SRC", not Staging's "pass --overwrite"
    # (which would then be refused as overlapping SRC).
    local_src = Path(os.fspath(src)).expanduser() if isinstance(src, (str, os.PathLike)) else None
    out_path = check_target(out, sources={"SRC": local_src} if local_src is not None and local_src.is_dir() else None)
    # Refused (and dead runs' leftovers recovered) before anything is downloaded or read.
    staging = Staging(out_path, overwrite=options.overwrite, flag="overwrite=True (--overwrite)", writes=WRITES)

    source = open_source(src, revision=options.revision, token=options.token)
    check_target(out_path, sources={"SRC": source.path})
    config, tensor_map = _plan(source, expected, options)
    if options.v1_init in CALIBRATED_INITS:  # before anything is written: a bad calibration text is refused, OUT kept
        _calibrate(source, config, tensor_map, options)
    try:
        with staging as tmp:
            _write(source, config, tensor_map, tmp, out_path.name, options)
            staging.seal()
            write_manifest(tmp, CONVERT_MARK)  # what proves to a later --overwrite which files convert wrote
            staging.install()
    except OSError as exc:
        raise ConversionError(
            f"writing {out_path} failed ({one_line(exc)}): check free disk space and permissions."
        ) from exc
    return out_path


def _checked(options: ConvertOptions, expected: Family) -> ConvertOptions:
    """`options` checked before anything is read, with `dtype`, `max_shard_size`, `seed` and `v1_init` resolved."""
    dtype, max_shard_size = parse_dtype(options.dtype), parse_size(options.max_shard_size)
    if options.lambda_std < 0:
        raise ConversionError(f"lambda_std={options.lambda_std} must be >= 0.")
    seed = check_seed(options.seed, "seed", ConversionError)
    v1_init = _check_v1_init(expected, options.diff_version, options.v1_init, options.calibration_data)
    if options.v1_layout is not None and v1_init is None:
        raise ConversionError("--v1-layout chooses how Llama heads map onto V1: add --diff-version 1, or drop it.")
    from .device import check_device

    device = check_device(options.device)
    return replace(options, dtype=dtype, max_shard_size=max_shard_size, seed=seed, v1_init=v1_init, device=device)


def _check_v1_init(expected: Family, diff_version: int, v1_init: str | None, calibration_data) -> str | None:
    """The V1 initialisation to use ("calibrated" / "paper"), None where there is none to choose (V2, a family
    imported exactly)."""
    if v1_init not in (None, *V1_INITS):
        raise ConversionError(f"v1_init={v1_init!r} is not one of {', '.join(V1_INITS)} (--v1-init).")
    if not expected.llama_shaped or diff_version != 1:
        if v1_init is not None or calibration_data is not None:
            raise ConversionError(
                "--v1-init / --calibration-data choose how a Llama -> Diff V1 conversion starts: add "
                "--diff-version 1, or drop them (V2 is function-preserving, nothing to calibrate)."
            )
        return None
    v1_init = v1_init or "calibrated"
    if v1_init == "paper" and calibration_data is not None:
        raise ConversionError("--calibration-data calibrates --v1-init calibrated, not paper: drop one of them.")
    return v1_init


def _calibrate(source, config, tensor_map, options: ConvertOptions) -> None:
    """Refit V1's o_proj (and choose λ) on calibration data (conversion/calibrate.py); record how, and the step-0
    perplexity on the data's held-out part, in the provenance."""
    from .calibrate import ADDITIVE_GRID, DIFFERENTIAL_GRID, STEADY_VALUE, calibrate_v1_start, plan_calibration

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


def _plan(source: SourceCheckpoint, expected: Family, options: ConvertOptions):
    """Validate SRC (config, then every tensor header) and return the Diff config and the tensor map."""
    where = source.repo_id or str(source.path)
    # A config that claims more model than the weights hold, refused before anything is built from it (a Hub source:
    # once its weights are downloaded, below).
    if source.repo_id is None:
        check_config_against_weights(source.path, source.config, where)
    else:  # the weights come after the config passed: bound what the config alone can make us plan
        check_config_sizes_plausible(source.config, where)
    config, tensor_map = _mapped_config(source, expected, options, where)
    check_model_config(config, where, build=False)  # before a Hub download
    # OUT gets SRC's generation_config.json: one that generate() cannot use (num_beams -3) is refused here.
    check_generation_config(str(source.path), where)
    read_weights_headers(source)
    if source.repo_id is not None:
        shapes = {name: info.shape for name, info in source.tensors.items()}
        check_config_against_weights(source.path, source.config, where, shapes)
    _validate_tensors(source, tensor_map.geometry, family_of_config(source.config))
    # The weights hold the layers the config claims: now building it (on the meta device) costs what the model is.
    check_model_config(config, where)
    config.dtype = options.dtype or _declared_dtype(source) or _stored_dtype(source, tensor_map.geometry)
    return config, tensor_map


def _mapped_config(source: SourceCheckpoint, expected: Family, options: ConvertOptions, where: str):
    """The Diff config and tensor map of SRC's config.json converted as OPTIONS ask (no weights read)."""
    v1_init = options.v1_init
    source_config, family, task = _source_config(source, expected)
    geometry = source_geometry(family, task, source_config)
    calibrated = v1_init in CALIBRATED_INITS
    layout = choose_v1_layout(geometry, options.v1_layout) if v1_init is not None else None
    tensor_map = make_tensor_map(
        family,
        options.diff_version,
        geometry,
        lambda_std=options.lambda_std,
        seed=options.seed,
        mirrored_lambda=calibrated,
        v1_layout=layout or "paired",
    )
    if v1_init == "paper":
        tensor_map.provenance = {"v1_init": "paper", "v1_layout": layout}
    if layout == "expanded" and v1_init == "calibrated-additive":
        pair = " (or --v1-layout paired)" if pairable(geometry) else ""  # never suggest a layout SRC cannot take
        raise ConversionError(
            "--v1-init calibrated-additive fits λ < 0 on paired heads; the expanded layout starts with A2 = A1, where "
            f"λ has no effect, so it has no additive start: use --v1-init calibrated{pair}."
        )
    # λ_init: the paper's schedule, except where λ starts fitted or at 0 (λ_init 0, mirrored vectors)
    lambda_init = 0.0 if calibrated and (layout == "paired" or v1_init == "calibrated-lambda0") else None
    floor = DIFFERENTIAL_LAMBDA_FLOOR if v1_init == "calibrated" else None
    # Built before any weights are downloaded or read, so that an unsupported config is refused early.
    config = _diff_config(source_config, family, task, geometry, options, where, lambda_init, layout, floor)
    return config, tensor_map


def planned_config(source_config: dict, diff_version: int | None = None, where: str = "config.json"):
    """The Diff config `convert` writes for a source whose config.json is SOURCE_CONFIG, with the converter's
    defaults (`diff-transformer plan`): nothing else is read."""
    source = SourceCheckpoint(Path(where), None, dict(source_config), [])
    family = family_of_config(source.config)
    if family is None:
        raise _model_type_error(source, expected=None)
    version = family.default_version if diff_version is None else diff_version
    options = _checked(ConvertOptions(version), family)
    check_config_sizes_plausible(source.config, where)
    return _mapped_config(source, family, options, where)[0]


def _declared_dtype(source: SourceCheckpoint) -> torch.dtype | None:
    declared = source.config.get("dtype") or source.config.get("torch_dtype")
    return cast_dtype(str(declared)) if declared else None


def _stored_dtype(source: SourceCheckpoint, geometry: Geometry) -> torch.dtype:
    """What the shards store (checked to be float): what the config records when SRC's config does not say."""
    return from_safetensors_code(source.tensors[geometry.prefix + "embed_tokens.weight"].dtype)


def _write(source, config, tensor_map, tmp: Path, name: str, options: ConvertOptions) -> None:
    """Everything OUT will hold, written into `tmp`: shards, config, custom code, side files, card."""
    family = family_of_config(source.config)
    writer = ShardWriter(tmp, options.max_shard_size, expected_tensors=2 * len(source.tensors))
    desc = f"{family.model_type} -> diff v{config.diff_version}"
    _stream(source, tensor_map, writer, options.dtype, options.progress, desc)
    writer.finish()
    _check_output_against_model(config, writer)
    config.conversion = conversion_provenance(source, family, config.diff_version)
    config.conversion.update(getattr(tensor_map, "provenance", None) or {})
    config.to_json_file(str(tmp / "config.json"))
    _copy_custom_code(tmp)
    _copy_side_files(source, tmp)
    diff_model_card(config, name).save(tmp / "README.md")  # the card save_pretrained writes too


def _stream(
    source: SourceCheckpoint, tensor_map, writer: ShardWriter, target_dtype, progress: bool, desc: str
) -> None:
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


# The public converters by name (`Family.converter`).
_CONVERTERS = {f.__name__: f for f in (convert_llama_to_diff, convert_diffllama_to_diff, convert_motif_to_diff)}

__all__ = [
    "AUTO_MAP",
    "ConvertOptions",
    "convert_diffllama_to_diff",
    "convert_llama_to_diff",
    "convert_motif_to_diff",
    "convert_to_diff",
    "parse_dtype",
    "parse_size",
]
