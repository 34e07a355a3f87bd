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


def tiny(products: list[str], workspace: dict) -> dict:
    return {**TINY, "workspace": workspace, "data": {**TINY["data"], "products": products}}


@dataclasses.dataclass
class Desk:
    api: str  # the Prefect server's API (its store on PostgreSQL; locked: AUTH)
    catalog_url: str  # the partition catalog's database (DataCatalog block)
    mlflow_url: str  # MLflow's tracking and registry store (MlflowTracking block)
    bucket: str  # the S3 site's storage and MLflow's artifacts
    workspace: dict  # what every run's workspace names: blocks by name, home ~/quantloop
    deployment: UUID


# The desk's Prefect server is locked, as infra/README.md starts it.
AUTH = "quantloop:hosts-" + os.urandom(8).hex()


@pytest.fixture(scope="module")
def desk(postgres, s3_endpoint, tmp_path_factory) -> Desk:
    """The desk's shared state, made once as an operator would (infra/README.md): three
    databases on the PostgreSQL server (Prefect's, the catalog's, MLflow's), a bucket,
    the Prefect server on its database, the blocks saved there, MLflow's tables and
    experiment, and the research deployment on the desk's pool. This process's flows
    and clients use that server while the module runs."""
    import s3fs
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    tag = os.urandom(3).hex()
    prefect_db = postgres.create_database(f"hosts_prefect_{tag}")
    catalog_url = postgres.create_database(f"hosts_catalog_{tag}")
    mlflow_url = postgres.create_database(f"hosts_mlflow_{tag}").replace(
        "postgresql://", "postgresql+psycopg2://", 1)  # fmt: skip
    bucket = f"ql-hosts-{tag}"
    s3fs.S3FileSystem(skip_instance_cache=True).mkdir(bucket)
    asyncpg = prefect_db.replace("postgresql://", "postgresql+asyncpg://", 1)
    with (
        servers.prefect_server(tmp_path_factory.mktemp("prefect"), auth_string=AUTH,
                               database=asyncpg) as api,
        temporary_settings({PREFECT_API_URL: api, PREFECT_API_AUTH_STRING: AUTH}),
    ):  # fmt: skip
        names = {"site": "desk-s3", "tracking": "desk-mlflow", "data_catalog": "desk-catalog"}
        # No scheduler: each run computes its nodes on a LocalCluster of the host it runs
        # on; what they write goes to S3.
        Site(name="desk", storage_root=f"s3://{bucket}/store", n_workers=1).save(names["site"])
        DataCatalog(database_url=catalog_url).save(names["data_catalog"])
        block = MlflowTracking(tracking_uri=mlflow_url,
                               artifact_location=f"s3://{bucket}/mlartifacts")  # fmt: skip
        block.save(names["tracking"])
        tracking.client_for(block)  # MLflow's tables and the experiment, once, before any run
        workspace = {"home": "~/quantloop", **names}
        [research] = [d for d in read_deployments(PREFECT_YAML) if d.flow == "research"]
        [spec] = for_stack([research], pool=POOL, checkout=REPO_ROOT, workspace=workspace)
        # The file's pull step ($QUANTLOOP_DIR, resolved on each worker host), not the stack's.
        spec = dataclasses.replace(spec, pull_steps=research.pull_steps)
        ids = apply([spec], queues={"host-1": 2, "host-2": 3})
        yield Desk(api, catalog_url, mlflow_url, bucket, workspace, ids[spec.full_name])


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
def hosts(desk, tmp_path_factory) -> dict[int, Host]:
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
                   "XDG_CONFIG_HOME": str(home / ".config"), "QUANTLOOP_DIR": str(REPO_ROOT),
                   "PREFECT_API_AUTH_STRING": AUTH}  # fmt: skip
            stack.enter_context(servers.prefect_worker(
                desk.api, POOL, root / "worker", env=env, name=f"host-{n}",
                args=("--work-queue", f"host-{n}", "--limit", "4")))  # fmt: skip
            cli_env = servers.prefect_env(root / "cli", PREFECT_API_URL=desk.api, **env)
            out[n] = Host(n, home, tmp, cli_env, root / "worker" / "prefect-worker.log")
        yield out


def start(desk: Desk, host: Host, products: list[str]) -> UUID:
    """A research run of the deployment on `products`, for `host`'s worker."""
    with get_client(sync_client=True) as client:
        run = client.create_flow_run_from_deployment(
            desk.deployment, parameters={"params": tiny(products, desk.workspace)},
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


HOST_PRODUCTS = {1: ["HAA", "HAB", "HAC", "HAD"], 2: ["HBA", "HBB", "HBC", "HBD"]}


def same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def alone(products: list[str], folder: Path) -> dict:
    """Each run made alone, one at a time, in this process: a catalog, store and MLflow
    store of its own (its nodes, on tiny inputs, computed in the flow's process)."""
    from quantloop.flows.research import ResearchParams, research

    return {p: research(ResearchParams.model_validate(tiny([p], {"home": str(folder / p)})))
            for p in products}  # fmt: skip


@pytest.mark.slow
@pytest.mark.server
def test_two_hosts_share_a_desk_through_postgresql_s3_and_prefect_only(desk, hosts, tmp_path):
    """One scenario, its runs reused (each is a flow-run process of its own):

    1. Host 1 lands the days of eight products: a research run over all of them, which
       lands them at the S3 site and records them in the PostgreSQL catalog.
    2. Then, at once: eight research runs, four from each host, each on one product, on
       the one catalog (and MLflow store, and S3 site); and, on host 2, once host 1's
       first run has ended, `quantloop reproduce` of it: its nodes, model and simulation.
    Host 2's runs find host 1's versions (they land nothing: the catalog's write counter
    does not move; a version counts as found once its bytes, read from S3, have its
    digest), pin them and train on them. Every run of the eight pins exactly its own
    product's days, and its model and mark-out are bit for bit those of the same run
    made alone (in this process, while host 1 lands). The reproduction on host 2 reads
    the run's pin from PostgreSQL and its inputs from S3: 0 failures. Neither host keeps
    a catalog or a store of its own."""
    h1, h2 = hosts[1], hosts[2]
    products = HOST_PRODUCTS[1] + HOST_PRODUCTS[2]
    landing_id = start(desk, h1, products)
    made_alone = alone(products, tmp_path)  # while host 1 lands
    landing_run = finish([landing_id], hosts)[landing_id]
    writes = dataset_writes(desk)
    assert writes == 2 * len(products)  # two days each, landed once, from host 1

    ids = {start(desk, hosts[n], [p]): (n, p) for n in (1, 2) for p in HOST_PRODUCTS[n]}
    # As soon as host 1's first run has ended, host 2 reproduces it (the others run on)
    first_id = next(i for i, (n, p) in ids.items() if p == HOST_PRODUCTS[1][0])
    first = recorded(desk, finish([first_id], hosts)[first_id].id)
    summary = h2.tmp / "reproduction.json"
    reproduce = quantloop(h2, "reproduce", first.info.run_id, "--sample", "0",
                          "--home", str(h2.home / "quantloop"), "--tracking-uri", desk.mlflow_url,
                          "--summary-json", str(summary))  # fmt: skip
    runs = finish(list(ids), hosts)
    out, _ = reproduce.communicate(timeout=RUN_TIMEOUT_S)
    assert reproduce.returncode == 0, out[-4000:]

    ran_on(h1, landing_id, hosts, landing_run)
    for i, (n, _) in ids.items():
        ran_on(hosts[n], i, hosts, runs[i])
    starts = [r.start_time for r in runs.values()]
    assert max(starts) < min(r.end_time for r in runs.values()), "not all eight ran at once"

    # Found: the eight landed nothing (host 2's four included); each pinned its own days,
    # the versions host 1 landed at the S3 site
    assert dataset_writes(desk) == writes
    catalog = Catalog(desk.catalog_url)
    versions = set()
    for i, (_, product) in ids.items():
        parent = recorded(desk, i)
        tags, metrics = parent.data.tags, parent.data.metrics
        pinned = catalog.pinned(tags["data_digest"])
        assert set(pinned["product"].to_pylist()) == {product}
        assert all(u.startswith(f"s3://{desk.bucket}/") for u in pinned["location"].to_pylist())
        # Its own data's model and mark-out: those of the same run alone
        own = made_alone[product]
        assert tags["data_digest"] == own.data_digest, product
        assert tags["model_digest"] == own.model_digest, product
        assert own.markout_bps and all(same(metrics[f"markout_bps.{h}"], bps)
                                       for h, bps in own.markout_bps.items()), product  # fmt: skip
        # Read: its nodes are those host 1 computed, found in the S3 store by their keys
        assert metrics["nodes"] == metrics["cache_hits"] == 2, product
        versions.add(tags["model_version"])
    assert len({a.model_digest for a in made_alone.values()}) == len(products)  # all differ
    assert len(versions) == len(products)  # a candidate version each, registered at once

    # Reproduced on host 2: both nodes of host 1's first run, its model and its simulation
    report = json.loads(summary.read_text())
    assert report["failures"] == 0, report
    assert sorted(c["what"] for c in report["checks"]) == ["features", "features", "model",
                                                            "simulation"]  # fmt: skip
    for host in (h1, h2):  # neither host made a catalog or a store of its own
        home = host.home / "quantloop"
        assert not (home / "catalog.sqlite").exists() and not (home / "store").exists()
