#!/usr/bin/env bash
# Sequence-parallel dmattn on the GPUs of one host (issue 21): checks Ulysses and
# ring against a float64 reference (SPEC 5's rule), then times fwd+bwd at
# S = 131072 against one GPU and prints both tables. Needs dmattn installed with
# its CUDA backend (this script builds nothing and downloads nothing). Every step
# runs under `timeout`; the whole script takes at most 6 minutes.
#
#   scripts/gpu_distributed.sh
#   env: NPROC (GPUs, default 2), OUT (keeps distributed-{check,time}.json there;
#        default a temporary directory), CHECK_SEQ (default 2048), SEQ (default
#        131072), REPS (default 3; TOPK_REPS, default 10, for the keep-window rows),
#        HEAD_CHUNKS (e.g. 8,16: a Ulysses row for each head_chunks count beside the
#        default's, and a ring row for each that divides the 8 kv heads; default
#        none), PYTHON (default python3)
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root" || exit 1
python=${PYTHON:-python3}
nproc=${NPROC:-2}
export OUT=${OUT:-$(mktemp -d)}
# NVLink multicast stays off on shared hosts.
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1} \
       NVSHMEM_DISABLE_NVLS=${NVSHMEM_DISABLE_NVLS:-1}
status=0

step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2 start rc
  shift 2
  start=$(date +%s)
  timeout --kill-after=10 "$limit" "$@"
  rc=$?
  echo "gpu_distributed: $name: $(( $(date +%s) - start )) s, exit $rc$([ $rc = 124 ] && echo " (timed out after $limit s)")"
  [ $rc = 0 ] || status=1
  return $rc
}

torchrun=("$python" -m torch.distributed.run --standalone --nproc_per_node="$nproc" bench/distributed_bench.py)
step environment 30 "$python" -c "
import torch, dmattn
info = dmattn.build_info()
print('dmattn', info['version'], 'CUDA', info['cuda'], info['cuda_architectures'], 'head dims', info['head_dims'])
print('torch', torch.__version__, torch.cuda.device_count(), 'x', torch.cuda.get_device_name())
assert info['cuda'], 'dmattn has no CUDA backend'
assert torch.cuda.device_count() >= $nproc, 'fewer GPUs than NPROC'" || exit 1
step check 120 "${torchrun[@]}" check --seq "${CHECK_SEQ:-2048}" --head-chunks "${HEAD_CHUNKS:-}"
step time 200 "${torchrun[@]}" time --seq "${SEQ:-131072}" --reps "${REPS:-3}" --topk-reps "${TOPK_REPS:-10}" \
  --head-chunks "${HEAD_CHUNKS:-}"
"$python" bench/distributed_bench.py report "$OUT"
echo "gpu_distributed: JSON in $OUT: $([ $status = 0 ] && echo PASS || echo FAIL)"
exit $status
