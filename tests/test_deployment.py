"""Deployments: infra/prefect.yaml is valid, and the research flow runs on a real worker.

The end-to-end test starts its own `prefect server` and `prefect worker` (not the
session's ephemeral harness): the flow run happens in a worker's child process,
exactly as an operator's deployment runs, and reports to a real MLflow server.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient
from prefect.client.orchestration import get_client
from prefect.deployments import run_deployment
from prefect.flows import load_flow_from_entrypoint
from prefect.settings import PREFECT_API_URL, temporary_settings

from infra.deploy import REPO_ROOT, deploy, ensure_pool
from quantloop.blocks import MlflowTracking, Site
from quantloop.tasks.stage import StageParams, feature_outputs
from quantloop.tasks.workspace import Selection, Workspace
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
        }
    }


def test_prefect_yaml_entrypoints_load_and_parameters_validate():
    config = yaml.safe_load(PREFECT_YAML.read_text())
    pools = set()
    for d in config["deployments"]:
        flow = load_flow_from_entrypoint(str(REPO_ROOT / d["entrypoint"]))
        params = dict(d.get("parameters") or {})
        if flow.name == "simulate":
            params["model_url"] = "s3://bucket/models/x.pt"  # required; given per run
        flow.validate_parameters(params)  # raises on an unknown or ill-typed field
        pools.add((flow.name, d["work_pool"]["name"]))
    assert pools == {
        ("research", "quantloop-cpu"),
        ("features", "quantloop-cpu"),
        ("train", "quantloop-gpu"),
        ("simulate", "quantloop-cpu"),
    }


def tail(path: Path, lines: int = 60) -> str:
    if not path.exists():
        return f"({path} missing)"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


@pytest.fixture(scope="module")
def prefect_server(tmp_path_factory) -> tuple[str, Path]:
    """A real `prefect server` for this module: (API URL, its folder)."""
    folder = tmp_path_factory.mktemp("prefect")
    with servers.prefect_server(folder) as api:
        yield api, folder


@pytest.mark.slow
@pytest.mark.server
def test_research_deployment_runs_on_a_process_worker(prefect_server, tmp_path, mlflow_uri):
    api, _ = prefect_server
    home, worker_dir = tmp_path / "workspace", tmp_path / "worker"
    # Restored on exit, so later tests see the session's settings again.
    with temporary_settings({PREFECT_API_URL: api}):
        deployment_id = deploy(POOL, name="test", tags=["quantloop", "test"])
        with get_client(sync_client=True) as client:
            deployment = client.read_deployment(deployment_id)
        assert deployment.pull_steps == [
            {"prefect.deployments.steps.set_working_directory": {"directory": str(REPO_ROOT)}}
        ]
        with servers.prefect_worker(api, POOL, worker_dir):
            flow_run = run_deployment(
                "research/test", parameters=tiny_params(home, mlflow_uri), timeout=240
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


def prefect_cli(api: str, home: Path, *args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "prefect", "--no-prompt", *args],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
        env=servers.prefect_env(home, PREFECT_API_URL=api),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.slow
@pytest.mark.server
def test_operator_setup_from_infra_readme(prefect_server, mlflow_uri):
    """infra/README.md's steps: register the blocks, save them, deploy prefect.yaml."""
    api, folder = prefect_server
    with temporary_settings({PREFECT_API_URL: api}):
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
                flow: client.read_deployment_by_name(f"{flow}/default")
                for flow in ("research", "features", "train", "simulate")
            }

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
