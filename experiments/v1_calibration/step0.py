"""Step-0 perplexity of Llama -> Diff V1 conversions against their source on several domains, for choosing and
documenting the V1 calibration (docs/converting.md, "Step 0 on other domains"; issue 47).

For each configuration (source, layout, calibration data, ridge strengths, held-out blocks, seed) it converts the
source with `convert_llama_to_diff(diff_version=1)` into a scratch directory, scores source and conversion on the
same token blocks of three texts, and appends one JSON line to --results (configurations already there are skipped,
so an interrupted run resumes). The texts, read at run time, never downloaded:

* Austen: the package's held-out text (assets/heldout.txt, not the built-in calibration text);
* pydoc: the Python Language Reference as CPython ships it for `help()` (`pydoc_data.topics`, sorted topics);
* code: Python source, the running interpreter's `argparse.py`.

Each is scored on BLOCKS blocks of 256 tokens (bos first), spread evenly over the text.

    python experiments/v1_calibration/step0.py --source DIR --layout expanded --calibration sampled --seed 0

--ridges, --heldout and --prior source run the constrained fits of fits.py instead of the converter's plain one.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch


sys.path.insert(0, str(Path(__file__).parent))
from fits import constrained_fits  # noqa: E402


BLOCKS, BLOCK = 8, 256


def domains() -> dict[str, str]:
    import argparse as argparse_module
    from pydoc_data.topics import topics

    from diff_transformer.conversion.calibrate import BUILTIN_TEXT

    return {
        "austen": (BUILTIN_TEXT.parent / "heldout.txt").read_text(encoding="utf-8"),
        "pydoc": "\n\n".join(topics[name] for name in sorted(topics)),
        "code": inspect.getsource(argparse_module),
    }


def blocks_of(tokenizer, text: str) -> torch.Tensor:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    bos = tokenizer.bos_token_id
    body = BLOCK - (bos is not None)
    starts = torch.linspace(0, len(ids) - body, BLOCKS).round().long().tolist()
    return torch.tensor([([bos] if bos is not None else []) + ids[s : s + body] for s in starts])  # (BLOCKS, BLOCK)


@torch.no_grad()
def loss(model, blocks: torch.Tensor) -> float:
    total = 0.0
    for row in blocks.split(2):
        total += float(model(row, labels=row).loss) * row.shape[0]
    return total / blocks.shape[0]


def scores(path, evaluation) -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    import diff_transformer  # noqa: F401  (registers the Diff classes)

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return {name: loss(model, blocks) for name, blocks in evaluation.items()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", required=True)
    parser.add_argument("--layout", choices=("paired", "expanded"), default=None)
    parser.add_argument("--calibration", default="sampled", help="sampled, austen (the built-in text) or a file")
    parser.add_argument("--ridges", default="1e-4", help="comma-separated relative ridge strengths tried per layer")
    parser.add_argument("--heldout", type=int, default=0, help="calibration blocks held out to choose λ and ridge")
    parser.add_argument("--blocks", type=int, default=16, help="calibration blocks")
    parser.add_argument("--prior", choices=("zero", "source"), default="zero", help="what the ridge shrinks o_proj to")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--steady-value",
        type=float,
        default=0.0,
        help="expanded: the steady second value half, k x the first (the converter's default: 10; 0: none)",
    )
    parser.add_argument("--results", default="experiments/v1_calibration/results/step0.jsonl")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    from transformers import AutoTokenizer
    from transformers.utils import logging as transformers_logging

    from diff_transformer.conversion import calibrate, convert_llama_to_diff

    transformers_logging.set_verbosity_error()
    ridges = tuple(float(r) for r in args.ridges.split(","))
    key = {
        "source": Path(args.source).name,
        "layout": args.layout,
        "calibration": args.calibration,
        "ridges": list(ridges),
        "heldout": args.heldout,
        "prior": args.prior,
        "blocks": args.blocks,
        "seed": args.seed,
    }
    if args.steady_value:
        key["steady_value"] = args.steady_value
    results = Path(args.results)
    done = [json.loads(line) for line in results.read_text().splitlines()] if results.exists() else []
    if any(row["config"] == key for row in done):
        print("done already:", key)
        return
    tokenizer = AutoTokenizer.from_pretrained(args.source)
    evaluation = {name: blocks_of(tokenizer, text) for name, text in domains().items()}
    source_key = {"source": key["source"], "source_scores": True}
    source = next((row["loss"] for row in done if row["config"] == source_key), None)
    if source is None:
        source = scores(args.source, evaluation)
        with results.open("a") as handle:
            handle.write(json.dumps({"config": source_key, "loss": source}) + "\n")

    original = calibrate.calibrate_v1_start

    def steady(*a, **k):  # this configuration's steady value over the converter's (0: rows recorded without the key)
        return original(*a, **{**k, "steady_value": args.steady_value})

    calibrate.calibrate_v1_start = steady
    sample = calibrate.sample_calibration_blocks

    def cached(path, num_blocks, block_size, seed, *more, **options):  # the same blocks for every configuration
        cache = Path(tempfile.gettempdir()) / f"v1step0-{Path(path).name}-{num_blocks}x{block_size}-{seed}.pt"
        if not cache.exists():
            torch.save(sample(path, num_blocks, block_size, seed, *more, **options), cache)
        return torch.load(cache)

    calibrate.sample_calibration_blocks = cached
    data = {"sampled": None, "austen": calibrate.BUILTIN_TEXT}.get(args.calibration, args.calibration)
    out = Path(tempfile.mkdtemp(prefix="v1step0-")) / "out"
    began = time.perf_counter()
    fits = constrained_fits(ridges, heldout=args.heldout, towards_source=args.prior == "source")
    try:
        with fits as chosen_ridges:
            convert_llama_to_diff(
                args.source,
                out,
                diff_version=1,
                v1_layout=args.layout,
                calibration_data=data,
                calibration_blocks=args.blocks,
                seed=args.seed,
                progress=False,
            )
        seconds = time.perf_counter() - began
        converted = scores(out, evaluation)
        conversion = json.loads((out / "config.json").read_text())["conversion"]
    finally:
        shutil.rmtree(out.parent, ignore_errors=True)
        calibrate.calibrate_v1_start, calibrate.sample_calibration_blocks = original, sample
    row = {
        "config": key,
        "loss": converted,
        "ratio": {name: round(math.exp(converted[name] - source[name]), 4) for name in converted},
        "source_ppl": {name: round(math.exp(value), 3) for name, value in source.items()},
        "ppl": {name: round(math.exp(value), 3) for name, value in converted.items()},
        "layout": conversion.get("v1_layout"),
        "lambda_start": conversion.get("lambda_start"),
        "residual": conversion.get("subln_relative_residual"),
        "chosen_ridges": chosen_ridges,
        "convert_seconds": round(seconds, 1),
        "machine": f"{platform.machine()}, 1 torch thread, 2 shared cores",
        "python": platform.python_version(),
    }
    with results.open("a") as handle:
        handle.write(json.dumps(row) + "\n")
    print(json.dumps({k: row[k] for k in ("config", "ratio", "ppl", "convert_seconds")}))


if __name__ == "__main__":
    main()
