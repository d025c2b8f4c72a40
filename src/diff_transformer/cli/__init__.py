"""The `diff-transformer` command: demo, convert, generate, inspect, merge, train, serve."""

import argparse
import logging
import math
import sys
import tempfile
import time
from pathlib import Path

from diff_transformer.cli.inspect import INSPECT_MAX_DPI
from diff_transformer.errors import UserError


def _demo(args) -> int:
    """Offline main job: the shipped tiny Llama (real tokenizer, trained on Austen) -> Diff V2, verified,
    generating."""
    if args.scratch:
        return _scratch_demo(args)
    from diff_transformer.cli.demo import run_demo

    kwargs = {"prompt": args.prompt} if args.prompt else {}
    return run_demo(args.output, overwrite=args.overwrite, **kwargs)


def _scratch_demo(args) -> int:
    """Build small Diff models of both versions, save them, reload through AutoModelForCausalLM, generate."""
    from diff_transformer.cli.demo import SCRATCH_MARK, demo_output

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

    from diff_transformer.conversion import convert_to_diff

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
    if "calibration_tokens" in conversion:  # a calibrated V1 start (either kind) records what it read
        blocks, length = conversion["calibration_tokens"]
        start = (
            f"λ at step 0 fitted per layer: {conversion['lambda_start']}"
            if "lambda_start" in conversion
            else "λ = 0 at step 0 (λ_init 0, mirrored λ vectors)"
        )
        print(
            f"V1 calibrated on {conversion['calibration_text']} ({blocks} blocks x {length} tokens): sub-layer norm "
            f"gains fitted by least squares, {start}; relative residual per layer "
            f"{conversion['subln_relative_residual']}."
        )
    if args.diff_version == 1 and conversion.get("source_model_type") != "diffllama":
        print(
            "note: diff_version=1 re-pairs the Llama heads: not function-preserving (--v1-init calibrated starts "
            "closest); continue pretraining."
        )
    if args.verify:
        report = _verify(args, out)
        greedy = "" if report["greedy_match"] is None else f", greedy continuations match: {report['greedy_match']}"
        print(
            f"verify (against {report['reference']}, both run in {report['dtype']}): max |Δlogit| = "
            f"{report['max_abs_logit_diff']:.3g}{greedy}  ({report['seconds']:.1f} s)"
        )
        if report["heldout"] is not None:
            heldout = report["heldout"]
            print(
                f"held-out perplexity ({heldout['tokens']:,} tokens of the built-in English text, as the demo scores "
                f"it): source {heldout['source']:.4f}, converted {heldout['converted']:.4f}"
            )
        if report["expected_exact"] and not report["passed"]:
            return 1
    return 0


def _verify(args, out) -> dict:
    """`verify_conversion` with the built-in held-out text (the demo's), announced first and timed: it loads both
    models whole, which takes a while for a real checkpoint."""
    from diff_transformer.cli.demo import shipped_assets
    from diff_transformer.conversion import verify_conversion

    print(f"verifying {out} against {args.src}: loading both models, comparing logits and perplexity ...", flush=True)
    start = time.perf_counter()
    with shipped_assets() as (_, heldout):
        text = heldout.read_text(encoding="utf-8")
    report = verify_conversion(args.src, out, heldout_text=text, progress=not args.quiet)
    return {**report, "seconds": time.perf_counter() - start}


def _generate(args) -> int:
    import torch
    from transformers import AutoConfig, AutoTokenizer

    from diff_transformer import adapters
    from diff_transformer.loading import check_diff_checkpoint, check_generation_config

    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens {args.max_new_tokens} must be at least 1.")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise UserError(f"--temperature {args.temperature} must be a number >= 0 (0 = greedy).")
    _check_generate_options(args)
    # Everything about the inputs is checked before the weights load.
    source = adapters.resolve(args.model, args.base)
    if source.local is not None:
        check_diff_checkpoint(source.local)
    check_generation_config(source.location, f"MODEL {args.model}")
    tokenizer = adapters.load_tokenizer(AutoTokenizer, source.tokenizer, source.tokenizer_local, args.model)
    if args.chat:
        inputs = _chat_inputs(args, tokenizer)
        ids = inputs["input_ids"][0].tolist()
    elif tokenizer is not None:
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
        text_config = AutoConfig.from_pretrained(source.location).get_text_config()
        vocab = text_config.vocab_size
    except Exception as exc:
        raise UserError(
            f"cannot read the config of MODEL {args.model} ({' '.join(str(exc).split())[:200]})."
        ) from None
    _check_generation_length(args, len(ids), text_config)
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise UserError(
            f"token id {bad[0]} in PROMPT is out of range for MODEL {args.model}: use ids from 0 to {vocab - 1}."
        )
    load_kwargs = {"dtype": getattr(torch, args.dtype)} if args.dtype else {}
    model = adapters.load(source, **load_kwargs).eval()
    kwargs = dict(max_new_tokens=args.max_new_tokens, do_sample=args.temperature > 0)
    if args.temperature > 0:
        kwargs["temperature"] = args.temperature
    if args.repetition_penalty is not None:
        kwargs["repetition_penalty"] = args.repetition_penalty
    if args.seed is not None:
        from transformers import set_seed

        set_seed(args.seed)  # the sampling draws (python, numpy and torch generators)
    output = model.generate(**inputs, **kwargs)[0, inputs["input_ids"].shape[1] :]
    print(
        tokenizer.decode(output, skip_special_tokens=True)
        if tokenizer is not None
        else " ".join(map(str, output.tolist()))
    )
    return 0


def _check_generate_options(args) -> None:
    """The options `generate` has beyond the prompt and length: one line each when out of range."""
    if args.repetition_penalty is not None and not (
        math.isfinite(args.repetition_penalty) and args.repetition_penalty > 0
    ):
        raise UserError(f"--repetition-penalty {args.repetition_penalty} must be a number > 0 (1 = none).")
    if args.system is not None and not args.chat:
        raise UserError("--system is the system message of a chat: add --chat.")
    if args.seed is not None and not 0 <= args.seed < 2**32:
        raise UserError(f"--seed {args.seed} must be in [0, 2**32).")


def _chat_inputs(args, tokenizer):
    """PROMPT (and --system) as a chat, through the tokenizer's chat template, ending with the assistant's turn."""
    if tokenizer is None:
        raise UserError(f"--chat needs a tokenizer with a chat template, and MODEL {args.model} has no tokenizer.")
    if not getattr(tokenizer, "chat_template", None):
        raise UserError(
            f"--chat: the tokenizer of MODEL {args.model} has no chat template: drop --chat for plain completion, "
            "or save a chat_template.jinja with the tokenizer."
        )
    messages = [{"role": "system", "content": args.system}] if args.system else []
    messages.append({"role": "user", "content": args.prompt})
    try:
        return tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_dict=True, return_tensors="pt"
        )
    except Exception as exc:  # jinja2 raises its own errors (e.g. a template that rejects a system message)
        raise UserError(
            f"--chat: the chat template of MODEL {args.model} failed ({' '.join(str(exc).split())[:200]})"
            + (": try without --system." if args.system else ".")
        ) from None


def _check_generation_length(args, prompt_tokens: int, config) -> None:
    """PROMPT + --max-new-tokens within the model's context: beyond it the positions were never trained, and the
    cache (memory) grows with whatever number is asked."""
    context = getattr(config, "max_position_embeddings", None)
    if context is not None and prompt_tokens >= context:
        raise UserError(
            f"PROMPT has {prompt_tokens} tokens, MODEL {args.model}'s context {context} positions: shorten it."
        )
    if context is not None and prompt_tokens + args.max_new_tokens > context:
        raise UserError(
            f"PROMPT ({prompt_tokens} tokens) + --max-new-tokens {args.max_new_tokens} exceeds MODEL {args.model}'s "
            f"context ({context} positions): lower --max-new-tokens to at most {context - prompt_tokens}."
        )


def _inspect(args) -> int:
    from diff_transformer.cli import inspect

    return inspect.run(args)


def _merge(args) -> int:
    """A PEFT adapter folded into its base model's weights: a full Diff checkpoint (custom code, card, tokenizer)."""
    from diff_transformer.adapters import merge_adapter

    out = merge_adapter(args.adapter, args.out, base=args.base, overwrite=args.overwrite)
    print(f"wrote {out}")
    return 0


def _train(args) -> int:
    from diff_transformer.extras import hide_bitsandbytes_kernel_notice

    if not args.load_in_4bit:
        hide_bitsandbytes_kernel_notice()
    from diff_transformer.training.train import run_cli

    return run_cli(args)


def _serve(args) -> int:
    from diff_transformer.extras import require

    require(["fastapi", "uvicorn", "openai", "pydantic"], "serve", "diff-transformer serve")
    from diff_transformer.cli.serve import main as serve

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


def _add_base_option(parser) -> None:
    parser.add_argument(
        "--base",
        help="for a PEFT adapter MODEL: its base model (default: base_model_name_or_path of adapter_config.json)",
    )


def _add_generate_options(generate) -> None:
    generate.add_argument("--chat", action="store_true", help="PROMPT is a user message: apply the chat template")
    generate.add_argument("--system", help="system message of --chat")
    generate.add_argument("--repetition-penalty", type=float, default=None, help="default: the model's (1 = none)")
    generate.add_argument("--seed", type=int, default=None, help="seed of the sampling (--temperature > 0)")
    generate.add_argument(
        "--dtype", choices=("float32", "bfloat16", "float16"), default=None, help="load the weights in this dtype"
    )
    _add_base_option(generate)


def main(argv=None) -> int:
    _show_notes()
    from diff_transformer._version import __version__

    parser = argparse.ArgumentParser(prog="diff-transformer", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
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
        choices=("calibrated", "calibrated-lambda0", "paper"),
        default=None,
        help="with --diff-version 1: calibrated (default: λ and the sub-layer norm fitted on text), "
        "calibrated-lambda0 (λ = 0 at start) or paper",
    )
    convert.add_argument(
        "--calibration-data",
        metavar="FILE",
        default=None,
        help="UTF-8 text to calibrate V1 on (default: a built-in public-domain English text)",
    )
    convert.add_argument("--quiet", action="store_true", help="no progress bar")
    convert.set_defaults(func=_convert)

    generate = commands.add_parser("generate", help="generate text (or chat) with a saved Diff model or LoRA adapter")
    generate.add_argument(
        "model", help="model or LoRA adapter directory, or Hub id org/name (hf://name forces a Hub id)"
    )
    generate.add_argument("prompt", help="text (or space-separated token ids if the model has no tokenizer)")
    generate.add_argument("--max-new-tokens", type=int, default=32)
    generate.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    _add_generate_options(generate)
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
        help="metric of --grid (answer/noise need --span; see docs/analysis.md)",
    )
    inspect.add_argument("--dpi", type=int, default=80, help=f"figure resolution, 1 to {INSPECT_MAX_DPI} (default 80)")
    inspect.add_argument(
        "--max-memory-gb",
        type=float,
        default=4.0,
        help="refuse a TEXT whose attention maps would need more memory than this (default 4)",
    )
    inspect.add_argument("--overwrite", action="store_true", help="replace an existing --out / --json file")
    _add_base_option(inspect)
    inspect.set_defaults(func=_inspect)

    merge = commands.add_parser(
        "merge", help="fold a LoRA adapter (train --lora) into its base model: a full Diff checkpoint"
    )
    merge.add_argument("adapter", help="PEFT adapter directory (what train --lora writes)")
    merge.add_argument("out", help="output directory for the merged checkpoint")
    merge.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT")
    _add_base_option(merge)
    merge.set_defaults(func=_merge)

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
