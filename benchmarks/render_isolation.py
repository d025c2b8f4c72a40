#!/usr/bin/env python
"""The cost of rendering chat templates in a worker process (`serving.render_pool`, what `diff-transformer serve`
does) and in a forked child (`chat_templates.render_in_fork`, what the CLI does) against rendering in the calling
process: the shipped tiny Llama's template on a three-message chat, renders
interleaved in pairs, median time per render of each, and the worker's start-up time (its imports).

    python benchmarks/render_isolation.py [--renders 200]
"""

from __future__ import annotations

import argparse
import time

import bench_common  # noqa: F401  (puts the checkout's src/ first on sys.path)


# isort: split
from transformers import AutoTokenizer

from diff_transformer.generation import chat_templates
from diff_transformer.generation.chat_templates import render_chat
from diff_transformer.serving.render_pool import RenderPool

from bench_common import median


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--renders", type=int, default=200)
    args = parser.parse_args()
    from pathlib import Path

    import diff_transformer

    tokenizer = AutoTokenizer.from_pretrained(Path(diff_transformer.__file__).parent / "assets" / "tiny-llama")
    messages = [
        {"role": "system", "content": "You are a novelist."},
        {"role": "user", "content": "Describe a ball at Netherfield."},
        {"role": "assistant", "content": "The candles were lit and the music began."},
    ]
    pool = RenderPool(1)
    start = time.perf_counter()
    pool.warm()
    pool.idle.put(pool.idle.get())  # waits for the worker to be up
    startup = time.perf_counter() - start
    inline, isolated, forked = [], [], []
    try:
        for _ in range(args.renders):
            targets = ((chat_templates.in_process, inline), (pool.render, isolated), (None, forked))
            for target, times in targets:
                chat_templates.isolate(target)
                start = time.perf_counter()
                render_chat(tokenizer, messages, add_generation_prompt=True)
                times.append(time.perf_counter() - start)
    finally:
        chat_templates.isolate(None)
        pool.close()
    print(f"worker start-up: {startup:.1f} s")
    print(f"in process: {median(inline) * 1e3:.3f} ms per render")
    print(f"worker:     {median(isolated) * 1e3:.3f} ms per render ({median(isolated) / median(inline):.1f}x)")
    print(f"fork:       {median(forked) * 1e3:.3f} ms per render ({median(forked) / median(inline):.1f}x)")


if __name__ == "__main__":
    main()
