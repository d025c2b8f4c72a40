"""Command-line options of `diff-transformer train` (argparse only, so `diff-transformer --help` stays fast)."""

from __future__ import annotations

import argparse

from ..checkpoints.backends import add_attn_option


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
        "--parallelism",
        choices=("ddp", "fsdp", "hsdp", "tp", "tp+fsdp"),  # training.parallel.PARALLELISMS (not imported: --help)
        default="ddp",
        help="under torchrun: ddp (a full copy per rank), fsdp (FSDP2, fully sharded), hsdp (sharded within a "
        "node, replicated across nodes), tp (tensor parallel), tp+fsdp (2-D); sharded runs write DCP checkpoints",
    )
    run.add_argument(
        "--tp-size", type=int, default=None, help="tp+fsdp: ranks per tensor-parallel group (default: per node)"
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


def parse_train_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="diff-transformer train", description="Continued pretraining or chat fine-tuning of a Diff model."
    )
    return add_train_arguments(parser).parse_args(argv)
