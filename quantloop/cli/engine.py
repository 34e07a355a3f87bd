"""`quantloop engine`: run one Prefect flow run, as `python -m prefect.engine` does; the
command a process work pool gives its flow runs (infra/prefect.yaml, job variable
`command`).

Through `quantloop` it runs in a warm process (quantloop/forkserver.py) when one is up:
a flow run started by a process worker then begins without importing Prefect, MLflow,
torch and the flows again. Prefect's own default starts two fresh interpreters per flow
run (a workspace supervisor, then the engine), each paying those imports.
`quantloop engine --warm`, in a worker's environment, starts that warm process before
the worker's first run (`quantloop serve` does, beside its worker).
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer


def engine(
    flow_run_id: Annotated[
        str | None,
        typer.Argument(
            help="The flow run to run; default: $PREFECT__FLOW_RUN_ID, as a worker sets it"
        ),
    ] = None,
    warm: Annotated[
        bool,
        typer.Option(
            "--warm",
            help="Run nothing: start the warm process that this environment's worker's flow "
            "runs will use, unless it is up",
        ),
    ] = False,
) -> None:
    """Run one Prefect flow run (a process worker's command: infra/prefect.yaml). The same
    code as `python -m prefect.engine`: the run's deployment pull steps, its flow loaded
    from the entrypoint, Prefect's signal handling and exit status."""
    if warm:
        # the warm process's own module does it, in a process of its own (the CLI is a
        # layer under it: pyproject's import contracts)
        import subprocess

        done = subprocess.run([sys.executable, "-m", "quantloop.forkserver", "--flow-runs"])
        raise typer.Exit(done.returncode)
    import runpy

    from quantloop.tasks.runtime import collector

    with collector.paused():  # then frozen: later collections skip Prefect's engine
        import prefect.engine

        from quantloop.tasks.runtime import heartbeats

    # Its flow run ends without waiting on Prefect's heartbeat thread, whichever flow the
    # deployment names (quantloop's flows install it on import too).
    heartbeats.install()

    # Prefect's engine module run as a script, its `__main__` block included: its modules
    # are imported already (in a warm process, before the fork), so this costs nothing;
    # run_path rather than run_module, which warns about a module imported twice.
    sys.argv = [prefect.engine.__file__, *([flow_run_id] if flow_run_id else [])]
    runpy.run_path(prefect.engine.__file__, run_name="__main__")
