"""The `quantloop` command line: run the research loop, serve the local stack, deploy,
query nodes, retrain and backtest registered models, run the ladder.

One module per command; each imports what its work needs only when it runs, so
`quantloop --help` and a bad option answer without loading Prefect, torch or MLflow.
"""

from __future__ import annotations

import os

import typer

from quantloop.cli import (
    api,
    backtest,
    deploy,
    engine,
    ladder,
    nodes,
    promote,
    replicate,
    reproduce,
    retrain,
    run,
    serve,
    verify,
)
from quantloop.cli.common import rich_table

# Plain help, not Rich's panels: Rich markup ate every `[default: ...]` written in a help
# text (an unknown style tag to it) and its panels gave each boolean flag a `<bool>` value;
# the plain formatter shows both as written, and a flag as `--flag` or `--flag / --no-flag`.
app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    rich_markup_mode=None,
    help=__doc__.split("\n\n")[0],
)


@app.callback()
def main() -> None:
    """quantloop: the research loop of a systematic trading desk, on Prefect, Dask and MLflow."""
    # The embedded Prefect server would try to send usage telemetry on start-up and log
    # an error on a machine without internet; an operator can still turn it back on.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


# In the order `quantloop --help` lists them: the researcher's, the auditor's, the operator's.
for command in (run.run, nodes.nodes, reproduce.reproduce, promote.promote, verify.verify,
                retrain.retrain, backtest.backtest, replicate.replicate, ladder.ladder,
                serve.serve, api.api, deploy.deploy, engine.engine):  # fmt: skip
    app.command()(command)

__all__ = ["app", "rich_table"]


def console_main() -> None:
    """The `quantloop` executable in this process (quantloop/launch.py first offers the
    command to a warm process): the commands, then an exit that skips the interpreter's
    teardown. Every exit handler still runs (Prefect's, Dask's, logging's flush, the
    run's breakdown) and every thread is joined; what is skipped is freeing thousands of
    modules one by one (torch's among them), 1.5-2 s of a cached re-run on 2 cores that
    nobody waits for on purpose. Tests call `app` itself and keep the normal exit."""
    os._exit(run_app())


def run_app() -> int:
    """Run the command of sys.argv, then the interpreter's own first steps at exit:
    threads joined, exit handlers run, streams flushed. Returns the exit status."""
    import atexit
    import sys
    import threading

    try:
        app()
        code = 0
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:  # sys.exit("message"): printed, exit status 1
            print(exc.code, file=sys.stderr)
            code = 1
    # The interpreter's own first steps at exit, in its order: threading's exit hooks
    # (concurrent.futures tells its workers to stop) and the join of every non-daemon
    # thread, then the exit handlers. (Joining the threads without the hooks waited
    # forever on an executor's idle workers.)
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    return code
