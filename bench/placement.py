"""Placement benchmark: the whole research loop under a single site's scheduler and under
node-level placement, two sites joined by a shaped link.

    sudo .venv/bin/python bench/placement.py                  # ~15-25 minutes here
    sudo .venv/bin/python bench/placement.py --link-mbit 50 --name placement-50mbit

Two sites, each in its own network namespace (`qlbench-a`, `qlbench-b`) joined by a
veth pair whose two ends are shaped by `tc qdisc ... tbf` at `--link-mbit` (each
direction): the only path between the sites. Site A (on-premises, cost 2.0/h): a `dask
scheduler` + `dask worker` in namespace A, storage on a local folder. Site B (the cloud,
cost 3.0/h, the GPU site): the same in namespace B, its worker declaring the `GPU`
resource (training and the replay go there; there is no GPU here, so they run on its
CPU), storage on an S3 server (moto) in namespace B. Half of the products are landed at
A, half at B, each site's from inside its namespace, at once.

The driver (the research, reproduce and promote flows; a Prefect server of its own and
the MLflow store on namespace A's side) runs in namespace A. Per policy (`single:A`:
every feature node at A, B's inputs read across; `node`: each node at the site holding
its input), on empty output stores, after one untimed warm-up research run on stores of
its own (the driver's and the workers' imports; `warm_up`):

1. the research run, cold: land (every version found at its site, its bytes checked),
   features, train, simulate, records;
2. `promote` of its model version at once, as the desk's first champion (no champion
   is set: the gate tests it against the baseline signal on its held-out day), its
   reproduction gate re-running every node: the promotion time is the end of the
   research run to the alias moving;
3. the research run again: every feature node, model and simulation a cache hit;
4. every result re-run at the other site: each feature node at the site it did not run
   at (a task on that site's Dask worker: its input read, its output computed and
   compared by digest), and the model and the simulation, made at B, re-run at A (the
   `reproduce` flow in the driver).

Five figures per policy: cold and re-run turnaround, compute cost, cache hit rate on the
re-run, reproduction failure rate at the other site, and the promotion time; with the
bytes read across sites (inputs, and the feature outputs copied to where training and
the replay run) and whether both policies' outputs are identical (every feature node,
model and mark-out).

Needs root (namespaces, tc). Everything it starts is inside the two namespaces it
creates and removes when it ends (also after an error or Ctrl-C); addresses are
10.213.0.1 (A) and 10.213.0.2 (B) on the veth pair, and each namespace's loopback.
Every wait is bounded. Writes bench/results/<name>.json and .md (default placement).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # `python bench/placement.py` from a checkout: tests.servers
from bench.report import stamp, stamp_line  # noqa: E402

NS = {"A": "qlbench-a", "B": "qlbench-b"}
OTHER = {"A": "B", "B": "A"}
IP = {"A": "10.213.0.1", "B": "10.213.0.2"}
VETH = {"A": "qlb-va", "B": "qlb-vb"}
S3_PORT, SCHEDULER_PORT = 9000, 8786
DATA_BUCKET = "ql-bench-data"
LETTERS = "ABCDEFGHIJKLMNOP"


def products(args: argparse.Namespace) -> dict[str, list[str]]:
    """The products landed at each site: `--at-a` of `--products` at A, the rest at B."""
    at_b = args.products - args.at_a
    return {"A": [f"AA{c}" for c in LETTERS[: args.at_a]], "B": [f"BB{c}" for c in LETTERS[:at_b]]}


COST_PER_HOUR = {"A": 2.0, "B": 3.0}  # illustrative: on-prem vs cloud
WAIT_S = 120  # the longest any start may take
RUN_TIMEOUT_S = 3600  # the longest the driver may take
# A small model: the replay predicts every event of every partition of the fold (its
# training days set the trading threshold), which at the default model's ~5,000
# windows/s on one core here would take most of an hour; this one does ~100,000/s.
MODEL = {"d_model": 8, "n_layers": 1, "n_heads": 1, "window": 8, "ff_mult": 1}


# ---------------------------------------------------------------- the outer process


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=30)


def remove_namespaces() -> None:
    """Remove the namespaces (their veth ends and processes' network go with them)."""
    for ns in NS.values():
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


@contextlib.contextmanager
def shaped_link(mbit: float) -> Iterator[None]:
    remove_namespaces()  # left by a run that was killed
    try:
        for ns in NS.values():
            sh("ip", "netns", "add", ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "link", "add", VETH["A"], "type", "veth", "peer", "name", VETH["B"])
        for site, ns in NS.items():
            sh("ip", "link", "set", VETH[site], "netns", ns)
            sh("ip", "-n", ns, "addr", "add", f"{IP[site]}/30", "dev", VETH[site])
            sh("ip", "-n", ns, "link", "set", VETH[site], "up")
            # Token bucket on each end's egress: each direction at `mbit`.
            sh("tc", "-n", ns, "qdisc", "add", "dev", VETH[site], "root", "tbf",
               "rate", f"{mbit}mbit", "burst", "64kb", "latency", "100ms")  # fmt: skip
        yield
    finally:
        remove_namespaces()


def child_env(work: Path) -> dict[str, str]:
    dropped = ("PREFECT_", "AWS_", "MLFLOW_")
    env = {k: v for k, v in os.environ.items()
           if "proxy" not in k.lower() and not k.startswith(dropped)}  # fmt: skip
    env.update(
        AWS_ENDPOINT_URL=f"http://{IP['B']}:{S3_PORT}",  # site B's object store
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1",
        PREFECT_HOME=str(work / "prefect-home"),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        # the checkout first (bench.*, tests.*), then what the caller had
        PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
        QUANTLOOP_FORKSERVER="0",
    )
    return env


def in_ns(site: str, args: list[str], work: Path, name: str) -> subprocess.Popen:
    log = open(work / f"{name}.log", "ab")
    return subprocess.Popen(["ip", "netns", "exec", NS[site], *args], stdout=log,
                            stderr=subprocess.STDOUT, env=child_env(work))  # fmt: skip


def stop(procs: list[subprocess.Popen]) -> None:
    for proc in reversed(procs):
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=20)


class LoadSampler:
    """The machine's 1-minute load average every 5 s while the benchmark runs (the
    benchmark shares its cores with whatever else runs: the figures are read with it)."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(5.0):
            self.samples.append(os.getloadavg()[0])

    def __enter__(self) -> LoadSampler:
        self.samples.append(os.getloadavg()[0])
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def summary(self) -> dict:
        s = self.samples or [0.0]
        return {"mean": sum(s) / len(s), "max": max(s), "min": min(s), "samples": len(s),
                "cores": os.cpu_count()}  # fmt: skip


def outer(args: argparse.Namespace) -> None:
    if os.geteuid() != 0:
        sys.exit("bench/placement.py needs root: it makes network namespaces and shapes a link")
    py = sys.executable
    work = Path(tempfile.mkdtemp(prefix="ql-placement-"))
    me = [py, str(Path(__file__).resolve()), "--work", str(work), "--events", str(args.events),
          "--dates", str(args.dates), "--link-mbit", str(args.link_mbit),
          "--products", str(args.products), "--at-a", str(args.at_a),
          "--steps", str(args.steps), "--horizon", args.horizon,
          "--repeats", str(args.repeats), "--policies", args.policies]  # fmt: skip
    procs: list[subprocess.Popen] = []
    t0 = time.perf_counter()
    try:
        with LoadSampler() as load, shaped_link(args.link_mbit):
            procs.append(in_ns("B", [py, "-m", "moto.server", "-H", IP["B"], "-p",
                                     str(S3_PORT)], work, "moto-b"))  # fmt: skip
            for site in NS:
                procs.append(in_ns(site, [py, "-m", "dask", "scheduler", "--host", IP[site],
                                          "--port", str(SCHEDULER_PORT), "--no-dashboard"],
                                   work, f"scheduler-{site}"))  # fmt: skip
                procs.append(in_ns(site, [
                    py, "-m", "dask", "worker", f"tcp://{IP[site]}:{SCHEDULER_PORT}",
                    "--nworkers", "1", "--nthreads", "1", "--memory-limit", "0",
                    "--no-dashboard", "--local-directory", str(work / f"dask-{site}"),
                    *(["--resources", "GPU=1"] if site == "B" else []),
                    "--preload", "quantloop.tasks.engine.batch",
                    "--preload", "quantloop.tasks.research.features",
                ], work, f"worker-{site}"))  # fmt: skip
            # Each site lands its own products, from inside its namespace, at once.
            t_land = time.perf_counter()
            landers = [in_ns(s, [*me, "--role", f"land-{s}"], work, f"land-{s}") for s in NS]
            for lander in landers:
                if lander.wait(timeout=RUN_TIMEOUT_S) != 0:
                    sys.exit(f"landing failed: see {work}/land-*.log")
            land_s = time.perf_counter() - t_land
            driver = in_ns("A", [*me, "--role", "drive"], work, "drive")
            if driver.wait(timeout=RUN_TIMEOUT_S) != 0:
                sys.exit(f"the driver failed: see {work}/drive.log")
            stop(procs)
            procs = []
        result = json.loads((work / "result.json").read_text())
        result.update(landing_s=land_s, load=load.summary(), bench_s=time.perf_counter() - t0)
        report(result, args)
    finally:
        stop(procs)
        remove_namespaces()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else ("equal" if a == b else "inf")


def report(result: dict, args: argparse.Namespace) -> None:
    stamped = stamp()  # machine, date, commit (bench/report.py)
    result.update(
        machine=stamped["machine"],
        date=stamped["date"],
        commit=stamped["commit"],
        link=f"veth pair between two network namespaces, tc tbf rate {args.link_mbit} "
        "Mbit/s burst 64 KB latency 100 ms on each end (each direction)",
    )
    pol = result["policies"]
    single, node = pol["single"], pol["node"]
    load = result["load"]
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [
        stamp_line({**stamped, "load": ""}),
        f"Load average (1 min) during the benchmark: mean {load['mean']:.1f}, max "
        f"{load['max']:.1f} on {load['cores']} cores (other work shares this machine: read "
        "the ratios between the policies, measured in the same run, before the seconds).",
        f"Link: {result['link']}; measured {result['measured_link_mbit']:.1f} Mbit/s "
        f"(one {result['probe_bytes'] / 1e6:.1f} MB GET of a B partition from namespace A).",
        f"Data: {result['partitions']} partitions of {result['events_per_partition']:,} events, "
        f"{result['input_bytes'] / 1e6:.1f} MB ({result['input_bytes_at']['B'] / 1e6:.1f} MB at "
        f"B: {len(result['products']['A'])} products at A, {len(result['products']['B'])} at "
        f"B), landed at both sites at once in {result['landing_s']:.1f} s; one Dask worker "
        f"per site; training ({result['train']['steps']} steps) and the replay at B, the GPU "
        "site (on its CPU here). Before the timed runs, one untimed warm-up research run "
        f"({result['warm_up']['research_s']:.0f} s: an untrained model under `node` on "
        "output stores of its own) started the driver's and the workers' imports.",
        "",
        f"Seconds: the median of {result['repeats']} runs of each policy (each run, in "
        "brackets; the policies in turn, the first one alternating); every run on empty "
        "output stores.",
        "",
        "| policy | cold s | re-run s | bytes across sites | compute cost | cache hits on "
        "re-run | reproduction failures at the other site | promotion s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def spread(values: list) -> str:
        return ", ".join(f"{v:.1f}" for v in values)

    for p in pol.values():
        promo = p["promotion"]
        if p["promotion_time_s"] is not None:
            shown = f"{p['promotion_time_s']:.1f} ({spread(p['promotion_time_s_all'])})"
        else:
            shown = f"{promo['decision']} at least once ({p['promotion_time_s_all']})"
        lines.append(
            f"| {p['placement']} | {p['cold_s']:.1f} ({spread(p['cold_s_all'])}) | "
            f"{p['rerun_s']:.1f} ({spread(p['rerun_s_all'])}) | "
            f"{p['bytes_across_sites']:,} | {p['cost']:.6f} | {p['cache_hit_rate']:.0%} "
            f"({p['rerun_hits']} / {p['rerun_results']} a run) | "
            f"{p['reproduction']['failures']} / {p['reproduction']['nodes']} | {shown} |"
        )
    lines += [
        "",
        f"`node` against `single:A`: cold turnaround {ratio(single['cold_s'], node['cold_s'])} "
        f"shorter, bytes across sites "
        f"{ratio(single['bytes_across_sites'], node['bytes_across_sites'])} "
        f"fewer; outputs identical under {'every policy' if len(pol) > 2 else 'both policies'}: "
        f"{result['outputs_identical']} "
        f"({result['compared']['features']} feature nodes, {result['compared']['models']} "
        "model(s), the mark-out).",
        *(
            f"`{p['placement']}` against `single:A`: cold turnaround "
            f"{ratio(single['cold_s'], p['cold_s'])} shorter, bytes across sites "
            f"{ratio(single['bytes_across_sites'], p['bytes_across_sites'])} fewer."
            for key, p in pol.items()
            if key not in ("single", "node")
        ),
        "",
        "Where the cold run's time and bytes went (stage seconds from the runs' MLflow "
        "records, medians; bytes across, by the stage that read them):",
        "",
        "| policy | land + plan s | features s | train s | simulate s | records s | "
        "input bytes across | train + simulate bytes across |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in pol.values():
        st = p["stages"]
        lines.append(
            f"| {p['placement']} | {st['land_plan']:.1f} | {st['features']:.1f} | "
            f"{st['train']:.1f} | {st['simulate']:.1f} | {st['records']:.1f} | "
            f"{p['input_bytes_across']:,} | "
            f"{p['bytes_across_sites'] - p['input_bytes_across']:,} |"
        )
    lines += ["", "Per site (the first cold run): nodes, compute seconds, bytes read across, cost:",
              ""]  # fmt: skip
    for p in pol.values():
        for site, c in sorted(p["sites"].items()):
            lines.append(
                f"- {p['placement']}, site {site}: {c.get('nodes', 0)} nodes, features "
                f"{c.get('compute_s', 0.0):.1f} s, train {c.get('train_s', 0.0):.1f} s, simulate "
                f"{c.get('simulate_s', 0.0):.1f} s, {c.get('bytes_across', 0):,} bytes across, "
                f"cost {c.get('cost', 0.0):.6f}"
            )
    lines += [
        "",
        "Promotion: the promote flow on the cold run's version at once, as the desk's first "
        "champion (no champion set: the gate tests it against the top-of-book imbalance "
        f"baseline on its held-out day at horizon {result['horizon']}); its reproduction "
        "gate re-runs every node, the model and the simulation, in the driver (site A). "
        + "; ".join(
            f"{p['placement']}: "
            + ", ".join(
                f"{r['promotion']['decision']} ({r['promotion']['flow_s']:.1f} s)"
                for r in p["runs"]
            )
            for p in pol.values()
        )
        + ". The promote flow's own seconds in brackets; the promotion time adds what "
        "came between the research run's end and its start (the run's records closed).",
    ]
    (out / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


# ---------------------------------------------------------------- inside a namespace


def dates(n: int) -> list[dt.date]:
    from quantloop.tasks.data.landing import business_days

    return business_days(dt.date(2026, 3, 2), n)


def synthetic(args: argparse.Namespace):
    from quantloop.tasks.data.synthetic import SyntheticConfig

    return SyntheticConfig(events_per_day=args.events, levels=10)


def land(site: str, args: argparse.Namespace) -> None:
    from quantloop.tasks.data.landing import land_synthetic
    from quantloop.tasks.runtime.workspace import Workspace
    from tests.servers import wait_http

    catalog = Workspace(home=str(args.work / "home")).catalog()
    if site == "B":
        import s3fs

        wait_http(f"http://{IP['B']}:{S3_PORT}/", WAIT_S)
        s3fs.S3FileSystem(skip_instance_cache=True).mkdir(DATA_BUCKET)
        root = f"s3://{DATA_BUCKET}/data"
    else:
        root = str(args.work / "a-data")
    land_synthetic(catalog, root, products(args)[site], dates(args.dates), synthetic(args),
                   site=site)  # fmt: skip


def sites_for(name: str, work: Path):
    """Sites A and B with fresh output stores for one policy (the data stays where it
    landed: the catalog says which site holds it). B declares a GPU: its worker has the
    GPU resource, so training and the replay go there."""
    import s3fs

    from quantloop.blocks.site import Site

    bucket = f"ql-bench-{name.replace(':', '-').lower()}"
    s3fs.S3FileSystem(skip_instance_cache=True).mkdir(bucket)
    a = Site(name="A", scheduler_address=f"tcp://{IP['A']}:{SCHEDULER_PORT}",
             storage_root=str(work / f"a-{bucket}"), cost_per_hour=COST_PER_HOUR["A"])  # fmt: skip
    b = Site(name="B", scheduler_address=f"tcp://{IP['B']}:{SCHEDULER_PORT}",
             storage_root=f"s3://{bucket}/store", cost_per_hour=COST_PER_HOUR["B"],
             gpus=1)  # fmt: skip
    return a, b


def research_params(workspace, products: list[str], args: argparse.Namespace, steps: int,
                    **train):  # fmt: skip
    from quantloop.flows.params import ResearchParams

    return ResearchParams.model_validate({
        "workspace": workspace,
        "data": {"products": products, "n_dates": args.dates, "start_date": dates(1)[0],
                 "synthetic": synthetic(args)},
        "train": {**MODEL, "steps": steps, "batch_size": 256, "log_every": 10, **train},
        "validation": {"folds": 1},
        "shard_size": 1000,
    })  # fmt: skip


def check_here(rows: list[dict], root: str, catalog_path: str) -> list[dict]:
    """On a site's Dask worker: re-run feature nodes from their recorded inputs and
    parameters (tasks/records/reproduce.check_nodes), writing nothing; the checks, each
    with the worker that ran it."""
    from distributed import get_worker

    from quantloop.tasks.data.catalog import Catalog
    from quantloop.tasks.records.reproduce import check_nodes
    from quantloop.tasks.research.planning import feature_kind

    kind = feature_kind()
    where = get_worker().address
    checks = check_nodes(rows, root=root, catalog=Catalog(catalog_path), kinds={kind.name: kind})
    return [{**c.to_dict(), "rerun_at": where} for c in checks]


def recorded(summary):
    """The run's MLflow parent, its stage runs and its manifest rows (ok nodes)."""
    from mlflow.tracking import MlflowClient

    from quantloop.tasks.records import runs
    from quantloop.tasks.records.reproduce import manifest_rows

    client = MlflowClient(summary.tracking_uri)
    parent = runs.find_research_run(client, summary.mlflow_run_id)
    stages = runs.stage_runs(client, parent)
    rows = manifest_rows(runs.manifest_tables(client, stages["features"].info.run_id))
    return client, parent, stages, rows


def stage_seconds(parent, stages, wall_s: float) -> dict[str, float]:
    """Each stage's wall seconds from its MLflow run; before the run's records open
    (landing, planning, the flow's start: the run's wall time less its parent run's) and
    after simulate (the records closed)."""

    def span(run) -> tuple[float, float]:
        return run.info.start_time / 1000, (run.info.end_time or run.info.start_time) / 1000

    out = {}
    for name in ("features", "train", "simulate"):
        first, last = span(stages[name])
        out[name] = last - first
    start, end = span(parent)
    out["land_plan"] = wall_s - (end - start)
    out["records"] = end - span(stages["simulate"])[1]
    return out


def reproduce_elsewhere(summary, clients: dict, home: str, trained_at: str) -> dict:
    """Every result of the run re-run at the other site: each feature node on the Dask
    worker of the site it did not run at; the model and the simulation (made at
    `trained_at`, which must be B) in this process, at A (the reproduce flow, no nodes)."""
    from quantloop.flows.reproduce import reproduce
    from quantloop.tasks.records import tracking
    from quantloop.tasks.runtime.workspace import Workspace

    _, parent, _, rows = recorded(summary)
    root, catalog = parent.data.tags[tracking.STORE_TAG], parent.data.tags[tracking.CATALOG_TAG]
    futures = {site: clients[site].submit(check_here, [r for r in rows if r["site"] == OTHER[site]],
                                          root, catalog, pure=False)
               for site in NS if any(r["site"] == OTHER[site] for r in rows)}  # fmt: skip
    checks = [c for f in futures.values() for c in f.result(timeout=RUN_TIMEOUT_S)]
    if trained_at != "B":
        raise RuntimeError(f"training ran at {trained_at!r}, not at the GPU site B: the bench "
                           "re-runs the model and the simulation at A only")  # fmt: skip
    t0 = time.perf_counter()
    report = reproduce(summary.mlflow_run_id, sample=0, models=True,
                       workspace=Workspace(home=home))  # fmt: skip
    checks += [{**c, "rerun_at": "driver (site A)"} for c in report["checks"]]
    failed = [c for c in checks if not c["reproduced"]]
    return {"nodes": len(checks), "failures": len(failed), "failed": failed[:10],
            "feature_nodes": len(rows), "models_and_simulation_s": time.perf_counter() - t0,
            "rerun_at": sorted({c["rerun_at"] for c in checks})}  # fmt: skip


def warm_up(args, home: str) -> dict:
    """Before the timed runs, once: a research run of an untrained model (1 step at lr
    1e-6, tests/test_audit.py's stand-in for a worse model) under `node` on output stores
    of its own (buckets no timed run reads). It starts what every run needs once and a
    desk's long-lived processes have: the driver's imports and MLflow store, each
    worker's feature, training and replay code. Without it the first policy's first run
    paid them (a rehearsal here: its train stage 32.8 s against the other's 4.4 s, most
    of it the GPU worker importing torch). Its version is registered as a candidate and
    never promoted: each policy's promotion stays the desk's first champion (against the
    baseline signal); the run counts as one more trial on the held-out day."""
    from quantloop.flows.research import research
    from quantloop.tasks.runtime.workspace import Workspace

    a, b = sites_for("warm-up", args.work)
    ws = Workspace(home=home, site=a, sites=[b], placement="node")
    at = products(args)
    t0 = time.perf_counter()
    run = research(research_params(ws, at["A"] + at["B"], args, 1, lr=1e-6))
    seconds = time.perf_counter() - t0
    print(f"warm-up: research run {seconds:.1f} s (untrained model, its own stores)", flush=True)
    return {"research_s": seconds, "run": run.mlflow_run_id, "markout_bps": run.markout_bps}


MARKOUT_FIELDS = ("against", "champion", "difference_bps", "p_adjusted", "trials", "windows", "why")


def one_run(name: str, policy: str, repeat: int, args, home: str, clients: dict) -> dict:
    """One policy once, on empty output stores: cold, promote, re-run, and (the first
    time) every result re-run at the other site."""
    from mlflow.tracking import MlflowClient

    from quantloop.flows.promote import promote
    from quantloop.flows.research import research
    from quantloop.tasks.runtime.workspace import Workspace

    a, b = sites_for(f"{name}-{repeat}", args.work)
    ws = Workspace(home=home, site=a, sites=[b], placement=policy)
    at = products(args)
    params = research_params(ws, at["A"] + at["B"], args, args.steps)
    t0 = time.perf_counter()
    cold = research(params)
    cold_s = time.perf_counter() - t0
    print(f"{policy}: cold {cold_s:.1f} s, {cold.bytes_across_sites:,} bytes across", flush=True)

    # Promoted at once, as the desk's first champion under each policy: no champion is
    # set, so the gate tests the candidate against the baseline signal on its held-out day.
    client = MlflowClient(cold.tracking_uri)
    guarded = ws.resolve_tracking().registered_model
    with contextlib.suppress(Exception):  # none yet: MLflow's RESOURCE_DOES_NOT_EXIST
        client.delete_registered_model_alias(guarded, "champion")
    t0 = time.perf_counter()
    decision = promote(cold.mlflow_run_id, horizon=args.horizon, reproduce_sample=cold.nodes,
                       workspace=Workspace(home=home))  # fmt: skip
    flow_s = time.perf_counter() - t0
    ended = decision.get("promotion_time_s")
    print(f"{policy}: promote {decision['decision']} in {flow_s:.1f} s", flush=True)

    t0 = time.perf_counter()
    again = research(params)
    rerun_s = time.perf_counter() - t0
    hits = again.cache_hits + sum(f["model_cached"] + f["simulation_cached"]
                                  for f in again.per_fold)  # fmt: skip
    results = again.nodes + 2 * len(again.per_fold)

    _, parent, stages, rows = recorded(cold)
    trained_at = next((s for s, c in cold.sites.items() if c.get("train_s")), "A")
    repro = reproduce_elsewhere(cold, clients, home, trained_at) if repeat == 0 else None
    said = (
        f"; reproduced at the other site: {repro['failures']} / {repro['nodes']} failed"
        if repro
        else ""
    )
    print(f"{policy}: re-run {rerun_s:.1f} s{said}", flush=True)
    input_across = sum(r.get("bytes_across", 0) or 0 for r in rows)
    return {
        "placement": policy,
        "repeat": repeat,
        "nodes": cold.nodes,
        "computed": cold.computed,
        "cold_s": cold_s,
        "rerun_s": rerun_s,
        "stages": stage_seconds(parent, stages, cold_s),
        "bytes_across_sites": cold.bytes_across_sites,
        "input_bytes_across": input_across,
        "cost": cold.cost,
        "sites": cold.sites,
        "trained_at": trained_at,
        "rerun_hits": hits,
        "rerun_results": results,
        "cache_hit_rate": hits / results,
        "reproduction": repro,
        "promotion": {
            "decision": decision["decision"],
            "promotion_time_s": ended,
            "decision_s": flow_s,
            "flow_s": flow_s,
            "gates": {g: v.get("passed") for g, v in decision["gates"].items()},
            "markout": {k: decision["gates"]["markout"].get(k) for k in MARKOUT_FIELDS},
            "reproduction": decision["gates"]["reproduction"],
        },  # fmt: skip
        "outputs": {
            "features": {r["key"]: r["output_digest"] for r in rows},
            "models": [f["model_digest"] for f in cold.per_fold],
            "markout_bps": cold.markout_bps,
        },
    }


def drive(args: argparse.Namespace) -> None:
    from distributed import Client
    from prefect.testing.utilities import prefect_test_harness

    from quantloop.tasks.engine import storage
    from quantloop.tasks.runtime.workspace import Workspace

    clients = {}
    for site in NS:  # both clusters up, with their workers
        clients[site] = Client(f"tcp://{IP[site]}:{SCHEDULER_PORT}", timeout=f"{WAIT_S}s")
        clients[site].wait_for_workers(1, timeout=WAIT_S)
    home = str(args.work / "home")
    entries = Workspace(home=home).catalog().entries("synthetic")
    at = {s: sum(e.length for e in entries if e.site == s) for s in NS}
    probe = next(e for e in entries if e.site == "B")
    t0 = time.perf_counter()
    storage.read_range(probe.location, probe.offset, probe.length)
    probe_s = time.perf_counter() - t0
    result: dict = {
        "link_mbit": args.link_mbit,
        "measured_link_mbit": probe.length * 8 / probe_s / 1e6,
        "probe_bytes": probe.length,
        "partitions": len(entries),
        "input_bytes": sum(at.values()),
        "input_bytes_at": at,
        "events_per_partition": args.events,
        "products": products(args),
        "cost_per_hour": COST_PER_HOUR,
        "train": {**MODEL, "steps": args.steps},
        "horizon": args.horizon,
        "policies": {},
    }
    policies = tuple((policy_name(p), p) for p in args.policies.split(","))
    made: dict[str, list[dict]] = {name: [] for name, _ in policies}
    with prefect_test_harness(server_startup_timeout=WAIT_S):
        result["warm_up"] = warm_up(args, home)
        for repeat in range(args.repeats):  # the policies in turn, the first one alternating
            for name, policy in policies[:: 1 if repeat % 2 == 0 else -1]:
                made[name].append(one_run(name, policy, repeat, args, home, clients))
    for c in clients.values():
        c.close()
    outputs = [r.pop("outputs") for runs in made.values() for r in runs]
    result["compared"] = {"features": len(outputs[0]["features"]),
                          "models": len(outputs[0]["models"]), "runs": len(outputs)}  # fmt: skip
    result["outputs_identical"] = all(o == outputs[0] for o in outputs)
    result["repeats"] = args.repeats
    for name, runs in made.items():
        first = runs[0]
        times = {k: [r[k] for r in runs] for k in ("cold_s", "rerun_s")}
        promo = [r["promotion"]["promotion_time_s"] for r in runs]
        result["policies"][name] = {
            **first,
            "cold_s": statistics.median(times["cold_s"]),
            "rerun_s": statistics.median(times["rerun_s"]),
            "cold_s_all": times["cold_s"],
            "rerun_s_all": times["rerun_s"],
            "promotion_time_s_all": promo,
            "promotion_time_s": statistics.median(promo) if None not in promo else None,
            "cost": statistics.median(r["cost"] for r in runs),
            "cache_hit_rate": sum(r["rerun_hits"] for r in runs)
            / sum(r["rerun_results"] for r in runs),
            "bytes_across_all": sorted({r["bytes_across_sites"] for r in runs}),
            "stages": {k: statistics.median(r["stages"][k] for r in runs) for k in first["stages"]},
            "runs": runs,
        }
    (args.work / "result.json").write_text(json.dumps(result, indent=1, default=str))


def policy_name(policy: str) -> str:
    """The key of a policy's results: `single` for single:A (the compared one), else its
    name with a dash (`node`, `single-b`)."""
    return "single" if policy == "single:A" else policy.replace(":", "-").lower()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--link-mbit", type=float, default=100.0)
    parser.add_argument("--events", type=int, default=100_000, help="events per partition")
    parser.add_argument("--dates", type=int, default=4, help="dates per product")
    parser.add_argument("--products", type=int, default=8, help="products, at both sites")
    parser.add_argument("--at-a", type=int, default=4, help="of which landed at A (the rest at B)")
    parser.add_argument("--steps", type=int, default=300, help="training steps")
    parser.add_argument("--horizon", default="5s", help="the promotion gate's horizon")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each policy (medians)")
    parser.add_argument("--policies", default="single:A,node",
                        help="placements run, comma-separated: single:A and node (the compared "
                        "pair) and others reported beside them, e.g. single:B")  # fmt: skip
    parser.add_argument("--name", default="placement", help="results file stem in bench/results")
    parser.add_argument("--keep", action="store_true", help="keep the work folder and logs")
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--role", default="outer", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not {"single:A", "node"} <= set(args.policies.split(",")):
        parser.error("--policies must include single:A and node (the compared pair)")
    if not 0 < args.at_a < args.products <= len(LETTERS):
        parser.error(f"--at-a must leave products at both sites (1 to {args.products - 1})")
    if args.role == "outer":
        outer(args)
    elif args.role.startswith("land-"):
        land(args.role.removeprefix("land-"), args)
    elif args.role == "drive":
        drive(args)


if __name__ == "__main__":
    main()
