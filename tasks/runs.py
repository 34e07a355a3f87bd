"""Find a research run and its records in MLflow from one id: the MLflow run id or
the Prefect flow run id, whichever the auditor has."""

from __future__ import annotations

import re
import tempfile

import pyarrow as pa
from mlflow.entities import Run
from mlflow.tracking import MlflowClient

from quantloop.tasks import storage
from quantloop.tasks.tracking import PARENT_TAG

_MLFLOW_ID = re.compile(r"^[0-9a-f]{32}$")
# Runs with stage runs (features, train, simulate) under them: a research run, and a
# retrain run (flows/retrain.py), which is shaped like one.
RESEARCH_STAGES = ("research", "retrain")


def find_research_run(client: MlflowClient, ref: str) -> Run:
    """The research run an id names; LookupError (naming the id and the tracking URI)
    if there is none: never an empty answer."""
    ref = ref.strip()
    if _MLFLOW_ID.match(ref):
        try:
            run = client.get_run(ref)
        except Exception as exc:  # MLflow's RESOURCE_DOES_NOT_EXIST
            raise LookupError(f"no MLflow run {ref} at {client.tracking_uri}: {exc}") from exc
        if run.data.tags.get("quantloop.stage") not in RESEARCH_STAGES:
            parent = run.data.tags.get(PARENT_TAG)
            if parent:  # a stage's run: its research run is meant
                return find_research_run(client, parent)
            raise LookupError(f"MLflow run {ref} is not a quantloop research run")
        return run
    experiments = [e.experiment_id for e in client.search_experiments()]
    found = []
    for stage in RESEARCH_STAGES if experiments else ():
        where = f"tags.prefect_flow_run_id = '{ref}' and tags.`quantloop.stage` = '{stage}'"
        found += client.search_runs(experiments, filter_string=where, max_results=2)
    if not found:
        raise LookupError(
            f"no research run with MLflow run id or Prefect flow run id {ref!r} at "
            f"{client.tracking_uri}"
        )
    return found[0]


def stage_runs(client: MlflowClient, research: Run) -> dict[str, Run]:
    """The research run's stage runs (features, train, simulate) by stage."""
    found = client.search_runs(
        [research.info.experiment_id],
        filter_string=f"tags.`{PARENT_TAG}` = '{research.info.run_id}'",
    )
    return {r.data.tags.get("quantloop.stage", r.info.run_name): r for r in found}


def artifact_files(client: MlflowClient, run_id: str, folder: str, suffix: str) -> list[str]:
    """Paths of a run's artifacts under `folder` (recursively) that end with `suffix`."""
    out, todo = [], [folder]
    while todo:
        for f in client.list_artifacts(run_id, todo.pop()):
            if f.is_dir:
                todo.append(f.path)
            elif f.path.endswith(suffix):
                out.append(f.path)
    return sorted(out)


def read_artifact(client: MlflowClient, run_id: str, path: str) -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        local = client.download_artifacts(run_id, path, tmp)
        with open(local, "rb") as f:
            return f.read()


def manifest_tables(client: MlflowClient, features_run_id: str) -> list[pa.Table]:
    """The node records a features run attached (its manifest, in one or more parts)."""
    paths = artifact_files(client, features_run_id, "manifest", ".parquet")
    if not paths:
        raise LookupError(f"features run {features_run_id} has no node manifest attached")
    return [storage.decode_table(read_artifact(client, features_run_id, p)) for p in paths]
