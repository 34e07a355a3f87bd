"""MLflow recording in batches: one HTTP call carries up to 1,000 metrics.

A tracking-server round trip costs ~66 ms (more behind basic auth), so nothing in
quantloop logs a value at a time: stages collect values and send them with
`RunLog.flush()`; a run's files go up on background threads while the stage goes on, and
the run waits for them before it ends (a failed upload fails the run, never silently).

Every MLflow call made through a client of `client_for` (or by RunLog) adds its seconds
to the process timeline's "mlflow" total (tasks/runtime/timeline.py), one count a call:
`quantloop run --profile` says how many calls a run made and what they cost.

Importing this module imports no MLflow (that is ~1.3 s): the first client does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import getpass
import hashlib
import inspect
import json
import os
import queue
import shutil
import socket
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import psutil

from quantloop.tasks.records import mlflow_db
from quantloop.tasks.records.provenance import git_commit
from quantloop.tasks.runtime import timeline

if TYPE_CHECKING:
    import pyarrow as pa
    from mlflow.store.artifact.artifact_repo import ArtifactRepository
    from mlflow.tracking import MlflowClient

    from quantloop.blocks.tracking import MlflowTracking

_MAX_METRICS, _MAX_PARAMS, _MAX_TAGS = 1000, 100, 100
_MAX_ENTITIES = 1000  # metrics, params and tags of one log_batch together
_MAX_BATCH_CHARS = 800_000  # MLflow refuses a log_batch request over 1 MB
_MAX_PARAM_CHARS = 6000  # MLflow's cap on a parameter value
# The experiment's kind, for MLflow's API and UIs that read it. MLflow 3.17's own UI does
# not: it picks the GenAI or model-training view from the page address, so the links we
# write carry the view (blocks/tracking.py MODEL_TRAINING_VIEW).
EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")
PARENT_TAG = "mlflow.parentRunId"
SENDERS = 4  # threads that upload a run's files while the run goes on
_SENDER_NAME = "mlflow-send"
BACKGROUND_TOTAL = "mlflow, background"


# ---------------------------------------------------------------- timing every call

_calls = threading.local()


@contextlib.contextmanager
def mlflow_call() -> Iterator[None]:
    """An MLflow call: its seconds go to the timeline's "mlflow" total (a call the run
    waited for) or BACKGROUND_TOTAL (one a sender thread made while the run went on),
    counted once however many MLflow calls it makes inside (a client method that calls
    another)."""
    depth = getattr(_calls, "depth", 0)
    _calls.depth = depth + 1
    t0 = time.perf_counter()
    try:
        yield
    finally:
        _calls.depth = depth
        if depth == 0:
            sender = threading.current_thread().name.startswith(_SENDER_NAME)
            timeline.add(BACKGROUND_TOTAL if sender else "mlflow", time.perf_counter() - t0)


@functools.cache
def _timed_client_class() -> type:
    """MlflowClient with every public method timed by `mlflow_call`."""
    from mlflow.tracking import MlflowClient

    def timed(method: Callable) -> Callable:
        @functools.wraps(method)
        def call(self, *args, **kwargs):
            with mlflow_call():
                return method(self, *args, **kwargs)

        return call

    methods = {name: timed(fn) for name, fn in vars(MlflowClient).items()
               if not name.startswith("_") and inspect.isfunction(fn)}  # fmt: skip
    return type("TimedMlflowClient", (MlflowClient,), methods)


# ---------------------------------------------------------------- client and experiment

# (client, experiment id) by tracking URI, experiment, artifact location and credentials,
# while a `shared_clients()` block is open: the stages of one run look the experiment up
# once, not once each.
_shared: dict[tuple, tuple[MlflowClient, str]] = {}
_shared_users = 0
_shared_lock = threading.Lock()


@contextlib.contextmanager
def shared_clients() -> Iterator[None]:
    """Inside the block, `client_for` gives the client and experiment id it gave first
    for the same block settings (one experiment lookup a research run, not one a stage);
    forgotten when the last such block ends, so a later run looks again."""
    global _shared_users
    with _shared_lock:
        _shared_users += 1
    try:
        yield
    finally:
        with _shared_lock:
            _shared_users -= 1
            if _shared_users == 0:
                _shared.clear()


def client_for(tracking: MlflowTracking) -> tuple[MlflowClient, str]:
    """A client and the experiment id, creating the experiment if needed."""
    uri = tracking.resolved_uri()
    if tracking.username and tracking.password:
        # MLflow's REST client reads credentials from these, per request; a block's
        # credentials win over the environment's.
        os.environ["MLFLOW_TRACKING_USERNAME"] = tracking.username
        os.environ["MLFLOW_TRACKING_PASSWORD"] = tracking.password.get_secret_value()
    secret = hashlib.sha256(os.environ.get("MLFLOW_TRACKING_PASSWORD", "").encode()).hexdigest()
    key = (uri, tracking.experiment, tracking.resolved_artifact_location(),
           os.environ.get("MLFLOW_TRACKING_USERNAME", ""), secret)  # fmt: skip
    with _shared_lock:
        if _shared_users and key in _shared:
            return _shared[key]
    found = _client_for(tracking, uri)
    with _shared_lock:
        if _shared_users:
            _shared[key] = found
    return found


def _client_for(tracking: MlflowTracking, uri: str) -> tuple[MlflowClient, str]:
    cache_schema_head()
    with _store_lock(uri):
        mlflow_db.seed(uri)  # a new SQLite store: a copy of a migrated empty one
        # Opening a SQLite store creates its tables (the client's constructor opens the
        # tracking store, the first registry call the registry's): two first runs at
        # once raced in the migration ("alembic_version ... 0 found", then "duplicate
        # column name: step" in CI), so both are opened under the lock.
        client = _timed_client_class()(tracking_uri=uri)
        if uri.startswith("sqlite:///"):
            client.search_registered_models(max_results=1)
        exp = client.get_experiment_by_name(tracking.experiment)
    if exp is not None:
        if exp.tags.get(EXPERIMENT_KIND[0]) is None:  # made before quantloop set it
            client.set_experiment_tag(exp.experiment_id, *EXPERIMENT_KIND)
        return client, exp.experiment_id
    try:
        return client, client.create_experiment(
            tracking.experiment,
            artifact_location=tracking.resolved_artifact_location(),
            tags=dict([EXPERIMENT_KIND]),
        )
    except Exception:
        # Another process created it between our get and create.
        exp = client.get_experiment_by_name(tracking.experiment)
        if exp is None:
            raise
        return client, exp.experiment_id


def cache_schema_head() -> None:
    """MLflow checks a SQL store's schema against the head of its migration scripts each
    time a process opens the store (SqlAlchemyStore's _verify_schema), and alembic reads
    and executes its 68 scripts to find that head: ~55 ms of every run's set-up here,
    in every child of the warm process too. The head is fixed by the installed MLflow, so
    it is computed once a process (for the warm process's children, once: `warm_store`).
    The database's own revision is still read and compared each time."""
    from mlflow.store.db import utils

    if not hasattr(utils._get_latest_schema_revision, "cache_info"):
        utils._get_latest_schema_revision = functools.cache(utils._get_latest_schema_revision)


def warm_store() -> None:
    """The migration scripts' head found in the warm process (quantloop/forkserver.py
    WARM_CALLS), for its children: `cache_schema_head`."""
    from mlflow.store.db import utils

    cache_schema_head()
    utils._get_latest_schema_revision()


def warm_client() -> None:
    """A run's first calls made once on a scratch SQLite store in the warm process
    (quantloop/forkserver.py WARM_CALLS), for its children: SQLAlchemy's mappers
    configured and its caches filled, MLflow's stores' lazy imports made. A child's first
    opening of its own store then took 34 ms instead of 280 ms here (this VM: its flow's
    set-up, every served run). Plain client calls, not `_client_for`'s timed ones: the
    warm process's timeline, which its children inherit, stays empty. The scratch
    store's engines are closed and forgotten, its folder removed, before any fork."""
    import shutil
    import tempfile

    from mlflow.entities import Metric, Param, RunTag
    from mlflow.store.model_registry.sqlalchemy_store import SqlAlchemyStore as Registry
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore
    from mlflow.tracking import MlflowClient

    warm_store()
    folder = tempfile.mkdtemp(prefix="quantloop-warm-mlflow-")
    uri = "sqlite:///" + os.path.join(folder, "mlflow.db")
    # No usage record of these calls: MLflow's telemetry (on where no CI variable is set)
    # would start its sending thread here, before the forks, and a child would inherit
    # its queue's lock without the thread.
    telemetry_off = os.environ.get("MLFLOW_DISABLE_TELEMETRY")
    os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"
    try:
        mlflow_db.seed(uri)
        client = MlflowClient(tracking_uri=uri)
        client.search_registered_models(max_results=1)
        experiment = client.create_experiment("warm", artifact_location=folder,
                                              tags=dict([EXPERIMENT_KIND]))  # fmt: skip
        client.get_experiment_by_name("warm")
        run = client.create_run(experiment, tags={"quantloop.stage": "warm"})
        client.log_batch(run.info.run_id, metrics=[Metric("m", 1.0, 0, 0)],
                         params=[Param("p", "1")], tags=[RunTag("t", "1")])  # fmt: skip
        client.set_terminated(run.info.run_id, "FINISHED")
        client.search_runs([experiment], max_results=1)
    finally:
        if telemetry_off is None:
            os.environ.pop("MLFLOW_DISABLE_TELEMETRY", None)
        else:
            os.environ["MLFLOW_DISABLE_TELEMETRY"] = telemetry_off
        for store in (SqlAlchemyStore, Registry):
            with store._engine_map_lock:
                engine = store._engine_map.pop(uri, None)
            if engine is not None:
                engine.dispose()
        shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def _store_lock(uri: str) -> Iterator[None]:
    """An exclusive lock beside a local SQLite store while it may be created; nothing
    for a tracking server, which serializes its own writes."""
    if not uri.startswith("sqlite:///"):
        yield
        return
    path = uri[len("sqlite:///") :]
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(f"{path}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def artifact_repo(client: MlflowClient, artifact_uri: str) -> ArtifactRepository:
    """The artifact store at `artifact_uri` (a run's or a logged model's), reached as the
    client reaches it, without the client's lookup of the location (a call each run)."""
    from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository
    from mlflow.utils.uri import add_databricks_profile_info_to_artifact_uri

    uri = add_databricks_profile_info_to_artifact_uri(artifact_uri, client.tracking_uri)
    return get_artifact_repository(uri, tracking_uri=client.tracking_uri)


_end_lock = threading.Lock()


def end_run(client: MlflowClient, run_id: str, status: str) -> None:
    """set_terminated without the run lookup MLflow makes to print the run's URL (a call
    a run: quantloop's own output links the runs)."""
    name = "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"
    with _end_lock:
        before = os.environ.get(name)
        os.environ[name] = "true"
        try:
            client.set_terminated(run_id, status)
        finally:
            # Never removed once set: runs end on background threads, and a variable
            # removed while another thread iterates os.environ (httpx reading proxies
            # as Prefect makes a client) raised KeyError there and failed the run.
            if before is not None:
                os.environ[name] = before


# Who made a run: a later run on the same host can tell a run whose process died
# (SIGKILL, power loss) from one still going, and mark it KILLED.
HOST_TAG, PID_TAG, PID_START_TAG = "quantloop.host", "quantloop.pid", "quantloop.pid_start"
# Where a research run's records live (its site's storage root, its catalog file, its
# workspace as JSON): what finds them from the run alone.
STORE_TAG, CATALOG_TAG, WORKSPACE_TAG = (
    "quantloop.store",
    "quantloop.catalog",
    "quantloop.workspace",
)
MANIFEST_TAG = "quantloop.manifest"  # a features run's manifest folder


def _owner_tags() -> dict[str, str]:
    me = psutil.Process()
    return {HOST_TAG: socket.gethostname(), PID_TAG: str(me.pid),
            PID_START_TAG: repr(me.create_time())}  # fmt: skip


def _process_alive(pid: int, started: str) -> bool:
    try:
        return repr(psutil.Process(pid).create_time()) == started
    except psutil.Error:
        return False


def close_dead_runs(client: MlflowClient, experiment_id: str) -> list[str]:
    """Mark KILLED the RUNNING runs this host's processes made and left behind when they
    died; returns their ids. Runs of other hosts are left alone (their liveness is not
    visible from here)."""
    from mlflow.entities import RunTag

    host = socket.gethostname()
    found = client.search_runs(
        [experiment_id],
        filter_string=f"attributes.status = 'RUNNING' and tags.`{HOST_TAG}` = '{host}'",
        max_results=1000,
    )
    closed = []
    for r in found:
        tags = r.data.tags
        if PID_TAG in tags and not _process_alive(int(tags[PID_TAG]), tags.get(PID_START_TAG, "")):
            closing = RunTag("quantloop.closed", "its process died; marked KILLED")
            client.log_batch(r.info.run_id, tags=[closing])
            end_run(client, r.info.run_id, "KILLED")
            closed.append(r.info.run_id)
    return closed


# ---------------------------------------------------------------- one run's records


class Senders:
    """A few daemon threads that send records in the background, first come first sent.

    Daemon threads, not a ThreadPoolExecutor's: nothing waits for them at exit (a
    command that joins every thread before its exit handlers would wait forever on an
    executor's idle workers), and nothing needs to, as every send is waited for by
    whoever made it (a run's end, registration's upload)."""

    def __init__(self, threads: int):
        self.threads = threads
        self._lock = threading.Lock()
        self._pid, self._queue, self._started = 0, queue.SimpleQueue(), 0

    def submit(self, fn: Callable, *args: Any) -> Future:
        future: Future = Future()
        with self._lock:
            if self._pid != os.getpid():  # a forked child has none of its parent's threads
                self._pid, self._queue, self._started = os.getpid(), queue.SimpleQueue(), 0
            if self._started < self.threads:
                self._started += 1
                threading.Thread(target=self._work, args=(self._queue,), daemon=True,
                                 name=f"{_SENDER_NAME}-{self._started}").start()  # fmt: skip
            self._queue.put((future, fn, args))
        return future

    @staticmethod
    def _work(jobs: queue.SimpleQueue) -> None:
        while True:
            future, fn, args = jobs.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args)
            except BaseException as exc:  # noqa: BLE001 - the future's owner raises it
                future.set_exception(exc)
            else:
                future.set_result(result)


_SENDERS = Senders(SENDERS)


def senders() -> Senders:
    """The process's background senders."""
    return _SENDERS


class RunLog:
    """Buffers params, tags and metrics of one MLflow run and sends them in batches.

    Files (artifact, file, json, table, figure) and datasets go up on background threads
    when `background` is set (a `run()` block's log): `flush()` and the end of the run
    wait for them and raise the first failure. Without it (a log made for an existing
    run), every call sends before it returns."""

    def __init__(self, client: MlflowClient, run_id: str, artifact_uri: str | None = None,
                 *, background: bool = False):  # fmt: skip
        self.client = client
        self.run_id = run_id
        self.artifact_uri = artifact_uri  # the run's, from its creation: no lookup
        self.background = background
        self._metrics: list = []
        self._params: list = []
        self._tags: list = []
        self._pending: list[Future] = []
        self._last_send: Future | None = None
        self._repo: ArtifactRepository | None = None

    def params(self, values: Mapping[str, Any]) -> None:
        """Parameters, each value written one way: lists and tuples as JSON lists
        ([1, 10, 100], never (1, 10, 100)), mappings as JSON, the rest as str()."""
        from mlflow.entities import Param

        self._params += [Param(k, param_value(v)) for k, v in values.items()]

    def tags(self, values: Mapping[str, Any]) -> None:
        from mlflow.entities import RunTag

        self._tags += [RunTag(k, str(v)) for k, v in values.items()]

    def metrics(self, values: Mapping[str, float], step: int = 0) -> None:
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        self._metrics += [Metric(k, float(v), ts, step) for k, v in values.items() if v is not None]

    def series(self, name: str, values: list[float], steps: list[int] | None = None) -> None:
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        steps = steps if steps is not None else list(range(len(values)))
        self._metrics += [Metric(name, float(v), ts, s) for s, v in zip(steps, values, strict=True)]

    def link_model(self, model_id: str) -> None:
        """The buffered step-0 metrics also become metrics of logged model `model_id` (what
        MLflow's log_model does by reading every metric's history back: a call each)."""
        from mlflow.entities import Metric

        self._metrics = [
            Metric(m.key, m.value, m.timestamp, m.step, model_id=model_id, run_id=self.run_id)
            if m.step == 0 and m.model_id is None else m
            for m in self._metrics
        ]  # fmt: skip

    def flush(self) -> None:
        """Wait for this run's sends in flight, then send everything buffered: one call
        per 1,000 values, not one per value. The first failure raises, after the rest."""
        failed = self._wait()
        while self._metrics or self._params or self._tags:
            self._log_batch(*self._batch())
        if failed is not None:
            raise failed

    def send(self) -> None:
        """Hand everything buffered to the background senders and go on (a `run()`
        block's log; another sends now). Sent in order: after this run's earlier sends,
        before its next flush; a failure raises at that flush."""
        if not self.background:
            self.flush()
            return
        batches = []
        while self._metrics or self._params or self._tags:
            batches.append(self._batch())
        previous = self._last_send

        def job() -> None:
            if previous is not None:  # its failure is its own to report
                with contextlib.suppress(Exception):
                    previous.result()
            for batch in batches:
                self._log_batch(*batch)

        self._last_send = senders().submit(job)
        self._pending.append(self._last_send)

    def _log_batch(self, params: list, tags: list, metrics: list) -> None:
        with mlflow_call():
            self.client.log_batch(self.run_id, metrics=metrics, params=params, tags=tags)

    def _batch(self) -> tuple[list, list, list]:
        """The next log_batch: at most 100 params, 100 tags, 1,000 values in all, under
        MLflow's request size."""
        room, chars = _MAX_ENTITIES, _MAX_BATCH_CHARS
        out = []
        for attr, cap in (("_params", _MAX_PARAMS), ("_tags", _MAX_TAGS),
                          ("_metrics", _MAX_METRICS)):  # fmt: skip
            items, n = getattr(self, attr), 0
            while n < min(cap, room, len(items)) and (n == 0 or _chars(items[n]) <= chars):
                chars -= _chars(items[n])
                n += 1
            room -= n
            out.append(items[:n])
            setattr(self, attr, items[n:])
        return out[0], out[1], out[2]

    def _wait(self) -> BaseException | None:
        pending, self._pending, self._last_send = self._pending, [], None
        failed = None
        for future in pending:
            try:
                future.result()
            except BaseException as exc:  # noqa: BLE001 - raised by flush()
                failed = failed or exc
        return failed

    def _send(self, job: Callable[[], None]) -> None:
        if self.background:
            self._pending.append(senders().submit(job))
        else:
            job()

    def _artifacts(self) -> ArtifactRepository | None:
        if self._repo is None and self.artifact_uri is not None:
            self._repo = artifact_repo(self.client, self.artifact_uri)
        return self._repo

    def _upload(self, path: str, artifact_path: str | None) -> None:
        with mlflow_call():
            repo = self._artifacts()
            if repo is None:
                self.client.log_artifact(self.run_id, path, artifact_path)
            elif os.path.isdir(path):
                name = os.path.basename(os.path.normpath(path))
                repo.log_artifacts(path, f"{artifact_path}/{name}" if artifact_path else name)
            else:
                repo.log_artifact(path, artifact_path)

    def artifact(self, path: str, artifact_path: str | None = None) -> None:
        """Log a local file (or folder): copied now, sent behind, so the caller may remove
        it at once (the ladder's files lived in a temporary folder that was gone before
        the sender reached them)."""
        name = os.path.basename(os.path.normpath(path))
        if os.path.isdir(path):
            self._write_and_send(lambda dest: shutil.copytree(path, dest), name, artifact_path)
        else:
            self._write_and_send(lambda dest: shutil.copyfile(path, dest), name, artifact_path)

    def table(self, table: pa.Table, name: str, artifact_path: str | None = None) -> None:
        """Log an Arrow table as a Parquet artifact."""
        from quantloop.tasks.engine import storage

        self.file(storage.parquet_bytes(table), name, artifact_path)

    def file(self, data: bytes, name: str, artifact_path: str | None = None) -> None:
        """Log bytes as an artifact file called `name`."""
        self._write_and_send(lambda path: _write(path, data), name, artifact_path)

    def _write_and_send(self, write: Callable[[str], None], name: str,
                        artifact_path: str | None) -> None:  # fmt: skip
        folder = tempfile.mkdtemp(prefix="quantloop-artifact-")
        try:
            path = os.path.join(folder, name)
            write(path)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise

        def send() -> None:
            try:
                self._upload(path, artifact_path)
            finally:
                shutil.rmtree(folder, ignore_errors=True)

        self._send(send)

    def figure(self, fig: Any, name: str) -> None:
        """Log a matplotlib figure as an image called `name` (drawn here, sent behind)."""
        folder, file = os.path.split(name)
        self._write_and_send(fig.savefig, file, folder or None)

    def json(self, value: Any, name: str, artifact_path: str | None = None) -> None:
        """Log a JSON-able value as a .json artifact (the UI shows it)."""
        self.file(json.dumps(value, indent=2, sort_keys=True, default=str).encode(), name,
                  artifact_path)  # fmt: skip

    def dataset(self, *, name: str, source: str, digest: str, context: str, rows: int) -> None:
        """An input dataset of the run (the UI's Datasets column): which catalog dataset,
        where it lives, and the digest of exactly the partition versions read."""
        from mlflow.data.dataset_source_registry import resolve_dataset_source
        from mlflow.data.meta_dataset import MetaDataset
        from mlflow.entities import DatasetInput, InputTag

        with warnings.catch_warnings():
            # a local path matches two registered local sources, both the same class
            warnings.simplefilter("ignore", UserWarning)
            resolved = resolve_dataset_source(source)
        ds = MetaDataset(
            resolved, name=name,
            digest=digest[:32],  # MLflow keeps 36 characters; the full digest is a tag
        )  # fmt: skip
        tags = [InputTag("mlflow.data.context", context), InputTag("quantloop.digest", digest),
                InputTag("quantloop.partitions", str(rows))]  # fmt: skip
        inputs = [DatasetInput(ds._to_mlflow_entity(), tags)]

        def send() -> None:
            with mlflow_call():
                self.client.log_inputs(self.run_id, inputs)

        self._send(send)


def _chars(entity: Any) -> int:
    """About what a param, tag or metric adds to a log_batch request (JSON)."""
    value = entity.value
    return len(entity.key) + (len(value) if isinstance(value, str) else 30) + 90


def _write(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def param_value(value: Any) -> str:
    if isinstance(value, tuple | list):
        value = json.dumps(list(value), default=str)
    elif isinstance(value, Mapping):
        value = json.dumps(value, sort_keys=True, default=str)
    return str(value)[:_MAX_PARAM_CHARS]


def _prefect_tags() -> dict[str, str]:
    """The Prefect flow run this MLflow run belongs to, when there is one."""
    from prefect.context import FlowRunContext
    from prefect.runtime import flow_run

    ctx = FlowRunContext.get()
    if ctx is not None and ctx.flow_run is not None and ctx.flow is not None:
        # from the run's own context: prefect.runtime's flow_name asks the API, which a
        # server restart mid-run made fail (tests/test_faults.py)
        return {"prefect_flow_run_id": str(ctx.flow_run.id), "prefect_flow": ctx.flow.name,
                "prefect_flow_run_name": ctx.flow_run.name}  # fmt: skip
    run_id = flow_run.id
    if not run_id:
        return {}
    return {"prefect_flow_run_id": run_id, "prefect_flow": flow_run.flow_name,
            "prefect_flow_run_name": flow_run.name}  # fmt: skip


def _stage_start_ms(name: str) -> int | None:
    """When the Prefect flow run of the stage `name` ("features", "train", "simulate")
    started, in ms since the epoch, when this runs inside it; else None (now).

    A stage records its child run at its end, once its figures exist: started then, the
    run would last as long as its recording (1.1 s for a 31 s features stage, 17.9 s of
    registration for a 96 s train stage); started when the stage's flow run did, and
    ended as the recording ends, it spans the stage's own work."""
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    if ctx is None or ctx.flow is None or ctx.flow.name != name:
        return None
    return int(ctx.start_time.timestamp() * 1000)


def source_tags(prefect: Mapping[str, str] | None = None) -> dict[str, str]:
    """What the UI's Source and User columns show: the flow (or command) and commit."""
    prefect = _prefect_tags() if prefect is None else prefect
    flow = prefect.get("prefect_flow")
    source = f"quantloop.flows.{flow}" if flow else "quantloop"
    tags = {"mlflow.source.name": source, "mlflow.source.type": "JOB",
            "mlflow.user": getpass.getuser()}  # fmt: skip
    if commit := git_commit():
        tags["mlflow.source.git.commit"] = commit.removesuffix("+dirty")
    return tags


@contextlib.contextmanager
def run(
    client: MlflowClient,
    experiment_id: str,
    name: str,
    *,
    parent: str | None = None,
    tags: Mapping[str, Any] | None = None,
) -> Iterator[RunLog]:
    """An MLflow run that ends FINISHED, or FAILED if the block raises or a record of it
    failed to send, or KILLED if a signal stopped it (Ctrl-C; SIGTERM, which Prefect
    raises as TerminationSignal; SystemExit): the status serve's clean-up gives a run
    whose process it ended (quantloop/orphans.py), whichever of the two closes it first.
    Flushed on exit (files still in flight included).

    Its name carries the Prefect flow run's ("research-clever-fox"), its
    `quantloop.stage` tag the bare `name` ("research"). Made with all its tags in one call."""
    prefect = _prefect_tags()
    run_name = f"{name}-{prefect['prefect_flow_run_name']}" if prefect else name
    all_tags = {"mlflow.runName": run_name, "quantloop.stage": name, **_owner_tags(),
                **source_tags(prefect), **prefect, **(tags or {})}  # fmt: skip
    if parent:
        all_tags[PARENT_TAG] = parent
    with mlflow_call():
        created = client.create_run(
            experiment_id,
            run_name=run_name,
            tags={k: str(v) for k, v in all_tags.items()},
            start_time=_stage_start_ms(name) if parent else None,
        )
    log = RunLog(client, created.info.run_id, created.info.artifact_uri, background=True)
    try:
        yield log
    except BaseException as e:
        with contextlib.suppress(Exception):
            log.flush()
        with mlflow_call():
            end_run(client, log.run_id, "FAILED" if isinstance(e, Exception) else "KILLED")
        raise
    try:
        log.flush()
    except BaseException as e:
        with contextlib.suppress(Exception), mlflow_call():
            end_run(client, log.run_id, "FAILED" if isinstance(e, Exception) else "KILLED")
        raise
    with mlflow_call():
        end_run(client, log.run_id, "FINISHED")


# ---------------------------------------------------------------- many child runs


@dataclasses.dataclass(kw_only=True, slots=True)
class ChildRun:
    """A child run to record whole: a sweep's (setting, fold), say."""

    name: str  # its run name (the Prefect flow run's name is appended, as run() does)
    stage: str  # its quantloop.stage tag
    tags: Mapping[str, Any]
    params: Mapping[str, Any]
    metrics: Mapping[str, float]
    series: Mapping[str, tuple[list[float], list[int]]]  # name -> (values, steps)


def child_runs(
    client: MlflowClient, experiment_id: str, parent: str, children: list[ChildRun]
) -> list[Future]:
    """Record each child of `parent` (MLflow's nested runs: tag mlflow.parentRunId) on the
    background senders, a Future each: made with its tags, then its params, metrics and
    series in batches (one log_batch for up to 100 params and 1,000 values), then ended
    FINISHED; three calls a run, the runs side by side on SENDERS threads (a call is
    ~66 ms). A child that fails to send ends
    FAILED and its Future raises."""
    prefect = _prefect_tags()  # from this thread's flow run: the senders have none
    common = {**_owner_tags(), **source_tags(prefect), **prefect, PARENT_TAG: parent}
    suffix = f"-{prefect['prefect_flow_run_name']}" if prefect else ""

    def record(child: ChildRun) -> str:
        tags = {**common, "mlflow.runName": child.name + suffix, "quantloop.stage": child.stage,
                **child.tags}  # fmt: skip
        with mlflow_call():
            created = client.create_run(experiment_id, run_name=child.name + suffix,
                                        tags={k: str(v) for k, v in tags.items()})  # fmt: skip
        log = RunLog(client, created.info.run_id)
        try:
            log.params(child.params)
            log.metrics({k: v for k, v in child.metrics.items() if v == v})  # no NaN
            for name, (values, steps) in child.series.items():
                log.series(name, values, steps)
            log.flush()
        except BaseException:
            with contextlib.suppress(Exception), mlflow_call():
                end_run(client, log.run_id, "FAILED")
            raise
        with mlflow_call():
            end_run(client, log.run_id, "FINISHED")
        return log.run_id

    return [senders().submit(record, child) for child in children]
