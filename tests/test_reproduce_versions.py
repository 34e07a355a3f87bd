"""A run's pinned inputs stay readable after newer versions of the same days land.

Landing new content for a partition makes a new version and keeps the old file; a
run pinned the versions it read, so reproducing it must find those, not the
catalog's current ones (issue 21: "NO input gone" once a day was re-landed).
"""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import pytest

from quantloop.tasks.data.catalog import Catalog
from quantloop.tasks.data.landing import business_days, land_synthetic
from quantloop.tasks.data.synthetic import SyntheticConfig
from quantloop.tasks.engine import NodeStore, plan_nodes, run_nodes, sha256_json, storage
from quantloop.tasks.records.reproduce import Report, check_nodes, manifest_rows
from quantloop.tasks.research.features import FeatureParams
from quantloop.tasks.research.planning import feature_kind

DAYS = business_days(dt.date(2026, 3, 2), 2)


def test_nodes_of_replaced_versions_reproduce_from_the_catalogs_history(tmp_path):
    root = str(tmp_path / "store")
    catalog = Catalog(tmp_path / "catalog.sqlite")
    params = FeatureParams().canonical()
    digest = sha256_json(params)
    storage.write_bytes_atomic(storage.join(root, "params", f"{digest}.json"),
                               json.dumps(params).encode())  # fmt: skip
    kind, store = feature_kind(), NodeStore(root)
    manifests = []
    # Each day landed three times with other content (other row counts): the first two
    # versions of every day are replaced, their files kept.
    for events in (300, 400, 500):
        landed = land_synthetic(catalog, root, ["SYNA"], DAYS,
                                SyntheticConfig(events_per_day=events, levels=1))  # fmt: skip
        assert {x.status for x in landed} == ({"new"} if events == 300 else {"changed"})
        pinned = catalog.pinned(catalog.pin("synthetic", [x.entry for x in landed]))
        ran = run_nodes(kind, {digest: params}, plan_nodes(kind, pinned, {"SYNA": digest}), store)
        assert ran.computed == len(DAYS)
        manifests.append(ran.manifest)
    for manifest in manifests:  # every earlier run's nodes, and the current one's
        report = Report(check_nodes(manifest_rows([manifest]), root=root, catalog=catalog,
                                    kinds={kind.name: kind}))  # fmt: skip
        assert (report.nodes, report.failures) == (len(DAYS), 0), report.summary()
    # Every version ever landed is still on disk: nothing collected the replaced ones.
    files = sorted(p.name for p in Path(root, "datasets").rglob("*.parquet"))
    assert len(files) == 3 * len(DAYS)


@pytest.mark.slow
def test_every_earlier_run_reproduces_after_each_day_was_relanded_twice(prefect_api, tmp_path):
    """The issue's case end to end: three research runs, each landing other content for
    the same days (another row count), then `reproduce` of every one: 0 failures."""
    from quantloop.flows.reproduce import reproduce
    from quantloop.flows.research import ResearchParams, research
    from quantloop.tasks.runtime.workspace import Workspace

    home = str(tmp_path / "home")
    done = []
    for events in (1_000, 1_500, 2_000):
        done.append(research(ResearchParams.model_validate({
            "workspace": {"home": home},
            "data": {"products": ["SYNA"], "n_dates": 3,
                     "synthetic": {"events_per_day": events, "levels": 2}},
            "train": {"steps": 5, "batch_size": 32, "optimizations": "none"},
        })))  # fmt: skip
    assert len({r.data_digest for r in done}) == 3  # three pins of the same three days
    for run in done:
        report = reproduce(run.mlflow_run_id, sample=None, workspace=Workspace(home=home))
        assert report["failures"] == 0, [c for c in report["checks"] if not c["reproduced"]]
        assert report["nodes"] == 3 + 2 + 1  # 3 feature nodes, 2 folds' models, 1 simulation
