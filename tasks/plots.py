"""Figures logged to MLflow: the loss curve and the mark-out curve (research flow); the
ladder's throughput per rung and a rung's loss curve against the baseline's.

Every figure takes plain lists and mappings, so its caller's records stay its own."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib

matplotlib.use("Agg")  # no display on workers or CI
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402


def loss_curve(loss: list[float], log_every: int) -> Figure:
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([(i + 1) * log_every for i in range(len(loss))], loss)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (standardized MSE)")
    ax.set_title("loss curve")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def markout_curve(curves: Mapping[str, Mapping[str, float]], title: str = "mark-out") -> Figure:
    """curves: signal name -> {horizon label: mean mark-out in bps}."""
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, curve in curves.items():
        labels = list(curve)
        ax.plot(labels, [curve[h] for h in labels], marker="o", label=name)
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xlabel("horizon")
    ax.set_ylabel("mean mark-out (bps)")
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def throughput_bars(
    labels: Sequence[str], samples_per_s: Sequence[float], ok: Sequence[bool], title: str
) -> Figure:
    """One bar per label; red where `ok` is False (a rung that is not equivalent)."""
    fig, ax = plt.subplots(figsize=(7, 3.5))
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
    fig, ax = plt.subplots(figsize=(6, 3.5))
    steps = [(i + 1) * log_every for i in range(len(base))]
    ax.plot(steps, base, label="baseline")
    ax.plot(steps, loss, "--", label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (interval mean)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    return fig
