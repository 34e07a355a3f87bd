"""What the stage flows (features, train, simulate) share: one parameter model, where
a selection's feature outputs are, the validation's folds over its dates and each
fold's outputs, and keyed outputs found by their key.

A stage output that is not a feature node (a model, a simulation) is keyed like a
node: key = sha256 of what decides it, stored under `<root>/<kind>/<key><suffix>`,
written atomically, so "exists" means "complete" and a re-run finds it instead of
recomputing it.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import pyarrow as pa
import pyarrow.compute as pc
from pydantic import BaseModel, ConfigDict, Field, model_validator

from quantloop.tasks.data.schema import Partition
from quantloop.tasks.engine import NodeKind, NodeStore, output_blob, sha256_json, storage
from quantloop.tasks.research.features import FeatureParams
from quantloop.tasks.research.folds import Fold, WalkForward, folds
from quantloop.tasks.research.form import (
    WALK_FORWARD,
    FeatureForm,
    ProductFeatures,
    ValidationForm,
    holdout_into_validation,
)
from quantloop.tasks.research.planning import feature_kind, plan_feature_table, product_params
from quantloop.tasks.runtime.workspace import Selection, Workspace

T = TypeVar("T")
log = logging.getLogger(__name__)


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
    validation: ValidationForm = Field(
        default=WALK_FORWARD,
        title="Validation",
        description="The walk-forward folds over the selection's dates: one model per fold, "
        "each replayed on its own test window.",
    )

    @model_validator(mode="before")
    @classmethod
    def _holdout(cls, values: Any) -> Any:
        return holdout_into_validation(values)  # a stage from before the folds

    def dates(self) -> list[dt.date]:
        """The trading days of the selection, as the catalog has them (oldest first)."""
        dates = pc.unique(self.selection.table(self.workspace.catalog())["date"]).to_pylist()
        return sorted(dt.date.fromisoformat(d) for d in dates)


def folds_of(dates: Iterable[dt.date], validation: WalkForward) -> list[Fold]:
    """The validation's folds over `dates`, oldest first (tasks/research/folds.folds). One date of
    data is one fold, the intraday cut at the held-out share, whatever `folds` asks: there
    is no later date to test on. ValueError naming the fields when the folds do not fit."""
    days = sorted(set(dates))
    if len(days) == 1 and validation.test_dates is not None:
        validation = dataclasses.replace(validation, folds=1)
    try:
        return folds(days, validation)
    except ValueError as exc:
        raise ValueError(f"validation: {exc}") from exc


def plan_folds(stage: StageParams) -> list[Fold]:
    """The folds of the stage's selection: what the train stage trains one model for and
    the simulate stage replays, each model on its own test window."""
    return folds_of(stage.dates(), stage.validation)


def describe(fold: Fold) -> str:
    """'train 2026-03-02..2026-03-04 (3 dates), test 2026-03-05': a fold in a log line."""

    def span(dates: tuple) -> str:
        if len(dates) == 1:
            return dates[0].isoformat()
        return f"{dates[0]}..{dates[-1]} ({len(dates)} dates)"

    if fold.intraday:
        return f"{span(fold.test_dates)}, the last {fold.holdout_fraction:.0%} of each day held out"
    embargo = f", embargo {span(fold.embargoed)}" if fold.embargoed else ""
    return f"train {span(fold.train_dates)}{embargo}, test {span(fold.test_dates)}"


def training_part(outputs: Mapping[Partition, T], fold: Fold) -> dict[Partition, T]:
    """The partitions a fold's model trains on (of an intraday fold: every partition of
    the day, whose rows before the cut train), in `outputs`' order."""
    dates = set(fold.train_dates)
    return {p: o for p, o in outputs.items() if p.date in dates}


def fold_part(outputs: Mapping[Partition, T], fold: Fold) -> dict[Partition, T]:
    """The partitions a fold's simulation reads: its training dates (where each signal's
    trading threshold comes from) and its test dates (what it replays), not its embargo."""
    dates = set(fold.train_dates) | set(fold.test_dates)
    return {p: o for p, o in outputs.items() if p.date in dates}


def fold_of(window: Mapping[str, Any], index: int = 0) -> Fold:
    """The Fold a recorded window (Fold.window(): a model's lineage, a run's folds.json)
    describes, to split tables as that fold did (tasks/research/folds.split_fold)."""

    def days(name: str) -> tuple[dt.date, ...]:
        return tuple(dt.date.fromisoformat(d) for d in window.get(name) or ())

    return Fold(index, days("train"), days("test"), days("embargo"),
                holdout_fraction=window.get("holdout_fraction"))  # fmt: skip


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
    site: str = ""  # the site whose store holds this copy

    def read(self) -> pa.Table:
        return storage.read_table(self.blob)


class DamagedOutputs(RuntimeError):
    """Stored feature outputs failed their digest or were gone when read; they have been
    dropped from the cache index, so the features stage recomputes them (the research
    flow does so itself, then goes on)."""

    def __init__(self, damaged: dict[str, str], labels: dict[str, str]):
        self.damaged = damaged  # key -> "corrupt" or "missing"
        self.labels = labels
        shown = ", ".join(f"{labels[k]} ({r})" for k, r in list(damaged.items())[:5])
        super().__init__(
            f"{len(damaged)} stored feature outputs were damaged and are dropped from the "
            f"cache (e.g. {shown}); the features stage recomputes them"
        )

    def __reduce__(self):  # raised in a training process of its own, re-raised in the flow
        return type(self), (self.damaged, self.labels)


def read_outputs(
    stage: StageParams, outputs: Mapping[Partition, FeatureOutput]
) -> dict[Partition, pa.Table]:
    """Each partition's feature table, checked against its digest. Damaged ones are
    dropped from the index together (all of them, not the first), then DamagedOutputs
    is raised: a damaged output is never used, nor counted as a hit again."""
    tables, damaged, labels = {}, {}, {}
    for part, out in outputs.items():
        try:
            tables[part] = out.read()
        except FileNotFoundError:
            damaged[out.key], labels[out.key] = "missing", str(part)
        except (ValueError, OSError) as exc:
            why = "missing" if "No such file" in str(exc) else "corrupt"
            damaged[out.key], labels[out.key] = why, str(part)
    if damaged:
        plan = plan_features(stage)
        for store in site_stores(stage.workspace):  # wherever the key is indexed
            for reason in set(damaged.values()):
                keys = pa.array([k for k, r in damaged.items() if r == reason], pa.string())
                rows = plan.nodes.filter(pc.is_in(plan.nodes["key"], value_set=keys))
                store.drop(plan.kind.name, rows.select(["key", "kind", "product", "date", "code",
                                                        "params"]).append_column(
                    "inputs", rows["digest"]), reason)  # fmt: skip
        raise DamagedOutputs(damaged, labels)
    return tables


def feature_outputs(
    stage: StageParams, prefer: str | None = None
) -> dict[Partition, FeatureOutput]:
    """Where each selected partition's features are stored; fails if any is missing.

    prefer: the site that will read them; where a node's output is stored at several
    sites (it ran at each under different placements), that site's copy is taken."""
    plan = plan_features(stage)
    rows: dict[str, dict] = {}
    held: dict[str, str] = {}  # key -> the site whose copy is taken
    sites = stage.workspace.resolve_sites()
    sites = sorted(sites, key=lambda s: s.name != prefer)  # stable: then the default first
    for site in sites:  # each node's output is where it ran (and where a copy was made)
        todo = plan.nodes.filter(
            pc.invert(pc.is_in(plan.nodes["key"], value_set=pa.array(list(rows), pa.string())))
        )
        if todo.num_rows:
            found = NodeStore(site.root).existing(plan.kind.name, todo).to_pylist()
            rows |= {r["key"]: r for r in found}
            held |= {r["key"]: site.name for r in found}
    out, missing = {}, []
    for key, product, date in zip(
        *(plan.nodes[c].to_pylist() for c in ("key", "product", "date")), strict=True
    ):
        part = Partition.trusted(product, dt.date.fromisoformat(date))
        if key in rows:
            out[part] = FeatureOutput(key, output_blob(rows[key]), held[key])
        else:
            missing.append(str(part))
    if missing:
        raise LookupError(
            f"features not computed for {len(missing)} partitions (e.g. {missing[:5]}); "
            "run the features flow on this selection first"
        )
    return out


def site_stores(workspace: Workspace) -> list[NodeStore]:
    """The node store of every site of the workspace, the default site's first."""
    return [NodeStore(site.root) for site in workspace.resolve_sites()]


@dataclass(frozen=True, slots=True)
class Keyed(Generic[T]):
    """A stage output found by its key, or computed now and stored under it."""

    key: str
    url: str
    value: T
    cache_hit: bool
    reason: str = ""  # why it was computed when it was stored: "corrupt"
    site: str = ""  # the site holding the copy taken, or where it was computed now


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
        try:
            return Keyed(key, url, load(url), cache_hit=True)
        except Exception as exc:  # noqa: BLE001 - any unreadable stored output is recomputed
            # Its bytes fail their check (or do not parse): never used, computed again
            # and stored over it.
            log.warning("%s %s is damaged (%s: %s): recomputing it", kind, key[:12],
                        type(exc).__name__, exc)  # fmt: skip
            value = compute()
            save(url, value)
            return Keyed(key, url, value, cache_hit=False, reason="corrupt")
    value = compute()
    save(url, value)
    return Keyed(key, url, value, cache_hit=False)
