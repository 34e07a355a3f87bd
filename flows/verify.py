"""The `verify` flow: re-hash a sample (or all) of a workspace's stores, at every site, and
repair what is damaged: feature outputs whose bytes fail their digest (or are gone) are
dropped from their site's cache index, so the next run recomputes them (reason
corrupt/missing); a stored model, simulation or statistics file that fails its recorded
digest (a model: its weights digest) is removed and forgotten by the catalog, so it is
computed again; input partitions are checked against the catalog and named with their
source for re-landing (the next research run on that source repairs them as it lands).

Every site: the workspace's, and every (site, storage root) the catalog has seen a run
use (a run on several sites records them), so `quantloop verify --home H` follows each
output to the site that holds it. A store that does not answer is named, not repaired."""

from __future__ import annotations

import os
import random
import time

import pyarrow as pa
import pyarrow.compute as pc
from prefect import flow, get_run_logger

from quantloop.tasks.data.catalog import OutputCopy
from quantloop.tasks.engine import NodeStore, storage
from quantloop.tasks.engine.driver import check_outputs
from quantloop.tasks.engine.store import DROPPED, latest_per
from quantloop.tasks.research.sited import site_roots
from quantloop.tasks.research.training import load_model
from quantloop.tasks.runtime import progress
from quantloop.tasks.runtime.workspace import Workspace


def _remove(url: str) -> None:
    fs, path = storage.filesystem(url)
    try:
        fs.rm_file(path)
    except FileNotFoundError:
        pass


def check_copy(kind: str, copy: OutputCopy) -> str:
    """'' when a recorded stage output copy has its recorded bytes (a model: and its
    weights their digest); else 'missing' or 'corrupt: ...'. OSError if its store does not
    answer."""
    try:
        data = storage.read_bytes(copy.url)
    except FileNotFoundError:
        return "missing"
    except OSError as exc:
        if "No such file" in str(exc):
            return "missing"
        raise
    digest = storage.sha256_hex(data)
    if (len(data), digest) != (copy.length, copy.digest):
        return (f"corrupt: {len(data):,} bytes with sha256 {digest[:12]}, recorded as "
                f"{copy.length:,} bytes with {copy.digest[:12]}")  # fmt: skip
    if kind == "model":
        try:
            load_model(copy.url)  # checks the weights against their stored digest
        except Exception as exc:  # noqa: BLE001 - any unreadable model is damaged
            return f"corrupt: {type(exc).__name__}: {exc}"
    return ""


@flow(name="verify")
def verify(
    workspace: Workspace = Workspace(),
    sample: int | None = None,
    repair: bool = True,
    seed: int = 0,
) -> dict:
    """Check `sample` stored feature outputs of each site (all: None), every stored model,
    simulation and statistics file at every site, and every current input partition;
    with `repair`, take damaged outputs out of the cache."""
    t0 = time.perf_counter()
    logger = get_run_logger()
    catalog = workspace.catalog()
    roots = site_roots([(s.name, s.root) for s in workspace.resolve_sites()], catalog)
    damaged: dict[str, str] = {}
    checked = committed_n = 0
    per_site: dict[str, dict] = {}
    unreachable: list[str] = []
    elsewhere: list[str] = []  # copies in folders this host does not have
    for name, root in roots:
        if "://" not in root and not os.path.isdir(root):
            continue  # a folder nothing was stored in (yet), or another host's
        label = name if name not in per_site else f"{name} ({root})"
        try:
            store = NodeStore(root)
            index = store.rows("features")
            latest = latest_per(index, ["key"]) if index.num_rows else index
            committed = latest.filter(pc.not_equal(latest["output_length"], DROPPED))
            picked = committed
            if sample is not None and sample < committed.num_rows:
                rows = sorted(random.Random(seed).sample(range(committed.num_rows), sample))
                picked = committed.take(pa.array(rows, pa.int64()))
            found = check_outputs(picked)
        except OSError as exc:
            unreachable.append(f"site {name} ({root}): {type(exc).__name__}: {exc}")
            continue
        if repair and found:
            for reason in set(found.values()):
                keys = pa.array([k for k, r in found.items() if r == reason], pa.string())
                store.drop("features", picked.filter(pc.is_in(picked["key"], value_set=keys)),
                           reason)  # fmt: skip
        per_site[label] = {"root": root, "outputs_checked": picked.num_rows,
                           "outputs_committed": committed.num_rows,
                           "outputs_damaged": len(found)}  # fmt: skip
        damaged |= found
        checked += picked.num_rows
        committed_n += committed.num_rows

    # Stage outputs: every copy the catalog records, at whichever site holds it.
    models_bad, others_bad = [], []
    recorded = set()
    stage_checked = 0
    for kind, key, copy in catalog.outputs():
        recorded.add(copy.url)
        root = copy.url.rsplit(f"/{kind}s/", 1)[0]
        if "://" not in copy.url and not os.path.isdir(root):
            # a folder this host does not have (another host's, on a shared catalog):
            # not checked here, and not forgotten
            elsewhere.append(f"{kind} {key[:12]} at site {copy.site}: {copy.url}")
            continue
        try:
            why = check_copy(kind, copy)
        except OSError as exc:
            unreachable.append(f"{kind} {key[:12]} at site {copy.site} ({copy.url}): {exc}")
            continue
        stage_checked += 1
        if not why:
            continue
        (models_bad if kind == "model" else others_bad).append(
            f"{copy.url}: {kind} at site {copy.site}: {why}")  # fmt: skip
        if repair:
            _remove(copy.url)
            catalog.drop_output(kind, key, copy.url)
    # Models stored before the catalog kept them: each site's models folder.
    for name, root in roots:
        if "://" not in root and not os.path.isdir(root):
            continue
        try:
            urls = storage.list_files(storage.join(root, "models"), ".pt")
        except OSError as exc:
            unreachable.append(f"site {name} ({root}) models: {exc}")
            continue
        for url in urls:
            if url in recorded:
                continue
            stage_checked += 1
            try:
                load_model(url)  # checks the weights against their recorded digest
            except Exception as exc:  # noqa: BLE001 - any unreadable model is damaged
                models_bad.append(f"{url}: {type(exc).__name__}: {exc}")
                if repair:
                    _remove(url)
    inputs_bad = [
        f"{e.dataset} {e.partition} (source: {e.source or 'unknown'})"
        for dataset in catalog.datasets()
        for e in catalog.entries(dataset)
        if not catalog.intact(e)
    ]
    report = {
        "outputs_checked": checked,
        "outputs_committed": committed_n,
        "outputs_damaged": {k: r for k, r in sorted(damaged.items())},
        "models_damaged": models_bad,
        "stage_outputs_checked": stage_checked,
        "stage_outputs_damaged": others_bad,  # simulations' mark-outs, their statistics
        "inputs_damaged": inputs_bad,
        "sites": per_site,
        "unreachable": unreachable,
        "not_on_this_host": elsewhere,
        "repaired": repair,
        "seconds": time.perf_counter() - t0,
    }
    dropped = " (dropped: recomputed next run)" if repair and damaged else ""
    line = (f"{checked:,} of {committed_n:,} outputs checked at {len(per_site)} site(s): "
            f"{len(damaged)} damaged{dropped}"
            f"; {stage_checked:,} models, simulations and statistics checked: "
            f"{len(models_bad)} models and {len(others_bad)} others damaged; "
            f"{len(inputs_bad)} inputs damaged")  # fmt: skip
    logger.info(line)
    progress.note("verify", line)
    for what in inputs_bad:
        logger.warning("input partition damaged: %s; land its source again", what)
    for what in unreachable:
        logger.warning("not checked (its store did not answer): %s", what)
    return report
