"""Continued pretraining after conversion, on real text: the shipped tiny Llama vs its Diff V2 and V1 conversions.

    python examples/continued_pretraining.py                  # 3 runs of 200 steps: ~4.5 min on 2 idle CPU cores
    python examples/continued_pretraining.py --steps 40       # a quick look

1. Convert `src/diff_transformer/assets/tiny-llama` (a 2.1M-parameter Llama trained by examples/train_tiny_llama.py on
   four Jane Austen novels) to Diff V2 (function-preserving) and to Diff V1 (paper layout: heads re-paired, fresh λ).
2. Train the Llama (the baseline, `--any-model`), V2 and V1 with `diff-transformer train` (run in this process) for
   the same budget and settings on data/corpus.txt, evaluating held-out perplexity on data/heldout.txt (the last two
   chapters of each book, never trained on) at step 0, every `--eval-every` steps and at the end.
3. Write docs/continued_pretraining.png (loss, held-out perplexity, λ per layer over steps), .json (all figures)
   and .md (tables).

Every run is seeded; what differs between the three is only the model.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

from diff_transformer import cli
from diff_transformer.conversion import convert_to_diff


REPO = Path(__file__).resolve().parent.parent
LLAMA = REPO / "src" / "diff_transformer" / "assets" / "tiny-llama"
NAMES = {"llama": "Llama (source, baseline)", "v2": "Diff V2 (converted)", "v1": "Diff V1 (converted)"}
COLORS = {"llama": "tab:gray", "v2": "tab:blue", "v1": "tab:red"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--block-size", type=int, default=256, help="as the tiny Llama was trained")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--logging-steps", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--models", nargs="+", choices=list(NAMES), default=list(NAMES))
    p.add_argument(
        "--workdir", type=Path, default=None, help="keep the converted models and runs here (default: temporary)"
    )
    p.add_argument(
        "--overwrite", action="store_true", help="replace the converted models and runs of a non-empty --workdir"
    )
    p.add_argument("--docs", type=Path, default=REPO / "docs", help="where the .png/.json/.md go")
    p.add_argument("--data", type=Path, default=REPO / "data" / "corpus.txt")
    p.add_argument("--heldout", type=Path, default=REPO / "data" / "heldout.txt")
    p.add_argument(
        "--from-json", type=Path, default=None, help="redraw the .png/.md from an earlier .json, no training"
    )
    p.add_argument("--note", default=None, help="a remark on the machine for the .md (e.g. its load)")
    return p.parse_args(argv)


def train(name: str, model: Path, out: Path, args) -> dict:
    argv = ["train", str(model), "--data", str(args.data), "--eval-data", str(args.heldout), "--output", str(out)]
    argv += [
        "--block-size",
        str(args.block_size),
        "--batch-size",
        str(args.batch_size),
        "--max-steps",
        str(args.steps),
    ]
    argv += ["--lr", str(args.lr), "--warmup-steps", str(args.warmup_steps), "--lr-scheduler", "cosine"]
    argv += ["--eval-on-start", "--eval-steps", str(args.eval_every), "--logging-steps", str(args.logging_steps)]
    argv += [
        "--save-steps",
        str(args.steps),
        "--save-total-limit",
        "1",
        "--seed",
        str(args.seed),
        "--quiet",
    ]
    if args.overwrite:
        argv.append("--overwrite")
    if name == "llama":
        argv.append("--any-model")
    print(f"\n=== {NAMES[name]}: diff-transformer {' '.join(argv)}", flush=True)
    start = time.perf_counter()
    if cli.main(argv) != 0:
        raise SystemExit(f"training {name} failed")
    seconds = time.perf_counter() - start
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    train_logs = [h for h in history if "loss" in h]
    evals = {}
    for h in history:  # the final evaluate() repeats the last in-training one: keep one per step
        if "eval_loss" in h:
            evals[h["step"]] = h["eval_loss"]
    lambdas = {}
    for h in train_logs:
        for key, value in h.items():
            if key.startswith(("lambda/", "lambda_std/")):
                lambdas.setdefault(key, []).append((h["step"], value))
    steps = sorted(evals)
    return {
        "name": NAMES[name],
        "train_seconds": seconds,
        "train_loss": [(h["step"], h["loss"]) for h in train_logs],
        "eval_loss": [(s, evals[s]) for s in steps],
        "eval_perplexity": [(s, math.exp(evals[s])) for s in steps],
        "ppl_step0": math.exp(evals[0]),
        "ppl_end": math.exp(evals[steps[-1]]),
        "lambda": lambdas,
    }


def plot(results: dict, path: Path, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    (loss_ax, ppl_ax), (v1_ax, v2_ax) = axes
    for name, r in results.items():
        steps, losses = zip(*r["train_loss"])
        style = dict(
            color=COLORS[name],
            label=r["name"],
            linestyle="--" if name == "llama" else "-",
            zorder=3 if name == "llama" else 2,
        )
        loss_ax.plot(steps, losses, **style)
        steps, ppl = zip(*r["eval_perplexity"])
        ppl_ax.plot(steps, ppl, marker="o", **style)
    loss_ax.set(title="training loss (mean over each logging window)", xlabel="step", ylabel="cross-entropy")
    ppl_ax.set(
        title="held-out perplexity (data/heldout.txt)", xlabel="step", ylabel="perplexity (log scale)", yscale="log"
    )
    for ax in (loss_ax, ppl_ax):
        ax.grid(alpha=0.3)
        ax.legend()
    cmap = plt.get_cmap("viridis")
    for ax, name, title in (
        (v1_ax, "v1", "V1: λ per layer (the layer's scalar)"),
        (v2_ax, "v2", "V2: mean sigmoid(λ) per layer (± std over tokens, heads)"),
    ):
        lam = results.get(name, {}).get("lambda", {})
        layers = sorted(k for k in lam if k.startswith("lambda/"))
        for i, key in enumerate(layers):
            steps, values = zip(*lam[key])
            color = cmap(i / max(1, len(layers) - 1))
            ax.plot(steps, values, color=color, label=key.split("/")[1].replace("_", " "))
            std_key = key.replace("lambda/", "lambda_std/")
            if std_key in lam:
                std = [s for _, s in lam[std_key]]
                ax.fill_between(
                    steps,
                    [v - s for v, s in zip(values, std)],
                    [v + s for v, s in zip(values, std)],
                    color=color,
                    alpha=0.15,
                )
        ax.set(title=title, xlabel="step", ylabel="λ")
        ax.grid(alpha=0.3)
        if layers:
            ax.legend(ncol=2, fontsize=8)
    fig.suptitle(
        "Continued pretraining of the converted tiny Llama: "
        f"{args.steps} steps x {args.batch_size} x {args.block_size} tokens, "
        f"lr {args.lr:g} (cosine, {args.warmup_steps} warm-up), same seed",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(results: dict, figures: dict, args) -> str:
    rows = [
        f"| {r['name']} | {r['ppl_step0']:.2f} | {r['ppl_end']:.2f} | "
        f"{r['train_loss'][-1][1]:.3f} | {r['train_seconds']:.0f} s |"
        for r in results.values()
    ]
    lines = [
        "# Continued pretraining after conversion (tiny Llama, Jane Austen)",
        "",
        "Produced by `python examples/continued_pretraining.py "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in figures["settings"].items())
        + "`. Held-out perplexity: `diff-transformer train`'s evaluation (exp of the mean token NLL over"
        f" data/heldout.txt packed into blocks of {args.block_size} tokens, each starting with `<s>`).",
        "",
        "| model | held-out ppl, step 0 | held-out ppl, step "
        + str(args.steps)
        + " | last logged training loss | training time |",
        "| --- | --- | --- | --- | --- |",
        *rows,
        "",
    ]
    base = results.get("llama")
    if "v2_vs_llama_step0_abs_loss_diff" in figures:
        lines.append(
            "* V2 at step 0 vs the Llama: |Δ eval loss| = "
            f"{figures['v2_vs_llama_step0_abs_loss_diff']:.2e} (the V2 conversion "
            "preserves the function)."
        )
    if base:
        for name in ("v2", "v1"):
            if name not in results:
                continue
            r = results[name]
            lines.append(
                f"* {NAMES[name]}: step 0 at {r['ppl_step0'] / base['ppl_step0']:.2f}x the Llama's perplexity, "
                f"step {args.steps} at "
                f"{r['ppl_end'] / base['ppl_end']:.3f}x the Llama trained for the same budget "
                f"({r['ppl_end']:.2f} vs {base['ppl_end']:.2f})."
            )
        lines.append(
            "* One seed per model; seed-to-seed spread was not measured, so differences of a few tenths of a percent "
            "mean 'no worse', not 'better'."
        )
    with_lambda = {name: r["lambda"] for name, r in results.items() if r["lambda"]}
    if with_lambda:
        lines += [
            "",
            "λ per layer, first log (step 1) -> last log (V1: the layer's scalar; "
            "V2: mean ± std of sigmoid(λ) over the "
            "tokens and heads of the logging window):",
            "",
        ]
        for name, lam in with_lambda.items():
            cells = []
            for key in sorted(k for k in lam if k.startswith("lambda/")):
                first, last = lam[key][0][1], lam[key][-1][1]
                std = lam.get(key.replace("lambda/", "lambda_std/"))
                cells.append(
                    f"{key.split('/')[1]} {first:.3f} -> {last:.3f}" + (f" ± {std[-1][1]:.3f}" if std else "")
                )
            lines.append(f"* {NAMES[name]}: " + ", ".join(cells))
    lines += [
        "",
        f"Machine: {figures['machine']}. Training times are wall-clock, evaluations and tokenisation included"
        + (f"; {figures['note']}." if figures.get("note") else "."),
        "",
        "![](continued_pretraining.png)",
        "",
    ]
    return "\n".join(lines)


def check_args(args) -> str | None:
    """The CLI's rules: a problem as one line (None: none). --workdir is checked like every output: never the
    current directory, home or root, and a non-empty one only with --overwrite."""
    from diff_transformer.errors import UserError
    from diff_transformer.safe_output import check_target

    for flag in ("steps", "batch_size", "block_size", "eval_every", "logging_steps"):
        if getattr(args, flag) < 1:
            return f"--{flag.replace('_', '-')} {getattr(args, flag)} must be at least 1"
    if args.threads is not None and args.threads < 1:
        return f"--threads {args.threads} must be at least 1"
    if args.workdir is not None:
        try:
            work = check_target(args.workdir, name="--workdir")
        except UserError as error:
            return str(error)
        if work.exists() and (not work.is_dir() or any(work.iterdir())) and not args.overwrite:
            return (
                f"--workdir {work} is not empty: pass --overwrite to replace the converted models and runs in it, "
                "or choose another directory"
            )
    return None


def main(argv=None) -> int:
    args = parse_args(argv)
    problem = None if args.from_json else check_args(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    if args.from_json:
        figures = json.loads(args.from_json.read_text())
        vars(args).update(figures["settings"])
        if args.note:
            figures["note"] = args.note
            args.from_json.write_text(json.dumps(figures, indent=1) + "\n")
        args.docs.mkdir(parents=True, exist_ok=True)
        plot(figures["results"], args.docs / "continued_pretraining.png", args)
        (args.docs / "continued_pretraining.md").write_text(markdown(figures["results"], figures, args))
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="diff-cpt-"))
    work.mkdir(parents=True, exist_ok=True)
    models = {"llama": LLAMA}
    for version in (2, 1):
        name = f"v{version}"
        if name in args.models:
            target = work / f"tiny-diff-{name}"
            convert_to_diff(LLAMA, target, diff_version=version, progress=False, overwrite=args.overwrite)
            models[name] = target

    results = {}
    for name in args.models:
        results[name] = train(name, models[name], work / f"run-{name}", args)

    figures = {
        "settings": {
            k: v
            for k, v in vars(args).items()
            if k in ("steps", "batch_size", "block_size", "lr", "warmup_steps", "eval_every", "seed")
        },
        "machine": (
            f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads, "
            f"torch {torch.__version__}"
        ),
        "note": args.note,
        "results": results,
    }
    if "llama" in results and "v2" in results:
        figures["v2_vs_llama_step0_abs_loss_diff"] = abs(
            results["v2"]["eval_loss"][0][1] - results["llama"]["eval_loss"][0][1]
        )
    figures["lambda_end"] = {
        name: {k: round(v[-1][1], 4) for k, v in r["lambda"].items()} for name, r in results.items() if r["lambda"]
    }

    args.docs.mkdir(parents=True, exist_ok=True)
    plot(results, args.docs / "continued_pretraining.png", args)
    (args.docs / "continued_pretraining.json").write_text(json.dumps(figures, indent=1) + "\n")
    (args.docs / "continued_pretraining.md").write_text(markdown(results, figures, args))
    print()
    for r in results.values():
        print(
            f"{r['name']:28s} held-out ppl step 0 {r['ppl_step0']:9.2f}   "
            f"step {args.steps} {r['ppl_end']:8.2f}   ({r['train_seconds']:.0f} s)"
        )
    print(f"wrote {args.docs / 'continued_pretraining.png'}, .json, .md; runs in {work}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
