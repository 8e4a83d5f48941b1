"""OpenRLHF 0.11.2 imported on a CPU machine, for the tests: its CUDA-only imports stood in for, for the import only.

OpenRLHF's model modules import, at module level, from two packages that cannot be imported without CUDA:

- flash-attn (its ``__init__`` loads the compiled extension). The ring path CALLS four of its pure-Python names:
  ``flash_attn.bert_padding``'s ``unpad_input``, ``pad_input``, ``index_first_axis`` and ``rearrange`` (einops',
  re-exported there) and ``flash_attn.utils.distributed.all_gather`` (an autograd all-gather whose backward
  reduce-scatters). These run as flash-attn's OWN files: ``bert_padding.py`` and ``utils/distributed.py`` of
  flash-attn 2.8.3 (the release OpenRLHF 0.11.2 requires), taken from its source distribution on PyPI, checked by
  sha256, and kept in ``.cache/flash-attn-2.8.3/`` (``fetch()``; CI runs ``python tests/_openrlhf.py`` while it
  installs, .ci/run). They need ``einops``. The packages above them (``flash_attn``, ``flash_attn.utils``) are
  empty modules: nothing else of flash-attn is imported at module level.
- deepspeed: used only on ZeRO-3 and mixture-of-experts paths the tests never take: an empty module.

After the import every stand-in leaves ``sys.modules`` again: OpenRLHF's modules keep the names they bound, and
nothing else sees a ``flash_attn`` (transformers' availability checks stay false; ``log_probs_from_logits``'s
``from flash_attn.ops.triton.cross_entropy import ...`` raises ``ImportError`` and takes its torch path).

``import_openrlhf(fetch_flash_attn=True)``: the flash-attn files are fetched when missing, and a failure to get
them raises. ``False`` (a caller that never runs the ring path): the files when cached, else ``None`` placeholders
for the four names, which that caller never calls. One process imports OpenRLHF once; asking for the real files
after a placeholder import in the same process raises.
"""
from __future__ import annotations

import hashlib
import importlib.util
import io
import sys
import tarfile
import types
import urllib.request
from pathlib import Path

__all__ = ["FLASH_ATTN_VERSION", "fetch", "import_openrlhf", "openrlhf_installed"]

FLASH_ATTN_VERSION = "2.8.3"
_SDIST = ("https://files.pythonhosted.org/packages/3b/b2/8d76c41ad7974ee264754709c22963447f7f8134613fd9ce80984ed0dab7/"
          "flash_attn-2.8.3.tar.gz", "1e71dd64a9e0280e0447b8a0c2541bad4bf6ac65bdeaa2f90e51a9e57de0370d")
# path inside the sdist (under flash_attn-2.8.3/) -> sha256 of the file; LICENSE: flash-attn's BSD-3 licence
_FILES = {
    "flash_attn/bert_padding.py": "805d449ac749f87a50f3a3114385710f0f926ff45521275000b74d9e80721e5c",
    "flash_attn/utils/distributed.py": "aa17326d15edb25b2cb95f4b61a432dfb85a3da3ed925338614303c7d52f9e74",
    "LICENSE": "8c9ccb96c065e706135b6cbad279b721da6156e51f3a5f27c6b3329af9416d73",
}
_CACHE = Path(__file__).resolve().parent.parent / ".cache" / f"flash-attn-{FLASH_ATTN_VERSION}"
_CALLED = {  # module -> the names OpenRLHF's ring path imports from it and calls
    "flash_attn.bert_padding": ("index_first_axis", "pad_input", "rearrange", "unpad_input"),
    "flash_attn.utils.distributed": ("all_gather",),
}
_MODULES = ("openrlhf.models.ring_attn_utils", "openrlhf.models.actor", "openrlhf.models.model")


def openrlhf_installed() -> bool:
    return importlib.util.find_spec("openrlhf") is not None


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _cached() -> bool:
    return all((_CACHE / name).is_file() and _sha256((_CACHE / name).read_bytes()) == digest
               for name, digest in _FILES.items())


def fetch() -> Path:
    """flash-attn's files in the cache (downloaded from PyPI and checked when missing); returns the cache folder."""
    if _cached():
        return _CACHE
    url, digest = _SDIST
    try:
        data = urllib.request.urlopen(url, timeout=120).read()
    except OSError as exc:
        raise RuntimeError(f"could not download flash-attn {FLASH_ATTN_VERSION}'s sdist from {url}: {exc}. Fix: "
                           f"run `python tests/_openrlhf.py` where PyPI is reachable (it fills {_CACHE})") from exc
    if _sha256(data) != digest:
        raise RuntimeError(f"{url}: sha256 {_sha256(data)}, expected {digest}; the file was not used")
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as sdist:
        for name, want in _FILES.items():
            content = sdist.extractfile(f"flash_attn-{FLASH_ATTN_VERSION}/{name}").read()
            if _sha256(content) != want:
                raise RuntimeError(f"{name} in {url}: sha256 {_sha256(content)}, expected {want}")
            (_CACHE / name).parent.mkdir(parents=True, exist_ok=True)
            (_CACHE / name).write_bytes(content)
    return _CACHE


def _load_file(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _absent(package: str) -> bool:
    return package not in sys.modules and importlib.util.find_spec(package) is None


def _stand_ins(real: bool) -> list:
    """Put the stand-ins for what is not installed into sys.modules (module docstring); returns their names."""
    placed = []
    if _absent("deepspeed"):
        sys.modules["deepspeed"] = types.ModuleType("deepspeed")
        placed.append("deepspeed")
    if not _absent("flash_attn"):
        return placed  # a machine with flash-attn installed imports the package itself
    for name in ("flash_attn", "flash_attn.utils"):
        sys.modules[name] = types.ModuleType(name)
        placed.append(name)
    for name, called in _CALLED.items():
        placed.append(name)
        if real:
            _load_file(name, _CACHE / (name.replace(".", "/") + ".py"))
        else:
            sys.modules[name] = types.ModuleType(name)
            sys.modules[name].__dict__.update(dict.fromkeys(called))
    return placed


def import_openrlhf(*, fetch_flash_attn: bool) -> types.SimpleNamespace:
    """OpenRLHF's ``ring_attn_utils``, ``actor`` and ``model`` modules, imported with the stand-ins (module
    docstring): ``.ring``, ``.actor``, ``.model``."""
    # Their deepspeed availability checks (find_spec) must run before a stand-in without a spec exists:
    import peft  # noqa: F401  (imports accelerate)
    import transformers.integrations.deepspeed  # noqa: F401

    if fetch_flash_attn:
        fetch()
    real = _cached() and importlib.util.find_spec("einops") is not None
    if fetch_flash_attn and not real:
        raise ImportError("flash-attn's bert_padding.py imports einops, which is not installed. Fix: "
                          "pip install einops")
    already = sys.modules.get(_MODULES[0])
    if fetch_flash_attn and already is not None and already.unpad_input is None:
        raise RuntimeError("openrlhf was imported in this process with placeholders for flash-attn's functions "
                           "(import_openrlhf(fetch_flash_attn=False)); its ring path cannot run here. Fix: ask for "
                           "the real files first, or run the ring path in a fresh process")
    placed = _stand_ins(real)
    try:
        ring, actor, model = (importlib.import_module(name) for name in _MODULES)
    finally:
        for name in placed:
            sys.modules.pop(name, None)
    return types.SimpleNamespace(ring=ring, actor=actor, model=model)


if __name__ == "__main__":
    print(f"flash-attn {FLASH_ATTN_VERSION}'s files: {fetch()}")
