"""The `diff-transformer` command: demo, convert, generate, inspect, merge, train, serve, niah, plan.

Each command is a module of this package with `add_parser(commands)` (its options, and `run(args)` as the function
to call); the modules import nothing heavy at the top, so `--help` and `--version` do not load torch's models.
"""

import argparse
import logging
import sys

from diff_transformer.checkpoints.backends import (
    check_attn_implementation,
    check_attn_name,
    requested_attn_implementation,
)
from diff_transformer.cli import convert, demo, generate, inspect, merge, niah, plan, serve, train
from diff_transformer.cli.options import DefaultsHelpFormatter, output_settings
from diff_transformer.errors import UserError, as_one_line, library_failure, one_line


COMMANDS = (demo, convert, generate, inspect, merge, train, serve, niah, plan)
# The argument naming the model each command reads, and the name its messages give it: resolved before torch loads
# (`checkpoints.names.resolve_model`, the first step of `checkpoints.open`): a mistyped path is the same line, at once.
MODEL_ARGUMENTS = {
    "convert": ("src", "SRC"),
    "generate": ("model", "MODEL"),
    "inspect": ("model", "MODEL"),
    "merge": ("adapter", "ADAPTER"),
    "niah": ("models", "MODEL"),
    "train": ("model", "MODEL"),
}


class _Notes(logging.Handler):
    """Our notes (e.g. what `outputs.staging` recovered after a killed run) as plain lines on the current stderr."""

    def emit(self, record):
        print(record.getMessage(), file=sys.stderr, flush=True)


def _show_notes() -> None:
    logger = logging.getLogger("diff_transformer")
    if not any(isinstance(h, _Notes) for h in logger.handlers):
        handler = _Notes(logging.WARNING)
        logger.addHandler(handler)


def build_parser() -> argparse.ArgumentParser:
    from diff_transformer._version import __version__

    parser = argparse.ArgumentParser(prog="diff-transformer", description=__doc__.split("\n", 1)[0])
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(commands)
    for subparser in commands.choices.values():
        subparser.formatter_class = DefaultsHelpFormatter  # every option's help shows its default
        subparser.add_argument(
            "--traceback", action="store_true", help="on an unexpected failure, show where it happened (for a report)"
        )
    return parser


def main(argv=None) -> int:
    from diff_transformer.progress import command

    with command():  # a log's silence counts from here (progress.Progress)
        return _main(argv)


def _main(argv=None) -> int:
    _show_notes()
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if rest and args.command != "serve":  # every option after `serve` goes to transformers' server
        # the command's own usage, not the top level's: the mistyped option belongs to the command
        subparsers = next(action for action in parser._actions if isinstance(action, argparse._SubParsersAction))
        subparsers.choices[args.command].error(f"unrecognized arguments: {' '.join(rest)}")
    args.serve_args = rest
    import diff_transformer

    try:
        # Option values that need no model, before torch and transformers load (seconds on a busy machine): a typo
        # is one line at once. `early_check` is a command's own (set_defaults), if it has one.
        backend = requested_attn_implementation(args)
        if backend is not None:
            check_attn_name(backend)
        if getattr(args, "early_check", None) is not None:
            args.early_check(args)
        _resolve_model_names(args)
        diff_transformer._load()  # what `import diff_transformer` does outside the command (the Auto classes)
        if backend is not None:
            check_attn_implementation(backend)
        with output_settings(getattr(args, "quiet", False)):
            return args.func(args)
    except UserError as error:
        print(f"error: {as_one_line(str(error))}", file=sys.stderr)
        return 2
    except Exception as exc:  # the one boundary: a failure of the machine or a file, or a bug (--traceback shows it)
        if args.traceback:
            raise
        known = library_failure(exc, getattr(args, "out", None) or getattr(args, "output", None))
        if known is not None:
            print(f"error: {as_one_line(known)}", file=sys.stderr)
            return 2
        print(
            f"error: unexpected {type(exc).__name__}: {one_line(exc)} (a bug: rerun with --traceback to see where, "
            "and report it)",
            file=sys.stderr,
        )
        return 1


def _resolve_model_names(args) -> None:
    """The models ARGS names (`MODEL_ARGUMENTS`), each an existing path or a Hub id, else one `UserError` line."""
    from diff_transformer.checkpoints.names import resolve_model

    attribute, label = MODEL_ARGUMENTS.get(args.command, (None, None))
    names = getattr(args, attribute, None) if attribute else None
    for name in names if isinstance(names, list) else [names] if names is not None else []:
        resolve_model(name, name=label)


def run_as_process(argv=None) -> int:
    """The console command: `main`, then, under torchrun, the ranks leave together and the process group's threads
    are joined before the interpreter exits (otherwise a rank could abort at exit now and then: "terminate called
    without an active exception"). `main` itself leaves the process group alone, for scripts that call it."""
    status = main(argv)
    if "torch" not in sys.modules:  # --version, --help: torch was never imported
        return status
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return status
