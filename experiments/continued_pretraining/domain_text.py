"""The training and held-out texts of a continued-pretraining run on another domain than the shipped Austen corpus,
written at run time from what the running interpreter ships, never downloaded (issue 47, item 4).

* `pydoc`: the Python Language Reference as CPython ships it for `help()` (`pydoc_data.topics`; the same text as the
  V1 step-0 table in docs/converting.md and the SmolLM2 conversion test). The topics in sorted order; every
  HELDOUT_EVERY-th of them (the 4th, 8th, ...) is held out, the rest is the training text, so the two share the
  domain but no passage. Technical English with code and grammar notation: far from Austen, and far from the text
  sampled from the source that the default V1 start is fitted on.

    python experiments/continued_pretraining/domain_text.py pydoc OUTDIR   # OUTDIR/train.txt, OUTDIR/heldout.txt
"""

from __future__ import annotations

import argparse
import platform
from pathlib import Path


HELDOUT_EVERY = 4


def pydoc_split() -> tuple[str, str]:
    """(training text, held-out text) of the Python Language Reference, split by topic."""
    from pydoc_data.topics import topics

    names = sorted(topics)
    held = {name for i, name in enumerate(names, start=1) if i % HELDOUT_EVERY == 0}
    train = "\n\n".join(topics[name] for name in names if name not in held)
    heldout = "\n\n".join(topics[name] for name in names if name in held)
    return train, heldout


def describe(domain: str) -> str:
    assert domain == "pydoc"
    return (
        f"the Python {platform.python_version()} Language Reference (pydoc_data.topics; every {HELDOUT_EVERY}th topic "
        "in sorted order held out, the rest trained on)"
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("domain", choices=["pydoc"])
    p.add_argument("out", type=Path, help="a folder: train.txt and heldout.txt are written in it")
    args = p.parse_args(argv)
    train, heldout = pydoc_split()
    args.out.mkdir(parents=True, exist_ok=True)
    for name, text in (("train.txt", train), ("heldout.txt", heldout)):
        part = args.out / f"{name}.part"  # never a half-written text that a resumed run would take for the whole
        part.write_text(text, encoding="utf-8")
        part.replace(args.out / name)
    print(f"{args.out}: {len(train):,} characters to train on, {len(heldout):,} held out ({describe(args.domain)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
