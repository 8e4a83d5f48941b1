#!/usr/bin/env bash
# The test command (README, scripts/setup_and_test.sh and .ci/run all run this): the whole CPU suite on both cores,
# whole modules per pytest-xdist worker (tests/conftest.py). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
exec python -m pytest -q -n 2 --dist loadscope "$@"
