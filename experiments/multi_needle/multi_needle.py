"""Multi-needle retrieval at toy scale: a Llama, Diff V1 and Diff V2 trained from scratch on the same data.

    python experiments/multi_needle/multi_needle.py --output runs/multi_needle      # ~12 min per model, 2 idle cores
    python experiments/multi_needle/multi_needle.py --output runs/multi_needle --seeds 3  # three seeds, one by one
    python experiments/multi_needle/multi_needle.py --output /tmp/mn --steps 40 --eval-per-cell 4  # a quick look
    python experiments/multi_needle/multi_needle.py --output runs/multi_needle --evaluate-only  # re-evaluate models

The task follows the paper's multi-needle test (Diff Transformer, §3.4, Table 2): N needles "the magic number of
CITY is NUMBER ." are hidden at random depths in a haystack of Jane Austen's prose (data/corpus.txt), and the model is
asked for R of them at the end: "what is the magic number of CITY ? NUMBER ." Toy-scale choices, all ours:

- a word-level vocabulary (the corpus's most frequent lowercased words, `<unk>` for the rest, plus 64 cities and the
  numbers 10..99 as single tokens), so an answer is one token and accuracy is the argmax at the "?" position;
- training asks N questions of a sequence of N needles (N uniform in 1..6), the needles drawn with replacement, and
  the loss is the cross-entropy on the answer tokens only: the haystack is not modelled, as in a retrieval
  fine-tune; each batch's length is uniform in 128..384 tokens (evaluation: 384, and 128/256 for accuracy by
  length). (Asking every needle once, as this script first did, rewards elimination: "a number not asked yet".)
- accuracy is the first answer's, and per query position: the R evaluation queries ask distinct needles (as the
  paper), so later answers can be narrowed down from the earlier ones;
- three models of equal parameter count: Llama with H heads of size d; V1 with H/2 differential heads of the same d
  (the paper's matching: the same parameters as the Llama plus 6d per layer); V2 with H differential heads of d (2H
  query heads over the Llama's K/V, as V2 specifies) and a narrower MLP to pay for its second query and W_λ;
- the same seeded data stream, steps, batch, learning-rate schedule and initialisation seed for all three.

Evaluation, on held-out haystack (data/heldout.txt) and fresh needles: accuracy for (N, R) = (1, 1), (2, 2), (4, 2),
(6, 2) as in the paper's Table 2, with the first queried needle at depths 0, 0.25, 0.5, 0.75, 1 of the haystack and the
others at random depths; and attention at the first "?" position with `diff_transformer.analysis`: "answer" = the
signed weight on the queried needle's 8 tokens over the row's total |weight|, "noise" = the |weight| on every other
token over the same total (docs/experiments/multi_needle.md gives the definitions and how they are aggregated).

Writes to --output: results.json (every figure, the training curves, the configs), tables.md, curves.png,
accuracy.png, attention.png, maps.png (one head of each model on one example) and models/<name>-seed<k>/
(save_pretrained + the word-level tokenizer, so `diff-transformer inspect` works on them). A training run wants a new
or empty --output (--overwrite trains into a non-empty one, replacing only the files above); --evaluate-only and
--plot-only want one that holds a run's results.json.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import re
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from diff_transformer import DiffConfig, DiffForCausalLM
from diff_transformer.analysis import attention_maps, layer_metrics, span_mass
from diff_transformer.errors import UserError
from diff_transformer.outputs.files import check_target


REPO = Path(__file__).resolve().parents[2]
SPECIALS = ["<s>", "</s>", "<pad>", "<unk>"]
NEEDLE_WORDS = ["the", "magic", "number", "of", "is", "what", "?", "."]
CITIES = (
    "amsterdam athens auckland bangkok barcelona beijing berlin bogota boston brussels budapest cairo chicago "
    "copenhagen dakar delhi denver dubai dublin geneva hanoi havana helsinki istanbul jakarta karachi kyoto lagos "
    "lima lisbon madrid manila melbourne miami milan montreal moscow mumbai munich nairobi naples osaka oslo "
    "ottawa prague quito riga rome santiago seattle seoul shanghai singapore stockholm sydney taipei tehran tokyo "
    "toronto tunis valencia vienna warsaw zurich"
).split()
NUMBERS = [str(n) for n in range(10, 100)]
NEEDLE_LEN = 8  # the magic number of CITY is NUMBER .
QUERY_LEN = 10  # what is the magic number of CITY ? NUMBER .
EVAL_CELLS = [(1, 1), (2, 2), (4, 2), (6, 2)]  # (N needles, R retrieved): the paper's Table 2
DEPTHS = [0.0, 0.25, 0.5, 0.75, 1.0]
# The training loss of a model that copies one of the sequence's N numbers at random: answers are weighted by N, as
# every needle is asked for, so sum(N ln N) / sum(N) over N = 1..6.
COPY_ANY_LOSS = sum(n * math.log(n) for n in range(1, 7)) / sum(range(1, 7))
EVAL_LENGTHS = [128, 256, 384]  # accuracy by context length (those up to --length)
WORD = re.compile(r"[a-z]+|[^\sa-z]")


# ---- Data ----


def words(path: Path) -> list[str]:
    return WORD.findall(path.read_text(encoding="utf-8").lower())


def build_tokenizer(corpus: list[str], size: int) -> PreTrainedTokenizerFast:
    """Word-level: specials, the needle's words, cities, numbers, then the corpus's most frequent other words."""
    fixed = SPECIALS + NEEDLE_WORDS + CITIES + NUMBERS
    taken = set(fixed)
    frequent = [w for w, _ in collections.Counter(corpus).most_common() if w not in taken]
    vocab = {w: i for i, w in enumerate(fixed + frequent[: size - len(fixed)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )


class NeedleTask:
    """Draws sequences [<s>] haystack-with-needles queries; knows where each answer and needle sits."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast, haystack: list[str], length: int):
        vocab = tokenizer.get_vocab()
        unk = vocab["<unk>"]
        self.haystack = np.array([vocab.get(w, unk) for w in haystack], dtype=np.int64)
        self.bos = vocab["<s>"]
        self.the, self.magic, self.number, self.of, self.is_, self.what, self.question, self.dot = (
            vocab[w] for w in NEEDLE_WORDS
        )
        self.cities = np.array([vocab[c] for c in CITIES])
        self.numbers = np.array([vocab[n] for n in NUMBERS])
        self.length = length

    def needle(self, city: int, number: int) -> list[int]:
        return [self.the, self.magic, self.number, self.of, city, self.is_, number, self.dot]

    def query(self, city: int, number: int) -> list[int]:
        return [self.what, self.is_, self.the, self.magic, self.number, self.of, city, self.question, number, self.dot]

    def sample(
        self,
        rng,
        n_needles: int,
        n_queries: int,
        first_depth: float | None = None,
        length: int | None = None,
        replace: bool = False,
    ):
        """One sequence of exactly `length` tokens (default: `self.length`). The queried needles are distinct, or with
        `replace` drawn with replacement (then no answer can be inferred from the earlier ones). The first queried
        needle goes at `first_depth` (a fraction of the haystack) when given; every other needle at a random depth.
        Returns (ids, answers, needle_starts): answers are (position of "?", answer token) in query order,
        needle_starts where the queried needles begin, same order."""
        length = length or self.length
        hay_len = length - 1 - NEEDLE_LEN * n_needles - QUERY_LEN * n_queries
        start = rng.integers(0, len(self.haystack) - hay_len)
        hay = self.haystack[start : start + hay_len].tolist()
        cities = rng.choice(self.cities, size=n_needles, replace=False)
        numbers = rng.choice(self.numbers, size=n_needles)
        asked = rng.integers(0, n_needles, n_queries) if replace else rng.permutation(n_needles)[:n_queries]
        cuts = rng.integers(0, hay_len + 1, size=n_needles)
        if first_depth is not None:
            cuts[asked[0]] = round(first_depth * hay_len)
        order = np.argsort(cuts, kind="stable")
        ids, starts, previous = [self.bos], {}, 0
        for k in order:
            ids += hay[previous : cuts[k]]
            starts[k] = len(ids)
            ids += self.needle(cities[k], numbers[k])
            previous = cuts[k]
        ids += hay[previous:]
        answers = []
        for k in asked:
            q = self.query(cities[k], numbers[k])
            answers.append((len(ids) + q.index(self.question), int(numbers[k])))
            ids += q
        assert len(ids) == length
        return ids, answers, [starts[k] for k in asked]

    def needle_starts(self, ids: list[int]) -> list[int]:
        """Where every needle begins (a query's "the magic number of" follows "is", a needle's never does)."""
        head = [self.the, self.magic, self.number, self.of]
        return [i for i in range(1, len(ids) - 3) if ids[i : i + 4] == head and ids[i - 1] != self.is_]

    def training_batch(self, rng: np.random.Generator, batch: int, max_needles: int, min_length: int):
        """(B, L) ids and (B, L) labels, -100 except at the answer positions (labels[i, t] = token at t + 1).
        L is drawn per batch, uniform in [min_length, self.length]: short haystacks early in training let a model
        find the retrieval circuit sooner, long ones teach it to ignore more text. N queries are drawn with
        replacement: asking every needle once let "a number of the context not asked yet" (elimination) score
        0.75 / 0.29 / 0.18 at N = 2 / 4 / 6 without any retrieval (docs/experiments/multi_needle.md)."""
        length = int(rng.integers(min_length, self.length + 1))
        ids = torch.empty(batch, length, dtype=torch.long)
        labels = torch.full((batch, length), -100, dtype=torch.long)
        for b in range(batch):
            n = int(rng.integers(1, max_needles + 1))
            seq, answers, _ = self.sample(rng, n, n, length=length, replace=True)
            ids[b] = torch.tensor(seq)
            for position, answer in answers:
                labels[b, position] = answer
        return ids, labels


# ---- Models of equal parameter count ----


def build_configs(args, vocab_size: int) -> dict[str, object]:
    common = dict(
        vocab_size=vocab_size,
        hidden_size=args.hidden_size,
        num_hidden_layers=args.layers,
        max_position_embeddings=args.length,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        rope_theta=10000.0,
        initializer_range=getattr(args, "init_std", 0.02),  # transformers' default unless the script sets one
    )
    d = args.hidden_size // args.heads
    llama = LlamaConfig(
        **common,
        intermediate_size=args.intermediate_size,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        head_dim=d,
    )
    v1 = DiffConfig(
        **common,
        diff_version=1,
        intermediate_size=args.intermediate_size,
        num_attention_heads=args.heads // 2,
        num_key_value_heads=args.heads // 2,
        head_dim=d,
    )
    # V2 adds a second query (D x D) and W_λ (D x H) per layer; a narrower MLP (3 D x I) pays for them.
    extra = args.hidden_size * args.hidden_size + args.hidden_size * args.heads
    v2_intermediate = args.intermediate_size - round(extra / (3 * args.hidden_size))
    v2 = DiffConfig(
        **common,
        diff_version=2,
        intermediate_size=v2_intermediate,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        head_dim=d,
    )
    return {"llama": llama, "v1": v1, "v2": v2}


def model_class(name: str):
    return LlamaForCausalLM if name == "llama" else DiffForCausalLM


def build_model(name: str, config, seed: int):
    torch.manual_seed(seed)
    return model_class(name)(config).float()


# ---- Training and evaluation ----


def answer_loss(model, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    hidden = model.model(input_ids=ids).last_hidden_state  # (B, L, D)
    picked = labels != -100
    logits = model.lm_head(hidden[picked])  # (answers, V): the LM head only where there is an answer
    return F.cross_entropy(logits.float(), labels[picked])


def optimizer(model, lr: float, steps: int):
    """AdamW (betas 0.9/0.95, weight decay 0.1), 5% linear warm-up, cosine decay to 10% of `lr`."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: (
            min(1.0, (s + 1) / warmup)
            * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / max(1, steps - warmup)))))
        ),
    )
    return opt, schedule


def train(name, model, task, args, seed, log):
    rng = np.random.default_rng(1000 + seed)  # the data stream: the same for every model of a seed
    opt, schedule = optimizer(model, args.lr, args.steps)
    model.train()
    curve, started, recent = [], time.perf_counter(), []
    for step in range(1, args.steps + 1):
        ids, labels = task.training_batch(rng, args.batch_size, args.max_needles, args.min_length)
        loss = answer_loss(model, ids, labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        schedule.step()
        opt.zero_grad(set_to_none=True)
        recent.append(loss.item())
        if step % args.log_every == 0 or step == args.steps:
            curve.append({"step": step, "loss": float(np.mean(recent)), "seconds": time.perf_counter() - started})
            log(
                f"  {name} seed {seed} step {step}/{args.steps}: answer loss {curve[-1]['loss']:.3f} "
                f"({curve[-1]['seconds']:.0f} s)"
            )
            recent = []
    model.eval()
    return curve


@torch.no_grad()
def answer_hits(model, samples) -> list[list[bool]]:
    """For each sample of one length: whether the argmax at each "?" is the asked number, in query order."""
    logits = model(input_ids=torch.tensor([ids for ids, _, _ in samples])).logits  # (B, L, V)
    return [
        [int(logits[b, pos].argmax()) == answer for pos, answer in answers]
        for b, (_, answers, _) in enumerate(samples)
    ]


@torch.no_grad()
def evaluate_accuracy(model, task, args, seed):
    """Per (N, R): "accuracy" = the first answer's (the only one no earlier answer tells anything about),
    "by_query" = each query position's, "all_answers" = every answer's (what elimination inflates: the R queries ask
    distinct needles, as in the paper), and the first answer's per depth of its needle."""
    rng = np.random.default_rng(10_000 + seed)
    results = {}
    for n, r in EVAL_CELLS:
        hits, correct_depth = [], {}
        for depth in DEPTHS:
            samples = [task.sample(rng, n, r, first_depth=depth) for _ in range(args.eval_per_cell)]
            at_depth = [h for i in range(0, len(samples), args.eval_batch)
                        for h in answer_hits(model, samples[i : i + args.eval_batch])]  # fmt: skip
            correct_depth[str(depth)] = float(np.mean([h[0] for h in at_depth]))
            hits += at_depth
        by_query = np.mean(hits, 0)  # (R,)
        results[f"N={n},R={r}"] = {
            "accuracy": float(by_query[0]),
            "by_query": by_query.tolist(),
            "all_answers": float(by_query.mean()),
            "by_depth": correct_depth,
        }
    return results


@torch.no_grad()
def accuracy_by_length(model, task, args, seed):
    """The first answer's accuracy per (N, R) at each context length, needles at random depths."""
    rng = np.random.default_rng(30_000 + seed)
    results = {}
    for length in [n for n in EVAL_LENGTHS if n <= args.length]:
        for n, r in EVAL_CELLS:
            hits = []
            for _ in range(0, 2 * args.eval_per_cell, args.eval_batch):
                chunk = [task.sample(rng, n, r, length=length) for _ in range(args.eval_batch)]
                hits += [sample_hits[0] for sample_hits in answer_hits(model, chunk)]
            results.setdefault(str(length), {})[f"N={n},R={r}"] = float(np.mean(hits))
    return results


@torch.no_grad()
def evaluate_attention(model, task, args, seed, n_needles=6, n_queries=2):
    """Per (layer, head), averaged over examples, at the first "?" (the row that predicts the answer): answer, noise,
    entropy, negative fraction, λ; "distractors" = the signed weight on the other needles (part of the noise) over
    the row's Σ|w|; "answer_at_city" = answer in the row before, the query's CITY token, where a model may also look
    the needle up."""
    rng = np.random.default_rng(20_000 + seed)
    totals = collections.defaultdict(float)
    count = 0
    for depth in DEPTHS:
        for _ in range(args.attention_per_depth):
            ids, answers, starts = task.sample(rng, n_needles, n_queries, first_depth=depth)
            entries = attention_maps(model, torch.tensor([ids]))
            position = answers[0][0]

            def mass(start, row):  # (layers, H): span_mass of the needle at `start` in `row`
                return torch.stack(
                    [span_mass(e.differential, e.mask, (start, start + NEEDLE_LEN), [row]) for e in entries]
                )

            metrics = layer_metrics(entries, span=(starts[0], starts[0] + NEEDLE_LEN), queries=[position])
            metrics["answer_at_city"] = mass(starts[0], position - 1)
            metrics["distractors"] = sum(mass(s, position) for s in task.needle_starts(ids) if s != starts[0])
            for key in ("answer", "noise", "distractors", "answer_at_city", "entropy", "negative_fraction", "lambda"):
                totals[key] = totals[key] + metrics[key].double()
            count += 1
    return {key: (value / count).tolist() for key, value in totals.items()}


def summarize_attention(attn: dict) -> dict:
    """Aggregates of the (layers, H) grids: mean over every head and layer, and the head that retrieves most."""
    answer, noise = torch.tensor(attn["answer"]), torch.tensor(attn["noise"])
    layer, head = divmod(int(answer.argmax()), answer.shape[1])
    return {
        "answer_mean": float(answer.mean()),
        "noise_mean": float(noise.mean()),
        "retrieval_head": [layer, head],
        "answer_retrieval_head": float(answer[layer, head]),
        "noise_retrieval_head": float(noise[layer, head]),
        "answer_last_layer": float(answer[-1].mean()),
        "noise_last_layer": float(noise[-1].mean()),
        "distractors_mean": float(torch.tensor(attn["distractors"]).mean()),
        "answer_at_city_best": float(torch.tensor(attn["answer_at_city"]).max()),
    }


def evaluate(model, task, args, seed) -> dict:
    attention = evaluate_attention(model, task, args, seed)
    return {
        "accuracy": evaluate_accuracy(model, task, args, seed),
        "accuracy_by_length": accuracy_by_length(model, task, args, seed),
        "attention": attention,
        "attention_summary": summarize_attention(attention),
    }


def describe(run: dict) -> str:
    summary = run["attention_summary"]
    return (
        ", ".join(f"{c} {v['accuracy']:.2f}" for c, v in run["accuracy"].items())
        + f"; answer {summary['answer_mean']:.3f} noise {summary['noise_mean']:.3f} (mean over heads), "
        f"retrieval head {summary['retrieval_head']}: answer {summary['answer_retrieval_head']:.3f} "
        f"noise {summary['noise_retrieval_head']:.3f}"
    )


# ---- Figures ----


def plot(results: dict, task: NeedleTask, tokenizer, models_dir: Path, out: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["models"])
    colors = {"llama": "tab:gray", "v1": "tab:blue", "v2": "tab:orange"}
    cells = [f"N={n},R={r}" for n, r in EVAL_CELLS]

    def seeds_of(name, getter):
        return np.array([getter(run) for run in results["models"][name]["seeds"]])

    fig, axes = plt.subplots(1, 3, figsize=(15, 3.8), constrained_layout=True)
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        acc = np.stack([seeds_of(name, lambda run, c=c: run["accuracy"][c]["accuracy"]) for c in cells], 1)
        x = np.arange(len(cells)) + (i - (len(names) - 1) / 2) * width
        axes[0].bar(x, acc.mean(0), width, color=colors[name], label=name)
        if len(acc) > 1:
            axes[0].plot(np.repeat(x[None], len(acc), 0).T, acc.T, "k.", ms=3)
        deep = np.stack(
            [seeds_of(name, lambda run, d=d: run["accuracy"]["N=6,R=2"]["by_depth"][str(d)]) for d in DEPTHS], 1
        )
        axes[1].plot(DEPTHS, deep.mean(0), "o-", color=colors[name], label=name)
        lengths = sorted(results["models"][name]["seeds"][0]["accuracy_by_length"], key=int)
        for cell, style in (("N=6,R=2", "o-"), ("N=2,R=2", "s--")):
            by_length = np.stack(
                [seeds_of(name, lambda run, n=n, c=cell: run["accuracy_by_length"][n][c]) for n in lengths], 1
            )
            axes[2].plot(
                [int(n) for n in lengths], by_length.mean(0), style, color=colors[name], label=f"{name} {cell}"
            )
    for i, (n, _) in enumerate(EVAL_CELLS):  # copying one of the context's N numbers at random
        axes[0].hlines(1 / n, i - 0.45, i + 0.45, colors="k", linestyles="--", lw=0.8, label="1/N" if i == 0 else None)
    axes[0].set_xticks(range(len(cells)), cells)
    axes[0].set_ylabel("accuracy (first answer)")
    axes[0].set_ylim(0, 1.05)
    axes[0].set_title("multi-needle retrieval (dots: seeds)")
    axes[0].legend()
    axes[1].set_xlabel("depth of the first queried needle")
    axes[1].set_ylabel("accuracy of its answer")
    axes[1].set_ylim(0, 1.05)
    axes[1].set_title("N=6, R=2 by depth (mean over seeds)")
    axes[2].set_xlabel("context length (tokens)")
    axes[2].set_ylabel("accuracy (first answer)")
    axes[2].set_ylim(0, 1.05)
    axes[2].set_title("by context length (mean over seeds)")
    axes[2].legend(fontsize=7)
    fig.savefig(out / "accuracy.png", dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), constrained_layout=True)
    for name in names:
        for key, ax in zip(("answer", "noise"), axes):
            grid = np.stack([np.array(run["attention"][key]) for run in results["models"][name]["seeds"]])
            per_layer = grid.mean(0).mean(-1)  # mean over seeds and heads -> (layers,)
            best = grid.mean(0).max(-1)
            ax.plot(range(len(per_layer)), per_layer, "o-", color=colors[name], label=f"{name}: mean over heads")
            ax.plot(
                range(len(best)),
                best if key == "answer" else grid.mean(0).min(-1),
                "s--",
                color=colors[name],
                alpha=0.6,
                label=f"{name}: {'best' if key == 'answer' else 'least noisy'} head",
            )
    axes[0].set_title('attention to the answer needle at "?" (N=6, R=2)')
    axes[1].set_title("attention noise: |weight| elsewhere")
    for ax in axes:
        ax.set_xlabel("layer")
        ax.set_xticks(range(len(per_layer)))
        ax.set_ylim(-0.02, 1.02)
        ax.legend(fontsize=7)
    fig.savefig(out / "attention.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 3.8), constrained_layout=True)
    for name in names:
        for k, run in enumerate(results["models"][name]["seeds"]):
            steps = [point["step"] for point in run["curve"]]
            ax.plot(steps, [point["loss"] for point in run["curve"]], color=colors[name], alpha=1 if k == 0 else 0.5,
                    label=name if k == 0 else None)  # fmt: skip
    ax.axhline(math.log(len(NUMBERS)), color="k", ls=":", lw=0.8)
    ax.axhline(COPY_ANY_LOSS, color="k", ls="--", lw=0.8)
    ax.text(steps[-1], math.log(len(NUMBERS)), "any number 10..99", ha="right", va="bottom", fontsize=7)
    ax.text(steps[-1], COPY_ANY_LOSS, "a number of the context, at random", ha="right", va="bottom", fontsize=7)
    ax.set_xlabel("step")
    ax.set_ylabel("answer loss (training batches)")
    ax.set_ylim(0, 6)
    ax.set_title("training (lighter: further seeds)")
    ax.legend()
    fig.savefig(out / "curves.png", dpi=110)
    plt.close(fig)

    # One example, the retrieval head of each model (first seed), keys around the answer needle.
    rng = np.random.default_rng(7)
    ids, answers, starts = task.sample(rng, 6, 2, first_depth=0.5)
    position = answers[0][0]
    tokens = tokenizer.convert_ids_to_tokens(ids)
    panels = []
    for name in names:
        run = results["models"][name]["seeds"][0]
        layer, head = run["attention_summary"]["retrieval_head"]
        model = model_class(name).from_pretrained(models_dir / run["model"])
        entries = attention_maps(model.eval(), torch.tensor([ids]))
        panels.append((name, layer, head, entries[layer].differential[0, head, position].numpy()))
    fig, axes = plt.subplots(len(panels), 1, figsize=(12, 2.2 * len(panels)), constrained_layout=True)
    for ax, (name, layer, head, row) in zip(np.atleast_1d(axes), panels):
        keys = np.arange(position + 1)
        ax.bar(keys, row[: position + 1], width=1.0, color=np.where(row[: position + 1] < 0, "tab:red", colors[name]))
        for s in task.needle_starts(ids):
            ax.axvspan(s - 0.5, s + NEEDLE_LEN - 0.5, color="gold" if s == starts[0] else "lightgray", alpha=0.4)
        ax.axhline(0, color="k", lw=0.5)
        ax.set_ylabel("weight")
        ax.set_title(
            f"{name}, layer {layer} head {head}: the row of '?' asking for "
            f"'{tokens[position - 1]}' (gold: its needle, gray: the other needles)",
            fontsize=9,
        )
    np.atleast_1d(axes)[-1].set_xlabel("key position")
    fig.savefig(out / "maps.png", dpi=110)
    plt.close(fig)


# ---- Tables (markdown, for docs/experiments/multi_needle.md) ----


def tables(results: dict) -> str:
    """Accuracy per (N, R) and per depth, and the attention aggregates: mean over seeds, then each seed's value."""
    names = list(results["models"])
    cells = [f"N={n},R={r}" for n, r in EVAL_CELLS]

    def cell(values, digits=2):
        values = np.array(values, dtype=float)
        each = " / ".join(f"{v:.{digits}f}" for v in values)
        return f"**{values.mean():.{digits}f}**" + (f" ({each})" if len(values) > 1 else "")

    def runs(name):
        return results["models"][name]["seeds"]

    lines = ["| model | parameters | train time / seed | " + " | ".join(cells) + " |", "|---" * (len(cells) + 3) + "|"]
    for name in names:
        seconds = np.mean([run["train_seconds"] for run in runs(name)])
        accs = [cell([run["accuracy"][c]["accuracy"] for run in runs(name)]) for c in cells]
        lines.append(
            f"| {name} | {results['models'][name]['parameters']:,} | {seconds / 60:.1f} min | "
            + " | ".join(accs)
            + " |"
        )
    lines += ["", "| model: accuracy per query position (1st / 2nd) | " + " | ".join(cells) + " |"]
    lines.append("|---" * (len(cells) + 1) + "|")
    for name in names:
        per_query = [
            " / ".join(cell([run["accuracy"][c]["by_query"][q] for run in runs(name)]) for q in range(r))
            for c, (_, r) in zip(cells, EVAL_CELLS)
        ]
        lines.append(f"| {name} | " + " | ".join(per_query) + " |")
    lines += [
        "",
        "| model (N=6, R=2) | " + " | ".join(f"depth {d}" for d in DEPTHS) + " |",
        "|---" * (len(DEPTHS) + 1) + "|",
    ]
    for name in names:
        deep = [cell([run["accuracy"]["N=6,R=2"]["by_depth"][str(d)] for run in runs(name)]) for d in DEPTHS]
        lines.append(f"| {name} | " + " | ".join(deep) + " |")
    lengths = sorted(runs(names[0])[0]["accuracy_by_length"], key=int)
    lines += ["", "| model | context | " + " | ".join(cells) + " |", "|---" * (len(cells) + 2) + "|"]
    for name in names:
        for n in lengths:
            accs = [cell([run["accuracy_by_length"][n][c] for run in runs(name)]) for c in cells]
            lines.append(f"| {name} | {n} | " + " | ".join(accs) + " |")
    keys = [
        ("answer_mean", "answer, mean of all heads"),
        ("noise_mean", "noise, mean of all heads"),
        ("answer_retrieval_head", "answer, retrieval head"),
        ("noise_retrieval_head", "noise, retrieval head"),
        ("distractors_mean", "other needles, mean of all heads"),
        ("answer_at_city_best", "answer at the query's CITY, best head"),
    ]
    extra = ["retrieval head (layer, head)", "negative weights, mean of all heads", "λ per layer (mean of heads)"]
    header = ['model (N=6, R=2, at the first "?")'] + [k[1] for k in keys] + extra
    lines += ["", "| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    for name in names:
        row = [cell([run["attention_summary"][k] for run in runs(name)], 3) for k, _ in keys]
        heads = " / ".join(str(tuple(run["attention_summary"]["retrieval_head"])) for run in runs(name))
        negative = cell([np.mean(run["attention"]["negative_fraction"]) for run in runs(name)], 3)
        lam = np.array([np.mean(run["attention"]["lambda"], 1) for run in runs(name)])  # (seeds, layers), NaN: Llama
        lam_text = "—" if np.isnan(lam).all() else ", ".join(f"{v:.2f}" for v in lam.mean(0))
        lines.append(f"| {name} | " + " | ".join(row) + f" | {heads} | {negative} | {lam_text} |")
    return "\n".join(lines) + "\n"


# ---- Driver ----


def check_output(parser, args, resumable: bool = False) -> None:
    """--output: a directory we may write (outputs.files.check_target), holding results.json when only re-plotting or
    re-evaluating, and empty unless --overwrite (or, where the script can pick up its runs, --resume)."""
    try:
        args.output = check_target(args.output, name="--output")
    except UserError as error:
        parser.error(str(error))
    reusing = args.plot_only or args.evaluate_only
    if reusing and not (args.output / "results.json").is_file():
        parser.error(f"--output {args.output} holds no results.json: run the experiment into it first")
    keeping = args.overwrite or (resumable and args.resume)
    if not reusing and not keeping and args.output.is_dir() and any(args.output.iterdir()):
        fix = "--resume or --overwrite" if resumable else "or --overwrite to train into it"
        parser.error(f"--output {args.output} is not empty: pass a new directory, {fix}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output", required=True, help="a new directory (checked: not empty, ., ~ or /)")
    p.add_argument("--overwrite", action="store_true", help="train into a non-empty --output, replacing what it wrote")
    p.add_argument("--models", default="llama,v1,v2")
    p.add_argument("--seeds", type=int, default=1)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--length", type=int, default=384, help="tokens per evaluation sequence; training's longest")
    p.add_argument("--min-length", type=int, default=128, help="training's shortest sequence")
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--intermediate-size", type=int, default=384)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4, help="the Llama's heads; V1 gets half, V2 as many")
    p.add_argument("--steps", type=int, default=2400)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--max-needles", type=int, default=6)
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--eval-per-cell", type=int, default=40, help="sequences per (N, R, depth)")
    p.add_argument("--eval-batch", type=int, default=20)
    p.add_argument("--attention-per-depth", type=int, default=8)
    p.add_argument("--plot-only", action="store_true", help="redraw the figures from --output's results.json")
    p.add_argument("--evaluate-only", action="store_true", help="re-evaluate --output's saved models, then plot")
    args = p.parse_args(argv)
    check_output(p, args)
    shortest = 1 + args.max_needles * (NEEDLE_LEN + QUERY_LEN) + 16
    if args.min_length < shortest or args.length < args.min_length:
        p.error(
            f"--min-length {args.min_length} / --length {args.length}: sequences need at least {shortest} tokens "
            f"for --max-needles {args.max_needles} (needles, queries and some haystack), and --length >= "
            "--min-length; raise them or lower --max-needles"
        )
    problem = _argument_problem(args)
    if problem:
        p.error(problem)
    return args


# The models this experiment builds, and the most needles an evaluation places (EVAL_CELLS, evaluate_attention).
MODEL_NAMES = ("llama", "v1", "v2")
EVAL_MAX_NEEDLES = max(n for n, _ in EVAL_CELLS)


def _argument_problem(args) -> str | None:
    """What the options cannot do, found before anything is trained or written (None: nothing)."""
    names = args.models.split(",")
    unknown = [name for name in names if name not in MODEL_NAMES]
    if unknown or len(set(names)) != len(names):
        return f"--models {args.models}: give distinct names among {', '.join(MODEL_NAMES)}, comma-separated"
    for flag in ("seeds", "log_every", "steps", "batch_size", "eval_per_cell", "eval_batch", "attention_per_depth"):
        if getattr(args, flag) < 1:
            return f"--{flag.replace('_', '-')} {getattr(args, flag)} must be at least 1"
    if args.threads is not None and args.threads < 1:
        return f"--threads {args.threads} must be at least 1"
    if not (math.isfinite(args.lr) and args.lr > 0):
        return f"--lr {args.lr} must be a finite number > 0"
    if not 1 <= args.max_needles <= len(CITIES):
        return f"--max-needles {args.max_needles} must be between 1 and {len(CITIES)} (one city per needle)"
    evaluated = 1 + EVAL_MAX_NEEDLES * (NEEDLE_LEN + QUERY_LEN) + 16
    if args.length < evaluated:
        return (
            f"--length {args.length}: the evaluation places up to {EVAL_MAX_NEEDLES} needles and needs sequences of "
            f"at least {evaluated} tokens; raise --length"
        )
    fixed = len(SPECIALS + NEEDLE_WORDS + CITIES + NUMBERS)
    if args.vocab_size <= fixed:
        return f"--vocab-size {args.vocab_size} must exceed the {fixed} words every sequence uses (needles, cities)"
    if args.layers < 1 or args.heads < 2 or args.heads % 2:
        return f"--layers {args.layers} must be >= 1 and --heads {args.heads} even and >= 2 (V1 pairs heads)"
    if args.hidden_size % args.heads or (args.hidden_size // args.heads) % 2:
        return f"--hidden-size {args.hidden_size} must split into --heads {args.heads} heads of an even size"
    if args.intermediate_size - round((args.hidden_size + args.heads) / 3) < 1:  # V2's narrower MLP (build_configs)
        return f"--intermediate-size {args.intermediate_size} is too small for V2's MLP at this --hidden-size"
    return None


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = args.output
    out.mkdir(parents=True, exist_ok=True)
    log_file = (out / "log.txt").open("a", encoding="utf-8")

    def log(line):
        print(line, flush=True)
        log_file.write(line + "\n")
        log_file.flush()

    corpus, heldout = words(REPO / "data" / "corpus.txt"), words(REPO / "data" / "heldout.txt")
    tokenizer = build_tokenizer(corpus, args.vocab_size)
    train_task = NeedleTask(tokenizer, corpus, args.length)
    eval_task = NeedleTask(tokenizer, heldout, args.length)
    if args.plot_only or args.evaluate_only:
        results = json.loads((out / "results.json").read_text())
        for name, model_results in results["models"].items() if args.evaluate_only else ():
            for run in model_results["seeds"]:
                model = model_class(name).from_pretrained(out / "models" / run["model"]).eval()
                run.update(evaluate(model, eval_task, args, run["seed"]))
                log(f"{name} seed {run['seed']} re-evaluated: " + describe(run))
            (out / "results.json").write_text(json.dumps(results, indent=1))
        plot(results, eval_task, tokenizer, out / "models", out)
        (out / "tables.md").write_text(tables(results))
        return
    configs = build_configs(args, len(tokenizer))
    names = args.models.split(",")
    settings = {k: v for k, v in vars(args).items() if k not in ("output", "overwrite", "plot_only", "evaluate_only")}
    results = {"args": settings, "models": {}}  # the experiment's settings; where it was written is not one
    for name in names:
        results["models"][name] = {"config": configs[name].to_dict(), "seeds": []}
    for seed in range(args.seeds):
        for name in names:
            model = build_model(name, configs[name], seed)
            params = sum(p.numel() for p in model.parameters())
            results["models"][name]["parameters"] = params
            log(f"{name} seed {seed}: {params:,} parameters")
            started = time.perf_counter()
            curve = train(name, model, train_task, args, seed, log)
            seconds = time.perf_counter() - started
            model_dir = f"{name}-seed{seed}"
            model.save_pretrained(out / "models" / model_dir)
            tokenizer.save_pretrained(out / "models" / model_dir)
            run = {"seed": seed, "model": model_dir, "train_seconds": seconds, "curve": curve}
            run.update(evaluate(model, eval_task, args, seed))
            results["models"][name]["seeds"].append(run)
            log(f"{name} seed {seed}: trained in {seconds:.0f} s; " + describe(run))
            (out / "results.json").write_text(json.dumps(results, indent=1))
    plot(results, eval_task, tokenizer, out / "models", out)
    (out / "tables.md").write_text(tables(results))
    log(f"wrote {out / 'results.json'}, tables.md, accuracy.png, attention.png, maps.png")


if __name__ == "__main__":
    main()
