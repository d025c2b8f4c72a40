"""Memory per GPU of a training run, planned from a config alone (`diff-transformer plan`): the model is built on the
meta device (no weights, no memory), its parameters counted exactly, and each rank's share worked out for a layout of
nodes x GPUs and a strategy. Pure arithmetic: nothing distributed is started.

What each rank holds (Trainer's AdamW, `torch.optim.AdamW`):

* weights: every parameter in the dtype it is loaded in (`--dtype`; float32 by default). Mixed precision (`--bf16`)
  is autocast: the weights stay float32 and are the master copy, no second one is kept. V1's λ vectors are float32
  whatever the dtype (`DiffPreTrainedModel`);
* gradients: one per trainable weight, its dtype;
* optimizer: AdamW's two moments (exp_avg, exp_avg_sq), each like its parameter, and one float32 `step` per parameter
  tensor: 4 + 4 + 8 = 16 bytes per parameter with float32 weights, 2 + 2 + 4 = 8 with bfloat16 ones;
* activations: what the backward pass keeps per token on a GPU's code path (`activation_bytes_per_token`, from the
  layer shapes; with bf16 weights exactly what autograd saves, counted in the tests), for micro-batch x sequence
  length tokens;
* transient (FSDP/HSDP): the unsharded parameters of the layer being computed and the one prefetched, and one layer's
  unsharded gradients, in the compute dtype.

Sharding, as torch's `fully_shard` (FSDP2) does it: every parameter split on dim 0 into `world` chunks
(`torch.chunk`: ceil(rows / world) rows each, the last ranks possibly fewer or none), gradients and moments alike.
ddp: nothing sharded. fsdp: over all ranks. hsdp: over one node's GPUs, replicated across nodes. tp: the model's
tp plan (its `base_model_tp_plan`, the embeddings and head split by vocabulary, the rest replicated) over one node's
GPUs, data-parallel across nodes. tp+fsdp: tp within a node, then each rank's tp shard fully sharded across the nodes.
"""

from __future__ import annotations

import fnmatch
import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from ..errors import UserError


STRATEGIES = ("ddp", "fsdp", "hsdp", "tp", "tp+fsdp")


@dataclass(frozen=True)
class Layout:
    """NODES x GPUS_PER_NODE ranks and how the model state is spread over them."""

    nodes: int
    gpus_per_node: int
    strategy: str

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def tp(self) -> int:
        """Tensor-parallel degree (one node's GPUs; 1 without tp)."""
        return self.gpus_per_node if self.strategy.startswith("tp") else 1

    @property
    def shards(self) -> int:
        """Over how many ranks each (tp-local) tensor is fully sharded."""
        return {"ddp": 1, "fsdp": self.world, "hsdp": self.gpus_per_node, "tp": 1, "tp+fsdp": self.nodes}[
            self.strategy
        ]

    @property
    def fsdp_ranks(self) -> int:
        """Over how many ranks FSDP2 runs, sharding or replicating (1: not at all). train turns --bf16 into FSDP2's
        bf16 MixedPrecisionPolicy exactly when this is over 1 (`training.parallel.distributed_config`: replicas x
        fsdp > 1), e.g. hsdp with one GPU per node too; a 1-rank fsdp run is not sharded and autocasts."""
        return {"ddp": 1, "fsdp": self.world, "hsdp": self.world, "tp": 1, "tp+fsdp": self.nodes}[self.strategy]


@dataclass(frozen=True)
class Training:
    """What a run computes: tokens per micro-batch, dtypes, recomputation."""

    micro_batch: int = 1
    seq_len: int = 2048
    dtype: torch.dtype = torch.float32  # of the loaded weights (train --dtype)
    bf16: bool = True  # autocast (train --bf16)
    gradient_checkpointing: bool = False
    attn_implementation: str = "sdpa"  # train --attn-implementation: "sdpa" or V1's fused "diff_triton"

    @property
    def compute_bytes(self) -> int:
        """Bytes of an activation element: bf16 under autocast, else the weights' dtype."""
        return 2 if self.bf16 else torch.finfo(self.dtype).bits // 8


@dataclass
class Plan:
    """Bytes per rank (the largest over the ranks) of each part, and what went into them."""

    parameters: int
    weights: int
    gradients: int
    optimizer: int
    activations: int
    transient: int
    activation_bytes_per_token: dict = field(default_factory=dict)

    @property
    def model_state(self) -> int:
        return self.weights + self.gradients + self.optimizer

    @property
    def total(self) -> int:
        return self.model_state + self.activations + self.transient


def meta_model(config):
    """The model of CONFIG on the meta device (no storage): exact parameter names, shapes and dtypes."""
    from .. import modeling_diff

    with torch.device("meta"):
        return getattr(modeling_diff, (config.architectures or ["DiffForCausalLM"])[0])(config)


def chunk_rows(rows: int, world: int, rank: int) -> int:
    """Rows of RANK's chunk when `rows` are split as `torch.chunk` (and so FSDP2's `fully_shard`) splits dim 0:
    ceil(rows / world) each, fewer or none for the last ranks. Rank 0's chunk is the largest of every tensor, so
    rank 0 holds the most state: no count ever loops over the world."""
    size = math.ceil(rows / world) if rows else 0
    return max(0, min(size, rows - rank * size))


# transformers' tensor-parallel styles (transformers/distributed/tensor_parallel.py) by the weight dim they split
_SPLIT_ROWS = ("colwise", "colwise_gather_output", "colwise_rep", "embedding_rowwise", "packed_colwise")
_SPLIT_COLUMNS = ("rowwise", "rowwise_rep", "embedding_colwise", "packed_rowwise")


def tp_style(name: str, plan: dict) -> str | None:
    """The style the model's tp plan gives parameter NAME (e.g. model.layers.3.self_attn.q_proj.weight), None when
    it names none (replicated)."""
    module = name.rsplit(".", 1)[0]
    for pattern, style in plan.items():
        if fnmatch.fnmatchcase(module, pattern):
            return style
    return None


def local_shapes(model, layout: Layout) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(name, shape, dtype) of each parameter as the tp rank holding the most holds it (before FSDP's sharding), from
    the plan transformers applies (`model._tp_plan`: the config's `base_model_tp_plan`, the embeddings split by
    vocabulary, the head's own): row styles split weight dim 0 and the bias, column styles weight dim 1 (the bias
    stays whole), ceil(size / tp) on the largest rank."""
    plan = dict(getattr(model, "_tp_plan", None) or {}) if layout.tp > 1 else {}
    shapes = []
    for name, param in model.named_parameters():
        shape, style = tuple(param.shape), tp_style(name, plan)
        dim = 0 if style in _SPLIT_ROWS else 1 if style in _SPLIT_COLUMNS and len(shape) == 2 else None
        if dim is not None:
            shape = shape[:dim] + (math.ceil(shape[dim] / layout.tp),) + shape[dim + 1 :]
        shapes.append((name, shape, param.dtype))
    return shapes


def state_bytes(model, layout: Layout, training: Training, rank: int | None = None) -> dict:
    """Weights, gradients and AdamW moment bytes held by RANK (None: the rank holding the most), and the parameter
    count: each parameter's tp-local shape (`local_shapes`) split on dim 0 as `chunk_rows` says, in the dtype it is
    loaded in (`element_bytes`); gradients and both moments like the parameter. (AdamW's `step` is a float32 scalar
    per parameter tensor on the CPU: not GPU memory, not counted.)"""
    strict, fp16_kept = _kept_fp32(model)
    tensors = [  # (rows, elements per row, bytes per element) of each tp-local parameter
        (shape[0] if shape else 1, math.prod(shape[1:]), element_bytes(name, training.dtype, strict, fp16_kept))
        for name, shape, _ in local_shapes(model, layout)
    ]
    # the tp ranks of one shard hold the same shapes; shard index 0 holds the largest chunk of every tensor
    shard_rank = 0 if rank is None else (rank // layout.tp) % layout.shards if layout.tp > 1 else rank % layout.shards
    weights = sum(chunk_rows(rows, layout.shards, shard_rank) * row * size for rows, row, size in tensors)
    return {
        "weights": weights,
        "gradients": weights,
        "optimizer": 2 * weights,
        "parameters": sum(p.numel() for p in model.parameters()),
    }


def _kept_fp32(model) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The module names transformers keeps in float32: always (strict; V1's λ vectors), and under float16 too."""
    return tuple(model._keep_in_fp32_modules_strict or ()), tuple(model._keep_in_fp32_modules or ())


def element_bytes(name: str, dtype: torch.dtype, strict=(), fp16_kept=()) -> int:
    """Bytes of one element of parameter NAME when the model is loaded in DTYPE: float32 for the modules
    transformers keeps in float32 (`_keep_in_fp32_modules_strict` in any dtype, `_keep_in_fp32_modules` under
    float16), else DTYPE's."""
    parts = name.split(".")
    kept = strict + (fp16_kept if dtype == torch.float16 else ())
    if any(".".join(parts[i : i + len(k.split("."))]) == k for k in kept for i in range(len(parts))):
        return 4
    return torch.finfo(dtype).bits // 8


def activation_bytes_per_token(config, training: Training) -> dict:
    """Bytes per token the backward pass keeps, per decoder layer and for the head, on a GPU's code path (sdpa's fused
    kernels: the maps are recomputed, never stored). Counted, not guessed: with bf16 weights (what FSDP2's bf16 policy
    computes in) this is exactly what autograd saves per layer on that path, for V1 and V2 with and without GQA
    (tests/training/test_plan.py counts it on the meta device with benchmarks/census.py's CUDA dispatch). r: the
    residual stream's bytes (float32 weights keep it float32 under autocast), c: the compute dtype's.

    * each of the two RMSNorms: its input upcast to float32 (4 bytes; the residual itself when that is float32), the
      normalized values in the residual's dtype (r), the weighted product the projections read (c): D each, and
      float32 1/rms (1);
    * attention: V2's one flash call over its 2H query heads keeps q and the output (2H·d each), k and v (H_kv·d
      each) and the log-sum-exp (2H, float32); then the output combined with λ, which o_proj reads (H·d), and λ (H).
      V1's values are 2d wide, so sdpa takes the memory-efficient kernel, which has no GQA: k and v are expanded to
      the 2H query heads (2H·d and 2H·2d), beside q (2H·d), the output (2H·2d) and the log-sum-exp; then the
      sub-layer norm's input and o_proj's input (H·2d each). V1 under "diff_triton" (the fused kernel: GQA without
      copies, both maps in one pass) keeps q (2H·d), k and v as projected (2H_kv·d each), the combined output, the
      second map's output and o_proj's input (H·2d each) and both maps' log-sum-exps (2H, float32); V2 runs sdpa
      under it;
    * MLP: gate and up outputs, the activation and the product: 4I.

    With gradient checkpointing a layer keeps only its input (D in the residual dtype) and one layer is recomputed at a
    time. The head keeps the logits (V, compute dtype), their float32 copy for the loss and its log-softmax (V float32
    each). Returned per token: a layer's part every tp rank keeps, its part tp splits, a checkpointed layer's input,
    the head's. A Motif-shaped V1 (grouped noise heads) is planned as the V1 of its head counts."""
    c = training.compute_bytes
    residual = 4 if training.dtype == torch.float32 else c
    D, inter, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    H, kv = config.num_attention_heads, config.num_key_value_heads
    d = getattr(config, "head_dim", None) or D // H
    lse = 2 * H * 4  # float32, one per query head
    v1 = int(getattr(config, "diff_version", 2)) == 1
    if v1 and training.attn_implementation == "diff_triton":
        attention = (2 * H * d + 2 * kv * d + 2 * kv * d + 3 * H * 2 * d) * c + lse
    elif v1:
        attention = (2 * H * d + 2 * H * d + 2 * H * 2 * d + 2 * H * 2 * d + H * 2 * d + H * 2 * d) * c + lse
    else:
        attention = (2 * H * d + kv * d + kv * d + 2 * H * d + H * d + H) * c + lse
    whole = 2 * ((4 + residual + c) * D + 4)  # two norms; every tp rank keeps these (no sequence parallelism)
    split = attention + 4 * inter * c  # heads and MLP columns: each tp rank keeps 1/tp
    return {"layer_whole": whole, "layer_split": split, "checkpoint": D * residual, "head": vocab * (c + 4 + 4)}


def activation_bytes(config, training: Training, tp: int = 1) -> int:
    """Activation bytes one rank keeps for a micro-batch: every layer's (`activation_bytes_per_token`), or with
    gradient checkpointing every layer's input and one layer's recomputed activations, and the head's logits (tp's
    lm_head gathers them: whole on every rank)."""
    per_token = activation_bytes_per_token(config, training)
    layer = per_token["layer_whole"] + per_token["layer_split"] // tp
    layers = config.num_hidden_layers
    kept = layers * per_token["checkpoint"] + layer if training.gradient_checkpointing else layers * layer
    return (kept + per_token["head"]) * training.micro_batch * training.seq_len


def autocast_copy_bytes(model, layout: Layout, training: Training) -> int:
    """Bytes of the bf16 copies autocast makes of float32 weights for its matmuls, which autograd keeps for the
    backward (each matmul saves the weight it multiplied): every `nn.Linear` weight, the head's included, tp-local
    (counted in the tests). With gradient checkpointing only the head's and the recomputed layer's: a checkpointed
    forward saves none (from the mechanism, not counted). None unless autocast runs over float32 weights unsharded:
    FSDP2's bf16 policy hands the layers bf16 weights itself and frees them after each layer (`transient`)."""
    if not (training.bf16 and training.dtype == torch.float32) or layout.fsdp_ranks > 1:
        return 0
    numel = {
        id(param): math.prod(shape) for (_, shape, _), param in zip(local_shapes(model, layout), model.parameters())
    }
    copies = [
        (name, numel[id(module.weight)])
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and id(module.weight) in numel
    ]
    if training.gradient_checkpointing:
        copies = [
            (name, n)
            for name, n in copies
            if not name.startswith("model.layers.") or name.startswith("model.layers.0.")
        ]
    return training.compute_bytes * sum(n for _, n in copies)


def plan_memory(config, layout: Layout, training: Training, model=None) -> Plan:
    """Per-rank bytes of CONFIG's model (MODEL: its `meta_model`, built if not given) trained as TRAINING asks on
    LAYOUT (the rank holding the most)."""
    check_layout(config, layout)
    check_seq_len(config, training.seq_len)
    model = meta_model(config) if model is None else model
    state = state_bytes(model, layout, training)
    computed = training
    mixed = training.bf16 and layout.fsdp_ranks > 1
    if mixed:
        # train's FSDP2 runs turn --bf16 into FSDP2's MixedPrecisionPolicy (training/parallel.py): the layers see
        # bf16 weights, so the residual stream is bf16 too, not autocast's float32
        computed = replace(training, dtype=torch.bfloat16)
    per_token = activation_bytes_per_token(config, computed)
    activations = activation_bytes(config, computed, layout.tp) + autocast_copy_bytes(model, layout, training)
    transient = 0
    if layout.shards > 1 or mixed:  # FSDP2: two layers' parameters gathered (or cast to bf16), one layer's grads
        layer = sum(p.numel() for p in model.model.layers[0].parameters()) // layout.tp
        transient = 3 * layer * training.compute_bytes
    parts = (state["weights"], state["gradients"], state["optimizer"], activations, transient)
    return Plan(state["parameters"], *parts, activation_bytes_per_token=per_token)


def check_layout(config, layout: Layout) -> None:
    """Refuse, in one line, a layout the strategy cannot use: counts below 1, tp degrees that split no head count."""
    if layout.strategy not in STRATEGIES:
        raise UserError(f"--strategy {layout.strategy!r} is not one of {', '.join(STRATEGIES)}.")
    if layout.nodes < 1 or layout.gpus_per_node < 1:
        raise UserError("--nodes and --gpus-per-node must be at least 1.")
    if layout.strategy == "hsdp" and layout.nodes < 2:
        raise UserError("--strategy hsdp replicates across nodes: with one node use fsdp, or give --nodes 2 or more.")
    for what, count in (("attention", config.num_attention_heads), ("key/value", config.num_key_value_heads)):
        if count % layout.tp:
            raise UserError(
                f"{layout.tp} tensor-parallel ranks (--gpus-per-node) cannot split {count} {what} heads: use a "
                "divisor of the head counts, or --strategy fsdp."
            )


def check_seq_len(config, seq_len: int | None) -> int:
    """The sequence length to plan: SEQ_LEN, or (None) 2048 capped at the model's context, as train caps its
    --block-size default (a refused default would fail a bare `plan` on a short-context model); one longer than
    the context is refused as train refuses that --block-size."""
    context = getattr(config, "max_position_embeddings", None)
    if seq_len is None:
        return min(2048, context or 2048)
    if context is not None and seq_len > context:
        raise UserError(
            f"--seq-len {seq_len} exceeds the model's context ({context} positions, max_position_embeddings): "
            f"pass --seq-len {context} or less."
        )
    return seq_len


def load_config(model_or_config, diff_version: int | None = None):
    """The Diff config to plan: a Diff checkpoint's (directory or config.json), or the one `convert` would write for
    a Llama-family source's config (`conversion.plan.planned_config`, V2 by default as there). Local files only."""
    path = Path(model_or_config).expanduser()
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise UserError(f"{path} has no config.json: pass a checkpoint directory or a config.json file (local).")
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UserError(f"{file} is not a readable JSON config ({' '.join(str(exc).split())[:200]}): fix it.") from exc
    if not isinstance(data, dict):
        raise UserError(f"{file} is not a config (a JSON object): pass a model's config.json.")
    from ..checkpoints.loading import check_config_against_weights, check_config_sizes_plausible

    # the model is built (on the meta device: time, not memory) from what the config claims: bounded first
    check_config_against_weights(file.parent, data, str(path))  # next to weights: it must describe them
    check_config_sizes_plausible(data, str(path))
    if data.get("model_type") == "diff":
        from ..configuration_diff import DiffConfig

        config = DiffConfig.from_dict(data)
        if diff_version is not None and diff_version != config.diff_version:
            raise UserError(
                f"{file} is a Diff V{config.diff_version} config: drop --diff-version (it chooses the conversion of "
                "a Llama-family config)."
            )
        return config
    from ..conversion.plan import planned_config

    return planned_config(data, diff_version, str(file))
