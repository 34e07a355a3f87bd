"""The promotion gate without servers: the paired test on planted mark-outs with a known
answer (tasks/research/gate.py), and the held-out window two models share
(tasks/research/window.py).

The flow's gate on real research runs (a planted better candidate promoted, an equal one
refused) is in tests/test_audit.py; across days and inside one day in tests/test_retrain.py.
"""

from __future__ import annotations

import datetime as dt
import math
import uuid

import numpy as np
import pyarrow as pa
import pytest

from quantloop.flows.promote import empty_window_result
from quantloop.tasks.data.schema import Partition
from quantloop.tasks.data.synthetic import SyntheticConfig, generate_day
from quantloop.tasks.research.features import FeatureParams, compute_features
from quantloop.tasks.research.folds import Fold
from quantloop.tasks.research.gate import GateConfig, paired_gate
from quantloop.tasks.research.simulation import SimConfig, replay_all
from quantloop.tasks.research.uncertainty import Sample, difference
from quantloop.tasks.research.window import (
    held_out_id,
    lineage_fold,
    replay_window,
    shared_window,
)

DAY_S = 23_400.0  # a session, 9:30 to 16:00
WIDTH_S = 10.0  # the 5 s horizon's window (uncertainty.MIN_WINDOW_S)


def planted(seed: int, improvement: float, *, days: int = 3, trades: int = 1_500,
            noise: float = 1.0) -> tuple[Sample, Sample]:  # fmt: skip
    """Candidate and incumbent mark-outs of trades at the same instants of the same days:
    each the market's move over the trade's window (shared by both signals, and by trades
    close in time: overlapping horizons) plus the signal's own noise; the candidate's is
    the incumbent's plus `improvement` bps."""
    rng = np.random.default_rng(seed)
    market = rng.normal(0.0, 3.0, (days, int(DAY_S / WIDTH_S) + 1))
    times = np.sort(rng.uniform(0.0, DAY_S, (days, trades)), axis=1)
    moves = np.take_along_axis(market, (times // WIDTH_S).astype(int), axis=1).ravel()
    labels = np.repeat([f"2026-03-0{d + 2}" for d in range(days)], trades)
    out = [Sample(moves + rng.normal(0.0, noise, moves.size) + shift, times.ravel(), labels)
           for shift in (0.0, improvement)]  # fmt: skip
    return out[1], out[0]


def test_a_candidate_planted_better_passes_and_one_planted_equal_does_not():
    cfg = GateConfig(alpha=0.05, min_improvement_bps=0.0, horizon="5s")
    better, incumbent = planted(0, 0.5)
    result = paired_gate(better, incumbent, WIDTH_S, cfg)
    assert result.passed and result.p_adjusted < 1e-6
    assert abs(result.difference_bps - 0.5) < 4 * result.se_bps  # the planted improvement
    assert result.statistic == pytest.approx(result.difference_bps / result.se_bps)
    assert (result.candidate_trades, result.incumbent_trades) == (4_500, 4_500)
    assert result.windows > 30 and result.n_eff > 0 and result.trials == 1
    # The market's moves cancel in the pair: the SE is the noise's, far below each mean's.
    assert result.se_bps < 0.05
    assert "p = 0.0000 < alpha 0.05" in result.why

    equal, incumbent = planted(0, 0.0)
    result = paired_gate(equal, incumbent, WIDTH_S, cfg)
    assert not result.passed and result.p_adjusted >= cfg.alpha
    worse, incumbent = planted(0, -0.5)
    result = paired_gate(worse, incumbent, WIDTH_S, cfg)
    assert not result.passed and result.p_value > 0.999 and result.difference_bps < 0


def test_an_equal_candidate_passes_at_about_the_nominal_rate():
    """Calibration: with no improvement planted, alpha = 0.05 passes ~5% of the time."""
    cfg = GateConfig(alpha=0.05)
    passed = [paired_gate(*planted(seed, 0.0, days=2, trades=400), WIDTH_S, cfg).passed
              for seed in range(300)]  # fmt: skip
    assert 0.02 <= np.mean(passed) <= 0.09, np.mean(passed)


def test_the_margin_and_the_trials_are_what_the_candidate_must_clear():
    better, incumbent = planted(1, 0.5)
    se = difference(better, incumbent, WIDTH_S).se
    # a margin at the planted improvement: no evidence of beating it
    at = paired_gate(better, incumbent, WIDTH_S, GateConfig(min_improvement_bps=0.5))
    assert not at.passed and 0.01 < at.p_value < 0.99
    assert at.statistic == pytest.approx((at.difference_bps - 0.5) / at.se_bps)
    # The SE is the same whatever the shift (a shift moves every candidate value alike): an
    # improvement of exactly 2.5 SE passes one trial, not the best of ten (Sidak).
    shift = better.values.mean() - incumbent.values.mean()
    planted_t = Sample(better.values - shift + 2.5 * se, better.times, better.days)
    one = paired_gate(planted_t, incumbent, WIDTH_S, GateConfig())
    ten = paired_gate(planted_t, incumbent, WIDTH_S, GateConfig(), trials=10)
    assert one.statistic == pytest.approx(2.5, rel=1e-6)
    assert one.passed and one.p_value == one.p_adjusted
    assert not ten.passed and ten.p_value == one.p_value
    assert ten.p_adjusted == pytest.approx(1 - (1 - one.p_value) ** 10)
    assert "after 10 trials" in ten.why


def test_too_few_windows_and_no_variation_are_refusals():
    better, incumbent = planted(2, 5.0, days=1, trades=20_000)
    few = [Sample(s.values[s.times < 150], s.times[s.times < 150], s.days[s.times < 150])
           for s in (better, incumbent)]  # fmt: skip
    result = paired_gate(*few, WIDTH_S, GateConfig())
    assert not result.passed and math.isnan(result.p_value)
    assert result.why.startswith("insufficient data:") and result.windows < 30
    same = paired_gate(incumbent, incumbent, WIDTH_S, GateConfig())  # the model itself
    assert not same.passed and same.why.startswith("no variation") and same.difference_bps == 0.0


# ---------------------------------------------------------------- the shared window

D = [dt.date(2026, 3, d) for d in (2, 3, 4, 5)]


def label_table(n: int) -> pa.Table:
    """Feature rows with one label, 10 events ahead (NaN where it passes the day's end)."""
    label = np.arange(n, dtype=np.float64)
    label[n - 10 :] = np.nan
    return pa.table({"time": np.linspace(34_200.0, 57_600.0, n), "label_10": label})


def tables(products, dates, n: int = 1_000) -> dict[Partition, pa.Table]:
    return {Partition(p, d): label_table(n) for p in products for d in dates}


def old_lineage(parts, holdout: float) -> dict:
    """A lineage record from before walk-forward folds: every partition of its run."""
    return {"partitions": sorted(str(p) for p in parts), "holdout_fraction": holdout}


def test_whole_days_the_incumbent_trained_on_leave_the_window():
    cand = tables(["SYNA", "SYNB"], D)
    fold = lineage_fold(old_lineage(cand, 0.3))  # 4 dates: the last 2 held out
    assert fold.test_dates == (D[2], D[3]) and fold.train_dates == (D[0], D[1])
    champ = tables(["SYNA", "SYNB"], D)
    champ_fold = lineage_fold(old_lineage(champ, 0.25))  # trained on the first 3
    window = shared_window(cand, fold, champ, champ_fold)
    assert sorted(window.start) == [Partition("SYNA", D[3]), Partition("SYNB", D[3])]
    assert set(window.start.values()) == {0} and window.events() == 2_000
    assert window.record()["days"] == ["2026-03-05"] and window.record()["from_row"] == {}
    assert set(window.excluded) == {"SYNA/2026-03-04", "SYNB/2026-03-04"}
    assert "the incumbent trained on it" in window.excluded["SYNA/2026-03-04"]
    # no incumbent (the first champion against the baseline): the whole held-out part
    alone = shared_window(cand, fold)
    assert sorted(alone.start) == sorted(Partition(p, d) for p in ("SYNA", "SYNB") for d in D[2:])


def test_in_one_day_the_window_is_the_rows_after_both_cuts():
    day = [D[0]]
    cand, champ = tables(["SYNA"], day), tables(["SYNA"], day)
    part = Partition("SYNA", D[0])
    # the candidate holds out from row 600; the champion trained on rows 0..799
    fold, champ_fold = lineage_fold(old_lineage(cand, 0.4)), lineage_fold(old_lineage(champ, 0.2))
    assert fold.intraday and champ_fold.intraday
    window = shared_window(cand, fold, champ, champ_fold)
    assert window.start == {part: 800} and window.events() == 200
    assert window.record()["from_row"] == {"SYNA/2026-03-02": 800}
    # the other way round: the champion trained on rows 0..499, the candidate holds out 800..
    window = shared_window(cand, lineage_fold(old_lineage(cand, 0.2)), champ,
                           lineage_fold(old_lineage(champ, 0.5)))  # fmt: skip
    assert window.start == {part: 800}
    # a champion trained on other days takes nothing of this one
    other = tables(["SYNA"], D[1:3])
    window = shared_window(cand, fold, other, lineage_fold(old_lineage(other, 0.5)))
    assert window.start == {part: 600}


def test_a_lineage_with_a_fold_window_is_split_by_its_fold():
    """A record of a walk-forward fold names its training partitions and its window."""
    cand = tables(["SYNA"], D)
    lineage = {"fold": 3, "partitions": [f"SYNA/{d}" for d in D[:3]],
               "window": {"train": [d.isoformat() for d in D[:3]], "embargo": [],
                          "test": [D[3].isoformat()], "holdout_fraction": None}}  # fmt: skip
    fold = lineage_fold(lineage)
    assert fold == Fold(3, tuple(D[:3]), (D[3],), (), holdout_fraction=None)
    assert shared_window(cand, fold).start == {Partition("SYNA", D[3]): 0}
    # an old record of the same split holds out the same data: the same trials window
    assert held_out_id(fold) == held_out_id(lineage_fold(old_lineage(cand, 0.25)))
    assert held_out_id(fold) != held_out_id(lineage_fold(old_lineage(cand, 0.5)))
    one_day = lineage_fold(old_lineage(tables(["SYNA"], [D[3]]), 0.3))
    assert held_out_id(one_day) != held_out_id(fold)  # the same date, cut inside the day


def test_an_empty_window_is_refused_saying_why():
    cand = tables(["SYNA"], D[:3])
    fold = lineage_fold(old_lineage(cand, 0.3))  # holds out the last date
    champ = tables(["SYNA"], D)
    window = shared_window(cand, fold, champ, lineage_fold(old_lineage(champ, 0.25)))
    assert window.empty
    assert window.why_empty() == (
        "no held-out window shared: SYNA/2026-03-04: the incumbent trained on it (rows "
        "0..999 of 1000; the candidate held out from row 0)"
    )
    result = empty_window_result(window, GateConfig(horizon="100ev"), "champion", trials=3)
    assert not result.passed and result.why == window.why_empty()
    assert (result.candidate_trades, result.incumbent_trades, result.trials) == (0, 0, 3)
    assert math.isnan(result.p_value) and result.windows == 0.0
    # A product the incumbent never trained on has no threshold to trade at: left out.
    other = tables(["SYNB"], D)
    window = shared_window(cand, fold, other, lineage_fold(old_lineage(other, 0.25)))
    assert window.empty and "no training part of this product" in window.why_empty()


def test_the_window_needs_the_same_events_in_both_models_features():
    cand, champ = tables(["SYNA"], [D[0]]), tables(["SYNA"], [D[0]], n=999)
    with pytest.raises(ValueError, match="999 rows, the candidate's 1000"):
        shared_window(cand, lineage_fold(old_lineage(cand, 0.3)), champ,
                      lineage_fold(old_lineage(champ, 0.5)))  # fmt: skip


def test_on_its_own_held_out_part_the_replay_is_the_simulations():
    """replay_window on the candidate's whole held-out part trades and marks out exactly
    what replay_all (the simulate stage) does: same threshold rule, same trades."""
    cfg = SimConfig()
    books = {Partition(p, d): compute_features(generate_day(p, d, SyntheticConfig(
        events_per_day=3_000, levels=2)), FeatureParams())
        for p in ("SYNA", "SYNB") for d in D[:3]}  # fmt: skip

    def predict(t: pa.Table) -> np.ndarray:  # any fixed signal of the features
        x = t.column("ofi").to_numpy() + 0.5 * t.column("imbalance_1").to_numpy()
        return np.stack([x, -x, x], axis=1)

    fold = lineage_fold(old_lineage(books, 0.3))
    window = shared_window(books, fold)
    train = {p: t for p, t in books.items() if p.date not in fold.test_dates}
    ours = replay_window(predict, train, {p: books[p].slice(s) for p, s in window.start.items()},
                         cfg)  # fmt: skip
    theirs = replay_all(predict, books, cfg, 0.3)["model"]
    assert set(ours) == set(theirs) == {"SYNA", "SYNB"}
    for product, table in ours.items():
        assert table.num_rows > 10
        for column in ("row", "time", "side", "day", "markout_5s", "markout_100ev"):
            ours_, theirs_ = (t.column(column).to_numpy() for t in (table, theirs[product]))
            np.testing.assert_array_equal(ours_, theirs_, column)


def test_the_promote_form_states_units_and_bounds():
    """The Prefect UI's form for promote: each gate setting says its unit and its bounds,
    and a value outside them is refused before the flow runs."""
    from prefect.exceptions import ParameterTypeError

    from quantloop.flows.promote import promote

    props = promote.parameters.model_dump()["properties"]
    assert (props["alpha"]["exclusiveMinimum"], props["alpha"]["exclusiveMaximum"]) == (0, 0.5)
    margin = props["min_improvement_bps"]
    assert (margin["minimum"], margin["maximum"]) == (0, 100)
    assert "basis points" in margin["description"]
    assert "seconds" in props["horizon"]["description"] and props["horizon"]["default"] == "5s"
    for bad in ({"alpha": 0.5}, {"min_improvement_bps": -0.1}, {"horizon": "5 s"}):
        with pytest.raises(ParameterTypeError):
            promote.validate_parameters({"run": "0" * 32, **bad})


@pytest.mark.slow
@pytest.mark.server
def test_research_trials_count_other_configurations_on_the_same_held_out_data(mlflow_uri):
    """A re-run (same params_hash) is not another trial; other data or other test windows
    are not trials on these data; an unfinished run is not counted."""
    from mlflow.tracking import MlflowClient

    from quantloop.tasks.records.runs import (
        TEST_WINDOWS_TAG,
        TRIALS_TAG,
        research_trials,
        trials_tag,
    )

    client = MlflowClient(mlflow_uri)
    experiment = client.create_experiment(f"trials-{uuid.uuid4().hex[:8]}")

    def research(params: str, data: str = "pin", windows: str = "w", finish: bool = True):
        run = client.create_run(experiment, tags={
            "quantloop.stage": "research", "params_hash": params, "data_digest": data,
            TEST_WINDOWS_TAG: windows})  # fmt: skip
        if finish:
            client.set_terminated(run.info.run_id)

    assert research_trials(client, experiment, "pin", "w", "mine") == 1
    research("a")
    research("a")  # a re-run of a
    research("b")
    research("c", data="other")
    research("d", windows="other")
    research("e", finish=False)
    assert research_trials(client, experiment, "pin", "w", "mine") == 3  # a, b and this one
    assert research_trials(client, experiment, "pin", "w", "a") == 2
    # A sweep is a trial per setting; a setting that is a configuration run alone before
    # (b) is not another, nor is this run's own setting when it ran in a sweep.
    run = client.create_run(experiment, tags={
        "quantloop.stage": "research", "params_hash": "sweep", "data_digest": "pin",
        TEST_WINDOWS_TAG: "w", TRIALS_TAG: trials_tag(["s1", "s2", "b"])})  # fmt: skip
    client.set_terminated(run.info.run_id)
    assert research_trials(client, experiment, "pin", "w", ["mine"]) == 5  # a, b, s1, s2, mine
    assert research_trials(client, experiment, "pin", "w", ["s1", "s3"]) == 5  # a, b, s1-s3


@pytest.mark.slow
@pytest.mark.server
def test_a_rerun_names_its_configurations_first_run_and_deleted_runs_still_count(mlflow_uri):
    """trials_on gives the count and the run a re-run repeats (its REPEAT_TAG); runs so
    tagged are not read again, which changes no count; a deleted run was still a trial."""
    from mlflow.tracking import MlflowClient

    from quantloop.tasks.records.runs import REPEAT_TAG, TEST_WINDOWS_TAG, trials_on

    client = MlflowClient(mlflow_uri)
    experiment = client.create_experiment(f"repeats-{uuid.uuid4().hex[:8]}")

    def research(params: str, **extra: str) -> str:
        run = client.create_run(experiment, tags={
            "quantloop.stage": "research", "params_hash": params, "data_digest": "pin",
            TEST_WINDOWS_TAG: "w", **extra})  # fmt: skip
        client.set_terminated(run.info.run_id)
        return run.info.run_id

    assert trials_on(client, experiment, "pin", "w", "a", params_hash="a") == (1, None)
    first_a = research("a")
    assert trials_on(client, experiment, "pin", "w", "a", params_hash="a") == (1, first_a)
    for _ in range(3):  # re-runs, tagged as flows/research.py tags them
        count, repeat_of = trials_on(client, experiment, "pin", "w", "a", params_hash="a")
        research("a", **{REPEAT_TAG: repeat_of})
        assert (count, repeat_of) == (1, first_a)
    b = research("b")
    assert trials_on(client, experiment, "pin", "w", "c", params_hash="c") == (3, None)
    client.delete_run(b)  # out of view, but b was tried on these data
    assert trials_on(client, experiment, "pin", "w", "c", params_hash="c") == (3, None)
    client.delete_run(first_a)  # its re-runs are not read; a still counts through it
    assert trials_on(client, experiment, "pin", "w", "a", params_hash="a") == (2, first_a)


@pytest.mark.slow
@pytest.mark.server
def test_the_gates_count_reads_each_configurations_model_once(mlflow_uri, tmp_path):
    """count_trials (the promotion gate's trials) counts the configurations whose models
    held out the candidate's window, and reads a model's lineage (a model version and a
    file) once per configuration: a second run of one already counted, untagged as runs
    before REPEAT_TAG were, is not read again, nor is a tagged re-run; a model that held
    out another window is not a trial on this one."""
    import json

    from mlflow.tracking import MlflowClient

    from quantloop.tasks.records.runs import REPEAT_TAG, count_trials
    from quantloop.tasks.records.tracking import STORE_TAG

    client = MlflowClient(mlflow_uri)
    experiment = client.create_experiment(f"gate-trials-{uuid.uuid4().hex[:8]}")
    model = f"gate-trials-{uuid.uuid4().hex[:8]}"
    client.create_registered_model(model)
    store = tmp_path / "store"
    (store / "lineage" / "models").mkdir(parents=True)
    held, other = ["2026-03-04"], ["2026-03-05"]

    def research(params: str, test: list[str], **extra: str) -> str:
        run = client.create_run(experiment, tags={
            "quantloop.stage": "research", "params_hash": params, "data_digest": "pin",
            STORE_TAG: str(store), **extra})  # fmt: skip
        key = uuid.uuid4().hex
        (store / "lineage" / "models" / f"{key}.json").write_text(json.dumps({
            "fold": 0, "window": {"train": ["2026-03-02", "2026-03-03"], "test": test,
                                  "embargo": [], "holdout_fraction": None}}))  # fmt: skip
        version = client.create_model_version(
            model, f"runs:/{run.info.run_id}/model", run.info.run_id, tags={"model_key": key}
        )
        client.set_tag(run.info.run_id, "registered_model", model)
        client.set_tag(run.info.run_id, "model_version", version.version)
        client.set_terminated(run.info.run_id)
        return run.info.run_id

    first_a = research("a", held)
    research("a", held)  # a re-run from before REPEAT_TAG: the same configuration
    research("a", held, **{REPEAT_TAG: first_a})
    research("b", held)
    research("c", other)
    research("d", held)
    research("f", other)
    client.set_terminated(research("e", held), status="FAILED")

    reads = []
    get_model_version = client.get_model_version

    def counted(name: str, version: str):
        reads.append(version)
        return get_model_version(name, version)

    client.get_model_version = counted
    window = held_out_id(lineage_fold({"window": {"test": held, "holdout_fraction": None}}))
    assert count_trials(client, experiment, "pin", window) == 3  # a, b and d
    assert len(reads) == 5  # a once, b, d, and c and f (their window: no trials here)
    other_window = held_out_id(lineage_fold({"window": {"test": other, "holdout_fraction": None}}))
    assert count_trials(client, experiment, "pin", other_window) == 2  # c and f
