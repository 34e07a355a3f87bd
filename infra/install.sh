#!/usr/bin/env bash
# Sets up .venv with quantloop in it; README's two commands start with this.
#   bash infra/install.sh          the package (to run flows and the CLI)
#   bash infra/install.sh --dev    also what the tests and lint need, and Debian's
#                                  chromium for the browser test and postgresql for
#                                  the PostgreSQL tests (apt-get, as root)
# Without an NVIDIA GPU it installs PyTorch's CPU build first (TORCH_SPEC, default
# torch==2.13.0, which these machines hold as a local CPU wheel); with one, pip
# resolves pyproject's torch range to the CUDA build a GPU user wants.
set -euo pipefail
cd "$(dirname "$0")/.."

extras=""
[ "${1:-}" = "--dev" ] && extras="[dev]"
python=${PYTHON:-$(command -v python3.11 || command -v python3)}
"$python" -c 'import sys; assert sys.version_info >= (3, 11), "quantloop needs Python >= 3.11"'

[ -x .venv/bin/python ] || "$python" -m venv .venv
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)

if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "install: NVIDIA GPU found, torch comes from pyproject's range (a CUDA build)"
  else
    echo "install: no GPU, installing ${TORCH_SPEC:-torch==2.13.0} (CPU build)"
    "${pip[@]}" "${TORCH_SPEC:-torch==2.13.0}"
  fi
fi
# Everything else in one resolve: installed one by one, moto pulls a botocore
# that s3fs's aiobotocore rejects.
"${pip[@]}" -e ".${extras}"
# A Debian package the tests need, installed as root through apt-get (as CI runs), or
# a line saying what to run and which variable skips those tests outside CI.
apt_package() {  # package, the tests that need it, the skip variable
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "install: installing Debian's $1 for $2"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$1" >/dev/null
  else
    echo "install: $1 is missing and apt-get needs root here: run" \
      "'sudo apt-get install $1', or $2 fails saying so (outside CI, $3=1 skips it)" >&2
  fi
}
# tests/test_ui.py drives Debian's chromium through Playwright (Playwright's own browser
# download fetches from outside the package registries, which fails on these machines).
if [ -n "$extras" ] && ! command -v chromium >/dev/null 2>&1; then
  apt_package chromium tests/test_ui.py QUANTLOOP_SKIP_BROWSER
fi
# tests/test_postgres.py starts its own server from initdb (tests/servers.py): Debian's
# server binaries, under /usr/lib/postgresql/<version>/bin. Only the binaries are needed;
# the package's own cluster, should it make one, is left alone.
if [ -n "$extras" ] && ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 \
  && ! command -v initdb >/dev/null 2>&1; then
  apt_package postgresql tests/test_postgres.py QUANTLOOP_SKIP_POSTGRES
fi
echo "install: done ($(.venv/bin/python -c 'import torch, prefect, mlflow; print(f"torch {torch.__version__}, prefect {prefect.__version__}, mlflow {mlflow.__version__}")'))"
