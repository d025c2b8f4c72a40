"""`diff-transformer inspect`: one head's attention maps (A1, A2, A1 - λA2, λ per layer) as a figure, and optionally
every layer's metrics as a grid and JSON. Bounded before anything loads: TEXT within the model's context and its maps
within --max-memory-gb; outputs checked writable and outside MODEL."""

import math
from pathlib import Path

from ..checkpoints.backends import add_attn_option
from ..errors import UserError
from .options import add_base_option, add_device_options, add_quiet_option, load_kwargs, resolve_device


INSPECT_MAX_DPI = 600


def add_parser(commands) -> None:
    inspect = commands.add_parser(
        "inspect", help="plot one head's attention maps (A1, A2, A1 - λA2, λ per layer) of a Diff, DiffLlama or Llama"
    )
    inspect.add_argument("model", help="model directory or Hub id org/name (hf://name forces a Hub id)")
    inspect.add_argument("text", help="text (or space-separated token ids if the model has no tokenizer)")
    inspect.add_argument("--layer", type=int, default=0, help="layer to plot (default 0)")
    inspect.add_argument("--head", type=int, default=0, help="differential head to plot (default 0)")
    inspect.add_argument("--out", help="figure file of the head's maps: .png, .pdf, .svg, ... (default: none)")
    inspect.add_argument(
        "--json", help="also write the head's maps, λ and per-layer/head metrics as JSON (default: none)"
    )
    inspect.add_argument(
        "--span", help="START:STOP token positions of an answer: adds the answer and noise metrics (default: none)"
    )
    inspect.add_argument(
        "--grid", help="also write a layer x head heatmap of --metric to this figure file (default: none)"
    )
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
    add_device_options(inspect)
    add_attn_option(inspect)
    add_base_option(inspect)
    add_quiet_option(inspect)
    inspect.set_defaults(func=run, early_check=_check_inspect_options)


def run(args) -> int:
    """Attention maps of one head (A1, A2, A1 - λA2, λ per layer) as a figure, and optionally every map as JSON."""
    from diff_transformer.analysis.maps import maps_and_metrics

    from ..checkpoints.opening import open_checkpoint
    from ..outputs.files import refuse_inside_source

    _check_inspect_options(args)
    device = resolve_device(args.device)
    out, json_out, grid_out = _output_files(args)
    checkpoint = open_checkpoint(args.model, args.base)
    outputs = (("--out", out), ("--json", json_out), ("--grid", grid_out))
    for directory in (checkpoint.local, checkpoint.adapter):
        refuse_inside_source(outputs, directory, f"MODEL {args.model}")
    tokenizer, ids = _token_ids(args, checkpoint.tokenizer)
    # Everything about the inputs is checked before the weights load.
    config, kind = _checked_config(args, checkpoint.config, ids)
    span = _span(args, ids)
    need_metrics = json_out is not None or grid_out is not None
    _check_inspect_size(args, ids.shape[1], config, kind, all_layers=need_metrics)
    model = checkpoint.load(merge=True, **load_kwargs(args.dtype, args.attn_implementation))  # merged: its maps
    model = model.eval().to(device)
    entries, metrics = maps_and_metrics(model, ids.to(device), args.layer, span, need_metrics)
    if tokenizer is not None:
        tokens = [tokenizer.decode([i]) for i in ids[0].tolist()]  # readable pieces, not byte-level symbols
    else:
        tokens = [str(i) for i in ids[0].tolist()]
    wrote = _write_outputs(args, (out, json_out, grid_out), kind, tokens, span, entries, metrics)
    for line in wrote:
        print(line)
    return 0


def _output_files(args) -> tuple[Path | None, Path | None, Path | None]:
    """--out, --json and --grid checked writable (figures: in a format matplotlib writes here), each a different
    file, before anything loads."""
    from ..outputs.files import check_output_file

    figure_types = set()
    if args.out or args.grid:  # figures: a missing matplotlib is one line, before anything loads
        from diff_transformer.analysis.plotting import _matplotlib, writable_figure_types

        Figure, _ = _matplotlib()
        figure_types = writable_figure_types(Figure)
    out = check_output_file(args.out, "--out", args.overwrite, suffixes=figure_types) if args.out else None
    json_out = check_output_file(args.json, "--json", args.overwrite, suffixes={"json"}) if args.json else None
    grid_out = check_output_file(args.grid, "--grid", args.overwrite, suffixes=figure_types) if args.grid else None
    named = [path.resolve() for path in (out, json_out, grid_out) if path is not None]
    if len(set(named)) < len(named):
        raise UserError("--out, --json and --grid name the same file: give each a different name.")
    return out, json_out, grid_out


def _token_ids(args, tokenizer):
    """(TOKENIZER, TEXT's token ids (1, N)): a model without a tokenizer (None) takes space-separated ids."""
    import torch

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
    return tokenizer, ids


def _checked_config(args, config, ids):
    """(CONFIG, MODEL's kind), with --layer, --head and TEXT's token ids checked against it."""
    from types import SimpleNamespace

    from diff_transformer.analysis import heads_per_layer, model_kind

    try:
        kind = model_kind(SimpleNamespace(config=config))
    except ValueError as error:
        raise UserError(f"MODEL {args.model}: {error}") from None
    layers = config.num_hidden_layers
    heads = heads_per_layer(kind, config)
    if not 0 <= args.layer < layers:
        raise UserError(f"--layer {args.layer} is out of range: MODEL {args.model} has layers 0 to {layers - 1}.")
    if not 0 <= args.head < heads:
        raise UserError(
            f"--head {args.head} is out of range: MODEL {args.model} has heads 0 to {heads - 1} per layer."
        )
    vocab = config.vocab_size
    if not ((0 <= ids) & (ids < vocab)).all():
        raise UserError(f"a token id in TEXT is out of range for MODEL {args.model}: use ids from 0 to {vocab - 1}.")
    return config, kind


def _span(args, ids) -> tuple[int, int] | None:
    """--span START:STOP as token positions within TEXT, or None."""
    if not args.span:
        return None
    return _span_bounds(args.span, ids.shape[1])


def _span_bounds(text: str, tokens: int | None = None) -> tuple[int, int]:
    """--span TEXT as (START, STOP), 0 <= START < STOP (<= TOKENS, TEXT's token count, once it is known)."""
    try:
        span = tuple(int(part) for part in text.split(":"))
    except ValueError:
        span = ()
    if len(span) != 2 or not 0 <= span[0] < span[1] <= (span[1] if tokens is None else tokens):
        bound = "" if tokens is None else f" <= {tokens} (the TEXT's token count)"
        raise UserError(f"--span {text} must be START:STOP with 0 <= START < STOP{bound}.")
    return span


def _write_outputs(args, paths, kind: str, tokens, span, entries, metrics) -> list[str]:
    """The figure, grid and JSON asked for, every one or none (an interrupt too leaves no temporary file); the lines
    saying what was written."""
    import json

    from diff_transformer.analysis import KIND_NAMES
    from diff_transformer.analysis.maps import head_record, lambda_summary
    from diff_transformer.analysis.plotting import head_figure

    from ..outputs.files import OutputFiles

    out, json_out, grid_out = paths
    name = KIND_NAMES[kind]
    title = f"{name}: {Path(str(args.model)).name}, {len(tokens)} tokens"
    files, wrote = OutputFiles(), []
    try:
        if out is not None:
            figure = head_figure(entries, args.layer, args.head, tokens=tokens, title=title)
            files.add(out, lambda path: figure.savefig(path, dpi=args.dpi))
            wrote.append(f"wrote {out} ({name}, layer {args.layer}, head {args.head})")
        if summary := lambda_summary(entries, kind):  # λ's sign: a layer with λ < 0 adds its second map
            print(summary)
        if grid_out is not None:
            from diff_transformer.analysis.plotting import metric_grid

            grid = metric_grid(metrics[args.metric], args.metric, title=f"{title}: {args.metric}")
            files.add(grid_out, lambda path: grid.savefig(path, dpi=args.dpi))
            wrote.append(f"wrote {grid_out} ({args.metric}, layers x heads)")
        if json_out is not None:
            report = {
                "model": str(args.model),
                "kind": kind,
                "tokens": tokens,
                "layer": args.layer,
                "head": args.head,
                "span": None if span is None else list(span),
                **head_record(entries[args.layer], args.head, metrics),
            }
            files.add(json_out, lambda path: Path(path).write_text(json.dumps(report)))
            wrote.append(f"wrote {json_out}")
        files.install()
    except BaseException:
        files.discard()
        raise
    return wrote


def _check_inspect_options(args) -> None:
    """The options that need no model: before torch loads (`cli.main`), and again in `run` for its callers. --layer,
    --head and --span are checked against MODEL and TEXT later (`_checked_config`, `_span`)."""
    if not (args.out or args.json or args.grid):
        raise UserError("inspect writes --out (a figure), --json (the maps and metrics) or --grid: name at least one.")
    if not 1 <= args.dpi <= INSPECT_MAX_DPI:
        raise UserError(f"--dpi {args.dpi} must be between 1 and {INSPECT_MAX_DPI} (dots per inch of the figures).")
    if not (math.isfinite(args.max_memory_gb) and args.max_memory_gb > 0):
        raise UserError(f"--max-memory-gb {args.max_memory_gb} must be a number > 0.")
    for option, value in (("--layer", args.layer), ("--head", args.head)):
        if value < 0:
            raise UserError(f"{option} {value} must be >= 0 (an index, from 0).")
    if args.span:
        _span_bounds(args.span)
    if args.metric in ("answer", "noise") and args.grid and not args.span:
        raise UserError(f"--metric {args.metric} needs --span START:STOP (the answer's token positions).")


def _check_inspect_size(args, tokens: int, config, kind: str, all_layers: bool) -> None:
    """TEXT fits the model's context, and the maps computed for it fit --max-memory-gb (`maps_bytes`), before the
    weights load."""
    context = getattr(config, "max_position_embeddings", None)
    if context is not None and tokens > context:
        raise UserError(
            f"TEXT has {tokens} tokens, beyond MODEL {args.model}'s context ({context} positions): shorten it."
        )
    from diff_transformer.analysis.maps import maps_bytes

    needed = maps_bytes(config, kind, tokens, all_layers)
    if needed > args.max_memory_gb * 1e9:
        raise UserError(
            f"TEXT has {tokens} tokens: its attention maps need about {needed / 1e9:.1f} GB, over --max-memory-gb "
            f"{args.max_memory_gb:g}: shorten the text, or raise --max-memory-gb if the memory is there."
        )
