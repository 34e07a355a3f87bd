"""The ladder's report: the rung table and the controls table, as markdown."""

from __future__ import annotations

import math


def _fmt(v, spec: str) -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and math.isnan(v):
        return "nan"
    return format(v, spec)


TABLE_COLUMNS = (
    ("rung", None), ("samples/s", ",.0f"), ("step ms", ".2f"), ("speedup", ".2f"),
    ("launches/step", ".1f"), ("syncs/step", ".2f"), ("GPU util", ".0%"), ("peak GB", ".2f"),
    ("TFLOP/s", ".1f"), ("roofline", ".1%"), ("step-0 dev", ".1e"), ("loss dev", ".1e"),
    ("pred L2", ".1e"), ("mark-out Δ bp", ".3f"), ("held-out loss", ".3f"), ("equivalent", None),
)  # fmt: skip
_KEYS = (None, "samples_per_s", "step_ms", "speedup_vs_baseline", "kernels_per_step",
         "syncs_per_step", "gpu_util", "peak_mem_gb", "achieved_tflops", "roofline_fraction",
         "step0_rel", "loss_max_rel_dev", "pred_rel_l2", "markout_delta_bps", "heldout_loss",
         None)  # fmt: skip


def controls_markdown(result: dict) -> str:
    """The controls: how far rounding alone and another seed move the baseline's answer."""
    lines = [
        "| control | loss dev | pred L2 | mark-out Δ bp | held-out loss | fp32 check "
        "| bf16 check |",
        "|---|---:|---:|---:|---:|---|---|",
    ]
    for name, c in (result.get("controls") or {}).items():
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


def table_markdown(result: dict) -> str:
    head = "| " + " | ".join(name for name, _ in TABLE_COLUMNS) + " |"
    rule = "|---|" + "---:|" * (len(TABLE_COLUMNS) - 2) + "---|"
    lines = [head, rule]
    for row in result["rungs"]:
        label = f"{row['number']}. {row['name']}"
        if row.get("skipped"):
            lines.append(f"| {label} | {row['skipped']} |" + " |" * (len(TABLE_COLUMNS) - 2))
            continue
        cells = [
            _fmt(row.get(key), spec)
            for (_, spec), key in zip(TABLE_COLUMNS[1:-1], _KEYS[1:-1], strict=True)
        ]
        eq = "yes" if row["equivalent"] else "**NO**: " + "; ".join(row["failures"])
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {eq} |")
    return "\n".join(lines)
