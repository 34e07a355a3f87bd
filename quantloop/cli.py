"""The `quantloop` command line: run the research loop, serve the local stack, deploy,
query nodes, retrain and backtest registered models, run the ladder."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError
from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from quantloop.tasks.summary import TextTable, markout_table, validity_notes

# Options several commands share.
HomeOption = Annotated[
    str | None, typer.Option(help="Folder for the embedded defaults [default: .quantloop]")
]
TrackingUriOption = Annotated[
    str | None, typer.Option(help="MLflow tracking URI [default: SQLite in home]")
]
SummaryJsonOption = Annotated[
    Path | None, typer.Option("--summary-json", help="Also write the result here, as JSON.")
]
VerboseOption = Annotated[
    bool, typer.Option("--verbose", "-v", help="Log lines on the console, not only in the log")
]

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)
console = Console(stderr=True)


@app.callback()
def main() -> None:
    """quantloop: the research loop of a systematic trading desk, on Prefect, Dask and MLflow."""
    # The embedded Prefect server would try to send usage telemetry on start-up and log
    # an error on a machine without internet; an operator can still turn it back on.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


class _Console:
    """The progress sink of `quantloop run`: a bar per stage, one line per stage note."""

    def __init__(self, bar: Progress):
        self.bar = bar
        self.tasks: dict[str, int] = {}

    def report(self, stage: str, done: int, total: int) -> None:
        if stage not in self.tasks:
            self.tasks[stage] = self.bar.add_task(stage, total=total)
        self.bar.update(self.tasks[stage], completed=done, total=total)

    def note(self, stage: str, message: str) -> None:
        self.bar.console.print(f"[bold]{stage}[/bold]: {message}", highlight=False)


def rich_table(table: TextTable) -> Table:
    """A text table for the terminal: no vertical rules, so ten columns of mark-out fit
    in 80 columns without cutting a name."""
    out = Table(
        title=table.title,
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        padding=(0, 1),
        collapse_padding=True,
    )
    for name, numeric in zip(table.columns, table.numeric, strict=True):
        out.add_column(name, justify="right" if numeric else "left", no_wrap=True)
    for row in table.rows:
        out.add_row(*row)
    return out


def quiet_console() -> None:
    """No log lines on the console: it shows progress bars, one line per stage, and
    one line for an error; every log line goes to the run's log file and the Prefect
    API. (A failed run used to print its traceback three times: task, stage, flow.)

    Prefect's console handler takes its level from the environment when Prefect sets
    up logging on import, so this runs before Prefect is imported. Dask's INFO lines
    (scheduler, nanny, close-stream) reach the console through the root logger's
    handler, so its level keeps them off the console too.
    """
    for handler in ("CONSOLE", "CONSOLE_FLOW_RUNS", "CONSOLE_TASK_RUNS"):
        os.environ.setdefault(f"PREFECT_LOGGING_HANDLERS_{handler}_LEVEL", "CRITICAL")


@contextlib.contextmanager
def log_file(path: Path, *, quiet: bool) -> Iterator[None]:
    """Every INFO record of the run (Prefect, Dask, MLflow, quantloop) goes to `path`;
    with `quiet`, MLflow's own console handler shows only warnings too."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setLevel(logging.INFO)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(name)s - %(message)s"))
    undo: list = []
    logging.getLogger().addHandler(handler)
    undo.append(lambda: logging.getLogger().removeHandler(handler))
    # Dask's loggers drop INFO themselves unless told otherwise, and so would
    # quantloop's own (the root logger stays at WARNING); MLflow's does not propagate to
    # the root (it has a console handler of its own).
    for name in ("distributed", "mlflow", "quantloop"):
        logger = logging.getLogger(name)
        level = logger.level
        logger.setLevel(logging.INFO)
        undo.append(lambda logger=logger, level=level: logger.setLevel(level))
        if logger.propagate:
            continue
        logger.addHandler(handler)
        undo.append(lambda logger=logger: logger.removeHandler(handler))
        for own in logger.handlers:
            if quiet and isinstance(own, logging.StreamHandler) and own is not handler:
                old = own.level
                own.setLevel(logging.CRITICAL)
                undo.append(lambda own=own, old=old: own.setLevel(old))
    try:
        yield
    finally:
        for step in reversed(undo):
            step()
        handler.close()


def fail(message: str, *, code: int = 2, verbose: bool = False, exc: Exception | None = None):
    """Print one error (no traceback unless verbose) and exit: 2 for bad input, 1 for a
    run that failed."""
    if verbose and exc is not None:
        console.print_exception()
    console.print(f"[bold red]error:[/bold red] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def read_params(path: Path) -> dict:
    """The research parameters of a JSON file; a missing or malformed file is named."""
    try:
        values = json.loads(path.read_text())
    except OSError as exc:
        fail(f"--params {path}: {exc.strerror or exc}")
    except json.JSONDecodeError as exc:
        fail(f"--params {path}: not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}")
    if not isinstance(values, dict):
        fail(f"--params {path}: expected a JSON object of parameters, got {type(values).__name__}")
    return values


def validation_errors(exc: ValidationError) -> list[str]:
    """One `field.path: what is wrong (given: value)` per error of a parameter model."""
    out = []
    for err in exc.errors(include_url=False):
        where = ".".join(str(p) for p in err["loc"]) or "parameters"
        message = err["msg"].removeprefix("Value error, ")
        given = "" if err["type"] == "missing" else f" (given: {err['input']!r:.60})"
        out.append(f"{where}: {message}{given}")
    return out


@app.command()
def run(
    lobster: Annotated[
        Path | None, typer.Option(help="Folder or file of LOBSTER data; default: synthetic.")
    ] = None,
    summary_json: SummaryJsonOption = None,
    params: Annotated[
        Path | None,
        typer.Option(help="JSON file of research parameters (the flow's form, as JSON)."),
    ] = None,
    home: HomeOption = None,
    tracking_uri: TrackingUriOption = None,
    workers: Annotated[int | None, typer.Option(help="LocalCluster workers [default: 2]")] = None,
    verbose: VerboseOption = False,
) -> None:
    """Run the research flow: data -> features -> train -> simulate -> MLflow."""
    if not verbose:
        quiet_console()
    from quantloop.flows.params import ResearchParams
    from quantloop.tasks import progress
    from quantloop.tasks.reaper import reap_on_death

    values = read_params(params) if params else {}
    ws = values.setdefault("workspace", {})
    if home is not None:
        ws["home"] = home
    if tracking_uri is not None:
        ws["tracking_uri"] = tracking_uri
    if workers is not None:
        ws["n_workers"] = workers
    if lobster is not None:
        if not lobster.exists():
            fail(f"--lobster: {lobster} does not exist")
        values.setdefault("data", {})["lobster_dir"] = str(lobster.resolve())
    source = f"--params {params}" if params else "the parameters"
    try:
        research_params = ResearchParams.model_validate(values)
    except ValidationError as exc:
        fail(f"{source}: " + "; ".join(validation_errors(exc)))
    # Bad input fails here, in seconds, before any server starts: the LOBSTER folder
    # is read and validated whole, overrides checked against its products.
    try:
        research_params.preflight()
    except (ValueError, OSError) as exc:
        fail(str(exc), verbose=verbose, exc=exc)

    # Imported after the checks (torch, Prefect and MLflow take seconds to import) but
    # before the log file's set-up, which quiets the console handler MLflow adds to its
    # logger on import.
    from quantloop.flows.research import research

    stamp = dt.datetime.now().strftime("%Y%m%dT%H%M%S")
    log_path = Path(research_params.workspace.home_abs) / "logs" / f"run-{stamp}.log"
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn())
    with (
        log_file(log_path, quiet=not verbose),
        Progress(*columns, TimeElapsedColumn(), console=console, transient=False) as bar,
    ):
        progress.install(_Console(bar))
        try:
            # A kill -9 of this command ends the temporary Prefect server and the Dask
            # processes with it (tasks/reaper.py).
            with reap_on_death():
                summary = research(research_params)
        except Exception as exc:  # noqa: BLE001 - one line for the user, the rest in the log
            bar.stop()
            logging.getLogger("quantloop").exception("the research run failed")
            fail(
                f"{type(exc).__name__}: {exc}\nfull traceback: {log_path}"
                + ("" if verbose else " (or run with --verbose)"),
                code=1, verbose=verbose, exc=exc,
            )  # fmt: skip
        finally:
            progress.install(None)
    console.print(rich_table(markout_table(summary)))
    for note in validity_notes(summary):
        console.print(note, soft_wrap=True)
    cached = [n for n, hit in (("model", summary.model_cached),
                               ("simulation", summary.simulation_cached)) if hit]  # fmt: skip
    console.print(
        f"feature nodes: {summary.nodes:,} ({summary.cache_hits:,} cache hits, "
        f"{summary.computed:,} computed); wall {summary.wall_s:.1f} s"
        + (f"; cached, not recomputed: {', '.join(cached)}" if cached else "")
    )
    console.print(f"MLflow run {summary.mlflow_run_id} at {summary.tracking_uri}", soft_wrap=True)
    console.print(f"log: {log_path}", soft_wrap=True)
    if summary_json is not None:
        summary_json.parent.mkdir(parents=True, exist_ok=True)
        tmp = summary_json.with_name(f".{summary_json.name}.tmp-{os.getpid()}")
        tmp.write_text(summary.model_dump_json(indent=2))
        os.replace(tmp, summary_json)
        console.print(f"summary written to {summary_json}", soft_wrap=True)


def _workspace(home: str | None, tracking_uri: str | None):
    from quantloop.tasks.workspace import Workspace

    values = {k: v for k, v in (("home", home), ("tracking_uri", tracking_uri)) if v is not None}
    return Workspace(**values)


def _write_json(path: Path | None, value: dict) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(value, indent=2, default=str))
    os.replace(tmp, path)
    console.print(f"summary written to {path}", soft_wrap=True)


RunArgument = Annotated[
    str, typer.Argument(help="The research run: its MLflow run id or its Prefect flow run id")
]


@app.command()
def reproduce(
    run: RunArgument,
    sample: Annotated[
        int, typer.Option(help="Feature nodes to re-run, drawn with a fixed seed; 0: all")
    ] = 20,
    models: Annotated[
        bool, typer.Option("--models/--nodes-only", help="Also re-train the model and replay")
    ] = True,
    summary_json: SummaryJsonOption = None,
    home: HomeOption = None,
    tracking_uri: TrackingUriOption = None,
    verbose: VerboseOption = False,
) -> None:
    """Re-run a research run's nodes, model and simulation from their recorded inputs,
    without the cache, and compare; exits 1 if anything does not reproduce."""
    if not verbose:
        quiet_console()
    from quantloop.flows.reproduce import reproduce as reproduce_flow

    try:
        report = reproduce_flow(run, sample=sample or None, models=models,
                                workspace=_workspace(home, tracking_uri))  # fmt: skip
    except LookupError as exc:
        fail(str(exc))
    table = Table(title="Reproduction", box=box.SIMPLE_HEAD, collapse_padding=True)
    for col in ("what", "of", "key", "reproduced", "reason"):
        table.add_column(col, no_wrap=col != "reason")
    for c in report["checks"]:
        table.add_row(c["what"], c["label"], c["key"][:12], "yes" if c["reproduced"] else "NO",
                      c["reason"])  # fmt: skip
    console.print(table)
    console.print(f"{report['nodes']} re-run, {report['failures']} failed: failure rate "
                  f"{report['failure_rate']:.3f} ({report['seconds']:.1f} s)")  # fmt: skip
    _write_json(summary_json, report)
    if report["failures"]:
        raise typer.Exit(1)


@app.command()
def replicate(
    to: Annotated[
        str, typer.Option("--to", help="The saved quantloop Site block that gets the copies.")
    ],
    dataset: Annotated[str, typer.Option(help="Catalog dataset.")] = "synthetic",
    products: Annotated[
        str | None, typer.Option(help="Comma-separated products; default: all.")
    ] = None,
    home: HomeOption = None,
    verbose: VerboseOption = False,
) -> None:
    """Copy landed partitions to another site (digests checked) and record the copies in
    the catalog: placement can then run their nodes at that site."""
    if not verbose:
        quiet_console()
    from quantloop.flows.replicate import replicate as replicate_flow
    from quantloop.tasks.workspace import Selection

    chosen = products.split(",") if products else None
    try:
        done = replicate_flow(
            to, _workspace(home, None), Selection(dataset=dataset, products=chosen)
        )
    except (ValueError, LookupError) as exc:
        fail(str(exc), verbose=verbose, exc=exc)
    console.print(f"{done['copied']:,} copied ({done['bytes_copied']:,} bytes), "
                  f"{done['present']:,} already at site {done['site']}")  # fmt: skip


@app.command()
def verify(
    sample: Annotated[
        int, typer.Option(help="Stored feature outputs to re-hash, drawn with a fixed seed; 0: all")
    ] = 0,
    repair: Annotated[
        bool, typer.Option("--repair/--check-only", help="Drop damaged outputs from the cache")
    ] = True,
    summary_json: SummaryJsonOption = None,
    home: HomeOption = None,
    verbose: VerboseOption = False,
) -> None:
    """Re-hash the workspace's stored outputs, models and inputs; damaged outputs are
    dropped from the cache (the next run recomputes them). Exits 1 if anything is damaged."""
    if not verbose:
        quiet_console()
    from quantloop.flows.verify import verify as verify_flow

    report = verify_flow(_workspace(home, None), sample=sample or None, repair=repair)
    for key, reason in report["outputs_damaged"].items():
        console.print(f"output {key[:16]}: {reason}")
    for line in report["models_damaged"] + report["inputs_damaged"]:
        console.print(line, soft_wrap=True)
    console.print(
        f"{report['outputs_checked']:,} of {report['outputs_committed']:,} outputs checked, "
        f"{len(report['outputs_damaged'])} damaged; {len(report['models_damaged'])} models, "
        f"{len(report['inputs_damaged'])} inputs damaged ({report['seconds']:.1f} s)"
    )
    _write_json(summary_json, report)
    if report["outputs_damaged"] or report["models_damaged"] or report["inputs_damaged"]:
        raise typer.Exit(1)


@app.command()
def promote(
    run: RunArgument,
    horizon: Annotated[
        str, typer.Option(help="Mark-out horizon the gate tests ('5s', '100ev')")
    ] = "5s",
    alpha: Annotated[
        float,
        typer.Option(
            min=0.0,
            max=0.5,
            help="Level of the one-sided paired test, after the "
            "trials adjustment (0 to 0.5, exclusive)",
        ),
    ] = 0.05,
    min_improvement_bps: Annotated[
        float,
        typer.Option(
            min=0.0,
            max=100.0,
            help="Margin in bps by which the candidate must "
            "beat the champion (or, for the first one, the baseline)",
        ),
    ] = 0.0,
    sample: Annotated[int, typer.Option(help="Feature nodes the reproduction gate re-runs")] = 20,
    summary_json: SummaryJsonOption = None,
    home: HomeOption = None,
    tracking_uri: TrackingUriOption = None,
    verbose: VerboseOption = False,
) -> None:
    """Move the `champion` alias to the run's model version if its gates pass: on one
    held-out window neither model trained on, its mark-out beats the champion's (the
    first champion: the baseline's) by a one-sided paired test at --alpha, trials counted;
    reproduced; ladder proven. The decision and the test's figures are recorded on the
    version. Exits 1 when refused."""
    if not verbose:
        quiet_console()
    from quantloop.flows.promote import promote as promote_flow

    try:
        decision = promote_flow(run, horizon=horizon, alpha=alpha,
                                min_improvement_bps=min_improvement_bps, reproduce_sample=sample,
                                workspace=_workspace(home, tracking_uri))  # fmt: skip
    except LookupError as exc:
        fail(str(exc))
    for gate, values in decision["gates"].items():
        verdict = "passed" if values["passed"] else "[bold red]failed[/bold red]"
        console.print(f"{gate}: {verdict} ({values.get('why', values)})", soft_wrap=True)
    time_s = decision.get("promotion_time_s")
    console.print(
        f"{decision['model']} version {decision['version']}: {decision['decision']}"
        + (f" in {time_s:.1f} s after its research run" if time_s else "")
    )
    _write_json(summary_json, decision)
    if decision["decision"] != "promoted":
        raise typer.Exit(1)


# A registered model's version: a number, or an alias (MLflow's alias rule, roughly)
_VERSION_REF = r"^([0-9]+|[A-Za-z_][A-Za-z0-9_-]*)$"
ModelOption = Annotated[
    str | None, typer.Option(help="Registered model [default: the tracking block's]")
]


def _check_version(option: str, value: str) -> None:
    import re

    if not re.match(_VERSION_REF, value):
        fail(f"{option} {value!r}: give a version number (3) or an alias (champion)")


@app.command()
def retrain(
    model: ModelOption = None,
    alias: Annotated[
        str, typer.Option(help="Whose recipe: an alias or a version number")
    ] = "champion",
    days: Annotated[
        int | None,
        typer.Option(help="Newest landed trading days to use [default: as many as the version's]"),
    ] = None,
    summary_json: SummaryJsonOption = None,
    home: HomeOption = None,
    tracking_uri: TrackingUriOption = None,
    verbose: VerboseOption = False,
) -> None:
    """Retrain a registered version's recipe (the champion's by default) on the newest
    landed days and register a new version; the alias does not move (promote moves it)."""
    _check_version("--alias", alias)
    if days is not None and days < 1:
        fail(f"--days must be >= 1, got {days}")
    if model is not None and not model.strip():
        fail("--model must not be empty")
    if not verbose:
        quiet_console()
    from quantloop.flows.retrain import retrain as retrain_flow

    try:
        summary = retrain_flow(model=model, alias=alias, days=days,
                               workspace=_workspace(home, tracking_uri))  # fmt: skip
    except LookupError as exc:
        fail(str(exc))
    made = f"new version {summary.new_version}"
    if summary.new_version is None:
        made = f"no new version (this model of these days is version {summary.version})"
    console.print(
        f"{summary.model} version {summary.from_version} ({summary.alias}) retrained on "
        f"{summary.start}..{summary.end}: {made}; {summary.alias} unchanged. MLflow run "
        f"{summary.mlflow_run_id} (quantloop promote {summary.mlflow_run_id})",
        soft_wrap=True,
    )
    _write_json(summary_json, summary.model_dump(mode="json"))


@app.command()
def backtest(
    model: ModelOption = None,
    version: Annotated[str, typer.Option(help="A version number or an alias")] = "champion",
    products: Annotated[
        str | None, typer.Option(help="Comma-separated products [default: the model's]")
    ] = None,
    start: Annotated[
        dt.datetime | None, typer.Option(formats=["%Y-%m-%d"], help="First day [default: all]")
    ] = None,
    end: Annotated[
        dt.datetime | None, typer.Option(formats=["%Y-%m-%d"], help="Last day [default: all]")
    ] = None,
    device: Annotated[
        str, typer.Option(help="auto (a GPU when the site has one), cpu or cuda")
    ] = "auto",
    shard_size: Annotated[int, typer.Option(help="Backtest nodes per Prefect task")] = 10_000,
    summary_json: SummaryJsonOption = None,
    home: HomeOption = None,
    tracking_uri: TrackingUriOption = None,
    verbose: VerboseOption = False,
) -> None:
    """Run a registered model version over products x days as cached nodes: predictions,
    trades and mark-out per product-day; a summary in MLflow. Exits 1 if nodes failed."""
    from quantloop.tasks.schema import Partition

    _check_version("--version", version)
    names = [p.strip() for p in products.split(",")] if products else None
    try:
        for p in names or []:
            Partition(p, dt.date(2000, 1, 1))  # the product-name rule, with its message
    except ValueError as exc:
        fail(f"--products: {exc}")
    first, last = (d.date() if d else None for d in (start, end))
    if first and last and first > last:
        fail(f"--start {first} is after --end {last}")
    if device not in ("auto", "cpu", "cuda") and not device.startswith("cuda:"):
        fail(f"--device {device!r}: give auto, cpu, cuda or cuda:N")
    if shard_size < 1:
        fail(f"--shard-size must be >= 1, got {shard_size}")
    if not verbose:
        quiet_console()
    from quantloop.flows.backtest import BacktestFailed
    from quantloop.flows.backtest import backtest as backtest_flow

    try:
        result = backtest_flow(model=model, version=version, products=names, start=first,
                               end=last, device=device, shard_size=shard_size,
                               workspace=_workspace(home, tracking_uri))  # fmt: skip
    except (LookupError, ValueError) as exc:
        fail(str(exc))
    except BacktestFailed as exc:
        fail(str(exc), code=1)
    table = Table(title=f"Backtest of {result.model} version {result.version} (bps)",
                  box=box.SIMPLE_HEAD, collapse_padding=True)  # fmt: skip
    horizons = list(result.total["mean_bps"])
    for col in ("product", "trades", *horizons):
        table.add_column(col, justify="left" if col == "product" else "right")
    for product, f in {**result.products, "total": result.total}.items():
        table.add_row(product, f"{f['trades']:,}", *(f"{f['mean_bps'][h]:+.2f}" for h in horizons))
    console.print(table)
    console.print(
        f"{result.nodes:,} product-days: {result.cache_hits:,} cache hits, {result.computed:,} "
        f"computed on {result.device} in {result.wall_s:.1f} s; MLflow run {result.mlflow_run_id}"
    )
    _write_json(summary_json, result.model_dump(mode="json"))


@app.command()
def serve(
    home: Annotated[
        Path, typer.Option(help="Workspace folder: stores, and the stack's state in home/serve")
    ] = Path(".quantloop"),
    host: Annotated[str, typer.Option(help="Address the servers listen on")] = "127.0.0.1",
    prefect_port: Annotated[int, typer.Option(help="Prefect server and UI port")] = 4200,
    mlflow_port: Annotated[int, typer.Option(help="MLflow server and UI port")] = 5000,
    pool: Annotated[str, typer.Option(help="Work pool of the stack's worker")] = (
        "quantloop-local"
    ),
    prefect_file: Annotated[
        Path | None, typer.Option(help="The deployments file [default: infra/prefect.yaml]")
    ] = None,
    auth: Annotated[
        bool,
        typer.Option("--auth/--no-auth", help="Lock both servers (credentials in home/serve)"),
    ] = True,
) -> None:
    """Run the local stack: Prefect server and UI, MLflow, a worker with the deployments."""
    from quantloop.deploy import PREFECT_YAML, DeploymentConflict
    from quantloop.serve import StackConfig, serve_forever

    cfg = StackConfig(
        home=home.resolve(), host=host, prefect_port=prefect_port, mlflow_port=mlflow_port,
        pool=pool, prefect_file=(prefect_file or PREFECT_YAML).resolve(), auth=auth,
    )  # fmt: skip
    try:
        serve_forever(cfg, say=lambda line: console.print(line, highlight=False, soft_wrap=True))
    except (RuntimeError, TimeoutError, DeploymentConflict, OSError) as exc:
        fail(f"{type(exc).__name__}: {exc}", code=1)


@app.command()
def deploy(
    prefect_file: Annotated[
        Path | None, typer.Option(help="The deployments file [default: infra/prefect.yaml]")
    ] = None,
    only: Annotated[
        list[str] | None, typer.Option(help="Only these deployments (flow/name); repeatable")
    ] = None,
    replace: Annotated[
        bool, typer.Option(help="Replace deployments that exist with other settings")
    ] = False,
) -> None:
    """Apply the deployments of infra/prefect.yaml to the server at PREFECT_API_URL.

    Creates their work pools (process pools) when missing; refuses, changing nothing,
    when a deployment exists with other settings, naming each difference (--replace).
    """
    from prefect.settings import PREFECT_API_URL

    from quantloop.deploy import (
        PREFECT_YAML,
        DeploymentConflict,
        apply,
        read_deployments,
        read_queues,
    )

    if not PREFECT_API_URL.value():
        # Prefect would start a temporary server and deploy there, to be lost on exit.
        fail(
            "PREFECT_API_URL is not set: `prefect config set PREFECT_API_URL=http://HOST:4200/api`"
        )
    specs = read_deployments(prefect_file or PREFECT_YAML)
    if only:
        unknown = set(only) - {d.full_name for d in specs}
        if unknown:
            fail(f"--only: no deployment {sorted(unknown)}; known: {[d.full_name for d in specs]}")
        specs = [d for d in specs if d.full_name in only]
    try:
        queues = read_queues(prefect_file or PREFECT_YAML)
        ids = apply(specs, replace=replace, queues=queues)
    except DeploymentConflict as exc:
        fail(str(exc), code=1)
    for d in specs:
        console.print(f"{d.full_name} -> work pool {d.pool}, queue {d.queue}: deployment "
                      f"{ids[d.full_name]}")  # fmt: skip
    if queues:
        ranked = sorted(queues.items(), key=lambda x: x[1])
        console.print(
            "work queues by priority (lower first): " + ", ".join(f"{q} {p}" for q, p in ranked)
        )


@app.command()
def ladder(
    preset: Annotated[
        str, typer.Option(help="auto (h200 with CUDA, else cpu_tiny), h200 or cpu_tiny")
    ] = "auto",
    rungs: Annotated[
        str, typer.Option(help="Comma-separated rung numbers (1 always runs); default: all")
    ] = "",
    out: Annotated[Path | None, typer.Option(help="Folder for traces and the report")] = None,
    home: HomeOption = None,
    tracking_uri: TrackingUriOption = None,
) -> None:
    """Run the GPU optimization ladder flow and print its report (docs/ladder.md)."""
    from quantloop.flows.ladder import LadderParams
    from quantloop.flows.ladder import ladder as ladder_flow
    from quantloop.profiling.report import report_markdown

    ws = {k: v for k, v in (("home", home), ("tracking_uri", tracking_uri)) if v is not None}
    try:
        params = LadderParams(
            workspace=ws,
            preset=preset,
            rungs=[int(r) for r in rungs.split(",") if r.strip()],
            out_dir=str(out.resolve()) if out else None,
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    result = ladder_flow(params)
    print(report_markdown(result), end="")
    console.print(
        f"MLflow run {result['mlflow_run_id']}; report in {params.out_dir or 'home/ladder'}"
    )


@app.command()
def nodes(
    home: Annotated[str, typer.Option(help="The workspace folder")] = ".quantloop",
    site: Annotated[str | None, typer.Option(help="A saved Site block, if not local")] = None,
    kind: Annotated[str, typer.Option(help="Node kind")] = "features",
    product: Annotated[str | None, typer.Option(help="Only this product")] = None,
    date: Annotated[str | None, typer.Option(help="Only this date (YYYY-MM-DD)")] = None,
    status: Annotated[str | None, typer.Option(help="ok or failed")] = None,
    cache_hit: Annotated[
        bool | None, typer.Option("--cache-hit/--computed", help="Only hits / only computed")
    ] = None,
    all_runs: Annotated[bool, typer.Option("--all-runs", help="Every run, not the last")] = False,
    lineage: Annotated[
        str | None, typer.Option(help="Show the lineage of the node with this key (or prefix)")
    ] = None,
    limit: Annotated[int, typer.Option(help="Rows to show")] = 20,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table")] = False,
    run: Annotated[
        str | None,
        typer.Option(
            help="A research run (MLflow run id or Prefect flow run id): its nodes, "
            "found from the run's record, wherever its workspace is"
        ),
    ] = None,
    tracking_uri: TrackingUriOption = None,
) -> None:
    """Query node records: filter the run manifests, or show one node's lineage."""
    import datetime as dt

    from quantloop.tasks import manifest, runs, tracking
    from quantloop.tasks.catalog import Catalog
    from quantloop.tasks.workspace import Workspace

    ws = Workspace(home=home, site=site)
    run_url = None
    if run is not None:
        try:
            client, _ = tracking.client_for(_workspace(home, tracking_uri).resolve_tracking())
            research = runs.find_research_run(client, run)
            features_run = runs.stage_runs(client, research)["features"]
            root = research.data.tags[tracking.STORE_TAG]
            catalog = Catalog(research.data.tags[tracking.CATALOG_TAG])
            run_url = features_run.data.tags[tracking.MANIFEST_TAG]
        except (LookupError, KeyError) as exc:
            fail(f"--run {run}: {exc}")
    else:
        root, catalog = ws.resolve_site().root, ws.catalog()
    if lineage is not None:
        try:
            found = manifest.lineage(root, catalog, lineage, kind)
        except LookupError as exc:
            fail(f"--lineage {lineage}: {exc}")
        typer.echo(json.dumps(found, indent=2, default=str))
        return
    if status not in (None, "ok", "failed"):
        raise typer.BadParameter("status must be ok or failed", param_hint="--status")
    try:
        day = dt.date.fromisoformat(date) if date else None
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--date") from exc
    found = manifest.query(root, kind, all_runs=all_runs, limit=limit, product=product,
                           date=day, status=status, cache_hit=cache_hit,
                           run_url=run_url)  # fmt: skip
    if found.total == 0:
        fail(f"no {kind} runs recorded under {root}", code=1)
    if found.matched == 0:
        given = {k: v for k, v in dict(product=product, date=date, status=status,
                                       cache_hit=cache_hit).items() if v is not None}  # fmt: skip
        fail(f"none of the {found.total:,} recorded nodes matches {given}", code=1)
    if as_json:
        typer.echo(json.dumps(found.rows.to_pylist(), indent=1, default=str))
        return
    computed = found.matched - found.cache_hits - found.failed
    console.print(
        f"{found.matched} of {found.total} nodes match ({found.cache_hits} cache hits, "
        f"{computed} computed, {found.failed} failed)"
    )
    table = Table()
    for col in ("key", "product", "date", "status", "hit", "reason", "rows", "ms", "site", "run"):
        table.add_column(col, justify="right" if col in ("rows", "ms") else "left")
    for r in found.rows.to_pylist():
        table.add_row(
            r["key"][:16], r["product"], r["date"], r["status"], "yes" if r["cache_hit"] else "",
            r["reason"] or r["error"][:40], str(r["rows"]), f"{r['duration_s'] * 1e3:.2f}",
            r["site"], r["run"][:15],
        )  # fmt: skip
    console.print(table)


if __name__ == "__main__":
    app()
