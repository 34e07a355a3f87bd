"""The auditor's commands (reproduce, nodes --run, promote) against a locked MLflow and
against a home with no store: one line saying what to do, never a traceback, and no
store made as a side effect; `quantloop serve`'s credentials for the home are found."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from quantloop.cli import app
from tests import servers

RUN = "0" * 32  # an MLflow run id no store has
COMMANDS = (["reproduce", RUN], ["promote", RUN], ["nodes", "--run", RUN])


def cli(*args: str):
    return CliRunner(env={"COLUMNS": "200"}).invoke(app, list(args))


@pytest.fixture(scope="module")
def locked(tmp_path_factory):
    """A basic-auth MLflow server (quantloop serve's ini) and its admin's credentials."""
    folder = tmp_path_factory.mktemp("locked")
    user = ("quantloop", "access-test-password")
    with servers.mlflow_server(folder, credentials=user) as uri:
        yield uri, user


@pytest.fixture
def no_credential_env(monkeypatch):
    for key in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
        monkeypatch.delenv(key, raising=False)


@pytest.mark.slow
def test_a_home_without_a_store_is_named_and_none_is_made(tmp_path, prefect_api):
    home = tmp_path / "home"
    for args in COMMANDS:
        out = cli(*args, "--home", str(home))
        assert out.exit_code == 2, (args, out.output)
        assert f"no MLflow store at {home}/mlflow.db" in out.output, out.output
        assert "Traceback" not in out.output
        assert not (home / "mlflow.db").exists(), args


@pytest.mark.slow
@pytest.mark.server
def test_a_locked_server_refusal_is_one_line_and_serves_credentials_are_found(
    locked, tmp_path, prefect_api, no_credential_env
):
    uri, (user, password) = locked
    home = tmp_path / "home"
    for args in COMMANDS:
        out = cli(*args, "--tracking-uri", uri, "--home", str(home))
        assert out.exit_code == 2, (args, out.output)
        lines = out.output.strip().splitlines()
        assert len(lines) == 1, out.output  # no traceback
        assert f"MLflow at {uri} refused the request (401: no credentials)" in lines[0]
        assert "MLFLOW_TRACKING_USERNAME" in lines[0]
        assert f"{home}/serve/credentials.json" in lines[0]
    # With serve's credentials file for the home (the one-user form of a stack served
    # before the identities; the current form is read in tests/test_guard.py), the same
    # command reaches the server and is told the run is not there.
    (home / "serve").mkdir(parents=True)
    (home / "serve" / "credentials.json").write_text(json.dumps(
        {"prefect_auth_string": "quantloop:x", "mlflow_user": user,
         "mlflow_password": password}))  # fmt: skip
    out = cli("reproduce", RUN, "--tracking-uri", uri, "--home", str(home))
    assert out.exit_code == 2 and f"no MLflow run {RUN} at {uri}" in out.output, out.output
