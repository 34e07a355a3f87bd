"""Reproduce recorded results: re-run nodes, the model and the simulation from their
recorded inputs, parameters and code, without reading or writing the cache, and compare.

A node reproduces when its output, computed again now, has the recorded digest. It
fails with a reason: the input is gone (no stored bytes with the recorded digest),
its parameters are gone, the code changed (today's fingerprint of its kind differs
from the recorded one: today's code cannot say what the old code did), or the output
differs (the same code and inputs gave other bytes: nondeterminism, or a platform
difference). The failure rate is failures / nodes checked.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from quantloop.tasks.data.catalog import Catalog
from quantloop.tasks.engine import NodeKind, storage


@dataclass(frozen=True, slots=True)
class Check:
    """One reproduced result: a node, the model or the simulation."""

    what: str  # the node kind, "model" or "simulation"
    key: str
    label: str  # product/date of a node; what a model or simulation is
    reproduced: bool
    reason: str  # "" when reproduced; else input gone, params gone, code changed, ...
    recorded: str  # the recorded digest (or figure)
    now: str  # what re-running gave

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class Report:
    checks: list[Check]

    @property
    def nodes(self) -> int:
        return len(self.checks)

    @property
    def failures(self) -> int:
        return sum(not c.reproduced for c in self.checks)

    @property
    def failure_rate(self) -> float:
        return self.failures / self.nodes if self.nodes else 0.0

    def summary(self) -> dict[str, Any]:
        return {"nodes": self.nodes, "failures": self.failures,
                "failure_rate": self.failure_rate,
                "checks": [c.to_dict() for c in self.checks]}  # fmt: skip


def sample_rows(rows: Sequence[dict], sample: int | None, seed: int = 0) -> list[dict]:
    """All rows, or `sample` of them drawn with a fixed seed (the same sample each time)."""
    rows = list(rows)
    if sample is None or sample >= len(rows):
        return rows
    return random.Random(seed).sample(rows, sample)


def input_blobs(catalog: Catalog, digests: set[str]) -> dict[str, storage.Blob]:
    """Where each input version lives, by digest: the catalog's current versions and
    every one they replaced (a run reads its pin, which newer landings do not change)."""
    return catalog.blobs(digests)


def check_nodes(
    rows: Sequence[dict],
    *,
    root: str,
    catalog: Catalog,
    kinds: Mapping[str, NodeKind],
) -> list[Check]:
    """Re-run each recorded node (a manifest row) alone, in this process, writing
    nothing, and compare its output digest with the recorded one."""
    blobs = input_blobs(catalog, {r["inputs"] for r in rows})
    checks = []
    for row in rows:
        label = f"{row['product']}/{row['date']}"

        def failed(reason: str, now: str = "", row=row, label=label) -> Check:
            return Check(row["kind"], row["key"], label, False, reason, row["output_digest"], now)

        kind = kinds.get(row["kind"])
        if kind is None:
            checks.append(failed(f"no code for node kind {row['kind']!r}"))
            continue
        if kind.code != row["code"]:
            checks.append(failed("code changed", kind.code))
            continue
        params_url = storage.join(root, "params", f"{row['params']}.json")
        if not storage.exists(params_url):
            checks.append(failed("params gone"))
            continue
        blob = blobs.get(row["inputs"])
        if blob is None:
            checks.append(failed("input gone"))
            continue
        try:
            table = storage.read_table(blob)  # checked against its digest
        except (OSError, ValueError) as exc:
            checks.append(failed(f"input gone: {exc}"))
            continue
        values = json.loads(storage.read_bytes(params_url))
        try:
            out = kind.compute(table, kind.prepare(values) if kind.prepare else values)
        except Exception as exc:  # noqa: BLE001 - a node that fails now is a failure to report
            checks.append(failed(f"fails now: {type(exc).__name__}: {exc}"))
            continue
        now = storage.sha256_hex(storage.arrow_bytes(out))
        ok = now == row["output_digest"]
        checks.append(Check(row["kind"], row["key"], label, ok, "" if ok else "output differs",
                            row["output_digest"], now))  # fmt: skip
    return checks


def check_value(
    what: str, key: str, label: str, recorded: str, compute: Callable[[], str]
) -> Check:
    """A model or a simulation: compute it again; `compute` returns what is compared
    (a weights digest; mark-outs rounded to the stated tolerance)."""
    try:
        now = compute()
    except Exception as exc:  # noqa: BLE001
        return Check(what, key, label, False, f"fails now: {type(exc).__name__}: {exc}",
                     recorded, "")  # fmt: skip
    same = now == recorded
    return Check(what, key, label, same, "" if same else "output differs", recorded, now)


MARKOUT_TOLERANCE_BPS = 1e-6  # another device class: mark-outs agree to this, not bit for bit


def markout_fingerprint(markout_bps: Mapping[str, float]) -> str:
    """Mark-out per horizon rounded to the tolerance: equal within it, equal text."""
    digits = int(-np.log10(MARKOUT_TOLERANCE_BPS))
    return json.dumps({h: round(v, digits) if np.isfinite(v) else None
                       for h, v in sorted(markout_bps.items())})  # fmt: skip


def manifest_rows(tables: Sequence[pa.Table]) -> list[dict]:
    """The ok rows of recorded manifests (a failed node has no output to reproduce)."""
    rows = []
    for t in tables:
        rows += [r for r in t.to_pylist() if r["status"] == "ok"]
    # identical-content partitions share a key: reproduce each output once
    return list({r["key"]: r for r in rows}.values())
