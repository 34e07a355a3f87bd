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


def test_a_replay_beside_a_registrations_export_predicts_as_it_does_alone(tmp_path):
    """A research run registers its model (torch.export) in a thread while its replay
    predicts (flows/train.records_in_background). While it traces, the export turns
    oneDNN off for the whole process, which changes the rounding of a forward beside it
    (the control below); the replay's Predictor waits for it (overlap.TRACING), so its
    predictions are those it makes alone, bit for bit, however the threads interleave."""
    import threading
    import warnings

    import torch

    from quantloop.tasks.records.registry import predictor, save_exported, windows

    table = learnable_table(700, 1)
    result = train([table], ["a", "b"], ["label_4"], TrainConfig(**SMALL))
    alone = predict(result, table)
    with warnings.catch_warnings():  # setting the flags warns of oneDNN's TF32 on Intel GPUs
        warnings.simplefilter("ignore", UserWarning)
        with torch.backends.mkldnn.flags(enabled=False):  # the export's state: the control
            assert not np.array_equal(predict(result, table), alone)

    example = windows(result, table, np.array([0, 350, 699]))
    meta = {"artifact_path": "model", "model_uuid": "m", "run_id": "r", "model_id": "m"}
    exported, stop = [], threading.Event()

    def register() -> None:  # as the registration thread exports, until told to stop
        while not stop.is_set():
            local = tmp_path / f"export-{len(exported)}"
            save_exported(predictor(result), example, str(local), meta)
            exported.append(local)

    thread = threading.Thread(target=register)
    thread.start()
    try:
        differing = made = 0
        while len(exported) < 2 or made < 20:
            differing += not np.array_equal(Predictor(result)(table), alone)
            made += 1
    finally:
        stop.set()
        thread.join()
    assert (tmp_path / "export-0" / "MLmodel").is_file()
    assert differing == 0, f"{differing} of {made} predictions beside the exports differed"
