"""A run's node records: one manifest row per node of the run, hit, computed or failed.

A run's manifest is a folder, one Parquet file per shard in plan order
(`part-00000.parquet`, ...), each written as its shard ends, and `run.json` (the
run's summary) written last: a run is recorded once its `run.json` is there, and a
driver never holds more than a shard's rows (10^6 rows are ~600 MB of Arrow columns).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from quantloop.tasks.engine import storage
from quantloop.tasks.engine.plan import NODE_COLUMNS
from quantloop.tasks.engine.store import KEY_PARTS, OUTPUT_COLUMNS

MANIFEST_SCHEMA = pa.schema(
    NODE_COLUMNS
    + [("site", pa.string())]
    # Where the node's input was read from, and the bytes it read from another site
    # (0 on a hit: it reads nothing). Manifests written before sites lack both.
    + [("input_site", pa.string()), ("bytes_across", pa.int64())]
    + KEY_PARTS
    + OUTPUT_COLUMNS
    + [
        ("cache_hit", pa.bool_()),
        ("status", pa.string()),  # "ok" or "failed"
        ("reason", pa.string()),  # why it ran: new, code, params, input, missing; "" on a hit
        ("error", pa.string()),
    ]
)
# Hashes (key, inputs, output_digest) are unique per row: dictionary-encoding them is
# tried and dropped at every page. Encoded plainly, with statistics only on what
# queries filter by, a 50,000-row part is written in ~45 ms instead of ~58 ms here.
_DICTIONARY = ["kind", "product", "date", "site", "input_site", "code", "params", "output_url",
               "status", "reason", "error"]  # fmt: skip
_STATISTICS = ["product", "date", "status", "cache_hit"]
MAX_FAILURES = 20  # errors a summary keeps to report; the manifest keeps every one
DONE = "run.json"


def manifest_rows(
    nodes: pa.Table,
    outputs: Mapping[str, Any],
    site: str,
    *,
    cache_hit: bool,
    reason: Any,
    errors: list[str],
) -> pa.Table:
    """Manifest rows: a plan's rows, their outputs (OUTPUT_COLUMNS), and how each ended.

    A plan placed across sites carries "input_site" (where its input copy is); without
    it the input is taken to be at `site`.
    """
    n = nodes.num_rows
    here = pa.repeat(pa.scalar(site, pa.string()), n)
    input_site = nodes["input_site"] if "input_site" in nodes.column_names else here
    if cache_hit:
        across = pa.repeat(pa.scalar(0, pa.int64()), n)
    else:
        elsewhere = pc.not_equal(input_site, here)
        across = pc.if_else(elsewhere, nodes["length"], 0).cast(pa.int64())
    return pa.table(
        {
            **{c: nodes[c] for c in ("key", "kind", "product", "date")},
            "site": here,
            "input_site": input_site,
            "bytes_across": across,
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


@dataclass(slots=True)
class RunSummary:
    """What a run, or a shard of it, did, without its rows: what a flow returns and
    records, summed shard by shard."""

    nodes: int = 0
    cache_hits: int = 0
    computed: int = 0
    failed: int = 0
    wall_s: float = 0.0
    batch_size: int = 0  # the largest batch (nodes per Dask task)
    batches: int = 0  # Dask tasks
    compute_s: float = 0.0  # the computed nodes' own seconds (read, compute, write)
    bytes_across: int = 0  # input bytes the computed nodes read from another site
    output_rows: int = 0
    output_bytes: int = 0
    reasons: dict[str, int] = field(default_factory=dict)  # computed nodes by why they ran
    failures: list[str] = field(default_factory=list)  # the first MAX_FAILURES errors
    manifest_url: str | None = None  # the run's manifest folder
    placement: str = ""  # the policy that placed the run's nodes
    sites: dict[str, dict] = field(default_factory=dict)  # per site: nodes, compute_s, cost, ...
    mlflow_run_id: str | None = None  # set by a flow that records the run

    @classmethod
    def of(cls, manifest: pa.Table, **counts: Any) -> RunSummary:
        """A shard's summary from its manifest rows (and its counts: nodes, wall_s, ...)."""
        ran = manifest.filter(pc.invert(manifest["cache_hit"]))
        failed = ran.filter(pc.equal(ran["status"], "failed"))
        reasons = pc.value_counts(ran["reason"]).to_pylist() if ran.num_rows else []
        return cls(
            **counts,
            compute_s=pc.sum(ran["duration_s"]).as_py() or 0.0,
            bytes_across=pc.sum(manifest["bytes_across"]).as_py() or 0,
            output_rows=pc.sum(manifest["rows"]).as_py() or 0,
            output_bytes=pc.sum(manifest["output_length"]).as_py() or 0,
            reasons={r["values"]: r["counts"] for r in reasons},
            failures=failed["error"].slice(0, MAX_FAILURES).to_pylist(),
        )

    def add(self, other: RunSummary) -> None:
        """Count another shard in (wall time aside: shards overlap)."""
        for name in ("nodes", "cache_hits", "computed", "failed", "batches", "compute_s",
                     "bytes_across", "output_rows", "output_bytes"):  # fmt: skip
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.batch_size = max(self.batch_size, other.batch_size)
        for reason, n in other.reasons.items():
            self.reasons[reason] = self.reasons.get(reason, 0) + n
        self.failures += other.failures[: MAX_FAILURES - len(self.failures)]


class RunRecords:
    """A run's manifest folder: a part per shard, `run.json` last."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")

    def write(self, part: int, manifest: pa.Table) -> str:
        """Write one shard's rows (atomically); returns the part's URL."""
        url = storage.join(self.url, f"part-{part:05d}.parquet")
        sink = pa.BufferOutputStream()
        pq.write_table(manifest, sink, compression="zstd", use_dictionary=_DICTIONARY,
                       write_statistics=_STATISTICS)  # fmt: skip
        storage.write_bytes_atomic(url, sink.getvalue().to_pybytes())
        return url

    def close(self, summary: RunSummary) -> None:
        """Mark the run recorded: its summary, written after every part."""
        text = json.dumps(dataclasses.asdict(summary), indent=1, default=str)
        storage.write_bytes_atomic(storage.join(self.url, DONE), text.encode())

    def parts(self) -> list[str]:
        return storage.list_files(self.url, ".parquet")


def recorded_runs(folder: str) -> list[str]:
    """The recorded runs under a folder of runs, oldest first (names start with a UTC
    stamp): run folders with their `run.json`, and older runs' single Parquet files."""
    runs = []
    for url in storage.list_files(folder):
        parent, name = url.rsplit("/", 1)
        if name == DONE:
            runs.append(parent)
        elif name.endswith(".parquet") and parent == folder.rstrip("/"):
            runs.append(url)
    return sorted(runs, key=lambda u: u.rsplit("/", 1)[-1])


def run_parts(url: str) -> list[str]:
    """The Parquet files of a recorded run, in plan order."""
    return [url] if url.endswith(".parquet") else RunRecords(url).parts()
