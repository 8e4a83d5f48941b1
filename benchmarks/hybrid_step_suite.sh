#!/usr/bin/env bash
# The hybrid training-step benchmark (benchmarks/hybrid_step.py) on NGPU GPUs, one torchrun per family: hfpatch CP
# on all NGPU ranks (step time, peak memory, the mixers' exchange share and CP share, the exchange bytes per layer)
# and one GPU on its share (mode single, run by every rank on its own GPU) in the same job. NGPU=1 runs the one-GPU
# rows alone, at HYBRID_SINGLE_SIZES.
#
#   HFPATCH_COMMIT=... HFPATCH_SOURCE_HASH=... OUT=<dir> bash benchmarks/hybrid_step_suite.sh NGPU
#
# benchmarks/device_suite.sh runs it after the Llama training step (with its OUT and TAG). Settings (environment;
# prefixed so that train_step_suite.sh's SIZES, LIMIT_S and EXTRA do not reach it):
#   HYBRID_FAMILIES      hybrid families, one torchrun each (default "qwen3_5 nemotron_h")
#   HYBRID_SIZES         tokens per GPU of the CP and one-GPU rows when NGPU >= 2 (default "32k")
#   HYBRID_SINGLE_SIZES  tokens of the one-GPU rows when NGPU = 1 (default "16k 32k")
#   HYBRID_LIMIT_S       seconds per family (default 540)
#   HYBRID_STEPS         warm-up and timed steps per measurement (default "--warmup 1 --steps 3")
#   HYBRID_EXTRA         more hybrid_step.py flags (e.g. "--layers 8" for a quick look)
#   HYBRID_MODES         hybrid_step.py --modes when NGPU >= 2 (default hfpatch,single; "hfpatch" alone when the
#                        one-GPU row at these tokens per GPU exists from another job: it does not depend on NGPU)
# The fast mixer kernels run where their packages import (flash-linear-attention / fla-core, causal-conv1d,
# mamba-ssm); each row names the implementation every mixer kernel ran, and the JSON lists the installed versions.
set -u
NGPU=${1:-}
if ! [[ "$NGPU" =~ ^[0-9]+$ ]] || (( NGPU < 1 )); then
  echo "usage: [OUT=<dir>] [HYBRID_FAMILIES='qwen3_5 nemotron_h'] bash benchmarks/hybrid_step_suite.sh NGPU" \
       "(got '${NGPU}')" >&2
  exit 2
fi
export PYTHONPATH=${PYTHONPATH:-$PWD}
OUT=${OUT:-benchmarks/results}
HYBRID_FAMILIES=${HYBRID_FAMILIES:-qwen3_5 nemotron_h}
HYBRID_LIMIT_S=${HYBRID_LIMIT_S:-540}
HYBRID_STEPS=${HYBRID_STEPS:---warmup 1 --steps 3}
HYBRID_EXTRA=${HYBRID_EXTRA:-}
mkdir -p "$OUT"
log() { echo "## $(date -u +%H:%M:%S) $*"; }
GPU=$(python benchmarks/_stamp.py --gpu-model)
TAG=${TAG:-$(python benchmarks/_stamp.py --tag)}
if (( NGPU == 1 )); then MODES=single; HYBRID_SIZES=${HYBRID_SINGLE_SIZES:-16k 32k}
else MODES=${HYBRID_MODES:-hfpatch,single}; HYBRID_SIZES=${HYBRID_SIZES:-32k}; fi
sizes=$(echo $HYBRID_SIZES | tr ' ' ',')
minutes=$(( HYBRID_LIMIT_S / 60 - 2 )); (( minutes < 1 )) && minutes=1

for family in $HYBRID_FAMILIES; do
  stem="hybrid_step_${family}_${NGPU}x${GPU}_$(echo $HYBRID_SIZES | tr ' ' '-')_${TAG}"
  log "hybrid training step, ${family}, ${sizes} tokens per GPU, ${NGPU} GPUs, modes ${MODES}" \
      "(limit ${HYBRID_LIMIT_S} s)"
  timeout "$HYBRID_LIMIT_S" torchrun --standalone --nproc-per-node "$NGPU" benchmarks/hybrid_step.py --family "$family" \
    --modes "$MODES" --seq-per-gpu "$sizes" $HYBRID_STEPS --max-minutes $minutes --out "$OUT" --tag "$stem" \
    $HYBRID_EXTRA
done
log "hybrid training step done"
