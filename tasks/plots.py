"""Figures logged to MLflow: the loss curve and the mark-out curve."""

from __future__ import annotations

from collections.abc import Mapping

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
