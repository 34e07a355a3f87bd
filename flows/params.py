"""The research flow's parameter: the run form (ResearchParams), in a module that imports
no flow, no MLflow and no torch, so `quantloop run` checks a run's parameters and data
before anything slow is loaded (a bad LOBSTER folder is refused in ~2 s, not ~5)."""

from __future__ import annotations

import datetime as dt
import math
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from quantloop.tasks.data.landing import business_days, scan_lobster_folder
from quantloop.tasks.data.schema import Partition
from quantloop.tasks.data.synthetic import SyntheticConfig
from quantloop.tasks.engine import sha256_json
from quantloop.tasks.research.features import FeatureParams
from quantloop.tasks.research.form import (
    WALK_FORWARD,
    FeatureForm,
    ProductFeatures,
    SimForm,
    TrainForm,
    ValidationForm,
    holdout_into_validation,
    without_null_branches,
)
from quantloop.tasks.research.planning import normalized_overrides, product_params
from quantloop.tasks.research.simulation import SimConfig
from quantloop.tasks.research.stage import StageParams, folds_of
from quantloop.tasks.research.sweep import Sweep
from quantloop.tasks.research.train_config import TrainConfig
from quantloop.tasks.runtime.workspace import Selection, Workspace

# The dates a run may name: wide enough for any market data, narrow enough to catch a
# typo (a start date in 1800 used to be accepted and generated).
FIRST_DATE, LAST_DATE = dt.date(1970, 1, 1), dt.date(2099, 12, 31)


class DataSource(BaseModel):
    """Where the order books come from: LOBSTER files, or the synthetic generator."""

    model_config = ConfigDict(extra="forbid")

    lobster_dir: Annotated[str, Field(title="Folder")] | None = Field(
        default=None,
        title="LOBSTER folder",
        description="Folder (or one file) of LOBSTER zips or message/orderbook CSV pairs, on "
        "the worker; every file is validated before anything lands. None: synthetic order "
        "books, as set below.",
    )
    products: list[str] = Field(
        default=["SYNA", "SYNB", "SYNC"],
        min_length=1,
        title="Products",
        description="Synthetic products to generate (at least one; letters, digits, '.', "
        "'_', '-').",
    )
    start_date: dt.date = Field(
        default=dt.date(2026, 3, 2),
        ge=FIRST_DATE,
        le=LAST_DATE,
        title="First date",
        description=f"First synthetic trading day ({FIRST_DATE} to {LAST_DATE}).",
    )
    n_dates: int = Field(
        default=4,
        ge=2,
        le=10_000,
        title="Trading days",
        description="Synthetic trading days per product, weekdays from the first date "
        "(2 to 10,000).",
    )
    synthetic: SyntheticConfig = Field(
        default=SyntheticConfig(),
        title="Synthetic generator",
        description="How the synthetic order books are generated (ignored with a LOBSTER folder).",
    )

    @field_validator("products")
    @classmethod
    def _products(cls, products: list[str]) -> list[str]:
        for p in products:
            Partition(p, FIRST_DATE)  # the name rule partitions enforce, with its message
        duplicated = sorted({p for p in products if products.count(p) > 1})
        if duplicated:
            raise ValueError(f"products listed more than once: {duplicated}")
        return products


class ResearchParams(BaseModel):
    """Everything a research run depends on. Unknown fields are errors, not ignored."""

    model_config = ConfigDict(extra="forbid")

    workspace: Workspace = Field(
        default=Workspace(),
        title="Workspace",
        description="Where the data, node outputs and records live: a site, MLflow tracking "
        "and a catalog (saved blocks), or the embedded defaults under a home folder.",
    )
    data: DataSource = Field(
        default=DataSource(),
        title="Data",
        description="The order books: LOBSTER files, or the synthetic generator.",
    )
    features: FeatureForm = Field(
        default=FeatureParams(),
        title="Features",
        description="The feature node's parameters (one node per product and date).",
    )
    product_features: ProductFeatures = {}
    train: TrainForm = Field(
        default=TrainConfig(),
        title="Training",
        description="How the model is trained on the training part of every product.",
    )
    sweep: Sweep = Field(
        default=Sweep(),
        title="Sweep of training settings",
        description="Several settings of the training config (learning rates, weight "
        "decays, seeds, model shapes: a grid or a list), each trained on every fold, "
        "replayed on its test windows and ranked on the pooled out-of-sample mark-outs, "
        "every setting counted as a trial; the best is the registered model. Empty: one "
        "model per fold at the training config.",
    )
    simulation: SimForm = Field(
        default=SimConfig(),
        title="Simulation",
        description="How the held-out part is replayed and marked out.",
    )
    validation: ValidationForm = Field(
        default=WALK_FORWARD,
        title="Validation",
        description="How the dates are split into walk-forward folds: one model per fold, "
        "trained on the dates before its test window and replayed on that window only; the "
        "mark-outs of all the test windows are pooled.",
    )
    shard_size: int = Field(
        default=50_000,
        ge=1,
        le=10_000_000,
        title="Shard size (nodes)",
        description="Feature nodes per Prefect task (1 to 10,000,000): the UI shows one task "
        "per shard, never one per node.",
    )
    verify_hits: bool = Field(
        default=True,
        title="Verify cached outputs",
        description="Read every cached feature output and check its length and sha256 before "
        "counting it a hit; a damaged one is recomputed. Off: a hit is trusted unread until "
        "something reads it (saves reading every output: see bench/cache_check.py).",
    )

    @classmethod
    def __get_pydantic_json_schema__(cls, core_schema, handler):
        # The run form (Prefect's UI) renders a null branch as 'Property is type "None"'.
        return without_null_branches(handler(core_schema), handler)

    @field_validator("simulation")
    @classmethod
    def _finite_horizons(cls, sim: SimConfig) -> SimConfig:
        # The form's `> 0` lets infinity through, and an infinite horizon gave a mark-out
        # column "infs" of NaN at the end of a run: refused here, before any work.
        if not all(0 < h < math.inf for h in sim.markout_horizons_s):
            raise ValueError(
                "simulation.markout_horizons_s must be finite numbers of seconds > 0, got "
                f"{list(sim.markout_horizons_s)}"
            )
        return sim

    # A form from before the folds (an old resolved_params.json, a recipe, a params file)
    # has a top-level holdout_fraction: the single split it made.
    @model_validator(mode="before")
    @classmethod
    def _holdout(cls, values: Any) -> Any:
        return holdout_into_validation(values)

    @model_validator(mode="after")
    def _overrides(self) -> ResearchParams:
        # Checked here, before any server starts: a typo in an override used to surface
        # 20 s into a run. With LOBSTER data the products are known only once the files
        # are read (preflight), so only the parameter names are checked here.
        if self.data.lobster_dir is None:
            product_params(self.features, self.product_features, self.data.products)
        self.product_features = normalized_overrides(self.features, self.product_features)
        if self.sweep.active:
            self.sweep.expand(self.train)  # ValueError naming the setting
            keys = self.simulation.horizon_keys()
            if self.sweep.rank_horizon not in keys:
                raise ValueError(f"sweep.rank_horizon {self.sweep.rank_horizon!r} is not a "
                                 f"horizon of the simulation: {', '.join(keys)}")  # fmt: skip
        return self

    def settings(self) -> list[TrainConfig]:
        """The training configs the run trains, one model per fold each: the sweep's
        settings, or the training config alone."""
        return self.sweep.expand(self.train) if self.sweep.active else [self.train]

    def trial_ids(self) -> list[str]:
        """Each configuration this run evaluates on its held-out data, as the digest a
        research run of that configuration alone has (`hash`): a sweep's settings are
        trials as separate runs would be, and a setting run again alone is not another."""
        if not self.sweep.active:
            return [self.hash()]
        return [self.model_copy(update={"train": cfg, "sweep": Sweep()}).hash()
                for cfg in self.settings()]  # fmt: skip

    def preflight(self) -> list[str]:
        """Check the inputs a run will read, before anything starts: the LOBSTER folder
        is read and validated whole (every file, every row), the per-product overrides
        are checked against its products, and each training part must be long enough
        to give training windows, and the validation's folds must fit the dates. Returns
        the products. Raises ValueError (or DataValidationError, a ValueError) naming the
        file, row, column or field."""
        days = []
        if self.data.lobster_dir is None:
            rows = {p: self.data.synthetic.events_per_day for p in self.data.products}
            dates = business_days(self.data.start_date, self.data.n_dates)
        else:
            # Checked streaming, no table kept: memory is a block of a file, whatever the
            # folder's size (the data stage reads the files again to land them). A file
            # unchanged since a run of this workspace read it is not read (sources.py).
            days = scan_lobster_folder(self.data.lobster_dir, home=self.workspace.home_abs)
            rows = {}
            for day in days:
                rows[day.product] = max(rows.get(day.product, 0), day.rows)
            dates = [day.date for day in days]
        product_params(self.features, self.product_features, sorted(rows))
        folds_of(dates, self.validation)  # ValueError naming validation's fields
        # An explicit list of optimizations that lacks a switch it requires, or a CUDA
        # device on a machine without one, fails here. Only those can fail, so only they
        # import torch (1-2 s; "auto" and "none" on the device "auto" or "cpu" cannot).
        # Not the whole plan: its device class asks CUDA for the GPU's name, which starts
        # CUDA on the check's path (0.10-0.25 s of "checks" on an H100, call 16 of
        # bench/results/turnaround-h200-ahead-notes.md), and it raises for nothing else.
        if not isinstance(self.train.optimizations, str):
            from quantloop.profiling.proof import check_requirements

            check_requirements(self.train.optimizations)
        if self.train.device.startswith("cuda"):
            from quantloop.tasks.research.training import resolve_device

            resolve_device(self.train.device)
        horizon = max(self.features.label_horizons)
        short = sorted(p for p, n in rows.items() if n <= horizon)
        if short:
            raise ValueError(_too_little_data(short, rows, horizon, days))
        return sorted(rows)

    def stage(self, selection: Selection) -> StageParams:
        """What the stage flows take: this run's workspace and features on `selection`."""
        return StageParams(
            workspace=self.workspace,
            selection=selection,
            features=self.features,
            product_features=self.product_features,
            validation=self.validation,
        )

    def hash(self) -> str:
        """Digest of what decides the result (not where it is stored)."""
        # without an empty sweep: a run's digest is the one it had before sweeps existed
        exclude = {"workspace"} | (set() if self.sweep.active else {"sweep"})
        return sha256_json(self.model_dump(mode="json", exclude=exclude))


def _too_little_data(short: list[str], rows: dict[str, int], horizon: int, days: list) -> str:
    """Why a run cannot train, with the advice that fits the data: LOBSTER days name their
    files' row counts; synthetic data names the generator's setting."""
    what = (
        f"too little data to train: {', '.join(short)} "
        f"{'has' if len(short) == 1 else 'have'} at most {min(rows[p] for p in short):,} "
        f"events a day, but the longest label horizon is {horizon} events "
        "(features.label_horizons)"
    )
    if not days:
        return (
            f"{what}; give more events per day (data.synthetic.events_per_day) or shorter "
            "label horizons"
        )
    counts = [f"{d.product}/{d.date}: {d.rows:,}" for d in sorted(
        (d for d in days if d.product in short), key=lambda d: (d.product, d.date))]  # fmt: skip
    shown = "; ".join(counts[:6]) + (f"; ... ({len(counts)} days)" if len(counts) > 6 else "")
    return (
        f"{what}; rows per LOBSTER day: {shown}. Each day is labelled on its own, so more days "
        f"do not help: add LOBSTER files with days of more than {horizon} events for "
        f"{', '.join(short)} (data.lobster_dir), or shorten features.label_horizons to under "
        f"{min(rows[p] for p in short)} events"
    )
