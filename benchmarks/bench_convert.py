"""Benchmark `convert_llama_to_diff` against a plain safetensors load-and-save of the same checkpoint.

Generates a ~1.1B-parameter bf16 Llama checkpoint (TinyLlama-like geometry) shard by shard with random
tensors (no model is materialised), then measures in separate fresh subprocesses (so peak RSS is per task):

* baseline: for each shard, `safetensors.torch.load_file` then `save_file` (the cheapest honest copy);
* convert:  `convert_llama_to_diff(src, out, diff_version=2, progress=False)`.

Each child reports wall time, ru_maxrss after imports (the interpreter + torch baseline) and at the end.
Runs are interleaved and repeated; medians are reported. Targets: wall(convert)/wall(baseline) <= 1.5 and
converter peak-RSS increase <= 1.3 x largest source shard.

    python benchmarks/bench_convert.py            # full (~1.1B params, ~2.2 GB, 3 shards)
    python benchmarks/bench_convert.py --quick    # tiny smoke test

A full run writes its report to benchmarks/results/results_convert.md and every run's figures, with the machine, its
load average and the date, to results_convert.json next to it (a --quick one only prints the report; `--json PATH`
writes the JSON of any run there). `benchmarks/results_page.py` renders docs/performance.md's table from the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_common import cpu_name, median, proc_status_kb, provenance  # it also puts the checkout's src/ first


RESULTS = Path(__file__).resolve().parent / "results" / "results_convert.md"
RESULTS_JSON = RESULTS.with_suffix(".json")
WALL_TARGET = 1.5
RSS_TARGET = 1.3

FULL = dict(
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=22,
    num_attention_heads=32,
    num_key_value_heads=4,
    vocab_size=32000,
)
SMALL = dict(
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=16,
    num_attention_heads=16,
    num_key_value_heads=4,
    vocab_size=32000,
)  # ~0.3B, when disk is short
QUICK = dict(
    hidden_size=128,
    intermediate_size=352,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=1000,
)


def maxrss_bytes() -> int:
    """ru_maxrss. Caveat: on Linux it survives fork+exec (it starts at the parent's RSS), hence `hwm_bytes`."""
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r if sys.platform == "darwin" else r * 1024


def hwm_bytes() -> int:
    """Peak RSS of this process image (VmHWM, reset by exec); falls back to ru_maxrss off Linux."""
    return proc_status_kb("VmHWM") * 1024 or maxrss_bytes()


# ----------------------------------------------------------------------------------------------- generation


def llama_tensors(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * d
    out = [("model.embed_tokens.weight", (v, h))]
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        out += [
            (p + "input_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (h, h)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.weight", (kv, h)),
            (p + "self_attn.o_proj.weight", (h, h)),
            (p + "post_attention_layernorm.weight", (h,)),
            (p + "mlp.gate_proj.weight", (i, h)),
            (p + "mlp.up_proj.weight", (i, h)),
            (p + "mlp.down_proj.weight", (h, i)),
        ]
    out += [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]
    return out


def generate(directory: Path, cfg: dict, shard_bytes: int) -> dict:
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    directory.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(**cfg, max_position_embeddings=2048, tie_word_embeddings=False, dtype="bfloat16")
    config.architectures = ["LlamaForCausalLM"]
    config.to_json_file(str(directory / "config.json"))

    # group tensors into shards of <= shard_bytes
    groups, cur, cur_bytes = [], [], 0
    for name, shape in llama_tensors(cfg):
        n = 2 * int(torch.Size(shape).numel())
        if cur and cur_bytes + n > shard_bytes:
            groups.append(cur)
            cur, cur_bytes = [], 0
        cur.append((name, shape))
        cur_bytes += n
    groups.append(cur)

    gen = torch.Generator().manual_seed(0)
    weight_map, total, params, shard_sizes = {}, 0, 0, []
    for k, group in enumerate(groups):
        fname = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        for name, shape in group:
            if len(shape) == 1:
                t = torch.ones(shape, dtype=torch.bfloat16)
            else:
                t = (torch.randn(shape, generator=gen, dtype=torch.float32) * 0.02).to(torch.bfloat16)
            tensors[name] = t
            weight_map[name] = fname
            total += t.numel() * 2
            params += t.numel()
        save_file(tensors, str(directory / fname), metadata={"format": "pt"})
        shard_sizes.append((directory / fname).stat().st_size)
        del tensors
    index = {"metadata": {"total_size": total, "total_parameters": params}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return {"params": params, "bytes": total, "shards": len(groups), "shard_sizes": shard_sizes}


# ----------------------------------------------------------------------------------------------- children


def child(task: str, src: str, out: str) -> None:
    import safetensors.torch as st
    import torch  # noqa: F401  (same import baseline for both tasks)

    from diff_transformer.conversion import convert_llama_to_diff

    start_rss, start_maxrss = hwm_bytes(), maxrss_bytes()
    t0 = time.perf_counter()
    if task == "baseline":
        os.makedirs(out, exist_ok=True)
        for f in sorted(Path(src).iterdir()):
            if f.suffix == ".safetensors":
                tensors = st.load_file(str(f))
                st.save_file(tensors, str(Path(out) / f.name), metadata={"format": "pt"})
                del tensors
            elif f.is_file():
                shutil.copy(f, Path(out) / f.name)
    elif task == "convert":
        convert_llama_to_diff(src, out, diff_version=2, progress=False)
    else:
        raise SystemExit(f"unknown task {task}")
    wall = time.perf_counter() - t0
    print(
        json.dumps(
            {
                "task": task,
                "wall_s": wall,
                "start_rss": start_rss,
                "peak_rss": hwm_bytes(),
                "start_ru_maxrss": start_maxrss,
                "peak_ru_maxrss": maxrss_bytes(),
            }
        )
    )


def run_child(task: str, src: Path, out: Path) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    # flush the previous run's dirty pages, so that its writeback does not throttle this run's writes
    os.sync()
    proc = subprocess.run(
        [sys.executable, __file__, "--child", task, str(src), str(out)], capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{task} child failed:\n{proc.stderr}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["out_bytes"] = sum(f.stat().st_size for f in out.iterdir() if f.suffix == ".safetensors")
    shutil.rmtree(out, ignore_errors=True)
    return result


def warm_cache(src: Path) -> None:
    for f in src.iterdir():
        with open(f, "rb") as fh:
            while fh.read(1 << 24):
                pass


# ----------------------------------------------------------------------------------------------- main


def gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny model, smoke test")
    ap.add_argument("--keep", action="store_true", help="keep the generated checkpoint")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--shard-mb", type=int, default=None, help="source shard size (default 1000, quick: 1)")
    ap.add_argument("--json", type=Path, help=f"write the figures as JSON here (a full run: {RESULTS_JSON.name})")
    ap.add_argument("--child", nargs=3, metavar=("TASK", "SRC", "OUT"), help=argparse.SUPPRESS)
    ap.add_argument("--generate", nargs=3, metavar=("CFG", "DIR", "SHARD_BYTES"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.generate:
        print(json.dumps(generate(Path(args.generate[1]), json.loads(args.generate[0]), int(args.generate[2]))))
        return
    if args.child:
        child(*args.child)
        return

    t_start = time.perf_counter()
    loads = [os.getloadavg()[0]]
    tmp = Path(tempfile.mkdtemp(prefix="bench_convert_", dir="/tmp"))
    free = shutil.disk_usage(tmp).free
    if args.quick:
        cfg, label = QUICK, "quick"
    elif free < 12e9:
        cfg, label = SMALL, f"small (only {gb(free)} free on /tmp)"
    else:
        cfg, label = FULL, "full"
    shard_bytes = (args.shard_mb or (1 if args.quick else 1000)) * 10**6
    src, out = tmp / "llama", tmp / "out"
    try:
        t0 = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, __file__, "--generate", json.dumps(cfg), str(src), str(shard_bytes)],
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"generation failed:\n{proc.stderr}")
        info = json.loads(proc.stdout.strip().splitlines()[-1])
        gen_s = time.perf_counter() - t0
        largest = max(info["shard_sizes"])
        print(
            f"generated {label}: {info['params'] / 1e9:.3f}B params, {gb(info['bytes'])}, {info['shards']} shards "
            f"(largest {gb(largest)}) in {gen_s:.1f}s at {src}",
            flush=True,
        )
        warm_cache(src)

        runs = {"baseline": [], "convert": []}
        for r in range(args.repeats):
            for task in ("baseline", "convert") if r % 2 == 0 else ("convert", "baseline"):
                res = run_child(task, src, out)
                runs[task].append(res)
                print(
                    f"  run {r + 1} {task:8s}: {res['wall_s']:.2f}s, peak RSS {gb(res['peak_rss'])} "
                    f"(+{gb(res['peak_rss'] - res['start_rss'])} over {gb(res['start_rss'])} after imports; "
                    f"ru_maxrss {gb(res['start_ru_maxrss'])} -> {gb(res['peak_ru_maxrss'])})",
                    flush=True,
                )

        def med(task, key):
            if key == "inc":
                return median(r["peak_rss"] - r["start_rss"] for r in runs[task])
            return median(r[key] for r in runs[task])

        wall_ratio = med("convert", "wall_s") / med("baseline", "wall_s")
        rss_ratio = med("convert", "inc") / largest
        base_rss_ratio = med("baseline", "inc") / largest
        lines = [
            f"# convert_llama_to_diff benchmark ({label})",
            "",
            f"Source: random bf16 LlamaForCausalLM, {info['params'] / 1e9:.3f}B params, {gb(info['bytes'])}, "
            f"{info['shards']} shards, largest {gb(largest)}; geometry {json.dumps(cfg)}.",
            f"Machine: {os.cpu_count()} CPUs; medians of {args.repeats} interleaved runs, each in a fresh "
            f"subprocess after os.sync(); source shards in page cache.",
            "Peak RSS = VmHWM of the child (reset at exec); ru_maxrss agrees once the parent stays small (it is "
            "inherited across fork+exec on Linux, so the checkpoint is generated in its own subprocess).",
            "",
            "| task | wall (s) | peak RSS | RSS after imports | RSS increase | increase / largest shard | output |",
            "|---|---|---|---|---|---|---|",
        ]
        for task, title in (
            ("baseline", "safetensors load_file+save_file per shard"),
            ("convert", "convert_llama_to_diff(diff_version=2)"),
        ):
            lines.append(
                f"| {title} | {med(task, 'wall_s'):.2f} | {gb(med(task, 'peak_rss'))} | "
                f"{gb(med(task, 'start_rss'))} | {gb(med(task, 'inc'))} | {med(task, 'inc') / largest:.2f}x | "
                f"{gb(med(task, 'out_bytes'))} |"
            )
        lines += [
            "",
            f"- {'PASS' if wall_ratio <= WALL_TARGET else 'MISS'}: wall time convert/baseline = {wall_ratio:.2f} "
            f"(target <= {WALL_TARGET})",
            f"- {'PASS' if rss_ratio <= RSS_TARGET else 'MISS'}: converter peak RSS increase / largest shard = "
            f"{rss_ratio:.2f}x (target <= {RSS_TARGET}x; baseline: {base_rss_ratio:.2f}x)",
            "",
            f"Total benchmark runtime {time.perf_counter() - t_start:.0f}s (generation {gen_s:.0f}s).",
        ]
        text = "\n".join(lines) + "\n"
        print()
        print(text)
        loads.append(os.getloadavg()[0])
        data = {
            "meta": {
                **provenance(),
                "machine": f"{cpu_name()}, {os.cpu_count()} CPUs",
                "loadavg": [round(x, 2) for x in loads],  # 1 minute, at the start and at the end
                "wall_s": time.perf_counter() - t_start,
                "generation_s": gen_s,
            },
            "label": label,
            "geometry": cfg,
            "source": {**info, "largest_shard_bytes": largest},
            "repeats": args.repeats,
            "median": {
                task: {key: med(task, key) for key in ("wall_s", "peak_rss", "start_rss", "inc", "out_bytes")}
                for task in runs
            },
            "wall_ratio": wall_ratio,
            "rss_increase_per_largest_shard": {"convert": rss_ratio, "baseline": base_rss_ratio},
            "targets": {"wall_ratio": WALL_TARGET, "rss_increase_per_largest_shard": RSS_TARGET},
            "runs": runs,
        }
        json_path = args.json or (None if args.quick else RESULTS_JSON)
        if not args.quick:
            RESULTS.parent.mkdir(exist_ok=True)
            RESULTS.write_text(text)
            print(f"wrote {RESULTS}")
        if json_path:
            json_path.write_text(json.dumps(data, indent=2) + "\n")
            print(f"wrote {json_path}")
    finally:
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
