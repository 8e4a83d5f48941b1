#!/usr/bin/env bash
# Fresh clone -> .venv -> `hfpatch demo`: the setup steps of .ci/run (everything before its test command: the venv
# and the pinned installs, without CI's step timer), each announced by a line as it starts, then the demo. Extra
# arguments go to `hfpatch demo` (e.g. --world-size 4).
#   bash scripts/setup_and_demo.sh [demo args]
set -euo pipefail
cd "$(dirname "$0")/.."
steps=$(awk '/^# The README.s test command:/ {exit} {print}' .ci/run)
grep -q "pip install" <<<"$steps" || { echo "scripts/setup_and_demo.sh: found no setup steps in .ci/run" >&2; exit 2; }

# announced: .ci/run's setup lines, each phase announced (scripts/_announced.sh)
. scripts/_announced.sh

exec bash -c "$(announced "$steps")
echo \"setup done (\${SECONDS}s); hfpatch demo\${*:+ \$*}\"
hfpatch demo \"\$@\"" .ci/run "$@"
