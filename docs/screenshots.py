"""The README's screenshots, taken in headless Chromium against a running `quantloop serve`.

    .venv/bin/quantloop serve --home /tmp/shots &          # wait for "ready in"
    .venv/bin/python docs/screenshots.py http://127.0.0.1:4200 [--no-run]

It opens the research deployment's run form (docs/ui-form.png: the workspace and data;
docs/ui-form-training.png: training and simulation), submits it as it is
(the deployment's defaults; --no-run: it submits nothing and shows the last run),
waits for the run to finish on the worker, and shows the finished run with its logs
(docs/ui-run.png) and its summary artifact (docs/ui-summary.png).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from playwright.sync_api import sync_playwright

DOCS = Path(__file__).resolve().parent
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run",
]  # fmt: skip


def wait_for_newest_research_run(api: str, timeout: float = 900) -> str:
    """The newest run of research/desk, once it is completed."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId
    from prefect.client.schemas.sorting import FlowRunSort
    from prefect.settings import PREFECT_API_URL, temporary_settings

    deadline = time.monotonic() + timeout
    with temporary_settings({PREFECT_API_URL: api}), get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name("research/desk")
        while True:
            [run] = client.read_flow_runs(
                deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment.id])),
                sort=FlowRunSort.EXPECTED_START_TIME_DESC,
                limit=1,
            )
            if run.state.is_final():
                if not run.state.is_completed():
                    raise SystemExit(f"the run ended {run.state_name}")
                return str(run.id)
            if time.monotonic() > deadline:
                raise SystemExit(f"the run is still {run.state_name}")
            time.sleep(2)


def main(prefect: str) -> None:
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 1500})
        page.set_default_timeout(60_000)
        page.goto(prefect + "/")
        page.get_by_role("link", name="Deployments").click()
        page.get_by_role("row").filter(has_text="research").get_by_role("link", name="desk").click()
        page.get_by_role("button", name="Run").first.click()
        page.get_by_role("menuitem", name="Custom run").click()
        page.get_by_text("Training (Optional)", exact=True).wait_for()
        page.get_by_text("Home folder (Optional)", exact=True).scroll_into_view_if_needed()
        page.screenshot(path=DOCS / "ui-form.png")
        page.get_by_text("Training (Optional)", exact=True).scroll_into_view_if_needed()
        page.mouse.wheel(0, 300)
        page.wait_for_timeout(500)
        page.screenshot(path=DOCS / "ui-form-training.png")
        if "--no-run" not in sys.argv:
            page.get_by_role("button", name="Submit").click()
            page.wait_for_timeout(3000)
        run_id = wait_for_newest_research_run(prefect + "/api")
        page.goto(f"{prefect}/v2/runs/flow-run/{run_id}")
        page.get_by_text("Completed").first.wait_for()
        page.get_by_role("tab", name="Logs").click()
        page.wait_for_timeout(3000)
        page.screenshot(path=DOCS / "ui-run.png")
        page.get_by_role("tab", name="Artifacts").click()
        page.get_by_role("link", name="research-summary").first.click()
        page.get_by_role("heading", name="Per product").wait_for()
        page.screenshot(path=DOCS / "ui-summary.png", full_page=True)
        browser.close()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:4200")
