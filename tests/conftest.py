import os
import sys

import pytest

# Spawned children unpickle test functions by module name: make tests/ importable for them.
sys.path.insert(0, os.path.dirname(__file__))

from _release import MARKER, RELEASE_INDEPENDENT  # noqa: E402

_TESTS = os.path.dirname(os.path.abspath(__file__))


def pytest_collection_modifyitems(config, items):
    """Mark every test of a module not in _release.RELEASE_INDEPENDENT ``release_dependent`` (CI's older tox envs
    run only those; docs/ci.md)."""
    for item in items:
        module = os.path.relpath(str(item.path), _TESTS).replace(os.sep, "/")
        if module not in RELEASE_INDEPENDENT:
            item.add_marker(getattr(pytest.mark, MARKER))
