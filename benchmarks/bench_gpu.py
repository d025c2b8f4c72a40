#!/usr/bin/env python
"""GPU benchmark at ~1B parameters, bf16: Llama vs transformers' DiffLlama vs Diff V1 / Diff V2, on every attention
backend each supports, in one process per call.

Run from the repository root (``PYTHONPATH=src`` or an install; the checkout's ``src/`` is put first on sys.path)::

    # call 1 (one H100, <= 9 min): attention alone, training, prefill, compiled training
    python3 benchmarks/bench_gpu.py --sections attention,train,prefill,train_compile --time-budget 450
    # call 2 (<= 9 min): decode with the dynamic cache and with a static cache + compile, added to the same JSON
    python3 benchmarks/bench_gpu.py --sections decode,decode_static --merge --time-budget 450
    python3 benchmarks/bench_gpu.py --report-only          # rewrite results_gpu.md from results_gpu.json
    python3 benchmarks/bench_gpu.py --smoke                # tiny shapes on CPU, every section, into a temp dir

Results go to ``<out-dir>/results_gpu.json`` (every sample, written after every measurement, so a timeout keeps what
was measured) and ``<out-dir>/results_gpu.md`` (generated from the JSON after every metric). An existing JSON is only
added to with ``--merge`` (a (model, backend) measured again replaces its earlier entry) or replaced with
``--overwrite``. ``--time-budget`` (seconds, counted after imports) stops starting warm-ups, compiles and repetitions
that would not finish in time and records them as "skipped: time budget"; a compile is assumed to take 90 s until
one has been timed. Most of a call's time is compiling: each ``--compile-configs`` entry costs one inductor compile
of the training step (train_compile) or two of the decode step (decode_static, batch 1 and 32), each probably
0.5-2 min for these models; everything uncompiled takes ~1.5 min per call.
``--out-dir`` defaults to ``benchmarks/results/``, where the benchmarks' results are kept.

Models (random init, bf16; same embeddings, MLP, norms, vocab 32000, untied head; sub-head size d = 64)
----------------------------------------------------------------------------------------------------
* ``llama``: hidden 2048, 16 layers, 32 heads x 64, 8 KV heads, intermediate 5632.
* ``diffllama``: transformers' DiffLlama with Llama's config (it pairs heads into 16 differential heads).
* ``v1``: Diff V1 with exactly Llama's matrices: H = 16, H_kv = 4 (2H = 32 query and 2H_kv = 8 key sub-heads).
* ``v2``: Diff V2 in the authors' comparison layout: H = 16 (2H = 32 query heads, Llama's), H_kv = 8 (Llama's);
  o_proj is H*d wide, so its attention has fewer parameters than Llama's.
* ``v2wide``: Diff V2 with H = 32 (64 query heads), H_kv = 4 (half Llama's KV cache). With a GQA Llama this is NOT
  an equal parameter budget (q 2Hd + k, v 2 H_kv d + o Hd = 6656 D vs Llama's 5120 D per layer); the layout with
  exactly Llama's attention parameters is H = 24, H_kv = 4 (``--v2wide-heads 24``). The report states every count.

Backends: sdpa, flex_attention, flash_attention_2 (only where ``flash_attn`` imports) and ``diff_triton`` (V1's fused
Triton kernel, once ``diff_transformer.kernels`` registers it). Each (model, backend) is probed with a tiny forward
first; a failure is recorded with its one-line reason and the pair is left out. eager is skipped on the GPU (it
materialises every (N, N) map: seconds per layer at 16k tokens); ``--smoke`` runs it. flex_attention compiles its
kernels on first use, so it runs in a second pass after every other backend of every requested section: if the
budget runs out there, only flex numbers are lost. Compiled sections run ``--compile-configs`` (default Llama, V1
and V2 on sdpa, and V1 on diff_triton where it probes ok).

Metrics (sections; each metric interleaves its repetitions: for rep, for (model, backend), order rotated per rep)
----------------------------------------------------------------------------------------------------------------
* ``attention``: ``attn_core``, seconds for forward + backward of attention alone on Llama's q/k/v shapes
  (q (1, 32, N, 64), k/v (1, 8, N, 64)): Llama through SDPA / flash_attn, V1 through today's two SDPA calls with a
  2d-wide V, and V1 through the kernel's op (see ``kernel_v1_op``). ``attn_layer``: layer 0's ``self_attn`` module
  (projections included) forward + backward through the model's own backend dispatch.
* ``train``: tokens/s of forward + backward + AdamW step, CausalLM with labels, batch 1 x 4096 tokens, no
  gradient checkpointing; ``--train-steps`` steps per repetition.
* ``train_compile``: the same with ``torch.compile(model)`` (default mode). ``compile_s``: the first call's time.
* ``prefill``: seconds of a base-model forward (no LM head) filling a DynamicCache, batch 1, 4096 and 16384 tokens.
* ``decode``: tokens/s of greedy ``generate`` with the dynamic cache, batch 1 and 32 after a 4096-token prompt.
  Rate = batch x (steps - 1) / (end - first step), timed from the first logits (after prefill, one sync there) to
  the end of generate (one sync): the decode loop runs unsynchronised, as in real use.
* ``decode_static``: compiled decoding (issue 48's ``decode_compiled``), as ``generate --compile`` runs it
  (``diff_transformer.generation.call.compile_kwargs``): a StaticCache, with which ``generate`` compiles the decode
  step with ``CompileConfig(fullgraph=True)`` (inductor, mode "reduce-overhead", i.e. CUDA graphs; a graph break fails
  the (model, backend) with its reason instead of measuring a split graph). Llama is compiled the same way in the
  same run. One StaticCache per (model, backend, batch) is reused across calls, as a server would, so the compiled
  graph and its static addresses stay put.

Peak memory of every measurement: the weights (+ AdamW state when training, + the static cache) plus
``torch.cuda.max_memory_allocated()`` minus the memory allocated just before the measurement. The other models stay
resident (interleaving), so this isolates the model's own peak. CUDA-graph pools recorded during warm-up are not
included. On CPU (smoke) the delta is the RSS high-water mark increase.

Ratios: for every metric, the median over reps of the per-rep ratio value / Llama's value on the same backend, and
value / the best Llama backend's value, paired by rep when both ran in the same interleaved group (else the ratio
of the medians). Ratios are of the raw metric: > 1 is better for tokens/s, < 1 for seconds and memory.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_common import (  # first: it puts the checkout's src/ first on sys.path
    StepClock,
    config_kwargs,
    cpu_name,
    greedy_generate,
    make_log,
    median_ratio,
    n_params,
    proc_status_kb,
    provenance,
    random_ids,
    recorded_argv,
    reset_peak_rss,
    rotated,
    same_matrices_model,
    timed,
)


# isort: split
import floors
import torch
import torch.nn.functional as F
import transformers
from transformers.cache_utils import StaticCache
from transformers.generation import CompileConfig
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from diff_transformer import DiffConfig, DiffForCausalLM
from diff_transformer.generation.call import compile_kwargs


_HERE = Path(__file__).resolve().parent
RESULTS_DIR = _HERE / "results"  # the default --out-dir


MODELS = ("llama", "diffllama", "v1", "v2", "v2wide")
BACKENDS = ("sdpa", "flex_attention", "flash_attention_2", "diff_triton", "eager")
SECTIONS = ("attention", "train", "prefill", "decode", "train_compile", "decode_static")  # run in this order
EAGER_SKIP = "skipped: eager materialises every (N, N) attention map, too slow and large at 4k/16k tokens"

FULL = dict(
    hidden=2048,
    layers=16,
    heads=32,
    kv_heads=8,
    head_dim=64,
    intermediate=5632,
    vocab=32000,
    train_seq=4096,
    train_steps=3,
    prefill=[4096, 16384],
    prompt=4096,
    new_tokens=32,
    decode_batches=[1, 32],
    attn_seq=4096,
    reps=5,
)
SMOKE = dict(
    hidden=64,
    layers=1,
    heads=4,
    kv_heads=2,
    head_dim=16,
    intermediate=128,
    vocab=256,
    train_seq=32,
    train_steps=1,
    prefill=[16, 32],
    prompt=16,
    new_tokens=4,
    decode_batches=[1, 2],
    attn_seq=32,
    reps=2,
)
COMPILE_CONFIGS = "llama/sdpa,v1/sdpa,v2/sdpa,v1/diff_triton"  # each ~1-2 min of inductor on the GPU
DEFAULTS = {
    False: dict(backends="sdpa,flex_attention,flash_attention_2,diff_triton", compile_configs=COMPILE_CONFIGS),
    True: dict(backends="sdpa,eager,flash_attention_2,diff_triton", compile_configs=COMPILE_CONFIGS),
}


def metric_specs(size: dict) -> dict:
    """metric -> (section, unit, higher_is_better, description)."""
    specs = {
        "attn_core": (
            "attention",
            "s",
            False,
            f"attention alone, fwd+bwd, Llama's q/k/v shapes, N={size['attn_seq']}",
        ),
        "attn_layer": ("attention", "s", False, f"layer-0 self_attn module fwd+bwd, N={size['attn_seq']}"),
        "train": ("train", "tok/s", True, f"train step (fwd+bwd+AdamW), 1 x {size['train_seq']} tokens"),
        "train_compile": (
            "train_compile",
            "tok/s",
            True,
            f"train step, torch.compile(model), 1 x {size['train_seq']} tokens",
        ),
    }
    for n in size["prefill"]:
        specs[f"prefill_{n}"] = ("prefill", "s", False, f"prefill latency, base model, {n} tokens")
    for kind, section in (("dynamic", "decode"), ("static", "decode_static")):
        label = "dynamic cache" if kind == "dynamic" else "static cache + compile"
        for b in size["decode_batches"]:
            specs[f"decode_b{b}_{kind}"] = (
                section,
                "tok/s",
                True,
                f"decode, batch {b}, {label}, after {size['prompt']} tokens",
            )
    return specs


# ----------------------------------------------------------------------------------------------------------- models
def model_config(name: str, size: dict, args):
    common = config_kwargs(size, max([*size["prefill"], size["prompt"] + size["new_tokens"], size["train_seq"]]))
    n_h, n_kv = size["heads"], size["kv_heads"]
    if name in ("llama", "diffllama", "v1"):
        return same_matrices_model(name, size, common)
    if name == "v2":  # the authors' comparison: 2H = Llama's query heads, Llama's KV heads
        return DiffForCausalLM, DiffConfig(
            diff_version=2, num_attention_heads=n_h // 2, num_key_value_heads=n_kv, **common
        )
    if name == "v2wide":  # H = Llama's heads (2x its query heads), half its KV heads
        heads = dict(
            num_attention_heads=args.v2wide_heads or n_h, num_key_value_heads=args.v2wide_kv_heads or n_kv // 2
        )
        return DiffForCausalLM, DiffConfig(diff_version=2, **heads, **common)
    raise ValueError(name)


def model_label(name: str, config) -> str:
    if name == "llama":
        return "Llama"
    if name == "diffllama":
        return "DiffLlama"
    c = config
    return f"Diff V{c.diff_version} (H={c.num_attention_heads}, H_kv={c.num_key_value_heads})"


def layout(name: str, config) -> str:
    c = config
    if name in ("llama", "diffllama"):
        return f"{c.num_attention_heads} heads x {c.head_dim}, {c.num_key_value_heads} KV heads"
    q = 2 * c.num_attention_heads
    kv = 2 * c.num_key_value_heads if c.diff_version == 1 else c.num_key_value_heads
    return (
        f"V{c.diff_version}: H={c.num_attention_heads}, H_kv={c.num_key_value_heads}, d={c.head_dim} "
        f"({q} query heads, {kv} cached K/V heads of {c.head_dim})"
    )


def build(name: str, size: dict, args, device, dtype, seed: int):
    cls, config = model_config(name, size, args)
    torch.manual_seed(seed)
    with torch.device(device):
        model = cls._from_config(config, attn_implementation="sdpa", dtype=dtype)
    model.to(device)  # fp32-kept modules and buffers created outside the device context
    model.eval()
    model.config.use_cache = False
    attn = model.model.layers[0].self_attn
    info = {
        "label": model_label(name, config),
        "layout": layout(name, config),
        "params_base": n_params(model.model),
        "params_lm": n_params(model),
        "attn_params_per_layer": n_params(attn),
        "kv_cache_bytes_per_token": _kv_bytes_per_token(name, config, dtype),
        "work": floor_work(model, size, dtype),
    }
    return model, info


def floor_work(model, size: dict, dtype) -> dict:
    """metric -> the work its floor counts (benchmarks/floors.py): multiply-adds (attention alone, prefill, a
    training step) or bytes read per decode step; the floor of a ratio to Llama is the ratio of these."""
    n, b = size["attn_seq"], torch.finfo(dtype).bits // 8
    qk, av, _ = floors._attention_widths(model.config)
    work = {"attn_core": (qk + av) * n * (n + 1) / 2}  # one layer's attention, Llama's q/k/v shapes
    work["train"] = work["train_compile"] = floors.forward_macs(model, size["train_seq"], lm_head=True)
    for tokens in size["prefill"]:
        work[f"prefill_{tokens}"] = floors.forward_macs(model.model, tokens)
    context = size["prompt"] + size["new_tokens"] // 2
    for batch in size["decode_batches"]:
        for kind in ("dynamic", "static"):
            work[f"decode_b{batch}_{kind}"] = floors.decode_bytes(model, context, batch, b) / batch
    return work


def _kv_bytes_per_token(name: str, c, dtype) -> int:
    # V1 caches 2 H_kv key sub-heads of d and its 2d-wide V as 2 H_kv halves; V2 caches H_kv heads; DiffLlama Llama's.
    heads = 2 * c.num_key_value_heads if name == "v1" else c.num_key_value_heads
    return 2 * heads * c.head_dim * c.num_hidden_layers * torch.finfo(dtype).bits // 8


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))


def optimizer_bytes(opt) -> int:
    return sum(tensor_bytes(state.values()) for state in opt.state.values()) if opt is not None else 0


def cache_bytes(cache) -> int:
    layers = getattr(cache, "layers", None) or []
    return sum(tensor_bytes([getattr(layer, "keys", None), getattr(layer, "values", None)]) for layer in layers)


# ------------------------------------------------------------------------------------------------ device utilities
class Device:
    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def free(self):
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()


class PeakMemory:
    """Peak memory of a measurement: `resident` bytes (passed in) + the allocation high-water mark above the start."""

    def __init__(self, dev: Device, resident: int):
        self.dev, self.resident, self.delta = dev, resident, 0

    def __enter__(self):
        if self.dev.cuda:
            self.dev.sync()
            torch.cuda.reset_peak_memory_stats(self.dev.device)
            self.before = torch.cuda.memory_allocated(self.dev.device)
        else:
            self.hwm_ok = reset_peak_rss()
            self.before = proc_status_kb("VmRSS") * 1024
        return self

    def __exit__(self, *exc):
        if exc[0] is not None:
            return False
        if self.dev.cuda:
            self.dev.sync()
            self.delta = torch.cuda.max_memory_allocated(self.dev.device) - self.before
        elif self.hwm_ok:
            self.delta = proc_status_kb("VmHWM") * 1024 - self.before
        return False

    @property
    def mib(self) -> float:
        return (self.resident + max(self.delta, 0)) / 2**20


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


# --------------------------------------------------------------------------------------------- backend probing
def applicable_backends(name: str, backends: list[str]) -> list[str]:
    return [b for b in backends if b != "diff_triton" or name == "v1"]  # the fused kernel is V1's


def kernels_status(device: torch.device) -> str | None:
    """None when `diff_triton` is registered and runs the fused kernel on `device`, else why not."""
    try:
        kernels = importlib.import_module("diff_transformer.kernels")
    except ImportError as e:
        return f"unavailable: diff_transformer.kernels does not import ({one_line(e)})"
    if "diff_triton" not in ALL_ATTENTION_FUNCTIONS.valid_keys():
        return "unavailable: 'diff_triton' is not registered with transformers' attention interface"
    if not kernels.is_available(device):
        return (
            "unavailable: the fused kernel needs a CUDA device and triton; "
            f"on {device.type} 'diff_triton' runs as sdpa"
        )
    return None


def set_backend(model, backend: str):
    if model.config._attn_implementation != backend:
        model.set_attn_implementation(backend)
    if model.config._attn_implementation != backend:
        raise RuntimeError(f"set_attn_implementation({backend!r}) left {model.config._attn_implementation!r}")


def probe(model, backend: str, dev: Device, smoke: bool, vocab: int) -> str | None:
    """None if a tiny forward runs on `backend`, else the one-line reason."""
    if backend == "eager" and not smoke:
        return EAGER_SKIP
    if backend == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        return "not installed (the flash_attn package does not import)"
    if backend == "diff_triton":
        reason = kernels_status(dev.device)
        if reason:
            return reason
    try:
        set_backend(model, backend)
        ids = random_ids(8, vocab, 0).to(dev.device)
        with torch.no_grad():
            out = model.model(input_ids=ids, use_cache=False).last_hidden_state
        dev.sync()
        if not torch.isfinite(out.float()).all():
            return "error: non-finite output on a tiny forward"
        return None
    except Exception as e:  # noqa: BLE001 - every failure is recorded, not raised
        prefix = "unavailable" if backend == "diff_triton" else "error"
        return f"{prefix}: {one_line(e)}"
    finally:
        with contextlib.suppress(Exception):
            set_backend(model, "sdpa")


# ------------------------------------------------------------------------------------------------- measurements
class Trainer:
    """AdamW on one model; the optimizer state stays resident between steps, as in a real run."""

    def __init__(self, model, dev: Device):
        self.model, self.dev = model, dev
        kwargs = {"fused": True} if dev.cuda else {}
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-6, **kwargs)

    def step(self, fn, ids):
        out = fn(input_ids=ids, labels=ids, use_cache=False)
        out.loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def measure(self, fn, ids, steps: int) -> dict:
        """`fn` is the model or its compiled wrapper."""
        self.model.train()
        try:
            resident = tensor_bytes(self.model.parameters()) + optimizer_bytes(self.opt)
            with PeakMemory(self.dev, resident) as mem:
                dt = timed(lambda: [self.step(fn, ids) for _ in range(steps)], self.dev.sync)
        finally:
            self.opt.zero_grad(set_to_none=True)
            self.model.eval()
        return {"value": steps * ids.numel() / dt, "peak_mib": mem.mib, "step_s": dt / steps}


def measure_prefill(model, ids, dev: Device) -> dict:
    with PeakMemory(dev, tensor_bytes(model.parameters())) as mem, torch.inference_mode():
        dt = timed(lambda: model.model(input_ids=ids, use_cache=True), dev.sync)
    return {"value": dt, "peak_mib": mem.mib}


def measure_decode(model, ids, new_tokens: int, dev: Device, cache=None, compile_config=None) -> dict:
    """Greedy generate; with `cache` (a StaticCache reused across calls, so its addresses and the compiled graph
    stay put) generate compiles the decode step, else it runs eagerly on a DynamicCache."""
    clock = StepClock(dev.sync)
    if cache is not None:
        cache.reset()
        kwargs = dict(past_key_values=cache, compile_config=compile_config)
    else:
        kwargs = dict(disable_compile=True)
    with PeakMemory(dev, tensor_bytes(model.parameters()) + cache_bytes(cache)) as mem:
        dev.sync()
        t0 = time.perf_counter()
        greedy_generate(model, ids, new_tokens, clock, use_cache=True, **kwargs)
        dev.sync()
        t_end = time.perf_counter()
    batch, t_first = ids.shape[0], clock.times[0]
    return {
        "value": batch * (len(clock.times) - 1) / (t_end - t_first),
        "peak_mib": mem.mib,
        "total_s": t_end - t0,
        "prefill_s": t_first - t0,
        "compiled": bool(cache is not None and hasattr(model, "_compiled_call")),
    }


def v1_sdpa_attention(q, k, v, lam, scale):
    """V1's attention as the model runs it on SDPA: one call per map, V 2d wide. q (B, 2H, N, d) = [q1 | q2]."""
    H, H_kv = q.shape[1] // 2, k.shape[1] // 2
    wide_v = torch.cat((v[:, :H_kv], v[:, H_kv:]), dim=-1)  # (B, H_kv, N, 2d)
    o1 = F.scaled_dot_product_attention(q[:, :H], k[:, :H_kv], wide_v, is_causal=True, scale=scale, enable_gqa=True)
    o2 = F.scaled_dot_product_attention(q[:, H:], k[:, H_kv:], wide_v, is_causal=True, scale=scale, enable_gqa=True)
    return o1 - lam.to(o1.dtype) * o2  # (B, H, N, 2d)


def kernel_v1_op(device):
    """V1's fused kernel as an op, or why not: `diff_transformer.kernels.triton_v1_attention(q, k, v, lam,
    scaling=..., causal=True)` with q (B, 2H, N, d) = [q1 | q2] heads, k (B, 2H_kv, N, d) = [k1 | k2], v (B, 2H_kv,
    N, d) = the two d-wide halves of V, returning (B, N, H, 2d). Checked against `v1_sdpa_attention` before timing."""
    try:
        kernels = importlib.import_module("diff_transformer.kernels")
    except ImportError as e:
        return None, f"unavailable: diff_transformer.kernels does not import ({one_line(e)})"
    op = getattr(kernels, "triton_v1_attention", None)
    if not callable(op):
        return None, "unavailable: diff_transformer.kernels has no triton_v1_attention"
    available = getattr(kernels, "is_available", None)
    if callable(available) and not available(device):
        return None, (
            f"unavailable: diff_transformer.kernels.is_available({device.type!r}) is False (needs triton and a GPU)"
        )
    return op, None


def flash_attn_op():
    try:
        from flash_attn import flash_attn_func
    except ImportError:
        return None, "not installed (the flash_attn package does not import)"
    return flash_attn_func, None


def attn_core_fns(size: dict, dev: Device, dtype, backends: list[str]):
    """config -> (fn() running fwd+bwd once) or reason; all on the same q/k/v (Llama's shapes)."""
    B, N, d, Hq, Hkv = 1, size["attn_seq"], size["head_dim"], size["heads"], size["kv_heads"]
    g = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dev.device, dtype).requires_grad_()

    q, k, v = rand(B, Hq, N, d), rand(B, Hkv, N, d), rand(B, Hkv, N, d)  # (B, 32, N, d), (B, 8, N, d) x 2
    lam = torch.tensor(0.3, device=dev.device, requires_grad=True)
    scale = d**-0.5
    grad_llama = torch.randn(B, Hq, N, d, generator=g).to(dev.device, dtype)
    grad_v1 = torch.randn(B, Hq // 2, N, 2 * d, generator=g).to(dev.device, dtype)

    def clear():
        for t in (q, k, v, lam):
            t.grad = None

    fns = {"resident": tensor_bytes((q, k, v))}  # the inputs; the peak adds what fwd+bwd allocates on top
    if "sdpa" in backends:

        def llama_sdpa():
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
            out.backward(grad_llama)
            clear()

        def v1_sdpa():
            v1_sdpa_attention(q, k, v, lam, scale).backward(grad_v1)
            clear()

        fns["llama/sdpa"], fns["v1/sdpa"] = llama_sdpa, v1_sdpa
    if "flash_attention_2" in backends:
        fa, reason = flash_attn_op()
        if fa is None:
            fns["llama/flash_attention_2"] = reason
        else:
            qt, kt, vt = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))  # (B, N, h, d)
            gt = grad_llama.transpose(1, 2).contiguous()

            def llama_fa2():
                fa(qt, kt, vt, causal=True, softmax_scale=scale).backward(gt)
                for t in (qt, kt, vt):
                    t.grad = None

            fns["llama/flash_attention_2"] = llama_fa2
    if "diff_triton" in backends:
        op, reason = kernel_v1_op(dev.device)
        if op is None:
            fns["v1/diff_triton"] = reason
        else:
            try:
                with torch.no_grad():
                    ref = v1_sdpa_attention(q, k, v, lam, scale).float()  # (B, H, N, 2d)
                    out = op(q, k, v, lam, scaling=scale, causal=True).float()  # (B, N, H, 2d)
                out = out.transpose(1, 2)  # (B, H, N, 2d)
                if out.shape != ref.shape:
                    raise RuntimeError(f"output shape {tuple(out.shape)}, expected {tuple(ref.shape)}")
                err = (out - ref).abs().max().item()
                tol = 2e-2 if dtype != torch.float32 else 1e-4
                if not err <= tol * max(1.0, ref.abs().max().item()):
                    raise RuntimeError(f"output differs from the SDPA reference by {err:.3g}")
                grad_kernel = grad_v1.transpose(1, 2).contiguous()  # (B, N, H, 2d)

                def v1_kernel():
                    op(q, k, v, lam, scaling=scale, causal=True).backward(grad_kernel)
                    clear()

                fns["v1/diff_triton"] = v1_kernel
            except Exception as e:  # noqa: BLE001
                fns["v1/diff_triton"] = f"unavailable: {one_line(e)}"
    return fns


def attn_layer_fn(model, size: dict, dev: Device, dtype):
    attn = model.model.layers[0].self_attn
    N = size["attn_seq"]
    g = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(1, N, size["hidden"], generator=g).to(dev.device, dtype).requires_grad_()
    grad = torch.randn(1, N, size["hidden"], generator=g).to(dev.device, dtype)
    pos = torch.arange(N, device=dev.device)[None]
    with torch.no_grad():
        cos_sin = model.model.rotary_emb(x, position_ids=pos)

    def run():
        out = attn(hidden_states=x, position_embeddings=cos_sin, attention_mask=None)[0]  # causal via is_causal
        out.backward(grad)
        x.grad = None
        attn.zero_grad(set_to_none=True)

    return run


# ---------------------------------------------------------------------------------------------------- results
class Results:
    def __init__(self, path_json: Path, path_md: Path, data: dict):
        self.path_json, self.path_md, self.data = path_json, path_md, data

    def save(self, md: bool = True):
        self.data["summary"], self.data["targets"] = summarize(self.data)
        _atomic_write(self.path_json, json.dumps(self.data, indent=1, allow_nan=True))
        if md:
            _atomic_write(self.path_md, render(self.data))


def _atomic_write(path: Path, text: str):
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def summarize(data: dict):
    summary = {}
    for metric, entry in data.get("metrics", {}).items():
        higher = entry["higher_is_better"]
        ok = {c: r for c, r in entry["configs"].items() if r["status"] == "ok" and r["values"]}
        medians = {c: statistics.median(r["values"]) for c, r in ok.items()}
        llama = [c for c in ok if c.startswith("llama/")]
        best_llama = (max if higher else min)(llama, key=medians.get) if llama else None
        out = {}
        for c, r in ok.items():
            backend = c.split("/", 1)[1]
            row = {
                "median": medians[c],
                "min": min(r["values"]),
                "max": max(r["values"]),
                "n": len(r["values"]),
                "peak_mib": statistics.median(r["peak_mib"]) if r.get("peak_mib") else None,
                "ratio_llama_same": _paired_ratio(r, ok.get(f"llama/{backend}")),
                "ratio_llama_best": _paired_ratio(r, ok.get(best_llama)) if best_llama else None,
                "llama_best": best_llama,
            }
            same = ok.get(f"llama/{backend}")
            same_peak = statistics.median(same["peak_mib"]) if same and same.get("peak_mib") else None
            row["peak_ratio_llama_same"] = row["peak_mib"] / same_peak if same_peak and row["peak_mib"] else None
            out[c] = row
        summary[metric] = out
    return summary, targets(data, summary)


def _paired_ratio(r: dict, ref: dict | None):
    """Median of per-rep ratios when both were interleaved in one group, else the ratio of the medians."""
    if ref is None:
        return None
    if r.get("group") != ref.get("group"):
        return statistics.median(r["values"]) / statistics.median(ref["values"])
    ref_by_rep = dict(zip(ref["reps"], ref["values"]))
    pairs = [(v, ref_by_rep[i]) for i, v in zip(r["reps"], r["values"]) if i in ref_by_rep]
    return median_ratio(*zip(*pairs)) if pairs else None


def best_config(data, summary, metric, model):
    """(config, row) of `model`'s best backend on `metric`, or (None, None)."""
    rows = {c: row for c, row in summary.get(metric, {}).items() if c.split("/")[0] == model}
    if not rows:
        return None, None
    pick = max if data["metrics"][metric]["higher_is_better"] else min
    c = pick(rows, key=lambda c: rows[c]["median"])
    return c, rows[c]


def targets(data: dict, summary: dict) -> list[dict]:
    """Issue 14's targets, on each model's best backend against Llama's best backend (paired per rep)."""
    out = []

    def add(text, ok):
        out.append({"target": text, "pass": ok})

    for metric in summary:
        higher = data["metrics"][metric]["higher_is_better"]
        if metric.startswith(("train", "decode")):
            goals = {"v1": 0.91, "v2": 0.97} if metric.startswith("train") else {"v1": 0.9, "v2": 0.97, "v2wide": 1.0}
            for model, goal in goals.items():
                c, row = best_config(data, summary, metric, model)
                if row and row["ratio_llama_best"] is not None:
                    add(
                        f"{metric}: {c} >= {goal}x {row['llama_best']}: {row['ratio_llama_best']:.3f}x",
                        row["ratio_llama_best"] >= goal,
                    )
            c, row = best_config(data, summary, metric, "v2wide")
            if metric.startswith("train") and row and row["ratio_llama_best"] is not None:
                add(f"{metric}: {c} (report only): {row['ratio_llama_best']:.3f}x {row['llama_best']}", None)
        dl_c, dl = best_config(data, summary, metric, "diffllama")
        if dl and not metric.startswith("attn"):
            for model in ("v1", "v2", "v2wide"):
                c, row = best_config(data, summary, metric, model)
                if row:
                    better = row["median"] > dl["median"] if higher else row["median"] < dl["median"]
                    add(
                        f"{metric}: {c} better than DiffLlama's best ({dl_c}): {row['median']:.4g} vs "
                        f"{dl['median']:.4g}",
                        better,
                    )
    rows = summary.get("attn_core", {})
    refs = [c for c in ("llama/sdpa", "llama/flash_attention_2") if c in rows]
    if refs:
        ref = min(refs, key=lambda c: rows[c]["median"])
        for c in ("v1/diff_triton", "v1/sdpa"):
            if c in rows:
                ratio = _paired_ratio(
                    data["metrics"]["attn_core"]["configs"][c], data["metrics"]["attn_core"]["configs"][ref]
                )
                add(
                    f"attn_core: {c} <= 1.6x {ref}: {ratio:.3f}x (FLOP ratio 1.5x)",
                    ratio <= 1.6 if c == "v1/diff_triton" else None,
                )
    return out


def fmt(x, unit: str) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if unit == "s":
        return f"{x * 1e3:,.2f} ms" if x < 1 else f"{x:,.3f} s"
    if unit == "tok/s":
        return f"{x:,.0f} tok/s" if x >= 100 else f"{x:,.2f} tok/s"
    return f"{x:g}"


def fmt_mib(x) -> str:
    return "-" if x is None else (f"{x:,.0f}" if x >= 100 else f"{x:.3g}")


def _r(x) -> str:
    return "-" if x is None else f"{x:.3f}x"


def _wall(run: dict) -> str:
    if "wall_s" not in run:
        return "unfinished (interrupted, or still running)"
    return f"wall {run['wall_s']:.0f} s" + (
        " (time budget reached: some work skipped)" if run.get("budget_hit") else ""
    )


def _floor(models: dict, name: str, metric: str, entry: dict) -> str:
    """The ratio to Llama the work implies (time: work ratio; tokens/s: its inverse), or - where not recorded."""
    work = models.get(name, {}).get("work", {}).get(metric)
    ref = models.get("llama", {}).get("work", {}).get(metric)
    if not work or not ref:
        return "-"
    return _r(ref / work if entry["higher_is_better"] else work / ref)


def render(data: dict) -> str:
    summary = data.get("summary", {})
    smoke = " (SMOKE: tiny shapes on CPU, numbers meaningless)" if data["smoke"] else ""
    lines = [
        f"# Diff Transformer GPU benchmark{smoke}",
        "",
        "Generated by `benchmarks/bench_gpu.py` from `results_gpu.json` (every sample is there).",
        "",
    ]
    for run in data.get("runs", []):
        lines.append(
            f"- run {run['date']}: sections {','.join(run['sections'])} | {run['device']} | driver {run['driver']} | "
            f"CUDA {run['cuda']} | torch {run['torch']} | triton {run['triton']} | transformers "
            f"{run['transformers']} | flash_attn {run['flash_attn']} | git {run['git']} | {run['dtype']} | "
            f"reps {run['reps']} | {_wall(run)}"
        )
    s = data["size"]
    lines += [
        "",
        f"Size: hidden {s['hidden']}, {s['layers']} layers, intermediate {s['intermediate']}, vocab "
        f"{s['vocab']}, untied LM head, d = {s['head_dim']}.",
        "",
        "## Models",
        "",
        "| model | layout | params (CausalLM) | x Llama | attention params / layer | KV cache / token |",
        "|---|---|---|---|---|---|",
    ]
    models = data.get("models", {})
    ref = models.get("llama")
    for m in models.values():
        ratio = f"{m['params_lm'] / ref['params_lm']:.3f}x" if ref else "-"
        lines.append(
            f"| {m['label']} | {m['layout']} | {m['params_lm']:,} | {ratio} | "
            f"{m['attn_params_per_layer']:,} | {m['kv_cache_bytes_per_token']:,} B |"
        )
    lines += ["", "## Backends (probe: a tiny forward)", "", "| model | backend | status |", "|---|---|---|"]
    for c, p in data.get("probes", {}).items():
        model, backend = c.split("/", 1)
        lines.append(f"| {model} | {backend} | {'ok' if p['ok'] else p['reason']} |")
    for metric, entry in data.get("metrics", {}).items():
        unit, better = entry["unit"], "higher" if entry["higher_is_better"] else "lower"
        lines += [
            "",
            f"## {metric}: {entry['description']} ({unit}, {better} is better)",
            "",
            "| model | backend | median | x Llama same backend | x best Llama | floor | peak MiB | peak x Llama "
            "| reps | note |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        rows = summary.get(metric, {})
        for c, r in entry["configs"].items():
            model, backend = c.split("/", 1)
            if c in rows:
                row = rows[c]
                note = ", ".join(
                    f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in r.get("notes", {}).items()
                )
                lines.append(
                    f"| {model} | {backend} | {fmt(row['median'], unit)} | {_r(row['ratio_llama_same'])} | "
                    f"{_r(row['ratio_llama_best'])} ({row['llama_best']}) | {_floor(models, model, metric, entry)} | "
                    f"{fmt_mib(row['peak_mib'])} | "
                    f"{_r(row['peak_ratio_llama_same'])} | {row['n']} | {note} |"
                )
            else:
                lines.append(f"| {model} | {backend} | - | - | - | - | - | - | 0 | {r['status']} |")
    tgts = data.get("targets", [])
    if tgts:
        lines += [
            "",
            "## Targets (issue 14: each model's best backend vs Llama's best backend, median paired ratio)",
            "",
        ]
        for t in tgts:
            mark = "REPORT" if t["pass"] is None else ("PASS" if t["pass"] else "MISS")
            lines.append(f"- {mark}: {t['target']}")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------------- runner
class Runner:
    def __init__(self, args, size, dev: Device, dtype, results: Results):
        self.args, self.size, self.dev, self.dtype, self.res = args, size, dev, dtype, results
        self.t_start = time.perf_counter()
        self.log = make_log(self.t_start)
        self.budget_hit = False
        self.compile_times: dict[float, list[float]] = {}  # seconds of first (compiling) calls, by kind of compile
        self.group = ""  # configs measured in the same group (run, pass) were interleaved: their ratios pair by rep
        self.flex_pass = False  # flex_attention compiles its kernels on a config's first call: budget for it

    def compile_est(self, default: float) -> float:
        return 0.0 if self.args.smoke else max(self.compile_times.get(default, []), default=default)

    def left(self) -> float:
        if not self.args.time_budget:
            return math.inf
        return self.args.time_budget - (time.perf_counter() - self.t_start)

    def run_metric(
        self,
        metric: str,
        configs: dict,
        warmups: int = 1,
        compile_first: bool = False,
        compile_default_s: float = 90.0,
    ):
        """configs: config -> measure() returning {"value", "peak_mib", ...}, or a string saying why not measured.
        Warm-ups, then interleaved reps; every sample is saved as it comes. A config measured before (an earlier
        pass or, with --merge, an earlier run) is replaced."""
        section, unit, higher, descr = metric_specs(self.size)[metric]
        entry = self.res.data["metrics"].setdefault(metric, {"configs": {}})
        entry.update(section=section, unit=unit, higher_is_better=higher, description=descr)
        t_metric = time.perf_counter()
        live = {}
        for c, fn in configs.items():
            rec = entry["configs"][c] = {
                "status": "ok",
                "group": self.group,
                "reps": [],
                "values": [],
                "peak_mib": [],
                "extra": [],
                "notes": {},
            }
            if isinstance(fn, str):
                rec["status"] = fn
                continue
            if self.flex_pass and not compile_first:
                compile_first, compile_default_s = True, 30.0
            need = self.compile_est(compile_default_s) if compile_first else 0.0
            if self.left() < need + 5:
                rec["status"] = "skipped: time budget"
                self.budget_hit = True
                continue
            try:
                for i in range(warmups):
                    t0 = time.perf_counter()
                    fn()
                    if i == 0 and compile_first:
                        rec["notes"]["compile_s"] = time.perf_counter() - t0
                        self.compile_times.setdefault(compile_default_s, []).append(rec["notes"]["compile_s"])
                live[c] = fn
            except Exception as e:  # noqa: BLE001
                rec["status"] = self._failure(e)
            if rec["status"] != "ok":
                self._after_failure(metric, c, rec["status"])
            self.res.save(md=False)
        rep_s = 0.0
        for rep in range(self.args.reps):
            if not live:
                break
            if rep > 0 and self.left() < rep_s + 5:
                self.budget_hit = True
                self.log(f"{metric}: time budget, stopping after {rep} reps")
                break
            t_rep = time.perf_counter()
            names = list(live)
            order = rotated(names, rep)
            for c in order:
                rec = entry["configs"][c]
                try:
                    r = live[c]()
                except Exception as e:  # noqa: BLE001
                    rec["status"] = self._failure(e)
                if rec["status"] != "ok":
                    self._after_failure(metric, c, rec["status"])
                    del live[c]
                    continue
                rec["reps"].append(rep)
                rec["values"].append(r.pop("value"))
                rec["peak_mib"].append(r.pop("peak_mib"))
                rec["extra"].append(r)
                self.res.save(md=False)
            rep_s = time.perf_counter() - t_rep
            self.log(
                f"{metric} rep {rep + 1}/{self.args.reps} ({rep_s:.1f}s): "
                + ", ".join(f"{c}={entry['configs'][c]['values'][-1]:.4g}" for c in names if c in live)
            )
        for c in configs:
            if entry["configs"][c]["status"] == "ok" and not entry["configs"][c]["values"]:
                entry["configs"][c]["status"] = "skipped: time budget"
        entry["wall_s"] = entry.get("wall_s", 0.0) + time.perf_counter() - t_metric
        self.res.save()

    @staticmethod
    def _failure(e: BaseException) -> str:
        return f"error: {'CUDA out of memory: ' if is_oom(e) else ''}{one_line(e)}"

    def _after_failure(self, metric: str, config: str, status: str):
        # Outside the except block: the traceback (and the activations its frames hold) is gone, so memory frees.
        self.log(f"{metric} {config}: {status}")
        self.dev.free()


def measured_pairs(runner: Runner, models: dict, backends: list[str]) -> list[str]:
    probes = runner.res.data["probes"]
    return [f"{m}/{b}" for m in models for b in applicable_backends(m, backends) if probes[f"{m}/{b}"]["ok"]]


def section_attention(runner: Runner, models: dict, backends: list[str]):
    r = runner
    core = attn_core_fns(r.size, r.dev, r.dtype, backends)
    resident = core.pop("resident")
    r.run_metric(
        "attn_core",
        {c: (fn if isinstance(fn, str) else _wrap_time(r.dev, fn, resident)) for c, fn in core.items()},
        warmups=2,
    )
    del core
    r.dev.free()
    layer = {}
    for c in measured_pairs(r, models, backends):
        name, backend = c.split("/", 1)
        if backend in ("flex_attention", "eager"):
            layer[c] = f"skipped: runs with attention_mask=None (causal via is_causal), which {backend} cannot"
            continue
        layer[c] = _layer_measure(r, models[name], backend)
    r.run_metric("attn_layer", layer, warmups=2)
    for m in models.values():
        set_backend(m, "sdpa")
    r.dev.free()


def _wrap_time(dev: Device, fn, resident: int):
    def measure():
        with PeakMemory(dev, resident) as mem:
            dt = timed(fn, dev.sync)
        return {"value": dt, "peak_mib": mem.mib}

    return measure


def _layer_measure(r: Runner, model, backend: str):
    state = {}

    def measure():
        set_backend(model, backend)
        if "fn" not in state:
            state["fn"] = attn_layer_fn(model, r.size, r.dev, r.dtype)
        model.train()
        try:
            resident = tensor_bytes(model.model.layers[0].self_attn.parameters())
            with PeakMemory(r.dev, resident) as mem:
                dt = timed(state["fn"], r.dev.sync)
        finally:
            model.eval()
        return {"value": dt, "peak_mib": mem.mib}

    return measure


def section_train(runner: Runner, models: dict, configs: list[str], compiled: bool):
    r = runner
    ids = random_ids(r.size["train_seq"], r.size["vocab"], 4).to(r.dev.device)
    trainers, fns, compiled_fns = {}, {}, {}
    compile_kwargs = ({"backend": "eager"} if r.args.smoke else {}) if compiled else None  # default mode on GPU
    for c in configs:
        name, backend = c.split("/", 1)

        def measure(c=c, name=name, backend=backend):
            model = models[name]
            set_backend(model, backend)  # a compiled graph guards on it: switching recompiles once, then both stay
            if name not in trainers:
                trainers[name] = Trainer(model, r.dev)
            fn = model
            if compiled:
                if c not in compiled_fns:
                    compiled_fns[c] = torch.compile(model, **compile_kwargs)
                fn = compiled_fns[c]
            return trainers[name].measure(fn, ids, r.size["train_steps"])

        fns[c] = measure
    metric = "train_compile" if compiled else "train"
    r.run_metric(metric, fns, warmups=2, compile_first=compiled)
    if compiled:
        r.res.data["metrics"][metric]["compile"] = (
            "torch.compile(model, backend='eager') (smoke)"
            if r.args.smoke
            else "torch.compile(model), default mode (inductor)"
        )
    trainers.clear()
    compiled_fns.clear()
    for m in models.values():
        m.zero_grad(set_to_none=True)
        m.eval()
    if compiled:
        torch._dynamo.reset()
    r.dev.free()


def section_prefill(runner: Runner, models: dict, configs: list[str]):
    r = runner
    for n in r.size["prefill"]:
        ids = random_ids(n, r.size["vocab"], 10 + n).to(r.dev.device)
        fns = {}
        for c in configs:
            name, backend = c.split("/", 1)

            def measure(name=name, backend=backend, ids=ids):
                set_backend(models[name], backend)
                return measure_prefill(models[name], ids, r.dev)

            fns[c] = measure
        r.run_metric(f"prefill_{n}", fns, warmups=1)
        r.dev.free()


def section_decode(runner: Runner, models: dict, configs: list[str], static: bool):
    r = runner
    compile_config = compile_kwargs(str(r.dev.device))["compile_config"]  # generate --compile's: fullgraph
    if static and r.args.smoke:  # CPU: generate only auto-compiles on accelerators unless told to; inductor is slow
        # dynamo only (no inductor), one trace for both batch sizes; fullgraph still refuses a graph break
        compile_config = CompileConfig(backend="eager", mode=None, dynamic=True, fullgraph=True)
        compile_config._compile_all_devices = True
    prompt = random_ids(r.size["prompt"], r.size["vocab"], 3).to(r.dev.device)
    for b in r.size["decode_batches"]:
        ids = prompt.expand(b, -1).contiguous()
        caches, fns = {}, {}
        for c in configs:
            name, backend = c.split("/", 1)

            def measure(c=c, name=name, backend=backend, ids=ids, caches=caches):
                model = models[name]
                set_backend(model, backend)
                if static and c not in caches:
                    max_len = r.size["prompt"] + r.size["new_tokens"]
                    caches[c] = StaticCache(config=model.config, max_cache_len=max_len)
                out = measure_decode(model, ids, r.size["new_tokens"], r.dev, caches.get(c), compile_config)
                if static and not out["compiled"]:
                    raise RuntimeError("generate did not compile the decode step (static cache + compile expected)")
                return out

            fns[c] = measure
        metric = f"decode_b{b}_{'static' if static else 'dynamic'}"
        r.run_metric(metric, fns, warmups=2 if static else 1, compile_first=static)
        caches.clear()
        r.dev.free()
    if static:
        for m in models.values():
            for attr in ("_compiled_call", "_last_compile_config"):
                if hasattr(m, attr):
                    delattr(m, attr)
        torch._dynamo.reset()
        r.dev.free()


# ------------------------------------------------------------------------------------------------------- meta
def environment(dev: Device, dtype, args) -> dict:
    def version(mod):
        try:
            return importlib.import_module(mod).__version__
        except Exception:  # noqa: BLE001
            return "not installed"

    driver = "n/a"
    if dev.cuda:
        try:
            smi = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
                check=False,
            )
            driver = smi.stdout.strip().splitlines()[0]
        except Exception:  # noqa: BLE001
            driver = "unknown"
    return {
        **provenance(),
        "device": torch.cuda.get_device_name(dev.device) if dev.cuda else f"CPU: {cpu_name()}",
        "driver": driver,
        "cuda": torch.version.cuda or "n/a",
        "cudnn": str(torch.backends.cudnn.version()) if dev.cuda else "n/a",
        "triton": version("triton"),
        "flash_attn": version("flash_attn"),
        "dtype": str(dtype).replace("torch.", ""),
        "reps": args.reps,
        "argv": recorded_argv(None),
    }


# ------------------------------------------------------------------------------------------------------- main
def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (fp32), every section; CI runs it")
    p.add_argument("--sections", default=",".join(SECTIONS), help="comma list from: " + ",".join(SECTIONS))
    p.add_argument("--models", default=",".join(MODELS), help="comma list from: " + ",".join(MODELS))
    p.add_argument(
        "--backends",
        default=None,
        help="comma list from: "
        + ",".join(BACKENDS)
        + f" (default {DEFAULTS[False]['backends']}; smoke {DEFAULTS[True]['backends']})",
    )
    p.add_argument(
        "--compile-configs",
        default=None,
        help=f"model/backend pairs for train_compile and decode_static (default {DEFAULTS[False]['compile_configs']})",
    )
    p.add_argument("--reps", type=int, default=None, help="interleaved repetitions per metric (default 5, smoke 2)")
    p.add_argument("--train-steps", type=int, default=None, help="training steps per repetition (default 3)")
    p.add_argument("--new-tokens", type=int, default=None, help="decode tokens per generate (default 32)")
    p.add_argument("--intermediate", type=int, default=None, help="MLP intermediate size (default 5632)")
    p.add_argument(
        "--v2wide-heads",
        type=int,
        default=None,
        help="v2wide's H (default Llama's heads; 24 = Llama's attention parameter count)",
    )
    p.add_argument("--v2wide-kv-heads", type=int, default=None, help="v2wide's H_kv (default Llama's KV heads / 2)")
    p.add_argument(
        "--out-dir",
        default=None,
        help="where results_gpu.{json,md} go (default benchmarks/results/; smoke: a new temporary directory)",
    )
    p.add_argument("--merge", action="store_true", help="add to an existing results_gpu.json (same sizes)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing results_gpu.json")
    p.add_argument("--report-only", action="store_true", help="rewrite results_gpu.md from results_gpu.json")
    p.add_argument(
        "--time-budget",
        type=float,
        default=None,
        help="seconds: stop starting work that would not "
        "finish in time (recorded as skipped); e.g. 500 for a 9-minute call",
    )
    return p.parse_args(argv)


def fail(msg: str) -> int:
    print(f"bench_gpu.py: error: {msg}", file=sys.stderr)
    return 2


def main(argv=None) -> int:
    args = parse_args(argv)
    defaults = DEFAULTS[args.smoke]
    out_dir = Path(args.out_dir) if args.out_dir else (None if args.smoke else RESULTS_DIR)  # smoke: a new temp dir
    path_json, path_md = (out_dir / "results_gpu.json", out_dir / "results_gpu.md") if out_dir else (None, None)
    if args.report_only:
        if out_dir is None:
            return fail("--report-only --smoke needs --out-dir (the smoke run's directory)")
        if not path_json.is_file():
            return fail(f"{path_json} does not exist: run the benchmark first or pass --out-dir")
        data = json.loads(path_json.read_text())
        Results(path_json, path_md, data).save()
        print(path_md)
        return 0

    sections = _csv(args.sections)
    models_req = _csv(args.models)
    backends = _csv(args.backends or defaults["backends"])
    compile_cfgs = _csv(args.compile_configs or defaults["compile_configs"])
    for what, values, allowed in (
        ("section", sections, SECTIONS),
        ("model", models_req, MODELS),
        ("backend", backends, BACKENDS),
    ):
        bad = [v for v in values if v not in allowed]
        if bad:
            return fail(f"unknown {what} {', '.join(bad)}: choose from {', '.join(allowed)}")
    for c in compile_cfgs:
        m, _, b = c.partition("/")
        if m not in MODELS or b not in BACKENDS:
            return fail(f"--compile-configs entry {c!r} is not model/backend (e.g. v1/sdpa)")
    if args.merge and args.overwrite:
        return fail("--merge and --overwrite exclude each other: pick one")
    if "llama" not in models_req:
        models_req.insert(0, "llama")  # every ratio is to Llama
    if not args.smoke and not torch.cuda.is_available():
        return fail("no CUDA device: run this on a GPU, or pass --smoke for the CPU smoke test")

    size = dict(SMOKE if args.smoke else FULL)
    for key, val in (
        ("train_steps", args.train_steps),
        ("new_tokens", args.new_tokens),
        ("intermediate", args.intermediate),
        ("reps", args.reps),
    ):
        if val is not None:
            if val <= 0:
                return fail(f"--{key.replace('_', '-')} must be a positive integer, got {val}")
            size[key] = val
    args.reps = size.pop("reps")
    if args.v2wide_heads or args.v2wide_kv_heads:
        size["v2wide"] = [args.v2wide_heads, args.v2wide_kv_heads]

    if out_dir is None:
        out_dir = Path(tempfile.mkdtemp(prefix="bench_gpu_smoke_"))
        path_json, path_md = out_dir / "results_gpu.json", out_dir / "results_gpu.md"
    out_dir.mkdir(parents=True, exist_ok=True)
    if path_json.exists() and not (args.merge or args.overwrite):
        return fail(f"{path_json} exists: pass --merge to add to it or --overwrite to replace it")
    data = {"schema": 1, "smoke": args.smoke, "size": size, "runs": [], "models": {}, "probes": {}, "metrics": {}}
    if args.merge and path_json.exists():
        old = json.loads(path_json.read_text())
        if old.get("size") != size or old.get("smoke") != args.smoke:
            return fail(
                f"{path_json} was measured with other sizes ({old.get('size')}): use the same options, "
                "another --out-dir, or --overwrite"
            )
        data = old

    dev = Device(torch.device("cpu") if args.smoke else torch.device("cuda"))
    dtype = torch.float32 if args.smoke else torch.bfloat16
    if args.smoke:
        torch.set_num_threads(1)  # tiny shapes: threads only add contention on a shared CI machine
    # Five models x two batch sizes share generate's compiled code object: raise dynamo's recompile limit (default 8)
    # and fail loudly instead of silently falling back to eager when it is hit anyway.
    torch._dynamo.config.recompile_limit = 32
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    transformers.utils.logging.set_verbosity_error()

    results = Results(path_json, path_md, data)
    runner = Runner(args, size, dev, dtype, results)
    meta = environment(dev, dtype, args)
    meta["sections"] = [s for s in SECTIONS if s in sections]
    data["runs"].append(meta)
    runner.log(f"{meta['device']} | torch {meta['torch']} | transformers {meta['transformers']} -> {out_dir}")

    models = {}
    for i, name in enumerate(m for m in MODELS if m in models_req):
        models[name], info = build(name, size, args, dev.device, dtype, seed=i)
        data["models"][name] = info
        runner.log(f"built {name}: {info['params_lm'] / 1e6:,.1f}M params ({info['layout']})")
    # Pass 1: every backend but flex_attention; pass 2: flex_attention, whose kernels compile on first use (per
    # shape and head layout), so a time budget spent there never costs the other backends their numbers.
    passes = [[b for b in backends if b != "flex_attention"], [b for b in backends if b == "flex_attention"]]
    for index, pass_backends in enumerate(p for p in passes if p):
        runner.group = f"{len(data['runs']) - 1}.{index}"
        runner.flex_pass = pass_backends == ["flex_attention"]
        for name, model in models.items():
            for b in applicable_backends(name, pass_backends):
                reason = probe(model, b, dev, args.smoke, size["vocab"])
                data["probes"][f"{name}/{b}"] = {"ok": reason is None, "reason": reason}
                if reason:
                    runner.log(f"probe {name}/{b}: {reason}")
        results.save()
        pairs = measured_pairs(runner, models, pass_backends)
        compiled = [c for c in compile_cfgs if c in pairs]
        for c in compile_cfgs:
            if c.split("/")[1] in pass_backends and c.split("/")[0] in models and c not in compiled:
                runner.log(f"compile config {c} left out: {data['probes'][c]['reason']}")
        for section in SECTIONS:
            if section not in sections or (section == "attention" and runner.flex_pass):
                continue  # attention alone runs without a mask object, which flex_attention needs
            configs = compiled if section in ("train_compile", "decode_static") else pairs
            if not configs and section != "attention":
                continue
            runner.log(f"== {section} ({', '.join(pass_backends)})")
            if section == "attention":
                section_attention(runner, models, pass_backends)
            elif section in ("train", "train_compile"):
                section_train(runner, models, configs, section == "train_compile")
            elif section == "prefill":
                section_prefill(runner, models, configs)
            else:
                section_decode(runner, models, configs, section == "decode_static")
    meta["wall_s"] = time.perf_counter() - runner.t_start
    meta["budget_hit"] = runner.budget_hit
    results.save()
    runner.log(f"wrote {path_json} and {path_md}")
    print(path_json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
