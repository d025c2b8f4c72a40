"""Command-line options of `diff-transformer train` (argparse only, so `diff-transformer --help` stays fast)."""

from __future__ import annotations

import argparse
import math

from ..checkpoints.backends import add_attn_option
from ..errors import check_seed
from . import TrainingError


SCHEDULERS = (
    "cosine",
    "linear",
    "constant",
    "constant_with_warmup",
    "cosine_with_min_lr",
    "inverse_sqrt",
    "polynomial",
)


def add_train_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p = parser
    p.add_argument(
        "model", help="Diff checkpoint directory or Hub id (convert a Llama first: diff-transformer convert)"
    )
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--data", nargs="+", metavar="FILE", help="training text: .txt files (one document each) or .jsonl"
    )
    source.add_argument(
        "--chat-data",
        nargs="+",
        metavar="FILE",
        help='chat fine-tuning instead: .jsonl of {"messages": [{"role", "content"}, ...]}, rendered with the chat '
        "template, loss on the assistant turns only",
    )
    p.add_argument("--output", required=True, help="directory for checkpoints, TensorBoard logs and the final model")
    p.add_argument("--text-field", default="text", help="JSONL field holding the text (default: text)")

    data = p.add_argument_group("data")
    data.add_argument(
        "--eval-data",
        nargs="+",
        metavar="FILE",
        help="held-out files, in the format of the training data (default: a split of it)",
    )
    data.add_argument(
        "--eval-fraction",
        type=float,
        default=0.05,
        help="share of the blocks (or conversations) held out when no --eval-data; 0 = no eval",
    )
    data.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="tokens per training block; with --chat-data the longest example, longer ones truncated (default: "
        "min(1024, context length))",
    )
    data.add_argument("--no-bos", action="store_true", help="do not start every block with the tokenizer's bos token")

    opt = p.add_argument_group("optimisation")
    opt.add_argument("--lr", type=float, default=1e-4, help="peak learning rate (default: 1e-4)")
    opt.add_argument(
        "--lr-scheduler", choices=SCHEDULERS, default="cosine", help="learning-rate schedule after warm-up"
    )
    opt.add_argument(
        "--warmup-steps", type=int, default=None, help="linear warm-up steps (default: none, 0 unless --warmup-ratio)"
    )
    opt.add_argument(
        "--warmup-ratio",
        type=float,
        default=None,
        help="warm-up as a share of all steps, instead of --warmup-steps (default: none)",
    )
    opt.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    opt.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping; 0 = off")
    opt.add_argument("--batch-size", type=int, default=8, help="blocks per device per micro-batch")
    opt.add_argument("--eval-batch-size", type=int, default=None, help="default: --batch-size")
    opt.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    opt.add_argument(
        "--max-steps",
        type=int,
        default=None,
        help="optimizer steps, overriding --epochs (default: none, --epochs decides)",
    )
    opt.add_argument("--epochs", type=float, default=1.0, help="passes over --data (fractions allowed)")
    opt.add_argument("--seed", type=int, default=42, help="seed of the data order, dropout and LoRA's initialisation")
    opt.add_argument(
        "--diff-only-steps",
        type=int,
        default=0,
        metavar="K",
        help="train only the new differential parameters for the first K steps, then everything",
    )
    opt.add_argument(
        "--lambda-warmup-steps",
        type=int,
        default=0,
        metavar="N",
        help="ramp the subtracted term in: λ used = min(1, step/N) λ (V1 and V2; nothing of it is saved)",
    )

    run = p.add_argument_group("precision and memory")
    run.add_argument(
        "--bf16",
        choices=("auto", "on", "off"),
        default="auto",
        help="bf16 autocast (auto: on where CUDA supports bf16)",
    )
    run.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="dtype of the loaded weights")
    run.add_argument(
        "--gradient-checkpointing", action="store_true", help="recompute activations: less memory, slower"
    )
    run.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the model (Trainer's torch_compile): faster steps on a GPU, after a compile at the start "
        "(tens of seconds; docs/training.md)",
    )
    run.add_argument(
        "--compile-backend",
        default=None,
        metavar="BACKEND",
        help="torch.compile backend (implies --compile; default inductor; aot_eager traces without generating code)",
    )
    run.add_argument(
        "--parallelism",
        choices=("ddp", "fsdp", "hsdp", "tp", "tp+fsdp"),  # training.parallel.PARALLELISMS (not imported: --help)
        default="ddp",
        help="under torchrun: ddp (a full copy per rank), fsdp (FSDP2, fully sharded), hsdp (sharded within a "
        "node, replicated across nodes), tp (tensor parallel), tp+fsdp (2-D); sharded runs write DCP checkpoints",
    )
    run.add_argument(
        "--tp-size", type=int, default=None, help="tp, tp+fsdp: ranks per tensor-parallel group (default: per node)"
    )
    run.add_argument(
        "--replicas", type=int, default=None, help="hsdp: number of replicas (default: the number of nodes)"
    )
    add_attn_option(run)

    log = p.add_argument_group("evaluation, logging, checkpoints")
    log.add_argument("--eval-steps", type=int, default=None, help="evaluate every N steps (default: only at the end)")
    log.add_argument(
        "--eval-on-start", action="store_true", help="also evaluate before the first step (step-0 perplexity)"
    )
    log.add_argument("--logging-steps", type=int, default=10, help="log loss, lr and λ every N steps")
    log.add_argument("--save-steps", type=int, default=500, help="write a checkpoint every N steps")
    log.add_argument(
        "--save-total-limit", type=int, default=None, help="keep at most N checkpoints (default: none, keep all)"
    )
    log.add_argument(
        "--report-to",
        nargs="+",
        default=None,
        help="tensorboard (default when installed, in OUTPUT/runs), none, ... (the console always shows the logs)",
    )
    log.add_argument(  # the help of cli.options.add_quiet_option, which the other commands share
        "--quiet",
        action="store_true",
        help="no progress bars, and no warnings from transformers, PEFT or tokenizers: results and errors only",
    )
    log.add_argument(
        "--resume",
        nargs="?",
        const="auto",
        default=None,
        metavar="CHECKPOINT",
        help="resume exactly from CHECKPOINT, or (no value / auto) from the last checkpoint in OUTPUT (default: a "
        "fresh run)",
    )
    log.add_argument(
        "--overwrite",
        action="store_true",
        help="start over: the old run's checkpoints and the files it recorded as its own (model, adapter, card, "
        "logs) are deleted once the new run's model has loaded; files of yours stay",
    )
    log.add_argument(
        "--any-model", action="store_true", help="allow a non-Diff MODEL (e.g. the source Llama, as a baseline)"
    )

    lora = p.add_argument_group("LoRA (PEFT)")
    lora.add_argument(
        "--lora", action="store_true", help="train LoRA adapters instead of all weights; saves the adapter"
    )
    lora.add_argument("--lora-r", type=int, default=8, help="LoRA rank r")
    lora.add_argument("--lora-alpha", type=int, default=16, help="LoRA scale alpha (the update is alpha / r x B A)")
    lora.add_argument("--lora-dropout", type=float, default=0.05, help="dropout on the LoRA input")
    lora.add_argument(
        "--lora-target-modules", nargs="+", default=None, help="default: PEFT's default for the model type"
    )
    lora.add_argument(
        "--lora-freeze-lambda", action="store_true", help="do not train λ (default: diff_lambda is in modules_to_save)"
    )
    lora.add_argument(
        "--base",
        help="when MODEL is a LoRA adapter (trained further): its base model (default: from adapter_config.json)",
    )
    lora.add_argument(
        "--load-in-4bit",
        action="store_true",
        help="QLoRA: load the base model in 4-bit NF4 (bitsandbytes; CUDA or CPU)",
    )
    return p


def check_option_values(args) -> None:
    """The options whose values need no model, data or installed package: one line each (exit 2), called by the
    command line before torch and transformers load (`cli.main`, as train's `early_check`) and again by
    `checks.check_args`."""
    if args.block_size is not None and args.block_size < 2:
        raise TrainingError(f"--block-size {args.block_size} must be at least 2")
    if args.resume == "auto" and args.overwrite:
        raise TrainingError(
            "--resume continues the run in --output and --overwrite starts it over: pass one of them (or --resume "
            "PATH --overwrite to continue another run's checkpoint in place of the run in --output)"
        )
    if args.warmup_steps is not None and args.warmup_ratio is not None:
        raise TrainingError("give --warmup-steps or --warmup-ratio, not both")
    if args.warmup_ratio is not None and not 0 <= args.warmup_ratio < 1:
        raise TrainingError(f"--warmup-ratio {args.warmup_ratio} must be in [0, 1)")
    for flag in ("batch_size", "grad_accum", "logging_steps", "save_steps"):
        if getattr(args, flag) < 1:
            raise TrainingError(f"--{flag.replace('_', '-')} {getattr(args, flag)} must be at least 1")
    if args.max_steps is not None and args.max_steps < 1:
        raise TrainingError(f"--max-steps {args.max_steps} must be at least 1")
    if args.eval_steps is not None and args.eval_steps < 1:
        raise TrainingError(
            f"--eval-steps {args.eval_steps} must be at least 1 (--eval-fraction 0 turns evaluation off)"
        )
    for flag, value in (("lr", args.lr), ("weight_decay", args.weight_decay), ("max_grad_norm", args.max_grad_norm)):
        if not (math.isfinite(value) and value >= 0):
            raise TrainingError(f"--{flag.replace('_', '-')} {value} must be a finite number >= 0")
    if not (math.isfinite(args.epochs) and args.epochs > 0):
        raise TrainingError(f"--epochs {args.epochs} must be a finite number > 0")
    if args.lora and not 0 <= args.lora_dropout < 1:
        raise TrainingError(f"--lora-dropout {args.lora_dropout} must be in [0, 1)")
    if args.diff_only_steps < 0:
        raise TrainingError(f"--diff-only-steps {args.diff_only_steps} must be >= 0")
    if args.lambda_warmup_steps < 0:
        raise TrainingError(f"--lambda-warmup-steps {args.lambda_warmup_steps} must be >= 0")
    if args.lambda_warmup_steps and args.max_steps is not None and args.lambda_warmup_steps > args.max_steps:
        raise TrainingError(
            f"--lambda-warmup-steps {args.lambda_warmup_steps} exceeds --max-steps {args.max_steps}: the ramp must "
            "end before the run does, or the saved model is not the one trained; lower it"
        )
    if getattr(args, "chat_data", None):  # the chat template decides the bos token and the text
        for flag, given in (("--no-bos", args.no_bos), ("--text-field", args.text_field != "text")):
            if given:
                raise TrainingError(f"{flag} applies to --data only: --chat-data renders with the chat template")
    files = [*(args.data or []), *(args.eval_data or [])]
    if args.text_field != "text" and files and not any(str(f).lower().endswith(".jsonl") for f in files):
        raise TrainingError(
            f"--text-field {args.text_field} names a field of .jsonl records, and no --data or --eval-data file is "
            ".jsonl (other files are read whole as text): drop --text-field"
        )
    if args.diff_only_steps and args.lora:
        raise TrainingError("--diff-only-steps and --lora do not combine (LoRA already trains only adapters and λ)")
    if args.load_in_4bit and not args.lora:
        raise TrainingError("--load-in-4bit needs --lora (4-bit weights cannot be trained directly)")
    if args.warmup_steps is not None and args.warmup_steps < 0:
        raise TrainingError(f"--warmup-steps {args.warmup_steps} must be >= 0")
    check_seed(args.seed, "--seed", TrainingError)  # Trainer seeds numpy, random and torch alike
    if args.eval_batch_size is not None and args.eval_batch_size < 1:
        raise TrainingError(f"--eval-batch-size {args.eval_batch_size} must be at least 1")
    if args.save_total_limit is not None and args.save_total_limit < 1:
        raise TrainingError(f"--save-total-limit {args.save_total_limit} must be at least 1 (omit it to keep all)")
    if not (math.isfinite(args.eval_fraction) and 0 <= args.eval_fraction < 1):
        raise TrainingError(f"--eval-fraction {args.eval_fraction} must be in [0, 1)")
    if args.eval_fraction == 0 and not args.eval_data:  # Trainer would skip them without a word: nothing held out
        for flag, given in (("--eval-steps", args.eval_steps is not None), ("--eval-on-start", args.eval_on_start)):
            if given:
                raise TrainingError(
                    f"{flag} evaluates on held-out blocks, and --eval-fraction 0 holds none out: pass an "
                    f"--eval-fraction above 0 or --eval-data FILE, or drop {flag}"
                )
    for flag, value in (("--lora-r", args.lora_r), ("--lora-alpha", args.lora_alpha)):
        if args.lora and value < 1:
            raise TrainingError(f"{flag} {value} must be at least 1")


def parse_train_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="diff-transformer train", description="Continued pretraining or chat fine-tuning of a Diff model."
    )
    return add_train_arguments(parser).parse_args(argv)
