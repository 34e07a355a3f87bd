"""The optimization ladder on a CPU: its logic, its equivalence checks, its report, its
flow and the device script.

CUDA-only rungs (the Triton kernel, streams, CUDA graphs) are skipped here with their
reason; their torch reference paths are tested directly. The H200 figures come from
bench/ladder.py on the device (bench/results/ladder-h200.json).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import mlflow
import numpy as np
import pytest
import torch

from quantloop.models.orderbook import OrderBookNet
from quantloop.profiling import kernels, measure
from quantloop.profiling.config import BF16, LadderConfig, Tolerance, cpu_tiny, preset
from quantloop.profiling.equivalence import compare, markout_delta, rel_l2, step0_deviation
from quantloop.profiling.evaluation import check_rung, reference
from quantloop.profiling.kernels import CHUNK, FusedAdamW
from quantloop.profiling.loop import model_config, train_rung
from quantloop.profiling.packing import PackedNet
from quantloop.profiling.report import report_markdown
from quantloop.profiling.results import RungResult
from quantloop.profiling.rungs import RUNGS, Switches
from quantloop.profiling.streams import Layout
from quantloop.profiling.workload import (
    Windows,
    build_workload,
    next_move,
    pack_plan,
    pack_plans,
    packed_batch,
    padded_batch,
    rows_grid,
)
from quantloop.tasks.records.provenance import git_commit

ROOT = Path(__file__).resolve().parents[1]
H200_RESULT = ROOT / "bench" / "results" / "ladder-h200.json"


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return build_workload(cpu_tiny(), str(tmp_path_factory.mktemp("store")))


def test_config_names_the_bad_field():
    with pytest.raises(ValueError, match="batch_size"):
        LadderConfig(batch_size=0)
    with pytest.raises(ValueError, match="compile_backend"):
        LadderConfig(compile_backend="nope")
    with pytest.raises(ValueError, match="unknown preset"):
        preset("h100")
    with pytest.raises(ValueError, match="pred_rel_l2"):
        Tolerance(step0_rel=1, loss_rel=1, pred_rel_l2=0, markout_bps=1)


def test_windows_vary_in_length_and_packing_keeps_every_event(work):
    lengths = work.train.lengths
    assert lengths.min() >= 1 and lengths.max() <= work.max_len and len(set(lengths)) > 5
    row, off = pack_plan(lengths[work.order[0]], work.max_len)
    end = off + lengths[work.order[0]]
    assert end.max() <= work.max_len
    for r in set(row):  # windows in one row never overlap
        spans = sorted(zip(off[row == r], end[row == r], strict=True))
        assert all(a_end <= b for (_, a_end), (b, _) in zip(spans, spans[1:], strict=False))
    b = packed_batch(work, 0)
    B = len(work.order[0])
    assert (b["seg"] < B).sum() == lengths[work.order[0]].sum()  # every real event, once


def test_pack_plans_is_pack_plan_batch_by_batch(work):
    rng = np.random.default_rng(0)
    cases = [(work.train.lengths[work.order], work.max_len)]
    cases += [(rng.integers(1, T + 1, size=(S, B)), T) for S, B, T in ((5, 30, 16), (3, 1, 4))]
    cases.append((rng.integers(1, 3, size=(4, 40)), 8))  # many ties
    for lengths, T in cases:
        row, off = pack_plans(lengths, T)
        for s in range(len(lengths)):
            want_row, want_off = pack_plan(lengths[s], T)
            assert np.array_equal(row[s], want_row) and np.array_equal(off[s], want_off)


def test_packed_rows_on_the_grid_fit_and_pad_an_eighth_at_most():
    assert [rows_grid(r) for r in (1, 12, 16, 17, 64, 65, 73, 75, 78, 80, 81, 150)] == [
        1, 12, 16, 18, 64, 72, 80, 80, 80, 80, 88, 160]  # fmt: skip
    assert all(r <= rows_grid(r) <= r * 9 / 8 for r in range(1, 2000))


def test_next_move_label_is_the_direction_of_the_next_mid_change(work):
    got = next_move(np.array([1.0, 1.0, 2.0, 2.0, 1.5, 1.5]))
    assert np.array_equal(got[:4], [1, 1, -1, -1]) and np.isnan(got[4:]).all()
    assert work.label_names == ["next_move"]
    raw = work.normalizer.unscale_labels(work.labels)
    assert set(np.round(raw.ravel(), 6)) == {-1.0, 1.0}  # no NaN anchors were kept


def test_packed_forward_is_the_padded_forward(work):
    torch.manual_seed(0)
    model = OrderBookNet(model_config(cpu_tiny(), work)).double()
    a, b = padded_batch(work, 3), packed_batch(work, 3)
    want = model(torch.from_numpy(a["x"]).double(), torch.from_numpy(a["mask"]))
    got = PackedNet(model)(
        torch.from_numpy(b["x"]).double(),
        *(torch.from_numpy(b[k]) for k in ("pos", "seg", "last", "count")),
    )
    assert torch.allclose(got, want, rtol=1e-10, atol=1e-12)


def test_fused_adamw_reference_is_torch_adamw_and_foreach_norm():
    torch.manual_seed(1)
    net = torch.nn.Sequential(
        torch.nn.Linear(7, 33), torch.nn.LayerNorm(33), torch.nn.Linear(33, 2)
    )
    twin = torch.nn.Sequential(
        torch.nn.Linear(7, 33), torch.nn.LayerNorm(33), torch.nn.Linear(33, 2)
    )
    twin.load_state_dict(net.state_dict())
    fused = FusedAdamW(net, lr=1e-2, weight_decay=0.1, use_triton=False)
    ring = torch.full((2, fused.n_chunks), math.nan)
    fused.log_into(ring, torch.tensor([1]), 0)
    ref = torch.optim.AdamW(twin.parameters(), lr=1e-2, weight_decay=0.1)
    assert fused.n_chunks == sum(-(-p.numel() // CHUNK) for p in net.parameters())
    for _ in range(4):  # fresh random data each step
        x = torch.randn(16, 7)
        for model, opt in ((net, fused), (twin, ref)):
            opt.zero_grad()
            model(x).square().mean().backward()
        want = torch.stack(torch._foreach_norm([p.grad for p in twin.parameters()]))
        fused.step()
        ref.step()
        starts = np.flatnonzero(np.diff(fused.chunk_owner, prepend=-1))
        got = np.sqrt(np.add.reduceat(ring[1].numpy(), starts))
        assert np.allclose(got, want.numpy(), rtol=1e-5)
    for p, q in zip(net.parameters(), twin.parameters(), strict=True):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-7)
        assert p.data_ptr() != q.data_ptr()


def test_equivalence_reports_failures_not_hides_them():
    tol = Tolerance(step0_rel=1e-4, loss_rel=1e-3, pred_rel_l2=1e-2, markout_bps=0.1)
    base = dict(base_loss_curve=np.array([1.0, 0.9]), base_pred=np.ones((4, 3)),
                base_markout_bps={"1s": -0.5, "5s": math.nan}, tolerance=tol)  # fmt: skip
    ok = compare(loss_curve=np.array([1.0, 0.9001]), pred=np.ones((4, 3)) * 1.001,
                 markout_bps={"1s": -0.45, "5s": math.nan}, **base)  # fmt: skip
    assert ok.equivalent and ok.failures == ()
    bad = compare(step0=1e-3, loss_curve=np.array([1.0, 0.95]), pred=np.ones((4, 3)) * 1.1,
                  markout_bps={"1s": -0.2, "5s": 0.3}, **base)  # fmt: skip
    assert not bad.equivalent
    assert [f.split()[0] for f in bad.failures] == [
        "step0_rel", "loss_max_rel_dev", "pred_rel_l2", "markout_delta_bps",
    ]  # fmt: skip
    assert rel_l2(np.array([np.nan]), np.array([1.0])) == math.inf
    assert markout_delta({"1s": math.nan}, {"1s": 1.0}) == math.inf
    assert step0_deviation(1.0, 1.0, np.array([2.0, 2.0]), np.array([2.0, 2.0])) == 0.0
    assert BF16.pred_rel_l2 > 1e-2  # bf16 looser than fp32


def test_a_broken_rung_is_reported_not_equivalent(work, monkeypatch):
    """The end-of-training checks have power: on the CPU preset, a correct fp32 rung (the
    fused optimizer's reference path) passes the fp32 tolerance, while the same rung with
    a real kind of bug (the first moment's bias correction dropped) and the baseline with
    a wrong learning rate fail it -- and are reported with the figures that failed."""
    cfg, cpu = cpu_tiny(), torch.device("cpu")
    base = reference(work, train_rung(RUNGS[0], Switches(), work, cfg, cpu, None), cfg)
    fused = Switches(fused_kernel=True)  # on a CPU: FusedAdamW's PyTorch reference path

    ok, _, _ = check_rung(work, train_rung(RUNGS[4], fused, work, cfg, cpu, None), base, cfg,
                          cfg.fp32_tolerance)  # fmt: skip
    assert ok.equivalent, ok.failures

    correct = kernels.bias_correction

    def no_first_moment_correction(step, *, lr, betas):
        coef = correct(step, lr=lr, betas=betas)
        return torch.stack((torch.tensor(lr, dtype=coef.dtype), coef[1]))

    with monkeypatch.context() as m:
        m.setattr(kernels, "bias_correction", no_first_moment_correction)
        broken = train_rung(RUNGS[4], fused, work, cfg, cpu, None)
    bad, _, _ = check_rung(work, broken, base, cfg, cfg.fp32_tolerance)
    assert not bad.equivalent
    assert bad.step0_rel < cfg.fp32_tolerance.step0_rel  # the first step can't see it ...
    failed = {f.split()[0] for f in bad.failures}  # ... the end of training does
    assert {"loss_max_rel_dev", "pred_rel_l2"} <= failed, bad.failures

    wrong_lr = dataclasses.replace(cfg, lr=2 * cfg.lr)
    bad_lr, _, _ = check_rung(work, train_rung(RUNGS[0], Switches(), work, wrong_lr, cpu, None),
                              base, cfg, cfg.bf16_tolerance)  # fmt: skip
    assert not bad_lr.equivalent  # fails even the looser bf16 tolerance
    assert "pred_rel_l2" in {f.split()[0] for f in bad_lr.failures}, bad_lr.failures


def test_layout_views_share_one_buffer():
    layout = Layout({"x": ((2, 3), "float32"), "m": ((5,), "bool"), "i": ((2,), "int64")})
    assert layout.nbytes % 64 == 0
    buf = np.zeros(layout.nbytes, np.uint8)
    views = layout.numpy_views(buf)
    views["x"][...] = 1.5
    views["i"][...] = [3, 4]
    t = layout.torch_views(torch.from_numpy(buf))
    assert t["x"].dtype == torch.float32 and t["x"].sum() == 9.0 and t["i"].tolist() == [3, 4]


def test_trace_counts_only_the_training_thread_inside_steps(tmp_path):
    def x(cat: str, name: str, tid: int, ts: float, dur: float = 1) -> dict:
        return {"ph": "X", "cat": cat, "name": name, "tid": tid, "ts": ts, "dur": dur}

    rt = "cuda_runtime"
    ev = [
        x("user_annotation", measure.STEP_LABEL, 1, 0, 10),
        x("user_annotation", measure.STEP_LABEL, 1, 20, 10),
        x(rt, "cudaLaunchKernel", 1, 1),
        x("cuda_driver", "cuLaunchKernelEx", 1, 21),
        x(rt, "cudaGraphLaunch", 1, 22),
        x(rt, "cudaStreamSynchronize", 1, 25),
        x(rt, "cudaEventSynchronize", 9, 5),  # another thread: not the training loop's
        x(rt, "cudaDeviceSynchronize", 1, 40),  # outside the steps
        x("kernel", "k", 7, 2, 5),
        x("kernel", "k", 7, 4, 4),
    ]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": ev}))
    c = measure.count_trace(str(path), steps=2)
    assert (c.launches, c.syncs, c.gpu_kernels) == (1.5, 0.5, 1.0)
    assert c.gpu_busy == pytest.approx(6 / 30)


def test_switches_are_cumulative_and_skip_what_the_cpu_cannot_run():
    cpu = {r.switch for r in RUNGS if not r.cuda_only}
    top = Switches.upto(8, cpu)
    assert top.compile and top.bf16 and top.device_metrics and top.packing
    assert not (top.fused_kernel or top.streams or top.cudagraph)
    assert Switches.upto(1, cpu) == Switches()


def test_rung_rows_of_the_h200_run_load_as_records_and_dump_unchanged():
    rows = json.loads(H200_RESULT.read_text())["rungs"]
    for row in rows:
        dumped = RungResult.from_dict(row).to_dict()
        assert dumped == row and list(dumped) == list(row)  # same keys, same order
    skipped = {"number": 7, "name": "cuda_graph", "predicted": "1.3x",
               "skipped": "skipped: no CUDA device (CUDA graphs need a CUDA GPU)",
               "equivalent": None}  # fmt: skip
    assert RungResult.from_dict(skipped).to_dict() == skipped
    with pytest.raises(ValueError, match="heldout_loss is missing"):
        RungResult.from_dict({k: v for k, v in rows[0].items() if k != "heldout_loss"})
    with pytest.raises(ValueError, match="step_ms must be None on a skipped rung"):
        RungResult.from_dict({**skipped, "step_ms": 1.0})
    with pytest.raises(ValueError, match="unknown rung result fields: \\['speed'\\]"):
        RungResult.from_dict({**rows[0], "speed": 1.0})


def markdown_tables(text: str) -> list[str]:
    return [b for b in text.split("\n\n") if b.startswith("| ")]


def test_the_report_renders_the_h200_run_as_it_was_published():
    """bench/results/ladder-h200.md is the report `quantloop ladder` wrote on the H200 for
    ladder-h200.json (README's table is its rung table): rendered here from the JSON, the
    rung table and the controls table must come out character for character."""
    result = json.loads(H200_RESULT.read_text())
    report = report_markdown(result)
    published = (H200_RESULT.parent / "ladder-h200.md").read_text()
    rung_table, controls_table = markdown_tables(report)
    assert [rung_table, controls_table] == markdown_tables(published)
    assert rung_table.count("\n") == 2 + 13 - 1 and "| 13. flex_blocks | 169,864 |" in rung_table
    assert report.startswith("# GPU optimization ladder on NVIDIA H200\n\ntorch 2.11.0+cu130, ")
    assert "commit `7cdf07b`" in report
    assert "Measured ceilings: bf16 matmul 760 TFLOP/s, device copy 4171 GB/s." in report


@pytest.mark.slow
def test_bench_script_runs_from_a_checkout_without_quantloop_installed(tmp_path):
    """bench/ladder.py as on the GPU machine: torch and the rest importable, quantloop not
    installed. `-S` skips site, so the venv's .pth files (the editable install's import
    finder) do not run, while PYTHONPATH still names the venv's packages."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = sysconfig.get_paths()["purelib"]

    def python(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-S", *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True)  # fmt: skip

    assert "No module named 'quantloop'" in python("-c", "import quantloop.profiling").stderr
    out = tmp_path / "out"
    run = python(str(ROOT / "bench" / "ladder.py"), "--out", str(out), "--work",
                 str(tmp_path / "work"), "--preset", "cpu_tiny", "--rungs", "1",
                 "--controls", "fp32")  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads((out / "ladder-h200.json").read_text())
    assert [(r["name"], r["equivalent"]) for r in result["rungs"]] == [("baseline", True)]
    assert result["commit"] == git_commit(short=True)  # the checkout's, without --commit
    assert (out / "ladder-h200.md").read_text() == report_markdown(result)


@pytest.mark.slow
def test_ladder_flow_on_cpu(prefect_api, tmp_path):
    from quantloop.flows.ladder import LadderParams, ladder

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    params = LadderParams(
        workspace={"home": str(tmp_path / "home"), "tracking_uri": uri, "experiment": "ladder"},
        preset="cpu_tiny",
        out_dir=str(tmp_path / "out"),
    )
    result = ladder(params)
    rungs = {r["name"]: r for r in result["rungs"]}
    assert [r["number"] for r in result["rungs"]] == list(range(1, len(RUNGS) + 1))
    for name in (
        "fused_kernel", "streams", "cuda_graph", "flex_attention", "combo_kernels", "autotune",
    ):  # fmt: skip
        assert rungs[name]["skipped"].startswith("skipped: no CUDA device")
    assert rungs["flat_grads"]["skipped"] == "skipped: needs fused_kernel, which cannot run here"
    for name in ("loader_mask", "flex_blocks"):
        assert rungs[name]["skipped"] == "skipped: needs flex_attention, which cannot run here"
    ran = [r for r in result["rungs"] if not r["skipped"]]
    assert [r["name"] for r in ran] == [
        "baseline",
        "compile",
        "bf16_tf32",
        "device_metrics",
        "no_padding",
    ]
    assert all(r["equivalent"] for r in ran), [r["failures"] for r in ran]
    assert rungs["compile"]["step0_rel"] < 1e-6  # same float32 arithmetic, traced
    # on-device metrics record exactly what the .item() loop recorded
    assert rungs["device_metrics"]["loss_curve"] == rungs["bf16_tf32"]["loss_curve"]
    assert set(result["controls"]) == {"fp32", "bf16", "other_seed"}
    assert result["controls"]["fp32"]["fails_fp32"] == []  # rounding passes ...
    assert result["controls"]["other_seed"]["fails_bf16"]  # ... another model does not
    written = json.loads((tmp_path / "out" / "ladder.json").read_text())["rungs"]
    assert [RungResult.from_dict(r).to_dict() for r in written] == written
    report = (tmp_path / "out" / "ladder.md").read_text()
    assert "| 8. no_padding |" in report and "skipped: no CUDA device" in report

    client = mlflow.tracking.MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("ladder")
    runs = client.search_runs([exp.experiment_id])
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == result["mlflow_run_id"]]
    assert len(children) == len(RUNGS)
    by_name = {r.data.tags["quantloop.stage"]: r for r in children}
    assert by_name["rung6-streams"].data.tags["skipped"].startswith("skipped")
    base = by_name["rung1-baseline"]
    assert base.data.metrics["samples_per_s"] > 0 and base.data.metrics["equivalent"] == 1.0
    arts = {a.path for a in client.list_artifacts(base.info.run_id)}
    assert {"equivalence.png", "equivalence.json", "trace"} <= arts
    parent_arts = {a.path for a in client.list_artifacts(result["mlflow_run_id"])}
    assert {"throughput.png", "ladder.md"} <= parent_arts


def test_windows_hold_contiguous_ends_and_their_lengths():
    # a research run's ends are a column of its [N, T] window index; the loader reads the
    # lengths for every batch, so Windows keeps its own contiguous copy and computes them once
    index = np.arange(40, dtype=np.int64).reshape(10, 4)
    w = Windows(start=index[:, 0], end=index[:, -1])
    assert w.end.flags["C_CONTIGUOUS"] and w.start.flags["C_CONTIGUOUS"]
    assert not np.shares_memory(w.end, index)
    assert np.array_equal(w.lengths, np.full(10, 4))
    assert len(w) == 10
