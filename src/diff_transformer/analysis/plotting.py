"""Figures of `diff_transformer.analysis` maps (matplotlib: `pip install 'diff-transformer[analysis]'`).

`head_figure`: A1, A2, the differential map A1 - λA2 (diverging colormap centred at 0) and λ per layer for one head;
`metric_grid`: a layer x head heatmap of any (layers, H) metric. Both return a `matplotlib.figure.Figure` built
without pyplot (no global state, any backend); `fig.savefig(path)` writes it.
"""

import torch

from diff_transformer.errors import UserError, missing


# Text that comes from the user (a model path, the tokens of TEXT) is drawn as it is: without these, a `$...$` in it
# is parsed as mathtext (`_`, `^`, `\` then mean something, and `$\foo$` fails when the figure is saved), and a
# matplotlibrc with text.usetex would send it through LaTeX.
LITERAL = {"parse_math": False, "usetex": False}


def _matplotlib():
    try:
        from matplotlib.colors import TwoSlopeNorm
        from matplotlib.figure import Figure
    except ImportError as exc:
        message = missing(["matplotlib"], "analysis", "plotting")
        raise UserError(message or f"plotting needs matplotlib, which fails to import ({exc}): reinstall.") from None
    return Figure, TwoSlopeNorm


LAYER_TICKS = 10  # at most this many labelled layers on the λ panel's axis: 30 labels in its width overlapped


def layer_ticks(count: int, most: int = LAYER_TICKS) -> list[int]:
    """The layers labelled on an axis of COUNT layers: every k-th from 0, k the smallest that gives at most MOST."""
    step = max(1, -(-count // most))  # ceil(count / most)
    return list(range(0, count, step))


def _show_map(fig, ax, values, tokens, title, cmap, norm=None, vmin=None, vmax=None):
    image = ax.imshow(values.numpy(), cmap=cmap, norm=norm, vmin=vmin, vmax=vmax, interpolation="nearest")
    ax.set_title(title, fontsize=9, **LITERAL)
    ax.set_xlabel("key", fontsize=8)
    ax.set_ylabel("query", fontsize=8)
    if tokens is not None and len(tokens) <= 40:
        positions = list(range(len(tokens)))
        ax.set_xticks(positions, tokens, rotation=90, fontsize=6, **LITERAL)
        ax.set_yticks(positions, tokens, fontsize=6, **LITERAL)
    else:
        ax.tick_params(labelsize=7)
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04).ax.tick_params(labelsize=7)


def head_figure(entries, layer: int, head: int, tokens=None, batch: int = 0, title: str | None = None):
    """Four panels for one head: A1, A2, A1 - λA2 (on a colormap centred at 0) and λ per layer.

    For a Llama (one softmax map per head, no λ) the A2 and λ panels say so instead.

    Args:
        entries: `attention_maps`'s result.
        layer: index into `entries`.
        head: differential head.
        tokens: the N token strings, for the axes; None for positions.
        batch: the sequence of the batch to draw.
        title: figure title.

    Returns:
        A `matplotlib.figure.Figure` (save it with `fig.savefig(path)`).
    """
    Figure, TwoSlopeNorm = _matplotlib()
    entry = entries[layer]
    valid = entry.mask[batch].any(-1)  # (N,): query rows that see a key (not left padding)
    first = entry.first[batch, head][valid][:, valid].cpu()  # (n, n)
    fig = Figure(figsize=(16, 4.2), layout="constrained")
    axes = fig.subplots(1, 4)
    shown = None if tokens is None else [t for t, keep in zip(tokens, valid.tolist()) if keep]
    _show_map(fig, axes[0], first, shown, f"A1 (softmax), layer {layer} head {head}", "viridis", vmin=0, vmax=1)
    if entry.second is None:
        axes[1].axis("off")
        axes[1].text(0.5, 0.5, "Llama: one softmax map per head\n(no A2, no λ)", ha="center", va="center")
        differential = first
    else:
        second = entry.second[batch, head][valid][:, valid].cpu()
        _show_map(fig, axes[1], second, shown, "A2 (softmax)", "viridis", vmin=0, vmax=1)
        differential = entry.differential[batch, head][valid][:, valid].cpu()
    bound = max(differential.abs().max().item(), 1e-6)
    norm = TwoSlopeNorm(vcenter=0.0, vmin=-bound, vmax=bound)
    name = "A1 (= the map: no λ)" if entry.second is None else "A1 − λ·A2 (blue < 0 < red)"
    _show_map(fig, axes[2], differential, shown, name, "RdBu_r", norm=norm)

    ax = axes[3]
    if entry.lam is None:
        ax.axis("off")
        ax.text(0.5, 0.5, "Llama: no λ", ha="center", va="center")
    else:
        layers = list(range(len(entries)))
        if entry.lam.dim() == 0:  # V1, DiffLlama: one scalar per layer
            values = [e.lam.item() for e in entries]
            ax.plot(layers, values, "o-", color="C0")
            ax.set_title("λ per layer (one scalar)", fontsize=9)
        else:  # V2: per token; mean over valid tokens of this head, bars from min to max
            per_token = [e.lam[batch, head][valid].cpu() for e in entries]
            mean = torch.stack([t.mean() for t in per_token])
            low = mean - torch.stack([t.min() for t in per_token])
            high = torch.stack([t.max() for t in per_token]) - mean
            ax.errorbar(layers, mean.numpy(), yerr=torch.stack([low, high]).numpy(), fmt="o-", color="C0", capsize=3)
            ax.set_title(f"λ per layer, head {head} (token mean, min–max)", fontsize=9)
        ax.axvline(layer, color="C3", linestyle=":", label=f"layer {layer}")
        ax.set_xlabel("layer", fontsize=8)
        ax.set_ylabel("λ", fontsize=8)
        ax.set_xticks(layer_ticks(len(layers)))
        ax.tick_params(labelsize=7)
        ax.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=10, **LITERAL)
    return fig


def metric_grid(values, name: str, title: str | None = None):
    """A layer × head heatmap, each cell annotated with its value.

    Args:
        values: `(layers, H)`, e.g. one entry of `layer_metrics`'s result.
        name: the metric's name, for the colour bar.
        title: figure title.

    Returns:
        A `matplotlib.figure.Figure`.
    """
    Figure, _ = _matplotlib()
    values = torch.as_tensor(values, dtype=torch.float32).cpu()
    layers, heads = values.shape
    fig = Figure(figsize=(1.2 + 0.7 * heads, 1.0 + 0.45 * layers), layout="constrained")
    ax = fig.subplots()
    image = ax.imshow(values.numpy(), cmap="magma", aspect="auto", interpolation="nearest")
    low, high = image.get_clim()
    middle = (low + high) / 2
    for i in range(layers):
        for j in range(heads):
            value = values[i, j].item()
            color = "black" if value == value and value > middle else "white"  # readable on magma's bright end
            ax.text(j, i, "–" if value != value else f"{value:.2f}", ha="center", va="center", fontsize=7, color=color)
    ax.set_xticks(range(heads))
    ax.set_yticks(range(layers))
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_title(title or name, fontsize=10, **LITERAL)
    fig.colorbar(image, ax=ax).set_label(name, **LITERAL)
    return fig


__all__ = ["head_figure", "layer_ticks", "metric_grid"]


def writable_figure_types(Figure) -> set[str]:
    """The figure suffixes matplotlib writes here on its own: pgf needs a TeX program (xelatex by default) and
    fails at the end of the run without one, so it counts only where that program is installed."""
    import shutil

    import matplotlib

    types = set(Figure().canvas.get_supported_filetypes())
    if not shutil.which(str(matplotlib.rcParams.get("pgf.texsystem", "xelatex"))):
        types.discard("pgf")
    return types
