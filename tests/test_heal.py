"""The store heals itself: a damaged stored output is found when it is read (or when
hits are verified), dropped from the cache and recomputed, never used or counted as a
hit; `quantloop verify` finds and drops damaged outputs on demand."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from quantloop.cli import app
from quantloop.flows.research import ResearchParams, research
from quantloop.tasks.engine import NodeStore
from quantloop.tasks.runtime.workspace import Workspace

TINY = {
    "data": {"products": ["SYNA"], "n_dates": 3,
             "synthetic": {"events_per_day": 2_000, "levels": 2}},
    "train": {"steps": 10, "batch_size": 32, "optimizations": "none"},
}  # fmt: skip


def run(home: Path, **changes):
    values = {**TINY, "workspace": {"home": str(home)}}
    for key, value in changes.items():
        values[key] = {**values.get(key, {}), **value} if isinstance(value, dict) else value
    return research(ResearchParams.model_validate(values))


def outputs(home: Path) -> list[dict]:
    store = NodeStore(Workspace(home=str(home)).resolve_site().root)
    return sorted(store.rows("features").to_pylist(), key=lambda r: r["date"])


def flip_a_byte(row: dict) -> None:
    path = Path(row["output_url"])
    data = bytearray(path.read_bytes())
    data[row["output_offset"] + row["output_length"] // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.slow
def test_damaged_outputs_are_dropped_and_recomputed_never_used(prefect_api, tmp_path):
    home = tmp_path / "home"
    first = run(home)
    assert first.computed == 3
    # A corrupted feature output is found when training reads it (another setting makes
    # the model a miss), dropped and recomputed; the run goes on and says so.
    flip_a_byte(outputs(home)[0])
    healed = run(home, train={"steps": 11})
    assert healed.healed_outputs == 1 and healed.recomputed == {"corrupt": 1}
    assert healed.computed == 1 and healed.cache_hits == 2
    # With hits verified, a gone output is found before anything reads it.
    gone = outputs(home)[-1]
    Path(gone["output_url"]).unlink()
    verified = run(home, train={"steps": 11}, verify_hits=True)
    assert verified.recomputed == {"missing": 1} and verified.cache_hits == 2
    assert verified.model_cached  # the recomputed node has the same key and digest
    # A damaged stored model is trained again, not loaded.
    model = Path(verified.model_url)
    model.write_bytes(model.read_bytes()[: model.stat().st_size // 2])
    again = run(home, train={"steps": 11})
    assert not again.model_cached and again.model_digest == verified.model_digest


@pytest.mark.slow
def test_verify_finds_and_drops_damaged_outputs(prefect_api, tmp_path):
    from quantloop.tasks.data.catalog import Catalog
    from quantloop.tasks.data.landing import business_days, land_synthetic
    from quantloop.tasks.data.synthetic import SyntheticConfig
    from quantloop.tasks.engine import plan_nodes, run_nodes, sha256_json
    from quantloop.tasks.research.features import FeatureParams
    from quantloop.tasks.research.planning import feature_kind

    ws = Workspace(home=str(tmp_path / "home"))
    root, catalog = ws.resolve_site().root, ws.catalog()
    assert isinstance(catalog, Catalog)
    land_synthetic(catalog, root, ["SYNA"], business_days(dt.date(2026, 3, 2), 3),
                   SyntheticConfig(events_per_day=500, levels=1))  # fmt: skip
    params = FeatureParams().canonical()
    digest = sha256_json(params)
    kind = feature_kind()
    run_nodes(kind, {digest: params}, plan_nodes(kind, catalog.table("synthetic"),
                                                 {"SYNA": digest}), NodeStore(root))  # fmt: skip
    flip_a_byte(outputs(tmp_path / "home")[1])
    runner = CliRunner(env={"COLUMNS": "200"})
    report = tmp_path / "verify.json"
    out = runner.invoke(app, ["verify", "--home", ws.home, "--summary-json", str(report)])
    assert out.exit_code == 1, out.output
    found = json.loads(report.read_text())
    assert found["outputs_checked"] == 3 and list(found["outputs_damaged"].values()) == ["corrupt"]
    out = runner.invoke(app, ["verify", "--home", ws.home])
    assert out.exit_code == 0 and "2 of 2 outputs checked, 0 damaged" in out.output


def flip_16_bytes(row: dict) -> None:
    path = Path(row["output_url"])
    data = bytearray(path.read_bytes())
    middle = row["output_offset"] + row["output_length"] // 2
    for i in range(middle, middle + 16):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_damaged_output_is_checked_and_recomputed_never_counted_a_hit(tmp_path):
    """By default a hit's stored bytes are read and re-hashed before it counts: 16
    flipped bytes in one output make it a recomputed node (reason corrupt), not a hit,
    though nothing downstream reads it (issue 21: "2 cache hits, 0 computed")."""
    from quantloop.tasks.data.landing import business_days, land_synthetic
    from quantloop.tasks.data.synthetic import SyntheticConfig
    from quantloop.tasks.engine import plan_nodes, run_nodes, sha256_json
    from quantloop.tasks.research.features import FeatureParams
    from quantloop.tasks.research.planning import feature_kind

    ws = Workspace(home=str(tmp_path / "home"))
    root, catalog = ws.resolve_site().root, ws.catalog()
    land_synthetic(catalog, root, ["SYNA"], business_days(dt.date(2026, 3, 2), 3),
                   SyntheticConfig(events_per_day=500, levels=1))  # fmt: skip
    params = FeatureParams().canonical()
    digest = sha256_json(params)
    kind, store = feature_kind(), NodeStore(root)
    plan = plan_nodes(kind, catalog.table("synthetic"), {"SYNA": digest})
    assert run_nodes(kind, {digest: params}, plan, store).computed == 3
    damaged = outputs(tmp_path / "home")[1]
    flip_16_bytes(damaged)
    again = run_nodes(kind, {digest: params}, plan, store)
    assert (again.cache_hits, again.computed) == (2, 1)
    rows = {r["key"]: r for r in again.manifest.to_pylist()}
    assert (rows[damaged["key"]]["cache_hit"], rows[damaged["key"]]["reason"]) == (False, "corrupt")
    # healed: the recomputed output has its digest again, and the next run hits all three
    assert run_nodes(kind, {digest: params}, plan, store).cache_hits == 3
    # A truncated pack (the size check) is caught the same way, as is a gone one.
    Path(damaged["output_url"]).unlink()
    gone = run_nodes(kind, {digest: params}, plan, store)
    assert gone.computed >= 1 and set(gone.summary().reasons) == {"missing"}
    # Switched off, a hit is trusted without reading it: the damage is found only when
    # something reads the output (or by `quantloop verify`).
    flip_16_bytes(gone.manifest.to_pylist()[0])
    trusted = run_nodes(kind, {digest: params}, plan, store, verify_hits=False)
    assert trusted.cache_hits == 3


@pytest.mark.slow
def test_a_research_rerun_heals_a_damaged_output_nothing_reads(prefect_api, tmp_path):
    """The issue's case: the same run again, so the model and the simulation are cached
    and nothing reads the features; a damaged one is still found, recomputed and
    reported as healed."""
    home = tmp_path / "home"
    first = run(home)
    assert first.computed == 3
    flip_16_bytes(outputs(home)[0])
    again = run(home)
    assert (again.cache_hits, again.computed) == (2, 1)
    assert again.recomputed == {"corrupt": 1} and again.healed_outputs == 1
    assert again.model_cached  # the recomputed output has the same digest


@pytest.mark.slow
def test_a_damaged_cached_simulation_is_recomputed_not_a_hit(prefect_api, tmp_path):
    """A cached simulation's stored mark-outs and statistics are checked (size, sha256)
    before they count: a statistics JSON with a number changed (still valid JSON) and a
    mark-out Parquet with a value changed (still a valid file) are recomputed, reported
    as healed, and the run's figures are the true ones, not the damaged ones."""
    import pyarrow.compute as pc

    from quantloop.tasks.engine import storage

    home = tmp_path / "home"
    first = run(home)
    root = Path(Workspace(home=str(home)).resolve_site().root)
    [statistics] = (root / "statistics").glob("*.json")
    figures = json.loads(statistics.read_text())
    figures["model"]["total"]["count"] += 1000
    statistics.write_text(json.dumps(figures))
    markouts = sorted((root / "simulations").glob("*.parquet"))[0]
    table = storage.read_parquet(str(markouts))
    i = next(j for j, f in enumerate(table.schema) if f.type == "double")
    table = table.set_column(i, table.field(i), pc.add(table.column(i), 1.0))
    markouts.write_bytes(storage.parquet_bytes(table))
    again = run(home)
    assert not again.simulation_cached
    assert again.healed_outputs == 2  # the mark-outs of one fold, the statistics
    assert again.trades == first.trades and again.markout_bps == first.markout_bps
    assert again.model_cached and again.cache_hits == 3  # nothing else was touched
    healed = run(home)  # what was stored again is whole: hits
    assert healed.simulation_cached and healed.healed_outputs == 0


def test_a_stored_output_is_checked_against_the_size_and_digest_beside_it(tmp_path):
    """save_checked/load_checked, what simulate stores its outputs with: a changed number
    or a cut file fails its check; an output stored before checks were kept (no check
    beside it) is taken once as it is, and checked from then on."""
    from quantloop.flows.simulate import CHECK_SUFFIX, load_checked, save_checked

    url = str(tmp_path / "statistics" / "k.json")
    save_checked(url, b'{"trades": 1040}')
    assert load_checked(url) == b'{"trades": 1040}'
    Path(url).write_bytes(b'{"trades": 1041}')  # same size, another digest
    with pytest.raises(ValueError, match=r"k\.json: 16 bytes with sha256 .*changed or truncated"):
        load_checked(url)
    Path(url).write_bytes(b'{"trades": 10')
    with pytest.raises(ValueError, match="13 bytes"):
        load_checked(url)
    Path(url + CHECK_SUFFIX).unlink()  # as stored before checks were kept
    assert load_checked(url) == b'{"trades": 10'
    assert json.loads(Path(url + CHECK_SUFFIX).read_text())["bytes"] == 13
    Path(url).write_bytes(b'{"trades": 11')
    with pytest.raises(ValueError):
        load_checked(url)
