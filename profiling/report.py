"""The ladder's report, as markdown: a header (device, torch, commit, measured ceilings),
the rung table and the controls table. The `ladder` flow, bench/ladder.py and
`quantloop ladder` all write this one report from a result (run_ladder's dict, or its JSON).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from quantloop.profiling.results import RungResult

# (header, RungResult field, format spec) of the rung table's figure columns; the rung's
# label comes first and the verdict last.
COLUMNS = (
    ("samples/s", "samples_per_s", ",.0f"),
    ("step ms", "step_ms", ".2f"),
    ("speedup", "speedup_vs_baseline", ".2f"),
    ("launches/step", "kernels_per_step", ".1f"),
    ("syncs/step", "syncs_per_step", ".2f"),
    ("GPU util", "gpu_util", ".0%"),
    ("peak GB", "peak_mem_gb", ".2f"),
    ("TFLOP/s", "achieved_tflops", ".1f"),
    ("roofline", "roofline_fraction", ".1%"),
    ("step-0 dev", "step0_rel", ".1e"),
    ("loss dev", "loss_max_rel_dev", ".1e"),
    ("pred L2", "pred_rel_l2", ".1e"),
    ("mark-out Δ bp", "markout_delta_bps", ".3f"),
    ("held-out loss", "heldout_loss", ".3f"),
)


def _fmt(v: float | None, spec: str) -> str:
    if v is None:
        return "-"  # not measurable on this machine (no CUDA trace, no NVML, no ceilings)
    if isinstance(v, float) and math.isnan(v):
        return "nan"
    return format(v, spec)


def table_markdown(rows: Sequence[RungResult]) -> str:
    """One line per rung: throughput, launches, syncs, utilisation, memory, roofline and
    the equivalence figures; a skipped rung says why."""
    headers = ["rung", *(header for header, _, _ in COLUMNS), "equivalent"]
    lines = ["| " + " | ".join(headers) + " |", "|---|" + "---:|" * len(COLUMNS) + "---|"]
    for row in rows:
        label = f"{row.number}. {row.name}"
        if row.skipped:
            lines.append(f"| {label} | {row.skipped} |" + " |" * len(COLUMNS))
            continue
        cells = [_fmt(getattr(row, field), spec) for _, field, spec in COLUMNS]
        eq = "yes" if row.equivalent else "**NO**: " + "; ".join(row.failures or ())
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {eq} |")
    return "\n".join(lines)


def controls_markdown(controls: Mapping[str, dict]) -> str:
    """The controls: how far rounding alone and another seed move the baseline's answer,
    and what the stated checks say about each."""
    lines = [
        "| control | loss dev | pred L2 | mark-out Δ bp | held-out loss | fp32 check "
        "| bf16 check |",
        "|---|---:|---:|---:|---:|---|---|",
    ]
    for name, c in controls.items():
        verdict = [
            "fails: " + "; ".join(c[k]) if c.get(k) else "passes"
            for k in ("fails_fp32", "fails_bf16")
        ]
        lines.append(
            f"| {name} | {c['loss_max_rel_dev']:.1e} | {c['pred_rel_l2']:.1e} | "
            f"{c['markout_delta_bps']:.3f} | {c['heldout_loss']:.3f} | {verdict[0]} | "
            f"{verdict[1]} |"
        )
    return "\n".join(lines)


def report_markdown(result: Mapping) -> str:
    """The whole report of one ladder result (run_ladder's dict, or its JSON loaded)."""
    versions = f"torch {result['torch']}"
    if result.get("triton"):
        versions += f", Triton {result['triton']}"
    sections = [
        f"# GPU optimization ladder on {result['gpu']}",
        f"{versions}, batch {result['batch_size']}, commit `{result.get('commit') or 'unknown'}`, "
        f"{result['date']}.",
    ]
    if result.get("ceilings"):
        c = result["ceilings"]
        sections.append(
            f"Measured ceilings: bf16 matmul {c['bf16_matmul_tflops']:.0f} TFLOP/s, "
            f"device copy {c['copy_gbps']:.0f} GB/s."
        )
    sections.append(table_markdown([RungResult.from_dict(r) for r in result["rungs"]]))
    if result.get("controls"):
        sections += [
            "Controls (the baseline re-trained; deviation from the baseline):",
            controls_markdown(result["controls"]),
        ]
    return "\n\n".join(sections) + "\n"
