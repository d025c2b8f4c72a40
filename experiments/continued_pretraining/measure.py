"""Measurements of a continued-pretraining run's models at step 0 and at the end, beyond the held-out perplexity that
training logs: the attention-noise metric of `diff_transformer.analysis` on needle-retrieval prompts, and perplexity
on a second real text of another domain.

* **Attention noise**: `noise_mass` of the last prompt token's row (the position that must produce the answer) over
  the keys outside the needle sentence, per layer averaged over heads, then over prompts; the prompts are
  `diff-transformer niah`'s (`evaluation.niah.PromptBuilder`, no chat template, the shipped haystack), at depths
  0.25/0.5/0.75, two needles each. Softmax rows (Llama) have noise = 1 - attention to the needle; differential rows
  use |w| (docs/analysis.md). Lower means more attention on the fact the answer needs.
* **Second text** (`--second-text`): `pydoc` (the default), the Python Language Reference as CPython ships it for
  `help()` (`pydoc_data.topics`, topics in sorted order): technical English with code, unlike the novels trained on;
  read from the running interpreter, never downloaded (its Python version is recorded). `austen`, the shipped held-out
  chapters (data/heldout.txt), for runs that train on the Language Reference (domain_text.py).

    python experiments/continued_pretraining/measure.py RESULTS.json --workdir WORKDIR   # fill in a finished run
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import sys
from pathlib import Path

import torch
from transformers.utils import logging as transformers_logging


DEPTHS = (0.25, 0.5, 0.75)
NEEDLES = 2
SECOND_TEXT_TOKENS = 8192
SECOND_TEXTS = ("pydoc", "austen")
AUSTEN_HELDOUT = Path(__file__).resolve().parents[2] / "data" / "heldout.txt"


def second_text(kind: str = "pydoc") -> str:
    if kind == "austen":
        return AUSTEN_HELDOUT.read_text(encoding="utf-8")
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics))


def second_text_name(kind: str = "pydoc") -> str:
    if kind == "austen":
        return f"Jane Austen, the shipped held-out chapters (data/heldout.txt), first {SECOND_TEXT_TOKENS} tokens"
    version = platform.python_version()
    return f"Python {version} Language Reference (pydoc_data.topics), first {SECOND_TEXT_TOKENS} tokens"


def retrieval_prompts(tokenizer, length: int):
    from diff_transformer.evaluation.niah import PromptBuilder, build_grid, default_haystack

    return build_grid(PromptBuilder(tokenizer, default_haystack(), chat=False), [length], DEPTHS, NEEDLES, seed=0)


@torch.no_grad()
def attention_noise(model, prompts) -> list[float]:
    """Per layer: the noise of the last prompt row outside the needle, averaged over heads and prompts."""
    from diff_transformer.analysis import iter_attention_maps, noise_mass

    per_prompt = []
    for prompt in prompts:
        ids = torch.tensor([prompt.ids])  # (1, N)
        span = (prompt.needle_start, prompt.needle_start + prompt.needle_length)
        layers = iter_attention_maps(model, ids)
        per_prompt.append([noise_mass(e.differential, e.mask, span, queries=-1).mean().item() for e in layers])
    return [sum(layer) / len(layer) for layer in zip(*per_prompt)]


@functools.cache  # the source is every seed's step 0 for the Llama: measured once per process
def measure(path: Path, length: int, text: str = "pydoc") -> dict:
    """Noise per layer (and its mean) and the second text's perplexity of the checkpoint at `path`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import diff_transformer  # noqa: F401  (registers the Auto classes)
    from diff_transformer.evaluation import heldout_perplexity

    transformers_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    noise = attention_noise(model, retrieval_prompts(tokenizer, length))
    block = min(1024, model.config.max_position_embeddings)
    ppl = heldout_perplexity(model, tokenizer, second_text(text), block_size=block, max_tokens=SECOND_TEXT_TOKENS)
    return {"noise": sum(noise) / len(noise), "noise_per_layer": noise, "ppl_text2": ppl, "noise_length": length}


def model_paths(workdir: Path, source: Path, name: str, seed: int) -> tuple[Path, Path]:
    """(step 0, end) checkpoints of one run as continued_pretraining.py lays them out in its --workdir."""
    key = name.split("-")[0]
    start = source if key == "llama" else workdir / f"tiny-diff-{key}-seed{seed}"
    return start, workdir / f"run-{name}-seed{seed}"


def fill(results: dict, workdir: Path, source: Path, length: int, text: str = "pydoc") -> None:
    """Add `measured = {"step0": ..., "end": ...}` to every run of `results["results"]` whose models are in workdir."""
    for name, entry in results["results"].items():
        for seed, run in entry["runs"].items():
            start, end = model_paths(workdir, source, name, int(seed))
            run["measured"] = {"step0": measure(start, length, text), "end": measure(end, length, text)}
    results["second_text"] = second_text_name(text)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", type=Path, help="a continued_pretraining.py results .json (rewritten in place)")
    p.add_argument("--workdir", type=Path, required=True, help="the --workdir that run kept its models in")
    p.add_argument("--source", type=Path, default=None, help="the run's --source (default: the workdir's smollm2/)")
    p.add_argument("--length", type=int, default=1024, help="tokens per retrieval prompt")
    p.add_argument("--second-text", choices=SECOND_TEXTS, default="pydoc", help="the other domain's text")
    args = p.parse_args(argv)
    results = json.loads(args.results.read_text())
    source = args.source or args.workdir.parent / "smollm2"
    fill(results, args.workdir, source, args.length, args.second_text)
    args.results.write_text(json.dumps(results, indent=1))
    print(f"measured {args.results}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
