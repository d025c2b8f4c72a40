"""Memory per rank of `diff-transformer train --parallelism fsdp` for world sizes 1, 2, 4 on CPU (gloo): the model
state each rank holds (its local shards of the parameters, their gradients and AdamW's two moments, counted exactly
from the local tensors' storage: `training.parallel.local_state_bytes`) and its peak RSS, against the ideal 1/N share
of the one-process run. Writes benchmarks/results/memory_per_rank.{json,md}.

    python benchmarks/memory_per_rank.py                 # worlds 1 2 4, a ~6.6M-parameter V2 model, 2 steps
    python benchmarks/memory_per_rank.py --worlds 1 2 --version 1

Each world size is one `torchrun --standalone` launch of this script in --rank mode, which builds the run exactly as
`train` does (`build_trainer` on the parsed command line) and adds one callback that measures just before each
optimizer step (after backward: parameters and gradients are there; AdamW's moments from the step before).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

import bench_common  # noqa: F401  (src/ on sys.path)


HERE = Path(__file__).resolve().parent
SIZES = {
    "small": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4),
    "large": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                  num_key_value_heads=8),
}  # fmt: skip


def make_model(path: Path, version: int, size: dict) -> None:
    from importlib.resources import files

    import torch
    from transformers import AutoTokenizer

    from diff_transformer import DiffConfig, DiffForCausalLM

    assets = files("diff_transformer") / "assets"
    tokenizer = AutoTokenizer.from_pretrained(str(assets / "tiny-llama"))
    torch.manual_seed(0)
    config = DiffConfig(
        vocab_size=len(tokenizer), diff_version=version, tie_word_embeddings=False, max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        **size,
    )  # fmt: skip
    DiffForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    (path.parent / "text.txt").write_text((assets / "heldout.txt").read_text(encoding="utf-8")[:6000], "utf-8")


def rank_main(model: str, out: str, steps: int) -> None:
    """One rank: `train`'s own Trainer, measured before every optimizer step."""
    import torch
    from transformers import TrainerCallback

    from diff_transformer.training.args import parse_train_args
    from diff_transformer.training.parallel import local_state_bytes
    from diff_transformer.training.train import build_trainer

    torch.set_num_threads(1)
    baseline = bench_common.rss_bytes()  # the interpreter with torch and transformers, before the model
    argv = [
        model, "--data", str(Path(model).parent / "text.txt"), "--output", f"{out}/run", "--parallelism", "fsdp",
        "--quiet", "--report-to", "none", "--block-size", "64", "--batch-size", "1", "--eval-fraction", "0",
        "--max-steps", str(steps), "--save-steps", "1000", "--bf16", "off", "--overwrite",
    ]  # fmt: skip
    kb = bench_common.proc_status_kb
    trainer = build_trainer(parse_train_args(argv)).trainer
    # Peak RSS phase by phase (VmHWM, reset between phases): loading, the training steps, the checkpoint save.
    phases = {"load": kb("VmHWM") * 1024, "after_load_anon": kb("RssAnon") * 1024}
    resettable = bench_common.reset_peak_rss()
    seen = {}

    class Measure(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            counts = local_state_bytes(trainer.model, trainer.optimizer)
            for key, value in counts.items():
                seen[key] = max(seen.get(key, 0), value)

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == state.max_steps:  # before the last step's checkpoint is written
                phases["train"] = kb("VmHWM") * 1024
                phases["train_anon"] = kb("RssAnon") * 1024
                bench_common.reset_peak_rss()

        def on_save(self, args, state, control, **kwargs):
            phases["save"] = kb("VmHWM") * 1024

    trainer.add_callback(Measure())
    trainer.train()
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux
    record = {"rank": rank, "world": world, "state_bytes": seen, "peak_rss_bytes": peak_rss}
    record.update(baseline_rss_bytes=baseline, phase_peak_rss_bytes=phases if resettable else None)
    Path(out, f"rank{rank}.json").write_text(json.dumps(record))


def phase_text(phases) -> str:
    if not phases:
        return "(VmHWM not resettable here)"
    return " / ".join(f"{phases[key] / 2**20:.0f}" if key in phases else "-" for key in ("load", "train", "save"))


def launch(world: int, model: Path, out: Path, steps: int) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent / "src"), str(HERE), env.get("PYTHONPATH", "")])
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"]
    command += [str(Path(__file__).resolve()), "--rank", str(model), str(out), "--steps", str(steps)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if result.returncode:
        raise SystemExit(f"world {world} failed:\n{result.stderr[-4000:]}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--version", type=int, choices=(1, 2), default=2)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--size", choices=sorted(SIZES), default="large")
    parser.add_argument("--out-dir", type=Path, default=HERE / "results")
    parser.add_argument("--rank", nargs=2, metavar=("MODEL", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank:
        return rank_main(*args.rank, args.steps)

    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        make_model(model, args.version, SIZES[args.size])
        runs = {world: launch(world, model, Path(tmp) / f"w{world}", args.steps) for world in args.worlds}
    base = runs[min(args.worlds)][0]["state_bytes"]["total"] * min(args.worlds)  # the whole state, one process
    rows = []
    for world, ranks in runs.items():
        ideal = base / world
        for record in ranks:
            state = record["state_bytes"]
            rows.append({
                "world": world, "rank": record["rank"], **{f"{k}_bytes": v for k, v in state.items()},
                "ideal_bytes": ideal, "ratio_to_ideal": state["total"] / ideal,
                "excess_bytes": state["total"] - ideal, "peak_rss_bytes": record["peak_rss_bytes"],
                "baseline_rss_bytes": record["baseline_rss_bytes"], "phases": record["phase_peak_rss_bytes"],
                "peak_above_baseline_bytes": record["peak_rss_bytes"] - record["baseline_rss_bytes"],
            })  # fmt: skip
    result = {
        "what": "train --parallelism fsdp, model state and peak RSS per rank (CPU, gloo)",
        "model": {
            "diff_version": args.version,
            **SIZES[args.size],
            "vocab": "tiny-llama tokenizer",
            "dtype": "float32",
            "parameters": runs[min(args.worlds)][0]["state_bytes"]["params"] * min(args.worlds) // 4,
        },  # fmt: skip
        "load": "machine: 2 CPU cores shared with ~5 other engineers' jobs (load average ~15); RSS is per process",
        "optimizer": "AdamW (two fp32 moments per parameter)",
        "steps": args.steps,
        "machine": bench_common.provenance(),
        "rows": rows,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "memory_per_rank.json").write_text(json.dumps(result, indent=1) + "\n")
    mib = 2**20
    lines = [
        f"# Memory per rank, `train --parallelism fsdp` (CPU, gloo; V{args.version}, "
        f"{result['model']['parameters']:,} parameters: {SIZES[args.size]}, fp32 + AdamW)",
        "",
        "| world | rank | params MiB | grads MiB | AdamW MiB | state MiB | ideal 1/N MiB | state / ideal | excess KiB "
        "| peak RSS MiB | peak RSS above the imports MiB | peak RSS MiB: load / steps / checkpoint save |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['world']} | {row['rank']} | {row['params_bytes'] / mib:.2f} | {row['grads_bytes'] / mib:.2f} | "
            f"{row['optimizer_bytes'] / mib:.2f} | {row['total_bytes'] / mib:.2f} | {row['ideal_bytes'] / mib:.2f} | "
            f"{row['ratio_to_ideal']:.4f} | {row['excess_bytes'] / 1024:.1f} | {row['peak_rss_bytes'] / mib:.0f} | "
            f"{row['peak_above_baseline_bytes'] / mib:.0f} | {phase_text(row['phases'])} |"
        )
    (args.out_dir / "memory_per_rank.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
