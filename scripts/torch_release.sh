#!/usr/bin/env bash
# The project under one torch release of the supported range, in a venv of its own (docs/ci.md, "The torch axis").
# The CI venv runs the newest; ring_kernels/torch_releases.py states the range, pyproject the same.
#
#   bash scripts/torch_release.sh [--release X.Y.Z | --matrix] [setup] [tests] [-- pytest args]   (no part: both)
#
#   (default)   the oldest supported release (the pin below): .venv-torch-oldest, parts labelled `torch-oldest`
#   --release   another release of the range: .venv-torch-X.Y.Z, parts labelled `torch-X.Y.Z`
#   --matrix    setup only: every .venv-torch-X.Y.Z that tox.ini's envs take their torch from
#               (HFPATCH_TORCH_PYTHON), one after the other (the oldest's venv is the plain setup's)
#
#   setup   the venv (gitignored): torch at the pin (PyPI's Linux wheel, a CUDA build: it runs on CPU; it brings
#           the triton its release pins), transformers at .ci/run's pin, then `pip install -e '.[test]'`; reused
#           while the pins match
#   tests   the release-independent tests (`-m "not release_dependent"`: kernels, checkpointing, the torch gates),
#           then the modules whose subject is torch itself rather than the transformers release: keep_attention,
#           FSDP2 + checkpointing + torch.compile (the training stack), the e2e models and the check CLI; then
#           `hfpatch demo` and `hfpatch check`
#
# Each part prints `<label> <part> <seconds>s`.
set -euo pipefail
# The venvs are installed without bytecode (--no-compile: most of torch's files are never imported); Python writes
# it at each module's first import, which PYTHONDONTWRITEBYTECODE would turn into a compile in every process.
unset PYTHONDONTWRITEBYTECODE
cd "$(dirname "$0")/.."

# The oldest supported series' tested release (TORCH_OLDEST in ring_kernels/torch_releases.py;
# tests/ring_kernels/test_torch_releases.py checks that the two agree).
oldest=torch==2.9.1
torch_pin=$oldest venv=.venv-torch-oldest label=torch-oldest
# Real-scale cases are about depth and width, not torch: they run once, in the CI venv.
torch_modules=(tests/attention/test_keep_attention.py tests/integrations/test_training_stack.py
               tests/model/test_e2e_models.py tests/tooling/test_check_cli.py)

die() { echo "scripts/torch_release.sh: $*" >&2; exit 1; }
. scripts/ci_pins.sh
timed() { local part=$1 start=$SECONDS; shift; "$@"; echo "$label $part $((SECONDS - start))s"; }

setup() {
    local pins
    pins="$torch_pin $(ci_pin transformers)"
    if [ "$(cat "$venv/.pins" 2>/dev/null)" != "$pins" ]; then
        rm -rf "$venv"
        python3 -m venv "$venv"
        "$venv/bin/python" -m pip install -q --upgrade pip
        # No cache: each CUDA build is 3-7 GB of wheels that no later install reads again (disk: docs/ci.md).
        "$venv/bin/python" -m pip install -q --no-cache-dir --no-compile "$torch_pin"
        # torch pinned again: the project's requirement must not move it.
        "$venv/bin/python" -m pip install -q --no-compile -e '.[test]' "$(ci_pin transformers)" "$torch_pin"
        # The Triton interpreter of triton < 3.7 (the triton that torch 2.10 and 2.11 pin) fails under numpy >= 2.4
        # ("only 0-dimensional arrays can be converted to Python scalars"): the interpreter tests need an older
        # numpy beside it. A GPU run of the kernels does not use numpy.
        if "$venv/bin/python" -c 'import sys, triton; sys.exit(tuple(map(int, triton.__version__.split(".")[:2])) >= (3, 7))' \
                2>/dev/null; then
            "$venv/bin/python" -m pip install -q 'numpy<2.4'
        fi
        # The files this venv holds in the same bytes as the CI venv or another torch venv (most of the NVIDIA
        # libraries): hard-linked to that copy, to spare the disk (docs/ci.md).
        python3 scripts/link_duplicates.py "$venv" .venv .venv-torch-* .py313/root/venv
        echo "$pins" >"$venv/.pins"
    fi
    "$venv/bin/python" -c "import torch, transformers; print('$label torch', torch.__version__,
        'transformers', transformers.__version__)"
}

tests() {
    "$venv/bin/python" -m pytest -q -rfEs -n 2 --dist loadscope -m "not release_dependent" "$@"
    "$venv/bin/python" -m pytest -q -rfEs -n 2 --dist loadscope -k "not real_scale" "${torch_modules[@]}" "$@"
    "$venv/bin/hfpatch" demo
    "$venv/bin/hfpatch" check
}

# The releases tox.ini's envs take their torch from, besides the oldest's venv and the CI venv (the newest).
matrix_releases() {
    grep -oE '\.venv-torch-[0-9]+\.[0-9]+\.[0-9]+/' tox.ini | sed -E 's/^\.venv-torch-//; s/\/$//' | sort -uV
}

parts=() args=() matrix=
while [ $# -gt 0 ]; do
    case $1 in
        setup|tests) parts+=("$1"); shift ;;
        --release)
            [[ ${2:-} =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] || die "--release takes a torch release X.Y.Z (got '${2:-}')"
            torch_pin=torch==$2 venv=.venv-torch-$2 label=torch-$2; shift 2 ;;
        --matrix) matrix=1; shift ;;
        --) shift; args=("$@"); break ;;
        *) die "unknown part '$1' (--release X.Y.Z, --matrix, setup, tests, then -- and pytest arguments)" ;;
    esac
done
[ ${#parts[@]} -gt 0 ] || parts=(setup tests)
if [ -n "$matrix" ]; then
    [ "${parts[*]}" = setup ] || die "--matrix sets up venvs only (give: --matrix setup)"
    for release in $(matrix_releases); do
        bash "$0" --release "$release" setup
    done
    exit 0
fi
for part in "${parts[@]}"; do
    if [ "$part" = tests ]; then timed tests tests "${args[@]}"; else timed "$part" "$part"; fi
done
