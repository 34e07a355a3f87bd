"""A research run with a sweep (tasks/research/sweep.py, flows/sweep.py): its form, its
(setting, fold) models keyed and stacked, its records, its ranking, and the model that
`promote` and `reproduce` see. The end-to-end test runs the real flow: Prefect's API,
the default LocalCluster, the session's MLflow server."""

from __future__ import annotations

import dataclasses
import json
import uuid

import numpy as np
import pytest
from pydantic import ValidationError

from quantloop.flows.params import ResearchParams
from quantloop.tasks.research.sweep import MAX_SETTINGS, Sweep, label, rank, varied
from quantloop.tasks.research.train_config import TrainConfig
from quantloop.tasks.research.training import prepare
from tests.test_training import SMALL, learnable_table

# ---------------------------------------------------------------- the form


def test_a_grid_is_every_combination_and_a_list_is_each_setting():
    base = TrainConfig(**SMALL)
    grid = Sweep(lr=[1e-3, 3e-3], seed=[0, 1], shapes=[{}, {"d_model": 16, "n_heads": 2}])
    configs = grid.expand(base)
    assert len(configs) == 8 and len(set(configs)) == 8
    # shapes outermost, then lr, weight decay, seed: the last list varies fastest
    assert [(c.d_model, c.lr, c.seed) for c in configs[:3]] == [
        (32, 1e-3, 0), (32, 1e-3, 1), (32, 3e-3, 0)]  # fmt: skip
    assert varied(configs) == ["lr", "seed", "d_model", "n_heads"]
    assert label(configs[-1], varied(configs)) == "lr=0.003 seed=1 d=16 H=2"
    listed = Sweep(settings=[{"lr": 1e-3}, {"seed": 3, "weight_decay": 0.0}]).expand(base)
    assert [(c.lr, c.seed, c.weight_decay) for c in listed] == [
        (1e-3, 0, base.weight_decay), (base.lr, 3, 0.0)]  # fmt: skip
    assert not Sweep().active and Sweep(seed=[1]).active


@pytest.mark.parametrize(
    ("sweep", "error"),
    [
        ({"lr": [1e-3], "settings": [{"lr": 1e-2}]}, r"give a grid \(lr\) or a list"),
        ({"lr": [0.0]}, "greater than 0"),
        ({"seed": list(range(MAX_SETTINGS + 1))}, f"at most {MAX_SETTINGS}"),
        ({"settings": [{"lr": 1e-3}, {"lr": 1e-3}]}, "settings 0 and 1 are the same"),
        ({"shapes": [{"d_model": 30}]}, r"sweep setting 0 \({'d_model': 30}\): d_model \(30\)"),
        ({"lr": [1e-3], "rank_horizon": "7s"}, "rank_horizon '7s' is not a horizon"),
        ({"lr": [1e-3], "rank_horzion": "5s"}, "rank_horzion"),
    ],
)
def test_a_bad_sweep_is_refused_naming_what_is_wrong(sweep, error):
    with pytest.raises(ValidationError, match=error):
        ResearchParams.model_validate({"sweep": sweep})


def test_an_empty_sweep_keeps_every_runs_digest_and_each_setting_is_a_trial():
    """A run without a sweep has the digest it had before sweeps (its trials and recipes
    match older runs); a sweep's trials are the digests of its settings run alone."""
    plain = ResearchParams()
    assert "sweep" not in json.dumps(plain.model_dump(mode="json", exclude={"workspace",
                                                                            "sweep"}))  # fmt: skip
    assert plain.trial_ids() == [plain.hash()]
    swept = ResearchParams.model_validate({"sweep": {"lr": [1e-3, plain.train.lr]}})
    alone = ResearchParams.model_validate({"train": {"lr": 1e-3}})
    assert swept.trial_ids() == [alone.hash(), plain.hash()]
    assert swept.hash() not in swept.trial_ids()


def test_the_form_describes_the_sweep():
    from prefect.utilities.callables import parameter_schema

    from quantloop.flows.research import research

    schema = parameter_schema(research).model_dump()
    defs = schema["definitions"]
    sweep = defs["Sweep"]["properties"]
    for name in ("lr", "weight_decay", "seed", "shapes", "settings", "rank_horizon", "stacked",
                 "stack_size", "check_alone"):  # fmt: skip
        assert len(sweep[name].get("description", "")) > 30, name
    assert sweep["lr"]["items"]["exclusiveMinimum"] == 0 and sweep["lr"]["items"]["maximum"] == 1
    assert "anyOf" not in json.dumps(defs["Setting"])  # no 'Property is type "None"' tab


def test_a_settings_data_is_what_prepare_gives_it():
    """The sweep prepares a fold's windows once and gives each setting its own batch order
    and model shape (flows/sweep.member_data): field by field what prepare gives that
    setting, so a stack's member trains on its solo run's data."""
    from quantloop.flows.sweep import member_data

    tables = [learnable_table(600, 0), learnable_table(500, 1)]
    base_cfg = TrainConfig(**SMALL)
    base = prepare(tables, ["a", "b"], ["label_4"], base_cfg)
    for change in ({"seed": 3}, {"lr": 1e-2}, {"d_model": 16, "n_heads": 2, "n_layers": 1}):
        cfg = dataclasses.replace(base_cfg, **change)
        mine, theirs = member_data(base, cfg), prepare(tables, ["a", "b"], ["label_4"], cfg)
        assert mine.model_config == theirs.model_config
        for field in ("features", "labels", "order"):
            np.testing.assert_array_equal(getattr(mine, field), getattr(theirs, field))
        np.testing.assert_array_equal(mine.windows.start, theirs.windows.start)
        assert mine.normalizer.to_dict() == theirs.normalizer.to_dict()


def test_settings_rank_on_the_paired_difference_and_a_setting_without_trades_is_last():
    def row(s, mean, se=0.1):
        paired = {"mean_bps": mean, "se_bps": se, "p_adjusted": 0.5, "significant": False}
        return {"setting": s, "paired": {"5s": paired}}

    ranked = rank([row(0, 0.1), row(1, float("nan")), row(2, 0.3), row(3, 0.1)], "5s")
    assert [r["setting"] for r in ranked] == [2, 0, 3, 1]  # ties keep the sweep's order
    assert [r["rank"] for r in ranked] == [1, 2, 3, 4] and ranked[0]["diff_bps"] == 0.3
    # Too few trades to test the difference (no SE, as paired_difference leaves it): after
    # every tested setting however high its mean, before a setting with no trade at all.
    nan = float("nan")
    ranked = rank([row(0, 0.1), row(1, 0.9, se=nan), row(2, nan, se=nan), row(3, 0.2),
                   row(4, 0.5, se=None)], "5s")  # fmt: skip
    assert [r["setting"] for r in ranked] == [3, 0, 1, 4, 2]


def test_the_held_out_pick_is_chosen_on_earlier_folds_and_judged_on_the_last_alone():
    """held_out ranks the settings on the folds before the last only (an untested setting
    after the tested ones, as rank does) and reports the pick's last-fold figures, its
    p-value adjusted for this pick and the other configurations on these data, not for
    the K settings; with one fold there is nothing to hold out."""
    from quantloop.tasks.research.sweep import held_out
    from quantloop.tasks.research.uncertainty import trials_adjusted

    def fig(mean, se=0.1, p_holm=0.01):
        return {"5s": {"mean_bps": mean, "se_bps": se, "p_holm": p_holm}}

    nan = float("nan")
    earlier = [fig(0.2), fig(0.9, se=nan), fig(0.4)]  # setting 1: best mean, no SE
    last = [fig(5.0), fig(5.0), fig(-0.3, se=0.2, p_holm=0.04)]
    h = held_out(earlier, last, ["a", "b", "c"], "5s", trials=5, settings=3, pooled_best=0)
    assert (h["setting"], h["label"]) == (2, "c")  # chosen where it was tested, not on 'last'
    assert h["same_as_best"] is False  # the pooled ranking chose setting 0
    assert (h["earlier_diff_bps"], h["diff_bps"], h["diff_se_bps"]) == (0.4, -0.3, 0.2)
    assert h["trials"] == 3  # 5 on these data, less the sweep's 3 settings, plus this pick
    assert h["p_adjusted"] == pytest.approx(trials_adjusted(0.04, 3)) and h["significant"] is False
    assert held_out([{}, {}], [{}, {}], ["a", "b"], "5s", trials=2, settings=2) is None
    # no setting could be judged on the earlier folds: no pick to test
    none = held_out([fig(0.2, se=nan), fig(0.1, se=None)], last[:2], ["a", "b"], "5s",
                    trials=2, settings=2)  # fmt: skip
    assert none["setting"] is None and "standard error at 5s" in none["why"]


def test_a_sweeps_notes_say_its_best_was_chosen_on_the_data_it_reports():
    """The best of K settings carries the winner's curse: the notes under the table say so,
    with K and the settings ranked last for want of an SE; a run without a sweep says
    nothing of it."""
    from quantloop.tasks.records.summary import validity_notes
    from tests.test_cli import summary

    rows = [{"rank": i + 1, "setting": i, "label": f"lr={lr}", "diff_bps": d, "diff_se_bps": se,
             "trades": 50} for i, (lr, d, se) in enumerate([(1e-3, 0.3, 0.1), (3e-3, 0.1, 0.1),
                                                           (1e-2, 0.9, float("nan"))])]  # fmt: skip
    [note] = [n for n in validity_notes(summary(sweep=rows)) if "settings" in n]
    assert "best of 3 settings" in note and "largest of 3 estimates" in note
    assert "1 setting(s) with too few trades" in note and "selection.md" in note
    assert not [n for n in validity_notes(summary()) if "best of" in n]


def test_the_winners_curse_quoted_is_the_benchmarks_for_the_nearest_measured_k():
    """The note's figure is bench/results/selection.json's mean t of the best, for the K
    measured beside the sweep's (its range over the correlations), never one K's figure
    for another's; past the largest K measured it says so."""
    from pathlib import Path

    from quantloop.tasks.records.summary import BEST_OF_K_MEAN_T, winners_curse

    bench = json.loads((Path(__file__).parents[1] / "bench/results/selection.json").read_text())
    for k, (lo, hi) in BEST_OF_K_MEAN_T.items():
        measured = [c["mean_t"] for c in bench["cases"] if c["k"] == k]
        assert len(measured) == len(bench["rhos"]), k
        assert (lo, hi) == (round(min(measured), 2), round(max(measured), 2)), k
    assert winners_curse(16) == "the best of 16 averaged +1.0 to +1.3 SE"
    assert "of 4 averaged +0.5 to +0.7 SE, of 16 +1.0 to +1.3 SE" in winners_curse(8)
    assert "less for fewer" in winners_curse(2)
    assert "not measured past 16" in winners_curse(64)


def test_a_stack_takes_the_switches_of_the_plan_it_has_and_their_requirements():
    from quantloop.flows.sweep import stack_setup
    from quantloop.profiling.proof import Plan

    top = ("compile", "bf16", "device_metrics", "fused_kernel", "streams", "cudagraph",
           "packing", "flex_attention", "flat_grads", "combo_kernels", "loader_mask",
           "flex_blocks")  # fmt: skip
    stack, rungs = stack_setup(Plan(requested="auto", rungs=top, proof=None))
    assert rungs == ("stacked", "compile", "bf16", "packing", "flex_attention", "flex_blocks",
                     "fused_kernel", "flat_grads", "cudagraph", "combo_kernels")  # fmt: skip
    assert stack.warmup_steps >= 4  # 3 eager steps before the capture
    # a switch whose requirement the plan lacks is left out with what needs it
    stack, rungs = stack_setup(
        Plan(requested="auto", rungs=("flex_attention", "flex_blocks", "flat_grads"), proof=None)
    )
    assert rungs == ("stacked",) and not stack.flex_attention and not stack.flat_grads
    assert stack_setup(Plan(requested="none", rungs=(), proof=None))[1] == ("stacked",)


def test_each_setting_and_fold_has_its_key_and_alone_it_is_the_train_stages():
    """Stacked: a key of its own per (setting, fold), not the solo model's; alone
    (`stacked: false`): the train stage's key, so a plain research run of a setting and
    the sweep share that model. Two folds that train on the same dates share one."""
    import datetime as dt

    from quantloop.flows.sweep import PLAIN, plan_nodes, stacked_key
    from quantloop.flows.train import model_key
    from quantloop.tasks.data.schema import Partition
    from quantloop.tasks.research.folds import Fold
    from quantloop.tasks.research.stage import FeatureOutput

    days = [dt.date(2026, 3, d) for d in (2, 3, 4)]
    outputs = {Partition("SYNA", d): FeatureOutput(f"feature-{d}", None) for d in days}
    folds = [Fold(0, (days[0],), (days[1],)), Fold(1, days[:2], (days[2],)),
             Fold(2, days[:2], (days[2],), holdout_fraction=None)]  # fmt: skip
    sweep = Sweep(lr=[1e-3, 2e-3])
    configs = sweep.expand(TrainConfig(**SMALL))
    stacked = plan_nodes(configs, folds, outputs, {configs[0].head_dim: PLAIN}, sweep, None)
    alone = plan_nodes(configs, folds, outputs, {configs[0].head_dim: PLAIN},
                       sweep.model_copy(update={"stacked": False}), None)  # fmt: skip
    for s, a in zip(stacked, alone, strict=True):
        feats = [o.key for o in s.parts.values()]
        assert a.key == model_key(a.config, feats, a.fold.training_window(), ())
        assert s.key == stacked_key(s.config, feats, s.fold.training_window(), ("stacked",),
                                    "cpu")  # fmt: skip
        assert s.key != a.key and s.stack is not None and a.stack is None
    keys = [n.key for n in stacked]
    assert len(set(keys)) == 4 and keys[1] == keys[2] and keys[4] == keys[5]


def test_the_ladder_gate_takes_a_stacked_model_only_on_its_runs_check():
    from types import SimpleNamespace

    from quantloop.flows.promote import ladder_gate

    check = {"equivalent": True, "loss_max_rel_dev": 1e-7, "pred_rel_l2": 1e-5,
             "tolerance": {"name": "fp32"}}  # fmt: skip

    def version(**tags):
        return SimpleNamespace(tags={"rungs": "stacked", **tags})

    assert ladder_gate(version(stack_check=json.dumps(check)))["passed"]
    failed = ladder_gate(version(stack_check=json.dumps({**check, "equivalent": False})))
    assert not failed["passed"] and "not equivalent to its solo training" in failed["why"]
    assert not ladder_gate(version())["passed"]  # no check: refused
    # its ladder rungs still need the ladder's proof
    proof = json.dumps({"proven": ["compile"], "source": "ladder.json"})
    mixed = version(rungs="stacked,compile,bf16", stack_check=json.dumps(check),
                    ladder_result=proof)  # fmt: skip
    assert ladder_gate(mixed)["why"] == "not proven equivalent: ['bf16']"


# ---------------------------------------------------------------- the research run

SWEEP_RUN = {
    # 3,000 events a day: the first fold's test day has trades enough for a 5 s standard
    # error, so the held-out pick is made (2,000: none could be judged there)
    "data": {"products": ["SYNA"], "n_dates": 3,
             "synthetic": {"events_per_day": 3_000, "levels": 2}},
    "train": {"steps": 12, "batch_size": 32, "log_every": 4, "optimizations": "none"},
    "validation": {"folds": 2, "test_dates": 1},
    "sweep": {"lr": [1e-3, 3e-3, 1e-2]},
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.server
def test_a_sweep_trains_every_setting_and_fold_stacked_ranks_them_and_promote_sees_the_best(
    prefect_api, mlflow_uri, tmp_path
):
    """3 settings x 2 folds: six models, each of its own key, trained as one stack; each
    equal to its solo training within the ladder's fp32 tolerance; the settings ranked on
    their pooled out-of-sample mark-outs, each a trial; a child MLflow run per (setting,
    fold) under the research run; a re-run finds every model and simulation by key; the
    best setting's last-fold model is the registered version that promote gates and
    reproduce trains again (its whole stack) bit for bit."""
    from mlflow.tracking import MlflowClient

    from quantloop.flows.promote import promote
    from quantloop.flows.reproduce import reproduce
    from quantloop.flows.research import research
    from quantloop.flows.sweep import PLAIN, fit_alone, stacked_key
    from quantloop.flows.train import model_key
    from quantloop.profiling.config import FP32
    from quantloop.profiling.equivalence import max_rel_dev, rel_l2
    from quantloop.tasks.engine import storage
    from quantloop.tasks.records.summary import validity_notes
    from quantloop.tasks.research.stage import feature_outputs, plan_folds, training_part
    from quantloop.tasks.research.training import load_model, predict
    from quantloop.tasks.runtime.workspace import Selection

    name = f"sweep-{uuid.uuid4().hex[:8]}"
    workspace = {"home": str(tmp_path / "home"),
                 "tracking": {"tracking_uri": mlflow_uri, "experiment": name,
                              "registered_model": name}}  # fmt: skip
    params = ResearchParams.model_validate({**SWEEP_RUN, "workspace": workspace})
    first = research(params)

    # Ranked, each setting a trial (a fresh experiment: these three are all of them).
    assert first.trials == 3 and len(first.sweep) == 3
    assert [r["rank"] for r in first.sweep] == [1, 2, 3]
    diffs = [r["diff_bps"] for r in first.sweep]
    assert diffs == sorted(diffs, reverse=True)
    assert {r["label"] for r in first.sweep} == {"lr=0.001", "lr=0.003", "lr=0.01"}
    best = first.sweep[0]
    assert first.paired_bps["5s"]["mean_bps"] == pytest.approx(best["diff_bps"])
    assert first.paired_bps["5s"]["trials"] == 3
    # each setting's p-value is adjusted for the three trials (Sidak after Holm)
    holm = first.paired_bps["5s"]["p_holm"]
    assert best["p_adjusted"] == pytest.approx(1 - (1 - holm) ** 3)

    # The pick made on the first fold alone, judged on the second, which it did not see.
    held = first.sweep_holdout
    assert held["setting"] is not None, held
    assert held["horizon"] == "5s" and held["trials"] == 1  # three settings, all this sweep's
    assert held["label"] == next(r["label"] for r in first.sweep
                                 if r["setting"] == held["setting"])  # fmt: skip
    assert any(n.startswith("held out: chosen on the folds before the last")
               for n in validity_notes(first))  # fmt: skip

    # Six (setting, fold) models, each its own key, all trained in one stack of six.
    by_setting = {r["setting"]: r for r in first.sweep}
    keys = [k for s in range(3) for k in by_setting[s]["model_keys"]]  # setting-major
    assert first.sweep_models == 6 and first.sweep_models_cached == 0 and len(set(keys)) == 6
    [stack] = first.sweep_stacks
    assert stack["k"] == 6 and stack["rungs"] == ["stacked"] and stack["samples_per_s"] > 0
    root = params.workspace.resolve_site().root
    # The stage of the run: its pinned selection, read back from the run's records.
    resolved = json.loads(storage.read_bytes(MlflowClient(mlflow_uri).download_artifacts(
        first.mlflow_run_id, "params/resolved_params.json", str(tmp_path))))  # fmt: skip
    stage = params.stage(Selection.model_validate(resolved["selection"]))
    folds = plan_folds(stage)
    outputs = feature_outputs(stage)
    configs = params.settings()
    for s, cfg in enumerate(configs):
        for fold, key in zip(folds, by_setting[s]["model_keys"], strict=True):
            feats = [o.key for o in training_part(outputs, fold).values()]
            # the key is what decides the model: this setting, this fold, stacked on a CPU
            assert key == stacked_key(cfg, feats, fold.training_window(), ("stacked",), "cpu")
            assert key != model_key(cfg, feats, fold.training_window())  # not the solo key
            lineage = json.loads(storage.read_bytes(
                storage.join(root, "lineage", "models", f"{key}.json")))  # fmt: skip
            assert [m["model_key"] for m in lineage["stack"]["members"]] == keys
            assert lineage["config"]["lr"] == cfg.lr and lineage["fold"] == fold.index
            # equal to the same model trained alone (the plain loop), within fp32's tolerance
            together = load_model(storage.join(root, "models", f"{key}.pt"))
            [alone], _ = fit_alone(stage, [(cfg, fold, training_part(outputs, fold))], [PLAIN],
                                   None)  # fmt: skip
            assert together.model_digest != alone.model_digest  # another sum order
            assert max_rel_dev(together.loss_curve, alone.loss_curve) <= FP32.loss_rel
            test = [o.read() for p, o in outputs.items() if p.date in fold.test_dates]
            assert (
                rel_l2(
                    np.concatenate([predict(together, t) for t in test]),
                    np.concatenate([predict(alone, t) for t in test]),
                )
                <= FP32.pred_rel_l2
            )
    # the registered model was checked against its solo training in the run
    assert first.sweep_check["equivalent"] and first.sweep_check["tolerance"]["name"] == "fp32"

    # MLflow: the research run is the sweep's parent; a child run per (setting, fold).
    client = MlflowClient(mlflow_uri)
    found = client.search_runs(
        [first.mlflow_experiment_id],
        filter_string=f"tags.mlflow.parentRunId = '{first.mlflow_run_id}'",
    )
    stages = {}
    for r in found:
        stages.setdefault(r.data.tags["quantloop.stage"], []).append(r)
    assert {s: len(v) for s, v in stages.items()} == {"features": 1, "train": 1, "simulate": 1,
                                                      "trial": 6}  # fmt: skip
    trials = {(int(r.data.tags["sweep_setting"]), int(r.data.tags["fold"])): r
              for r in stages["trial"]}  # fmt: skip
    assert sorted(trials) == [(s, f.index) for s in range(3) for f in folds]
    for (s, k), r in trials.items():
        assert r.info.status == "FINISHED"
        assert r.data.tags["model_key"] == by_setting[s]["model_keys"][[f.index for f in folds]
                                                                        .index(k)]  # fmt: skip
        assert int(r.data.tags["sweep_rank"]) == by_setting[s]["rank"]
        assert float(r.data.params["train.lr"]) == configs[s].lr
        assert [m.step for m in client.get_metric_history(r.info.run_id, "loss")] == [4, 8, 12]
        assert "markout_bps.5s" in r.data.metrics
    parent = client.get_run(first.mlflow_run_id)
    assert parent.data.tags["sweep_setting"] == str(best["setting"])
    assert parent.data.metrics["sweep.holdout.setting"] == held["setting"]
    assert parent.data.metrics["sweep.models"] == 6 and parent.data.params["sweep.count"] == "3"

    # The registered version is the best setting's last-fold model, tagged as such.
    version = client.get_model_version(first.registered_model, first.model_version)
    assert version.tags["model_key"] == best["model_keys"][-1]
    assert first.model_digest == best["model_digests"][-1]
    assert version.tags["sweep_setting"] == str(best["setting"])
    assert json.loads(version.tags["train_config"])["lr"] == configs[best["setting"]].lr
    assert version.tags["rungs"] == "stacked" and json.loads(version.tags["stack_check"])[
        "equivalent"]  # fmt: skip

    # Run again: every model and simulation found by key, nothing trained, the same ranking.
    again = research(params)
    assert again.sweep_models_cached == 6 and again.sweep_stacks == []
    assert again.model_cached and again.simulation_cached
    assert [(r["setting"], r["model_digests"]) for r in again.sweep] == [
        (r["setting"], r["model_digests"]) for r in first.sweep]  # fmt: skip
    assert (again.registered_model, again.model_version) == (first.registered_model,
                                                             first.model_version)  # fmt: skip
    assert again.trials == 3  # a re-run of the same settings is not another trial

    # promote sees the best setting's version; its ladder gate takes the stacked rung on
    # the run's check; the mark-out gate counts the sweep's settings as its trials.
    decision = promote(first.mlflow_run_id, reproduce_sample=1,
                       workspace=params.workspace)  # fmt: skip
    assert (decision["model"], decision["version"]) == (first.registered_model,
                                                        first.model_version)  # fmt: skip
    assert decision["gates"]["ladder"]["passed"], decision["gates"]["ladder"]
    assert decision["gates"]["markout"]["trials"] == 3
    # reproduce trains the registered setting's models again, each in its recorded stack
    report = reproduce(first.mlflow_run_id, sample=1, models=True, workspace=params.workspace)
    models = [c for c in report["checks"] if c["what"] == "model"]
    assert len(models) == 2 and all(c["reproduced"] for c in models), report
    assert report["failures"] == 0
