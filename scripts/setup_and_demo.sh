#!/usr/bin/env bash
# Fresh clone -> .venv -> `hfpatch demo`: the setup steps of .ci/run (everything before its test command: the venv
# and the pinned installs, without CI's step timer), each announced by a line as it starts, then the demo. Extra
# arguments go to `hfpatch demo` (e.g. --world-size 4).
#   bash scripts/setup_and_demo.sh [demo args]
set -euo pipefail
cd "$(dirname "$0")/.."
steps=$(awk '/^# The README.s test command:/ {exit} {print}' .ci/run)
grep -q "pip install" <<<"$steps" || { echo "scripts/setup_and_demo.sh: found no setup steps in .ci/run" >&2; exit 2; }

# .ci/run's lines without CI's bookkeeping (its step timer: `begin_step` calls and the EXIT trap that prints the
# times), with a line announcing each phase (the venv, each pip install) as it starts.
announced() {
    local total phase=0 line
    total=$(grep -cE '^python3? -m (venv|pip install)' <<<"$1")
    while IFS= read -r line; do
        case $line in begin_step\ * | trap\ *) continue ;; esac
        if [[ $line =~ ^python3?\ -m\ (venv|pip\ install) ]]; then
            phase=$((phase + 1))
            printf 'echo "setup %d/%d (${SECONDS}s):" %q\n' "$phase" "$total" "$line"
        fi
        printf '%s\n' "$line"
    done <<<"$1"
}

exec bash -c "$(announced "$steps")
echo \"setup done (\${SECONDS}s); hfpatch demo\${*:+ \$*}\"
hfpatch demo \"\$@\"" .ci/run "$@"
