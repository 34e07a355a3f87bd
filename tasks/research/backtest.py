"""Backtest nodes: a registered model's predictions and mark-out on one (product, day).

A backtest node reads one feature node's output (the features the model was trained
on, computed or found by the features stage), predicts every event with the model,
trades the day on the prediction and marks the trades out (tasks/research/simulation.py's rules:
fills at the touch, the greedy cool-down, mark-out at clock and event horizons). Its
output is the day's trades with their predictions and mark-outs.

Its key is the engine's: sha256(kind, code, params digest, input digest), where the
params carry the model's key and weights digest, the device type and the simulation
settings. A re-run is a cache hit; a new model version (other weights) recomputes.

The trading threshold is the `trade_quantile` of the day's own |prediction| (a bulk
backtest has no training period per day to take it from, as the simulation does):
each day trades at the same rate, and what the mark-out measures is whether the
model's largest predicted moves point the right way.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import asdict
from functools import partial
from typing import Any

import numpy as np
import pyarrow as pa

from quantloop.models import orderbook
from quantloop.tasks.engine import NodeKind, code_fingerprint
from quantloop.tasks.research import simulation, training
from quantloop.tasks.research.simulation import SimConfig, markout, signal_column, simulate
from quantloop.tasks.research.training import TrainResult, load_model

KIND = "backtest"

# A Dask worker runs many batches of one backtest: the model is loaded (and its digest
# checked) once per worker process and device, not once per batch.
_MODELS: dict[tuple[str, str, str], TrainResult] = {}
MODELS_KEPT = 4
_LOCK = threading.Lock()


def node_params(model_key: str, model_digest: str, device: str, config: SimConfig) -> dict:
    """What a backtest node's key takes from the model and the run (JSON values)."""
    return {"model_key": model_key, "model_digest": model_digest, "device": device,
            "sim": asdict(config)}  # fmt: skip


def prepare(values: dict[str, Any], *, model_url: str) -> tuple[TrainResult, SimConfig]:
    """The model on its device and the simulation settings, once per batch."""
    cached = (model_url, values["model_digest"], values["device"])
    with _LOCK:
        model = _MODELS.get(cached)
        if model is None:
            model = load_model(model_url, device=values["device"])  # checks the digest
            if model.model_digest != values["model_digest"]:
                raise ValueError(f"{model_url}: weights {model.model_digest[:12]} are not the "
                                 f"version's {values['model_digest'][:12]}")  # fmt: skip
            while len(_MODELS) >= MODELS_KEPT:  # the oldest goes: dicts keep insertion order
                del _MODELS[next(iter(_MODELS))]
            _MODELS[cached] = model
    sim = dict(values["sim"])
    sim["markout_horizons_s"] = tuple(sim["markout_horizons_s"])
    sim["markout_horizons_events"] = tuple(sim["markout_horizons_events"])
    return model, SimConfig(**sim)


def backtest_day(features: pa.Table, prepared: tuple[TrainResult, SimConfig]) -> pa.Table:
    """One day's trades on the model's prediction, marked out: simulate()'s columns
    (row, time, side, price, mid, signal: the predicted move in bps) and one
    `markout_<horizon>` column per horizon (bps)."""
    model, config = prepared
    signal = signal_column(training.predict(model, features), config)
    magnitude = np.abs(signal[np.isfinite(signal)])
    # no finite prediction: no trade (an infinite threshold triggers nothing)
    threshold = float(np.quantile(magnitude, config.trade_quantile)) if len(magnitude) else np.inf
    return markout(simulate(features, signal, threshold, config), features, config)


def backtest_kind(model_url: str) -> NodeKind:
    """The backtest node kind reading its model from `model_url` (where the model is
    does not enter the key: its digest does, through the params)."""
    return NodeKind(
        name=KIND,
        compute=backtest_day,
        code=code_fingerprint(sys.modules[__name__], simulation, training, orderbook),
        prepare=partial(prepare, model_url=model_url),
    )
