"""The `ladder` flow: run the GPU optimization ladder, record each rung in MLflow, report.

One parent MLflow run "ladder" with the device, config and ceilings; one child run per
rung with its metrics (throughput, launches, syncs, utilisation, memory, FLOPs, roofline,
equivalence figures), its loss curve, its profiler trace and equivalence figures as
artifacts; the parent holds the throughput-per-rung plot and the markdown report. On a
machine without CUDA the CUDA-only rungs are recorded as skipped, with the reason.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Literal

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from pydantic import BaseModel, ConfigDict, Field

from quantloop.profiling.config import preset
from quantloop.profiling.ladder import run_ladder
from quantloop.profiling.report import report_markdown
from quantloop.profiling.results import RungResult
from quantloop.profiling.rungs import RUNGS
from quantloop.tasks.records import plots, tracking
from quantloop.tasks.records.provenance import git_commit
from quantloop.tasks.runtime.workspace import Workspace

REPORT_NAME = "ladder.md"


class LadderParams(BaseModel):
    """What a ladder run depends on. Unknown fields are errors, not ignored."""

    model_config = ConfigDict(extra="forbid")

    workspace: Workspace = Field(default_factory=Workspace)
    preset: Literal["auto", "h200", "cpu_tiny"] = Field(
        default="auto", description="Config preset; auto = h200 with CUDA, else cpu_tiny."
    )
    rungs: list[int] = Field(
        default_factory=list, description="Rung numbers to run (1 always runs); empty: all."
    )
    out_dir: str | None = Field(
        default=None, description="Folder for traces and the report; empty: <home>/ladder."
    )


@flow(name="ladder")
def ladder(params: LadderParams = LadderParams()) -> dict:
    """Run the rungs cumulatively; returns the results (also in MLflow and as a report)."""
    logger = get_run_logger()
    cfg = preset(params.preset)
    out = params.out_dir or os.path.join(params.workspace.home_abs, "ladder")
    result = run_ladder(cfg, out, rungs=tuple(params.rungs) or None, log=logger.info)
    result["commit"] = git_commit()
    report = report_markdown(result)
    with open(os.path.join(out, REPORT_NAME), "w") as f:
        f.write(report)
    with open(os.path.join(out, "ladder.json"), "w") as f:
        json.dump(result, f, indent=2, default=str)

    client, experiment = tracking.client_for(params.workspace.resolve_tracking())
    rows = [RungResult.from_dict(r) for r in result["rungs"]]
    base_curve = rows[0].loss_curve
    with tracking.run(client, experiment, "ladder", tags={"gpu": result["gpu"]}) as parent:
        parent.params({f"ladder.{k}": v for k, v in result["config"].items()})
        parent.params({"gpu": result["gpu"], "torch": result["torch"], "preset": params.preset})
        parent.metrics({f"ceiling.{k}": v for k, v in result["ceilings"].items()})
        parent.flush()
        for row, record in zip(rows, result["rungs"], strict=True):
            with tracking.run(
                client, experiment, f"rung{row.number}-{row.name}", parent=parent.run_id
            ) as child:
                child.params({"rung": row.number, "name": row.name, "predicted": row.predicted})
                if row.skipped:
                    child.tags({"skipped": row.skipped})
                    continue
                child.params({f"switch.{k}": v for k, v in row.switches.items()})
                child.params({f"tolerance.{k}": v for k, v in record["tolerance"].items()})
                child.tags({"equivalent": row.equivalent, "failures": "; ".join(row.failures)})
                child.metrics({
                    k: float(v) for k, v in record.items()
                    if isinstance(v, int | float) and not isinstance(v, bool) and k != "number"
                })  # fmt: skip
                child.metrics({"equivalent": float(row.equivalent)})
                steps = [(i + 1) * cfg.log_every for i in range(len(row.loss_curve))]
                child.series("loss", row.loss_curve, steps)
                child.flush()
                equivalence = plots.loss_vs_baseline(
                    base_curve, row.loss_curve, cfg.log_every, label=row.name,
                    title=f"rung {row.number}: loss dev {row.loss_max_rel_dev:.2e}",
                )  # fmt: skip
                child.figure(equivalence, "equivalence.png")
                with tempfile.TemporaryDirectory() as tmp:
                    path = os.path.join(tmp, "equivalence.json")
                    with open(path, "w") as f:
                        json.dump({k: record[k] for k in ("step0_rel", "loss_max_rel_dev",
                                   "pred_rel_l2", "markout_delta_bps", "tolerance",
                                   "equivalent", "failures")}, f, indent=2)  # fmt: skip
                    child.artifact(path)
                if row.trace:
                    child.artifact(os.path.join(out, row.trace), "trace")
        ran = [r for r in rows if not r.skipped]
        throughput = plots.throughput_bars(
            [f"{r.number}. {r.name}" for r in ran],
            [r.samples_per_s for r in ran],
            [bool(r.equivalent) for r in ran],
            title=f"ladder on {result['gpu']} (red: not equivalent)",
        )
        parent.figure(throughput, "throughput.png")
        parent.artifact(os.path.join(out, REPORT_NAME))
        result["mlflow_run_id"] = parent.run_id
    create_markdown_artifact(
        markdown=report, key="ladder-report", description="Throughput and equivalence per rung"
    )
    logger.info(
        "ladder done: %d of %d rungs ran, top %.0f samples/s (%.2fx); all equivalent: %s",
        len(ran), len(RUNGS), ran[-1].samples_per_s, ran[-1].speedup_vs_baseline,
        all(r.equivalent for r in ran),
    )  # fmt: skip
    return result
