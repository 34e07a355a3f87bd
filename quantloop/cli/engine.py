"""`quantloop engine`: run one Prefect flow run, as `python -m prefect.engine` does; the
command a process work pool gives its flow runs (infra/prefect.yaml, job variable
`command`).

Through `quantloop` it runs in a warm process (quantloop/forkserver.py) when one is up:
a flow run started by a process worker then begins without importing Prefect, MLflow,
torch and the flows again. Prefect's own default starts two fresh interpreters per flow
run (a workspace supervisor, then the engine), each paying those imports.
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
) -> None:
    """Run one Prefect flow run (a process worker's command: infra/prefect.yaml). The same
    code as `python -m prefect.engine`: the run's deployment pull steps, its flow loaded
    from the entrypoint, Prefect's signal handling and exit status."""
    import runpy

    import prefect.engine

    # Prefect's engine module run as a script, its `__main__` block included: its modules
    # are imported already (in a warm process, before the fork), so this costs nothing;
    # run_path rather than run_module, which warns about a module imported twice.
    sys.argv = [prefect.engine.__file__, *([flow_run_id] if flow_run_id else [])]
    runpy.run_path(prefect.engine.__file__, run_name="__main__")
