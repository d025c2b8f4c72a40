"""What the benchmark scripts share: the checkout on sys.path, the compared models' common configuration, timing,
process memory, interleaving, the median/ratio arithmetic of the reports and the run's provenance.

Importing this module puts the checkout's src/ first on sys.path (a checkout is benchmarked as it is, installed or
not), so a script imports it before anything of diff_transformer. It imports only the standard library and torch
(bench_convert.py measures RSS after imports: transformers stays out of its baseline).
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path


REPO = Path(__file__).resolve().parent.parent
if (REPO / "src" / "diff_transformer").is_dir():
    sys.path.insert(0, str(REPO / "src"))

import torch  # noqa: E402


# ----------------------------------------------------------------------------------------------------------- models
def config_kwargs(size: dict, max_positions: int) -> dict:
    """The configuration every compared model shares (same embeddings, MLP, norms, vocab, untied head)."""
    return dict(
        vocab_size=size["vocab"],
        hidden_size=size["hidden"],
        intermediate_size=size["intermediate"],
        num_hidden_layers=size["layers"],
        head_dim=size["head_dim"],
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        max_position_embeddings=max_positions,
    )


def same_matrices_model(name: str, size: dict, common: dict):
    """(class, config) of the models with exactly Llama's attention matrices: Llama itself, transformers' DiffLlama
    (which pairs Llama's heads) and Diff V1 with 2H = Llama's heads and 2H_kv = its KV heads; None for another name
    (each benchmark lays out its V2 variants itself)."""
    from transformers import DiffLlamaConfig, DiffLlamaForCausalLM, LlamaConfig, LlamaForCausalLM

    from diff_transformer import DiffConfig, DiffForCausalLM

    n_h, n_kv = size["heads"], size["kv_heads"]
    if name == "llama":
        return LlamaForCausalLM, LlamaConfig(num_attention_heads=n_h, num_key_value_heads=n_kv, **common)
    if name == "diffllama":
        return DiffLlamaForCausalLM, DiffLlamaConfig(num_attention_heads=n_h, num_key_value_heads=n_kv, **common)
    if name == "v1":  # 2H = Llama's heads, 2H_kv = Llama's KV heads: identical matrices
        heads = dict(num_attention_heads=n_h // 2, num_key_value_heads=n_kv // 2)
        return DiffForCausalLM, DiffConfig(diff_version=1, **heads, **common)
    return None


def n_params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def random_ids(n: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (1, n), generator=g)


# ----------------------------------------------------------------------------------------------------------- timing
def timed(fn, sync=None) -> float:
    """Seconds of one call of `fn`; `sync` (e.g. a CUDA synchronize) runs before and after, so the time covers the
    queued device work too."""
    if sync is not None:
        sync()
    t0 = time.perf_counter()
    fn()
    if sync is not None:
        sync()
    return time.perf_counter() - t0


class StepClock:
    """A no-op logits processor (generate calls it once per forward) that timestamps every generation step. `sync`
    runs before the first stamp only: prefill is then finished, and the decode loop stays unsynchronised, as in real
    use."""

    def __init__(self, sync=None):
        self.sync, self.times = sync, []

    def __call__(self, input_ids, scores):
        if not self.times and self.sync is not None:
            self.sync()
        self.times.append(time.perf_counter())
        return scores


def greedy_generate(lm, ids, new_tokens: int, clock: StepClock, **kwargs):
    """Greedy `generate` of exactly `new_tokens` tokens after `ids`, stepped by `clock`; raises when it stopped
    early or ran fewer than two steps (nothing to time)."""
    from transformers.generation import LogitsProcessorList

    out = lm.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        pad_token_id=0,
        logits_processor=LogitsProcessorList([clock]),
        **kwargs,
    )
    if out.shape[1] != ids.shape[1] + new_tokens or len(clock.times) < 2:
        raise RuntimeError(f"generate returned {tuple(out.shape)} after {len(clock.times)} steps")
    return out


def rotated(names: list, rep: int) -> list:
    """`names` started at index rep (mod len): interleaved repetitions rotate the order so no model always runs
    first (or right after the same neighbour)."""
    return names[rep % len(names) :] + names[: rep % len(names)]


def make_log(t_start: float):
    """print-like logger to stderr, each line stamped with the seconds since `t_start`."""

    def log(msg: str):
        print(f"[{time.perf_counter() - t_start:7.1f}s] {msg}", file=sys.stderr, flush=True)

    return log


# ----------------------------------------------------------------------------------------------------------- memory
def proc_status_kb(field: str) -> int:
    """A kB field of /proc/self/status (VmRSS, VmHWM); 0 where there is none (not Linux)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def reset_peak_rss() -> bool:
    """Resets VmHWM to the current RSS (Linux >= 4.0); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# -------------------------------------------------------------------------------------------------------- reporting
def median(xs) -> float:
    xs = list(xs)
    return statistics.median(xs) if xs else float("nan")


def median_ratio(values, refs) -> float:
    """Median over repetitions of value / reference of the same repetition (paired: drift that hits both cancels)."""
    return median(v / r for v, r in zip(values, refs))


def recorded_argv(argv) -> list[str]:
    """The command line as the committed results record it: an absolute path outside the repository becomes
    DIR/<its name> (the machine's directories are not the results' to publish)."""

    def recorded(argument: str) -> str:
        option, equals, value = argument.partition("=") if argument.startswith("--") else ("", "", argument)
        path = Path(value)
        if path.is_absolute():
            value = str(path.relative_to(REPO)) if path.is_relative_to(REPO) else f"DIR/{path.name}"
        return option + equals + value

    return [recorded(a) for a in (sys.argv[1:] if argv is None else argv)]


def provenance() -> dict:
    """When and with what a run was made: date, the checkout's revision, torch, transformers and Python versions."""
    import transformers

    return {
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "git": git_rev(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }


def git_rev() -> str:
    """Short commit of the checkout, naming the src/ files with uncommitted changes; "unknown" outside git."""
    try:
        rev = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "src"], capture_output=True, text=True
        ).stdout.split("\n")
        dirty = [line[3:] for line in dirty if line.strip()]
        return rev + (f" + uncommitted src changes ({', '.join(dirty)})" if dirty else "") if rev else "unknown"
    except OSError:
        return "unknown"


def write_report(data: dict, text: str, json_path: Path | None, md_path: Path | None) -> None:
    """A run's report: TEXT printed, DATA written as JSON and TEXT as markdown where their paths are given."""
    import json

    print(text)
    if json_path:
        json_path.write_text(json.dumps(data, indent=1) + "\n")
    if md_path:
        md_path.write_text(text)


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
