"""scripts/link_duplicates.py: a venv's files that another venv holds in the same bytes become hard links to that
copy; nothing else is touched, and the sources are only read."""
from __future__ import annotations

import base64
import hashlib
import os
import subprocess
import sys
from pathlib import Path

from _paths import ROOT

SCRIPT = ROOT / "scripts" / "link_duplicates.py"
BIG = 300 * 1024   # over the script's 256 KiB floor


def _venv(root: Path, files: dict[str, bytes], installed: dict[str, bytes] | None = None) -> Path:
    """A stand-in venv: one distribution whose RECORD lists the given files (sha256 and size, as pip writes them);
    ``installed`` gives what RECORD says a file held, where it has changed since."""
    site = root / "lib" / "python3.11" / "site-packages"
    dist_info = site / "lib_x-1.0.dist-info"
    dist_info.mkdir(parents=True)
    rows = []
    for name, data in files.items():
        path = site / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        recorded = (installed or {}).get(name, data)
        digest = base64.urlsafe_b64encode(hashlib.sha256(recorded).digest()).rstrip(b"=").decode()
        rows.append(f"{name},sha256={digest},{len(recorded)}")
    rows.append("lib_x-1.0.dist-info/RECORD,,")
    (dist_info / "RECORD").write_text("\n".join(rows) + "\n")
    return root


def _run(*args: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True)


def _inode(venv: Path, name: str) -> int:
    return (venv / "lib" / "python3.11" / "site-packages" / name).stat().st_ino


def test_identical_files_become_links_and_nothing_else_changes(tmp_path):
    same, other = os.urandom(BIG), os.urandom(BIG)
    source = _venv(tmp_path / "source", {"lib_x/same.so": same, "lib_x/differs.so": other,
                                         "lib_x/small.py": b"x = 1\n"})
    target = _venv(tmp_path / "target", {"lib_x/same.so": same, "lib_x/differs.so": os.urandom(BIG),
                                         "lib_x/small.py": b"x = 1\n"})
    source_inodes = {name: _inode(source, name) for name in ("lib_x/same.so", "lib_x/differs.so")}
    done = _run(target, source, tmp_path / "not-made-yet")
    assert done.returncode == 0, done.stderr
    assert "1 files linked" in done.stdout
    assert _inode(target, "lib_x/same.so") == source_inodes["lib_x/same.so"]
    assert (target / "lib/python3.11/site-packages/lib_x/same.so").read_bytes() == same
    assert _inode(target, "lib_x/differs.so") != source_inodes["lib_x/differs.so"]   # same size, other bytes
    assert _inode(target, "lib_x/small.py") != _inode(source, "lib_x/small.py")      # under the floor
    assert {name: _inode(source, name) for name in source_inodes} == source_inodes   # the source is only read
    again = _run(target, source)                                                      # idempotent
    assert again.returncode == 0 and "0 files linked" in again.stdout


def test_a_file_changed_since_install_is_not_linked(tmp_path):
    """RECORD's hash is the file as installed: a file whose size on disk differs from RECORD is left alone."""
    data = os.urandom(BIG)
    source = _venv(tmp_path / "source", {"lib_x/lib.so": data})
    target = _venv(tmp_path / "target", {"lib_x/lib.so": data + b"patched"}, installed={"lib_x/lib.so": data})
    assert _run(target, source).returncode == 0
    assert _inode(target, "lib_x/lib.so") != _inode(source, "lib_x/lib.so")


def test_a_target_that_is_not_a_venv_is_named(tmp_path):
    done = _run(tmp_path, tmp_path)
    assert done.returncode != 0
    assert "is not a venv" in done.stderr
