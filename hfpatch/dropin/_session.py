"""The one hfpatch ``Patch`` installed through a drop-in API, and the per-step state it is given from outside.

ring-flash-attn and axolotl keep module-level globals (the group, ``DATA_PARAMS``); here the state is the
``Patch`` of ``hfpatch.apply`` plus what its ``RingContext`` needs per step. A second ``substitute_*`` /
``register_*`` call removes the previous drop-in patch and applies again (ring-flash-attn's second call wraps
its own lambda and then fails with "version not supported"); a patch applied directly with ``hfpatch.apply``
is never touched (``apply`` then raises ``PatchError`` naming it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

import hfpatch
from hfpatch.errors import PatchError
from hfpatch.attention.semantics import StepState

__all__: list = []


@dataclass
class Session:
    """What one drop-in install set up: the ``Patch``, the CP group, the ring variant and llama3's head stride."""

    patch: Any
    group: Any
    kernel: str
    heads_k_stride: Optional[int]
    owner: str

    @property
    def live(self) -> bool:
        """True while the patch is installed (active and not removed)."""
        return bool(self.patch.active) and not self.patch.removed


_current: Optional[Session] = None


def check_stride(fn: str, heads_k_stride) -> Optional[int]:
    if heads_k_stride is None:
        return None
    if isinstance(heads_k_stride, bool) or not isinstance(heads_k_stride, int) or heads_k_stride < 1:
        raise ValueError(f"{fn}: heads_k_stride={heads_k_stride!r} must be a positive int (K/V heads exchanged "
                         f"at a time by llama3; it must divide the model's num_key_value_heads) or None (all)")
    return heads_k_stride


def forget() -> None:
    """Remove the drop-in patch if it is still installed, and forget the session: an update call then needs a
    ``substitute_*`` / ``register_*`` call first, as in a fresh process."""
    global _current
    if _current is not None and _current.live:
        _current.patch.remove()
    _current = None


def install(owner: str, group, *, kernel: str, heads_k_stride: Optional[int], model: Optional[torch.nn.Module],
            verify: bool = True) -> Session:
    """``hfpatch.apply(group, kernel=kernel, model=model)``, replacing a previous drop-in install."""
    global _current
    forget()
    patch = hfpatch.apply(group, kernel=kernel, model=model, verify=verify)
    if patch.active:
        patch.ctx.heads_k_stride = heads_k_stride
    _current = Session(patch=patch, group=group, kernel=kernel, heads_k_stride=heads_k_stride, owner=owner)
    return _current


def current(fn: str, *, needs: str) -> Session:
    """The live drop-in session, or ``PatchError`` saying which call must come first."""
    if _current is None:
        raise PatchError(f"{fn}() was called before {needs}(); there is no ring-attention patch to configure. "
                         f"Fix: call {needs}(...) once at startup, on every rank.")
    return _current


def set_step(session: Session, source: str, *, kernel: str, layout: str, batch: int, seq_global: int,
             cu_seqlens: Optional[torch.Tensor]) -> None:
    """Give the session's ring context this step's layout (identical on every rank): no collective per layer.

    ``cu_seqlens``: GLOBAL int32 (num_docs + 1,) for a packed row (batch 1), else None.
    An inactive patch (a group of one, a fallback) has no context: nothing to set, attention is not split.
    """
    if not session.live:
        return

    ctx = session.patch.ctx
    if seq_global % ctx.world_size:
        raise ValueError(f"{source}: the global sequence has {seq_global} tokens, not divisible by the CP group "
                         f"size {ctx.world_size}; pad it to a multiple of {ctx.world_size}")
    ctx.set_step(StepState(kernel=kernel, layout=layout, packed=cu_seqlens is not None, batch_size=batch,
                           seq_len_global=seq_global, seq_len_local=seq_global // ctx.world_size,
                           cu_seqlens=cu_seqlens, source=source))
