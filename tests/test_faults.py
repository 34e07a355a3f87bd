"""Faults a run meets for real: its own process killed, and what the next run finds."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from mlflow.tracking import MlflowClient

from quantloop.blocks import MlflowTracking
from quantloop.tasks import tracking

TINY = {
    "data": {"products": ["SYNA"], "n_dates": 2,
             "synthetic": {"events_per_day": 2_000, "levels": 2}},
    "train": {"steps": 2_000, "batch_size": 32},  # long enough to be killed mid-run
}  # fmt: skip


def roles(proc: psutil.Process) -> dict[int, str]:
    """The run's descendants that matter here: the temporary Prefect server and Dask."""
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
def test_kill_9_of_a_run_leaves_no_process_and_the_next_run_closes_its_mlflow_run(tmp_path):
    params = tmp_path / "params.json"
    params.write_text(json.dumps(TINY))
    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(tmp_path / "prefect"))
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
        # Kill it once both the server and the Dask processes are up (the features stage).
        while set(seen.values()) != {"prefect-server", "dask"}:
            assert run.poll() is None, "the run ended before it could be killed"
            assert time.monotonic() < deadline, f"never saw the server and Dask: {seen}"
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
    assert left.data.tags["mlflow.runName"] == "research"
    assert tracking.close_dead_runs(client, experiment) == [left.info.run_id]
    closed = MlflowClient(block.resolved_uri()).get_run(left.info.run_id)
    assert closed.info.status == "KILLED"
    assert "process died" in closed.data.tags["quantloop.closed"]
    # A live run (this process's) is not touched.
    with tracking.run(client, experiment, "alive"):
        assert tracking.close_dead_runs(client, experiment) == []
