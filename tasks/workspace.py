"""Where a run reads and writes: the site, the catalog, MLflow. Defaults need no server.

Flows take a `Workspace` (small, JSON-able, rendered as a form in the Prefect UI)
and resolve it here into blocks: a saved block by name when one is given,
otherwise the embedded default under `home` (a LocalCluster, storage and the
catalog in one folder, MLflow on a SQLite file there).
"""

from __future__ import annotations

import datetime as dt
import os

import pyarrow as pa
import pyarrow.compute as pc
from pydantic import BaseModel, ConfigDict, Field

from quantloop.blocks.catalog import DataCatalog
from quantloop.blocks.site import Site
from quantloop.blocks.tracking import MlflowTracking
from quantloop.tasks.catalog import Catalog, Entry

DEFAULT_HOME = ".quantloop"


class Workspace(BaseModel):
    """Where the run's data, node outputs and records live."""

    model_config = ConfigDict(extra="forbid")

    home: str = Field(
        default=DEFAULT_HOME,
        description="Local folder for the embedded defaults: catalog, storage, MLflow store.",
    )
    site: str | None = Field(
        default=None, description="Name of a saved quantloop Site block; empty: a LocalCluster."
    )
    n_workers: int = Field(default=2, ge=1, description="LocalCluster workers (no site block).")
    tracking: str | None = Field(
        default=None, description="Name of a saved quantloop MLflow Tracking block."
    )
    data_catalog: str | None = Field(
        default=None,
        description="Name of a saved quantloop Data Catalog block; empty: catalog.sqlite in home.",
    )
    tracking_uri: str | None = Field(
        default=None, description="MLflow tracking URI; overrides the block. Empty: SQLite in home."
    )
    experiment: str = Field(default="quantloop", description="MLflow experiment name.")

    @property
    def home_abs(self) -> str:
        return os.path.abspath(os.path.expanduser(self.home))

    def resolve_site(self) -> Site:
        if self.site:
            return Site.load(self.site)
        return Site(
            name="local",
            storage_root=os.path.join(self.home_abs, "store"),
            n_workers=self.n_workers,
        )

    def resolve_tracking(self) -> MlflowTracking:
        if self.tracking:
            block = MlflowTracking.load(self.tracking)
        else:
            block = MlflowTracking(
                tracking_uri="sqlite:///" + os.path.join(self.home_abs, "mlflow.db"),
                experiment=self.experiment,
            )
        if self.tracking_uri:
            block = block.model_copy(update={"tracking_uri": self.tracking_uri})
        return block

    def catalog(self) -> Catalog:
        if self.data_catalog:
            return Catalog(DataCatalog.load(self.data_catalog).resolved_path())
        return Catalog(os.path.join(self.home_abs, "catalog.sqlite"))


class Selection(BaseModel):
    """Which partitions of a dataset a run covers (a product list and a date range)."""

    model_config = ConfigDict(extra="forbid")

    dataset: str = Field(default="synthetic", description="Catalog dataset name.")
    products: list[str] | None = Field(default=None, description="Products; empty: all.")
    start: dt.date | None = Field(default=None, description="First date; empty: the earliest.")
    end: dt.date | None = Field(default=None, description="Last date; empty: the latest.")

    def entries(self, catalog: Catalog) -> list[Entry]:
        found = [
            e
            for e in catalog.entries(self.dataset)
            if (self.products is None or e.partition.product in self.products)
            and (self.start is None or e.partition.date >= self.start)
            and (self.end is None or e.partition.date <= self.end)
        ]
        self._check(catalog, {e.partition.product for e in found})
        return found

    def table(self, catalog: Catalog) -> pa.Table:
        """The selected entries as Arrow columns (`Catalog.table`)."""
        table = catalog.table(self.dataset)
        keep = None
        if self.products is not None:
            keep = pc.is_in(table["product"], value_set=pa.array(self.products, pa.string()))
        # ISO dates compare as strings
        for bound, op in ((self.start, pc.greater_equal), (self.end, pc.less_equal)):
            if bound is not None:
                mask = op(table["date"], bound.isoformat())
                keep = mask if keep is None else pc.and_(keep, mask)
        if keep is not None:
            table = table.filter(keep)
        self._check(catalog, set(pc.unique(table["product"]).to_pylist()))
        return table

    def _check(self, catalog: Catalog, products: set[str]) -> None:
        if not products:
            raise ValueError(
                f"no partitions of dataset {self.dataset!r} match products={self.products} "
                f"start={self.start} end={self.end}; known datasets: {catalog.datasets()}"
            )
        if self.products:
            missing = set(self.products) - products
            if missing:
                raise ValueError(
                    f"dataset {self.dataset!r} has no partitions for products {sorted(missing)}"
                )
