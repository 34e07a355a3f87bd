"""What the commands share: the console, options, one-line errors, the run log, JSON out."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from pydantic import ValidationError
from rich import box
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

if TYPE_CHECKING:
    from quantloop.tasks.records.summary import TextTable
    from quantloop.tasks.runtime.local_api import Api, ApiHandle

# tasks/runtime/workspace.py's default home, without importing it (it imports Prefect).
DEFAULT_HOME = ".quantloop"

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

console = Console(stderr=True)


class ConsoleSink:
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
    forkserver = sys.modules.get("quantloop.forkserver")
    if forkserver is not None and forkserver.IN_CHILD:
        # A warm process's child (quantloop/forkserver.py): Prefect set up its logging
        # before this command read its options, so its handlers are told directly.
        # dictConfig names them; logging has no public lookup by name before Python 3.12.
        for handler in ("console", "console_flow_runs", "console_task_runs"):
            found = logging._handlers.get(handler)  # noqa: SLF001
            if found is not None:
                found.setLevel(logging.CRITICAL)


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


def home_of(home: str | None) -> str:
    """The workspace's home folder as Workspace.home_abs resolves it."""
    return os.path.abspath(os.path.expanduser(home or DEFAULT_HOME))


class PrefectApi:
    """The Prefect API of a command's flows; `ready()` waits for it (a resident server's
    start) and prints one line saying which it is."""

    def __init__(self, handle: ApiHandle):
        self.handle = handle
        self.api: Api | None = None

    def ready(self) -> Api:
        if self.api is None:
            from quantloop.tasks.runtime.local_api import LocalApiError

            try:
                self.api = self.handle.ready()
            except LocalApiError as exc:
                fail(str(exc), code=1)
            console.print(self.api.line(), highlight=False, soft_wrap=True)
        return self.api


@contextlib.contextmanager
def prefect_api(home: str | None, *, wait: bool = True) -> Iterator[PrefectApi]:
    """Inside the block, the command's flows record to a Prefect API: a configured one,
    `quantloop serve`'s on this home, or the home's resident server, started if need be
    and shared with other commands (tasks/runtime/local_api.py), not a temporary server
    of the command's own. Enter it after the input checks (bad input starts nothing);
    with `wait=False`, before the flow's imports, which then overlap a server's start,
    and call `ready()` before the flow."""
    from quantloop.tasks.runtime import timeline
    from quantloop.tasks.runtime.local_api import LocalApiError, using_api

    def say(message: str) -> None:
        console.print(message, highlight=False, soft_wrap=True)

    with contextlib.ExitStack() as stack:
        try:
            handle = stack.enter_context(
                using_api(home_of(home), say=say, timeline=timeline.TIMELINE, wait=False)
            )
        except LocalApiError as exc:
            fail(str(exc), code=1)
        api = PrefectApi(handle)
        if wait:
            api.ready()
        yield api


def workspace_of(home: str | None, tracking_uri: str | None):
    from quantloop.tasks.runtime.workspace import Workspace

    values = {k: v for k, v in (("home", home), ("tracking_uri", tracking_uri)) if v is not None}
    return Workspace(**values)


def write_json(path: Path | None, value: dict) -> None:
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


# A registered model's version: a number, or an alias (MLflow's alias rule, roughly)
_VERSION_REF = r"^([0-9]+|[A-Za-z_][A-Za-z0-9_-]*)$"
ModelOption = Annotated[
    str | None, typer.Option(help="Registered model [default: the tracking block's]")
]


def check_version(option: str, value: str) -> None:
    import re

    if not re.match(_VERSION_REF, value):
        fail(f"{option} {value!r}: give a version number (3) or an alias (champion)")


# What a locked MLflow answers a request without (or with the wrong) credentials, and one
# whose identity may not do it, as MLflow's REST client words it.
_REFUSED = {401: "401 != 200", 403: "403 != 200"}


def refused(exc: BaseException) -> int | None:
    """401 or 403 when `exc` (or an exception it was raised from) is a locked MLflow
    server's refusal; None otherwise."""
    seen = 0
    while exc is not None and seen < 10:
        text = str(exc)
        for code, marker in _REFUSED.items():
            if marker in text or getattr(exc, "error_code", None) in (
                ("UNAUTHENTICATED",) if code == 401 else ("PERMISSION_DENIED",)
            ):
                return code
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return None


def refusal_line(code: int, uri: str, home: str | None, role: str) -> str:
    """One line saying what to do about a 401 or 403 from the MLflow server at `uri`."""
    where = os.path.join(home_of(home), "serve", "credentials.json")
    user = os.environ.get("MLFLOW_TRACKING_USERNAME")
    if code == 401:
        return (
            f"MLflow at {uri} refused the request (401: "
            + (f"user {user!r} and its password are not accepted" if user else "no credentials")
            + "): set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD, or give the "
            f"--home of the `quantloop serve` workspace, whose {where} has them "
            f"(mlflow.{role})"
        )
    return (
        f"MLflow at {uri} refused user {user!r} (403: not permitted): this command needs the "
        f"{role} identity (mlflow.{role} in {where}; promote is the promoter's alone)"
    )


def served_tracking(home: str) -> str | None:
    """The MLflow of a running `quantloop serve` on `home`, for a command that records
    runs there: its URL, with the researcher's credentials put in the environment (unless
    it names its own); None when no serve runs there. Says so in one line."""
    from quantloop.tasks.runtime.local_api import serve_mlflow

    served = serve_mlflow(home)
    if served is None:
        return None
    url, locked = served
    who = ""
    if locked and not os.environ.get("MLFLOW_TRACKING_USERNAME"):
        from quantloop.identities import read_for

        found = read_for(home, "researcher")
        if found is None:
            fail(f"quantloop serve runs on {home} with MLflow locked, but its credentials "
                 "name no researcher: set MLFLOW_TRACKING_USERNAME and _PASSWORD")  # fmt: skip
        os.environ["MLFLOW_TRACKING_USERNAME"] = found.username
        os.environ["MLFLOW_TRACKING_PASSWORD"] = found.password
    if locked:
        who = f" as {os.environ['MLFLOW_TRACKING_USERNAME']}"
    console.print(f"MLflow: quantloop serve's at {url}{who} (it serves this home)", soft_wrap=True)
    return url


def records_workspace(home: str | None, tracking_uri: str | None, role: str = "researcher"):
    """The workspace a command that reads (or, with role promoter, gates) recorded runs
    uses, checked before anything starts: a local store that is not there is an error
    naming it (never made empty as a side effect); a tracking server's credentials, when
    the environment gives none, are `quantloop serve`'s for this home (`role`'s entry of
    <home>/serve/credentials.json), and a refusal is one line saying what to do."""
    import urllib.error
    import urllib.request

    ws = workspace_of(home, tracking_uri)
    uri = ws.resolve_tracking().resolved_uri()
    if uri.startswith("sqlite:///"):
        path = uri[len("sqlite:///") :]
        if not os.path.exists(path):
            flag = "--tracking-uri" if tracking_uri else "--home"
            fail(f"no MLflow store at {path}: nothing was recorded there (give the {flag} "
                 "of the runs' records)")  # fmt: skip
        return ws
    if not uri.startswith(("http://", "https://")):
        return ws
    if not os.environ.get("MLFLOW_TRACKING_USERNAME"):
        from quantloop.identities import read_for

        found = read_for(home_of(home), role)
        if found is not None:
            os.environ["MLFLOW_TRACKING_USERNAME"] = found.username
            os.environ["MLFLOW_TRACKING_PASSWORD"] = found.password
    request = urllib.request.Request(f"{uri.rstrip('/')}/api/2.0/mlflow/experiments/search"
                                     "?max_results=1")  # fmt: skip
    user = os.environ.get("MLFLOW_TRACKING_USERNAME")
    if user:
        import base64

        token = f"{user}:{os.environ.get('MLFLOW_TRACKING_PASSWORD', '')}".encode()
        request.add_header("Authorization", "Basic " + base64.b64encode(token).decode())
    try:
        with urllib.request.urlopen(request, timeout=30):
            pass
    except urllib.error.HTTPError as exc:
        if exc.code in _REFUSED:
            fail(refusal_line(exc.code, uri, home, role))
        fail(f"MLflow at {uri} answered HTTP {exc.code} to a search of experiments")
    except (urllib.error.URLError, OSError) as exc:
        fail(f"MLflow at {uri} is not reachable: {getattr(exc, 'reason', exc)}")
    return ws
