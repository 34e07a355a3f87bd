"""`quantloop serve` as a supervisor: a killed service is started again, a stop (Ctrl-C)
or a death (kill -9) leaves no process of the stack and no run it ended RUNNING, and a
taken port is said in one line before anything starts.

The stack is the real one (tests/test_ui.py starts it the same way): `quantloop serve` on
free loopback ports with its home in tmp_path, the research deployment run with a small
data set and a long training, so that the run is still in flight when the stack is
stopped or killed.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sqlite3
import stat
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import yaml

from quantloop.deploy import PREFECT_YAML, REPO_ROOT
from tests.servers import free_port

SERVE_TIMEOUT_S = 420  # a first start on a busy 2-core machine: 20-70 s measured
STACK_ENV = "QUANTLOOP_SERVE_STACK"  # quantloop/supervisor.py's tag (not imported: see below)


def cli_env() -> dict[str, str]:
    """serve's environment as a researcher's shell gives it: no Prefect or MLflow settings
    of the tests', and the warm process on (its worker's flow runs fork from one, which
    the stack's stop must end too)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
    return env | {"QUANTLOOP_FORKSERVER": "1", "QUANTLOOP_FORKSERVER_IDLE_S": "300"}


def long_research(path: Path) -> Path:
    """infra/prefect.yaml with a research run on two small days whose training lasts
    minutes: it is in flight when the stack is stopped."""
    config = yaml.safe_load(PREFECT_YAML.read_text())
    [research] = [d for d in config["deployments"] if d["entrypoint"].endswith(":research")]
    research["parameters"]["params"].update(
        data={"products": ["SYNA"], "n_dates": 2,
              "synthetic": {"events_per_day": 2000, "levels": 2}},
        train={"steps": 50_000, "batch_size": 64},
        validation={"folds": 1},
    )  # fmt: skip
    research["parameters"]["params"]["workspace"]["n_workers"] = 1
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


class Served:
    def __init__(self, home: Path, ports: tuple[int, int], prefect_file: Path, n: int):
        self.home, self.ports = home, ports
        self.out = home.parent / f"serve-{n}.out"
        with open(self.out, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "quantloop.cli", "serve", "--home", str(home),
                 "--prefect-port", str(ports[0]), "--mlflow-port", str(ports[1]),
                 "--prefect-file", str(prefect_file)],
                stdout=log, stderr=subprocess.STDOUT, env=cli_env(), cwd=REPO_ROOT,
            )  # fmt: skip

    def output(self) -> str:
        return self.out.read_text(errors="replace")

    def wait_for(self, text: str, timeout: float = SERVE_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.output():
            code = self.proc.poll()
            assert code is None, f"serve exited {code}:\n{self.output()}"
            assert time.monotonic() < deadline, f"no {text!r} from serve:\n{self.output()}"
            time.sleep(0.5)

    @property
    def api(self) -> str:
        return f"http://127.0.0.1:{self.ports[0]}/api"

    @property
    def mlflow(self) -> str:
        return f"http://127.0.0.1:{self.ports[1]}"

    def client(self):
        from prefect.client.orchestration import get_client
        from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

        auth = json.loads((self.home / "serve" / "credentials.json").read_text())
        stack = contextlib.ExitStack()
        stack.enter_context(temporary_settings({PREFECT_API_URL: self.api,
                                                PREFECT_API_AUTH_STRING: auth[
                                                    "prefect_auth_string"]}))  # fmt: skip
        return stack, stack.enter_context(get_client(sync_client=True))

    def service(self, module: str) -> psutil.Process:
        """The stack's process started as `python -m <module> ...` (serve's child)."""
        [p] = [c for c in psutil.Process(self.proc.pid).children()
               if c.cmdline()[1:3] == ["-m", module]]  # fmt: skip
        return p

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()


@contextlib.contextmanager
def serve(home: Path, ports: tuple[int, int], prefect_file: Path, n: int) -> Iterator[Served]:
    served = Served(home, ports, prefect_file, n)
    try:
        served.wait_for("ready in")
        yield served
    finally:
        served.stop()


def start_run(served: Served):
    stack, client = served.client()
    with stack:
        deployment = client.read_deployment_by_name("research/desk")
        return client.create_flow_run_from_deployment(deployment.id).id


def flow_runs(served: Served) -> list:
    stack, client = served.client()
    with stack:
        return client.read_flow_runs()


def wait_in_training(served: Served, run_id, timeout: float = 400) -> None:
    """Until the run's train subflow runs (the parent and the features subflow before it)."""
    deadline = time.monotonic() + timeout
    while True:
        stack, client = served.client()
        with stack:
            runs = client.read_flow_runs()
            names = {f.id: f.name for f in client.read_flows()}
        [run] = [r for r in runs if r.id == run_id]
        assert not run.state.is_final(), f"the run ended early: {run.state}"
        if any(r.parent_task_run_id and r.state.is_running() and names[r.flow_id] == "train"
               for r in runs):  # fmt: skip
            return
        assert time.monotonic() < deadline, [(names[r.flow_id], r.state_name) for r in runs]
        time.sleep(2)


def mlflow_statuses(home: Path) -> dict[str, str]:
    """run id -> status in the workspace's MLflow store, read as a file (no server)."""
    with contextlib.closing(sqlite3.connect(home / "mlflow.db")) as db:
        return dict(db.execute("select run_uuid, status from runs"))


def stack_processes(home: Path) -> list[psutil.Process]:
    """Processes carrying a stack's tag for `home`."""
    found = []
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if p.environ().get(STACK_ENV, "").endswith(f" {home}"):
                found.append(p)
    return found


def listeners(ports: tuple[int, ...]) -> list[int]:
    return [c.pid for c in psutil.net_connections("tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr.port in ports]  # fmt: skip


def health(url: str) -> bytes:
    with urllib.request.urlopen(url + "/health", timeout=5) as r:
        return r.read()


def mode(path: Path) -> str:
    return oct(stat.S_IMODE(path.stat().st_mode))


@pytest.fixture
def home(tmp_path) -> Iterator[Path]:
    """The stack's home; whatever of a stack on it a failed test leaves is ended."""
    home = tmp_path / "home"
    home.mkdir()
    yield home
    for p in stack_processes(home):
        with contextlib.suppress(psutil.Error):
            p.kill()


@pytest.mark.slow
@pytest.mark.server
def test_serve_restarts_what_dies_and_leaves_nothing_running(home, tmp_path):
    # A store an embedded `quantloop run` made with the default umask: serve closes it.
    sqlite3.connect(home / "mlflow.db").close()
    (home / "mlflow.db").chmod(0o644)
    deployments = long_research(tmp_path / "prefect.yaml")
    ports = (free_port(), free_port())

    with serve(home, ports, deployments, 1) as served:
        modes = {p: mode(home / p) for p in ("serve", "mlflow.db", "serve/mlflow-auth.db")}
        # (a) kill -9 of MLflow's serving process (uvicorn, the child of `mlflow server`)
        [uvicorn] = psutil.Process(served.service("mlflow").pid).children()
        uvicorn.kill()
        served.wait_for("mlflow server restarted", timeout=300)
        assert served.proc.poll() is None and health(served.mlflow) == b"OK"
        # (b) Ctrl-C with a run in flight (its train subflow running)
        run_id = start_run(served)
        wait_in_training(served, run_id)
        # the run is a child of the worker's warm process (started beside the worker),
        # both carrying the stack's tag
        warm = [p for p in stack_processes(home) if "quantloop.forkserver" in p.cmdline()]
        assert len(warm) >= 2, [p.cmdline() for p in stack_processes(home)]
        in_flight = {r.id for r in flow_runs(served) if not r.state.is_final()}
        opened = {k for k, v in mlflow_statuses(home).items() if v == "RUNNING"}
        family = psutil.Process(served.proc.pid).children(recursive=True)
        served.stop()
    assert served.proc.returncode == 0, served.output()
    left = [p for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert left == [], [p.cmdline() for p in left]
    assert stack_processes(home) == [] and listeners(ports) == []
    assert len(in_flight) >= 2 and opened, (in_flight, opened)  # the run and its subflow(s)

    # The same ports again: the records of the stopped run are closed.
    with serve(home, ports, deployments, 2) as again:
        states = {r.id: r.state_name for r in flow_runs(again) if r.id in in_flight}
        assert states and all(s == "Cancelled" for s in states.values()), states
        statuses = mlflow_statuses(home)
        assert {statuses[r] for r in opened} == {"KILLED"}, statuses
        assert modes == {"serve": "0o700", "mlflow.db": "0o600",
                         "serve/mlflow-auth.db": "0o600"}  # fmt: skip
        # (c) kill -9 of the `mlflow server` parent: its child would keep the port
        parent = again.service("mlflow")
        [child] = parent.children()
        parent.kill()
        again.wait_for("mlflow server restarted", timeout=300)
        assert not child.is_running() and health(again.mlflow) == b"OK"
        # then kill -9 of serve itself, with a run in flight, and of its watcher, which
        # would otherwise end its processes (tasks/runtime/reaper.py): all of them are
        # left, the servers holding the ports
        run_id = start_run(again)
        wait_in_training(again, run_id)
        in_flight = {r.id for r in flow_runs(again) if not r.state.is_final()}
        opened = {k for k, v in mlflow_statuses(home).items() if v == "RUNNING"}
        again.service("quantloop.tasks.runtime.reaper").kill()
        again.proc.kill()
        again.proc.wait()
        assert listeners(ports), "the killed stack's servers should still hold the ports"

    # A third start on the same ports: what the killed stack left is ended, its runs closed.
    with serve(home, ports, deployments, 3) as third:
        assert "processes an earlier stack on this home left" in third.output()
        others = [p for p in stack_processes(home)
                  if not p.environ()[STACK_ENV].startswith(f"{third.proc.pid}:")]  # fmt: skip
        assert others == [], [p.cmdline() for p in others]
        states = {r.id: r.state_name for r in flow_runs(third) if r.id in in_flight}
        assert states and all(s in ("Crashed", "Cancelled") for s in states.values()), states
        statuses = mlflow_statuses(home)
        assert {statuses[r] for r in opened} == {"KILLED"}, statuses
    assert stack_processes(home) == [] and listeners(ports) == []
    print(served.output(), again.output(), third.output(), sep="\n----\n")


def test_a_taken_port_is_said_in_one_line_before_anything_starts(tmp_path):
    prefect_port = free_port()
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        t0 = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-m", "quantloop.cli", "serve", "--home", str(tmp_path / "home"),
             "--prefect-port", str(prefect_port), "--mlflow-port", str(taken)],
            capture_output=True, text=True, env=cli_env(), cwd=REPO_ROOT, timeout=300,
        )  # fmt: skip
        took = time.monotonic() - t0
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert len(lines) == 1, lines
    assert f"port {taken} is in use (by pid {os.getpid()}: " in lines[0], lines
    assert "--mlflow-port" in lines[0], lines
    assert not (tmp_path / "home" / "serve" / "logs" / "prefect-server.log").exists()
    assert took < 60, took
