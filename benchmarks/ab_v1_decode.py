#!/usr/bin/env python
"""V1 decoding on CPU: `DECODE_DIFF_MAP` (two products over the cache) against `SPLIT_VALUE` (four sdpa calls, one
per map and V half, what V1 decoded with before), the same model in one process, bench_model.py's V1 and decode
measurement (greedy, tokens/s = 1 / median step interval), interleaved pairs in alternating order.

    python benchmarks/ab_v1_decode.py [--pairs 8] [--prompt 512] [--new-tokens 64] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import types

import bench_model  # first: through bench_common it puts the checkout's src/ first on sys.path


# isort: split
import torch

import diff_transformer.integrations.cpu_attention as cpu

from bench_common import median, random_ids


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=8)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    lm = bench_model.build("v1", dict(bench_model.FULL), types.SimpleNamespace(v2_heads=None, v2_kv_heads=None))
    ids = random_ids(args.prompt, bench_model.FULL["vocab"], 3)
    select = cpu.select_cpu_strategy

    def without_decode_map(*args, **kwargs):  # the plain calls instead: four sdpa calls on the cache's V halves
        strategy = select(*args, **kwargs)
        return None if strategy is cpu.CpuStrategy.DECODE_DIFF_MAP else strategy

    def tokens_per_s(decode_map: bool) -> float:
        cpu.select_cpu_strategy = select if decode_map else without_decode_map
        return bench_model.time_decode(lm, ids, args.new_tokens)["tok_s"]

    tokens_per_s(True), tokens_per_s(False)  # warm-up
    ratios = []
    for pair in range(args.pairs):
        order = (True, False) if pair % 2 == 0 else (False, True)
        rate = {mode: tokens_per_s(mode) for mode in order}
        ratios.append(rate[True] / rate[False])
        print(f"pair {pair + 1}: DECODE_DIFF_MAP {rate[True]:.1f} tok/s, SPLIT_VALUE {rate[False]:.1f} tok/s, "
              f"ratio {ratios[-1]:.3f} (load {os.getloadavg()[0]:.1f})", flush=True)  # fmt: skip
    cpu.select_cpu_strategy = select
    print(f"DECODE_DIFF_MAP / SPLIT_VALUE tokens/s: median {median(ratios):.3f}, {min(ratios):.3f}-{max(ratios):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
