# Sourced by scripts/python313.sh and scripts/torch_release.sh: the pins of .ci/run (the CI venv's torch and
# transformers), read from it so that the other venvs cannot drift from it. Run from the repository root.

# `ci_pin NAME` prints .ci/run's first NAME==<version> (e.g. `transformers==5.24.0`); none: an error, exit 1.
ci_pin() {
    local found
    found=$(grep -oE "(^|[ '\"])$1==[0-9][0-9a-z.]*" .ci/run | head -1 | tr -d " '\"")
    [ -n "$found" ] || { echo "no $1==<version> pin found in .ci/run" >&2; exit 1; }
    echo "$found"
}
