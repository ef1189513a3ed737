#!/usr/bin/env bash
# Everything a GPU machine checks and measures, in one command, offline: the
# CUDA check matrix under compute-sanitizer (scripts/gpu_check.sh), the top-k
# selection check (scripts/gpu_selection_check.sh), the Python suite on the CUDA
# build, the peer benchmark (scripts/bench_gpu.sh) and the tiny Doge training
# runs (dense and top-k). Stages can be picked; a failing stage does not stop
# the others, and the exit status says whether all passed.
#
#   scripts/gpu_all.sh [stage ...]     stages: check selection pytest bench doge (default: all)
#   env: OUT (default build-gpu/all), BUILD (the CMake build; default build-gpu),
#        DMATTN_CUDA_ARCHS (default 90a), DMATTN_CUTLASS_DIR, PYTHON (default
#        python3), BENCH_DEADLINE (epoch seconds: bench cases after it are not run),
#        BENCH_ONLY (run only the bench cases whose name contains it), BENCH_SUITES (e.g.
#        shapes,topk; default all), DMATTN_COMMIT
#        (the commit to report, where the tree's git metadata is not its own)
#
# Writes only OUT/summary.txt and OUT/logs.tar.gz (every log, the benchmark's
# JSON, table and plot, the Doge curves).
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root" || exit 1
out=${OUT:-$root/build-gpu/all}
build=${BUILD:-$root/build-gpu}
logs=$(mktemp -d)/logs
mkdir -p "$out" "$logs"
export DMATTN_CUDA_ARCHS=${DMATTN_CUDA_ARCHS:-90a}
python=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(check selection pytest bench doge)
summary=$out/summary.txt
: >"$summary"
failed=0

stage() {  # name, command...: runs it into its log, notes the time and the status
  local name=$1 start rc
  shift
  start=$(date +%s)
  "$@" >"$logs/$name.log" 2>&1
  rc=$?
  echo "== $name: rc $rc, $(( $(date +%s) - start )) s" | tee -a "$summary"
  [ $rc -eq 0 ] || failed=1
}
installed=0
install_python() {  # the package with the CUDA backend into $python, once
  [ $installed -eq 1 ] && return 0
  local settings=(-C "cmake.define.DMATTN_CUDA_ARCHS=$DMATTN_CUDA_ARCHS")
  [ -n "${DMATTN_CUTLASS_DIR:-}" ] && settings+=(-C "cmake.define.DMATTN_CUTLASS_DIR=$DMATTN_CUTLASS_DIR")
  DMATTN_CUDA=ON PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
    "$python" -m pip install -q --no-build-isolation --no-deps "${settings[@]}" . && installed=1
}
python_tests() { install_python && "$python" -m pytest tests/python -q -p no:cacheprovider -rfE; }
doge() {
  install_python && "$python" bench/doge_training.py --out "$logs" &&
    "$python" bench/doge_training.py --out "$logs" --keep-window 64
}

nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | sed 's/^/device: /' | tee -a "$summary"
export DMATTN_COMMIT=${DMATTN_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
echo "commit: $DMATTN_COMMIT" | tee -a "$summary"
for s in "${stages[@]}"; do
  case $s in
    check) OUT=$logs/check stage check bash scripts/gpu_check.sh "$build"
           grep -E "^(check|sanitizers)|^bench" "$logs/check.log" >>"$summary" ;;
    selection) OUT=$logs/selection stage selection bash scripts/gpu_selection_check.sh "$build"
               tail -4 "$logs/selection.log" >>"$summary" ;;
    pytest) stage pytest python_tests
            tail -1 "$logs/pytest.log" >>"$summary" ;;
    bench) OUT=$logs stage bench bash scripts/bench_gpu.sh ${BENCH_DEADLINE:+--deadline "$BENCH_DEADLINE"} \
             ${BENCH_ONLY:+--only "$BENCH_ONLY"} ${BENCH_SUITES:+--suite "$BENCH_SUITES"}
           # each section's heading and its target rows (met: yes / no)
           grep -E '^## |^\| .* \| (yes|no) \|$' "$logs/performance.md" >>"$summary" 2>/dev/null ;;
    doge) stage doge doge
          grep -E "^(eager|dmattn|max)" "$logs/doge.log" >>"$summary" ;;
    *) echo "unknown stage $s (check selection pytest bench doge)"; exit 2 ;;
  esac
done
tar -czf "$out/logs.tar.gz" -C "$(dirname "$logs")" logs
echo "== all: $([ $failed -eq 0 ] && echo passed || echo FAILED)" | tee -a "$summary"
exit $failed
