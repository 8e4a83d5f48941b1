#!/usr/bin/env bash
# The training-step benchmark (benchmarks/train_step.py) on NGPU GPUs, one torchrun per tokens-per-GPU size:
# hfpatch CP (plain checkpointing, and with keep_attention: mode keep) and PyTorch's native CP on all NGPU ranks,
# and the one-GPU ceiling (mode single, SINGLE_LAYERS decoder layers, run by every rank on its own GPU) in the same
# job. NGPU=1 runs the ceiling alone.
#
#   HFPATCH_COMMIT=... HFPATCH_SOURCE_HASH=... OUT=<dir> bash benchmarks/train_step_suite.sh NGPU
#
# benchmarks/device_suite.sh runs it last (with its OUT and TAG). Settings (environment):
#   SIZES          tokens per GPU, one torchrun each (default "32k 64k 128k"; a 10-minute-per-command machine:
#                  one size per call)
#   SINGLE_LAYERS  decoder layers of the one-GPU ceiling (default 8: the whole 8B model and its AdamW states do not
#                  fit one H100 next to 32k tokens of activations)
#   LIMIT_S        seconds per size (default 540 at 32k, 1200 above)
#   MODES          train_step.py --modes (default hfpatch,keep,native,single; single alone for NGPU=1)
#   EXTRA          more train_step.py flags (e.g. "--layers 8" for a quick look)
#   PYTORCH_CUDA_ALLOC_CONF  the caching allocator's settings for every mode (default expandable_segments:True:
#                  freed memory serves any size, so keep's "auto" budget counts live tensors, not a fragmented
#                  reserve; set it empty for the allocator's defaults). Each result's stamp records it.
# Native CP runs every SDPA backend x rotate method at the first size; the larger sizes run only the fastest of
# those (read from the first size's JSON).
set -u
NGPU=${1:-}
if ! [[ "$NGPU" =~ ^[0-9]+$ ]] || (( NGPU < 1 )); then
  echo "usage: [OUT=<dir>] [SIZES='32k 64k 128k'] bash benchmarks/train_step_suite.sh NGPU (got '${NGPU}')" >&2
  exit 2
fi
export PYTHONPATH=${PYTHONPATH:-$PWD}
OUT=${OUT:-benchmarks/results}
SIZES=${SIZES:-32k 64k 128k}
SINGLE_LAYERS=${SINGLE_LAYERS:-8}
EXTRA=${EXTRA:-}
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF-expandable_segments:True}
mkdir -p "$OUT"
log() { echo "## $(date -u +%H:%M:%S) $*"; }
GPU=$(python benchmarks/_stamp.py --gpu-model)
TAG=${TAG:-$(python benchmarks/_stamp.py --tag)}
if (( NGPU == 1 )); then MODES=single; else MODES=${MODES:-hfpatch,keep,native,single}; fi

NATIVE=()
for size in $SIZES; do
  stem="train_step_${NGPU}x${GPU}_${size}_${TAG}"
  if [[ "$size" == "32k" || "$size" == "32768" ]]; then limit=${LIMIT_S:-540}; steps="--warmup 1 --steps 3"
  else limit=${LIMIT_S:-1200}; steps="--warmup 1 --steps 2"; fi
  log "training step, ${size} tokens per GPU, ${NGPU} GPUs, modes ${MODES} (limit ${limit} s)"
  timeout "$limit" torchrun --standalone --nproc-per-node "$NGPU" benchmarks/train_step.py --modes "$MODES" \
    --seq-per-gpu "$size" --single-layers "$SINGLE_LAYERS" $steps "${NATIVE[@]}" --max-minutes $(( limit / 60 - 2 )) \
    --out "$OUT" --tag "$stem" $EXTRA
  if (( ${#NATIVE[@]} == 0 )) && [[ -f "$OUT/$stem.json" ]]; then
    best=$(python - "$OUT/$stem.json" <<'PY'
import json, sys
rows = [r for r in json.load(open(sys.argv[1]))["rows"]
        if r["mode"] == "native" and r["status"] == "ok" and r["layout"] == "batch"]
if rows:
    b = min(rows, key=lambda r: r["step_ms"])
    print(b["sdpa"], b["rotate"])
PY
)
    if [[ -n "$best" ]]; then
      read -r sdpa rotate <<<"$best"
      NATIVE=(--native-backends "$sdpa" --native-rotate "$rotate")
      log "native CP runs sdpa:${sdpa} rotate ${rotate} (fastest at ${size}) from here on"
    fi
  fi
done
log "training step done"
