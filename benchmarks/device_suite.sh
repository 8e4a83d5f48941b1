#!/usr/bin/env bash
# The device run behind benchmarks/results/ on NGPU GPUs: profiles, then the ring benchmark at 8k tokens per GPU
# (every batch variant x cuDNN/flash/Triton, native CP peers), 32k tokens, the MHA config and the varlen variants.
#
#   # in the git checkout that sends the tree (the GPU machine receives it without .git):
#   eval "export $(python benchmarks/_stamp.py --export)"        # HFPATCH_COMMIT and HFPATCH_SOURCE_HASH of HEAD
#   # on the machine, from the repository root, with both variables passed along:
#   HFPATCH_COMMIT=... HFPATCH_SOURCE_HASH=... OUT=<dir> bash benchmarks/device_suite.sh NGPU
#
# Every result file's stamp names that commit only if the tree that ran is the commit's (benchmarks/_stamp.py
# compares source hashes); otherwise it is stamped "uncommitted-tree" with the tree's source hash, and the file
# names end in the same tag (TAG overrides it). The machine part of the names is NGPUx<GPU model>, e.g. 4xH200.
# Each step has its own time limit so that one slow step cannot take the others' time; results are written as
# each case group finishes. The per-call cross-rank shape check is off while timing (--skip-rank-check): hfpatch
# runs it once per step (ring_kernels.rank_check_scope) and PyTorch's native CP has none; its cost is measured
# separately in profile_2xH200_rank_check_and_nccl_knobs_94c6b18.log.
set -u
NGPU=${1:-}
if ! [[ "$NGPU" =~ ^[0-9]+$ ]] || (( NGPU < 2 )); then
  echo "usage: [HFPATCH_COMMIT=<sha> HFPATCH_SOURCE_HASH=<hash>] [OUT=<dir>] bash benchmarks/device_suite.sh NGPU" \
       "(NGPU >= 2: the GPUs to run on; got '${NGPU}')" >&2
  exit 2
fi
export PYTHONPATH=$PWD NGPU
export HFPATCH_COMMIT=${HFPATCH_COMMIT:-} HFPATCH_SOURCE_HASH=${HFPATCH_SOURCE_HASH:-}
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
log() { echo "## $(date -u +%H:%M:%S) $*"; }

python -c "
import sys, torch
n = torch.cuda.device_count()
if n < $NGPU:
    sys.exit(f'device_suite.sh: {$NGPU} GPUs asked for, {n} visible')" || exit 2
GPU=$(python benchmarks/_stamp.py --gpu-model)
MACHINE="${NGPU}x${GPU}"
if [[ -z "$HFPATCH_COMMIT" ]]; then
  log "WARNING: HFPATCH_COMMIT is not set: every result of this run is stamped uncommitted-tree (see the usage above)"
fi
log "provenance of this tree:"
python benchmarks/_stamp.py --describe || exit 2
TAG=${TAG:-$(python benchmarks/_stamp.py --tag)}
log "machine $MACHINE, file tag $TAG, results in $OUT"

profile() { timeout 45 torchrun --standalone --nproc-per-node "$NGPU" benchmarks/profile_ring.py --backend torch_cudnn --iters 10 \
  --top 0 "$@" 2>&1 | grep -E "^--- rank 0|attention \(cudnn|nccl  "; }
step() { grep -o "step [0-9.]*" "$1" | head -1 | cut -d' ' -f2; }

# NCCL settings a user can choose (environment, read when the process group is created): the default and a
# high-priority NCCL stream (8 channels minimum was tried and gave nothing consistent:
# results/profile_2xH200_forward_yield_18cdfe2.log). Each is profiled on zigzag (causal) and ring (non-causal) x cuDNN;
# the benchmarks run with the faster (sum of the two steps; it must beat the default by >= 1%). Native CP runs under
# the same setting.
SETTINGS=("" "TORCH_NCCL_HIGH_PRIORITY=1")
sums=()
for i in "${!SETTINGS[@]}"; do
  log "profiles with NCCL setting [${SETTINGS[$i]:-default}]"
  env ${SETTINGS[$i]} bash -c "$(declare -f profile); profile --variant zigzag --causal" | tee "$OUT/nccl_setting_${i}_zigzag.txt"
  env ${SETTINGS[$i]} bash -c "$(declare -f profile); profile --variant ring" | tee "$OUT/nccl_setting_${i}_ring.txt"
  sums+=("$(python -c "import sys; print(sum(float(x) if x else float('inf') for x in sys.argv[1:]))" \
            "$(step "$OUT/nccl_setting_${i}_zigzag.txt")" "$(step "$OUT/nccl_setting_${i}_ring.txt")")")
done
best=$(python - "${sums[@]}" <<'PY'
import sys
t = [float(x) for x in sys.argv[1:]]
best = min(range(len(t)), key=t.__getitem__)
print(best if t[best] < 0.99 * t[0] else 0)
PY
)
log "profile step sums (ms): ${sums[*]}; benchmarks run with [${SETTINGS[$best]:-default NCCL settings}]"
for kv in ${SETTINGS[$best]}; do export "$kv"; done

B="torchrun --standalone --nproc-per-node $NGPU benchmarks/ring_bench.py --skip-rank-check --out $OUT"
log "8k batch, llama3-8b"
timeout 250 $B --tokens 8192 --layouts batch --configs llama3-8b --variants ring,zigzag,stripe \
  --backends torch_cudnn,torch_flash,triton --native cudnn,flash --max-minutes 3.2 --tag ring_bench_${MACHINE}_8k_batch_$TAG
log "32k batch, llama3-8b, fwd+bwd"
timeout 90 $B --tokens 32768 --layouts batch --configs llama3-8b --variants ring,zigzag --backends torch_cudnn \
  --native cudnn --modes fwd_bwd --no-nocomm --max-minutes 1 --tag ring_bench_${MACHINE}_32k_batch_$TAG
log "8k batch, MHA, fwd+bwd"
timeout 70 $B --tokens 8192 --layouts batch --configs mha --variants ring,zigzag --backends torch_cudnn \
  --native cudnn --modes fwd_bwd --no-nocomm --max-minutes 0.8 --tag ring_bench_${MACHINE}_8k_mha_$TAG
log "8k varlen, llama3-8b"
timeout 90 $B --tokens 8192 --layouts varlen --configs llama3-8b --variants llama3,ring_varlen,zigzag_varlen \
  --backends torch_flash,torch_cudnn --native '' --no-nocomm --max-minutes 1 --tag ring_bench_${MACHINE}_8k_varlen_$TAG
# The training step (issue 17 item 2): benchmarks/train_step_suite.sh, with this run's OUT and TAG (its settings:
# SIZES, SINGLE_LAYERS, LIMIT_S; see that script).
log "training step: benchmarks/train_step_suite.sh $NGPU"
OUT="$OUT" TAG="$TAG" bash benchmarks/train_step_suite.sh "$NGPU"
# The ~1B hybrid's training step (issue 15 item 6): benchmarks/hybrid_step_suite.sh (its settings: HYBRID_FAMILIES,
# HYBRID_SIZES, HYBRID_LIMIT_S; see that script).
log "hybrid training step: benchmarks/hybrid_step_suite.sh $NGPU"
OUT="$OUT" TAG="$TAG" bash benchmarks/hybrid_step_suite.sh "$NGPU"
log "done"
