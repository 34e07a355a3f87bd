"""`quantloop replicate`: copy landed partitions to another site (digests checked) and
record the copies in.
"""

from __future__ import annotations

from typing import Annotated

import typer

from quantloop.cli.common import (
    HomeOption,
    VerboseOption,
    console,
    fail,
    prefect_api,
    quiet_console,
    workspace_of,
)


def replicate(
    to: Annotated[
        str, typer.Option("--to", help="The saved quantloop Site block that gets the copies.")
    ],
    dataset: Annotated[str, typer.Option(help="Catalog dataset.")] = "synthetic",
    products: Annotated[
        str | None, typer.Option(help="Comma-separated products [default: all]")
    ] = None,
    home: HomeOption = None,
    verbose: VerboseOption = False,
) -> None:
    """Copy landed partitions to another site (digests checked) and record the copies in
    the catalog: placement can then run their nodes at that site."""
    if not verbose:
        quiet_console()
    with prefect_api(home, wait=False) as api:  # a server's start overlaps the imports
        from quantloop.tasks.runtime import collector

        with collector.paused():  # then frozen: later collections skip the stack
            from quantloop.flows.replicate import replicate as replicate_flow
            from quantloop.tasks.runtime.workspace import Selection

        api.ready()
        chosen = products.split(",") if products else None
        try:
            done = replicate_flow(
                to, workspace_of(home, None), Selection(dataset=dataset, products=chosen)
            )
        except (ValueError, LookupError) as exc:
            fail(str(exc), verbose=verbose, exc=exc)
    console.print(f"{done['copied']:,} copied ({done['bytes_copied']:,} bytes), "
                  f"{done['present']:,} already at site {done['site']}")  # fmt: skip
