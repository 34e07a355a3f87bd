"""Faults a run meets for real: its own process killed, and what the next run finds."""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest
from mlflow.tracking import MlflowClient

from quantloop.blocks import MlflowTracking
from quantloop.tasks.data.catalog import Catalog
from quantloop.tasks.data.schema import Partition
from quantloop.tasks.data.synthetic import SyntheticConfig, generate_day
from quantloop.tasks.engine import NodeStore, run_nodes, storage
from quantloop.tasks.records import tracking
from quantloop.tasks.research.stage import StageParams, plan_features
from quantloop.tasks.runtime.workspace import Selection, Workspace
from tests import servers
from tests.servers import FlakyProxy

TINY = {
    "data": {"products": ["SYNA"], "n_dates": 2,
             "synthetic": {"events_per_day": 2_000, "levels": 2}},
    "train": {"steps": 2_000, "batch_size": 32},  # long enough to be killed mid-run
    "validation": {"folds": 1},  # two dates fit one walk-forward fold
}  # fmt: skip


def roles(proc: psutil.Process) -> dict[int, str]:
    """The run's descendants that matter here: Dask's, and a Prefect server should the
    run have started one as its child (it does not: it records to a configured API, or
    to its home's resident server, which is started detached on purpose)."""
    found = {}
    for p in proc.children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if "uvicorn" in cmd and "prefect" in cmd:
            found[p.pid] = "prefect-server"
        elif "multiprocessing" in cmd or "spawn_main" in cmd:
            found[p.pid] = "dask"
    return found


@pytest.mark.slow
def test_kill_9_of_a_run_leaves_no_process_and_the_next_run_closes_its_mlflow_run(
    prefect_api, tmp_path
):
    params = tmp_path / "params.json"
    params.write_text(json.dumps(TINY))
    home = tmp_path / "home"
    # The session's Prefect API, as PREFECT_API_URL configures one: not a child of the
    # run, so what the kill must take down is the run's own processes, Dask's.
    # QUANTLOOP_INLINE_BELOW_S=0: its small first nodes start the LocalCluster, not run in
    # the flow's process (flows/features.py), so there are Dask processes to outlive it.
    env = servers.prefect_env(tmp_path / "prefect", PREFECT_API_URL=prefect_api,
                              QUANTLOOP_INLINE_BELOW_S="0")  # fmt: skip
    exe = Path(sys.executable).with_name("quantloop")
    run = subprocess.Popen(
        [str(exe), "run", "--params", str(params), "--home", str(home), "--workers", "1"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    proc = psutil.Process(run.pid)
    seen: dict[int, str] = {}
    identities: dict[int, float] = {}
    deadline = time.monotonic() + 180
    try:
        # Kill it once the Dask processes are up (the features stage).
        while "dask" not in seen.values():
            assert run.poll() is None, "the run ended before it could be killed"
            assert time.monotonic() < deadline, f"never saw Dask: {seen}"
            seen.update(roles(proc))
            time.sleep(0.05)
        identities = {pid: psutil.Process(pid).create_time() for pid in seen
                      if psutil.pid_exists(pid)}  # fmt: skip
        os.kill(run.pid, signal.SIGKILL)
        run.wait()

        def survivors() -> list[str]:
            out = []
            for pid, created in identities.items():
                try:
                    if psutil.Process(pid).create_time() == created:
                        out.append(f"{seen[pid]} {pid}")
                except psutil.Error:
                    pass
            return out

        end = time.monotonic() + 20
        while survivors() and time.monotonic() < end:
            time.sleep(0.2)
        assert survivors() == [], "left running after kill -9"
    finally:  # whatever the outcome, nothing of this test stays behind
        for pid, created in identities.items():
            try:
                p = psutil.Process(pid)
                if p.create_time() == created:
                    p.kill()
            except psutil.Error:
                pass
        if run.poll() is None:
            run.kill()

    # The killed run's MLflow parent run is still RUNNING; the next run marks it KILLED.
    block = MlflowTracking(tracking_uri=f"sqlite:///{home / 'mlflow.db'}")
    client, experiment = tracking.client_for(block)
    [left] = client.search_runs([experiment], filter_string="attributes.status = 'RUNNING'")
    assert left.data.tags["quantloop.stage"] == "research"
    assert tracking.close_dead_runs(client, experiment) == [left.info.run_id]
    closed = MlflowClient(block.resolved_uri()).get_run(left.info.run_id)
    assert closed.info.status == "KILLED"
    assert "process died" in closed.data.tags["quantloop.closed"]
    # A live run (this process's) is not touched.
    with tracking.run(client, experiment, "alive"):
        assert tracking.close_dead_runs(client, experiment) == []


# ---------------------------------------------------------------- S3 that throttles and drops


@pytest.fixture
def s3_bucket(s3_endpoint) -> str:
    import s3fs

    name = f"faults-{uuid.uuid4().hex[:12]}"
    s3fs.S3FileSystem(skip_instance_cache=True).mkdir(name)
    return name


def through(monkeypatch, proxy: FlakyProxy, **env: str) -> None:
    """This process's s3fs goes through `proxy` (storage caches one filesystem per
    endpoint and retry settings, so the change takes effect at once)."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    for k, v in env.items():
        monkeypatch.setenv(k, v)


@pytest.mark.slow
@pytest.mark.server
def test_throttled_and_dropped_s3_calls_are_retried_and_the_nodes_complete(
    s3_endpoint, s3_bucket, tmp_path, monkeypatch
):
    """moto's S3 behind a proxy that answers every third request with 503 SlowDown and
    drops every fifth connection: landing, feature nodes and their index all complete,
    every stored byte matches its digest, and no temporary or partial object remains."""
    import s3fs

    root = f"s3://{s3_bucket}/store"
    with FlakyProxy(s3_endpoint, slow_down_every=3, drop_every=5) as proxy:
        through(monkeypatch, proxy)
        catalog = Catalog(tmp_path / "catalog.sqlite")
        for day in (dt.date(2026, 3, 2), dt.date(2026, 3, 3)):
            table = generate_day("SYNA", day, SyntheticConfig(events_per_day=1_500, levels=2))
            catalog.land("synthetic", Partition("SYNA", day), table, root=root)
        stage = StageParams(
            workspace=Workspace(home=str(tmp_path)), selection=Selection()
        )  # only for its feature parameters
        plan = plan_features(stage, catalog.table("synthetic"))
        result = run_nodes(plan.kind, plan.params, plan.nodes, NodeStore(root))
        assert (result.computed, result.failed) == (2, 0), result.failures
    assert proxy.slowed > 0 and proxy.dropped > 0, vars(proxy)  # the faults did happen
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)  # read back past the proxy
    for row in result.manifest.to_pylist():
        data = storage.read_range(row["output_url"], row["output_offset"], row["output_length"])
        assert storage.sha256_hex(data) == row["output_digest"]
    for e in catalog.entries("synthetic"):
        assert storage.sha256_hex(storage.read_bytes(e.location)) == e.digest
    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    assert not [p for p in fs.find(s3_bucket) if storage.TMP_MARK in p]
    assert fs.call_s3("list_multipart_uploads", Bucket=s3_bucket).get("Uploads", []) == []


@pytest.mark.slow
@pytest.mark.server
@pytest.mark.parametrize("fault", ["slow_down_every", "drop_every"])
def test_s3_that_stays_down_fails_naming_the_object_and_leaves_nothing(
    s3_endpoint, s3_bucket, monkeypatch, fault
):
    url = f"s3://{s3_bucket}/store/never.bin"
    with FlakyProxy(s3_endpoint, **{fault: 1}) as proxy:
        # Fewer client retries than the default (~30-40 s of them) keep the test short;
        # the behaviour is the same.
        through(monkeypatch, proxy, AWS_MAX_ATTEMPTS="2")
        with pytest.raises(storage.StorageError, match=f"{url}: write failed"):
            storage.write_bytes_atomic(url, b"x" * 10_000)
    assert proxy.forwarded == 0 and proxy.requests > 1  # every try failed, and was retried
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    assert not storage.exists(url)


# ---------------------------------------------------------------- MLflow away for a while


@pytest.mark.slow
@pytest.mark.server
def test_records_wait_for_an_mlflow_server_that_comes_back(tmp_path):
    """The tracking server stops with a run's records still buffered and comes back on
    its port; the flush goes through (MLflow's client retries with exponential backoff,
    ~4 minutes in all by default) and nothing is lost."""
    import threading

    from tests.servers import free_port, mlflow_server

    port = free_port()
    with mlflow_server(tmp_path, port=port) as uri:
        client, experiment = tracking.client_for(MlflowTracking(tracking_uri=uri))
        recording = tracking.run(client, experiment, "across-a-restart")
        log = recording.__enter__()
        log.metrics({"before": 1.0})
        log.flush()
        log.series("loss", [0.5, 0.4, 0.3])  # buffered, not sent yet
    # The server is down now. It comes back on the same port (and store) a few seconds on.
    back = threading.Event()
    stop = threading.Event()

    def restart() -> None:
        time.sleep(3)
        with mlflow_server(tmp_path, port=port):
            back.set()
            stop.wait(300)

    thread = threading.Thread(target=restart, daemon=True)
    thread.start()
    try:
        t0 = time.monotonic()
        log.flush()  # retried until the server answers
        waited = time.monotonic() - t0
        recording.__exit__(None, None, None)
        assert back.is_set() and waited > 3
        run = client.get_run(log.run_id)
        assert run.info.status == "FINISHED" and run.data.metrics["before"] == 1.0
        assert [m.value for m in client.get_metric_history(log.run_id, "loss")] == [0.5, 0.4, 0.3]
    finally:
        stop.set()
        thread.join(60)


# ---------------------------------------------------------------- Prefect restarted mid-run


@pytest.mark.slow
@pytest.mark.server
def test_a_deployment_run_survives_a_prefect_server_restart(tmp_path):
    """The Prefect server stops while a research deployment runs on a process worker and
    comes back on its port and database; the flow run's client retries through the gap
    and the run completes, recorded as such."""
    import threading

    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    from quantloop.deploy import PREFECT_YAML, REPO_ROOT, apply, for_stack, read_deployments
    from tests.servers import free_port, prefect_server, prefect_worker

    auth, port, folder = "quantloop:restart-" + uuid.uuid4().hex[:8], free_port(), tmp_path / "p"
    home = tmp_path / "home"
    params = {"params": {
        "workspace": {"home": str(home), "n_workers": 1},
        "data": {"products": ["SYNA"], "n_dates": 2,
                 "synthetic": {"events_per_day": 3_000, "levels": 2}},
        # Long enough that the server is taken away while it trains: measured on a quiet
        # 2-core VM, a 7.5 s train stage (4.7 s of steps) and the stop 0.4 s into it. The
        # restart (15-30 s) is the test's critical path; more steps only lengthened it
        # when a loaded machine made the 600 steps this was outlast the restart.
        "train": {"steps": 250, "batch_size": 64, "optimizations": "none"},
        "validation": {"folds": 1},  # two dates fit one walk-forward fold
    }}  # fmt: skip
    restarted = threading.Event()
    stop_server = threading.Event()
    up = threading.Event()

    def server() -> None:  # the server's life: up, down while the run trains, up again
        with prefect_server(folder, auth_string=auth, port=port):
            up.set()
            stop_server.wait(300)
        time.sleep(3)
        with prefect_server(folder, auth_string=auth, port=port):
            restarted.set()
            while not finished.is_set():
                time.sleep(0.5)

    finished = threading.Event()
    thread = threading.Thread(target=server, daemon=True)
    thread.start()
    assert up.wait(180), "the Prefect server did not start"
    api = f"http://127.0.0.1:{port}/api"
    research = [d for d in read_deployments(PREFECT_YAML) if d.flow == "research"]
    try:
        with temporary_settings({PREFECT_API_URL: api, PREFECT_API_AUTH_STRING: auth}):
            apply(for_stack(research, pool="restart-pool", checkout=REPO_ROOT,
                            workspace={"home": str(home)}))  # fmt: skip
            with prefect_worker(api, "restart-pool", tmp_path / "worker",
                                env={"PREFECT_API_AUTH_STRING": auth}):  # fmt: skip
                flow_run = run_deployment("research/desk", parameters=params, timeout=0)
                deadline = time.monotonic() + 240
                with get_client(sync_client=True) as client:
                    # take the server away while the training stage runs
                    while time.monotonic() < deadline:
                        running = {client.read_flow(r.flow_id).name
                                   for r in client.read_flow_runs()
                                   if r.state is not None and r.state.is_running()}  # fmt: skip
                        if "train" in running:
                            break
                        time.sleep(0.5)
                    assert "train" in running, f"never saw the train stage run: {running}"
                stop_server.set()
                assert restarted.wait(180), "the Prefect server did not come back"
                with get_client(sync_client=True) as client:
                    while not (run := client.read_flow_run(flow_run.id)).state.is_final():
                        assert time.monotonic() < deadline + 300, f"still {run.state_name}"
                        time.sleep(1)
        assert run.state.is_completed(), (
            f"{run.state}\n" + (tmp_path / "worker" / "prefect-worker.log").read_text()[-4000:]
        )
    finally:
        finished.set()
        stop_server.set()
        thread.join(120)
