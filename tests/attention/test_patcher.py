"""Binding sites: found by identity, swapped all-or-nothing, restored exactly; modules imported after install
get the wrapper (import hook) and get the original back on restore."""
from __future__ import annotations

import importlib
import importlib.machinery
import sys
import textwrap
import types

import pytest

import transformers.modeling_flash_attention_utils as mfau
import transformers.modeling_utils as modeling_utils
from hfpatch.attention import patcher
from hfpatch.errors import AlreadyRemoved, PatchError, SitesRebound

try:  # integrations/flash_attention.py and the attention interface exist from 4.48 on
    import transformers.integrations.flash_attention as integ
except ImportError:
    integ = None

MFAU_SITE = "transformers.modeling_flash_attention_utils._flash_attention_forward"
INTEG_SITE = "transformers.integrations.flash_attention._flash_attention_forward"


def _wrapper(*args, **kwargs):  # the patcher never calls it: any object will do, identity is what counts
    raise AssertionError("not called in these tests")


@pytest.fixture
def original():
    fn = mfau._flash_attention_forward
    yield fn
    # every test must leave transformers exactly as it found it
    assert mfau._flash_attention_forward is fn and (integ is None or integ._flash_attention_forward is fn)
    assert not any(isinstance(f, patcher.RebindFinder) for f in sys.meta_path)


@pytest.fixture
def tmp_modules(tmp_path, monkeypatch):
    """Write modules into a fresh sys.path entry; they are removed from sys.modules afterwards."""
    monkeypatch.syspath_prepend(str(tmp_path))
    names = []

    def write(name, source):
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        names.append(name)
        importlib.invalidate_caches()

    yield write
    for name in names:
        sys.modules.pop(name, None)


def _alias_module(name, original):
    """An imported module holding the original under another name (``from ... import x as y``)."""
    module = types.ModuleType(name)
    module.fa_alias = original
    sys.modules[name] = module
    return module


def test_plan_finds_sites_by_identity_and_interface_routes(original):
    module = _alias_module("hfpatch_test_alias_site", original)
    try:
        plan = patcher.binding_sites(original)
    finally:
        del sys.modules[module.__name__]
    labels = [s.label for s in plan.sites]
    assert labels[0] == MFAU_SITE  # the defining module first
    assert "hfpatch_test_alias_site.fa_alias" in labels
    assert all(s.original is original for s in plan.sites)
    if integ is None:
        assert plan.routes == []  # before 4.48 there is no attention interface
        return
    assert INTEG_SITE in labels
    # interface entries are routes through INTEG's globals, not sites (their signature is the interface's)
    keys = {r.key for r in plan.routes}
    assert "flash_attention_2" in keys
    assert all(r.globals_ is integ.__dict__ and r.name == "_flash_attention_forward" for r in plan.routes)
    assert not any("AttentionInterface" in label for label in labels)


def test_install_and_restore_every_site_by_identity(original):
    module = _alias_module("hfpatch_test_alias_install", original)
    try:
        inst = patcher.install(patcher.binding_sites(original), _wrapper)
        assert mfau._flash_attention_forward is _wrapper
        assert module.fa_alias is _wrapper
        assert all(site.current() is _wrapper for site in inst.sites)
        assert all(r.reaches() is _wrapper for r in inst.routes)
        if integ is not None:
            assert integ._flash_attention_forward is _wrapper
            fn = modeling_utils.ALL_ATTENTION_FUNCTIONS["flash_attention_2"]
            assert fn.__globals__["_flash_attention_forward"] is _wrapper  # what the interface entry calls
        assert inst.hook in sys.meta_path
        inst.remove()  # raises SitesRebound if a site was left
        assert module.fa_alias is original
    finally:
        del sys.modules[module.__name__]


def test_module_imported_after_install_gets_wrapper_and_original_back(original, tmp_modules):
    tmp_modules("hfpatch_late_from_import", """
        from transformers.modeling_flash_attention_utils import _flash_attention_forward
        from transformers.modeling_flash_attention_utils import _flash_attention_forward as aliased
    """)
    # A module that reaches the ORIGINAL object some other way (a saved reference): the hook rebinds it.
    sys.modules["hfpatch_saved_reference"] = types.SimpleNamespace(saved=original)
    tmp_modules("hfpatch_late_saved", """
        import sys
        fa = sys.modules["hfpatch_saved_reference"].saved
    """)
    try:
        inst = patcher.install(patcher.binding_sites(original), _wrapper)
        late = importlib.import_module("hfpatch_late_from_import")
        saved = importlib.import_module("hfpatch_late_saved")
        assert late._flash_attention_forward is _wrapper and late.aliased is _wrapper
        assert saved.fa is _wrapper
        labels = [s.label for s in inst.sites]
        for label in ("hfpatch_late_from_import._flash_attention_forward", "hfpatch_late_from_import.aliased",
                      "hfpatch_late_saved.fa"):
            assert label in labels
        # the module's loader is the real one, untouched (the one-shot exec hook is gone): nothing sees hfpatch
        assert type(late.__loader__) is importlib.machinery.SourceFileLoader
        assert late.__spec__.loader is late.__loader__ and "exec_module" not in vars(late.__loader__)
        inst.remove()
        assert late._flash_attention_forward is original and late.aliased is original and saved.fa is original
    finally:
        del sys.modules["hfpatch_saved_reference"]


def test_restore_sweeps_modules_that_bypassed_the_import_system(original):
    inst = patcher.install(patcher.binding_sites(original), _wrapper)
    stray = types.ModuleType("hfpatch_test_stray")
    stray.fa = mfau._flash_attention_forward  # copied from a patched module without an import
    sys.modules[stray.__name__] = stray
    try:
        inst.remove()
        assert stray.fa is original
    finally:
        del sys.modules[stray.__name__]


class _GuardedModule(types.ModuleType):
    """A module that refuses to have its binding replaced: the failure injected at the 2nd site."""

    armed = False

    def __setattr__(self, name, value):
        if self.armed and name == "fa":
            raise RuntimeError("injected failure while installing")
        super().__setattr__(name, value)


def test_failure_at_second_site_rolls_back_everything(original):
    guarded = _GuardedModule("aaa_hfpatch_guarded")  # sorts right after the defining module
    guarded.fa = original
    sys.modules[guarded.__name__] = guarded
    try:
        plan = patcher.binding_sites(original)
        assert [s.label for s in plan.sites][:2] == [MFAU_SITE, "aaa_hfpatch_guarded.fa"]
        guarded.armed = True
        with pytest.raises(PatchError) as info:
            patcher.install(plan, _wrapper)
        message = str(info.value)
        assert "aaa_hfpatch_guarded.fa" in message and "restored" in message
        assert isinstance(info.value.__cause__, RuntimeError)
        assert guarded.fa is original  # fixture checks MFAU, INTEG and the import hook
    finally:
        del sys.modules[guarded.__name__]


def test_site_rebound_between_plan_and_install_changes_nothing(original):
    module = _alias_module("hfpatch_test_rebound", original)
    try:
        plan = patcher.binding_sites(original)
        module.fa_alias = lambda *a, **k: None
        with pytest.raises(PatchError, match="hfpatch_test_rebound.fa_alias holds"):
            patcher.install(plan, _wrapper)
        assert mfau._flash_attention_forward is original
    finally:
        del sys.modules[module.__name__]


def test_interface_entry_with_closure_over_original_is_refused_before_any_change(original, monkeypatch):
    def make():
        captured = original

        def closure_attention(module, query, key, value, attention_mask, **kwargs):
            return captured(query, key, value, attention_mask, query.shape[2], True)

        return closure_attention

    interface = getattr(modeling_utils, "AttentionInterface", None)
    if interface is not None:  # 4.51+: the class-wide registry
        monkeypatch.setitem(interface._global_mapping, "hfpatch_test_closure", make())
    elif isinstance(getattr(modeling_utils, "ALL_ATTENTION_FUNCTIONS", None), dict):  # 4.48-4.50: a plain dict
        monkeypatch.setitem(modeling_utils.ALL_ATTENTION_FUNCTIONS, "hfpatch_test_closure", make())
    else:
        pytest.skip("transformers < 4.48 has no attention interface whose entries could close over the function")
    with pytest.raises(PatchError, match="closure"):
        patcher.binding_sites(original)


def test_nothing_holds_the_function():
    with pytest.raises(PatchError, match="no imported module holds"):
        patcher.binding_sites(lambda: None)


def test_restore_leaves_a_site_someone_else_rebound_and_reports_it(original):
    module = _alias_module("hfpatch_test_foreign", original)
    try:
        inst = patcher.install(patcher.binding_sites(original), _wrapper)
        other = lambda *a, **k: None  # noqa: E731  (another patcher, applied after hfpatch)
        module.fa_alias = other
        with pytest.raises(SitesRebound) as info:
            inst.remove()
        assert info.value.sites == ["hfpatch_test_foreign.fa_alias"]
        assert module.fa_alias is other  # not clobbered
    finally:
        del sys.modules[module.__name__]


def test_removing_twice_is_an_error(original):
    inst = patcher.install(patcher.binding_sites(original), _wrapper)
    inst.remove()
    with pytest.raises(AlreadyRemoved):
        inst.remove()
    assert mfau._flash_attention_forward is original
