"""The processes of `quantloop serve`: each service started in a session of its own,
watched, restarted when it dies (a bounded number of times), and ended with its whole
tree.

A service's tree is more than its process group: `mlflow server` serves from a uvicorn
child in its group, but the worker starts each flow run in a session of its own, and a
flow run's Dask processes hang below that. Three records find them all, even after a
parent died and the kernel re-parented its children:

- the process group (the service leads it): a killed `mlflow server` leaves its uvicorn
  child there, holding the port;
- the descendants seen while it ran (pid and create time, so a reused pid is not ours),
  refreshed by the supervisor every second;
- STACK_ENV, set in each service's environment and so inherited by every process below
  it: "<serve's pid>:<its create time> <home>". It also finds what a stack killed with
  kill -9 left behind, when the next `serve` on the same home starts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import psutil

STACK_ENV = "QUANTLOOP_SERVE_STACK"
GRACE_S = 5.0  # SIGTERM first (uvicorn, Prefect and Dask shut down cleanly), then SIGKILL
# A service that dies more often than this within RESTART_WINDOW_S is left dead and the
# stack stops: a crash loop (a corrupt database, a port taken by another program) is
# not fixed by starting it again.
MAX_RESTARTS = 3
RESTART_WINDOW_S = 600.0


def stack_tag(home: Path) -> str:
    """The STACK_ENV value of this process's stack on `home`."""
    me = psutil.Process()
    return f"{me.pid}:{me.create_time():.2f} {home}"


def tag_owner_alive(tag: str) -> bool:
    """Whether the `serve` that wrote `tag` is still running (same pid, same start)."""
    owner, _, _ = tag.partition(" ")
    pid, _, created = owner.partition(":")
    with contextlib.suppress(psutil.Error, ValueError):
        return f"{psutil.Process(int(pid)).create_time():.2f}" == created
    return False


def tagged(match: Callable[[str], bool]) -> list[psutil.Process]:
    """The processes whose STACK_ENV satisfies `match` (this user's: others' environment
    is not readable, and we could not end them anyway)."""
    found = []
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            tag = p.environ().get(STACK_ENV)
            if tag is not None and match(tag):
                found.append(p)
    return found


def leftovers(home: Path) -> list[psutil.Process]:
    """Processes of an earlier stack on `home` whose `serve` is dead (killed with kill -9:
    its reaper ends what it knew of, but a child re-parented before the reaper saw it, or
    a reaper killed too, leaves some)."""
    return tagged(lambda tag: tag.partition(" ")[2] == str(home) and not tag_owner_alive(tag))


def live_stack_on(home: Path) -> int | None:
    """The pid of another `serve` running on `home`, found through its processes."""
    for p in tagged(lambda tag: tag.partition(" ")[2] == str(home) and tag_owner_alive(tag)):
        with contextlib.suppress(psutil.Error, ValueError):
            return int(p.environ()[STACK_ENV].partition(":")[0])
    return None


def end_processes(procs: Iterable[psutil.Process], grace: float = GRACE_S) -> int:
    """SIGTERM, then SIGKILL what is left after `grace`; how many were running."""
    alive = []
    for p in procs:
        with contextlib.suppress(psutil.Error):
            if p.status() != psutil.STATUS_ZOMBIE:
                p.terminate()
                alive.append(p)
    _, still = psutil.wait_procs(alive, timeout=grace)
    for p in still:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(still, timeout=grace)
    return len(alive)


def group_members(pgid: int) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if os.getpgid(p.pid) == pgid:
                found.append(p)
    return found


def describe(p: psutil.Process) -> str:
    """A process as a reader knows it: `prefect server start`, not the interpreter's path."""
    try:
        argv = p.cmdline()
    except psutil.Error:
        return "?"
    if len(argv) > 2 and argv[1] == "-m":
        argv = argv[2:]
    elif argv and "python" in Path(argv[0]).name and len(argv) > 1:
        argv = argv[1:]
    words = [Path(argv[0]).name, *argv[1:]] if argv else [p.name()]
    text = " ".join(" ".join(words).split())  # one line, whatever the arguments hold
    return text if len(text) <= 60 else text[:57] + "..."


class PortInUse(RuntimeError):
    """A port the stack needs is taken; nothing was started."""


def port_holder(host: str, port: int) -> str | None:
    """None when `host:port` can be bound (as uvicorn binds it: SO_REUSEADDR, so a
    closed connection's TIME_WAIT does not count); else what holds it."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            return None
        except OSError:
            pass
    with contextlib.suppress(psutil.Error, OSError):
        for c in psutil.net_connections("tcp"):
            if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN and c.pid:
                return f"by pid {c.pid}: {describe(psutil.Process(c.pid))}"
    return "by a process this user cannot see"


def check_ports(host: str, ports: dict[str, int]) -> None:
    """Fail in one line, before anything starts, if a port is taken ({flag: port})."""
    if len(set(ports.values())) < len(ports):
        raise PortInUse(f"the ports must differ: {', '.join(f'{f} {p}' for f, p in ports.items())}")
    for flag, port in ports.items():
        if (holder := port_holder(host, port)) is not None:
            raise PortInUse(f"port {port} is in use ({holder}); pass {flag}")


@dataclasses.dataclass
class Service:
    """One process of the stack, in a session of its own, logging to a file."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log: Path
    proc: subprocess.Popen | None = None
    ready: Callable[[], bool] | None = None  # holds once it serves (after a restart too)
    umask: int = -1  # the process's umask (-1: this process's)
    tag: str = ""  # STACK_ENV for its processes
    # its descendants seen while it ran, pid -> create time
    family: dict[int, float] = dataclasses.field(default_factory=dict)
    restarts: list[float] = dataclasses.field(default_factory=list)  # when (monotonic)
    started: datetime.datetime | None = None  # its last start (UTC)
    prepare: Callable[[], object] | None = None  # called before each start

    def start(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        if self.prepare is not None:
            self.prepare()
        self.started = datetime.datetime.now(datetime.UTC)
        env = {**self.env, STACK_ENV: self.tag} if self.tag else self.env
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                self.argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True, umask=self.umask,
            )  # fmt: skip
        self.family = {}
        self.remember()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def check(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(
                f"{self.name} exited with {self.proc.returncode}; its log: {self.log}\n"
                + tail(self.log)
            )

    def remember(self) -> None:
        """Record the process and its descendants as they are now."""
        if self.proc is None:
            return
        with contextlib.suppress(psutil.Error):
            me = psutil.Process(self.proc.pid)
            for p in [me, *me.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):
                    self.family.setdefault(p.pid, p.create_time())

    def tree(self) -> list[psutil.Process]:
        """What is left of it: its group, and the descendants it had (still the same
        processes)."""
        if self.proc is None:
            return []
        self.remember()
        found = {p.pid: p for p in group_members(self.proc.pid)}
        for pid, created in self.family.items():
            with contextlib.suppress(psutil.Error):
                p = psutil.Process(pid)
                if p.create_time() == created:
                    found.setdefault(pid, p)
        return list(found.values())

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM to the process (Prefect's CLI passes it on to its own child as SIGINT;
        signalling the whole group made the worker wait out the timeout), SIGKILL to it
        after `timeout`, then whatever is left of its tree: a killed parent's child that
        holds the port, a flow run's process and its Dask workers."""
        if self.proc is None:
            return
        left = self.tree()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=timeout)
        end_processes([p for p in left if p.pid != self.proc.pid] + self.tree())

    def may_restart(self) -> bool:
        """Count a restart; False once it has died MAX_RESTARTS times within the window."""
        now = time.monotonic()
        self.restarts = [t for t in self.restarts if now - t < RESTART_WINDOW_S] + [now]
        return len(self.restarts) <= MAX_RESTARTS


def tail(path: Path, lines: int = 30) -> str:
    if not path.exists():
        return f"({path} missing)"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def wait_ready(service: Service, timeout: float) -> float:
    """Seconds until `service.ready()` holds; fails if it exits or is not ready in time."""
    t0 = time.monotonic()
    while True:
        service.check()
        with contextlib.suppress(OSError, ValueError):
            if service.ready is None or service.ready():
                return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"{service.name} not ready within {timeout:.0f} s after a restart")
        time.sleep(0.25)
