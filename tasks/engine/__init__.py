"""The node engine: keys, packed content-addressed outputs, the cache index, execution.

It knows nodes, not the domain: a plan table (NODES_SCHEMA) in, outputs, index
segments and manifest rows out. Planning from a catalog lives in quantloop.tasks.
"""

from quantloop.tasks.engine.driver import BatchFailed, NoWorkers, RunResult, run_nodes
from quantloop.tasks.engine.keys import code_fingerprint, node_keys, sha256_json
from quantloop.tasks.engine.placement import COPIES_SCHEMA, NoCopyReachable, Policy, SiteCost, place
from quantloop.tasks.engine.plan import NODES_SCHEMA, NodeKind, plan_nodes
from quantloop.tasks.engine.records import (
    MANIFEST_SCHEMA,
    RunRecords,
    RunSummary,
    recorded_runs,
    run_parts,
)
from quantloop.tasks.engine.store import INDEX_SCHEMA, NodeStore, output_blob

__all__ = ["BatchFailed", "COPIES_SCHEMA", "INDEX_SCHEMA", "MANIFEST_SCHEMA", "NODES_SCHEMA",
           "NoCopyReachable", "NoWorkers", "NodeKind", "NodeStore", "Policy", "RunRecords",
           "RunResult", "RunSummary", "SiteCost", "code_fingerprint", "node_keys", "output_blob",
           "place", "plan_nodes", "recorded_runs", "run_nodes", "run_parts",
           "sha256_json"]  # fmt: skip
