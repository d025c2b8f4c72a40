#!/usr/bin/env python
"""Fused Diff Transformer V1 attention (diff_transformer.kernels) against PyTorch SDPA on a GPU, bf16.

Same attention width on both sides: Llama with 32 query heads x d over 8 KV heads (d = 64, --head-dim), V1 with H=16
differential heads (32 query maps) over H_kv=4 groups whose 2d-wide V is 8 heads x d, i.e. identical q, k, v tensors
(B, 32, N, d), (B, 8, L, d), (B, 8, L, d). V1's forward does 1.5x Llama's attention FLOPs (its PV products are 2d
wide); its backward the same as Llama's (dO Vᵀ is shared by the two maps).

* prefill, causal, N = L: forward and forward+backward
    llama_sdpa      F.scaled_dot_product_attention(enable_gqa=True), flash backend
    v1_sdpa_model   what modeling_diff.py runs today on sdpa: one call per map with V 2d wide (transformers' sdpa path)
    v1_fused        triton_v1_attention (this package's kernels), dQ by a separate kernel / by atomics
* decode, N = 1 against L cached positions: forward
    llama_sdpa, v1_sdpa_model (four calls on V halves, as the model decodes today), v1_fused (split-K kernel)
Times are medians of triton.testing.do_bench (L2 flushed between runs); ratios are against llama_sdpa of the same
shape in the same run.

    python benchmarks/bench_kernel.py [--batch 1,2] [--length 4096] [--decode-batch 1,32] [--head-dim 64] [--sweep]
                                      [--out FILE]
    python benchmarks/bench_kernel.py --registers [--head-dim 64]     # no GPU needed

--sweep first times a few launch configurations per kernel on the prefill/decode shapes and keeps the fastest
(printed, to copy into CUDA_CONFIGS of src/diff_transformer/kernels/diff_attention_v1.py). --registers compiles the
same candidates for sm_90 on any machine and prints registers and spills per thread.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import bench_common  # first: it puts the checkout's src/ first on sys.path


# isort: split
import torch
import torch.nn.functional as F


HEADS, KV_HEADS = 32, 8  # Llama; V1: H = 16, H_kv = 4 on the same tensors
D = 64  # head dim, --head-dim
SWEEP = {  # candidates per head dim: (BLOCK_M, BLOCK_N, num_warps, num_stages); decode ignores BLOCK_M
    64: {
        "fwd": [(128, 64, 8, 3), (128, 32, 8, 3), (64, 32, 4, 3), (128, 64, 8, 2), (64, 128, 8, 3)],
        "bwd_dkdv": [(32, 64, 8, 2), (64, 32, 8, 2), (32, 32, 8, 2), (64, 64, 8, 3), (16, 32, 4, 2)],
        "bwd_dq": [(128, 64, 8, 2), (128, 32, 8, 3), (64, 32, 4, 3), (64, 64, 4, 2)],
        "decode": [(16, 64, 4, 3), (16, 128, 4, 3), (16, 64, 8, 4), (16, 32, 4, 4)],
    },
    128: {
        "fwd": [(64, 32, 8, 2), (64, 64, 8, 2), (32, 32, 4, 2), (128, 32, 8, 2)],
        "bwd_dkdv": [(32, 32, 8, 2), (64, 32, 8, 2), (16, 32, 4, 2), (32, 64, 8, 2)],
        "bwd_dq": [(32, 32, 4, 2), (64, 32, 8, 2), (128, 32, 8, 2)],
        "decode": [(16, 64, 8, 2), (16, 32, 4, 2), (16, 32, 8, 3)],
    },
}


def bench(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


class _Module:  # what transformers' sdpa_attention_forward reads from the attention module
    def __init__(self, groups):
        self.num_key_value_groups, self.is_causal, self.training = groups, True, False


def inputs(B, N, L, grad, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g, device="cuda", dtype=torch.bfloat16).requires_grad_(grad)

    return r(B, HEADS, N, D), r(B, KV_HEADS, L, D), r(B, KV_HEADS, L, D)


def llama_sdpa(q, k, v, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=D**-0.5, enable_gqa=True)


def v1_sdpa_model(q, k, v, lam, causal):
    """DiffAttentionV1's attention on sdpa (modeling_diff.py; prefill: V 2d wide per map; decode: four calls)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    B, _, N, _ = q.shape
    H, H_kv = HEADS // 2, KV_HEADS // 2
    module = _Module(H // H_kv)
    queries, keys, halves = q.view(B, 2, H, N, D), k.unflatten(1, (2, H_kv)), v.unflatten(1, (2, H_kv))
    outputs = []
    for c in (0, 1):
        if N == 1:
            outputs.append(
                torch.cat(
                    [
                        sdpa_attention_forward(
                            module, queries[:, c], keys[:, c], halves[:, c_v], None, scaling=D**-0.5
                        )[0]
                        for c_v in (0, 1)
                    ],
                    dim=-1,
                )
            )
        else:
            wide = torch.cat((halves[:, 0], halves[:, 1]), dim=-1)  # (B, H_kv, L, 2d)
            outputs.append(sdpa_attention_forward(module, queries[:, c], keys[:, c], wide, None, scaling=D**-0.5)[0])
    return outputs[0] - lam.to(outputs[0].dtype) * outputs[1]  # (B, N, H, 2d)


def v1_fused(q, k, v, lam, causal, **options):
    from diff_transformer.kernels import triton_v1_attention

    return triton_v1_attention(q, k, v, lam, scaling=D**-0.5, causal=causal, **options)


def timed(fn, backward):
    if not backward:

        def run():
            with torch.no_grad():
                fn()

        return bench(run)
    out = fn()
    grad = torch.randn_like(out)

    def run():
        fn().backward(grad)

    return bench(run)


def sweep(batch, length):
    from diff_transformer.kernels import diff_attention_v1 as op

    best = {}
    q, k, v = inputs(batch, length, length, grad=True)
    lam = torch.tensor(0.8, device="cuda", requires_grad=True)
    out = v1_fused(q, k, v, lam, True)
    grad = torch.randn_like(out)
    for kind, candidates in SWEEP[D].items():
        times = {}
        for config in candidates:
            op.CUDA_CONFIGS[kind][D] = config
            try:
                if kind == "fwd":
                    times[config] = timed(lambda: v1_fused(q, k, v, lam, True), backward=False)
                elif kind == "decode":
                    qd, kd, vd = inputs(32, 1, length, grad=False)
                    times[config] = timed(lambda: v1_fused(qd, kd, vd, lam, True), backward=False)
                else:
                    out = v1_fused(q, k, v, lam, True)
                    times[config] = bench(lambda: torch.autograd.grad(out, (q, k, v, lam), grad, retain_graph=True))
            except Exception as error:  # a config the compiler rejects (shared memory, registers)
                print(f"  {kind} {config}: {type(error).__name__}: {str(error)[:120]}", flush=True)
        for config, ms in sorted(times.items(), key=lambda item: item[1]):
            print(f"  {kind} {config}: {ms:.3f} ms", flush=True)
        best[kind] = min(times, key=times.get)
        op.CUDA_CONFIGS[kind][D] = best[kind]
        print(f"{kind}: best {best[kind]}", flush=True)
    return best


def register_report():
    """Registers, spill stack and shared memory per thread of every sweep candidate, compiled for sm_90 (H100)."""
    import kernel_registers  # benchmarks/, next to this script

    base = dict(CAUSAL=True, MASK_KIND=0, VARLEN=False, HEAD_DIM=D, BLOCK_D=D, DOT_PREC="tf32")
    kernels = {
        "fwd": ("_fwd_kernel", dict(SAVE_O2=True)),
        "bwd_dkdv": ("_bwd_dkdv_kernel", dict(ATOMIC_DQ=False)),
        "bwd_dq": ("_bwd_dq_kernel", {}),
        "decode": ("_decode_split_kernel", dict(BLOCK_R=16)),
    }
    print(f"| kernel (d={D}) | BLOCK_M, BLOCK_N, warps, stages | registers | spill stack bytes | shared bytes |")
    print("|---|---|---|---|---|")
    for kind, candidates in SWEEP[D].items():
        name, extra = kernels[kind]
        for block_m, block_n, warps, stages in candidates:
            constexprs = dict(base, BLOCK_N=block_n, **extra)
            if kind == "decode":
                constexprs.pop("VARLEN")
            else:
                constexprs["BLOCK_M"] = block_m
            usage = kernel_registers.resource_usage(kernel_registers.compile_kernel(name, constexprs, warps, stages))
            print(
                f"| {kind} | {block_m}, {block_n}, {warps}, {stages} | {usage['registers']} | "
                f"{usage['stack_bytes']} | {usage['shared_bytes']} |",
                flush=True,
            )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", default="1,2", help="prefill batch sizes")
    parser.add_argument("--length", type=int, default=4096, help="prefill length N = L and decode cache length L")
    parser.add_argument("--decode-batch", default="1,32")
    parser.add_argument("--head-dim", type=int, choices=sorted(SWEEP), default=64)
    parser.add_argument("--sweep", action="store_true", help="tune the launch configurations first")
    parser.add_argument(
        "--registers",
        action="store_true",
        help="no GPU needed: compile the --sweep candidates for sm_90 and report registers/spills",
    )
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)
    global D
    D = args.head_dim
    if args.registers:
        return register_report()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    from diff_transformer import kernels

    if not kernels.is_available():
        parser.error("needs triton (pip install triton)")
    from diff_transformer.kernels import diff_attention_v1 as op

    device = torch.cuda.get_device_name()
    results = {**bench_common.provenance(), "device": device, "prefill": [], "decode": []}
    print(f"# {device}, torch {torch.__version__}", flush=True)
    if args.sweep:
        results["sweep"] = {k: list(v) for k, v in sweep(1, args.length).items()}
    results["configs"] = {k: list(v[D]) for k, v in op.CUDA_CONFIGS.items()}
    lam = torch.tensor(0.8, device="cuda", requires_grad=True)

    print(
        "\n| prefill B x N | pass | llama_sdpa ms | v1_sdpa_model ms (x) | v1_fused ms (x) "
        "| v1_fused atomic dQ ms (x) |"
    )
    print("|---|---|---|---|---|---|")
    for B in map(int, args.batch.split(",")):
        q, k, v = inputs(B, args.length, args.length, grad=True)
        with torch.no_grad():  # the fused op agrees with the model's SDPA path
            diff = (v1_fused(q, k, v, lam, True).float() - v1_sdpa_model(q, k, v, lam, True).float()).abs().max()
        for backward in (False, True):
            row = {
                "B": B,
                "N": args.length,
                "pass": "fwd+bwd" if backward else "fwd",
                "llama_sdpa": timed(lambda: llama_sdpa(q, k, v, True), backward),
                "v1_sdpa_model": timed(lambda: v1_sdpa_model(q, k, v, lam, True), backward),
                "v1_fused": timed(lambda: v1_fused(q, k, v, lam, True, atomic_dq=False), backward),
                "max_abs_diff_vs_sdpa_model": diff.item(),
            }
            if backward:
                row["v1_fused_atomic_dq"] = timed(lambda: v1_fused(q, k, v, lam, True, atomic_dq=True), backward)
            results["prefill"].append(row)
            base = row["llama_sdpa"]
            cells = [
                f"{row[name]:.3f} ({row[name] / base:.2f}x)" if name in row else "-"
                for name in ("v1_sdpa_model", "v1_fused", "v1_fused_atomic_dq")
            ]
            print(f"| {B} x {args.length} | {row['pass']} | {base:.3f} | " + " | ".join(cells) + " |", flush=True)

    print(f"\n| decode B, L={args.length} | llama_sdpa ms | v1_sdpa_model ms (x) | v1_fused ms (x) |")
    print("|---|---|---|---|")
    for B in map(int, args.decode_batch.split(",")):
        q, k, v = inputs(B, 1, args.length, grad=False)
        row = {
            "B": B,
            "L": args.length,
            "llama_sdpa": timed(lambda: llama_sdpa(q, k, v, False), False),
            "v1_sdpa_model": timed(lambda: v1_sdpa_model(q, k, v, lam, False), False),
            "v1_fused": timed(lambda: v1_fused(q, k, v, lam, False), False),
        }
        results["decode"].append(row)
        base = row["llama_sdpa"]
        print(
            f"| {B} | {base:.4f} | {row['v1_sdpa_model']:.4f} ({row['v1_sdpa_model'] / base:.2f}x) | "
            f"{row['v1_fused']:.4f} ({row['v1_fused'] / base:.2f}x) |",
            flush=True,
        )
    results["kernels_ms"] = kernel_breakdown(int(args.batch.split(",")[0]), args.length)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")


def kernel_breakdown(B, N):
    """GPU time per kernel of one fused forward+backward (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    q, k, v = inputs(B, N, N, grad=True)
    lam = torch.tensor(0.8, device="cuda", requires_grad=True)
    out = v1_fused(q, k, v, lam, True)
    grad = torch.randn_like(out)
    out.backward(grad)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        v1_fused(q, k, v, lam, True).backward(grad)
        torch.cuda.synchronize()
    times = {}
    for event in prof.key_averages():
        if event.device_type.name == "CUDA" or getattr(event, "self_device_time_total", 0):
            times[event.key] = round(getattr(event, "self_device_time_total", 0) / 1000, 4)
    print(f"\nkernels of one fused fwd+bwd, B={B}, N={N} (ms):", flush=True)
    for name, ms in sorted(times.items(), key=lambda item: -item[1])[:12]:
        print(f"  {ms:8.3f}  {name[:90]}", flush=True)
    return times


if __name__ == "__main__":
    main()
