"""The `diff-transformer` command: demo, convert, generate, inspect, train, serve."""

import argparse
import logging
import math
import sys
import tempfile
import time
from pathlib import Path

from diff_transformer.errors import UserError


def _demo(args) -> int:
    """Offline main job: the shipped tiny Llama (real tokenizer, trained on Austen) -> Diff V2, verified,
    generating."""
    if args.scratch:
        return _scratch_demo(args)
    from diff_transformer.demo import run_demo

    kwargs = {"prompt": args.prompt} if args.prompt else {}
    return run_demo(args.output, overwrite=args.overwrite, **kwargs)


def _scratch_demo(args) -> int:
    """Build small Diff models of both versions, save them, reload through AutoModelForCausalLM, generate."""
    from diff_transformer.demo import SCRATCH_MARK, demo_output

    if args.output is None:
        with tempfile.TemporaryDirectory(prefix="diff-demo-") as tmp:
            return _scratch_models(args, Path(tmp), shown=None)
    with demo_output(args.output, SCRATCH_MARK, overwrite=args.overwrite) as (tmp, out):
        return _scratch_models(args, tmp, shown=out)


def _scratch_models(args, out: Path, shown: Path | None) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    from diff_transformer import DiffConfig, DiffForCausalLM

    prompt = torch.tensor([[1, 17, 42, 7, 99, 3]])
    for version in (1, 2):
        torch.manual_seed(args.seed)
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
        start = time.perf_counter()
        generated = reloaded.generate(prompt, max_new_tokens=16, min_new_tokens=16, do_sample=False)
        seconds = time.perf_counter() - start
        with torch.no_grad():
            same = torch.equal(model(prompt).logits, reloaded(prompt).logits)
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


def _convert(args) -> int:
    import json

    from diff_transformer.conversion import convert_to_diff, verify_conversion

    out = convert_to_diff(
        args.src,
        args.out,
        diff_version=args.diff_version,
        dtype=args.dtype,
        overwrite=args.overwrite,
        progress=not args.quiet,
        **{k: v for k, v in (("v1_init", args.v1_init), ("calibration_data", args.calibration_data)) if v is not None},
    )
    print(f"wrote {out}")
    conversion = json.loads((Path(out) / "config.json").read_text(encoding="utf-8")).get("conversion") or {}
    if conversion.get("v1_init") == "calibrated":
        blocks, length = conversion["calibration_tokens"]
        print(
            f"V1 calibrated on {conversion['calibration_text']} ({blocks} blocks x {length} tokens): sub-layer norm "
            "gains fitted by least squares, λ = 0 at step 0 (λ_init 0, mirrored λ vectors); relative residual per "
            f"layer {conversion['subln_relative_residual']}."
        )
    if args.diff_version == 1 and conversion.get("source_model_type") != "diffllama":
        print(
            "note: diff_version=1 re-pairs the Llama heads: not function-preserving (--v1-init calibrated starts "
            "closest); continue pretraining."
        )
    if args.verify:
        report = verify_conversion(args.src, out)
        greedy = "" if report["greedy_match"] is None else f", greedy continuations match: {report['greedy_match']}"
        print(
            f"verify (against {report['reference']}, both run in {report['dtype']}): max |Δlogit| = "
            f"{report['max_abs_logit_diff']:.3g}{greedy}"
        )
        if report["expected_exact"] and not report["passed"]:
            return 1
    return 0


def _generate(args) -> int:
    import torch
    from transformers import AutoConfig, AutoTokenizer

    from diff_transformer.loading import check_diff_checkpoint, load_causal_lm, resolve_model

    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens {args.max_new_tokens} must be at least 1.")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise UserError(f"--temperature {args.temperature} must be a number >= 0 (0 = greedy).")
    # Everything about the inputs is checked before the weights load.
    location, local = resolve_model(args.model)
    if local is not None:
        check_diff_checkpoint(local)
    tokenizer = _tokenizer(AutoTokenizer, location, local, args.model)
    if tokenizer is not None:
        inputs = tokenizer(args.prompt, return_tensors="pt")
        ids = inputs["input_ids"][0].tolist()
    else:
        try:
            ids = [int(t) for t in args.prompt.split()]
        except ValueError:
            raise UserError(
                f"MODEL {args.model} has no tokenizer, so PROMPT must be space-separated token ids like '5 6 7', not "
                f"{args.prompt!r}: pass token ids, or save a tokenizer with the model."
            ) from None
        inputs = {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long)}
    if not ids:
        raise UserError("PROMPT is empty: pass some text (or token ids).")
    try:
        vocab = AutoConfig.from_pretrained(location).get_text_config().vocab_size
    except Exception as exc:
        raise UserError(
            f"cannot read the config of MODEL {args.model} ({' '.join(str(exc).split())[:200]})."
        ) from None
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise UserError(
            f"token id {bad[0]} in PROMPT is out of range for MODEL {args.model}: use ids from 0 to {vocab - 1}."
        )
    model = load_causal_lm(args.model).eval()
    kwargs = dict(max_new_tokens=args.max_new_tokens, do_sample=args.temperature > 0)
    if args.temperature > 0:
        kwargs["temperature"] = args.temperature
    output = model.generate(**inputs, **kwargs)[0, inputs["input_ids"].shape[1] :]
    print(
        tokenizer.decode(output, skip_special_tokens=True)
        if tokenizer is not None
        else " ".join(map(str, output.tolist()))
    )
    return 0


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


def _tokenizer(auto_tokenizer, location: str, local: Path | None, shown: str):
    """The model's tokenizer; None when it has none (prompts are then token ids)."""
    has_files = local is not None and any((local / name).is_file() for name in _TOKENIZER_FILES)
    try:
        return auto_tokenizer.from_pretrained(location)
    except Exception as exc:  # transformers raises OSError, ValueError, TypeError... for a missing or broken tokenizer
        if has_files:
            message = " ".join(str(exc).split())[:200]
            raise UserError(
                f"the tokenizer files of MODEL {shown} cannot be loaded ({message}): restore them."
            ) from None
        return None


def _output_file(path: str, option: str, overwrite: bool, suffixes=None) -> Path:
    """A file the command will write: its directory exists, it is not there already (or --overwrite), its suffix
    fits."""
    out = Path(path)
    if suffixes is not None and out.suffix.lower().lstrip(".") not in suffixes:
        choices = ", ".join(f".{suffix}" for suffix in sorted(suffixes))
        raise UserError(f"{option} {path} needs a file suffix it can be written as: one of {choices}.")
    if not out.parent.is_dir():
        raise UserError(f"{option} {path}: directory {out.parent} does not exist; create it first.")
    if out.is_dir():
        raise UserError(f"{option} {path} is a directory: give a file name.")
    if out.exists() and not overwrite:
        raise UserError(f"{option} {path} already exists: pass --overwrite to replace it, or choose another name.")
    return out


def _write_atomically(out: Path, write) -> None:
    """`write(temporary path)` next to OUT, then rename it onto OUT: a failed write leaves nothing half-written."""
    import os

    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=out.suffix)
    os.close(fd)
    try:
        write(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it private: the permissions of any file the user creates
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _inspect(args) -> int:
    """Attention maps of one head (A1, A2, A1 - λA2, λ per layer) as a figure, and optionally every map as JSON."""
    import json
    from types import SimpleNamespace

    import torch

    from diff_transformer.analysis import attention_maps, layer_metrics, model_kind
    from diff_transformer.loading import load_causal_lm, resolve_model
    from diff_transformer.plotting import _matplotlib, head_figure

    Figure, _ = _matplotlib()  # before anything loads: a missing matplotlib is one line
    figure_types = set(Figure().canvas.get_supported_filetypes())
    out = _output_file(args.out, "--out", args.overwrite, suffixes=figure_types)
    json_out = _output_file(args.json, "--json", args.overwrite, suffixes={"json"}) if args.json else None
    grid_out = _output_file(args.grid, "--grid", args.overwrite, suffixes=figure_types) if args.grid else None
    named = [path.resolve() for path in (out, json_out, grid_out) if path is not None]
    if len(set(named)) < len(named):
        raise UserError("--out, --json and --grid name the same file: give each a different name.")
    if args.metric in ("answer", "noise") and args.grid and not args.span:
        raise UserError(f"--metric {args.metric} needs --span START:STOP (the answer's token positions).")
    location, local = resolve_model(args.model)
    from transformers import AutoConfig, AutoTokenizer

    import diff_transformer  # noqa: F401  (registers the Auto classes: AutoConfig reads Diff configs)

    tokenizer = _tokenizer(AutoTokenizer, location, local, args.model)
    if tokenizer is not None:
        ids = tokenizer(args.text, return_tensors="pt")["input_ids"]
    else:
        try:
            ids = torch.tensor([[int(t) for t in args.text.split()]])
        except ValueError:
            raise UserError(
                f"MODEL {args.model} has no tokenizer, so TEXT must be space-separated token ids like '5 6 7', not "
                f"{args.text!r}: pass token ids, or save a tokenizer with the model."
            ) from None
    if ids.numel() == 0:
        raise UserError("TEXT is empty: pass some text (or token ids).")
    # Everything about the inputs is checked before the weights load.
    try:
        config = AutoConfig.from_pretrained(location)
    except Exception as exc:
        raise UserError(
            f"cannot read the config of MODEL {args.model} ({' '.join(str(exc).split())[:200]})."
        ) from None
    try:
        kind = model_kind(SimpleNamespace(config=config))
    except ValueError as error:
        raise UserError(f"MODEL {args.model}: {error}") from None
    layers = config.num_hidden_layers
    heads = config.num_attention_heads // (2 if kind == "diffllama" else 1)  # DiffLlama pairs head h with h + H/2
    if not 0 <= args.layer < layers:
        raise UserError(f"--layer {args.layer} is out of range: MODEL {args.model} has layers 0 to {layers - 1}.")
    if not 0 <= args.head < heads:
        raise UserError(
            f"--head {args.head} is out of range: MODEL {args.model} has heads 0 to {heads - 1} per layer."
        )
    vocab = config.vocab_size
    if not ((0 <= ids) & (ids < vocab)).all():
        raise UserError(f"a token id in TEXT is out of range for MODEL {args.model}: use ids from 0 to {vocab - 1}.")
    span = None
    if args.span:
        try:
            span = tuple(int(part) for part in args.span.split(":"))
        except ValueError:
            span = ()
        if len(span) != 2 or not 0 <= span[0] < span[1] <= ids.shape[1]:
            raise UserError(
                f"--span {args.span} must be START:STOP with "
                f"0 <= START < STOP <= {ids.shape[1]} (the TEXT's token count)."
            )
    model = load_causal_lm(args.model).eval()
    entries = attention_maps(model, ids)
    metrics = layer_metrics(entries, span=span)  # (layers, heads) each; answer/noise at the last position
    if tokenizer is not None:
        tokens = [tokenizer.decode([i]) for i in ids[0].tolist()]  # readable pieces, not byte-level symbols
    else:
        tokens = [str(i) for i in ids[0].tolist()]

    name = {"diff-v1": "Diff V1", "diff-v2": "Diff V2", "diffllama": "DiffLlama", "llama": "Llama"}[kind]
    title = f"{name}: {Path(str(args.model)).name}, {ids.shape[1]} tokens"
    figure = head_figure(entries, args.layer, args.head, tokens=tokens, title=title)
    _write_atomically(out, lambda path: figure.savefig(path, dpi=args.dpi))
    print(f"wrote {out} ({name}, layer {args.layer}, head {args.head})")
    if grid_out is not None:
        from diff_transformer.plotting import metric_grid

        grid = metric_grid(metrics[args.metric], args.metric, title=f"{title}: {args.metric}")
        _write_atomically(grid_out, lambda path: grid.savefig(path, dpi=args.dpi))
        print(f"wrote {grid_out} ({args.metric}, layers x heads)")
    if json_out is not None:
        entry = entries[args.layer]

        def plain(tensor):  # NaN (Llama's λ) as null
            return None if tensor is None else [[None if v != v else v for v in row] for row in tensor.tolist()]

        report = {
            "model": str(args.model),
            "kind": kind,
            "tokens": tokens,
            "layer": args.layer,
            "head": args.head,
            "span": None if span is None else list(span),
            "first": plain(entry.first[0, args.head]),
            "second": plain(None if entry.second is None else entry.second[0, args.head]),
            "differential": plain(entry.differential[0, args.head]),
            "lambda": None
            if entry.lam is None
            else (entry.lam if entry.lam.dim() == 0 else entry.lam[0, args.head]).tolist(),
            "metrics": {key: plain(value) for key, value in metrics.items()},  # (layers, heads) each
        }
        _write_atomically(json_out, lambda path: Path(path).write_text(json.dumps(report)))
        print(f"wrote {json_out}")
    return 0


def _train(args) -> int:
    from diff_transformer.training.args import hide_bitsandbytes_kernel_notice

    if not args.load_in_4bit:
        hide_bitsandbytes_kernel_notice()
    from diff_transformer.training.train import run_cli

    return run_cli(args)


def _serve(args) -> int:
    from diff_transformer.serving import main as serve

    return serve(args.serve_args)


class _Notes(logging.Handler):
    """Our notes (e.g. what `safe_output` recovered after a killed run) as plain lines on the current stderr."""

    def emit(self, record):
        print(record.getMessage(), file=sys.stderr, flush=True)


def _show_notes() -> None:
    logger = logging.getLogger("diff_transformer")
    if not any(isinstance(h, _Notes) for h in logger.handlers):
        handler = _Notes(logging.WARNING)
        logger.addHandler(handler)


def main(argv=None) -> int:
    _show_notes()
    parser = argparse.ArgumentParser(prog="diff-transformer", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser(
        "demo", help="offline demo: convert the shipped tiny Llama to Diff V2, verify, generate"
    )
    demo.add_argument("--output", help="where to write the converted model (default: a temporary directory)")
    demo.add_argument("--prompt", help="English prompt to continue")
    demo.add_argument("--scratch", action="store_true", help="instead: build, save, reload random Diff V1/V2 models")
    demo.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a non-empty --output that is not an unchanged earlier demo output",
    )
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=_demo)

    convert = commands.add_parser(
        "convert", help="convert a Llama, Mistral, Qwen2, Qwen3 or DiffLlama checkpoint into a Diff checkpoint"
    )
    convert.add_argument(
        "src", help="source checkpoint directory or Hub model id org/name (hf://name forces a Hub id)"
    )
    convert.add_argument("out", help="output directory")
    convert.add_argument(
        "--diff-version", type=int, choices=(1, 2), default=None, help="2 (default for Llama): exact; 1: paper layout"
    )
    convert.add_argument(
        "--dtype", choices=("float32", "bfloat16", "float16"), default=None, help="cast weights (default: keep)"
    )
    convert.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT")
    convert.add_argument(
        "--verify",
        action="store_true",
        help="compare logits and greedy continuations with the source (with --dtype: the source cast the same way)",
    )
    convert.add_argument(
        "--v1-init",
        choices=("calibrated", "paper"),
        default=None,
        help="with --diff-version 1: calibrated (default: λ = 0 at start, sub-layer norm fitted on text) or paper",
    )
    convert.add_argument(
        "--calibration-data",
        metavar="FILE",
        default=None,
        help="UTF-8 text to calibrate V1 on (default: a built-in public-domain English text)",
    )
    convert.add_argument("--quiet", action="store_true", help="no progress bar")
    convert.set_defaults(func=_convert)

    generate = commands.add_parser("generate", help="generate text with a saved Diff model")
    generate.add_argument("model", help="model directory or Hub id org/name (hf://name forces a Hub id)")
    generate.add_argument("prompt", help="text (or space-separated token ids if the model has no tokenizer)")
    generate.add_argument("--max-new-tokens", type=int, default=32)
    generate.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    generate.set_defaults(func=_generate)

    inspect = commands.add_parser(
        "inspect", help="plot one head's attention maps (A1, A2, A1 - λA2, λ per layer) of a Diff, DiffLlama or Llama"
    )
    inspect.add_argument("model", help="model directory or Hub id org/name (hf://name forces a Hub id)")
    inspect.add_argument("text", help="text (or space-separated token ids if the model has no tokenizer)")
    inspect.add_argument("--layer", type=int, default=0, help="layer to plot (default 0)")
    inspect.add_argument("--head", type=int, default=0, help="differential head to plot (default 0)")
    inspect.add_argument("--out", required=True, help="figure file (.png, .pdf, .svg, ...)")
    inspect.add_argument("--json", help="also write the head's maps, λ and per-layer/head metrics as JSON")
    inspect.add_argument("--span", help="START:STOP token positions of an answer: adds the answer and noise metrics")
    inspect.add_argument("--grid", help="also write a layer x head heatmap of --metric to this figure file")
    inspect.add_argument(
        "--metric",
        choices=("entropy", "negative_fraction", "lambda", "answer", "noise"),
        default="entropy",
        help="metric of --grid (answer/noise need --span; see README, 'Inspecting attention')",
    )
    inspect.add_argument("--dpi", type=int, default=80)
    inspect.add_argument("--overwrite", action="store_true", help="replace an existing --out / --json file")
    inspect.set_defaults(func=_inspect)

    from diff_transformer.training.args import add_train_arguments

    train = commands.add_parser(
        "train", help="continued pretraining (transformers' Trainer) on local .txt/.jsonl files"
    )
    add_train_arguments(train).set_defaults(func=_train)

    # Every option after `serve` goes to transformers' server: `diff-transformer serve --help` lists them.
    serve = commands.add_parser(
        "serve", add_help=False, help="OpenAI-compatible server (transformers serve) for Diff models"
    )
    serve.set_defaults(func=_serve)

    args, rest = parser.parse_known_args(argv)
    if rest and args.command != "serve":
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.serve_args = rest
    try:
        return args.func(args)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


def run_as_process(argv=None) -> int:
    """The console command: `main`, then, under torchrun, the ranks leave together and the process group's threads
    are joined before the interpreter exits (otherwise a rank could abort at exit now and then: "terminate called
    without an active exception"). `main` itself leaves the process group alone, for scripts that call it."""
    status = main(argv)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(run_as_process())
