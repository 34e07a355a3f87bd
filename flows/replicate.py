"""The `replicate` flow: copy landed partition versions to another site and record the
copies, so placement can run their nodes there (or there too, when a site is down)."""

from __future__ import annotations

from dataclasses import asdict

from prefect import flow, get_run_logger

from quantloop.blocks.site import Site
from quantloop.tasks.data.replicate import replicate as replicate_versions
from quantloop.tasks.runtime import progress
from quantloop.tasks.runtime.workspace import BlockName, Selection, Workspace


@flow(name="replicate")
def replicate(
    to: Site | BlockName,
    workspace: Workspace = Workspace(),
    selection: Selection = Selection(),
) -> dict:
    """Copy the selected partitions' versions (the pinned ones, or the current ones) to
    the site `to`, checking each copy's digest, and record them in the catalog.

    Args:
        to: The site that gets the copies: a saved quantloop Site block, or its name.
        workspace: Whose catalog records the copies.
        selection: Which partitions (a dataset, products, dates, or a run's pin).
    """
    site = to if isinstance(to, Site) else Site.load(to)
    catalog = workspace.catalog()
    done = replicate_versions(catalog, selection.dataset, selection.table(catalog),
                              site=site.name, root=site.root)  # fmt: skip
    line = (f"{done.copied:,} partitions copied to site {site.name} ({done.bytes_copied:,} "
            f"bytes, digests checked), {done.present:,} already there")  # fmt: skip
    get_run_logger().info(line)
    progress.note("replicate", line)
    return asdict(done)
