"""The `quantloop` command as a user runs it: what the console shows, what the log keeps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from quantloop.cli import app, rich_table
from quantloop.tasks.records.summary import ResearchSummary, markout_table
from tests import servers

HORIZONS = ["1s", "5s", "30s", "60s", "300s", "10ev", "100ev"]


def summary(**changes) -> ResearchSummary:
    curve = {h: -1.2345 for h in HORIZONS}
    values = dict(
        dataset="lobster", nodes=2, cache_hits=0, computed=2, markout_bps=curve,
        baseline_markout_bps={**curve, "300s": float("nan")}, hit_rate={"1s": 0.4567},
        baseline_hit_rate={"1s": 0.5}, trades=123_456, baseline_trades=98_765, per_product={},
        model_cached=False, simulation_cached=False, model_digest="m" * 64, model_url="x",
        data_digest="d" * 64, code_digest="c" * 64, params_hash="p" * 64, mlflow_run_id="r",
        mlflow_stage_runs={}, mlflow_experiment_id="1", tracking_uri="sqlite:///x",
        prefect_flow_run_id="f", wall_s=1.0,
    )  # fmt: skip
    return ResearchSummary(**{**values, **changes})


def test_markout_table_fits_an_80_column_terminal_without_cutting_a_name():
    console = Console(width=80, record=True, force_terminal=False)
    console.print(rich_table(markout_table(summary())))
    text = console.export_text()
    assert "…" not in text
    assert max(len(line) for line in text.splitlines()) <= 80
    for name in ("signal", "trades", *HORIZONS, "hit 1s", "model", "baseline", "123,456"):
        assert name in text, name
    assert "-1.23" in text and "nan" in text and "45.7%" in text


def test_markout_table_as_markdown_is_the_same_table():
    md = markout_table(summary()).markdown().splitlines()
    assert md[0] == "| signal | trades | " + " | ".join(HORIZONS) + " | hit 1s |"
    assert md[1] == "|---|" + "---:|" * (len(HORIZONS) + 2)
    assert md[2].startswith("| model | 123,456 | -1.23 |")


@pytest.mark.slow
def test_run_shows_stage_lines_and_keeps_dask_chatter_in_the_log(prefect_api, tmp_path):
    """`quantloop run` on a tiny synthetic set: the console has the stage lines and the
    table, not Dask's INFO lines; the log file has those. It records to the session's
    Prefect API (a configured API, as PREFECT_API_URL gives it), not a server of its own:
    tests/test_local_api.py starts those."""
    params = tmp_path / "params.json"
    params.write_text(json.dumps({
        "data": {"products": ["SYNA"], "n_dates": 2,
                 "synthetic": {"events_per_day": 2_000, "levels": 2}},
        "train": {"steps": 10, "batch_size": 32},
        "validation": {"folds": 1},  # two dates fit one walk-forward fold
    }))  # fmt: skip
    # QUANTLOOP_INLINE_BELOW_S=0: the LocalCluster starts (these 2 small first nodes would
    # run in the flow's process), so that Dask's lines are there to keep off the console
    # XDG_CACHE_HOME a file: no migrated empty MLflow store to copy (tasks/records/
    # mlflow_db.py), so MLflow creates the new home's tables itself and says so: its line
    # must reach the log, not the console
    (tmp_path / "no-cache").write_text("")
    env = servers.prefect_env(tmp_path / "prefect", PREFECT_API_URL=prefect_api, COLUMNS="80",
                              QUANTLOOP_INLINE_BELOW_S="0",
                              XDG_CACHE_HOME=str(tmp_path / "no-cache"))  # fmt: skip
    exe = Path(sys.executable).with_name("quantloop")
    home = tmp_path / "home"
    proc = subprocess.run(
        [str(exe), "run", "--params", str(params), "--home", str(home),
         "--summary-json", str(tmp_path / "summary.json"), "--workers", "1"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    console = proc.stdout + proc.stderr
    assert proc.returncode == 0, console[-4000:]
    for line in ("data: 2 partitions of synthetic: 2 new", "features: 2 nodes",
                 "validation: 1 fold(s): fold 0: train 2026-03-02, test 2026-03-03",
                 "train: fold 0 (train 2026-03-02, test 2026-03-03): trained on", "simulate: ",
                 "Mark-out on held-out data"):  # fmt: skip
        assert line in console, line
    assert "distributed." not in console and "| INFO" not in console, console
    # MLflow's own lines go to the log. (Its "Successfully registered model" print was
    # one until 12d0f2b registered versions through the client's calls: MLflow no longer
    # prints it.)
    assert "Creating initial MLflow database tables" not in console
    assert "Successfully registered model" not in console
    [log] = (home / "logs").glob("run-*.log")
    kept = log.read_text()
    assert "distributed.scheduler" in kept and "Beginning flow run" in kept
    assert "mlflow.store.db.utils - Creating initial MLflow database tables" in kept
    assert json.loads((tmp_path / "summary.json").read_text())["nodes"] == 2


# ---------------------------------------------------------------- bad input, refused early


def run_cli(*args: str):
    from typer.testing import CliRunner

    from quantloop.cli import app

    return CliRunner(env={"COLUMNS": "400"}).invoke(app, ["run", *args])


def write_json(path: Path, value) -> Path:
    path.write_text(json.dumps(value) if not isinstance(value, str) else value)
    return path


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"data": {"products": []}}, "data.products: List should have at least 1 item"),
        ({"data": {"products": ["A", "A"]}}, "products listed more than once: ['A']"),
        ({"data": {"products": ["bad name!"]}}, "'bad name!' is not a valid product name"),
        ({"data": {"start_date": "1800-01-02"}}, "data.start_date: Input should be greater"),
        ({"train": {"stepz": 3}}, "train.stepz"),
        ({"product_features": {"SYNA": {"ofi_windw": 3}}},
         "product_features.SYNA.ofi_windw: Extra inputs are not permitted"),
        ({"product_features": {"SYNA": {"imbalance_levels": 3}}},
         "product_features.SYNA: imbalance_levels cannot differ per product: it changes the "
         "feature columns"),
        ({"train": {"device": "gpu"}}, "train.device: Input should be 'auto', 'cpu' or 'cuda'"),
        ({"product_features": {"NOPE": {"ofi_window": 3}}},
         "product_features names products not in this run: ['NOPE']"),
        ({"data": {"synthetic": {"events_per_day": 50}}},
         "too little data to train: SYNA, SYNB, SYNC have at most 50 events a day"),
        ({"data": {"n_dates": 2}},
         "validation: too few dates for folds=2: 2 dates, but 2 fold(s) need 3"),
        ({"data": {"n_dates": 6}, "validation": {"embargo_dates": 5}},
         "validation: too few dates for folds=2: 6 dates, but 2 fold(s) need 8: the first "
         "trains on 1 (min_train_dates=1, train_dates=0), skips embargo_dates=5"),
        ({"validation": {"folds": 2, "test_dates": None}},
         "validation: test_dates=None (hold out the last holdout_fraction of the dates) makes "
         "one fold, but folds=2"),
        ({"holdout_fraction": 0.3, "validation": {"holdout_fraction": 0.2}},
         "holdout_fraction=0.3 and validation.holdout_fraction=0.2 disagree"),
        ("{\"data\": {", "not valid JSON: Expecting property name enclosed in double quotes at "
                         "line 1, column 11"),
        ("[1, 2]", "expected a JSON object of parameters, got list"),
    ],
)  # fmt: skip
def test_bad_parameters_fail_in_one_line_before_anything_starts(tmp_path, params, message):
    home = tmp_path / "home"
    result = run_cli("--params", str(write_json(tmp_path / "p.json", params)), "--home", str(home))
    assert result.exit_code == 2, result.output
    assert message in result.output
    error_lines = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1 and "Traceback" not in result.output
    assert not home.exists()  # no catalog, no MLflow store, no log: nothing was started


def test_a_missing_params_file_is_named(tmp_path):
    result = run_cli("--params", str(tmp_path / "nope.json"))
    assert result.exit_code == 2 and f"--params {tmp_path / 'nope.json'}: No such file" in (
        result.output
    )


def test_a_folder_of_bad_lobster_files_is_refused_naming_each(tmp_path):
    from tests.test_ingest import BOOK, MSG

    folder = tmp_path / "lobster"
    folder.mkdir()
    faults = {
        "AAA": (MSG[:2] + [MSG[2] + ",7"] + MSG[3:], BOOK),  # a column too many
        "BBB": (MSG, BOOK[:2] + ["999000,100,1000000,200,9999999999,0,-9999999999,0"]
                + BOOK[3:]),  # crossed book
        "CCC": ([MSG[0], "34200.20,1,2,fifty,999900,1"] + MSG[2:], BOOK),  # not a number
    }  # fmt: skip
    for ticker, (msg, book) in faults.items():
        stem = f"{ticker}_2024-01-02_34200000_57600000"
        (folder / f"{stem}_message_2.csv").write_text("\n".join(msg) + "\n")
        (folder / f"{stem}_orderbook_2.csv").write_text("\n".join(book) + "\n")
    home = tmp_path / "home"
    result = run_cli("--lobster", str(folder), "--home", str(home))
    assert result.exit_code == 2, result.output
    assert "3 of 3 LOBSTER files are invalid" in result.output
    for where in ("AAA_2024-01-02_34200000_57600000_message_2.csv: row 3",
                  "BBB_2024-01-02_34200000_57600000_orderbook_2.csv: row 3",
                  "CCC_2024-01-02_34200000_57600000_message_2.csv: row 2, column 4"):  # fmt: skip
        assert where in result.output, where
    assert "Traceback" not in result.output and not home.exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["retrain", "--alias", "champ ion"], "--alias 'champ ion': give a version number (3) or "
                                              "an alias (champion)"),
        (["retrain", "--days", "0"], "--days must be >= 1, got 0"),
        (["backtest", "--version", "v 2"], "--version 'v 2': give a version number"),
        (["backtest", "--products", "SYNA,bad name!"],
         "--products: product 'bad name!' is not a valid product name"),
        (["backtest", "--start", "2026-03-05", "--end", "2026-03-02"],
         "--start 2026-03-05 is after --end 2026-03-02"),
        (["backtest", "--device", "gpu"], "--device 'gpu': give auto, cpu, cuda or cuda:N"),
        (["backtest", "--shard-size", "0"], "--shard-size must be >= 1, got 0"),
    ],
)  # fmt: skip
def test_bad_retrain_and_backtest_input_fails_in_one_line_before_anything_starts(
    tmp_path, args, message
):
    home = tmp_path / "home"
    result = CliRunner(env={"COLUMNS": "200"}).invoke(app, [*args, "--home", str(home)])
    assert result.exit_code == 2, result.output
    assert message in result.output
    error_lines = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1 and "Traceback" not in result.output
    assert not home.exists()  # no catalog, no MLflow store: nothing was started


def test_a_summary_reads_back_from_its_json_with_untested_horizons():
    """--summary-json writes NaN (an untested horizon's SE) as null: it reads back as NaN
    and the table and notes still render."""
    import math

    from quantloop.tasks.records.summary import validity_notes

    nan = float("nan")
    s = summary(markout_se_bps={h: nan for h in HORIZONS},
                paired_bps={"1s": {"mean_bps": 0.1, "se_bps": nan, "significant": False}},
                pnl={"model": {"horizon": "300s", "days": {"d": 1.0}, "total_bps": 1.0,
                               "se_bps": nan}})  # fmt: skip
    text = json.dumps(json.loads(s.model_dump_json()))
    assert "NaN" not in text
    back = ResearchSummary.model_validate_json(text)
    assert math.isnan(back.markout_se_bps["1s"]) and math.isnan(back.baseline_markout_bps["300s"])
    assert "n/a" in markout_table(back).markdown()
    assert any("(n/a) bps over 1 day(s)" in n for n in validity_notes(back))


@pytest.mark.parametrize("command", ["run", "nodes", "backtest", "retrain", "serve"])
def test_help_shows_the_defaults_and_flags_as_flags(command):
    """`quantloop <command> --help` as a user's terminal shows it: every `[default: ...]`
    (given by the option or written in its help) and boolean flags as `--flag` or
    `--flag/--no-flag`, never with a `<bool>` value. (Rich markup ate the written
    defaults as unknown style tags, and its panels gave every flag a `<bool>` type.)"""
    exe = Path(sys.executable).with_name("quantloop")
    proc = subprocess.run([str(exe), command, "--help"], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "COLUMNS": "200"})  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())  # one line: a wrapped help text still matches
    assert "<bool>" not in text
    expected = {
        "run": ["[default: .quantloop]", "[default: SQLite in home]", "[default: 2]",
                "--profile ", "-v, --verbose "],
        "nodes": ["[default: 20]", "[default: features]", "--cache-hit / --computed",
                  "--all-runs ", "--json "],
        "backtest": ["[default: all]", "[default: the model's]"],
        "retrain": ["[default: as many as the version's]"],
        "serve": ["[default: infra/prefect.yaml]"],
    }[command]  # fmt: skip
    for part in expected:
        assert part in text, part


def recorded_workspace(home: Path) -> tuple[list[str], str, str]:
    """A home whose store holds one recorded features run of 4 nodes, one of them failed
    with a long error: the keys, the run's name and the error."""
    import datetime as dt

    import pyarrow as pa

    from quantloop.tasks.data.catalog import Catalog
    from quantloop.tasks.data.schema import Partition
    from quantloop.tasks.engine import storage
    from quantloop.tasks.research.features import FeatureParams
    from quantloop.tasks.research.planning import feature_kind, plan_feature_table, product_params
    from tests.books import random_book
    from tests.test_manifest import record_run

    root = str(home / "store")
    catalog = Catalog(home / "catalog.sqlite")
    parts = [
        (Partition(p, d), random_book(100, seed=i))
        for i, (p, d) in enumerate(
            (p, d) for p in ("AAA", "BBB") for d in (dt.date(2026, 1, 5), dt.date(2026, 1, 6))
        )
    ]
    catalog.land_packed("d", parts, root=root)
    kind = feature_kind()
    nodes, by_digest = plan_feature_table(catalog.table("d"), product_params(
        FeatureParams(), {}, ["AAA", "BBB"]), kind)  # fmt: skip
    name = "20260105T000000-a-run-whose-name-is-longer-than-fifteen"
    records = record_run(root, name, kind, by_digest, nodes)
    error = "ValueError: " + "the book of this partition is crossed at row 1234; " * 4
    first = records.parts()[0]
    table = storage.read_parquet(first)
    n = table.num_rows
    table = table.set_column(
        table.schema.get_field_index("status"), "status", pa.array(["failed"] + ["ok"] * (n - 1))
    )
    table = table.set_column(table.schema.get_field_index("error"), "error",
                             pa.array([error] + [""] * (n - 1)))  # fmt: skip
    storage.write_parquet_atomic(first, table)
    return nodes["key"].to_pylist(), name, error


def test_nodes_piped_prints_every_value_whole(tmp_path):
    """`quantloop nodes > file` (stdout not a terminal) writes tab-separated rows with
    every value whole, on stdout; it cut every column to fit 80 characters (16 of a
    64-character key, 15 of a run's name, 40 of an error) and printed to stderr."""
    home = tmp_path / "home"
    keys, name, error = recorded_workspace(home)
    exe = Path(sys.executable).with_name("quantloop")
    proc = subprocess.run([str(exe), "nodes", "--home", str(home)], capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    header = lines[0].split("\t")
    assert header[:4] == ["key", "product", "date", "status"], lines[0]
    rows = [dict(zip(header, line.split("\t"), strict=True)) for line in lines[1:]]
    assert sorted(r["key"] for r in rows) == sorted(keys) and len(keys[0]) == 64
    assert {r["run"] for r in rows} == {name}
    assert [r["error"] for r in rows if r["status"] == "failed"] == [error]
    assert "…" not in proc.stdout
    assert "4 of 4 nodes match" in proc.stderr  # the count is for the reader, not the file

    # --format json and the older --json give the same rows, whole
    for args in (["--format", "json"], ["--json"]):
        proc = subprocess.run([str(exe), "nodes", "--home", str(home), *args],
                              capture_output=True, text=True, timeout=120)  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        found = json.loads(proc.stdout)
        assert sorted(r["key"] for r in found) == sorted(keys), args
        assert [r["error"] for r in found if r["status"] == "failed"] == [error]


def test_nodes_table_on_a_terminal_fits_its_width_keeping_the_short_columns():
    """On a terminal the table is cut to its width: the key, the error and the run's name
    give up what is lacking; the product, date, status and timings stay whole."""
    from quantloop.cli.nodes import fitted_table

    row = ("dd571d20a821b80d", "AAA", "2026-01-05", "failed", "", "new",
           "ValueError: the book is crossed at row 1234; " * 3, "100", "27.40", "local",
           "20260105T000000-a-run-whose-name-is-long")  # fmt: skip
    for width in (80, 120):
        console = Console(width=width, record=True, force_terminal=False)
        console.print(fitted_table([row], width))
        lines = console.export_text().splitlines()
        assert max(len(line) for line in lines) <= width, width
        for whole in ("AAA", "2026-01-05", "failed", "new", "27.40", "local"):
            assert whole in lines[-1], (width, whole)
    assert "dd571d20a821b80d" in lines[-1] and "…" in lines[-1]  # 120: the key fits, not all


@pytest.mark.slow
def test_run_on_a_served_home_records_through_serves_mlflow(prefect_api, mlflow_uri, tmp_path):
    """A home that `quantloop serve` serves (its stack file names a live process and its
    MLflow): `quantloop run` there records through that MLflow, so the run's artifacts are
    served (mlflow-artifacts:/, loadable from another host), not written beside a SQLite
    file on this disk, as serve's researcher, whose credentials it finds in the home. Here
    the stack file names this test's process and the session's MLflow server (locked; its
    user stands for the researcher), so no serve has to start."""
    import psutil
    from mlflow.tracking import MlflowClient

    from tests.conftest import MLFLOW_PASSWORD, MLFLOW_USER

    home = tmp_path / "home"
    (home / "serve").mkdir(parents=True)
    me = psutil.Process()
    (home / "serve" / "stack.json").write_text(json.dumps({
        "api_url": prefect_api, "mlflow_url": mlflow_uri, "pid": me.pid,
        "pid_created": f"{me.create_time():.2f}", "auth": True}))  # fmt: skip
    (home / "serve" / "credentials.json").write_text(json.dumps({"mlflow": {
        "researcher": {"username": MLFLOW_USER, "password": MLFLOW_PASSWORD}}}))  # fmt: skip
    params = tmp_path / "params.json"
    params.write_text(json.dumps({
        "data": {"products": ["SYNA"], "n_dates": 2,
                 "synthetic": {"events_per_day": 2_000, "levels": 2, "seed": 7}},
        "train": {"steps": 10, "batch_size": 32, "seed": 7},
        "validation": {"folds": 1},
    }))  # fmt: skip
    env = servers.prefect_env(tmp_path / "prefect", PREFECT_API_URL=prefect_api)
    env = {k: v for k, v in env.items() if not k.startswith("MLFLOW_TRACKING")}
    exe = Path(sys.executable).with_name("quantloop")
    proc = subprocess.run(
        [str(exe), "run", "--params", str(params), "--home", str(home),
         "--summary-json", str(tmp_path / "summary.json"), "--workers", "1"],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    console = proc.stdout + proc.stderr
    assert proc.returncode == 0, console[-4000:]
    assert f"MLflow: quantloop serve's at {mlflow_uri} as {MLFLOW_USER}" in console
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["tracking_uri"] == mlflow_uri
    run = MlflowClient(mlflow_uri).get_run(summary["mlflow_run_id"])
    assert run.info.artifact_uri.startswith("mlflow-artifacts:/"), run.info.artifact_uri
    assert not (home / "mlflow.db").exists()  # nothing recorded beside the home
