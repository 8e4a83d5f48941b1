"""The mixer modules' world: a module that declares its cases as ``CASES`` (``_mixer_cases.Case``) and asks for
``world`` runs them all in one gloo world (``_mixer_cases.run_module_world``), each case then its own test:

    @pytest.mark.parametrize("name", [c.name for c in CASES])
    def test_case(world, name):
        world.check(name)
"""
import pytest

from _mixer_cases import run_module_world, selected_cases


@pytest.fixture(scope="module")
def world(request, tmp_path_factory):
    """The outcome of the requesting module's ``CASES`` that pytest selected (after -k / -m / node ids), run once
    per module."""
    module = request.module
    return run_module_world(module.CASES, tmp_path_factory.mktemp(f"{module.__name__}_world"),
                            selected_cases(request))
