#!/usr/bin/env bash
# Builds the Python package into a virtual environment and runs the Python tests
# (pytest, tests/python). Prints pytest's summary line; fails on any failure.
#
#   DMATTN_VENV   the virtual environment (default: .venv in the repository, gitignored)
#   DMATTN_CUDA   AUTO, ON or OFF (default OFF here: CI has no GPU; `pip install .` alone uses AUTO)
#   PYTHON        the interpreter that creates the environment (default python3)
set -euo pipefail
cd "$(dirname "$0")/.."

# Pinned test and build dependencies (torch from PyPI brings its nvidia-* wheels).
PINS=(torch==2.11.0 transformers==5.17.0 numpy==2.4.6 pytest==9.0.2 nanobind==2.12.0 scikit-build-core==0.11.6)
VENV=${DMATTN_VENV:-.venv}
export DMATTN_CUDA=${DMATTN_CUDA:-OFF}
export CMAKE_BUILD_PARALLEL_LEVEL=${JOBS:-2}
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 PIP_NO_CACHE_DIR=1

step() { echo "python: $1: $(( $(date +%s) - $2 )) s"; }

start=$(date +%s)
[ -x "$VENV/bin/python" ] || "${PYTHON:-python3}" -m venv "$VENV"
# Staged: pip keeps every wheel it downloads until its install ends, so one
# `pip install` of the pins peaks at ~7.6 GB (the ~2.6 GB of wheels beside the
# ~5 GB they install: torch's nvidia-* libraries); CI once ran out of disk there.
# The resolver's plan (metadata only) is installed as it resolved it, each
# binary wheel on its own and the pure-Python ones together: the peak is the
# installed ~5 GB (+40 s on a fresh environment).
echo "python: free disk before the dependencies: $(df -h --output=avail . | tail -1 | tr -d ' ')"
# The plan needs pip >= 22.2 (--dry-run --report); an older Python's bundled pip is upgraded first.
if ! "$VENV/bin/python" -c "import sys, pip; sys.exit(tuple(map(int, pip.__version__.split('.')[:2])) < (22, 2))"; then
  "$VENV/bin/python" -m pip install -q pip==24.3.1
fi
plan=$(mktemp)
"$VENV/bin/python" -m pip install -q --dry-run --report "$plan" "${PINS[@]}"
mapfile -t batches < <("$VENV/bin/python" - "$plan" <<'PY'
import json, sys
pure, binary = [], []
for item in json.load(open(sys.argv[1]))["install"]:
    pin = f'{item["metadata"]["name"]}=={item["metadata"]["version"]}'
    (pure if item["download_info"]["url"].endswith("-none-any.whl") else binary).append(pin)
for batch in [" ".join(pure)] + binary:
    if batch:
        print(batch)
PY
)
rm -f "$plan"
for batch in "${batches[@]}"; do
  read -ra pins <<<"$batch"
  "$VENV/bin/python" -m pip install -q --no-deps "${pins[@]}"
done
step "dependencies" "$start"

start=$(date +%s)
# No build isolation: the pinned scikit-build-core and nanobind above build it, and a
# persistent build tree (build/python-*) makes a rebuild incremental.
"$VENV/bin/python" -m pip install -q --no-build-isolation .
step "build and install (DMATTN_CUDA=$DMATTN_CUDA)" "$start"

start=$(date +%s)
"$VENV/bin/python" -m pytest tests/python -q -p no:cacheprovider
step "pytest" "$start"
