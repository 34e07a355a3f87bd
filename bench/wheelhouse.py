"""The wheels the GPU machine needs to run quantloop: .whl/lite (ignored by git).

The H200 machine has Python 3.12, torch, Triton, numpy, pyarrow, pandas, scipy,
statsmodels, matplotlib and many small packages, but no Prefect, MLflow or Dask, and no
network. This downloads cp312 manylinux wheels of what quantloop imports at run time
(the versions installed here), keeps what they need that the image lacks, and builds
quantloop's own wheel from a clean copy of the checkout; bench/device.sh installs them
with --no-deps into /tmp/site. A device call carries the working tree and `carry`
together under 64 MiB, so it prints that total.

    python bench/wheelhouse.py              # download, prune, build quantloop's wheel
    python bench/wheelhouse.py --quantloop  # quantloop's wheel again, after code changes
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from importlib.metadata import version
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / ".whl" / "lite"
LIMIT = 64 * 2**20  # what a device call carries: working tree and `carry` together
PLATFORMS = (
    "manylinux2014_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_28_x86_64",
    "manylinux1_x86_64",
    "any",
)
# What quantloop imports at run time besides torch, numpy, pyarrow and Triton (pyproject's
# dependencies; mlflow as mlflow-skinny: no server on the GPU machine), at the versions
# installed here (the ones the tests ran against).
ROOTS = {
    "prefect": "prefect",
    "mlflow-skinny": "mlflow",
    "dask[distributed]": "dask",
    "distributed": "distributed",
    "fsspec": "fsspec",
    "pydantic": "pydantic",
    "typer": "typer",
    "rich": "rich",
    "psutil": "psutil",
    "scipy": "scipy",
    "pandas": "pandas",
    "matplotlib": "matplotlib",
}
# In the image (device/KINDS.md's package list, read 2026-11-17), so not carried: the
# GPU stack, the scientific stack and the small packages the runs there have used.
IMAGE = set(
    """torch triton numpy pyarrow scipy pandas statsmodels patsy formulaic interface-meta
    narwhals matplotlib pillow fonttools kiwisolver contourpy cycler pyparsing wrapt
    pygments regex pyyaml msgpack protobuf charset-normalizer psutil markupsafe certifi
    requests urllib3 idna jinja2 click cloudpickle packaging rich typer markdown-it-py
    mdurl six sortedcontainers toolz attrs h11 httpcore httpx humanize python-dateutil
    colorama shellingham markdown prometheus-client zipp fsspec pathspec pluggy
    annotated-doc filelock""".split()
)
# Carried although the image has them: tiny, and our pins need recent releases
# (pydantic 2.14 wants typing-extensions >= 4.16; mlflow excludes anyio 4.15.0).
CARRY_ANYWAY = {"typing-extensions", "anyio"}
# Not imported by a run on the GPU machine (no S3 there; Prefect imports apprise only
# to send a notification, docker only for its Docker worker; google-auth is MLflow's for
# Google storage): left out for size (the tree and the wheels reached the 64 MiB a call
# carries on 2026-12-04). graphviz looks as idle but Prefect imports it: call 14's
# first attempt failed without it.
NOT_NEEDED = {"s3fs", "aiobotocore", "botocore", "apprise", "docker", "google-auth"}


def is_image(name: str) -> bool:
    if name in CARRY_ANYWAY:
        return False
    return name in IMAGE or name in NOT_NEEDED or name.startswith("nvidia-")


def wheel_name(path: Path) -> str:
    return canonicalize_name(path.name.split("-")[0])


def requirements(path: Path) -> list[Requirement]:
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    tag = "Requires-Dist:"
    return [Requirement(line[len(tag) :]) for line in lines if line.startswith(tag)]


def needed(wheels: dict[str, Path], roots: list[Requirement]) -> set[str]:
    """The names the roots need on Python 3.12 on Linux, stopping at what the image has."""
    env = default_environment()
    env.update(python_version="3.12", python_full_version="3.12.3", sys_platform="linux")
    env.update(platform_system="Linux", platform_machine="x86_64")
    seen: set[tuple[str, frozenset[str]]] = set()
    out: set[str] = set()
    stack = [(canonicalize_name(r.name), frozenset(r.extras)) for r in roots]
    while stack:
        name, extras = stack.pop()
        if (name, extras) in seen:
            continue
        seen.add((name, extras))
        # a package the image has brings nothing but what its extras add (httpx[http2]:
        # the image has httpx, not h2)
        image = is_image(name)
        if image and not extras:
            continue
        if not image:
            out.add(name)
        if name not in wheels:
            raise SystemExit(f"{name} is needed but no wheel of it was downloaded")
        for req in requirements(wheels[name]):
            base = req.marker is None or req.marker.evaluate(dict(env, extra=""))
            added = req.marker is not None and any(
                req.marker.evaluate(dict(env, extra=e)) for e in extras
            )
            if (base and not image) or added:
                stack.append((canonicalize_name(req.name), frozenset(req.extras)))
    return out


def download() -> None:
    pins = [f"{spec}=={version(dist)}" for spec, dist in ROOTS.items()]
    cmd = [sys.executable, "-m", "pip", "download", "-qq", "--only-binary=:all:",
           "--python-version", "3.12", "--implementation", "cp", "-d", str(OUT)]  # fmt: skip
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    for old in OUT.glob("*.whl"):  # a stale version beside a new one stops the install
        old.unlink()
    print("pip download", *pins, flush=True)
    subprocess.run([*cmd, *pins], check=True)
    wheels = {wheel_name(p): p for p in OUT.glob("*.whl") if wheel_name(p) != "quantloop"}
    keep = needed(wheels, [Requirement(p) for p in pins])
    for name, path in sorted(wheels.items()):
        if name not in keep:
            path.unlink()
    versions: dict[str, list[str]] = {}
    for p in OUT.glob("*.whl"):
        versions.setdefault(wheel_name(p), []).append(p.name)
    if twice := {n: v for n, v in versions.items() if len(v) > 1}:
        raise SystemExit(f"two versions of a package stop the install there: {twice}")


def build_quantloop() -> Path:
    """quantloop's wheel from a copy of what it is made of (as tests/test_layout.py builds
    it): setuptools builds in the source tree, where a stale build/ could slip in a module
    that moved."""
    for old in OUT.glob("quantloop-*.whl"):
        old.unlink()
    with tempfile.TemporaryDirectory(prefix="quantloop-wheel-") as tmp:
        src = Path(tmp)
        for name in ("pyproject.toml", "README.md"):
            shutil.copy(ROOT / name, src / name)
        for folder in ("quantloop", "flows", "tasks", "blocks", "models", "profiling"):
            shutil.copytree(
                ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__")
            )
        subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
             "--no-build-isolation", "--wheel-dir", str(OUT), str(src)],
            check=True,
        )  # fmt: skip
    [whl] = OUT.glob("quantloop-*.whl")
    return whl


def travelling_bytes() -> int:
    """What a device call sends besides `carry`: tracked files and untracked ones git
    does not ignore."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, check=True,
    ).stdout.split(b"\0")  # fmt: skip
    files = (ROOT / p.decode() for p in listed if p)
    return sum(f.stat().st_size for f in files if f.is_file() and not f.is_symlink())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quantloop", action="store_true", help="only build quantloop's wheel again"
    )
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    if not args.quantloop:
        download()
    whl = build_quantloop()
    wheels = sorted(OUT.glob("*.whl"))
    size = sum(p.stat().st_size for p in wheels)
    tree = travelling_bytes()
    print(f"{len(wheels)} wheels in {OUT.relative_to(ROOT)}: {size / 2**20:.1f} MiB "
          f"({whl.name} {whl.stat().st_size / 2**10:.0f} KiB)")  # fmt: skip
    print(f"with the working tree ({tree / 2**20:.1f} MiB): {(size + tree) / 2**20:.1f} MiB "
          f"of the {LIMIT / 2**20:.0f} MiB a device call carries")  # fmt: skip
    print(", ".join(re.sub(r"-py\d.*|-cp\d.*", "", p.name) for p in wheels))
    if size + tree > LIMIT:
        raise SystemExit("over the device call's limit: carry less")


if __name__ == "__main__":
    main()
