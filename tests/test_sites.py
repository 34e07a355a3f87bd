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


def losing_site(folder, ws: Workspace, b: Site, prefix: str, run, resources=None, **update):
    """run(stage) with `b` (the workspace's one other site) on a fresh Dask site in `folder`
    (its scheduler and one worker declaring `resources`), whose workers and nanny are
    killed as its scheduler hands out the first task of `prefix`; (the outcome or the
    error, seconds from the kill to the run's end)."""
    from distributed import Client

    with servers.dask_site(folder, resources=resources) as address, \
            Client(address, timeout="10s") as client:  # fmt: skip
        on_b = ws.model_copy(update={"sites": [b.model_copy(
            update={"scheduler_address": address})]})  # fmt: skip
        client.register_plugin(servers.KillSiteGiven(prefix))
        try:
            outcome = run(stage_of(on_b, **update))
        except Exception as exc:  # noqa: BLE001 - checked by the caller
            outcome = exc
        end = time.time()
        at = client.run_on_scheduler(lambda dask_scheduler: dask_scheduler.plugins[
            "kill-site-given"].at)  # fmt: skip
        assert at and not client.nthreads()  # killed mid-run, and none came back
        return outcome, end - at


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
    # The model is stored at B, which trained it, and the catalog says so.
    catalog = ws.catalog()
    [copy] = catalog.output_copies("model", trained.model_key)
    assert (copy.site, copy.url, copy.origin) == ("B", trained.model_url, "B")
    assert ws.sites[0].holds(trained.model_url) and copy.length == storage.size(copy.url)
    # What training at B read from A (A's products' features on the fold's training date:
    # nothing of the test date is read) was copied to B first and counted, to the byte.
    at_a = sum(r["output_length"] for r in rows if r["product"] in AT_A)
    at_a_train = sum(r["output_length"] for r in rows
                     if r["product"] in AT_A and r["date"] == DATES[0].isoformat())  # fmt: skip
    assert trained.bytes_across == at_a_train > 0 and trained_one.bytes_across == 0
    assert trained.bytes_across_at == {"B": at_a_train}

    # Simulation replays at B too, next to training; the same mark-outs as one site's. It
    # reads the fold's training date (for the thresholds: B has copies now) and its test
    # date: A's outputs of that date are copied; the model is B's own.
    sim = simulate(trained.model_url, stage_of(ws))
    assert (sim.site, sim.cache_hit) == ("B", False) and sim.worker in gpu_workers
    assert sim.bytes_across == at_a - at_a_train and sim.compute_s > 0
    sim_one = simulate(trained_one.model_url, stage_of(one))
    assert (sim_one.site, sim_one.worker, sim_one.bytes_across) == ("local", "", 0)
    assert sim.markout_bps == sim_one.markout_bps and sim.trades == sim_one.trades > 0
    # Every feature output now has a copy at B, each indexed there and whole; the
    # simulation is stored at B, its statistics (the flow's) at A.
    at_b = feature_outputs(stage_of(ws), prefer="B")
    assert all(ws.sites[0].holds(o.blob.url) and o.site == "B" for o in at_b.values())
    assert {p: o.blob.digest for p, o in at_b.items()} == {
        p: o.blob.digest for p, o in found.items()}  # fmt: skip
    assert all(o.read().num_rows > 0 for o in at_b.values())  # read back and checked
    sims = catalog.outputs("simulation")
    assert [(c.site, c.origin) for _, _, c in sims] == [("B", "B")]
    assert ws.sites[0].holds(sims[0][2].url)
    assert [c.site for _, _, c in catalog.outputs("statistic")] == ["A"]

    # Replayed at A (B declares no GPU now): the cached simulation at B is found, and the
    # model, which the replay's check reads where it replays, is copied from B to A once,
    # recorded with its origin, and counted at A.
    no_gpu = ws.model_copy(update={"sites": [ws.sites[0].model_copy(update={"gpus": 0})]})
    elsewhere = simulate(trained.model_url, stage_of(no_gpu))
    model_bytes = storage.size(trained.model_url)
    assert (elsewhere.site, elsewhere.cache_hit) == ("A", True)
    assert (elsewhere.bytes_across, elsewhere.bytes_across_at) == (model_bytes, {"A": model_bytes})
    assert elsewhere.markout_bps == sim.markout_bps
    copies = {c.site: c for c in catalog.output_copies("model", trained.model_key)}
    assert (copies["A"].origin, copies["A"].digest) == ("B", copies["B"].digest)
    assert ws.site.holds(copies["A"].url)
    assert simulate(trained.model_url, stage_of(no_gpu)).bytes_across == 0  # the copy is there


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
        """features() with B's workers killed mid-run."""
        return losing_site(tmp_path / folder, ws, b, BATCH_PREFIX, features, **update)

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


@pytest.mark.slow
@pytest.mark.server
def test_a_gpu_site_whose_workers_are_all_gone_fails_naming_it_or_its_stages_move(
    prefect_api, clusters, tmp_path
):
    """Site B declares a GPU (its own scheduler and a worker with GPU=1) and holds no data:
    training and the replay go there, reading copies of A's feature outputs made there
    first. B loses every worker and its nanny as its scheduler hands out the training (the
    replay). After B's no_workers_timeout_s the wait ends: the train flow fails naming B,
    or with on_unreachable "replica" training (the replay) runs in the flow's process,
    which is site A; the bytes copied to B before it was lost still count at B, and the
    model and mark-outs are a one-site run's."""

    from quantloop.tasks.research.sited import SiteOutputs

    limit = 3.0
    a = Site(name="A", scheduler_address=clusters["A"], storage_root=str(tmp_path / "a"),
             cost_per_hour=1.0, connect_timeout_s=5)  # fmt: skip
    b = Site(name="B", storage_root=str(tmp_path / "b"), gpus=1, connect_timeout_s=5,
             no_workers_timeout_s=limit)  # fmt: skip
    ws = Workspace(home=str(tmp_path / "home"), site=a, sites=[b])
    land_synthetic(ws.catalog(), a.root, AT_A, DATES, SYNTHETIC, site="A")
    rows = rows_of(features(stage_of(ws)))  # every input is at A: every node ran there
    assert {r["site"] for r in rows} == {"A"}
    at_a_train = sum(r["output_length"] for r in rows if r["date"] == DATES[0].isoformat())

    def losing_b(folder: str, prefix: str, run, **update):
        """run(stage) with B (a fresh cluster and store, a GPU worker) lost mid-run."""
        b_here = b.model_copy(update={"storage_root": str(tmp_path / folder / "b")})
        return losing_site(tmp_path / folder, ws, b_here, prefix, run, "GPU=1", **update)

    failed, lag = losing_b("b1", "fit_and_store", lambda stage: train(stage, TINY))
    assert isinstance(failed, NoWorkers) and failed.site == "B"
    assert re.search(r"site 'B': its Dask scheduler had no workers with the GPU resource for "
                     r"\d.* with fit_and_store in flight", str(failed))  # fmt: skip
    assert limit < lag < limit + 3.0, lag
    print(f"train, fail: {lag:.2f} s from the kill to the flow's end (limit {limit} s)")

    trained, lag = losing_b("b2", "fit_and_store", lambda stage: train(stage, TINY),
                            on_unreachable="replica")  # fmt: skip
    assert not isinstance(trained, Exception), trained
    assert limit < lag < limit + 15, lag  # the wait, then the model trained here
    print(f"train, replica: {lag:.2f} s from the kill to the flow's end (limit {limit} s)")
    # Trained in the flow's process (site A), stored at A; the copies made at B for it
    # before B was lost count at B.
    assert (trained.site, trained.worker, trained.cache_hit) == ("A", "", False)
    assert a.holds(trained.model_url)
    assert trained.bytes_across_at == {"B": at_a_train} and at_a_train > 0
    [copy] = SiteOutputs(ws).catalog.output_copies("model", trained.model_key)
    assert (copy.site, copy.origin) == ("A", "A")

    sim, lag = losing_b("b3", "replay_and_store",
                        lambda stage: simulate(trained.model_url, stage),
                        on_unreachable="replica")  # fmt: skip
    assert not isinstance(sim, Exception), sim
    assert limit < lag < limit + 15, lag
    print(f"simulate, replica: {lag:.2f} s from the kill to the flow's end (limit {limit} s)")
    # Replayed here; B had been given copies of the model and of every feature output.
    model_bytes = storage.size(trained.model_url)
    at_a = sum(r["output_length"] for r in rows)
    assert (sim.site, sim.worker, sim.cache_hit) == ("A", "", False)
    assert sim.bytes_across_at == {"B": model_bytes + at_a}

    # The model and the mark-outs are those of a run on one site (A's cluster, another
    # store and catalog), without the fault.
    one = Workspace(
        home=str(tmp_path / "one"),
        site=a.model_copy(update={"storage_root": str(tmp_path / "one-a")}),
    )
    land_synthetic(one.catalog(), one.resolve_site().root, AT_A, DATES, SYNTHETIC, site="A")
    features(stage_of(one))
    alone = train(stage_of(one), TINY)
    assert trained.model_digest == alone.model_digest
    sim_alone = simulate(alone.model_url, stage_of(one))
    assert sim.markout_bps == sim_alone.markout_bps and sim.trades == sim_alone.trades > 0


@pytest.mark.slow
@pytest.mark.server
def test_a_research_run_on_two_sites_is_followed_verified_and_reproduced_where_its_outputs_are(
    prefect_api, clusters, s3_endpoint, tmp_path
):
    """A research run whose data lands at A (a folder) and whose model is trained and
    replayed at B (S3, a worker with GPU=1): the model and the simulation are stored at
    B and recorded with it; `nodes --lineage` finds a feature output at A and its copy at
    B, and the model B trained from it; `reproduce` re-runs everything from where each
    output is, with no failure; `verify` checks every site and finds a damaged model
    and a damaged feature copy at B, names them, and forgets them."""
    import dataclasses
    import json

    from typer.testing import CliRunner

    from quantloop.cli import app
    from quantloop.flows.reproduce import reproduce
    from quantloop.flows.research import ResearchParams, research

    bucket = f"site-b-{uuid.uuid4().hex[:10]}"
    s3fs.S3FileSystem(skip_instance_cache=True).mkdir(bucket)
    a = Site(name="A", scheduler_address=clusters["A"], storage_root=str(tmp_path / "a"),
             cost_per_hour=1.0, connect_timeout_s=5)  # fmt: skip
    b = Site(name="B", scheduler_address=clusters["B"], storage_root=f"s3://{bucket}/store",
             cost_per_hour=3.0, gpus=1, connect_timeout_s=5)  # fmt: skip
    home = str(tmp_path / "home")
    ws = Workspace(home=home, site=a, sites=[b])
    params = ResearchParams.model_validate({
        "workspace": ws.model_dump(mode="json"),
        "data": {"products": AT_A, "n_dates": 2, "start_date": DATES[0].isoformat(),
                 "synthetic": dataclasses.asdict(SYNTHETIC)},
        "train": {"window": 8, "stride": 2, "batch_size": 64, "steps": 10, "log_every": 5,
                  "device": "cpu", "optimizations": "none"},
        "validation": {"folds": 1},
    })  # fmt: skip
    summary = research(params)
    assert b.holds(summary.model_url) and summary.sites["B"]["train_bytes_across"] > 0
    catalog = ws.catalog()
    model_key = summary.model_url.rsplit("/", 1)[-1].removesuffix(".pt")
    [model] = catalog.output_copies("model", model_key)
    assert (model.site, model.origin) == ("B", "B")
    assert [c.site for _, _, c in catalog.outputs("simulation")] == ["B"]
    assert {name for name, _ in catalog.site_roots()} == {"A", "B"}

    # A feature output of the training date: computed at A, copied to B for training.
    runner = CliRunner(env={"COLUMNS": "400"})
    run = ["--home", home, "--run", summary.mlflow_run_id]
    out = runner.invoke(app, ["nodes", *run, "--json", "--limit", "10"])
    assert out.exit_code == 0, out.output
    row = next(r for r in json.loads(out.output) if r["date"] == DATES[0].isoformat())
    out = runner.invoke(app, ["nodes", *run, "--lineage", row["key"][:20]])
    assert out.exit_code == 0, out.output
    lineage = json.loads(out.output)
    assert lineage["output"]["site"] == "A" and a.holds(lineage["output"]["url"])
    assert [s["site"] for s in lineage["stored_at"]] == ["A", "B"]
    assert b.holds(lineage["stored_at"][1]["url"])
    [used] = lineage["used_by_models"]
    assert (used["model_digest"], used["trained_at"]) == (summary.model_digest, "B")
    assert [c["site"] for c in used["stored_at"]] == ["B"]

    # Reproduced from where each output is (the model's lineage is at B): no failure.
    reproduced = reproduce(summary.mlflow_run_id, sample=None, workspace=ws)
    assert reproduced["failures"] == 0 and reproduced["nodes"] == 4 + 2, reproduced

    # Damage at B: the model, and the copy of that feature output. verify, given the home
    # only (whose own site is neither A nor B), checks both sites the catalog knows,
    # names them, and forgets them.
    storage.write_bytes_atomic(model.url, storage.read_bytes(model.url)[:100])
    copy = lineage["stored_at"][1]
    data = bytearray(storage.read_bytes(copy["url"]))
    data[copy["offset"] + 10] ^= 0xFF
    storage.write_bytes_atomic(copy["url"], bytes(data))
    report = tmp_path / "verify.json"
    out = runner.invoke(app, ["verify", "--home", home, "--summary-json", str(report)])
    assert out.exit_code == 1, out.output
    found = json.loads(report.read_text())
    assert found["outputs_damaged"] == {row["key"]: "corrupt"}
    assert found["sites"]["B"]["outputs_damaged"] == 1 and found["sites"]["A"][
        "outputs_damaged"] == 0  # fmt: skip
    [bad] = found["models_damaged"]
    assert bad.startswith(f"{model.url}: model at site B: corrupt")
    assert catalog.output_copies("model", model_key) == [] and used["model_key"] == model_key
    assert not storage.exists(model.url)
    out = runner.invoke(app, ["verify", "--home", home])
    assert out.exit_code == 0, out.output


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
