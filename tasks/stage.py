"""What the stage flows (features, train, simulate) share: one parameter model, where
a selection's feature outputs are, and keyed outputs found by their key.

A stage output that is not a feature node (a model, a simulation) is keyed like a
node: key = sha256 of what decides it, stored under `<root>/<kind>/<key><suffix>`,
written atomically, so "exists" means "complete" and a re-run finds it instead of
recomputing it.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import pyarrow as pa
import pyarrow.compute as pc
from pydantic import BaseModel, ConfigDict, Field

from quantloop.tasks import storage
from quantloop.tasks.engine import NodeKind, NodeStore, output_blob, sha256_json
from quantloop.tasks.features import FeatureParams
from quantloop.tasks.form import FeatureForm, HoldoutFraction, ProductFeatures
from quantloop.tasks.planning import feature_kind, plan_feature_table, product_params
from quantloop.tasks.schema import Partition
from quantloop.tasks.workspace import Selection, Workspace

T = TypeVar("T")


class StageParams(BaseModel):
    """The parameters every stage flow takes: where it runs, which partitions, which
    features (a model and a simulation are keyed by the feature nodes they read)."""

    model_config = ConfigDict(extra="forbid")

    workspace: Workspace = Field(
        default=Workspace(),
        title="Workspace",
        description="Where the data, node outputs and records live.",
    )
    selection: Selection = Field(
        default=Selection(),
        title="Selection",
        description="The partitions (products x dates) of a landed dataset this stage covers.",
    )
    features: FeatureForm = Field(
        default=FeatureParams(),
        title="Features",
        description="The feature parameters the stage's feature nodes were (or are) made with.",
    )
    product_features: ProductFeatures = {}
    holdout_fraction: HoldoutFraction = 0.3


@dataclass(frozen=True, slots=True)
class FeaturePlan:
    """The feature nodes of a selection, as a plan table (NODES_SCHEMA)."""

    kind: NodeKind
    nodes: pa.Table
    params: dict[str, dict]  # canonical parameters by digest (what node keys hash)
    per_product: dict[str, FeatureParams]

    def data_digest(self) -> str:
        """The digest of exactly which input versions the plan reads: sorted
        (product/date, partition digest) pairs."""
        pairs = zip(self.nodes["product"].to_pylist(), self.nodes["date"].to_pylist(),
                    self.nodes["digest"].to_pylist(), strict=True)  # fmt: skip
        return sha256_json(sorted((f"{p}/{d}", digest) for p, d, digest in pairs))


def plan_features(stage: StageParams, entries: pa.Table | None = None) -> FeaturePlan:
    """Plan the feature nodes of the stage's selection (catalog read and hashing only).

    entries: the selection's catalog table when the caller has read it already.
    """
    if entries is None:
        entries = stage.selection.table(stage.workspace.catalog())
    kind = feature_kind()
    per_product = product_params(
        stage.features, stage.product_features, pc.unique(entries["product"]).to_pylist()
    )
    nodes, by_digest = plan_feature_table(entries, per_product, kind)
    return FeaturePlan(kind, nodes, by_digest, per_product)


@dataclass(frozen=True, slots=True)
class FeatureOutput:
    key: str  # the feature node's key: what downstream keys are built from
    blob: storage.Blob

    def read(self) -> pa.Table:
        return storage.read_table(self.blob)


def feature_outputs(stage: StageParams) -> dict[Partition, FeatureOutput]:
    """Where each selected partition's features are stored; fails if any is missing."""
    plan = plan_features(stage)
    store = NodeStore(stage.workspace.resolve_site().root)
    found = store.existing(plan.kind.name, plan.nodes)
    rows = {r["key"]: r for r in found.to_pylist()}
    out, missing = {}, []
    for key, product, date in zip(
        *(plan.nodes[c].to_pylist() for c in ("key", "product", "date")), strict=True
    ):
        part = Partition.trusted(product, dt.date.fromisoformat(date))
        if key in rows:
            out[part] = FeatureOutput(key, output_blob(rows[key]))
        else:
            missing.append(str(part))
    if missing:
        raise LookupError(
            f"features not computed for {len(missing)} partitions (e.g. {missing[:5]}); "
            "run the features flow on this selection first"
        )
    return out


@dataclass(frozen=True, slots=True)
class Keyed(Generic[T]):
    """A stage output found by its key, or computed now and stored under it."""

    key: str
    url: str
    value: T
    cache_hit: bool


def output_key(kind: str, **decided_by: Any) -> str:
    """The key of a stage output: the digest of everything that decides it."""
    return sha256_json({"kind": kind, **decided_by})


def keyed_output(
    root: str,
    kind: str,
    key: str,
    suffix: str,
    *,
    load: Callable[[str], T],
    compute: Callable[[], T],
    save: Callable[[str, T], None],
) -> Keyed[T]:
    """The output stored under `<root>/<kind>s/<key><suffix>`, else computed and saved.

    `save` must write atomically (storage.write_bytes_atomic or its callers), so a
    stored output is always a complete one.
    """
    url = storage.join(root, f"{kind}s", f"{key}{suffix}")
    if storage.exists(url):
        return Keyed(key, url, load(url), cache_hit=True)
    value = compute()
    save(url, value)
    return Keyed(key, url, value, cache_hit=False)
