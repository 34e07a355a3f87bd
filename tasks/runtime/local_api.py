"""The Prefect API a command records its flow runs to: a configured one, `quantloop
serve`'s, or a resident server of the workspace home, started once and shared.

Without an API, Prefect starts a temporary server in every command and gives up on it
after 20 s; here that start took 14-26 s on a quiet 2-core VM and up to 74 s on a loaded
one, so a command paid ~13 s for it at best and failed outright at worst. Instead, the
way `dagster dev` or a language server works, a command uses, in this order:

1. a configured API: PREFECT_API_URL in the environment, the active Prefect profile, or
   the settings of a Prefect already imported (the test suite's harness);
2. the Prefect server of `quantloop serve` on the same home (`<home>/serve/stack.json`,
   its auth string in `<home>/serve/credentials.json`);
3. the resident server of the home, under `<home>/prefect/` (its PREFECT_HOME and its
   SQLite database, so the run history stays with the runs' other records): started by
   the first command that needs it, reused by the next, stopped after
   QUANTLOOP_API_IDLE_TIMEOUT_S (default 900; 0: as soon as the last command leaves)
   with no command using it.

The resident server is `prefect server start` on a free loopback port under a small
supervisor process (`python -m quantloop.tasks.runtime.local_api supervise`), started
in a session of its own and not as a child of the command, so neither Ctrl-C nor a
kill of the command (nor its reaper) reaches it. Its files, under `<home>/prefect/`:

    api.json     url, port, pid (the supervisor's), server_pid, state, started_at:
                 written atomically; present while the server is starting or ready
    api.lock     an fcntl.flock serialising "find or start, and take a lease" against
                 "stop when idle" and `quantloop api stop`: a command never takes a
                 lease on a server that is stopping, and two commands never start two
    leases/      one file per command using the server (<pid>-<create time>-<n>),
                 removed when it ends, ignored (and removed) once its process is gone
    server.log   the supervisor's and the server's output
    prefect.db   the server's SQLite database; ui/ its UI's static files

Which of the server's background services run: those the temporary server runs (it is
the guide: flow and task runs get recorded as it records them), no others. That is the
task-run recorder (task runs reach the server as events: a server without it,
`--no-services`, drops their states), the event persister and distributor, reactive and
proactive triggers, actions, and the events' vacuum (events older than 7 days; the
database lives with the workspace, so that bounds it). Off: the scheduler, late runs,
pause expirations, cancellation clean-up, the repossessor, the foreman and the clean-up
reconciler, which serve deployments, workers and concurrency leases that this server
has none of (`quantloop serve` runs those) and would poll its SQLite database while a
run writes to it. They are not what a start costs (measured on a loaded 2-core VM:
importing the server 6-8 s, creating the database ~12 s and registering block types
~4 s on a first start only, the services ~2 s), and none of that is optional; a new
home's database is made as a copy of an empty one migrated once per Prefect version
(prefect_db.py: a first start 9.3 s -> 4.2 s on a quiet machine).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import dataclasses
import datetime
import fcntl
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil

from quantloop.tasks.runtime import prefect_db

IDLE_ENV, IDLE_DEFAULT_S = "QUANTLOOP_API_IDLE_TIMEOUT_S", 900.0
START_ENV, START_DEFAULT_S = "QUANTLOOP_API_START_TIMEOUT_S", 300.0
EPHEMERAL_TIMEOUT_ENV = "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"
PROGRESS_EVERY_S = 10.0
HOST = "127.0.0.1"

# The resident server's settings beside its home, database and URLs: the background
# services the temporary server does not run are off (see the module's docstring).
SERVER_SETTINGS = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_SERVER_SERVICES_SCHEDULER_ENABLED": "false",
    "PREFECT_SERVER_SERVICES_LATE_RUNS_ENABLED": "false",
    "PREFECT_SERVER_SERVICES_PAUSE_EXPIRATIONS_ENABLED": "false",
    "PREFECT_SERVER_SERVICES_CANCELLATION_CLEANUP_ENABLED": "false",
    "PREFECT_SERVER_SERVICES_REPOSSESSOR_ENABLED": "false",
    "PREFECT_SERVER_SERVICES_FOREMAN_ENABLED": "false",
    "PREFECT_SERVER_SERVICES_CLEANUP_RECONCILER_ENABLED": "false",
}


class LocalApiError(RuntimeError):
    """The local Prefect API could not be found or started."""


def _env_seconds(name: str, default: float) -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise LocalApiError(f"{name}={raw!r}: give a number of seconds") from None
    if value < 0:
        raise LocalApiError(f"{name}={raw!r}: give a number of seconds >= 0")
    return value


def idle_timeout_s() -> float:
    return _env_seconds(IDLE_ENV, IDLE_DEFAULT_S)


def start_timeout_s() -> float:
    return _env_seconds(START_ENV, START_DEFAULT_S)


def _now_iso() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def _log(message: str) -> None:
    """A line of the supervisor's in the server log (its stdout)."""
    print(f"{_now_iso()} [quantloop supervisor {os.getpid()}] {message}", flush=True)


# ------------------------------------------------------------------ files of a home


@dataclasses.dataclass(frozen=True)
class Paths:
    home: Path

    @property
    def root(self) -> Path:
        return self.home / "prefect"

    @property
    def api(self) -> Path:
        return self.root / "api.json"

    @property
    def lock(self) -> Path:
        return self.root / "api.lock"

    @property
    def leases(self) -> Path:
        return self.root / "leases"

    @property
    def log(self) -> Path:
        return self.root / "server.log"

    @property
    def db(self) -> Path:
        return self.root / "prefect.db"

    @property
    def stack(self) -> Path:  # `quantloop serve`'s, on the same home
        return self.home / "serve" / "stack.json"

    @property
    def credentials(self) -> Path:
        return self.home / "serve" / "credentials.json"


def paths_of(home: str | os.PathLike) -> Paths:
    return Paths(Path(os.path.abspath(os.path.expanduser(os.fspath(home)))))


def read_json(path: Path) -> dict | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def write_json_atomic(path: Path, value: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(value, indent=1))
    os.replace(tmp, path)


def tail(path: Path, lines: int = 20) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return f"({path} missing)"
    return "\n".join(text.splitlines()[-lines:])


@contextlib.contextmanager
def _locked(paths: Paths, *, wait_s: float | None = None, say=None) -> Iterator[bool]:
    """The home's flock, held inside the block; yields False when it was not had within
    `wait_s` (None: wait as long as it takes; 0: do not wait)."""
    paths.root.mkdir(parents=True, exist_ok=True)
    fd = os.open(paths.lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        t0, said = time.monotonic(), 0
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                waited = time.monotonic() - t0
                if wait_s is not None and waited >= wait_s:
                    yield False
                    return
                if say is not None and waited >= (said + 1) * PROGRESS_EVERY_S:
                    said += 1
                    say(f"waiting for the local Prefect API's lock ({paths.lock}) ... "
                        f"{waited:.0f} s")  # fmt: skip
                time.sleep(0.1)
        try:
            yield True
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


# ------------------------------------------------------------------ processes


def _created(p: psutil.Process) -> str:
    return f"{p.create_time():.2f}"


def _process(pid: Any, created: Any = None) -> psutil.Process | None:
    """The live process `pid`, if it is the one created at `created` (a reused pid is
    not); None when gone or a zombie."""
    if not isinstance(pid, int):
        return None
    try:
        p = psutil.Process(pid)
        if created is not None and _created(p) != created:
            return None
        if p.status() == psutil.STATUS_ZOMBIE:
            return None
        return p
    except psutil.Error:
        return None


def _end(procs: list[psutil.Process], grace_s: float = 20.0) -> None:
    """SIGTERM, then SIGKILL to what is left after `grace_s`."""
    alive = []
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.terminate()
            alive.append(p)
    _, still = psutil.wait_procs(alive, timeout=grace_s)
    for p in still:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(still, timeout=5)


def _end_server_of(state: dict, grace_s: float = 20.0) -> None:
    """Stop what a state names: the supervisor (which stops its server) and then the
    server, should it outlive the supervisor."""
    sup = _process(state.get("pid"), state.get("pid_created"))
    if sup is not None:
        _end([sup], grace_s)
    server = _process(state.get("server_pid"), state.get("server_created"))
    if server is not None:
        _end([server], grace_s)


def _free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


# No proxy for loopback, whatever http_proxy says.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def healthy(api_url: str, auth: str | None = None, timeout: float = 5.0) -> bool:
    """The API answers its health check (with HTTP basic auth, "user:password", when
    given)."""
    request = urllib.request.Request(api_url.rstrip("/") + "/health")
    if auth:
        request.add_header("Authorization", "Basic " + base64.b64encode(auth.encode()).decode())
    try:
        with _OPENER.open(request, timeout=timeout) as r:
            return r.read().strip() == b"true"
    except (OSError, ValueError):
        return False


# ------------------------------------------------------------------ leases


_lease_numbers = itertools.count()


@dataclasses.dataclass
class Lease:
    """A command's hold on the resident server: a file named for its process."""

    path: Path

    @classmethod
    def take(cls, paths: Paths) -> Lease:
        paths.leases.mkdir(parents=True, exist_ok=True)
        me = psutil.Process()
        path = paths.leases / f"{me.pid}-{_created(me)}-{next(_lease_numbers)}"
        info = {"pid": me.pid, "since": _now_iso(), "command": " ".join(sys.argv[:8])}
        write_json_atomic(path, info)
        return cls(path)

    def release(self) -> None:
        self.path.unlink(missing_ok=True)


def live_leases(paths: Paths, *, prune: bool = True) -> list[dict]:
    """The leases whose process lives; those of dead processes are removed."""
    out = []
    try:
        names = sorted(os.listdir(paths.leases))
    except FileNotFoundError:
        return out
    for name in names:
        if name.startswith("."):
            continue
        pid, _, rest = name.partition("-")
        created = rest.rpartition("-")[0]
        if pid.isdigit() and _process(int(pid), created) is not None:
            info = read_json(paths.leases / name) or {}
            out.append({"pid": int(pid), "file": name, **info})
        elif prune:
            (paths.leases / name).unlink(missing_ok=True)
    return out


def _leases_touched(paths: Paths) -> float:
    """When a lease was last taken or given back (the folder's mtime, on the wall clock)."""
    try:
        return paths.leases.stat().st_mtime
    except OSError:
        return 0.0


# ------------------------------------------------------------------ the supervisor


def server_env(paths: Paths, port: int) -> dict[str, str]:
    """The resident server's environment: none of the command's PREFECT_* settings (its
    API URL, its console log levels), the home's Prefect home and database, a UI that
    asks this port for its API."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(
        PREFECT_HOME=str(paths.root),
        PREFECT_API_DATABASE_CONNECTION_URL=f"sqlite+aiosqlite:///{paths.db}",
        PREFECT_UI_API_URL=f"http://{HOST}:{port}/api",
        # Copied and rewritten on the first start: here, not in the installed package.
        PREFECT_UI_STATIC_DIRECTORY=str(paths.root / "ui"),
        **SERVER_SETTINGS,
    )
    return env


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """The server gets SIGTERM should its supervisor die (Linux; elsewhere, a stale
    api.json's server is ended by the next command)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Supervisor:
    """Runs the server, writes its state, and stops it and itself when idle."""

    def __init__(self, paths: Paths, port: int, idle_s: float, start_s: float):
        self.paths, self.port, self.idle_s, self.start_s = paths, port, idle_s, start_s
        self.me = psutil.Process()
        self.server: subprocess.Popen | None = None
        self.stopping = False

    def _on_signal(self, signum, frame) -> None:  # noqa: ARG002
        self.stopping = True

    def update(self, **changes: Any) -> bool:
        """Merge `changes` into api.json if it names this supervisor (the command that
        started it writes it first: wait a little for that); False if it does not."""
        for _ in range(100):
            state = read_json(self.paths.api)
            if state is not None and state.get("pid") == self.me.pid:
                write_json_atomic(self.paths.api, {**state, **changes})
                return True
            if state is not None:
                return False  # replaced: another server is the home's now
            time.sleep(0.1)
        return False

    def forget(self) -> None:
        """Remove api.json if it still names this supervisor."""
        state = read_json(self.paths.api)
        if state is not None and state.get("pid") == self.me.pid:
            self.paths.api.unlink(missing_ok=True)

    def start_server(self) -> None:
        argv = [sys.executable, "-m", "prefect", "server", "start",
                "--host", HOST, "--port", str(self.port)]  # fmt: skip
        env = server_env(self.paths, self.port)
        if prefect_db.seed(env):  # a new home: its database a copy of a migrated empty one
            _log(f"{self.paths.db} made from {prefect_db.template_path()}")
        # Its own process group (a kill of the group ends what it started too).
        self.server = subprocess.Popen(
            argv, env=env, stdin=subprocess.DEVNULL,
            process_group=0, preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )  # fmt: skip
        url = f"http://{HOST}:{self.port}"
        try:
            created = _created(psutil.Process(self.server.pid))
        except psutil.Error:
            created = None  # exited already: wait_ready says so
        self.update(port=self.port, url=url + "/api", ui_url=url, server_pid=self.server.pid,
                    server_created=created)  # fmt: skip
        _log(f"started `prefect server start` (pid {self.server.pid}) on {url}")

    def stop_server(self) -> None:
        if self.server is None or self.server.poll() is not None:
            return
        # SIGTERM to the CLI, which stops uvicorn cleanly; then its group.
        self.server.terminate()
        try:
            self.server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.server.pid, signal.SIGKILL)
            self.server.wait(timeout=10)
        _log(f"server stopped ({self.server.returncode})")

    def wait_ready(self) -> bool:
        t0 = time.monotonic()
        retries = 3
        api = f"http://{HOST}:{self.port}/api"
        while not self.stopping:
            code = self.server.poll()
            if code is not None:
                # Another process took the port between its choice and the bind: again,
                # on another one (a quick exit; the log says "already in use").
                if retries and "already in use" in tail(self.paths.log, 5):
                    retries -= 1
                    self.port = _free_port()
                    _log(f"port taken; starting again on {self.port}")
                    self.start_server()
                    api = f"http://{HOST}:{self.port}/api"
                    continue
                _log(f"the server exited with {code} before it was ready")
                return False
            if healthy(api, timeout=2.0):
                took = time.monotonic() - t0
                self.update(state="ready", ready_at=_now_iso(), start_s=round(took, 2))
                _log(f"ready in {took:.1f} s at {api}")
                return True
            if time.monotonic() - t0 > self.start_s:
                _log(f"not ready within {self.start_s:.0f} s ({START_ENV})")
                return False
            time.sleep(0.25)
        return False

    def serve(self) -> int:
        """Until idle, a signal, or the server's exit: the exit code."""
        last_busy = time.time()
        poll_s = min(1.0, max(self.idle_s / 4, 0.2))
        unnamed = 0  # polls in a row that found api.json not naming this supervisor
        while True:
            if self.stopping:
                _log("stop requested")
                return 0
            code = self.server.poll()
            if code is not None:
                _log(f"the server exited with {code}")
                with _locked(self.paths, wait_s=30.0):  # body runs either way
                    self.forget()
                return 1
            state = read_json(self.paths.api)
            unnamed = unnamed + 1 if state is None or state.get("pid") != self.me.pid else 0
            if unnamed >= 3:
                # Its home was wiped (a test's, a benchmark's) or another server took it
                # over: no command can find this one any more.
                _log("api.json no longer names this server: stopping")
                return 0
            now = time.time()
            if live_leases(self.paths):
                last_busy = now
            last_busy = max(last_busy, _leases_touched(self.paths))
            if now - last_busy >= self.idle_s:
                # Under the lock, so no command takes a lease on a server that stops: it
                # finds no api.json once the lock is its, and starts another.
                with _locked(self.paths, wait_s=0) as had:
                    if had and not live_leases(self.paths):
                        _log(f"idle for {now - last_busy:.0f} s ({IDLE_ENV}={self.idle_s:g}): "
                             "stopping")  # fmt: skip
                        self.forget()
                        self.stop_server()
                        return 0
            time.sleep(poll_s)

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._on_signal)
        _log(f"supervising the local Prefect API of {self.paths.home} (idle timeout "
             f"{self.idle_s:g} s)")  # fmt: skip
        try:
            self.start_server()
            if not self.wait_ready():
                if not self.stopping:  # else whoever stops it holds the lock
                    with _locked(self.paths, wait_s=30.0):
                        self.forget()
                return 1
            return self.serve()
        finally:
            # Whatever ended it: the server does not outlive its supervisor.
            self.stop_server()
            self.forget()


# The command does not start the supervisor itself (it would be the command's child,
# which the command's reaper ends with it); a launcher starts it in a session of its
# own, prints its pid and exits, so init adopts it.
_LAUNCH = """
import subprocess, sys
log = open(sys.argv[1], "ab")
p = subprocess.Popen(sys.argv[2:], stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                     start_new_session=True)
print(p.pid, flush=True)
"""


def _launch_supervisor(paths: Paths, port: int, idle_s: float, start_s: float) -> int:
    paths.root.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(OSError):
        if paths.log.stat().st_size > 10 * 2**20:
            os.replace(paths.log, paths.log.with_suffix(".log.1"))
    # Its own limit on a start is a safety net, later than the command's: the command
    # that waits decides, and says why.
    argv = [sys.executable, "-m", "quantloop.tasks.runtime.local_api", "supervise",
            "--home", str(paths.home), "--port", str(port),
            "--idle-timeout", str(idle_s), "--start-timeout", str(start_s + 30)]  # fmt: skip
    # In the home's folder: the command's may be gone before the server is.
    out = subprocess.run(
        [sys.executable, "-c", _LAUNCH, str(paths.log), *argv], cwd=paths.root,
        capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    if out.returncode != 0 or not out.stdout.strip().isdigit():
        raise LocalApiError(f"could not start the local Prefect API's supervisor: "
                            f"{out.stderr.strip()[-2000:]}")  # fmt: skip
    return int(out.stdout.strip())


# ------------------------------------------------------------------ finding an API


def configured_api() -> tuple[str, str | None] | None:
    """(url, auth string) of a Prefect API this process is configured for, or None.

    With Prefect imported, its current settings (any source; a harness's temporary
    settings). Without, without importing it: PREFECT_API_URL in the environment, then
    the active profile of the profiles file (PREFECT_PROFILES_PATH, else
    $PREFECT_HOME/profiles.toml, else ~/.prefect/profiles.toml; PREFECT_PROFILE, else
    its `active`)."""
    if "prefect.settings" in sys.modules:
        from prefect.settings import get_current_settings

        api = get_current_settings().api
        if not api.url:
            return None
        auth = api.auth_string
        secret = auth.get_secret_value() if hasattr(auth, "get_secret_value") else auth
        return str(api.url), secret or None
    if url := os.environ.get("PREFECT_API_URL", "").strip():
        return url, os.environ.get("PREFECT_API_AUTH_STRING") or None
    import tomllib

    home = Path(os.path.expanduser(os.environ.get("PREFECT_HOME", "~/.prefect")))
    path = Path(os.path.expanduser(os.environ.get("PREFECT_PROFILES_PATH", "") or
                                   home / "profiles.toml"))  # fmt: skip
    try:
        profiles = tomllib.loads(path.read_text())
    except (OSError, ValueError):
        return None
    active = os.environ.get("PREFECT_PROFILE") or profiles.get("active") or "ephemeral"
    profile = (profiles.get("profiles") or {}).get(active) or {}
    if url := str(profile.get("PREFECT_API_URL") or "").strip():
        return url, profile.get("PREFECT_API_AUTH_STRING") or None
    return None


def serve_api(paths: Paths) -> tuple[str, str | None, str] | None:
    """(api url, auth string, ui url) of a running `quantloop serve` on this home."""
    stack = read_json(paths.stack)
    if not stack or _process(stack.get("pid"), stack.get("pid_created")) is None:
        return None
    auth = None
    if stack.get("auth"):
        auth = (read_json(paths.credentials) or {}).get("prefect_auth_string")
    url = stack.get("api_url")
    if not isinstance(url, str) or not healthy(url, auth):
        return None
    return url, auth, stack.get("ui_url") or url.removesuffix("/api")


def serve_mlflow(home: str | os.PathLike) -> tuple[str, bool] | None:
    """(MLflow URL, locked) of a running `quantloop serve` on this home, from its stack
    file: where a run on the served home records, so its artifacts are served
    (mlflow-artifacts:/, loadable from another host) and the server's permissions apply."""
    stack = read_json(Paths(Path(home)).stack)
    if not stack or _process(stack.get("pid"), stack.get("pid_created")) is None:
        return None
    url = stack.get("mlflow_url")
    return (url, bool(stack.get("auth"))) if isinstance(url, str) and url else None


@dataclasses.dataclass
class Api:
    """The API a command uses, and how it came to it."""

    kind: str  # "configured", "serve" or "resident"
    url: str
    how: str  # "configured", "serve", "resident: reused", "resident: started in 12.3 s"
    ui_url: str | None = None
    seconds: float = 0.0  # finding it, starting it included
    idle_timeout_s: float | None = None
    auth: str | None = dataclasses.field(default=None, repr=False)

    def line(self) -> str:
        """One line for the console."""
        if self.kind == "configured":
            return f"Prefect API: configured, {self.url}"
        if self.kind == "serve":
            return f"Prefect API: quantloop serve's, {self.url} (UI {self.ui_url})"
        idle = self.idle_timeout_s or 0
        stops = f"{idle / 60:g} min" if idle >= 60 else f"{idle:g} s"
        stops = f"stops after {stops} idle" if idle else "stops when no command uses it"
        return f"Prefect API: {self.how}; UI {self.ui_url} ({stops}; `quantloop api status`)"


@dataclasses.dataclass
class _Pending:
    """A resident server this command holds a lease on, maybe not ready yet."""

    paths: Paths
    lease: Lease
    state: dict
    started: bool  # by this command
    joined: bool  # another command's start, under way
    t0: float  # monotonic, when this command began to find it


def _acquire(paths: Paths, say: Callable[[str], None], start_s: float) -> _Pending:
    """Under the lock: the home's server (ready, or starting), or a new one; a lease."""
    t0 = time.monotonic()
    with _locked(paths, wait_s=start_s + 60, say=say) as had:
        if not had:
            raise LocalApiError(f"the local Prefect API's lock {paths.lock} was held for "
                                f"{start_s + 60:.0f} s")  # fmt: skip
        state = read_json(paths.api)
        if state is not None:
            sup = _process(state.get("pid"), state.get("pid_created"))
            if sup is not None and state.get("state") == "starting":
                return _Pending(paths, Lease.take(paths), state, False, True, t0)
            if sup is not None and state.get("state") == "ready":
                # Busy (a run writing to it on a loaded machine) is not dead: three tries.
                for attempt in range(3):
                    if healthy(state.get("url", ""), timeout=10.0):
                        return _Pending(paths, Lease.take(paths), state, False, False, t0)
                    time.sleep(1.0 + attempt)
                say(f"the local Prefect API at {state.get('url')} does not answer: replacing it")
            # Stale: a dead supervisor, or a server that does not answer.
            _end_server_of(state, grace_s=10.0)
            paths.api.unlink(missing_ok=True)
        lease = Lease.take(paths)
        try:
            idle_s, port = idle_timeout_s(), _free_port()
            first = not paths.db.exists()
            pid = _launch_supervisor(paths, port, idle_s, start_s)
            try:
                created = _created(psutil.Process(pid))
            except psutil.Error:
                raise LocalApiError(
                    f"the local Prefect API's supervisor exited at once; its "
                    f"log: {paths.log}\n{tail(paths.log)}"
                ) from None
            state = {
                "url": f"http://{HOST}:{port}/api", "ui_url": f"http://{HOST}:{port}",
                "port": port, "pid": pid, "pid_created": created, "server_pid": None,
                "state": "starting", "started_at": _now_iso(), "first_start": first,
                "idle_timeout_s": idle_s, "log": str(paths.log),
            }  # fmt: skip
            write_json_atomic(paths.api, state)
        except BaseException:
            lease.release()
            raise
        note = " (first start: creating its database)" if first else ""
        say(f"starting the local Prefect API{note} under {paths.root}")
        return _Pending(paths, lease, state, True, False, t0)


def _failed(paths: Paths, state: dict, why: str) -> LocalApiError:
    """Stop a start that failed (if api.json still names it) and say why, with the log."""
    with _locked(paths, wait_s=60.0):
        now = read_json(paths.api)
        if now is not None and now.get("pid") == state.get("pid"):
            _end_server_of(now, grace_s=10.0)
            paths.api.unlink(missing_ok=True)
    return LocalApiError(f"the local Prefect API did not start: {why}; its log: {paths.log}, "
                         f"last lines:\n{tail(paths.log)}")  # fmt: skip


def _wait_ready(pending: _Pending, say: Callable[[str], None], start_s: float) -> dict:
    """The state once its server answers; progress through `say` every ~10 s."""
    paths, state = pending.paths, pending.state
    note = " (first start: creating its database)" if state.get("first_start") else ""
    said = 0
    while True:
        now = read_json(paths.api)
        if now is None or now.get("pid") != state.get("pid"):
            raise _failed(paths, state, "its supervisor gave up (the server exited, or timed "
                                        "out)")  # fmt: skip
        state = pending.state = now
        if now.get("state") == "ready" and healthy(now["url"], timeout=10.0):
            return now
        if _process(now.get("pid"), now.get("pid_created")) is None:
            raise _failed(paths, now, "its supervisor exited")
        waited = time.monotonic() - pending.t0
        if waited > start_s:
            raise _failed(paths, now, f"no answer within {start_s:.0f} s ({START_ENV})")
        if waited >= (said + 1) * PROGRESS_EVERY_S:
            said = int(waited // PROGRESS_EVERY_S)
            say(f"starting the local Prefect API{note} ... {waited:.0f} s")
        time.sleep(0.25)


class ApiHandle:
    """What `using_api` yields: the API (`ready()` waits for it and gives its `Api`)."""

    def __init__(self, home, say, timeline, start_s: float):
        self.paths = paths_of(home)
        self.say, self.timeline, self.start_s = say, timeline, start_s
        self.api: Api | None = None
        self.pending: _Pending | None = None
        self._undo: list[Callable[[], None]] = []
        self._env_saved: dict[str, str | None] = {}
        self._pointed_at: tuple[str, str | None] | None = None

    def _phase(self, name: str):
        return self.timeline.phase(name) if self.timeline is not None else contextlib.nullcontext()

    def find(self) -> None:
        """The configured API or serve's (ready), or the resident one: found or started,
        leased, and Prefect pointed at it; ready() waits for its start."""
        t0 = time.monotonic()
        with self._phase("api"):
            if found := configured_api():
                self.api = Api("configured", found[0], "configured", auth=found[1],
                               seconds=time.monotonic() - t0)  # fmt: skip
                return
            if found := serve_api(self.paths):
                url, auth, ui = found
                self.api = Api("serve", url, "serve", ui_url=ui, auth=auth,
                               seconds=time.monotonic() - t0)  # fmt: skip
                self._point(url, auth)
                return
            self.pending = _acquire(self.paths, self.say, self.start_s)
            # Pointed now, before Prefect is imported, so its settings read it from the
            # environment; ready() points again should the server move to another port.
            self._point(self.pending.state["url"], None)

    def ready(self) -> Api:
        """Wait for the API (a resident server's start) and give it."""
        if self.api is not None:
            return self.api
        pending = self.pending
        with self._phase("api (wait)" if pending.started else "api (reuse)"):
            state = _wait_ready(pending, self.say, self.start_s)
        took = time.monotonic() - pending.t0
        if pending.started:
            how = f"resident: started in {took:.1f} s"
        elif pending.joined:
            how = f"resident: joined another command's start, ready in {took:.1f} s"
        else:
            how = "resident: reused"
        self.api = Api("resident", state["url"], how, ui_url=state.get("ui_url"),
                       seconds=took, idle_timeout_s=state.get("idle_timeout_s"))  # fmt: skip
        if self._pointed_at != (state["url"], None):
            self._point(state["url"], None)
        return self.api

    def _point(self, url: str, auth: str | None) -> None:
        """Prefect's API: the environment (this process's Prefect, when imported later,
        and its children), and, when Prefect is imported already, its settings."""
        from quantloop.tasks.runtime.prefect_settings import plain_http_tls

        self._unpoint()
        values = {"PREFECT_API_URL": url}
        if auth:
            values["PREFECT_API_AUTH_STRING"] = auth
        values |= plain_http_tls(url)  # the clients' TLS context: 45 ms -> 0.7 ms each
        for k, v in values.items():
            self._env_saved.setdefault(k, os.environ.get(k))
            os.environ[k] = v
        self._pointed_at = (url, auth)
        if "prefect.settings" in sys.modules:
            import prefect.context
            from pydantic import SecretStr

            from quantloop.tasks.runtime.prefect_settings import overridden

            updates: dict[str, object] = {"api.url": url}
            if auth:
                updates["api.auth_string"] = SecretStr(auth)
            if cert := values.get("PREFECT_API_SSL_CERT_FILE"):
                updates["api.ssl_cert_file"] = cert
            # The global settings too: threads that do not carry this context (Prefect's
            # event and log workers) read those.
            prefect.context.refresh_global_settings_context()
            cm = overridden(updates)
            cm.__enter__()
            self._undo.append(lambda: cm.__exit__(None, None, None))

    def _unpoint(self) -> None:
        while self._undo:
            self._undo.pop()()
        for k, v in self._env_saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if self._env_saved and "prefect.context" in sys.modules:
            import prefect.context

            prefect.context.refresh_global_settings_context()
        self._env_saved = {}
        self._pointed_at = None

    def close(self) -> None:
        try:
            if self._env_saved:
                _drain_prefect()
            self._unpoint()
        finally:
            if self.pending is not None:
                self.pending.lease.release()


def _drain_prefect(timeout: float = 30.0) -> None:
    """Send what Prefect's event and log workers still hold (task-run states travel as
    events) before the lease goes: a server idle at once (QUANTLOOP_API_IDLE_TIMEOUT_S=0)
    would otherwise stop before the process's exit sends them."""
    workers = []
    if "prefect.events.worker" in sys.modules:
        workers.append(sys.modules["prefect.events.worker"].EventsWorker)
    if "prefect.logging.handlers" in sys.modules:
        workers.append(sys.modules["prefect.logging.handlers"].APILogWorker)
    for worker in workers:
        with contextlib.suppress(Exception):
            worker.drain_all(timeout=timeout, at_exit=False)


@contextlib.contextmanager
def using_api(
    home: str | os.PathLike,
    *,
    say: Callable[[str], None] = print,
    timeline: Any = None,
    wait: bool = True,
) -> Iterator[ApiHandle]:
    """Inside the block, Prefect uses an API (configured, serve's or the resident one)
    and, if resident, this command holds a lease on it. With `wait`, the block starts
    once it is ready (`handle.api`); without, call `handle.ready()` before the first flow
    (and import Prefect meanwhile: a start overlaps the imports). `timeline`: a
    tasks.runtime.timeline.Timeline whose phases "api" (and "api (wait)") record it."""
    start_s = start_timeout_s()
    # No path in this process falls back to Prefect's own 20 s.
    os.environ.setdefault(EPHEMERAL_TIMEOUT_ENV, f"{start_s:g}")
    handle = ApiHandle(home, say, timeline, start_s)
    try:
        handle.find()
        if wait:
            handle.ready()
        yield handle
    finally:
        handle.close()


# ------------------------------------------------------------------ operator's view


def status(home: str | os.PathLike) -> dict:
    """The resident server of `home`: where, its processes, leases, idle time."""
    paths = paths_of(home)
    state = read_json(paths.api)
    out: dict[str, Any] = {"home": str(paths.home), "root": str(paths.root),
                           "log": str(paths.log), "database": str(paths.db)}  # fmt: skip
    if found := configured_api():
        out["configured"] = found[0]
    if found := serve_api(paths):
        out["serve"] = found[0]
    if state is None:
        return {**out, "running": False}
    sup = _process(state.get("pid"), state.get("pid_created"))
    leases = live_leases(paths, prune=False)
    now = time.time()
    info = {
        **out,
        **{k: state.get(k) for k in ("url", "ui_url", "port", "pid", "server_pid", "state",
                                     "started_at", "ready_at", "start_s", "idle_timeout_s")},
        "running": sup is not None,
        "answers": sup is not None and healthy(state.get("url", ""), timeout=5.0),
        "leases": leases,
    }  # fmt: skip
    if sup is not None and not leases and state.get("state") == "ready":
        ready = state.get("ready_at")
        since = datetime.datetime.fromisoformat(ready).timestamp() if ready else now
        info["idle_s"] = round(now - max(since, _leases_touched(paths)), 1)
    return info


def stop(home: str | os.PathLike, *, grace_s: float = 30.0) -> dict:
    """Stop the resident server of `home` now (leases or not): what it stopped."""
    paths = paths_of(home)
    with _locked(paths, wait_s=120.0) as had:
        if not had:
            raise LocalApiError(f"the local Prefect API's lock {paths.lock} is held")
        state = read_json(paths.api)
        if state is None:
            return {"stopped": False}
        leases = live_leases(paths)
        paths.api.unlink(missing_ok=True)
        _end_server_of(state, grace_s=grace_s)
    return {"stopped": True, "pid": state.get("pid"), "server_pid": state.get("server_pid"),
            "url": state.get("url"), "leases": leases}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m quantloop.tasks.runtime.local_api")
    sub = parser.add_subparsers(dest="what", required=True)
    sup = sub.add_parser("supervise", help="run the resident server (what a command starts)")
    sup.add_argument("--home", required=True)
    sup.add_argument("--port", type=int, required=True)
    sup.add_argument("--idle-timeout", type=float, default=IDLE_DEFAULT_S)
    sup.add_argument("--start-timeout", type=float, default=START_DEFAULT_S)
    args = parser.parse_args(argv)
    supervisor = Supervisor(paths_of(args.home), args.port, args.idle_timeout, args.start_timeout)
    return supervisor.run()


if __name__ == "__main__":
    sys.exit(main())
