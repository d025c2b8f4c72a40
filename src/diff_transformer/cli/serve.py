"""`diff-transformer serve`: transformers' own OpenAI-compatible server (`transformers serve`) for Diff models.

transformers 5.23's server looks the model class up by name on the `transformers` package
(`getattr(transformers, config.architectures[0])` in `transformers/cli/serving/model_manager.py`), so it only loads
architectures that transformers ships: `transformers serve --trust-remote-code` fails on every custom-code
checkpoint with "module transformers has no attribute DiffForCausalLM". This command imports diff_transformer (which
registers the Auto classes), makes the Diff classes resolvable where the server looks, and then runs transformers'
`serve` command in this process with the same options (`diff-transformer serve --help`).

What transformers' server does not bound, this command does (`limit_generation`, `graceful_shutdown`):

* `max_tokens` (`max_completion_tokens`, `max_output_tokens`): transformers generates as many tokens as a request
  asks (and 1024 by default). Here every generation is clamped to the model's context (`max_position_embeddings`
  minus the prompt) and to `--max-new-tokens-limit N` when given; the answer then ends with finish_reason "length".
  A prompt that already fills the context is refused (HTTP 400).
* A client that disconnects: transformers cancels a *streaming* generation at its next token; a non-streaming one
  runs to its end, which the clamp above bounds.
* SIGTERM: uvicorn then waits for the requests in flight without limit; here for 5 s, after which they are cancelled
  and the process exits (the generation thread is a daemon).
* `serve MODEL` with a MODEL that does not exist: one line, exit status 2, before the server starts.
"""

import functools
import sys

from ..errors import UserError, require


GRACEFUL_SHUTDOWN_S = 5


def add_parser(commands) -> None:
    # Every option after `serve` goes to transformers' server: `diff-transformer serve --help` lists them.
    serve = commands.add_parser(
        "serve", add_help=False, help="OpenAI-compatible server (transformers serve) for Diff models"
    )
    serve.set_defaults(func=run)


def run(args) -> int:
    require(["fastapi", "uvicorn", "openai", "pydantic"], "serve", "diff-transformer serve")
    return main(args.serve_args)


def expose_to_transformers_serve() -> None:
    """Make `getattr(transformers, "DiffForCausalLM")` (and DiffModel) resolve for transformers' model manager."""
    from transformers.cli.serving import model_manager

    from ..modeling_diff import DiffForCausalLM, DiffModel

    # The module object the model manager imported (transformers can swap `sys.modules["transformers"]` for a
    # fresh lazy module while importing its submodules, so `import transformers` here could be a different one).
    for cls in (DiffModel, DiffForCausalLM):
        setattr(model_manager.transformers, cls.__name__, cls)


def _generation_limit(model, inputs: dict, gen_config, limit: int | None) -> None:
    """Clamp `gen_config.max_new_tokens` to the context left after the prompt (and to `limit`); a request's
    settings outside their range (`num_beams: -3` in its generation_config) are an HTTP 400, not a 500 mid-run."""
    from fastapi import HTTPException

    from ..checkpoints.configs import generation_value_problem

    for field in ("num_beams", "num_return_sequences", "top_k", "top_p", "temperature", "repetition_penalty"):
        problem = generation_value_problem(field, getattr(gen_config, field, None))
        if problem:
            raise HTTPException(status_code=400, detail=f"{problem}.")

    input_ids = inputs["input_ids"]
    prompt = len(input_ids) if isinstance(input_ids, list) else input_ids.shape[-1]
    context = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    room = None if context is None else context - prompt
    if room is not None and room < 1:
        raise HTTPException(
            status_code=400, detail=f"the prompt has {prompt} tokens: the model's context is {context} positions."
        )
    bound = min(x for x in (room, limit) if x is not None) if (room, limit) != (None, None) else None
    if bound is not None and (gen_config.max_new_tokens is None or gen_config.max_new_tokens > bound):
        gen_config.max_new_tokens = bound


def limit_generation(limit: int | None = None) -> None:
    """Every generation of transformers' server (plain and continuous batching, streaming or not) bounded by the
    model's context and `limit` (see the module docstring)."""
    from transformers.cli.serving import utils

    for manager in (utils.GenerateManager, utils.CBGenerateManager):
        for name in ("generate_streaming", "generate_non_streaming"):
            method = getattr(manager, name)
            if getattr(method, "_diff_limited", False):
                continue

            def make(method):
                if name == "generate_non_streaming":

                    @functools.wraps(method)
                    async def bounded(self, model, processor, inputs, gen_config, *args, **kwargs):
                        _generation_limit(model, inputs, gen_config, limit)
                        return await method(self, model, processor, inputs, gen_config, *args, **kwargs)

                else:

                    @functools.wraps(method)
                    def bounded(self, model, processor, inputs, gen_config, *args, **kwargs):
                        _generation_limit(model, inputs, gen_config, limit)
                        return method(self, model, processor, inputs, gen_config, *args, **kwargs)

                bounded._diff_limited = True
                return bounded

            setattr(manager, name, make(method))


def graceful_shutdown(seconds: float = GRACEFUL_SHUTDOWN_S) -> None:
    """uvicorn servers created from now on wait at most `seconds` for requests in flight after SIGTERM/SIGINT."""
    import uvicorn

    init = uvicorn.Config.__init__
    if getattr(init, "_diff_bounded", False):
        return

    @functools.wraps(init)
    def bounded(self, *args, **kwargs):
        kwargs.setdefault("timeout_graceful_shutdown", seconds)
        init(self, *args, **kwargs)

    bounded._diff_bounded = True
    uvicorn.Config.__init__ = bounded


def _own_options(argv: list[str]) -> tuple[list[str], int | None]:
    """(ARGV less our --max-new-tokens-limit N, that N), and a MODEL argument checked to exist."""
    from ..checkpoints.names import resolve_model

    rest, limit, index = [], None, 0
    while index < len(argv):
        arg = argv[index]
        if arg == "--max-new-tokens-limit" or arg.startswith("--max-new-tokens-limit="):
            value = arg.partition("=")[2] if "=" in arg else (argv[index + 1] if index + 1 < len(argv) else "")
            index += 1 if "=" in arg else 2
            if not value.isdigit() or int(value) < 1:
                raise UserError(f"--max-new-tokens-limit {value!r} must be a whole number >= 1.")
            limit = int(value)
            continue
        rest.append(arg)
        index += 1
    model = rest[0] if rest and not rest[0].startswith("-") else None
    if model is not None and ":" not in model and "@" not in model:  # GGUF "<repo>:<file>", revisions: the Hub's
        resolve_model(model, name="MODEL")  # a mistyped path: one line, before the server starts
    return rest, limit


def main(argv=None):
    """Run `transformers serve` with ARGV (its options: model, --continuous-batching, --port, ...)."""
    import typer
    from transformers.cli.serve import Serve

    argv, limit = _own_options(sys.argv[1:] if argv is None else list(argv))
    expose_to_transformers_serve()
    limit_generation(limit)
    graceful_shutdown()
    app = typer.Typer(add_completion=False)
    app.command(help=Serve.__doc__)(Serve)
    return app(argv, prog_name="diff-transformer serve")


if __name__ == "__main__":
    main()
