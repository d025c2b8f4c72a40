"""`diff-transformer serve`: transformers' own OpenAI-compatible server (`transformers serve`) for Diff models.

The command: its options parsed (`_own_options`: ours, each MODEL checked before the server starts; everything else
goes to transformers), `diff_transformer.serving` installed (`serving.patches.install` applies its table of patches;
the package docstring says what it bounds and fixes, and why), then transformers' `serve` command run in this
process with the same options (`diff-transformer serve --help`).
"""

import argparse
import sys

from ..errors import UserError, require
from ..text_input import whole_number
from .options import output_settings


PASSED_THROUGH = """\
Every other option goes to transformers' server (`transformers serve`) unchanged, e.g. --host (default localhost),
--port (default 8000), --device (default auto), --dtype (default auto), --attn-implementation,
--continuous-batching with --cb-block-size/--cb-num-blocks/--cb-max-batch-tokens, --compile, --quantization,
--model-timeout, --log-level, --enable-cors, --default-seed: --transformers-help lists them all.

Endpoints: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health. `stop` (up to 4 strings
of 1-256 characters) ends the answer before the stop string, streaming or not; n above 1 and out-of-range fields are
refused (HTTP 400, OpenAI's error body); a model that does not exist, or other than a pinned server's MODEL, answers
404, one that cannot be loaded 400, a local directory with an @revision 400 (it has none); a request past
the queue bound above answers 429 with Retry-After (the work ahead), a body past the byte bound above 413."""


class ParagraphsHelpFormatter(argparse.HelpFormatter):
    """argparse's formatter, except that the description and epilog keep their paragraphs (blank lines), each
    refilled to the terminal's width (RawDescriptionHelpFormatter kept the source's 116-column lines)."""

    def _fill_text(self, text, width, indent):
        import textwrap

        fill = textwrap.TextWrapper(width, initial_indent=indent, subsequent_indent=indent, break_on_hyphens=False)
        return "\n\n".join(fill.fill(" ".join(paragraph.split())) for paragraph in text.split("\n\n"))


def help_parser() -> argparse.ArgumentParser:
    """The options of `diff-transformer serve` as `--help` shows them (`_own_options` parses them: everything else in
    ARGV goes to transformers, so argparse must not take a value of theirs for MODEL)."""
    from ..serving.patches import MAX_LOADED_MODELS, MAX_QUEUED_REQUESTS, MAX_REQUEST_BYTES

    parser = argparse.ArgumentParser(
        prog="diff-transformer serve",
        usage="%(prog)s [MODEL ...] [--max-new-tokens-limit N] [--max-queued-requests N] [--max-loaded-models N]\n"
        "       [--max-request-bytes N] [--quiet] [transformers serve options]",
        description="OpenAI-compatible server for Diff models: transformers' own server (transformers serve) with\n"
        "the Diff classes, every generation bounded by the model's context, and errors clients can read.",
        epilog=PASSED_THROUGH,
        formatter_class=ParagraphsHelpFormatter,
        add_help=False,
    )
    parser.add_argument(
        "model",
        nargs="*",
        metavar="MODEL",
        help="model directory or Hub id, loaded at start and pinned: requests name it as given here, or omit model. "
        "Several: the models this server answers for, listed by /v1/models from the start, each loaded when a "
        "request first names it (default: none; any model a request names is loaded on first use, and /v1/models "
        "lists those loaded and the Hub cache's)",
    )
    parser.add_argument(
        "--max-new-tokens-limit",
        metavar="N",
        type=int,
        help="at most N new tokens per request, whatever max_tokens asks (default: none; the model's context "
        "bounds every request)",
    )
    parser.add_argument(
        "--max-queued-requests",
        metavar="N",
        type=int,
        help="at most N requests (POST: completions, chat, model loads) in the server at once, generating or waiting "
        "for the model; one more is answered 429 with Retry-After (default %(default)s; with --continuous-batching, "
        "about the batch the cache holds)",
        default=MAX_QUEUED_REQUESTS,
    )
    parser.add_argument(
        "--max-loaded-models",
        metavar="N",
        type=int,
        help="at most N models loaded at once (at least the MODELs named): loading another unloads the one used "
        "least recently (default %(default)s)",
        default=MAX_LOADED_MODELS,
    )
    parser.add_argument(
        "--max-request-bytes",
        metavar="N",
        type=int,
        help="at most N bytes of request body, refused (413) before it is read in full (default %(default)s: 16 MiB)",
        default=MAX_REQUEST_BYTES,
    )
    parser.add_argument(
        "--quiet",
        action="store_true",
        help="no progress bars, no per-request log lines: transformers' log level error (unless --log-level), "
        "uvicorn's warning",
    )
    parser.add_argument("--transformers-help", action="store_true", help="show transformers' own options and exit")
    parser.add_argument("-h", "--help", action="help", help="show this help and exit")
    return parser


class _Help(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        help_parser().print_help()
        parser.exit()


def add_parser(commands) -> None:
    # Our options are parsed by `_own_options`; every other option after `serve` goes to transformers' server.
    serve = commands.add_parser(
        "serve", add_help=False, help="OpenAI-compatible server (transformers serve) for Diff models"
    )
    serve.add_argument("-h", "--help", action=_Help, nargs=0, help=argparse.SUPPRESS)
    serve.set_defaults(func=run, early_check=_check_options)


def _check_options(args) -> None:
    """Our counts, before transformers loads (`cli.main`); the MODELs and the rest are checked by `_own_options`."""
    _counts_given(args.serve_args)


def run(args) -> int:
    require(["fastapi", "uvicorn", "openai", "pydantic"], "serve", "diff-transformer serve")
    return main(args.serve_args)


def _transformers_flags() -> set[str]:
    """The options of transformers' `Serve` that take no value (its bool parameters, `--x` and `--no-x`): any other
    option's next argument is its value, not a MODEL."""
    import inspect
    import typing

    from transformers.cli.serve import Serve

    flags = {"--help"}
    for name, parameter in inspect.signature(Serve.__init__).parameters.items():
        annotation = parameter.annotation
        kind = typing.get_args(annotation)[0] if hasattr(annotation, "__metadata__") else annotation
        if kind is bool or kind == (bool | None):
            flags |= {f"--{name.replace('_', '-')}", f"--no-{name.replace('_', '-')}"}
    return flags


# Our options that take a count (>= 1), and the keyword of `_own_options`' counts each sets.
_COUNTS = {
    "--max-new-tokens-limit": "limit",
    "--max-queued-requests": "max_queued_requests",
    "--max-loaded-models": "max_loaded_models",
    "--max-request-bytes": "max_request_bytes",
}


def _own_options(argv: list[str]) -> tuple[list[str], dict, bool, tuple[str, ...]]:
    """(ARGV less our options, {"limit", "max_queued_requests", "max_loaded_models"}: our counts, --quiet, the MODELs
    when several), each MODEL checked to exist. One MODEL goes to transformers (its pinned `force_model`); several stay
    here (then `ServeSettings.served`)."""
    from ..checkpoints.names import resolve_model
    from ..serving.models import check_model_directory, local_revision_problem
    from ..serving.patches import MAX_LOADED_MODELS, MAX_QUEUED_REQUESTS, MAX_REQUEST_BYTES

    rest, given, quiet = _counts_given(argv)
    counts = {
        "limit": None,
        "max_queued_requests": MAX_QUEUED_REQUESTS,
        "max_loaded_models": MAX_LOADED_MODELS,
        "max_request_bytes": MAX_REQUEST_BYTES,
    } | given
    _check_device_options(rest)
    flags = _transformers_flags()
    positions = [
        i
        for i, arg in enumerate(rest)
        if not arg.startswith("-")
        and (i == 0 or not rest[i - 1].startswith("-") or "=" in rest[i - 1] or rest[i - 1] in flags)
    ]
    models = [rest[i] for i in positions]
    for model in models:
        name = model.partition("@")[0]
        if name == "":
            raise UserError(f"MODEL {model!r} names no model: pass a model directory or Hub id ('DIR', 'org/model').")
        if "@" in model and local_revision_problem(model):
            raise UserError(local_revision_problem(model, "MODEL"))
        if "@" in model:
            resolve_model(name, name="MODEL")  # a mistyped path with a revision: one line too
        if ":" in model or "@" in model:  # GGUF "<repo>:<file>", revisions: the Hub's
            continue
        _, local = resolve_model(model, name="MODEL")  # a mistyped path: one line, before the server starts
        if local is not None and not (local / "config.json").is_file():
            raise UserError(f"MODEL {model!r} is a directory without config.json: pass a saved model's directory.")
        if local is not None:
            check_model_directory(local, f"MODEL {model}", None)
    if len(set(models)) < len(models):
        raise UserError(f"MODEL {next(m for m in models if models.count(m) > 1)!r} is named twice: name it once.")
    served = tuple(models) if len(models) > 1 else ()
    if served:
        rest = [arg for i, arg in enumerate(rest) if i not in positions]
    if quiet and not any(arg == "--log-level" or arg.startswith("--log-level=") for arg in rest):
        rest += ["--log-level", "error"]
    return rest, counts, quiet, served


def _counts_given(argv: list[str]) -> tuple[list[str], dict, bool]:
    """(ARGV less our counts and --quiet, the counts given, --quiet): each count a whole number >= 1, else one line.
    Nothing heavy is imported, so `cli.main` runs it before transformers loads (serve's `early_check`)."""
    rest, counts, quiet, index = [], {}, False, 0
    while index < len(argv):
        arg = argv[index]
        if arg == "--quiet":
            quiet = True
            index += 1
            continue
        if arg == "--transformers-help":
            rest.append("--help")
            index += 1
            continue
        option = arg.partition("=")[0]
        if option in _COUNTS:
            value = arg.partition("=")[2] if "=" in arg else (argv[index + 1] if index + 1 < len(argv) else "")
            index += 1 if "=" in arg else 2
            number = whole_number(value)
            if number is None or number < 1:
                raise UserError(f"{option} {value!r} must be a whole number >= 1.")
            counts[_COUNTS[option]] = number
            continue
        rest.append(arg)
        index += 1
    return rest, counts, quiet


def _check_device_options(argv: list[str]) -> None:
    """transformers' --device and --dtype, checked as the other commands check theirs (`options.resolve_device`,
    `options.DTYPES`) before the server starts: transformers takes any string and fails at the first request."""
    from .options import DTYPES, resolve_device

    for index, arg in enumerate(argv):
        option, equals, value = arg.partition("=")
        if option not in ("--device", "--dtype"):
            continue
        if not equals:
            value = argv[index + 1] if index + 1 < len(argv) else ""
            if value.startswith("--"):
                raise UserError(f"{option} needs a value, e.g. {option} {'cpu' if option == '--device' else 'auto'}.")
        if option == "--dtype" and value not in DTYPES:
            raise UserError(f"--dtype {value!r} is not a dtype for the weights: use one of {', '.join(DTYPES)}.")
        if option == "--device" and value != "auto":
            resolve_device(f"cuda:{value}" if value.isdigit() else value)  # transformers reads "N" as cuda:N


def main(argv=None):
    """Run `transformers serve` with ARGV (its options: model, --continuous-batching, --port, ...)."""
    import typer
    from transformers.cli.serve import Serve

    from ..serving.patches import ServeSettings, install

    argv, counts, quiet, served = _own_options(sys.argv[1:] if argv is None else list(argv))
    install(ServeSettings(max_new_tokens_limit=counts.pop("limit"), quiet=quiet, served=served, **counts))
    app = typer.Typer(add_completion=False)
    app.command(help=Serve.__doc__)(Serve)
    with output_settings(quiet):
        return app(argv, prog_name="diff-transformer serve")


if __name__ == "__main__":
    main()
