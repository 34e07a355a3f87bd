"""The sweep stage: a research run's sweep (tasks/research/sweep.py), every setting trained
on every walk-forward fold, replayed on that fold's test window, ranked.

Each (setting, fold) is a model of its own key: its setting's TrainConfig, its fold's
training window and feature nodes, the device type and how it was trained. A re-run
finds every model by its key and trains only those it lacks; a setting added to a sweep
trains that setting's models alone.

Training: the models to train are grouped by what a stack must share (the model's and
the step's shape: profiling/stacked.py SHARED) and each group is trained as one stacked
model, in stacks of at most `Sweep.stack_size`: one stream of batched kernels for K
models, each with its own seed, data, batch order, learning rate and weight decay. A
stacked model is keyed apart from the same setting trained alone (rung "stacked"): it
equals that model within the ladder's tolerances, not bit for bit (the order of float
sums in a batched matmul changes with K). Its lineage record names the stack it was
trained in, member by member, so `quantloop reproduce` trains that stack again and gets
its weights bit for bit (`refit_stacked`). With `Sweep.stacked` off, each model trains
alone exactly as the train stage trains it, under the same key.

Records: the research run is the sweep's parent MLflow run; each (setting, fold) is a
child run of it (stage "trial"), made in the background, three calls each. The best
setting's models are recorded as the train stage's (its last fold's model registered:
what `promote` sees), its replay as the simulate stage's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import asdict, dataclass

from prefect import flow, get_run_logger
from pydantic import BaseModel

from quantloop.flows.simulate import SimSummary
from quantloop.flows.simulate import simulate as simulate_flow
from quantloop.flows.train import (
    TrainSummary,
    _record,
    device_type,
    model_key,
    plan_for,
    record_lineage,
    save_timed,
    train_summary,
)
from quantloop.models import orderbook
from quantloop.models import stacked as stacked_model
from quantloop.models.orderbook import ModelConfig
from quantloop.profiling import stacked, trainer
from quantloop.profiling.config import BF16, FP32
from quantloop.profiling.equivalence import max_rel_dev, rel_l2
from quantloop.profiling.proof import Plan
from quantloop.profiling.stacked import Member, StackConfig, train_stacked
from quantloop.tasks.data.schema import Partition
from quantloop.tasks.engine import code_fingerprint, storage
from quantloop.tasks.records import tracking
from quantloop.tasks.research import folds, training
from quantloop.tasks.research.features import feature_set
from quantloop.tasks.research.folds import Fold, split_fold
from quantloop.tasks.research.form import SimForm, TrainForm
from quantloop.tasks.research.simulation import SimConfig
from quantloop.tasks.research.stage import (
    FeatureOutput,
    Keyed,
    StageParams,
    feature_outputs,
    fold_of,
    keyed_output,
    output_key,
    plan_folds,
    read_outputs,
    training_part,
)
from quantloop.tasks.research.sweep import Sweep, held_out, label, rank, varied
from quantloop.tasks.research.train_config import TrainConfig
from quantloop.tasks.research.training import (
    TrainingData,
    TrainResult,
    load_model,
    predict,
    prepare,
    resolve_device,
    sample_order,
    train_plain,
)
from quantloop.tasks.runtime import progress, timeline
from quantloop.tasks.runtime.sites import GPU, gpu_client, worker_address

PLAIN = Plan(requested="none", rungs=(), proof=None)  # the plain loop's plan

Spec = tuple[TrainConfig, Fold, dict[Partition, FeatureOutput]]  # one model to train


class SweepSummary(BaseModel):
    """The sweep stage's result. `train` and `simulate` are the best setting's, as the
    train and simulate stages give them (its last fold's model registered); `settings`
    ranks every setting."""

    train: TrainSummary
    simulate: SimSummary
    horizon: str  # the mark-out horizon the settings are ranked on
    chosen: int  # the best setting's index in the sweep's order
    # ranked, best first: tasks/research/sweep.rank's rows (setting, label, train (the
    # swept fields), rank, diff_bps, diff_se_bps, p_adjusted, significant, markout_bps,
    # markout_se_bps, trades, per fold: model_keys, model_digests, final_loss, ...)
    settings: list[dict]
    stacks: list[dict] = []  # the stacks trained in this run: K, shape, seconds, samples/s
    models: int = 0  # (setting, fold) models of the sweep
    models_cached: int = 0  # of them found by their key
    train_s: float | None = None  # the training loops' seconds in this run (None: all cached)
    check: dict | None = None  # the registered model against its solo training
    trials: int = 1
    # the pick made on the folds before the last, tested on the last (tasks/research/sweep.py
    # held_out; None with one fold)
    holdout: dict | None = None


@dataclass(kw_only=True, slots=True)
class Node:
    """One (setting, fold) of the sweep: the model it trains and under which key."""

    setting: int
    config: TrainConfig
    fold: Fold
    parts: dict[Partition, FeatureOutput]  # the fold's training part
    key: str
    rungs: tuple[str, ...]
    stack: StackConfig | None  # how it trains in a stack (None: alone, by `plan`)
    plan: Plan


def stack_setup(plan: Plan) -> tuple[StackConfig, tuple[str, ...]]:
    """The stack's switches from a training plan: those of the plan's rungs a stack has
    (profiling/stacked.py SWITCHES: the device's metrics, the copy stream and the loader's
    mask are the solo loop's), less any whose own requirement is not among them; and the
    rungs a stacked model records: "stacked", then those."""
    on = {name for name in stacked.SWITCHES if name in plan.rungs}
    while lacking := {n for n, needs in stacked.REQUIRES.items()
                      if n in on and not set(needs) <= on}:  # fmt: skip
        on -= lacking
    stack = StackConfig(**{name: True for name in on}, compile_backend=plan.compile_backend,
                        warmup_steps=10 if "cudagraph" in on else 3)  # fmt: skip
    return stack, ("stacked", *stack.switches())


def member_data(base: TrainingData, cfg: TrainConfig) -> TrainingData:
    """A setting's training data from its fold's, prepared once for every setting of the
    same windows: its seeded batch order and its model's shape. Equal to what
    tasks/research/training.prepare gives for `cfg` (windows and normalization depend on
    the tables, window, stride and window_s only)."""
    n_features, n_outputs = len(base.inputs), len(base.label_names)
    return dataclasses.replace(
        base,
        order=sample_order(len(base.windows), cfg),
        model_config=ModelConfig(n_features=n_features, n_outputs=n_outputs, **cfg.model_size),
    )


def read_members(stage: StageParams, specs: Sequence[Spec]) -> list[TrainingData]:
    """Each model's training data: the feature outputs of every fold read once (each
    checked against its digest: a damaged one raises DamagedOutputs), each fold's
    training part windowed once per window setting."""
    every: dict[Partition, FeatureOutput] = {}
    for _, _, parts in specs:
        every |= parts
    with timeline.phase("train: read features"):
        tables = read_outputs(stage, every)
    layout = feature_set(stage.features)
    prepared: dict[tuple, TrainingData] = {}
    out = []
    with timeline.phase("train: windows"):
        for cfg, fold, parts in specs:
            shared = (json.dumps(fold.training_window()), tuple(map(str, parts)), cfg.window,
                      cfg.stride, cfg.window_s)  # fmt: skip
            if shared not in prepared:
                train, _ = split_fold({p: tables[p] for p in parts}, fold, layout.labels)
                prepared[shared] = prepare(list(train.values()), layout.inputs, layout.labels,
                                           cfg)  # fmt: skip
            out.append(member_data(prepared[shared], cfg))
    return out


def fit_stack(
    stage: StageParams, specs: Sequence[Spec], stack: StackConfig
) -> tuple[list[TrainResult], dict, str]:
    """Train the specs as one stack, wherever it runs: each model's result (as its solo
    run would give it, within the ladder's tolerances), the stack's timing, and the Dask
    worker it ran on ("" in the flow's process). A compiled stack's kernels are kept in
    (and looked for in) the workspace site's store, as a solo training's are."""
    datas = read_members(stage, specs)
    members = [Member(data=d, config=cfg) for d, (cfg, _, _) in zip(datas, specs, strict=True)]
    root = stage.workspace.resolve_site().root
    with timeline.phase("train: stacked steps"):
        results, timing = train_stacked(members, stack, compile_cache=root)
    return results, asdict(timing), worker_address()


def fit_alone(
    stage: StageParams, specs: Sequence[Spec], plans: Sequence[Plan], compile_cache: str | None
) -> tuple[list[TrainResult], str]:
    """Train each spec alone, one after another, as the train stage does (the plain loop,
    or the ladder's trainer with its plan's rungs): the same models under the same keys."""
    datas = read_members(stage, specs)
    results = []
    for data, (cfg, _, _), plan in zip(datas, specs, plans, strict=True):
        if not plan.rungs:
            results.append(train_plain(data, cfg))
        else:
            results.append(trainer.train_prepared(data, cfg, plan, compile_cache=compile_cache))
    return results, worker_address()


def stacked_key(
    config: TrainConfig, feature_keys: list[str], window: dict, rungs: tuple[str, ...],
    device: str,
) -> str:  # fmt: skip
    """A stacked model's key: what decides it, as flows/train.model_key's (code, config,
    device type, feature nodes, training window), with the stacked trainer's code and
    its rungs. Not the stack's other members: they change the order of float sums, not
    the model (its lineage names them)."""
    code = code_fingerprint(training, orderbook, folds, stacked_model, stacked, member_data,
                            read_members, fit_stack, stack_setup)  # fmt: skip
    config_values = {k: v for k, v in asdict(config).items() if k != "optimizations"}
    return output_key("model", code=code, config=config_values, device=device,
                      features=sorted(feature_keys), window=window, rungs=list(rungs))  # fmt: skip


def plan_nodes(
    configs: Sequence[TrainConfig], planned: Sequence[Fold],
    outputs: dict[Partition, FeatureOutput], plans: dict[int, Plan], sweep: Sweep,
    device: str | None,
) -> list[Node]:  # fmt: skip
    """Every (setting, fold), setting-major, with its key."""
    nodes = []
    for s, cfg in enumerate(configs):
        plan = plans[cfg.head_dim]
        stack, rungs = stack_setup(plan) if sweep.stacked else (None, plan.rungs)
        for fold in planned:
            parts = training_part(outputs, fold)
            feats = [o.key for o in parts.values()]
            if stack is None:
                key = model_key(cfg, feats, fold.training_window(), plan.rungs, device)
            else:
                key = stacked_key(cfg, feats, fold.training_window(), rungs,
                                  device or device_type(cfg.device))  # fmt: skip
            nodes.append(Node(setting=s, config=cfg, fold=fold, parts=parts, key=key,
                              rungs=rungs, stack=stack, plan=plan))  # fmt: skip
    return nodes


def stacks_of(nodes: Sequence[Node], size: int) -> list[list[Node]]:
    """The nodes a stack each: grouped by what members of a stack share (their step's
    and model's shape, their stack's switches), in order, at most `size` a stack."""
    groups: dict[tuple, list[Node]] = {}
    for n in nodes:
        shared = (*(getattr(n.config, name) for name in stacked.SHARED), n.stack)
        groups.setdefault(shared, []).append(n)
    return [g[i : i + size] for g in groups.values() for i in range(0, len(g), size)]


def member_record(n: Node) -> dict:
    """A stack member as its lineage names it: enough to train the stack again."""
    return {
        "model_key": n.key,
        "config": asdict(n.config),
        "fold": n.fold.index,
        "window": n.fold.window(),
        "feature_keys": sorted(o.key for o in n.parts.values()),
    }


@flow(name="sweep")
def sweep(
    stage: StageParams = StageParams(),
    config: TrainForm = TrainConfig(),
    sweep: Sweep = Sweep(),
    simulation: SimForm = SimConfig(),
    parent_run_id: str | None = None,
    trials: int = 1,
) -> SweepSummary:
    """Train every setting of `sweep` on every fold of the stage's validation, replay each
    setting's models on their test windows, and rank the settings.

    Args:
        stage: The workspace, the partitions (their features computed), the folds.
        config: The training config the sweep's settings change.
        sweep: The settings, how they are ranked and trained.
        simulation: How each setting's models trade and are marked out.
        parent_run_id: The MLflow run to record under (the research run): the best
            setting as the "train" and "simulate" stage runs, a child run per (setting,
            fold). Empty: nothing is recorded.
        trials: Configurations evaluated on these held-out data, every setting of this
            sweep included: the paired p-values are adjusted for them.
    """
    if not sweep.active:
        raise ValueError("sweep: no settings to try (give lr, weight_decay, seed, shapes or "
                         "settings)")  # fmt: skip
    with contextlib.ExitStack() as stack:
        return _sweep(stage, config, sweep, simulation, parent_run_id, trials, stack)


def _sweep(stage, config, sweep, simulation, parent_run_id, trials, stack) -> SweepSummary:
    logger = get_run_logger()
    site = stage.workspace.resolve_site()
    configs = sweep.expand(config)
    fields = varied(configs)
    with timeline.phase("train: plan"):
        gpu = gpu_client(stage.workspace.resolve_sites(), stack)
        outputs = feature_outputs(stage, prefer=(gpu[0] if gpu else site).name)
        planned = plan_folds(stage)
        device = gpu[1].submit(device_type, config.device, resources={GPU: 1},
                               pure=False).result() if gpu else None  # fmt: skip
        plans = {cfg.head_dim: plan_for(stage, cfg, device) for cfg in configs}
        nodes = plan_nodes(configs, planned, outputs, plans, sweep, device)
    at = gpu[0] if gpu else site
    ran_at = {"site": at.name, "worker": ""}

    def at_site(fn: Callable, *args):
        if gpu is None:
            return fn(*args)
        return gpu[1].submit(fn, *args, resources={GPU: 1}, pure=False).result()

    models, unique = found_models(site.root, nodes, logger)
    todo = [n for n in unique.values() if n.key not in models or models[n.key].reason]
    logger.info(
        "sweep: %d settings x %d folds = %d models; %d found by key, %d to train%s",
        len(configs),
        len(planned),
        len(nodes),
        len(unique) - len(todo),
        len(todo),
        f" as {'stacks' if sweep.stacked else 'one model at a time'}" if todo else "",
    )
    stacks = []
    train_s = []
    if sweep.stacked:
        for group in stacks_of(todo, sweep.stack_size):
            specs = [(n.config, n.fold, n.parts) for n in group]
            results, timing, ran_at["worker"] = at_site(fit_stack, stage, specs, group[0].stack)
            stacks.append(stack_record(group, timing, fields))
            train_s.append(timing["duration_s"])
            note = (f"trained a stack of {len(group)} models ({stacks[-1]['shape']}) in "
                    f"{timing['duration_s']:.1f} s: {timing['samples_per_s']:,.0f} samples/s "
                    f"(all models) after a {timing['warmup_s']:.1f} s warm-up, "
                    f"{timing['step_ms']:.2f} ms a step")  # fmt: skip
            logger.info(note)
            progress.note("train", note)
            members = [member_record(n) for n in group]
            for i, (n, result) in enumerate(zip(group, results, strict=True)):
                result.rungs = n.rungs
                if n.plan.proof is not None and len(n.rungs) > 1:
                    result.ladder_result = n.plan.proof.to_dict()
                extra = {"stack": {"members": members, "position": i,
                                   "config": asdict(n.stack)}}  # fmt: skip
                models[n.key] = store_model(site.root, n, result, models.get(n.key), extra)
    elif todo:
        specs = [(n.config, n.fold, n.parts) for n in todo]
        results, ran_at["worker"] = at_site(fit_alone, stage, specs, [n.plan for n in todo],
                                            stage.workspace.resolve_site().root)  # fmt: skip
        for n, result in zip(todo, results, strict=True):
            models[n.key] = store_model(site.root, n, result, models.get(n.key))
            train_s.append(result.duration_s)
            logger.info(
                "setting %d fold %d: trained alone in %.1f s, final loss %.4f",
                n.setting,
                n.fold.index,
                result.duration_s,
                result.loss_curve[-1],
            )

    # Each setting's models replay their own folds' test windows, pooled (cached by key).
    sims: list[SimSummary] = []
    with timeline.phase("simulate"):
        for s in range(len(configs)):
            urls = [models[n.key].url for n in nodes if n.setting == s]
            sims.append(simulate_flow.fn(urls, stage, simulation, None, trials))
    rows = [setting_row(s, cfg, fields, [n for n in nodes if n.setting == s], models, sims[s],
                        sweep.rank_horizon) for s, cfg in enumerate(configs)]  # fmt: skip
    ranked = rank(rows, sweep.rank_horizon)
    for row in ranked:
        row.pop("paired")
    chosen = ranked[0]["setting"]
    progress.note("sweep", f"best of {len(configs)} settings on the {sweep.rank_horizon} paired "
                  f"mark-out: {ranked[0]['label']} ({fmt_bps(ranked[0]['diff_bps'])} bps against "
                  f"the baseline, p adjusted for {trials} trials "
                  f"{fmt_p(ranked[0]['p_adjusted'])})")  # fmt: skip
    # the same choice made on the folds before the last, tested on the last (none with one)
    holdout = held_out([sim.paired_earlier_folds_bps for sim in sims],
                       [sim.paired_last_fold_bps for sim in sims],
                       [label(cfg, fields) for cfg in configs], sweep.rank_horizon, trials,
                       len(configs), pooled_best=chosen)  # fmt: skip
    if holdout is not None and holdout["setting"] is None:
        progress.note("sweep", f"no held-out test of the pick: {holdout['why']}")
    elif holdout is not None:
        progress.note("sweep", f"chosen on the folds before the last: {holdout['label']}; on "
                      f"the last fold {fmt_bps(holdout['diff_bps'])} bps against the baseline, "
                      f"p adjusted {fmt_p(holdout['p_adjusted'])}")  # fmt: skip
    best = [n for n in nodes if n.setting == chosen]

    check = None
    if sweep.stacked and sweep.check_alone:
        with timeline.phase("train: check alone"):
            check = check_chosen(stage, site.root, best[-1], models[best[-1].key], at_site,
                                 device, logger)  # fmt: skip

    trained = [(n.fold, models[n.key], n.parts, bytes_across(n, models[n.key], at))
               for n in best]  # fmt: skip
    run_id = version = None
    sim = sims[chosen]
    if parent_run_id is not None:
        client, experiment = tracking.client_for(stage.workspace.resolve_tracking())
        children = tracking.child_runs(client, experiment, parent_run_id,
                                       trial_runs(nodes, models, sims, ranked, fields))  # fmt: skip
        extra = {"sweep_setting": chosen, "sweep_label": ranked[0]["label"],
                 "sweep_settings": len(configs), "sweep_rank_horizon": sweep.rank_horizon,
                 "sweep_stacked": sweep.stacked,
                 **({"stack_check": json.dumps(check)} if check is not None else {})}  # fmt: skip
        with timeline.phase("train: record"):
            run_id, version = _record(stage, parent_run_id, configs[chosen], outputs, trained,
                                      ran_at["site"], plans[configs[chosen].head_dim],
                                      extra)  # fmt: skip
        if isinstance(version, Future):  # registered in the background: the caller joins it
            version = None
        # the best setting's replay as the simulate stage's run (every fold cached now)
        sim = simulate_flow.fn([m.url for _, m, _, _ in trained], stage, simulation,
                               parent_run_id, trials)  # fmt: skip
        with timeline.phase("sweep: record"):
            for future in children:
                future.result()
    return SweepSummary(
        train=train_summary(trained, ran_at, run_id, version),
        simulate=sim,
        horizon=sweep.rank_horizon,
        chosen=chosen,
        settings=ranked,
        stacks=stacks,
        models=len(nodes),
        models_cached=sum(models[n.key].cache_hit for n in nodes),
        train_s=sum(train_s) if train_s else None,
        check=check,
        trials=trials,
        holdout=holdout,
    )


def found_models(root: str, nodes: Sequence[Node], logger) -> tuple[dict[str, Keyed], dict]:
    """The models stored under the nodes' keys (each checked against its digest as it
    loads; a damaged one is kept as such, to train again), and the nodes by key (folds
    that train on the same dates share one)."""
    unique: dict[str, Node] = {}
    for n in nodes:
        unique.setdefault(n.key, n)
    models: dict[str, Keyed] = {}
    for key in unique:
        url = storage.join(root, "models", f"{key}.pt")
        if not storage.exists(url):
            continue
        try:
            models[key] = Keyed(key, url, load_model(url), cache_hit=True)
        except Exception as exc:  # noqa: BLE001 - any unreadable stored model is trained again
            logger.warning("model %s is damaged (%s: %s): training it again", key[:12],
                           type(exc).__name__, exc)  # fmt: skip
            models[key] = Keyed(key, url, None, cache_hit=False, reason="corrupt")
    return models, unique


def store_model(root: str, n: Node, result: TrainResult, before: Keyed | None,
                extra: dict | None = None) -> Keyed:  # fmt: skip
    url = storage.join(root, "models", f"{n.key}.pt")
    save_timed(url, result)
    record_lineage(root, n.key, result.model_digest, n.parts, n.config, n.fold, extra)
    return Keyed(n.key, url, result, cache_hit=False, reason=before.reason if before else "")


def bytes_across(n: Node, model: Keyed, at) -> int:
    if model.cache_hit:
        return 0
    return sum(o.blob.length for o in n.parts.values() if not at.holds(o.blob.url))


def stack_record(group: Sequence[Node], timing: dict, fields: Sequence[str]) -> dict:
    cfg = group[0].config
    shape = f"d={cfg.d_model} L={cfg.n_layers} H={cfg.n_heads} ff={cfg.ff_mult}"
    return {"k": len(group), "shape": shape, "rungs": list(group[0].rungs),
            "members": [f"{label(n.config, fields)} fold {n.fold.index}" for n in group],
            "batch_size": cfg.batch_size, "steps": cfg.steps,
            **{k: timing[k] for k in ("duration_s", "warmup_s", "step_ms", "samples_per_s",
                                      "peak_mem_gb", "gpu_util")}}  # fmt: skip


def setting_row(s: int, cfg: TrainConfig, fields: Sequence[str], nodes: Sequence[Node],
                models: dict[str, Keyed], sim: SimSummary, horizon: str) -> dict:  # fmt: skip
    """One setting's line of the ranking, before it is ranked."""
    return {
        "setting": s,
        "label": label(cfg, fields),
        "train": {name: getattr(cfg, name) for name in fields},
        "paired": sim.paired_bps,
        "markout_bps": sim.markout_bps.get(horizon),
        "markout_se_bps": sim.markout_se_bps.get(horizon),
        "trades": sim.trades,
        "baseline_trades": sim.baseline_trades,
        "per_fold_markout_bps": [sim.per_fold[n.fold.index]["markout_bps"].get(horizon)
                                 for n in nodes],
        "model_keys": [n.key for n in nodes],
        "model_digests": [models[n.key].value.model_digest for n in nodes],
        "final_loss": [models[n.key].value.loss_curve[-1] for n in nodes],
        "models_cached": all(models[n.key].cache_hit for n in nodes),
        "simulation_cached": sim.cache_hit,
    }  # fmt: skip


def trial_runs(
    nodes: Sequence[Node], models: dict[str, Keyed], sims: Sequence[SimSummary],
    ranked: Sequence[dict], fields: Sequence[str],
) -> list[tracking.ChildRun]:  # fmt: skip
    """A child run per (setting, fold): its config, fold, model, loss curve and the mark-out
    of its fold's test window; its setting's rank and pooled figures."""
    by_setting = {row["setting"]: row for row in ranked}
    out = []
    for n in nodes:
        row, result, keyed = by_setting[n.setting], models[n.key].value, models[n.key]
        replayed = sims[n.setting].per_fold[n.fold.index]
        h = row["horizon"]
        curve = result.loss_curve
        steps = [(i + 1) * n.config.log_every for i in range(len(curve))]
        out.append(tracking.ChildRun(
            name=f"s{n.setting}-fold{n.fold.index}",
            stage="trial",
            tags={"sweep_setting": n.setting, "sweep_label": row["label"], "fold": n.fold.index,
                  "fold_window": json.dumps(n.fold.window()), "model_key": n.key,
                  "model_digest": result.model_digest, "model_url": keyed.url,
                  "cache_hit": keyed.cache_hit, "rungs": ",".join(result.rungs) or "none",
                  "sweep_rank": row["rank"], "sweep_chosen": row["rank"] == 1},
            params={**{f"train.{k}": v for k, v in asdict(n.config).items()},
                    "setting": n.setting, "fold": n.fold.index,
                    "swept": ",".join(fields)},
            metrics={"final_loss": curve[-1], "samples": result.samples,
                     "duration_s": result.duration_s, "trades": replayed["trades"],
                     "baseline_trades": replayed["baseline_trades"],
                     **{f"markout_bps.{k}": v for k, v in replayed["markout_bps"].items()},
                     "setting.rank": row["rank"],
                     **({"setting.diff_bps." + h: row["diff_bps"]}
                        if row["diff_bps"] is not None else {})},
            series={"loss": (curve, steps)},
        ))  # fmt: skip
    return out


def check_chosen(stage, root: str, node: Node, model: Keyed, at_site, device, logger) -> dict:
    """The registered (last-fold) model of the best setting against the same model trained
    alone as the train stage trains it (the training plan's rungs, which the ladder proved
    equivalent to the plain loop; on a CPU, the plain loop itself): the loss curve and the
    predictions on its fold's test part, under the ladder's tolerance for the stack's
    precision (bf16 or fp32). Why not the plain fp32 loop on a GPU: at learning rates from
    5e-4 a bf16 model trained alone is itself over bf16's tolerance from the plain loop
    (docs/gpu.md), so the plain loop cannot tell a stack's error from any rounding change
    there. The solo model is stored under the train stage's key (a research run of that
    setting alone finds it); the comparison is kept by the two models' keys: a re-run
    reads both back."""
    feats = [o.key for o in node.parts.values()]
    plan = node.plan
    alone_key = model_key(node.config, feats, node.fold.training_window(), plan.rungs, device)

    def train_alone() -> TrainResult:
        results, _ = at_site(fit_alone, stage, [(node.config, node.fold, node.parts)], [plan],
                             stage.workspace.resolve_site().root)  # fmt: skip
        return results[0]

    alone = keyed_output(root, "model", alone_key, ".pt", load=load_model, compute=train_alone,
                         save=save_timed)  # fmt: skip
    if not alone.cache_hit:
        record_lineage(root, alone_key, alone.value.model_digest, node.parts, node.config,
                       node.fold)  # fmt: skip
    test = {p: o for p, o in feature_outputs(stage).items() if p.date in node.fold.test_dates}
    key = output_key("stack_check", stacked=node.key, alone=alone_key,
                     code=code_fingerprint(compare_alone))  # fmt: skip
    kept = keyed_output(
        root, "stack_check", key, ".json",
        load=lambda url: json.loads(storage.read_bytes(url)),
        compute=lambda: at_site(compare_alone, stage, node.fold, test, model.url, alone.url,
                                "bf16" in node.rungs),
        save=lambda url, value: storage.write_bytes_atomic(url, json.dumps(value).encode()),
    )  # fmt: skip
    check = {**kept.value, "alone_rungs": list(plan.rungs), "alone_model_key": alone_key,
             "alone_model_digest": alone.value.model_digest, "cached": kept.cache_hit}  # fmt: skip
    logger.info("the registered model against itself trained alone (rungs: %s): %s (loss "
                "curve %.2e, predictions %.2e; tolerance %s)", ", ".join(plan.rungs) or "none",
                "equivalent" if check["equivalent"] else "NOT equivalent",
                check["loss_max_rel_dev"], check["pred_rel_l2"], check["tolerance"])  # fmt: skip
    return check


def compare_alone(stage: StageParams, fold: Fold, test: dict[Partition, FeatureOutput],
                  stacked_url: str, alone_url: str, bf16: bool) -> dict:  # fmt: skip
    """Loss curves and held-out predictions of a stacked model and its solo training,
    against the ladder's tolerance (profiling/config.py) for `bf16` or fp32, where the
    models train."""
    where = str(resolve_device("auto"))
    together, alone = load_model(stacked_url, device=where), load_model(alone_url, device=where)
    tables = read_outputs(stage, test)
    _, parts = split_fold(tables, fold)
    ours = [predict(together, t) for t in parts.values()]
    theirs = [predict(alone, t) for t in parts.values()]
    import numpy as np

    tol = BF16 if bf16 else FP32
    loss = max_rel_dev(together.loss_curve, alone.loss_curve)
    pred = rel_l2(np.concatenate(ours), np.concatenate(theirs)) if ours else float("nan")
    return {"equivalent": bool(loss <= tol.loss_rel and pred <= tol.pred_rel_l2),
            "loss_max_rel_dev": loss, "pred_rel_l2": pred,
            "tolerance": {"name": "bf16" if bf16 else "fp32", "loss_rel": tol.loss_rel,
                          "pred_rel_l2": tol.pred_rel_l2},
            "windows": int(sum(len(p) for p in ours))}  # fmt: skip


def refit_stacked(
    stage: StageParams, lineage: dict, outputs: dict[Partition, FeatureOutput]
) -> dict[str, str]:
    """A stacked model's stack trained again as its lineage records it: the same members
    in the same order, from the features of the stage's catalog. Returns each member's
    weights digest by its key; LookupError naming a member whose feature nodes differ now
    (the catalog's current versions are other data)."""
    record = lineage["stack"]
    specs = []
    for m in record["members"]:
        fold = fold_of(m["window"], m["fold"])
        parts = training_part(outputs, fold)
        if sorted(o.key for o in parts.values()) != m["feature_keys"]:
            raise LookupError(f"inputs changed since (stack member {m['model_key'][:12]}: other "
                              "feature nodes in the catalog's current versions)")  # fmt: skip
        config = dict(m["config"])
        if isinstance(config.get("optimizations"), list):
            config["optimizations"] = tuple(config["optimizations"])
        specs.append((TrainConfig(**config), fold, parts))
    results, _, _ = fit_stack(stage, specs, StackConfig(**record["config"]))
    return {m["model_key"]: r.model_digest
            for m, r in zip(record["members"], results, strict=True)}  # fmt: skip


def fmt_bps(value) -> str:
    return "n/a" if value is None or value != value else f"{value:+.3f}"


def fmt_p(value) -> str:
    return "n/a" if value is None or value != value else f"{value:.3g}"
