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

`--large`: what large input costs instead (bench/results/bad-input-large.json and .md), each
command's wall time and peak RSS (its own, read by a small parent process with os.wait4):
(c) zip bombs, 1 and 2 GiB of NUL bytes as a message member, given to `quantloop run
    --lobster` (the target: refused in one line, < 5 s, < 500 MB), beside the same command
    on a folder that does not exist (the CLI's start alone);
(d) a valid 1-level day, a 200 MB message file and its 178 MB order book (7.4M rows): checked
    (`scan_lobster_folder`, what `quantloop run` does before it starts) and landed
    (`land_lobster`: one pass, each day written into its Parquet file a row group at a
    time, 1024 * 1024 rows), beside the same on a 4-row day (the imports alone).
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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--large", action="store_true", help="zip bombs and a 378 MB day")
    if parser.parse_args().large:
        return large()
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


# ------------------------------------------------------------------------------- --large

STEM = "AMZN_2012-06-21_34200000_57600000"
MSG_ROW, BOOK_ROW = b"34200.1,1,1,100,1000100,-1\n", b"1000100,100,1000000,200\n"
# A child forked from this process would count this process's pages as its own (Linux keeps
# the RSS high-water mark across fork and exec), so a small parent reports it.
WRAP = (
    "import os, subprocess, sys; p = subprocess.Popen(sys.argv[1:]); "
    "_, status, usage = os.wait4(p.pid, 0); "
    "print(f'\\n@@maxrss_kib {usage.ru_maxrss}', file=sys.stderr); "
    "sys.exit(os.waitstatus_to_exitcode(status) & 0xFF)"
)
SCAN = (
    "import sys; from quantloop.tasks.data.landing import scan_lobster_folder as f; f(sys.argv[1])"
)
LAND = (
    "import sys; from quantloop.tasks.data.catalog import Catalog; "
    "from quantloop.tasks.data.landing import land_lobster; "
    "import tempfile; store = tempfile.mkdtemp(dir=sys.argv[2]); "  # a fresh catalog each run
    "land_lobster(Catalog(store + '/catalog.db'), store, sys.argv[1])"
)


def measured(cmd: list[str], env: dict) -> dict:
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", WRAP, *cmd], env=env, capture_output=True,
                          text=True, timeout=900)  # fmt: skip
    wall = time.perf_counter() - t
    out, _, peak = (proc.stdout + proc.stderr).rpartition("\n@@maxrss_kib ")
    lines = [line for line in out.splitlines() if line.strip()]
    return {"wall_s": wall, "peak_mb": int(peak) / 1024, "rc": proc.returncode,
            "lines": len(lines), "last_line": lines[-1][:300] if lines else ""}  # fmt: skip


def bomb(path: Path, size: int) -> None:
    chunk = bytes(16 << 20)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        with zf.open(f"{STEM}_message_1.csv", "w", force_zip64=size >= 2**31) as f:
            for _ in range(size // len(chunk)):
                f.write(chunk)
        zf.writestr(f"{STEM}_orderbook_1.csv", BOOK_ROW * 10)


def day(folder: Path, rows: int) -> None:
    folder.mkdir()
    for kind, row in (("message", MSG_ROW), ("orderbook", BOOK_ROW)):
        with (folder / f"{STEM}_{kind}_1.csv").open("wb") as f:
            for _ in range(rows // 100_000):
                f.write(row * 100_000)
            f.write(row * (rows % 100_000))


def large() -> None:
    exe = str(Path(sys.executable).with_name("quantloop"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="quantloop-bad-input-large-") as tmp:
        cases = []
        for gib in (1, 2):
            folder = Path(tmp) / f"bomb-{gib}"
            folder.mkdir()
            bomb(folder / "bomb.zip", gib << 30)
            zip_mb = (folder / "bomb.zip").stat().st_size / 1e6
            label = f"(c) zip bomb: {zip_mb:.1f} MB zip, {gib} GiB NUL member, `quantloop run`"
            cases.append((label, [exe, "run", "--lobster", str(folder)]))
        cases.append(("(c) the CLI's start alone (a folder that does not exist)",
                      [exe, "run", "--lobster", f"{tmp}/nope"]))  # fmt: skip
        day(Path(tmp) / "small", 4)
        day(Path(tmp) / "large", 200_000_000 // len(MSG_ROW))
        size_mb = sum(f.stat().st_size for f in (Path(tmp) / "large").iterdir()) / 1e6
        for what, script in (
            ("checked (scan_lobster_folder)", SCAN),
            ("landed (land_lobster)", LAND),
        ):
            for name, label in (("small", "a 4-row day"), ("large", f"a {size_mb:.0f} MB day")):
                cmd = [sys.executable, "-c", script, f"{tmp}/{name}", tmp]
                cases.append((f"(d) {label} {what}", cmd))
        for label, cmd in cases:
            runs = [measured(cmd, env | {"PREFECT_HOME": f"{tmp}/prefect"}) for _ in range(3)]
            best = min(runs, key=lambda r: r["wall_s"])
            rows.append({"case": label, **best,
                         "wall_s_repeats": [round(r["wall_s"], 2) for r in runs],
                         "peak_mb_repeats": [round(r["peak_mb"]) for r in runs]})  # fmt: skip
            print(f"{label}: {best['wall_s']:.2f} s, {best['peak_mb']:.0f} MB, rc {best['rc']}, "
                  f"{best['last_line'][:120]}", flush=True)  # fmt: skip
    stamped = stamp()
    result = {"cases": rows, "target": "refused in one line, < 5 s, < 500 MB peak", **stamped}
    out = OUT.with_name("bad-input-large.json")
    out.write_text(json.dumps(result, indent=2) + "\n")
    md = "\n".join([
        stamp_line(result), "",
        "Peak RSS of the command itself (os.wait4 in a small parent); the fastest of 3 runs, "
        "all 3 listed.", "",
        "| case | wall s | peak MB | exit | output lines | runs (s) | runs (MB) |",
        "|---|---:|---:|---:|---:|---|---|",
        *[f"| {r['case']} | {r['wall_s']:.2f} | {r['peak_mb']:.0f} | {r['rc']} | {r['lines']} | "
          f"{', '.join(map(str, r['wall_s_repeats']))} | "
          f"{', '.join(map(str, r['peak_mb_repeats']))} |" for r in rows],
        "", "The bombs' error line: " + next(r["last_line"] for r in rows if "bomb" in r["case"]),
        "",
    ])  # fmt: skip
    out.with_suffix(".md").write_text(md)
    print("\n" + md)


if __name__ == "__main__":
    main()
