"""What a research run's MLflow records say about it: the stages' child runs span the
stages' own work, and a tag name means one thing wherever it is found (issue 21)."""

from __future__ import annotations

import uuid

import pytest
from mlflow.tracking import MlflowClient
from prefect.client.orchestration import get_client

from quantloop.flows.research import ResearchParams, research
from quantloop.tasks.records import runs
from quantloop.tasks.runtime import timeline

TINY = {
    "data": {"products": ["SYNA"], "n_dates": 3,
             "synthetic": {"events_per_day": 2_000, "levels": 2}},
    "train": {"steps": 40, "batch_size": 32, "optimizations": "none"},
}  # fmt: skip
STAGES = ("features", "train", "simulate")


@pytest.fixture(scope="module")
def recorded(prefect_api, mlflow_uri, tmp_path_factory):
    """One research run on the session's MLflow server, and the timeline spans of its
    stages (what `<log>.profile.json` and `quantloop run --profile` show)."""
    name = f"records-{uuid.uuid4().hex[:8]}"
    home = tmp_path_factory.mktemp("records") / "home"
    before = len(timeline.TIMELINE.spans)
    summary = research(ResearchParams.model_validate({**TINY, "workspace": {
        "home": str(home), "tracking": {"tracking_uri": mlflow_uri, "experiment": name,
                                        "registered_model": name}}}))  # fmt: skip
    spans = {s.name: s for s in timeline.TIMELINE.spans[before:] if s.name in STAGES}
    return summary, spans, MlflowClient(mlflow_uri)


@pytest.mark.slow
@pytest.mark.server
def test_stage_child_runs_span_the_stages_work(recorded):
    summary, spans, client = recorded
    stages = runs.stage_runs(client, client.get_run(summary.mlflow_run_id))
    origin = timeline.TIMELINE.origin
    for name in STAGES:
        info, span = stages[name].info, spans[name]
        start, end = info.start_time / 1e3, info.end_time / 1e3
        stage_start, stage_end = origin + span.start_s, origin + span.start_s + span.seconds
        if name == "train":
            # its model is registered in the background while the simulation runs
            # (flows/train.records_in_background): the run ends with the registration
            # (torch.export and the uploads, seconds), after the stage has returned
            assert end > stage_end, ("train registered before its stage ended", end, stage_end)
            sim = spans["simulate"]
            stage_end = max(stage_end, origin + sim.start_s + sim.seconds)
        # Inside the stage (its Prefect subflow starts a little after the phase opens) ...
        assert stage_start - 0.5 <= start and end <= stage_end + 0.5, (name, start, end)
        # ... and nearly all of its Prefect subflow run, the stage's work: before, a child
        # run lasted as long as its recording (1.1 s of a 31 s features stage). Measured
        # against the subflow, not the phase: Prefect's start of a subflow (its API calls)
        # took 2.3 s of a 3.6 s simulate phase on a loaded 2-core CI machine, with the train
        # stage's registration running beside it, against 0.15 s here.
        with get_client(sync_client=True) as prefect:
            flow_run = prefect.read_flow_run(stages[name].data.tags["prefect_flow_run_id"])
        work = (flow_run.end_time - flow_run.start_time).total_seconds()
        assert start <= flow_run.start_time.timestamp() + 0.5, (name, start, flow_run)
        assert end - start >= 0.8 * work - 0.5, (name, end - start, work)


@pytest.mark.slow
@pytest.mark.server
def test_a_tag_name_means_the_same_on_the_run_and_its_model_version(recorded):
    summary, _, client = recorded
    research_tags = client.get_run(summary.mlflow_run_id).data.tags
    version = client.get_model_version(summary.registered_model, summary.model_version)
    train_tags = client.get_run(version.run_id).data.tags
    # params_hash is the research form's digest wherever it is; the model's own
    # (features, training, validation) is named model_params_hash.
    for tags in (version.tags, train_tags):
        assert tags.get("params_hash", research_tags["params_hash"]) == research_tags[
            "params_hash"]  # fmt: skip
        assert len(tags["model_params_hash"]) == 64
    assert version.tags["model_params_hash"] == train_tags["model_params_hash"]
    for tag in ("data_digest", "code_digest"):  # the same name, the same value
        assert version.tags[tag] == research_tags[tag], tag
