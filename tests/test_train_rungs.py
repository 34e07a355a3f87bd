"""Training that applies the ladder's rungs (profiling.trainer, profiling.proof) on a CPU:
what `auto` picks and on what evidence, how an explicit list is checked, that `none` is
the plain loop bit for bit, and that the rungs a CPU can run train the same model within
the ladder's tolerances. The GPU rungs run on the H200 (bench/results/research-h200.json).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from quantloop.flows.train import model_key
from quantloop.models.orderbook import OrderBookNet
from quantloop.profiling import packing, proof, replay
from quantloop.profiling.compile import inductor_options
from quantloop.profiling.config import BF16, FP32, cpu_tiny
from quantloop.profiling.equivalence import max_rel_dev, rel_l2
from quantloop.profiling.inference import Predictor, forward_rungs, inference_rungs, mode_name
from quantloop.profiling.kernels import FusedAdamW
from quantloop.profiling.loop import model_config
from quantloop.profiling.packing import (
    FLEX_TILES,
    FlexMask,
    PackedNet,
    flex_layout,
    window_blocks,
)
from quantloop.profiling.proof import plan_rungs, proof_from_result
from quantloop.profiling.rungs import RUNGS
from quantloop.profiling.trainer import train_applied
from quantloop.profiling.workload import build_workload, packed_batch, window_block_lists
from quantloop.tasks.research.train_config import OPTIMIZATIONS, TrainConfig
from quantloop.tasks.research.training import (
    load_model,
    predict,
    save_model,
    train,
)
from tests.test_ladder import H200_RESULT
from tests.test_training import SMALL, learnable_table

CPU = torch.device("cpu")
TABLES = [learnable_table(600, 0), learnable_table(500, 1)]
INPUTS, LABELS = ["a", "b"], ["label_4"]
# The plain loop's weights for TABLES and SMALL with torch 2.13.0+cpu, per CPU vendor and
# the kernels' instruction set: the same code gives other weights on an AMD EPYC than on
# an Intel Xeon, and with AVX2 than with AVX512 (the kernels sum in another order).
# Intel's was recorded from main at 792135a, before the trainer existed; AMD's AVX512 one
# at 2026-12-02's regrouping of tasks/ (the first session on an EPYC), and its AVX2 one
# at 9f4d7c7 (2026-12-07, the first session on an EPYC whose torch picks AVX2: the
# fresh-clone suite skipped the check there), the same with one thread or two: those pin
# that day's weights, not 792135a's.
PLAIN_DIGESTS = {
    ("GenuineIntel", "AVX512"): "db74f6c9978277f4da297937b3542e9b1cd94edd0ec66299328224ec8bf654b6",
    ("AuthenticAMD", "AVX512"): "57d994a6ce78e36c2a0d723b5e027f0396445392f8179538c206f8e3eef33581",
    ("AuthenticAMD", "AVX2"): "2d985e6eb866c0b8d6ac7a905f3b492edaafa5b18a603ceafe7f4915ccf5da7f",
}


def cpu_vendor() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("vendor_id"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def test_the_names_are_the_ladders_switches():
    assert OPTIMIZATIONS == tuple(r.switch for r in RUNGS if r.switch)


def test_config_checks_and_canonicalizes_the_names():
    assert TrainConfig().optimizations == "auto"
    listed = TrainConfig(optimizations=["packing", "compile", "packing"])
    assert listed.optimizations == ("compile", "packing")  # once each, rung order
    assert listed == TrainConfig(optimizations=("compile", "packing"))
    assert TrainConfig(optimizations=[]).optimizations == "none"
    with pytest.raises(ValueError, match="optimizations: unknown \\['cuda_grap'\\]"):
        TrainConfig(optimizations=["cuda_grap"])
    with pytest.raises(ValueError, match="optimizations must be 'auto', 'none' or a list"):
        TrainConfig(optimizations="all")


def test_auto_on_a_cpu_applies_nothing_without_a_cpu_result():
    plan = plan_rungs("auto", CPU)
    assert plan.rungs == () and plan.proof is None
    # the committed H200 result is recorded, and speaks for that GPU only
    [h200] = proof.recorded_proofs()
    assert h200.device_class == "cuda/NVIDIA H200" and h200.source == str(
        H200_RESULT.relative_to(H200_RESULT.parents[2])
    )


def test_auto_applies_what_a_result_proved_and_this_machine_runs(monkeypatch):
    """The H200's proof read on a CPU (device class patched): the combination less the
    switches only CUDA runs, each dropped with its reason."""
    monkeypatch.setattr(proof, "device_class", lambda device: "cuda/NVIDIA H200")
    plan = plan_rungs("auto", CPU)
    assert plan.rungs == ("compile", "bf16", "device_metrics", "packing")
    assert set(plan.dropped) == {
        "fused_kernel",
        "streams",
        "cudagraph",
        "flex_attention",
        "flat_grads",
        "combo_kernels",
        "loader_mask",
        "flex_blocks",
    }
    assert plan.dropped["loader_mask"] == "needs flex_attention, which cannot run here"
    assert plan.proof.commit == json.loads(H200_RESULT.read_text())["commit"]
    assert plan.record()["rungs"] == "compile,bf16,device_metrics,packing"


def test_the_proof_stops_at_the_first_rung_that_is_not_equivalent(tmp_path, monkeypatch):
    result = json.loads(H200_RESULT.read_text())
    assert proof_from_result(result, "x").proven == OPTIMIZATIONS[:12]  # rungs 1-13
    rows = [dict(r) for r in result["rungs"]]
    rows[4]["equivalent"] = False  # rung 5, fused_kernel
    later = {**result, "rungs": rows, "date": "2099-01-01T00:00:00+00:00"}
    assert proof_from_result(later, "x").proven == ("compile", "bf16", "device_metrics")
    # a skipped rung (no CUDA) does not stop it: the later rungs ran without its switch
    rows[4] = {k: rows[4][k] for k in ("number", "name", "predicted")} | {
        "skipped": "failed: RuntimeError",
        "equivalent": None,
    }
    for r in rows[5:]:
        r["switches"] = {**r["switches"], "fused_kernel": False}
    assert "fused_kernel" not in proof_from_result(later, "x").proven
    # the latest result of the device class wins: a workspace's own ladder run, say
    path = tmp_path / "ladder.json"
    path.write_text(json.dumps(later))
    monkeypatch.setattr(proof, "device_class", lambda device: "cuda/NVIDIA H200")
    plan = plan_rungs("auto", CPU, [path])
    assert plan.proof.source == str(path)
    assert plan.rungs == ("compile", "bf16", "device_metrics", "packing")


def test_auto_leaves_out_what_a_research_run_should_not_pay_for(monkeypatch):
    """A result that proved every rung, read where every rung runs (runnable patched):
    `auto` applies all but autotune (minutes of compile), which a list still applies."""
    result = json.loads(H200_RESULT.read_text())
    row = result["rungs"][-1]
    top = {**row, "number": 13, "name": "autotune", "switches": dict.fromkeys(OPTIMIZATIONS, True)}
    newer = {**result, "rungs": [*result["rungs"], top], "date": "2099-01-01T00:00:00+00:00"}
    monkeypatch.setattr(proof, "device_class", lambda device: "cuda/NVIDIA H200")
    monkeypatch.setattr(proof, "runnable", lambda device: set(OPTIMIZATIONS))
    monkeypatch.setattr(proof, "recorded_proofs", lambda extra=(): [
        proof.proof_from_result(newer, "newer.json")])  # fmt: skip
    plan = plan_rungs("auto", CPU)
    assert plan.proof.proven == OPTIMIZATIONS
    assert plan.rungs == OPTIMIZATIONS[:-1] and list(plan.dropped) == ["autotune"]
    assert "compile takes minutes" in plan.dropped["autotune"]
    assert plan_rungs(OPTIMIZATIONS, CPU).rungs == OPTIMIZATIONS  # asked for by name


def test_inductor_options_are_inductors():
    """torch.compile rejects an unknown option only when it compiles (on a GPU, here never):
    the names are checked against this torch's Inductor config."""
    known = torch._inductor.config.get_config_copy()
    for autotune, combo in ((True, False), (False, True), (True, True)):
        options = inductor_options(autotune=autotune, combo=combo)
        assert options and set(options) <= set(known)
    assert inductor_options(autotune=False, combo=True) == {"combo_kernels": True}
    assert inductor_options(autotune=False, combo=False) == {}


def test_an_explicit_list_is_checked_and_what_cannot_run_is_dropped():
    with pytest.raises(ValueError, match="train.optimizations: cudagraph needs device_metrics"):
        plan_rungs(("cudagraph",), CPU)
    with pytest.raises(ValueError, match="flex_attention needs packing"):
        plan_rungs(("flex_attention",), CPU)
    plan = plan_rungs(("device_metrics", "fused_kernel", "flat_grads", "packing"), CPU)
    assert plan.rungs == ("device_metrics", "packing")
    assert plan.dropped == {
        "fused_kernel": "no CUDA device (the fused AdamW + norm kernel is Triton, which needs "
        "a CUDA GPU)",
        "flat_grads": "needs fused_kernel, which cannot run here",
    }
    assert plan.unproven == ("device_metrics", "packing")  # no result for a CPU
    assert plan_rungs("none", CPU).rungs == ()


def test_none_is_the_plain_loop_bit_for_bit():
    cfg = TrainConfig(**SMALL)
    plain = train(TABLES, INPUTS, LABELS, cfg)
    for optimizations in ("none", "auto"):  # auto: nothing proven for a CPU
        c = dataclasses.replace(cfg, optimizations=optimizations)
        again = train_applied(TABLES, INPUTS, LABELS, c)
        assert again.model_digest == plain.model_digest and again.rungs == ()
        assert again.loss_curve == plain.loss_curve
    where = (cpu_vendor(), torch.backends.cpu.get_cpu_capability())
    if torch.__version__ != "2.13.0+cpu" or where not in PLAIN_DIGESTS:
        pytest.skip(f"no plain digest recorded for torch {torch.__version__} on {where}")
    assert plain.model_digest == PLAIN_DIGESTS[where]  # the same weights as recorded


# bf16 on a CPU: the ladder's bf16 loss tolerance (3e-3, set on the H200) is under bf16's
# unit roundoff, 2^-8 = 3.9e-3. On a Xeon with native AVX512-BF16 this test's loss curve
# deviated by 3.2e-3 (2026-12-01, the same on ef6231f, before any change of that session);
# it passed under 3e-3 on the machines before. A broken rung deviates by far more.
CPU_BF16 = dataclasses.replace(BF16, loss_rel=2.0**-8)


@pytest.mark.parametrize(
    ("rungs", "tolerance"),
    [
        (("device_metrics",), FP32),
        (("compile", "device_metrics", "packing"), FP32),
        (("compile", "bf16", "packing"), CPU_BF16),
    ],
)
def test_the_rungs_a_cpu_runs_train_the_same_model(rungs, tolerance):
    """Against the plain loop, same seed, data and batches: the loss curve and the
    predictions within the ladder's tolerance of the precision. compile runs aot_eager
    (Dynamo and AOTAutograd without Inductor's C++ build)."""
    cfg = TrainConfig(**SMALL)
    plain = train(TABLES, INPUTS, LABELS, cfg)
    plan = plan_rungs(rungs, CPU)
    got = train_applied(TABLES, INPUTS, LABELS, cfg, plan, compile_backend="aot_eager")
    assert got.rungs == rungs and got.steady_samples_per_s > 0 and got.step_ms > 0
    assert got.warmup_s > 0 and got.samples_seen == plain.samples_seen
    assert max_rel_dev(got.loss_curve, plain.loss_curve) <= tolerance.loss_rel
    held_out = learnable_table(400, 9)
    assert rel_l2(predict(got, held_out), predict(plain, held_out)) <= tolerance.pred_rel_l2


def test_clock_windows_vary_in_length_and_pack(tmp_path):
    """Research windows of the last window_s seconds (the ladder's workload shape): padded
    and packed training agree, and the saved model keeps its rungs and figures."""
    t = np.cumsum(np.random.default_rng(0).exponential(0.1, 600))
    tables = [learnable_table(600, 0).append_column("time", [t])]
    cfg = TrainConfig(**SMALL | {"window": 16, "window_s": 0.8})
    plain = train(tables, INPUTS, LABELS, cfg)
    got = train_applied(tables, INPUTS, LABELS, cfg, plan_rungs(("packing",), CPU))
    assert max_rel_dev(got.loss_curve, plain.loss_curve) <= FP32.loss_rel
    path = tmp_path / "m.pt"
    save_model(got, path)
    loaded = load_model(path)
    assert loaded.rungs == ("packing",) and loaded.step_ms == got.step_ms
    assert np.array_equal(predict(loaded, tables[0]), predict(got, tables[0]))
    # simulate's key reads the mode and digest from the stored model, without building it
    assert replay.inference_mode(str(path)) == (Predictor(loaded).stats.mode, got.model_digest)
    assert mode_name(forward_rungs(loaded.rungs, torch.device("cuda"))) == "packing"
    assert mode_name(forward_rungs(loaded.rungs, CPU)) == "eager"


def test_packed_bulk_prediction_is_the_eager_prediction():
    """profiling.inference's packed path (a GPU adds bf16, compile and the graph) against
    tasks.training.predict, over tables of other lengths with one static shape."""
    t = np.cumsum(np.random.default_rng(0).exponential(0.1, 3000))
    tables = [learnable_table(3000, 0).append_column("time", [t])]
    cfg = TrainConfig(**SMALL | {"window": 64, "window_s": 1.5})
    model = train_applied(tables, INPUTS, LABELS, cfg, plan_rungs(("packing",), CPU))
    assert inference_rungs(model, CPU) == ()  # on a CPU simulate predicts eagerly
    fast = Predictor(model, batch=256, rungs=("packing",))
    for table in (tables[0], learnable_table(700, 3).append_column("time", [t[:700]])):
        assert rel_l2(fast(table), predict(model, table)) < 1e-6
    assert fast.stats.windows == 3700 and fast.stats.samples_per_s > 0


def test_model_key_follows_the_rungs_applied_not_how_they_were_asked_for():
    auto, none = TrainConfig(), TrainConfig(optimizations="none")
    listed = TrainConfig(optimizations=["packing", "compile"])
    key = lambda c, r: model_key(c, ["f1", "f2"], 0.3, r)  # noqa: E731
    assert key(auto, ()) == key(none, ())  # auto that applies nothing is the plain loop
    assert key(auto, ("compile", "packing")) == key(listed, ("compile", "packing"))
    assert key(auto, ("compile", "packing")) != key(auto, ("packing",)) != key(auto, ())


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return build_workload(cpu_tiny(), str(tmp_path_factory.mktemp("store")))


def test_flex_block_mask_lists_exactly_the_blocks_a_window_spans(work):
    for step in range(6):
        seg = torch.from_numpy(packed_batch(work, step)["seg"])
        R, T = seg.shape
        for block in (4, 8, 16):
            n = T // block
            num, idx = window_blocks(seg, block)
            same = seg[:, :, None] == seg[:, None, :]
            need = same.view(R, n, block, n, block).any(4).any(2)  # [R, q block, kv block]
            listed = torch.zeros_like(need)
            for r, i in np.ndindex(R, n):
                listed[r, i, idx[r, 0, i, : num[r, 0, i]].long()] = True
            assert torch.equal(listed, need)


def test_the_loaders_block_lists_are_the_devices(work):
    """Rung 12 lists the blocks on the host (NumPy); rungs 9-11 on the device (torch). Rows
    of 32 events here: blocks of 12 and 24 leave a partial last block, 64 one block a row."""
    for step in range(6):
        b = packed_batch(work, step, mask_block=8)
        seg = torch.from_numpy(b["seg"])
        for block in (4, 8, 12, 16, 24, 64):
            num, idx = window_block_lists(b["seg"], block)
            ref_num, ref_idx = window_blocks(seg, block)
            assert num.dtype == idx.dtype == np.int32
            assert np.array_equal(num, ref_num.numpy()) and np.array_equal(idx, ref_idx.numpy())
        assert np.array_equal(b["kv_num"], window_block_lists(b["seg"], 8)[0])
    assert "kv_num" not in packed_batch(work, 0)  # only when asked for


def test_flex_layout_keeps_to_the_layouts_shown_to_work():
    """bench/flex_shapes.py on the H200: 128-event blocks with Inductor's tiles worked for
    every row length and head dimension tried; 64-event blocks only for head dimensions up
    to 32 on rows of 200 or 256 (rows of 32 came out wrong, rows of 100 did not compile)."""
    for T in range(1, 600):
        for head_dim in (16, 32, 64, 128):
            assert flex_layout(T, head_dim, tuned=False) == (128, None)
            block, tiles = flex_layout(T, head_dim, tuned=True)
            if tiles is None:
                assert block == 128
            else:
                assert (block, tiles) == (64, FLEX_TILES)
                assert head_dim <= 32 and T >= 128 and T % 64 == 0
    assert flex_layout(256, 32, tuned=True) == (64, FLEX_TILES)  # the ladder's shape
    for T, head_dim in ((256, 64), (200, 32), (100, 16), (32, 16)):
        assert flex_layout(T, head_dim, tuned=True) == (128, None)


def test_a_head_narrower_than_flex_attention_takes_drops_it_and_its_users(monkeypatch):
    """TrainConfig's default model (32 wide, 4 heads: head dimension 8) on a machine that
    runs every rung (runnable patched): FlexAttention's kernels need 16."""
    monkeypatch.setattr(proof, "runnable", lambda device: set(OPTIMIZATIONS))
    wanted = ("packing", "flex_attention", "loader_mask", "flex_blocks")
    plan = plan_rungs(wanted, CPU, head_dim=TrainConfig().head_dim)
    assert plan.rungs == ("packing",)
    assert plan.dropped == {
        "flex_attention": "head dimension 8 (d_model / n_heads) is below FlexAttention's 16",
        "loader_mask": "needs flex_attention, which is dropped",
        "flex_blocks": "needs flex_attention, which is dropped",
    }
    assert plan_rungs(wanted, CPU, head_dim=16).rungs == wanted


def test_flex_forward_is_the_dense_forward(work, monkeypatch):
    """FlexAttention has no backward on a CPU; its forward here is checked against the
    dense block-diagonal mask (the H200 ladder checks training, rung 9), with the device's
    block lists and the loader's, and with blocks that leave a partial last block (12) or
    are longer than the row (64, as 128 is for rows under 128)."""
    torch.manual_seed(0)
    model = OrderBookNet(model_config(cpu_tiny(), work))
    dense_net, flex_net = PackedNet(model), PackedNet(model, flex=True)
    seen = []  # the kernel options each flex_attention call got
    real = packing.flex_attention
    monkeypatch.setattr(packing, "flex_attention", lambda *a, **kw: (
        seen.append(kw.get("kernel_options")), real(*a, **kw))[1])  # fmt: skip
    for step in (0, 5):
        b = packed_batch(work, step)
        args = [torch.from_numpy(b[k]) for k in ("x", "pos", "seg", "last", "count")]
        with torch.no_grad():
            dense = dense_net(*args)
            for block in (8, 12, 64):
                mask = FlexMask(work.pack_rows, work.max_len, CPU, block=block)
                lists = [torch.from_numpy(a) for a in window_block_lists(b["seg"], block)]
                flex = flex_net(*args, block_mask=mask.update(args[2]))
                assert torch.allclose(flex, dense, rtol=1e-5, atol=1e-6), block
                loaded = flex_net(*args, block_mask=mask.update(args[2], *lists))
                assert torch.equal(loaded, flex)  # the same mask, listed by the loader
            assert not any(seen) and len(seen) == 6 * len(model.blocks)
            # rung 13's tiles reach flex_attention (a CPU runs it unfused and ignores them)
            PackedNet(model, flex=True, tiles=FLEX_TILES)(*args, block_mask=mask.block_mask)
            assert seen[-len(model.blocks) :] == [FLEX_TILES] * len(model.blocks)
            seen.clear()


def test_handing_gradients_over_is_accumulating_them():
    torch.manual_seed(2)
    nets = [torch.nn.Sequential(torch.nn.Linear(5, 9), torch.nn.Linear(9, 1)) for _ in "ab"]
    nets[1].load_state_dict(nets[0].state_dict())
    opts = [FusedAdamW(n, lr=1e-2, weight_decay=0.1, use_triton=False, handoff=h)
            for n, h in zip(nets, (False, True), strict=True)]  # fmt: skip
    for _ in range(3):
        x = torch.randn(8, 5)
        for net, opt in zip(nets, opts, strict=True):
            opt.zero_grad()
            net(x).square().mean().backward()
            opt.step()
    assert torch.equal(opts[0].param, opts[1].param) and torch.equal(opts[0].grad, opts[1].grad)
