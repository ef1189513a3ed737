#!/usr/bin/env bash
# One command on a machine with a GPU: builds dmattn (Release, CUDA on), checks
# the CUDA forward and backward against the CPU float64 oracle on the whole matrix
# (tools/gpu_check.cpp), runs compute-sanitizer memcheck and racecheck on a small
# subset of both, times the forward and forward + backward, and prints a summary.
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
mkdir -p "$logs"

config=(-DCMAKE_BUILD_TYPE=Release -DDMATTN_CUDA=ON -DDMATTN_BUILD_TESTS=OFF -DDMATTN_BUILD_TOOLS=ON
        "-DDMATTN_CUDA_ARCHS=${DMATTN_CUDA_ARCHS:-80;90a}" "-DDMATTN_HEAD_DIMS=${DMATTN_HEAD_DIMS:-64;128}")
[ -n "${DMATTN_CUTLASS_DIR:-}" ] && config+=("-DDMATTN_CUTLASS_DIR=$DMATTN_CUTLASS_DIR")
command -v ninja >/dev/null && config+=(-G Ninja)
start=$(date +%s)
if ! { cmake -S "$root" -B "$build" "${config[@]}" &&
       cmake --build "$build" -j"$(nproc)" --target dmattn_gpu_check; } >"$logs/build.log" 2>&1; then
  tail -40 "$logs/build.log"
  echo "gpu_check: BUILD FAILED (log: $logs/build.log)"
  exit 1
fi
echo "build: $(( $(date +%s) - start )) s on $(nproc) cores (archs ${DMATTN_CUDA_ARCHS:-80;90a})"

check="$build/dmattn_gpu_check"
only=(); [ -n "${CHECK_ONLY:-}" ] && only=(--only "$CHECK_ONLY")
# The check's time is the CPU oracle's: shards in parallel, the cores split among them.
shards=${CHECK_SHARDS:-4}
threads=$(( $(nproc) / shards )); [ "$threads" -ge 1 ] || threads=1
for i in $(seq 0 $(( shards - 1 ))); do
  DMATTN_NUM_THREADS=$threads "$check" "${only[@]}" --shard "$i/$shards" >"$logs/check.$i.log" 2>&1 &
done
check_rc=0
for i in $(seq 0 $(( shards - 1 ))); do wait -n || check_rc=1; done
cat "$logs"/check.*.log >"$logs/check.log"
grep -E '^(PASS|FAIL|SKIP) ' "$logs/check.log" | cut -c1-220
passed=$(grep -c '^PASS ' "$logs/check.log"); failed=$(grep -c '^FAIL ' "$logs/check.log")
skipped=$(grep -c '^SKIP ' "$logs/check.log")
echo "$passed passed, $failed failed, $skipped skipped ($shards shards: $(grep -hE '^[0-9]+ passed' "$logs"/check.*.log | paste -sd';'))" | tee -a "$logs/check.log"
[ "$failed" -eq 0 ] || check_rc=1

sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
status=()
for tool in memcheck racecheck; do
  "$sanitizer" --tool "$tool" --error-exitcode 1 "$check" --small "${only[@]}" >"$logs/$tool.log" 2>&1
  rc=$?
  status+=("$tool: $([ $rc -eq 0 ] && echo clean || echo "FAILED (rc $rc)"); $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$logs/$tool.log" | tail -1)")
done

[ "${BENCH:-1}" = 0 ] || "$check" --bench 2>&1 | tee "$logs/bench.log"

echo "=== summary ==="
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | sed 's/^/device: /'
echo "check: $(tail -1 "$logs/check.log")"
printf '%s\n' "${status[@]}"
[ $check_rc -eq 0 ] && [[ "${status[*]}" != *FAILED* ]]
