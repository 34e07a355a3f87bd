"""The workspace resolves saved blocks by name, and embedded defaults without them."""

from __future__ import annotations

import datetime as dt

import pytest

from quantloop.blocks.catalog import DataCatalog
from quantloop.blocks.site import Site
from quantloop.blocks.tracking import MlflowTracking
from quantloop.tasks.data.schema import Partition
from quantloop.tasks.runtime.workspace import Selection, Workspace
from tests.books import random_book


def test_embedded_defaults_live_under_home(tmp_path):
    ws = Workspace(home=str(tmp_path / "h"))
    assert ws.resolve_site().root == str(tmp_path / "h" / "store")
    assert ws.resolve_tracking().resolved_uri() == f"sqlite:///{tmp_path / 'h' / 'mlflow.db'}"
    assert ws.catalog().path == tmp_path / "h" / "catalog.sqlite"


@pytest.mark.slow
def test_saved_blocks_are_used_by_name(prefect_api, tmp_path):
    DataCatalog(path=str(tmp_path / "shared" / "cat.sqlite")).save("ws-cat", overwrite=True)
    Site(name="onprem", storage_root=str(tmp_path / "onprem")).save("ws-site", overwrite=True)
    MlflowTracking(tracking_uri="http://127.0.0.1:1", experiment="desk").save(
        "ws-mlflow", overwrite=True
    )
    ws = Workspace(home=str(tmp_path / "h"), data_catalog="ws-cat", site="ws-site",
                   tracking="ws-mlflow")  # fmt: skip
    catalog = ws.catalog()
    assert catalog.path == tmp_path / "shared" / "cat.sqlite"
    catalog.land("d", Partition("AAA", dt.date(2026, 1, 5)), random_book(20), root=str(tmp_path))
    assert [e.partition.product for e in ws.catalog().entries("d")] == ["AAA"]
    assert ws.resolve_site().name == "onprem"
    assert ws.resolve_tracking().experiment == "desk"
    override = ws.model_copy(update={"tracking_uri": "sqlite:////tmp/x.db"})
    assert override.resolve_tracking().tracking_uri == "sqlite:////tmp/x.db"


def test_unknown_workspace_field_is_an_error():
    with pytest.raises(ValueError, match="catalog_block"):
        Workspace(catalog_block="x")


@pytest.mark.parametrize(
    "selection",
    [
        Selection(dataset="d"),
        Selection(dataset="d", products=["BBB"]),
        Selection(dataset="d", start=dt.date(2026, 1, 6)),
        Selection(dataset="d", products=["AAA"], end=dt.date(2026, 1, 5)),
    ],
)
def test_selection_picks_the_catalog_rows_it_names(tmp_path, selection):
    ws = Workspace(home=str(tmp_path))
    catalog = ws.catalog()
    days = [dt.date(2026, 1, 5), dt.date(2026, 1, 6), dt.date(2026, 1, 7)]
    parts = [(Partition(p, d), random_book(50, seed=i)) for i, (p, d) in
             enumerate((p, d) for p in ("AAA", "BBB") for d in days)]  # fmt: skip
    catalog.land_packed("d", parts, root=str(tmp_path / "store"))
    rows = [
        (e.partition.product, e.partition.date.isoformat())
        for e in catalog.entries("d")
        if (selection.products is None or e.partition.product in selection.products)
        and (selection.start is None or e.partition.date >= selection.start)
        and (selection.end is None or e.partition.date <= selection.end)
    ]
    table = selection.table(catalog)
    assert list(zip(table["product"].to_pylist(), table["date"].to_pylist(), strict=True)) == rows
    assert rows


def test_selection_names_what_is_missing(tmp_path):
    catalog = Workspace(home=str(tmp_path)).catalog()
    catalog.land_packed("d", [(Partition("AAA", dt.date(2026, 1, 5)), random_book(50))],
                        root=str(tmp_path / "store"))  # fmt: skip
    with pytest.raises(ValueError, match=r"no partitions for products \['ZZZ'\]"):
        Selection(dataset="d", products=["AAA", "ZZZ"]).table(catalog)
    with pytest.raises(ValueError, match="known datasets: \\['d'\\]"):
        Selection(dataset="nope").table(catalog)


def test_landing_records_the_site_it_landed_at(tmp_path):
    from quantloop.tasks.data.landing import land_synthetic
    from quantloop.tasks.data.synthetic import SyntheticConfig

    catalog = Workspace(home=str(tmp_path / "h")).catalog()
    land_synthetic(catalog, str(tmp_path / "onprem"), ["SYNA"], [dt.date(2026, 3, 2)],
                   SyntheticConfig(events_per_day=200, levels=1), site="onprem")  # fmt: skip
    [entry] = catalog.entries("synthetic")
    assert entry.site == "onprem" and entry.location.startswith(str(tmp_path / "onprem"))
