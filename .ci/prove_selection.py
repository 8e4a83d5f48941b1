"""Show that an older tox env's test selection catches a break of its own release's registry entry (docs/ci.md).

Run with a tox env's interpreter (not by CI; its result is quoted in docs/ci.md):

    .tox/tf4.48.3/bin/python .ci/prove_selection.py [pytest args, e.g. -n 2 --dist loadscope]

On a copy of the tree whose registry entry for that env's transformers release has its first parameter renamed
(tests/tooling/test_ci_selection.py's ``broken_copy``; no other release's entry changes), it runs the tests that env
runs (``-m release_dependent``), which must fail, and the tests it leaves out (``-m "not release_dependent"``),
which must pass: the break is invisible to them, so only the selection catches it. Exit 0 when both hold.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_SUMMARY = re.compile(r"^=*\s*(\d+ \w+.*? in [\d.]+s.*?)\s*=*$", re.M)


def _run(copy: Path, marker: str, extra: list[str]) -> tuple[int, str, list[str], float]:
    env = {**os.environ, "PYTHONPATH": str(copy), "PYTHONDONTWRITEBYTECODE": "1"}
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", marker, *extra],
                          cwd=copy, env=env, capture_output=True, text=True)
    out = proc.stdout + proc.stderr
    summary = _SUMMARY.findall(out)
    failed = sorted(set(re.findall(r"^(?:FAILED|ERROR) (\S+)", out, re.M)))
    return proc.returncode, summary[-1] if summary else out[-2000:], failed, time.monotonic() - start


def main(extra: list[str]) -> int:
    # test_ci_selection and the helpers it imports by bare name (tests/conftest.py's path); the root first, so that
    # tests/ring_kernels/ is not taken for the ring_kernels package.
    sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "tooling")]
    from test_ci_selection import broken_copy

    import transformers

    with tempfile.TemporaryDirectory() as tmp:
        copy, entry_id, renamed = broken_copy(Path(tmp))
        print(f"transformers {transformers.__version__}: registry entry {entry_id} broken (first parameter renamed "
              f"to {renamed!r}) in a copy of the tree")
        code, summary, failed, took = _run(copy, "release_dependent", extra)
        print(f"-m release_dependent (what the env runs): exit {code}, {summary} [{took:.0f}s wall]")
        for nodeid in failed:
            print(f"  failed: {nodeid}")
        caught = code == 1 and failed
        code2, summary2, failed2, took2 = _run(copy, "not release_dependent", extra)
        print(f'-m "not release_dependent" (left out of the env): exit {code2}, {summary2} [{took2:.0f}s wall]')
        for nodeid in failed2:
            print(f"  failed: {nodeid}")
    print("the selection catches the break" if caught else "NOT CAUGHT by the selection")
    if code2 != 0:
        print("the left-out tests fail too: they may depend on the release (or fail for another reason)")
    return 0 if caught and code2 == 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
