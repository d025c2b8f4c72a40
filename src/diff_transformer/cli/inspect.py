"""`diff-transformer inspect`: one head's attention maps (A1, A2, A1 - λA2, λ per layer) as a figure, and optionally
every layer's metrics as a grid and JSON. Bounded before anything loads: TEXT within the model's context and its maps
within --max-memory-gb; outputs checked writable and outside MODEL."""

import math
import os
import tempfile
from pathlib import Path

from ..checkpoints.adapters import load_tokenizer
from ..checkpoints.backends import add_attn_option
from ..errors import UserError, one_line
from .options import (
    add_base_option,
    add_device_options,
    add_quiet_option,
    load_kwargs,
    resolve_device,
)


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
    inspect.set_defaults(func=run)


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
    _probe_writable(out, option)
    return out


def _probe_writable(out: Path, option: str) -> None:
    """Create and remove a file beside OUT: a read-only or full directory is refused before any work is done."""

    try:
        fd, probe = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise UserError(
            f"{option} {out}: cannot write in {out.parent} ({exc.strerror or exc}): choose a writable directory."
        ) from None


def _refuse_inside_model(paths, local: Path | None, model: str) -> None:
    """No output may be written inside MODEL's directory (its config.json, say): sources are never modified."""
    if local is None:
        return
    root = local.resolve()
    for option, path in paths:
        if path is not None and (path.resolve() == root or root in path.resolve().parents):
            raise UserError(
                f"{option} {path} lies inside MODEL {model}, which is never modified: write it somewhere else."
            )


def writable_figure_types(Figure) -> set[str]:
    """The figure suffixes matplotlib writes here on its own: pgf needs a TeX program (xelatex by default) and
    fails at the end of the run without one, so it counts only where that program is installed."""
    import shutil

    import matplotlib

    types = set(Figure().canvas.get_supported_filetypes())
    if not shutil.which(str(matplotlib.rcParams.get("pgf.texsystem", "xelatex"))):
        types.discard("pgf")
    return types


class _Outputs:
    """The files of one run, each written to a temporary file beside it (`add`) and renamed into place together
    (`install`) once every one is complete: a failure leaves none of them, and nothing half-written."""

    def __init__(self):
        self.pending: list[tuple[str, Path]] = []

    def add(self, out: Path, write) -> None:
        try:
            fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=out.suffix)
        except OSError as exc:
            self.discard()
            raise UserError(
                f"cannot write {out} ({exc.strerror or exc}): check the directory and free space."
            ) from None
        os.close(fd)
        self.pending.append((tmp, out))
        try:
            write(tmp)
        except OSError as exc:
            self.discard()
            raise UserError(
                f"writing {out} failed ({exc.strerror or exc}): check free space and permissions."
            ) from None
        except (RuntimeError, ValueError) as exc:  # matplotlib: a format it cannot write here, text it cannot draw
            self.discard()
            raise UserError(f"writing {out} failed ({one_line(exc)}): choose another format, e.g. .png.") from None
        except BaseException:
            self.discard()
            raise

    def install(self) -> None:
        umask = os.umask(0)
        os.umask(umask)
        try:
            for tmp, out in self.pending:
                os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it private: the permissions of a file the user creates
                os.replace(tmp, out)
        except OSError as exc:
            self.discard()
            raise UserError(
                f"writing {out} failed ({exc.strerror or exc}): check free space and permissions."
            ) from None
        self.pending = []

    def discard(self) -> None:
        for tmp, _ in self.pending:
            Path(tmp).unlink(missing_ok=True)
        self.pending = []


def run(args) -> int:
    """Attention maps of one head (A1, A2, A1 - λA2, λ per layer) as a figure, and optionally every map as JSON."""
    import json
    from types import SimpleNamespace

    import torch

    from diff_transformer.analysis import KIND_NAMES, heads_per_layer, model_kind
    from diff_transformer.analysis.plotting import _matplotlib, head_figure

    from ..checkpoints import adapters
    from ..checkpoints.loading import check_diff_checkpoint

    _check_inspect_options(args)
    device = resolve_device(args.device)
    figure_types = set()
    if args.out or args.grid:  # figures: a missing matplotlib is one line, before anything loads
        Figure, _ = _matplotlib()
        figure_types = writable_figure_types(Figure)
    out = _output_file(args.out, "--out", args.overwrite, suffixes=figure_types) if args.out else None
    json_out = _output_file(args.json, "--json", args.overwrite, suffixes={"json"}) if args.json else None
    grid_out = _output_file(args.grid, "--grid", args.overwrite, suffixes=figure_types) if args.grid else None
    named = [path.resolve() for path in (out, json_out, grid_out) if path is not None]
    if len(set(named)) < len(named):
        raise UserError("--out, --json and --grid name the same file: give each a different name.")
    if args.metric in ("answer", "noise") and args.grid and not args.span:
        raise UserError(f"--metric {args.metric} needs --span START:STOP (the answer's token positions).")
    source = adapters.resolve(args.model, args.base)
    location, local = source.location, source.local
    outputs = (("--out", out), ("--json", json_out), ("--grid", grid_out))
    for directory in (local, source.adapter):
        _refuse_inside_model(outputs, directory, args.model)
    from transformers import AutoConfig, AutoTokenizer

    import diff_transformer  # noqa: F401  (registers the Auto classes: AutoConfig reads Diff configs)

    if local is not None:
        check_diff_checkpoint(local)

    tokenizer = load_tokenizer(AutoTokenizer, source.tokenizer, source.tokenizer_local, args.model)
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
    need_metrics = json_out is not None or grid_out is not None
    _check_inspect_size(args, ids.shape[1], config, kind, all_layers=need_metrics)
    model = adapters.load(source, merge=True, **load_kwargs(args.dtype, args.attn_implementation))  # merged: its maps
    model = model.eval().to(device)
    entries, metrics = _inspect_maps(model, ids.to(device), args.layer, span, need_metrics)
    if tokenizer is not None:
        tokens = [tokenizer.decode([i]) for i in ids[0].tolist()]  # readable pieces, not byte-level symbols
    else:
        tokens = [str(i) for i in ids[0].tolist()]

    name = KIND_NAMES[kind]
    title = f"{name}: {Path(str(args.model)).name}, {ids.shape[1]} tokens"
    files, wrote = _Outputs(), []
    try:  # every output, or none: an interrupt too leaves no temporary file
        if out is not None:
            figure = head_figure(entries, args.layer, args.head, tokens=tokens, title=title)
            files.add(out, lambda path: figure.savefig(path, dpi=args.dpi))
            wrote.append(f"wrote {out} ({name}, layer {args.layer}, head {args.head})")
        lambdas = [float(entry.lam.float().mean()) for entry in entries if entry.lam is not None]
        if lambdas:  # λ's sign: a layer with λ < 0 adds its second map instead of subtracting it
            each = "mean over tokens and heads" if kind == "diff-v2" else "one per layer"
            negative = sum(value < 0 for value in lambdas)
            print(
                f"λ per layer ({each}): {', '.join(f'{value:+.3f}' for value in lambdas)}; {negative} of "
                f"{len(lambdas)} layers have λ < 0 (they add their second map instead of subtracting it)"
            )
        if grid_out is not None:
            from diff_transformer.analysis.plotting import metric_grid

            grid = metric_grid(metrics[args.metric], args.metric, title=f"{title}: {args.metric}")
            files.add(grid_out, lambda path: grid.savefig(path, dpi=args.dpi))
            wrote.append(f"wrote {grid_out} ({args.metric}, layers x heads)")
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
            files.add(json_out, lambda path: Path(path).write_text(json.dumps(report)))
            wrote.append(f"wrote {json_out}")
        files.install()
    except BaseException:
        files.discard()
        raise
    for line in wrote:
        print(line)
    return 0


def _check_inspect_options(args) -> None:
    if not (args.out or args.json or args.grid):
        raise UserError("inspect writes --out (a figure), --json (the maps and metrics) or --grid: name at least one.")
    if not 1 <= args.dpi <= INSPECT_MAX_DPI:
        raise UserError(f"--dpi {args.dpi} must be between 1 and {INSPECT_MAX_DPI} (dots per inch of the figures).")
    if not (math.isfinite(args.max_memory_gb) and args.max_memory_gb > 0):
        raise UserError(f"--max-memory-gb {args.max_memory_gb} must be a number > 0.")


def _check_inspect_size(args, tokens: int, config, kind: str, all_layers: bool) -> None:
    """TEXT fits the model's context, and the maps computed for it fit --max-memory-gb, before the weights load.
    Each layer's maps are (query heads, N, N) fp32, several at once (two softmaxes, their difference, the metrics'
    temporaries): about 10 of them for the layer being measured plus the plotted layer's 3 when metrics run over
    every layer (--grid/--json), 6 for the plotted layer alone."""
    context = getattr(config, "max_position_embeddings", None)
    if context is not None and tokens > context:
        raise UserError(
            f"TEXT has {tokens} tokens, beyond MODEL {args.model}'s context ({context} positions): shorten it."
        )
    query_heads = config.num_attention_heads * (2 if kind in ("diff-v1", "diff-v2") else 1)
    needed = (13 if all_layers else 6) * query_heads * tokens * tokens * 4
    if needed > args.max_memory_gb * 1e9:
        raise UserError(
            f"TEXT has {tokens} tokens: its attention maps need about {needed / 1e9:.1f} GB, over --max-memory-gb "
            f"{args.max_memory_gb:g}: shorten the text, or raise --max-memory-gb if the memory is there."
        )


def _inspect_maps(model, ids, layer: int, span, need_metrics: bool):
    """(entries for head_figure: the plotted layer's maps, every layer's λ; the (layers, heads) metrics or None),
    one layer's maps in memory at a time; without metrics only the plotted layer's maps are computed."""
    from dataclasses import replace

    import torch

    from diff_transformer.analysis import iter_attention_maps, layer_metrics

    entries, rows = [], []
    for index, entry in enumerate(iter_attention_maps(model, ids, maps_for=None if need_metrics else {layer})):
        if need_metrics:
            rows.append(layer_metrics([entry], span=span))  # (1, heads) each; answer/noise at the last position
        entries.append(entry if index == layer else replace(entry, first=None, second=None, differential=None))
    if not need_metrics:
        return entries, None
    return entries, {key: torch.cat([row[key] for row in rows]) for key in rows[0]}
