"""Where the tests find the tree: the repository's root, tests/, benchmarks/, and the folders of test modules.

Test modules and their helpers import each other by bare module name (``from _dist import run_world``, ``from
test_semantics import hf_call``), from whichever folder of ``TEST_FOLDERS`` holds them: tests/conftest.py puts every
one of them on ``sys.path`` (and so does any script that launches a helper as ``__main__``). Module basenames are
unique across the folders.
"""
from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
BENCHMARKS = ROOT / "benchmarks"
DATA = TESTS / "data"
# tests/ itself (the shared helpers), then each subfolder that holds Python modules (ring_kernels/, attention/, ...,
# gpu/), in name order.
TEST_FOLDERS = (TESTS, *sorted(d for d in TESTS.iterdir()
                               if d.is_dir() and d.name != "__pycache__" and any(d.glob("*.py"))))
