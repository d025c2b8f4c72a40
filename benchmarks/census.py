#!/usr/bin/env python
"""Census of the work each model dispatches per decoder layer, on the code path a GPU takes, on any machine.

For Llama, transformers' DiffLlama, Diff V1 (sdpa and "diff_triton") and Diff V2, it counts per decoder layer, for a
training step (forward + backward with labels, no cache, as bench_gpu.py's), a prefill (base forward filling a
DynamicCache) and one decode step after a cached prefix:

* ops: the aten ops dispatched that launch work (see "What counts" below); on a GPU each is at least one kernel
  launch, so at batch 1 (launch-bound decoding) the ratio of ops predicts the ratio of step times;
* bytes: the bytes those ops write (the sum of their output tensors' sizes; an in-place op writes its whole self);
* FLOPs: `torch.utils.flop_counter.FlopCounterMode`'s count (matmuls and attention calls; elementwise ops are 0).

    python benchmarks/census.py                # the table (Markdown) on stdout
    python benchmarks/census.py --verbose      # + the per-op breakdown of each model against Llama
    python benchmarks/census.py --write        # also benchmarks/results/census.json (then results_page.py)
    python benchmarks/census.py --tiny         # the tiny geometry of tests/benchmarks/test_census.py

How
---
Every model runs on the meta device (`torch.device("meta")`): shapes without memory, so the 0.85B geometry costs
nothing and the package's CPU-only strategies (chosen where `query.device.type == "cpu"`) are not taken. Three things
a CUDA device decides differently from meta are emulated, because they decide what a GPU dispatches:

* `F.scaled_dot_product_attention` is a composite op that picks its kernel by device; meta would fall back to the
  math decomposition (a dozen ops). `CudaDispatchMode` picks as torch's CUDA dispatcher does for bf16 on sm80/sm90
  (priority flash, then memory-efficient, then math): flash where there is no mask, q/k/v share one head size <= 256
  (a multiple of 8) and is_causal is not asked with fewer queries than keys (GQA allowed); memory-efficient where q
  and k share the head size (V may differ), heads are equal (no GQA) and there is no mask; else the math
  decomposition. It then
  calls `aten._scaled_dot_product_flash_attention` / `_efficient_attention` itself (one op each, and autograd's one
  backward op). No call in this census passes a mask (batch 1, no padding: transformers' sdpa mask is None).
* `F.rms_norm` (`nn.RMSNorm`'s, DiffLlama's per-head norm and Diff V1's subln; Llama's own RMSNorm is written out op
  by op and is not one) runs torch's fused kernel on CUDA, `aten._fused_rms_norm`, one op (and one
  `_fused_rms_norm_backward`), where the weight has the input's dtype; meta and CPU run its composite (8 ops in bf16).
  `cuda_rms_norm` counts it as CUDA runs it, with the bytes its kernels write.
* "diff_triton": the fused V1 kernel launches Triton kernels, which no dispatch mode sees. `counted_triton` runs the
  op's own Python (its allocations, contiguous copies, λ cast, backward's dλ sum) on meta with the Triton launches
  replaced by a recorder: each launch counts as one op named `triton.<kernel>`, with the bytes of the output tensors it
  writes and the FLOPs FlopCounterMode gives two attention calls of the same shapes (QKᵀ over d, AV over 2d per map).

Per-layer figures: each model is built with 1 and with 2 decoder layers and the census of the second minus the first
is one layer's (embeddings, rotary tables, mask building, final norm, LM head and loss drop out). The decode step's
cache is filled by a prefill on meta too.

What counts: every aten op except the metadata-only ones, which launch nothing on a GPU: views (`OpOverload.is_view`:
view, reshape-as-view, transpose, permute, expand, slice, select, unsqueeze, t, split, detach, alias ...), plus
`_unsafe_view`, `lift_fresh`, `empty*`/`new_empty*` (allocation, no kernel) and `_local_scalar_dense`. A
`reshape` that must copy dispatches `clone` (counted) then `_unsafe_view` (not). `--verbose` lists the skipped ones
too. Counting is exact and machine-independent for a given torch / transformers / source: the same on any machine.

Geometry (default): bench_gpu.py's 0.85B models, bf16: hidden 2048, 32 heads x 64 (V1: H = 16, H_kv = 4, Llama's
matrices; V2: H = 16, H_kv = 8, the authors' comparison), 8 KV heads, intermediate 5632, vocab 32000; training and
prefill over 4096 tokens, decoding the token after a 4096-token prefix, batch 1. Op counts do not depend on widths or
lengths (the dispatch is the same), bytes and FLOPs do. `--tiny` (the test's) has the same head size 64 and the same
GQA groups, so the same dispatch.

Floor: Llama's count plus the ops of the least work the differential step needs, itself counted under the same rules
(`floor_extra`, whose docstring gives the reasoning); ops only.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import re
import sys
import traceback
from pathlib import Path
from unittest import mock


sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
from results_page import CENSUS_LABELS as LABELS  # noqa: E402  (the page renders census.json with its table)
from results_page import CENSUS_PHASES as PHASE_LABELS  # noqa: E402
from results_page import census_table as table  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402
from torch.utils._python_dispatch import (  # noqa: E402
    TorchDispatchMode,
    _disable_current_modes,
    _get_current_dispatch_mode_stack,
)
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count  # noqa: E402

from bench_common import REPO, config_kwargs, provenance, same_matrices_model  # noqa: E402


RESULTS = REPO / "benchmarks" / "results" / "census.json"
PHASES = ("decode", "prefill", "train")
CONFIGS = ("llama/sdpa", "diffllama/sdpa", "v1/sdpa", "v1/diff_triton", "v2/sdpa")
FULL = dict(hidden=2048, heads=32, kv_heads=8, head_dim=64, intermediate=5632, vocab=32000, seq=4096)
# the same dispatch as FULL: head size 64, 4 query heads per KV head (V2: 2), V1's H_kv > 1 (repeat_kv copies), more
# than 16 queries with more than 64 rows per KV group (the fused op's prefill path)
TINY = dict(hidden=128, heads=16, kv_heads=4, head_dim=64, intermediate=256, vocab=64, seq=32)
DTYPE = torch.bfloat16

# Metadata-only ops: no kernel on a GPU, nothing written.
NO_LAUNCH = {"_unsafe_view", "lift_fresh", "empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided"}
NO_LAUNCH |= {"_local_scalar_dense", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset"}


# ------------------------------------------------------------------------------------------------------- counting
class Census(TorchDispatchMode):
    """Counts the aten ops dispatched while active: name -> calls, name -> bytes written; `skipped` the metadata
    ops (see the module docstring). With `where`, also (name, source line) -> calls in `sites`: the innermost frame
    outside torch of the forward code that dispatched the op, for a backward op the forward line that made its
    autograd node (anomaly mode records it)."""

    def __init__(self, where: bool = False):
        super().__init__()
        self.ops, self.bytes, self.skipped = collections.Counter(), collections.Counter(), collections.Counter()
        self.sites = collections.Counter()
        self.active, self.triton_flops, self.where = False, 0, where

    def __enter__(self):
        self.active = True
        return super().__enter__()

    def __exit__(self, *exc):
        self.active = False
        return super().__exit__(*exc)

    def record(self, name: str, out) -> None:
        self.ops[name] += 1
        self.bytes[name] += sum(t.numel() * t.element_size() for t in _tensors(out))
        if self.where:
            self.sites[(name, _site())] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if func.is_view or name in NO_LAUNCH:
            self.skipped[name] += 1
        else:
            self.record(name, out)
        return out


_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


def _site() -> str:
    """'file.py:line function' of the model code behind the op being dispatched (see `Census`)."""
    node = torch._C._current_autograd_node()
    if node is not None:  # backward: the forward stack anomaly mode kept on the node
        frames = [m.groups() for line in node.metadata.get("traceback_", []) for m in [_FRAME.search(line)] if m]
        prefix = f"backward of {node.name()} at "
    else:
        frames = [(f.filename, f.lineno, f.name) for f in traceback.extract_stack()]
        prefix = ""
    for filename, line, function in reversed(frames):
        if "/torch/" not in filename and not filename.endswith(("census.py", "contextlib.py")):
            return f"{prefix}{Path(filename).name}:{line} {function}"
    return prefix + "?"


def _tensors(out):
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _tensors(o)]
    return []


class CudaDispatchMode(TorchFunctionMode):
    """`F.scaled_dot_product_attention` and `F.rms_norm` as a CUDA device dispatches them (module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            return cuda_sdpa(*args, **kwargs)
        if func in (torch.nn.functional.rms_norm, torch.rms_norm):
            return cuda_rms_norm(*args, **kwargs)
        return func(*args, **kwargs)


def cuda_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    d_q, d_k, d_v = query.shape[-1], key.shape[-1], value.shape[-1]
    gqa = query.shape[-3] != key.shape[-3]
    if gqa and not enable_gqa:
        raise ValueError(f"sdpa: {query.shape[-3]} query heads over {key.shape[-3]} key heads without enable_gqa")
    low = query.dtype in (torch.float16, torch.bfloat16)
    causal_ok = not is_causal or query.shape[-2] == key.shape[-2]
    if attn_mask is None and low and d_q == d_k == d_v <= 256 and d_q % 8 == 0 and causal_ok:
        out = torch.ops.aten._scaled_dot_product_flash_attention(
            query, key, value, dropout_p, is_causal, False, scale=scale
        )
        return out[0]
    if attn_mask is None and d_q == d_k and d_q % 8 == 0 and d_v % 8 == 0 and not gqa:
        needs_lse = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        out = torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, None, needs_lse, dropout_p, is_causal, scale=scale
        )
        return out[0]
    if attn_mask is not None:
        raise NotImplementedError("census: an attention mask reached sdpa; the census runs mask-free (batch 1)")
    return torch.nn.functional.scaled_dot_product_attention(
        query, key, value, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa
    )  # the math decomposition, as on CUDA when no fused kernel fits


def cuda_rms_norm(input, normalized_shape, weight=None, eps=None):
    """`F.rms_norm` as torch's CUDA build runs it (its layer_norm.cpp `rms_norm_symint`, and native_functions.yaml /
    derivatives.yaml as installed under torchgen/packaged): one `_fused_rms_norm` (one kernel) where a weight has the
    input's dtype, and in a backward one `_fused_rms_norm_backward`; else the composite, as on meta."""
    if (weight is not None and weight.dtype != input.dtype) or input.is_complex():
        return torch.nn.functional.rms_norm(input, normalized_shape, weight, eps)
    return _FusedRmsNorm.apply(input, weight, tuple(normalized_shape), eps)


def _active_census():
    return next((m for m in reversed(_get_current_dispatch_mode_stack()) if isinstance(m, Census)), None)


class _FusedRmsNorm(torch.autograd.Function):
    """One op forward and one backward, with the bytes CUDA's kernels write (output and fp32 rstd; the gradients):
    the values come from the composite, run outside the census."""

    @staticmethod
    def forward(ctx, input, weight, normalized_shape, eps):
        census = _active_census()
        with _disable_current_modes():
            out = torch.nn.functional.rms_norm(input, normalized_shape, weight, eps)
            rstd = input.new_empty(input.shape[: input.dim() - len(normalized_shape)], dtype=torch.float32)
        if census is not None:
            census.record("_fused_rms_norm", [out, rstd])
        ctx.save_for_backward(input, weight)
        ctx.normalized_shape, ctx.eps = normalized_shape, eps
        return out

    @staticmethod
    def backward(ctx, grad):
        input, weight = ctx.saved_tensors
        census = _active_census()
        with _disable_current_modes(), torch.enable_grad():
            leaves = [t.detach().requires_grad_() for t in (input, weight) if t is not None]
            out = torch.nn.functional.rms_norm(
                leaves[0], ctx.normalized_shape, leaves[1] if weight is not None else None, ctx.eps
            )
            grads = torch.autograd.grad(out, leaves, grad)
        if census is not None:
            census.record("_fused_rms_norm_backward", list(grads))
        return grads[0], grads[1] if weight is not None else None, None, None


# ------------------------------------------------------------------------------------------------------- diff_triton
class _Launch:
    """One Triton kernel as `kernel[grid](*args, **meta)` sees it: records the launch and what it writes."""

    WRITES = {  # kernel -> indices of the tensor arguments it writes (diff_attention_v1.py's launch lists)
        "_fwd_kernel": (4, 5, 6, 7),  # out, o2, lse1, lse2
        "_decode_split_kernel": (4, 5),  # part_acc, part_ml
        "_decode_combine_kernel": (3, 4, 5, 6),  # out, o2, lse1, lse2
        "_bwd_preprocess_kernel": (4, 5),  # delta1, delta2
        "_bwd_dkdv_kernel": (11, 12, 13),  # dkey, dvalue, dquery (atomic dQ)
        "_bwd_dq_kernel": (11,),  # dquery
    }

    def __init__(self, name: str, recorder):
        self.name, self.recorder = name, recorder

    def __getitem__(self, grid):
        def launch(*args, **meta):
            self.recorder(self.name, args)

        return launch


@contextlib.contextmanager
def counted_triton(census_getter):
    """The "diff_triton" op on meta: its Python runs, its Triton launches are recorded as ops (see the module
    docstring). Raises `LookupError` where the op's hooks are not where this expects them (the kernel's module was
    rearranged: the row is then reported as not countable)."""
    try:
        from diff_transformer.integrations.attention import diff_triton_differential_attention
        from diff_transformer.kernels import diff_attention_v1 as op
    except ImportError as error:
        raise LookupError(f"diff_triton's modules: {error}") from error
    for name in ("_kernels", "triton_available", "_validate"):
        if not hasattr(op, name):
            raise LookupError(f"diff_transformer.kernels.diff_attention_v1.{name} is gone")

    def recorder(name, args):
        census = census_getter()
        if census is None or not census.active:  # e.g. the prefill that fills the decode step's cache
            return
        writes = [args[i] for i in _Launch.WRITES.get(name, ()) if isinstance(args[i], torch.Tensor)]
        census.record(f"triton.{name}", writes)
        census.triton_flops += _triton_flops(name, args)

    class Kernels:
        def __getattr__(self, name):
            return _Launch(name, recorder)

    saved = (
        op._kernels,
        op.triton_available,
        op._validate,
        getattr(diff_triton_differential_attention, "runs_on", None),
    )
    op._kernels = lambda device: Kernels()
    op.triton_available = lambda: True
    op._validate = lambda *args: None  # its checks refuse meta tensors; they dispatch nothing
    diff_triton_differential_attention.runs_on = lambda device: True
    try:
        yield
    finally:
        op._kernels, op.triton_available, op._validate, diff_triton_differential_attention.runs_on = saved


def _triton_flops(name: str, args) -> int:
    """What FlopCounterMode gives two sdpa calls (one per map) of the fused call's shapes: q (B, H, N, d),
    k (B, H_kv, L, d), v (B, H_kv, L, 2d); the forward in `_fwd_kernel` / `_decode_split_kernel`, the backward in
    `_bwd_dkdv_kernel` (the dQ kernel's recompute is the kernel's own choice, not counted twice)."""
    if name not in ("_fwd_kernel", "_decode_split_kernel", "_bwd_dkdv_kernel"):
        return 0
    query, key = args[0], args[1]
    B, H2, N, d = query.shape
    H_kv2, L = key.shape[1], key.shape[2]
    q, k, v = (B, H2 // 2, N, d), (B, H_kv2 // 2, L, d), (B, H_kv2 // 2, L, 2 * d)
    if name == "_bwd_dkdv_kernel":
        return 2 * sdpa_backward_flop_count((B, H2 // 2, N, 2 * d), q, k, v)
    return 2 * sdpa_flop_count(q, k, v)


# ------------------------------------------------------------------------------------------------------- models
def build(config_name: str, geometry: dict, layers: int):
    """(model on meta, bf16, train mode off) for 'model/backend' with `layers` decoder layers."""
    from diff_transformer import DiffConfig, DiffForCausalLM

    name, backend = config_name.split("/")
    size = dict(geometry, layers=layers)
    common = config_kwargs(size, max_positions=2 * geometry["seq"] + 8)
    if name == "v2":  # bench_gpu.py's v2: 2H = Llama's query heads, Llama's KV heads
        cls = DiffForCausalLM
        config = DiffConfig(
            diff_version=2,
            num_attention_heads=geometry["heads"] // 2,
            num_key_value_heads=geometry["kv_heads"],
            **common,
        )
    else:
        cls, config = same_matrices_model(name, size, common)
    with torch.device("meta"):
        model = cls._from_config(config, attn_implementation=backend, dtype=DTYPE)
    model.to("meta")  # anything created outside the device context
    model.eval()
    return model


def unpacked_batch():
    """Without a cache, transformers looks for packed sequences in position_ids (a host read, which meta cannot do;
    once per forward, not per layer): told there are none, as a plain batch has."""
    return mock.patch("transformers.masking_utils.find_packed_sequence_indices", lambda position_ids: None)


def run_phase(
    model, phase: str, seq: int, census_box: list, cuda_sdpa: bool = True, where: bool = False
) -> tuple[Census, int]:
    """(census, FLOPs) of one phase on `model`; `census_box[0]` is set to the phase's census (for the Triton
    recorder). Batch 1, no attention mask (no padding). `cuda_sdpa=False` leaves sdpa to meta's own choice (the math
    decomposition); `where` records each op's source line (`Census`)."""
    from transformers import DynamicCache

    sdpa = CudaDispatchMode if cuda_sdpa else contextlib.nullcontext
    ids = torch.zeros(1, seq, dtype=torch.long, device="meta")
    census, flops = Census(where), FlopCounterMode(display=False)
    census_box[0] = census
    if phase == "train":
        model.train()
        # anomaly mode keeps each node's forward stack for `where`
        anomaly = torch.autograd.set_detect_anomaly(True, check_nan=False) if where else contextlib.nullcontext()
        with sdpa(), flops, census, anomaly, unpacked_batch():
            out = model(input_ids=ids, labels=ids, use_cache=False)  # as bench_gpu's training step
            out.loss.backward()
        model.zero_grad(set_to_none=True)
        model.eval()
    elif phase == "prefill":
        with torch.no_grad(), sdpa(), flops, census:
            model.model(input_ids=ids, past_key_values=DynamicCache(config=model.config), use_cache=True)
    elif phase == "decode":
        with torch.no_grad(), sdpa():
            cache = DynamicCache(config=model.config)
            model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            step = torch.zeros(1, 1, dtype=torch.long, device="meta")
            position = torch.full((1,), seq, dtype=torch.long, device="meta")
            with flops, census:
                model(input_ids=step, past_key_values=cache, use_cache=True, cache_position=position)
    else:
        raise ValueError(phase)
    return census, flops.get_total_flops() + census.triton_flops


def saved_bytes_per_layer(config_name: str, geometry: dict) -> int:
    """Bytes autograd keeps for the backward in one decoder layer, in a training forward of `geometry["seq"]` tokens
    on the GPU's code path (`CudaDispatchMode`): the distinct storages the saved tensors hold (a view shares its
    base's), parameters left out, of the 2-layer model minus the 1-layer one. Its growth per token is what
    `diff-transformer plan` predicts as a layer's activations (tests/training/test_plan.py)."""
    totals = []
    for layers in (1, 2):
        model = build(config_name, geometry, layers)
        parameters = {p.untyped_storage()._cdata for p in model.parameters()}
        storages, kept = {}, []  # kept: the saved tensors stay alive, so no storage address is reused

        def pack(tensor):
            storage = tensor.untyped_storage()
            if storage._cdata not in parameters and storage._cdata not in storages:
                storages[storage._cdata] = storage.nbytes()
                kept.append(tensor)
            return tensor

        ids = torch.zeros(1, geometry["seq"], dtype=torch.long, device="meta")
        model.train()
        with CudaDispatchMode(), unpacked_batch(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(input_ids=ids, labels=ids, use_cache=False)
        totals.append(sum(storages.values()))
    return totals[1] - totals[0]


def census_config(config_name: str, geometry: dict, cuda_sdpa: bool = True, where: bool = False) -> dict:
    """Per decoder layer, per phase: ops, bytes, FLOPs, the per-op histogram (ops and bytes) and the skipped
    metadata ops, as the census of 2 layers minus that of 1; with `where`, "sites": "op @ source line" -> calls."""
    box = [None]
    triton = counted_triton(lambda: box[0]) if config_name.endswith("/diff_triton") else contextlib.nullcontext()
    result = {}
    with triton:
        models = {n: build(config_name, geometry, n) for n in (1, 2)}
        for phase in PHASES:
            runs = {n: run_phase(models[n], phase, geometry["seq"], box, cuda_sdpa, where) for n in (1, 2)}
            (one, flops_1), (two, flops_2) = runs[1], runs[2]
            ops = two.ops.copy()
            ops.subtract(one.ops)
            written = two.bytes.copy()
            written.subtract(one.bytes)
            skipped = two.skipped.copy()
            skipped.subtract(one.skipped)
            result[phase] = {
                "ops": sum(ops.values()),
                "bytes": sum(written.values()),
                "flops": flops_2 - flops_1,
                "per_op": {k: v for k, v in sorted(ops.items()) if v},
                "per_op_bytes": {k: v for k, v in sorted(written.items()) if v},
                "skipped": {k: v for k, v in sorted(skipped.items()) if v},
            }
            if where:
                sites = two.sites.copy()
                sites.subtract(one.sites)
                result[phase]["sites"] = {f"{op} @ {line}": n for (op, line), n in sorted(sites.items()) if n}
    return result


def census(geometry: dict, configs=CONFIGS, cuda_sdpa: bool = True, where: bool = False) -> dict:
    """config -> phase -> figures; a "diff_triton" row that cannot be counted holds {"error": reason}."""
    out = {}
    for config_name in configs:
        try:
            out[config_name] = census_config(config_name, geometry, cuda_sdpa, where)
        except LookupError as error:
            out[config_name] = {"error": str(error)}
    return out


# ------------------------------------------------------------------------------------------------------- floor
def floor_extra(geometry: dict) -> dict:
    """model -> phase -> the ops the differential step needs at the least beyond Llama's layer, per layer, each
    counted by running that least work itself under the same census (so the floor follows the counting rules):

    * V2 (2H query heads in Llama's one attention call over Llama's K/V, an H·d-wide o_proj: no extra call):
      λ = sigmoid(x W_λᵀ) (one mm, one sigmoid) and a_2h - λ a_2h+1 as one `addcmul` on views of the attention
      output; in training their backward as autograd runs it, plus one `add`: the λ projection's input gradient
      joins the three of q/k/v_proj.
    * V1 (Llama's matrices: 2H query sub-heads, 2H_kv key sub-heads, V 2d wide) at the least, i.e. with one fused
      attention call (both maps and A1 V - λ A2 V in the call that replaces Llama's: no extra op; sdpa cannot, as
      flash needs V as wide as Q and the memory-efficient kernel no GQA, hence at least one more call there) and the
      subln as one `F.rms_norm` over 2d with (1 - λ_init) folded into its weight: on CUDA one fused kernel, and one
      in the backward (`cuda_rms_norm`).
      λ = exp(λq1·λk1) - exp(λq2·λk2) + λ_init depends on parameters only: a constant at inference (0 ops per
      decode or prefill step once computed) and, in training, one expression per forward for every layer's λ at once
      (their vectors stacked: a handful of ops per model, 0 per layer; per layer, its forward and backward are 15).
    * DiffLlama: transformers' implementation is measured, not a target; its floor is V1's (same matrices, same
      differential step).
    """
    B, N, d = 1, geometry["seq"], geometry["head_dim"]
    H, D = geometry["heads"] // 2, geometry["hidden"]

    def count(fn, train: bool) -> int:
        """Ops of fn() (no grad), or of fn() and its backward (train) from a given output gradient."""
        census = Census()
        if not train:
            with torch.no_grad(), CudaDispatchMode(), census:
                fn()
            return sum(census.ops.values())
        out = fn()
        grad = torch.empty_like(out)  # outside the census: the incoming gradient is the next op's
        census = Census()
        with CudaDispatchMode(), census:
            out = fn()
            out.backward(grad)
        return sum(census.ops.values())

    with torch.device("meta"):
        x = torch.empty(B, N, D, dtype=DTYPE, requires_grad=True)
        w_lambda = torch.empty(H, D, dtype=DTYPE, requires_grad=True)
        pair = torch.empty(B, N, H, 2, d, dtype=DTYPE, requires_grad=True)  # the attention output's head pairs
        heads = torch.empty(B, N, H, 2 * d, dtype=DTYPE, requires_grad=True)  # V1's attention output
        subln_weight = torch.empty(2 * d, dtype=DTYPE, requires_grad=True)  # (1 - λ_init) folded in

    def v2_step():
        lam = torch.sigmoid(torch.nn.functional.linear(x, w_lambda))  # (B, N, H)
        return torch.addcmul(pair[..., 0, :], lam.unsqueeze(-1), pair[..., 1, :], value=-1)  # (B, N, H, d)

    extra = {"v2": {}, "v1": {}}
    for phase in PHASES:
        train = phase == "train"
        extra["v2"][phase] = count(v2_step, train) + (1 if train else 0)
        extra["v1"][phase] = count(lambda: torch.nn.functional.rms_norm(heads, (2 * d,), subln_weight, 1e-6), train)
    extra["diffllama"] = dict(extra["v1"])
    return extra


# ------------------------------------------------------------------------------------------------------- report
def _mib(n: int) -> str:
    return f"{n / 2**20:,.2f} MiB" if n >= 2**20 else f"{n / 2**10:,.1f} KiB"


def breakdown(results: dict, config_name: str, phase: str) -> list[str]:
    """The ops `config_name` dispatches per layer against Llama's, op by op (counts, then the skipped metadata)."""
    row, ref = results[config_name][phase], results["llama/sdpa"][phase]
    names = sorted(set(row["per_op"]) | set(ref["per_op"]))
    lines = [f"{LABELS[config_name]}, {PHASE_LABELS[phase]}: {row['ops']} ops/layer vs Llama's {ref['ops']}"]
    for n in sorted(names, key=lambda n: (-(row["per_op"].get(n, 0) - ref["per_op"].get(n, 0)), n)):
        mine, theirs = row["per_op"].get(n, 0), ref["per_op"].get(n, 0)
        delta = f"{mine - theirs:+d}" if mine != theirs else "  ="
        lines.append(
            f"    {n:48s} {mine:4d}  (Llama {theirs:3d}) {delta:>4s}  writes {_mib(row['per_op_bytes'].get(n, 0))}"
        )
    skipped = ", ".join(f"{n} {c}" for n, c in row["skipped"].items())
    lines.append(f"    not counted (metadata): {skipped}")
    if "sites" in row:
        lines.append("    where (op @ the source line that dispatched it, per layer):")
        lines += [f"        {n:3d}  {site}" for site, n in row["sites"].items()]
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="the test's tiny geometry (same op counts, small bytes/FLOPs)")
    p.add_argument("--verbose", action="store_true", help="per-op breakdown of every model against Llama")
    p.add_argument("--write", action="store_true", help=f"write {RESULTS.relative_to(REPO)} (full geometry only)")
    p.add_argument(
        "--meta-sdpa",
        action="store_true",
        help="leave sdpa and rms_norm to the meta device's composites (how the issue's first figures were counted)",
    )
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated model/backend (Llama is always run)")
    args = p.parse_args(argv)
    if args.write and (args.tiny or args.meta_sdpa):
        p.error("--write records the full geometry with CUDA's dispatch: drop --tiny / --meta-sdpa")
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        p.error(f"unknown config(s) {', '.join(unknown)}; known: {', '.join(CONFIGS)}")
    if "llama/sdpa" not in configs:
        configs.insert(0, "llama/sdpa")
    geometry = TINY if args.tiny else FULL
    results = census(geometry, configs, cuda_sdpa=not args.meta_sdpa, where=args.verbose)
    extra = floor_extra(geometry)
    print("\n".join(table(results, extra)))
    if args.verbose:
        for config_name in configs:
            if "error" in results[config_name]:
                continue
            for phase in PHASES:
                print()
                print("\n".join(breakdown(results, config_name, phase)))
        print()
        print("Llama, skipped metadata ops per layer:")
        for phase in PHASES:
            print(f"    {phase}: " + ", ".join(f"{n} {c}" for n, c in results["llama/sdpa"][phase]["skipped"].items()))
    if args.write:
        data = {
            "meta": provenance(),
            "geometry": geometry,
            "dtype": str(DTYPE).removeprefix("torch."),
            "floor_extra": extra,
            "results": {  # without the source lines of --verbose: they move with every edit
                c: {p: {k: v for k, v in r.items() if k != "sites"} for p, r in row.items()}
                if "error" not in row
                else row
                for c, row in results.items()
            },
        }
        RESULTS.write_text(json.dumps(data, indent=1) + "\n")
        print(f"wrote {RESULTS.relative_to(REPO)}; now `python benchmarks/results_page.py`", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
