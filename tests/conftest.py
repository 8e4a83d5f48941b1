"""The suite's layout, its import path, its markers and its scheduler.

tests/ mirrors the wings of the tree; each test module sits in the folder of the wing it tests:

- ``ring_kernels/``: the kernel package (backends, merge, layout, transport, the ring / zigzag / stripe / varlen /
  Ulysses engines, options, checkpointing, tolerances, the torch range, ``ring_kernels.world``);
- ``attention/``: hfpatch's attention path (the signature registry, codegen, patcher, semantics, the switch, the
  call path, kernel choice, head parallelism, autocast) and the API around it (apply, undo, fallback, the rank
  check, keep_attention);
- ``model/``: ``apply(model=)`` (the audit and probe, heads, positions, labels, wrappers, several models,
  multimodal towers) and the model sweep on real HF classes;
- ``mixers/``: the sequence mixers (kinds, families, forms, the registry and its fingerprints); the cases of a
  module run in one world (``_mixer_cases.py``, its ``world`` fixture in mixers/conftest.py);
- ``integrations/``: the trainers, TRL, OpenRLHF, the drop-ins, scoring, the examples and the training stack;
- ``tooling/``: the command line, check / compat / scan, the release matrix and CI's selection, docs, the import
  graph, packaging, the setup scripts and the benchmarks' tests;
- ``gpu/``: CUDA tests (skipped without GPUs).

A helper used by one folder lives there (``mixers/_mixer_cases.py``); the shared ones (``_dist``, ``_release``,
``_paths``, ``_tox``, ``_openrlhf``) and ``data/`` stay here. Modules import each other by bare name, so basenames
are unique across the folders.
"""
import os
import sys
from importlib.util import find_spec

import pytest

# Every test folder on sys.path, now, before any world starts: the ranks (forked from ring_kernels.world's fork
# server, which starts with this process's sys.path) unpickle test functions by module name, and test modules import
# helpers and each other by bare name. The repository root too: with tests/ on sys.path, tests/ring_kernels/ would
# otherwise be taken for a namespace package named ring_kernels where the root is not on it (a plain `pytest`
# command with the editable install), while a regular package anywhere on the path wins over it.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _paths import ROOT, TEST_FOLDERS, TESTS  # noqa: E402

sys.path[:0] = [str(folder) for folder in TEST_FOLDERS if str(folder) not in sys.path]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

from _release import (MARKER, RELEASE_INDEPENDENT, SAME_WORKER, TORCH_MARKER, TORCH_OPS,  # noqa: E402
                      UNDER_THE_PIN, ci_pin, installed_transformers)
from ring_kernels.world import preload_in_ranks  # noqa: E402

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
    torch series between the two ends run those too); skip the tests of a module in _release.UNDER_THE_PIN unless
    the installed transformers is the CI pin."""
    installed = installed_transformers()
    off_the_pin = installed is not None and installed != ci_pin()
    for item in items:
        module = os.path.relpath(str(item.path), TESTS).replace(os.sep, "/")
        if module not in RELEASE_INDEPENDENT:
            item.add_marker(getattr(pytest.mark, MARKER))
        if off_the_pin and module in UNDER_THE_PIN:
            item.add_marker(pytest.mark.skip(reason=f"under the CI pin only ({UNDER_THE_PIN[module]}); this env has "
                                                    f"transformers {installed}"))
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
