"""Figures logged to MLflow: the loss curve and the mark-out curve (research flow); the
ladder's throughput per rung and a rung's loss curve against the baseline's.

Every figure takes plain lists and mappings, so its caller's records stay its own. They
are drawn with matplotlib's object API (a `Figure` of its own, Agg's canvas), not pyplot:
pyplot keeps a registry of open figures shared by every thread, while a `Figure` made
and saved by one thread is that thread's alone (matplotlib's "Embedding in a web
application server" advice); so a record's figure can be drawn beside the run's work,
in the thread that sends the record. `png` saves one."""

from __future__ import annotations

import functools
import io
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # matplotlib (~0.4 s) is imported by the first figure, not by this module
    from matplotlib.figure import Figure


@functools.cache
def _figure_class() -> Any:
    """matplotlib's Figure, with Agg's canvas imported (PNG, no display on workers or CI)."""
    import matplotlib.backends.backend_agg  # noqa: F401  (savefig's canvas for PNG)
    from matplotlib.figure import Figure

    return Figure


def new_figure(**kwargs: Any) -> Figure:
    """A figure no registry keeps: it is freed with its last reference."""
    return _figure_class()(**kwargs)


def png(fig: Figure) -> bytes:
    """The figure as PNG bytes."""
    out = io.BytesIO()
    fig.savefig(out, format="png")
    return out.getvalue()


def loss_curve(loss: list[float], log_every: int) -> Figure:
    fig = new_figure(figsize=(6, 3.5))
    ax = fig.subplots()
    ax.plot([(i + 1) * log_every for i in range(len(loss))], loss)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (standardized MSE)")
    ax.set_title("loss curve")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def markout_curve(
    curves: Mapping[str, Mapping[str, float]],
    errors: Mapping[str, Mapping[str, float]] | None = None,
    title: str = "mark-out",
) -> Figure:
    """curves: signal name -> {horizon label: mean mark-out in bps}; errors: the same
    shape, standard errors drawn as bars. Clock horizons ("5s") and event horizons
    ("10ev") are two panels, each on its own axis: they are different clocks, and one
    line through both would join points that are not neighbours."""
    fig = new_figure(figsize=(8, 3.5))
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    panels = [("clock horizon (s)", "s"), ("event horizon (events)", "ev")]
    axes = fig.subplots(1, 2, sharey=True, gridspec_kw={"width_ratios": [3, 2]})
    for ax, (label, unit) in zip(axes, panels, strict=True):
        for name, curve in curves.items():
            keys = [h for h in curve if h.endswith(unit)]  # "5s" or "10ev"
            x = [float(h[: -len(unit)]) for h in keys]
            y = [curve[h] for h in keys]
            err = [errors[name][h] for h in keys] if errors and name in errors else None
            ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=name)
        ax.set_xscale("log")
        # Ticks at the horizons measured, none between: a log axis's minor ticks (2..9 a
        # decade) were most of the figure's 0.24 s (each tick is objects to lay out)
        shown = sorted({float(h[: -len(unit)]) for c in curves.values() for h in c
                        if h.endswith(unit)})  # fmt: skip
        ax.xaxis.set_major_locator(FixedLocator(shown))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.axhline(0, color="grey", lw=0.8)
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("mean mark-out (bps)")
    axes[0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def throughput_bars(
    labels: Sequence[str], samples_per_s: Sequence[float], ok: Sequence[bool], title: str
) -> Figure:
    """One bar per label; red where `ok` is False (a rung that is not equivalent)."""
    fig = new_figure(figsize=(7, 3.5))
    ax = fig.subplots()
    ax.bar(list(labels), list(samples_per_s), color=["tab:blue" if g else "tab:red" for g in ok])
    ax.set_ylabel("samples/s")
    ax.set_title(title)
    ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    return fig


def loss_vs_baseline(
    base: Sequence[float], loss: Sequence[float], log_every: int, *, label: str, title: str
) -> Figure:
    """Two loss curves of interval means (one point per `log_every` steps): the baseline's
    solid, `label`'s dashed."""
    fig = new_figure(figsize=(6, 3.5))
    ax = fig.subplots()
    steps = [(i + 1) * log_every for i in range(len(base))]
    ax.plot(steps, base, label="baseline")
    ax.plot(steps, loss, "--", label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (interval mean)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    return fig
