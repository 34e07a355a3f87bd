"""Real servers on loopback: MLflow tracking, an S3 endpoint (moto), a Prefect server and
a Prefect process worker. The tests and the benchmarks start them from here."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from distributed.diagnostics.plugin import SchedulerPlugin

from quantloop.tasks.records import mlflow_db
from quantloop.tasks.runtime import prefect_db


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server for {url} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status < 500:
                    return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"{url} did not answer within {timeout} s")


class MlflowServer:
    """`mlflow server` on a free loopback port with a SQLite store, started and not yet
    waited for: `ready()` waits until it answers and gives its URI, `stop()` ends it.
    (mlflow_server() below does both around a block; the session's server starts here
    early, so that its ~10 s start overlaps the tests before the first that needs it.)

    With credentials (user, password: 12 characters or more), MLflow's basic-auth app
    runs in front of it: every request needs them, that user is its admin; its settings
    are `quantloop serve`'s (quantloop.serve.MLFLOW_AUTH_INI) unless auth_ini gives
    others. A given port (and folder) restarts a stopped server on its store.
    """

    def __init__(
        self,
        folder: Path,
        credentials: tuple[str, str] | None = None,
        port: int | None = None,
        auth_ini: str | None = None,
    ):
        port = port or free_port()
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        auth = []
        if credentials is not None:
            user, password = credentials
            ini = folder / "auth.ini"
            from quantloop.serve import MLFLOW_AUTH_INI  # the one `quantloop serve` writes

            ini.write_text((auth_ini or MLFLOW_AUTH_INI).format(db=folder / "auth.db", user=user))
            env.update(MLFLOW_AUTH_CONFIG_PATH=str(ini), MLFLOW_AUTH_ADMIN_PASSWORD=password,
                       MLFLOW_FLASK_SERVER_SECRET_KEY=os.urandom(16).hex())  # fmt: skip
            auth = ["--app-name", "basic-auth"]
        self.uri = f"http://127.0.0.1:{port}"
        store = f"sqlite:///{folder / 'mlflow.db'}"
        mlflow_db.seed(store)  # as `quantloop serve` starts its server
        self._log = open(folder / "mlflow-server.log", "ab")
        self.proc = subprocess.Popen(
            [
                sys.executable, "-m", "mlflow", "server", *auth,
                "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
                "--backend-store-uri", store,
                "--artifacts-destination", str(folder / "artifacts"),
            ],
            stdout=self._log, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip

    def ready(self, timeout: float = 300) -> str:
        wait_http(f"{self.uri}/health", timeout=timeout, proc=self.proc)
        return self.uri

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._log.close()


@contextlib.contextmanager
def mlflow_server(
    folder: Path,
    credentials: tuple[str, str] | None = None,
    port: int | None = None,
    auth_ini: str | None = None,
) -> Iterator[str]:
    """`mlflow server` (MlflowServer's) around a block, once it answers; yields its URI."""
    server = MlflowServer(folder, credentials, port, auth_ini)
    try:
        yield server.ready()
    finally:
        server.stop()


@contextlib.contextmanager
def s3_server() -> Iterator[str]:
    """moto's standalone S3 server on a free loopback port; yields the endpoint URL."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


def _stop(proc: subprocess.Popen, timeout: float = 20) -> None:
    """Terminate, wait, kill if it does not go; never leaves a zombie behind."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=timeout)


def prefect_env(home: Path, **settings: str) -> dict[str, str]:
    """This process's environment without its PREFECT_* settings, plus `settings`.

    A subprocess then reads no profile or API URL of the developer's, only ours.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(
        PREFECT_HOME=str(home),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_SERVER_UI_ENABLED="false",
        # a temporary server, should one start, is waited for as the tests' own servers
        # are (Prefect's default gives up after 20 s, short of a start on a busy machine)
        PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="300",
        **settings,
    )
    return env


@contextlib.contextmanager
def prefect_server(
    folder: Path,
    timeout: float = 120,
    auth_string: str | None = None,
    port: int | None = None,
    database: str | None = None,
) -> Iterator[str]:
    """`prefect server start` on a free loopback port, SQLite under `folder`; yields the API URL.
    With `auth_string` ("user:password") every API request must carry it. A given port
    (and folder) restarts a stopped server on its database. `database`: a PostgreSQL
    database for its store instead (postgresql+asyncpg://...), as a desk runs it.

    Its start takes 15-30 s on SQLite (migrations, services), ~4 s on PostgreSQL here;
    the log is `folder/prefect-server.log`.
    """
    folder.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    env = prefect_env(
        folder / "server-home",
        PREFECT_API_DATABASE_CONNECTION_URL=database
        or f"sqlite+aiosqlite:///{folder / 'prefect.db'}",
        **({"PREFECT_SERVER_API_AUTH_STRING": auth_string} if auth_string else {}),
    )
    prefect_db.seed(env)  # as the resident API and `quantloop serve` start theirs
    log = open(folder / "prefect-server.log", "ab")
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "prefect", "server", "start",
            "--host", "127.0.0.1", "--port", str(port), "--no-ui", "--analytics-off",
        ],
        stdout=log, stderr=subprocess.STDOUT, env=env,
    )  # fmt: skip
    api = f"http://127.0.0.1:{port}/api"
    try:
        wait_http(f"{api}/health", timeout=timeout, proc=proc)
        yield api
    finally:
        drain_prefect_senders()  # while the server they may send to is still up
        _stop(proc)
        log.close()


def drain_prefect_senders(timeout: float = 30) -> None:
    """Send, and end, what this process's Prefect event and log senders still hold.

    Each sender is made for the API it first sent to and lives on after that server
    stops; the session's `prefect_test_harness` drains every sender at its end and
    waits, without a limit, for one that retries a server gone since. Here a flow run
    in-process against a server of a module's own, then the harness's end: 78 s; a
    worker that ran test_hosts (its desk runs flows in-process) was still in that drain
    more than 10 min after its last test began (2026-12-03). Drained while their server
    is up, they end at once; the next sender is made anew for whichever API is set."""
    if "prefect.events.worker" in sys.modules:
        from prefect.events.worker import EventsWorker

        EventsWorker.drain_all(timeout=timeout)
    if "prefect.logging.handlers" in sys.modules:
        from prefect.logging.handlers import APILogWorker

        APILogWorker.drain_all(timeout=timeout)


@contextlib.contextmanager
def prefect_worker(
    api_url: str,
    pool: str,
    folder: Path,
    env: dict[str, str] | None = None,
    args: tuple[str, ...] = (),
    name: str | None = None,
    prewarm: bool = True,
) -> Iterator[subprocess.Popen]:
    """`prefect worker start --type process` polling `pool` every second; yields the process.
    With `prewarm`, the warm process its flow runs use is started beside it, as `quantloop
    serve` starts its worker's (its first run then does not import everything itself
    while that process imports the same beside it).

    Flow runs it picks up run as its child processes and inherit its environment
    (`env` adds to it, and replaces what it names, HOME or TMPDIR included); the log,
    flow runs' output included, is `folder/prefect-worker.log`. `name`: the worker's name
    in the pool (default `<pool>-test-worker`; workers of one pool need their own).
    """
    folder.mkdir(parents=True, exist_ok=True)
    worker_env = prefect_env(
        folder / "worker-home",
        PREFECT_API_URL=api_url,
        PREFECT_WORKER_QUERY_SECONDS="1",
        PREFECT_WORKER_HEARTBEAT_SECONDS="5",
        # Flow runs as an operator's worker runs them (infra/prefect.yaml: `quantloop
        # engine`, found on PATH, in a warm process of this worker's environment), the
        # warm process gone soon after the test (and ended below).
        PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]),
        QUANTLOOP_FORKSERVER="1",
        QUANTLOOP_FORKSERVER_IDLE_S="120",
        **(env or {}),
    )
    log = open(folder / "prefect-worker.log", "wb")
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "prefect", "worker", "start",
            "--pool", pool, "--type", "process", "--name", name or f"{pool}-test-worker", *args,
        ],
        stdout=log, stderr=subprocess.STDOUT, env=worker_env,
    )  # fmt: skip
    # its environment, for a test (a worker's /proc/<pid>/environ reads empty: Prefect
    # writes its process title over it)
    proc.env = worker_env
    if prewarm:  # `quantloop engine --warm` in the worker's environment
        subprocess.run([sys.executable, "-m", "quantloop.forkserver", "--flow-runs"],
                       env=worker_env, stdout=log, stderr=subprocess.STDOUT, timeout=300,
                       check=True)  # fmt: skip
    try:
        yield proc
    finally:
        # SIGTERM lets the worker cancel its own flow-run processes before it exits.
        _stop(proc, timeout=30)
        end_warm_processes(worker_env["PREFECT_HOME"])
        log.close()


def end_warm_processes(prefect_home: str) -> None:
    """End the warm processes (quantloop/forkserver.py) that flow runs of a worker with
    this PREFECT_HOME started, with what they forked."""
    import psutil

    found = []
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if (p.environ().get("PREFECT_HOME") == prefect_home
                    and "quantloop.forkserver" in " ".join(p.cmdline())):  # fmt: skip
                found.append(p)
    for p in found:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(found, timeout=10)


class FlakyProxy:
    """An HTTP proxy in front of a server that fails some requests on purpose: every
    `slow_down_every`-th gets S3's throttling answer (503 SlowDown), every
    `drop_every`-th has its connection closed with no answer, every `delay_every`-th
    waits `delay_s` first. Counts what it did, so a test can show the faults happened."""

    SLOW_DOWN = (
        b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
        b"<Message>Please reduce your request rate.</Message></Error>"
    )

    def __init__(self, target: str, *, slow_down_every: int = 0, drop_every: int = 0,
                 delay_every: int = 0, delay_s: float = 1.0):  # fmt: skip
        import http.client
        import http.server
        import threading
        import urllib.parse

        self.target = urllib.parse.urlsplit(target)
        self.slow_down_every, self.drop_every = slow_down_every, drop_every
        self.delay_every, self.delay_s = delay_every, delay_s
        self.requests = self.slowed = self.dropped = self.delayed = self.forwarded = 0
        self._lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _handle(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with proxy._lock:
                    proxy.requests += 1
                    n = proxy.requests
                if proxy.drop_every and n % proxy.drop_every == 0:
                    with proxy._lock:
                        proxy.dropped += 1
                    self.close_connection = True
                    self.connection.shutdown(2)  # no answer at all
                    return
                if proxy.slow_down_every and n % proxy.slow_down_every == 0:
                    with proxy._lock:
                        proxy.slowed += 1
                    self.send_response(503)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(proxy.SLOW_DOWN)))
                    self.end_headers()
                    self.wfile.write(proxy.SLOW_DOWN)
                    return
                if proxy.delay_every and n % proxy.delay_every == 0:
                    with proxy._lock:
                        proxy.delayed += 1
                    time.sleep(proxy.delay_s)
                upstream = http.client.HTTPConnection(proxy.target.hostname, proxy.target.port,
                                                      timeout=60)  # fmt: skip
                headers = {k: v for k, v in self.headers.items() if k.lower() != "connection"}
                upstream.request(self.command, self.path, body=body or None, headers=headers)
                answer = upstream.getresponse()
                data = answer.read()
                self.send_response(answer.status, answer.reason)
                for k, v in answer.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                upstream.close()
                with proxy._lock:
                    proxy.forwarded += 1

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> FlakyProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()


@contextlib.contextmanager
def dask_site(
    folder: Path, *, workers: int = 1, resources: str | None = None,
    env: dict[str, str] | None = None, timeout: float = 60,
) -> Iterator[str]:  # fmt: skip
    """A site's own Dask cluster as an operator runs it: `dask scheduler` and `dask worker`
    processes on loopback (the worker declaring `resources`, e.g. "GPU=1"); yields the
    scheduler's address once its workers have joined. Logs: folder/dask-*.log."""
    from distributed import Client

    folder.mkdir(parents=True, exist_ok=True)
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    run_env = {**os.environ, **(env or {})}
    logs = [open(folder / f"dask-{role}.log", "ab") for role in ("scheduler", "worker")]
    procs = [subprocess.Popen(
        [sys.executable, "-m", "dask", "scheduler", "--host", "127.0.0.1", "--port", str(port),
         "--no-dashboard"],
        stdout=logs[0], stderr=subprocess.STDOUT, env=run_env,
    )]  # fmt: skip
    try:
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "dask", "worker", address, "--nworkers", str(workers),
             "--nthreads", "1", "--memory-limit", "0", "--no-dashboard",
             "--local-directory", str(folder / "worker"),
             *(["--resources", resources] if resources else []),
             "--preload", "quantloop.tasks.engine.batch",
             "--preload", "quantloop.tasks.research.features"],
            stdout=logs[1], stderr=subprocess.STDOUT, env=run_env,
        ))  # fmt: skip
        client = Client(address, timeout=f"{timeout}s")
        try:
            client.wait_for_workers(workers, timeout=timeout)
        finally:
            client.close()
        yield address
    finally:
        for proc in reversed(procs):
            _stop(proc)
        for log in logs:
            log.close()


class KillWorkerGiven(SchedulerPlugin):
    """A Dask scheduler plugin: SIGKILLs the worker process that the scheduler gives a
    task of `prefix` to, as it is given (before the worker has it), the first `times`
    times: a worker lost mid-run, at a known moment. `killed`: those workers' pids."""

    name = "kill-worker-given"

    def __init__(self, prefix: str, times: int = 1):
        self.prefix, self.times = prefix, times
        self.killed: list[int] = []
        self.scheduler = None

    async def start(self, scheduler) -> None:
        self.scheduler = scheduler

    def transition(self, key, start, finish, *args, **kwargs) -> None:
        from dask.utils import key_split

        if len(self.killed) >= self.times or finish != "processing":
            return
        worker = self.scheduler.tasks[key].processing_on
        if key_split(key) == self.prefix and worker is not None and worker.pid:
            self.killed.append(worker.pid)
            os.kill(worker.pid, signal.SIGKILL)


class KillSiteGiven(KillWorkerGiven):
    """A Dask scheduler plugin: as the scheduler gives the first task of `prefix` to a
    worker, SIGKILLs every worker of the site and its nanny (the `dask worker` process
    that would start another): the site has no workers until an operator starts some.
    `at`: the time.time() of the kill; `killed`: the pids."""

    name = "kill-site-given"

    def __init__(self, prefix: str):
        super().__init__(prefix, 1)
        self.at = 0.0

    def transition(self, key, start, finish, *args, **kwargs) -> None:
        import psutil
        from dask.utils import key_split

        if self.killed or finish != "processing" or key_split(key) != self.prefix:
            return
        self.at = time.time()
        for worker in list(self.scheduler.workers.values()):
            nanny = psutil.Process(worker.pid).parent()
            # only a `dask worker` process: never whatever else a worker's parent may be
            if nanny is not None and "worker" in nanny.cmdline():
                self.killed.append(nanny.pid)
                os.kill(nanny.pid, signal.SIGKILL)
            self.killed.append(worker.pid)
            os.kill(worker.pid, signal.SIGKILL)


def postgres_bin() -> Path | None:
    """The newest installed PostgreSQL's bin folder (Debian keeps them versioned under
    /usr/lib/postgresql, off PATH), or one whose initdb is on PATH; None if none is."""
    import shutil

    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"),
                   key=lambda p: int(p.parent.parent.name) if p.parent.parent.name.isdigit()
                   else 0)  # fmt: skip
    if found:
        return found[-1].parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


class PostgresServer:
    """A real PostgreSQL server for a test session: `initdb` in `folder`, `pg_ctl start` on
    a free loopback port, its unix socket in `folder` (never /var/run/postgresql), trust
    authentication on loopback and that socket only: no password, and nothing listens
    beyond 127.0.0.1. `url(db)` names a database as clients reach it; `create_database`
    makes one; `stop()` is `pg_ctl stop -m fast`.

    PostgreSQL refuses to run as root: as root the server runs as the `postgres` user
    (Debian's package makes it), which owns the data folder; the folders above it are
    opened to it for traversal. initdb took 1.4 s here, the start 0.3 s.
    """

    USER = "quantloop"  # the cluster's superuser, a role of its own (not the OS user's name)

    def __init__(self, folder: Path, bin_dir: Path):
        self.folder, self.bin = folder, bin_dir
        self.data, self.sockets = folder / "data", folder / "sockets"
        self.log = folder / "postgres.log"
        self.port = free_port()
        self.as_postgres: list[str] = []
        folder.mkdir(parents=True, exist_ok=True)
        if os.geteuid() == 0:
            import shutil

            runuser = shutil.which("runuser")
            self.as_postgres = [runuser, "-u", "postgres", "--"] if runuser else []
            # Whoever the tests run as reaches the socket; postgres reaches its folders.
            for p in (folder, *folder.parents):
                if p.stat().st_mode & 0o001 == 0:
                    p.chmod(p.stat().st_mode | 0o001)
        self.sockets.mkdir(parents=True)
        self.sockets.chmod(0o777)
        if self.as_postgres:
            import shutil

            shutil.chown(folder, "postgres")
            self.log.touch()
            shutil.chown(self.log, "postgres")
        self._run("initdb", "-D", str(self.data), "-U", self.USER, "-A", "trust",
                  "-E", "UTF8", "--locale", "C", "--no-sync")  # fmt: skip
        # initdb's trust covers local sockets and loopback; listen on loopback only.
        options = (f"-c listen_addresses=127.0.0.1 -c port={self.port} "
                   f"-c unix_socket_directories={self.sockets} -c fsync=off "
                   "-c full_page_writes=off -c synchronous_commit=off")  # fmt: skip
        self._run("pg_ctl", "start", "-D", str(self.data), "-l", str(self.log), "-w",
                  "-t", "60", "-o", options)  # fmt: skip

    def _run(self, tool: str, *args: str) -> str:
        done = subprocess.run([*self.as_postgres, str(self.bin / tool), *args],
                              capture_output=True, text=True, cwd=self.folder)  # fmt: skip
        if done.returncode != 0:
            log = self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""
            raise RuntimeError(f"{tool} {' '.join(args)} exited {done.returncode}:\n"
                               f"{done.stdout}{done.stderr}{log}")  # fmt: skip
        return done.stdout

    def url(self, database: str = "postgres", user: str | None = None,
            password: str | None = None) -> str:  # fmt: skip
        login = user or self.USER
        if password is not None:
            import urllib.parse

            login += ":" + urllib.parse.quote(password, safe="")
        return f"postgresql://{login}@127.0.0.1:{self.port}/{database}"

    def sql(self, statement: str, database: str = "postgres") -> list[tuple]:
        """Run one statement as the superuser (autocommit: CREATE DATABASE needs it)."""
        import psycopg2

        conn = psycopg2.connect(self.url(database))
        try:
            conn.autocommit = True
            with conn.cursor() as cur:
                cur.execute(statement)
                return cur.fetchall() if cur.description else []
        finally:
            conn.close()

    def create_database(self, name: str, owner: str | None = None) -> str:
        self.sql(f'CREATE DATABASE "{name}"' + (f' OWNER "{owner}"' if owner else ""))
        return self.url(name)

    def stop(self) -> None:
        if (self.data / "postmaster.pid").exists():
            self._run("pg_ctl", "stop", "-D", str(self.data), "-m", "fast", "-w")


@contextlib.contextmanager
def postgres_server(folder: Path) -> Iterator[PostgresServer]:
    """PostgresServer around a block, stopped on the way out. Without PostgreSQL's
    binaries the test fails saying how to install them (`bash infra/install.sh --dev`
    does, as root); outside CI (no CI=true), QUANTLOOP_SKIP_POSTGRES=1 skips it instead."""
    import pytest

    bin_dir = postgres_bin()
    if bin_dir is None:
        why = ("no PostgreSQL server binaries (initdb) under /usr/lib/postgresql or on PATH: "
               "`bash infra/install.sh --dev` installs Debian's postgresql (as root), "
               "or `apt-get install postgresql`")  # fmt: skip
        if os.environ.get("QUANTLOOP_SKIP_POSTGRES") == "1" and not os.environ.get("CI"):
            pytest.skip(why)
        pytest.fail(why)
    server = PostgresServer(folder, bin_dir)
    try:
        yield server
    finally:
        server.stop()
