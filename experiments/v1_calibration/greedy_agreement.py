"""What a "close" V1 start does to answers: the share of held-out positions where a V1 conversion at step 0 predicts
the same next token as its source (teacher-forced argmax agreement), on the three texts of step0.py, and one chat
answer of each, greedy (docs/converting.md, "What step 0 does to answers"; issue 57 item 6).

    python experiments/v1_calibration/greedy_agreement.py --source DIR --converted DIR --json results/FILE.json

Both models score the same BLOCKS x BLOCK token blocks (step0.py's `blocks_of`); agreement is counted over every
predicted position, with a 95 % Wilson interval over positions (positions within a block are not independent, so the
interval is narrower than the truth; the spread across the three texts is the honest one).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
from pathlib import Path

import torch


sys.path.insert(0, str(Path(__file__).parent))
from step0 import BLOCK, BLOCKS, blocks_of, domains  # noqa: E402


QUESTION = "What is the capital of France?"


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return centre - half, centre + half


@torch.no_grad()
def next_tokens(model, blocks: torch.Tensor) -> torch.Tensor:
    return torch.cat([model(input_ids=row).logits.argmax(-1)[:, :-1] for row in blocks.split(2)])  # (B, L-1)


@torch.no_grad()
def chat_answer(model, tokenizer, max_new_tokens: int = 24) -> str:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTION}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    out = model.generate(input_ids=ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", required=True)
    parser.add_argument("--converted", required=True)
    parser.add_argument("--json", required=True)
    args = parser.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import diff_transformer  # noqa: F401  (registers model_type "diff")

    tokenizer = AutoTokenizer.from_pretrained(args.source)
    source = AutoModelForCausalLM.from_pretrained(args.source, dtype=torch.float32).eval()
    converted = AutoModelForCausalLM.from_pretrained(args.converted, dtype=torch.float32).eval()
    rows = {}
    for name, text in domains().items():
        blocks = blocks_of(tokenizer, text)
        same = next_tokens(source, blocks) == next_tokens(converted, blocks)
        k, n = int(same.sum()), same.numel()
        rows[name] = {"agree": k, "positions": n, "share": k / n, "wilson95": wilson(k, n)}
        print(f"{name}: {k}/{n} = {k / n:.3f} next tokens equal", flush=True)
    answers = {"source": chat_answer(source, tokenizer), "converted": chat_answer(converted, tokenizer)}
    print(json.dumps(answers, ensure_ascii=False, indent=1))
    record = {
        "source": args.source,
        "converted": args.converted,
        "blocks": [BLOCKS, BLOCK],
        "texts": rows,
        "question": QUESTION,
        "answers": answers,
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
