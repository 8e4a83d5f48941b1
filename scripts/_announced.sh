# Sourced by scripts/setup_and_demo.sh and scripts/setup_and_test.sh (from the repository root).
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
