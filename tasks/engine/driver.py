"""The driver's side: find a plan's cache hits, send the rest to Dask in batches sized
as the run goes, and put every node's manifest row back in plan order."""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from quantloop.tasks.engine import storage
from quantloop.tasks.engine.batch import batch_seconds, run_batch, run_batch_ipc
from quantloop.tasks.engine.plan import NodeKind
from quantloop.tasks.engine.reasons import explain
from quantloop.tasks.engine.records import MANIFEST_SCHEMA, RunSummary, manifest_rows
from quantloop.tasks.engine.sizing import IN_FLIGHT_PER_WORKER, batch_size, typical_node_s
from quantloop.tasks.engine.store import HISTORY_COLUMNS, NodeStore, product_range


@dataclass(frozen=True, slots=True)
class RunResult:
    """One plan's run: every node's manifest row, in plan order, and the counts."""

    manifest: pa.Table
    nodes: int
    cache_hits: int
    computed: int
    failed: int
    wall_s: float
    batch_size: int = 0  # the largest batch (nodes per Dask task)
    batches: int = 0  # Dask tasks

    @property
    def failures(self) -> list[str]:
        failed = self.manifest.filter(pc.equal(self.manifest["status"], "failed"))
        return failed["error"].to_pylist()

    def summary(self) -> RunSummary:
        return RunSummary.of(
            self.manifest, nodes=self.nodes, cache_hits=self.cache_hits,
            computed=self.computed, failed=self.failed, wall_s=self.wall_s,
            batch_size=self.batch_size, batches=self.batches,
        )  # fmt: skip


def run_nodes(
    kind: NodeKind,
    params: Mapping[str, dict],
    plan: pa.Table,
    store: NodeStore,
    *,
    client: Any | None = None,
    connect: Callable[[], Any] | None = None,
    site: str = "local",
    progress: Callable[[int, int], None] | None = None,
    priority: int = 0,
    verify_hits: bool = True,
    inline_below_s: float = 0.0,
    unknown_s_per_mb: float | None = None,
    no_workers_timeout_s: float | None = None,
) -> RunResult:
    """Run the nodes of a plan (NODES_SCHEMA) that are not cached; returns the manifest
    of all of them.

    The plan's keys are looked up in the index segments of its products only (a
    shard's, not the whole index), reading first only what a hit's row takes; the
    history that explains the others is read only if some node must run.
    params: parameter dicts by their digest (the plan's "params"); products may differ.
    client: a `distributed.Client` (the site's cluster); or connect() -> one, called
      only if a node must run; neither: in-process.
    progress(done, total) is called as batches finish.
    priority: the Dask priority of the plan's batches (higher runs first). Plans run
      side by side (a flow's shards) given falling priorities end one after the other,
      each next one filling the last one's tail, instead of sharing the workers evenly
      and ending together.
    verify_hits: before a hit counts, read its stored bytes (each pack file once) and
      check their length and sha256 against the index row; a hit whose bytes fail or
      are gone is dropped from the index and recomputed, its reason "corrupt" or
      "missing": a damaged output is never counted a hit. On by default (bench/
      cache_check.py: ~1 ms per MB of output here; the default research run's 12 hits
      add tens of ms); off, a hit is trusted unread until something reads it (which
      checks it) or `quantloop verify` does, which the 10^5-10^6-node scale benches
      measure both ways (docs/scale.md).
    inline_below_s: with `connect` (a cluster to start), run in-process instead when the
      nodes to run are expected, from the kind's history, to take less than this many
      seconds in all: less than starting and stopping the cluster would (a LocalCluster
      of 2 workers: 2.7 s here). Unknown work (no history) goes to the cluster, unless
      `unknown_s_per_mb` is given: then its expected work is the nodes' input bytes
      (the plan's "length", all of them known) times that many seconds per MB.
    no_workers_timeout_s: while batches are in flight, a cluster whose scheduler reports
      no workers for longer than this ends the wait: NoWorkers, carrying the manifest
      rows finished so far and the plan rows not run. None: wait as long as Dask does.
    """
    t0 = time.perf_counter()
    total = plan.num_rows
    segments = store.segments(kind.name) if total else []
    keys = plan["key"].combine_chunks()
    found = store.lookup(kind.name, plan, segments=segments)
    hit = pc.is_valid(found["key"])
    damaged: dict[str, str] = {}
    if verify_hits and pc.any(hit).as_py():
        damaged = check_outputs(found.filter(hit))
        if damaged:
            bad = pc.is_in(plan["key"], value_set=pa.array(list(damaged), pa.string()))
            dropped = plan.filter(bad)
            for reason in set(damaged.values()):
                mine = pa.array([k for k, r in damaged.items() if r == reason], pa.string())
                these = dropped.filter(pc.is_in(dropped["key"], value_set=mine))
                columns = ["key", "kind", "product", "date", "code", "params"]
                store.drop(kind.name, these.select(columns).append_column(
                    "inputs", these["digest"]), reason)  # fmt: skip
            hit = pc.and_(hit, pc.invert(bad))
    todo, parts, cached = plan, [], 0
    if pc.any(hit).as_py():
        todo, hit_plan = plan.filter(pc.invert(hit)), plan.filter(hit)
        # Each hit node gets its own row, from its plan row and its key's index row:
        # two partitions with identical content share a key and an output, not a row.
        found = found.filter(hit)
        no_errors = [""] * hit_plan.num_rows
        parts.append(manifest_rows(hit_plan, found, site, cache_hit=True, reason=no_errors,
                                   errors=no_errors))  # fmt: skip
        cached = hit_plan.num_rows
    done = cached
    size = batches_run = 0
    if todo.num_rows:
        history = store.rows(kind.name, product_range(plan), HISTORY_COLUMNS, segments=segments)
        reasons = explain(history, todo)
        if damaged:  # what re-hashing found says why, not the (unchanged) key
            why = [damaged.get(k) for k in todo["key"].to_pylist()]
            reasons = pa.array([w or r for w, r in zip(why, reasons.to_pylist(), strict=True)])
        todo = todo.append_column("reason", reasons)
        history_s = typical_node_s(history)
        del history
        if history_s is not None:
            expected_s = history_s * todo.num_rows
        elif unknown_s_per_mb is not None and todo["length"].null_count == 0:
            expected_s = unknown_s_per_mb * pc.sum(todo["length"]).as_py() / 1e6
        else:
            expected_s = None
        small = expected_s is not None and expected_s < inline_below_s
        if client is None and connect is not None and not small:
            client = connect()
        # Asked of the scheduler, not read from scheduler_info(): distributed 2026.8's
        # periodic refresh of that cache (n_workers=0) can empty its worker list under
        # a concurrent reader, and a shard that counts 0 workers submits nothing. With
        # no worker yet, batches are sized for one and wait in Dask's queue.
        workers = max(1, len(client.nthreads())) if client is not None else 1
        # Work per node: from the kind's history, then from this run's own batches
        # (whole task times over their nodes, so each task's fixed cost is included).
        measured_s, measured_n = 0.0, 0
        batches = _Batches(client, kind, params, store.root, site, priority,
                           no_workers_timeout_s)  # fmt: skip
        finished: list[pa.Table] = []
        pos = 0

        def submit_more() -> None:
            nonlocal pos, size
            while pos < todo.num_rows and batches.pending < workers * IN_FLIGHT_PER_WORKER:
                node_s = measured_s / measured_n if measured_n else history_s
                n = batch_size(todo.num_rows - pos, workers, node_s)
                batches.submit(todo.slice(pos, n))
                pos += n
                size = max(size, n)

        submit_more()
        if progress:  # after submitting: the workers start while this reports
            progress(done, total)
        try:
            for batch_rows in batches:
                finished.append(batch_rows)
                batches_run += 1
                measured_s += batch_seconds(batch_rows)
                measured_n += batch_rows.num_rows
                submit_more()
                done += batch_rows.num_rows
                if progress:
                    progress(done, total)
        except NoWorkers as exc:  # what finished is stored and indexed; the rest is not run
            rows = [*parts, *batches.in_order(finished)]
            exc.finished = (pa.concat_tables([r.replace_schema_metadata(None) for r in rows])
                            if rows else MANIFEST_SCHEMA.empty_table())  # fmt: skip
            exc.pending = pa.concat_tables([*batches.unfinished(), todo.slice(pos)]
                                           ).drop_columns(["reason"])  # fmt: skip
            raise
        # in plan order, whatever order the batches finished in
        parts.append(pa.concat_tables(batches.in_order(finished)).replace_schema_metadata(None))
    elif progress:
        progress(done, total)
    manifest = pa.concat_tables(parts) if parts else MANIFEST_SCHEMA.empty_table()
    if cached and todo.num_rows:  # hits and computed rows together, in plan order
        manifest = manifest.take(pc.sort_indices(pc.index_in(manifest["key"], value_set=keys)))
    failed = pc.sum(pc.equal(manifest["status"], "failed")).as_py() or 0
    return RunResult(
        manifest=manifest,
        nodes=total,
        cache_hits=cached,
        computed=total - cached - failed,
        failed=failed,
        wall_s=time.perf_counter() - t0,
        batch_size=size,
        batches=batches_run,
    )


def check_outputs(rows: pa.Table) -> dict[str, str]:
    """Re-hash the stored outputs of index rows (HIT_COLUMNS): {key: "corrupt" or
    "missing"} for those that fail. Each pack file is fetched once."""
    reader = storage.BlobReader()
    bad: dict[str, str] = {}
    for row in rows.to_pylist():
        blob = storage.Blob(row["output_url"], row["output_offset"], row["output_length"],
                            row["output_digest"])  # fmt: skip
        try:
            reader.read(blob)
        except FileNotFoundError:
            bad[row["key"]] = "missing"
        except (ValueError, OSError) as exc:
            bad[row["key"]] = "missing" if "No such file" in str(exc) else "corrupt"
    return bad


class BatchFailed(RuntimeError):
    """A batch task failed as a whole on a site's cluster (its workers kept dying, the
    store could not be written): node failures are recorded per node instead."""


# How often a wait for batches asks the scheduler for its workers (when none finished).
NO_WORKERS_POLL_S = 0.5


class NoWorkers(ConnectionError):
    """A site's scheduler had no workers for longer than its setting while batches were
    in flight. `finished`: the manifest rows of the nodes done (cache hits, batches that
    finished: stored and indexed); `pending`: the plan rows not run (set by run_nodes)."""

    def __init__(self, message: str, site: str | None = None):
        super().__init__(message)
        self.site = site  # the site's name
        self.finished: pa.Table | None = None
        self.pending: pa.Table | None = None


class _Batches:
    """Batches in flight on a Dask cluster (or run in-process without a client, each
    when the iteration reaches it); iterating yields manifest rows as batches finish,
    and more may be submitted meanwhile. With `no_workers_timeout_s`, a wait in which
    the scheduler reports no workers for longer than that raises NoWorkers (and cancels
    the batches in flight: nothing of them is kept, as with a batch that failed)."""

    def __init__(self, client, kind: NodeKind, params: Mapping[str, dict], root: str, site: str,
                 priority: int = 0, no_workers_timeout_s: float | None = None):  # fmt: skip
        self.client, self.kind, self.root, self.site = client, kind, root, site
        self.priority, self.no_workers_timeout_s = priority, no_workers_timeout_s
        self.params = dict(params)
        self._submitted = 0
        self._queue: list[tuple[int, pa.Table]] = []  # in-process: not run yet
        self._running: dict[Any, tuple[int, pa.Table]] = {}  # future -> (number, batch)
        self._finished: queue.SimpleQueue = queue.SimpleQueue()  # futures, as they finish
        self._done: list[int] = []  # submission numbers, in the order batches finished

    @property
    def pending(self) -> int:
        return len(self._queue) if self.client is None else len(self._running)

    def unfinished(self) -> list[pa.Table]:
        """The batches submitted and not finished, in submission order."""
        return [batch for _, batch in sorted(self._running.values(), key=lambda nb: nb[0])]

    def submit(self, batch: pa.Table) -> None:
        number, self._submitted = self._submitted, self._submitted + 1
        if self.client is None:
            self._queue.append((number, batch))
            return
        # kind and params travel inside each task (small); scattered data would be lost
        # with a dying worker, and the batch could not be retried elsewhere. A batch goes
        # as an IPC stream: pickling a slice of a table would send the whole table.
        future = self.client.submit(run_batch_ipc, self.kind, self.params,
                                    storage.arrow_bytes(batch), self.root, self.site,
                                    pure=False, priority=self.priority)  # fmt: skip
        self._running[future] = (number, batch)
        # Not distributed.wait: it waits through the default client, and a run holds
        # one client per site.
        future.add_done_callback(self._finished.put)

    def __iter__(self) -> Iterator[pa.Table]:
        if self.client is None:
            while self._queue:
                number, batch = self._queue.pop(0)
                self._done.append(number)
                yield run_batch(self.kind, self.params, batch, self.root, self.site)
            return
        while self._running:
            done = self._wait()
            for future in sorted(done, key=lambda f: self._running[f][0]):
                number, _ = self._running.pop(future)
                self._done.append(number)
                try:
                    rows = future.result()
                except Exception as exc:  # the batch's task itself failed, not a node in it
                    raise BatchFailed(
                        f"site {self.site}: a batch of {self.kind.name} nodes failed on the "
                        f"site's cluster: {type(exc).__name__}: {exc}"
                    ) from exc
                yield rows

    def _wait(self) -> set:
        """The batches in flight that have finished, once one has; meanwhile, every
        poll without one asks the scheduler how many workers it has."""
        limit = self.no_workers_timeout_s
        poll = None if limit is None else min(NO_WORKERS_POLL_S, limit / 4)
        since = None  # when the scheduler was first seen without workers
        while True:
            try:
                done = {self._finished.get(timeout=poll)}
            except queue.Empty:
                done = set()
            if done:
                while not self._finished.empty():
                    done.add(self._finished.get_nowait())
                return done & self._running.keys()
            if self.client.nthreads():
                since = None
                continue
            # the time the answer came, not the time it was asked: the scheduler may have
            # lost its workers while the call waited, and a clock started when it was sent
            # could say "no workers for 3.0 s" sooner than 3 s after they were lost (a
            # fresh clone's test measured 2.8 s from the kill to the end of a 3-s wait)
            now = time.monotonic()
            since = now if since is None else since
            if now - since > limit:
                self.client.cancel(list(self._running))
                raise NoWorkers(
                    f"site {self.site!r}: its Dask scheduler had no workers for "
                    f"{now - since:.1f} s (no_workers_timeout_s {limit:g}) with "
                    f"{len(self._running)} batches of {self.kind.name} nodes in flight",
                    self.site,
                )

    def in_order(self, finished: list[pa.Table]) -> list[pa.Table]:
        """The batches' rows (given in the order they finished) in submission order."""
        return [finished[i] for i in sorted(range(len(finished)), key=self._done.__getitem__)]
