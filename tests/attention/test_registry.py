"""The signature registry: entries, release coverage, and the exact / compatible / unsupported rules."""
from __future__ import annotations

import inspect
from importlib import metadata

import pytest

from hfpatch.errors import SignatureMismatch
from hfpatch.signatures import ROLES, load_registry, match
from hfpatch.signatures import registry
from hfpatch.signatures.registry import SourceDefault, entry_for_version, entry_from_json, require

P = inspect.Parameter
ENTRIES = {e.id: e for e in load_registry()}

# The census (latest patch of every minor, read from the wheels): release -> signature generation.
CENSUS = {
    "4.36.2": None, "4.37.2": None, "4.38.2": None, "4.39.3": None, "4.40.2": None, "4.41.2": None,
    "4.42.4": None, "4.43.4": "S1-4.43.4", "4.44.2": "S2-4.44.2", "4.45.2": "S2-4.44.2",
    "4.46.3": "S2-4.44.2", "4.47.1": "S3-4.47.1", "4.48.3": "S4-4.48.3", "4.49.0": "S4-4.48.3",
    "4.50.3": "S4-4.48.3", "4.51.3": "S4-4.48.3", "4.52.4": "S4-4.48.3", "4.53.3": "S5-4.53.3",
    "4.54.1": "S6-4.54.1", "4.55.4": "S6-4.54.1", "4.56.2": "S6-4.54.1", "4.57.6": "S6-4.54.1",
    **{v: "S5-4.53.3" for v in ["5.0.0", "5.1.0", "5.2.0", "5.3.0", "5.4.0", "5.5.4", "5.6.2", "5.7.0",
                                 "5.8.1", "5.9.0", "5.10.4", "5.11.0", "5.12.1", "5.13.1", "5.14.1",
                                 "5.15.1", "5.16.1", "5.17.0", "5.18.0"]},
    **{v: "S7-5.19.0" for v in ["5.19.0", "5.20.2", "5.21.1", "5.22.2", "5.23.0", "5.24.0"]},
    # Earlier patches of a covered series belong to the same generation.
    "4.43.0": "S1-4.43.4", "4.53.0": "S5-4.53.3", "4.54.0": "S6-4.54.1", "5.0.0rc1": "S5-4.53.3",
}


def _sig(entry_id: str) -> inspect.Signature:
    return ENTRIES[entry_id].signature()


def _edit(sig: inspect.Signature, **changes) -> inspect.Signature:
    """Replace parameters by name (value None deletes) in ``sig``."""
    params = []
    for p in sig.parameters.values():
        if p.name in changes:
            if changes[p.name] is not None:
                params.append(changes[p.name])
        else:
            params.append(p)
    return sig.replace(parameters=params)


def _insert(sig: inspect.Signature, before: str, *new: inspect.Parameter) -> inspect.Signature:
    params = list(sig.parameters.values())
    i = [p.name for p in params].index(before)
    return sig.replace(parameters=params[:i] + list(new) + params[i:])


def test_registry_has_every_generation_in_order():
    assert list(ENTRIES) == ["S1-4.43.4", "S2-4.44.2", "S3-4.47.1", "S4-4.48.3", "S5-4.53.3", "S6-4.54.1", "S7-5.19.0"]
    counts = {e.id: len(e.params) for e in ENTRIES.values()}
    assert counts == {"S1-4.43.4": 12, "S2-4.44.2": 13, "S3-4.47.1": 18, "S4-4.48.3": 19,
                      "S5-4.53.3": 20, "S6-4.54.1": 20, "S7-5.19.0": 23}


@pytest.mark.parametrize("entry_id", list(ENTRIES))
def test_entry_matches_itself_exactly_and_no_other(entry_id):
    entry = ENTRIES[entry_id]
    result = match(entry.signature())
    assert (result.verdict, result.id, result.entry) == ("exact", entry_id, entry)
    assert dict(result.roles) == dict(entry.roles)
    assert result.diff == "" and result.added == ()
    assert set(entry.roles.values()) <= set(ROLES)
    others = [e for e in ENTRIES.values() if e is not entry]
    assert not any(
        len(o.params) == len(entry.params) and all(s.matches(p) for s, p in zip(o.params, entry.signature().parameters.values()))
        for o in others
    )


@pytest.mark.parametrize("version,expected", sorted(CENSUS.items()))
def test_releases_cover_every_census_release_exactly_once(version, expected):
    covering = [e.id for e in ENTRIES.values() if e.covers(version)]
    assert covering == ([] if expected is None else [expected])
    assert (entry_for_version(version).id if expected else entry_for_version(version)) == expected


def test_s5_and_s6_have_the_same_count_and_are_told_apart_by_name():
    s5, s6 = _sig("S5-4.53.3"), _sig("S6-4.54.1")
    assert len(s5.parameters) == len(s6.parameters) == 20
    assert match(s5).id == "S5-4.53.3" and match(s6).id == "S6-4.54.1"
    assert match(s5).roles["attn_implementation"] == "implementation"
    assert match(s6).roles["implementation"] == "implementation"
    assert match(s6, "4.55.4").notes == () and match(s5, "5.10.4").notes == ()
    # The S6 signature on a release recorded as S5: the signature decides, with a remark.
    assert match(s6, "5.10.4").verdict == "exact" and "outside the releases" in match(s6, "5.10.4").notes[0]


# The 4.43 `deterministic` default is environment-dependent: any bool is accepted, nothing else.
@pytest.mark.parametrize(
    "default,verdict",
    [
        (False, "exact"),
        (True, "exact"),
        (SourceDefault('os.environ.get("FLASH_ATTENTION_DETERMINISTIC", "0") == "1"'), "exact"),
        (SourceDefault("os.environ.get('FLASH_ATTENTION_DETERMINISTIC', '0') == '1'"), "exact"),  # quotes
        (SourceDefault('os.environ.get("OTHER", "0") == "1"'), "unsupported"),
        (None, "unsupported"),
        (1, "unsupported"),
    ],
)
def test_s1_deterministic_default(default, verdict):
    sig = _edit(_sig("S1-4.43.4"), deterministic=P("deterministic", P.POSITIONAL_OR_KEYWORD, default=default))
    result = match(sig)
    assert result.verdict == verdict
    if verdict == "unsupported":
        assert "default changed: deterministic" in result.diff


S7 = "S7-5.19.0"
OPT = P.POSITIONAL_OR_KEYWORD
KW = P.KEYWORD_ONLY

# (case, live signature builder, verdict, matched/nearest entry, added names, text the diff must contain)
CASES = [
    ("optional param appended", lambda s: _insert(s, "kwargs", P("s_aux", OPT, default=None)),
     "compatible", S7, ("s_aux",), "only in live: s_aux (index 22"),
    ("optional param in the middle", lambda s: _insert(s, "softmax_scale", P("sinks", OPT, default=None)),
     "compatible", S7, ("sinks",), "moved: softmax_scale: index 8 in S7-5.19.0 -> 9"),
    ("keyword-only optional", lambda s: _insert(s, "kwargs", P("flag", KW, default=False)),
     "compatible", S7, ("flag",), "only in live: flag"),
    ("two added", lambda s: _insert(s, "kwargs", P("a", OPT, default=1), P("b", KW, default="x")),
     "compatible", S7, ("a", "b"), "only in live: b"),
    ("removed param", lambda s: _edit(s, softcap=None), "unsupported", S7, (), "only in S7-5.19.0: softcap (index 11"),
    ("renamed param", lambda s: _edit(s, softcap=P("soft_cap", OPT, default=None)),
     "unsupported", S7, (), "only in live: soft_cap"),
    ("reordered params", lambda s: _edit(s, softmax_scale=P("sliding_window", OPT, default=None),
                                         sliding_window=P("softmax_scale", OPT, default=None)),
     "unsupported", S7, (), "order changed"),
    ("changed default", lambda s: _edit(s, dropout=P("dropout", OPT, default=0.1)),
     "unsupported", S7, (), "default changed: dropout: `0.0` in S7-5.19.0, `0.1` in live"),
    ("default of another type", lambda s: _edit(s, dropout=P("dropout", OPT, default=0)),
     "unsupported", S7, (), "default changed: dropout"),
    ("default removed", lambda s: s.replace(parameters=[P(p.name, p.kind) if p.name == "dropout" else p
                                                     for p in list(s.parameters.values())[:7]]),
     "unsupported", "S1-4.43.4", (), "default changed: dropout: `0.0` in S1-4.43.4, `required` in live"),
    ("new required keyword-only", lambda s: _insert(s, "kwargs", P("layer_idx", KW)),
     "unsupported", S7, (), "only in live: layer_idx (index 22, keyword-only, required)"),
    ("added *args", lambda s: _insert(s, "kwargs", P("args", P.VAR_POSITIONAL)),
     "unsupported", S7, (), "only in live: args"),
    ("kind changed", lambda s: s.replace(parameters=[P(p.name, P.POSITIONAL_ONLY) if p.name == "query_states" else p
                                                  for p in s.parameters.values()]),
     "unsupported", S7, (), "kind changed: query_states"),
    # Without **kwargs, S7 is S3 plus four optional parameters: compatible with S3 (and guarded).
    ("**kwargs removed", lambda s: _edit(s, kwargs=None), "compatible", "S3-4.47.1",
     ("attn_implementation", "block_table", "k_cache", "v_cache"), "only in live: v_cache (index 21"),
]


@pytest.mark.parametrize("case,build,verdict,entry_id,added,text", CASES, ids=[c[0] for c in CASES])
def test_compatibility_table(case, build, verdict, entry_id, added, text):
    live = build(_sig(S7))
    result = match(live, "5.99.0")
    assert result.verdict == verdict
    assert result.entry.id == entry_id
    assert result.id == f"{entry_id}+{verdict}"
    assert result.added == added
    assert text in result.diff, result.diff
    # Both full definitions are in the diff.
    assert result.diff.splitlines()[0].startswith("live (transformers 5.99.0):")
    assert f"registry {entry_id}:" in result.diff.splitlines()[1]
    for name in added:
        assert result.roles[name] == "unknown"
    if verdict == "compatible":
        assert {n: r for n, r in result.roles.items() if n not in added} == dict(ENTRIES[entry_id].roles)


def test_compatible_picks_the_entry_needing_fewest_additions():
    # S4 + one optional param is compatible with S4 (1 addition), not with S3 (2 additions: **kwargs is not
    # allowed as an addition anyway).
    live = _insert(_sig("S4-4.48.3"), "kwargs", P("layer_idx", OPT, default=None))
    result = match(live)
    assert (result.verdict, result.entry.id, result.added) == ("compatible", "S4-4.48.3", ("layer_idx",))


def test_unsupported_nearest_entry_and_the_real_transitions():
    # 4.43 -> 4.44 changed the deterministic default and inserted position_ids: unsupported vs S1.
    s2 = _sig("S2-4.44.2")
    result = match(s2.replace(parameters=[p for p in s2.parameters.values()]))
    assert result.id == "S2-4.44.2"
    without_s2 = [e for e in ENTRIES.values() if e.id != "S2-4.44.2"]
    near = registry.nearest(without_s2, list(s2.parameters.values()), None)
    assert near.id in ("S1-4.43.4", "S3-4.47.1")
    diff = registry.render_diff(ENTRIES["S1-4.43.4"], s2)
    assert "only in live: position_ids (index 7" in diff
    assert "moved: softmax_scale: index 7 in S1-4.43.4 -> 8 in live" in diff
    assert "default changed: deterministic" in diff


def test_require_raises_signature_mismatch_with_fields_and_fix():
    live = _edit(_sig(S7), softcap=P("soft_cap", OPT, default=None))
    with pytest.raises(SignatureMismatch) as info:
        require(live, "5.99.0")
    err = info.value
    assert isinstance(err, TypeError)
    assert (err.transformers_version, err.expected) == ("5.99.0", S7)
    assert "soft_cap=None" in err.found and "only in live: soft_cap" in err.diff
    assert "pin transformers to a supported release" in str(err) and "'<5.25.0,>=5.19.0'" in str(err)
    assert "hfpatch signatures scan" in str(err)
    assert require(_sig(S7), "5.24.0").verdict == "exact"


def test_match_rejects_non_signatures_and_accepts_callables():
    with pytest.raises(TypeError, match="inspect.Signature"):
        match("query_states, key_states")

    def f(query_states, key_states, value_states, attention_mask, query_length, is_causal, dropout=0.0,
          softmax_scale=None, sliding_window=None, use_top_left_mask=False, softcap=None, deterministic=False):
        pass

    assert match(f).id == "S1-4.43.4"


def test_installed_transformers_matches_its_recorded_entry_exactly():
    from transformers import modeling_flash_attention_utils as mfau

    version = metadata.version("transformers")
    expected = entry_for_version(version)
    assert expected is not None, f"installed transformers {version} is not covered by the registry"
    result = require(inspect.signature(mfau._flash_attention_forward), version)
    assert (result.verdict, result.id) == ("exact", expected.id)
    if ENTRIES[S7].covers(version):  # the pinned dev environment (5.24.0)
        assert result.id == S7


@pytest.mark.parametrize(
    "mutate,message",
    [
        (lambda d: d.update(format=2), "format 2"),
        (lambda d: d.update(id="S?-5.19.0"), "id 'S\\?-5.19.0' must look like"),
        (lambda d: d.update(releases="4.43"), "packaging specifier"),
        (lambda d: d["params"][0].update(role="querry"), "role 'querry'"),
        (lambda d: d["params"][1].update(role="query"), "roles ['query']"),
        (lambda d: d["params"][0].update(kind="POSITIONAL"), "kind 'POSITIONAL'"),
        (lambda d: d["params"][6]["default"].pop("value"), "needs 'value'"),
        (lambda d: d["params"].insert(0, d["params"].pop(6)), "non-default"),
    ],
)
def test_malformed_entry_files_are_refused(mutate, message):
    data = ENTRIES[S7].to_json()
    mutate(data)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        entry_from_json(data, origin="test.json")


@pytest.mark.parametrize("entry_id", list(ENTRIES))
def test_json_round_trip(entry_id):
    entry = ENTRIES[entry_id]
    again = entry_from_json(entry.to_json())
    assert again == entry
