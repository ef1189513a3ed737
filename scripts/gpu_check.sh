#!/usr/bin/env bash
# One command on a machine with a GPU, a thin wrapper over ctest: builds dmattn
# and its tests (Release, CUDA on), runs the CUDA check matrix against the CPU
# float64 oracle (ctest -L cuda: tests/cuda, sharded), compute-sanitizer
# memcheck and racecheck on its small subset (ctest -L sanitizer), times the
# forward and forward + backward (dmattn_bench_cuda), and prints a summary.
# Downloads nothing.
#
#   scripts/gpu_check.sh [build-dir]          (default: build-gpu)
#   env: DMATTN_CUDA_ARCHS (default "80;90a"), DMATTN_HEAD_DIMS (default "64;128"),
#        DMATTN_CUTLASS_DIR (default: the nvidia-cutlass pip package's headers),
#        OUT (where the logs go; default <build-dir>/gpu_check), CHECK_ONLY (only
#        the cases whose name contains it, sanitizers included), BENCH (0: no timing),
#        CHECK_SHARDS (processes sharing the check's CPU oracle work; default 4)
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build-gpu}
logs=${OUT:-$build/gpu_check}
shards=${CHECK_SHARDS:-4}
mkdir -p "$logs"

config=(-DCMAKE_BUILD_TYPE=Release -DDMATTN_CUDA=ON -DDMATTN_BUILD_TESTS=ON -DDMATTN_BUILD_TOOLS=ON
        "-DDMATTN_CUDA_ARCHS=${DMATTN_CUDA_ARCHS:-80;90a}" "-DDMATTN_HEAD_DIMS=${DMATTN_HEAD_DIMS:-64;128}"
        "-DDMATTN_CUDA_TEST_SHARDS=$shards")
[ -n "${DMATTN_CUTLASS_DIR:-}" ] && config+=("-DDMATTN_CUTLASS_DIR=$DMATTN_CUTLASS_DIR")
command -v ninja >/dev/null && config+=(-G Ninja)
start=$(date +%s)
if ! { cmake -S "$root" -B "$build" "${config[@]}" &&
       cmake --build "$build" -j"$(nproc)" --target test_cuda dmattn_bench_cuda; } >"$logs/build.log" 2>&1; then
  tail -40 "$logs/build.log"
  echo "gpu_check: BUILD FAILED (log: $logs/build.log)"
  exit 1
fi
echo "build: $(( $(date +%s) - start )) s on $(nproc) cores (archs ${DMATTN_CUDA_ARCHS:-80;90a})"

# The check's time is the CPU oracle's: shards in parallel, the cores split among them.
threads=$(( $(nproc) / shards )); [ "$threads" -ge 1 ] || threads=1
export DMATTN_CHECK_ONLY=${CHECK_ONLY:-}
[ -n "$DMATTN_CHECK_ONLY" ] || unset DMATTN_CHECK_ONLY
DMATTN_NUM_THREADS=$threads ctest --test-dir "$build" -L '^cuda$' -j "$shards" -V >"$logs/check.log" 2>&1
check_rc=$?
grep -E '(PASS|FAIL)  ' "$logs/check.log" | sed 's/^[0-9]*: //' | cut -c1-220
passed=$(grep -cE '^[0-9]*: PASS  ' "$logs/check.log"); failed=$(grep -cE '^[0-9]*: FAIL  ' "$logs/check.log")
skipped=$(grep -cE '\[  SKIPPED \] .*\([0-9]+ ms\)' "$logs/check.log")
echo "$passed passed, $failed failed, $skipped skipped ($shards shards)" | tee -a "$logs/check.log"

ctest --test-dir "$build" -L '^sanitizer$' -j "$shards" --output-on-failure >"$logs/sanitizer.log" 2>&1
sanitizer_rc=$?
status="sanitizers (memcheck, racecheck): $([ $sanitizer_rc -eq 0 ] && echo clean || echo "FAILED (rc $sanitizer_rc)"); $(grep -E 'tests passed' "$logs/sanitizer.log" | tail -1)"

[ "${BENCH:-1}" = 0 ] || "$build/dmattn_bench_cuda" 2>&1 | tee "$logs/bench.log"

echo "=== summary ==="
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | sed 's/^/device: /'
echo "check: $(tail -1 "$logs/check.log")"
echo "$status"
[ $check_rc -eq 0 ] && [ $sanitizer_rc -eq 0 ]
