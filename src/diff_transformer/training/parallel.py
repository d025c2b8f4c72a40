"""`train --parallelism`: how a run spreads over its processes, and the sharded checkpoints of a sharded run.

    ddp        every rank holds the whole model (Trainer + accelerate's DistributedDataParallel; the default)
    fsdp       FSDP2: every DiffDecoderLayer (and the embeddings, the final norm + head, the root) fully sharded
    hsdp       FSDP2 within a node, replicated across nodes: a 2-D (dp_replicate, fsdp) DeviceMesh
    tp         tensor parallelism over all ranks, through the model's `base_model_tp_plan`
    tp+fsdp    2-D: tensor parallel within groups of --tp-size ranks, FSDP2 across the groups

Every sharded strategy is transformers' own (`from_pretrained(distributed_config=DistributedConfig(...))`): the model
is built on the meta device, sharded, and each rank reads only its shard of the safetensors (transformers'
`DtensorShardOperation`); Trainer knows such a model and neither wraps nor shards it again. accelerate's FSDP plugin
(`TrainingArguments(fsdp=...)`) is not used: accelerate turns FSDP on only for accelerator backends
(`AcceleratorState.__init__` checks `distributed_type in (MULTI_GPU, MULTI_XPU, ...)`, never MULTI_CPU), so on CPU
it silently trains under DDP, and the CPU is where the tests run.

Trainer refuses to checkpoint the optimizer of such a model ("Resuming is not supported for models sharded at load
time"), so the checkpoints are written here, with `torch.distributed.checkpoint` (DCP): each rank writes its own
shards of the weights and Adam states (HuggingFaceStorageWriter: safetensors files, no pickle), and DCP reshards them
on load, onto any world size. What is not a tensor goes beside them as JSON (optimizer hyper-parameters) or as
Trainer writes it (scheduler.pt, rng_state_R.pth, trainer_state.json: the data position).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import NamedTuple

from . import TrainingError


PARALLELISMS = ("ddp", "fsdp", "hsdp", "tp", "tp+fsdp")
SHARDED_DIR = "sharded"  # inside checkpoint-N: the DCP shards of the model and the optimizer
PARAM_GROUPS = "optimizer_param_groups.json"  # inside checkpoint-N: the optimizer's numbers that are not tensors


class Layout(NamedTuple):
    """How WORLD ranks are arranged: REPLICAS x FSDP x TP = WORLD."""

    replicas: int
    fsdp: int
    tp: int


def world_sizes() -> tuple[int, int]:
    """(WORLD_SIZE, LOCAL_WORLD_SIZE) as torchrun sets them (1, 1 for a plain process)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return world, int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))


def plan_layout(args, config) -> Layout | None:
    """The layout of `--parallelism` for this launch, or None for DDP; refused in one line when the world size, the
    nodes or the head counts do not divide (before anything loads)."""
    choice = args.parallelism
    for option in ("tp_size", "replicas"):
        value = getattr(args, option)
        if value is not None and value < 1:
            raise TrainingError(f"--{option.replace('_', '-')} {value}: pass a whole number >= 1")
    if choice == "ddp":
        for option in ("tp_size", "replicas"):
            if getattr(args, option) is not None:
                flag = "--" + option.replace("_", "-")
                raise TrainingError(f"{flag} belongs to a sharded --parallelism (fsdp, hsdp, tp, tp+fsdp): drop it")
        return None
    if "WORLD_SIZE" not in os.environ:  # a plain process: it would train one whole copy, sharded over nothing
        raise TrainingError(
            f"--parallelism {choice} shards over the processes torchrun starts, and this is a plain process: launch "
            "it with torchrun (torchrun --nproc-per-node N -m diff_transformer.cli train ..., docs/training.md), "
            "or drop --parallelism"
        )
    for flag, given in (("--lora", args.lora), ("--load-in-4bit", args.load_in_4bit)):
        if given:
            raise TrainingError(
                f"{flag} with --parallelism {choice}: LoRA trains too few weights to need sharding; "
                "use --parallelism ddp (the default)"
            )
    if args.diff_only_steps:
        raise TrainingError(
            f"--diff-only-steps with --parallelism {choice}: not supported yet on sharded weights; "
            "train this run with --parallelism ddp (the default)"
        )
    world, local = world_sizes()
    if choice == "fsdp":
        layout = Layout(1, world, 1)
    elif choice == "hsdp":
        replicas = args.replicas or max(1, world // local)  # default: one replica per node
        if world % replicas:
            raise TrainingError(
                f"--parallelism hsdp: {world} processes do not split into {replicas} replicas: "
                "pass --replicas N with N dividing the world size (default: the number of nodes)"
            )
        layout = Layout(replicas, world // replicas, 1)
    else:
        tp = args.tp_size or (world if choice == "tp" else local)
        if choice == "tp" and tp != world:
            raise TrainingError(
                f"--parallelism tp --tp-size {tp} on {world} processes: tp uses every rank; "
                "use --parallelism tp+fsdp to shard the rest with FSDP"
            )
        if world % tp:
            raise TrainingError(
                f"--parallelism {choice}: --tp-size {tp} does not divide the {world} processes: "
                "pass a --tp-size that divides the world size (default: processes per node)"
            )
        for name in ("num_attention_heads", "num_key_value_heads"):
            count = getattr(config, name)
            if count % tp:
                raise TrainingError(
                    f"--parallelism {choice}: the model's {name}={count} is not divisible by the tensor-parallel "
                    f"size {tp} (each rank holds whole heads): pass a --tp-size that divides it"
                )
        layout = Layout(1, world // tp, tp)
        if tp > 1 and not _has_accelerator():
            raise TrainingError(
                f"--parallelism {choice} needs GPUs: accelerate's ParallelismConfig, which Trainer uses for a "
                "tensor-parallel model, refuses CPU processes (MULTI_CPU); on CPU use --parallelism fsdp or hsdp"
            )
    if args.replicas is not None and choice != "hsdp":
        raise TrainingError(f"--replicas belongs to --parallelism hsdp, not {choice}: drop it")
    if args.tp_size is not None and choice not in ("tp", "tp+fsdp"):
        raise TrainingError(f"--tp-size belongs to --parallelism tp or tp+fsdp, not {choice}: drop it")
    return layout


def _has_accelerator() -> bool:
    import torch

    return torch.accelerator.is_available()


def distributed_config(layout: Layout, bf16: bool):
    """transformers' DistributedConfig for LAYOUT; with BF16, FSDP2's MixedPrecisionPolicy (bf16 compute and
    all-gathers, fp32 gradient reduction and master weights)."""
    from transformers.distributed import DistributedConfig

    return DistributedConfig(
        fsdp_size=layout.fsdp,
        dp_replicate_size=layout.replicas,
        tp_size=layout.tp,
        tp_plan="auto" if layout.tp > 1 else None,
        fsdp_mixed_precision=bf16 and layout.replicas * layout.fsdp > 1,
    )


def is_sharded(model) -> bool:
    """Whether MODEL was sharded when it loaded (`DistributedConfig`), so its checkpoints are DCP's."""
    return bool(getattr(model, "is_distributed_loading_by_transformers", False))


def is_sharded_checkpoint(checkpoint: Path) -> bool:
    return (Path(checkpoint) / SHARDED_DIR).is_dir()


def _tensor_state(model, optimizer):
    """The model's and the optimizer's state as DCP sees it (DTensors: each rank's own shards), the optimizer's
    flattened by parameter name so that another mesh maps onto it; split into tensors (for DCP) and the rest."""
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    from transformers.distributed.checkpoint import _redistribute_state_dict

    options = StateDictOptions(flatten_optimizer_state_dict=True)
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    # transformers' workaround: DCP writes one chunk per DTensor, which a strided (TP + FSDP) shard is not.
    tensors = _redistribute_state_dict({"model": model_state, "optim": optim_state})
    rest = {key: value for key, value in tensors["optim"].items() if not isinstance(value, torch.Tensor)}
    tensors["optim"] = {key: value for key, value in tensors["optim"].items() if isinstance(value, torch.Tensor)}
    return model_state, optim_state, tensors, rest


def save_sharded(model, optimizer, checkpoint: Path, main: bool) -> None:
    """Every rank's shards of the weights and optimizer states into CHECKPOINT/sharded (collective), the optimizer's
    other numbers (lr, betas...) into CHECKPOINT/optimizer_param_groups.json by the main process."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter

    _, _, tensors, rest = _tensor_state(model, optimizer)
    writer = HuggingFaceStorageWriter(path=str(checkpoint / SHARDED_DIR), save_distributed=True)
    dcp.save(tensors, storage_writer=writer)
    if main:
        (checkpoint / PARAM_GROUPS).write_text(json.dumps(rest, sort_keys=True), encoding="utf-8")


def load_sharded(model, optimizer, checkpoint: Path) -> None:
    """`save_sharded` read back into this run's MODEL and OPTIMIZER, resharded onto this run's mesh."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict
    from transformers.distributed.checkpoint import _redistribute_state_dict

    model_state, optim_state, tensors, _ = _tensor_state(model, optimizer)
    dcp.load(tensors, storage_reader=HuggingFaceStorageReader(str(checkpoint / SHARDED_DIR)))
    model_state = _redistribute_state_dict(tensors["model"], reference_state_dict=model_state)
    loaded = _redistribute_state_dict(
        tensors["optim"], reference_state_dict={key: optim_state[key] for key in tensors["optim"]}
    )
    groups = json.loads((checkpoint / PARAM_GROUPS).read_text(encoding="utf-8"))
    optim_state = {**optim_state, **loaded, **{key: groups[key] for key in optim_state if key in groups}}
    set_state_dict(
        model,
        optimizer,
        model_state_dict=model_state,
        optim_state_dict=optim_state,
        options=StateDictOptions(flatten_optimizer_state_dict=True),
    )


def sharded_shapes(checkpoint: Path) -> dict[str, tuple]:
    """name -> global shape of every model tensor in a sharded checkpoint (the safetensors headers' DCP metadata)."""
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = HuggingFaceStorageReader(str(Path(checkpoint) / SHARDED_DIR)).read_metadata()
    return {
        key.removeprefix("model."): tuple(value.size)
        for key, value in metadata.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(value, TensorStorageMetadata)
    }


def local_state_bytes(model, optimizer) -> dict[str, int]:
    """Bytes of model state this rank holds: its local shards of the parameters, their gradients and the optimizer
    states (exact: the storage of each local tensor)."""
    import torch
    from torch.distributed.tensor import DTensor

    def local(tensor):
        return tensor.to_local() if isinstance(tensor, DTensor) else tensor

    def size(tensor):
        tensor = local(tensor)
        return tensor.numel() * tensor.element_size()

    params = list(model.parameters())
    counts = {
        "params": sum(size(p) for p in params),
        "grads": sum(size(p.grad) for p in params if p.grad is not None),
        "optimizer": sum(
            size(value)
            for state in optimizer.state.values()
            for value in state.values()
            if isinstance(value, torch.Tensor)
        ),
    }
    counts["total"] = sum(counts.values())
    return counts
