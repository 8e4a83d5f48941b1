"""The fingerprint corpus: ``family.canonical_dump`` of every modeling module of the installed transformers,
one 16-hex digest per file, committed for the CI pin so that every Python CI runs (and the GPU machine's) can be
held to the keys Python 3.11 gives.

``python -m tests.mixers._fingerprint_corpus --write`` rewrites ``tests/data/fingerprint_corpus.json`` from the
installed transformers (run it on Python 3.11 when the CI pin moves: tests/mixers/test_fingerprint.py checks there
that the canonical text is ``ast.dump``'s, so the digests are the registry's keys' rule applied to every file).
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import json
import pathlib
import sys

from hfpatch.mixers.family import canonical_dump

# tests/data/ (not through _paths: ``python -m tests.mixers._fingerprint_corpus`` runs without tests/ on sys.path)
CORPUS = pathlib.Path(__file__).resolve().parent.parent / "data" / "fingerprint_corpus.json"


def modeling_files() -> list[pathlib.Path]:
    """Every ``models/*/modeling_*.py`` of the installed transformers, sorted."""
    import transformers

    return sorted(pathlib.Path(transformers.__file__).parent.glob("models/*/modeling_*.py"))


def relative(path: pathlib.Path) -> str:
    return path.relative_to(path.parents[2]).as_posix()  # "models/llama/modeling_llama.py"


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def compute() -> dict[str, str]:
    """{file relative to transformers/: digest of the canonical dump of its whole syntax tree}."""
    return {relative(path): digest(canonical_dump(ast.parse(path.read_text(encoding="utf-8"))))
            for path in modeling_files()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"rewrite {CORPUS.relative_to(CORPUS.parents[2])}")
    args = parser.parse_args(argv)
    import transformers

    record = {"transformers": transformers.__version__,
              "python": f"{sys.version_info.major}.{sys.version_info.minor}", "files": compute()}
    if args.write:
        CORPUS.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
        print(f"wrote {len(record['files'])} digests of transformers {record['transformers']} to {CORPUS}")
    else:
        print(json.dumps(record, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
