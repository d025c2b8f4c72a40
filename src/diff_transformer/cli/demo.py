"""`diff-transformer demo`: the offline end-to-end demo (`diff_transformer.demo`): the shipped tiny Llama converted
to Diff V2, verified and generating, or with --scratch random Diff V1/V2 models saved, reloaded and generating."""

from ..demo import DEFAULT_PROMPT, run_demo, scratch_demo
from ..errors import check_seed
from .options import add_quiet_option


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
