"""Bad input that used to cost memory or pass silently (issue 21): a zip bomb, a bad row at
the end of a large file, a dangling symlink, a symlink's target, an infinite mark-out
horizon, and "too little data" advice that must fit LOBSTER input.

The zip and large-file tests run the real CLI in a child process and read that child's
peak RSS from the kernel (os.wait4's rusage), with an address-space cap on the child so
that a regression fails the test with a MemoryError instead of taking this machine's
memory from everything else running on it.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import resource
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch

from quantloop.flows.params import ResearchParams
from quantloop.tasks.data.catalog import Catalog
from quantloop.tasks.data.ingest import DataValidationError
from quantloop.tasks.data.landing import land_lobster, read_lobster_folder

GiB, MiB = 1 << 30, 1 << 20
EXE = Path(sys.executable).with_name("quantloop")
STEM = "AMZN_2012-06-21_34200000_57600000"
# One valid 1-level day: a message row and its order book row, repeated (equal times are
# allowed, so any number of copies is a valid day).
MSG_ROW = b"34200.1,1,1,100,1000100,-1\n"
BOOK_ROW = b"1000100,100,1000000,200\n"
# What the child may map at most: well above the 500 MB target (Python, NumPy and Arrow map
# more than they touch), far below what the unbounded reads took (3.9 GB for 200 MB).
AS_CAP = 3 * GiB
PEAK_MB = 500


# The child is started by a small Python process that reports the child's rusage: a child
# forked from pytest itself would count pytest's pages as its own (Linux keeps the RSS
# high-water mark across fork and exec: a 4-row day measured 310 MB that way).
_WRAP = (
    "import os, subprocess, sys; p = subprocess.Popen(sys.argv[1:]); "
    "_, status, usage = os.wait4(p.pid, 0); "
    "print(f'\\n@@maxrss_kib {usage.ru_maxrss}', file=sys.stderr); "
    "sys.exit(os.waitstatus_to_exitcode(status) & 0xFF)"
)


def measured(args: list[str], *, env: dict | None = None, timeout: float = 120.0):
    """(exit code, output, peak RSS in MB, wall seconds) of a command."""
    cap = lambda: resource.setrlimit(resource.RLIMIT_AS, (AS_CAP, AS_CAP))  # noqa: E731
    t = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRAP, *args], env=env, preexec_fn=cap, start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the wrapper and the command under it
        proc.communicate()
        raise
    wall = time.perf_counter() - t
    text, _, peak = out.decode("utf-8", "replace").rpartition("\n@@maxrss_kib ")
    assert peak.strip().isdigit(), text[-3000:]
    return proc.returncode, text, int(peak) / 1024, wall  # ru_maxrss is in KiB on Linux


def write_nul_member(zf: zipfile.ZipFile, name: str, size: int) -> None:
    chunk = bytes(16 * MiB)
    with zf.open(name, "w", force_zip64=size >= 2 * GiB) as f:
        for _ in range(size // len(chunk)):
            f.write(chunk)
        f.write(bytes(size % len(chunk)))


@pytest.fixture(scope="session")
def bomb_dir(tmp_path_factory) -> Path:
    """A folder holding one ~1 MB zip whose message member is 1 GiB of NUL bytes (what the
    testers sent, at half their size); made once per session (a few seconds)."""
    folder = tmp_path_factory.mktemp("bomb")
    with zipfile.ZipFile(folder / "bomb.zip", "w", zipfile.ZIP_DEFLATED) as zf:
        write_nul_member(zf, f"{STEM}_message_1.csv", GiB)
        zf.writestr(f"{STEM}_orderbook_1.csv", BOOK_ROW * 10)
    return folder


def run_cli(folder: Path, tmp_path: Path, **env: str):
    environ = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")} | env
    return measured(
        [str(EXE), "run", "--lobster", str(folder), "--home", str(tmp_path / "home")],
        env=environ,
    )


def assert_one_line_refusal(code: int, out: str, *parts: str) -> str:
    lines = [line for line in out.splitlines() if line.strip()]
    assert code == 2, out[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error:"), out[-3000:]
    for part in parts:
        assert part in lines[0], lines[0]
    return lines[0]


def test_a_zip_member_declaring_a_gib_is_refused_in_one_line_in_little_memory(bomb_dir, tmp_path):
    code, out, peak_mb, wall = run_cli(bomb_dir, tmp_path)
    line = assert_one_line_refusal(code, out, "bomb.zip", f"{STEM}_message_1.csv", "1 GiB")
    assert "QUANTLOOP_INGEST_MAX_MEMBER_BYTES" in line  # says how to raise the limit
    assert peak_mb < PEAK_MB, f"peak RSS {peak_mb:.0f} MB"
    assert wall < 30, f"{wall:.1f} s (target 5 s on an idle machine: bench/bad_input.py)"
    assert not (tmp_path / "home").exists()


def test_a_bomb_under_the_size_limit_is_refused_by_its_ratio_or_streamed(bomb_dir, tmp_path):
    # The size limit raised past the member: the compression ratio refuses it.
    code, out, peak_mb, _ = run_cli(
        bomb_dir, tmp_path, QUANTLOOP_INGEST_MAX_MEMBER_BYTES=str(2 * GiB)
    )
    assert_one_line_refusal(code, out, "bomb.zip", "QUANTLOOP_INGEST_MAX_RATIO")
    assert peak_mb < PEAK_MB, f"peak RSS {peak_mb:.0f} MB"
    # Both limits raised: the member is streamed, and its first block (no line end in it)
    # is refused at row 1, without inflating the rest.
    code, out, peak_mb, _ = run_cli(
        bomb_dir, tmp_path,
        QUANTLOOP_INGEST_MAX_MEMBER_BYTES=str(2 * GiB), QUANTLOOP_INGEST_MAX_RATIO="100000",
    )  # fmt: skip
    assert_one_line_refusal(code, out, f"bomb.zip!{STEM}_message_1.csv: row 1", "line end")
    assert peak_mb < PEAK_MB, f"peak RSS {peak_mb:.0f} MB"


def test_a_member_whose_declared_size_lies_is_refused_in_little_memory(tmp_path):
    """300 MB of NULs whose headers declare 1 MiB: only the declared bytes are inflated."""
    folder = tmp_path / "lies"
    folder.mkdir()
    path = folder / "lies.zip"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        write_nul_member(zf, f"{STEM}_message_1.csv", 300 * MiB)
        zf.writestr(f"{STEM}_orderbook_1.csv", BOOK_ROW * 10)
    data = bytearray(path.read_bytes())
    for signature, field in ((b"PK\x03\x04", 22), (b"PK\x01\x02", 24)):  # local, central
        at = data.index(signature)
        assert int.from_bytes(data[at + field : at + field + 4], "little") == 300 * MiB
        data[at + field : at + field + 4] = MiB.to_bytes(4, "little")
    path.write_bytes(bytes(data))
    code, out, peak_mb, _ = run_cli(folder, tmp_path)
    assert_one_line_refusal(code, out, "lies.zip")
    assert peak_mb < PEAK_MB, f"peak RSS {peak_mb:.0f} MB"


@pytest.fixture(scope="session")
def large_day(tmp_path_factory) -> Path:
    """A valid 1-level LOBSTER day: a 200 MB message file and its 178 MB order book."""
    folder = tmp_path_factory.mktemp("large")
    rows = 200_000_000 // len(MSG_ROW)
    block = 100_000
    for kind, row in (("message", MSG_ROW), ("orderbook", BOOK_ROW)):
        with (folder / f"{STEM}_{kind}_1.csv").open("wb") as f:
            for _ in range(rows // block):
                f.write(row * block)
            f.write(row * (rows % block))
    return folder


def test_a_bad_row_at_the_end_of_a_large_file_is_found_in_little_memory(large_day, tmp_path):
    folder = tmp_path / "bad"
    folder.mkdir()
    message = large_day / f"{STEM}_message_1.csv"
    rows = message.stat().st_size // len(MSG_ROW)
    (folder / message.name).symlink_to(message)
    (folder / f"{STEM}_orderbook_1.csv").symlink_to(large_day / f"{STEM}_orderbook_1.csv")
    # The same day with its last message row given a column too many.
    bad = folder / "copy"
    bad.mkdir()
    with (bad / message.name).open("wb") as f, message.open("rb") as src:
        while chunk := src.read(64 * MiB):
            f.write(chunk)
        f.seek(-1, os.SEEK_END)
        f.write(b",7\n")
    (bad / f"{STEM}_orderbook_1.csv").symlink_to(large_day / f"{STEM}_orderbook_1.csv")
    code, out, peak_mb, wall = run_cli(bad, tmp_path)
    assert_one_line_refusal(code, out, f"_message_1.csv: row {rows}:", "7 columns")
    size_mb = message.stat().st_size / 1e6
    assert peak_mb < PEAK_MB, f"peak RSS {peak_mb:.0f} MB for a {size_mb:.0f} MB file"
    print(f"bad row at the end of {rows:,} rows: refused in {wall:.1f} s, peak {peak_mb:.0f} MB")


def test_a_large_valid_day_is_checked_in_memory_well_below_its_size(large_day, tmp_path):
    """What `quantloop run` does before anything starts (preflight) reads the whole day in
    bounded memory; landing it then holds the day's table (measured in bench/bad_input.py)."""
    size_mb = sum(f.stat().st_size for f in large_day.iterdir()) / 1e6
    script = (
        "import sys; from quantloop.tasks.data.landing import scan_lobster_folder as s; "
        "print([(d.product, d.rows) for d in s(sys.argv[1])])"
    )
    small_day(tmp_path)
    code, out, imports_mb, _ = measured([sys.executable, "-c", script, str(tmp_path)])
    assert code == 0 and "('TEST', 4)" in out, out[-3000:]
    code, out, peak_mb, wall = measured([sys.executable, "-c", script, str(large_day)])
    assert code == 0, out[-3000:]
    assert f"('AMZN', {200_000_000 // len(MSG_ROW)})" in out
    # Beyond what the imports and a 4-row day take: a few blocks, not the files.
    assert peak_mb - imports_mb < 100, (
        f"peak RSS {peak_mb:.0f} MB ({imports_mb:.0f} MB for a 4-row day) for {size_mb:.0f} "
        "MB of files"
    )
    print(f"{size_mb:.0f} MB of LOBSTER files checked in {wall:.1f} s, peak {peak_mb:.0f} MB "
          f"({imports_mb:.0f} MB for a 4-row day)")  # fmt: skip


# --------------------------------------------------------------------------- symlinks


def small_day(folder: Path, product: str = "TEST", day: str = "2024-01-02", rows: int = 4):
    stem = f"{product}_{day}_34200000_57600000"
    (folder / f"{stem}_message_1.csv").write_bytes(MSG_ROW * rows)
    (folder / f"{stem}_orderbook_1.csv").write_bytes(BOOK_ROW * rows)
    return folder / f"{stem}_message_1.csv"


def test_a_dangling_symlink_is_an_error_naming_the_link_and_its_target(tmp_path):
    small_day(tmp_path)
    gone = tmp_path / "elsewhere" / "GONE_2024-01-02_34200000_57600000_message_1.csv"
    link = tmp_path / gone.name
    link.symlink_to(gone)
    with pytest.raises(DataValidationError) as err:
        read_lobster_folder(tmp_path)
    assert str(link) in str(err.value) and str(gone) in str(err.value), err.value
    zip_link = tmp_path / "day.zip"
    link.unlink()
    zip_link.symlink_to(tmp_path / "missing.zip")
    with pytest.raises(DataValidationError, match="day.zip.*missing.zip.*does not exist"):
        read_lobster_folder(tmp_path)


def test_a_dangling_orderbook_symlink_names_the_link_and_its_target(tmp_path):
    message = small_day(tmp_path)
    book = message.with_name(message.name.replace("message", "orderbook"))
    book.unlink()
    book.symlink_to(tmp_path / "nowhere.csv")
    with pytest.raises(DataValidationError) as err:
        read_lobster_folder(tmp_path)
    assert str(book) in str(err.value) and "nowhere.csv" in str(err.value), err.value


def test_the_catalog_records_the_file_a_symlink_points_to(tmp_path):
    real = tmp_path / "store"
    real.mkdir()
    message = small_day(real)
    folder = tmp_path / "lobster"
    folder.mkdir()
    for f in real.iterdir():
        (folder / f.name).symlink_to(f)
    catalog = Catalog(tmp_path / "catalog.db")
    [landed] = land_lobster(catalog, str(tmp_path / "root"), folder)
    assert str(message.resolve()) in landed.entry.source, landed.entry.source
    assert str(folder / message.name) in landed.entry.source, landed.entry.source


# --------------------------------------------------------------------------- parameters


@pytest.mark.parametrize("bad", [math.inf, -math.inf, "Infinity"])
def test_a_non_finite_markout_horizon_is_refused_naming_the_parameter(bad):
    with pytest.raises(ValueError, match=r"markout_horizons_s") as err:
        ResearchParams.model_validate({"simulation": {"markout_horizons_s": [1, bad]}})
    assert "finite" in str(err.value) or "greater than 0" in str(err.value), err.value


def test_the_cli_refuses_an_infinite_markout_horizon_before_any_work(tmp_path):
    params = tmp_path / "params.json"
    params.write_text('{"simulation": {"markout_horizons_s": [1, Infinity]}}')
    proc = subprocess.run(
        [str(EXE), "run", "--params", str(params), "--home", str(tmp_path / "home")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    # SimConfig's own check (backtest and retrain build it too) answers first, naming the
    # section and the field
    assert_one_line_refusal(proc.returncode, out, "simulation: markout_horizons_s", "finite")
    assert not (tmp_path / "home").exists()


def test_too_little_lobster_data_names_the_days_and_gives_lobster_advice(tmp_path):
    for i in range(3):
        small_day(tmp_path, day=f"2024-01-0{i + 2}", rows=4 + i)
    params = ResearchParams.model_validate({"data": {"lobster_dir": str(tmp_path)}})
    with pytest.raises(ValueError) as err:
        params.preflight()
    text = str(err.value)
    assert "synthetic" not in text, text
    assert "TEST" in text and "6 events" in text and "2024-01-04" in text, text
    assert "features.label_horizons" in text and "LOBSTER" in text, text
    assert dt.date(2024, 1, 4).isoformat() in text
    json.dumps(text)  # one plain string


def test_the_checks_refuse_an_incomplete_optimization_list_and_a_missing_gpu():
    # what preflight checks of the training's plan before any server starts: a switch
    # without the one it needs, on any machine; a CUDA device on a machine without one
    params = ResearchParams.model_validate({"train": {"optimizations": ["cudagraph"]}})
    with pytest.raises(ValueError, match="train.optimizations: cudagraph needs device_metrics"):
        params.preflight()
    complete = ResearchParams.model_validate(
        {"train": {"optimizations": ["device_metrics", "packing"]}}
    )
    assert complete.preflight()  # the products it found
    if not torch.cuda.is_available():
        on_gpu = ResearchParams.model_validate({"train": {"device": "cuda"}})
        with pytest.raises(ValueError, match="has no CUDA"):
            on_gpu.preflight()
