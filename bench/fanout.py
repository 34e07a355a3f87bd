"""Fan-out benchmark: 100,000 feature nodes through quantloop's engine, against its peers.

    python bench/fanout.py                       # 200 products x 500 dates, ~3 minutes here
    python bench/fanout.py --scale 1m            # 1,000 x 1,000: 10^6 nodes, no peers
    python bench/fanout.py --scale 10k           # 100 x 100
    python bench/fanout.py --products 20 --dates 50 --out /tmp/fanout.json   # quick look

One process tree, one real Prefect server, one Dask LocalCluster (2 workers, as a
site's long-lived cluster: started once, outside the timings), the same synthetic
partitions and the same feature function for every row:

  (a) engine, cold        the `features` flow as `research` runs it (a stage flow in
                          a flow run): planning, keys, scheduling, packed writes,
                          index, manifest, MLflow record (median of 3 runs, each
                          from an empty node store)
  (a') top-level          the same cold run as a flow run of its own: Prefect's
                          heartbeat thread, joined at exit, adds up to 1 s
  (b) engine, no-op       the same flow again: everything is a cache hit
  (c) engine, 1 product   one product's feature parameters changed
  (d) raw Dask            `Client.map`, one Dask task per node (a sample)
  (e) Prefect, threads    one Prefect task per node, default thread runner (a sample)
  (f) Prefect, Dask       one Prefect task per node, prefect-dask's DaskTaskRunner (a sample)

(d)-(f) compute the same node (read the partition, check its digest, compute the
features, write the output atomically) one node per task; they run on a sample and
their rate is what the table reports (nodes/s does not depend on the node count
once a run is past its first seconds), so the larger scales leave them out
(--no-peers). Results: a table on stdout and a JSON file.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # `python bench/fanout.py` from a checkout: tests.servers

from bench.report import stamp  # noqa: E402

EVENTS_PER_PARTITION = 60  # a small day: the node is far smaller than Dask's per-task cost
# The driver's glibc malloc, set as Dask sets its workers' (MALLOC_TRIM_THRESHOLD_):
# with glibc's default dynamic mmap threshold, the MB-sized buffers of batches and
# their results end up on the heap once the first is freed, and a process that runs
# run after run kept ~0.1-0.3 GB more after each 10^6-node cold run (713 -> 918 MB
# after the second here, 0.7 -> 1.3 -> 1.5 GB peaks); fixed thresholds: 617 -> 751
# -> 695 MB. A deployment's flow run is a process of its own and does not accumulate.
MALLOC_THRESHOLDS = {"M_TRIM_THRESHOLD": (-1, 128 << 10), "M_MMAP_THRESHOLD": (-3, 128 << 10)}


def fix_malloc_thresholds() -> dict[str, int]:
    """glibc's trim and mmap thresholds fixed for this process (as the environment's
    MALLOC_TRIM_THRESHOLD_ / MALLOC_MMAP_THRESHOLD_ would at its start)."""
    import ctypes
    import ctypes.util

    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    return {name: value for name, (param, value) in MALLOC_THRESHOLDS.items()
            if libc.mallopt(param, value) == 1}  # fmt: skip


class RssSampler:
    """Peak resident memory of this process and all its descendants (Dask workers,
    the Prefect server), sampled every 0.2 s, with the split by role at the peak."""

    def __init__(self) -> None:
        import psutil

        self._proc = psutil.Process()
        self._stop = threading.Event()
        self.peak = 0
        self.peak_by_role: dict[str, int] = {}
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _role(self, p, cmd: str) -> str:
        return (
            "driver" if p.pid == self._proc.pid
            else "prefect_server" if "prefect" in cmd and "server" in cmd
            else "dask_worker" if "spawn_main" in cmd or "multiprocessing" in cmd
            else "other"
        )  # fmt: skip

    def _tree(self):
        """(process, role) of every live process in the tree."""
        import psutil

        for p in [self._proc, *self._proc.children(recursive=True)]:
            try:
                yield p, self._role(p, " ".join(p.cmdline()))
            except psutil.Error:
                continue

    def _run(self) -> None:
        import psutil

        while not self._stop.is_set():
            by_role: dict[str, int] = {}
            for p, role in self._tree():
                try:
                    by_role[role] = by_role.get(role, 0) + p.memory_info().rss
                except psutil.Error:
                    pass
            total = sum(by_role.values())
            if total > self.peak:
                self.peak, self.peak_by_role = total, by_role
            time.sleep(0.2)

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds so far of each process in the tree, by role."""
        import psutil

        out: dict[str, float] = {}
        for p, role in self._tree():
            try:
                t = p.cpu_times()
            except psutil.Error:
                continue
            out[role] = out.get(role, 0.0) + t.user + t.system
        return out

    @contextmanager
    def phase(self, results: dict, name: str):
        self.peak, self.peak_by_role = 0, {}
        before = self.cpu_seconds()
        yield
        after = self.cpu_seconds()
        time.sleep(0.25)
        results.setdefault(name, {})["peak_rss_mb"] = round(self.peak / 2**20, 1)
        results[name]["peak_rss_mb_by_role"] = {
            role: round(v / 2**20, 1) for role, v in self.peak_by_role.items()
        }
        results[name]["cpu_s"] = {
            role: round(after[role] - before.get(role, 0.0), 2) for role in after
        }

    def close(self) -> None:
        self._stop.set()


def one_node(kind, params: dict, node: dict, root: str) -> float:
    """The peers' unit of work: the engine's node (a row of its plan), alone in its task,
    its own file."""
    from quantloop.tasks.engine import storage

    t0 = time.perf_counter()
    blob = storage.Blob(node["url"], node["offset"], node["length"], node["digest"])
    table = storage.read_table(blob)
    values = params[node["params"]]
    out = kind.compute(table, kind.prepare(values) if kind.prepare else values)
    key = node["key"]
    url = storage.join(root, "single", kind.name, key[:2], f"{key}.arrows")
    storage.write_bytes_atomic(url, storage.arrow_bytes(out))
    return time.perf_counter() - t0


SCALES = {"10k": (100, 100), "100k": (200, 500), "1m": (1_000, 1_000)}  # products, dates


def land(catalog, root: str, products: range, dates: int) -> int:
    """Small partitions of these products x `dates` days; one generated session per
    product, cut into days, landed product by product (catalog.land_packed streams)."""
    from quantloop.tasks.data.schema import Partition
    from quantloop.tasks.data.synthetic import SyntheticConfig, generate_day

    cfg = SyntheticConfig(levels=2, events_per_day=EVENTS_PER_PARTITION * dates, seed=11)
    days = [dt.date(2024, 1, 1) + dt.timedelta(days=i) for i in range(dates)]

    def items():
        for p in products:
            name = f"P{p:03d}"
            session = generate_day(name, days[0], cfg)
            for i, day in enumerate(days):
                yield (
                    Partition(name, day),
                    session.slice(i * EVENTS_PER_PARTITION, EVENTS_PER_PARTITION),
                )

    return sum(catalog.land_packed("fanout", items(), root=root).values())


def _land_job(catalog_path: str, root: str, products: range, dates: int) -> int:
    from quantloop.tasks.data.catalog import Catalog

    return land(Catalog(catalog_path), root, products, dates)


def land_apart(catalog_path, root: str, products: int, dates: int, processes: int) -> int:
    """Land in processes of their own, a share of the products each: generating the
    sessions is most of it (~0.27 s per 60,000-event product here), and its heap is
    not the driver's to keep (nor the memory figures' to count)."""
    import multiprocessing

    from quantloop.tasks.data.catalog import Catalog

    catalog = Catalog(catalog_path)
    if catalog.table("fanout").num_rows == products * dates:
        return products * dates  # a --workdir landed before: the same partitions
    shares = [range(i, products, processes) for i in range(processes)]
    with multiprocessing.get_context("spawn").Pool(processes) as pool:
        landed = pool.starmap(_land_job, [(str(catalog_path), root, s, dates) for s in shares])
    return sum(landed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", choices=sorted(SCALES), default=None,
                        help="products x dates: 10k = 100 x 100, 100k = 200 x 500 (the "
                        "default), 1m = 1,000 x 1,000 (and --no-peers)")  # fmt: skip
    parser.add_argument("--products", type=int, default=200)
    parser.add_argument("--dates", type=int, default=500)
    parser.add_argument(
        "--no-peers", action="store_true", help="skip (d)-(f): per-node costs, not the total's"
    )
    parser.add_argument("--sample", type=int, default=2_000, help="nodes for (d) and (e)")
    parser.add_argument("--dask-runner-sample", type=int, default=300, help="nodes for (f)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--cold-repeats", type=int, default=3, help="cold runs of (a); the median is reported"
    )
    parser.add_argument(
        "--shard-size",
        type=int,
        default=None,
        help="nodes per Prefect shard task [default: the flow's]",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "fanout.json")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument(
        "--markdown",
        type=Path,
        default=None,
        help="only print the markdown table of an existing results file",
    )
    args = parser.parse_args()
    if args.scale:
        args.products, args.dates = SCALES[args.scale]
        args.no_peers = args.no_peers or args.scale != "100k"
        if args.out == parser.get_default("out") and args.scale != "100k":
            args.out = args.out.with_name(f"fanout-{args.scale}.json")
    if args.markdown:
        print(markdown(json.loads(args.markdown.read_text())))
        return

    from tests.servers import prefect_server  # the same launcher the tests use

    malloc = fix_malloc_thresholds() if platform.system() == "Linux" else {}
    work = args.workdir or Path(tempfile.mkdtemp(prefix="quantloop-fanout-"))
    work.mkdir(parents=True, exist_ok=True)
    rss = RssSampler()
    results: dict = {"driver_malloc": malloc}
    print(f"workdir {work}", flush=True)
    with prefect_server(work / "prefect") as api:
        # Set before Prefect is imported and before the Dask workers start, so every
        # process (the flows here, tasks on the workers) talks to this one server.
        os.environ["PREFECT_API_URL"] = api
        os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
        run(args, work, rss, results)
        # Logs and events still queued go out while the server is up, not at exit.
        from prefect.events.worker import EventsWorker
        from prefect.logging.handlers import APILogHandler

        APILogHandler().flush()
        EventsWorker.drain_all(timeout=10)
    rss.close()
    report(args, results)


def run(args, work: Path, rss: RssSampler, results: dict) -> None:
    from distributed import Client, LocalCluster
    from prefect import flow, task
    from prefect.task_runners import ThreadPoolTaskRunner
    from prefect_dask import DaskTaskRunner

    from quantloop.blocks.site import WORKER_PRELOAD, Site
    from quantloop.flows.features import features
    from quantloop.tasks.records import tracking
    from quantloop.tasks.research.features import FeatureParams
    from quantloop.tasks.research.stage import StageParams, plan_features
    from quantloop.tasks.runtime.workspace import Selection, Workspace

    params = FeatureParams(
        imbalance_levels=2, return_lags=(1, 5), vol_windows=(10,), ofi_window=10,
        label_horizons=(5, 10),
    )  # fmt: skip
    # Started as a site's workers are (infra/dask/site.sh): node code preloaded.
    with LocalCluster(
        n_workers=args.workers, threads_per_worker=1, dashboard_address=None, silence_logs=40,
        preload=list(WORKER_PRELOAD),
    ) as cluster:  # fmt: skip
        site = Site(name="bench", scheduler_address=cluster.scheduler_address,
                    storage_root=str(work / "store"))  # fmt: skip
        site.save("fanout-bench", overwrite=True)
        workspace = Workspace(home=str(work / "home"), site="fanout-bench", experiment="fanout")
        catalog = workspace.catalog()
        t0 = time.perf_counter()
        n = land_apart(catalog.path, site.root, args.products, args.dates, args.workers)
        results["setup"] = {"land_s": time.perf_counter() - t0, "nodes": n}
        print(f"landed {n} partitions in {results['setup']['land_s']:.1f} s", flush=True)
        selection = Selection(dataset="fanout")
        mlflow, experiment = tracking.client_for(workspace.resolve_tracking())  # warm the store
        parent = mlflow.create_run(experiment, run_name=f"fanout-{n}").info.run_id

        @flow(name="warm-up")
        def warm_up() -> None:  # the server's first flow run: not part of any timing
            pass

        warm_up()

        shard = {"shard_size": args.shard_size} if args.shard_size else {}

        def stage(product_features) -> StageParams:
            return StageParams(workspace=workspace, selection=selection, features=params,
                               product_features=product_features or {})  # fmt: skip

        @flow(name="fanout-research")
        def as_stage(product_features, verify_hits: bool) -> tuple:
            """The features flow as `research` runs it: a stage flow (its heartbeat
            thread ends with it: tasks/runtime/heartbeats.py)."""
            t = time.perf_counter()
            result = features(stage(product_features), parent_run_id=parent,
                              verify_hits=verify_hits, **shard)  # fmt: skip
            return result, time.perf_counter() - t

        def engine(
            name: str, product_features=None, *, top_level: bool = False, verify: bool = False
        ) -> None:
            with rss.phase(results, name):
                if top_level:  # a flow run of its own
                    t = time.perf_counter()
                    result = features(stage(product_features), parent_run_id=parent, **shard)
                    wall = time.perf_counter() - t
                else:
                    result, wall = as_stage(product_features, verify)
            compute_s = result.compute_s
            results[name].update(
                nodes=result.nodes, wall_s=wall, computed=result.computed,
                cache_hits=result.cache_hits, failed=result.failed,
                nodes_per_s=result.nodes / wall, node_compute_s=compute_s,
                efficiency=compute_s / args.workers / wall if result.computed else None,
                batch_size=result.batch_size, batches=result.batches,
                recomputed_products=recomputed_products(result.manifest_url),
            )  # fmt: skip
            print(f"{name}: {result.nodes} nodes, {result.computed} computed in {wall:.2f} s",
                  flush=True)  # fmt: skip

        def forget_outputs() -> None:
            """What makes the next run cold: no node outputs, index, manifests or
            parameter records (the landed partitions stay)."""
            for part in ("packs", "index", "manifests", "params"):
                shutil.rmtree(Path(site.root) / part, ignore_errors=True)

        # This VM's speed drifts by +-20% from run to run, so (a) runs several times
        # from an empty store and the table reports the median run (all are kept).
        for i in range(args.cold_repeats):
            forget_outputs()  # each from an empty store (a --workdir may hold an old one)
            engine(f"a_cold_{i}")
        colds = sorted((results.pop(f"a_cold_{i}") for i in range(args.cold_repeats)),
                       key=lambda r: r["wall_s"])  # fmt: skip
        results["a_cold"] = {
            **colds[len(colds) // 2],
            "peak_rss_mb": max(r["peak_rss_mb"] for r in colds),
            "repeats": colds,
        }
        # The same cold run as a flow run of its own: it ends on the next tick of
        # Prefect's heartbeat thread (joined at exit, 1 s sleep granularity).
        forget_outputs()
        engine("a_cold_top_level", top_level=True)
        engine("b_noop")
        # The auditor's setting: every hit's output re-hashed before it counts.
        engine("b_noop_verified", verify=True)
        engine("c_one_product", {"P007": {"ofi_window": 12}})
        if args.no_peers:
            mlflow.set_terminated(parent, "FINISHED")
            return

        planned = plan_features(stage(None))
        kind, by_digest = planned.kind, planned.params
        nodes = planned.nodes.slice(0, args.sample + max(args.sample, args.dask_runner_sample))
        nodes = nodes.to_pylist()
        root = str(work / "peers")
        sample = nodes[: args.sample]
        with Client(cluster) as client:
            client.run(lambda: None)  # connections up before the clock starts
            with rss.phase(results, "d_raw_dask"):
                t = time.perf_counter()
                durations = client.gather(
                    client.map(
                        one_node,
                        [kind] * len(sample),
                        [by_digest] * len(sample),
                        sample,
                        [root] * len(sample),
                        pure=False,
                    )  # fmt: skip
                )
                wall = time.perf_counter() - t
            results["d_raw_dask"].update(nodes=len(sample), wall_s=wall,
                                         nodes_per_s=len(sample) / wall,
                                         node_compute_s=sum(durations))  # fmt: skip
            print(f"d_raw_dask: {len(sample)} nodes in {wall:.2f} s", flush=True)

        node_task = task(one_node, name="node", cache_policy=None, persist_result=False)

        def per_task(runner, name: str, count: int) -> None:
            batch = nodes[args.sample : args.sample + count]

            @flow(name=name, task_runner=runner)
            def per_node_flow(count: int) -> None:  # nodes come from the closure, not the API
                futures = [node_task.submit(kind, by_digest, nd, root) for nd in batch[:count]]
                for f in futures:
                    f.result()

            with rss.phase(results, name):
                t = time.perf_counter()
                per_node_flow(len(batch))
                wall = time.perf_counter() - t
            results[name].update(nodes=len(batch), wall_s=wall, nodes_per_s=len(batch) / wall)
            print(f"{name}: {len(batch)} nodes in {wall:.2f} s", flush=True)

        per_task(ThreadPoolTaskRunner(), "e_prefect_threads", args.sample)
        per_task(DaskTaskRunner(address=cluster.scheduler_address), "f_prefect_dask",
                 args.dask_runner_sample)  # fmt: skip
        mlflow.set_terminated(parent, "FINISHED")


def recomputed_products(manifest_url: str) -> list[str]:
    """The first five products with a computed node, from the run's manifest files."""
    import pyarrow.compute as pc

    from quantloop.tasks.engine import run_parts, storage

    products: set[str] = set()
    for part in run_parts(manifest_url):
        t = storage.read_parquet(part, ["product"], pc.field("cache_hit") == False)  # noqa: E712
        products.update(pc.unique(t["product"]).to_pylist())
    return sorted(products)[:5]


def report(args, results: dict) -> None:
    malloc = results.pop("driver_malloc", {})
    a = results["a_cold"]
    rows = [(label, key) for label, key in ROWS if key in results]
    print()
    print(f"{'run':44} {'nodes':>8} {'computed':>9} {'wall s':>8} {'nodes/s':>9} "
          f"{'peak RSS MB':>12} {'(a)/this':>9}")  # fmt: skip
    for label, key in rows:
        r = results[key]
        computed = r.get("computed", r["nodes"])
        ratio = a["nodes_per_s"] / r["nodes_per_s"]
        print(f"{label:44} {r['nodes']:>8} {computed:>9} {r['wall_s']:>8.2f} "
              f"{r['nodes_per_s']:>9.0f} {r['peak_rss_mb']:>12.0f} {ratio:>9.1f}")  # fmt: skip
    print(
        f"\n(a) scheduling efficiency (node compute s / {args.workers} workers / wall s): "
        f"{a['efficiency']:.2f}; {a['batches']} Dask tasks of up to {a['batch_size']} nodes"
    )
    peers = all(k in results for k in PEER_RUNS)

    def rate(key: str) -> float | None:
        return results[key]["nodes_per_s"] if peers else None

    b, c = results["b_noop"], results["c_one_product"]
    stamped = stamp()  # machine, date, commit (bench/report.py)
    summary = {
        "nodes": a["nodes"],
        "products": args.products,
        "dates": args.dates,
        "cold_s": a["wall_s"],
        "noop_rerun_s": b["wall_s"],
        "noop_verified_rerun_s": results["b_noop_verified"]["wall_s"],
        "verify_hits_cost_ratio": results["b_noop_verified"]["wall_s"] / b["wall_s"],
        "one_product_rerun_s": c["wall_s"],
        "one_product_rerun_nodes": c["computed"],
        # What the one-product re-run would take in proportion to its nodes: the no-op's
        # wall time plus its nodes' own compute spread over the workers.
        "one_product_proportional_s": b["wall_s"] + c["node_compute_s"] / args.workers,
        "raw_dask_nodes_per_s": rate("d_raw_dask"),
        "prefect_thread_nodes_per_s": rate("e_prefect_threads"),
        "prefect_dask_nodes_per_s": rate("f_prefect_dask"),
        "engine_nodes_per_s": a["nodes_per_s"],
        "engine_vs_raw_dask": a["nodes_per_s"] / rate("d_raw_dask") if peers else None,
        "engine_vs_prefect_thread": (
            a["nodes_per_s"] / rate("e_prefect_threads") if peers else None
        ),
        "engine_vs_prefect_dask": a["nodes_per_s"] / rate("f_prefect_dask") if peers else None,
        "peers": "measured" if peers else PEERS_SKIPPED,
        "efficiency": a["efficiency"],
        "cold_s_repeats": [r["wall_s"] for r in a["repeats"]],
        "cold_top_level_s": results["a_cold_top_level"]["wall_s"],
        "efficiency_top_level": results["a_cold_top_level"]["efficiency"],
        "efficiency_repeats": [r["efficiency"] for r in a["repeats"]],
        # The engine's runs (a)-(c); the peers' runs are reported apart.
        "peak_rss_mb": max(results[k]["peak_rss_mb"] for k in ENGINE_RUNS),
        "peers_peak_rss_mb": (max(results[k]["peak_rss_mb"] for k in PEER_RUNS) if peers else None),
        "peak_rss_mb_by_role": max(
            (results[k] for k in ENGINE_RUNS), key=lambda r: r["peak_rss_mb"]
        ).get("peak_rss_mb_by_role", {}),
        "workers": args.workers,
        "driver_malloc": malloc,  # glibc thresholds fixed in the driver (fix_malloc_thresholds)
        "events_per_partition": EVENTS_PER_PARTITION,
        "machine": stamped["machine"],
        "commit": stamped["commit"],
        "date": stamped["date"],
        "runs": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2, default=str) + "\n")
    args.out.with_suffix(".md").write_text(markdown(summary))
    print(f"\nwritten to {args.out} and {args.out.with_suffix('.md')}")


PEERS_SKIPPED = (
    "not run: (d)-(f) measure a per-node cost (one Dask or Prefect task per node), which "
    "does not depend on the total; bench/results/fanout.json has them at 10^5 nodes"
)
ENGINE_RUNS = ("a_cold", "a_cold_top_level", "b_noop", "b_noop_verified", "c_one_product")
PEER_RUNS = ("d_raw_dask", "e_prefect_threads", "f_prefect_dask")
ROWS = [
    ("(a) engine, cold", "a_cold"),
    ("(a') the same, as a top-level flow run", "a_cold_top_level"),
    ("(b) engine, no-op re-run", "b_noop"),
    ("(b') the same, verify_hits (every hit re-hashed)", "b_noop_verified"),
    ("(c) engine, one product changed", "c_one_product"),
    ("(d) raw Dask, one task per node", "d_raw_dask"),
    ("(e) Prefect task per node, thread runner", "e_prefect_threads"),
    ("(f) Prefect task per node, DaskTaskRunner", "f_prefect_dask"),
]


def markdown(summary: dict) -> str:
    """The results as a markdown table, with the machine, date and commit."""
    runs = summary["runs"]
    a = runs["a_cold"]
    lines = [
        f"Machine: {summary['machine']}; {summary['workers']} Dask workers; "
        f"{summary['date']}; commit {summary['commit']}.",
        "",
        "| run | nodes | computed | wall s | nodes/s | peak RSS MB | (a) nodes/s ÷ this |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for label, key in ROWS:
        if key not in runs:
            continue
        r = runs[key]
        lines.append(
            f"| {label} | {r['nodes']:,} | {r.get('computed', r['nodes']):,} | "
            f"{r['wall_s']:.2f} | {r['nodes_per_s']:,.0f} | {r['peak_rss_mb']:,.0f} | "
            f"{a['nodes_per_s'] / r['nodes_per_s']:.1f} |"
        )
    if summary.get("peers", "measured") == "measured":
        peers = (
            f"(d), (e) and (f) ran on samples of {runs['d_raw_dask']['nodes']:,}, "
            f"{runs['e_prefect_threads']['nodes']:,} and {runs['f_prefect_dask']['nodes']:,} "
            "nodes; their nodes/s is the sample's rate. "
        )
    else:
        peers = f"(d)-(f) {summary['peers']}. "
    c = runs["c_one_product"]
    lines += [
        "",
        peers + "(a) is the median of "
        f"{len(summary['cold_s_repeats'])} cold runs (wall s: "
        f"{', '.join(f'{w:.2f}' for w in summary['cold_s_repeats'])}; efficiency: "
        f"{', '.join(f'{e:.2f}' for e in summary['efficiency_repeats'])}). "
        "Scheduling efficiency of (a) (node compute "
        f"seconds / workers / wall seconds): {summary['efficiency']:.2f}; the engine ran "
        f"{a.get('batches', 0):,} Dask tasks of up to {a['batch_size']:,} nodes. (c) computed "
        f"{c['computed']:,} nodes ({c['node_compute_s']:.2f} s of node work) in "
        f"{c['wall_s']:.2f} s, against {summary['one_product_proportional_s']:.2f} s for the "
        "no-op's wall time plus that work over the workers. (a), (b) and "
        "(c) run the features flow as the research flow runs it, a stage without its own "
        "heartbeat thread; (a') is a flow run of its own, which ends on the next tick of "
        "Prefect's heartbeat thread (joined at exit with 1 s sleep granularity): "
        f"efficiency {summary['efficiency_top_level']:.2f}. Peak RSS is "
        "the whole process tree (driver with the Dask scheduler, Dask workers, Prefect "
        "server); at the engine runs' peak: "
        + ", ".join(
            f"{role} {mb:,.0f} MB"
            for role, mb in sorted(summary.get("peak_rss_mb_by_role", {}).items())
        )
        + "."
        + (
            " The driver runs with glibc's malloc thresholds fixed ("
            + ", ".join(f"{k} {v:,}" for k, v in summary["driver_malloc"].items())
            + " bytes), as Dask runs its workers."
            if summary.get("driver_malloc")
            else ""
        ),
        "",
    ]
    if "verify_hits_cost_ratio" in summary:
        lines[-1:-1] = [
            "",
            "(b') is (b) with `verify_hits` on: every hit's stored output is read and "
            f"re-hashed before it counts, {summary['noop_verified_rerun_s']:.2f} s against "
            f"{summary['noop_rerun_s']:.2f} s "
            f"({summary['verify_hits_cost_ratio']:.1f}x the plain no-op's wall time).",
        ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
