"""Streaming conversion of Llama / DiffLlama checkpoints into Diff checkpoints (docs/design.md, "Converting a Llama
checkpoint").

The source is read tensor by tensor from its safetensors shards and the output is written shard by shard, so peak
memory stays near one shard. Everything is written into a temporary directory next to OUT and renamed into place only
once complete (`staging.Staging`); on any error the temporary directory is removed and OUT (and SRC, which is only
ever read) is left as it was.

One conversion (`_convert`), in order: its options checked (options.py), SRC read and planned into a Diff config and
a tensor map (source.py, plan.py, layout.py), a V1 start calibrated (calibrate.py, fit.py), OUT written (output.py,
writer.py) and installed.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..checkpoints import CUSTOM_CODE_FILES
from ..families import DIFFLLAMA, LLAMA, MOTIF, Family, family_of_config
from ..integrations.hub import diff_model_card
from ..outputs.files import check_target
from ..outputs.records import write_manifest
from ..outputs.staging import Staging
from .errors import ConversionError, conversion_boundary, one_line
from .options import CALIBRATED_INITS, ConvertOptions, checked_options
from .output import check_output_against_model, copy_custom_code, copy_side_files, stream_tensors
from .plan import model_type_error, plan_conversion
from .provenance import conversion_provenance
from .source import SIDE_FILE_PATTERNS, open_source
from .writer import ShardWriter


CONVERT_MARK = "diff-transformer convert"
# The names OUT may get (Staging refuses an --overwrite over a user's entry of such a name before any work).
WRITES = ("README.md", "config.json", *CUSTOM_CODE_FILES, *SIDE_FILE_PATTERNS)
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
            half, so the sub-layer norm starts nearly linear (`fit._steady_second_half`).
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
        raise model_type_error(source, expected=None)
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


def _convert(src, out, expected: Family, options: ConvertOptions) -> Path:
    """Convert SRC, of a family `expected`'s converter reads, into OUT as `options` ask."""
    options = checked_options(options, expected)
    # A local SRC is held against OUT first: `convert SRC SRC` is "OUT is SRC", not Staging's "pass --overwrite"
    # (which would then be refused as overlapping SRC).
    local_src = Path(os.fspath(src)).expanduser() if isinstance(src, (str, os.PathLike)) else None
    out_path = check_target(out, sources={"SRC": local_src} if local_src is not None and local_src.is_dir() else None)
    # Refused (and dead runs' leftovers recovered) before anything is downloaded or read.
    staging = Staging(out_path, overwrite=options.overwrite, flag="overwrite=True (--overwrite)", writes=WRITES)

    source = open_source(src, revision=options.revision, token=options.token)
    check_target(out_path, sources={"SRC": source.path})
    config, tensor_map = plan_conversion(source, expected, options)
    if options.v1_init in CALIBRATED_INITS:  # before anything is written: a bad calibration text is refused, OUT kept
        from .calibrate import calibrate_conversion

        calibrate_conversion(source, config, tensor_map, options)
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


def _write(source, config, tensor_map, tmp: Path, name: str, options: ConvertOptions) -> None:
    """Everything OUT will hold, written into `tmp`: shards, config, custom code, side files, card."""
    family = family_of_config(source.config)
    writer = ShardWriter(tmp, options.max_shard_size, expected_tensors=2 * len(source.tensors))
    desc = f"{family.model_type} -> diff v{config.diff_version}"
    stream_tensors(source, tensor_map, writer, options.dtype, options.progress, desc)
    writer.finish()
    check_output_against_model(config, writer)
    config.conversion = conversion_provenance(source, family, config.diff_version)
    config.conversion.update(getattr(tensor_map, "provenance", None) or {})
    config.to_json_file(str(tmp / "config.json"))
    copy_custom_code(tmp)
    copy_side_files(source, tmp)
    diff_model_card(config, name).save(tmp / "README.md")  # the card save_pretrained writes too


# The public converters by name (`Family.converter`).
_CONVERTERS = {f.__name__: f for f in (convert_llama_to_diff, convert_diffllama_to_diff, convert_motif_to_diff)}

__all__ = [
    "ConvertOptions",
    "convert_diffllama_to_diff",
    "convert_llama_to_diff",
    "convert_motif_to_diff",
    "convert_to_diff",
]
