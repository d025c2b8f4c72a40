"""`diff-transformer train MODEL --data FILES --output DIR`: continued pretraining or LoRA fine-tuning on
transformers' Trainer (`diff_transformer.training`). Only the options are defined here: Trainer loads when it runs."""

from ..training.args import add_train_arguments, check_option_values


def add_parser(commands) -> None:
    train = commands.add_parser(
        "train",
        help="continued pretraining (transformers' Trainer) on local .txt/.jsonl files, or chat fine-tuning",
    )
    add_train_arguments(train).set_defaults(func=run, early_check=check_option_values)


def run(args) -> int:
    from ..checkpoints.adapters import hide_bitsandbytes_kernel_notice

    if not args.load_in_4bit:
        hide_bitsandbytes_kernel_notice()
    from ..training.train import run_cli

    return run_cli(args)
