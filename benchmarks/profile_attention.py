#!/usr/bin/env python
"""Where does the time of differential attention go on CPU? Companion of bench_model.py.

1. Attention *kernel* alone (after projections/RoPE), batch 1, the bench_model.py default shapes
   (d=64; Llama 8 heads/8 KV; V1 H=4/H_kv=4, V 2d wide; V2 16 query heads/4 KV heads), for N in --lengths:
   * ``llama``             one SDPA call, 8 heads x 64 (reference)
   * ``v1_math``           one SDPA call, 8 query heads x 64, V 8 x 128 -> PyTorch falls back to the math kernel
   * ``v1_pad``            q/k zero-padded to 128 -> one flash call with head dim 128
   * ``v1_two_calls``      DiffLlama-style: two calls (one per V half), V repeated to 8 heads (copies)
   * ``v1_four_calls``     four GQA calls on views (q_c, k_c, v_half), no copies
   * ``v2``                one SDPA call, 16 query heads over 4 KV heads (enable_gqa)
   Forward and forward+backward, timed interleaved, min and median of --reps.
2. ``torch.profiler`` op breakdown of one decoder layer forward (Llama vs our V1/V2) at --profile-len tokens.

    python benchmarks/profile_attention.py [--reps 7] [--lengths 512,2048] [--threads 2]
"""

from __future__ import annotations

import argparse

from bench_common import median, timed  # first: it puts the checkout's src/ first on sys.path


# isort: split
import torch
import torch.nn.functional as F


def kernels(N: int, d: int = 64, grad: bool = False):
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g).requires_grad_(grad)

    q8, k8, v8 = r(1, 8, N, d), r(1, 8, N, d), r(1, 8, N, d)  # Llama; V1 q=[q1|q2], k=[k1|k2], v=[va|vb]
    q16, k4, v4 = r(1, 16, N, d), r(1, 4, N, d), r(1, 4, N, d)  # V2
    s = d**-0.5

    def llama():
        return F.scaled_dot_product_attention(q8, k8, v8, is_causal=True, scale=s)

    def v1_wide_value():
        halves = v8.view(1, 2, 4, N, d)
        v = halves.permute(0, 2, 3, 1, 4).unsqueeze(1).expand(1, 2, 4, N, 2, d).reshape(1, 8, N, 2 * d)
        return v

    def v1_math():
        return F.scaled_dot_product_attention(q8, k8, v1_wide_value(), is_causal=True, scale=s)

    def v1_pad():
        return F.scaled_dot_product_attention(
            F.pad(q8, (0, d)), F.pad(k8, (0, d)), v1_wide_value(), is_causal=True, scale=s
        )

    def v1_two_calls():
        halves = v8.view(1, 2, 4, N, d)
        return torch.cat(
            [
                F.scaled_dot_product_attention(q8, k8, halves[:, c].repeat(1, 2, 1, 1), is_causal=True, scale=s)
                for c in (0, 1)
            ],
            dim=-1,
        )

    def v1_four_calls():
        q1, q2, k1, k2, va, vb = q8[:, :4], q8[:, 4:], k8[:, :4], k8[:, 4:], v8[:, :4], v8[:, 4:]
        o = [
            F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=s)
            for q, k in ((q1, k1), (q2, k2))
            for v in (va, vb)
        ]
        return torch.cat([torch.cat(o[0:2], -1), torch.cat(o[2:4], -1)], 1)

    def v2():
        return F.scaled_dot_product_attention(q16, k4, v4, is_causal=True, scale=s, enable_gqa=True)

    return {f.__name__: f for f in (llama, v1_math, v1_pad, v1_two_calls, v1_four_calls, v2)}


def bench_kernels(lengths, reps):
    print("\n## SDPA kernel time, batch 1 (ms; min / median; ratio of min to llama)\n")
    print("| N | pass | " + " | ".join(kernels(8).keys()) + " |")
    print("|---|---|" + "---|" * len(kernels(8)))
    for N in lengths:
        for grad in (False, True):
            ks = kernels(N, grad=grad)
            # sanity: every V1 variant computes the same thing
            with torch.no_grad():
                ref = ks["v1_math"]()
                for name in ("v1_pad", "v1_two_calls", "v1_four_calls"):
                    torch.testing.assert_close(ks[name](), ref, rtol=1e-4, atol=1e-5)
            times = {n: [] for n in ks}

            def run(f):
                if grad:
                    return timed(lambda: f().sum().backward())
                with torch.inference_mode():
                    return timed(f)

            for f in ks.values():
                run(f)
            for _ in range(reps):
                for n, f in ks.items():
                    times[n].append(run(f))
            base = min(times["llama"])
            cells = [f"{min(t) * 1e3:.0f} / {median(t) * 1e3:.0f} ({min(t) / base:.2f}x)" for t in times.values()]
            print(f"| {N} | {'fwd+bwd' if grad else 'fwd'} | " + " | ".join(cells) + " |", flush=True)


def profile_layers(N: int):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    from diff_transformer import DiffConfig
    from diff_transformer.modeling_diff import DiffDecoderLayer

    common = dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=1, head_dim=64, vocab_size=32000)
    cfgs = {
        "llama": (LlamaDecoderLayer, LlamaConfig(num_attention_heads=8, num_key_value_heads=8, **common)),
        "diff_v1": (
            DiffDecoderLayer,
            DiffConfig(diff_version=1, num_attention_heads=4, num_key_value_heads=4, **common),
        ),
        "diff_v2": (
            DiffDecoderLayer,
            DiffConfig(diff_version=2, num_attention_heads=8, num_key_value_heads=4, **common),
        ),
    }
    x = torch.randn(1, N, 512)
    for name, (cls, cfg) in cfgs.items():
        cfg._attn_implementation = "sdpa"
        layer = cls(cfg, 0).eval()
        rope = LlamaRotaryEmbedding(cfg)
        pos = rope(x, torch.arange(N)[None])
        with torch.inference_mode():
            layer(x, position_embeddings=pos)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                for _ in range(3):
                    layer(x, position_embeddings=pos)
        print(f"\n## {name}: one decoder layer forward, N={N} (3 calls)\n")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--lengths", default="512,2048")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--profile-len", type=int, default=2048)
    p.add_argument("--no-profile", action="store_true")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    bench_kernels([int(n) for n in args.lengths.split(",")], args.reps)
    if not args.no_profile:
        profile_layers(args.profile_len)


if __name__ == "__main__":
    main()
