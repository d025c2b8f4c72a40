"""`diff-transformer merge`: a PEFT adapter folded into its base model's weights and written as a full checkpoint."""

from __future__ import annotations

from pathlib import Path

from . import CheckpointError
from .adapters import ADAPTER_CONFIG, MERGE_MARK
from .opening import open_checkpoint


def merge_adapter(
    adapter,
    out,
    *,
    base: str | None = None,
    overwrite: bool = False,
    device: str = "cpu",
    dtype: str = "auto",
    allow_non_finite: bool = False,
) -> Path:
    """Fold the PEFT adapter directory ADAPTER into its base model (`merge_and_unload`: each adapted weight becomes
    W + (alpha / r)·B·A, λ copies in `modules_to_save` replace the base's) and write a full checkpoint to OUT: weights
    in the base's dtype, the custom code, a card naming the adapter and its base, the tokenizer (the adapter's, else
    the base's). Nothing is written unless everything loads; OUT is replaced only with `overwrite`. The merge runs on
    DEVICE; DTYPE ("float32", "bfloat16", "float16") converts the weights, "auto" keeps the base's. With `overwrite`
    the new checkpoint is installed whole: of the old OUT only what a command of this package provably wrote is
    removed, the user's files stay (or the merge is refused naming them, `staging.users_entries`); a manifest records
    what merge wrote. A merged weight holding NaN or inf (an adapter's `lora_alpha` that overflows
    W + (alpha / r)·B·A, say) is refused before anything is written, unless `allow_non_finite`."""
    from transformers import AutoTokenizer

    from ..integrations.hub import diff_model_card
    from ..outputs.files import check_target, follow_umask
    from ..outputs.records import write_manifest
    from ..outputs.staging import Staging
    from . import CUSTOM_CODE_FILES

    checkpoint = open_checkpoint(adapter, base, tokenizer=False, label="ADAPTER")
    source = checkpoint.source
    if source.adapter is None:
        raise CheckpointError(
            f"ADAPTER {adapter} is a model, not a PEFT adapter directory (no {ADAPTER_CONFIG}): merge takes what "
            "`diff-transformer train --lora` wrote."
        )
    sources = {"ADAPTER": source.adapter} | ({"BASE": source.local} if source.local is not None else {})
    out_path = check_target(out, sources=sources)
    # Refuses a non-empty OUT before anything loads, and with `overwrite` the user's files the merge would replace.
    staging = Staging(out_path, overwrite=overwrite, writes=("README.md", *CUSTOM_CODE_FILES))
    with staging as staging_dir:
        import torch

        placed = {} if device == "cpu" else {"device_map": {"": device}}
        torch_dtype = "auto" if dtype in (None, "auto") else getattr(torch, dtype)
        model = checkpoint.load(merge=True, dtype=torch_dtype, **placed)
        bad = [] if allow_non_finite else non_finite_tensors(model.state_dict())
        if bad:
            raise CheckpointError(
                f"merging ADAPTER {adapter} gives NaN or inf in {len(bad)} weight(s), e.g. {bad[0]} (its lora_alpha "
                "or weights overflow W + (alpha / r)·B·A): nothing was written; fix the adapter, or pass "
                "--allow-non-finite (allow_non_finite=True) to write them anyway."
            )
        try:
            tokenizer = AutoTokenizer.from_pretrained(source.tokenizer)
        except (OSError, ValueError, TypeError):  # a model saved without a tokenizer (prompts are token ids)
            tokenizer = None
        if getattr(model.config, "model_type", None) == "diff":
            card = diff_model_card(model.config, out_path.name)
            card.text += (
                f"\n## Merged adapter\n\nThe LoRA adapter `{adapter}` merged into `{source.base}` with "
                "`diff-transformer merge` (PEFT's `merge_and_unload`): no PEFT is needed to load it.\n"
            )
            card.save(staging_dir / "README.md")  # before save_pretrained, which then keeps it
        model.save_pretrained(staging_dir)
        follow_umask(staging_dir.glob("*.safetensors"))  # safetensors writes them owner-only
        if tokenizer is not None:
            tokenizer.save_pretrained(staging_dir)
        staging.seal()
        write_manifest(staging_dir, MERGE_MARK)  # what proves to a later --overwrite which files merge wrote
        staging.install()
    return out_path


def non_finite_tensors(state_dict) -> list[str]:
    """The names of the floating-point tensors of STATE_DICT that hold NaN or inf (shared storage checked once): a
    merge never writes such weights silently; they come from values that overflow (an adapter's `lora_alpha` in
    W + (alpha / r)·B·A, float16 weights out of range)."""
    import torch

    found, seen = [], set()
    for name, tensor in state_dict.items():
        if not torch.is_floating_point(tensor) or tensor.device.type == "meta":
            continue
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key not in seen:
            seen.add(key)
            if not bool(torch.isfinite(tensor).all()):
                found.append(name)
    return found


__all__ = ["merge_adapter", "non_finite_tensors"]
