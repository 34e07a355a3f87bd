"""Windows, seeded training, prediction and save/load of the order-book model."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from quantloop.tasks.research.features import FeatureParams, compute_features, feature_set
from quantloop.tasks.research.training import (
    CPU_BATCH,
    DEVICE_BATCH,
    Normalizer,
    TrainConfig,
    load_model,
    make_windows,
    predict,
    save_model,
    train,
)
from tests.books import random_book

SMALL = dict(window=8, stride=2, batch_size=64, steps=20, log_every=5, device="cpu")


def learnable_table(n: int, seed: int) -> pa.Table:
    """label = sum of `a` over the last 4 events: only a model that reads the window fits it."""
    rng = np.random.default_rng(seed)
    a, b = rng.standard_normal(n), rng.standard_normal(n)
    c = np.cumsum(a)
    label = c - np.concatenate([np.zeros(4), c[:-4]]) + 0.05 * rng.standard_normal(n)
    label[-3:] = np.nan  # like the end of a day
    return pa.table({"a": a, "b": b, "label_4": label})


def test_windows_on_a_hand_example():
    t1 = pa.table({"x": [10.0, 11, 12, 13, 14, 15], "y": [1.0, 2, 3, 4, np.nan, np.nan]})
    t2 = pa.table({"x": [20.0, 21, 22], "y": [5.0, np.nan, 7]})
    data = make_windows([t1, t2], ["x"], ["y"], TrainConfig(window=3, stride=2))
    # t1 anchors 0, 2 (4 has a NaN label); t2 anchors 0, 2
    assert data.table.tolist() == [0, 0, 1, 1]
    assert data.row.tolist() == [0, 2, 0, 2]
    # each window a run of rows of the stacked features (t2's rows follow t1's 6)
    assert data.start.tolist() == [0, 0, 6, 6] and data.end.tolist() == [0, 2, 6, 8]
    assert data.labels[:, 0].tolist() == [1.0, 3.0, 5.0, 7.0]
    assert data.mask.tolist() == [
        [False, False, True],
        [True, True, True],
        [False, False, True],  # t2's first window never reaches back into t1
        [True, True, True],
    ]
    x, mask, y = data.batch(np.arange(4))
    assert x.shape == (4, 3, 1)
    assert x[..., 0].tolist() == [[0, 0, 10], [10, 11, 12], [0, 0, 20], [20, 21, 22]]
    assert np.array_equal(mask, data.mask) and np.array_equal(y, data.labels)
    assert data.features[-1].tolist() == [0.0]  # the padding row


def test_missing_column_is_named():
    with pytest.raises(ValueError, match="nope"):
        make_windows([pa.table({"x": [1.0]})], ["nope"], [], TrainConfig())


def test_same_seed_same_curve_and_digest():
    tables = [learnable_table(600, 0), learnable_table(500, 1)]
    rng_before = torch.get_rng_state()
    a = train(tables, ["a", "b"], ["label_4"], TrainConfig(**SMALL))
    assert torch.equal(torch.get_rng_state(), rng_before)  # train leaves the global RNG alone
    b = train(tables, ["a", "b"], ["label_4"], TrainConfig(**SMALL))
    c = train(tables, ["a", "b"], ["label_4"], TrainConfig(**SMALL | {"seed": 1}))
    assert len(a.loss_curve) == 4  # 20 steps / log_every 5
    assert a.loss_curve == b.loss_curve
    assert a.model_digest == b.model_digest and len(a.model_digest) == 64
    assert c.model_digest != a.model_digest
    assert a.samples == len(make_windows(tables, ["a", "b"], ["label_4"], TrainConfig(**SMALL)))
    assert a.samples_seen == 20 * 64 and a.samples_per_s > 0 and a.device == "cpu"


def test_loss_decreases_on_a_learnable_signal():
    tables = [learnable_table(3000, s) for s in range(2)]
    cfg = TrainConfig(**SMALL | {"stride": 1, "steps": 150, "batch_size": 128, "log_every": 10})
    result = train(tables, ["a", "b"], ["label_4"], cfg)
    curve = result.loss_curve
    assert np.mean(curve[-3:]) < 0.3 * np.mean(curve[:2]), curve
    # and out of sample the predictions (in label units, not standardized) track the label
    test = learnable_table(1000, 7)
    pred = predict(result, test, ["a", "b"])[:, 0]
    label = test.column("label_4").to_numpy()
    ok = np.isfinite(label)
    assert np.corrcoef(pred[ok], label[ok])[0, 1] > 0.9


def test_predict_matches_training_windows_and_covers_every_row():
    table = learnable_table(300, 3)
    result = train([table], ["a", "b"], ["label_4"], TrainConfig(**SMALL))
    pred = predict(result, table, batch_size=64)  # several batches
    assert pred.shape == (300, 1) and np.isfinite(pred).all()
    # the same windows, built by make_windows and fed directly, give the same numbers
    data = make_windows([table], ["a", "b"], ["label_4"], TrainConfig(**SMALL | {"stride": 1}))
    x, mask, _ = data.batch(np.arange(len(data)))
    with torch.no_grad():
        z = result.model(
            torch.from_numpy(result.normalizer.apply_inputs(x)), torch.from_numpy(mask)
        )
    direct = result.normalizer.unscale_labels(z.numpy())
    np.testing.assert_allclose(pred[data.row], direct, rtol=0, atol=1e-4)
    with pytest.raises(ValueError, match="inputs"):
        predict(result, table, ["b", "a"])
    # the CPU's batch (CPU_BATCH, smaller than DEVICE_BATCH, which a GPU takes) changes how
    # many windows go through a forward, not the numbers (equal here; a BLAS may round a
    # row differently by the batch's size)
    wide = learnable_table(CPU_BATCH * 3 + 17, 4)
    large = predict(result, wide, batch_size=DEVICE_BATCH)
    np.testing.assert_allclose(predict(result, wide), large, rtol=1e-6, atol=1e-7)


def test_save_load_round_trip(tmp_path):
    table = learnable_table(400, 4)
    result = train([table], ["a", "b"], ["label_4"], TrainConfig(**SMALL))
    path = tmp_path / "models" / "m.pt"
    save_model(result, path)
    assert [p.name for p in path.parent.iterdir()] == ["m.pt"]  # no temp file left behind
    loaded = load_model(path)
    assert loaded.model_digest == result.model_digest
    assert loaded.train_config == result.train_config
    assert loaded.model_config == result.model_config
    assert loaded.loss_curve == result.loss_curve and loaded.inputs == result.inputs
    assert np.array_equal(predict(loaded, table), predict(result, table))


def test_normalizer_dict_round_trip_and_inverse():
    norm = Normalizer(
        input_mean=np.array([1.0, -2.0]),
        input_std=np.array([2.0, 0.5]),
        label_mean=np.array([0.5]),
        label_std=np.array([3.0]),
    )
    again = Normalizer.from_dict(norm.to_dict())
    assert again.to_dict() == norm.to_dict()
    y = np.array([[1.0], [-4.0]])
    np.testing.assert_allclose(norm.unscale_labels(norm.scale_labels(y)), y, rtol=1e-6)
    z = norm.apply_inputs(np.array([[3.0, np.nan], [1e9, -2.0]]))
    assert z.tolist() == [[1.0, 0.0], [10.0, 0.0]]  # NaN -> mean, extremes clipped


def test_train_on_order_book_features():
    params = FeatureParams()
    fs = feature_set(params)
    tables = [compute_features(random_book(1500, levels=5, seed=s), params) for s in range(2)]
    result = train(tables, fs.inputs, fs.labels, TrainConfig(**SMALL))
    assert result.model_config.n_features == len(fs.inputs)
    pred = predict(result, tables[0], fs.inputs)
    assert pred.shape == (tables[0].num_rows, len(fs.labels)) and np.isfinite(pred).all()


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"window": 0}, "window"), ({"lr": 0.0}, "lr"), ({"device": "nonsense"}, "device")],
)
def test_config_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        TrainConfig(**kwargs)
