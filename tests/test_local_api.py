"""The resident local Prefect API (tasks/runtime/local_api.py), with real processes: a
command starts it, the next reuses it, it stops itself when idle, waits out a slow start,
serves two commands at once, and `quantloop api` shows and stops it.

Each test has its own home and stops what it started; the commands run without any
PREFECT_* setting of this process (no API URL: the suite's harness does not reach them).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from quantloop.tasks.runtime import local_api

pytestmark = [pytest.mark.slow, pytest.mark.server]

PY = sys.executable

# A command that uses the API and nothing else: it holds its lease for argv[2] seconds,
# meeting the others of argv[3] (a folder) there when given, and prints what it saw.
USE = r"""
import json, os, sys, time
from pathlib import Path
from quantloop.tasks.runtime import local_api
home, hold_s = sys.argv[1], float(sys.argv[2])
meet = Path(sys.argv[3]) if len(sys.argv) > 3 else None
paths = local_api.paths_of(home)

def together(step, n=2, timeout=180):
    (meet / f"{step}-{os.getpid()}").touch()
    t0 = time.monotonic()
    while len(list(meet.glob(f"{step}-*"))) < n:
        assert time.monotonic() - t0 < timeout, f"the other command never reached {step}"
        time.sleep(0.1)

t0 = time.monotonic()
with local_api.using_api(home, say=lambda m: print("say:", m, flush=True)) as h:
    api = h.api
    out = {"kind": api.kind, "how": api.how, "url": api.url, "line": api.line(),
           "seconds": round(time.monotonic() - t0, 2), "env_url": os.environ.get("PREFECT_API_URL"),
           "state": local_api.read_json(paths.api)}
    if meet is not None:
        together("ready")
        out["leases_together"] = len(local_api.live_leases(paths))
        together("counted")
    time.sleep(hold_s)
    out["leases_at_end"] = len(local_api.live_leases(paths))
    out["healthy_at_end"] = local_api.healthy(api.url)
out["env_url_after"] = os.environ.get("PREFECT_API_URL")
print("RESULT " + json.dumps(out), flush=True)
"""

# A flow with tasks on whatever API the command found; the server's record of it.
FLOW = r"""
import json, sys, time, urllib.request
from quantloop.tasks.runtime import local_api
with local_api.using_api(sys.argv[1], say=lambda m: print("say:", m, flush=True)) as h:
    from prefect import flow, task

    @task
    def one() -> int:
        return 1

    @flow
    def tiny() -> int:
        return one() + one() + one()

    assert tiny() == 3
    state = local_api.read_json(local_api.paths_of(sys.argv[1]).api)
    print("RESULT " + json.dumps({"how": h.api.how, "url": h.api.url, "state": state,
                                  "seconds": h.api.seconds}), flush=True)
"""


def env_of(tmp_path: Path, **extra: str) -> dict[str, str]:
    """This environment without any Prefect setting (API URL, profile): a Prefect home
    of its own, so no profile of the user's configures an API either."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(tmp_path / "user-prefect"), COLUMNS="120", **extra)
    return env


def result(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    [line] = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    return {**json.loads(line.removeprefix("RESULT ")), "stdout": proc.stdout}


def use(home: Path, env: dict, hold_s: float = 0.0, timeout: float = 400) -> dict:
    return result(subprocess.run([PY, "-c", USE, str(home), str(hold_s)], env=env,
                                 capture_output=True, text=True, timeout=timeout))  # fmt: skip


def supervisors_of(home: Path) -> list[psutil.Process]:
    """Every supervisor of `home` alive now, whatever api.json says."""
    out = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "quantloop.tasks.runtime.local_api" in cmd and str(home) in cmd:
            out.append(p)
    return out


def end_all(home: Path) -> None:
    """Stop the home's server, and anything of it left by a failed test."""
    with contextlib.suppress(Exception):
        local_api.stop(home, grace_s=20)
    procs = []
    for sup in supervisors_of(home):
        with contextlib.suppress(psutil.Error):
            procs += [sup, *sup.children(recursive=True)]
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    _, alive = psutil.wait_procs(procs, timeout=20)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()


@pytest.fixture
def home(tmp_path, request) -> Path:
    h = tmp_path / "home"
    request.addfinalizer(lambda: end_all(h))
    return h


def gone(pid: int, created: str | None, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if local_api._process(pid, created) is None:
            return True
        time.sleep(0.25)
    return False


def post(url: str, body: dict) -> list:
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(request, timeout=30) as r:
        return json.loads(r.read())


# ------------------------------------------------------------------ the real command


def test_a_second_run_reuses_the_resident_server_which_records_flow_and_task_runs(tmp_path, home):
    params = tmp_path / "small.json"
    params.write_text(json.dumps({
        "data": {"products": ["SYNA"], "n_dates": 2,
                 "synthetic": {"events_per_day": 2_000, "levels": 2}},
        "train": {"steps": 5, "batch_size": 32},
        "validation": {"folds": 1},
    }))  # fmt: skip
    env = env_of(tmp_path)

    def run(n: int) -> tuple[str, dict, float]:
        summary = tmp_path / f"summary-{n}.json"
        t0 = time.monotonic()
        proc = subprocess.run(
            [PY, "-m", "quantloop.cli", "run", "--home", str(home), "--params", str(params),
             "--workers", "1", "--summary-json", str(summary)],
            env=env, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        took = time.monotonic() - t0
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, out[-5000:]
        return out, json.loads(summary.read_text()), took

    first, summary1, took1 = run(1)
    assert "Prefect API: resident: started in" in first, first[-3000:]
    state1 = local_api.read_json(home / "prefect" / "api.json")
    assert state1["state"] == "ready" and state1["ui_url"] in first  # the UI URL, printed
    # The server outlives the command that started it, with no lease left behind.
    assert local_api.healthy(state1["url"])
    assert local_api.live_leases(local_api.paths_of(home)) == []

    second, summary2, took2 = run(2)
    assert "Prefect API: resident: reused" in second, second[-3000:]
    state2 = local_api.read_json(home / "prefect" / "api.json")
    assert (state2["pid"], state2["port"], state2["server_pid"]) == (
        state1["pid"], state1["port"], state1["server_pid"]
    )  # fmt: skip
    print(f"first run {took1:.1f} s (server started {state1['start_s']} s), second {took2:.1f} s")

    # Both runs are in the server's database, each flow run with its task runs' states
    # (the task-run recorder runs: task runs reach the server as events).
    api = state2["url"]
    for s in (summary1, summary2):
        [run_] = post(api + "/flow_runs/filter",
                      {"flow_runs": {"id": {"any_": [s["prefect_flow_run_id"]]}}})  # fmt: skip
        assert run_["state_type"] == "COMPLETED", run_
    deadline = time.monotonic() + 30  # the recorder writes them asynchronously
    while True:
        tasks = post(api + "/task_runs/filter", {"flow_runs": {"id": {
            "any_": [summary1["prefect_flow_run_id"]]}}})  # fmt: skip
        if tasks and all(t["state_type"] == "COMPLETED" for t in tasks):
            break
        assert time.monotonic() < deadline, [(t["name"], t["state_type"]) for t in tasks]
        time.sleep(1)


# ------------------------------------------------------------------ leases and idling


def test_it_stops_when_idle_and_the_next_command_starts_another(tmp_path, home):
    env = env_of(tmp_path, QUANTLOOP_API_IDLE_TIMEOUT_S="3")
    # Held for twice the idle timeout: a lease keeps it up.
    first = use(home, env, hold_s=6)
    assert first["kind"] == "resident" and first["how"].startswith("resident: started in")
    assert first["healthy_at_end"] and first["leases_at_end"] == 1
    assert first["env_url"] == first["url"] and first["env_url_after"] is None
    state = first["state"]
    # ... and then, no lease for 3 s: the supervisor and its server are gone, api.json too.
    assert gone(state["pid"], state["pid_created"], timeout=60)
    assert gone(state["server_pid"], state["server_created"], timeout=30)
    assert not (home / "prefect" / "api.json").exists()
    assert "idle for" in (home / "prefect" / "server.log").read_text()

    # The next command starts another; idle at once (0), it stops as this command leaves,
    # and what the command's flow sent it is recorded first (task runs travel as events).
    env["QUANTLOOP_API_IDLE_TIMEOUT_S"] = "0"
    second = result(subprocess.run([PY, "-c", FLOW, str(home)], env=env, capture_output=True,
                                   text=True, timeout=400))  # fmt: skip
    assert second["how"].startswith("resident: started in"), second
    new = second["state"]
    assert new["pid"] != state["pid"]
    assert gone(new["pid"], new["pid_created"], timeout=30)
    assert gone(new["server_pid"], new["server_created"], timeout=30)
    with contextlib.closing(sqlite3.connect(home / "prefect" / "prefect.db")) as db:
        tasks = db.execute("select state_type, count(*) from task_run group by 1").fetchall()
        flows = db.execute("select state_type, count(*) from flow_run group by 1").fetchall()
    assert (tasks, flows) == ([("COMPLETED", 3)], [("COMPLETED", 1)])


def test_two_commands_at_once_share_one_server(tmp_path, home):
    env = env_of(tmp_path)
    meet = tmp_path / "meet"
    meet.mkdir()
    argv = [PY, "-c", USE, str(home), "0", str(meet)]
    procs = [subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]  # fmt: skip
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=400)
        outs.append(result(subprocess.CompletedProcess(p.args, p.returncode, out, err)))
    hows = sorted(o["how"].split(",")[0].split(" in ")[0] for o in outs)
    # One started it; the other joined that start (or, if it came late, reused it).
    assert hows[1] == "resident: started", hows
    assert hows[0] in ("resident: joined another command's start", "resident: reused"), hows
    assert len({o["state"]["pid"] for o in outs}) == 1
    assert len({o["url"] for o in outs}) == 1
    assert [o["leases_together"] for o in outs] == [2, 2]
    [sup] = supervisors_of(home)
    # A home wiped under its server (a benchmark's empty home): the server stops.
    shutil.rmtree(home / "prefect")
    _, alive = psutil.wait_procs([sup], timeout=30)
    assert alive == []


# ------------------------------------------------------------------ a slow start


def slow_server(tmp_path: Path, delay_s: float) -> str:
    """A PYTHONPATH with a sitecustomize that makes `prefect server start` (and nothing
    else) sleep `delay_s` before it starts: the real server, genuinely slow."""
    folder = tmp_path / "slow"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(
        "import time\n"
        "with open('/proc/self/cmdline', 'rb') as f:\n"
        "    argv = f.read().split(b'\\0')\n"
        "if b'prefect' in argv and b'server' in argv and b'start' in argv:\n"
        f"    time.sleep({delay_s})\n"
    )
    return os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH")) if p)


def test_a_server_slower_than_prefects_20_s_starts_and_records_a_flow(tmp_path, home):
    env = env_of(tmp_path, PYTHONPATH=slow_server(tmp_path, 25))
    t0 = time.monotonic()
    proc = subprocess.run([PY, "-c", FLOW, str(home)], env=env, capture_output=True, text=True,
                          timeout=500)  # fmt: skip
    took = time.monotonic() - t0
    out = result(proc)
    assert out["how"].startswith("resident: started in") and out["seconds"] > 25, out
    # It said it was waiting, every ~10 s.
    waiting = "starting the local Prefect API (first start: creating its database) ... 2"
    assert waiting in out["stdout"], out["stdout"]
    print(f"slow start: ready in {out['seconds']:.1f} s, the command took {took:.1f} s")
    tasks = post(out["url"] + "/task_runs/filter", {})
    deadline = time.monotonic() + 30
    while len(tasks) < 3 or any(t["state_type"] != "COMPLETED" for t in tasks):
        assert time.monotonic() < deadline, [(t["name"], t["state_type"]) for t in tasks]
        time.sleep(1)
        tasks = post(out["url"] + "/task_runs/filter", {})


def test_a_start_that_times_out_says_so_naming_the_log_and_leaves_nothing(tmp_path, home):
    env = env_of(tmp_path, QUANTLOOP_API_START_TIMEOUT_S="4",
                 PYTHONPATH=slow_server(tmp_path, 60))  # fmt: skip
    proc = subprocess.run([PY, "-c", USE, str(home), "0"], env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert proc.returncode != 0
    assert "LocalApiError: the local Prefect API did not start: no answer within 4 s" in (
        proc.stderr
    ), proc.stderr[-3000:]
    assert str(home / "prefect" / "server.log") in proc.stderr
    assert "started `prefect server start`" in proc.stderr  # its last lines
    assert not (home / "prefect" / "api.json").exists()
    time.sleep(1)
    assert supervisors_of(home) == []


# ------------------------------------------------------------------ the operator's command


def test_api_status_and_stop_and_which_api_wins(tmp_path, home):
    env = env_of(tmp_path)
    cli = [PY, "-m", "quantloop.cli", "api"]

    def api(*args: str, home_: Path = home) -> subprocess.CompletedProcess:
        return subprocess.run([*cli, *args, "--home", str(home_)], env=env, capture_output=True,
                              text=True, timeout=120)  # fmt: skip

    out = api("status", "--json")
    assert out.returncode == 0 and json.loads(out.stdout)["running"] is False

    # A command holds the server while `status` looks.
    holder = subprocess.Popen([PY, "-c", USE, str(home), "600"], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while not (state := local_api.read_json(home / "prefect" / "api.json")) or (
            state.get("state") != "ready"
        ):
            assert holder.poll() is None, holder.communicate()
            assert time.monotonic() < deadline
            time.sleep(0.5)
        info = json.loads(api("status", "--json").stdout)
        assert info["running"] and info["answers"] and info["pid"] == state["pid"]
        assert [lease["pid"] for lease in info["leases"]] == [holder.pid]
        text = api("status").stderr
        for shown in (state["url"], state["ui_url"], str(state["pid"]), "leases:    1",
                      "in use", str(home / "prefect" / "server.log")):  # fmt: skip
            assert shown in text, (shown, text)

        # Another home's commands: quantloop serve's API there wins over a resident one,
        # and a configured API over both; neither starts anything.
        other = tmp_path / "other"
        (other / "serve").mkdir(parents=True)
        (other / "serve" / "stack.json").write_text(json.dumps({
            "api_url": state["url"], "ui_url": state["ui_url"], "pid": state["pid"],
            "pid_created": state["pid_created"], "auth": False}))  # fmt: skip
        served = use(other, env)
        assert (served["kind"], served["url"]) == ("serve", state["url"])
        configured = use(tmp_path / "third", {**env, "PREFECT_API_URL": state["url"]})
        assert configured["kind"] == "configured" and configured["line"].startswith(
            "Prefect API: configured"
        )  # fmt: skip
        for h in (other, tmp_path / "third"):
            assert not (h / "prefect" / "api.json").exists()

        out = api("stop")
        assert out.returncode == 0 and "stopped the local Prefect API" in out.stderr
        assert "1 command(s) were using it" in out.stderr
        assert gone(state["pid"], state["pid_created"], timeout=30)
        assert gone(state["server_pid"], state["server_created"], timeout=30)
        assert json.loads(api("status", "--json").stdout)["running"] is False
        assert "no local Prefect API is running" in api("stop").stderr
    finally:
        holder.kill()
        holder.wait()
