"""`diff-transformer serve`: transformers' own OpenAI-compatible server (`transformers serve`) for Diff models.

transformers 5.23's server looks the model class up by name on the `transformers` package
(`getattr(transformers, config.architectures[0])` in `transformers/cli/serving/model_manager.py`), so it only loads
architectures that transformers ships: `transformers serve --trust-remote-code` fails on every custom-code
checkpoint with "module transformers has no attribute DiffForCausalLM". This command imports diff_transformer (which
registers the Auto classes), makes the Diff classes resolvable where the server looks, and then runs transformers'
`serve` command in this process with the same options (`diff-transformer serve --help`).
"""

import sys


def expose_to_transformers_serve() -> None:
    """Make `getattr(transformers, "DiffForCausalLM")` (and DiffModel) resolve for transformers' model manager."""
    from transformers.cli.serving import model_manager

    from ..modeling_diff import DiffForCausalLM, DiffModel

    # The module object the model manager imported (transformers can swap `sys.modules["transformers"]` for a
    # fresh lazy module while importing its submodules, so `import transformers` here could be a different one).
    for cls in (DiffModel, DiffForCausalLM):
        setattr(model_manager.transformers, cls.__name__, cls)


def main(argv=None):
    """Run `transformers serve` with ARGV (its options: model, --continuous-batching, --port, ...)."""
    import typer
    from transformers.cli.serve import Serve

    expose_to_transformers_serve()
    app = typer.Typer(add_completion=False)
    app.command(help=Serve.__doc__)(Serve)
    return app(sys.argv[1:] if argv is None else list(argv), prog_name="diff-transformer serve")


if __name__ == "__main__":
    main()
