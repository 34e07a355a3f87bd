"""Placement: which site runs each node of a plan, and which copy of its input it reads.

A node's input may have copies at several sites (same digest). Under the `node`
policy a node runs at a site holding a copy, the cheapest per hour of those (ties: the
earlier site in the list), and reads that copy: no input byte crosses sites. Under
`single:<site>` every node runs at that site and reads the copy there if it has one,
else the copy at the first site that has one: the bytes cross. A node whose input has
no copy at any site given runs at the first (default) site and reads the location its
plan row names; its input site is "" (not one of ours), so its bytes count as crossing.

Domain-free: an inputs table (the plan's INPUT_COLUMNS: digest, location, offset,
length), copies and site names in; the same rows with "site" and "input_site" columns
and each row's location, offset and length those of the chosen copy, out.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import pyarrow as pa

COPIES_SCHEMA = pa.schema(
    [("digest", pa.string()), ("site", pa.string()), ("url", pa.string()),
     ("offset", pa.int64()), ("length", pa.int64())]
)  # fmt: skip


@dataclass(frozen=True, slots=True, kw_only=True)
class SiteCost:
    name: str
    cost_per_hour: float = 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Policy:
    """`node` (each node where its input is) or `single:<site>` (every node at one site)."""

    single: str | None = None

    @classmethod
    def parse(cls, text: str, sites: Collection[str]) -> Policy:
        if text == "node":
            return cls()
        if text.startswith("single:") and text.removeprefix("single:") in sites:
            return cls(single=text.removeprefix("single:"))
        raise ValueError(
            f"placement {text!r}: must be 'node' or 'single:<site>' with a site of "
            f"the workspace ({', '.join(sites)})"
        )

    def __str__(self) -> str:
        return "node" if self.single is None else f"single:{self.single}"


class NoCopyReachable(LookupError):
    """Nodes whose input has no copy at any site that can run them."""


def place(
    inputs: pa.Table,
    copies: pa.Table,
    sites: Sequence[SiteCost],
    policy: Policy,
    *,
    down: Collection[str] = (),
) -> pa.Table:
    """The inputs with each node's site, input site and chosen input copy.

    inputs: one row per node: "digest" (its input's), "location", "offset", "length".
    copies: COPIES_SCHEMA rows, every known copy of the inputs (any order).
    sites: the sites that may run nodes, the default first.
    down: sites that cannot run nodes now; a node is re-placed at another site holding
      a copy of its input, and NoCopyReachable names the site when none does.
    """
    rank = {s.name: (s.cost_per_hour, i) for i, s in enumerate(sites)}
    at: dict[str, dict[str, tuple[str, int, int]]] = {}  # digest -> site -> copy
    for digest, site, url, offset, length in zip(
        *(copies[c].to_pylist() for c in COPIES_SCHEMA.names), strict=True
    ):
        if site in rank:
            at.setdefault(digest, {}).setdefault(site, (url, offset, length))
    default = sites[0].name
    by_cost = sorted(rank, key=rank.__getitem__)
    by_order = [s.name for s in sites]
    if policy.single in down:
        raise NoCopyReachable(f"site {policy.single!r} is down and the placement is {policy}")
    n = inputs.num_rows
    run_at, read_at = [""] * n, [""] * n
    urls, offsets, lengths = (inputs[c].to_pylist() for c in ("location", "offset", "length"))
    stranded: dict[str, int] = {}  # down site -> nodes with no copy elsewhere
    for i, digest in enumerate(inputs["digest"].to_pylist()):
        held = at.get(digest, {})
        if policy.single is not None:
            run_at[i] = policy.single
            source = policy.single if policy.single in held else next(
                (s for s in by_order if s in held), "")  # fmt: skip
        else:
            source = next((s for s in by_cost if s in held and s not in down), "")
            if not source and held:  # copies only at sites that are down
                for s in held:
                    stranded[s] = stranded.get(s, 0) + 1
                continue
            run_at[i] = source or default
        read_at[i] = source
        if source:
            urls[i], offsets[i], lengths[i] = held[source]
    if stranded:
        names = ", ".join(f"{s!r} ({k} nodes)" for s, k in sorted(stranded.items()))
        raise NoCopyReachable(
            f"site {names} cannot run its nodes and no other site holds a copy of their "
            "inputs (replicate them to another site, or bring the site back)"
        )
    if default in down and "" in run_at:
        raise NoCopyReachable(f"site {default!r} (the default) is down and runs the nodes "
                              "whose inputs are at no site of the workspace")  # fmt: skip
    out = inputs
    for name, values, typ in (("location", urls, pa.string()), ("offset", offsets, pa.int64()),
                              ("length", lengths, pa.int64())):  # fmt: skip
        out = out.set_column(out.schema.get_field_index(name), name, pa.array(values, typ))
    return out.append_column("site", pa.array(run_at, pa.string())).append_column(
        "input_site", pa.array(read_at, pa.string())
    )
