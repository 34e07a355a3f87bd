"""Where a run reads and writes: the site, the catalog, MLflow. Defaults need no server.

Flows take a `Workspace` (small, JSON-able, rendered as a form in the Prefect UI)
and resolve it here into blocks: a saved block by name when one is given,
otherwise the embedded default under `home` (a LocalCluster, storage and the
catalog in one folder, MLflow on a SQLite file there).
"""

from __future__ import annotations

import datetime as dt
import os
from typing import Annotated, Literal

import pyarrow as pa
import pyarrow.compute as pc
from pydantic import BaseModel, ConfigDict, Field, model_validator

from quantloop.blocks.catalog import DataCatalog
from quantloop.blocks.site import Site
from quantloop.blocks.tracking import MlflowTracking
from quantloop.tasks.data.catalog import Catalog

DEFAULT_HOME = ".quantloop"
# A saved block given by its name (JSON, the CLI, prefect.yaml); the UI labels the choice.
BlockName = Annotated[str, Field(title="By name")]
# Set by `quantloop serve` for the flows its worker runs: the MLflow UI it serves and
# the store it serves, so summaries of runs recorded in that store link to their pages.
MLFLOW_UI_URL_ENV, MLFLOW_UI_STORE_ENV = "QUANTLOOP_MLFLOW_UI_URL", "QUANTLOOP_MLFLOW_UI_STORE"


class Workspace(BaseModel):
    """Where the run's data, node outputs and records live.

    The site, tracking and catalog are saved blocks: the Prefect UI offers a picker of
    the saved ones (a block-typed field), and JSON or the CLI may name one instead.
    """

    model_config = ConfigDict(extra="forbid")

    home: str = Field(
        default=DEFAULT_HOME,
        title="Home folder",
        description="Folder for the embedded defaults: the partition catalog, the storage "
        "and the MLflow store of runs without blocks. Relative paths are relative to the "
        "worker's working directory (the checkout).",
    )
    site: Site | BlockName | None = Field(
        default=None,
        title="Site",
        description="Where nodes run and outputs are stored: a saved quantloop Site block "
        "(pick one, or give its name). None: a Dask LocalCluster on the worker, storage "
        "under the home folder.",
    )
    sites: list[Site | BlockName] = Field(
        default_factory=list,
        title="More sites",
        description="Other sites the run may place nodes at, beside the site above (the "
        "default): saved quantloop Site blocks or their names. Each feature node runs at a "
        "site holding its input.",
    )
    # The policies of tasks/engine/placement.py. The form offers them as a choice, and
    # the site for `single` in its own field; JSON and the CLI may also give the policy's
    # text, `single:<site>`, which is what `placement` holds once validated.
    placement: str = Field(
        default="node",
        title="Placement",
        description="'node': each feature node runs at the site holding its input (the "
        "cheaper per hour of several). 'single': every node at one site (Single site), "
        "inputs read across sites.",
        json_schema_extra={"enum": ["node", "single"]},
    )
    single_site: str | None = Field(
        default=None,
        title="Single site",
        description="With placement 'single': the name of the site every node runs at "
        "(the default site's or one of More sites'). Empty with 'node'.",
    )
    on_unreachable: Literal["fail", "replica"] = Field(
        default="fail",
        title="When a site's scheduler is unreachable",
        description="'fail': the run fails naming the site. 'replica': its nodes run at "
        "another site holding a copy of their inputs (fails naming the site if none does).",
    )
    n_workers: int = Field(
        default=2,
        ge=1,
        le=256,
        title="Local workers",
        description="Processes of the LocalCluster when no site is chosen (1 to 256).",
    )
    tracking: MlflowTracking | BlockName | None = Field(
        default=None,
        title="MLflow tracking",
        description="Where runs are recorded: a saved quantloop MLflow Tracking block (pick "
        "one, or give its name). None: the MLflow store in the home folder.",
    )
    data_catalog: DataCatalog | BlockName | None = Field(
        default=None,
        title="Data catalog",
        description="The partition catalog: a saved quantloop Data Catalog block (pick one, "
        "or give its name). None: catalog.sqlite in the home folder.",
    )
    tracking_uri: Annotated[str, Field(title="URI")] | None = Field(
        default=None,
        title="MLflow tracking URI",
        description="An MLflow tracking URI (http://host:5000 or sqlite:///path) that "
        "overrides the tracking block's. None: the block's, or the home folder's store.",
    )
    experiment: str = Field(
        default="quantloop",
        min_length=1,
        title="MLflow experiment",
        description="MLflow experiment of the runs without a tracking block.",
    )

    @model_validator(mode="after")
    def _check_placement(self) -> Workspace:
        if self.placement not in ("node", "single") and not self.placement.startswith("single:"):
            raise ValueError(
                f"placement {self.placement!r}: must be 'node', 'single' (with single_site) "
                "or 'single:<site name>'"
            )
        given = self.placement.removeprefix("single:") if ":" in self.placement else None
        if self.placement == "node":
            if self.single_site:
                raise ValueError(
                    f"single_site {self.single_site!r} is for placement 'single', not 'node'"
                )
        elif not (given or self.single_site):
            raise ValueError("placement 'single' needs single_site: the site every node runs at")
        elif given and self.single_site and given != self.single_site:
            raise ValueError(
                f"placement {self.placement!r} and single_site {self.single_site!r} disagree"
            )
        else:
            self.single_site = given or self.single_site
            self.placement = f"single:{self.single_site}"
        return self

    @property
    def home_abs(self) -> str:
        return os.path.abspath(os.path.expanduser(self.home))

    def resolve_site(self) -> Site:
        if isinstance(self.site, Site):
            return self.site
        if self.site:
            return Site.load(self.site)
        return Site(
            name="local",
            storage_root=os.path.join(self.home_abs, "store"),
            n_workers=self.n_workers,
        )

    def resolve_sites(self) -> list[Site]:
        """Every site of the workspace, the default (`site`) first; names are unique."""
        found = [self.resolve_site()]
        for site in self.sites:
            found.append(site if isinstance(site, Site) else Site.load(site))
        names = [s.name for s in found]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"workspace sites: the site name(s) {twice} are given twice")
        return found

    def resolve_tracking(self) -> MlflowTracking:
        if isinstance(self.tracking, MlflowTracking):
            block = self.tracking
        elif self.tracking:
            block = MlflowTracking.load(self.tracking)
        else:
            uri = "sqlite:///" + os.path.join(self.home_abs, "mlflow.db")
            served = os.environ.get(MLFLOW_UI_STORE_ENV) == uri
            block = MlflowTracking(
                tracking_uri=uri,
                experiment=self.experiment,
                ui_url=os.environ.get(MLFLOW_UI_URL_ENV) if served else None,
            )
        if self.tracking_uri:
            # Another store: the block's UI does not show it.
            block = block.model_copy(update={"tracking_uri": self.tracking_uri, "ui_url": None})
        return block

    def catalog(self) -> Catalog:
        """The block's catalog (its PostgreSQL database when it names one, else its
        SQLite file), or catalog.sqlite in the home folder."""
        if isinstance(self.data_catalog, DataCatalog):
            return Catalog(self.data_catalog.where())
        if self.data_catalog:
            return Catalog(DataCatalog.load(self.data_catalog).where())
        return Catalog(os.path.join(self.home_abs, "catalog.sqlite"))


class Selection(BaseModel):
    """Which partitions of a dataset a run covers (a product list and a date range)."""

    model_config = ConfigDict(extra="forbid")

    dataset: str = Field(
        default="synthetic",
        min_length=1,
        title="Dataset",
        description="Catalog dataset: synthetic (the generator's) or lobster (landed files).",
    )
    products: list[str] | None = Field(
        default=None, title="Products", description="Products to cover. None: all of them."
    )
    start: dt.date | None = Field(
        default=None, title="First date", description="First date. None: the earliest."
    )
    end: dt.date | None = Field(
        default=None, title="Last date", description="Last date (included). None: the latest."
    )
    pin: str | None = Field(
        default=None,
        title="Pinned versions",
        description="The exact partition versions to read (a pin the research run records "
        "when it lands its data). None: the catalog's current versions.",
    )

    def table(self, catalog: Catalog) -> pa.Table:
        """The selected entries as Arrow columns (`Catalog.table`): the pinned versions
        when there is a pin, else the current ones."""
        table = catalog.pinned(self.pin) if self.pin else catalog.table(self.dataset)
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
