"""What the distribution installs, and which way its imports point.

The design card's folders (flows/, tasks/, blocks/, models/, profiling/) sit at the
repository's top but install as quantloop.flows, quantloop.tasks, ...: the wheel
puts one name into site-packages. The import contracts in pyproject.toml are
checked against that same wheel's tree (grimp walks a package's folder, and in the
checkout quantloop's subpackages live beside it, not inside it).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from quantloop.tasks.records.provenance import code_digest

ROOT = Path(__file__).resolve().parents[1]
SUBPACKAGES = ("flows", "tasks", "blocks", "models", "profiling")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> tuple[Path, Path]:
    """(the built wheel, its contents unpacked as site-packages would hold them)."""
    out = tmp_path_factory.mktemp("wheel")
    # Built from a copy of what the wheel is made of: setuptools builds in the source
    # tree (build/), where a stale module from an earlier build could slip in.
    src = out / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for folder in ("quantloop", *SUBPACKAGES):
        shutil.copytree(ROOT / folder, src / folder,
                        ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
         "--wheel-dir", str(out), str(src)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    [whl] = out.glob("quantloop-*.whl")
    tree = out / "site"
    with zipfile.ZipFile(whl) as z:
        z.extractall(tree)
    return whl, tree


def python(code: str, *, cwd: Path, path: Path | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if path is not None:
        env["PYTHONPATH"] = str(path)
    return subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True
    )


def test_the_wheel_installs_one_top_level_name(wheel):
    whl, tree = wheel
    with zipfile.ZipFile(whl) as z:
        names = z.namelist()
    tops = {n.split("/", 1)[0] for n in names if ".dist-info/" not in n}
    assert tops == {"quantloop"}
    [info] = tree.glob("quantloop-*.dist-info")
    assert (info / "top_level.txt").read_text().split() == ["quantloop"]
    # Prefect imports the collection by this name to register the block types.
    entry_points = (info / "entry_points.txt").read_text()
    assert "[prefect.collections]\nquantloop = quantloop.blocks" in entry_points
    for sub in SUBPACKAGES:
        assert (tree / "quantloop" / sub / "__init__.py").is_file(), sub


def test_bare_folder_names_are_not_importable_outside_the_checkout(tmp_path):
    ok = python("import quantloop.flows.research, quantloop.blocks", cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    for sub in SUBPACKAGES:
        bare = python(f"import {sub}", cwd=tmp_path)
        assert bare.returncode != 0 and f"No module named '{sub}'" in bare.stderr, sub


def test_code_digest_is_the_same_from_the_wheel_and_the_checkout(wheel, tmp_path):
    _, tree = wheel
    # Another project's folder named like ours beside the wheel's files must not count.
    (tree / "models").mkdir()
    (tree / "models" / "__init__.py").write_text("x = 1\n")
    code = "from quantloop.tasks.records.provenance import code_digest; print(code_digest())"
    from_wheel = python(code, cwd=tmp_path, path=tree)
    assert from_wheel.returncode == 0, from_wheel.stderr
    where = python("import quantloop.tasks; print(quantloop.tasks.__file__)", cwd=tmp_path,
                   path=tree).stdout.strip()  # fmt: skip
    assert where.startswith(str(tree)), where  # the wheel's copy was the one imported
    assert from_wheel.stdout.strip() == code_digest()
    shutil.rmtree(tree / "models")


def test_bench_checkout_maps_the_packages_to_its_own_checkout(tmp_path):
    """bench/checkout.py, for the GPU machine where quantloop is not installed: a copy of
    the checkout imports quantloop's packages from its own folders (pyproject's
    package-dir). `-S` leaves out site-packages, and with it the installed quantloop."""
    from bench.checkout import use_checkout

    assert use_checkout() is False  # installed here: nothing to do
    copy = tmp_path / "checkout"
    for name in ("quantloop", *SUBPACKAGES):
        shutil.copytree(ROOT / name, copy / name, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "bench").mkdir()
    for name in ("pyproject.toml", "bench/checkout.py"):
        shutil.copy(ROOT / name, copy / name)
    code = (
        "import sys; sys.path.insert(0, sys.argv[1])\n"
        "from bench.checkout import use_checkout\n"
        "assert use_checkout()\n"
        "import quantloop.profiling.config, quantloop.tasks.records.provenance\n"
        "print(quantloop.profiling.config.__file__, quantloop.tasks.records.provenance.__file__)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run([sys.executable, "-S", "-c", code, str(copy)], cwd=tmp_path, env=env,
                         capture_output=True, text=True)  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == [
        str(copy / "profiling" / "config.py"), str(copy / "tasks" / "records" / "provenance.py")
    ]  # fmt: skip


def lint_imports(tree: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    exe = Path(sys.executable).with_name("lint-imports")
    return subprocess.run(
        [str(exe), "--no-cache", str(ROOT / "pyproject.toml")],
        cwd=tree, env=env, capture_output=True, text=True,
    )  # fmt: skip


def test_import_contracts_hold(wheel):
    _, tree = wheel
    result = lint_imports(tree)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_import_contracts_catch_an_upward_import(wheel, tmp_path):
    """The check can fail: a library module that imports the CLI breaks the layers."""
    _, tree = wheel
    planted = tmp_path / "site"
    shutil.copytree(tree, planted)
    storage = planted / "quantloop" / "tasks" / "engine" / "storage.py"
    storage.write_text(storage.read_text() + "\nimport quantloop.cli  # noqa\n")
    result = lint_imports(planted)
    assert result.returncode != 0
    assert "quantloop.tasks.engine.storage -> quantloop.cli" in result.stdout


def test_the_engine_contract_catches_a_domain_import(wheel, tmp_path):
    """The engine may not import the domain: a features import in the engine breaks it."""
    _, tree = wheel
    planted = tmp_path / "site"
    shutil.copytree(tree, planted)
    store = planted / "quantloop" / "tasks" / "engine" / "store.py"
    store.write_text(store.read_text() + "\nimport quantloop.tasks.research.features  # noqa\n")
    result = lint_imports(planted)
    assert result.returncode != 0
    assert "quantloop.tasks.engine.store -> quantloop.tasks.research.features" in result.stdout


def test_site_workers_preload_what_the_site_block_names():
    """infra/dask/site.sh starts workers with the modules blocks/site.py preloads for a
    local cluster, and each of them imports."""
    import importlib
    import re

    from quantloop.blocks.site import WORKER_PRELOAD

    script = (ROOT / "infra" / "dask" / "site.sh").read_text()
    assert tuple(re.findall(r"--preload (\S+)", script)) == WORKER_PRELOAD
    for name in WORKER_PRELOAD:
        importlib.import_module(name)


def test_the_rooms_contract_catches_an_upward_import(wheel, tmp_path):
    """tasks/ rooms point one way: the data room may not import what a run records."""
    _, tree = wheel
    planted = tmp_path / "site"
    shutil.copytree(tree, planted)
    catalog = planted / "quantloop" / "tasks" / "data" / "catalog.py"
    catalog.write_text(catalog.read_text() + "\nimport quantloop.tasks.records.tracking  # noqa\n")
    result = lint_imports(planted)
    assert result.returncode != 0
    assert "quantloop.tasks.data.catalog -> quantloop.tasks.records.tracking" in result.stdout
