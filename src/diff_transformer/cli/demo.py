"""`diff-transformer demo`, the offline end-to-end demo: a real (tiny) trained Llama checkpoint -> Diff Transformer
V2, verified; the command (`add_parser`, `run`) and its pipeline, which prints what it did as it goes.

`run_demo()` takes the Llama shipped in `diff_transformer/assets/tiny-llama/` (trained by
`scripts/train_tiny_llama.py` on public-domain Jane Austen novels, with its own byte-level BPE tokenizer), converts
it with `convert_llama_to_diff(..., diff_version=2)`, checks that the conversion preserved the function (max |Δlogit|,
greedy continuations, held-out perplexity), reloads the result through `AutoModelForCausalLM` and generates English
text with both models. It needs no network and prints what it did and the figures; the return value is a process
exit code (0 when every check holds). `scratch_demo()` (`demo --scratch`) builds random Diff V1 and V2 models instead,
saves, reloads and generates.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import UserError, as_one_line, check_seed
from ..evaluation import HELDOUT_TOKENS, format_perplexity, heldout_description, heldout_perplexity
from ..outputs.files import OutputError, check_target
from ..outputs.records import write_manifest, wrote_this
from ..outputs.staging import Staging
from .options import add_quiet_option


if TYPE_CHECKING:
    import torch


ASSET_MODEL = "tiny-llama"
ASSET_HELDOUT = "heldout.txt"
DEFAULT_PROMPT = "Elizabeth could not help smiling at"
DEFAULT_MAX_NEW_TOKENS = 32
DEMO_EVAL_TOKENS = HELDOUT_TOKENS  # the held-out slice the demo (and convert --verify) scores: 16 full windows
LOGIT_ATOL = 1e-4
PPL_RTOL = 1e-5


@contextlib.contextmanager
def shipped_assets():
    """Yield (checkpoint directory, held-out text file) of the shipped tiny Llama as real paths."""
    root = resources.files("diff_transformer").joinpath("assets")
    if isinstance(root, Path) or os.path.isdir(str(root)):
        yield Path(str(root)) / ASSET_MODEL, Path(str(root)) / ASSET_HELDOUT
        return
    with resources.as_file(root) as path:  # zipped installs (Python >= 3.12 extracts directories)
        yield Path(path) / ASSET_MODEL, Path(path) / ASSET_HELDOUT


def _dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


def _indent(text: str, prefix: str = " " * 20) -> str:
    return text.replace("\n", "\n" + prefix)


DEMO_MARK = "diff-transformer demo"
SCRATCH_MARK = "diff-transformer demo --scratch"


def check_demo_output(output, mark: str, overwrite: bool = False) -> tuple[Path, bool]:
    """(--output as an absolute path, whether it must be replaced). A non-empty directory is replaced only when its
    manifest proves that this demo (`mark`) wrote it and nothing changed since, or with `overwrite`; anything else
    (a training run, a model of the user's...) raises `OutputError`."""
    out = check_target(output, name="--output")
    if os.path.lexists(out) and (not out.is_dir() or any(out.iterdir())):
        if overwrite or (out.is_dir() and not out.is_symlink() and wrote_this(out, mark)):
            return out, True
        raise OutputError(
            f"--output {out} holds files that this demo did not write (or that changed since): choose another "
            "directory, or pass --overwrite to replace it."
        )
    return out, False


@contextlib.contextmanager
def demo_output(output, mark: str, overwrite: bool = False):
    """Yield (staging directory, --output): write into the first; on success it becomes --output, with a manifest."""
    out, replace = check_demo_output(output, mark, overwrite)
    staging = Staging(out, overwrite=replace, name="--output", writes=("diff-v1", "diff-v2"))
    with staging as tmp:
        yield tmp, out
        staging.seal()
        write_manifest(tmp, mark)
        staging.install()


@dataclass
class _Loaded:
    """A model of the demo with its tokenizer, its held-out perplexity and the logits behind it."""

    model: torch.nn.Module
    tokenizer: object
    perplexity: float
    logits: list[torch.Tensor]


class _Log:
    """What a demo run prints (to `file`, default stdout) and the figures and checks it records."""

    def __init__(self, figures: dict, file=None):
        self.figures, self.file = figures, file

    def say(self, text: str = "") -> None:
        print(text, file=self.file or sys.stdout, flush=True)

    def fail(self, error: Exception) -> int:
        print(f"error: {as_one_line(str(error))}", file=self.file or sys.stderr, flush=True)
        self.figures.update(ok=False, error=str(error))
        return 2

    def check(self, name: str, ok: bool) -> bool:
        self.figures.setdefault("checks", {})[name] = bool(ok)
        return ok


@contextlib.contextmanager
def _quiet_transformers():
    """transformers' warnings and progress bars off for the demo's own output, restored afterwards."""
    from transformers.utils import logging as hf_logging

    verbosity, progress_bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if progress_bars:
            hf_logging.enable_progress_bar()


def run_demo(
    output_dir: str | os.PathLike | None = None,
    prompt: str = DEFAULT_PROMPT,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    *,
    overwrite: bool = False,
    results: dict | None = None,
    file=None,
) -> int:
    """Convert the shipped tiny Llama to Diff V2 in `output_dir` (default: a temporary directory, removed afterwards),
    verify it, and generate a continuation of `prompt` with both models. Prints to `file` (default stdout; errors to
    stderr); fills `results` (if given) with the figures. Returns 0 when every check holds, 1 when one fails, 2 when
    the conversion cannot run (e.g. `output_dir` is a non-empty directory that this demo did not write, or changed
    since, and `overwrite` is not set)."""
    log = _Log(results if results is not None else {}, file)
    t0 = time.perf_counter()
    with _quiet_transformers(), contextlib.ExitStack() as cleanup:
        if output_dir is None:
            tmp = Path(tempfile.mkdtemp(prefix="diff-demo-"))
            cleanup.callback(shutil.rmtree, tmp, ignore_errors=True)
            out, replace, keep = tmp / "tiny-diff-v2", False, False
        else:
            try:
                out, replace = check_demo_output(output_dir, DEMO_MARK, overwrite)
            except UserError as exc:
                return log.fail(exc)
            keep = True
        with shipped_assets() as (src, heldout_path):
            title = "a trained Llama checkpoint -> Diff Transformer V2 (function-preserving), offline"
            log.say(f"diff-transformer demo: {title}")
            log.say()
            heldout_text = heldout_path.read_text(encoding="utf-8")
            source = _load_source(log, src, heldout_text)
            try:
                _convert_into(log, src, out, replace, keep)
            except UserError as exc:
                return log.fail(exc)
            _verify(log, src, out)
            converted = _load_converted(log, out, source, heldout_text)
            _generate(log, prompt, max_new_tokens, source, converted)
        return _summary(log, t0, out if keep else None)


def _load_source(log: _Log, src: Path, heldout_text: str) -> _Loaded:
    """[1] The source checkpoint, its tokenizer and its held-out perplexity."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(src)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    n_src = sum(p.numel() for p in model.parameters())
    cfg = model.config
    figures = log.figures
    figures.update(
        source_dir=str(src), source_bytes=_dir_size(src), source_parameters=n_src, vocab_size=len(tokenizer)
    )
    log.say(f"[1] source: {src}")
    log.say(
        f"    {type(model).__name__}: {n_src:,} parameters, {cfg.num_hidden_layers} layers, hidden "
        f"{cfg.hidden_size}, {cfg.num_attention_heads} heads / {cfg.num_key_value_heads} KV heads; "
        f"{figures['source_bytes'] / 1e6:.2f} MB on disk"
    )
    log.say(
        f"    tokenizer: byte-level BPE, {len(tokenizer)} entries (bos {tokenizer.bos_token!r}, "
        f"eos {tokenizer.eos_token!r}, pad {tokenizer.pad_token!r}), chat template: "
        f"{'yes' if tokenizer.chat_template else 'no'}"
    )
    ppl, logits = heldout_perplexity(model, tokenizer, heldout_text, max_tokens=DEMO_EVAL_TOKENS, return_logits=True)
    n_eval = min(DEMO_EVAL_TOKENS, len(tokenizer(heldout_text, add_special_tokens=False, verbose=False).input_ids))
    figures.update(source_perplexity=ppl, eval_tokens=n_eval)
    log.say(
        f"    held-out perplexity on {heldout_description(n_eval)}, the first tokens of the last chapters of four "
        f"Austen novels, unseen in training: {format_perplexity(ppl, 4)}  (uniform: {len(tokenizer)})"
    )
    figures["time_load_source_s"] = time.perf_counter() - t
    log.say(f"    ({figures['time_load_source_s']:.1f} s)")
    return _Loaded(model, tokenizer, ppl, logits)


def _convert_into(log: _Log, src: Path, out: Path, replace: bool, keep: bool) -> None:
    """[2] convert_llama_to_diff into `out`; a kept output gets the manifest that lets a later run replace it."""
    from ..conversion import convert_llama_to_diff

    t = time.perf_counter()
    before = _identities(out) if replace else {}
    convert_llama_to_diff(src, out, diff_version=2, progress=False, overwrite=replace)
    if keep:
        # What lets a later run replace this directory without --overwrite; the user's files an --overwrite kept
        # (moved, so with the inodes they had) are not the demo's.
        carried = [name for name, identity in _identities(out).items() if before.get(name) == identity]
        write_manifest(out, DEMO_MARK, exclude=carried)
    figures = log.figures
    figures.update(output_dir=str(out), output_bytes=_dir_size(out), time_convert_s=time.perf_counter() - t)
    log.say()
    log.say(
        f"[2] converted with convert_llama_to_diff(diff_version=2) -> {out if keep else 'a temporary directory'}"
        f" ({figures['output_bytes'] / 1e6:.2f} MB, {figures['time_convert_s']:.1f} s)"
    )


def _identities(directory: Path) -> dict[str, tuple[int, int]]:
    """name -> (device, inode) of each top-level entry of DIRECTORY."""
    found = {}
    for entry in os.scandir(directory) if directory.is_dir() else []:
        info = entry.stat(follow_symlinks=False)
        found[entry.name] = (info.st_dev, info.st_ino)
    return found


def _verify(log: _Log, src: Path, out: Path) -> None:
    """[3] verify_conversion: random token sequences, logits and greedy continuations."""
    from ..conversion import verify_conversion

    t = time.perf_counter()
    report = verify_conversion(src, out)
    log.figures.update(
        verify_max_abs_logit_diff=report["max_abs_logit_diff"],
        verify_greedy_match=report["greedy_match"],
        time_verify_s=time.perf_counter() - t,
    )
    log.say()
    log.say(
        f"[3] verify_conversion ({report['num_sequences']} random sequences of {report['seq_len']} tokens, "
        f"{report['dtype']}): max |Δlogit| = {report['max_abs_logit_diff']:.2e} (tolerance {LOGIT_ATOL:g}), "
        f"greedy continuations identical: {report['greedy_match']}  ({log.figures['time_verify_s']:.1f} s)"
    )
    log.check("verify_logits", report["max_abs_logit_diff"] <= LOGIT_ATOL)
    log.check("verify_greedy", report["greedy_match"])


def _load_converted(log: _Log, out: Path, source: _Loaded, heldout_text: str) -> _Loaded:
    """[4] The converted checkpoint through the Auto classes, on the source's held-out text."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..modeling_diff import DiffForCausalLM

    t = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    n_out = sum(p.numel() for p in model.parameters())
    cfg = model.config
    log.figures.update(converted_class=type(model).__name__, converted_parameters=n_out, diff_version=cfg.diff_version)
    same_vocab = tokenizer.get_vocab() == source.tokenizer.get_vocab()
    log.say()
    log.say(
        f"[4] AutoModelForCausalLM.from_pretrained(converted) -> {type(model).__name__} "
        f"(diff_version={cfg.diff_version}): {n_out:,} parameters, {cfg.num_attention_heads} differential "
        f"heads = {2 * cfg.num_attention_heads} query heads over {cfg.num_key_value_heads} KV heads; "
        f"tokenizer copied: {same_vocab}"
    )
    log.check("converted_class", isinstance(model, DiffForCausalLM) and cfg.diff_version == 2)
    log.check("tokenizer_copied", same_vocab and tokenizer.chat_template == source.tokenizer.chat_template)
    ppl, logits = heldout_perplexity(model, tokenizer, heldout_text, max_tokens=DEMO_EVAL_TOKENS, return_logits=True)
    src_ppl = source.perplexity
    text_diff = max((a - b).abs().max().item() for a, b in zip(source.logits, logits, strict=False))
    log.figures.update(converted_perplexity=ppl, heldout_max_abs_logit_diff=text_diff)
    log.say(
        f"    held-out perplexity on the same {log.figures['eval_tokens']:,} tokens: source "
        f"{format_perplexity(src_ppl, 4)}, converted {format_perplexity(ppl, 4)} "
        f"(relative difference {abs(ppl - src_ppl) / src_ppl:.1e}); max |Δlogit| on that text {text_diff:.2e}"
    )
    log.check("perplexity_equal", abs(ppl - src_ppl) <= PPL_RTOL * src_ppl)
    log.check("heldout_logits", text_diff <= LOGIT_ATOL)
    log.figures["time_converted_eval_s"] = time.perf_counter() - t
    return _Loaded(model, tokenizer, ppl, logits)


def _generate(log: _Log, prompt: str, max_new_tokens: int, source: _Loaded, converted: _Loaded) -> None:
    """[5] Greedy continuations of `prompt` by both models, which must be token-identical."""
    import torch

    t = time.perf_counter()
    inputs = source.tokenizer(prompt, return_tensors="pt")
    kwargs = {"max_new_tokens": max_new_tokens, "do_sample": False, "num_beams": 1}
    with torch.no_grad():
        src_tokens = source.model.generate(**inputs, **kwargs)
        t_src = time.perf_counter() - t
        out_tokens = converted.model.generate(**inputs, **kwargs)
    t_out = time.perf_counter() - t - t_src
    new = slice(inputs.input_ids.shape[1], None)
    src_text = source.tokenizer.decode(src_tokens[0, new], skip_special_tokens=True)
    out_text = converted.tokenizer.decode(out_tokens[0, new], skip_special_tokens=True)
    same = torch.equal(src_tokens, out_tokens)
    log.figures.update(
        prompt=prompt,
        source_generation=src_text,
        converted_generation=out_text,
        generated_tokens=int(src_tokens.shape[1] - inputs.input_ids.shape[1]),
        generations_identical=same,
        time_generate_source_s=t_src,
        time_generate_converted_s=t_out,
    )
    settings = ", ".join(
        f"{k}={v}"
        for k, v in converted.model.generation_config.to_diff_dict().items()
        if k in ("repetition_penalty", "no_repeat_ngram_size")
    )
    log.say()
    log.say(
        f"[5] greedy continuation of {prompt!r} ({max_new_tokens} new tokens at most"
        f"{', ' + settings if settings else ''}, from generation_config.json):"
    )
    log.say(f"    Llama ({t_src:.2f} s): " + _indent(prompt + src_text))
    log.say(f"    Diff  ({t_out:.2f} s): " + _indent(prompt + out_text))
    log.say(f"    token-identical: {same}")
    log.check("generations_identical", same)


def _summary(log: _Log, t0: float, kept: Path | None) -> int:
    """PASS or FAIL with the failed checks; the exit code."""
    figures = log.figures
    ok = all(figures["checks"].values())
    figures["ok"] = ok
    figures["time_total_s"] = time.perf_counter() - t0
    failed = [name for name, passed in figures["checks"].items() if not passed]
    verdict = (
        "the converted Diff V2 model computes the same function as the source Llama"
        if ok
        else "checks failed: " + ", ".join(failed)
    )
    log.say()
    log.say(f"{'PASS' if ok else 'FAIL'}: {verdict}  (total {figures['time_total_s']:.1f} s)")
    if kept is not None:
        log.say(f"converted checkpoint kept at {kept}")
    return 0 if ok else 1


def scratch_demo(output_dir: str | os.PathLike | None, seed: int, *, overwrite: bool = False) -> int:
    """Build small Diff models of both versions, save them, reload through AutoModelForCausalLM, generate."""
    if output_dir is None:
        with tempfile.TemporaryDirectory(prefix="diff-demo-") as tmp:
            return _scratch_models(seed, Path(tmp), shown=None)
    with demo_output(output_dir, SCRATCH_MARK, overwrite=overwrite) as (tmp, out):
        return _scratch_models(seed, tmp, shown=out)


def _scratch_models(seed: int, out: Path, shown: Path | None) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    from diff_transformer import DiffConfig, DiffForCausalLM

    prompt = torch.tensor([[1, 17, 42, 7, 99, 3]])
    for version in (1, 2):
        torch.manual_seed(seed)
        config = DiffConfig(
            vocab_size=256,
            hidden_size=128,
            intermediate_size=344,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            diff_version=version,
        )
        model = DiffForCausalLM(config).eval()
        path = out / f"diff-v{version}"
        model.save_pretrained(path)
        reloaded = AutoModelForCausalLM.from_pretrained(path).eval()
        with torch.no_grad():  # also the first forward, whose one-time set-up the tokens/s below would count
            same = torch.equal(model(prompt).logits, reloaded(prompt).logits)
        start = time.perf_counter()
        generated = reloaded.generate(prompt, max_new_tokens=16, min_new_tokens=16, do_sample=False)
        seconds = time.perf_counter() - start
        params = sum(p.numel() for p in reloaded.parameters())
        where = (
            shown / path.name if shown is not None else "a temporary directory (removed at exit; --output keeps it)"
        )
        print(f"Diff V{version}: {params / 1e6:.2f}M params, saved to {where}")
        print(
            f"  reloaded as {type(reloaded).__name__} via AutoModelForCausalLM; logits identical after reload: {same}"
        )
        print(f"  greedy tokens: {generated[0, prompt.shape[1] :].tolist()} ({16 / seconds:.0f} tokens/s)")
        if not same:
            return 1
    return 0


def add_parser(commands) -> None:
    demo = commands.add_parser(
        "demo", help="offline demo: convert the shipped tiny Llama to Diff V2, verify, generate"
    )
    demo.add_argument("--output", help="where to write the converted model (default: a temporary directory)")
    demo.add_argument("--prompt", help=f"English prompt to continue (default: {DEFAULT_PROMPT!r})")
    demo.add_argument("--scratch", action="store_true", help="instead: build, save, reload random Diff V1/V2 models")
    demo.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a non-empty --output that is not an unchanged earlier demo output",
    )
    demo.add_argument("--seed", type=int, default=0, help="seed of --scratch's random models")
    add_quiet_option(demo)
    demo.set_defaults(func=run, early_check=_check_options)


def run(args) -> int:
    """Offline main job: the shipped tiny Llama (real tokenizer, trained on Austen) -> Diff V2, verified,
    generating."""
    _check_options(args)
    if args.scratch:
        return scratch_demo(args.output, args.seed, overwrite=args.overwrite)
    kwargs = {"prompt": args.prompt} if args.prompt else {}
    return run_demo(args.output, overwrite=args.overwrite, **kwargs)


def _check_options(args) -> None:
    """Before torch loads (`cli.main`), and again in `run` for its callers."""
    check_seed(args.seed, "--seed")  # a seed past 2**64 would overflow deep inside torch


__all__ = [
    "DEFAULT_PROMPT",
    "DEMO_EVAL_TOKENS",
    "check_demo_output",
    "demo_output",
    "heldout_perplexity",
    "run_demo",
    "scratch_demo",
    "shipped_assets",
]
