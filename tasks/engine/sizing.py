"""How many nodes go into one Dask task (guided self-scheduling).

Nodes far smaller than Dask's per-task cost (~3 ms here) run in batches sized from
the measured work per node, so each node costs only its own work.
"""

from __future__ import annotations

import math
import statistics

import pyarrow as pa

# A Dask task should hold about this much node work: long enough to bury its fixed
# cost (Dask's ~3 ms, reading packs, writing a pack and an index segment); the load
# balance at the end comes from batches shrinking as the work runs out.
TARGET_TASK_S = 1.0
IN_FLIGHT_PER_WORKER = 2  # one running, one waiting: a worker never waits on the driver
FIRST_BATCH_NODES = 256  # batch size until the work per node has been measured


def batch_size(remaining: int, workers: int, node_s: float | None) -> int:
    """Nodes for the next Dask task: about TARGET_TASK_S of work, but at most a
    1/(2 x workers) share of what remains, so batches shrink toward the end and the
    workers finish together; not below a sixteenth of the target (~60 ms of work),
    where a task's own cost would start to show. Before anything is measured
    (node_s None), FIRST_BATCH_NODES."""
    share = max(1, math.ceil(remaining / (2 * workers)))
    if node_s is None:
        return min(FIRST_BATCH_NODES, share)
    by_work = max(1, int(TARGET_TASK_S / max(node_s, 1e-6)))
    return min(max(share, by_work // 16), by_work, remaining)


def typical_node_s(index: pa.Table) -> float | None:
    """Median work per node of a kind from its committed history, if there is any."""
    if index.num_rows == 0:
        return None
    recent = index["duration_s"].slice(max(0, index.num_rows - 2_000))
    values = [v for v in recent.to_pylist() if v is not None]
    return statistics.median(values) if values else None
