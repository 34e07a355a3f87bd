"""The `verify` flow: re-hash a sample (or all) of a workspace's store and repair what
is damaged: feature outputs whose bytes fail their digest (or are gone) are dropped
from the cache index, so the next run recomputes them (reason corrupt/missing); a
stored model that fails its weights digest is removed, so it is trained again; input
partitions are checked against the catalog and named with their source for re-landing
(the next research run on that source repairs them as it lands)."""

from __future__ import annotations

import random
import time

import pyarrow as pa
import pyarrow.compute as pc
from prefect import flow, get_run_logger

from quantloop.tasks.engine import NodeStore, storage
from quantloop.tasks.engine.driver import check_outputs
from quantloop.tasks.engine.store import DROPPED, latest_per
from quantloop.tasks.research.training import load_model
from quantloop.tasks.runtime import progress
from quantloop.tasks.runtime.workspace import Workspace


@flow(name="verify")
def verify(
    workspace: Workspace = Workspace(),
    sample: int | None = None,
    repair: bool = True,
    seed: int = 0,
) -> dict:
    """Check `sample` stored feature outputs (all: None), every stored model and every
    current input partition; with `repair`, take damaged outputs out of the cache."""
    t0 = time.perf_counter()
    logger = get_run_logger()
    site, catalog = workspace.resolve_site(), workspace.catalog()
    store = NodeStore(site.root)
    index = store.rows("features")
    latest = latest_per(index, ["key"]) if index.num_rows else index
    committed = latest.filter(pc.not_equal(latest["output_length"], DROPPED))
    picked = committed
    if sample is not None and sample < committed.num_rows:
        rows = sorted(random.Random(seed).sample(range(committed.num_rows), sample))
        picked = committed.take(pa.array(rows, pa.int64()))
    damaged = check_outputs(picked)
    if repair and damaged:
        for reason in set(damaged.values()):
            keys = pa.array([k for k, r in damaged.items() if r == reason], pa.string())
            store.drop("features", picked.filter(pc.is_in(picked["key"], value_set=keys)),
                       reason)  # fmt: skip
    models_bad = []
    for url in storage.list_files(storage.join(site.root, "models"), ".pt"):
        try:
            load_model(url)  # checks the weights against their recorded digest
        except Exception as exc:  # noqa: BLE001 - any unreadable model is damaged
            models_bad.append(f"{url}: {type(exc).__name__}: {exc}")
            if repair:
                fs, path = storage.filesystem(url)
                fs.rm_file(path)
    inputs_bad = [
        f"{e.dataset} {e.partition} (source: {e.source or 'unknown'})"
        for dataset in catalog.datasets()
        for e in catalog.entries(dataset)
        if not catalog.intact(e)
    ]
    report = {
        "outputs_checked": picked.num_rows,
        "outputs_committed": committed.num_rows,
        "outputs_damaged": {k: r for k, r in sorted(damaged.items())},
        "models_damaged": models_bad,
        "inputs_damaged": inputs_bad,
        "repaired": repair,
        "seconds": time.perf_counter() - t0,
    }
    line = (f"{picked.num_rows:,} of {committed.num_rows:,} outputs checked: {len(damaged)} "
            f"damaged{' (dropped: recomputed next run)' if repair and damaged else ''}; "
            f"{len(models_bad)} models damaged; {len(inputs_bad)} inputs damaged")  # fmt: skip
    logger.info(line)
    progress.note("verify", line)
    for what in inputs_bad:
        logger.warning("input partition damaged: %s; land its source again", what)
    return report
