#!/usr/bin/env bash
# The project under the oldest torch of the supported range (CI's torch-oldest steps; docs/ci.md says why and what
# runs). The CI venv runs the newest; ring_kernels/torch_releases.py states the range, pyproject the same.
#
#   bash scripts/torch_oldest.sh [setup] [tests] [-- pytest args]     (no part: both)
#
#   setup   .venv-torch-oldest (gitignored): torch at the pin below (PyPI's Linux wheel, a CUDA build: it runs on
#           CPU; it brings the triton its release pins), transformers at .ci/run's pin, then `pip install -e
#           '.[test]'`; reused while the pins match
#   tests   the release-independent tests (`-m "not release_dependent"`: kernels, checkpointing, the torch gates),
#           then the modules whose subject is torch itself rather than the transformers release: keep_attention,
#           FSDP2 + checkpointing + torch.compile (the training stack), the e2e models and the check CLI; then
#           `hfpatch demo` and `hfpatch check`
#
# Each part prints `torch-oldest <part> <seconds>s`.
set -euo pipefail
cd "$(dirname "$0")/.."

# The oldest supported series' tested release (TORCH_OLDEST in ring_kernels/torch_releases.py;
# tests/test_torch_releases.py checks that the two agree).
oldest=torch==2.9.1
venv=.venv-torch-oldest
# Real-scale cases are about depth and width, not torch: they run once, in the CI venv.
torch_modules=(tests/test_keep_attention.py tests/test_training_stack.py tests/test_e2e_models.py
               tests/test_check_cli.py)

die() { echo "scripts/torch_oldest.sh: $*" >&2; exit 1; }
. scripts/ci_pins.sh
timed() { local part=$1 start=$SECONDS; shift; "$@"; echo "torch-oldest $part $((SECONDS - start))s"; }

setup() {
    local pins
    pins="$oldest $(ci_pin transformers)"
    if [ "$(cat "$venv/.pins" 2>/dev/null)" != "$pins" ]; then
        rm -rf "$venv"
        python3 -m venv "$venv"
        "$venv/bin/python" -m pip install -q --upgrade pip
        "$venv/bin/python" -m pip install -q "$oldest"
        # torch pinned again: the project's requirement must not move it.
        "$venv/bin/python" -m pip install -q -e '.[test]' "$(ci_pin transformers)" "$oldest"
        echo "$pins" >"$venv/.pins"
    fi
    "$venv/bin/python" -c 'import torch, transformers; print("torch-oldest torch", torch.__version__,
        "transformers", transformers.__version__)'
}

tests() {
    "$venv/bin/python" -m pytest -q -rfEs -n 2 --dist loadscope -m "not release_dependent" "$@"
    "$venv/bin/python" -m pytest -q -rfEs -n 2 --dist loadscope -k "not real_scale" "${torch_modules[@]}" "$@"
    "$venv/bin/hfpatch" demo
    "$venv/bin/hfpatch" check
}

parts=() args=()
while [ $# -gt 0 ]; do
    case $1 in
        setup|tests) parts+=("$1"); shift ;;
        --) shift; args=("$@"); break ;;
        *) die "unknown part '$1' (setup, tests, then -- and pytest arguments)" ;;
    esac
done
[ ${#parts[@]} -gt 0 ] || parts=(setup tests)
for part in "${parts[@]}"; do
    if [ "$part" = tests ]; then timed tests tests "${args[@]}"; else timed "$part" "$part"; fi
done
