"""Deployments: infra/prefect.yaml is the one source, and the research flow runs on a
real worker.

The end-to-end tests start their own `prefect server` and `prefect worker` (not the
session's ephemeral harness): the flow run happens in a worker's child process,
exactly as an operator's deployment runs, and reports to a real MLflow server.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
import yaml
from mlflow.tracking import MlflowClient
from prefect.client.orchestration import get_client
from prefect.deployments import run_deployment
from prefect.flows import load_flow_from_entrypoint
from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

from quantloop.blocks import MlflowTracking, Site
from quantloop.deploy import (
    REPO_ROOT,
    apply,
    asks_for_cuda,
    ensure_pool,
    for_stack,
    read_deployments,
    read_queues,
)
from quantloop.tasks.research.stage import StageParams, feature_outputs
from quantloop.tasks.runtime.workspace import Selection, Workspace
from tests import servers

PREFECT_YAML = REPO_ROOT / "infra" / "prefect.yaml"
POOL = "quantloop-test-cpu"


def tiny_params(home: Path, tracking_uri: str) -> dict:
    return {
        "params": {
            "workspace": {"home": str(home), "tracking_uri": tracking_uri, "n_workers": 1},
            "data": {
                "products": ["SYNA"],
                "n_dates": 2,
                "synthetic": {"events_per_day": 3000, "levels": 2},
            },
            "train": {"steps": 20, "batch_size": 64},
            "validation": {"folds": 1},  # two dates fit one walk-forward fold
        }
    }


def test_prefect_yaml_entrypoints_load_and_parameters_validate():
    pools = {}
    for d in read_deployments(PREFECT_YAML):
        flow = load_flow_from_entrypoint(str(REPO_ROOT / d.entrypoint))
        params = dict(d.parameters)
        if flow.name == "simulate":
            params["model_urls"] = ["s3://bucket/models/x.pt"]  # required; given per run
        if flow.name == "promote":
            params["run"] = "0" * 32  # required; given per run
        flow.validate_parameters(params)  # raises on an unknown or ill-typed field
        pools[d.full_name] = d.pool
    assert pools == {
        "research/desk": "quantloop-cpu",
        "features/desk": "quantloop-cpu",
        "train/gpu": "quantloop-gpu",
        "simulate/desk": "quantloop-cpu",
        "retrain/nightly": "quantloop-cpu",
        "backtest/desk": "quantloop-cpu",
        "promote/desk": "quantloop-cpu",
    }
    queues = {d.full_name: d.queue for d in read_deployments(PREFECT_YAML)}
    priority = read_queues(PREFECT_YAML)
    # retraining and backtests wait behind research in its own pool
    for batch in ("retrain/nightly", "backtest/desk"):
        assert priority[queues[batch]] > priority[queues["research/desk"]]


def test_a_stack_runs_the_same_deployments_from_its_checkout_on_its_pool(tmp_path):
    specs = for_stack(read_deployments(PREFECT_YAML), pool="local", checkout=tmp_path,
                      workspace={"home": "/home/me/.quantloop"})  # fmt: skip
    assert {d.full_name for d in specs} == {d.full_name for d in read_deployments(PREFECT_YAML)}
    for d in specs:
        assert d.pool == "local"
        assert d.pull_steps == [{"prefect.deployments.steps.set_working_directory":
                                 {"directory": str(tmp_path)}}]  # fmt: skip
        [workspace] = [v["workspace"] for v in [d.parameters, *d.parameters.values()]
                       if isinstance(v, dict) and "workspace" in v]  # fmt: skip
        assert workspace == {"home": "/home/me/.quantloop"}  # the desk's blocks are not here


def tail(path: Path, lines: int = 60) -> str:
    if not path.exists():
        return f"({path} missing)"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


# The module's server is locked, as infra/README.md starts it: every client here (this
# process, the CLIs, the worker and its flow runs) sends the auth string.
AUTH = "quantloop:test-" + os.urandom(8).hex()


def settings(api: str):
    return temporary_settings({PREFECT_API_URL: api, PREFECT_API_AUTH_STRING: AUTH})


@pytest.fixture(scope="module")
def prefect_server(tmp_path_factory) -> tuple[str, Path]:
    """A real `prefect server` for this module: (API URL, its folder)."""
    folder = tmp_path_factory.mktemp("prefect")
    with servers.prefect_server(folder, auth_string=AUTH) as api:
        yield api, folder


@pytest.mark.slow
@pytest.mark.server
def test_the_locked_server_refuses_a_client_without_the_auth_string(prefect_server):
    api, _ = prefect_server
    request = urllib.request.Request(f"{api}/flows/filter", data=b"{}", method="POST",
                                     headers={"Content-Type": "application/json"})  # fmt: skip
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    assert refused.value.code == 401
    with settings(api), get_client(sync_client=True) as client:
        client.read_flows(limit=1)  # with it, the same call is answered


@pytest.mark.slow
@pytest.mark.server
def test_flow_runs_after_the_first_run_in_a_warm_process_and_cancel_there(prefect_server, tmp_path):
    """infra/prefect.yaml's run command, `quantloop engine`: a worker's first flow run runs
    in its own process and starts a warm one; the next ones are its children (the flow
    says so), complete, and a cancelled one ends as Cancelled with its process gone; a
    worker whose warm process `quantloop engine --warm` started has its first run warm."""
    import psutil
    from prefect.client.schemas.objects import StateType
    from prefect.states import Cancelling

    api, _ = prefect_server
    [template] = [d for d in read_deployments(PREFECT_YAML) if d.flow == "research"]
    assert template.job_variables == {"command": "quantloop engine"}
    pool = "quantloop-test-warm"
    [spec] = for_stack([template], pool=pool, checkout=REPO_ROOT, workspace={})
    spec = dataclasses.replace(spec, flow="where-it-ran", name="warm",
                               entrypoint="tests/engine_flows.py:where_it_ran", parameters={})
    reports = [tmp_path / f"run{i}.json" for i in range(3)]
    log = tmp_path / "worker" / "prefect-worker.log"
    with settings(api):
        apply([spec])
        with servers.prefect_worker(api, pool, tmp_path / "worker", prewarm=False,
                                    env={"PREFECT_API_AUTH_STRING": AUTH}):  # fmt: skip
            runs = [run_deployment("where-it-ran/warm", parameters={"out": str(reports[i])},
                                   timeout=300) for i in range(2)]  # fmt: skip
            for run in runs:
                assert run.state.is_completed(), (run.state, tail(log))
            first, second = (json.loads(r.read_text()) for r in reports[:2])
            assert not first["warm"] and second["warm"], (first, second)
            # Cancelled from the API (the UI's button) while it sleeps in a warm child
            run = run_deployment("where-it-ran/warm", timeout=0,
                                 parameters={"out": str(reports[2]), "sleep_s": 600})  # fmt: skip
            with get_client(sync_client=True) as client:
                end = time.monotonic() + 300
                while not reports[2].exists():
                    assert time.monotonic() < end, tail(tmp_path / "worker" / "prefect-worker.log")
                    time.sleep(0.5)
                third = json.loads(reports[2].read_text())
                assert third["warm"]
                client.set_flow_run_state(run.id, Cancelling(), force=True)
                end = time.monotonic() + 120
                while (state := client.read_flow_run(run.id).state).type != StateType.CANCELLED:
                    assert time.monotonic() < end, (state, tail(log))
                    time.sleep(0.5)
            assert not psutil.pid_exists(third["pid"]) or psutil.Process(
                third["pid"]).status() == psutil.STATUS_ZOMBIE  # fmt: skip

        # Another worker (its own environment), its warm process started beforehand by
        # `quantloop engine --warm` in its environment, as `quantloop serve` does: its
        # first run is already a warm child.
        with servers.prefect_worker(api, pool, tmp_path / "worker2", prewarm=False,
                                    env={"PREFECT_API_AUTH_STRING": AUTH}) as worker:  # fmt: skip
            env = worker.env
            warmed = subprocess.run([str(Path(sys.executable).parent / "quantloop"), "engine",
                                     "--warm"], env=env, capture_output=True, text=True,
                                    timeout=120)  # fmt: skip
            assert warmed.returncode == 0 and "a warm process" in warmed.stdout, warmed
            out = tmp_path / "run3.json"
            run = run_deployment("where-it-ran/warm", parameters={"out": str(out)}, timeout=300)
            log = tmp_path / "worker2" / "prefect-worker.log"
            assert run.state.is_completed(), (run.state, tail(log))
            report = json.loads(out.read_text())
            if not report["warm"]:  # which variables the warm process was not started with
                code = ("import json; from quantloop.forkserver import flow_run_environment; "
                        "print(json.dumps(flow_run_environment()))")  # fmt: skip
                found = subprocess.run([sys.executable, "-c", code], env=env,
                                       capture_output=True, text=True)  # fmt: skip
                guess, got = json.loads(found.stdout), report["env"]
                differ = {k: (guess.get(k), got.get(k)) for k in {*guess, *got}
                          if guess.get(k) != got.get(k) and not k.startswith("PREFECT__")}
                raise AssertionError(f"the first run was not warm; environments differ: {differ}")


@pytest.mark.slow
@pytest.mark.server
def test_research_deployment_runs_on_a_process_worker(prefect_server, tmp_path, mlflow_uri):
    api, _ = prefect_server
    home, worker_dir = tmp_path / "workspace", tmp_path / "worker"
    research = [d for d in read_deployments(PREFECT_YAML) if d.flow == "research"]
    specs = for_stack(research, pool=POOL, checkout=REPO_ROOT, workspace={"home": str(home)})
    # Restored on exit, so later tests see the session's settings again.
    with settings(api):
        ids = apply(specs)
        with get_client(sync_client=True) as client:
            deployment = client.read_deployment(ids["research/desk"])
        assert deployment.work_pool_name == POOL
        assert deployment.pull_steps == [
            {"prefect.deployments.steps.set_working_directory": {"directory": str(REPO_ROOT)}}
        ]
        with servers.prefect_worker(api, POOL, worker_dir, env={"PREFECT_API_AUTH_STRING": AUTH}):
            flow_run = run_deployment(
                "research/desk", parameters=tiny_params(home, mlflow_uri), timeout=240
            )

    assert flow_run.state is not None and flow_run.state.is_completed(), (
        f"flow run {flow_run.id} ended {flow_run.state}; worker log:\n"
        + tail(worker_dir / "prefect-worker.log")
    )
    client = MlflowClient(tracking_uri=mlflow_uri)
    experiment = client.get_experiment_by_name("quantloop")
    parents = client.search_runs(
        [experiment.experiment_id], filter_string=f"tags.prefect_flow_run_id = '{flow_run.id}'"
    )
    assert len(parents) == 1
    parent = parents[0]
    assert parent.info.status == "FINISHED"
    assert parent.data.metrics["nodes"] == 2
    children = client.search_runs(
        [experiment.experiment_id],
        filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'",
    )
    assert {r.data.tags["quantloop.stage"] for r in children} >= {"features", "train", "simulate"}

    stage = StageParams(workspace=Workspace(home=str(home)), selection=Selection(products=["SYNA"]))
    outputs = feature_outputs(stage)
    assert len(outputs) == 2
    # Each read checks the stored bytes against the digest recorded when they were written.
    assert all(out.read().num_rows > 0 for out in outputs.values())


def quantloop_cli(*args: str, check: bool = True):
    """`quantloop ARGS` in this process (the CLI's own app, as tests/test_cli.py runs it),
    inside `settings(api)`: the server and auth string it reads are those. In a
    subprocess each call cost its interpreter and imports (~5 s of CPU here), three
    times."""
    from typer.testing import CliRunner

    from quantloop.cli import app

    result = CliRunner(env={"COLUMNS": "200"}).invoke(app, list(args))
    assert not check or result.exit_code == 0, result.output[-3000:]
    return result


def prefect_cli(api: str, home: Path, *args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "prefect", "--no-prompt", *args],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
        env=servers.prefect_env(home, PREFECT_API_URL=api, PREFECT_API_AUTH_STRING=AUTH),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.slow
@pytest.mark.server
def test_operator_setup_from_infra_readme(prefect_server, mlflow_uri):
    """infra/README.md's steps: register the blocks, save them, deploy prefect.yaml."""
    api, folder = prefect_server
    with settings(api):
        prefect_cli(api, folder / "cli-home", "block", "register", "-m", "quantloop.blocks")
        Site(name="onprem", scheduler_address="tcp://10.0.0.5:8786", storage_root="s3://x/y").save(
            "onprem", overwrite=True
        )
        MlflowTracking(tracking_uri=mlflow_uri).save("desk-mlflow", overwrite=True)
        site = Site.load("onprem")
        tracking_block = Workspace(tracking="desk-mlflow").resolve_tracking()

        for pool in ("quantloop-cpu", "quantloop-gpu"):  # `prefect deploy` needs them to exist
            ensure_pool(pool)
        prefect_cli(
            api, folder / "cli-home", "deploy", "--all", "--prefect-file", str(PREFECT_YAML)
        )
        with get_client(sync_client=True) as client:
            deployed = {
                flow: client.read_deployment_by_name(f"{flow}/{name}")
                for flow, name in (("research", "desk"), ("features", "desk"),
                                   ("train", "gpu"), ("simulate", "desk"))
            }  # fmt: skip

        # `quantloop deploy` applies the same file: nothing differs, nothing is refused.
        quantloop_cli("deploy")
        # A file with other settings is refused, naming the difference, and changes
        # nothing; --replace replaces.
        changed = yaml.safe_load(PREFECT_YAML.read_text())
        changed["definitions"]["workspace"]["home"] = "/data/desk"
        changed["deployments"][0]["parameters"]["params"]["workspace"]["home"] = "/data/desk"
        other = folder / "changed.yaml"
        other.write_text(yaml.safe_dump(changed))
        refused = quantloop_cli("deploy", "--prefect-file", str(other), check=False)
        with get_client(sync_client=True) as client:
            kept = client.read_deployment_by_name("research/desk").parameters
        quantloop_cli("deploy", "--prefect-file", str(other), "--only", "research/desk",
                      "--replace")  # fmt: skip
        with get_client(sync_client=True) as client:
            replaced = client.read_deployment_by_name("research/desk").parameters

    assert refused.exit_code == 1, refused.output
    assert "research/desk: parameters:" in refused.stderr and "/data/desk" in refused.stderr
    assert "--replace" in refused.stderr
    assert kept["params"]["workspace"]["home"] == "/srv/quantloop"
    assert replaced["params"]["workspace"]["home"] == "/data/desk"

    assert (site.scheduler_address, site.root) == ("tcp://10.0.0.5:8786", "s3://x/y")
    assert tracking_block.resolved_uri() == mlflow_uri
    assert {f: d.work_pool_name for f, d in deployed.items()} == {
        "research": "quantloop-cpu",
        "features": "quantloop-cpu",
        "train": "quantloop-gpu",
        "simulate": "quantloop-cpu",
    }
    # The checkout's path is resolved on the worker host when a run starts.
    assert deployed["train"].pull_steps == [
        {"prefect.deployments.steps.set_working_directory": {"directory": "{{ $QUANTLOOP_DIR }}"}}
    ]
    assert deployed["research"].parameters["params"]["workspace"]["site"] == "onprem"


@pytest.mark.slow
@pytest.mark.server
def test_a_queued_research_run_starts_before_queued_retrains(prefect_server, tmp_path):
    """Research's queue outranks the batch queue in one pool: runs queued while the
    worker is down are started research first, whatever waited longer. The retrains
    retrain the research run's version (1 of a fresh store's candidates model: research
    registers candidates, and only `promote` writes the guarded model): one started first
    would find no model and fail."""
    api, _ = prefect_server
    pool, home, worker_dir = "quantloop-test-queues", tmp_path / "workspace", tmp_path / "worker"
    wanted = [d for d in read_deployments(PREFECT_YAML) if d.flow in ("research", "retrain")]
    # A store of its own: the research run registers version 1 of the model there.
    workspace = {"home": str(home), "tracking_uri": f"sqlite:///{home / 'queue-mlflow.db'}"}
    specs = for_stack(wanted, pool=pool, checkout=REPO_ROOT, workspace=workspace)
    research_params = tiny_params(home, workspace["tracking_uri"])
    with settings(api):
        ids = apply(specs, replace=True, queues=read_queues(PREFECT_YAML))
        with get_client(sync_client=True) as client:
            queues = {q.name: q.priority for q in client.read_work_queues(work_pool_name=pool)}
            retrains = [
                client.create_flow_run_from_deployment(
                    ids["retrain/nightly"],
                    parameters={"model": "quantloop-orderbook-candidates", "alias": "1",
                                "workspace": {**workspace, "n_workers": 1}},
                )
                for _ in range(2)
            ]
            research_run = client.create_flow_run_from_deployment(
                ids["research/desk"], parameters=research_params
            )
            runs = [research_run, *retrains]
            assert all(r.state.is_scheduled() for r in runs)  # nothing serves the pool yet
            with servers.prefect_worker(api, pool, worker_dir, args=("--limit", "1"),
                                        env={"PREFECT_API_AUTH_STRING": AUTH}):  # fmt: skip
                deadline = time.monotonic() + 240
                while time.monotonic() < deadline:
                    runs = [client.read_flow_run(r.id) for r in runs]
                    if all(r.state.is_final() for r in runs):
                        break
                    time.sleep(1)
    assert queues["default"] < queues["batch"], queues
    research_run, *retrains = runs
    log = tail(worker_dir / "prefect-worker.log")
    assert all(r.state.is_completed() for r in runs), [str(r.state) for r in runs] + [log]
    assert all(research_run.start_time < r.start_time for r in retrains), (
        research_run.start_time, [r.start_time for r in retrains])  # fmt: skip
    assert retrains[0].created < research_run.created  # it waited longer, and still went later


@pytest.mark.skipif(torch.cuda.is_available(), reason="what a worker without CUDA does")
def test_train_gpu_on_a_worker_without_cuda_fails_at_once_naming_the_device(tmp_path):
    """train/gpu asks for device cuda: on a worker without CUDA its first device lookup
    fails in one line naming the parameter (torch failed later, in the training loop, with
    "AssertionError: Torch not compiled with CUDA enabled"); serve says so at start."""
    from quantloop.flows.train import plan_for
    from quantloop.tasks.research.train_config import TrainConfig

    asking = {d.full_name: d for d in read_deployments(PREFECT_YAML) if asks_for_cuda(d)}
    assert list(asking) == ["train/gpu"]
    gpu = asking["train/gpu"]
    stage = StageParams(workspace=Workspace(home=str(tmp_path)))
    with pytest.raises(ValueError, match=r"^config\.device is 'cuda' but this worker has no CUDA"):
        plan_for(stage, TrainConfig(**gpu.parameters["config"]))
