"""Turnaround: `quantloop run` from process start to exit against the work it did.

For each data set (the embedded synthetic default; the LOBSTER samples) and each case:

- cold: an empty home (its resident Prefect API started by the run itself);
- no-op: the same run again (every node a hit, the models and simulations found by key);
- one product's feature changed (`product_features`, a new value each repetition);
- one training parameter changed (`train.seed`, a new value each repetition),
- the same with `QUANTLOOP_OVERLAP=0` (tasks/runtime/overlap.py off: no Inductor import
  ahead, the model exported in the run's own interpreter, Inductor's compile workers
  started as PyTorch starts them), run alternately with the case before: its peer in the
  same session,
- the no-op again in-process (`QUANTLOOP_FORKSERVER=0`): the peer of the warm process,

every case but the last run by the warm process (quantloop/forkserver.py), which the
benchmark starts and waits for before the first run, as a user's earlier command would;

the median of `--repeat` runs (3) of the real CLI in a subprocess: the wall from the
process's start to its exit, the run's own breakdown (tasks/runtime/timeline.py: imports,
API, landing, each stage, MLflow calls, shutdown) and the work's compute alone (feature
node seconds + the training loop + the replay, from the run's summary). The figure is
wall / compute, and wall - compute: what a run costs beyond its work.

    python bench/turnaround.py                     # both data sets, 3 repetitions
    python bench/turnaround.py --data synthetic --repeat 1 --name turnaround-quick

Writes bench/results/<name>.json and .md with the machine, date, commit and load.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.report import commit, markdown_table, stamp, stamp_line, write  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LOBSTER = ROOT.parent / "shared" / "data" / "lobster"
CASES = ("cold", "no-op", "feature changed", "training changed")
IN_PROCESS = "no-op in-process"
OVERLAP_OFF = "training changed (overlap off)"
# The breakdown's phases, in the order a run passes them (the table's columns).
PHASES = (
    "start and imports (cli)",
    "checks",
    "imports (flow)",
    "api",
    "landing",
    "features",
    "train",
    "simulate",
    "shutdown",
)


# The peer: the same CLI from the code this replaces (`--peer DIR`: a folder laid out as an
# install would be, DIR/quantloop/{cli.py, flows, tasks, ...}, e.g. links into a
# `git worktree` of e464a67), on this interpreter's packages but without the editable
# install's finder (-S, then site-packages added by hand), so `quantloop` is the peer's;
# Dask's spawned workers inherit that path.
PEER_BOOT = """import sys
sys.path += sys.argv.pop(1).split(":")  # this environment's site-packages
sys.path.insert(0, sys.argv.pop(1))
sys.argv[0] = "quantloop"
from quantloop.cli import app
app()
"""
PEER: Path | None = None


def quantloop() -> list[str]:
    if PEER is not None:
        import site

        packages = ":".join(site.getsitepackages())
        return [sys.executable, "-S", "-c", PEER_BOOT, packages, str(PEER)]
    exe = Path(sys.executable).with_name("quantloop")
    # `-m quantloop` is the executable's way in (quantloop/launch.py: the warm process)
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "quantloop"]


def data_params(data: str, extra: dict) -> dict:
    params = json.loads(json.dumps(extra))
    if data == "lobster":
        params.setdefault("data", {})["lobster_dir"] = str(LOBSTER)
    return params


def products_of(home: Path) -> list[str]:
    summary = json.loads((home / "bench-summary.json").read_text())
    return sorted(summary["per_product"])


def changed(params: dict, case: str, rep: int, product: str) -> dict:
    out = json.loads(json.dumps(params))
    if case == "feature changed":
        # one product's order-flow window: that product's feature nodes, then every fold's
        # model and simulation (they read that product's features), recompute
        out.setdefault("product_features", {})[product] = {"ofi_window": 60 + 10 * rep}
    elif case == "training changed":
        out.setdefault("train", {})["seed"] = 100 + rep
    elif case == OVERLAP_OFF:
        out.setdefault("train", {})["seed"] = 200 + rep
    return out


def run_once(home: Path, params: dict, env: dict) -> dict:
    """One `quantloop run`: its wall from before the process starts to after it exits,
    its breakdown and its summary."""
    pfile = home.parent / f"{home.name}-params.json"
    pfile.write_text(json.dumps(params))
    summary_path = home / "bench-summary.json"
    summary_path.unlink(missing_ok=True)
    before = set((home / "logs").glob("*.profile.json")) if (home / "logs").exists() else set()
    cmd = [
        *quantloop(),
        "run",
        "--home",
        str(home),
        "--params",
        str(pfile),
        "--summary-json",
        str(summary_path),
    ]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stderr[-3000:]}")
    profiles = set((home / "logs").glob("*.profile.json")) - before
    # the peer writes no breakdown: its wall and compute only
    breakdown = (
        json.loads(profiles.pop().read_text())
        if profiles
        else {"phases": [], "totals": {}, "wall_s": wall}
    )
    summary = json.loads(summary_path.read_text())
    sites = summary.get("sites") or {}
    compute = sum(
        s.get("compute_s", 0) + s.get("train_s", 0) + s.get("simulate_s", 0) for s in sites.values()
    )
    phases: dict[str, float] = {}
    for p in breakdown["phases"]:
        phases[p["name"]] = phases.get(p["name"], 0.0) + p["seconds"]
    # "other": the flow's own overhead (Prefect's flow and task runs, MLflow set-up,
    # planning) is what "flow" holds beyond its stages
    stages = sum(
        phases.get(n, 0.0) for n in ("landing", "planning", "features", "train", "simulate")
    )
    phases["flow overhead"] = phases.get("flow", 0.0) - stages
    phases["after exit handlers"] = max(wall - breakdown["wall_s"], 0.0)
    return {
        "wall_s": wall,
        "compute_s": compute,
        "cache_hits": summary["cache_hits"],
        "computed": summary["computed"],
        "model_cached": summary["model_cached"],
        "simulation_cached": summary["simulation_cached"],
        "phases": phases,
        "totals": breakdown["totals"],
        "process": breakdown.get("process", "in-process"),
        "api": next(
            (
                line
                for line in done.stdout.splitlines() + done.stderr.splitlines()
                if "Prefect API" in line
            ),
            "",
        ),
    }


def median_of(runs: list[dict]) -> dict:
    def med(values):
        return statistics.median(values) if values else float("nan")

    phases = sorted({k for r in runs for k in r["phases"]})
    order = list(dict.fromkeys(k for r in runs for k in r["phases"]))  # as a run passes them
    totals = sorted({k for r in runs for k in r["totals"]})
    wall, compute = med([r["wall_s"] for r in runs]), med([r["compute_s"] for r in runs])
    # The overhead and the ratio of each run, then their median: the median wall less the
    # median compute can pair one run's wall with another's compute (synthetic training
    # changed on 2026-12-04 gave +6.2 s that way; the runs' computes were not kept then,
    # so their own overheads are unknown; a rerun's were 5.4, 3.1 and 3.5 s)
    ratios = [r["wall_s"] / r["compute_s"] for r in runs if r["compute_s"] > 0]
    return {
        "wall_s": wall,
        "wall_all_s": [round(r["wall_s"], 2) for r in runs],
        "compute_s": compute,
        "compute_all_s": [round(r["compute_s"], 2) for r in runs],
        "overhead_s": med([r["wall_s"] - r["compute_s"] for r in runs]),
        "ratio": med(ratios) if ratios else None,
        "phases": {k: med([r["phases"].get(k, 0.0) for r in runs]) for k in phases},
        "phase_order": order,
        "totals": {
            k: {
                "seconds": med([r["totals"].get(k, {}).get("seconds", 0.0) for r in runs]),
                "count": med([r["totals"].get(k, {}).get("count", 0) for r in runs]),
            }
            for k in totals
        },
        "hits": [f"{r['cache_hits']}/{r['cache_hits'] + r['computed']}" for r in runs],
        "process": sorted({r["process"] for r in runs}),
        "api": [r["api"] for r in runs],
    }


def warm_up(env: dict) -> int | None:
    """Start the warm process for `env` (a command that fails at once starts it) and wait
    until it has done its imports; its pid. None with QUANTLOOP_FORKSERVER=0 or a peer."""
    if PEER is not None or env.get("QUANTLOOP_FORKSERVER") == "0":
        return None
    subprocess.run([*quantloop(), "run", "--lobster", "/nonexistent-warm-up"], env=env,
                   capture_output=True)  # fmt: skip
    # asked by the runs' own interpreter and quantloop (on the GPU machine the bench's
    # differ: the checkout here, the installed wheel there)
    ping = [quantloop()[0], "-m", "quantloop.forkserver", "--ping"]
    if Path(ping[0]).name == "quantloop":
        ping[0] = sys.executable
    deadline = time.monotonic() + 300
    while (done := subprocess.run(ping, env=env, capture_output=True, text=True)).returncode:
        if time.monotonic() > deadline:
            raise RuntimeError("the warm process did not start in 300 s")
        time.sleep(0.5)
    return int(done.stdout)


def stop_api(home: Path, env: dict) -> None:
    subprocess.run(
        [*quantloop(), "api", "stop", "--home", str(home)], env=env, capture_output=True, text=True
    )


def bench(
    data: str,
    repeat: int,
    extra: dict,
    work: Path,
    env: dict,
    out: dict,
    done=lambda: None,
    cases: tuple[str, ...] = CASES,
    cold_repeat: int | None = None,
) -> dict:
    """The cases on one data set, into `out`; `done()` after each (the results so far are
    written)."""
    params = data_params(data, extra)
    homes = [work / f"{data}-cold{r}" for r in range(cold_repeat or repeat)]
    try:
        cold = []
        for r, home in enumerate(homes):
            cold.append(run_once(home, params, env))
            print(f"{data} cold {r}: {cold[-1]['wall_s']:.1f} s", flush=True)
            if r > 0:
                stop_api(home, env)
        out["cold"] = median_of(cold)
        done()
        home = homes[0]  # the warm home: its API resident, its stores full
        product = products_of(home)[0]
        noop = []
        for r in range(repeat):
            noop.append(run_once(home, params, env))
            print(f"{data} no-op {r}: {noop[-1]['wall_s']:.1f} s", flush=True)
        out["no-op"] = median_of(noop)
        done()
        if IN_PROCESS in cases and PEER is None:
            inproc, env_in = [], {**env, "QUANTLOOP_FORKSERVER": "0"}
            for r in range(repeat):
                inproc.append(run_once(home, params, env_in))
                print(f"{data} {IN_PROCESS} {r}: {inproc[-1]['wall_s']:.1f} s", flush=True)
            out[IN_PROCESS] = median_of(inproc)
            done()
        if "feature changed" in cases:
            runs = []
            for r in range(repeat):
                runs.append(run_once(home, changed(params, "feature changed", r, product), env))
                print(f"{data} feature changed {r}: {runs[-1]['wall_s']:.1f} s", flush=True)
            out["feature changed"] = median_of(runs)
            done()
        # training changed, and its peer with overlap off alternately (the same drift)
        pair = [c for c in ("training changed", OVERLAP_OFF) if c in cases]
        runs_of: dict[str, list] = {c: [] for c in pair}
        env_of = {"training changed": env, OVERLAP_OFF: {**env, "QUANTLOOP_OVERLAP": "0"}}
        for r in range(repeat):
            for case in pair:
                runs_of[case].append(run_once(home, changed(params, case, r, product),
                                              env_of[case]))  # fmt: skip
                print(f"{data} {case} {r}: {runs_of[case][-1]['wall_s']:.1f} s", flush=True)
                out[case] = median_of(runs_of[case])
                done()
    finally:
        for home in homes:
            stop_api(home, env)
    return out


def markdown(result: dict) -> str:
    lines = [
        "# Turnaround: `quantloop run` from process start to exit",
        "",
        stamp_line(result["stamp"]),
        "",
        f"Median of {result['repeat']} runs of the real CLI in a subprocess each. compute: "
        "the work alone (feature node seconds + the training loop + the replay, from the "
        "run's summary); overhead and wall / compute: each run's, their median (not the "
        "median wall's less the median compute's). Extra parameters: "
        f"`{json.dumps(result['extra'])}`. process: `warm` a child of the warm process "
        "(quantloop/forkserver.py, started and waited for before the first run), "
        "`in-process` the command's own interpreter.",
        "",
    ]
    if result.get("peer"):
        lines += [
            f"Peer: the same runs of the CLI of the checkout `{result['peer']}` (the code "
            "this replaces), its temporary Prefect server waited for.",
            "",
        ]
    rows = []
    for data, cases in result["data"].items():
        for case, m in cases.items():
            ratio = f"{m['ratio']:.2f}" if m["ratio"] else "n/a"
            rows.append(
                (
                    data,
                    case,
                    f"{m['wall_s']:.1f}",
                    f"{m['compute_s']:.1f}",
                    f"{m['overhead_s']:.1f}",
                    ratio,
                    " ".join(m["hits"]),
                    ", ".join(f"{w:.1f}" for w in m["wall_all_s"]),
                    " ".join(m.get("process", [])),
                )
            )
    lines += [
        markdown_table(
            (
                "data",
                "case",
                "wall s",
                "compute s",
                "overhead s",
                "wall / compute",
                "feature hits",
                "each run's wall s",
                "process",
            ),
            rows,
            numeric=[False, False, True, True, True, True, False, False, False],
        ),
        "",
    ]
    for data, cases in result["data"].items():
        warm, inproc = cases.get("no-op"), cases.get(IN_PROCESS)
        if warm and inproc:
            lines += [
                f"{data}: the no-op re-run by the warm process {warm['wall_s']:.1f} s against "
                f"{inproc['wall_s']:.1f} s in-process: {inproc['wall_s'] / warm['wall_s']:.2f}x "
                "shorter.",
                "",
            ]
    lines += ["## Where the time goes (median seconds per phase)", ""]
    names = [*PHASES, "flow overhead", "after exit handlers"]
    rows = []
    for data, cases in result["data"].items():
        for case, m in cases.items():
            mlflow = m["totals"].get("mlflow", {})
            rows.append(
                (
                    data,
                    case,
                    *(f"{m['phases'].get(n, 0.0):.2f}" for n in names),
                    f"{mlflow.get('seconds', 0.0):.2f} / {mlflow.get('count', 0):.0f}",
                )
            )
    lines += [
        markdown_table(
            ("data", "case", *names, "MLflow s / calls"),
            rows,
            numeric=[False, False, *[True] * (len(names) + 1)],
        ),
        "",
    ]
    lines += [
        "Phases: `start and imports (cli)` from the process's start to the command's first "
        "line; `checks` the parameters and the data read and validated; `imports (flow)` "
        "Prefect, MLflow, Dask and the stages; `api` finding or starting the Prefect API; "
        "the stages inside the flow; `flow overhead` the flow's time outside its stages "
        "(Prefect's flow and task runs, MLflow's client and runs, planning); `shutdown` "
        "from the output to the last exit handler; `after exit handlers` the interpreter's "
        "teardown, measured from outside. MLflow: the calls' seconds, inside the phases.",
        "",
    ]
    lines += inside(result)
    return "\n".join(lines)


# The train and simulate stages' own phases, and the totals of the work in and beside them
INSIDE = ("flow", "features", "train", "simulate", "statistics")
BESIDE = ("ahead: inductor", "registration", "registration: export in a warm child",
          "mlflow", "mlflow, background")  # fmt: skip


def inside(result: dict) -> list[str]:
    """A table of the training-changed cases' train and simulate phases side by side
    (median seconds), with the work beside them and what the compute holds."""
    cases = [(data, case, m) for data, by_case in result["data"].items()
             for case, m in by_case.items() if case.startswith("training changed")]  # fmt: skip
    if not cases:
        return []
    order = list(dict.fromkeys(n for *_, m in cases for n in m.get("phase_order", [])
                               if n.startswith(INSIDE)))  # fmt: skip
    rows = [(name, *(f"{m['phases'].get(name, 0.0):.2f}" for *_, m in cases)) for name in order]
    rows += [(f"{name} (total)",
              *(f"{m['totals'].get(name, {}).get('seconds', 0.0):.2f}" for *_, m in cases))
             for name in BESIDE if any(name in m["totals"] for *_, m in cases)]  # fmt: skip
    rows += [
        ("wall", *(f"{m['wall_s']:.2f}" for *_, m in cases)),
        ("compute", *(f"{m['compute_s']:.2f}" for *_, m in cases)),
        (
            "of which the first compiled step",
            *(f"{m['phases'].get('train: first step', 0.0):.2f}" for *_, m in cases),
        ),
        ("wall - compute", *(f"{m['overhead_s']:.2f}" for *_, m in cases)),
        ("wall / compute", *(f"{m['ratio']:.2f}" if m["ratio"] else "n/a" for *_, m in cases)),
    ]
    return [
        "## The flow and its stages inside (median seconds per phase)",
        "",
        markdown_table(
            ("phase", *(f"{data}: {case}" for data, case, _ in cases)),
            rows,
            numeric=[False, *[True] * len(cases)],
        ),  # fmt: skip
        "",
        "compute is the feature nodes' seconds, the training loop (from the compile cache's "
        "load to the last step: the first compiled step, which loads the kernels, included) "
        "and the replay (the model's load and its first, compiling batches included). "
        "Totals: seconds summed over their calls; `ahead: inductor` (a thread), "
        "`registration` (a thread; its export in another process when `registration: export "
        "in a warm child` shows) and `mlflow, background` ran beside the phases above.",
        "",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--data",
        default="synthetic,lobster",
        help="comma-separated: synthetic (the embedded default), lobster",
    )
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--cold-repeat",
        type=int,
        default=None,
        help="cold runs (default --repeat): each compiles or fills a fresh home",
    )
    parser.add_argument(
        "--params",
        type=Path,
        default=None,
        help="research parameters every run gets (the H200's workload shape)",
    )
    parser.add_argument("--name", default="turnaround", help="bench/results/<name>.json, .md")
    parser.add_argument("--results", type=Path, default=None, help="folder for the results")
    parser.add_argument("--work", type=Path, default=None, help="folder for the runs' homes")
    parser.add_argument(
        "--peer",
        type=Path,
        default=None,
        help="a checkout of the code this replaces: the same runs of its CLI",
    )
    parser.add_argument(
        "--cases",
        default=",".join((*CASES, IN_PROCESS)),
        help="cold and no-op always run; add 'feature changed', 'training changed', "
        f"'{OVERLAP_OFF}', '{IN_PROCESS}'",
    )
    args = parser.parse_args()
    extra = json.loads(args.params.read_text()) if args.params else {}
    work = args.work or Path(tempfile.mkdtemp(prefix="turnaround-"))
    work.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    global PEER
    if args.peer is not None:
        PEER = args.peer.resolve()
        # the peer's temporary server per command: waited for (its 20 s default failed
        # here on a busy machine; a failed run would measure nothing)
        env["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"] = "600"
        env["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    result: dict = {
        "repeat": args.repeat,
        "extra": extra,
        "data": {},
        "peer": str(args.peer) if args.peer else None,
    }
    folder = args.results or ROOT / "bench" / "results"

    code = commit()  # before the first save: the results are tracked files, and a stamp
    # taken after it read the checkout as changed ("+dirty")

    def save() -> tuple[Path, Path]:
        # after every case: a run cut short (the GPU machine's 10-minute limit) keeps what
        # it measured
        result["stamp"] = {**stamp(), "commit": code}
        return write(args.name, result, markdown(result), folder)

    warm = warm_up(env)
    result["warm_process"] = warm is not None
    print(f"warm process: {warm or 'none'}", flush=True)
    try:
        for data in args.data.split(","):
            if data == "lobster" and not LOBSTER.is_dir():
                print(f"skipping lobster: {LOBSTER} not found", flush=True)
                continue
            result["data"][data] = {}
            bench(
                data,
                args.repeat,
                extra,
                work,
                env,
                result["data"][data],
                done=save,
                cases=tuple(args.cases.split(",")),
                cold_repeat=args.cold_repeat,
            )
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    paths = save()
    print(markdown(result))
    print("written:", *paths)


if __name__ == "__main__":
    main()
