"""Locked servers: MLflow behind its basic-auth app, Prefect behind an API auth string.

The session's MLflow server (conftest.py) runs with basic auth, so every test that
records a run does so with credentials; here: without them a request gets 401, and a
tracking block's credentials are enough on their own and never shown.
"""

from __future__ import annotations

import os
import urllib.error
import urllib.request

import pytest
from pydantic import SecretStr

from quantloop.blocks import MlflowTracking
from quantloop.tasks.records import tracking
from tests.conftest import MLFLOW_PASSWORD, MLFLOW_USER

CREDENTIAL_ENV = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")


def status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


@pytest.fixture
def no_credential_env(monkeypatch):
    for key in CREDENTIAL_ENV:
        monkeypatch.delenv(key, raising=False)


@pytest.mark.slow
@pytest.mark.server
def test_mlflow_refuses_a_request_without_credentials(mlflow_uri):
    assert status(f"{mlflow_uri}/api/2.0/mlflow/experiments/search?max_results=1") == 401
    assert status(f"{mlflow_uri}/") == 401  # the UI too
    assert status(f"{mlflow_uri}/health") == 200  # what a load balancer probes


@pytest.mark.slow
@pytest.mark.server
def test_a_wrong_password_is_refused_after_the_right_one_was_accepted(mlflow_uri):
    # the server caches good credential checks (auth_cache_ttl_seconds): the cache is keyed
    # by the password too, so a wrong one still gets 401 right after the right one
    import base64

    def with_password(password: str) -> int:
        url = f"{mlflow_uri}/api/2.0/mlflow/experiments/search?max_results=1"
        token = base64.b64encode(f"{MLFLOW_USER}:{password}".encode()).decode()
        req = urllib.request.Request(url, headers={"Authorization": f"Basic {token}"})
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status
        except urllib.error.HTTPError as exc:
            return exc.code

    assert with_password(MLFLOW_PASSWORD) == 200
    assert with_password(MLFLOW_PASSWORD + "x") == 401
    assert with_password(MLFLOW_PASSWORD) == 200


def test_mlflow_reads_the_credential_cache_we_configure(tmp_path, monkeypatch):
    """The cache is invisible to a client (a password change drops its entry at once), and
    MLflow reads an unknown or renamed key as 0, off: so read `quantloop serve`'s file the
    way the server does. (Its effect is measured in bench/mlflow_auth.py.)"""
    from mlflow.server.auth.config import read_auth_config

    from quantloop.serve import MLFLOW_AUTH_INI

    ini = tmp_path / "auth.ini"
    ini.write_text(MLFLOW_AUTH_INI.format(db=tmp_path / "auth.db", user=MLFLOW_USER))
    monkeypatch.setenv("MLFLOW_AUTH_CONFIG_PATH", str(ini))
    config = read_auth_config()
    assert config.auth_cache_ttl_seconds == 300 and config.auth_cache_max_size > 0
    assert config.admin_username == MLFLOW_USER and config.default_permission == "READ"
    assert not config.grant_default_workspace_access


@pytest.mark.slow
@pytest.mark.server
def test_a_tracking_block_carries_its_own_credentials(mlflow_uri, no_credential_env):
    locked = MlflowTracking(tracking_uri=mlflow_uri, experiment="auth-test")
    with pytest.raises(Exception, match="401|Unauthorized|credentials"):
        tracking.client_for(locked)
    block = locked.model_copy(update={"username": MLFLOW_USER,
                                      "password": SecretStr(MLFLOW_PASSWORD)})  # fmt: skip
    client, experiment = tracking.client_for(block)
    with tracking.run(client, experiment, "with-block-credentials") as run:
        run.metrics({"x": 1.0})
    assert client.get_run(run.run_id).data.metrics["x"] == 1.0
    # The secret stays secret wherever the block is shown.
    assert MLFLOW_PASSWORD not in repr(block) and MLFLOW_PASSWORD not in str(block.model_dump())
    assert MLFLOW_PASSWORD not in block.model_dump_json()
    assert os.environ["MLFLOW_TRACKING_USERNAME"] == MLFLOW_USER
