#!/usr/bin/env python
"""CPU benchmark: Llama vs transformers' DiffLlama vs our Diff V1 / Diff V2, at equal parameter budgets, in one run.

Run from a checkout (no install needed, the checkout's ``src/`` is put first on ``sys.path``)::

    python benchmarks/bench_model.py                      # full run, ~60M-parameter models
    python benchmarks/bench_model.py --quick              # tiny models, < 1 minute smoke test
    python benchmarks/bench_model.py --reps 7 \\
        --json benchmarks/results/results_cpu.json --md benchmarks/results/results_cpu.md

Models (fp32, ``attn_implementation="sdpa"``, random init, same embedding / MLP / norms / vocab everywhere)
-------------------------------------------------------------------------------------------------------------
Default size: hidden D=512, 8 layers, MLP intermediate 1376, vocab 32000, untied LM head, sub-head size d=64.

* **Llama** (``LlamaForCausalLM``): 8 heads of 64, 8 KV heads. Attention parameters per layer:
  q, k, v, o = 4 * D * 512 = 4 D^2.
* **DiffLlama** (``DiffLlamaForCausalLM``): the *same* config as Llama (8 heads of 64, 8 KV heads); DiffLlama pairs
  heads (i, i + 4) into 4 differential heads with 128-wide values. Same matrices as Llama + 4d lambda per layer.
* **Diff V1** (ours, ``diff_version=1``): H=4 differential heads, H_kv=4, d=64. q = 2*H*d = 512, k = 2*H_kv*d = 512,
  v = 2*H_kv*d = 512, o = 2*H*d -> D: exactly Llama's 4 D^2, + 6d per layer (lambda vectors 4d, subln 2d).
  2H = 8 query/key sub-heads of 64, like Llama's 8 heads.
* **Diff V2** (ours, ``diff_version=2``): H=8 differential heads, H_kv=4, d=64 (2H = 16 query heads).
  V2's q_proj is 2H*d wide, k/v are H_kv*d, o_proj is H*d -> D and the lambda projection is D -> H. With d=64,
  the only layout whose parameter count equals Llama's is H=8, H_kv=4:
  q 1024 + k 256 + v 256 + o 512 (all x D) = 4 D^2 = Llama's, + D*H = 4096 per layer (0.01% of the model).
  V2 thus trades K/V width (2:1 GQA, half Llama's KV cache) for twice Llama's query heads -- exactly the trade
  Diff Transformer V2 makes -- so its attention does 2x Llama's QK^T/PV FLOPs at the same parameter count.
  The layout the brief first suggested, H=4 (8 query heads like Llama), can at most use H_kv=4 (H % H_kv == 0):
  q 512 + k 256 + v 256 + o 256 = 2.5 D^2, i.e. 3.1M (~5%) fewer parameters than Llama -- not an equal budget.
  It is available as the extra model ``v2h4`` (``--models llama,diffllama,v1,v2,v2h4``) and the V2 head counts
  can be overridden with ``--v2-heads/--v2-kv-heads``. The table prints every model's parameter count.
* **Diff V2 (map first)** (``v2mf``): the same model with ``attn_implementation="diff_map_first"``, the opt-in
  backend that forms each pair's differential map before V in eval mode too (CPU, fp32, no padding). Only its
  prefill rows differ from V2's: decode steps have a cached prefix and keep the fused call, the memory row's 8,192
  tokens exceed the blocked path's budget, and train mode forms the map first for both. Its floor is V2's.

Measurements (ratios are to Llama *measured in the same run*)
-------------------------------------------------------------
Repetitions are interleaved: ``for rep: for metric: for model`` (model order rotated every rep), after one
untimed warm-up per (model, metric). Reported: the median of the absolute numbers, and in parentheses the median
over reps of the per-rep ratio model/Llama (paired, so slow drift from other load on the machine cancels);
PASS/MISS uses these median ratios. A second table gives best-of-reps (min time / max tokens/s) and the ratio of
the bests: the least contended estimate when other processes share the CPU (the load average seen at each rep is
recorded).
``torch.set_num_threads`` = all usable cores; inference under ``torch.inference_mode()``.

1. Prefill latency: base model (no LM head), batch 1, 512 and 2048 random tokens, ``use_cache=True`` (a real
   prefill that fills a DynamicCache).
2. Decode tokens/s: CausalLM ``generate`` greedy (``do_sample=False``, ``min_new_tokens = max_new_tokens = 128``)
   after a 512-token prompt. A no-op logits processor timestamps every generation step, so the 127 intervals
   between steps are the single-token decode forwards (plus generate's per-step overhead, identical for every
   model). Reported tokens/s = 1 / median interval: on a shared machine one burst of foreign load inflates a
   few intervals but not the median. The plain mean rate (127 / (t_last - t_first)) and the end-to-end generate
   time are in the JSON (``detail.decode_detail``).
3. Peak memory: one base-model forward (``use_cache=False``, inference mode) at 8192 tokens, in a fresh
   subprocess per model and per repetition. The worker builds the model, runs a 16-token warm-up forward
   (thread pools, lazy init), ``gc.collect()``, then resets the kernel's RSS high-water mark
   (``echo 5 > /proc/self/clear_refs``, Linux >= 4.0), reads VmRSS, runs the forward and reads VmHWM:
   peak = VmHWM - VmRSS_before (the extra resident memory the forward needed: activations, attention workspace,
   output). A 1 ms `/proc` RSS sampler runs too and is reported in the JSON (and used if clear_refs is not
   writable). Weights are excluded by construction. The worker runs with ``MALLOC_MMAP_THRESHOLD_=65536``: every
   allocation >= 64 KiB is its own mmap, returned to the OS on free, so RSS tracks live tensors. Without it,
   glibc's *dynamic* mmap threshold lets freed blocks linger in the heap and the same forward's peak varied by
   up to +-100 MiB between runs; with it, repeated runs agree to 0.1 MiB.
3b. Compiled decode tokens/s (``decode_compiled``): the same greedy ``generate`` as ``generate --compile`` runs it
   (``diff_transformer.generation.call.compile_kwargs``): a static cache, and transformers compiling the decoding
   step with ``torch.compile(fullgraph=True)``, inductor's default mode (the prefill stays eager). Every model,
   Llama included, is compiled in the same run; the compile happens in the warm-up (its seconds, and whether the
   compiled greedy tokens equal the eager ones, are in the JSON: ``detail.decode_compiled``). Ratios are to the
   compiled Llama.
4. Training step: CausalLM in train mode, batch 1, 1024 tokens, forward + loss (``labels=input_ids``) +
   backward; gradients are dropped (set to None) outside the timed region. No optimizer step (it is
   parameter-proportional, hence equal for equal budgets).

Targets (ours vs Llama): V1 prefill <= 1.25x and faster than DiffLlama; V2 prefill <= 1.4x; decode tokens/s
V2 >= 0.9x, V1 >= 0.85x; peak memory <= 1.2x; training step <= 1.35x. A PASS/MISS line is printed per target.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench_common import (  # first: it puts the checkout's src/ first on sys.path
    StepClock,
    config_kwargs,
    cpu_name,
    greedy_generate,
    make_log,
    median,
    median_ratio,
    n_params,
    proc_status_kb,
    provenance,
    random_ids,
    reset_peak_rss,
    rotated,
    rss_bytes,
    same_matrices_model,
    timed,
)


# isort: split
from floors import decode_bytes, forward_macs, meta_model


# isort: split
import torch
from transformers.utils import logging as hf_logging

from diff_transformer import DiffConfig, DiffForCausalLM
from diff_transformer.generation.call import compile_kwargs


hf_logging.set_verbosity_error()

MODEL_LABELS = {
    "llama": "Llama",
    "diffllama": "DiffLlama",
    "v1": "Diff V1",
    "v2": "Diff V2",
    "v2h4": "Diff V2 (H=4)",
    "v2mf": "Diff V2 (map first)",
}

FULL = dict(
    hidden=512,
    layers=8,
    heads=8,
    kv_heads=8,
    head_dim=64,
    intermediate=1376,
    vocab=32000,
    prefill=[512, 2048],
    prompt=512,
    new_tokens=128,
    mem_seq=8192,
    train_seq=1024,
    reps=7,
    mem_reps=2,
)
QUICK = dict(
    hidden=64,
    layers=2,
    heads=4,
    kv_heads=4,
    head_dim=16,
    intermediate=172,
    vocab=1000,
    prefill=[64, 256],
    prompt=32,
    new_tokens=16,
    mem_seq=1024,
    train_seq=128,
    reps=2,
    mem_reps=1,
)


# ----------------------------------------------------------------------------------------------------------- models
def model_config(name: str, size: dict, v2_heads: int | None = None, v2_kv_heads: int | None = None):
    common = config_kwargs(size, max(8192, size["mem_seq"], size["prompt"] + size["new_tokens"]))
    n_h, n_kv = size["heads"], size["kv_heads"]
    if name in ("llama", "diffllama", "v1"):
        return same_matrices_model(name, size, common)
    if name in ("v2", "v2mf"):  # H = Llama's heads (2H query heads), H_kv = half Llama's KV heads: 4 D^2 like Llama
        H = v2_heads or n_h
        H_kv = v2_kv_heads or max(1, n_kv // 2)
        return DiffForCausalLM, DiffConfig(
            diff_version=2,
            num_attention_heads=H,
            num_key_value_heads=H_kv,
            **common,
        )
    if name == "v2h4":  # 2H = Llama's heads: smaller than Llama (see docstring)
        return DiffForCausalLM, DiffConfig(
            diff_version=2, num_attention_heads=n_h // 2, num_key_value_heads=n_kv // 2, **common
        )
    raise ValueError(f"unknown model {name!r}; choose from {sorted(MODEL_LABELS)}")


def build(name: str, size: dict, args, seed: int = 0, base_only: bool = False):
    cls, config = model_config(name, size, args.v2_heads, args.v2_kv_heads)
    torch.manual_seed(seed)
    backend = "diff_map_first" if name == "v2mf" else "sdpa"
    model = cls._from_config(config, attn_implementation=backend, dtype=torch.float32)
    assert model.config._attn_implementation == backend, model.config._attn_implementation
    model.eval()
    if base_only:
        model = model.model
    return model


def describe(name: str, model) -> str:
    c = model.config
    if name in ("llama", "diffllama"):
        return f"{c.num_attention_heads} heads x {c.head_dim}, {c.num_key_value_heads} KV heads"
    return f"V{c.diff_version}: H={c.num_attention_heads} diff heads, H_kv={c.num_key_value_heads}, d={c.head_dim}"


# ----------------------------------------------------------------------------------------------------- measurements
def time_prefill(base, ids) -> float:
    with torch.inference_mode():
        return timed(lambda: base(input_ids=ids, use_cache=True))


def time_decode(lm, ids, new_tokens: int, compiled: bool = False) -> dict:
    """Greedy decode; `compiled`: as `generate --compile` does it (static cache, fullgraph-compiled decoding step)."""
    timer = StepClock()
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = greedy_generate(lm, ids, new_tokens, timer, **(compile_kwargs("cpu") if compiled else {}))
        total = time.perf_counter() - t0
    steps = len(timer.times)
    decode_s = timer.times[-1] - timer.times[0]
    intervals = [b - a for a, b in zip(timer.times, timer.times[1:])]
    return {
        "tok_s": 1.0 / median(intervals),
        "tok_s_mean": (steps - 1) / decode_s,
        "total_s": total,
        "prefill_s": timer.times[0] - t0,
        "steps": steps,
        "tokens": out[0, ids.shape[1] :].tolist(),
    }


def time_train(lm, ids) -> float:
    lm.train()
    t0 = time.perf_counter()
    out = lm(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    dt = time.perf_counter() - t0
    lm.zero_grad(set_to_none=True)
    lm.eval()
    return dt


# --------------------------------------------------------------------------------------- memory (subprocess worker)
class _Sampler(threading.Thread):
    def __init__(self, interval: float = 0.001):
        super().__init__(daemon=True)
        self.interval, self.peak, self._stop_evt = interval, 0, threading.Event()

    def run(self):
        while not self._stop_evt.is_set():
            self.peak = max(self.peak, rss_bytes())
            time.sleep(self.interval)

    def stop(self):
        self._stop_evt.set()
        self.join()
        self.peak = max(self.peak, rss_bytes())


def memory_worker(name: str, size: dict, args) -> dict:
    torch.set_num_threads(args.threads)
    base = build(name, size, args, base_only=True)
    with torch.inference_mode():
        base(input_ids=random_ids(16, size["vocab"], 1), use_cache=False)
    ids = random_ids(size["mem_seq"], size["vocab"], 2)
    gc.collect()
    hwm_ok = reset_peak_rss()
    rss_before = rss_bytes()
    sampler = _Sampler()
    sampler.start()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = base(input_ids=ids, use_cache=False).last_hidden_state
    dt = time.perf_counter() - t0
    sampler.stop()
    hwm = proc_status_kb("VmHWM") * 1024
    del out
    res = {
        "rss_before_mib": rss_before / 2**20,
        "peak_sampled_mib": (sampler.peak - rss_before) / 2**20,
        "forward_s": dt,
        "hwm_reset": hwm_ok,
    }
    res["peak_hwm_mib"] = (hwm - rss_before) / 2**20 if hwm_ok else None
    res["peak_mib"] = res["peak_hwm_mib"] if hwm_ok else res["peak_sampled_mib"]
    return res


def run_memory_subprocess(name: str, args) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--_mem-worker", name, "--threads", str(args.threads)]
    if args.quick:
        cmd.append("--quick")
    if args.v2_heads:
        cmd += ["--v2-heads", str(args.v2_heads)]
    if args.v2_kv_heads:
        cmd += ["--v2-kv-heads", str(args.v2_kv_heads)]
    if args.mem_seq:
        cmd += ["--mem-seq", str(args.mem_seq)]
    env = dict(os.environ)
    env.setdefault("MALLOC_MMAP_THRESHOLD_", str(64 * 1024))  # see the docstring: makes RSS track live tensors
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"memory worker for {name} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------------------------- reporting
def summarize(raw: dict, names: list[str]) -> dict:
    """raw[metric][model] = list of per-rep values (same rep index = same interleaved round)."""
    out = {}
    for metric, per_model in raw.items():
        ref = per_model["llama"]
        out[metric] = {}
        for name in names:
            vals = per_model[name]
            higher = metric.startswith("decode")  # tokens/s
            best, best_ref = (max(vals), max(ref)) if higher else (min(vals), min(ref))
            out[metric][name] = {
                "median": median(vals),
                "ratio": median_ratio(vals, ref),
                "min": min(vals),
                "max": max(vals),
                "best": best,
                "best_ratio": best / best_ref,
            }
    return out


def fmt(x: float, unit: str) -> str:
    if unit == "ms":
        return f"{x * 1e3:,.0f} ms" if x >= 0.1 else f"{x * 1e3:,.1f} ms"
    if unit == "tok/s":
        return f"{x:,.1f} tok/s"
    if unit == "MiB":
        return f"{x:,.0f} MiB"
    return f"{x:g}"


def floor_ratios(args, size, names) -> dict:
    """metric -> model -> the ratio to Llama that the model's work implies (benchmarks/floors.py)."""
    models = {n: meta_model(*model_config(n, size, args.v2_heads, args.v2_kv_heads)) for n in names}
    out = {}
    for n_tokens in size["prefill"]:
        ref = forward_macs(models["llama"].model, n_tokens)
        out[f"prefill_{n_tokens}"] = {n: forward_macs(m.model, n_tokens) / ref for n, m in models.items()}
    ref = forward_macs(models["llama"], size["train_seq"], lm_head=True)
    out["train"] = {n: forward_macs(m, size["train_seq"], lm_head=True) / ref for n, m in models.items()}
    context = size["prompt"] + size["new_tokens"] // 2  # the mean context of the decode steps
    ref = decode_bytes(models["llama"], context)
    out["decode"] = {n: ref / decode_bytes(m, context) for n, m in models.items()}  # tokens/s: inverse of bytes
    out["decode_compiled"] = out["decode"]
    return out


def report(args, size, names, params, descr, summary, meta) -> tuple[str, list[tuple[str, bool]]]:
    cols = [MODEL_LABELS[n] for n in names]
    lines = ["| metric | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    lines.append("| layout | " + " | ".join(descr[n] for n in names) + " |")
    for key, label in (("base", "params, base model"), ("lm", "params, CausalLM")):
        ref = params["llama"][key]
        cells = [f"{params[n][key] / 1e6:,.3f}M ({params[n][key] / ref:.3f}x)" for n in names]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    rows = [(f"prefill_{n}", f"prefill {n} tok, base (lower=better)", "ms") for n in size["prefill"]]
    rows += [
        ("decode", f"decode tok/s, {size['new_tokens']} new after {size['prompt']} (higher=better)", "tok/s"),
        (
            "decode_compiled",
            f"compiled decode tok/s (static cache, fullgraph), {size['new_tokens']} new after {size['prompt']} "
            "(higher=better; ratio to compiled Llama)",
            "tok/s",
        ),
        ("memory", f"peak RSS increase, base fwd {size['mem_seq']} tok (lower=better)", "MiB"),
        ("train", f"train step fwd+bwd {size['train_seq']} tok (lower=better)", "ms"),
    ]
    best_lines = ["| best of reps | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    floor = floor_ratios(args, size, names)

    def cell(metric, name, value, ratio):
        bound = f"; floor {floor[metric][name]:.2f}x" if metric in floor else ""
        return f"{fmt(value, unit)} ({ratio:.2f}x{bound})"

    for metric, label, unit in rows:
        if metric not in summary:
            continue
        cells = [cell(metric, n, summary[metric][n]["median"], summary[metric][n]["ratio"]) for n in names]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
        if metric != "memory":
            cells = [cell(metric, n, summary[metric][n]["best"], summary[metric][n]["best_ratio"]) for n in names]
            best_lines.append(f"| {label} | " + " | ".join(cells) + " |")

    checks: list[tuple[str, bool]] = []

    def ratio(metric, name):
        return summary[metric][name]["ratio"]

    def best(metric, name):
        return summary[metric][name]["best_ratio"]

    def check(text, ok):
        checks.append((text, ok))

    for n in size["prefill"]:
        m = f"prefill_{n}"
        if m not in summary:  # --skip prefill
            continue
        if "v1" in names:
            check(
                f"V1 prefill {n} <= 1.25x Llama: {ratio(m, 'v1'):.2f}x (best-of {best(m, 'v1'):.2f}x)",
                ratio(m, "v1") <= 1.25,
            )
            if "diffllama" in names:
                check(
                    f"V1 prefill {n} faster than DiffLlama: {ratio(m, 'v1'):.2f}x vs {ratio(m, 'diffllama'):.2f}x "
                    f"(best-of {best(m, 'v1'):.2f}x vs {best(m, 'diffllama'):.2f}x)",
                    ratio(m, "v1") < ratio(m, "diffllama"),
                )
        if "v2" in names:
            check(
                f"V2 prefill {n} <= 1.4x Llama: {ratio(m, 'v2'):.2f}x (best-of {best(m, 'v2'):.2f}x)",
                ratio(m, "v2") <= 1.4,
            )
    for metric, what in (("decode", "decode"), ("decode_compiled", "compiled decode")):
        if metric not in summary:
            continue
        for n, limit in (("v2", 0.9), ("v1", 0.85)):
            if n in names:
                check(
                    f"{MODEL_LABELS[n]} {what} tok/s >= {limit}x Llama: {ratio(metric, n):.2f}x "
                    f"(best-of {best(metric, n):.2f}x)",
                    ratio(metric, n) >= limit,
                )
    for n, row in meta.get("decode_compiled", {}).items():
        check(f"{MODEL_LABELS[n]} compiled greedy tokens equal eager ones", row["tokens_equal_eager"])
    for metric in [f"prefill_{n}" for n in size["prefill"]] + ["train"]:
        for n in ("v1", "v2", "v2mf") if metric != "train" else ("v1", "v2"):  # v2mf trains as v2 does
            if metric in summary and metric in floor and n in names:
                check(
                    f"{MODEL_LABELS[n]} {metric} within 1.05x of its floor: {ratio(metric, n):.2f}x Llama, floor "
                    f"{floor[metric][n]:.2f}x ({ratio(metric, n) / floor[metric][n]:.2f}x of it)",
                    ratio(metric, n) <= 1.05 * floor[metric][n],
                )
    for metric, limit, label in (("memory", 1.2, "peak memory"), ("train", 1.35, "training step")):
        if metric not in summary:
            continue
        for n in ("v1", "v2"):
            if n in names:
                extra = "" if metric == "memory" else f" (best-of {best(metric, n):.2f}x)"
                check(
                    f"{MODEL_LABELS[n]} {label} <= {limit}x Llama: {ratio(metric, n):.2f}x{extra}",
                    ratio(metric, n) <= limit,
                )

    text = [
        f"# Diff Transformer CPU benchmark{' (QUICK smoke test)' if args.quick else ''}",
        "",
        f"{meta['date']} | git {meta['git']} | torch {meta['torch']} | transformers {meta['transformers']} | "
        f"{meta['cpu']} | {meta['threads']} threads | fp32 sdpa | reps={meta['reps']} (memory: {meta['mem_reps']} "
        f"fresh subprocesses per model) | wall time {meta['wall_s'] / 60:.1f} min",
        "",
        f"Size: hidden {size['hidden']}, {size['layers']} layers, intermediate {size['intermediate']}, vocab "
        f"{size['vocab']}, untied LM head. Cells: median (median per-rep ratio to Llama; the floor, the ratio the "
        "work alone implies: multiply-adds for prefill and training, bytes of weights + KV cache read per token for "
        "decode, see benchmarks/floors.py).",
        "",
        *lines,
        "",
        "Best of reps (min time / max tokens/s; ratio of bests), the least contended view:",
        "",
        *best_lines,
        "",
        f"Load average (1 min) seen at the end of each rep: {meta['loadavg']}; the benchmark uses "
        f"{meta['threads']} threads on {os.cpu_count()} CPUs.",
        "",
        "Targets (judged on the median per-rep ratios; best-of ratios in parentheses):",
        "",
        *[f"- {'PASS' if ok else 'MISS'}: {t}" for t, ok in checks],
        "",
    ]
    return "\n".join(text), checks


# ------------------------------------------------------------------------------------------------------------- main
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--reps", type=int, default=None, help="timed repetitions per metric (default 7, quick 2)")
    p.add_argument("--mem-reps", type=int, default=None, help="fresh memory subprocesses per model (default 2)")
    p.add_argument("--quick", action="store_true", help="tiny sizes: a < 1 minute smoke test")
    p.add_argument("--json", metavar="OUT", help="write all results (raw samples included) as JSON")
    p.add_argument("--md", metavar="OUT", help="write the markdown report")
    p.add_argument("--models", default="llama,diffllama,v1,v2,v2mf", help="comma list from: " + ",".join(MODEL_LABELS))
    p.add_argument(
        "--skip", default="", help="comma list of metrics to skip: prefill,decode,decode_compiled,memory,train"
    )
    p.add_argument("--prompt", type=int, default=None, help="decode prompt tokens (default 512, quick 32)")
    p.add_argument("--new-tokens", type=int, default=None, help="decoded tokens (default 128, quick 16)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all usable cores)")
    p.add_argument("--v2-heads", type=int, default=None, help="V2 differential heads H (default: Llama heads)")
    p.add_argument("--v2-kv-heads", type=int, default=None, help="V2 KV heads (default: Llama KV heads / 2)")
    p.add_argument("--mem-seq", type=int, default=None, help="tokens of the memory forward (default 8192)")
    p.add_argument("--_mem-worker", dest="mem_worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.threads is None:
        args.threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return args


def main(argv=None):
    args = parse_args(argv)
    size = dict(QUICK if args.quick else FULL)
    if args.mem_seq:
        size["mem_seq"] = args.mem_seq
    size["prompt"] = args.prompt or size["prompt"]
    size["new_tokens"] = args.new_tokens or size["new_tokens"]
    if args.mem_worker:
        print(json.dumps(memory_worker(args.mem_worker, size, args)))
        return 0

    t_start = time.perf_counter()
    torch.set_num_threads(args.threads)
    # Every model's compiled decoding step is one code object (Module.__call__) with a graph per model: room for them
    # all, and a loud failure rather than a silent eager fallback past the limit (as bench_gpu.py).
    torch._dynamo.config.recompile_limit = 32
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    reps = args.reps or size["reps"]
    mem_reps = args.mem_reps or size["mem_reps"]
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    if "llama" not in names:
        names.insert(0, "llama")
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}

    log = make_log(t_start)

    log(f"building {names} ({args.threads} threads)")
    lms = {n: build(n, size, args, seed=i) for i, n in enumerate(names)}
    params = {n: {"base": n_params(lm.model), "lm": n_params(lm)} for n, lm in lms.items()}
    descr = {n: describe(n, lm) for n, lm in lms.items()}
    for n in names:
        log(f"  {MODEL_LABELS[n]:>14}: {params[n]['base']:,} base / {params[n]['lm']:,} CausalLM params ({descr[n]})")

    prefill_ids = {L: random_ids(L, size["vocab"], 10 + L) for L in size["prefill"]}
    prompt = random_ids(size["prompt"], size["vocab"], 3)
    train_ids = random_ids(size["train_seq"], size["vocab"], 4)

    metrics = []  # (key, fn(name) -> value, extra-recorder)
    if "prefill" not in skip:
        for L in size["prefill"]:
            metrics.append((f"prefill_{L}", lambda n, L=L: time_prefill(lms[n].model, prefill_ids[L])))
    if "decode" not in skip:
        metrics.append(("decode", lambda n: time_decode(lms[n], prompt, size["new_tokens"])))
    if "decode_compiled" not in skip:
        metrics.append(("decode_compiled", lambda n: time_decode(lms[n], prompt, size["new_tokens"], compiled=True)))
    if "train" not in skip:
        metrics.append(("train", lambda n: time_train(lms[n], train_ids)))

    log("warm-up")
    compiled: dict = {}  # model -> first compiled call's seconds (the compile) and its tokens against eager ones
    for key, fn in metrics:
        for n in names:
            t0 = time.perf_counter()
            out = fn(n)
            if key == "decode_compiled":
                eager = time_decode(lms[n], prompt, size["new_tokens"])["tokens"]
                compiled[n] = {"compile_s": time.perf_counter() - t0, "tokens_equal_eager": out["tokens"] == eager}
                log(f"  {MODEL_LABELS[n]} compiled decode: {compiled[n]}")
    raw: dict = {key: {n: [] for n in names} for key, _ in metrics}
    extra: dict = {"decode_detail": {n: [] for n in names}, "decode_compiled": {n: [] for n in names}}
    loads: list[float] = []
    for rep in range(reps):
        order = rotated(names, rep)
        for key, fn in metrics:
            for n in order:
                v = fn(n)
                if key.startswith("decode"):
                    v.pop("tokens")  # compared once, in the warm-up
                    extra["decode_detail" if key == "decode" else key][n].append(v)
                    v = v["tok_s"]
                raw[key][n].append(v)
        loads.append(round(os.getloadavg()[0], 1))
        log(
            f"rep {rep + 1}/{reps} (load {loads[-1]}): "
            + ", ".join(f"{key}=" + "/".join(f"{raw[key][n][-1]:.3g}" for n in names) for key, _ in metrics)
        )

    if "memory" not in skip:
        del lms  # free the parent's copies; workers are separate processes anyway
        gc.collect()
        raw["memory"] = {n: [] for n in names}
        extra["memory_detail"] = {n: [] for n in names}
        for rep in range(mem_reps):
            order = rotated(names, rep)
            for n in order:
                r = run_memory_subprocess(n, args)
                extra["memory_detail"][n].append(r)
                raw["memory"][n].append(r["peak_mib"])
                log(
                    f"memory rep {rep + 1}/{mem_reps} {MODEL_LABELS[n]}: +{r['peak_mib']:.0f} MiB "
                    f"(sampled +{r['peak_sampled_mib']:.0f} MiB, fwd {r['forward_s']:.1f}s)"
                )

    summary = summarize(raw, names)
    meta = {
        **provenance(),
        "cpu": cpu_name(),
        "threads": args.threads,
        "reps": reps,
        "mem_reps": mem_reps,
        "wall_s": time.perf_counter() - t_start,
        "loadavg": loads,
        **({"decode_compiled": compiled} if compiled else {}),
    }
    text, checks = report(args, size, names, params, descr, summary, meta)
    print(text)
    if args.md:
        Path(args.md).write_text(text)
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "meta": meta,
                    "size": size,
                    "models": names,
                    "layout": descr,
                    "params": params,
                    "summary": summary,
                    "floor": floor_ratios(args, size, names),
                    "raw": raw,
                    "detail": extra,
                    "targets": [{"target": t, "pass": ok} for t, ok in checks],
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
