"""The servers on PostgreSQL: the session's real server (tests/servers.py), and
`quantloop serve --database` running Prefect's and MLflow's stores on it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import psycopg2
import pytest

from quantloop.database import DatabaseError, ServerDatabases
from quantloop.deploy import REPO_ROOT
from quantloop.identities import load as load_credentials
from tests.servers import free_port

SERVE_TIMEOUT_S = 420  # a first start on a busy 2-core machine (test_ui.py's bound)


def rows(url: str, statement: str) -> list[tuple]:
    conn = psycopg2.connect(url)
    try:
        with conn.cursor() as cur:
            cur.execute(statement)
            return cur.fetchall()
    finally:
        conn.close()


@pytest.mark.slow
def test_session_postgres_is_on_loopback_only_and_gives_each_test_a_database(postgres, postgres_db):
    [(listen, sockets)] = rows(
        postgres_db,
        "SELECT current_setting('listen_addresses'), current_setting('unix_socket_directories')",
    )
    assert listen == "127.0.0.1"
    assert Path(sockets) == postgres.sockets  # not /var/run/postgresql
    assert rows(postgres_db, "SELECT current_database()")[0][0] == postgres_db.rsplit("/", 1)[1]
    # The server runs as postgres when the tests run as root (it refuses root). Asked
    # while the connection is open: its backend process ends with it (a closed one's pid
    # was gone by the time psutil looked, in a suite on four workers).
    conn = psycopg2.connect(postgres_db)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT pg_backend_pid()")
            [(pid,)] = cur.fetchall()
            owner = psutil.Process(pid).username()
    finally:
        conn.close()
    assert owner == ("postgres" if os.geteuid() == 0 else psutil.Process().username())


def test_database_urls_name_a_database_per_server_and_never_show_the_password():
    dbs = ServerDatabases("postgresql://desk:s3cr%40t@db.example:5433/quant")
    assert dbs.prefect == "postgresql+asyncpg://desk:s3cr%40t@db.example:5433/quant_prefect"
    assert dbs.mlflow == "postgresql+psycopg2://desk:s3cr%40t@db.example:5433/quant_mlflow"
    assert (
        dbs.mlflow_auth == "postgresql+psycopg2://desk:s3cr%40t@db.example:5433/quant_mlflow_auth"
    )
    assert dbs.masked() == "postgresql://desk:***@db.example:5433/quant"
    for bad, says in [
        ("sqlite:///x.db", "not a postgresql:// URL"),
        ("postgresql://desk:pw@db/", "give a user, a host and a base name"),
        ("postgresql://desk:pw@db/a-b", "letters, digits and _ only"),
    ]:
        with pytest.raises(DatabaseError, match=says) as err:
            ServerDatabases(bad)
        assert ":pw@" not in str(err.value)


def serve_env(database: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
    # In the environment, as infra/README.md tells operators: off the command line.
    return {**env, "QUANTLOOP_SERVE_DATABASE": database}


@pytest.mark.slow
@pytest.mark.server
def test_serve_runs_prefect_and_mlflow_on_postgresql(postgres, tmp_path):
    import mlflow
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    # A role as an operator makes it (infra/README.md): a password, CREATEDB, not superuser.
    # Characters a URL must percent-encode, and that MLflow's auth ini must escape.
    secret = os.urandom(8).hex()
    password = "pg@%:" + secret
    # a role of its own: the session's server is shared (test_catalog_db makes "desk")
    postgres.sql(f"CREATE ROLE servedesk LOGIN CREATEDB PASSWORD '{password}'")
    database = postgres.url("quantdesk", user="servedesk", password=password)
    home, ports = tmp_path / "home", (free_port(), free_port())
    out = tmp_path / "serve.out"
    t0 = time.monotonic()
    with open(out, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "quantloop.cli", "serve", "--home", str(home),
             "--prefect-port", str(ports[0]), "--mlflow-port", str(ports[1])],
            stdout=log, stderr=subprocess.STDOUT, env=serve_env(database), cwd=REPO_ROOT,
        )  # fmt: skip
    try:
        while "ready in" not in out.read_text(errors="replace"):
            assert proc.poll() is None, f"serve exited {proc.returncode}:\n{out.read_text()}"
            assert time.monotonic() - t0 < SERVE_TIMEOUT_S, out.read_text()
            time.sleep(0.5)
        said = out.read_text()
        print(f"serve on PostgreSQL ready after {time.monotonic() - t0:.1f} s: "
              + [line for line in said.splitlines() if "ready in" in line][0])  # fmt: skip
        assert "quantdesk_prefect, quantdesk_mlflow, quantdesk_mlflow_auth (" in said
        assert "servedesk:***@" in said
        # Each server's database, owned by the role; nothing of theirs in SQLite files.
        owners = dict(
            rows(
                postgres.url(),
                "SELECT datname, pg_get_userbyid(datdba) "
                "FROM pg_database WHERE datname LIKE 'quantdesk%'",
            )
        )
        assert owners == {
            f"quantdesk_{s}": "servedesk" for s in ("prefect", "mlflow", "mlflow_auth")
        }
        assert not list(home.rglob("*.db")), list(home.rglob("*.db"))

        creds = load_credentials(home / "serve" / "credentials.json")
        api = f"http://127.0.0.1:{ports[0]}/api"
        settings = {PREFECT_API_URL: api, PREFECT_API_AUTH_STRING: creds.prefect_auth_string}
        with temporary_settings(settings), get_client(sync_client=True) as client:
            pool = client.read_work_pool("quantloop-local")
            deployments = {d.name for d in client.read_deployments()}
        url = ServerDatabases(database)
        prefect_db = url.for_server("prefect")
        assert rows(prefect_db, "SELECT id::text FROM work_pool WHERE name = 'quantloop-local'") \
            == [(str(pool.id),)]  # fmt: skip
        assert {n for (n,) in rows(prefect_db, "SELECT name FROM deployment")} == deployments
        assert deployments

        # A run recorded through the locked MLflow server, as the researcher, lands in
        # the tracking database; the identities in the auth database.
        os.environ.update(MLFLOW_TRACKING_USERNAME=creds.researcher.username,
                          MLFLOW_TRACKING_PASSWORD=creds.researcher.password)  # fmt: skip
        try:
            client = mlflow.MlflowClient(f"http://127.0.0.1:{ports[1]}")
            [experiment] = [e for e in client.search_experiments() if e.name != "Default"]
            run = client.create_run(experiment.experiment_id)
            client.log_metric(run.info.run_id, "markout_bps", 1.25)
        finally:
            for key in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
                os.environ.pop(key, None)
        assert rows(url.for_server("mlflow"), f"SELECT key, value FROM metrics WHERE run_uuid = "
                                f"'{run.info.run_id}'") == [("markout_bps", 1.25)]  # fmt: skip
        users = {u for (u,) in rows(url.for_server("mlflow_auth"), "SELECT username FROM users")}
        assert {creds.admin.username, creds.researcher.username} <= users

        # The password is on no command line, in no log and in no printed line.
        family = psutil.Process(proc.pid).children(recursive=True)
        assert family
        for p in family:
            assert secret not in " ".join(p.cmdline()), p.cmdline()
        for text in (said, *(f.read_text(errors="replace") for f in (home / "serve" / "logs")
                             .iterdir())):  # fmt: skip
            assert secret not in text
        assert oct((home / "serve" / "mlflow-auth.ini").stat().st_mode & 0o777) == "0o600"
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
    assert proc.returncode == 0, out.read_text()
    assert secret not in out.read_text()
