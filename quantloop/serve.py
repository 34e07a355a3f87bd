"""`quantloop serve`: the stack a researcher needs on one machine.

A Prefect server with its UI, an MLflow server over the workspace's stores, and a
process worker on a local pool with the deployments of infra/prefect.yaml applied,
all under one home folder that needs no root:

    <home>/                    the workspace (catalog, node store, mlflow.db, mlartifacts):
                               what `quantloop run --home <home>` uses too
    <home>/serve/prefect/      Prefect's home, its SQLite database, the UI's static files
    <home>/serve/worker/       the worker's Prefect home
    <home>/serve/logs/         prefect-server.log, mlflow-server.log, prefect-worker.log
    <home>/serve/stack.json    while it runs: where its Prefect API is, so `quantloop run`
                               and the other commands on this home record their runs there

Every process runs in a session of its own, so Ctrl-C reaches only `serve`, which
supervises them (quantloop/supervisor.py): a service that dies is started again (a
bounded number of times, each said); a stop ends the worker first, marks the runs it was
running Cancelled in Prefect and KILLED in MLflow (quantloop/orphans.py), then the
servers, each with its whole process tree. A watcher ends them if `serve` itself is
killed (tasks/runtime/reaper.py), and the next start ends what is left of such a stack
and closes its runs. Ports are checked before anything starts. A second start finds
the same database, stores and static files.

The servers are locked: Prefect with an API auth string (its clients, the worker and
this process send it; its UI asks for it once and keeps it), MLflow behind its
basic-auth app. The credentials are made on the first start, kept in
<home>/serve/credentials.json (readable by its owner only) and reused; a request
without them gets 401. MLflow has three identities (quantloop/identities.py): serve's
admin, the researchers' and the promoter's; the deployments' flow runs record through
the server (artifacts as mlflow-artifacts:/ URIs another host can load), research,
retrain and backtest as the researcher, promote as the promoter, so only the promote
flow can change the guarded registered model that carries `champion`. `--no-auth`
serves without it (runs then record to the workspace's store directly).
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import datetime
import json
import os
import secrets
import signal
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil

from quantloop.database import SERVERS, ServerDatabases
from quantloop.deploy import (
    PREFECT_YAML,
    REPO_ROOT,
    apply,
    asks_for_cuda,
    for_stack,
    read_deployments,
    read_queues,
)
from quantloop.identities import PROMOTER, RESEARCHER, Credentials
from quantloop.supervisor import (
    MAX_RESTARTS,
    RESTART_WINDOW_S,
    Service,
    check_ports,
    describe,
    end_processes,
    leftovers,
    live_stack_on,
    stack_tag,
    tagged,
    tail,
    wait_ready,
)
from quantloop.tasks.records import mlflow_db
from quantloop.tasks.runtime import prefect_db
from quantloop.tasks.runtime.prefect_settings import plain_http_tls

WORKER_NAME = "quantloop-serve"
WORKER_SERVICE = "prefect worker"  # its Service's name


# auth_cache_ttl_seconds: MLflow checks the password hash (scrypt, ~0.1 s of CPU here) on
# every request unless a good check is cached; uncached, each API call of a run took
# 250-330 ms on a 2-core VM against ~70 ms with the cache (a research run's ~90 calls: 22 s).
# MLflow leaves it off because each worker process caches on its own; this server runs one
# worker (--workers 1), where a password change through the API drops the entry at once.
MLFLOW_AUTH_INI = """[mlflow]
default_permission = READ
database_uri = sqlite:///{db}
admin_username = {user}
authorization_function = mlflow.server.auth:authenticate_request_basic_auth
grant_default_workspace_access = false
auth_cache_ttl_seconds = 300
"""


@dataclasses.dataclass(frozen=True, kw_only=True)
class StackConfig:
    """Where the stack lives and listens."""

    home: Path
    host: str = "127.0.0.1"
    prefect_port: int = 4200
    mlflow_port: int = 5000
    pool: str = "quantloop-local"
    prefect_file: Path = PREFECT_YAML
    checkout: Path = REPO_ROOT
    auth: bool = True
    database: str | None = dataclasses.field(default=None, repr=False)
    """A PostgreSQL server for both servers' stores (postgresql://USER:PASSWORD@HOST:PORT/NAME:
    databases NAME_prefect, NAME_mlflow, NAME_mlflow_auth, quantloop/database.py); None:
    SQLite files under home. Kept out of repr: it holds a password."""

    @property
    def databases(self) -> ServerDatabases | None:
        return ServerDatabases(self.database) if self.database else None

    @property
    def state(self) -> Path:
        return self.home / "serve"

    @property
    def logs(self) -> Path:
        return self.state / "logs"

    @property
    def stack_file(self) -> Path:
        """Where a running stack says where its Prefect API is (its PID, its URL, whether
        it is locked), so `quantloop run` on the same home records its runs there
        (tasks/runtime/local_api.py); removed before the stack stops."""
        return self.state / "stack.json"

    @property
    def prefect_url(self) -> str:
        return f"http://{self.host}:{self.prefect_port}"

    @property
    def api_url(self) -> str:
        return f"{self.prefect_url}/api"

    @property
    def mlflow_url(self) -> str:
        return f"http://{self.host}:{self.mlflow_port}"

    @property
    def mlflow_store(self) -> str:
        """The MLflow server's store: the workspace's (what embedded runs on this home
        write), or its database on PostgreSQL with --database."""
        if dbs := self.databases:
            return dbs.mlflow
        return "sqlite:///" + str(self.home / "mlflow.db")

    def credentials(self) -> Credentials | None:
        """The stack's credentials (made on its first start, then reused; a file of the
        one-user form upgraded): quantloop/identities.py. None with auth off."""
        if not self.auth:
            return None
        from quantloop import identities

        return identities.load(self.state / "credentials.json")

    def workspace(self, role: str = RESEARCHER) -> dict:
        """The workspace the deployments get: embedded defaults under home, recording
        through this stack's MLflow server as `role` (a saved tracking block serve writes:
        quantloop/identities.py) when it is locked; the embedded store without auth."""
        from quantloop import identities

        if not self.auth:
            # On PostgreSQL the runs record through the (open) server: its store's URL
            # holds a password, which deployment parameters must not.
            return {"home": str(self.home), **({"tracking_uri": self.mlflow_url}
                                               if self.database else {})}  # fmt: skip
        block = identities.PROMOTER_BLOCK if role == PROMOTER else identities.RESEARCHER_BLOCK
        return {"home": str(self.home), "tracking": block}


def prefect_env(home: Path, **settings: str) -> dict[str, str]:
    """This environment without its PREFECT_* settings, plus `settings`: a process of the
    stack reads no profile or API URL of the user's, only the stack's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false", **settings)
    return env


def prefect_service(cfg: StackConfig) -> Service:
    home = cfg.state / "prefect"
    creds = cfg.credentials()
    locked = {"PREFECT_SERVER_API_AUTH_STRING": creds.prefect_auth_string} if creds else {}
    env = prefect_env(
        home,
        # In the environment, not argv: on PostgreSQL the URL holds the password.
        PREFECT_API_DATABASE_CONNECTION_URL=(
            cfg.databases.prefect if cfg.databases else f"sqlite+aiosqlite:///{home / 'prefect.db'}"
        ),
        # The UI asks this URL for the API: without it, a port other than 4200 shows
        # "Unable to connect to Prefect server".
        PREFECT_UI_API_URL=cfg.api_url,
        # The UI's static files, copied and rewritten on the first start (a cache key
        # per Prefect version and base URL): here, not in the installed package.
        PREFECT_UI_STATIC_DIRECTORY=str(home / "ui"),
        **locked,
    )
    argv = [sys.executable, "-m", "prefect", "server", "start",
            "--host", cfg.host, "--port", str(cfg.prefect_port)]  # fmt: skip
    # a new home's SQLite database: a copy of a migrated empty one (5 s of a first start)
    return Service("prefect server", argv, env, cfg.logs / "prefect-server.log",
                   prepare=lambda: prefect_db.seed(env))  # fmt: skip


def mlflow_service(cfg: StackConfig) -> Service:
    # The store in the environment, not argv: on PostgreSQL its URL holds the password.
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
           "MLFLOW_BACKEND_STORE_URI": cfg.mlflow_store}  # fmt: skip
    app = []
    if creds := cfg.credentials():
        ini = cfg.state / "mlflow-auth.ini"
        auth_db = cfg.state / "mlflow-auth.db"
        text = MLFLOW_AUTH_INI.format(db=auth_db, user=creds.admin.username)
        if dbs := cfg.databases:
            # configparser reads % as interpolation: a percent-encoded password doubles it.
            text = text.replace(f"sqlite:///{auth_db}", dbs.mlflow_auth.replace("%", "%%"))
        ini.touch(mode=0o600)  # it may hold the database's password
        ini.chmod(0o600)
        ini.write_text(text)
        # The admin's password on the auth database's first start only; later ones keep
        # what the database has (a rotation changes it through the API: identities.setup).
        env.update(MLFLOW_AUTH_CONFIG_PATH=str(ini),
                   MLFLOW_AUTH_ADMIN_PASSWORD=creds.previous_admin_password
                   or creds.admin.password,
                   MLFLOW_FLASK_SERVER_SECRET_KEY=secrets.token_hex(16))  # fmt: skip
        app = ["--app-name", "basic-auth"]
    argv = [
        sys.executable, "-m", "mlflow", "server", *app,
        "--host", cfg.host, "--port", str(cfg.mlflow_port), "--workers", "1",
        "--artifacts-destination", str(cfg.home / "mlartifacts"),
    ]  # fmt: skip
    # a new home's SQLite store: a copy of a migrated empty one (1.3-2.5 CPU-s of a start),
    # private as protect_stores makes it
    return Service("mlflow server", argv, env, cfg.logs / "mlflow-server.log",
                   prepare=lambda: mlflow_db.seed(cfg.mlflow_store, mode=0o600))  # fmt: skip


def worker_service(cfg: StackConfig) -> Service:
    from quantloop.tasks.runtime.workspace import MLFLOW_UI_STORE_ENV, MLFLOW_UI_URL_ENV

    creds = cfg.credentials()
    env = prefect_env(
        cfg.state / "worker",
        PREFECT_API_URL=cfg.api_url,
        **({"PREFECT_API_AUTH_STRING": creds.prefect_auth_string} if creds else {}),
        PREFECT_WORKER_QUERY_SECONDS="2",
        # its flow runs' Prefect clients: one certificate to load, not certifi's 117
        **plain_http_tls(cfg.api_url),
        # Summaries of runs recorded in the workspace's store link to this MLflow UI
        # (on PostgreSQL, the store's URL and its password stay out of the flow runs).
        **{MLFLOW_UI_URL_ENV: cfg.mlflow_url},
        **({} if cfg.database else {MLFLOW_UI_STORE_ENV: cfg.mlflow_store}),
    )
    # its flow runs' command, `quantloop engine` (infra/prefect.yaml), is this install's
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    argv = [sys.executable, "-m", "prefect", "worker", "start",
            "--pool", cfg.pool, "--type", "process", "--name", WORKER_NAME]  # fmt: skip
    return Service(WORKER_SERVICE, argv, env, cfg.logs / "prefect-worker.log")


def warm_flow_runs(worker: Service) -> None:
    """Start the warm process the worker's flow runs use (`quantloop engine --warm` in
    the worker's environment: `python -m quantloop.forkserver --flow-runs`), beside the
    worker's own start: the researcher's first run from the UI is then a forked child
    too. Carrying the stack's tag, it is ended with the stack (with QUANTLOOP_FORKSERVER=0
    it starts nothing and says so in the worker's log)."""
    import subprocess
    import threading

    from quantloop.supervisor import STACK_ENV

    env = {**worker.env, STACK_ENV: worker.tag}

    def start() -> None:
        with open(worker.log, "ab") as log:
            subprocess.run([sys.executable, "-m", "quantloop.forkserver", "--flow-runs"],
                           env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                           timeout=300, check=False)  # fmt: skip

    threading.Thread(target=start, name="warm-flow-runs", daemon=True).start()


def wait_for(
    checks: dict[str, Callable[[], bool]], services: list[Service], timeout: float
) -> dict[str, float]:
    """Poll every check until each has held once; the seconds each took. Fails if a
    service exits or a check does not hold within `timeout`."""
    t0 = time.monotonic()
    took: dict[str, float] = {}
    while len(took) < len(checks):
        for s in services:
            s.check()
        for name, ready in checks.items():
            if name not in took:
                with contextlib.suppress(OSError, ValueError):
                    if ready():
                        took[name] = time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            late = sorted(set(checks) - set(took))
            raise TimeoutError(f"not ready within {timeout:.0f} s: {', '.join(late)}")
        time.sleep(0.25)
    return took


def get(url: str, auth: str | None = None) -> bytes:
    """GET, with HTTP basic auth ("user:password") when given."""
    request = urllib.request.Request(url)
    if auth:
        request.add_header("Authorization", "Basic " + base64.b64encode(auth.encode()).decode())
    with urllib.request.urlopen(request, timeout=5) as r:
        return r.read()


def ui_serves_the_app(cfg: StackConfig) -> bool:
    """The UI's settings name this stack's API, and its default UI's page is served."""
    creds = cfg.credentials()
    settings = json.loads(get(cfg.prefect_url + "/ui-settings",
                              creds.prefect_auth_string if creds else None))  # fmt: skip
    base = settings.get(f"{settings.get('default_ui')}_base_url") or "/"
    page = get(cfg.prefect_url + base.rstrip("/") + "/").decode(errors="replace")
    return settings.get("api_url") == cfg.api_url and '<script type="module"' in page


def worker_online(cfg: StackConfig, since: datetime.datetime) -> bool:
    """The stack's worker has sent a heartbeat since `since` (a record of the last start's
    worker still reads ONLINE for a while)."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        workers = client.read_workers_for_work_pool(cfg.pool)
    return any(
        w.name == WORKER_NAME and w.last_heartbeat_time and w.last_heartbeat_time >= since
        for w in workers
    )


@dataclasses.dataclass
class Stack:
    config: StackConfig
    services: list[Service]
    timings: dict[str, float]
    deployments: dict[str, str]
    experiment_id: str | None = None  # the served experiment's, once MLflow has it

    def urls(self) -> dict[str, str]:
        from quantloop.blocks.tracking import MODEL_TRAINING_VIEW, MlflowTracking

        # The experiment's page in the model-training view: MLflow 3.17's UI opens its
        # GenAI view otherwise (blocks/tracking.py).
        served = MlflowTracking(tracking_uri=self.config.mlflow_url)
        mlflow = (served.experiment_url(self.experiment_id) if self.experiment_id
                  else f"{self.config.mlflow_url}/#/experiments?{MODEL_TRAINING_VIEW}")  # fmt: skip
        return {
            "Prefect UI": self.config.prefect_url,
            "Prefect API": self.config.api_url,
            "MLflow UI": mlflow,
        }


def write_stack_file(cfg: StackConfig) -> None:
    """The stack's state file, written atomically (its auth string stays in
    credentials.json)."""
    me = psutil.Process()
    started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    state = {"api_url": cfg.api_url, "ui_url": cfg.prefect_url, "mlflow_url": cfg.mlflow_url,
             "pid": me.pid, "pid_created": f"{me.create_time():.2f}", "auth": cfg.auth,
             "started_at": started}  # fmt: skip
    tmp = cfg.stack_file.with_name(f".{cfg.stack_file.name}.tmp-{me.pid}")
    tmp.write_text(json.dumps(state, indent=1))
    os.replace(tmp, cfg.stack_file)


def stop_all(cfg: StackConfig, services: list[Service], say: Callable[[str], None]) -> None:
    """The worker first, with the flow runs it was running; then, while the Prefect
    server still answers, the runs it left in flight are closed (Cancelled in Prefect,
    KILLED in MLflow); then the servers, each with its whole tree; then anything else
    carrying this stack's tag."""
    t0 = time.monotonic()
    for s in reversed(services):
        s.stop()
        if s.name == WORKER_SERVICE:
            close_left_runs(cfg, say, crashed=False, message="serve stopped; it ended the run")
    tags = {s.tag for s in services if s.tag}
    stray = end_processes(tagged(lambda tag: tag in tags)) if tags else 0
    say(f"stopped {', '.join(s.name for s in reversed(services))} in {time.monotonic() - t0:.1f} s"
        + (f" ({stray} more processes of the stack ended)" if stray else ""))  # fmt: skip


def close_left_runs(cfg: StackConfig, say: Callable[[str], None], *, crashed: bool,
                    message: str) -> None:  # fmt: skip
    """Close the flow runs of the stack's pool left in flight and the MLflow runs they
    opened (quantloop/orphans.py), saying how many; a Prefect server that no longer
    answers is said, not raised: the processes are stopped either way."""
    from quantloop.orphans import close_runs

    try:
        flows, runs = close_runs(cfg.pool, cfg.mlflow_store, crashed=crashed, message=message)
    except Exception as exc:  # noqa: BLE001 (stopping goes on; the next start retries)
        say(f"could not close the runs in flight ({type(exc).__name__}: {exc}); "
            "the next start closes them")  # fmt: skip
        return
    if flows or runs:
        state = "Crashed" if crashed else "Cancelled"
        say(f"{flows} flow runs in flight marked {state}, {runs} MLflow runs KILLED")


def restart(cfg: StackConfig, s: Service, say: Callable[[str], None]) -> None:
    """Start a dead service again (after ending what it left: a child holding its port,
    the worker's flow runs, whose runs are then closed), or fail once it has died too
    often."""
    code = s.proc.returncode if s.proc is not None else None
    if not s.may_restart():
        raise RuntimeError(
            f"{s.name} exited with {code}, {len(s.restarts)} times within "
            f"{RESTART_WINDOW_S / 60:.0f} min; not restarting it again; its log: {s.log}\n"
            + tail(s.log)
        )
    window = f"{RESTART_WINDOW_S / 60:.0f} min"
    say(f"{s.name} exited with {code}; restarting it (restart {len(s.restarts)} of "
        f"{MAX_RESTARTS} allowed within {window}; its log: {s.log})")  # fmt: skip
    s.stop()
    if s.name == WORKER_SERVICE:
        close_left_runs(cfg, say, crashed=False, message="its worker died; serve ended the run")
    s.start()
    took = wait_ready(s, timeout=300)
    protect_stores(cfg)
    say(f"{s.name} restarted, ready in {took:.1f} s")


def supervise(cfg: StackConfig, services: list[Service], say: Callable[[str], None]) -> None:
    """One look at the stack: record each service's processes, restart a dead one."""
    for s in services:
        if s.alive():
            s.remember()
        else:
            restart(cfg, s, say)


def say_cuda_needs(specs: list, say: Callable[[str], None]) -> None:
    """serve's one worker runs every deployment on this machine, so one that asks for CUDA
    (train/gpu) fails each run at once where torch finds none (its error says so). It is
    deployed all the same, prefect.yaml staying the one list: a custom run with
    config.device auto or cpu trains on the CPU. Said once at start."""
    if needs := [d.full_name for d in specs if asks_for_cuda(d)]:
        import torch

        if not torch.cuda.is_available():
            say(f"note: {', '.join(needs)} asks for device cuda and this machine has no CUDA: "
                "its runs fail at once; give it config.device auto or cpu in a custom run, "
                "or run it on a CUDA worker's pool")  # fmt: skip


def protect_stores(cfg: StackConfig) -> None:
    """The stack's state folder 700, its databases 600 (MLflow's auth database holds
    password hashes; its store, every run's parameters). The servers create theirs with
    umask 077; this covers files made before (an embedded `quantloop run` on this home)."""
    cfg.state.mkdir(parents=True, exist_ok=True)
    cfg.state.chmod(0o700)
    for db in (cfg.home / "mlflow.db", cfg.state / "mlflow-auth.db"):
        with contextlib.suppress(FileNotFoundError):
            db.chmod(0o600)


def clear_leftovers(cfg: StackConfig, say: Callable[[str], None]) -> None:
    """Before anything starts: refuse a second stack on this home; end what an earlier
    one killed with kill -9 left (a server child holding a port, a flow run); then check
    that the ports are free (one line naming the port and its holder)."""
    if (pid := live_stack_on(cfg.home)) is not None:
        raise RuntimeError(f"quantloop serve (pid {pid}) already runs on {cfg.home}")
    if left := leftovers(cfg.home):
        names = sorted({describe(p) for p in left})
        ended = end_processes(left)
        say(f"ended {ended} processes an earlier stack on this home left: {'; '.join(names)}")
    check_ports(cfg.host, {"--prefect-port": cfg.prefect_port, "--mlflow-port": cfg.mlflow_port})


def register_blocks() -> None:
    """quantloop's block types, so the UI can list, create and pick them."""
    from quantloop.blocks import DataCatalog, MlflowTracking, Site

    for block in (Site, MlflowTracking, DataCatalog):
        block.register_type_and_schema()


def setup_identities(cfg: StackConfig, creds: Credentials) -> str:
    """Once MLflow is up: its users, registered models and grants (quantloop/identities.py),
    as its admin; then the researcher's and the promoter's tracking blocks, saved under
    the names the deployments' workspaces give (their passwords as SecretStr). Returns
    the served experiment's id."""
    from pydantic import SecretStr

    from quantloop import identities
    from quantloop.blocks import MlflowTracking

    served = MlflowTracking(tracking_uri=cfg.mlflow_url, ui_url=cfg.mlflow_url)
    models = (served.registered_model, served.candidates)
    experiment_id = identities.setup(cfg.mlflow_url, creds, experiment=served.experiment,
                                     models=models)  # fmt: skip
    if creds.previous_admin_password:  # the server has the rotated one now
        creds = dataclasses.replace(creds, previous_admin_password=None)
        identities.write(cfg.state / "credentials.json", creds)
    for block_name, who in ((identities.RESEARCHER_BLOCK, creds.researcher),
                            (identities.PROMOTER_BLOCK, creds.promoter)):  # fmt: skip
        served.model_copy(update={"username": who.username,
                                  "password": SecretStr(who.password)}).save(
            block_name, overwrite=True)  # fmt: skip
    return experiment_id


@contextlib.contextmanager
def running(cfg: StackConfig, *, say: Callable[[str], None] = print) -> Iterator[Stack]:
    """The stack, up and ready inside the block, stopped (everything) on the way out."""
    from prefect.settings import (
        PREFECT_API_AUTH_STRING,
        PREFECT_API_SSL_CERT_FILE,
        PREFECT_API_URL,
        temporary_settings,
    )

    from quantloop.tasks.runtime.reaper import reap_on_death

    cfg.logs.mkdir(parents=True, exist_ok=True)
    protect_stores(cfg)
    clear_leftovers(cfg, say)
    if dbs := cfg.databases:
        created = dbs.ensure()
        say(f"databases on {dbs.masked()}: {', '.join(dbs.name(s) for s in SERVERS)}"
            + (f" ({', '.join(created)} created)" if created else ""))  # fmt: skip
    creds = cfg.credentials()
    prefect_auth = creds.prefect_auth_string if creds else None
    client_auth = {PREFECT_API_AUTH_STRING: prefect_auth} if creds else {}
    if cert := plain_http_tls(cfg.api_url).get("PREFECT_API_SSL_CERT_FILE"):
        client_auth[PREFECT_API_SSL_CERT_FILE] = cert  # this process's clients, as the worker's
    first = not (cfg.state / "prefect" / "ui").exists()
    prefect, mlflow = prefect_service(cfg), mlflow_service(cfg)
    services = [prefect, mlflow]
    # Every process below a service carries the tag (a stray one is found by it); the
    # servers' files are their owner's only (MLflow's auth database holds password hashes).
    tag = stack_tag(cfg.home)
    for s in services:
        s.tag, s.umask = tag, 0o077
    prefect.ready = lambda: (get(cfg.api_url + "/health", prefect_auth) == b"true"
                             and ui_serves_the_app(cfg))  # fmt: skip
    mlflow.ready = lambda: get(cfg.mlflow_url + "/health") == b"OK"
    timings: dict[str, float] = {}
    with contextlib.ExitStack() as stack:
        stack.enter_context(reap_on_death())
        # The stack's API for this process's clients until everything is stopped.
        stack.enter_context(temporary_settings({PREFECT_API_URL: cfg.api_url, **client_auth}))
        # Stopped in reverse: the worker first, its runs closed, then the servers.
        stack.callback(stop_all, cfg, services, say)
        t0 = time.monotonic()
        for s in services:
            s.start()
        say(f"starting Prefect ({'first start: building the UI' if first else 'UI built'}) "
            f"and MLflow under {cfg.home}")  # fmt: skip
        timings.update(
            wait_for(
                {
                    "prefect_api_s": lambda: get(cfg.api_url + "/health", prefect_auth) == b"true",
                    "prefect_ui_s": lambda: ui_serves_the_app(cfg),
                    "mlflow_s": lambda: get(cfg.mlflow_url + "/health") == b"OK",
                },
                services,
                timeout=300,
            )
        )
        protect_stores(cfg)
        write_stack_file(cfg)
        stack.callback(cfg.stack_file.unlink, missing_ok=True)
        # Runs an earlier stack on this home left in flight (killed with kill -9): no
        # process of theirs is left (clear_leftovers), and no worker of ours runs yet.
        close_left_runs(cfg, say, crashed=True,
                        message="its process was gone when serve started again")  # fmt: skip
        t1 = time.monotonic()
        with temporary_settings({PREFECT_API_URL: cfg.api_url, **client_auth}):
            register_blocks()
            experiment_id = None
            if creds:
                t2 = time.monotonic()
                experiment_id = setup_identities(cfg, creds)
                timings["identities_s"] = time.monotonic() - t2
            # The promote deployment records as the promoter; the others as researchers.
            found = read_deployments(cfg.prefect_file, cfg.checkout)
            specs = [
                *for_stack([d for d in found if d.flow != "promote"], pool=cfg.pool,
                           checkout=cfg.checkout, workspace=cfg.workspace(RESEARCHER)),
                *for_stack([d for d in found if d.flow == "promote"], pool=cfg.pool,
                           checkout=cfg.checkout, workspace=cfg.workspace(PROMOTER)),
            ]  # fmt: skip
            # The stack's own server: its deployments follow prefect.yaml.
            ids = apply(specs, replace=True, root=cfg.checkout,
                        queues=read_queues(cfg.prefect_file))  # fmt: skip
            timings["deploy_s"] = time.monotonic() - t1
            say_cuda_needs(specs, say)
            worker = worker_service(cfg)
            worker.tag = tag
            worker.ready = lambda: worker_online(cfg, worker.started)
            services.append(worker)
            since = datetime.datetime.now(datetime.UTC)
            worker.start()
            warm_flow_runs(worker)
            timings.update(wait_for({"worker_s": lambda: worker_online(cfg, since)}, services, 300))
        timings["total_s"] = time.monotonic() - t0
        yield Stack(cfg, services, timings, {name: str(i) for name, i in ids.items()},
                    experiment_id)  # fmt: skip


def serve_forever(cfg: StackConfig, say: Callable[[str], None] = print) -> None:
    """Run the stack until SIGINT or SIGTERM, then stop all of it."""

    def stop(signum, frame):  # noqa: ARG001
        # Once: a second Ctrl-C must not cut the stopping short.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise KeyboardInterrupt

    # SIGINT too: a shell starts a background job with SIGINT ignored, and Python then
    # leaves it ignored.
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        with running(cfg, say=say) as stack:
            t = stack.timings
            for name, url in stack.urls().items():
                say(f"{name + ':':13} {url}")
            say(f"deployments:  {', '.join(stack.deployments)} on work pool {cfg.pool}")
            say(f"workspace:    {cfg.home}   logs: {cfg.logs}")
            if cfg.auth:
                say(
                    f"credentials:  {cfg.state / 'credentials.json'} (the Prefect UI asks for "
                    "prefect_auth_string; MLflow for mlflow.researcher's username and "
                    "password; mlflow.promoter is the promote flow's)"
                )
            say(
                f"ready in {t['total_s']:.1f} s (Prefect API {t['prefect_api_s']:.1f} s, "
                f"UI {t['prefect_ui_s']:.1f} s, MLflow {t['mlflow_s']:.1f} s, deployments "
                f"{t['deploy_s']:.1f} s, worker {t['worker_s']:.1f} s); Ctrl-C stops it all"
            )
            while True:
                supervise(cfg, stack.services, say)
                time.sleep(1.0)
    except KeyboardInterrupt:
        pass
