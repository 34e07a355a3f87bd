"""Windows of feature rows -> OrderBookNet, trained with a fixed seed; predict, save, load.

Data layout: every table's input columns are stacked into one float32 matrix with a
trailing zero row, and a window is a row of indices into it ([N, T], padding points
at the zero row). The matrix, the indices and the labels go to the device once;
a batch is one gather there, so the loop has no host->device copy and no host sync
until the loss curve is read at the end. `train_step` is a plain function that an
optimization ladder (torch.compile, autocast, CUDA graphs) can wrap.
"""

from __future__ import annotations

import hashlib
import io
import os
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import numpy as np
import pyarrow as pa
import torch
import torch.nn.functional as F

from quantloop.models.orderbook import ModelConfig, OrderBookNet
from quantloop.tasks.engine import storage
from quantloop.tasks.research.train_config import TrainConfig

INPUT_CLIP = 10.0  # standardized inputs are clipped to +-10 std: one wild event can't dominate


def start_cuda_driver() -> bool:
    """Start the CUDA driver (`cuInit`) through ctypes, which lets go of the interpreter's
    lock for a foreign call, so that a thread starting CUDA leaves the others running; a
    later torch.cuda.is_available() then finds the driver up. Starting it from torch holds
    the lock throughout: 0.24 s of a served no-op's main thread on an H100, stuck in the
    ahead thread's Thread.start (py-spy, bench/results/turnaround-h200-ahead-notes.md,
    call 18). False where there is no driver (a CPU machine) or torch has no CUDA."""
    if torch.version.cuda is None:
        return False
    import ctypes

    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return driver.cuInit(0) == 0  # CUDA_SUCCESS; an error is raised again by torch's call


def open_cuda_context(device: torch.device) -> bool:
    """Create `device`'s primary context (the one torch's runtime uses) through ctypes, the
    interpreter's lock let go, after `start_cuda_driver`: the runtime's first call on the
    device then finds it made. Made by torch instead, it held the lock 0.35-0.9 s (a
    `torch.zeros(1)` in a thread beside the main thread's MLflow calls, H200 call 12 of
    bench/results/turnaround-h200-ahead-notes.md). Retained for the process's life, as the
    runtime retains it. False where it could not be made (torch's call says why)."""
    import ctypes

    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    ordinal, context = ctypes.c_int(), ctypes.c_void_p()
    if driver.cuDeviceGet(ctypes.byref(ordinal), device.index or 0) != 0:
        return False
    return driver.cuDevicePrimaryCtxRetain(ctypes.byref(context), ordinal) == 0


def resolve_device(name: str) -> torch.device:
    """The device `name` (TrainConfig.device) means on the machine that trains: checked
    here, not in the config, which is also read where training does not run (the UI's
    form, a CPU flow process that trains on a GPU site's worker)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        # torch would fail later with "AssertionError: Torch not compiled with CUDA enabled"
        raise ValueError(
            f"config.device is {name!r} but this worker has no CUDA "
            "(torch.cuda.is_available() is False): run it on a CUDA worker's pool, or with "
            "device auto or cpu"
        )
    return torch.device(name)


# ---------------------------------------------------------------- windows


@dataclass(kw_only=True, slots=True, frozen=True)
class WindowData:
    """Training windows as runs of rows of one stacked feature matrix (no [N, T, F] copy).

    A window is its first and last row (`start`, `end`: consecutive rows of one table);
    `index` and `mask` lay them out as [N, T], right-aligned, when asked for (the plain
    loop's gather): the packed trainer reads the runs alone, and building the [N, T]
    arrays was 1 s of an H200 research run's train stage (180,000 windows of 256)."""

    features: np.ndarray  # [rows + 1, F] float32; the last row is zeros, the padding row
    start: np.ndarray  # [N] int64, the window's first real event's row in features
    end: np.ndarray  # [N] int64, its anchor's row (the window's last event)
    window: int  # T: the events a window holds at most
    labels: np.ndarray  # [N, L] float32, labels at the anchor (the window's last event)
    table: np.ndarray  # [N] int64, which input table each window comes from
    row: np.ndarray  # [N] int64, the anchor's row in that table

    def __len__(self) -> int:
        return len(self.end)

    @property
    def mask(self) -> np.ndarray:
        """[N, T] bool, True = real event; windows are right-aligned."""
        lengths = self.end - self.start + 1
        return np.arange(self.window)[None, :] >= (self.window - lengths)[:, None]

    @property
    def index(self) -> np.ndarray:
        """[N, T] int64 into features; padding positions point at the last row."""
        rows = self.end[:, None] + np.arange(1 - self.window, 1)[None, :]
        return np.where(self.mask, rows, len(self.features) - 1)

    def batch(self, which: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """x [B, T, F], mask [B, T], y [B, L] for windows `which`."""
        idx = self.index[which]
        return self.features[idx], self.mask[which], self.labels[which]


def column_matrix(table: pa.Table, names: Sequence[str]) -> np.ndarray:
    """[rows, len(names)] float32 of the named columns."""
    missing = [n for n in names if n not in table.column_names]
    if missing:
        raise ValueError(f"table has no column(s) {missing}; it has {table.column_names}")
    if not names:
        return np.zeros((table.num_rows, 0), np.float32)
    return np.column_stack(
        [table.column(n).to_numpy(zero_copy_only=False).astype(np.float32) for n in names]
    )


def clock_window_starts(time: np.ndarray, window_s: float, max_len: int) -> np.ndarray:
    """First row of each row's window: events with time in (t - window_s, t], <= max_len."""
    rows = np.arange(len(time))
    start = np.searchsorted(time, time - window_s, side="right")
    return np.maximum(start, rows - (max_len - 1)).astype(np.int64)


def window_starts(table: pa.Table, cfg: TrainConfig) -> np.ndarray:
    """[rows] first row of each row's window in `table`: the last `cfg.window` events, or
    with `cfg.window_s` those of the last window_s seconds (at most `cfg.window`)."""
    if cfg.window_s is None:
        return np.maximum(np.arange(table.num_rows) - (cfg.window - 1), 0)
    time = table.column("time").to_numpy(zero_copy_only=False).astype(np.float64)
    return clock_window_starts(time, cfg.window_s, cfg.window)


def make_windows(
    tables: Sequence[pa.Table], inputs: Sequence[str], labels: Sequence[str], cfg: TrainConfig
) -> WindowData:
    """Anchors every `cfg.stride` events (rows 0, stride, 2*stride, ...) whose labels are all
    finite; each window is the `cfg.window` events up to and including the anchor (or those
    of the last `cfg.window_s` seconds), from the same table only (a day's first events get
    left padding, mask False)."""
    feats, starts, ends, ys, which, anchor_rows = [], [], [], [], [], []
    offset = 0
    for i, table in enumerate(tables):  # one iteration per table (day), not per window
        x = column_matrix(table, inputs)
        y = column_matrix(table, labels)
        anchors = np.arange(0, table.num_rows, cfg.stride)
        anchors = anchors[np.isfinite(y[anchors]).all(axis=1)]
        # the window's first row: the last `window` events (window_starts: of the last
        # window_s seconds, at most `window`), never before the table's first row
        first = np.maximum(anchors - (cfg.window - 1), 0)
        if cfg.window_s is not None:
            first = np.maximum(first, window_starts(table, cfg)[anchors])
        feats.append(x)
        starts.append(first + offset)
        ends.append(anchors + offset)
        ys.append(y[anchors])
        which.append(np.full(len(anchors), i, np.int64))
        anchor_rows.append(anchors)
        offset += table.num_rows
    feats.append(np.zeros((1, len(inputs)), np.float32))
    empty = np.zeros(0, np.int64)
    return WindowData(
        features=np.concatenate(feats),
        start=np.concatenate(starts, dtype=np.int64) if starts else empty,
        end=np.concatenate(ends, dtype=np.int64) if ends else empty,
        window=cfg.window,
        labels=np.concatenate(ys) if ys else np.zeros((0, len(labels)), np.float32),
        table=np.concatenate(which) if which else np.zeros(0, np.int64),
        row=np.concatenate(anchor_rows).astype(np.int64) if anchor_rows else np.zeros(0, np.int64),
    )


# ---------------------------------------------------------------- normalization


def _finite_mean_std(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    # x: [rows, F]; statistics over finite entries only; a constant column gets std 1
    x = x.astype(np.float64)
    finite = np.isfinite(x)
    count = np.maximum(finite.sum(0), 1)
    xz = np.where(finite, x, 0.0)
    mean = xz.sum(0) / count
    var = (np.where(finite, x - mean, 0.0) ** 2).sum(0) / count
    std = np.sqrt(var)
    return mean, np.where(std > 1e-12, std, 1.0)


@dataclass(kw_only=True, slots=True, frozen=True)
class Normalizer:
    """Per-feature standardization of inputs and per-label standardization of targets."""

    input_mean: np.ndarray  # [F] float64
    input_std: np.ndarray  # [F]
    label_mean: np.ndarray  # [L]
    label_std: np.ndarray  # [L]

    @classmethod
    def fit(cls, data: WindowData) -> Normalizer:
        """Input statistics over the rows the windows cover, label statistics over anchors."""
        # rows inside any window: +1 where a window starts, -1 after it ends, summed
        n = len(data.features) + 1
        edges = np.bincount(data.start, minlength=n) - np.bincount(data.end + 1, minlength=n)
        covered = np.cumsum(edges[:-1]) > 0
        input_mean, input_std = _finite_mean_std(data.features[covered])
        label_mean, label_std = _finite_mean_std(data.labels)
        return cls(
            input_mean=input_mean, input_std=input_std, label_mean=label_mean, label_std=label_std
        )

    def apply_inputs(self, x: np.ndarray) -> np.ndarray:
        """[..., F] raw -> standardized float32, clipped to +-INPUT_CLIP; NaN/inf -> 0 (mean)."""
        z = (x - self.input_mean) / self.input_std
        return np.clip(
            np.nan_to_num(z, nan=0.0, posinf=0.0, neginf=0.0), -INPUT_CLIP, INPUT_CLIP
        ).astype(np.float32)

    def scale_labels(self, y: np.ndarray) -> np.ndarray:
        return ((y - self.label_mean) / self.label_std).astype(np.float32)

    def unscale_labels(self, z: np.ndarray) -> np.ndarray:
        """Model outputs -> bps (float64)."""
        return z.astype(np.float64) * self.label_std + self.label_mean

    def to_dict(self) -> dict:
        return {k: [float(v) for v in getattr(self, k)] for k in self.__dataclass_fields__}

    @classmethod
    def from_dict(cls, values: dict) -> Normalizer:
        return cls(**{k: np.asarray(values[k], np.float64) for k in cls.__dataclass_fields__})


# ---------------------------------------------------------------- training


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    x: torch.Tensor,
    mask: torch.Tensor,
    y: torch.Tensor,
) -> torch.Tensor:
    """One optimizer step on MSE of standardized labels; returns the detached loss (no sync).

    x: [B, T, F], mask: [B, T] bool, y: [B, L] standardized labels.
    """
    pred = model(x, mask)
    loss = F.mse_loss(pred.float(), y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.detach()


def sample_order(n: int, cfg: TrainConfig) -> np.ndarray:
    """[steps, batch] window indices: shuffled epochs from numpy Generator(seed), concatenated."""
    rng = np.random.default_rng(cfg.seed)
    need = cfg.steps * cfg.batch_size
    epochs = -(-need // n)
    order = np.concatenate([rng.permutation(n) for _ in range(epochs)])[:need]
    return order.reshape(cfg.steps, cfg.batch_size)


def model_digest(model: torch.nn.Module) -> str:
    """sha256 hex of the state dict: names sorted, each with dtype, shape and raw bytes."""
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@dataclass(kw_only=True, slots=True)
class TrainResult:
    model: OrderBookNet
    model_config: ModelConfig
    train_config: TrainConfig
    normalizer: Normalizer
    inputs: list[str]
    labels: list[str]
    loss_curve: list[float]  # mean training loss per `log_every` steps (standardized MSE)
    model_digest: str
    samples: int  # training windows available
    samples_seen: int  # steps * batch_size
    duration_s: float  # the optimization loop, ending with the one host sync
    samples_per_s: float  # samples_seen / duration_s
    device: str
    # --- what the ladder's trainer (profiling.trainer) adds; defaults for the plain loop
    rungs: tuple[str, ...] = ()  # the optimizations applied; () = the plain loop below
    steady_samples_per_s: float | None = None  # after the warm-up (compile, capture)
    step_ms: float | None = None  # per step after the warm-up (the whole loop's mean here)
    warmup_s: float | None = None  # the warm-up steps' time
    gpu_util: float | None = None  # mean NVML busy fraction over the steps after the warm-up
    peak_mem_gb: float | None = None  # GiB allocated at most during training (CUDA)
    ladder_result: dict | None = None  # the ladder result `auto` relied on (profiling.proof)
    # compiled kernels from the workspace's store: "loaded", "missing" (compiled, then
    # stored), "off" (not compiled, or no store given); profiling/compile_cache.py
    compile_cache: str | None = None


@dataclass(kw_only=True, slots=True)
class TrainingData:
    """Everything a training run reads, prepared from the tables once: windows, normalized
    features and labels, the seeded batch order, the model's config. The plain loop below
    and the ladder's trainer (profiling.trainer) both train on this."""

    windows: WindowData
    normalizer: Normalizer
    features: np.ndarray  # [rows + 1, F] float32 standardized; the last row zeros (padding)
    labels: np.ndarray  # [N, L] float32 standardized
    order: np.ndarray  # [steps, batch] window indices (sample_order)
    model_config: ModelConfig
    inputs: list[str]
    label_names: list[str]

    @property
    def starts(self) -> np.ndarray:
        """[N] row of each window's first real event in `features` (windows are runs of
        consecutive rows, right-aligned in `windows.index`)."""
        return self.windows.start

    @property
    def ends(self) -> np.ndarray:
        """[N] row of each window's anchor in `features`."""
        return self.windows.end


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's CPU thread count set to n inside the block (n <= 0: left alone)."""
    if n <= 0:
        yield
        return
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def prepare(
    tables: Sequence[pa.Table],
    inputs: Sequence[str],
    labels: Sequence[str],
    cfg: TrainConfig,
    model_cfg: ModelConfig | None = None,
) -> TrainingData:
    """Windows, normalization and batch order of a training run; model_cfg defaults to
    ModelConfig(n_features=len(inputs), n_outputs=len(labels)) at the config's size."""
    inputs, labels = list(inputs), list(labels)
    if model_cfg is None:
        model_cfg = ModelConfig(n_features=len(inputs), n_outputs=len(labels), **cfg.model_size)
    if (model_cfg.n_features, model_cfg.n_outputs) != (len(inputs), len(labels)):
        raise ValueError(
            f"model_cfg has n_features={model_cfg.n_features}, n_outputs={model_cfg.n_outputs}"
            f" but there are {len(inputs)} inputs and {len(labels)} labels"
        )
    if cfg.window > model_cfg.max_len:
        raise ValueError(f"window {cfg.window} exceeds model max_len {model_cfg.max_len}")
    data = make_windows(tables, inputs, labels, cfg)
    if len(data) == 0:
        raise ValueError("no training windows: no anchor row has all labels finite")
    normalizer = Normalizer.fit(data)
    features = normalizer.apply_inputs(data.features)
    features[-1] = 0.0  # keep the padding row zero
    return TrainingData(
        windows=data,
        normalizer=normalizer,
        features=features,
        labels=normalizer.scale_labels(data.labels),
        order=sample_order(len(data), cfg),
        model_config=model_cfg,
        inputs=inputs,
        label_names=labels,
    )


def train(
    tables: Sequence[pa.Table],
    inputs: Sequence[str],
    labels: Sequence[str],
    cfg: TrainConfig,
    model_cfg: ModelConfig | None = None,
) -> TrainResult:
    """Fit OrderBookNet on windows of `tables` in the plain loop: eager float32, whatever
    `cfg.optimizations` says (the ladder's trainer, profiling.trainer, applies those).
    Same seed + data -> same curve and digest (CPU). The global torch RNG state is restored
    afterwards."""
    return train_plain(prepare(tables, inputs, labels, cfg, model_cfg), cfg)


def train_plain(prepared: TrainingData, cfg: TrainConfig) -> TrainResult:
    """The plain loop over prepared data: everything on the device, a batch is one gather
    there, one host sync at the end."""
    device = resolve_device(cfg.device)
    data = prepared.windows
    # everything the loop reads lives on the device; a batch is a gather there
    feats_t = torch.from_numpy(prepared.features).to(device)  # [rows + 1, F]
    index_t = torch.from_numpy(data.index).to(device)  # [N, T]
    mask_t = torch.from_numpy(data.mask).to(device)  # [N, T]
    labels_t = torch.from_numpy(prepared.labels).to(device)  # [N, L]
    order_t = torch.from_numpy(prepared.order).to(device)  # [steps, B]

    rng_devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=rng_devices), torch_threads(cfg.num_threads):
        torch.manual_seed(cfg.seed)
        model = OrderBookNet(prepared.model_config).to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        losses = torch.zeros(cfg.steps, device=device)  # filled on device, read once at the end
        model.train()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        for step in range(cfg.steps):
            b = order_t[step]
            loss = train_step(model, optimizer, feats_t[index_t[b]], mask_t[b], labels_t[b])
            losses[step] = loss
        curve = losses.cpu().numpy().astype(np.float64)  # the one host sync
        duration = time.perf_counter() - start
        model.eval()
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    seen = cfg.steps * cfg.batch_size
    return TrainResult(
        model=model,
        model_config=prepared.model_config,
        train_config=cfg,
        normalizer=prepared.normalizer,
        inputs=prepared.inputs,
        labels=prepared.label_names,
        loss_curve=interval_means(curve, cfg.log_every),
        model_digest=model_digest(model),
        samples=len(data),
        samples_seen=seen,
        duration_s=duration,
        samples_per_s=seen / duration if duration > 0 else float("inf"),
        device=str(device),
        step_ms=duration / cfg.steps * 1e3,
        peak_mem_gb=peak,
    )


def interval_means(per_step: np.ndarray, every: int) -> list[float]:
    """The loss curve: mean of each run of `every` steps (the last run may be shorter)."""
    starts = np.arange(0, len(per_step), every)
    counts = np.diff(np.append(starts, len(per_step)))
    return (np.add.reduceat(np.asarray(per_step, np.float64), starts) / counts).tolist()


# ---------------------------------------------------------------- inference and persistence

# Windows a forward of `predict`. On a CPU a batch's activations should stay in cache:
# one thread, the default model (d_model 32, window 32) on 18,000 rows took 1.84 CPU-s
# in batches of 4096, 1.03 s in 256 (d 64/window 64: 3.07 -> 1.62 s; d 128/window 128,
# 4 layers: 7.26 -> 5.34 s), the same predictions (2026-12-05, this 2-core VM). Prediction
# was the largest compute of the test suite (each research run's simulation, the promotion
# gate, backtests). A GPU wants the large batch.
CPU_BATCH = 256
DEVICE_BATCH = 4096


def predict(
    result: TrainResult,
    table: pa.Table,
    inputs: Sequence[str] | None = None,
    batch_size: int | None = None,
) -> np.ndarray:
    """Predictions in bps for every row of a feature table: [rows, n_outputs] float64.

    Each row is the anchor of its own window; the first rows of the day get shorter,
    left-padded windows, exactly as in training. Eager float32, padded, `batch_size`
    windows a forward (default: CPU_BATCH on a CPU, DEVICE_BATCH elsewhere).
    """
    if inputs is not None and list(inputs) != result.inputs:
        raise ValueError(f"inputs {list(inputs)} differ from the model's inputs {result.inputs}")
    n, window = table.num_rows, result.train_config.window
    model = result.model.eval()
    device = next(model.parameters()).device
    if batch_size is None:
        batch_size = CPU_BATCH if device.type == "cpu" else DEVICE_BATCH
    features = result.normalizer.apply_inputs(column_matrix(table, result.inputs))
    feats_t = torch.from_numpy(
        np.concatenate([features, np.zeros((1, features.shape[1]), np.float32)])
    ).to(device)
    offsets = torch.arange(1 - window, 1, device=device)  # [T]
    # fixed windows start at max(row - T + 1, 0): the mask is rows >= 0, as it always was
    starts = torch.from_numpy(window_starts(table, result.train_config)).to(device)  # [rows]
    out = np.empty((n, result.model_config.n_outputs), np.float32)
    with torch.no_grad(), torch_threads(result.train_config.num_threads):
        for start in range(0, n, batch_size):  # one iteration per batch of rows
            stop = min(n, start + batch_size)
            rows = torch.arange(start, stop, device=device)[:, None] + offsets  # [B, T]
            mask = rows >= starts[start:stop, None]
            x = feats_t[torch.where(mask, rows, n)]  # [B, T, F]; n is the zero row
            out[start:stop] = model(x, mask).float().cpu().numpy()
    return result.normalizer.unscale_labels(out)


# TrainResult's measured figures a saved model keeps (absent from models saved before them)
MEASURED = (
    "steady_samples_per_s", "step_ms", "warmup_s", "gpu_util", "peak_mem_gb", "ladder_result",
)  # fmt: skip


def save_model(result: TrainResult, url: str | os.PathLike) -> None:
    """torch.save of the state dict, configs, normalizer and metadata to a local path or
    an object-store URL, atomically (storage.write_bytes_atomic)."""
    storage.write_bytes_atomic(os.fspath(url), model_bytes(result))


def model_bytes(result: TrainResult) -> bytes:
    """What save_model stores: torch.save of the state dict, configs, normalizer and
    metadata."""
    payload = {
        "format": 1,
        "state_dict": {k: v.detach().cpu() for k, v in result.model.state_dict().items()},
        "model_config": asdict(result.model_config),
        "train_config": asdict(result.train_config),
        "normalizer": result.normalizer.to_dict(),
        "inputs": list(result.inputs),
        "labels": list(result.labels),
        "loss_curve": list(result.loss_curve),
        "model_digest": result.model_digest,
        "samples": result.samples,
        "samples_seen": result.samples_seen,
        "duration_s": result.duration_s,
        "samples_per_s": result.samples_per_s,
        "device": result.device,
        **{k: getattr(result, k) for k in MEASURED},
    }
    payload["rungs"] = list(result.rungs)
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    return buffer.getvalue()


def stored_model(url: str | os.PathLike) -> dict:
    """What save_model stored besides the weights (configs, digest, rungs, figures),
    without building the model or checking its weights: load_model does both."""
    payload = torch.load(io.BytesIO(storage.read_bytes(os.fspath(url))), map_location="cpu",
                         weights_only=True)  # fmt: skip
    payload.pop("state_dict")
    return payload


def load_model(url: str | os.PathLike, device: str = "cpu") -> TrainResult:
    """Inverse of save_model (a local path or an object-store URL); the model comes back
    in eval mode on `device`.

    Raises ValueError if the weights do not match the stored digest.
    """
    path = os.fspath(url)
    data = io.BytesIO(storage.read_bytes(path))
    payload = torch.load(data, map_location="cpu", weights_only=True)
    model_cfg = ModelConfig(**payload["model_config"])
    model = OrderBookNet(model_cfg)
    model.load_state_dict(payload["state_dict"])
    digest = model_digest(model)
    if digest != payload["model_digest"]:
        raise ValueError(f"{path}: weights digest {digest} != stored {payload['model_digest']}")
    return TrainResult(
        model=model.to(resolve_device(device)).eval(),
        model_config=model_cfg,
        train_config=TrainConfig(**payload["train_config"]),
        normalizer=Normalizer.from_dict(payload["normalizer"]),
        inputs=list(payload["inputs"]),
        labels=list(payload["labels"]),
        loss_curve=list(payload["loss_curve"]),
        model_digest=digest,
        samples=payload["samples"],
        samples_seen=payload["samples_seen"],
        duration_s=payload["duration_s"],
        samples_per_s=payload["samples_per_s"],
        device=payload["device"],
        rungs=tuple(payload.get("rungs", ())),  # models saved before the trainer had none
        **{k: payload.get(k) for k in MEASURED},
    )
