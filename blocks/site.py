"""Site: a Dask cluster and the storage beside it. Work goes to the site holding its data."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from prefect.blocks.core import Block
from pydantic import Field, model_validator

# Imported by every Dask worker as it starts (Dask's preload), so the first batch of
# a run does not pay for importing the node code (~0.3 s per fresh worker here): the
# engine's worker side and the feature node's code (what a batch task unpickles).
# infra/dask/site.sh names the same modules.
WORKER_PRELOAD = ("quantloop.tasks.engine.batch", "quantloop.tasks.research.features")


class SiteUnreachable(ConnectionError):
    """A site's Dask scheduler did not answer; the message names the site and address."""


class Site(Block):
    """A place that runs work: a Dask cluster (or a local one) and its storage root.

    Example:
        ```python
        from quantloop.blocks.site import Site
        site = Site.load("onprem")
        with site.client() as client:
            print(client.scheduler_info()["workers"].keys())
        ```
    """

    _block_type_name = "quantloop Site"
    _block_type_slug = "quantloop-site"
    _description = (
        "A Dask cluster and its storage root; quantloop sends work to the site that holds its data."
    )

    name: str = Field(default="local", description="Short site name recorded on every node.")
    scheduler_address: str | None = Field(
        default=None,
        description="Address of the site's Dask scheduler (tcp://host:8786). "
        "Empty: start a LocalCluster for the run.",
    )
    n_workers: int = Field(
        default=2, ge=1, description="Workers of the LocalCluster when no scheduler is given."
    )
    threads_per_worker: int = Field(
        default=1, ge=1, description="Threads per LocalCluster worker (feature nodes hold the GIL)."
    )
    storage_root: str = Field(
        default=".quantloop/store",
        description="Where the site keeps datasets and node outputs: a local folder or s3://bucket/prefix.",
    )
    gpus: int = Field(default=0, ge=0, description="GPUs available to training on this site.")
    cost_per_hour: float = Field(
        default=0.0,
        ge=0,
        description="Cost of the site's compute per hour: placement prefers the cheaper of two "
        "sites holding a node's input, and runs report seconds x this per site.",
    )
    connect_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="Seconds to wait for the scheduler before the run fails naming this site.",
    )
    no_workers_timeout_s: float = Field(
        default=120.0,
        gt=0,
        description="Seconds the scheduler may have no workers while a run's batches wait "
        "there: then the run fails naming this site, or (the workspace's on_unreachable "
        "'replica') its nodes not yet run go to a site holding a copy of their inputs.",
    )

    @model_validator(mode="after")
    def _check(self) -> Site:
        if self.scheduler_address is not None and not self.scheduler_address.strip():
            self.scheduler_address = None
        if self.scheduler_address and "://" not in self.scheduler_address:
            raise ValueError(
                f"scheduler_address {self.scheduler_address!r} must be a URL such as tcp://host:8786"
            )
        return self

    @property
    def root(self) -> str:
        """The storage root as an absolute path or URL."""
        if "://" in self.storage_root:
            return self.storage_root.rstrip("/")
        return os.path.abspath(self.storage_root)

    def holds(self, url: str) -> bool:
        """Whether `url` lies under this site's storage root."""
        root = self.root
        return url == root or url.startswith(root + "/")

    @contextlib.contextmanager
    def client(self) -> Iterator[object]:
        """A `distributed.Client` to the site's cluster, closed on exit.

        The client is not entered as a context manager: that makes it the "current"
        client of the calling thread's context, and a flow may open it in one shard's
        thread and close it in its own (distributed then refuses the context reset).
        """
        from distributed import Client, LocalCluster

        if self.scheduler_address:
            try:
                client = Client(self.scheduler_address, timeout=f"{self.connect_timeout_s}s")
            except (OSError, TimeoutError) as exc:
                raise SiteUnreachable(
                    f"site {self.name!r}: its Dask scheduler {self.scheduler_address} did not "
                    f"answer within {self.connect_timeout_s:g} s ({type(exc).__name__}: {exc})"
                ) from exc
            try:
                yield client
            finally:
                client.close()
            return
        # Processes, not threads: feature nodes are NumPy-heavy Python and hold the GIL.
        with LocalCluster(
            n_workers=self.n_workers,
            threads_per_worker=self.threads_per_worker,
            processes=True,
            dashboard_address=None,
            silence_logs=40,
            preload=list(WORKER_PRELOAD),
        ) as cluster:
            client = Client(cluster)
            try:
                yield client
            finally:
                client.close()
