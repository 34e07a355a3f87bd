"""A plan: the nodes a run is asked for, one Arrow row each (NODES_SCHEMA).

Columns, not objects: building, pickling and walking 10^5 Node objects cost the
driver 1.7 s per run under cProfile, the columns ~0.1 s.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from quantloop.tasks.engine.keys import keys_of

NODE_COLUMNS = [("key", pa.string()), ("kind", pa.string()), ("product", pa.string()),
                ("date", pa.string())]  # fmt: skip
# One row per node, what a batch ships to its worker; the input blob's digest is the
# key's "inputs".
NODES_SCHEMA = pa.schema(
    NODE_COLUMNS
    + [("code", pa.string()), ("params", pa.string())]
    + [("url", pa.string()), ("offset", pa.int64()), ("length", pa.int64()),
       ("digest", pa.string())]
)  # fmt: skip
# What a plan is made from: one row per input partition (a catalog table's columns).
INPUT_COLUMNS = ("product", "date", "digest", "location", "offset", "length")


@dataclass(frozen=True, slots=True)
class NodeKind:
    """How to compute a kind of node: compute(input table, params) -> output table.

    prepare(params dict) -> params as compute takes them, called once per batch and
    parameter set (parsing and validating per node would cost more than a small node).
    compute_many must give each node exactly what compute gives it alone.
    """

    name: str
    compute: Callable[[pa.Table, Any], pa.Table]
    code: str
    prepare: Callable[[dict], Any] | None = None
    # compute_many(tables, params) -> outputs: the same results for many small
    # inputs in one vectorized call, when the kind has one
    compute_many: Callable[[list[pa.Table], Any], list[pa.Table]] | None = None


def plan_nodes(kind: NodeKind, inputs: pa.Table, params_of: Mapping[str, str]) -> pa.Table:
    """One node of `kind` per input partition (a table with INPUT_COLUMNS), its
    parameters the digest `params_of[product]`: the plan table (NODES_SCHEMA)."""
    n = inputs.num_rows
    products = pc.dictionary_encode(inputs["product"].combine_chunks())
    by_product = pa.array([params_of[p] for p in products.dictionary.to_pylist()], pa.string())
    digests = by_product.take(products.indices)
    keys = keys_of(kind.name, kind.code, digests, inputs["digest"].combine_chunks())
    return pa.table(
        {
            "key": keys,
            "kind": pa.repeat(pa.scalar(kind.name, pa.string()), n),
            "product": inputs["product"],
            "date": inputs["date"],
            "code": pa.repeat(pa.scalar(kind.code, pa.string()), n),
            "params": digests,
            "url": inputs["location"].cast(pa.string()),  # dictionary-encoded in a catalog
            "offset": inputs["offset"],
            "length": inputs["length"],
            "digest": inputs["digest"],
        },
        schema=NODES_SCHEMA,
    )
