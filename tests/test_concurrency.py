"""Runs at the same time on one workspace: each reads exactly the data it landed, and
the shared stores (MLflow's SQLite file, the catalog, the node index) stay whole."""

from __future__ import annotations

import datetime as dt
import json
import multiprocessing
import sqlite3
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest

from quantloop.flows.research import ResearchParams, research
from tests import servers

TINY = {
    "data": {"products": ["SYNA"], "n_dates": 2,
             "synthetic": {"events_per_day": 3_000, "levels": 2}},
    "train": {"steps": 20, "batch_size": 64, "optimizations": "none"},
    "validation": {"folds": 1},  # two dates fit one walk-forward fold
}  # fmt: skip


def params_with_seed(seed: int) -> dict:
    data = {**TINY["data"], "synthetic": {**TINY["data"]["synthetic"], "seed": seed}}
    return {**TINY, "data": data}


@pytest.mark.slow
def test_two_runs_at_once_on_one_workspace_each_get_their_own_datas_results(prefect_api, tmp_path):
    """Two `quantloop run`s start together on one workspace with different data for the
    same partitions (two generator seeds); each result equals that data's run alone.
    (Both record to the session's Prefect API: what they share here is the workspace.)"""
    home = tmp_path / "shared"
    exe = Path(sys.executable).with_name("quantloop")
    procs = {}
    for seed in (1, 2):
        params = tmp_path / f"p{seed}.json"
        params.write_text(json.dumps(params_with_seed(seed)))
        env = servers.prefect_env(tmp_path / f"prefect-{seed}", PREFECT_API_URL=prefect_api)
        procs[seed] = subprocess.Popen(
            [str(exe), "run", "--params", str(params), "--home", str(home), "--workers", "1",
             "--summary-json", str(tmp_path / f"together-{seed}.json")],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
    for seed, proc in procs.items():
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"run {seed}:\n{out[-3000:]}"
    for seed in (1, 2):
        together = json.loads((tmp_path / f"together-{seed}.json").read_text())
        alone = research(ResearchParams.model_validate(
            {**params_with_seed(seed), "workspace": {"home": str(tmp_path / f"alone-{seed}")}}
        ))  # fmt: skip
        assert together["data_digest"] == alone.data_digest, seed
        assert together["model_digest"] == alone.model_digest, seed
        assert together["markout_bps"] == alone.markout_bps, seed
    digests = {json.loads((tmp_path / f"together-{s}.json").read_text())["data_digest"]
               for s in (1, 2)}  # fmt: skip
    assert len(digests) == 2  # the two runs did read different data
    # each its own log (they were started in the same second, often), each with its run
    logs = sorted((home / "logs").glob("run-*.log"))
    assert len(logs) == 2, logs
    assert all("research" in log.read_text() for log in logs)


def _one_of_many(home: str, i: int) -> dict:
    """What a run does to the shared stores, in a process of its own: make the MLflow
    store (the first to come creates it), land partitions (some shared with the other
    processes, some not), compute their feature nodes into the shared store and index."""
    from quantloop.blocks import MlflowTracking
    from quantloop.tasks.data.landing import land_synthetic
    from quantloop.tasks.data.synthetic import SyntheticConfig
    from quantloop.tasks.engine import NodeStore, run_nodes
    from quantloop.tasks.records import tracking
    from quantloop.tasks.research.stage import StageParams, plan_features
    from quantloop.tasks.runtime.workspace import Selection, Workspace

    ws = Workspace(home=home)
    client, experiment = tracking.client_for(
        MlflowTracking(tracking_uri=f"sqlite:///{home}/mlflow.db")
    )
    catalog, root = ws.catalog(), ws.resolve_site().root
    days = [dt.date(2026, 3, 2), dt.date(2026, 3, 3)]
    cfg = SyntheticConfig(events_per_day=500, levels=1, seed=i % 2)  # two processes per seed
    landed = land_synthetic(catalog, root, ["SHARED", f"OWN{i}"], days, cfg)
    pin = catalog.pin("synthetic", [x.entry for x in landed])
    stage = StageParams(workspace=ws, selection=Selection(pin=pin))
    plan = plan_features(stage)
    result = run_nodes(plan.kind, plan.params, plan.nodes, NodeStore(root))
    with tracking.run(client, experiment, f"process-{i}") as run:
        run.metrics({"computed": result.computed})
    return {"nodes": plan.nodes.select(["key", "product"]).to_pylist(), "failed": result.failed}


@pytest.mark.slow
def test_eight_processes_at_once_keep_the_shared_stores_whole(tmp_path):
    home = str(tmp_path / "shared")
    # Eight processes of their own, forked from a fresh server process that imported this
    # module (and with it Prefect, MLflow, torch) once. Spawned, each paid those imports
    # before its first write: the test took 58 s, forked 32 s (the same loaded 2-core
    # VM, one after the other); and forked, they start writing together, the contention
    # the test is for.
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    with context.Pool(8) as pool:
        results = pool.starmap(_one_of_many, [(home, i) for i in range(8)])
    assert all(r["failed"] == 0 for r in results)
    from quantloop.tasks.engine import NodeStore
    from quantloop.tasks.runtime.workspace import Workspace

    ws = Workspace(home=home)
    store = NodeStore(ws.resolve_site().root)
    nodes = pa.Table.from_pylist([n for r in results for n in r["nodes"]])
    wanted = set(nodes["key"].to_pylist())
    found = store.existing("features", nodes)
    assert set(found["key"].to_pylist()) == wanted  # every process's nodes are committed
    for row in found.to_pylist():
        assert store.read(row).num_rows == row["rows"]  # and whole (read checks the digest)
    with sqlite3.connect(ws.catalog().path) as db:
        assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{home}/mlflow.db")
    [experiment] = [e for e in client.search_experiments() if e.name == "quantloop"]
    assert len(client.search_runs([experiment.experiment_id])) == 8
