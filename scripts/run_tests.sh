#!/usr/bin/env bash
# The test command (README via scripts/setup_and_test.sh, and CI's README step in .ci/run): the whole CPU suite on
# both cores, whole modules per pytest-xdist worker (tests/conftest.py); the closing summary lists every failure,
# error and skip with its reason (-rfEs), then the 25 slowest tests (where CI time goes). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
exec python -m pytest -q -rfEs -n 2 --dist loadscope --durations=25 "$@"
