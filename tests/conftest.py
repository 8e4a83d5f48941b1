import os
import sys
from importlib.util import find_spec

import pytest

# The ranks unpickle test functions by module name: make tests/ importable for them.
sys.path.insert(0, os.path.dirname(__file__))

from _release import MARKER, RELEASE_INDEPENDENT, SAME_WORKER, TORCH_MARKER, TORCH_OPS  # noqa: E402
from ring_kernels.world import preload_in_ranks  # noqa: E402

_TESTS = os.path.dirname(os.path.abspath(__file__))

# The tests' ranks are forked from ring_kernels.world's fork server: have it import transformers' modeling core once
# (where transformers is installed), so that a rank of a test on a transformers model starts in a fraction of a
# second instead of importing it anew (seconds; the suite starts hundreds of worlds).
if find_spec("transformers") is not None:
    preload_in_ranks("transformers.modeling_utils")

if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    # Under pytest-xdist the workers share the cores: one worker's in-process torch ops get its share of them, not
    # all (CPU oversubscription slows every worker). The gloo ranks tests spawn use one thread each anyway.
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


def pytest_collection_modifyitems(config, items):
    """Mark every test of a module not in _release.RELEASE_INDEPENDENT ``release_dependent`` (CI's older tox envs
    run only those; docs/ci.md), and every test of a module in _release.TORCH_OPS ``torch_ops`` (the envs on the
    torch series between the two ends run those too)."""
    for item in items:
        module = os.path.relpath(str(item.path), _TESTS).replace(os.sep, "/")
        if module not in RELEASE_INDEPENDENT:
            item.add_marker(getattr(pytest.mark, MARKER))
        if module in TORCH_OPS:
            item.add_marker(getattr(pytest.mark, TORCH_MARKER))


@pytest.hookimpl(optionalhook=True)   # pytest-xdist's hook: absent without the plugin (-p no:xdist)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadscope` (scripts/run_tests.sh): whole modules per worker, so a module-scoped fixture (the model
    sweep, the CPU benchmark world) runs once, and the modules of _release.SAME_WORKER share a worker."""
    if config.getoption("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class _ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            module = nodeid.split("::", 1)[0]
            return SAME_WORKER.get(module, module)

    return _ModuleScheduling(config, log)
