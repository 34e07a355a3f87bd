"""Why a node runs: which part of its key differs from its partition's last version."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from quantloop.tasks.engine.store import DROPPED, latest_per

# By which parts of its key differ from the partition's last committed node:
# bit 1 code, 2 params, 4 input; 8: the partition has none. A node whose key is the
# same as its partition's last one but was dropped (store.DROPPED) says why instead:
# "corrupt" or "missing".
_REASONS = pa.array(
    ["missing", "code", "params", "code+params", "input", "code+input", "params+input",
     "code+params+input", "new"]
)  # fmt: skip


def explain(idx: pa.Table, nodes: pa.Table) -> pa.Array:
    """Why each node (a row of a plan) must run: which part of its key differs from the
    last version of the same (kind, partition) in the index `idx`; "new" if there is
    none, "missing" if all parts match but the output is not committed."""
    n = nodes.num_rows
    if n == 0 or idx.num_rows == 0:
        return pc.take(_REASONS, pa.array([8] * n, pa.int8()))
    dropped = ["output_url", "output_length"] if "output_length" in idx.column_names else []
    last = latest_per(
        idx.select(["product", "date", "code", "params", "inputs", *dropped, "written_at"]),
        ["product", "date"],
    ).select(["product", "date", "code", "params", "inputs", *dropped])
    last = last.rename_columns(["product", "date", "last_code", "last_params", "last_inputs",
                                *(f"last_{c}" for c in dropped)])  # fmt: skip
    joined = (
        nodes.select(["product", "date", "code", "params", "digest"])
        .append_column("row", pa.array(range(n), pa.int64()))
        .join(last, keys=["product", "date"], join_type="left outer")
        .sort_by("row")
    )
    reason = pc.multiply(pc.cast(pc.is_null(joined["last_code"]), pa.int8()), 8)
    for bit, (now, before) in enumerate(
        [("code", "last_code"), ("params", "last_params"), ("digest", "last_inputs")]
    ):
        differs = pc.fill_null(pc.not_equal(joined[now], joined[before]), False)
        reason = pc.add(reason, pc.multiply(pc.cast(differs, pa.int8()), 1 << bit))
    reasons = pc.take(_REASONS, reason)
    if dropped:
        was_dropped = pc.fill_null(pc.equal(joined["last_output_length"], DROPPED), False)
        same_key = pc.equal(reason, 0)
        reasons = pc.if_else(pc.and_(was_dropped, same_key), joined["last_output_url"], reasons)
    return reasons.combine_chunks()
