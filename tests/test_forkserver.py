"""The warm process (quantloop/forkserver.py), through the real `quantloop` executable:
a server started by one command forks the next, with the client's streams, folder and
exit status; a kill -9 or Ctrl-C of the client reaches the command; changed code and an
idle timeout end the server. A test that ends its server has one of its own (TMPDIR is
part of its address); the others share one; each server is ended with its fixture."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from quantloop import forkserver
from tests import servers

EXE = Path(sys.executable).with_name("quantloop")
TINY = {
    "data": {"products": ["SYNA"], "n_dates": 2,
             "synthetic": {"events_per_day": 2_000, "levels": 2}},
    "train": {"steps": 2_000, "batch_size": 32},  # long enough to be interrupted
    "validation": {"folds": 1},
}  # fmt: skip


class Warm:
    """A test's own server: its environment, its log, its processes."""

    def __init__(self, tmp_path: Path, **env: str):
        self.tmp = tmp_path
        self.env = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR"}
        self.env.update({"QUANTLOOP_FORKSERVER": "1", "QUANTLOOP_FORKSERVER_IDLE_S": "120",
                         "TMPDIR": str(tmp_path), "COLUMNS": "300", **env})  # fmt: skip
        self.log = tmp_path / f"quantloop-{os.getuid()}" / "forkserver.log"

    def cli(self, *args: str, cwd: Path | None = None, **kw) -> subprocess.CompletedProcess:
        return subprocess.run([str(EXE), *args], env=self.env, cwd=cwd or self.tmp,
                              capture_output=True, text=True, timeout=300, **kw)  # fmt: skip

    def lines(self) -> list[str]:
        return self.log.read_text().splitlines() if self.log.exists() else []

    def servers(self) -> list[int]:
        return [int(m[1]) for line in self.lines() if (m := re.search(r"pid (\d+) ready", line))]

    def started(self) -> list[int]:
        """Every server that bound the address, ready or still warming up."""
        return [int(m[1]) for line in self.lines()
                if (m := re.search(r"pid (\d+) warming up", line))]  # fmt: skip

    def wait_started(self, count: int, timeout: float = 60) -> int:
        """The `count`-th server to start, as soon as it has bound its address (not once
        ready: its warm-up is 9-20 CPU-s a test need not wait for)."""
        end = time.monotonic() + timeout
        while len(self.started()) < count:
            assert time.monotonic() < end, f"no server started: {self.lines()}"
            time.sleep(0.1)
        return self.started()[count - 1]

    def forked(self) -> list[int]:
        return [
            int(m[1]) for line in self.lines() if (m := re.search(r"pid (\d+): quantloop", line))
        ]

    def wait_ready(self, count: int = 1, timeout: float = 180) -> int:
        end = time.monotonic() + timeout
        while len(self.servers()) < count:
            assert time.monotonic() < end, f"no server ready: {self.lines()}"
            time.sleep(0.2)
        return self.servers()[-1]

    def stop(self) -> None:
        _kill(set(self.servers()) | set(self.started()))


def _started(tmp: Path, **env: str) -> Warm:
    w = Warm(tmp, **env)
    # The first command runs in-process and starts the server for the next ones.
    first = w.cli("run", "--lobster", str(tmp / "absent"))
    assert first.returncode == 2 and "absent does not exist" in first.stderr
    assert w.forked() == []
    w.wait_ready()
    return w


@pytest.fixture
def warm(tmp_path):
    """A server of the test's own: for the tests that end it."""
    w = _started(tmp_path)
    yield w
    w.stop()


@pytest.fixture(scope="module")
def warm_shared(tmp_path_factory):
    """A server the tests that only use it share (its warm-up: 9-20 CPU-s). Its idle
    timeout outlasts the module (the fixture ends it): with the tests' 120 s it exited
    between its first test and its last in two fresh-clone suites, and the export test
    found no server."""
    w = _started(tmp_path_factory.mktemp("warm-shared"), QUANTLOOP_FORKSERVER_IDLE_S="3600")
    yield w
    w.stop()


@pytest.mark.slow
@pytest.mark.server
def test_the_next_command_is_forked_with_the_clients_folder_streams_and_status(
    warm_shared, tmp_path
):
    warm = warm_shared
    work = tmp_path / "work"
    work.mkdir()
    (work / "bad.json").write_text(json.dumps({"train": {"lr": -1}}))
    server = warm.servers()[-1]
    before = warm.forked()
    # A path relative to the client's folder; the answer on the client's own pipes.
    done = warm.cli("run", "--params", "bad.json", cwd=work)
    assert done.returncode == 2
    assert "--params bad.json: train.lr" in done.stderr and "greater than 0" in done.stderr
    [child] = warm.forked()[len(before) :]
    # it sends its status, then exits: gone within moments (the client may be first)
    assert _gone({child: psutil.Process(child).create_time()} if psutil.pid_exists(child)
                 else {}, timeout=10) == []  # fmt: skip
    # The same server forked it: no second one started, and it is still up.
    assert warm.servers() == [server] and psutil.pid_exists(server)
    assert "ready" not in done.stderr  # the server's own lines go to its log only
    # What the warm-up imported is frozen (tasks/runtime/collector.py): a child's
    # collections skip it (Prefect, MLflow, torch and the stages: ~650,000 objects)
    [frozen] = [int(m[1].replace(",", "")) for line in warm.lines()
                if (m := re.search(r"ready in .* s, ([\d,]+) objects frozen", line))]  # fmt: skip
    assert frozen > 200_000
    # A command it does not run (serve, api, ...) and --help still answer in-process.
    assert warm.cli("api", "--help").returncode == 0
    assert warm.forked() == [*before, child]


def test_a_different_import_time_variable_is_another_server_and_others_are_not():
    env = dict(os.environ)
    assert forkserver.address(env) == forkserver.address(env | {"MLFLOW_TRACKING_URI": "x"})
    assert forkserver.address(env) != forkserver.address(env | {"OMP_NUM_THREADS": "3"})
    assert forkserver.address(env) != forkserver.address(env | {"PREFECT_HOME": "/elsewhere"})
    assert forkserver.address(env) == forkserver.address(env | {"QUANTLOOP_FORKSERVER": "1"})
    # read while a command runs, not at import: the same server
    assert forkserver.address(env) == forkserver.address(env | {"QUANTLOOP_OVERLAP": "0"})


@pytest.fixture(scope="module")
def warm_api(tmp_path_factory, prefect_api):
    """A server whose commands record to the session's Prefect API (PREFECT_API_URL is
    part of the address, so it is a server of its own), shared by the tests that
    interrupt a research run: what they end is the command, not the server."""
    tmp = tmp_path_factory.mktemp("warm-api")
    w = Warm(tmp)
    # QUANTLOOP_INLINE_BELOW_S=0: a run's small first nodes start the LocalCluster (not run
    # in the flow's process), so that it has Dask processes to interrupt it among
    w.env = {**servers.prefect_env(tmp / "prefect", PREFECT_API_URL=prefect_api,
                                   QUANTLOOP_INLINE_BELOW_S="0"),
             **{k: w.env[k] for k in ("QUANTLOOP_FORKSERVER", "QUANTLOOP_FORKSERVER_IDLE_S",
                                      "TMPDIR", "COLUMNS")}}  # fmt: skip
    w.env.pop("XDG_RUNTIME_DIR", None)
    w.cli("run", "--lobster", str(tmp / "absent"))
    w.wait_ready()
    yield w
    w.stop()


def _run_until_dask(warm: Warm, tmp_path: Path):
    """A research run forked by the server, once its Dask processes are up: (client
    Popen, {pid: create time} of the forked command and its descendants)."""
    params = tmp_path / "params.json"
    params.write_text(json.dumps(TINY))
    before = set(warm.forked())
    client = subprocess.Popen(
        [str(EXE), "run", "--params", str(params), "--home", str(tmp_path / "home"),
         "--workers", "1"],
        env=warm.env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    end = time.monotonic() + 180
    while not (new := set(warm.forked()) - before):
        assert client.poll() is None and time.monotonic() < end, warm.lines()
        time.sleep(0.05)
    [child] = new
    proc = psutil.Process(child)
    while not [p for p in proc.children(recursive=True) if "spawn_main" in _cmdline(p)]:
        assert client.poll() is None, client.stderr.read()
        assert time.monotonic() < end, "never saw Dask"
        time.sleep(0.05)
    return client, {p.pid: p.create_time() for p in (proc, *proc.children(recursive=True))}


def _cmdline(p: psutil.Process) -> str:
    """A process's command line; "" for one that ended or is a zombie meanwhile (a
    short-lived child of the run: the fresh-clone suite of 5ae496f met one)."""
    try:
        return " ".join(p.cmdline())
    except psutil.Error:
        return ""


def _kill(pids) -> None:
    """Whatever of `pids` still runs: a test leaves nothing behind, whatever its outcome."""
    for pid in pids:
        try:
            psutil.Process(pid).kill()
        except psutil.Error:
            pass


def _gone(pids: dict[int, float], timeout: float = 30) -> list[int]:
    end = time.monotonic() + timeout
    while True:
        alive = []
        for pid, created in pids.items():
            try:
                p = psutil.Process(pid)
                if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.Error:
                pass
        if not alive or time.monotonic() > end:
            return alive
        time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.server
def test_kill_9_of_the_client_ends_its_command_and_what_it_started(warm_api, tmp_path):
    client, watched = _run_until_dask(warm_api, tmp_path)
    try:
        os.kill(client.pid, signal.SIGKILL)
        client.wait()
        assert _gone(watched) == [], "left running after kill -9 of the client"
    finally:
        _kill(watched)


@pytest.mark.slow
@pytest.mark.server
def test_ctrl_c_reaches_the_command_which_stops_cleanly(warm_api, tmp_path):
    client, watched = _run_until_dask(warm_api, tmp_path)
    try:
        os.kill(client.pid, signal.SIGINT)
        assert client.wait(timeout=120) == 130  # what the command answers in-process too
        assert _gone(watched) == []
    finally:
        _kill(watched)


@pytest.mark.slow
@pytest.mark.server
def test_changed_code_ends_the_server_and_the_command_runs_in_process(tmp_path):
    """The server watches every module file it imported. The file changed here is one
    only this test's server imports (a sitecustomize on its PYTHONPATH, which is part of
    its address): a change to quantloop's own files, touched for the test, would also
    end the warm processes of tests running beside it on other workers, were one of
    them asked for something meanwhile."""
    custom = tmp_path / "custom"
    custom.mkdir()
    watched = custom / "sitecustomize.py"
    watched.write_text("# imported by every interpreter of this test's environment\n")
    path = os.pathsep.join(p for p in (str(custom), os.environ.get("PYTHONPATH")) if p)
    warm = _started(tmp_path, PYTHONPATH=path)
    try:
        server = warm.servers()[-1]
        st = watched.stat()
        os.utime(watched, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
        done = warm.cli("run", "--lobster", "/absent-too")
        assert done.returncode == 2 and "absent-too does not exist" in done.stderr
        said = f"{watched} changed on disk: exiting"
        assert any(line.endswith(said) for line in warm.lines()), warm.lines()
        assert warm.forked() == []  # answered in-process, not by a stale child
        end = time.monotonic() + 30
        while psutil.pid_exists(server):  # not our child: polled, and it may be gone already
            assert time.monotonic() < end, "the stale server is still running"
            time.sleep(0.1)
        assert warm.wait_started(count=2) != server  # the client started a fresh one
    finally:
        warm.stop()


@pytest.mark.slow
@pytest.mark.server
def test_an_idle_server_exits(tmp_path):
    w = Warm(tmp_path, QUANTLOOP_FORKSERVER_IDLE_S="2")
    try:
        w.cli("run", "--lobster", str(tmp_path / "absent"))
        server = w.wait_ready()
        end = time.monotonic() + 60
        while psutil.pid_exists(server):
            assert time.monotonic() < end, "the idle server is still running"
            time.sleep(0.2)
        assert any("idle for 2 s: exiting" in line for line in w.lines())
    finally:
        w.stop()


@pytest.mark.slow
@pytest.mark.server
def test_stop_ends_the_server_and_the_next_command_starts_another(warm):
    server = warm.servers()[-1]
    stop = [sys.executable, "-m", "quantloop.forkserver", "--stop"]
    done = subprocess.run(stop, env=warm.env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == str(server)
    end = time.monotonic() + 30
    while psutil.pid_exists(server):
        assert time.monotonic() < end, "the stopped server is still running"
        time.sleep(0.1)
    again = subprocess.run(stop, env=warm.env, capture_output=True, text=True, timeout=60)
    assert again.returncode == 1 and "no warm process" in again.stdout
    assert warm.cli("run", "--lobster", "/absent").returncode == 2  # in-process
    assert warm.wait_started(count=2) != server


@pytest.mark.slow
def test_off_starts_nothing(tmp_path):
    w = Warm(tmp_path, QUANTLOOP_FORKSERVER="0")
    done = w.cli("run", "--lobster", str(tmp_path / "absent"))
    assert done.returncode == 2
    time.sleep(1)
    assert not w.log.exists()


def _catches(pid: int, signum: int) -> bool:
    """Whether process `pid` has a handler for `signum` (Linux: SigCgt in its status)."""
    with open(f"/proc/{pid}/status") as status:
        caught = next(line for line in status if line.startswith("SigCgt:"))
    return bool(int(caught.split()[1], 16) >> (signum - 1) & 1)


@contextlib.contextmanager
def _importing_server(w: Warm) -> Iterator[subprocess.Popen]:
    """A server of `w`'s environment that has bound its address and is still importing
    (7-8 s here), ended when the block ends."""
    name = forkserver.address(w.env)
    w.log.parent.mkdir(mode=0o700, parents=True)
    with open(w.log, "ab") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "quantloop.forkserver", name.lstrip("\0")], env=w.env,
            stdout=out, stderr=out, start_new_session=True,
        )  # fmt: skip
    try:
        import socket

        end = time.monotonic() + 30
        while True:
            with socket.socket(socket.AF_UNIX) as probe:
                if probe.connect_ex(name) == 0:
                    break
            assert time.monotonic() < end, "the server never bound its address"
            time.sleep(0.05)
        yield server
    finally:
        server.kill()
        server.wait()


def _waiting_client(w: Warm, *args: str) -> subprocess.Popen:
    """`quantloop *args` started once it waits on the server (in its backlog): its signal
    handlers are set (SIGHUP caught, which Python leaves alone), not after a fixed sleep;
    a loaded CI machine took over 0.5 s to reach them."""
    client = subprocess.Popen([str(EXE), *args], env=w.env, stderr=subprocess.PIPE,
                              text=True)  # fmt: skip
    end = time.monotonic() + 60
    while not _catches(client.pid, signal.SIGHUP):
        assert client.poll() is None, client.stderr.read()
        assert time.monotonic() < end, "the client never waited on the server"
        time.sleep(0.02)
    return client


@pytest.mark.slow
@pytest.mark.server
def test_ctrl_c_while_the_server_is_still_importing_stops_the_client_at_once(tmp_path):
    w = Warm(tmp_path)
    with _importing_server(w):
        client = _waiting_client(w, "run", "--lobster", str(tmp_path / "absent"))
        # a SIGINT during the interpreter's start-up would be Python's, hence the wait
        client.send_signal(signal.SIGINT)
        assert client.wait(timeout=10) == 130
        assert w.servers() == [], "the server was ready before the Ctrl-C: nothing shown"
        assert "Traceback" not in client.stderr.read()


@pytest.mark.slow
@pytest.mark.server
def test_a_server_that_dies_while_importing_leaves_the_command_to_run_in_process(tmp_path):
    """The client waits in the backlog of a server that is killed before it forks (an OOM
    kill, a broken install): the command runs in the client's own process, as with no
    server at all."""
    w = Warm(tmp_path)
    with _importing_server(w) as server:
        client = _waiting_client(w, "run", "--lobster", str(tmp_path / "absent"))
        server.kill()
        server.wait()
        assert client.wait(timeout=120) == 2
        err = client.stderr.read()
        assert w.servers() == [], "the server was ready before its kill: nothing shown"
    assert "absent does not exist" in err and "Traceback" not in err, err


@pytest.mark.slow
@pytest.mark.server
def test_a_command_hands_its_model_export_to_a_fresh_child_of_its_server(
    warm_shared, tmp_path, monkeypatch, caplog
):
    """tasks/runtime/overlap.call from a command of the server (its address set as the
    fork sets it): the registration's model export runs in another child of the server,
    from the stored model, and gives the model the export here gives; a call the server
    does not list is refused; a child that fails leaves the export to the caller, with a
    warning; with QUANTLOOP_OVERLAP=0, or no server, the caller is told to do the work
    itself."""
    import mlflow.pytorch
    import numpy as np
    import torch

    from quantloop.tasks.records import registry
    from quantloop.tasks.research.training import TrainConfig, save_model, train
    from quantloop.tasks.runtime import overlap
    from tests.test_training import SMALL, learnable_table

    warm = warm_shared
    table = learnable_table(400, 5)
    result = train([table], ["a", "b"], ["label_4"], TrainConfig(**SMALL))
    url = tmp_path / "models" / "m.pt"
    save_model(result, url)
    example = registry.windows(result, table, np.array([0, 5, 200, 399]))
    meta = {"artifact_path": "file:///nowhere", "model_uuid": "m-1", "run_id": "r-1",
            "model_id": "m-1"}  # fmt: skip
    monkeypatch.setattr(overlap, "SERVER", forkserver.address(warm.env))
    there = tmp_path / "there"
    there.mkdir()
    registry.export(result, example, str(there / "model"), meta, str(url))
    [call] = [line for line in warm.lines() if ": call " in line]
    assert call.endswith("call quantloop.tasks.records.registry:export_stored")
    monkeypatch.setattr(overlap, "SERVER", None)  # an in-process command: exported here
    here = tmp_path / "here"
    here.mkdir()
    registry.export(result, example, str(here / "model"), meta, str(url))
    assert len([line for line in warm.lines() if ": call " in line]) == 1
    x = torch.from_numpy(example)
    with torch.no_grad():
        exported = [mlflow.pytorch.load_model(str(d / "model"))(x) for d in (there, here)]
        assert torch.equal(exported[0], exported[1])
        assert torch.equal(exported[0], registry.predictor(result)(x))
    assert sorted(p.name for p in (there / "model").iterdir()) == sorted(
        p.name for p in (here / "model").iterdir())  # fmt: skip

    monkeypatch.setattr(overlap, "SERVER", forkserver.address(warm.env))
    with pytest.raises(overlap.CallFailed, match="not a call this server runs"):
        overlap.call("os:getcwd", {})

    # a child that fails: exported here instead, and said so
    def failing(target, kwargs):
        raise overlap.CallFailed("planted")

    monkeypatch.setattr(overlap, "call", failing)
    fallback = tmp_path / "fallback"
    fallback.mkdir()
    with caplog.at_level("WARNING", logger="quantloop.tasks.records.registry"):
        registry.export(result, example, str(fallback / "model"), meta, str(url))
    assert "planted" in caplog.text and (fallback / "model" / "MLmodel").exists()
    monkeypatch.undo()
    monkeypatch.setattr(overlap, "SERVER", forkserver.address(warm.env))
    monkeypatch.setenv("QUANTLOOP_OVERLAP", "0")
    with pytest.raises(overlap.Unavailable, match="QUANTLOOP_OVERLAP=0"):
        overlap.call("quantloop.tasks.records.registry:export_stored", {})
    assert len([line for line in warm.lines() if ": call " in line]) == 1


def torch_cuda_built() -> bool:
    import torch

    return torch.cuda._is_compiled() and any(
        n.startswith("nvidia") and n[6:].isdigit() for n in os.listdir("/dev"))  # fmt: skip


@pytest.mark.slow
def test_the_warm_up_leaves_the_server_fit_to_fork():
    """forkserver.warm_up, in a fresh interpreter as the server runs it, asks nothing of
    CUDA: where CUDA is built, `torch.cuda.is_available()` (asked at import by Inductor's
    benchmarking module, and by torch.export's fake tensors) and the device guard's
    set-up (FakeTensorMode.__enter__ where no device is said to be there) initialize the
    driver, and the server then refuses to serve: each did on an H200. It restores what
    it changed for the calls. Its other half, no OpenMP region entered, is what the
    export test above runs into: a forked export hung in its first LayerNorm when the
    warm-up ran a LayerNorm for real. Inductor's question at import is torch 2.11's (the
    H200's); this machine's torch asks it later, so here the block that answers it
    (cuda_asked_of_devices) is asked directly."""
    code = """
import json, torch
from torch._subclasses.fake_tensor import FakeTensorMode
from quantloop import forkserver
asked = []
def recorder(name):
    return lambda *a, **k: asked.append(name)
torch.cuda.is_available = recorder("is_available")
torch.cuda.device_count = recorder("device_count")
torch._C._ensureCUDADeviceGuardSet = recorder("_ensureCUDADeviceGuardSet")
is_available = torch.cuda.is_available
prop = FakeTensorMode.__dict__["avoid_device_init"]
from prefect.client.schemas.filters import FlowRunFilter  # completed on first use
lazy = FlowRunFilter.__pydantic_complete__
forkserver.warm_up()
with forkserver.cuda_asked_of_devices():  # what Inductor's import asks, under torch 2.11
    answered = torch.cuda.is_available()
print(json.dumps({
    "asked": asked,
    "answered": answered,
    "inductor": "torch._inductor.cudagraph_trees" in __import__("sys").modules,
    "restored": torch.cuda.is_available is is_available
    and FakeTensorMode.__dict__["avoid_device_init"] is prop,
    # what a subflow's start builds on first use, built here (tasks/runtime/first_calls)
    "prefect models": [lazy, FlowRunFilter.__pydantic_complete__],
}))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.splitlines()[-1])
    # Inductor in too where a GPU is (on a CPU nothing compiles: not imported)
    assert found == {"asked": [], "answered": torch_cuda_built(),
                     "inductor": torch_cuda_built(), "restored": True,
                     "prefect models": [False, True]}  # fmt: skip


def test_a_failing_warm_up_step_is_logged_and_left_out():
    """A warm-up step only saves commands time (Inductor's import, the export's first
    call): one that fails is said in the server's log, and the server goes on to serve."""
    code = (
        "from quantloop import forkserver\n"
        "forkserver.WARM_MODULES = ()\n"
        "forkserver.WARM_CALLS = ('os:no_such_function',\n"
        "                         'quantloop.tasks.records.plots:_figure_class')\n"
        "forkserver.warm_up()\n"
        "print('serving')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert "warm-up step os:no_such_function failed, left out: AttributeError" in lines[0]
    assert lines[1:] == ["serving"]


def test_the_warm_imports_come_from_the_runtime_dependencies():
    """README's first command installs without [dev]: a warm module from a test-only
    package (arch once was) would fail the server's warm-up there and nowhere in CI."""
    import importlib.metadata as md
    import tomllib
    from pathlib import Path

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    from quantloop.forkserver import WARM_INDUCTOR, WARM_MODULES

    # quantloop's own from pyproject.toml (an editable install's metadata can be older)
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    own = pyproject["project"]["dependencies"]
    runtime: set[str] = set()
    todo: list[tuple[str, frozenset[str]]] = [("quantloop", frozenset())]
    seen = set(todo)
    while todo:  # quantloop's requirements without its extras, and theirs, extras asked
        dist, extras = todo.pop()
        reqs = own if dist == "quantloop" else md.requires(dist) or ()
        for req in map(Requirement, reqs):
            if req.marker and not any(req.marker.evaluate({"extra": e}) for e in extras or {""}):
                continue
            runtime.add(canonicalize_name(req.name))
            key = (canonicalize_name(req.name), frozenset(req.extras))
            try:
                md.distribution(req.name)
            except md.PackageNotFoundError:
                continue
            if key not in seen:
                seen.add(key)
                todo.append(key)
    assert "numpy" in runtime and "arch" not in runtime
    owners = md.packages_distributions()
    for module in WARM_MODULES + WARM_INDUCTOR:
        top = module.split(".")[0]
        if top != "quantloop":
            dists = {canonicalize_name(d) for d in owners.get(top, [])}
            assert dists & runtime, (module, dists)
