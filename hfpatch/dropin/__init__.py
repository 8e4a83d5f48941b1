"""Drop-in replacements for the APIs existing users already call, on hfpatch's guarantees.

- ``hfpatch.dropin.ring_flash_attn``: ring-flash-attn's HF adapter (``substitute_hf_flash_attn``,
  ``update_ring_flash_attn_params``, ``use_ring_attn``) and its kernel entry points (``ring_flash_attn_func``,
  ``zigzag_ring_flash_attn_varlen_func``, ``llama3_flash_attn_varlen_func``, ... with flash-attn's arguments).
- ``hfpatch.dropin.axolotl``: axolotl's ring-attention patch (``register_ring_attn_from_device_mesh``,
  ``get_ring_attn_group``, ``set_ring_attn_group``, ``update_ring_attn_params``, ``RingAttnFunc``).

Switching is a one-line import change; docs/migration.md lists
where the behaviour differs (always towards refusing what cannot be honoured instead of ignoring it).
``hfpatch.dropin.forget()`` removes the patch either API installed and forgets its per-step state.
"""

from hfpatch.dropin._session import forget

__all__ = ["ring_flash_attn", "axolotl", "forget"]
