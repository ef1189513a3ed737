#!/usr/bin/env bash
# Sets up, builds and runs the demo: forward + backward of a Doge-like problem on
# the best available backend, checked against the float64 CPU oracle.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_deps.sh
# Without a GPU the CUDA kernels could not run: build the CPU library alone (the
# test command still compiles them, so that CI catches compile errors).
if nvidia-smi -L >/dev/null 2>&1; then cuda=AUTO; else cuda=OFF; fi
BUILD=${BUILD:-$([ $cuda = OFF ] && echo build-cpu || echo build)}
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDMATTN_CUDA=$cuda -DDMATTN_BUILD_TESTS=OFF \
  -DDMATTN_BUILD_TOOLS=ON >/dev/null
cmake --build "$BUILD" --target dmattn_demo -j "${JOBS:-2}"
"$BUILD/dmattn_demo"
