"""Needle in a haystack: the long-context retrieval test, on any causal LM transformers loads.

A grid of (context length, depth) cells. Each cell holds `needles` prompts: a public-domain text (the package's Jane
Austen chapters, or the user's own) cut at token precision so that the whole prompt is exactly `length` tokens, with
one sentence, "The special magic number for KEY is VALUE.", inserted at the sentence boundary nearest `depth` of the
way into the text, and a question asking for KEY's number, ending with the start of the answer. A prompt is scored by
exact match of VALUE in the greedy answer (plain argmax: a generation config's repetition penalty would punish
copying the needle's digits) and by the log-probability of VALUE's tokens (informative where the model is
too small to answer). Keys and values are drawn from (seed, length, depth, index), so every model sees the same grid.

Prompts are token sequences concatenated piece by piece (template, text, needle, question), never re-tokenized text,
so lengths are exact and one tokenizer gives the same prompts to a source model and its conversion.
"""

from __future__ import annotations

import json
import math
import random
import re
import sys
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path

from ..errors import UserError


INSTRUCTION = "Read the text below. A special magic number is hidden in it; remember it."
NEEDLE = "The special magic number for {key} is {value}."
QUESTION = "What is the special magic number for {key} mentioned in the text above?"
ANSWER_PREFIX = "The special magic number for {key} is"
KEYS = (
    "amber", "anchor", "autumn", "badger", "beacon", "birch", "bramble", "canyon", "cedar", "cobalt", "comet",
    "coral", "cricket", "dune", "ember", "falcon", "fern", "glacier", "harbor", "hazel", "heron", "island", "ivory",
    "juniper", "lantern", "lichen", "maple", "meadow", "orchid", "otter", "pebble", "quartz", "raven", "saffron",
    "sparrow", "thistle", "timber", "tundra", "violet", "walnut", "willow", "zephyr",
)  # fmt: skip
MAX_NEEDLES = 1000  # per cell: what one run may be asked to generate
# The run's budget, checked before anything is built, over every model named: one model's grid is held (its token
# ids) until it is scored, the next model's built once that one is done.
MAX_PROMPTS = 100_000  # lengths x depths x needles x models
MAX_GRID_TOKENS = 1 << 26  # 64 Mi tokens: the sum of the prompts' lengths over all models (~0.5 GiB of token ids)
MAX_HAYSTACK_BYTES = 64 * 2**20
# What of the haystack is tokenized: a prefix of HAYSTACK_CHARS_PER_TOKEN x the longest length (at least
# MIN_HAYSTACK_CHARS), cut at a line end, doubled until it gives enough tokens; never more than MAX_HAYSTACK_CHARS
# characters (a fast tokenizer holds ~60x the text it reads: 16 Mi characters stay near 1 GB, where a whole 60 MB
# text aborted at 3.8 GB). The shipped text (~130 k characters) is always tokenized whole.
HAYSTACK_CHARS_PER_TOKEN = 8
MIN_HAYSTACK_CHARS = 1 << 20
MAX_HAYSTACK_CHARS = 1 << 24
_PLACEHOLDER = "\x00HAYSTACK\x00"
_SENTENCE_END = re.compile(r"[.!?][\"')\]]*\s*$|\n\s*$")


def default_haystack() -> str:
    """The shipped text: the last two chapters of each of Jane Austen's novels (public domain), ~28k tokens."""
    return resources.files("diff_transformer").joinpath("assets/heldout.txt").read_text(encoding="utf-8")


def read_haystack(path) -> str:
    """A user's haystack file: UTF-8 text, not empty, at most 64 MiB (one line each otherwise)."""
    path = Path(path)
    shown = repr(str(path))  # quoted, so a newline or control character in the name stays on one line
    if not path.is_file():
        raise UserError(f"--haystack {shown} is not a file: pass a UTF-8 text file.")
    if path.stat().st_size > MAX_HAYSTACK_BYTES:
        raise UserError(f"--haystack {shown} is larger than 64 MiB: pass a shorter text (a few MB make 1M tokens).")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UserError(f"--haystack {shown} is not UTF-8 text: convert it (e.g. iconv -t utf-8).") from None
    if not text.strip():
        raise UserError(f"--haystack {shown} is empty: pass a text with some sentences.")
    return text


@dataclass(frozen=True)
class Prompt:
    length: int  # tokens of the whole prompt, == len(ids)
    depth: float  # asked
    placed_depth: float  # where the needle went: its first token's offset / the text's tokens
    key: str
    value: str
    ids: tuple[int, ...]
    value_ids: tuple[int, ...]  # VALUE's tokens as they follow the answer prefix
    needle_start: int  # index in ids of the needle's first token
    needle_length: int


def needle_for(seed: int, length: int, depth: float, index: int) -> tuple[str, str]:
    """(key, 7-digit value) of one prompt; a string seed is hashed deterministically (not by PYTHONHASHSEED)."""
    rng = random.Random(f"niah-{seed}-{length}-{depth!r}-{index}")
    return rng.choice(KEYS), str(rng.randint(1_000_000, 9_999_999))


class PromptBuilder:
    """Prompts of exact token lengths from one tokenizer and one haystack text."""

    def __init__(self, tokenizer, haystack: str, *, chat: bool, name: str = "the model", tokens: int | None = None):
        """`tokens`: how many haystack tokens the longest prompt can need (None: all of them): only a prefix of the
        text that gives them is tokenized (`haystack_ids`)."""
        self.tokenizer, self.chat, self.name = tokenizer, chat, name
        self._frames: dict[str, tuple[list[int], list[int]]] = {}
        self.haystack = haystack_ids(tokenizer, haystack, tokens)
        # Sentence boundaries: offsets i where token i-1 ends a sentence (or a line); 0 is one too.
        ends = {}
        for token in set(self.haystack):
            ends[token] = bool(_SENTENCE_END.search(tokenizer.decode([token])))
        self.boundaries = [0] + [i for i in range(1, len(self.haystack) + 1) if ends[self.haystack[i - 1]]]

    def _encode(self, text: str, special: bool = False) -> list[int]:
        return self.tokenizer(text, add_special_tokens=special)["input_ids"]

    def frame(self, key: str) -> tuple[list[int], list[int]]:
        """Token ids before and after the haystack (the needle not counted): template, instruction, question and
        the start of the answer."""
        if key not in self._frames:  # one render per key (a few dozen), whatever the grid
            self._frames[key] = self._frame(key)
        return self._frames[key]

    def _frame(self, key: str) -> tuple[list[int], list[int]]:
        from ..generation.chat_templates import ChatRenderError, render_chat

        question, answer = QUESTION.format(key=key), ANSWER_PREFIX.format(key=key)
        if self.chat:
            content = f"{INSTRUCTION}\n\n{_PLACEHOLDER}\n\n{question}"
            try:
                text = render_chat(self.tokenizer, [{"role": "user", "content": content}], add_generation_prompt=True)
            except ChatRenderError as error:
                raise UserError(f"MODEL {self.name}: {error}; or pass --no-chat for plain-text prompts.") from None
            if text.count(_PLACEHOLDER) != 1:  # the haystack goes where the template wrote the user's message
                raise UserError(
                    f"MODEL {self.name}: its chat template writes the user's message {text.count(_PLACEHOLDER)} "
                    "times, not once as it was given, so the haystack has no one place in the prompt: pass "
                    "--no-chat for plain-text prompts."
                )
            before, after = text.split(_PLACEHOLDER)
            # The rendered template holds its own special tokens (BOS included where it wants one).
            return self._encode(before), self._encode(after + answer)
        return self._encode(f"{INSTRUCTION}\n\n", special=True), self._encode(f"\n\n{question}\nAnswer: {answer}")

    def build(self, length: int, depth: float, key: str, value: str) -> Prompt:
        before, after = self.frame(key)
        needle = self._encode(" " + NEEDLE.format(key=key, value=value))
        n = length - len(before) - len(after) - len(needle)  # haystack tokens
        if n < 1:
            raise UserError(
                f"--lengths {length} is too short: the question, needle and template alone take "
                f"{length - n} tokens; ask for more."
            )
        if n > len(self.haystack):
            raise UserError(
                f"--lengths {length} needs {n} tokens of haystack, the text has {len(self.haystack)}: pass a longer "
                "--haystack FILE, or shorter --lengths."
            )
        candidates = [b for b in self.boundaries if b <= n] + [n]
        offset = min(candidates, key=lambda b: (abs(b - depth * n), b))
        ids = before + self.haystack[:offset] + needle + self.haystack[offset:n] + after
        value_ids = self._encode(" " + value)
        assert len(ids) == length
        return Prompt(
            length=length,
            depth=depth,
            placed_depth=offset / n,
            key=key,
            value=value,
            ids=tuple(ids),
            value_ids=tuple(value_ids),
            needle_start=len(before) + offset,
            needle_length=len(needle),
        )


def haystack_ids(tokenizer, text: str, tokens: int | None = None) -> list[int]:
    """The token ids of TEXT, or of a prefix of it (cut at a line end) that holds at least TOKENS of them, so the
    tokenizer's memory follows the longest prompt, not the file (see MAX_HAYSTACK_CHARS)."""
    size = len(text) if tokens is None else max(MIN_HAYSTACK_CHARS, HAYSTACK_CHARS_PER_TOKEN * tokens)
    while True:
        size = min(size, len(text), MAX_HAYSTACK_CHARS)
        cut = text.rfind("\n", 0, size) + 1 if size < len(text) else size
        prefix = text[: cut or size]
        ids = tokenizer(prefix, add_special_tokens=False, verbose=False)["input_ids"]
        # a prefix cut mid-text: its last tokens may merge with what follows, so one more than asked is kept aside
        if size >= len(text) or size >= MAX_HAYSTACK_CHARS or tokens is None or len(ids) > tokens:
            return ids
        size *= 2


def build_grid(builder: PromptBuilder, lengths, depths, needles: int, seed: int) -> list[Prompt]:
    return [
        builder.build(length, depth, *needle_for(seed, length, depth, index))
        for length in lengths
        for depth in depths
        for index in range(needles)
    ]


def is_correct(answer: str, value: str) -> bool:
    """Exact match: VALUE appears in the answer as a whole number (not inside a longer run of digits)."""
    return re.search(rf"(?<!\d){re.escape(value)}(?!\d)", answer) is not None


@dataclass
class Sample:
    key: str
    value: str
    answer: str
    correct: bool
    value_logprob: float
    placed_depth: float

    @classmethod
    def of(cls, prompt: Prompt, answer: str, value_logprob: float) -> Sample:
        """PROMPT's answer scored (whatever backend produced it)."""
        return cls(
            key=prompt.key,
            value=prompt.value,
            answer=answer,
            correct=is_correct(answer, prompt.value),
            value_logprob=float(value_logprob),
            placed_depth=prompt.placed_depth,
        )


@dataclass
class Cell:
    length: int
    depth: float
    accuracy: float
    mean_value_logprob: float
    n: int
    samples: list[Sample] = field(default_factory=list)


def cells_of(prompts: list[Prompt], samples: list[Sample]) -> list[Cell]:
    grouped: dict[tuple[int, float], list[Sample]] = {}
    for prompt, sample in zip(prompts, samples):
        grouped.setdefault((prompt.length, prompt.depth), []).append(sample)
    return [
        Cell(
            length=length,
            depth=depth,
            accuracy=sum(s.correct for s in group) / len(group),
            mean_value_logprob=sum(s.value_logprob for s in group) / len(group),
            n=len(group),
            samples=group,
        )
        for (length, depth), group in grouped.items()
    ]


def evaluate(model, tokenizer, prompts: list[Prompt], *, batch_size: int = 1, max_new_tokens: int = 16, progress=None):
    """One `Sample` per prompt, in order. Each batch is one forward over prompt + VALUE (the log-probability of
    VALUE, and the first answer token), the cache cut back to the prompt, then a greedy loop: the prompt is computed
    once. Prompts of a batch have equal lengths, so no padding is needed."""
    import torch

    device = next(model.parameters()).device
    eos = _eos_ids(model, tokenizer)
    samples: dict[int, Sample] = {}
    order = sorted(range(len(prompts)), key=lambda i: (prompts[i].length, len(prompts[i].value_ids)))
    batches = []
    for i in order:
        if batches and len(batches[-1]) < batch_size and _same_shape(prompts[batches[-1][0]], prompts[i]):
            batches[-1].append(i)
        else:
            batches.append([i])
    done = 0
    for batch in batches:
        group = [prompts[i] for i in batch]
        m = len(group[0].value_ids)
        ids = torch.tensor([p.ids + p.value_ids for p in group], device=device)  # (B, N + m)
        with torch.no_grad():
            out = model(input_ids=ids, use_cache=True, logits_to_keep=m + 1)
            logits = out.logits.float()  # (B, m + 1, V): positions N-1 .. N+m-1
            logp = torch.log_softmax(logits[:, :m], dim=-1)  # (B, m, V)
            target = ids[:, -m:].unsqueeze(-1)  # (B, m, 1)
            value_logprob = logp.gather(-1, target).squeeze(-1).sum(-1)  # (B,)
            cache = out.past_key_values
            cache.crop(-m)  # drop VALUE: the cache holds the prompt alone
            token = logits[:, 0].argmax(-1)  # (B,)
            answers = [token]
            finished = torch.isin(token, eos)
            for _ in range(max_new_tokens - 1):
                if bool(finished.all()):
                    break
                out = model(input_ids=token[:, None], past_key_values=cache, use_cache=True)
                token = out.logits[:, -1].float().argmax(-1)
                token = torch.where(finished, eos[0], token)
                answers.append(token)
                finished |= torch.isin(token, eos)
        generated = torch.stack(answers, dim=1).tolist()  # (B, T)
        for row, (index, prompt) in enumerate(zip(batch, group)):
            text = tokenizer.decode(_until_eos(generated[row], eos.tolist()), skip_special_tokens=True)
            samples[index] = Sample.of(prompt, text, value_logprob[row])
        done += len(batch)
        if progress is not None:
            progress(done, len(prompts), group[0])
    return [samples[i] for i in range(len(prompts))]


def evaluate_vllm(location: str, tokenizer, prompts: list[Prompt], *, max_new_tokens: int = 16, dtype=None):
    """`evaluate` through vLLM (the plugin serves Diff checkpoints; any architecture vLLM knows works): greedy answers
    with prefix caching, then the log-probability of VALUE from one more pass over prompt + VALUE (`prompt_logprobs`),
    which reuses the cached prompt."""
    from vllm import LLM, SamplingParams

    longest = max(p.length + max(len(p.value_ids), max_new_tokens) for p in prompts)
    llm = LLM(location, dtype=dtype or "auto", max_model_len=longest + 1, seed=0, enable_prefix_caching=True)
    try:
        greedy = SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
        answers = llm.generate([{"prompt_token_ids": list(p.ids)} for p in prompts], greedy, use_tqdm=False)
        scoring = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
        scored = llm.generate(
            [{"prompt_token_ids": list(p.ids + p.value_ids)} for p in prompts], scoring, use_tqdm=False
        )
    finally:
        llm.llm_engine.engine_core.shutdown()  # the engine's processes and KV cache go before the next model
    samples = []
    for prompt, answer, score in zip(prompts, answers, scored):
        m = len(prompt.value_ids)
        logprobs = score.prompt_logprobs[-m:]  # one {token id: Logprob} per VALUE token
        text = tokenizer.decode(answer.outputs[0].token_ids, skip_special_tokens=True)
        samples.append(Sample.of(prompt, text, sum(lp[t].logprob for lp, t in zip(logprobs, prompt.value_ids))))
    return samples


def _same_shape(a: Prompt, b: Prompt) -> bool:
    return a.length == b.length and len(a.value_ids) == len(b.value_ids)


def _eos_ids(model, tokenizer):
    import torch

    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if ids is None:
        ids = tokenizer.eos_token_id
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    device = next(model.parameters()).device
    return torch.tensor(ids or [-1], device=device)


def _until_eos(tokens: list[int], eos: list[int]) -> list[int]:
    for i, token in enumerate(tokens):
        if token in eos:
            return tokens[:i]
    return tokens


def result_record(name: str, cells: list[Cell]) -> dict:
    return {"model": name, "cells": [asdict(c) for c in cells]}


def markdown_table(results: list[dict], lengths, depths) -> str:
    """Rows: model x depth; columns: lengths; each cell 'accuracy (mean log-prob of VALUE)'."""
    lines = ["| model | depth | " + " | ".join(f"{n} tokens" for n in lengths) + " |"]
    lines.append("|---|---|" + "---|" * len(lengths))
    for result in results:
        by = {(c["length"], c["depth"]): c for c in result["cells"]}
        for depth in depths:
            row = [f"{by[(n, depth)]['accuracy']:.2f} ({by[(n, depth)]['mean_value_logprob']:.1f})" for n in lengths]
            lines.append(f"| {result['model']} | {depth:g} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def _samples(result: dict) -> list[dict]:
    return [sample for cell in result["cells"] for sample in cell["samples"]]


def _delta(x: float) -> str:
    """A log-probability difference: 0.0 when none, else enough digits to see its size (rounding or real)."""
    return "0.0" if x == 0 else f"{x:.1e}" if x < 0.05 else f"{x:.2f}"


def summary(results: list[dict]) -> str:
    """One line per model (mean accuracy and mean log-prob of VALUE over every prompt), then each model against the
    first: "B = A (max Δ log-prob ...)" when every answer is the same, else both means, their differences and how
    many answers differ. Every model of a run has the same grid (keys and values from --seed), compared prompt by
    prompt."""
    lines = []
    for result in results:
        samples = _samples(result)
        accuracy = sum(s["correct"] for s in samples) / len(samples)
        logprob = sum(s["value_logprob"] for s in samples) / len(samples)
        lines.append(
            f"{result['model']}: mean accuracy {accuracy:.2f}, mean log-prob of the value {logprob:.2f} "
            f"({len(samples)} prompts)"
        )
    first = results[0]
    base = _samples(first)
    for result in results[1:]:
        samples = _samples(result)
        pairs = list(zip(base, samples))  # the same grid: prompt i is the same key and value in both
        differ = sum(a["answer"] != b["answer"] or a["correct"] != b["correct"] for a, b in pairs)
        largest = max(abs(b["value_logprob"] - a["value_logprob"]) for a, b in pairs)
        name, against = result["model"], first["model"]
        if differ == 0:
            lines.append(f"{name} = {against} (every answer the same; max Δ log-prob {_delta(largest)})")
            continue
        acc_a, acc_b = (sum(s["correct"] for s in x) / len(x) for x in (base, samples))
        lp_a, lp_b = (sum(s["value_logprob"] for s in x) / len(x) for x in (base, samples))
        lines.append(
            f"{name} vs {against}: accuracy {acc_b:.2f} vs {acc_a:.2f} (Δ {acc_b - acc_a:+.2f}), mean log-prob "
            f"{lp_b:.2f} vs {lp_a:.2f} (Δ {lp_b - lp_a:+.2f}); {differ} of {len(pairs)} answers differ, max Δ "
            f"log-prob {_delta(largest)}"
        )
    return "\n".join(lines)


def heatmap(results: list[dict], lengths, depths):
    """The familiar figure: one panel per model, depth down, length across, accuracy on one colour scale (0 to 1),
    each cell annotated with its accuracy and the mean log-probability of VALUE."""
    from ..analysis.plotting import _matplotlib

    Figure, _ = _matplotlib()
    fig = Figure(
        figsize=(1.2 + 0.9 * len(lengths) * len(results) + 0.6, 0.9 + 0.55 * len(depths)), layout="constrained"
    )
    axes = fig.subplots(1, len(results), squeeze=False)[0]
    image = None
    for ax, result in zip(axes, results):
        by = {(c["length"], c["depth"]): c for c in result["cells"]}
        grid = [[by[(n, d)]["accuracy"] for n in lengths] for d in depths]  # (depths, lengths)
        image = ax.imshow(grid, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
        for row, d in enumerate(depths):
            for col, n in enumerate(lengths):
                cell = by[(n, d)]
                ax.text(col, row, f"{cell['accuracy']:.2f}\n{cell['mean_value_logprob']:.1f}", ha="center",
                        va="center", fontsize=7)  # fmt: skip
        ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
        ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
        ax.set_xlabel("context length (tokens)")
        ax.set_title(result["model"].replace("$", r"\$"), fontsize=9)  # a "$" in a path is no mathtext
    axes[0].set_ylabel("needle depth")
    fig.colorbar(image, ax=list(axes), label="accuracy")
    fig.suptitle("needle in a haystack (cells: accuracy, mean log-prob of the value)", fontsize=9)
    return fig


def check_grid(lengths, depths, needles: int, models: int = 1) -> None:
    """The grid's options, before anything loads; the budget counts the grids of all MODELS of the run."""
    if not lengths or any(n < 1 for n in lengths):
        raise UserError("--lengths must be positive token counts, e.g. --lengths 1024 2048 4096.")
    if len(set(lengths)) != len(lengths):
        raise UserError("--lengths repeats a length: give each once.")
    if not depths or any(not (math.isfinite(d) and 0 <= d <= 1) for d in depths):
        raise UserError("--depths must be fractions of the text from 0 (start) to 1 (end), e.g. --depths 0 0.5 1.")
    if len(set(depths)) != len(depths):
        raise UserError("--depths repeats a depth: give each once.")
    if not 1 <= needles <= MAX_NEEDLES:
        raise UserError(f"--needles {needles} must be from 1 to {MAX_NEEDLES} (prompts per cell).")
    prompts = len(lengths) * len(depths) * needles * models
    if prompts > MAX_PROMPTS:
        raise UserError(
            f"--lengths ({len(lengths)}) x --depths ({len(depths)}) x --needles {needles} x {models} MODEL(s) make "
            f"{prompts:,} prompts, more than {MAX_PROMPTS:,} in one run: give fewer lengths, depths, needles or "
            "models."
        )
    tokens = sum(lengths) * len(depths) * needles * models
    if tokens > MAX_GRID_TOKENS:
        raise UserError(
            f"the run's {prompts:,} prompts hold {tokens:,} tokens (--lengths summed x --depths x --needles x "
            f"{models} MODEL(s)), more than {MAX_GRID_TOKENS:,} in one run: give fewer or shorter --lengths, fewer "
            "--depths, --needles or models."
        )


def save(out: Path, settings: dict, results: list[dict], lengths, depths, *, figure: bool = True) -> None:
    (out / "niah.json").write_text(json.dumps({"schema": 1, "settings": settings, "results": results}, indent=1))
    if figure:
        heatmap(results, lengths, depths).savefig(out / "niah.png", dpi=150)
    print(markdown_table(results, lengths, depths), file=sys.stdout)
    print(f"\n{summary(results)}", file=sys.stdout)


__all__ = [
    "Prompt", "PromptBuilder", "build_grid", "check_grid", "default_haystack", "evaluate", "heatmap", "is_correct",
    "markdown_table", "needle_for", "read_haystack", "summary",
]  # fmt: skip
