"""Prefect's clients of a plain-HTTP API with one CA certificate (the CA file
tasks/runtime/prefect_settings.plain_http_tls sets) against certifi's bundle (Prefect's
default, the peer it replaces), in the same run:

1. one PrefectClient made (its TLS context built in __init__), CPU milliseconds, the
   median of `--clients` each, alternating;
2. a cached `quantloop run` of a tiny synthetic workspace (every node a hit, served by
   the warm process), process start to exit, `--repeats` pairs, each side first in half
   of them; the peer's
   runs set PREFECT_API_SSL_CERT_FILE to certifi's file, which the command leaves as the
   user's choice. Each side has its own warm process (they are keyed by the environment).

    python bench/client_tls.py [--repeats 20] [--clients 30] [--out bench/results]

Writes <out>/client-tls.json and .md (machine, date, commit).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.checkout import use_checkout  # noqa: E402

use_checkout()

from bench.report import RESULTS, markdown_table, stamp, stamp_line, write  # noqa: E402

QUANTLOOP = str(Path(sys.executable).with_name("quantloop"))  # this install's command
TINY = {
    "data": {"n_dates": 2, "products": ["AAA"],
             "synthetic": {"events_per_day": 1500, "levels": 2}},
    "train": {"steps": 10, "batch_size": 64, "log_every": 5},
    "validation": {"folds": 1},
}  # fmt: skip

CLIENT = """
import ssl, statistics, sys, time
from prefect.client.orchestration import PrefectClient
cafile = sys.argv[1]
from quantloop.tasks.runtime.prefect_settings import overridden
out = []
with overridden({"api.ssl_cert_file": cafile}):
    for _ in range(int(sys.argv[2])):
        t = time.thread_time()
        PrefectClient("http://127.0.0.1:9/api")
        out.append((time.thread_time() - t) * 1000)
print(statistics.median(out))
"""


def sign_test(differences: list[float]) -> float:
    """Two-sided sign test of median zero (ties dropped): the exact binomial p-value."""
    from math import comb

    pos = sum(d > 0 for d in differences)
    n = pos + sum(d < 0 for d in differences)
    if n == 0:
        return 1.0
    k = min(pos, n - pos)
    return min(1.0, 2 * sum(comb(n, i) for i in range(k + 1)) / 2**n)


def client_ms(cafile: str, n: int) -> float:
    out = subprocess.run([sys.executable, "-c", CLIENT, cafile, str(n)], check=True,
                         capture_output=True, text=True).stdout  # fmt: skip
    return float(out.strip().splitlines()[-1])


def run_s(home: Path, params: Path, env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run([QUANTLOOP, "run", "--home", str(home), "--params", str(params)],
                   env=env, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)  # fmt: skip
    return time.perf_counter() - start


def main() -> None:
    import certifi

    from quantloop.tasks.runtime.prefect_settings import PLAIN_HTTP_CA

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--clients", type=int, default=30)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    sides = {"one certificate": str(PLAIN_HTTP_CA), "certifi (peer)": certifi.where()}

    clients: dict[str, list[float]] = {s: [] for s in sides}
    for _ in range(3):
        for side, cafile in sides.items():
            clients[side].append(client_ms(cafile, args.clients))

    work = Path(tempfile.mkdtemp(prefix="client-tls-"))
    params = work / "tiny.json"
    params.write_text(json.dumps(TINY))
    home = work / "home"
    base = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    envs = {"one certificate": base,
            "certifi (peer)": {**base, "PREFECT_API_SSL_CERT_FILE": certifi.where()}}  # fmt: skip
    run_s(home, params, base)  # lands, computes and registers; both sides then hit
    for env in envs.values():
        run_s(home, params, env)  # each side's warm process started and its first run
    runs: dict[str, list[float]] = {s: [] for s in sides}
    order = list(envs)
    for r in range(args.repeats):
        # each side first in half the pairs: a run that gains (or loses) from following
        # the other would otherwise show as a difference between the sides
        for side in order if r % 2 == 0 else order[::-1]:
            runs[side].append(run_s(home, params, envs[side]))
            print(f"{side} {r}: {runs[side][-1]:.2f} s", flush=True)
    # the resident API now; the warm processes end on their idle timeout
    subprocess.run([QUANTLOOP, "api", "stop", "--home", str(home)], env=base,
                   capture_output=True)  # fmt: skip

    new, old = runs["one certificate"], runs["certifi (peer)"]
    paired = [o - n for n, o in zip(new, old, strict=True)]
    result = {
        "stamp": stamp(),
        "client_ms": {s: statistics.median(v) for s, v in clients.items()},
        "client_ms_each": clients,
        "noop_s": runs,
        "noop_median_s": {s: statistics.median(v) for s, v in runs.items()},
        "paired_saving_s": {
            # the median and a sign test: one run of a pair slowed by the machine (4.2 s
            # against 2.2 once) moves a mean by a tenth of a second here
            "median": statistics.median(paired),
            "mean": statistics.mean(paired),
            "faster_in": sum(d > 0 for d in paired),
            "pairs": len(paired),
            "sign_test_p": sign_test(paired),
        },
    }
    c, n = result["client_ms"], result["noop_median_s"]
    this, peer = "one certificate", "certifi (peer)"
    rows = [
        ["PrefectClient made, CPU ms (median)", f"{c[this]:.2f}", f"{c[peer]:.2f}",
         f"{c[peer] / c[this]:.0f}x"],
        ["cached `quantloop run`, s (median)", f"{n[this]:.2f}", f"{n[peer]:.2f}",
         f"{n[peer] / n[this]:.2f}x"],
    ]  # fmt: skip
    ps = result["paired_saving_s"]
    md = "\n\n".join([
        "# Prefect's clients of a plain-HTTP API: one CA certificate against certifi's",
        stamp_line(result["stamp"]),
        markdown_table(["measure", "one certificate", "certifi (peer)", "peer / this"], rows),
        f"Paired saving of a cached run (peer less this, {ps['pairs']} pairs, each side "
        "first in half of them): "
        f"median {ps['median']:.3f} s (mean {ps['mean']:.3f}); this side faster in "
        f"{ps['faster_in']} of {ps['pairs']} (two-sided sign test p = {ps['sign_test_p']:.3f})."
        " The run: a tiny synthetic workspace (one "
        "product, two days), every node a cache hit, served by its side's warm process; "
        "process start to exit, measured from outside. A client's CPU: "
        f"{args.clients} made in a row in a fresh interpreter, the median, three "
        "interpreters a side (each side's medians: "
        + ", ".join(f"{s} {', '.join(f'{x:.2f}' for x in v)}" for s, v in clients.items())
        + ").",
    ]) + "\n"  # fmt: skip
    print(md)
    write("client-tls", result, md, args.out)


if __name__ == "__main__":
    main()
