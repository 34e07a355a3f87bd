"""The ladder's workload: variable-length clock-time windows over the Parquet feature store.

Synthetic order-book days (tasks.synthetic) -> features (tasks.features) -> one Parquet
file per (product, date) -> read back. A window is every event of the last `window_s`
seconds before its anchor, capped at `max_len` events, so event counts differ from
window to window (from a handful in a quiet regime to the cap in a busy one).

Batches are built on the host each step from the feature matrix read from the store,
in one of two layouts:
  padded  x [B, T, F], mask [B, T], y [B, L]     (T = max_len, windows right-aligned)
  packed  x [R, T, F], pos [R, T], seg [R, T], last [B], count [B], y [B, L]
          (windows first-fit-decreasing into R rows of T events; R is the most rows any
          step of the run needs, so the shape is static and CUDA graphs still apply)
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from quantloop.profiling.config import LadderConfig
from quantloop.tasks.data.synthetic import SyntheticConfig, generate_day
from quantloop.tasks.engine import storage
from quantloop.tasks.research.features import FeatureParams, compute_features, feature_set
from quantloop.tasks.research.training import Normalizer, clock_window_starts, column_matrix

START_DATE = dt.date(2026, 3, 2)
PAD_SEG = -1  # seg of the positions past T that fill a row's last, partial sparse block
STORE_PATH = "{root}/features-{key}/product={product}/date={date}.parquet"


# ---------------------------------------------------------------- the feature store


def write_store(cfg: LadderConfig, root: str) -> list[str]:
    """Generate `cfg.n_days` synthetic days, compute features, write one Parquet file each."""
    synth = SyntheticConfig(seed=cfg.seed, events_per_day=cfg.events_per_day, signal=cfg.signal)
    params = feature_params(cfg)
    # the data's knobs name the folder: a store written with other settings is never reused
    key = f"s{cfg.seed}-n{cfg.events_per_day}-sig{cfg.signal:g}-h" + "_".join(
        map(str, cfg.label_horizons)
    )
    urls = []
    for i in range(cfg.n_days):
        date = START_DATE + dt.timedelta(days=i)
        url = STORE_PATH.format(root=root, key=key, product=cfg.product, date=date.isoformat())
        if not storage.exists(url):  # written atomically: existing means complete
            book = generate_day(cfg.product, date, synth)
            storage.write_parquet_atomic(url, compute_features(book, params))
        urls.append(url)
    return urls


def feature_params(cfg: LadderConfig) -> FeatureParams:
    return FeatureParams(label_horizons=cfg.label_horizons)


def next_move(mid: np.ndarray) -> np.ndarray:
    """[rows] +1/-1: the direction of the mid's next change after each row; NaN if none."""
    change = np.flatnonzero(np.diff(mid) != 0)  # the mid changes between row c and c + 1
    first = np.searchsorted(change, np.arange(len(mid)))  # first change at or after row i
    out = np.full(len(mid), np.nan)
    ok = first < len(change)
    c = change[first[ok]]
    out[ok] = np.sign(mid[c + 1] - mid[c])
    return out


def label_names(cfg: LadderConfig) -> list[str]:
    if cfg.target == "next_move":
        return ["next_move"]
    return list(feature_set(feature_params(cfg)).labels)


def label_matrix(table: pa.Table, cfg: LadderConfig) -> np.ndarray:
    """[rows, L] float32 labels of one day in their own units (direction, or bps)."""
    if cfg.target == "next_move":
        mid = table.column("mid").to_numpy(zero_copy_only=False).astype(np.float64)
        return next_move(mid).astype(np.float32)[:, None]
    return column_matrix(table, label_names(cfg))


# ---------------------------------------------------------------- the dataset


@dataclass(kw_only=True, slots=True)
class Windows:
    """Windows as [start, end] row ranges (inclusive) into Workload.features.

    start and end are kept as contiguous int64 and the lengths computed once: the loader
    thread reads them for every batch, and a research run's ends arrive as a column of its
    [N, T] window index (a stride of T * 8 bytes). Derived through that view for every
    batch, the lengths cost 1.2 ms a batch on a 2-core VM (0.2 ms from contiguous arrays),
    more than the H200's whole step (bench/loader.py)."""

    start: np.ndarray  # [N] int64
    end: np.ndarray  # [N] int64, the anchor row
    lengths: np.ndarray = field(init=False)  # [N] int64, end - start + 1

    def __post_init__(self) -> None:
        self.start = np.ascontiguousarray(self.start, np.int64)
        self.end = np.ascontiguousarray(self.end, np.int64)
        self.lengths = self.end - self.start + 1

    def __len__(self) -> int:
        return len(self.end)


@dataclass(kw_only=True, slots=True)
class TrainingSet:
    """What the batch makers read: the feature matrix, the windows, their labels, the
    order of every step's batch and its packing plan. The ladder's Workload is one; a
    research run's prepared data makes another (profiling.trainer)."""

    features: np.ndarray  # [rows + 1, F] float32 standardized; last row zeros (padding)
    train: Windows  # training windows
    labels: np.ndarray  # [N, L] float32 standardized labels of the training windows
    order: np.ndarray  # [steps, B] training window per step and slot (fixed by the seed)
    max_len: int
    pack_row: np.ndarray  # [steps, B] row of each window when the step's batch is packed
    pack_off: np.ndarray  # [steps, B] its first position in that row
    pack_rows: int  # R: rows of max_len events that hold any step's batch, packed

    @property
    def pad_row(self) -> int:
        return len(self.features) - 1

    @property
    def n_features(self) -> int:
        return self.features.shape[1]

    @classmethod
    def planned(
        cls,
        *,
        features: np.ndarray,
        train: Windows,
        labels: np.ndarray,
        order: np.ndarray,
        max_len: int,
        packing: bool = True,
        rows_on_grid: bool = False,
    ) -> TrainingSet:
        """With every step's packing plan fixed up front (or none, if not packing);
        rows_on_grid: plan_packing's."""
        plan = plan_packing(train.lengths, order, max_len, packing, rows_on_grid)
        return cls(features=features, train=train, labels=labels, order=order, max_len=max_len,
                   **plan)  # fmt: skip


def plan_packing(
    lengths: np.ndarray, order: np.ndarray, max_len: int, packing: bool, rows_on_grid: bool = False
) -> dict:
    """pack_row, pack_off, pack_rows of TrainingSet: the sampler's packing plan, fixed with
    the order before training starts (zeros and one row when not packing). rows_on_grid:
    pack_rows rounded up by rows_grid, so that another order (seed) of the same windows
    gives the same batch shape."""
    if not packing:
        zeros = np.zeros(order.shape, np.int64)
        return {"pack_row": zeros, "pack_off": zeros, "pack_rows": 1}
    pack_row, pack_off = pack_plans(lengths[order], max_len)
    rows = int(pack_row.max()) + 1
    return {
        "pack_row": pack_row,
        "pack_off": pack_off,
        "pack_rows": rows_grid(rows) if rows_on_grid else rows,
    }


def rows_grid(rows: int) -> int:
    """`rows` rounded up to a step of an eighth of the power of two below it (75 -> 80,
    150 -> 160, 12 -> 12): at most an eighth more rows, all padding.

    The packed batch's row count is a compiled shape, and the plan's own count depends on
    the batch order: on the H200 research workload seeds 0-29 planned 75 to 77 rows and
    seeds 100-102 76, 75 and 78, so a run that changed only its seed compiled its step again
    (16 s of warm-up instead of 3 s with the compiled kernels cached,
    bench/results/turnaround-h200-overlap.log). On the grid they all train on 80 rows and
    find their kernels; a plan on the far side of a step compiles once more."""
    step = 1 << max(rows.bit_length() - 4, 0)
    return -(-rows // step) * step


@dataclass(kw_only=True, slots=True)
class Workload(TrainingSet):
    """The ladder's training set with its held-out day and what evaluation reads."""

    test: Windows  # one window per event of the held-out day
    test_table: pa.Table  # the held-out day's feature table (for the replay simulation)
    threshold: Windows  # a subsample of training events: the trade threshold's quantile
    normalizer: Normalizer
    label_names: list[str]
    test_labels: np.ndarray  # [test rows, L] the held-out day's labels, own units (NaN: none)


def _finite_stats(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    x = x.astype(np.float64)
    ok = np.isfinite(x)
    n = np.maximum(ok.sum(0), 1)
    mean = np.where(ok, x, 0.0).sum(0) / n
    std = np.sqrt((np.where(ok, x - mean, 0.0) ** 2).sum(0) / n)
    return mean, np.where(std > 1e-12, std, 1.0)


def build_workload(cfg: LadderConfig, root: str) -> Workload:
    """Write (or reuse) the store under `root`, read it back, cut windows, fix the order."""
    tables = [storage.read_parquet(url) for url in write_store(cfg, root)]
    inputs, names = feature_set(feature_params(cfg)).inputs, label_names(cfg)
    train_tables, test_table = tables[:-1], tables[-1]

    feats, starts, ends, ys, thr_s, thr_e = [], [], [], [], [], []
    offset = 0
    for table in train_tables:  # one iteration per day
        x, y = column_matrix(table, inputs), label_matrix(table, cfg)
        start = clock_window_starts(
            table.column("time").to_numpy().astype(np.float64), cfg.window_s, cfg.max_len
        )
        anchors = np.arange(0, table.num_rows, cfg.stride)
        anchors = anchors[np.isfinite(y[anchors]).all(axis=1)]
        starts.append(start[anchors] + offset)
        ends.append(anchors + offset)
        ys.append(y[anchors])
        every = np.arange(0, table.num_rows, cfg.threshold_stride)
        thr_s.append(start[every] + offset)
        thr_e.append(every + offset)
        feats.append(x)
        offset += table.num_rows
    x_test = column_matrix(test_table, inputs)
    test_start = clock_window_starts(
        test_table.column("time").to_numpy().astype(np.float64), cfg.window_s, cfg.max_len
    )
    feats.append(x_test)

    raw = np.concatenate(feats)
    labels = np.concatenate(ys)
    input_mean, input_std = _finite_stats(raw[:offset])  # training rows only
    label_mean, label_std = _finite_stats(labels)
    normalizer = Normalizer(
        input_mean=input_mean, input_std=input_std, label_mean=label_mean, label_std=label_std
    )
    features = np.concatenate(
        [normalizer.apply_inputs(raw), np.zeros((1, len(inputs)), np.float32)]
    )
    train = Windows(start=np.concatenate(starts), end=np.concatenate(ends))
    rng = np.random.default_rng(cfg.seed)
    need = cfg.steps * cfg.batch_size
    order = np.concatenate([rng.permutation(len(train)) for _ in range(-(-need // len(train)))])
    order = order[:need].reshape(cfg.steps, cfg.batch_size)
    return Workload(
        features=features,
        train=train,
        labels=normalizer.scale_labels(labels),
        order=order,
        test=Windows(start=test_start + offset, end=np.arange(len(x_test)) + offset),
        test_table=test_table,
        threshold=Windows(start=np.concatenate(thr_s), end=np.concatenate(thr_e)),
        normalizer=normalizer,
        label_names=names,
        test_labels=label_matrix(test_table, cfg),
        max_len=cfg.max_len,
        **plan_packing(train.lengths, order, cfg.max_len, packing=True),
    )


# ---------------------------------------------------------------- padded batches


def padded_index(
    w: Windows, which: np.ndarray, T: int, pad_row: int
) -> tuple[np.ndarray, np.ndarray]:
    """idx [B, T] into the feature matrix (pad_row on padding), mask [B, T]; right-aligned."""
    rows = w.end[which, None] + np.arange(1 - T, 1)[None, :]
    mask = rows >= w.start[which, None]
    return np.where(mask, rows, pad_row), mask


def padded_batch(work: TrainingSet, step: int, out: dict[str, np.ndarray] | None = None) -> dict:
    """The step's padded batch, freshly gathered from the feature matrix (or into `out`)."""
    which = work.order[step]
    idx, mask = padded_index(work.train, which, work.max_len, work.pad_row)
    if out is None:
        return {"x": work.features[idx], "mask": mask, "y": work.labels[which]}
    np.take(work.features, idx, axis=0, out=out["x"])
    out["mask"][...] = mask
    np.take(work.labels, which, axis=0, out=out["y"])
    return out


def padded_spec(work: TrainingSet, batch_size: int) -> dict[str, tuple[tuple[int, ...], str]]:
    B, T, F, L = batch_size, work.max_len, work.n_features, work.labels.shape[1]
    return {"x": ((B, T, F), "float32"), "mask": ((B, T), "bool"), "y": ((B, L), "float32")}


# ---------------------------------------------------------------- packed batches


def pack_plan(lengths: np.ndarray, T: int) -> tuple[np.ndarray, np.ndarray]:
    """First-fit decreasing: (row, offset) of each window in rows of T events."""
    row, off = np.empty(len(lengths), np.int64), np.empty(len(lengths), np.int64)
    free = np.zeros(0, np.int64)  # events used per open row
    for i in np.argsort(-lengths, kind="stable"):  # one iteration per window of one batch
        fits = np.flatnonzero(free + lengths[i] <= T)
        r = int(fits[0]) if len(fits) else len(free)
        if r == len(free):
            free = np.append(free, 0)
        row[i], off[i] = r, free[r]
        free[r] += lengths[i]
    return row, off


def pack_plans(lengths: np.ndarray, T: int) -> tuple[np.ndarray, np.ndarray]:
    """pack_plan of every batch at once: lengths [S, B] (a row per step's batch) ->
    (row, offset), each [S, B], the same as pack_plan gives row by row.

    The windows of rank k (k-th longest, ties in batch order) of all S batches are placed
    together, so the Python loop runs B times, not S * B: 1.0-1.6 s of an H200 research
    run's train stage with 1,000 steps of 256 windows went to pack_plan's loop."""
    S, B = lengths.shape
    rank = np.argsort(-lengths, axis=1, kind="stable")
    ranked = np.take_along_axis(lengths, rank, axis=1)
    used = np.zeros((S, B), np.int64)  # events used per row; a batch opens at most B rows
    opened = np.zeros(S, np.int64)  # rows open per batch
    row, off = np.empty((S, B), np.int64), np.empty((S, B), np.int64)
    batches, cols = np.arange(S), np.arange(B)
    for k in range(B):  # one iteration per rank, over every batch
        n = max(int(opened.max()), 1)  # argmax needs a column; cols < opened masks it
        fits = (used[:, :n] + ranked[:, k, None] <= T) & (cols[:n] < opened[:, None])
        found = fits.any(axis=1)
        r = np.where(found, fits.argmax(axis=1), opened)  # the first row it fits, or a new one
        off[:, k] = used[batches, r]
        used[batches, r] += ranked[:, k]
        row[:, k] = r
        opened += ~found
    out_row, out_off = np.empty_like(row), np.empty_like(off)
    np.put_along_axis(out_row, rank, row, axis=1)
    np.put_along_axis(out_off, rank, off, axis=1)
    return out_row, out_off


def pack_fields(
    starts: np.ndarray,
    lengths: np.ndarray,
    row: np.ndarray,
    off: np.ndarray,
    T: int,
    R: int,
    pad_row: int,
) -> dict[str, np.ndarray]:
    """Windows (first feature row, length) placed at (row, off) of R rows of T events.

    src = feature row of each position (pad_row on padding), seg = slot of the window in the
    batch (B on padding), pos = events before the window's anchor (the model's positional
    index), last = flat index of each anchor, count = length.
    """
    B = len(lengths)
    # token k of window b sits at flat index row*T + off + k and reads feature row start + k
    slot = np.repeat(np.arange(B), lengths)
    k = np.arange(lengths.sum()) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    flat = row[slot] * T + off[slot] + k
    src = np.full(R * T, pad_row, np.int64)
    src[flat] = starts[slot] + k
    seg = np.full(R * T, B, np.int64)
    seg[flat] = slot
    pos = np.zeros(R * T, np.int64)
    pos[flat] = lengths[slot] - 1 - k
    return {
        "src": src,
        "seg": seg.reshape(R, T),
        "pos": pos.reshape(R, T),
        "last": row * T + off + lengths - 1,
        "count": lengths.astype(np.float32),
    }


def packed_batch(
    work: TrainingSet, step: int, out: dict[str, np.ndarray] | None = None, mask_block: int = 0
) -> dict:
    """The step's windows packed into [R, T] rows, same windows and order as padded_batch.

    mask_block > 0 (rung 12, loader_mask): also FlexAttention's block lists for blocks of
    that many events (kv_num, kv_idx: window_block_lists), so the device does not build
    them each step."""
    which = work.order[step]
    T, R = work.max_len, work.pack_rows
    fields = pack_fields(
        work.train.start[which], work.train.lengths[which], work.pack_row[step],
        work.pack_off[step], T, R, work.pad_row,
    )  # fmt: skip
    if mask_block:
        fields["kv_num"], fields["kv_idx"] = window_block_lists(fields["seg"], mask_block)
    src = fields.pop("src")
    if out is None:
        return {"x": work.features[src].reshape(R, T, -1), **fields, "y": work.labels[which]}
    np.take(work.features, src, axis=0, out=out["x"].reshape(R * T, -1))
    for name, value in fields.items():
        out[name][...] = value
    np.take(work.labels, which, axis=0, out=out["y"])
    return out


def window_block_lists(seg: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Which key blocks each query block of a packed row needs: kv_num [R, 1, n] and
    kv_idx [R, 1, n, n] (int32) for n = ceil(T / block) blocks; BlockMask's layout, and the
    same lists as packing.window_blocks computes on the device.

    Windows are contiguous runs of one seg value (padding, the tail, is one run too), so
    the keys a query block needs run from the start of the run holding its first position
    to the end of the run holding its last one: one contiguous range of key blocks, listed
    first; the rest of a row of kv_idx repeats the last block (never read). The runs are
    found once over the flat batch and each block's two ends looked up in them:
    bench/loader.py measured the lists at +0.06 ms a batch on a 2-core VM, against +0.25 ms
    for running max/min over every position (as window_blocks does on the device).
    """
    n = -(-seg.shape[1] // block)
    if n * block != seg.shape[1]:  # a partial last block: the rest is a run of its own
        seg = np.pad(seg, ((0, 0), (0, n * block - seg.shape[1])), constant_values=PAD_SEG)
    R, T = seg.shape
    flat = seg.reshape(-1)
    new = np.empty(R * T, dtype=bool)  # a run starts here
    new[0] = True
    np.not_equal(flat[1:], flat[:-1], out=new[1:])
    new[::T] = True  # runs never cross rows
    starts = np.flatnonzero(new)
    ends = np.append(starts[1:] - 1, R * T - 1)
    base = (np.arange(R) * T)[:, None]
    first = base + np.arange(0, T, block)  # [R, n] each query block's first position
    lo = (starts[np.searchsorted(starts, first, side="right") - 1] - base) // block
    last = first + block - 1
    hi = (ends[np.searchsorted(starts, last, side="right") - 1] - base) // block
    num = (hi - lo + 1).astype(np.int32)[:, None]
    idx = np.minimum(lo[..., None] + np.arange(n), n - 1).astype(np.int32)[:, None]
    return num, idx


def packed_spec(
    work: TrainingSet, batch_size: int, mask_block: int = 0
) -> dict[str, tuple[tuple[int, ...], str]]:
    B, T, R, F, L = batch_size, work.max_len, work.pack_rows, work.n_features, work.labels.shape[1]
    spec = {
        "x": ((R, T, F), "float32"),
        "seg": ((R, T), "int64"),
        "pos": ((R, T), "int64"),
        "last": ((B,), "int64"),
        "count": ((B,), "float32"),
        "y": ((B, L), "float32"),
    }
    if mask_block:
        n = -(-T // mask_block)
        spec |= {"kv_num": ((R, 1, n), "int32"), "kv_idx": ((R, 1, n, n), "int32")}
    return spec
