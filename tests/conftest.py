"""Session-wide real servers: one temporary Prefect API, one MLflow server, one S3 endpoint."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests import servers

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
LOBSTER_DIR = SHARED_DATA / "lobster"


@pytest.fixture(scope="session")
def prefect_api():
    """One temporary Prefect server for the session (its start costs 15-25 s)."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


# The session's MLflow server is locked (basic auth), as infra/ and `quantloop serve`
# run it: every test that records to it does so with credentials.
MLFLOW_USER, MLFLOW_PASSWORD = "quantloop-test", "test-password-" + os.urandom(6).hex()


@pytest.fixture(scope="session")
def mlflow_uri(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("mlflow")
    with servers.mlflow_server(folder, credentials=(MLFLOW_USER, MLFLOW_PASSWORD)) as uri:
        saved = {k: os.environ.get(k) for k in ("MLFLOW_TRACKING_USERNAME",
                                                "MLFLOW_TRACKING_PASSWORD")}  # fmt: skip
        os.environ.update(MLFLOW_TRACKING_USERNAME=MLFLOW_USER,
                          MLFLOW_TRACKING_PASSWORD=MLFLOW_PASSWORD)  # fmt: skip
        try:
            yield uri
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


@pytest.fixture(scope="session")
def s3_endpoint():
    """A moto S3 server; s3fs in this process and in Dask workers finds it via the env."""
    keys = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")
    saved = {k: os.environ.get(k) for k in keys}
    with servers.s3_server() as endpoint:
        os.environ.update(
            AWS_ENDPOINT_URL=endpoint,
            AWS_ACCESS_KEY_ID="testing",
            AWS_SECRET_ACCESS_KEY="testing",
            # Not region_name in client_kwargs: moto then rejects bucket creation.
            AWS_DEFAULT_REGION="us-east-1",
        )
        try:
            yield endpoint
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


@pytest.fixture
def lobster_dir() -> Path:
    if not LOBSTER_DIR.is_dir():
        pytest.skip(f"LOBSTER samples not found at {LOBSTER_DIR} (../shared/data/lobster)")
    return LOBSTER_DIR
