"""Let a tox env use a torch CI has already installed in a venv (the CI venv's, or a torch venv of the torch axis),
instead of installing it again.

Why: torch is several GB (the CUDA build PyPI serves); nine tox envs reinstalling it would cost minutes each and
disk. Each tox env only needs its own *transformers* (and that release's tokenizers / huggingface_hub pins); its
torch is one of the venvs CI already made for the torch axis (tox.ini names which, docs/ci.md says why).

How: this script runs with the tox env's interpreter as tox's ``install_command`` (so it runs before any
dependency is installed, and again before each later install; it is idempotent). It asks the interpreter
that owns torch (``HFPATCH_TORCH_PYTHON``, default ``<repo>/.venv/bin/python``) for the files of torch and
of its runtime requirements, symlinks them into ``<envdir>/shared-torch/``, and writes a ``.pth`` file
into the env's site-packages naming that folder. ``site`` appends ``.pth`` folders AFTER the env's own
site-packages, so everything the env installs itself (transformers, tokenizers, huggingface_hub, ...)
wins over anything shared, and only torch's closure is shared -- never the parent's transformers.
pip, run afterwards in the env, sees torch's ``.dist-info`` through the same folder and therefore treats
hfpatch's ``torch`` requirement as satisfied: it installs nothing torch-related.
Distributions the env already has (pip, setuptools, ...) are never shadowed.

Usage (tox.ini): ``install_command = python {toxinidir}/.ci/share_torch.py {envdir} -- {opts} {packages}``;
everything after ``--`` is passed to ``python -m pip install``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from importlib import metadata
from pathlib import Path

_PTH_NAME = "_hfpatch_shared_torch.pth"

# Runs in the interpreter that owns torch: prints {dist name: [top-level paths]} for torch's closure.
_CLOSURE_PROBE = r"""
import json, re
from importlib import metadata
from pathlib import Path
try:
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.requirements import Requirement

def norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()

def wanted(req, extras):
    # A requirement is part of the closure when its marker holds on this machine, for no extra or for an extra the
    # parent asked for (torch asks for cuda-toolkit[cublas,cudart,...]: its NVIDIA libraries are such extras).
    if req.marker is None:
        return True
    return any(req.marker.evaluate({"extra": extra}) for extra in ("", *extras))

def closure(root):
    todo, seen, asked = [(root, ())], {}, {}
    while todo:
        name, extras = todo.pop()
        key = norm(name)
        new_extras = set(extras) - asked.get(key, set())
        if key in seen and not new_extras:
            continue
        asked.setdefault(key, set()).update(extras)
        try:
            dist = seen.get(key) or metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        seen[key] = dist
        for line in dist.requires or []:
            req = Requirement(line)
            if wanted(req, asked[key]):
                todo.append((req.name, tuple(sorted(req.extras))))
    return seen

out = {}
for key, dist in closure("torch").items():
    base = Path(dist.locate_file(""))
    tops = set()
    for f in dist.files or []:
        first = f.parts[0]
        if first in ("..", "__pycache__") or first.endswith(".pth"):
            continue
        tops.add(str(base / first))
    out[key] = sorted(tops)
print(json.dumps(out))
"""


def _norm(name: str) -> str:
    import re

    return re.sub(r"[-_.]+", "-", name).lower()


def _env_distributions(site_packages: Path) -> set[str]:
    """Normalized names of the distributions installed in the env itself (not via the shared folder)."""
    return {_norm(d.metadata["Name"]) for d in metadata.distributions(path=[str(site_packages)]) if d.metadata["Name"]}


def link_shared_torch(envdir: Path, torch_python: str) -> Path:
    """Create ``envdir/shared-torch`` (symlinks to torch's closure) and the ``.pth`` naming it."""
    site_packages = Path(sysconfig.get_paths()["purelib"])
    probe = subprocess.run([torch_python, "-c", _CLOSURE_PROBE], capture_output=True, text=True)
    if probe.returncode != 0 or not probe.stdout.strip():
        raise SystemExit(
            f"share_torch: cannot list torch's files with {torch_python!r} (set HFPATCH_TORCH_PYTHON to an "
            f"interpreter that has torch installed):\n{probe.stderr[-2000:]}"
        )
    closure: dict[str, list[str]] = json.loads(probe.stdout)
    if "torch" not in closure:
        raise SystemExit(f"share_torch: {torch_python!r} has no torch installed")
    own = _env_distributions(site_packages)
    shared = envdir / "shared-torch"
    shared.mkdir(parents=True, exist_ok=True)
    # Made anew on every call: a reused env whose torch interpreter changed (another release of the range) must not
    # keep the old closure's links (two torch .dist-info folders, another CUDA runtime).
    for old in shared.iterdir():
        if old.is_symlink():
            old.unlink()
    for dist_name, paths in closure.items():
        if dist_name in own:  # the env's own copy wins; do not shadow pip/setuptools/...
            continue
        for src in paths:
            link = shared / Path(src).name
            if not link.exists():
                link.symlink_to(src)
    (site_packages / _PTH_NAME).write_text(str(shared) + "\n")
    return shared


def main(argv: list[str]) -> int:
    if "--" not in argv or argv.index("--") != 1:
        raise SystemExit("usage: share_torch.py ENVDIR -- [pip install options and packages]")
    envdir = Path(argv[0])
    default_python = Path(__file__).resolve().parent.parent / ".venv" / "bin" / "python"
    torch_python = os.environ.get("HFPATCH_TORCH_PYTHON") or str(default_python)
    link_shared_torch(envdir, torch_python)
    pip_args = argv[2:]
    return subprocess.call([sys.executable, "-m", "pip", "install", *pip_args])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
