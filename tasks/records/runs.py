"""Find a research run and its records in MLflow from one id: the MLflow run id or
the Prefect flow run id, whichever the auditor has."""

from __future__ import annotations

import json
import re
import tempfile
from collections.abc import Sequence
from typing import TYPE_CHECKING

from quantloop.tasks.records.tracking import CATALOG_TAG, PARENT_TAG, STORE_TAG

if TYPE_CHECKING:  # imported where used: this module imports no MLflow, Arrow or store
    import pyarrow as pa
    from mlflow.entities import Run
    from mlflow.tracking import MlflowClient

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
            # a locked server's basic-auth app answers a run that is not there with 403
            why = ("not there, or not readable by this identity (MLflow answers 403 to both)"
                   if "403 != 200" in str(exc) else str(exc))  # fmt: skip
            raise LookupError(f"no MLflow run {ref} at {client.tracking_uri}: {why}") from exc
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


def model_lineage(client: MlflowClient, run: Run) -> dict:
    """The lineage record (flows/train.py record_lineage) of the model a research (or
    retrain) run registered, from the run's store; LookupError naming what is missing."""
    from quantloop.tasks.engine import storage
    from quantloop.tasks.research import sited

    name, number = run.data.tags.get("registered_model"), run.data.tags.get("model_version")
    if not name or not number:
        raise LookupError(f"run {run.info.run_id} registered no model version")
    try:
        key = client.get_model_version(name, number).tags.get("model_key", "")
    except Exception as exc:  # MLflow's RESOURCE_DOES_NOT_EXIST: the version was deleted
        raise LookupError(f"{name} version {number} is not at {client.tracking_uri}") from exc
    root = run.data.tags.get(STORE_TAG, "")
    url = storage.join(root, "lineage", "models", f"{key}.json")
    try:
        # beside the model, at the site that trained it (the run's catalog says where)
        catalog = sited.catalog_at(run.data.tags.get(CATALOG_TAG, ""))
        if catalog is not None:
            return sited.read_lineage(catalog, key, [root])
        return json.loads(storage.read_bytes(url))
    except (OSError, ValueError, LookupError) as exc:
        raise LookupError(f"{name} version {number}: its lineage record is not "
                          f"readable: {exc}") from exc  # fmt: skip


def count_trials(client: MlflowClient, experiment_id: str, data_digest: str, window: str) -> int:
    """How many models were tried on one test window: the finished research (and retrain)
    runs of the experiment on the data pin `data_digest` (their `data_digest` tag) whose
    registered model held out `window` (tasks/research/window.held_out_id of the fold its lineage
    record names: the test dates and the intraday cut, which with the pin are the
    held-out data). Runs with the same parameters (tag `params_hash`) made the same model
    and count once: a run whose configurations are counted already is not read again
    (its lineage is two calls and a file), nor is a re-run tagged REPEAT_TAG at all. Deleted
    runs count, as in trials_on. At least 1: the candidate is a trial."""
    from mlflow.entities import ViewType

    from quantloop.tasks.research.window import held_out_id, lineage_fold

    where = (f"tags.data_digest = '{data_digest}' and attributes.status = 'FINISHED' "
             f"and tags.`{REPEAT_TAG}` IS NULL")  # fmt: skip
    seen: set[str] = set()
    token = None
    while True:
        page = client.search_runs([experiment_id], filter_string=where, max_results=1000,
                                  page_token=token, run_view_type=ViewType.ALL)  # fmt: skip
        for run in page:
            if run.data.tags.get("quantloop.stage") not in RESEARCH_STAGES:
                continue
            if trial_ids(run) <= seen:
                continue
            try:
                held = held_out_id(lineage_fold(model_lineage(client, run)))
            except (LookupError, KeyError, ValueError):  # no model, or no record of it
                continue
            if held == window:
                seen |= trial_ids(run)
        token = page.token
        if not token:
            break
    return max(len(seen), 1)


TEST_WINDOWS_TAG = "test_windows"  # the research run's validation, hashed (flows/research.py)
# A sweep's configurations: each setting's digest as a run of it alone would have it
# (flows/params.ResearchParams.trial_ids), TRIAL_ID_CHARS characters each, comma-joined.
TRIALS_TAG = "quantloop.trials"
TRIAL_ID_CHARS = 16


def trial_ids(run: Run) -> set[str]:
    """The configurations a research run evaluated: a sweep's settings (TRIALS_TAG), else
    its parameters' digest (tag `params_hash`), else the run itself."""
    tags = run.data.tags
    if tags.get(TRIALS_TAG):
        return set(tags[TRIALS_TAG].split(","))
    return {(tags.get("params_hash") or run.info.run_id)[:TRIAL_ID_CHARS]}


def trials_tag(ids: Sequence[str]) -> str:
    """TRIALS_TAG's value for these configurations' digests."""
    return ",".join(i[:TRIAL_ID_CHARS] for i in ids)


# A research run whose configuration (params_hash) had already finished on the same data pin
# and test windows when it started: the value is that earlier run's id (trials_on finds
# it). Its trials are that run's, so trials_on does not read it: without the tag every
# re-run was read again by every later run (0.14-0.31 s for 40 re-runs of one
# configuration on the 2-core VM, growing with the workspace's history).
REPEAT_TAG = "quantloop.trial_repeat"


def research_trials(
    client: MlflowClient, experiment_id: str, data_digest: str, test_windows: str,
    own: str | Sequence[str],
) -> int:  # fmt: skip
    """How many configurations a research run's result was chosen among (trials_on's count)."""
    return trials_on(client, experiment_id, data_digest, test_windows, own)[0]


def trials_on(
    client: MlflowClient, experiment_id: str, data_digest: str, test_windows: str,
    own: str | Sequence[str], params_hash: str | None = None,
) -> tuple[int, str | None]:  # fmt: skip
    """How many configurations a research run's result was chosen among: the finished
    research runs of the experiment on the same data pin and test windows (its validation:
    tag TEST_WINDOWS_TAG) with other parameters (one per `params_hash`, or per setting of
    a sweep: a re-run is not another trial), and this run's own (`own`: its configurations'
    digests, ResearchParams.trial_ids: one, or a sweep's settings); and the id of a run
    among them with `params_hash`, the run's own parameters (its REPEAT_TAG), or None.

    Deleted runs count: a configuration deleted from view was still tried on these data.
    Runs tagged REPEAT_TAG are not read (their configuration's first run is), nor are runs
    from before the test-windows tag."""
    from mlflow.entities import ViewType

    where = (f"tags.`quantloop.stage` = 'research' and tags.data_digest = '{data_digest}' "
             f"and tags.{TEST_WINDOWS_TAG} = '{test_windows}' "
             f"and attributes.status = 'FINISHED' and tags.`{REPEAT_TAG}` IS NULL")  # fmt: skip
    seen = {i[:TRIAL_ID_CHARS] for i in ([own] if isinstance(own, str) else own)}
    repeat_of = None
    token = None
    while True:
        page = client.search_runs([experiment_id], filter_string=where, max_results=1000,
                                  page_token=token, run_view_type=ViewType.ALL)  # fmt: skip
        for r in page:
            if r.data.tags.get("params_hash") or r.data.tags.get(TRIALS_TAG):
                seen |= trial_ids(r)
            if params_hash and repeat_of is None and r.data.tags.get("params_hash") == params_hash:
                repeat_of = r.info.run_id
        token = page.token
        if not token:
            return len(seen), repeat_of


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
    from quantloop.tasks.engine import storage

    paths = artifact_files(client, features_run_id, "manifest", ".parquet")
    if not paths:
        raise LookupError(f"features run {features_run_id} has no node manifest attached")
    return [storage.decode_table(read_artifact(client, features_run_id, p)) for p in paths]
