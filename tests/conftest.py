"""Session-wide real servers: one temporary Prefect API, one MLflow server, one S3 endpoint,
one PostgreSQL server (on demand), per pytest-xdist worker (the suite runs on `-n auto`
workers; each is a session of its own)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

# One OpenMP thread per process when the workers fill the cores (three on two, the CI
# machine): torch's intra-op threads then add nothing but GNU OpenMP's spin-waits after
# each parallel region, CPU taken from the other workers. Set before anything imports
# torch (here or in a subprocess given this environment). test_research, test_audit,
# test_retrain and test_guard on -n 3 (2026-12-07, this 2-core VM, A B A B): 530 and 524
# CPU-s of the machine with torch's default (two threads), 490 and 473 with one.
_CORES = len(os.sched_getaffinity(0))
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS >= _CORES:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, _CORES // _WORKERS)))

from tests import servers  # noqa: E402 - after the thread count, which torch reads at import

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
LOBSTER_DIR = SHARED_DATA / "lobster"

# Anything that falls back to a temporary Prefect server (a flow called with no API set,
# in this process or in a subprocess given this environment) waits for its start as long
# as the session's own servers do, not Prefect's default 20 s: under a loaded 2-core CI
# machine a start took 30-74 s, and two tests of a fresh-clone suite failed on the 20 s.
SERVER_START_S = 300
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", str(SERVER_START_S))

# A `quantloop` subprocess of a test runs in-process, as `python -m quantloop.cli` does: a
# warm process (quantloop/forkserver.py) is keyed by the environment, and each test's own
# variables would start one more (450 MB, 7 s of imports) that outlives it by its idle
# timeout. tests/test_forkserver.py turns it on for its own commands.
os.environ.setdefault("QUANTLOOP_FORKSERVER", "0")

# Inductor compiles in this process, without its pool of compile workers: a compile that
# misses the cache starts one Python process a core, each importing torch (2-5 s of CPU
# here), which on the suite's busy two cores compile nothing sooner. test_compile_cache's
# three compiling processes: 61.7 CPU-s with the pool, 51.7 without (2026-12-05, one run
# each, alone; inside the suite the module's CPU did not move, 52.1 -> 53.6). The
# product keeps the pool for a real compile (profiling/trainer.no_compile_workers turns
# it off only where the cache was loaded).
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

MLFLOW_CREDENTIAL_VARS = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")

# Each xdist worker gets a temporary folder of its own, set before anything asks for one:
# tests that check nothing temporary is left behind there (test_catalog's S3 landing)
# would otherwise see another worker's files in flight. World-traversable (755), as /tmp
# is: the PostgreSQL server runs as its own user under it.
if os.environ.get("PYTEST_XDIST_WORKER"):
    import tempfile

    _WORKER_TMP = os.path.join(tempfile.gettempdir(), f"quantloop-tests-{os.getpid()}-"
                               f"{os.environ['PYTEST_XDIST_WORKER']}")  # fmt: skip
    os.makedirs(_WORKER_TMP, mode=0o755, exist_ok=True)
    os.chmod(_WORKER_TMP, 0o755)
    os.environ["TMPDIR"] = _WORKER_TMP
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again
    import shutil
    from multiprocessing import util as _mp_util

    # Removed with the worker (its servers are stopped by then): runs do not pile up in
    # /tmp. As multiprocessing's last finalizer, not an atexit hook: one ran before
    # multiprocessing removed its own pymp-* folder in here, which then printed a
    # FileNotFoundError traceback into CI's log (its finalizers run at priority -100).
    _mp_util.Finalize(None, shutil.rmtree, args=(_WORKER_TMP,),
                      kwargs={"ignore_errors": True}, exitpriority=-101)  # fmt: skip


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto`: one worker more than the cores, at most 4. The tests wait on servers and
    subprocesses much of their time: on this 2-core VM the suite took 13.5 min on 2
    workers (a fresh clone), 11.6 on 3 and 11.5 on 4 (the same tree). Each worker starts
    its own servers (a Prefect API and MLflow, ~1 GB)."""
    return max(1, min(4, len(os.sched_getaffinity(0)) + 1))


def pytest_configure(config) -> None:
    """`QUANTLOOP_TEST_CPU=FILE`: each test's CPU seconds appended to FILE (tests/cpu_use.py)."""
    if path := os.environ.get("QUANTLOOP_TEST_CPU"):
        from tests.cpu_use import CpuUse

        config.pluginmanager.register(CpuUse(path), "quantloop-cpu-use")


@pytest.hookimpl(wrapper=True)
def pytest_collection(session):
    """The test modules imported with the cyclic collector paused, then frozen
    (tasks/runtime/collector.py): the stack they import (Prefect, MLflow, torch, the
    flows) is not scanned again by every full collection of the session."""
    from quantloop.tasks.runtime import collector

    with collector.paused():
        return (yield)


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist worksteal` (pyproject's addopts) with its first share planned by measured
    time, a module's tests on one worker, the longest first (tests/scheduling.py)."""
    if config.getvalue("dist") != "worksteal":
        return None
    from tests.scheduling import BalancedWorkStealing

    return BalancedWorkStealing(config, log)


@contextlib.contextmanager
def env_restored(keys: tuple[str, ...]) -> Iterator[None]:
    """The environment variables `keys` as they were before the block, after it."""
    saved = {k: os.environ.get(k) for k in keys}
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture(autouse=True)
def _mlflow_credentials_restored():
    """Each test's changes to MLflow's credential variables end with it: tests that talk
    to servers of their own as other users set them, and so does a flow run in-process
    with a tracking block's credentials (tasks/records/tracking.client_for, for MLflow's
    REST client). A later test then met the session's MLflow server as another user, or
    as none: 401 for the 10 tests after test_guard and test_postgres in a fresh-clone
    suite (441cd06)."""
    with env_restored(MLFLOW_CREDENTIAL_VARS):
        yield


@pytest.fixture(scope="session")
def prefect_api() -> str:
    """One temporary Prefect server for the session (its start costs 15-25 s); its API
    URL, for the subprocesses (`quantloop run`) that should record to it too."""
    from prefect.settings import PREFECT_API_SSL_CERT_FILE, PREFECT_API_URL, temporary_settings
    from prefect.testing.utilities import prefect_test_harness

    from quantloop.tasks.runtime.prefect_settings import plain_http_tls

    with prefect_test_harness(server_startup_timeout=SERVER_START_S):
        url = PREFECT_API_URL.value()
        # its clients (in-process flows make several a run) load one certificate, as a
        # command's do (tasks/runtime/prefect_settings.py), not certifi's 117 each
        cert = plain_http_tls(url).get("PREFECT_API_SSL_CERT_FILE")
        with temporary_settings({PREFECT_API_SSL_CERT_FILE: cert} if cert else {}):
            yield url


# The session's MLflow server is locked (basic auth), as infra/ and `quantloop serve`
# run it: every test that records to it does so with credentials.
MLFLOW_USER, MLFLOW_PASSWORD = "quantloop-test", "test-password-" + os.urandom(6).hex()


@pytest.fixture(scope="session", autouse=True)
def _mlflow_started(request, tmp_path_factory) -> servers.MlflowServer | None:
    """The session's MLflow server, started with the session when any selected test
    needs it, and waited for only by the first that does: its start (~10 s of CPU)
    overlaps the tests before, and the Prefect server's start."""
    if not any("mlflow_uri" in getattr(item, "fixturenames", ()) for item in request.session.items):
        yield None
        return
    server = servers.MlflowServer(tmp_path_factory.mktemp("mlflow"),
                                  credentials=(MLFLOW_USER, MLFLOW_PASSWORD))  # fmt: skip
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def mlflow_uri(_mlflow_started) -> str:
    uri = _mlflow_started.ready(timeout=SERVER_START_S)
    with env_restored(MLFLOW_CREDENTIAL_VARS):
        os.environ.update(MLFLOW_TRACKING_USERNAME=MLFLOW_USER,
                          MLFLOW_TRACKING_PASSWORD=MLFLOW_PASSWORD)  # fmt: skip
        yield uri


@pytest.fixture(scope="session")
def s3_endpoint():
    """A moto S3 server; s3fs in this process and in Dask workers finds it via the env."""
    keys = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")
    with env_restored(keys), servers.s3_server() as endpoint:
        os.environ.update(
            AWS_ENDPOINT_URL=endpoint,
            AWS_ACCESS_KEY_ID="testing",
            AWS_SECRET_ACCESS_KEY="testing",
            # Not region_name in client_kwargs: moto then rejects bucket creation.
            AWS_DEFAULT_REGION="us-east-1",
        )
        yield endpoint


@pytest.fixture(scope="session")
def postgres() -> servers.PostgresServer:
    """One PostgreSQL server for the session, started by the first test that asks (1.7 s:
    initdb and start), stopped at the session's end (tests/servers.py)."""
    import shutil
    import tempfile

    # Not under pytest's basetemp: every pytest session sets /tmp/pytest-of-<user> back to
    # 700, which shuts the server's user (postgres, when the tests run as root) out of it.
    folder = Path(tempfile.mkdtemp(prefix="quantloop-postgres-"))
    try:
        with servers.postgres_server(folder) as server:
            yield server
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def postgres_db(postgres, request) -> str:
    """A database of its own for this test on the session's PostgreSQL; its URL."""
    import re

    test = re.sub(r"[^a-z0-9_]", "_", request.node.name.lower())[:40]
    name = f"t_{test}_{os.urandom(3).hex()}"
    return postgres.create_database(name)


@pytest.fixture
def lobster_dir() -> Path:
    if not LOBSTER_DIR.is_dir():
        pytest.skip(f"LOBSTER samples not found at {LOBSTER_DIR} (../shared/data/lobster)")
    return LOBSTER_DIR
