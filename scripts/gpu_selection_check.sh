#!/usr/bin/env bash
# One command on a machine with a GPU for the top-k selection: builds the
# selection check (Release, CUDA on), compares the GPU selection with the CPU's
# on the whole matrix (tools/gpu_selection_check.cpp), runs compute-sanitizer
# memcheck and racecheck on `--small`, times the interval selection, and prints
# a summary. Downloads nothing.
#
#   scripts/gpu_selection_check.sh [build-dir]          (default: build-gpu)
#   env: DMATTN_CUDA_ARCHS (default "80;90a"), DMATTN_CUTLASS_DIR,
#        DMATTN_SELECTION_CHECK (a prebuilt dmattn_gpu_selection_check: no build),
#        OUT (where the logs go; default <build-dir>/gpu_selection_check)
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build-gpu}
logs=${OUT:-$build/gpu_selection_check}
mkdir -p "$logs"

check=${DMATTN_SELECTION_CHECK:-}
if [ -z "$check" ]; then
  config=(-DCMAKE_BUILD_TYPE=Release -DDMATTN_CUDA=ON -DDMATTN_BUILD_TESTS=OFF -DDMATTN_BUILD_TOOLS=ON
          "-DDMATTN_CUDA_ARCHS=${DMATTN_CUDA_ARCHS:-80;90a}")
  [ -n "${DMATTN_CUTLASS_DIR:-}" ] && config+=("-DDMATTN_CUTLASS_DIR=$DMATTN_CUTLASS_DIR")
  command -v ninja >/dev/null && config+=(-G Ninja)
  if ! { cmake -S "$root" -B "$build" "${config[@]}" &&
         cmake --build "$build" -j"$(nproc)" --target dmattn_gpu_selection_check; } >"$logs/build.log" 2>&1; then
    tail -40 "$logs/build.log"
    echo "gpu_selection_check: BUILD FAILED (log: $logs/build.log)"
    exit 1
  fi
  check="$build/dmattn_gpu_selection_check"
fi

"$check" >"$logs/check.log" 2>&1
check_rc=$?
grep -v '^PASS' "$logs/check.log" | head -40

sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
status=()
for tool in memcheck racecheck; do
  "$sanitizer" --tool "$tool" --error-exitcode 1 "$check" --small >"$logs/$tool.log" 2>&1
  rc=$?
  status+=("$tool: $([ $rc -eq 0 ] && echo clean || echo "FAILED (rc $rc)"); $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$logs/$tool.log" | tail -1); $(tail -1 "$logs/$tool.log")")
done

"$check" --bench 2>&1 | tee "$logs/bench.log"
bench_rc=${PIPESTATUS[0]}

echo "=== summary ==="
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | sed 's/^/device: /'
echo "check: $(tail -1 "$logs/check.log")"
printf '%s\n' "${status[@]}"
[ $check_rc -eq 0 ] && [ $bench_rc -eq 0 ] && [[ "${status[*]}" != *FAILED* ]]
