"""The `quantloop` command line: run the research loop, serve the local stack, deploy,
query nodes, retrain and backtest registered models, run the ladder.

One module per command; each imports what its work needs only when it runs, so
`quantloop --help` and a bad option answer without loading Prefect, torch or MLflow.
"""

from __future__ import annotations

import os

import typer

from quantloop.cli import (
    backtest,
    deploy,
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

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__.split("\n\n")[0])


@app.callback()
def main() -> None:
    """quantloop: the research loop of a systematic trading desk, on Prefect, Dask and MLflow."""
    # The embedded Prefect server would try to send usage telemetry on start-up and log
    # an error on a machine without internet; an operator can still turn it back on.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


# In the order `quantloop --help` lists them: the researcher's, the auditor's, the operator's.
for command in (run.run, nodes.nodes, reproduce.reproduce, promote.promote, verify.verify,
                retrain.retrain, backtest.backtest, replicate.replicate, ladder.ladder,
                serve.serve, deploy.deploy):  # fmt: skip
    app.command()(command)

__all__ = ["app", "rich_table"]
