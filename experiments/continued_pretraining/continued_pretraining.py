"""Continued pretraining after conversion, on real text: the shipped tiny Llama vs its Diff V2 and V1 conversions.

    python experiments/continued_pretraining/continued_pretraining.py   # 8 configurations x 3 seeds of 200 steps:
                                                                         # ~1 h on one idle core
    python experiments/continued_pretraining/continued_pretraining.py --models llama v1cal --seeds 0 --steps 40
    python experiments/continued_pretraining/continued_pretraining.py --merge a.json b.json  # several partial runs
    python -m tests.helpers.smollm2 smollm2 && python experiments/continued_pretraining/continued_pretraining.py \
        --source smollm2 --models llama v2 v1cal --seeds 0 --steps 150 --block-size 1024 --batch-size 1 \
        --eval-every 50 --gradient-checkpointing --stem smollm2_150   # the real checkpoint (hours on a CPU)
    python experiments/continued_pretraining/domain_text.py pydoc pd && python ... --data pd/train.txt \
        --heldout pd/heldout.txt --domain "the Python Language Reference" --second-text austen   # another domain

1. Convert `src/diff_transformer/assets/tiny-llama` (a 2.1M-parameter Llama trained by scripts/train_tiny_llama.py on
   four Jane Austen novels) to Diff V2 (function-preserving) and to Diff V1 three times: the paper's start
   (`--v1-init paper`: heads re-paired, λ_init schedule, fresh λ, unit sub-layer norm), the calibrated start
   (`--v1-init calibrated`: each layer's λ and the sub-layer norm gains fitted on the built-in calibration text,
   which is not the held-out text; λ trainable) and the calibrated start with λ = 0 exactly (`calibrated-lambda0`).
   Each seed converts again (the λ vectors are drawn with the seed).
2. Train the Llama (the baseline, `--any-model`), V2 and the V1s, each V1 with and without `--lambda-warmup-steps`,
   with `diff-transformer train` (run in this process) for the same budget and settings on data/corpus.txt, evaluating
   held-out perplexity on data/heldout.txt (the last two chapters of each book, never trained on) at step 0, every
   `--eval-every` steps and at the end; once per seed (the seed drives the data order and the λ vectors). Another
   domain: --data, --heldout and --domain (its name on the page), e.g. the Python Language Reference written by
   domain_text.py, with --second-text austen for measure.py's second text.
3. Write the page <--docs>/<--stem>.md (default docs/experiments/: tables, means ± standard deviation over seeds,
   ratios to the Llama of the same seed), the figure it embeds, <--docs>/continued_pretraining/<--stem>.png (loss,
   held-out perplexity: mean over seeds with the min-max band; λ per layer), and the raw results
   <--results>/<--stem>.json (default experiments/continued_pretraining/results/: every run).

What differs between configurations of one seed is only the model and, for "+ warm-up", the λ ramp.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from diff_transformer import cli
from diff_transformer.conversion import convert_to_diff


sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import DEPTHS, NEEDLES, SECOND_TEXTS, measure, second_text_name  # noqa: E402


HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
LLAMA = REPO / "src" / "diff_transformer" / "assets" / "tiny-llama"
SOURCES = {"tiny-llama": "tiny Llama", "smollm2": "SmolLM2-135M-Instruct", None: "tiny Llama"}
# The page's figures go in this folder beside it (docs/experiments/continued_pretraining/ by default).
FIGURES = "continued_pretraining"
NAMES = {
    "llama": "Llama (source, baseline)",
    "v2": "Diff V2 (converted)",
    "v1": "Diff V1, paper init",
    "v1-wu": "Diff V1, paper init + λ warm-up",
    "v1cal": "Diff V1, calibrated init (differential, λ > 0)",
    "v1cal-wu": "Diff V1, calibrated init (differential) + λ warm-up",
    "v1add": "Diff V1, calibrated additive init (λ < 0 at start)",
    "v1exp": "Diff V1, expanded layout, calibrated (differential)",
    "v1cal0": "Diff V1, calibrated init with λ = 0",
    "v1cal0-wu": "Diff V1, calibrated init with λ = 0 + λ warm-up",
}
COLORS = {
    "llama": "tab:gray",
    "v2": "tab:blue",
    "v1": "tab:red",
    "v1-wu": "tab:orange",
    "v1cal": "tab:green",
    "v1cal-wu": "tab:olive",
    "v1add": "tab:brown",
    "v1exp": "tab:cyan",
    "v1cal0": "tab:purple",
    "v1cal0-wu": "tab:pink",
}
# How each configuration's model is made: (diff_version, v1_init, v1_layout) or None for the source itself.
CONVERSIONS = {
    "llama": None,
    "v2": (2, None, None),
    "v1": (1, "paper", None),
    "v1cal": (1, "calibrated", None),
    "v1cal0": (1, "calibrated-lambda0", None),
    "v1add": (1, "calibrated-additive", None),
    "v1exp": (1, "calibrated", "expanded"),
}
SETTINGS = ("steps", "batch_size", "block_size", "lr", "warmup_steps", "eval_every", "seeds", "lambda_warmup_steps")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--block-size", type=int, default=256, help="as the tiny Llama was trained")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--lambda-warmup-steps", type=int, default=50, help="the '+ warm-up' configurations' λ ramp")
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--logging-steps", type=int, default=10)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--models", nargs="+", choices=list(NAMES), default=list(NAMES))
    p.add_argument(
        "--workdir", type=Path, default=None, help="keep the converted models and runs here (default: temporary)"
    )
    p.add_argument(
        "--overwrite", action="store_true", help="replace the converted models and runs of a non-empty --workdir"
    )
    p.add_argument(
        "--docs",
        type=Path,
        default=REPO / "docs" / "experiments",
        help=f"where the page (.md) goes, and its figure under {FIGURES}/ (.png)",
    )
    p.add_argument("--results", type=Path, default=HERE / "results", help="where the raw results (.json) go")
    p.add_argument("--stem", default="continued_pretraining", help="their file name without the suffix")
    p.add_argument(
        "--source",
        type=Path,
        default=LLAMA,
        help="the Llama-family checkpoint to convert and train (default: the shipped tiny Llama; e.g. SmolLM2-135M "
        "built by `python -m tests.helpers.smollm2 DIR`)",
    )
    p.add_argument("--gradient-checkpointing", action="store_true", help="passed to `diff-transformer train`")
    p.add_argument("--data", type=Path, default=REPO / "data" / "corpus.txt")
    p.add_argument("--heldout", type=Path, default=REPO / "data" / "heldout.txt")
    p.add_argument("--domain", default="Jane Austen", help="what --data and --heldout are, for the page's title")
    p.add_argument(
        "--second-text",
        choices=SECOND_TEXTS,
        default="pydoc",
        help="measure.py's text of another domain than --data's: the Python Language Reference or Austen's held-out",
    )
    p.add_argument(
        "--from-json", type=Path, default=None, help="redraw the .png/.md from an earlier .json, no training"
    )
    p.add_argument(
        "--merge", type=Path, nargs="+", default=None, help="combine the runs of several .json files (same settings)"
    )
    p.add_argument("--note", default=None, help="a remark on the machine for the .md (e.g. its load)")
    p.add_argument(
        "--save-every",
        type=int,
        default=None,
        help="save a checkpoint every N steps (default: at the end only), so --resume can go on after an interruption",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="reuse the converted models in --workdir and resume its interrupted runs from their last checkpoint",
    )
    p.add_argument(
        "--no-measure",
        action="store_true",
        help="skip measure.py's attention noise and second-text perplexity at step 0 and the end of each run",
    )
    return p.parse_args(argv)


def train(name: str, model: Path, out: Path, seed: int, args) -> dict:
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
        str(args.save_every or args.steps),
        "--save-total-limit",
        "1",
        "--seed",
        str(seed),
        "--quiet",
    ]
    if args.resume and (out / "train_results.json").is_file():  # finished before the interruption
        print(f"\n=== {NAMES[name]}, seed {seed}: finished earlier in {out}", flush=True)
        return read_run(out, json.loads((out / "train_results.json").read_text())["train_runtime"])
    if args.resume and any(out.glob("checkpoint-*")):
        argv.append("--resume")  # the interrupted run goes on from its last checkpoint, same data order
    elif args.overwrite or args.resume:  # with --resume, a run that saved no checkpoint yet starts over
        argv.append("--overwrite")
    if name == "llama":
        argv.append("--any-model")
    if args.gradient_checkpointing:
        argv.append("--gradient-checkpointing")
    if name.endswith("-wu"):
        argv += ["--lambda-warmup-steps", str(args.lambda_warmup_steps)]
    print(f"\n=== {NAMES[name]}, seed {seed}: diff-transformer {' '.join(argv)}", flush=True)
    start = time.perf_counter()
    if cli.main(argv) != 0:
        raise SystemExit(f"training {name} (seed {seed}) failed")
    return read_run(out, time.perf_counter() - start)


def read_run(out: Path, seconds: float) -> dict:
    """The figures of one finished run, from its trainer_state.json."""
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
        "train_seconds": seconds,
        "train_loss": [(h["step"], h["loss"]) for h in train_logs],
        "eval_loss": [(s, evals[s]) for s in steps],
        "eval_perplexity": [(s, math.exp(evals[s])) for s in steps],
        "ppl_step0": math.exp(evals[0]),
        "ppl_end": math.exp(evals[steps[-1]]),
        "lambda": lambdas,
    }


def mean_sd(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def curve(runs: dict, key: str) -> tuple[list, list, list, list]:
    """(steps, mean, min, max) over seeds of a per-step series present in every run."""
    series = [dict(run[key]) for run in runs.values()]
    steps = sorted(set.intersection(*(set(s) for s in series)))
    values = [[s[step] for s in series] for step in steps]
    return steps, [statistics.fmean(v) for v in values], [min(v) for v in values], [max(v) for v in values]


def plot(results: dict, path: Path, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    (loss_ax, ppl_ax), (v1_ax, v2_ax) = axes
    for name, r in results.items():
        style = dict(color=COLORS[name], label=NAMES[name], linestyle="--" if name == "llama" else "-")
        for ax, key, marker in ((loss_ax, "train_loss", None), (ppl_ax, "eval_perplexity", "o")):
            steps, mean, low, high = curve(r["runs"], key)
            ax.plot(steps, mean, marker=marker, markersize=3, **style)
            ax.fill_between(steps, low, high, color=COLORS[name], alpha=0.15)
    loss_ax.set(
        title="training loss (mean over each logging window; mean over seeds, band: min-max)",
        xlabel="step",
        ylabel="cross-entropy",
    )
    ppl_ax.set(
        title=f"held-out perplexity ({args.heldout_name})",
        xlabel="step",
        ylabel="perplexity (log scale)",
        yscale="log",
    )
    for ax in (loss_ax, ppl_ax):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    cmap = plt.get_cmap("viridis")
    v1_styles = (("v1cal", "-", "solid: calibrated"), ("v1exp", "--", "dashed: expanded"))
    v1_styles += (("v1add", "-.", "dash-dot: additive"), ("v1", ":", "dotted: paper init"))
    v1_panel = [(n, ls) for n, ls, _ in v1_styles if n in results]
    v1_title = "V1: λ per layer, seed-mean (" + ", ".join(t for n, _, t in v1_styles if n in results) + ")"
    for ax, panel, title in (
        (v1_ax, v1_panel, v1_title),
        (v2_ax, [("v2", "-")] if "v2" in results else [], "V2: mean sigmoid(λ) per layer, seed-mean"),
    ):
        labelled = set()
        for name, linestyle in panel:
            first = next(iter(results[name]["runs"].values()))["lambda"]
            layers = sorted(k for k in first if k.startswith("lambda/"))
            for i, key in enumerate(layers):
                steps, mean, low, high = curve(
                    {s: {key: r["lambda"][key]} for s, r in results[name]["runs"].items()}, key
                )
                label = key.split("/")[1].replace("_", " ")
                color = cmap(i / max(1, len(layers) - 1))
                ax.plot(steps, mean, color=color, linestyle=linestyle, label=None if label in labelled else label)
                ax.fill_between(steps, low, high, color=color, alpha=0.1)
                labelled.add(label)
        ax.set(title=title, xlabel="step", ylabel="λ")
        ax.grid(alpha=0.3)
        if labelled:
            ax.legend(ncol=2, fontsize=8)
    fig.suptitle(
        f"Continued pretraining of the converted {SOURCES.get(args.source_name, args.source_name)} on {args.domain}: "
        f"{args.steps} steps x {args.batch_size} x {args.block_size} tokens, "
        f"lr {args.lr:g} (cosine, {args.warmup_steps} warm-up), λ warm-up {args.lambda_warmup_steps} steps, "
        f"seeds {', '.join(map(str, args.seeds))}",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def summary(results: dict) -> dict:
    """Per configuration: means ± sd over seeds of perplexities and of ratios to the Llama of the same seed."""
    base = results.get("llama", {}).get("runs", {})
    out = {}
    for name, r in results.items():
        runs = r["runs"]
        row = {
            "ppl_step0": mean_sd([run["ppl_step0"] for run in runs.values()]),
            "ppl_end": mean_sd([run["ppl_end"] for run in runs.values()]),
            "seconds": mean_sd([run["train_seconds"] for run in runs.values()]),
            "seeds": len(runs),
        }
        paired = [seed for seed in runs if seed in base]
        if paired:
            for key in ("ppl_step0", "ppl_end"):
                ratios = [runs[seed][key] / base[seed][key] for seed in paired]
                row[f"ratio_{key}"] = mean_sd(ratios)
                row[f"ratio_{key}_range"] = (min(ratios), max(ratios))
        out[name] = row
    return out


def measured_lines(results: dict, figures: dict, args) -> list[str]:
    """The table of measure.py's figures (attention noise, second-text perplexity), where the runs have them."""
    measured = {name: r for name, r in results.items() if all("measured" in run for run in r["runs"].values())}
    if not measured:
        return []

    def cell(name, when, key, digits):
        values = [run["measured"][when][key] for run in measured[name]["runs"].values()]
        mean, sd = mean_sd(values)
        return f"{mean:.{digits}f}" + (f" ± {sd:.{digits}f}" if len(values) > 1 else "")

    length = next(iter(next(iter(measured.values()))["runs"].values()))["measured"]["end"]["noise_length"]
    lines = [
        f"Attention noise (measure.py: `noise_mass` of the answer position's row outside the needle sentence, "
        f"{len(DEPTHS)} depths x {NEEDLES} needles of `diff-transformer niah` at {length} tokens, mean over layers "
        f"and heads; lower = more attention on the fact) and perplexity on a second text, "
        f"{figures.get('second_text', 'the Python Language Reference')}:",
        "",
        f"| model | noise, step 0 | noise, step {args.steps} | 2nd-text ppl, step 0 | "
        f"2nd-text ppl, step {args.steps} |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name in measured:
        lines.append(
            f"| {NAMES[name]} | {cell(name, 'step0', 'noise', 3)} | {cell(name, 'end', 'noise', 3)} | "
            f"{cell(name, 'step0', 'ppl_text2', 2)} | {cell(name, 'end', 'ppl_text2', 2)} |"
        )
    return lines + [""]


def markdown(results: dict, figures: dict, args) -> str:
    table = summary(results)

    def cell(pair, digits=2, n=2):
        return f"{pair[0]:.{digits}f}" + (f" ± {pair[1]:.{digits}f}" if n > 1 else "")

    def ratio(row, key):
        if f"ratio_{key}" not in row:
            return "-"
        low, high = row[f"ratio_{key}_range"]
        n = row["seeds"]
        return cell(row[f"ratio_{key}"], 3, n) + (f" ({low:.3f}-{high:.3f})" if n > 1 else "")

    rows = [
        f"| {NAMES[name]} | {row['seeds']} | {cell(row['ppl_step0'], n=row['seeds'])} | {ratio(row, 'ppl_step0')} | "
        f"{cell(row['ppl_end'], n=row['seeds'])} | {ratio(row, 'ppl_end')} | {row['seconds'][0]:.0f} s |"
        for name, row in table.items()
    ]
    settings = figures["settings"]
    command = " ".join(
        f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}" for k, v in settings.items()
    )
    seeds = len(args.seeds)
    lines = [
        f"# Continued pretraining after conversion ({SOURCES.get(figures.get('source'), figures.get('source'))}, "
        f"{figures.get('domain', 'Jane Austen')})",
        "",
        f"Produced by `python experiments/continued_pretraining/continued_pretraining.py {command}`. Held-out "
        "perplexity: `diff-transformer train`'s evaluation (exp of the mean token NLL over "
        f"{figures.get('heldout_name', 'data/heldout.txt')} packed into blocks of {args.block_size} tokens, each "
        "starting with `<s>`). Figures are the mean ± standard "
        f"deviation over the n seeds of each configuration (of {seeds}; the seed drives the data order and V1's λ "
        "vectors); ratios are taken per seed against the Llama of the same seed (step 0: the source itself; the end: "
        "the Llama trained the same way), with their min-max in brackets.",
        "",
        f"| model | n | held-out ppl, step 0 | ÷ source | held-out ppl, step {args.steps} | ÷ Llama trained alike | "
        "training time (mean) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        *rows,
        "",
    ]
    lines += measured_lines(results, figures, args)
    if "v2_vs_llama_step0_abs_loss_diff" in figures:
        lines.append(
            "* V2 at step 0 vs the Llama: max |Δ eval loss| over seeds = "
            f"{figures['v2_vs_llama_step0_abs_loss_diff']:.2e} (the V2 conversion preserves the function)."
        )
    lines.append(
        "* V1 paper init: the paper's λ_init schedule, λ vectors ~ N(0, 0.1²), unit sub-layer norm, the source's "
        "o_proj. V1 calibrated init (`--v1-init calibrated`, the default): differential, λ_init = 0 and each layer's "
        "λ fitted in [0.1, 0.5], o_proj refitted by least squares on "
        f"{calibration_of(results)}, λ trainable and kept above 0.05 (`lambda_floor`). Additive "
        "(`--v1-init calibrated-additive`): the same fit with λ in [-1, 0.5] (it picks λ < 0: the second map is "
        "added), no floor. Expanded (`--v1-layout expanded`): one differential head per Llama head, q2/k2 copied "
        "from q1/k1 (A2 = A1 at step 0), λ = the paper's λ_init, o_proj refitted, the floor. 'with λ = 0' "
        "(`--v1-init calibrated-lambda0`): λ = 0 exactly at step 0 (mirrored λ vectors). '+ λ warm-up': "
        f"`--lambda-warmup-steps {args.lambda_warmup_steps}` (λ used = min(1, step/{args.lambda_warmup_steps}) λ); "
        "its step 0 is the model as trained there (nothing subtracted; the paper init still has its unit-gain norm "
        "and 1 - λ_init)."
    )
    for result in results.values():  # the V1 starts, from the first seed's record (every seed's is built alike)
        start = next(iter(result["runs"].values())).get("start")
        if start:
            lines.append(
                f"* This run's {result['name']}, as its conversion recorded it: {start['v1_layout']} layout; "
                f"sub-layer norm and o_proj: {start.get('subln', 'not recorded')}."
            )
    lines.append(
        "* A difference between two configurations counts only where it exceeds the seed spread shown next to it."
    )
    with_lambda = {name: r for name, r in results.items() if next(iter(r["runs"].values()))["lambda"]}
    if with_lambda:
        lines += [
            "",
            "λ per layer, first log (step 1) -> last log, lowest seed "
            "(V1: the layer's scalar as used, i.e. times the warm-up multiplier; "
            "V2: mean ± std of sigmoid(λ) over the tokens and heads of the logging window):",
            "",
        ]
        for name, r in with_lambda.items():
            lam = r["runs"][min(r["runs"], key=int)]["lambda"]
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
        f"Machine: {figures['machine']}. Training times: "
        + figures.get("time_basis", "wall-clock, evaluations and tokenisation included")
        + (f"; {figures['note']}." if figures.get("note") else "."),
        "",
        f"![]({FIGURES}/{args.stem}.png)",
        "",
    ]
    return "\n".join(lines)


def calibration_of(results: dict) -> str:
    """What the V1 starts were fitted on, as their conversion recorded it (runs before the record: the built-in
    text, then the default)."""
    texts = {run["calibration"] for r in results.values() for run in r["runs"].values() if "calibration" in run}
    if not texts:
        return "the built-in calibration text (Persuasion, chapters 1-2; not the held-out text)"
    return "; ".join(sorted(texts))


def describe_path(path: Path) -> str:
    """A data file as the page names it: relative to the repository, or its folder and name."""
    path = path.resolve()
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else f"{path.parent.name}/{path.name}"


def check_args(args) -> str | None:
    """The CLI's rules: a problem as one line (None: none). --workdir is checked like every output: never the
    current directory, home or root, and a non-empty one only with --overwrite."""
    from diff_transformer.errors import UserError
    from diff_transformer.outputs.files import check_target

    for flag in ("steps", "batch_size", "block_size", "eval_every", "logging_steps", "save_every"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            return f"--{flag.replace('_', '-')} {getattr(args, flag)} must be at least 1"
    if args.threads is not None and args.threads < 1:
        return f"--threads {args.threads} must be at least 1"
    if not (args.source / "config.json").is_file():
        return f"--source {args.source} is not a checkpoint directory (no config.json): pass one"
    if args.workdir is not None:
        try:
            work = check_target(args.workdir, name="--workdir")
        except UserError as error:
            return str(error)
        if work.exists() and (not work.is_dir() or any(work.iterdir())) and not (args.overwrite or args.resume):
            return (
                f"--workdir {work} is not empty: pass --overwrite to replace the converted models and runs in it, "
                "or choose another directory"
            )
    return None


def render(figures: dict, args) -> None:
    vars(args).update(figures["settings"])
    args.heldout_name = figures.get("heldout_name", "data/heldout.txt")
    args.domain, args.source_name = figures.get("domain", "Jane Austen"), figures.get("source")
    results = {name: figures["results"][name] for name in NAMES if name in figures["results"]}
    figures["summary"] = summary(results)
    for directory in (args.docs / FIGURES, args.results):
        directory.mkdir(parents=True, exist_ok=True)
    plot(results, args.docs / FIGURES / f"{args.stem}.png", args)
    (args.results / f"{args.stem}.json").write_text(json.dumps(figures, indent=1) + "\n")
    (args.docs / f"{args.stem}.md").write_text(markdown(results, figures, args))


def merge(paths: list[Path]) -> dict:
    """One figures dict from several partial runs with the same settings (runs of a configuration are combined)."""
    merged = None
    for path in paths:
        figures = json.loads(path.read_text())
        if merged is None:
            merged = figures
            continue
        same = {k: v for k, v in figures["settings"].items() if k != "seeds"}
        if same != {k: v for k, v in merged["settings"].items() if k != "seeds"}:
            raise SystemExit(f"{path} was run with other settings than {paths[0]}: not merged")
        for name, r in figures["results"].items():
            merged["results"].setdefault(name, {"name": r["name"], "runs": {}})["runs"].update(r["runs"])
        merged["settings"]["seeds"] = sorted(set(merged["settings"]["seeds"]) | set(figures["settings"]["seeds"]))
    _step0_check(merged)
    return merged


def _step0_check(figures: dict) -> None:
    results = figures["results"]
    if "llama" in results and "v2" in results:
        paired = set(results["llama"]["runs"]) & set(results["v2"]["runs"])
        figures["v2_vs_llama_step0_abs_loss_diff"] = max(
            abs(results["v2"]["runs"][s]["eval_loss"][0][1] - results["llama"]["runs"][s]["eval_loss"][0][1])
            for s in paired
        )


def main(argv=None) -> int:
    args = parse_args(argv)
    problem = None if (args.from_json or args.merge) else check_args(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    if args.from_json or args.merge:
        figures = merge(args.merge) if args.merge else json.loads(args.from_json.read_text())
        if args.note:
            figures["note"] = args.note
        render(figures, args)
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="diff-cpt-"))
    work.mkdir(parents=True, exist_ok=True)
    results = {name: {"name": NAMES[name], "runs": {}} for name in args.models}
    for seed in args.seeds:
        models = {"llama": args.source}
        for key, conversion in CONVERSIONS.items():
            if conversion is None or not any(name.split("-")[0] == key for name in args.models):
                continue
            version, v1_init, v1_layout = conversion
            target = work / f"tiny-diff-{key}-seed{seed}"
            models[key] = target
            if args.resume and (target / "config.json").is_file():
                continue  # converted by the interrupted run (the same seed converts to the same model)
            options = {"v1_init": v1_init} if v1_init else {}
            options |= {"v1_layout": v1_layout} if v1_layout else {}
            convert_to_diff(
                args.source,
                target,
                diff_version=version,
                progress=False,
                seed=seed,
                overwrite=args.overwrite,
                **options,
            )
        for name in args.models:
            run = train(name, models[name.split("-")[0]], work / f"run-{name}-seed{seed}", seed, args)
            if not args.no_measure:
                start, end = models[name.split("-")[0]], work / f"run-{name}-seed{seed}"
                run["measured"] = {
                    "step0": measure(start, args.block_size, args.second_text),
                    "end": measure(end, args.block_size, args.second_text),
                }
            conversion = json.loads((models[name.split("-")[0]] / "config.json").read_text()).get("conversion", {})
            if "calibration_text" in conversion:  # the V1 starts: what their o_proj was fitted on
                run["calibration"] = conversion["calibration_text"]
            if "v1_layout" in conversion:  # and how the start was built, as its conversion recorded it
                run["start"] = {key: conversion[key] for key in ("v1_layout", "subln") if key in conversion}
            results[name]["runs"][str(seed)] = run

    figures = {
        "settings": {k: v for k, v in vars(args).items() if k in SETTINGS},
        "machine": (
            f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads, "
            f"torch {torch.__version__}"
        ),
        "note": args.note,
        "source": args.source.name,
        "domain": args.domain,
        "data_name": describe_path(args.data),
        "heldout_name": describe_path(args.heldout),
        "results": results,
    }
    if not args.no_measure:
        figures["second_text"] = second_text_name(args.second_text)
    _step0_check(figures)
    render(figures, args)
    print()
    for name, row in figures["summary"].items():
        print(
            f"{NAMES[name]:40s} held-out ppl step 0 {row['ppl_step0'][0]:9.2f} ± {row['ppl_step0'][1]:.2f}   "
            f"step {args.steps} {row['ppl_end'][0]:8.2f} ± {row['ppl_end'][1]:.2f}   ({row['seconds'][0]:.0f} s)"
        )
    print(
        f"wrote {args.docs / args.stem}.md, {args.docs / FIGURES / args.stem}.png, {args.results / args.stem}.json; "
        f"runs in {work}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
