#!/usr/bin/env bash
# The real-scale acceptance on a GPU machine of 4 GPUs (2 for hybrids, sft and fp32) (results under benchmarks/results/): hfpatch at the depth,
# width and dtype users train, on the machine's Python (3.12 there).
#
#   OUT=<dir> bash benchmarks/real_scale_suite.sh [PART ...]       (no part: all of them, in this order)
#
#   probe     tests/gpu/test_probe_gpu.py: apply(model=) with verify=True on Llama-3-8B in bf16 over 2 and 4 GPUs
#   margin    benchmarks/probe_margin.py on 4 GPUs (bf16 with the 8B, fp32) and 2 GPUs (bf16 with the 8B)
#   cost      benchmarks/model_probe_cost.py: the probe on the 8B on one GPU, against one 4k-token forward
#   python    tests/mixers/test_fingerprint.py and `hfpatch models --check` on this Python (CPU; in the background)
#   hybrids   tests/gpu/test_hybrids_gpu.py on GPUs 0,1, beside `sft` on GPUs 2,3 (on 0,1 too on a 2-GPU machine)
#   sft       benchmarks/sft_cp_compare.py: examples/sft_cp.py with cp=2 and cp=1, bf16 then fp32 (SFT_RUNS:
#             "dtype:tokens per row" pairs, default "bfloat16:16384 float32:8192"; "none": no comparison); with
#             SFT_THROUGHPUT=<tokens per GPU> then benchmarks/sft_throughput.py: hfpatch cp=2, one GPU at its share,
#             accelerate's own cp_size=2 and hfpatch on its rows, on the ~1B Llama in bf16 (6 steps each, 180 s per
#             launch)
#   fp32      benchmarks/probe_margin.py in fp32 on GPUs 2,3 (after sft), each rank's stacks printed if it hangs
#
# The packages the machine lacks travel in .whl/ (benchmarks/README.md: transformers 5.24.0, TRL, datasets and
# theirs); they are installed into /tmp/site first. Each part has its own time limit; logs go to $OUT.
set -u
OUT=${OUT:?set OUT to the folder the logs go to}
parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(python probe margin cost hybrids sft)
wants() { local p; for p in "${parts[@]}"; do [ "$p" = "$1" ] && return 0; done; return 1; }
quiet() { grep --line-buffered -v -e Warning -e '^W11' -e 'falling back' -e 'return func' -e ProcessGroupNCCL; }

if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl &&
  python3 -c "import glob, tarfile; [tarfile.open(p).extractall('/tmp/site', filter='tar') for p in glob.glob('.whl/*.tar.xz')]" ||
  { echo "real_scale_suite: installing .whl/ failed" >&2; exit 2; }
fi
export PYTHONPATH=/tmp/site:$PWD TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
python3 -c "import os, sys, torch, transformers; print('python', sys.version.split()[0], 'torch', torch.__version__,
'transformers', transformers.__version__, 'gpus', torch.cuda.device_count(), torch.cuda.get_device_name(0),
'NCCL_NVLS_ENABLE', os.environ.get('NCCL_NVLS_ENABLE'))" | tee "$OUT/versions.log"

if wants python; then
  (timeout 300 python3 -m pytest -q -p no:cacheprovider tests/mixers/test_fingerprint.py; echo "fingerprint exit $?"
   timeout 300 python3 -m hfpatch models --check; echo "models exit $?") > "$OUT/python_sweep.log" 2>&1 &
fi
if wants probe; then
  timeout 260 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_probe_gpu.py 2>&1 | quiet > "$OUT/probe_8b.log"
fi
if wants margin; then
  timeout 100 torchrun --standalone --nproc-per-node 4 benchmarks/probe_margin.py --device cuda --exact small,8b --dtypes bfloat16 \
    2>&1 | quiet > "$OUT/probe_margin_4gpu.log"
  timeout 60 torchrun --standalone --nproc-per-node 4 benchmarks/probe_margin.py --device cuda --exact small --dtypes float32 \
    --watchdog 50 2>&1 | quiet >> "$OUT/probe_margin_4gpu.log"
  timeout 90 torchrun --standalone --nproc-per-node 2 benchmarks/probe_margin.py --device cuda --exact small,8b --dtypes bfloat16 \
    2>&1 | quiet > "$OUT/probe_margin_2gpu.log"
fi
if wants cost; then
  timeout 80 torchrun --standalone --nproc-per-node 1 benchmarks/model_probe_cost.py --device cuda --model 8b --tokens 4096 \
    2>&1 | quiet > "$OUT/probe_cost_8b.log"
fi
if wants hybrids; then
  (CUDA_VISIBLE_DEVICES=0,1 timeout 450 python3 -m pytest -s -rs -p no:cacheprovider tests/gpu/test_hybrids_gpu.py \
     -k cuda > "$OUT/hybrids_gpu.log" 2>&1; echo "hybrids exit $?" >> "$OUT/hybrids_gpu.log") &
fi
second_pair=2,3
[ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 4 ] || second_pair=0,1
(export CUDA_VISIBLE_DEVICES=$second_pair
 if wants sft; then
   for run in ${SFT_RUNS:-bfloat16:16384 float32:8192}; do
     [ "$run" = none ] && continue
     dtype=${run%:*} pack=${run#*:}
     timeout 170 python3 benchmarks/sft_cp_compare.py --tag "sft_cp_$dtype" --device cuda --cp 2 --out "$OUT" -- \
       --model small --steps 6 --dtype "$dtype" --pack-len "$pack" --doc-len 2048 > "$OUT/sft_cp_$dtype.log" 2>&1
     echo "sft $dtype exit $?" >> "$OUT/sft_cp_$dtype.log"
   done
   if [ -n "${SFT_THROUGHPUT:-}" ]; then
     timeout 760 python3 benchmarks/sft_throughput.py --device cuda --cp 2 --model small --dtype bfloat16 \
       --tokens-per-gpu "$SFT_THROUGHPUT" --steps 6 --timeout 180 --out "$OUT" > "$OUT/sft_throughput.log" 2>&1
     echo "sft throughput exit $?" >> "$OUT/sft_throughput.log"
   fi
 fi
 if wants fp32; then
   timeout 90 torchrun --standalone --nproc-per-node 2 benchmarks/probe_margin.py --device cuda --exact small --dtypes float32 \
     --watchdog 75 2>&1 | quiet > "$OUT/probe_margin_fp32_2gpu.log"
 fi) &
wait
for f in "$OUT"/*.log; do echo "== $(basename "$f")"; tail -n 14 "$f"; done
