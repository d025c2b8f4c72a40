"""`diff-transformer merge ADAPTER OUT`: a LoRA adapter (what `train --lora` writes) folded into its base model's
weights, written as a full Diff checkpoint (`checkpoints.merging.merge_adapter`)."""

from .options import add_base_option, add_device_options, add_quiet_option, resolve_device


def add_parser(commands) -> None:
    merge = commands.add_parser(
        "merge", help="fold a LoRA adapter (train --lora) into its base model: a full Diff checkpoint"
    )
    merge.add_argument("adapter", help="PEFT adapter directory (what train --lora writes)")
    merge.add_argument("out", help="output directory for the merged checkpoint")
    merge.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT")
    merge.add_argument(
        "--allow-non-finite",
        action="store_true",
        help="write the merged weights even where they hold NaN or inf (refused by default: nothing is written)",
    )
    add_device_options(merge, "merge (the weights are written from there)")
    add_base_option(merge)
    add_quiet_option(merge)
    merge.set_defaults(func=run)


def run(args) -> int:
    """A PEFT adapter folded into its base model's weights: a full Diff checkpoint (custom code, card, tokenizer)."""
    from ..checkpoints.merging import merge_adapter

    device = resolve_device(args.device)
    out = merge_adapter(
        args.adapter,
        args.out,
        base=args.base,
        overwrite=args.overwrite,
        device=device,
        dtype=args.dtype,
        allow_non_finite=args.allow_non_finite,
    )
    print(f"wrote {out}")
    return 0
