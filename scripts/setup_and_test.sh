#!/usr/bin/env bash
# Fresh clone -> .venv -> the test suite, exactly as CI does it: runs .ci/run from its first line through its
# "The README's test command" step (the venv, the pinned installs, the test command), so this script and CI cannot
# drift apart. Extra arguments go to that test command (e.g. -k docs).
#   bash scripts/setup_and_test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
steps=$(awk '{print} done {exit} /^# The README.s test command:/ {done=1}' .ci/run)
grep -q "^# The README.s test command:" <<<"$steps" || { echo "scripts/setup_and_test.sh: .ci/run has no \"# The README's test command:\" step" >&2; exit 2; }
exec bash -c "$steps \"\$@\"" .ci/run "$@"
