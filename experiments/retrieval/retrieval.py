"""Key-value retrieval among distractors at toy scale: Llama, Diff V1 and Diff V2 of equal parameter count, over seeds.

    python experiments/retrieval/retrieval.py --output runs/retrieval --seeds 5 --jobs 2   # the documented run
    python experiments/retrieval/retrieval.py --output runs/composed --task composed --steps 6000 --seeds 3 --jobs 2
    python experiments/retrieval/retrieval.py --output /tmp/r --steps 60 --seeds 1 --eval-per-cell 8   # a quick look
    python experiments/retrieval/retrieval.py --output runs/retrieval --evaluate-only   # re-evaluate the saved models

The paper's retrieval claims (Diff Transformer, Table 2: multi-needle accuracy; Table 3: attention to the answer and
"attention noise"; Table 5: top attention logits and hidden states) are about finding one fact among similar
distractors. This is that task stripped to what a 2-layer model learns on a CPU in minutes
(docs/experiments/retrieval.md):

- `--task single` (default): N key-value pairs, each ONE token (key k with value v is token PAIR[k, v]; 32 keys x 8
  values), scattered at random positions in a context of noise tokens; then Q queries, each a key token KEY[k] drawn
  with replacement from the N keys, and at each query the model must predict VALUE[v]. The answers are never in the
  sequence (no elimination, no copying from an earlier answer) and the loss is on the values only. One layer can
  solve it: the query's key attends to the pair token that holds it and copies its value (no composition).
- `--task composed`: the pairs are two tokens, KEY[k] VALUE[v] (multi-query associative recall, as the needle
  format): the model must find the key and read the token after it, which needs two heads to compose (an
  induction-style circuit).

Keys of a sequence are distinct; N and the context length are drawn per batch (N uniform in 1..--max-pairs, length
uniform in --min-length..--length). The three models are sized as in experiments/multi_needle/multi_needle.py (V1 half
the heads, V2 a narrower MLP) and share, per seed, the data stream, the evaluation samples and the initialisation seed.
Weights start at std --init-std 0.1 (about 1/sqrt(hidden size)): at transformers' 0.02, sized for hidden sizes near
1,000, the query-key products start so small that a 64-wide model stays at the copy plateau for thousands of steps.

Measured per model and seed (results.json; docs/experiments/retrieval.md defines every figure): accuracy over N x
context length (in distribution and beyond), training accuracy per step and the first step at 90% / 95%, accuracy over
N at fixed step budgets during training (--grid-steps), at the best retrieval head the answer mass, distractor-key mass
and noise mass (diff_transformer.analysis), λ, the largest and median |attention logit| and largest |hidden state| (the
paper's Table 5), and accuracy after round-to-nearest int8 / int4 weight quantization.

Runs (model, seed) go to --jobs processes of one torch thread each; every finished run is saved at once
(runs/<name>-seed<k>.json and models/<name>-seed<k>/), so --resume picks up after an interruption.
"""

from __future__ import annotations

import argparse
import copy
import json
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from diff_transformer.analysis import attention_maps, layer_metrics, span_mass


sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "multi_needle"))  # experiments/multi_needle/
from multi_needle import build_configs, build_model, check_output, model_class, optimizer  # noqa: E402


BOS, EOS, PAD, NOISE = 0, 1, 2, 3  # noise tokens: ids NOISE .. NOISE + noise - 1
EVAL_PAIRS = (2, 4, 8, 16, 32)
ATTENTION_PAIRS = 8  # attention and outliers are measured at N = 8, in-distribution length
# Training accuracy levels whose first step the tables give: leaving the plateau (1/values = 0.125 for 8 values; a
# 10-step window holds 2,560 answers, so 0.2 is many standard errors above it), half-way, and learned.
LEVELS = (0.2, 0.5, 0.9, 0.95)


class RetrievalTask:
    """Draws batches (ids, labels, meta). ids: (B, 1 + L + Q) = [BOS] context queries; labels -100 except at the
    query positions, which hold the asked key's VALUE token; meta: pair starts, which pair each query asks."""

    def __init__(self, kind: str = "single", queries: int = 8, keys: int = 32, values: int = 8, noise: int = 64):
        if kind not in ("single", "composed"):
            raise ValueError(f"task {kind!r}: 'single' or 'composed'")
        self.kind, self.queries, self.keys, self.values, self.noise = kind, queries, keys, values, noise
        self.width = 1 if kind == "single" else 2  # tokens per pair
        self.key = NOISE + noise  # query keys (and, for the composed task, the context's keys)
        self.value = self.key + keys  # the answers (and the composed task's context values)
        self.pair = self.value + values  # single task: pair + k * values + v holds key k with value v
        self.vocab_size = self.pair + (keys * values if kind == "single" else 0)

    def batch(self, rng: np.random.Generator, batch: int, n_pairs: int, length: int):
        w, Q = self.width, self.queries
        if not 1 <= n_pairs <= self.keys or w * n_pairs > length:
            raise ValueError(f"{n_pairs} pairs of {w} token(s) do not fit a context of {length} ({self.keys} keys)")
        keys = np.argsort(rng.random((batch, self.keys)), 1)[:, :n_pairs]  # (B, N): distinct keys
        values = rng.integers(0, self.values, (batch, n_pairs))  # (B, N)
        # Non-overlapping starts: N sorted distinct slots of the L - (w-1)N free ones, shifted by (w-1) per rank.
        slots = np.sort(np.argsort(rng.random((batch, length - (w - 1) * n_pairs)), 1)[:, :n_pairs], 1)
        starts = 1 + slots + (w - 1) * np.arange(n_pairs)  # (B, N), after BOS; pair i keeps key i (random order)
        context = NOISE + rng.integers(0, self.noise, (batch, length))  # (B, L)
        asked = rng.integers(0, n_pairs, (batch, Q))  # (B, Q): with replacement
        ids = np.concatenate([np.full((batch, 1), BOS), context, self.key + np.take_along_axis(keys, asked, 1)], 1)
        rows = np.arange(batch)[:, None]
        if self.kind == "single":
            ids[rows, starts] = self.pair + keys * self.values + values
        else:
            ids[rows, starts], ids[rows, starts + 1] = self.key + keys, self.value + values
        labels = np.full(ids.shape, -100)
        labels[:, 1 + length :] = self.value + np.take_along_axis(values, asked, 1)
        meta = {"starts": starts, "asked": asked, "length": length}
        return torch.from_numpy(ids), torch.from_numpy(labels), meta

    def training_batch(self, rng, args):
        length = int(rng.integers(args.min_length, args.length + 1))
        n_pairs = int(rng.integers(1, min(args.max_pairs, length // self.width) + 1))
        return self.batch(rng, args.batch_size, n_pairs, length)


def loss_and_hits(model, ids, labels):
    """Cross-entropy on the values, and whether each value is the argmax (of the whole vocabulary)."""
    hidden = model.model(input_ids=ids).last_hidden_state  # (B, T, D)
    picked = labels != -100
    logits = model.lm_head(hidden[picked]).float()  # (answers, V): the LM head only where there is an answer
    return F.cross_entropy(logits, labels[picked]), logits.argmax(-1) == labels[picked]


@torch.no_grad()
def accuracy(model, task, rng, n_pairs, length, sequences, batch):
    hits = []
    for i in range(0, sequences, batch):
        ids, labels, _ = task.batch(rng, min(batch, sequences - i), n_pairs, length)
        hits.append(loss_and_hits(model, ids, labels)[1])
    return float(torch.cat(hits).float().mean())


def eval_lengths(args):
    return [args.length * k for k in (1, 2, 4)]


def accuracy_by_n(model, task, args, seed, stream, sequences, lengths):
    """{"L=..": {"N=..": accuracy}}: `sequences` x Q answers per cell, from a stream fixed by (seed, stream)."""
    rng = np.random.default_rng([seed, stream])
    out = {}
    for length in lengths:
        out[f"L={length}"] = {
            f"N={n}": accuracy(model, task, rng, n, length, sequences, args.eval_batch)
            for n in EVAL_PAIRS
            if n <= task.keys and n * task.width <= length
        }
    return out


def train(name, model, task, args, seed, log):
    rng = np.random.default_rng([seed, 1])  # the data stream: the same for every model of a seed
    opt, schedule = optimizer(model, args.lr, args.steps)
    grid_steps = {int(s) for s in args.grid_steps.split(",") if s}
    curve, grid, recent_loss, recent_hits, started = [], {}, [], [], time.perf_counter()
    model.train()
    for step in range(1, args.steps + 1):
        ids, labels, _ = task.training_batch(rng, args)
        loss, hits = loss_and_hits(model, ids, labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        schedule.step()
        opt.zero_grad(set_to_none=True)
        recent_loss.append(loss.item())
        recent_hits.append(hits.float().mean().item())
        if step % args.log_every == 0 or step == args.steps:
            curve.append(
                {
                    "step": step,
                    "loss": float(np.mean(recent_loss)),
                    "accuracy": float(np.mean(recent_hits)),
                    "seconds": time.perf_counter() - started,
                }
            )
            recent_loss, recent_hits = [], []
            if step % (args.log_every * 10) == 0 or step == args.steps:
                log(f"{name} seed {seed} step {step}: loss {curve[-1]['loss']:.3f} acc {curve[-1]['accuracy']:.3f}")
        if step in grid_steps:  # accuracy at a fixed budget, on its own stream (the training stream is untouched)
            model.eval()
            grid[str(step)] = accuracy_by_n(model, task, args, seed, 3, args.eval_per_cell // 2, [args.length])
            model.train()
    model.eval()
    return curve, grid


def first_step_at(curve, level):
    """The first logged step whose training accuracy (mean over the logging window) reaches `level`, else None."""
    return next((point["step"] for point in curve if point["accuracy"] >= level), None)


# ---- Attention, outliers, quantization ----


@torch.no_grad()
def evaluate_attention(model, task, args, seed):
    """(layers, H) grids at the first query's row, averaged over sequences of N = 8 pairs at --length: "answer" =
    signed weight on the asked pair's token(s) / the row's Σ|w|, "distractors" = signed weight on the other pairs'
    tokens / Σ|w|, "noise" = |weight| on everything but the asked pair / Σ|w| (so it includes the distractors);
    entropy, negative fraction, λ. Also the largest and median |attention logit| over every layer, query (sub-)head
    and allowed entry, and the largest and median |hidden state| over every decoder layer's output (paper Table 5)."""
    rng = np.random.default_rng([seed, 2])
    w, totals, count = task.width, {}, 0
    logits_max, logits_all, hidden_max, hidden_all = 0.0, [], 0.0, []
    outputs, handles = [], []
    for layer in model.model.layers:  # the residual stream after each decoder layer
        hook = lambda m, a, out: outputs.append(out[0] if isinstance(out, tuple) else out)  # noqa: E731
        handles.append(layer.register_forward_hook(hook))
    try:
        for _ in range(args.attention_sequences):
            ids, _, meta = task.batch(rng, 1, ATTENTION_PAIRS, args.length)
            outputs.clear()
            entries = attention_maps(model, ids)
            row = 1 + args.length  # the first query
            starts = meta["starts"][0]
            answer = int(starts[meta["asked"][0, 0]])
            metrics = layer_metrics(entries, span=(answer, answer + w), queries=[row])
            metrics["distractors"] = sum(
                torch.stack([span_mass(e.differential, e.mask, (int(s), int(s) + w), [row]) for e in entries])
                for s in starts
                if s != answer
            )
            for key in ("answer", "noise", "distractors", "entropy", "negative_fraction", "lambda"):
                totals[key] = totals.get(key, 0) + metrics[key].double()
            count += 1
            for e in entries:
                allowed = e.logits[e.mask.unsqueeze(1).expand_as(e.logits)].abs()
                logits_max = max(logits_max, float(allowed.max()))
                logits_all.append(allowed)
            states = torch.cat([h.abs().flatten() for h in outputs])
            hidden_max = max(hidden_max, float(states.max()))
            hidden_all.append(states)
    finally:
        for handle in handles:
            handle.remove()
    grids = {key: (value / count).tolist() for key, value in totals.items()}
    outliers = {
        "logit_max": logits_max,
        "logit_median": float(torch.cat(logits_all).median()),
        "hidden_max": hidden_max,
        "hidden_median": float(torch.cat(hidden_all).median()),
    }
    return grids, outliers


def summarize_attention(grids: dict) -> dict:
    answer = torch.tensor(grids["answer"])
    layer, head = divmod(int(answer.argmax()), answer.shape[1])
    pick = {key: float(torch.tensor(grids[key])[layer, head]) for key in ("answer", "distractors", "noise")}
    lam = torch.tensor(grids["lambda"])
    return {
        "retrieval_head": [layer, head],
        **{f"{key}_retrieval_head": value for key, value in pick.items()},
        "lambda_retrieval_head": None if lam.isnan().all() else float(lam[layer, head]),
        "lambda_per_layer": None if lam.isnan().all() else lam.mean(1).tolist(),
        "answer_mean": float(answer.mean()),
        "noise_mean": float(torch.tensor(grids["noise"]).mean()),
    }


@torch.no_grad()
def quantize_weights(model, bits: int):
    """Round-to-nearest, symmetric, per output row, of every nn.Linear weight in the decoder layers (attention, MLP,
    V2's W_λ); the tied embedding / LM head, norms and V1's λ vectors stay fp32. Values are stored dequantized."""
    top = 2 ** (bits - 1) - 1  # 127 or 7
    for module in model.model.layers.modules():
        if isinstance(module, torch.nn.Linear):
            scale = module.weight.abs().amax(1, keepdim=True).clamp_min(1e-12) / top  # (out, 1)
            module.weight.copy_((module.weight / scale).round().clamp(-top, top) * scale)
    return model


def evaluate(model, task, args, seed) -> dict:
    grids, outliers = evaluate_attention(model, task, args, seed)
    quantized = {}
    for bits in (8, 4):
        small = quantize_weights(copy.deepcopy(model), bits)
        cells = accuracy_by_n(small, task, args, seed, 4, args.eval_per_cell // 2, [args.length])
        quantized[f"int{bits}"] = cells[f"L={args.length}"]
    return {
        "accuracy": accuracy_by_n(model, task, args, seed, 5, args.eval_per_cell, eval_lengths(args)),
        "attention": grids,
        "attention_summary": summarize_attention(grids),
        "outliers": outliers,
        "quantized": quantized,
    }


def describe(run: dict, args) -> str:
    acc = run["accuracy"][f"L={args.length}"]
    s = run["attention_summary"]
    return (
        "accuracy " + " ".join(f"{k} {v:.3f}" for k, v in acc.items())
        + f"; head {s['retrieval_head']} answer {s['answer_retrieval_head']:.3f} "
        f"distractors {s['distractors_retrieval_head']:.3f} noise {s['noise_retrieval_head']:.3f}; "
        f"max logit {run['outliers']['logit_max']:.1f} max hidden {run['outliers']['hidden_max']:.1f}"
    )  # fmt: skip


# ---- One run, in its own process ----


def make_task(args) -> RetrievalTask:
    return RetrievalTask(args.task, args.queries, args.keys, args.values, args.noise)


def run_one(name: str, seed: int, args) -> dict:
    torch.set_num_threads(args.threads)
    out = args.output

    def log(line):
        print(line, flush=True)

    task = make_task(args)
    config = build_configs(args, task.vocab_size)[name]
    model = build_model(name, config, seed)
    started = time.perf_counter()
    curve, grid = train(name, model, task, args, seed, log)
    seconds = time.perf_counter() - started
    model_dir = f"{name}-seed{seed}"
    model.save_pretrained(out / "models" / model_dir)
    run = {
        "seed": seed,
        "model": model_dir,
        "parameters": sum(p.numel() for p in model.parameters()),
        "train_seconds": seconds,
        "curve": curve,
        "steps_to_90": first_step_at(curve, 0.90),
        "steps_to_95": first_step_at(curve, 0.95),
        "grid": grid,
    }
    run.update(evaluate(model, task, args, seed))
    log(f"{name} seed {seed}: trained in {seconds:.0f} s; " + describe(run, args))
    path = out / "runs" / f"{model_dir}.json"
    path.with_suffix(".tmp").write_text(json.dumps(run))
    os.replace(path.with_suffix(".tmp"), path)  # a run's file is complete or absent
    return run


def collect(args) -> dict:
    settings = {k: v for k, v in vars(args).items() if k not in ("output", "overwrite", "resume", "evaluate_only",
                                                                 "plot_only", "jobs", "threads")}  # fmt: skip
    results = {"args": settings, "models": {}}
    configs = build_configs(args, make_task(args).vocab_size)
    for name in args.models.split(","):
        runs = []
        for seed in range(args.seeds):
            path = args.output / "runs" / f"{name}-seed{seed}.json"
            if path.is_file():
                runs.append(json.loads(path.read_text()))
        results["models"][name] = {"config": configs[name].to_dict(), "seeds": runs}
    return results


# ---- Figures and tables ----


def spread(values, digits=3):
    """'mean ± sd [min, max]' over seeds (sd with n - 1); None entries (never reached) are counted and left out."""
    values = list(values)
    reached = np.array([v for v in values if v is not None], dtype=float)
    missing = len(values) - len(reached)
    if not len(reached):
        return "never"
    text = f"{reached.mean():.{digits}f}"
    if len(reached) > 1:
        text += f" ± {reached.std(ddof=1):.{digits}f} [{reached.min():.{digits}f}, {reached.max():.{digits}f}]"
    return text + (f" ({missing} never)" if missing else "")


def tables(results: dict) -> str:
    args = results["args"]
    names = list(results["models"])

    def runs(name):
        return results["models"][name]["seeds"]

    lines = [
        f"Mean ± sd [min, max] over seeds ({', '.join(f'{n}: {len(runs(n))}' for n in names)} seeds).",
        "",
        "| model | parameters | train min / seed | " + " | ".join(f"steps to {p:.0%}" for p in LEVELS) + " |",
        "|---" * (len(LEVELS) + 3) + "|",
    ]
    for name in names:
        r = runs(name)
        steps = [spread([first_step_at(x["curve"], level) for x in r], 0) for level in LEVELS]
        lines.append(
            f"| {name} | {r[0]['parameters']:,} | {np.mean([x['train_seconds'] for x in r]) / 60:.1f} | "
            + " | ".join(steps)
            + " |"
        )

    def copy_row(cells):  # the value of a random pair of the context: right 1/N of the time, else by chance
        v = args["values"]
        return "| copy a random pair (expected) | " + " | ".join(f"{1 / n + (1 - 1 / n) / v:.3f}" for n in (
            int(c[2:]) for c in cells)) + " |"  # fmt: skip

    length_keys = list(runs(names[0])[0]["accuracy"])
    for length in length_keys:
        cells = list(runs(names[0])[0]["accuracy"][length])
        lines += ["", f"Accuracy at context {length[2:]} tokens.", ""]
        lines += ["| model | " + " | ".join(cells) + " |", "|---" * (len(cells) + 1) + "|", copy_row(cells)]
        for name in names:
            vals = [spread(x["accuracy"][length][c] for x in runs(name)) for c in cells]
            lines.append(f"| {name} | " + " | ".join(vals) + " |")
    for step in runs(names[0])[0]["grid"]:
        cells = list(runs(names[0])[0]["grid"][step][f"L={args['length']}"])
        lines += ["", f"Accuracy after {step} steps (context {args['length']}).", ""]
        lines += ["| model | " + " | ".join(cells) + " |", "|---" * (len(cells) + 1) + "|", copy_row(cells)]
        for name in names:
            vals = [spread(x["grid"][step][f"L={args['length']}"][c] for x in runs(name)) for c in cells]
            lines.append(f"| {name} | " + " | ".join(vals) + " |")
    keys = ["answer_retrieval_head", "distractors_retrieval_head", "noise_retrieval_head", "answer_mean", "noise_mean"]
    lines += ["", f"Attention at the first query, N = {ATTENTION_PAIRS}, context {args['length']}.", ""]
    lines += ["| model | " + " | ".join(keys) + " | retrieval heads | λ per layer (mean) |"]
    lines += ["|---" * (len(keys) + 3) + "|"]
    for name in names:
        heads = " ".join(str(tuple(x["attention_summary"]["retrieval_head"])) for x in runs(name))
        lam = [x["attention_summary"]["lambda_per_layer"] for x in runs(name)]
        lam_text = "—" if lam[0] is None else ", ".join(spread(v, 2) for v in np.array(lam).T)
        vals = [spread(x["attention_summary"][k] for x in runs(name)) for k in keys]
        lines.append(f"| {name} | " + " | ".join(vals) + f" | {heads} | {lam_text} |")
    keys = ["logit_max", "logit_median", "hidden_max", "hidden_median"]
    lines += ["", "Outliers (|attention logit|, |hidden state|) and accuracy (mean over N) after weight RTN.", ""]
    lines += ["| model | " + " | ".join(keys) + " | fp32 | int8 | int4 |", "|---" * (len(keys) + 4) + "|"]
    for name in names:
        vals = [spread((x["outliers"][k] for x in runs(name)), 2) for k in keys]
        acc = [spread(np.mean(list(x["accuracy"][f"L={args['length']}"].values())) for x in runs(name))]
        acc += [spread(np.mean(list(x["quantized"][q].values())) for x in runs(name)) for q in ("int8", "int4")]
        lines.append(f"| {name} | " + " | ".join(vals + acc) + " |")
    return "\n".join(lines) + "\n"


def length_panel_pairs(results) -> int:
    """The largest N <= training's largest that every evaluation length holds."""
    run = next(iter(results["models"].values()))["seeds"][0]
    common = set.intersection(*(set(cells) for cells in run["accuracy"].values()))
    return max(int(c[2:]) for c in common if int(c[2:]) <= results["args"]["max_pairs"])


def plot(results: dict, out: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    args = results["args"]
    names = list(results["models"])
    colors = {"llama": "tab:gray", "v1": "tab:blue", "v2": "tab:orange"}

    def runs(name):
        return results["models"][name]["seeds"]

    fig, axes = plt.subplots(1, 3, figsize=(15, 3.6), constrained_layout=True)
    for name in names:
        for k, run in enumerate(runs(name)):
            steps = [p["step"] for p in run["curve"]]
            axes[0].plot(steps, [p["accuracy"] for p in run["curve"]], color=colors[name], lw=0.8, alpha=0.7,
                         label=name if k == 0 else None)  # fmt: skip
        for ax, length, ls in ((axes[1], f"L={args['length']}", "o-"), (axes[2], None, "s-")):
            if length is None:  # accuracy over length at the largest N every length holds
                lengths = list(runs(name)[0]["accuracy"])
                n = f"N={length_panel_pairs(results)}"
                x = [int(k[2:]) for k in lengths]
                values = np.array([[run["accuracy"][k][n] for k in lengths] for run in runs(name)])
            else:
                cells = list(runs(name)[0]["accuracy"][length])
                x = [int(c[2:]) for c in cells]
                values = np.array([[run["accuracy"][length][c] for c in cells] for run in runs(name)])
            ax.plot(x, values.mean(0), ls, color=colors[name], label=name)
            ax.fill_between(x, values.min(0), values.max(0), color=colors[name], alpha=0.2)
    axes[0].axhline(0.9, color="k", ls=":", lw=0.8)
    axes[0].set(xlabel="step", ylabel="training accuracy (window mean)", title="training (every seed)", ylim=(0, 1.02))
    axes[1].set(xscale="log", xlabel="pairs N", ylabel="accuracy", ylim=(0, 1.02),
                title=f"accuracy over N, context {args['length']} (band: seed min-max)")  # fmt: skip
    copy = [1 / n + (1 - 1 / n) / args["values"] for n in EVAL_PAIRS]
    axes[1].plot(EVAL_PAIRS, copy, "k:", label="copy a random pair")
    axes[1].minorticks_off()
    axes[1].set_xticks(EVAL_PAIRS, [str(n) for n in EVAL_PAIRS])
    axes[2].set(xscale="log", xlabel="context length (training: up to the first)", ylabel="accuracy", ylim=(0, 1.02),
                title=f"accuracy over length, N = {length_panel_pairs(results)}")  # fmt: skip
    x = [int(k[2:]) for k in runs(names[0])[0]["accuracy"]]
    axes[2].minorticks_off()
    axes[2].set_xticks(x, [str(v) for v in x])
    for ax in axes:
        ax.axhline(1 / args["values"], color="k", ls="--", lw=0.6)
        ax.legend(fontsize=8)
    fig.savefig(out / "accuracy.png", dpi=80)
    plt.close(fig)

    fig, axes = plt.subplots(1, 3, figsize=(15, 3.4), constrained_layout=True)
    groups = [("answer_retrieval_head", "answer"), ("distractors_retrieval_head", "distractor keys"),
              ("noise_retrieval_head", "noise (all but answer)")]  # fmt: skip
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        x = np.arange(len(groups)) + (i - (len(names) - 1) / 2) * width
        values = np.array([[run["attention_summary"][k] for k, _ in groups] for run in runs(name)])
        axes[0].bar(x, values.mean(0), width, color=colors[name], label=name)
        axes[0].plot(np.repeat(x[None], len(values), 0).T, values.T, "k.", ms=3)
        keys = ["logit_max", "hidden_max"]
        values = np.array([[run["outliers"][k] for k in keys] for run in runs(name)])
        x = np.arange(len(keys)) + (i - (len(names) - 1) / 2) * width
        axes[1].bar(x, values.mean(0), width, color=colors[name], label=name)
        axes[1].plot(np.repeat(x[None], len(values), 0).T, values.T, "k.", ms=3)
        keys = ["fp32", "int8", "int4"]
        values = np.array(
            [
                [np.mean(list(run["accuracy"][f"L={args['length']}"].values()))]
                + [np.mean(list(run["quantized"][q].values())) for q in ("int8", "int4")]
                for run in runs(name)
            ]
        )
        x = np.arange(len(keys)) + (i - (len(names) - 1) / 2) * width
        axes[2].bar(x, values.mean(0), width, color=colors[name], label=name)
        axes[2].plot(np.repeat(x[None], len(values), 0).T, values.T, "k.", ms=3)
    axes[0].set_xticks(range(len(groups)), [g[1] for g in groups])
    axes[0].set(ylabel="fraction of the row's Σ|w|", title=f"retrieval head, first query, N = {ATTENTION_PAIRS}")
    axes[1].set_xticks(range(2), ["max |attention logit|", "max |hidden state|"])
    axes[1].set(title="outliers (paper Table 5)", yscale="log")
    axes[2].set_xticks(range(3), ["fp32", "int8 RTN", "int4 RTN"])
    axes[2].set(ylabel=f"accuracy, mean over N (context {args['length']})", ylim=(0, 1.02), title="weights RTN")
    for ax in axes:
        ax.legend(fontsize=8)
    fig.savefig(out / "attention.png", dpi=80)
    plt.close(fig)


# ---- Driver ----


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output", required=True, help="a new directory (checked: not empty, ., ~ or /)")
    p.add_argument("--overwrite", action="store_true", help="train into a non-empty --output, replacing its runs")
    p.add_argument("--resume", action="store_true", help="keep the finished runs in --output, train the rest")
    p.add_argument("--task", choices=("single", "composed"), default="single")
    p.add_argument("--models", default="llama,v1,v2")
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--jobs", type=int, default=1, help="runs in parallel, one process each")
    p.add_argument("--threads", type=int, default=1, help="torch threads per run")
    p.add_argument("--length", type=int, default=64, help="training's longest context; evaluation: 1x, 2x, 4x")
    p.add_argument("--min-length", type=int, default=16)
    p.add_argument("--max-pairs", type=int, default=16, help="training's largest N (evaluation: up to 32)")
    p.add_argument("--queries", type=int, default=8)
    p.add_argument("--keys", type=int, default=32, help="distinct keys (N <= keys)")
    p.add_argument("--values", type=int, default=8, help="distinct values: guessing scores 1/values")
    p.add_argument("--noise", type=int, default=64, help="distinct noise tokens")
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--intermediate-size", type=int, default=192)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4, help="the Llama's heads; V1 gets half, V2 as many")
    p.add_argument(
        "--init-std",
        type=float,
        default=0.1,
        help="std of the initial weights (transformers' 0.02 suits hidden sizes near 1,000; at 64 it leaves the "
        "attention at a saddle for thousands of steps)",
    )
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument(
        "--grid-steps", default="100,200,300", help="steps at which accuracy over N is measured mid-training"
    )
    p.add_argument("--eval-per-cell", type=int, default=64, help="sequences per (N, length) cell, x --queries answers")
    p.add_argument("--eval-batch", type=int, default=32)
    p.add_argument("--attention-sequences", type=int, default=32)
    p.add_argument("--plot-only", action="store_true", help="redraw the figures and tables from --output's runs")
    p.add_argument("--evaluate-only", action="store_true", help="re-evaluate --output's saved models, then plot")
    args = p.parse_args(argv)
    check_output(p, args, resumable=True)
    width = 1 if args.task == "single" else 2
    if not (1 <= args.max_pairs <= args.keys and width * args.max_pairs <= args.min_length <= args.length):
        p.error(
            f"--max-pairs {args.max_pairs} / --min-length {args.min_length} / --length {args.length}: need 1 <= "
            f"max-pairs <= --keys {args.keys}, {width} x max-pairs <= min-length <= length"
        )
    for flag in ("seeds", "jobs", "threads", "steps", "batch_size", "queries", "eval_per_cell", "eval_batch",
                 "attention_sequences", "log_every", "keys", "values", "noise"):  # fmt: skip
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be at least 1")
    return args


def finish(args, results):
    (args.output / "results.json").write_text(json.dumps(results, indent=1))
    (args.output / "tables.md").write_text(tables(results))
    plot(results, args.output)


def main(argv=None):
    args = parse_args(argv)
    out = args.output
    if args.plot_only or args.evaluate_only:
        results = json.loads((out / "results.json").read_text())
        for key, value in results["args"].items():  # the run's settings, not today's defaults
            setattr(args, key, value)
        if args.evaluate_only:
            torch.set_num_threads(args.threads)
            task = make_task(args)
            for name, model_results in results["models"].items():
                for run in model_results["seeds"]:
                    model = model_class(name).from_pretrained(out / "models" / run["model"]).eval()
                    run.update(evaluate(model, task, args, run["seed"]))
                    print(f"{name} seed {run['seed']} re-evaluated: " + describe(run, args), flush=True)
        finish(args, results)
        return results
    (out / "runs").mkdir(parents=True, exist_ok=True)
    todo = [(name, seed) for seed in range(args.seeds) for name in args.models.split(",")]
    if args.resume:
        todo = [(n, s) for n, s in todo if not (out / "runs" / f"{n}-seed{s}.json").is_file()]
    elif args.overwrite:
        for name, seed in todo:
            (out / "runs" / f"{name}-seed{seed}.json").unlink(missing_ok=True)
    if args.jobs == 1:
        for name, seed in todo:
            run_one(name, seed, args)
    else:
        with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("fork")) as pool:
            for future in [pool.submit(run_one, name, seed, args) for name, seed in todo]:
                future.result()
    results = collect(args)
    finish(args, results)
    print(f"wrote {out / 'results.json'}, tables.md, accuracy.png, attention.png", flush=True)
    return results


if __name__ == "__main__":
    main()
