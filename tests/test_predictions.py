"""Predictions kept by what they depend on (tasks/research/predictions.py): read back by
another process's predictor of the same model, never for another table, way of
predicting or a damaged file."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from quantloop.profiling.inference import Predictor
from quantloop.tasks.research.predictions import PredictionStore
from quantloop.tasks.research.training import TrainConfig, load_model, predict, save_model, train
from tests.test_training import SMALL, learnable_table


def stored_files(store: PredictionStore) -> list:
    from pathlib import Path

    return sorted(Path(store.folder).rglob("*.npy"))


def test_a_models_predictions_are_read_back_only_for_what_they_were_made_from(tmp_path):
    table = learnable_table(700, 1)
    result = train([table], ["a", "b"], ["label_4"], TrainConfig(**SMALL))
    save_model(result, tmp_path / "model.pt")
    store = PredictionStore(str(tmp_path / "store"))

    first = Predictor(result, store=store)
    made = first(table)
    assert (first.stats.windows, first.stats.stored_windows) == (700, 0)
    np.testing.assert_array_equal(made, predict(result, table))
    [kept] = stored_files(store)

    # the same model loaded from its file, as a promotion's gate loads it: read, not made
    again = Predictor(load_model(tmp_path / "model.pt"), store=store)
    np.testing.assert_array_equal(again(table), made)
    assert (again.stats.windows, again.stats.stored_windows) == (0, 700)

    # one input changed, or a slice of the day (its first windows are shorter): made anew
    changed = table.set_column(0, "a", pa.array(np.r_[table["a"].to_numpy()[:-1], 9.0]))
    again(changed)
    again(table.slice(100))
    assert again.stats.windows == 700 + 600 and len(stored_files(store)) == 3

    # another way of predicting (the packed fast path) is another key
    packed = Predictor(result, store=store, rungs=("packing",))
    packed(table)
    assert packed.stats.windows == 700 and len(stored_files(store)) == 4

    # a damaged file is not used: predicted again and stored over it
    kept.write_bytes(kept.read_bytes()[:-40] + bytes(40))
    healed = Predictor(result, store=store)
    np.testing.assert_array_equal(healed(table), made)
    assert (healed.stats.windows, healed.stats.stored_windows) == (700, 0)
    reread = Predictor(result, store=store)
    reread(table)
    assert reread.stats.stored_windows == 700


def test_without_a_store_every_table_is_predicted(tmp_path):
    table = learnable_table(300, 2)
    result = train([table], ["a", "b"], ["label_4"], TrainConfig(**SMALL))
    plain = Predictor(result)
    plain(table)
    plain(table)
    assert (plain.stats.windows, plain.stats.stored_windows) == (600, 0)
