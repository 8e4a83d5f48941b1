"""The static release scanner and ``hfpatch signatures scan`` / ``static_check``, on synthetic releases
(small wheels and source trees written here: no network, no real transformers release)."""
from __future__ import annotations

import inspect
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from hfpatch.release import scan as scan_mod
from hfpatch.cli import main
from hfpatch.cli.static_check import static_check
from hfpatch.errors import InvalidReleaseSpec, ScanError, WheelFetchError
from hfpatch.release.scan import scan_source, scan_version, scan_wheel
from hfpatch.signatures import load_registry
from hfpatch.signatures.registry import SourceDefault, entry_from_json

ENTRIES = {e.id: e for e in load_registry()}
P = inspect.Parameter


def def_source(entry_id: str, *, rename: dict[str, str] | None = None) -> str:
    """The module text of modeling_flash_attention_utils.py defining the entry's signature as HF writes it."""
    rename = rename or {}
    lines = ["import os", "from typing import Optional", "import torch", "", "", "def _flash_attention_forward("]
    for p in ENTRIES[entry_id].params:
        name = rename.get(p.name, p.name)
        if p.kind is P.VAR_KEYWORD:
            lines.append(f"    **{name},")
            continue
        text = name + (f": {p.annotation}" if p.annotation else "")
        lines.append(f"    {text} = {p.default.source}," if p.default else f"    {text},")
    lines += ["):", "    raise NotImplementedError", ""]
    return "\n".join(lines)


MODELS = {
    # module-level, relative import
    "transformers/integrations/flash_attention.py":
        "from ..modeling_flash_attention_utils import _flash_attention_forward\n",
    # under a module-level if
    "transformers/models/llama/modeling_llama.py":
        "from ...utils import is_flash_attn_2_available\n"
        "if is_flash_attn_2_available():\n"
        "    from ...modeling_flash_attention_utils import _flash_attention_forward\n",
    # absolute and aliased
    "transformers/models/falcon/modeling_falcon.py":
        "from transformers.modeling_flash_attention_utils import _flash_attention_forward as _faf\n",
    # inside a function
    "transformers/models/gptj/modeling_gptj.py":
        "def attend():\n    from ...modeling_flash_attention_utils import _flash_attention_forward\n",
    # a package __init__ (relative level counted from the package itself)
    "transformers/models/__init__.py": "from ..modeling_flash_attention_utils import _flash_attention_forward\n",
    # mentions but does not bind it: another module's function, a module import, a comment
    "transformers/models/other/modeling_other.py":
        "from .helpers import _flash_attention_forward\n"
        "from ... import modeling_flash_attention_utils  # _flash_attention_forward via attribute\n",
}
EXPECTED_SITES = [
    ("transformers.integrations.flash_attention", "_flash_attention_forward", "module"),
    ("transformers.models", "_flash_attention_forward", "module"),
    ("transformers.models.falcon.modeling_falcon", "_faf", "module"),
    ("transformers.models.gptj.modeling_gptj", "_flash_attention_forward", "function attend"),
    ("transformers.models.llama.modeling_llama", "_flash_attention_forward", "module (conditional)"),
]

INTERFACES = {
    "class": (
        "class GeneralInterface:\n    pass\n\n"
        "class AttentionInterface(GeneralInterface):\n"
        "    _global_mapping = {\n"
        '        "flash_attention_3": flash_attention_forward,\n'
        '        "flash_attention_2": flash_attention_forward,\n'
        '        "sdpa": sdpa_attention_forward,\n'
        '        "paged|flash_attention_2": paged_attention_forward,\n'
        "    }\n",
        "AttentionInterface class", ("flash_attention_3", "flash_attention_2", "sdpa", "paged|flash_attention_2"),
        ("flash_attention_3", "flash_attention_2"),
    ),
    "plain dict": (
        "ALL_ATTENTION_FUNCTIONS = {}\n"
        'ALL_ATTENTION_FUNCTIONS.update({"flash_attention_2": flash_attention_forward, "sdpa": sdpa_attention_forward})\n',
        "plain dict", ("flash_attention_2", "sdpa"), ("flash_attention_2",),
    ),
    "none": ("def unrelated():\n    pass\n", "none", (), ()),
}


def release_files(version: str, mfau: str | None, *, interface: str = "class", extra: dict | None = None) -> dict:
    files = {"transformers/__init__.py": f'__version__ = "{version}"\n', "transformers/utils/__init__.py": ""}
    if mfau is not None:
        files["transformers/modeling_flash_attention_utils.py"] = mfau
    files["transformers/modeling_utils.py"] = INTERFACES[interface][0]
    files.update(MODELS)
    files.update(extra or {})
    return files


def make_wheel(directory: Path, version: str, files: dict[str, str], *, name: str = "transformers") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for rel, text in files.items():
            zf.writestr(rel, text)
        zf.writestr(f"{name}-{version}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return path


def make_tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        target = root / "src" / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    return root


PRE_443_MODEL = (
    "class LlamaFlashAttention2:\n"
    "    def _flash_attention_forward(self, query_states, key_states, value_states, attention_mask,\n"
    "                                 query_length, dropout=0.0, softmax_scale=None):\n"
    "        pass\n"
)


# --------------------------------------------------------------------------------------------- scanner


@pytest.mark.parametrize("entry_id", list(ENTRIES))
def test_scan_reads_every_generation_and_proposes_the_same_entry(tmp_path, entry_id):
    entry = ENTRIES[entry_id]
    version = entry.scanned_in[0]
    result = scan_wheel(make_wheel(tmp_path, version, release_files(version, def_source(entry_id))))
    assert result.version == version
    found = result.match()
    assert (found.verdict, found.id) == ("exact", entry_id)
    proposal = result.to_registry_entry(entry_id=entry_id, releases=str(entry.releases))
    again = entry_from_json(proposal)
    assert again.params == entry.params and again.releases == entry.releases and again.scanned_in == (version,)
    # Defaults: literals evaluated, the rest kept as source text.
    for spec in entry.params:
        if spec.default is not None:
            assert result.default_sources[spec.name] == spec.default.source
    if entry_id == "S1-4.43.4":
        assert isinstance(result.signature.parameters["deterministic"].default, SourceDefault)
        assert proposal["params"][11]["default"]["one_of"] == [False, True]
    else:
        assert result.signature.parameters["dropout"].default == 0.0


def test_binding_sites_by_from_import_only(tmp_path):
    result = scan_wheel(make_wheel(tmp_path, "5.23.0", release_files("5.23.0", def_source("S7-5.19.0"))))
    assert [(s.module, s.bound_as, s.scope) for s in result.binding_sites] == EXPECTED_SITES
    assert result.binding_modules == tuple(sorted(m for m, _, _ in EXPECTED_SITES))
    assert all(site.line >= 1 for site in result.binding_sites)
    assert result.class_methods == ()


def test_a_module_that_binds_twice_is_two_sites_and_one_module(tmp_path):
    """transformers 4.46.3's models/glm/modeling_glm.py binds the function twice: under
    ``if is_flash_attn_2_available():`` (line 52) and again unconditionally (line 54). Both are sites; the module
    counts once: 4.46.3 has 56 sites in 55 modules (the census's "56 modules" counted import statements)."""
    importer = "from ...modeling_flash_attention_utils import _flash_attention_forward\n"
    glm = f"if is_flash_attn_2_available():\n    {importer}\n{importer}"
    extra = {"transformers/models/glm/__init__.py": "", "transformers/models/glm/modeling_glm.py": glm}
    result = scan_wheel(make_wheel(tmp_path, "4.46.3", release_files("4.46.3", def_source("S2-4.44.2"), extra=extra)))
    module = "transformers.models.glm.modeling_glm"
    assert [(s.scope, s.line) for s in result.binding_sites if s.module == module] == [
        ("module (conditional)", 2), ("module", 4)]
    assert result.binding_modules.count(module) == 1
    assert len(result.binding_sites) == len(EXPECTED_SITES) + 2
    assert len(result.binding_modules) == len({m for m, _, _ in EXPECTED_SITES}) + 1


@pytest.mark.parametrize("interface", list(INTERFACES))
def test_attention_interface_kind_and_keys(tmp_path, interface):
    _, kind, keys, flash = INTERFACES[interface]
    files = release_files("5.23.0", def_source("S7-5.19.0"), interface=interface)
    result = scan_wheel(make_wheel(tmp_path, "5.23.0", files))
    assert (result.attention_interface_kind, result.attention_interface.keys, result.flash_keys) == (kind, keys, flash)


def test_source_tree_reads_like_the_wheel(tmp_path):
    files = release_files("5.23.0", def_source("S7-5.19.0"))
    from_wheel = scan_wheel(make_wheel(tmp_path / "w", "5.23.0", files)).to_json()
    for root in (tmp_path / "t", tmp_path / "t" / "src", tmp_path / "t" / "src" / "transformers"):
        make_tree(tmp_path / "t", files)
        from_tree = scan_source(root).to_json()
        assert {k: v for k, v in from_tree.items() if k != "origin"} == {
            k: v for k, v in from_wheel.items() if k != "origin"}


def test_pre_443_release_has_class_methods_and_no_entry(tmp_path):
    files = release_files("4.42.4", None, interface="none", extra={"transformers/models/llama/modeling_llama.py": PRE_443_MODEL})
    result = scan_wheel(make_wheel(tmp_path, "4.42.4", files))
    assert result.signature is None and result.match() is None
    assert [(m.module, m.class_name, m.params) for m in result.class_methods] == [(
        "transformers.models.llama.modeling_llama", "LlamaFlashAttention2",
        ("query_states", "key_states", "value_states", "attention_mask", "query_length", "dropout", "softmax_scale"))]
    with pytest.raises(ScanError, match="per-class methods only"):
        result.to_registry_entry()


def _not_a_zip(tmp_path):
    path = tmp_path / "transformers-1.0-py3-none-any.whl"
    path.write_text("not a zip")
    return path


@pytest.mark.parametrize(
    "build,message",
    [
        (lambda t: t / "missing.whl", "no such file"),
        (_not_a_zip, "not a zip archive"),
        (lambda t: make_wheel(t, "1.0", {"torch/__init__.py": ""}, name="torch"), "not a transformers wheel"),
        (lambda t: make_wheel(t, "5.0.0", release_files("5.0.0", "def _flash_attention_forward(:\n")), "does not parse"),
    ],
)
def test_bad_wheels_raise_scan_error(tmp_path, build, message):
    with pytest.raises(ScanError, match=message) as info:
        scan_wheel(build(tmp_path))
    assert isinstance(info.value, ValueError)


def test_bad_source_dirs_raise_scan_error(tmp_path):
    with pytest.raises(ScanError, match="no such directory"):
        scan_source(tmp_path / "nope")
    with pytest.raises(ScanError, match="holds no transformers package"):
        scan_source(tmp_path)


# ------------------------------------------------------------------------------------ fetching (no net)


class FakePip:
    """Stands in for ``subprocess.run([... pip download ...])``: writes ``wheel_files`` into --dest, or fails."""

    def __init__(self, wheel_files: dict | None = None, stderr: str = "") -> None:
        self.wheel_files, self.stderr, self.calls = wheel_files, stderr, []

    def __call__(self, cmd, **kwargs):
        self.calls.append(cmd)
        if self.wheel_files is None:
            return subprocess.CompletedProcess(cmd, 1, "", self.stderr)
        dest = Path(cmd[cmd.index("--dest") + 1])
        version = cmd[-1].split("==")[1]
        make_wheel(dest, version, self.wheel_files)
        return subprocess.CompletedProcess(cmd, 0, "", "")


def test_scan_version_downloads_once_into_the_cache(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("HFPATCH_WHEEL_CACHE", str(cache))
    pip = FakePip(release_files("5.23.0", def_source("S7-5.19.0")))
    monkeypatch.setattr(scan_mod.subprocess, "run", pip)
    assert scan_version("5.23.0").match().id == "S7-5.19.0"
    assert scan_version("5.23").match().id == "S7-5.19.0"  # same release, from the cache
    assert len(pip.calls) == 1 and "--no-deps" in pip.calls[0] and pip.calls[0][-1] == "transformers==5.23.0"
    assert [p.name for p in cache.iterdir()] == ["transformers-5.23.0-py3-none-any.whl"]


@pytest.mark.parametrize(
    "stderr,message",
    [
        ("ERROR: No matching distribution found for transformers==9.9.9", "not a release on the package index"),
        ("WARNING: Retrying ... NewConnectionError", "no network"),
    ],
)
def test_scan_version_failures_write_nothing(tmp_path, monkeypatch, stderr, message):
    cache = tmp_path / "cache"
    monkeypatch.setattr(scan_mod.subprocess, "run", FakePip(None, stderr))
    with pytest.raises(WheelFetchError, match=message) as info:
        scan_version("9.9.9", cache_dir=cache)
    assert info.value.version == "9.9.9" and stderr in info.value.pip_output
    assert not cache.exists()
    with pytest.raises(InvalidReleaseSpec, match="'five' is not a valid version"):
        scan_version("five", cache_dir=cache)


def test_static_check(tmp_path, monkeypatch):
    monkeypatch.setattr(scan_mod.subprocess, "run", FakePip(None, "no network"))  # proves nothing is fetched
    old = static_check("4.36.2", cache_dir=tmp_path)
    assert (old["supported"], old["verdict"], old["signature_id"]) == (False, "unsupported", None)
    assert "upgrade to >= 4.43" in old["message"]
    make_wheel(tmp_path, "5.23.0", release_files("5.23.0", def_source("S7-5.19.0")))
    new = static_check("5.23.0", cache_dir=tmp_path)
    assert (new["supported"], new["verdict"], new["signature_id"], new["expected_id"]) == (True, "exact", "S7-5.19.0", "S7-5.19.0")
    assert new["binding_modules"] == sorted(m for m, _, _ in EXPECTED_SITES)
    assert new["attention_interface"]["flash_keys"] == ["flash_attention_3", "flash_attention_2"]
    json.dumps(new)
    # A release the registry records as S5 whose wheel reads as something else: unsupported, with a diff.
    make_wheel(tmp_path, "5.10.0", release_files("5.10.0", def_source("S5-4.53.3", rename={"softcap": "soft_cap"})))
    broken = static_check("5.10.0", cache_dir=tmp_path)
    assert (broken["supported"], broken["verdict"], broken["expected_id"]) == (False, "unsupported", "S5-4.53.3")
    assert "only in live: soft_cap" in broken["diff"]
    with pytest.raises(WheelFetchError):
        static_check("5.99.0", cache_dir=tmp_path)
    with pytest.raises(InvalidReleaseSpec, match="--transformers"):
        static_check("latest", cache_dir=tmp_path)


# ------------------------------------------------------------------------------------------------- CLI


def _scan_cli(capsys, *args):
    code = main(["signatures", "scan", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_exit_codes_and_output(tmp_path, capsys):
    exact = make_wheel(tmp_path / "a", "4.54.1", release_files("4.54.1", def_source("S6-4.54.1")))
    code, out, err = _scan_cli(capsys, "--wheel", exact)
    assert code == 0 and "verdict: exact  signature: S6-4.54.1" in out and err == ""
    assert "transformers.models.falcon.modeling_falcon" in out and "flash keys: flash_attention_3, flash_attention_2" in out
    assert "proposed registry entry" not in out

    code, out, _ = _scan_cli(capsys, "--wheel", exact, "--json")
    report = json.loads(out)
    assert code == 0 and (report["verdict"], report["signature_id"]) == ("exact", "S6-4.54.1")
    assert report["scan"]["binding_modules"] == sorted(m for m, _, _ in EXPECTED_SITES)

    added = def_source("S7-5.19.0").replace("    **kwargs,", "    s_aux: torch.Tensor | None = None,\n    **kwargs,")
    compatible = make_wheel(tmp_path / "b", "5.30.0", release_files("5.30.0", added))
    code, out, _ = _scan_cli(capsys, "--wheel", compatible)
    assert code == 0 and "verdict: compatible  signature: S7-5.19.0+compatible" in out
    assert "only in live: s_aux" in out and '"role": "unknown"' in out  # the proposal marks it for a human

    renamed = make_wheel(tmp_path / "c", "5.31.0", release_files("5.31.0", def_source("S7-5.19.0", rename={"softcap": "soft_cap"})))
    code, out, _ = _scan_cli(capsys, "--wheel", renamed)
    assert code == 1 and "verdict: unsupported" in out and "only in S7-5.19.0: softcap" in out
    assert "proposed registry entry" in out

    old = make_wheel(tmp_path / "d", "4.42.4", release_files("4.42.4", None, extra={
        "transformers/models/llama/modeling_llama.py": PRE_443_MODEL}))
    code, out, _ = _scan_cli(capsys, "--source", make_tree(tmp_path / "tree", release_files("4.42.4", None)))
    assert code == 1 and "upgrade to >= 4.43" in out
    code, out, _ = _scan_cli(capsys, "--wheel", old)
    assert code == 1 and "1 per-class methods" in out


@pytest.mark.parametrize(
    "args,message",
    [
        (["--wheel", "{tmp}/missing.whl"], "no such file"),
        (["--wheel", "{tmp}/bad.whl"], "not a zip archive"),
        (["--source", "{tmp}"], "holds no transformers package"),
        (["--version", "five"], "'five' is not a valid version"),
        (["--version", "9.9.9"], "not a release on the package index"),
        (["--wheel", "{tmp}/bad.whl", "--write", "--releases", "~~"], "not a packaging specifier"),
    ],
)
def test_cli_bad_input_exits_2_and_writes_nothing(tmp_path, capsys, monkeypatch, args, message):
    (tmp_path / "bad.whl").write_text("not a zip")
    cache = tmp_path / "cache"
    monkeypatch.setenv("HFPATCH_WHEEL_CACHE", str(cache))
    monkeypatch.setattr(scan_mod.subprocess, "run", FakePip(None, "No matching distribution found"))
    registry_dir = tmp_path / "registry"
    code, out, err = _scan_cli(capsys, *[a.format(tmp=tmp_path) for a in args], "--registry-dir", registry_dir)
    assert code == 2 and out == "" and message in err
    assert not cache.exists() and not registry_dir.exists()


def test_cli_write(tmp_path, capsys):
    registry_dir = tmp_path / "registry"
    renamed = make_wheel(tmp_path, "5.31.0", release_files("5.31.0", def_source("S7-5.19.0", rename={"softcap": "soft_cap"})))
    added = def_source("S7-5.19.0").replace("    **kwargs,", "    layer_idx: int | None = None,\n    **kwargs,")
    new_gen = make_wheel(tmp_path / "n", "5.32.0", release_files("5.32.0", added))
    # A new generation without --id, or with a parameter of unknown role: refused, nothing written.
    assert _scan_cli(capsys, "--wheel", new_gen, "--write", "--registry-dir", registry_dir)[0] == 1
    code, _, err = _scan_cli(capsys, "--wheel", renamed, "--write", "--id", "S8-5.31.0", "--registry-dir", registry_dir)
    assert code == 1 and "no known role" in err and "soft_cap" in err
    assert not registry_dir.exists()
    # layer_idx has no role either: still refused.
    code, _, err = _scan_cli(capsys, "--wheel", new_gen, "--write", "--id", "S8-5.32.0", "--registry-dir", registry_dir)
    assert code == 1 and "layer_idx" in err
    # A release of a known generation: recorded in that entry's scanned_in (written to the given folder).
    exact = make_wheel(tmp_path / "e", "5.20.0", release_files("5.20.0", def_source("S7-5.19.0")))
    code, out, _ = _scan_cli(capsys, "--wheel", exact, "--write", "--releases", ">=5.19.0,<5.25.0", "--registry-dir", registry_dir)
    written = json.loads((registry_dir / "S7-5.19.0.json").read_text())
    assert code == 0 and "written:" in out
    scanned_in = sorted({*ENTRIES["S7-5.19.0"].scanned_in, "5.20.0"}, key=lambda v: tuple(map(int, v.split("."))))
    assert written["releases"] == ">=5.19.0,<5.25.0" and written["scanned_in"] == scanned_in
    assert entry_from_json(written).params == ENTRIES["S7-5.19.0"].params
    # A genuinely new generation whose parameters all have known roles (S7 minus the paged-cache params,
    # read as new because nothing in the registry equals it): written as <ID>.json and loadable.
    trimmed = def_source("S7-5.19.0").replace("    block_table: torch.Tensor | None = None,\n", "")
    trimmed_wheel = make_wheel(tmp_path / "t", "5.40.0", release_files("5.40.0", trimmed))
    code, out, _ = _scan_cli(capsys, "--wheel", trimmed_wheel, "--write", "--id", "S8-5.40.0",
                             "--releases", "==5.40.*", "--registry-dir", registry_dir)
    assert code == 0
    entry = entry_from_json(json.loads((registry_dir / "S8-5.40.0.json").read_text()))
    assert entry.id == "S8-5.40.0" and "block_table" not in entry.roles and entry.covers("5.40.1")


def test_cli_entry_point_runs_as_a_module(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "hfpatch", "signatures", "scan", "--wheel", str(tmp_path / "x.whl")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "no such file" in proc.stderr


def test_cli_signatures_without_action_prints_help_and_exits_2(capsys):
    assert main(["signatures"]) == 2
    assert "scan" in capsys.readouterr().out
