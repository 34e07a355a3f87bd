"""Two sites in one run, each its own `dask scheduler` + `dask worker` processes on
loopback: site A stores on a local folder, site B on moto's S3 server through s3fs
(its worker declares GPU=1). Some products landed at A, the others at B.

What placement must do: under `node` every feature node runs on the cluster of the
site holding its input and no input byte crosses sites; under `single:A` everything
runs at A and exactly B's input bytes cross; the outputs are a one-site run's, bit for
bit; an unreachable scheduler fails the run naming the site, or (on_unreachable
"replica") its nodes run where a replica is; a worker killed as it is given a batch is
replaced by its nanny and the batch runs again; a site left without any worker ends
the wait after its setting, failing naming the site or running its nodes at a replica.
"""

from __future__ import annotations

import datetime as dt
import os
import re
import time
import uuid

import pyarrow as pa
import pyarrow.compute as pc
import pytest
import s3fs

from quantloop.blocks.site import Site, SiteUnreachable
from quantloop.flows.features import features
from quantloop.flows.replicate import replicate as replicate_flow
from quantloop.flows.simulate import simulate
from quantloop.flows.train import train
from quantloop.tasks.data.landing import land_synthetic
from quantloop.tasks.data.replicate import replicate
from quantloop.tasks.data.synthetic import SyntheticConfig
from quantloop.tasks.engine import BatchFailed, NoCopyReachable, NodeStore, NoWorkers, storage
from quantloop.tasks.research.features import FeatureParams
from quantloop.tasks.research.stage import StageParams, feature_outputs, plan_features
from quantloop.tasks.research.training import TrainConfig
from quantloop.tasks.runtime.workspace import Selection, Workspace
from tests import servers

AT_A, AT_B = ["SYNA", "SYNB"], ["SYNC", "SYND"]
DATES = [dt.date(2026, 3, 2), dt.date(2026, 3, 3)]
SYNTHETIC = SyntheticConfig(events_per_day=1500, levels=2)
TINY = TrainConfig(window=8, stride=2, batch_size=64, steps=10, log_every=5, device="cpu",
                   optimizations="none")  # fmt: skip
BATCH_PREFIX = "run_batch_ipc"  # the engine's Dask task (tasks/engine/batch.py)


@pytest.fixture(scope="module")
def clusters(s3_endpoint, tmp_path_factory):
    """Site A's and site B's schedulers (their workers inherit the S3 environment)."""
    folder = tmp_path_factory.mktemp("sites")
    with (
        servers.dask_site(folder / "a") as a,
        servers.dask_site(folder / "b", resources="GPU=1") as b,
    ):
        yield {"A": a, "B": b}


def batches_run(address: str) -> int:
    """Engine batch tasks a scheduler has run so far (kept by the scheduler per prefix)."""
    from distributed import Client

    def count(dask_scheduler) -> int:
        prefix = dask_scheduler.task_prefixes.get(BATCH_PREFIX)
        # cumulative transitions: every batch a worker ran passed through "processing"
        return 0 if prefix is None else prefix.state_counts.get("processing", 0)

    with Client(address, timeout="10s") as client:
        return client.run_on_scheduler(count)


def workers_of(address: str) -> set[str]:
    from distributed import Client

    with Client(address, timeout="10s") as client:
        return set(client.nthreads())


@pytest.fixture
def two_sites(clusters, s3_endpoint, tmp_path):
    """A workspace over both sites (A the default and cheaper), with data landed at each."""
    bucket = f"site-b-{uuid.uuid4().hex[:10]}"
    s3fs.S3FileSystem(skip_instance_cache=True).mkdir(bucket)
    a = Site(name="A", scheduler_address=clusters["A"], storage_root=str(tmp_path / "a"),
             cost_per_hour=1.0, connect_timeout_s=5)  # fmt: skip
    b = Site(name="B", scheduler_address=clusters["B"], storage_root=f"s3://{bucket}/store",
             cost_per_hour=3.0, gpus=1, connect_timeout_s=5)  # fmt: skip
    ws = Workspace(home=str(tmp_path / "home"), site=a, sites=[b])
    catalog = ws.catalog()
    land_synthetic(catalog, a.root, AT_A, DATES, SYNTHETIC, site="A")
    land_synthetic(catalog, b.root, AT_B, DATES, SYNTHETIC, site="B")
    return ws


def stage_of(ws: Workspace, **update) -> StageParams:
    # two dates: one walk-forward fold, trained on the first and tested on the second
    return StageParams(workspace=ws.model_copy(update=update), selection=Selection(),
                       validation={"folds": 1})  # fmt: skip


def rows_of(summary) -> list[dict]:
    parts = storage.list_files(summary.manifest_url, ".parquet")
    return [r for p in parts for r in storage.read_parquet(p).to_pylist()]


def input_bytes(ws: Workspace, products: list[str]) -> int:
    return sum(e.length for e in ws.catalog().entries("synthetic")
               if e.partition.product in products)  # fmt: skip


@pytest.mark.slow
@pytest.mark.server
def test_each_node_runs_at_the_site_holding_its_input(prefect_api, two_sites, tmp_path):
    ws = two_sites
    before = {name: batches_run(ws_site.scheduler_address)
              for name, ws_site in (("A", ws.site), ("B", ws.sites[0]))}  # fmt: skip
    placed = features(stage_of(ws))
    assert (placed.nodes, placed.computed, placed.failed) == (8, 8, 0)
    rows = rows_of(placed)
    for row in rows:
        home = "A" if row["product"] in AT_A else "B"
        assert (row["site"], row["input_site"], row["bytes_across"]) == (home, home, 0)
        # the output is stored at the site that ran it: A's folder, B's bucket
        assert ws.resolve_sites()[0 if home == "A" else 1].holds(row["output_url"])
    assert placed.bytes_across == 0 and placed.placement == "node"
    # Each site's own scheduler ran its batches (and the other's none of them).
    ran = {name: batches_run(s.scheduler_address) - before[name]
           for name, s in (("A", ws.site), ("B", ws.sites[0]))}  # fmt: skip
    assert ran["A"] >= 1 and ran["B"] >= 1
    sites = placed.sites
    assert {k: (v["nodes"], v["bytes_across"]) for k, v in sites.items()} == {
        "A": (4, 0), "B": (4, 0)}  # fmt: skip
    assert sites["B"]["cost"] == pytest.approx(sites["B"]["compute_s"] * 3.0 / 3600)

    # single:A: every node at A; exactly B's inputs cross (A's are hits: nothing read)
    single = features(stage_of(ws, placement="single:A"))
    rows_single = rows_of(single)
    assert {r["site"] for r in rows_single} == {"A"}
    assert single.bytes_across == input_bytes(ws, AT_B) > 0
    assert (single.cache_hits, single.computed) == (4, 4)
    assert batches_run(ws.sites[0].scheduler_address) - before["B"] == ran["B"]

    # The outputs are a one-site run's, bit for bit (same keys, same output digests).
    one = Workspace(home=str(tmp_path / "one"), n_workers=1)
    land_synthetic(one.catalog(), one.resolve_site().root, AT_A + AT_B, DATES, SYNTHETIC)
    alone = {(r["key"], r["output_digest"]) for r in rows_of(features(stage_of(one)))}
    assert {(r["key"], r["output_digest"]) for r in rows} == alone
    assert {(r["key"], r["output_digest"]) for r in rows_single} == alone
    # The stages after features find every output, wherever it was computed.
    found = feature_outputs(stage_of(ws))
    assert len(found) == 8 and all(o.read().num_rows > 0 for o in found.values())

    # Training goes to B, whose worker declares GPU=1, and gives the model a one-site
    # run trains in its own process.
    trained = train(stage_of(ws), TINY)
    gpu_workers = workers_of(ws.sites[0].scheduler_address)
    assert trained.site == "B" and trained.worker in gpu_workers and not trained.cache_hit
    trained_one = train(stage_of(one), TINY)
    assert trained.model_digest == trained_one.model_digest
    # What training at B read from A (A's products' features on the fold's training date:
    # nothing of the test date is read) is counted, to the byte.
    at_a = sum(r["output_length"] for r in rows if r["product"] in AT_A)
    at_a_train = sum(r["output_length"] for r in rows
                     if r["product"] in AT_A and r["date"] == DATES[0].isoformat())  # fmt: skip
    assert trained.bytes_across == at_a_train > 0 and trained_one.bytes_across == 0

    # Simulation replays at B too, next to training; the same mark-outs as one site's. It
    # reads the fold's training date (for the thresholds) and its test date: both of A's.
    sim = simulate(trained.model_url, stage_of(ws))
    assert (sim.site, sim.cache_hit) == ("B", False) and sim.worker in gpu_workers
    model_bytes = storage.size(trained.model_url)  # stored at the default site, A
    assert sim.bytes_across == at_a + model_bytes and sim.compute_s > 0
    sim_one = simulate(trained_one.model_url, stage_of(one))
    assert (sim_one.site, sim_one.worker, sim_one.bytes_across) == ("local", "", 0)
    assert sim.markout_bps == sim_one.markout_bps and sim.trades == sim_one.trades > 0


@pytest.mark.slow
@pytest.mark.server
def test_an_unreachable_scheduler_fails_naming_the_site_or_uses_a_replica(prefect_api, two_sites):
    ws = two_sites
    gone = ws.sites[0].model_copy(
        update={"scheduler_address": f"tcp://127.0.0.1:{servers.free_port()}",
                "connect_timeout_s": 2.0}
    )  # fmt: skip
    broken = ws.model_copy(update={"sites": [gone]})
    with pytest.raises(SiteUnreachable, match="site 'B'"):
        features(stage_of(broken))
    with pytest.raises(NoCopyReachable, match="site 'B'"):
        features(stage_of(broken, on_unreachable="replica"))

    # Replicate B's partitions to A (the flow): the copies are verified and recorded, a
    # second call copies nothing.
    copied = replicate_flow(ws.site, ws, Selection(products=AT_B))
    assert (copied["copied"], copied["present"]) == (4, 0)
    assert copied["bytes_copied"] == input_bytes(ws, AT_B)
    catalog = ws.catalog()
    table = Selection(products=AT_B).table(catalog)
    again = replicate(catalog, "synthetic", table, site="A", root=ws.site.root)
    assert (again.copied, again.present) == (0, 4)

    # Now B's scheduler being away does not stop the run: its nodes run at A, on the
    # replicas, with nothing read across sites.
    healed = features(stage_of(broken, on_unreachable="replica"))
    assert (healed.nodes, healed.failed, healed.bytes_across) == (8, 0, 0)
    assert {r["site"] for r in rows_of(healed)} == {"A"}
    # And with both up, the cheaper site (A) holds every input: all run there.
    cheap = features(stage_of(ws))
    assert {(r["site"], r["input_site"]) for r in rows_of(cheap)} == {("A", "A")}


@pytest.mark.slow
@pytest.mark.server
def test_a_worker_killed_mid_run_is_replaced_and_a_batch_that_keeps_killing_fails_naming_the_site(
    prefect_api, two_sites
):
    """B's worker process is SIGKILLed as its scheduler hands it the run's first batch:
    its nanny starts a new worker, the scheduler gives the batch to that one, and the
    run ends with every node computed once, at the site holding its input. A batch
    whose every worker dies (Dask gives up after 3 retries) fails the run naming B."""
    from distributed import Client

    ws = two_sites
    with Client(ws.sites[0].scheduler_address, timeout="10s") as client:
        pids: list[tuple[set[int], set[int]]] = []  # the site's worker processes before, after

        def run_killing(times: int, stage: StageParams, killed: list[int]):
            plugin = servers.KillWorkerGiven(BATCH_PREFIX, times)
            before = set(client.run(os.getpid).values())
            client.register_plugin(plugin)
            try:
                return features(stage)
            finally:  # the plugin goes either way; the checks come after, outside
                killed += client.run_on_scheduler(
                    lambda dask_scheduler: dask_scheduler.plugins["kill-worker-given"].killed
                )
                client.unregister_scheduler_plugin(plugin.name)
                client.wait_for_workers(1, timeout=60)
                pids.append((before, set(client.run(os.getpid).values())))

        def killed_and_replaced(killed: list[int]) -> None:
            before, after = pids[-1]
            assert killed and killed[0] in before
            assert not set(killed) & after  # the workers now are new ones

        killed: list[int] = []
        placed = run_killing(1, stage_of(ws), killed)
        killed_and_replaced(killed)
        assert len(killed) == 1
        assert (placed.nodes, placed.computed, placed.failed) == (8, 8, 0)
        rows = rows_of(placed)
        assert len({r["key"] for r in rows}) == 8
        assert {r["site"] for r in rows if r["product"] in AT_B} == {"B"}
        for r in rows:  # each output is whole: it reads back and matches its digest
            blob = storage.Blob(r["output_url"], r["output_offset"], r["output_length"],
                                r["output_digest"])  # fmt: skip
            assert storage.read_table(blob).num_rows == r["rows"] > 0

        # New feature parameters (new keys): B's batches now kill every worker they are
        # given; Dask gives a task up when its 4th worker dies (allowed-failures: 3).
        other = stage_of(ws).model_copy(update={"features": FeatureParams(ofi_window=20)})
        killed = []
        with pytest.raises(BatchFailed, match="site B: .*KilledWorker"):
            run_killing(100, other, killed)
        killed_and_replaced(killed)
        assert len(killed) >= 4
    # Nothing of B's half was kept: no index entry a later run could take for an output.
    plan = plan_features(other)
    at_b = plan.nodes.filter(pc.is_in(plan.nodes["product"], value_set=pa.array(AT_B)))
    assert at_b.num_rows == 4
    assert NodeStore(ws.sites[0].root).existing(plan.kind.name, at_b).num_rows == 0


@pytest.mark.slow
@pytest.mark.server
def test_a_site_whose_workers_are_all_gone_fails_naming_it_or_its_nodes_run_at_a_replica(
    prefect_api, clusters, tmp_path
):
    """Site B (cheaper, its own scheduler and worker) loses every worker and its nanny as
    its scheduler hands out the run's first batch. After B's no_workers_timeout_s the
    wait ends: the run fails naming B; with on_unreachable "replica" and B's inputs
    replicated to A, B's nodes run at A and the outputs are a run's without the fault."""
    from distributed import Client

    limit = 3.0
    a = Site(name="A", scheduler_address=clusters["A"], storage_root=str(tmp_path / "a"),
             cost_per_hour=1.0, connect_timeout_s=5)  # fmt: skip
    b = Site(name="B", storage_root=str(tmp_path / "b"), cost_per_hour=0.5, connect_timeout_s=5,
             no_workers_timeout_s=limit)  # fmt: skip
    ws = Workspace(home=str(tmp_path / "home"), site=a, sites=[b])
    catalog = ws.catalog()
    land_synthetic(catalog, a.root, AT_A, DATES, SYNTHETIC, site="A")
    land_synthetic(catalog, b.root, AT_B, DATES, SYNTHETIC, site="B")

    def run_losing_b(folder: str, **update):
        """features() with B's workers killed mid-run; (summary or error, seconds from
        the kill to the run's end)."""
        with servers.dask_site(tmp_path / folder) as address, \
                Client(address, timeout="10s") as client:  # fmt: skip
            on_b = ws.model_copy(update={"sites": [b.model_copy(
                update={"scheduler_address": address})]})  # fmt: skip
            client.register_plugin(servers.KillSiteGiven(BATCH_PREFIX))
            try:
                outcome = features(stage_of(on_b, **update))
            except Exception as exc:  # noqa: BLE001 - checked by the caller
                outcome = exc
            end = time.time()
            at = client.run_on_scheduler(lambda dask_scheduler: dask_scheduler.plugins[
                "kill-site-given"].at)  # fmt: skip
            assert at and not client.nthreads()  # killed mid-run, and none came back
            return outcome, end - at

    failed, lag = run_losing_b("b1")
    assert isinstance(failed, NoWorkers)
    assert re.search(r"site 'B': its Dask scheduler had no workers for \d", str(failed))
    assert limit < lag < limit + 3.0, lag
    print(f"fail: {lag:.2f} s from the kill to the run's end (limit {limit} s)")

    replicate(catalog, "synthetic", Selection(products=AT_B).table(catalog), site="A",
              root=a.root)  # fmt: skip
    healed, lag = run_losing_b("b2", on_unreachable="replica")
    assert not isinstance(healed, Exception), healed
    assert limit < lag < limit + 15, lag  # the wait, then B's 4 nodes computed at A
    print(f"replica: {lag:.2f} s from the kill to the run's end (limit {limit} s)")
    assert (healed.nodes, healed.failed) == (8, 0)
    rows = rows_of(healed)
    assert {(r["product"] in AT_B, r["site"], r["input_site"]) for r in rows} == {
        (False, "A", "A"), (True, "A", "A")}  # fmt: skip
    # Nothing of B's was kept (none of its batches finished), and the outputs are a
    # one-site run's, bit for bit.
    plan = plan_features(stage_of(ws))
    at_b = plan.nodes.filter(pc.is_in(plan.nodes["product"], value_set=pa.array(AT_B)))
    assert NodeStore(b.root).existing(plan.kind.name, at_b).num_rows == 0
    one = Workspace(home=str(tmp_path / "one"), n_workers=1)
    land_synthetic(one.catalog(), one.resolve_site().root, AT_A + AT_B, DATES, SYNTHETIC)
    alone = {(r["key"], r["output_digest"]) for r in rows_of(features(stage_of(one)))}
    assert {(r["key"], r["output_digest"]) for r in rows} == alone and len(alone) == 8


def test_a_replica_whose_source_bytes_are_bad_is_not_recorded(tmp_path):
    ws = Workspace(home=str(tmp_path / "home"))
    catalog = ws.catalog()
    land_synthetic(catalog, str(tmp_path / "a"), ["SYNA"], DATES[:1], SYNTHETIC, site="A")
    [entry] = catalog.entries("synthetic")
    storage.write_bytes_atomic(entry.location, b"not the landed bytes")
    with pytest.raises(ValueError, match="does not match its digest.*not replicated"):
        replicate(catalog, "synthetic", catalog.table("synthetic"), site="B",
                  root=str(tmp_path / "b"))  # fmt: skip
    assert set(catalog.copies("synthetic")["site"].to_pylist()) == {"A"}


def test_place_picks_the_cheaper_site_holding_the_input_and_reads_across_only_when_told():
    import pyarrow as pa

    from quantloop.tasks.engine import COPIES_SCHEMA, Policy, SiteCost, place

    inputs = pa.table({"digest": ["d1", "d2", "d3"], "location": ["a/1", "b/2", "x/3"],
                       "offset": [0, 0, 0], "length": [10, 20, 30]})  # fmt: skip
    copies = pa.table({"digest": ["d1", "d2", "d2"], "site": ["A", "B", "C"],
                       "url": ["a/1", "b/2", "c/2"], "offset": [0, 0, 0],
                       "length": [10, 20, 20]}, schema=COPIES_SCHEMA)  # fmt: skip
    sites = [SiteCost(name="A", cost_per_hour=2.0), SiteCost(name="B", cost_per_hour=3.0),
             SiteCost(name="C", cost_per_hour=1.0)]  # fmt: skip
    by_node = place(inputs, copies, sites, Policy.parse("node", "ABC"))
    # d2 is at B and C: C is cheaper; d3 is at no site of ours: the default, read across
    assert by_node["site"].to_pylist() == ["A", "C", "A"]
    assert by_node["input_site"].to_pylist() == ["A", "C", ""]
    assert by_node["location"].to_pylist() == ["a/1", "c/2", "x/3"]
    single = place(inputs, copies, sites, Policy.parse("single:B", "ABC"))
    assert single["site"].to_pylist() == ["B", "B", "B"]
    assert single["input_site"].to_pylist() == ["A", "B", ""]
    down = place(inputs, copies, sites, Policy.parse("node", "ABC"), down={"C"})
    assert down["site"].to_pylist() == ["A", "B", "A"]
    with pytest.raises(NoCopyReachable, match="site 'A'"):
        place(inputs, copies, sites, Policy.parse("node", "ABC"), down={"A"})
    with pytest.raises(ValueError, match="single:Z"):
        Policy.parse("single:Z", "ABC")


def test_a_sites_cost_counts_its_feature_training_and_replay_seconds():
    from quantloop.tasks.runtime.sites import SiteCounts

    counts = SiteCounts()
    counts.add(4, 3, 36.0, 100, cost_per_hour=2.0)
    counts.add_stage("train", 18.0, 50, cost_per_hour=2.0)
    counts.add_stage("simulate", 9.0, 0, cost_per_hour=2.0)
    assert (counts.nodes, counts.computed, counts.compute_s) == (4, 3, 36.0)
    assert (counts.train_s, counts.simulate_s, counts.bytes_across) == (18.0, 9.0, 150)
    assert counts.cost == pytest.approx((36.0 + 18.0 + 9.0) * 2.0 / 3600)
