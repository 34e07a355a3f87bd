"""A model's predictions of a feature table, kept by what they are a function of.

A research run's simulation predicts each fold's days with the fold's model; promoting
that model replays it on the same held-out days (flows/promote.markout_gate), which
predicted them all again: on this 2-core VM most of a promotion's compute. Here the
simulation stores what it predicted and the gate reads it back.

The key is everything a prediction depends on, so a hit is the prediction that would
be made, never a stale one:
- the model: its weights' digest, the normalizer, the window rule, inputs and outputs;
- the table: the sha256 of its input matrix (the model's input columns, before the
  normalizer) and of each row's window start (a slice of a day has other starts than
  the whole day, so another key);
- how it predicts: "eager" or the forward rungs applied, the device's type, torch's
  version, and the source of the prediction code (given by the caller,
  profiling/inference, which holds the fast path).
A file is stored with its size and sha256 beside it, as every stage output is
(sited.save_checked): one that fails them is not used, and the prediction is made again
and stored over it. A reproduction never reads from here: it predicts, to check that the
model still predicts what it did.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
from dataclasses import asdict

import numpy as np
import torch

from quantloop.tasks.engine import storage
from quantloop.tasks.research.sited import load_checked, save_checked

log = logging.getLogger(__name__)

FOLDER = "predictions"


def model_key(result, mode: str, device: torch.device, code: str) -> str:
    """What of a trained model (training.TrainResult), its way of predicting and the
    prediction code (`code`, a code_fingerprint) a prediction depends on."""
    cfg = result.train_config
    return hashlib.sha256(json.dumps({
        "weights": result.model_digest,
        "normalizer": result.normalizer.to_dict(),
        "window": cfg.window, "window_s": cfg.window_s,
        "inputs": list(result.inputs), "labels": list(result.labels),
        "model": asdict(result.model_config),
        "mode": mode, "device": device.type, "torch": torch.__version__, "code": code,
    }, sort_keys=True, default=str).encode()).hexdigest()  # fmt: skip


def table_key(model: str, features: np.ndarray, starts: np.ndarray) -> str:
    """The key of one table's predictions by the model of `model` (model_key): its input
    matrix and window starts."""
    h = hashlib.sha256(model.encode())
    for a in (features, starts):
        a = np.ascontiguousarray(a)
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(a.data)
    return h.hexdigest()


class PredictionStore:
    """Predictions under `<root>/predictions/`, a file per key."""

    def __init__(self, root: str) -> None:
        self.folder = storage.join(root, FOLDER)

    def url(self, key: str) -> str:
        return storage.join(self.folder, key[:2], f"{key}.npy")

    def get(self, key: str) -> np.ndarray | None:
        """The stored predictions of `key`, or None: none stored, or a file that fails
        its check (logged; the caller predicts and stores over it)."""
        url = self.url(key)
        try:
            return np.load(io.BytesIO(load_checked(url)), allow_pickle=False)
        except FileNotFoundError:
            return None
        except ValueError as exc:  # fails its size or sha256, or does not parse
            log.warning("stored predictions %s not used (%s): predicted again", url, exc)
            return None

    def put(self, key: str, predictions: np.ndarray) -> None:
        buffer = io.BytesIO()
        np.save(buffer, np.ascontiguousarray(predictions), allow_pickle=False)
        save_checked(self.url(key), buffer.getvalue())
