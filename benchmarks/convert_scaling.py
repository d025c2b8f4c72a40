"""How `convert` scales with the source's size: time and peak RSS of a V2 and a calibrated V1 conversion of synthetic
Llama-shaped bf16 checkpoints of three sizes (random weights made on the fly by bench_convert.generate, the shipped
tiny-llama's tokenizer files copied next to them; nothing is downloaded), a power law t = a·N^b fitted per task over
the sizes, and its extrapolation to 8B parameters (Llama-3-8B: 8.03e9).

Each conversion runs in a fresh subprocess (peak RSS = its VmHWM), one at a time. V1's calibration samples its text
from the source and fits every layer (conversion/calibrate.py): on a CPU that dominates, so the sizes run it on a
reduced sample (`--blocks` x `--block-size` tokens fitted, plus the 4 held-out blocks the converter always scores);
the smallest size is also converted with the converter's defaults (16 x 256), and the ratio of the two scales the
8B extrapolation to the defaults (the sampling and the fits are linear in the tokens).

    nohup nice python benchmarks/convert_scaling.py > /tmp/convert_scaling.log 2>&1 &
    python benchmarks/convert_scaling.py --quick      # two tiny sizes, a smoke test (prints, writes nothing)

Writes benchmarks/results/convert_scaling.{json,md}; docs/performance.md quotes the table with the machine and load.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_convert import generate, hwm_bytes

from bench_common import cpu_name, provenance  # it also puts the checkout's src/ first


HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "convert_scaling.md"
TOKENIZER = HERE.parent / "src" / "diff_transformer" / "assets" / "tiny-llama"
TARGET_PARAMS = 8.03e9  # Llama-3-8B
SIZES = {  # Llama-shaped: head_dim 64 (0.03B: 48, 0.5B: 128), 4 KV heads, untied head, a 32k vocabulary
    "0.03B": dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=8),
    "0.06B": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8),
    "0.1B": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12),
    "0.5B": dict(hidden_size=1536, intermediate_size=4096, num_hidden_layers=16, num_attention_heads=12),
    "0.3B": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=16, num_attention_heads=16),
    "1.2B": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32),
}
# What a shared 2-core machine finishes in reasonable time (V1 on 0.5B and 1.2B: hours at a fraction of a core).
DEFAULT_SIZES = "0.03B,0.06B,0.1B"
QUICK = {
    "tiny-a": dict(hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=4),
    "tiny-b": dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=4),
}


def child(task: str, src: str, out: str, blocks: int, block_size: int) -> None:
    """One conversion, timed, with the calibration's two phases timed as well."""
    import torch  # noqa: F401  (imports before the RSS/time baseline)

    from diff_transformer.conversion import calibrate, convert_llama_to_diff

    phases = {}

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                phases[name] = phases.get(name, 0.0) + time.perf_counter() - t0

        return wrapper

    calibrate.sample_calibration_blocks = timed("sampling_s", calibrate.sample_calibration_blocks)
    calibrate.calibrate_v1_start = timed("fitting_s", calibrate.calibrate_v1_start)
    start_rss, t0, cpu0 = hwm_bytes(), time.perf_counter(), _cpu_seconds()
    version = 2 if task == "v2" else 1
    options = {} if version == 2 else dict(calibration_blocks=blocks, calibration_block_size=block_size)
    convert_llama_to_diff(src, out, diff_version=version, progress=False, **options)
    wall, cpu = time.perf_counter() - t0, _cpu_seconds() - cpu0
    print(json.dumps({"wall_s": wall, "cpu_s": cpu, "start_rss": start_rss, "peak_rss": hwm_bytes(), **phases}))


def _cpu_seconds() -> float:
    """User + system CPU seconds of this process (and its threads): what the work cost, whatever else the machine
    ran meanwhile (the wall time of a shared machine depends on its load)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run_child(task: str, src: Path, out: Path, blocks: int, block_size: int) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    os.sync()
    command = [sys.executable, __file__, "--child", task, str(src), str(out), str(blocks), str(block_size)]
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{task} on {src.name} failed:\n{proc.stderr[-3000:]}")
    shutil.rmtree(out, ignore_errors=True)
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "blocks": blocks, "block_size": block_size}


def power_law(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(a, b) of y = a·x^b, least squares on log y against log x."""
    xs, ys = [math.log(x) for x, _ in points], [math.log(y) for _, y in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return math.exp(my - b * mx), b


def report(data: dict) -> str:
    gb = 1e9
    lines = [
        "# convert: time and peak RSS against the source's size",
        "",
        f"Machine: {data['meta']['machine']}; load average (1 min) {data['meta']['loadavg']} at start and end "
        "(shared with other work); each conversion in a fresh subprocess, one at a time, niced.",
        f"Sources: random bf16 Llama-shaped checkpoints (32k vocabulary, untied head, 4 KV heads). V1: calibrated "
        f"(the default), on {data['blocks']} x {data['block_size']} sampled tokens (+ 4 held-out blocks).",
        "",
        "| size | parameters | V2 wall (s) | V2 CPU (s) | V2 peak RSS (GB) | V1 wall (s) | V1 CPU (s) | "
        "V1 sampling (s) | V1 fitting (s) | V1 peak RSS (GB) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in data["sizes"].items():
        v1, v2 = row["v1"], row["v2"]
        lines.append(
            f"| {name} | {row['params'] / 1e9:.3f}B | {v2['wall_s']:.1f} | {v2['cpu_s']:.1f} | "
            f"{v2['peak_rss'] / gb:.2f} | {v1['wall_s']:.1f} | {v1['cpu_s']:.1f} | {v1.get('sampling_s', 0):.1f} | "
            f"{v1.get('fitting_s', 0):.1f} | "
            f"{v1['peak_rss'] / gb:.2f} |"
        )
    fit, default = data["fit"], data.get("default_sample")
    lines += ["", "Power law t = a·N^b over the sizes, extrapolated to 8.03B parameters (Llama-3-8B):", ""]
    for task, values in fit.items():
        lines.append(
            f"- {task}: exponent b = {values['exponent']:.2f}; at 8B ≈ {values['at_8b']:.0f} "
            f"{'GB' if 'RSS' in task else 's'} (linear from the largest size: "
            f"{values['linear_at_8b']:.0f} {'GB' if 'RSS' in task else 's'})"
        )
    if default and default.get("estimated"):
        lines += [
            "",
            f"Not measured: V1 with the converter's default sample ({default['blocks']} x {default['block_size']} + 4 "
            f"held-out blocks), {default['ratio']:.1f}x the tokens read here. Scaled by that ratio (sampling and fits "
            f"are linear in the tokens), an 8B source would cost ≈ {default['at_8b_s'] / 3600:.1f} CPU hours here by "
            f"the fitted exponent, {default['linear_at_8b_s'] / 3600:.0f} by the linear one.",
        ]
    elif default:
        lines += [
            "",
            f"The smallest size with the converter's default sample ({default['blocks']} x {default['block_size']}): "
            f"V1 {default['cpu_s']:.1f} CPU s, {default['ratio']:.2f}x the reduced sample's; scaled by it, a default "
            f"V1 conversion of an 8B source costs ≈ {default['at_8b_s'] / 3600:.1f} CPU hours here (divide by the "
            "cores torch can use for the wall time of an idle machine).",
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="two tiny sizes: a smoke test, nothing written")
    parser.add_argument(
        "--sizes", default=None, help=f"comma-separated, of {', '.join(SIZES)} (default: {DEFAULT_SIZES})"
    )
    parser.add_argument("--blocks", type=int, default=4, help="V1 calibration blocks at every size")
    parser.add_argument("--block-size", type=int, default=128, help="tokens per V1 calibration block")
    parser.add_argument("--no-default", action="store_true", help="skip the smallest size's default-sample V1 run")
    parser.add_argument("--report-only", action="store_true", help="refit and rewrite the report from the JSON")
    parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        task, src, out, blocks, block_size = args.child
        child(task, src, out, int(blocks), int(block_size))
        return
    if args.report_only:
        data = json.loads(RESULTS.with_suffix(".json").read_text())
        meta = data["meta"]
        finish(data, meta["loadavg"], time.perf_counter() - meta["wall_s"], write=True, meta=meta)
        return
    sizes = QUICK if args.quick else {name: SIZES[name] for name in (args.sizes or DEFAULT_SIZES).split(",")}
    loads, t_start = [os.getloadavg()[0]], time.perf_counter()
    data = {"blocks": args.blocks, "block_size": args.block_size, "sizes": {}}
    tmp = Path(tempfile.mkdtemp(prefix="convert_scaling_", dir="/tmp"))
    try:
        for name, shape in sizes.items():
            geometry = dict(shape, num_key_value_heads=4, vocab_size=1000 if args.quick else 32000)
            src = tmp / name
            info = generate(src, geometry, 2 * 10**9)
            for file in ("tokenizer.json", "tokenizer_config.json"):
                shutil.copyfile(TOKENIZER / file, src / file)
            row = {"params": info["params"], "geometry": geometry}
            for task in ("v2", "v1"):
                row[task] = run_child(task, src, tmp / "out", args.blocks, args.block_size)
                print(f"{name} {task}: {json.dumps(row[task])}", flush=True)
            if name == next(iter(sizes)) and not args.no_default:  # the defaults' cost, relative to the reduced sample
                row["v1_default"] = run_child("v1", src, tmp / "out", 16, 256)
                print(f"{name} v1 default sample: {json.dumps(row['v1_default'])}", flush=True)
            data["sizes"][name] = row
            shutil.rmtree(src)
            if len(data["sizes"]) >= 2:  # written after each size: a run stopped later keeps what it measured
                loads.append(os.getloadavg()[0])
                finish(data, loads, t_start, write=not args.quick)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def finish(data: dict, loads: list, t_start: float, write: bool, meta: dict | None = None) -> None:
    """Fit the power laws over the sizes measured so far, print the report and (WRITE) save it."""
    params = [row["params"] for row in data["sizes"].values()]
    data["fit"] = {}
    for task, key in (
        ("V2 wall", "wall_s"),
        ("V2 CPU", "cpu_s"),
        ("V1 wall", "wall_s"),
        ("V1 CPU", "cpu_s"),
        ("V1 peak RSS above the imports", "rss_increase"),
    ):
        column = "v2" if task.startswith("V2") else "v1"

        def value(run):  # seconds, or GB above the interpreter + torch's own RSS (what the conversion adds)
            return (run["peak_rss"] - run["start_rss"]) / 1e9 if key == "rss_increase" else run[key]

        a, b = power_law([(p, value(row[column])) for p, row in zip(params, data["sizes"].values())])
        data["fit"][task] = {"a": a, "exponent": b, "at_8b": a * TARGET_PARAMS**b}
        largest = max(zip(params, data["sizes"].values()), key=lambda pair: pair[0])
        # exponent 1 from the largest size: sampling and fits cost a fixed number of FLOPs per parameter and token,
        # which fixed costs (per generated token, per layer) hide at small sizes
        data["fit"][task]["linear_at_8b"] = value(largest[1][column]) * TARGET_PARAMS / largest[0]
    first = next(iter(data["sizes"].values()))
    if "v1_default" in first:
        ratio = first["v1_default"]["cpu_s"] / first["v1"]["cpu_s"]
        data["default_sample"] = {
            "blocks": 16,
            "block_size": 256,
            "cpu_s": first["v1_default"]["cpu_s"],
            "ratio": ratio,
            "at_8b_s": ratio * data["fit"]["V1 CPU"]["at_8b"],
        }
    else:  # not measured: scaled by the tokens the calibration reads (sampling and fits are linear in them)
        tokens = (data["blocks"] + 4) * data["block_size"]
        ratio = (16 + 4) * 256 / tokens
        data["default_sample"] = {"blocks": 16, "block_size": 256, "ratio": ratio, "estimated": True}
        data["default_sample"]["at_8b_s"] = ratio * data["fit"]["V1 CPU"]["at_8b"]
        data["default_sample"]["linear_at_8b_s"] = ratio * data["fit"]["V1 CPU"]["linear_at_8b"]
    data["meta"] = meta or {
        **provenance(),
        "machine": f"{cpu_name()}, {os.cpu_count()} CPUs",
        "loadavg": [round(x, 2) for x in (loads[0], loads[-1])],
        "wall_s": time.perf_counter() - t_start,
    }
    text = report(data)
    print(text, flush=True)
    if write:
        RESULTS.write_text(text)
        RESULTS.with_suffix(".json").write_text(json.dumps(data, indent=2) + "\n")
        print(f"wrote {RESULTS} and {RESULTS.with_suffix('.json').name}", flush=True)


if __name__ == "__main__":
    main()
