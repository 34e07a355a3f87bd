"""A run's sites side by side: a Dask client per site, each node's site, and what it cost.

The workspace names the sites (the default first); the catalog says where each input
version has copies; the engine's `place` decides which site runs each node. Here the
two meet: the placed selection, the clients (opened when a site first has a node to
run), and the per-site counts a run reports.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import pyarrow as pa

from quantloop.blocks.site import Site, SiteUnreachable
from quantloop.tasks.data.catalog import Catalog
from quantloop.tasks.engine import Policy, SiteCost, place


class SiteClient:
    """A site's Dask client, started (or connected to) by the first shard that has a
    node to run there: a run whose nodes are all cached starts no cluster. Several
    shards' threads may ask at once; one connects."""

    def __init__(self, site: Site, stack: contextlib.ExitStack):
        self._site, self._stack = site, stack
        self._lock = threading.Lock()
        self._client = None

    @property
    def starts_cluster(self) -> bool:
        """Whether connecting starts a LocalCluster (the site names no scheduler)."""
        return not self._site.scheduler_address

    @property
    def no_workers_timeout_s(self) -> float:
        """Seconds the site's scheduler may have no workers while batches wait there."""
        return self._site.no_workers_timeout_s

    def __call__(self):
        with self._lock:
            if self._client is None:
                self._client = self._stack.enter_context(self._site.client())
            return self._client


def place_selection(
    entries: pa.Table,
    catalog: Catalog,
    dataset: str,
    sites: Sequence[Site],
    policy: Policy,
    *,
    down: Collection[str] = (),
) -> pa.Table:
    """The selection's catalog rows with the site that runs each node ("site"), where
    its input is read from ("input_site") and that copy's location.

    One site: everything runs there and reads where the catalog says (no copies are
    looked up: a 10^6-node run on one site pays nothing for sites).
    """
    if len(sites) == 1:
        name = pa.repeat(pa.scalar(sites[0].name, pa.string()), entries.num_rows)
        return entries.append_column("site", name).append_column("input_site", name)
    copies = catalog.copies(dataset)
    # A copy recorded under a site name the workspace does not use, but stored under one
    # of its sites' roots (a site renamed, or landed before sites were named), is there.
    names = {s.name for s in sites}
    if copies.num_rows and not set(copies["site"].to_pylist()) <= names:
        fixed = [
            s if s in names else next((x.name for x in sites if x.holds(url)), s)
            for s, url in zip(copies["site"].to_pylist(), copies["url"].to_pylist(), strict=True)
        ]
        copies = copies.set_column(1, "site", pa.array(fixed, pa.string()))
    costs = [SiteCost(name=s.name, cost_per_hour=s.cost_per_hour) for s in sites]
    return place(entries, copies, costs, policy, down=down)


def unreachable(sites: Sequence[Site], clients: dict[str, SiteClient]) -> list[str]:
    """The sites whose scheduler does not answer now (a LocalCluster site always does:
    it is started, and is not probed here)."""
    down = []
    for site in sites:
        if site.scheduler_address:
            try:
                clients[site.name]()
            except SiteUnreachable:
                down.append(site.name)
    return down


@dataclass(slots=True)
class SiteCounts:
    """What one site did in a run: its feature nodes and their compute seconds, the
    seconds of the training loop and the replay it ran, the bytes those read from other
    sites, and what its seconds cost."""

    nodes: int = 0
    computed: int = 0
    compute_s: float = 0.0  # feature nodes
    # bytes read from other sites: feature nodes' inputs, and the feature outputs and
    # models copied here for training and the replay (of which the next two say how many)
    bytes_across: int = 0
    cost: float = 0.0  # all of this site's seconds x its cost_per_hour / 3600
    train_s: float = 0.0
    simulate_s: float = 0.0
    train_bytes_across: int = 0
    simulate_bytes_across: int = 0

    def add(self, nodes: int, computed: int, compute_s: float, bytes_across: int,
            cost_per_hour: float) -> None:  # fmt: skip
        self.nodes += nodes
        self.computed += computed
        self.compute_s += compute_s
        self._spent(compute_s, bytes_across, cost_per_hour)

    def add_stage(self, stage: str, seconds: float, bytes_across: int,
                  cost_per_hour: float) -> None:  # fmt: skip
        """Training's ("train") or the replay's ("simulate") seconds at this site, and the
        bytes copied here for it."""
        field = f"{stage}_s"
        setattr(self, field, getattr(self, field) + seconds)
        self._spent(seconds, bytes_across, cost_per_hour)
        field = f"{stage}_bytes_across"
        setattr(self, field, getattr(self, field) + bytes_across)

    def _spent(self, seconds: float, bytes_across: int, cost_per_hour: float) -> None:
        self.bytes_across += bytes_across
        self.cost += seconds * cost_per_hour / 3600.0


def worker_address() -> str:
    """The Dask worker this runs in, or "" outside one (the flow's own process)."""
    try:
        from distributed import get_worker

        return get_worker().address
    except ValueError:
        return ""


GPU = "GPU"  # the Dask worker resource a GPU host declares (`dask worker --resources GPU=1`)


# How many of a scheduler's workers declare the GPU resource; asked of the scheduler
# itself. A lambda: cloudpickle sends it by value, so a site's scheduler needs no quantloop.
_gpu_workers = lambda dask_scheduler: sum(  # noqa: E731
    "GPU" in w.resources for w in dask_scheduler.workers.values()
)


class StageSite:
    """Where a stage's work runs (training, the replay): a site's Dask worker that
    declares the GPU resource, or, with no client, the flow's own process at the default
    site. `run` waits for the worker's result only while the site has such a worker:
    after the site's no_workers_timeout_s without one it cancels the task and raises
    NoWorkers naming the site."""

    def __init__(self, site: Site, client=None):
        self.site, self.client = site, client

    @property
    def remote(self) -> bool:
        return self.client is not None

    def run(self, fn, *args):
        if self.client is None:
            return fn(*args)
        future = self.client.submit(fn, *args, resources={GPU: 1}, pure=False)
        return wait_for(self.client, future, self.site, getattr(fn, "__name__", "a task"))


def wait_for(client, future, site: Site, what: str):
    """The future's result; every poll without it asks the scheduler whether a worker
    with the GPU resource is there. None for longer than the site's no_workers_timeout_s:
    the task is cancelled and NoWorkers raised naming the site.

    A poll waits for the task to finish, not for its result: the result is gathered once,
    after, however long it takes to come over the link. (`future.result(timeout=poll)`
    started the gather again at every poll and cut it at the poll's end, so a result
    that took longer than a poll to cross, a replay's mark-outs over a slow link, never
    came: bench/placement.py at 100 Mbit/s.)"""
    from distributed import wait

    from quantloop.tasks.engine.driver import NO_WORKERS_POLL_S, NoWorkers

    limit = site.no_workers_timeout_s
    poll = min(NO_WORKERS_POLL_S, limit / 4)
    since = None  # when the scheduler was first seen without a GPU worker
    while True:
        try:
            wait(future, timeout=poll)
        except TimeoutError:
            pass
        else:
            return future.result()
        now = time.monotonic()
        if client.run_on_scheduler(_gpu_workers):
            since = None
            continue
        since = now if since is None else since
        if now - since > limit:
            client.cancel(future)
            raise NoWorkers(
                f"site {site.name!r}: its Dask scheduler had no workers with the {GPU} "
                f"resource for {now - since:.1f} s (no_workers_timeout_s {limit:g}) with "
                f"{what} in flight",
                site.name,
            )


def stage_site(
    sites: Sequence[Site],
    stack: contextlib.ExitStack,
    *,
    down: Collection[str] = (),
    on_unreachable: str = "fail",
    log=None,
) -> StageSite:
    """Where training and the replay run: the first site (the default first) that
    declares GPUs, is not `down` and whose scheduler has a worker with the GPU resource;
    else the flow's process, which is the default site. Only sites with a scheduler are
    asked: a LocalCluster site is this machine, where the flow trains anyway. A GPU site
    whose scheduler does not answer fails the run naming it (SiteUnreachable), or with
    on_unreachable "replica" is passed over."""
    for site in sites:
        if not (site.gpus and site.scheduler_address) or site.name in down:
            continue
        try:
            client = stack.enter_context(site.client())
        except SiteUnreachable as exc:
            if on_unreachable != "replica":
                raise
            if log is not None:
                log.warning("%s: training and the replay go elsewhere", exc)
            continue
        # Asked of the scheduler itself: its workers' declared resources.
        if client.run_on_scheduler(_gpu_workers):
            return StageSite(site, client)
    return StageSite(sites[0])


def gpu_client(sites: Sequence[Site], stack: contextlib.ExitStack):
    """(site, client) of the first site that declares GPUs and whose scheduler has a
    worker with the GPU resource (stage_site); None when there is none."""
    where = stage_site(sites, stack)
    return (where.site, where.client) if where.remote else None
