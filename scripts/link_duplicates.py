"""Hard-link the files a new venv holds in the same bytes as a venv CI made before it.

Why: CI makes seven torch venvs (the CI venv, the torch axis's, the 3.13 root's) on a disk it shares with other
jobs. PyPI's torch is a CUDA build whose NVIDIA libraries are 3-4 GB a venv, and neighbouring releases pin the same
ones (2.9.1 and 2.10.0 all but one; the cu13 releases most of theirs; the 3.13 root the CI venv's, whose wheels are
Python-independent). Linked, the venvs take 13 GB less (docs/ci.md). scripts/torch_release.sh and
scripts/python313.sh call this at the end of each setup.

How: pip records each installed file's sha256 and size in its distribution's RECORD. A file of the TARGET venv
whose (sha256, size) a SOURCE venv's RECORD lists, at that size on disk, is replaced by a hard link to the source's
file (``os.link`` to a temporary name beside it, then ``os.replace``: the file is never missing). Only the target is
written; the sources are read, so a source that another setup is still installing is safe. Installed files are never
written in place (Python writes bytecode beside them; pip's uninstall removes them), so the link stays correct.

Usage: ``python3 scripts/link_duplicates.py TARGET_VENV [SOURCE_VENV ...]``: a source that does not exist yet is
skipped; files under 256 KiB are left alone (they are most of the count and little of the bytes). Prints what it
linked.
"""
from __future__ import annotations

import csv
import os
import sys
from pathlib import Path

MIN_SIZE = 256 * 1024


def _site_packages(venv: Path) -> list[Path]:
    return sorted(venv.glob("lib/python3*/site-packages"))


def installed_files(venv: Path) -> dict[tuple[str, int], Path]:
    """{(sha256 in RECORD's encoding, size): path} for the venv's files of at least MIN_SIZE bytes that RECORD
    lists with a hash and a size, and that are on disk at that size."""
    files: dict[tuple[str, int], Path] = {}
    for site in _site_packages(venv):
        for record in site.glob("*.dist-info/RECORD"):
            with record.open(newline="") as handle:
                for row in csv.reader(handle):
                    if len(row) != 3 or not row[1].startswith("sha256=") or not row[2].isdigit():
                        continue
                    size = int(row[2])
                    if size < MIN_SIZE:
                        continue
                    path = site / row[0]
                    try:
                        on_disk = path.lstat()
                    except FileNotFoundError:
                        continue
                    if on_disk.st_size == size and path.is_file() and not path.is_symlink():
                        files.setdefault((row[1], size), path)
    return files


def link_duplicates(target: Path, sources: list[Path]) -> tuple[int, int]:
    """Replace the target's files that a source holds in the same bytes by hard links; returns (files, bytes)."""
    wanted = installed_files(target)
    linked = saved = 0
    for source in sources:
        if not source.is_dir() or source.resolve() == target.resolve():
            continue
        for key, source_path in installed_files(source).items():
            target_path = wanted.get(key)
            if target_path is None:
                continue
            if target_path.stat().st_ino == source_path.stat().st_ino:
                del wanted[key]
                continue
            temporary = target_path.with_name(target_path.name + ".link-duplicates")
            try:
                os.link(source_path, temporary)
            except FileNotFoundError:   # the source's setup removed it meanwhile
                continue
            os.replace(temporary, target_path)
            del wanted[key]
            linked += 1
            saved += key[1]
    return linked, saved


def main(argv: list[str]) -> int:
    if not argv:
        raise SystemExit("usage: link_duplicates.py TARGET_VENV [SOURCE_VENV ...]")
    target = Path(argv[0])
    if not _site_packages(target):
        raise SystemExit(f"link_duplicates: {target} is not a venv (no lib/python3*/site-packages)")
    linked, saved = link_duplicates(target, [Path(arg) for arg in argv[1:]])
    print(f"link_duplicates: {target}: {linked} files linked to other venvs' copies, {saved / 1e9:.1f} GB freed")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
