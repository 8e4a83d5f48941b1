"""Remove the top-level ``tests`` package that openrlhf's wheel installs beside itself (its own test suite): it would
shadow this repository's tests/ (``from tests import ...``). Removed only when openrlhf's RECORD lists it."""
from __future__ import annotations

import shutil
import sysconfig
from importlib import metadata
from pathlib import Path


def main() -> None:
    try:
        files = metadata.distribution("openrlhf").files or []
    except metadata.PackageNotFoundError:
        return
    if any(str(f) == "tests/__init__.py" for f in files):
        stray = Path(sysconfig.get_paths()["purelib"]) / "tests"
        if stray.is_dir():
            shutil.rmtree(stray)
            print(f"removed openrlhf's top-level tests package: {stray}")


if __name__ == "__main__":
    main()
