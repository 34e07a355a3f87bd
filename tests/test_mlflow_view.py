"""The run links quantloop writes open MLflow's model-training view, in a real browser.

MLflow 3.17's UI has two views of an experiment: GenAI (traces, sessions, judges,
evaluation runs, an overview whose "Detect Issues" popover covers the page) and model
training (runs, models, the run's metrics and parameters). It picks one from the page
address's `workflowType` query parameter, else from the browser's own last choice
(localStorage), and a browser that never chose gets GenAI; the experiment's
`mlflow.experimentKind` tag is not read (the UI's workflow-navigation flag is always on).
So a link must carry `workflowType=machine_learning`.
"""

from __future__ import annotations

import pytest

from quantloop.blocks.tracking import MlflowTracking
from quantloop.tasks.records import tracking
from tests.servers import mlflow_server
from tests.test_ui import CHROMIUM_ARGS, GENAI_ONLY, chromium


@pytest.mark.slow
@pytest.mark.server
def test_a_run_link_opens_the_runs_model_training_view(tmp_path):
    from playwright.sync_api import expect, sync_playwright

    browser_path = chromium()
    with mlflow_server(tmp_path) as uri:
        block = MlflowTracking(tracking_uri=uri, experiment="quantloop")
        client, experiment = tracking.client_for(block)
        run = client.create_run(experiment, run_name="research")
        client.log_param(run.info.run_id, "train.steps", "10")
        client.log_metric(run.info.run_id, "markout_bps.300s", 1.5)
        client.set_terminated(run.info.run_id)
        # the link the research summary (flows/research.py mlflow_link), retrain and
        # backtest write
        url = block.run_url(experiment, run.info.run_id)
        assert url is not None and "workflowType=machine_learning" in url

        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=browser_path, args=CHROMIUM_ARGS)
            # a fresh browser: no view chosen before, so MLflow would default to GenAI
            page = browser.new_context(viewport={"width": 1400, "height": 1000}).new_page()
            page.set_default_timeout(60_000)
            page.goto(url)
            # the run's parameters and metrics, on its overview
            page.get_by_text("train.steps", exact=True).wait_for()  # the page has loaded
            expect(page.get_by_text("markout_bps.300s", exact=True)).to_be_visible()
            assert "workflowType=genai" not in page.url, page.url
            # the breadcrumb names the experiment's runs, not its evaluations
            expect(page.get_by_role("link", name="Runs", exact=True).first).to_be_visible()
            text = page.inner_text("body")
            shown = [s for s in GENAI_ONLY if s in text]
            assert shown == [], (shown, page.url)
            # nothing covers the page: a click reaches the run's tabs (Playwright waits for
            # the tab to receive pointer events, and fails if a popover takes them)
            page.get_by_role("tab", name="Model metrics").click(timeout=15_000)
            page.wait_for_url("**/model-metrics**")
            expect(page.get_by_role("dialog")).to_have_count(0)
            browser.close()


def test_serve_prints_the_experiment_in_the_model_training_view(tmp_path):
    """The MLflow address serve prints opens the served experiment's runs in the
    model-training view, and before the experiment is known, a page with the view's
    parameter still: the bare server address opened GenAI's view in a fresh browser."""
    from quantloop.serve import Stack, StackConfig

    cfg = StackConfig(home=tmp_path, mlflow_port=5311)
    urls = Stack(cfg, [], {}, {}, experiment_id="7").urls()
    assert urls["MLflow UI"] == (
        "http://127.0.0.1:5311/#/experiments/7/runs?workflowType=machine_learning"
    )
    assert "workflowType=machine_learning" in Stack(cfg, [], {}, {}).urls()["MLflow UI"]
    block = MlflowTracking(tracking_uri="http://mlflow.example:5000/")
    assert block.experiment_url("3") == (
        "http://mlflow.example:5000/#/experiments/3/runs?workflowType=machine_learning"
    )
    assert MlflowTracking(tracking_uri="sqlite:///x.db").experiment_url("3") is None
