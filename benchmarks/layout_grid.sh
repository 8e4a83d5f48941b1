#!/usr/bin/env bash
# The layout grid behind kernel="auto" (ring_kernels/layout_costs.json): causal attention forward + backward of every
# exact layout -- the ring variants, Ulysses and USP -- and PyTorch's native CP, over tokens per GPU, batch and
# packed rows, MHA and GQA 4:1 (head dim 128), on NGPU GPUs with the cuDNN block backend. One torchrun of
# benchmarks/ring_bench.py per size, each with its own time limit; results as layout_grid_<NGPU>x<GPU>_<size>_<TAG>.
#
#   HFPATCH_COMMIT=... HFPATCH_SOURCE_HASH=... OUT=<dir> bash benchmarks/layout_grid.sh NGPU
#   python scripts/fit_layout_costs.py benchmarks/results/layout_grid_*.json    # then: the cost model's table
#
# Settings (environment): SIZES (default "8k 16k 32k 64k 128k"), CONFIGS (default "llama3-8b,mha"), LAYOUTS (default
# "batch,varlen"; "varlen": the packed rows alone, e.g. to measure them again), LIMIT_S
# (seconds per size; default 100 up to 16k, 120 at 32k, 180 at 64k, 300 above: on 4 H100s 40 s at 8k and 60 s at
# 32k covered only the GQA batch rows, each case's correctness gate and native CP's setup included). The whole grid
# takes more than one 10-minute call: SIZES="8k 16k 32k" in one, "64k 128k" in another. The plain contiguous ring
# (ring, ring_varlen) leaves causal work unbalanced; it runs up to 64k only.
set -u
NGPU=${1:-}
if ! [[ "$NGPU" =~ ^[0-9]+$ ]] || (( NGPU < 2 )); then
  echo "usage: [OUT=<dir>] [SIZES='8k 16k 32k 64k 128k'] bash benchmarks/layout_grid.sh NGPU (NGPU >= 2; got '${NGPU}')" >&2
  exit 2
fi
export PYTHONPATH=${PYTHONPATH:-$PWD}
export HFPATCH_COMMIT=${HFPATCH_COMMIT:-} HFPATCH_SOURCE_HASH=${HFPATCH_SOURCE_HASH:-}
OUT=${OUT:-benchmarks/results}
SIZES=${SIZES:-8k 16k 32k 64k 128k}
CONFIGS=${CONFIGS:-llama3-8b,mha}
LAYOUTS=${LAYOUTS:-batch,varlen}
mkdir -p "$OUT"
log() { echo "## $(date -u +%H:%M:%S) $*"; }
GPU=$(python benchmarks/_stamp.py --gpu-model)
TAG=${TAG:-$(python benchmarks/_stamp.py --tag)}
log "layout grid on ${NGPU}x${GPU}, sizes ${SIZES}, configs ${CONFIGS}, layouts ${LAYOUTS}, tag ${TAG}"

for size in $SIZES; do
  tokens=$(( ${size%k} * 1024 ))
  variants=zigzag,ulysses,usp,llama3,zigzag_varlen,ulysses_varlen,usp_varlen
  if (( tokens <= 65536 )); then variants=ring,ring_varlen,$variants; fi
  case "$size" in
    8k|16k) limit=${LIMIT_S:-100} ;;
    32k) limit=${LIMIT_S:-120} ;;
    64k) limit=${LIMIT_S:-180} ;;
    *) limit=${LIMIT_S:-300} ;;
  esac
  iters=""
  if (( tokens > 65536 )); then iters="--warmup 1 --iters 2"; fi
  log "${size} tokens per GPU: ${variants} (limit ${limit} s)"
  timeout "$limit" torchrun --standalone --nproc-per-node "$NGPU" benchmarks/ring_bench.py --skip-rank-check --tokens "$tokens" \
    --configs "$CONFIGS" --layouts "$LAYOUTS" --causal causal --variants "$variants" --backends torch_cudnn \
    --native cudnn --modes fwd_bwd --no-nocomm $iters --max-minutes "$(python -c "print(round($limit * 0.8 / 60, 2))")" --no-plot --out "$OUT" \
    --tag "layout_grid_${NGPU}x${GPU}_${size}_${TAG}"
done
log "layout grid done"
