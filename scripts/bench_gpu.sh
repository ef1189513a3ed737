#!/usr/bin/env bash
# On a machine with a GPU: builds and installs the Python package with the CUDA
# backend into the current python3 (no downloads: --no-build-isolation --no-deps,
# the build tools of that environment), then runs bench/bench_gpu.py, which
# writes performance.json, performance.md and the plots into $OUT (default docs/);
# options go to `bench_gpu.py run` (--suite main,shapes,topk,portable, --deadline, --only).
#
#   scripts/bench_gpu.sh [bench_gpu.py run options: --suite, --deadline EPOCH, --commit SHA, --only]
#   env: DMATTN_CUDA_ARCHS (default 90a), DMATTN_HEAD_DIMS (default 64;128),
#        DMATTN_CUTLASS_DIR (default: the nvidia-cutlass pip package's headers),
#        PYTHON (default python3; its environment needs nanobind and
#        scikit-build-core, the build tools scripts/test_python.sh pins)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
python=${PYTHON:-python3}
cutlass=${DMATTN_CUTLASS_DIR:-}

export DMATTN_CUDA=ON CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 PIP_NO_INDEX=1
settings=(-C "cmake.define.DMATTN_CUDA_ARCHS=${DMATTN_CUDA_ARCHS:-90a}"
          -C "cmake.define.DMATTN_HEAD_DIMS=${DMATTN_HEAD_DIMS:-64;128}")
[ -n "$cutlass" ] && settings+=(-C "cmake.define.DMATTN_CUTLASS_DIR=$cutlass")
start=$(date +%s)
"$python" -m pip install -q --no-build-isolation --no-deps "${settings[@]}" .
echo "build and install: $(( $(date +%s) - start )) s on $(nproc) cores (nanobind $("$python" -c 'import nanobind; print(nanobind.__version__)'))"
(cd /tmp && "$python" -c 'import dmattn; info = dmattn.build_info(); print("dmattn:", info); assert info["cuda"], "no CUDA backend"')

"$python" bench/bench_gpu.py run --out "${OUT:-docs}" "$@"
