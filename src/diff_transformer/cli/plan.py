"""`diff-transformer plan MODEL_OR_CONFIG`: memory per GPU of training a Diff model (or a Llama-family source as
`convert` would turn it into one) on nodes x GPUs under each sharding strategy, from its config alone
(`diff_transformer.training.plan`)."""

import math
import re
from pathlib import Path

from .options import add_quiet_option


STRATEGIES = ("ddp", "fsdp", "hsdp", "tp", "tp+fsdp")
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40})


def _positive(text: str) -> int:
    import argparse

    if not re.fullmatch(r"\d+", text.strip()) or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1")
    return int(text)


def memory_size(text: str) -> int:
    """Bytes of "80GiB", "141 GB", "24GiB" (GB = 10^9, GiB = 2^30). A bare number is refused, not read as bytes:
    `--gpu-memory 80` means 80 GB or GiB to anyone who types it (accelerate's max_memory strings refuse it too)."""
    import argparse

    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*((?:[KMGT]I?)?B)?", text.strip().upper())
    size = float(match.group(1)) * _UNITS[match.group(2) or "B"] if match else math.inf
    if not math.isfinite(size):  # inf: 400 digits overflow a float
        raise argparse.ArgumentTypeError(f"{text!r} is not a memory size: write it like 80GiB or 141GB")
    if size > 0 and not match.group(2):
        raise argparse.ArgumentTypeError(
            f"{text.strip()} has no unit: write {match.group(1)}GiB or {match.group(1)}GB"
        )
    if size < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be more than zero: write the GPU's memory, e.g. 80GiB")
    return int(size)


def add_parser(commands) -> None:
    plan = commands.add_parser(
        "plan", help="memory per GPU of training a model (or a Llama config as converted) on nodes x GPUs"
    )
    plan.add_argument(
        "model", metavar="MODEL_OR_CONFIG", help="a Diff or Llama-family checkpoint directory or config.json"
    )
    plan.add_argument("--nodes", type=_positive, default=1, help="machines")
    plan.add_argument("--gpus-per-node", type=_positive, default=8, help="GPUs on each machine")
    plan.add_argument(
        "--strategy",
        choices=(*STRATEGIES, "all"),
        default="all",
        help="ddp (full copies), fsdp (all ranks shard), hsdp (shard in a node, replicate across), tp (tensor "
        "parallel in a node), tp+fsdp (tp in a node, fsdp across nodes), or all that apply",
    )
    plan.add_argument(
        "--diff-version",
        type=int,
        choices=(1, 2),
        default=None,
        help="for a Llama-family config: the version to convert it to (default: 2, as convert)",
    )
    plan.add_argument(
        "--micro-batch", type=_positive, default=1, help="sequences per GPU per step (train --batch-size)"
    )
    plan.add_argument(
        "--seq-len",
        type=_positive,
        default=None,
        help="tokens per sequence (train --block-size; default: 2048, or the model's context if shorter)",
    )
    plan.add_argument("--gradient-checkpointing", action="store_true", help="recompute activations in the backward")
    plan.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="train --dtype")
    plan.add_argument("--bf16", choices=("on", "off"), default="on", help="bf16 autocast (train --bf16)")
    plan.add_argument(
        "--attn-implementation",
        choices=("sdpa", "diff_triton"),
        default="sdpa",
        help="train --attn-implementation: sdpa, or V1's fused kernel diff_triton (keeps K and V unexpanded)",
    )
    plan.add_argument("--gpu-memory", type=memory_size, default="80GiB", help="memory of one GPU, e.g. 80GiB")
    add_quiet_option(plan)
    plan.set_defaults(func=run)


def run(args) -> int:
    from diff_transformer.errors import UserError

    if not Path(args.model).expanduser().exists():
        raise UserError(f"{args.model} does not exist: pass a local checkpoint directory or config.json.")
    strategies = STRATEGIES if args.strategy == "all" else (args.strategy,)
    if args.nodes == 1:  # hsdp and tp+fsdp need several nodes to differ from fsdp and tp
        if args.strategy in ("hsdp", "tp+fsdp"):
            raise UserError(f"--strategy {args.strategy} spreads over nodes: give --nodes 2 or more, or use fsdp/tp.")
        strategies = tuple(s for s in strategies if s not in ("hsdp", "tp+fsdp"))

    import torch

    from diff_transformer.training.plan import (
        Layout,
        Training,
        check_seq_len,
        load_config,
        meta_model,
        plan_memory,
    )

    config = load_config(args.model, args.diff_version)
    args.seq_len = check_seq_len(config, args.seq_len)
    model = meta_model(config)
    training = Training(
        micro_batch=args.micro_batch,
        seq_len=args.seq_len,
        dtype=getattr(torch, args.dtype),
        bf16=args.bf16 == "on",
        gradient_checkpointing=args.gradient_checkpointing,
        attn_implementation=args.attn_implementation,
    )
    rows, skipped = [], []
    for strategy in strategies:
        layout = Layout(args.nodes, args.gpus_per_node, strategy)
        try:
            rows.append((strategy, plan_memory(config, layout, training, model)))
        except UserError as error:
            if args.strategy != "all":
                raise
            skipped.append(f"{strategy}: {error}")
    print(describe(config, args, rows[0][1].parameters if rows else None))
    print(table(rows, args.gpu_memory))
    for line in skipped:
        print(f"not planned: {line}")
    return 0


def describe(config, args, parameters) -> str:
    # a tiny model (the shipped one: 2.1M) would print as 0.00B
    scale, unit = (1e9, "B") if parameters and parameters >= 1e9 else (1e6, "M")
    count = f"{parameters / scale:.2f}{unit} parameters, " if parameters else ""
    return (
        f"Diff V{config.diff_version} ({count}{config.num_hidden_layers} layers, hidden {config.hidden_size}, "
        f"{config.num_attention_heads} heads / {config.num_key_value_heads} KV heads) on {args.nodes} node(s) x "
        f"{args.gpus_per_node} GPU(s); micro-batch {args.micro_batch} x {args.seq_len} tokens, {args.dtype} weights, "
        f"bf16 autocast {args.bf16}, gradient checkpointing {'on' if args.gradient_checkpointing else 'off'}. "
        "GiB per GPU:"
    )


def table(rows, gpu_memory: int) -> str:
    gib = 1 << 30
    lines = [
        "| strategy | weights | gradients | optimizer | activations | transient | total | "
        f"fits {gpu_memory / gib:g} GiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for strategy, plan in rows:
        parts = (plan.weights, plan.gradients, plan.optimizer, plan.activations, plan.transient, plan.total)
        cells = " | ".join(f"{part / gib:.1f}" for part in parts)
        lines.append(f"| {strategy} | {cells} | {'yes' if plan.total <= gpu_memory else 'no'} |")
    return "\n".join(lines)
