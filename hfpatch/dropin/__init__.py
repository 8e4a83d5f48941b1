"""Drop-in replacements for the APIs existing users already call, on hfpatch's guarantees.

- ``hfpatch.dropin.ring_flash_attn``: ring-flash-attn's HF adapter (``substitute_hf_flash_attn``,
  ``update_ring_flash_attn_params``, ``use_ring_attn``) and its kernel entry points (``ring_flash_attn_func``,
  ``zigzag_ring_flash_attn_varlen_func``, ``llama3_flash_attn_varlen_func``, ... with flash-attn's arguments).
- ``hfpatch.dropin.axolotl``: axolotl's ring-attention patch (``register_ring_attn_from_device_mesh``,
  ``get_ring_attn_group``, ``set_ring_attn_group``, ``update_ring_attn_params``, ``RingAttnFunc``).

Switching is a one-line import change; docs/migration.md lists
where the behaviour differs (always towards refusing what cannot be honoured instead of ignoring it).
``hfpatch.dropin.provide_ring_flash_attn()`` makes code that imports ``ring_flash_attn`` by that name (OpenRLHF)
get ``hfpatch.dropin.ring_flash_attn``, unedited. ``hfpatch.dropin.forget()`` removes the patch either API
installed, forgets its per-step state and withdraws that name.

The names are imported on first use (PEP 562 ``__getattr__``): ``import hfpatch.dropin`` and
``provide_ring_flash_attn()`` load no torch, so they may run at every interpreter start (a ``.pth`` line).
"""
from __future__ import annotations

import importlib

# public name -> the module that defines it (None: the name is a submodule)
_EXPORTS = {
    "forget": "hfpatch.dropin._session",
    "provide_ring_flash_attn": "hfpatch.dropin._provide",
    "ring_flash_attn": None,
    "axolotl": None,
}

__all__ = ["ring_flash_attn", "axolotl", "forget", "provide_ring_flash_attn"]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'hfpatch.dropin' has no attribute {name!r}")
    module = _EXPORTS[name]
    value = importlib.import_module(f"{__name__}.{name}") if module is None else getattr(
        importlib.import_module(module), name)
    globals()[name] = value                   # later reads skip this function
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
