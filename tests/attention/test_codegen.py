"""The generated wrapper: exact signature, arguments by role, guarded unknown parameters, readable source."""
from __future__ import annotations

import inspect
import linecache
import traceback

import pytest

from hfpatch.attention import codegen
from hfpatch.errors import PatchError, UnsupportedArgument
from hfpatch.signatures import load_registry, match

P = inspect.Parameter
ENTRIES = {e.id: e for e in load_registry()}


def _capture(call, extra):
    return call, extra


def _render(m, fn, **kwargs):
    """The wrapper for ``m`` around ``fn(call, extra)``: the role dict the wrapper's positional roles make."""
    return codegen.render(m, codegen.by_role(m, fn), **kwargs)


def _original_with(sig: inspect.Signature):
    """A stand-in for HF's function: a named function carrying ``sig``."""

    def _flash_attention_forward(*args, **kwargs):
        raise AssertionError("the wrapper must not call the original")

    _flash_attention_forward.__signature__ = sig
    return _flash_attention_forward


def _tokens(sig: inspect.Signature) -> dict[str, object]:
    """One distinct object per named parameter, so that a misrouted argument cannot go unnoticed."""
    return {n: object() for n, p in sig.parameters.items() if p.kind not in (P.VAR_POSITIONAL, P.VAR_KEYWORD)}


def _expected_call(entry, tokens):
    return {entry.roles[name]: token for name, token in tokens.items()}


@pytest.mark.parametrize("entry_id", list(ENTRIES))
def test_wrapper_has_exactly_the_entry_signature_and_identity(entry_id):
    entry = ENTRIES[entry_id]
    sig = entry.signature()
    original = _original_with(sig)
    wrapper = _render(match(sig), _capture, original=original)
    assert inspect.signature(wrapper, follow_wrapped=False) == sig
    assert str(inspect.signature(wrapper, follow_wrapped=False)) == str(sig)  # annotations included
    # Defaults are the very same objects (bound by reference, never re-evaluated).
    for name, param in sig.parameters.items():
        if param.default is not P.empty:
            assert inspect.signature(wrapper, follow_wrapped=False).parameters[name].default is param.default
    assert wrapper.__wrapped__ is original
    assert (wrapper.__name__, wrapper.__qualname__, wrapper.__module__) == (
        original.__name__, original.__qualname__, original.__module__)
    assert wrapper.__hfpatch_id__ == entry_id
    assert wrapper.__code__.co_filename == f"<hfpatch wrapper {entry_id}>"


@pytest.mark.parametrize("entry_id", list(ENTRIES))
def test_arguments_land_in_their_roles_positionally_by_keyword_and_mixed(entry_id):
    entry = ENTRIES[entry_id]
    sig = entry.signature()
    wrapper = _render(match(sig), _capture)
    tokens = _tokens(sig)
    expected = _expected_call(entry, tokens)
    names = list(tokens)
    positional = wrapper(*tokens.values())
    keyword = wrapper(**tokens)
    mixed = wrapper(*[tokens[n] for n in names[:4]], **{n: tokens[n] for n in names[4:]})
    for call, extra in (positional, keyword, mixed):
        assert call == expected and all(call[r] is t for r, t in expected.items())
        assert extra == {}
    # Only the required arguments: every other role holds the original default object.
    required = [n for n in names if sig.parameters[n].default is P.empty]
    call, _ = wrapper(*[tokens[n] for n in required])
    for name in names[len(required):]:
        assert call[entry.roles[name]] is sig.parameters[name].default


@pytest.mark.parametrize("entry_id", list(ENTRIES))
def test_extra_keywords_go_to_extra_or_are_refused_like_the_original(entry_id):
    entry = ENTRIES[entry_id]
    sig = entry.signature()
    wrapper = _render(match(sig), _capture)
    tokens = _tokens(sig)
    if "extra_kwargs" in entry.roles.values():
        call, extra = wrapper(**tokens, layer_idx=3, s_aux=None)
        assert extra == {"layer_idx": 3, "s_aux": None}
        assert "layer_idx" not in call
    else:  # 4.43 - 4.47 have no **kwargs: an unknown keyword is a TypeError, as with the original
        with pytest.raises(TypeError, match="layer_idx"):
            wrapper(**tokens, layer_idx=3)
        with pytest.raises(TypeError):
            sig.bind(**tokens, layer_idx=3)


@pytest.mark.parametrize("entry_id", list(ENTRIES))
def test_original_kwargs_maps_a_call_back_to_the_live_names(entry_id):
    entry = ENTRIES[entry_id]
    sig = entry.signature()
    m = match(sig)
    wrapper = _render(m, _capture)
    tokens = _tokens(sig)
    extra_in = {"layer_idx": 7} if "extra_kwargs" in entry.roles.values() else {}
    kwargs = codegen.original_kwargs(m, *wrapper(**tokens, **extra_in))
    bound = sig.bind(**kwargs)
    for name, token in tokens.items():
        assert bound.arguments[name] is token
    if extra_in:
        assert bound.arguments["kwargs"] == extra_in
    # A call holding only some roles passes only those names: the original applies its own defaults.
    assert codegen.original_kwargs(m, {"query": 1, "key": 2}, {}) == dict(zip(list(sig.parameters)[:2], (1, 2)))


def _compatible_s7():
    s7 = ENTRIES["S7-5.19.0"].signature()
    params = list(s7.parameters.values())
    scale = 0.5
    added = [P("s_aux", P.POSITIONAL_OR_KEYWORD, default=None), P("alpha", P.KEYWORD_ONLY, default=scale)]
    return s7.replace(parameters=params[:-1] + added + params[-1:])


def test_unknown_parameter_at_default_passes_and_non_default_is_refused_naming_it():
    sig = _compatible_s7()
    m = match(sig)
    assert m.verdict == "compatible" and m.roles["s_aux"] == m.roles["alpha"] == "unknown"
    wrapper = _render(m, _capture)
    assert inspect.signature(wrapper, follow_wrapped=False) == sig
    tokens = _tokens(sig)
    del tokens["s_aux"], tokens["alpha"]
    call, extra = wrapper(**tokens, s_aux=None, alpha=1 / 2)  # equal values, other objects: accepted
    assert "s_aux" not in extra and "unknown" not in call and set(call) == set(ENTRIES["S7-5.19.0"].roles.values()) - {"extra_kwargs"}
    with pytest.raises(UnsupportedArgument) as info:
        wrapper(**tokens, s_aux=object())
    assert info.value.parameter == "s_aux" and isinstance(info.value, ValueError)
    assert "s_aux" in str(info.value) and "hfpatch signatures scan" in str(info.value)
    for bad in (0.25, 1, "0.5"):  # another value, or the same value of another type
        with pytest.raises(UnsupportedArgument, match="alpha"):
            wrapper(**tokens, alpha=bad)
    # Positionally too: s_aux sits at index 22.
    with pytest.raises(UnsupportedArgument, match="s_aux"):
        wrapper(*tokens.values(), "not-none")
    assert "_hfpatch_differs(s_aux, _hfpatch_d22)" in codegen.wrapper_source(wrapper)


def test_source_is_readable_in_linecache_getsource_and_tracebacks():
    sig = ENTRIES["S4-4.48.3"].signature()

    def failing(call, extra):
        raise RuntimeError("handler failed")

    original = _original_with(sig)
    wrapper = _render(match(sig), failing, original=original)
    source = codegen.wrapper_source(wrapper)
    filename = wrapper.__code__.co_filename
    assert "".join(linecache.getlines(filename)) == source
    # inspect.getsource(fn) follows __wrapped__ to the original (Python's rule); the code object is ours.
    assert inspect.getsource(wrapper.__code__) == source
    unwrapped = _render(match(sig), failing)
    assert inspect.getsource(unwrapped) == codegen.wrapper_source(unwrapped)
    assert "query_states,  # query" in source and "target_dtype,  # target_dtype" in source
    with pytest.raises(RuntimeError) as info:
        wrapper(*_tokens(sig).values())
    frames = traceback.extract_tb(info.value.__traceback__)
    ours = [f for f in frames if f.filename == filename]
    assert ours and ours[0].line.startswith("return _hfpatch_handler(")


def test_render_name_and_missing_original():
    sig = ENTRIES["S2-4.44.2"].signature()
    wrapper = _render(match(sig), _capture, name="my_attention")
    assert wrapper.__name__ == wrapper.__qualname__ == "my_attention"
    assert wrapper.__module__ == "transformers.modeling_flash_attention_utils"
    assert not hasattr(wrapper, "__wrapped__")
    plain = _render(match(sig), _capture)
    assert plain.__name__ == "_flash_attention_forward"


def test_render_refuses_what_it_cannot_map():
    s7 = ENTRIES["S7-5.19.0"].signature()
    broken = s7.replace(parameters=[p for p in s7.parameters.values() if p.name != "softcap"])
    with pytest.raises(PatchError, match="unsupported"):
        _render(match(broken), _capture)
    with pytest.raises(TypeError, match="handler"):
        codegen.render(match(s7), None)
    with pytest.raises(TypeError, match="Match"):
        codegen.render(s7, _capture)
    with pytest.raises(ValueError, match="identifier"):
        _render(match(s7), _capture, name="not a name")
    clash = s7.replace(parameters=list(s7.parameters.values())[:-1]
                       + [P("_hfpatch_handler", P.KEYWORD_ONLY, default=None), P("kwargs", P.VAR_KEYWORD)])
    with pytest.raises(PatchError, match="reserved"):
        _render(match(clash), _capture)
    with pytest.raises(TypeError, match="not a wrapper"):
        codegen.wrapper_source(len)


def test_original_kwargs_refuses_collisions_and_extras_without_var_keyword():
    m3 = match(ENTRIES["S3-4.47.1"].signature())
    with pytest.raises(PatchError, match="no \\*\\*kwargs"):
        codegen.original_kwargs(m3, {"query": 1}, {"layer_idx": 0})
    m7 = match(ENTRIES["S7-5.19.0"].signature())
    with pytest.raises(PatchError, match="collide"):
        codegen.original_kwargs(m7, {"query": 1}, {"query_states": 2})


def test_two_renders_with_different_source_get_distinct_filenames():
    a = _render(match(ENTRIES["S7-5.19.0"].signature()), _capture)
    b = _render(match(_compatible_s7()), _capture)
    c = _render(match(ENTRIES["S7-5.19.0"].signature()), _capture)
    assert a.__code__.co_filename == c.__code__.co_filename != b.__code__.co_filename
    assert inspect.getsource(b) == codegen.wrapper_source(b)


def test_wrapper_for_the_installed_transformers_function():
    from transformers import modeling_flash_attention_utils as mfau

    live = mfau._flash_attention_forward
    m = match(inspect.signature(live))
    wrapper = _render(m, _capture, original=live)
    assert inspect.signature(wrapper, follow_wrapped=False) == inspect.signature(live)
    assert wrapper.__wrapped__ is live
    assert (wrapper.__name__, wrapper.__qualname__, wrapper.__module__) == (
        "_flash_attention_forward", live.__qualname__, "transformers.modeling_flash_attention_utils")
    assert wrapper.__defaults__ == live.__defaults__ and all(
        a is b for a, b in zip(wrapper.__defaults__, live.__defaults__))
