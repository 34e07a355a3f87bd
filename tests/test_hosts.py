"""Several hosts on one desk (issue 22): two hosts that share only the PostgreSQL server
(the partition catalog and MLflow's store), S3 (moto's server) and the Prefect server.

A host here is a process tree: a `prefect worker` of the desk's work pool and the flow
runs it starts, with a HOME and a TMPDIR of its own. The research deployment is
infra/prefect.yaml's, applied as `quantloop deploy` applies it (its pull step names the
checkout through $QUANTLOOP_DIR, set on each worker), with a workspace that names the
desk's saved blocks and the home `~/quantloop`, which each host resolves under its own
HOME: nothing a run writes or reads is on a disk both hosts see. Each host's worker
serves a work queue of its own in the one pool, so a test says which host runs a flow.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from uuid import UUID

import pytest
from mlflow.tracking import MlflowClient
from prefect.client.orchestration import get_client

from quantloop.blocks import DataCatalog, MlflowTracking, Site
from quantloop.deploy import REPO_ROOT, apply, for_stack, read_deployments
from quantloop.tasks.data.catalog import Catalog
from quantloop.tasks.records import tracking
from tests import servers

PREFECT_YAML = REPO_ROOT / "infra" / "prefect.yaml"
POOL = "quantloop-hosts"
RUN_TIMEOUT_S = 600  # eight tiny runs at once on a busy 2-core machine

# One product per run, two days of tiny books, one fold: a whole research loop (land,
# features, train, simulate, record) in a few seconds of CPU.
TINY = {
    "data": {"n_dates": 2, "synthetic": {"events_per_day": 1500, "levels": 2}},
    "train": {"steps": 10, "batch_size": 64, "log_every": 5},
    "validation": {"folds": 1},
}


def tiny(product: str, workspace: dict) -> dict:
    return {**TINY, "workspace": workspace, "data": {**TINY["data"], "products": [product]}}


@dataclasses.dataclass
class Desk:
    catalog_url: str  # the partition catalog's database (DataCatalog block)
    mlflow_url: str  # MLflow's tracking and registry store (MlflowTracking block)
    bucket: str  # the S3 site's storage and MLflow's artifacts
    workspace: dict  # what every run's workspace names: blocks by name, home ~/quantloop
    deployment: UUID


@pytest.fixture(scope="module")
def desk(postgres, s3_endpoint, prefect_api) -> Desk:
    """The desk's shared state, made once as an operator would (infra/README.md): two
    databases on the PostgreSQL server, a bucket, the blocks saved on the Prefect server,
    MLflow's tables and experiment, and the research deployment on the desk's pool."""
    import s3fs

    tag = os.urandom(3).hex()
    catalog_url = postgres.create_database(f"hosts_catalog_{tag}")
    mlflow_url = postgres.create_database(f"hosts_mlflow_{tag}").replace(
        "postgresql://", "postgresql+psycopg2://", 1)  # fmt: skip
    bucket = f"ql-hosts-{tag}"
    s3fs.S3FileSystem(skip_instance_cache=True).mkdir(bucket)
    names = {"site": f"hosts-s3-{tag}", "tracking": f"hosts-mlflow-{tag}",
             "data_catalog": f"hosts-catalog-{tag}"}  # fmt: skip
    # No scheduler: each run computes its nodes on a LocalCluster of the host it runs on;
    # what they write goes to S3.
    Site(name="desk", storage_root=f"s3://{bucket}/store", n_workers=1).save(names["site"])
    DataCatalog(database_url=catalog_url).save(names["data_catalog"])
    block = MlflowTracking(tracking_uri=mlflow_url, artifact_location=f"s3://{bucket}/mlartifacts")
    block.save(names["tracking"])
    tracking.client_for(block)  # MLflow's tables and the experiment, once, before any run
    workspace = {"home": "~/quantloop", **names}
    [research] = [d for d in read_deployments(PREFECT_YAML) if d.flow == "research"]
    [spec] = for_stack([research], pool=POOL, checkout=REPO_ROOT, workspace=workspace)
    # The file's pull step ($QUANTLOOP_DIR, resolved on each worker host), not the stack's.
    spec = dataclasses.replace(spec, name=f"hosts-{tag}", pull_steps=research.pull_steps)
    ids = apply([spec], queues={"host-1": 2, "host-2": 3})
    return Desk(catalog_url, mlflow_url, bucket, workspace, ids[spec.full_name])


@dataclasses.dataclass
class Host:
    n: int
    home: Path  # its HOME: the workspace's ~/quantloop is under it
    tmp: Path  # its TMPDIR
    env: dict  # what its processes run with
    log: Path  # its worker's log, the flow runs' output included

    @property
    def queue(self) -> str:
        return f"host-{self.n}"


@pytest.fixture(scope="module")
def hosts(desk, prefect_api, tmp_path_factory) -> dict[int, Host]:
    """Two hosts: each a `prefect worker` of the desk's pool on a queue of its own
    (at most 4 flow runs at once), with its own HOME and TMPDIR."""
    out = {}
    with contextlib.ExitStack() as stack:
        for n in (1, 2):
            root = tmp_path_factory.mktemp(f"host{n}")
            home, tmp = root / "home", root / "tmp"
            home.mkdir()
            tmp.mkdir()
            env = {"HOME": str(home), "TMPDIR": str(tmp), "XDG_CACHE_HOME": str(home / ".cache"),
                   "XDG_CONFIG_HOME": str(home / ".config"),
                   "QUANTLOOP_DIR": str(REPO_ROOT)}  # fmt: skip
            stack.enter_context(servers.prefect_worker(
                prefect_api, POOL, root / "worker", env=env, name=f"host-{n}",
                args=("--work-queue", f"host-{n}", "--limit", "4")))  # fmt: skip
            out[n] = Host(n, home, tmp, servers.prefect_env(root / "cli", PREFECT_API_URL=prefect_api,
                                                            **env), root / "worker" / "prefect-worker.log")  # fmt: skip
        yield out


def start(desk: Desk, host: Host, product: str) -> UUID:
    """A research run of the deployment on one product, for `host`'s worker."""
    with get_client(sync_client=True) as client:
        run = client.create_flow_run_from_deployment(
            desk.deployment, parameters={"params": tiny(product, desk.workspace)},
            work_queue_name=host.queue)  # fmt: skip
    return run.id


def finish(ids: list[UUID], hosts: dict[int, Host], timeout: float = RUN_TIMEOUT_S) -> dict:
    """Wait for the flow runs to end; each must have completed (else the hosts' logs)."""
    deadline = time.monotonic() + timeout
    with get_client(sync_client=True) as client:
        while True:
            runs = {i: client.read_flow_run(i) for i in ids}
            if all(r.state.is_final() for r in runs.values()) or time.monotonic() > deadline:
                break
            time.sleep(1)
    bad = {str(i): str(r.state) for i, r in runs.items() if not r.state.is_completed()}
    logs = "\n".join(f"--- host {h.n}:\n{tail(h.log)}" for h in hosts.values())
    assert not bad, f"{bad}\n{logs}"
    return runs


def tail(path: Path, lines: int = 80) -> str:
    if not path.exists():
        return f"({path} missing)"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def recorded(desk: Desk, flow_run_id: UUID):
    """The MLflow parent run a research flow run recorded (found by its Prefect id)."""
    client = MlflowClient(tracking_uri=desk.mlflow_url)
    experiment = client.get_experiment_by_name("quantloop")
    [parent] = client.search_runs([experiment.experiment_id],
                                  f"tags.prefect_flow_run_id = '{flow_run_id}'")  # fmt: skip
    return parent


def dataset_writes(desk: Desk) -> int:
    """Writes to the synthetic dataset so far (the catalog's version counter)."""
    import psycopg2

    with psycopg2.connect(desk.catalog_url) as conn, conn.cursor() as cur:
        cur.execute("SELECT version FROM versions WHERE dataset = 'synthetic'")
        row = cur.fetchone()
    return row[0] if row else 0


def ran_on(host: Host, flow_run_id: UUID, hosts: dict[int, Host], run) -> None:
    """The flow run went to `host`'s queue and its worker (not the other's) started it."""
    assert run.work_queue_name == host.queue
    assert str(flow_run_id) in host.log.read_text(errors="replace")
    for other in hosts.values():
        if other is not host:
            assert str(flow_run_id) not in other.log.read_text(errors="replace")


def quantloop(host: Host, *args: str) -> subprocess.Popen:
    """A `quantloop` command on `host`: its HOME, TMPDIR and the desk's Prefect server."""
    return subprocess.Popen([sys.executable, "-m", "quantloop.cli", *args], cwd=REPO_ROOT,
                            env=host.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)  # fmt: skip


@pytest.mark.slow
@pytest.mark.server
def test_data_landed_on_one_host_is_found_pinned_and_read_on_the_other(desk, hosts):
    """Host 1 runs research on a product nobody landed: it lands the days at the S3 site
    and records them in the PostgreSQL catalog. Then, at once on host 2: a research run
    on the same product finds host 1's versions (it lands nothing: the catalog's write
    counter does not move), pins the same versions and trains on them; and `quantloop
    reproduce` re-runs every node, the model and the simulation of host 1's run from its
    recorded pin, reading the inputs from S3: 0 failures. Host 2 keeps no catalog and no
    store of its own."""
    h1, h2 = hosts[1], hosts[2]
    first_id = start(desk, h1, "HLAND")
    first_run = finish([first_id], hosts)[first_id]
    first = recorded(desk, first_id)
    writes = dataset_writes(desk)
    assert writes >= 2  # its two days, landed from host 1

    second_id = start(desk, h2, "HLAND")
    summary = h2.tmp / "reproduction.json"
    reproduce = quantloop(h2, "reproduce", first.info.run_id, "--sample", "0",
                          "--home", str(h2.home / "quantloop"), "--tracking-uri", desk.mlflow_url,
                          "--summary-json", str(summary))  # fmt: skip
    second_run = finish([second_id], hosts)[second_id]
    out, _ = reproduce.communicate(timeout=RUN_TIMEOUT_S)
    assert reproduce.returncode == 0, out[-4000:]
    second = recorded(desk, second_id)

    ran_on(h1, first_id, hosts, first_run)
    ran_on(h2, second_id, hosts, second_run)
    # Found: host 2 landed nothing; pinned: the same versions (the pin is their digest)
    assert dataset_writes(desk) == writes
    assert second.data.tags["data_digest"] == first.data.tags["data_digest"]
    pinned = Catalog(desk.catalog_url).pinned(second.data.tags["data_digest"])
    assert set(pinned["product"].to_pylist()) == {"HLAND"}
    assert all(u.startswith(f"s3://{desk.bucket}/") for u in pinned["location"].to_pylist())
    # ... and read: its nodes are host 1's outputs, and its model host 1's
    assert second.data.metrics["cache_hits"] == second.data.metrics["nodes"] == 2
    assert second.data.tags["model_digest"] == first.data.tags["model_digest"]
    # Reproduced on host 2: both nodes, the model and the simulation, from S3 and the pin
    report = json.loads(summary.read_text())
    assert report["failures"] == 0 and report["nodes"] == 4, report
    assert sorted(c["what"] for c in report["checks"]) == ["features", "features", "model",
                                                            "simulation"]  # fmt: skip
    for host in (h1, h2):  # neither host made a catalog or a store of its own
        home = host.home / "quantloop"
        assert not (home / "catalog.sqlite").exists() and not (home / "store").exists()


HOST_PRODUCTS = {1: ["HAA", "HAB", "HAC", "HAD"], 2: ["HBA", "HBB", "HBC", "HBD"]}


def same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


@pytest.mark.slow
@pytest.mark.server
def test_eight_runs_at_once_four_from_each_host_get_their_own_datas_model_and_markout(
    desk, hosts, tmp_path
):
    """Eight research runs at once, four from each host, each on its own product, on the
    one PostgreSQL catalog (and MLflow store, and S3 site): every run pins exactly its own
    product's days, and its model and mark-out are bit for bit those of the same run made
    alone, in a workspace of its own (after them, one at a time, in this process)."""
    from distributed import LocalCluster

    from quantloop.blocks.site import WORKER_PRELOAD
    from quantloop.flows.research import ResearchParams, research

    ids = {start(desk, hosts[n], p): (n, p) for n in (1, 2) for p in HOST_PRODUCTS[n]}
    runs = finish(list(ids), hosts)
    starts = [r.start_time for r in runs.values()]
    ends = [r.end_time for r in runs.values()]
    assert max(starts) < min(ends), "the eight runs were not all running at one moment"
    at_once = {ids[i][1]: recorded(desk, i) for i in ids}
    for i, (n, _) in ids.items():
        ran_on(hosts[n], i, hosts, runs[i])

    # The same runs alone: one at a time, each on a catalog, store and MLflow of its own
    # (one Dask cluster for all, so that no run pays for starting one)
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=None,
                      preload=list(WORKER_PRELOAD)) as cluster:  # fmt: skip
        alone = {}
        for product in at_once:
            home = tmp_path / product
            site = Site(name="alone", scheduler_address=cluster.scheduler_address,
                        storage_root=str(home / "store"))  # fmt: skip
            alone[product] = research(ResearchParams.model_validate(
                tiny(product, {"home": str(home), "site": site})))  # fmt: skip

    catalog = Catalog(desk.catalog_url)
    versions = set()
    for product, parent in at_once.items():
        tags, metrics = parent.data.tags, parent.data.metrics
        own = alone[product]
        assert set(catalog.pinned(tags["data_digest"])["product"].to_pylist()) == {product}
        assert tags["data_digest"] == own.data_digest, product
        assert tags["model_digest"] == own.model_digest, product
        assert metrics["nodes"] == metrics["computed"] == 2, product
        for h, bps in own.markout_bps.items():
            assert same(metrics[f"markout_bps.{h}"], bps), (product, h)
        versions.add(tags["model_version"])
    # Eight distinct models, eight candidate versions registered at once
    assert len({p.data.tags["model_digest"] for p in at_once.values()}) == 8
    assert len(versions) == 8
