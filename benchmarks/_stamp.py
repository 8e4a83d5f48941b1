"""Where and with what a run was made: device, GPU count, library versions, date, the commit, the block backends.

**The commit.** A result names a commit only when the tree that ran is that commit's. The GPU machine receives a
working tree without ``.git`` (and may find an unrelated ``.git`` above it), so the commit is passed in:

    HFPATCH_COMMIT      the commit the caller sent (``git rev-parse HEAD`` where the run was launched)
    HFPATCH_SOURCE_HASH that commit's source hash (``source_hash`` below, computed from git's objects)

``python benchmarks/_stamp.py --export`` prints both for HEAD (run it in the checkout before sending the tree).
The stamp hashes the source of the tree that runs (``source_hash``: every file under ``SOURCE_DIRS`` except
results and caches) and names the commit only when that hash equals the commit's; otherwise ``git_commit`` is
``"uncommitted-tree"`` and ``based_on_commit``/``provenance`` say which commit the tree started from and why it
is not that commit (uncommitted edits, no commit given, no hash to check it against). In a git checkout of its
own (``git rev-parse --show-toplevel`` is this repository) the stamp checks HEAD, or ``HFPATCH_COMMIT``, itself.

**The block backends.** ``backend_choices(recorder_or_none)`` turns ``ring_kernels.backends``' record of which
block backend ran, for which shape class and why, into JSON rows (a result row's, or the whole process's).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import hashlib
import importlib.metadata
import os
import platform
import re
import subprocess
import sys
from typing import Dict, List, Optional, Tuple

import torch

__all__ = ["stamp", "provenance", "source_hash", "committed_source_hash", "backend_choices", "UNCOMMITTED",
           "SOURCE_DIRS"]

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
UNCOMMITTED = "uncommitted-tree"
# What a result depends on: the kernels, the patch, the harnesses and the examples they run.
# Directory names (the stamp reads files, never imports them), written as one string so that the CI selection's
# static check (tests/tooling/test_ci_selection.py) does not take the directory "hfpatch" for a module reference.
SOURCE_DIRS = tuple("benchmarks examples hfpatch ring_kernels".split())
_EXCLUDED_PREFIXES = ("benchmarks/results/",)
_EXCLUDED_PARTS = ("__pycache__", "build", "dist", ".pytest_cache")   # .gitignore's entries under SOURCE_DIRS
_COMMIT = re.compile(r"[0-9a-f]{7,40}")


# ------------------------------------------------------------------------------------------- versions


def _version(dist_name: str) -> Optional[str]:
    """Installed version from package metadata (no import: importing transformers takes seconds)."""
    try:
        return importlib.metadata.version(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _nccl_version() -> Optional[str]:
    try:
        v = torch.cuda.nccl.version()
    except (AttributeError, RuntimeError):
        return None
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


# ------------------------------------------------------------------------------------------- the source


def _counted(rel: str) -> bool:
    parts = rel.split("/")
    return (parts[0] in SOURCE_DIRS and not rel.startswith(_EXCLUDED_PREFIXES)
            and not any(p in _EXCLUDED_PARTS or p.endswith(".egg-info") for p in parts[:-1])
            and not rel.endswith((".pyc", ".pyo")))


def _digest(files: List[Tuple[str, bytes]]) -> str:
    """sha256 over (path, sha256(content)) in path order: the same files with the same bytes, the same hash."""
    h = hashlib.sha256()
    for rel, content in sorted(files):
        h.update(rel.encode() + b"\0" + hashlib.sha256(content).hexdigest().encode() + b"\n")
    return "sha256:" + h.hexdigest()


def source_hash(root: Optional[str] = None) -> Tuple[str, int]:
    """(hash, number of files) of the source files of the tree at ``root`` (default: this repository;
    ``SOURCE_DIRS``, without results, caches and build outputs): what a run imports, whatever git knows of it."""
    root = root or _REPO
    files = []
    for top in SOURCE_DIRS:
        for dirpath, dirnames, filenames in os.walk(os.path.join(root, top)):
            dirnames[:] = sorted(d for d in dirnames if d not in _EXCLUDED_PARTS and not d.endswith(".egg-info"))
            for name in filenames:
                path = os.path.join(dirpath, name)
                rel = os.path.relpath(path, root).replace(os.sep, "/")
                if _counted(rel) and os.path.isfile(path) and not os.path.islink(path):
                    with open(path, "rb") as f:
                        files.append((rel, f.read()))
    return _digest(files), len(files)


def _git(*args: str, stdin: Optional[bytes] = None) -> Optional[bytes]:
    try:
        out = subprocess.run(["git", *args], cwd=_REPO, input=stdin, capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def _own_checkout() -> bool:
    """Whether this repository is a git checkout itself (not a plain tree inside an unrelated one)."""
    top = _git("rev-parse", "--show-toplevel")
    return top is not None and os.path.realpath(top.decode().strip()) == os.path.realpath(_REPO)


def committed_source_hash(commit: str) -> Tuple[str, int]:
    """``source_hash`` of the files as committed in ``commit`` (read from git's objects, not the working tree)."""
    listing = _git("ls-tree", "-r", "-z", commit, "--", *SOURCE_DIRS)
    if listing is None:
        raise ValueError(f"git cannot list commit {commit!r} in {_REPO}")
    entries = [e.split("\t", 1) for e in listing.decode().split("\0") if e]
    paths = [path for meta, path in entries
             if meta.split()[1] == "blob" and meta.split()[0] != "120000" and _counted(path)]  # no symlinks
    data = _git("cat-file", "--batch", stdin="".join(f"{commit}:{p}\n" for p in paths).encode())
    if data is None:
        raise ValueError(f"git cannot read the files of commit {commit!r}")
    files, pos = [], 0
    for path in paths:
        header_end = data.index(b"\n", pos)
        size = int(data[pos:header_end].split()[2])
        files.append((path, data[header_end + 1: header_end + 1 + size]))
        pos = header_end + 1 + size + 1
    return _digest(files), len(files)


def _head() -> Optional[str]:
    out = _git("rev-parse", "HEAD")
    return out.decode().strip() if out else None


def provenance(commit: Optional[str] = None, expected_hash: Optional[str] = None) -> Dict[str, object]:
    """Which commit produced this tree, checked: ``git_commit`` (the commit, or ``"uncommitted-tree"``),
    ``based_on_commit``, ``source_hash``, ``source_files``, ``provenance`` (how it was decided).

    ``commit``/``expected_hash`` default to $HFPATCH_COMMIT / $HFPATCH_SOURCE_HASH. Raises ``ValueError`` for a
    commit that is not a hex id, or a hash that contradicts what this checkout's git says about the commit.
    """
    commit = commit or os.environ.get("HFPATCH_COMMIT") or None
    expected_hash = expected_hash or os.environ.get("HFPATCH_SOURCE_HASH") or None
    tree_hash, count = source_hash()
    own = _own_checkout()
    if commit is not None and not _COMMIT.fullmatch(commit):
        raise ValueError(f"HFPATCH_COMMIT={commit!r} is not a commit id (7 to 40 lower-case hex digits); pass "
                         f"`git rev-parse HEAD` of the tree you send")
    source = "HFPATCH_COMMIT"
    if commit is None and own:
        commit, source = _head(), "this checkout's HEAD"
    if commit is not None and own:
        full = _git("rev-parse", "--verify", f"{commit}^{{commit}}")
        if full is not None:
            commit = full.decode().strip()
            from_git, _ = committed_source_hash(commit)
            if expected_hash is not None and expected_hash != from_git:
                raise ValueError(f"HFPATCH_SOURCE_HASH={expected_hash} is not the source hash of commit {commit} "
                                 f"({from_git}); recompute it with `python benchmarks/_stamp.py --export`")
            expected_hash = from_git
    out = {"git_commit": UNCOMMITTED, "based_on_commit": commit, "source_hash": tree_hash, "source_files": count}
    if commit is None:
        out["provenance"] = (f"no commit given (HFPATCH_COMMIT) and {_REPO} is no git checkout: the tree is "
                             f"identified by its source hash only")
    elif expected_hash is None:
        out["provenance"] = (f"{source}={commit} given without HFPATCH_SOURCE_HASH and no git here to check it: "
                             f"not confirmed as the tree that ran")
    elif expected_hash != tree_hash:
        out["provenance"] = (f"the tree differs from commit {commit} ({source}): source hash {tree_hash}, the "
                             f"commit's {expected_hash} (uncommitted or untracked changes under {SOURCE_DIRS})")
    else:
        out.update(git_commit=commit, provenance=f"{source}={commit}, its source hash equals the tree's")
    return out


# ------------------------------------------------------------------------------------------- backends


def backend_choices(recorder=None) -> List[dict]:
    """JSON rows of the block-backend choices (backend, requested, reason, shape class, calls, fallback): those
    made inside ``recorder`` (a ``ring_kernels.backends.recording()``), or every one of this process."""
    if recorder is not None:
        return [c.as_dict() for c in recorder.choices()]
    try:
        from ring_kernels.backends import choices
    except ImportError:
        return []
    return [c.as_dict() for c in choices()]


# ------------------------------------------------------------------------------------------- the stamp


@functools.lru_cache(maxsize=None)
def _static(device_type: str, device_index: Optional[int]) -> dict:
    cuda = device_type == "cuda"
    origin = provenance()
    if origin["git_commit"] == UNCOMMITTED:
        print(f"_stamp: results are stamped {UNCOMMITTED} ({origin['source_hash']}): {origin['provenance']}",
              file=sys.stderr, flush=True)
    return {
        "device_type": device_type,
        "device_name": torch.cuda.get_device_name(device_index) if cuda else (platform.processor() or "cpu"),
        "gpu_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "nccl": _nccl_version() if cuda else None,
        "triton": _version("triton"),
        "flash_attn": _version("flash-attn"),
        "transformers": _version("transformers"),
        "python": platform.python_version(),
        **origin,
        "hostname": platform.node(),
        # What makes one machine slower than another: each GPU's clocks, throttling, power, temperature, PCIe
        # link, and the GPUs' interconnect (nvidia-smi; None where it cannot run).
        "gpu_facts": _gpu_facts() if cuda else None,
        "topology": _run_text(["nvidia-smi", "topo", "-m"]) if cuda else None,
        # Settings that change communication speed (read by NCCL / ProcessGroupNCCL / ring_kernels at start-up).
        "env": {k: v for k, v in sorted(os.environ.items())
                if k.startswith(("NCCL_", "TORCH_NCCL_", "RING_KERNELS_")) or k == "PYTORCH_CUDA_ALLOC_CONF"},
    }


_GPU_FIELDS = ("index", "name", "clocks.sm", "clocks.max.sm", "clocks_event_reasons.active", "power.draw",
               "power.limit", "temperature.gpu", "pcie.link.gen.current", "pcie.link.width.current")


def _run_text(command: list) -> Optional[str]:
    """``command``'s standard output, or None when it cannot run or fails (within 20 s)."""
    import subprocess

    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout if result.returncode == 0 else None


def _gpu_facts() -> Optional[list]:
    """One dict per GPU of ``_GPU_FIELDS`` (``nvidia-smi --query-gpu``); older drivers name the throttle reasons
    ``clocks_throttle_reasons``."""
    for fields in (_GPU_FIELDS, tuple(f.replace("clocks_event", "clocks_throttle") for f in _GPU_FIELDS)):
        text = _run_text(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"])
        if text:
            return [dict(zip(_GPU_FIELDS, (v.strip() for v in line.split(",")))) for line in text.splitlines()
                    if line.strip()]
    return None


def _ring_kernels_options() -> Optional[dict]:
    """The ring_kernels options in effect (``ring_kernels.options``: set in code or by RING_KERNELS_*)."""
    try:
        from ring_kernels import get_options
    except ImportError:
        return None
    return dataclasses.asdict(get_options())


def stamp(device: torch.device, world_size: int) -> dict:
    """The stamp of a run on ``device`` with ``world_size`` ranks (date in UTC, ISO 8601), with the commit as
    ``provenance`` decides and the block-backend choices this process made so far."""
    return dict(_static(device.type, device.index), world_size=world_size,
                ring_kernels_options=_ring_kernels_options(), block_backend_choices=backend_choices(),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))


def gpu_model(name: str) -> str:
    """The GPU model in a device name, for file names (``ring_kernels.layout_costs.gpu_model``: "NVIDIA H100 80GB
    HBM3" -> "H100"); without a model number, the name's last word with its punctuation removed ("cpu" for an
    empty name)."""
    from ring_kernels.layout_costs import gpu_model as model_in_name   # as backend_choices: ring_kernels on demand

    return model_in_name(name) or re.sub(r"[^A-Za-z0-9]+", "", name.split()[-1] if name else "cpu") or "cpu"


def _short_tag(origin: dict) -> str:
    """A file-name tag: the short commit, or ``uncommitted-<12 hex of the source hash>``."""
    if origin["git_commit"] != UNCOMMITTED:
        return str(origin["git_commit"])[:7]
    return f"{UNCOMMITTED}-{str(origin['source_hash']).split(':')[1][:12]}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="The commit provenance of this tree (see the module docstring).")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--export", action="store_true",
                      help="print HFPATCH_COMMIT=... HFPATCH_SOURCE_HASH=... for HEAD (in a git checkout)")
    mode.add_argument("--tag", action="store_true", help="print the file-name tag of a result of this tree")
    mode.add_argument("--describe", action="store_true", help="print the provenance fields")
    mode.add_argument("--gpu-model", action="store_true",
                      help="print GPU 0's model for file names (gpu_model: H100, H200; cpu without CUDA)")
    args = p.parse_args(argv)
    if args.export:
        head = _head() if _own_checkout() else None
        if head is None:
            print(f"_stamp --export: {_REPO} is no git checkout", file=sys.stderr)
            return 1
        committed, _ = committed_source_hash(head)
        if committed != source_hash()[0]:
            print(f"_stamp --export: the working tree differs from HEAD {head[:7]} under {SOURCE_DIRS}: commit "
                  f"first, or its results will be stamped {UNCOMMITTED}", file=sys.stderr)
        print(f"HFPATCH_COMMIT={head} HFPATCH_SOURCE_HASH={committed}")
        return 0
    if args.gpu_model:
        print(gpu_model(torch.cuda.get_device_name(0)) if torch.cuda.is_available() else "cpu")
        return 0
    origin = provenance()
    if args.tag:
        print(_short_tag(origin))
    else:
        for key, value in origin.items():
            print(f"{key}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
