#!/usr/bin/env bash
# Fresh clone -> .venv -> the test suite, with CI's setup and test command: runs .ci/run's lines before its "The
# README's test command" step (the venv and the pinned installs, without CI's step timer), each phase announced by
# a line as it starts, then the command that step wraps, scripts/run_tests.sh (CI also records the run as the newest
# release's matrix entry; a user's run records nothing). Extra arguments go to that test command (e.g. -k docs).
#   bash scripts/setup_and_test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
steps=$(awk '/^# The README.s test command:/ {exit} {print}' .ci/run)
readme_step=$(awk 'found {print; exit} /^# The README.s test command:/ {found=1}' .ci/run)
grep -q "scripts/run_tests.sh" <<<"$readme_step" || {
    echo "scripts/setup_and_test.sh: .ci/run's \"# The README's test command:\" step does not run scripts/run_tests.sh" \
         "(found: ${readme_step:-nothing})" >&2; exit 2; }

# announced: .ci/run's setup lines, each phase announced (scripts/_announced.sh)
. scripts/_announced.sh

exec bash -c "$(announced "$steps")
echo \"setup done (\${SECONDS}s); the test suite: bash scripts/run_tests.sh\${*:+ \$*}\"
exec bash scripts/run_tests.sh \"\$@\"" .ci/run "$@"
