"""Bad input, refused: how long a folder of three bad LOBSTER files takes to be refused.

The folder is LOBSTER's three sample days (../shared/data/lobster), each with one fault
near its end, so every file is read whole before the fault shows: a message row with a
column too many, an order book row with a crossed book, a price that is not a number.

(a) `quantloop run --lobster <folder>`: the command a researcher types, process start
    to exit, its checks before any server starts (the CLI's preflight).
(b) the peer it replaces: the same folder handed to the research flow as a deployment
    or a script hands it, without the CLI's checks: Prefect's temporary server starts
    first, and the error comes from the data stage (what every bad folder did before).

Writes bench/results/bad-input.json and .md; records the machine, date and commit.
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
import zipfile
from pathlib import Path

from report import stamp, stamp_line  # bench/ is the script's folder, so on sys.path

ROOT = Path(__file__).resolve().parents[1]
LOBSTER = ROOT.parent / "shared" / "data" / "lobster"
OUT = ROOT / "bench" / "results" / "bad-input.json"
PEER = """
import sys
from quantloop.flows.params import ResearchParams
from quantloop.flows.research import research
research(ResearchParams.model_validate(
    {"data": {"lobster_dir": sys.argv[1]}, "workspace": {"home": sys.argv[2]}}))
"""


def bad_folder(where: Path) -> list[str]:
    """The three sample days, one fault in each near its end; the faults, described."""
    faults = []
    for i, sample in enumerate(sorted(LOBSTER.glob("LOBSTER_SampleFile_*.zip"))):
        written = []
        with zipfile.ZipFile(sample) as z:
            for name in z.namelist():
                if not name.endswith(".csv"):
                    continue
                # Two samples are AMZN on the same day (1 and 5 levels): one day each.
                target = where / (name.replace("AMZN", "AMZX") if i == 0 else name)
                target.write_bytes(z.read(name))
                written.append(target)
        message = next(f for f in written if "_message_" in f.name)
        book = next(f for f in written if "_orderbook_" in f.name)
        rows = (message if i != 1 else book).read_text().splitlines()
        k = len(rows) - 10
        cells = rows[k].split(",")
        if i == 0:
            rows[k] += ",7"
            faults.append(f"{message.name} row {k + 1}: a column too many")
        elif i == 1:
            cells[0], cells[2] = cells[2], cells[0]  # best ask below best bid
            rows[k] = ",".join(cells)
            faults.append(f"{book.name} row {k + 1}: crossed book")
        else:
            cells[4] = "fifty"
            rows[k] = ",".join(cells)
            faults.append(f"{message.name} row {k + 1}: price not a number")
        (message if i != 1 else book).write_text("\n".join(rows) + "\n")
    return faults


def timed(cmd: list[str], env: dict) -> tuple[float, int, str]:
    t = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    return time.perf_counter() - t, proc.returncode, proc.stdout + proc.stderr


def main() -> None:
    # No options: the parser gives `--help` (which would otherwise run the benchmark).
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    if not LOBSTER.is_dir():
        sys.exit(f"bench/bad_input.py needs LOBSTER's samples at {LOBSTER}")
    exe = Path(sys.executable).with_name("quantloop")
    with tempfile.TemporaryDirectory(prefix="quantloop-bad-input-") as tmp:
        folder = Path(tmp) / "lobster"
        folder.mkdir()
        faults = bad_folder(folder)
        size_mb = sum(f.stat().st_size for f in folder.iterdir()) / 1e6
        env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
        cli, peer = [], []
        for i in range(3):
            env["PREFECT_HOME"] = f"{tmp}/prefect-{i}"
            wall, code, out = timed(
                [str(exe), "run", "--lobster", str(folder), "--home", f"{tmp}/home-{i}"], env
            )
            assert code == 2 and "3 of 3 LOBSTER files are invalid" in out, out[-2000:]
            assert not Path(f"{tmp}/home-{i}").exists(), "the refused run wrote its home"
            cli.append(wall)
            print(f"(a) quantloop run: refused in {wall:.2f} s", flush=True)
            error_lines = [line for line in out.splitlines() if line.startswith("error:")]
        for i in range(2):
            env["PREFECT_HOME"] = f"{tmp}/prefect-peer-{i}"
            wall, code, out = timed(
                [sys.executable, "-c", PEER, str(folder), f"{tmp}/peer-home-{i}"], env
            )
            assert code != 0, out[-2000:]
            peer.append(wall)
            peer_lines = len(out.splitlines())
            print(f"(b) the flow without the CLI's checks: failed in {wall:.2f} s", flush=True)
    a, b = statistics.median(cli), statistics.median(peer)
    stamped = stamp()  # machine, date, commit (bench/report.py)
    result = {
        "folder": {"files": 6, "mb": round(size_mb, 1), "faults": faults},
        "cli_refused_s": a,
        "cli_refused_s_repeats": cli,
        "cli_error_lines": len(error_lines),
        "flow_failed_s": b,
        "flow_failed_s_repeats": peer,
        "flow_output_lines": peer_lines,
        "speedup": b / a,
        "target_s": 3.0,
        "machine": stamped["machine"],
        "date": stamped["date"],
        "commit": stamped["commit"],
    }
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    md = "\n".join([
        stamp_line(result),
        "",
        f"A folder of 3 bad LOBSTER days ({size_mb:.0f} MB, 6 files; one fault near the end "
        "of each: " + "; ".join(faults) + ").",
        "",
        "| run | wall s (median) | runs | output | (b) ÷ this |",
        "|---|---:|---:|---|---:|",
        f"| (a) `quantloop run --lobster`: refused before any server starts | {a:.2f} | "
        f"{', '.join(f'{w:.2f}' for w in cli)} | {len(error_lines)} error line naming "
        f"each file | {b / a:.1f} |",
        f"| (b) the research flow without the CLI's checks | {b:.2f} | "
        f"{', '.join(f'{w:.2f}' for w in peer)} | {peer_lines} lines | 1.0 |",
        "",
    ])  # fmt: skip
    OUT.with_suffix(".md").write_text(md)
    print("\n" + md)


if __name__ == "__main__":
    main()
