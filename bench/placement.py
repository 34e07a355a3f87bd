"""Placement benchmark: single-site scheduling vs node-level placement over a shaped link.

    sudo .venv/bin/python bench/placement.py                  # ~3-5 minutes here
    sudo .venv/bin/python bench/placement.py --link-mbit 50 --events 200000

Two sites, each in its own network namespace (`qlbench-a`, `qlbench-b`) joined by a
veth pair whose two ends are shaped by `tc qdisc ... tbf` at `--link-mbit` (each
direction): the only path between the sites. Site A: a `dask scheduler` + `dask
worker` in namespace A, storage on a local folder. Site B: the same in namespace B,
storage on an S3 server (moto) in namespace B. Half of the products are landed at
A, half at B (B's landed from namespace B, so landing does not cross the link).

The driver (the `features` flow, a Prefect server of its own on namespace A's
loopback) runs in namespace A: under `single:A` every node runs on A's cluster and
B's inputs cross the link; under `node` each node runs on the cluster of the site
holding its input. Each policy runs cold on empty output stores, then again (every
node a cache hit). Reproduction: the nodes whose site differs between the two
policies (B's products: computed at B under `node`, at A under `single:A`) have the
same keys; their output digests are compared.

Needs root (namespaces, tc). Everything it starts is inside the two namespaces it
creates and removes when it ends (also after an error or Ctrl-C); addresses are
10.213.0.1 (A) and 10.213.0.2 (B) on the veth pair, and each namespace's loopback.
Every wait is bounded. Writes bench/results/placement.json and placement.md.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # `python bench/placement.py` from a checkout: tests.servers
from bench.report import stamp, stamp_line  # noqa: E402

NS = {"A": "qlbench-a", "B": "qlbench-b"}
IP = {"A": "10.213.0.1", "B": "10.213.0.2"}
VETH = {"A": "qlb-va", "B": "qlb-vb"}
S3_PORT, SCHEDULER_PORT = 9000, 8786
DATA_BUCKET = "ql-bench-data"
PRODUCTS = {"A": ["AAA", "AAB", "AAC", "AAD"], "B": ["BBA", "BBB", "BBC", "BBD"]}
COST_PER_HOUR = {"A": 2.0, "B": 3.0}  # illustrative: on-prem vs cloud
WAIT_S = 120  # the longest any start may take
RUN_TIMEOUT_S = 1200  # the longest the driver may take


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
    env = {k: v for k, v in os.environ.items()
           if "proxy" not in k.lower() and not k.startswith(("PREFECT_", "AWS_"))}  # fmt: skip
    env.update(
        AWS_ENDPOINT_URL=f"http://{IP['B']}:{S3_PORT}",  # site B's object store
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1",
        PREFECT_HOME=str(work / "prefect-home"),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PYTHONPATH=str(ROOT),
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


def outer(args: argparse.Namespace) -> None:
    if os.geteuid() != 0:
        sys.exit("bench/placement.py needs root: it makes network namespaces and shapes a link")
    py = sys.executable
    work = Path(tempfile.mkdtemp(prefix="ql-placement-"))
    me = [py, str(Path(__file__).resolve()), "--work", str(work), "--events", str(args.events),
          "--dates", str(args.dates), "--link-mbit", str(args.link_mbit)]  # fmt: skip
    procs: list[subprocess.Popen] = []
    try:
        with shaped_link(args.link_mbit):
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
                    "--preload", "quantloop.tasks.engine.batch",
                    "--preload", "quantloop.tasks.research.features",
                ], work, f"worker-{site}"))  # fmt: skip
            # Each site lands its own products, from inside its namespace, at once.
            landers = [in_ns(s, [*me, "--role", f"land-{s}"], work, f"land-{s}") for s in NS]
            for lander in landers:
                if lander.wait(timeout=RUN_TIMEOUT_S) != 0:
                    sys.exit(f"landing failed: see {work}/land-*.log")
            driver = in_ns("A", [*me, "--role", "drive"], work, "drive")
            if driver.wait(timeout=RUN_TIMEOUT_S) != 0:
                sys.exit(f"the driver failed: see {work}/drive.log")
            stop(procs)
            procs = []
        report(json.loads((work / "result.json").read_text()), args)
    finally:
        stop(procs)
        remove_namespaces()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


def report(result: dict, args: argparse.Namespace) -> None:
    stamped = stamp()  # machine, date, commit (bench/report.py)
    result.update(
        machine=stamped["machine"],
        date=stamped["date"],
        commit=stamped["commit"],
        link=f"veth pair between two network namespaces, tc tbf rate {args.link_mbit} "
        "Mbit/s burst 64 KB latency 100 ms on each end (each direction)",
    )
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [
        stamp_line(result),
        f"Link: {result['link']}; measured {result['measured_link_mbit']:.1f} Mbit/s "
        f"(one {result['probe_bytes'] / 1e6:.1f} MB GET of a B partition from namespace A).",
        f"Data: {result['partitions']} partitions, {result['input_bytes'] / 1e6:.1f} MB "
        f"({result['input_bytes_at']['B'] / 1e6:.1f} MB at B); one Dask worker per site.",
        "",
        "| policy | nodes | cold s | re-run s | bytes across sites | compute cost | "
        "cache hits on re-run | reproduction failures |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in result["policies"].values():
        lines.append(
            f"| {p['placement']} | {p['nodes']} | {p['cold_s']:.2f} | {p['rerun_s']:.2f} | "
            f"{p['bytes_across_sites']:,} | {p['cost']:.6f} | {p['cache_hit_rate']:.0%} | "
            f"{p['reproduction_failures']} / {p['reproduced_nodes']} |"
        )
    lines += ["", f"Outputs identical under both policies: {result['outputs_identical']}."]
    (out / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


# ---------------------------------------------------------------- inside a namespace


def dates(n: int) -> list[dt.date]:
    from quantloop.tasks.data.landing import business_days

    return business_days(dt.date(2026, 3, 2), n)


def land(site: str, args: argparse.Namespace) -> None:
    from quantloop.tasks.data.landing import land_synthetic
    from quantloop.tasks.data.synthetic import SyntheticConfig
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
    cfg = SyntheticConfig(events_per_day=args.events, levels=10)
    land_synthetic(catalog, root, PRODUCTS[site], dates(args.dates), cfg, site=site)


def sites_for(policy: str, work: Path):
    """Sites A and B with fresh output stores for one policy (the data stays where it
    landed: the catalog says which site holds it)."""
    import s3fs

    from quantloop.blocks.site import Site

    bucket = f"ql-bench-{policy.replace(':', '-').lower()}"
    s3fs.S3FileSystem(skip_instance_cache=True).mkdir(bucket)
    a = Site(name="A", scheduler_address=f"tcp://{IP['A']}:{SCHEDULER_PORT}",
             storage_root=str(work / f"a-{bucket}"), cost_per_hour=COST_PER_HOUR["A"])  # fmt: skip
    b = Site(name="B", scheduler_address=f"tcp://{IP['B']}:{SCHEDULER_PORT}",
             storage_root=f"s3://{bucket}/store", cost_per_hour=COST_PER_HOUR["B"])  # fmt: skip
    return a, b


def drive(args: argparse.Namespace) -> None:
    from distributed import Client
    from prefect.testing.utilities import prefect_test_harness

    from quantloop.flows.features import features
    from quantloop.tasks.engine import storage
    from quantloop.tasks.research.stage import StageParams
    from quantloop.tasks.runtime.workspace import Selection, Workspace

    for site in NS:  # both clusters up, with their workers
        with Client(f"tcp://{IP[site]}:{SCHEDULER_PORT}", timeout=f"{WAIT_S}s") as client:
            client.wait_for_workers(1, timeout=WAIT_S)
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
        "cost_per_hour": COST_PER_HOUR,
        "policies": {},
    }
    digests: dict[str, dict[str, tuple[str, str]]] = {}
    with prefect_test_harness(server_startup_timeout=WAIT_S):
        for name, policy in (("single", "single:A"), ("node", "node")):
            a, b = sites_for(policy, args.work)
            ws = Workspace(home=home, site=a, sites=[b], placement=policy)
            stage = StageParams(workspace=ws, selection=Selection())
            t0 = time.perf_counter()
            cold = features(stage, shard_size=1000)
            cold_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            again = features(stage, shard_size=1000)
            rerun_s = time.perf_counter() - t0
            rows = [r for p in storage.list_files(cold.manifest_url, ".parquet")
                    for r in storage.read_parquet(p).to_pylist()]  # fmt: skip
            digests[name] = {r["key"]: (r["site"], r["output_digest"]) for r in rows}
            result["policies"][name] = {
                "placement": policy,
                "nodes": cold.nodes,
                "computed": cold.computed,
                "failed": cold.failed + again.failed,
                "cold_s": cold_s,
                "rerun_s": rerun_s,
                "bytes_across_sites": cold.bytes_across,
                "cost": sum(c["cost"] for c in cold.sites.values()),
                "sites": cold.sites,
                "cache_hit_rate": again.cache_hits / again.nodes,
            }
            print(f"{policy}: cold {cold_s:.2f} s, re-run {rerun_s:.2f} s, "
                  f"{cold.bytes_across:,} bytes across", flush=True)  # fmt: skip
    single, node = digests["single"], digests["node"]
    moved = [k for k in node if single.get(k, ("", ""))[0] != node[k][0]]
    failures = sum(1 for k in moved if single[k][1] != node[k][1])
    for name in ("single", "node"):
        result["policies"][name]["reproduction_failures"] = failures
        result["policies"][name]["reproduced_nodes"] = len(moved)
    result["outputs_identical"] = set(single) == set(node) and all(
        single[k][1] == node[k][1] for k in node
    )
    (args.work / "result.json").write_text(json.dumps(result, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--link-mbit", type=float, default=100.0)
    parser.add_argument("--events", type=int, default=400_000, help="events per partition")
    parser.add_argument("--dates", type=int, default=4, help="dates per product")
    parser.add_argument("--name", default="placement", help="results file stem in bench/results")
    parser.add_argument("--keep", action="store_true", help="keep the work folder and logs")
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--role", default="outer", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "outer":
        outer(args)
    elif args.role.startswith("land-"):
        land(args.role.removeprefix("land-"), args)
    elif args.role == "drive":
        drive(args)


if __name__ == "__main__":
    main()
