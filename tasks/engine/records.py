"""A run's node records: one manifest row per node of the run, hit, computed or failed."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pyarrow as pa

from quantloop.tasks.engine.plan import NODE_COLUMNS
from quantloop.tasks.engine.store import KEY_PARTS, OUTPUT_COLUMNS

MANIFEST_SCHEMA = pa.schema(
    NODE_COLUMNS
    + [("site", pa.string())]
    + KEY_PARTS
    + OUTPUT_COLUMNS
    + [
        ("cache_hit", pa.bool_()),
        ("status", pa.string()),  # "ok" or "failed"
        ("reason", pa.string()),  # why it ran: new, code, params, input, missing; "" on a hit
        ("error", pa.string()),
    ]
)


def manifest_rows(
    nodes: pa.Table,
    outputs: Mapping[str, Any],
    site: str,
    *,
    cache_hit: bool,
    reason: Any,
    errors: list[str],
) -> pa.Table:
    """Manifest rows: a plan's rows, their outputs (OUTPUT_COLUMNS), and how each ended."""
    n = nodes.num_rows
    return pa.table(
        {
            **{c: nodes[c] for c in ("key", "kind", "product", "date")},
            "site": pa.repeat(pa.scalar(site, pa.string()), n),
            **{c: nodes[c] for c in ("code", "params")},
            "inputs": nodes["digest"],
            **{name: outputs[name] for name, _ in OUTPUT_COLUMNS},
            "cache_hit": pa.repeat(pa.scalar(cache_hit), n),
            "status": ["failed" if e else "ok" for e in errors],
            "reason": reason,
            "error": errors,
        },
        schema=MANIFEST_SCHEMA,
    )
