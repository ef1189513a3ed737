#!/usr/bin/env bash
# Sets up, builds and runs every test: the C++ suite (CTest + GoogleTest) and the
# Python suite (pytest). Prints each runner's summary line; fails on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_deps.sh
BUILD=${BUILD:-build}
start=$(date +%s)
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDMATTN_BUILD_TESTS=ON -DDMATTN_BUILD_TOOLS=ON
cmake --build "$BUILD" -j "${JOBS:-2}"
echo "C++ build: $(( $(date +%s) - start )) s"
ctest --test-dir "$BUILD" --output-on-failure -j "${JOBS:-2}"
if [ -f scripts/test_python.sh ]; then
  bash scripts/test_python.sh
fi
echo "all tests: $(( $(date +%s) - start )) s"
