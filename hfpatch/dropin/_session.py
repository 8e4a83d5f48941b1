"""The one hfpatch ``Patch`` installed through a drop-in API, and the per-step state it is given from outside.

ring-flash-attn and axolotl keep module-level globals (the group, ``DATA_PARAMS``); here the state is the
``Patch`` of ``hfpatch.apply`` plus what its ``RingContext`` needs per step. A second ``substitute_*`` /
``register_*`` call while the first one's patch is live (RL keeps a policy and a reference model in one process)
keeps that patch: over the same ranks, with the same kernel and stride, its ``model=`` joins the ring beside the
first call's (``Patch.add_model``) and the same ``Patch`` is returned; anything else raises ``PatchError`` naming
both calls, so the first model never silently leaves the ring. After ``patch.remove()`` a call applies anew. A
patch applied directly with ``hfpatch.apply`` is never touched (``apply`` then raises ``PatchError`` naming it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

import hfpatch
from hfpatch import modes
from hfpatch.dropin import _provide
from hfpatch.errors import PatchError
from hfpatch.attention.context import StepState
from hfpatch.model.wrappers import inner_model

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
    """Remove the drop-in patch if it is still installed, forget the session, and withdraw the name
    ``provide_ring_flash_attn`` provided (if it did): an update call then needs a ``substitute_*`` / ``register_*``
    call first, and ``import ring_flash_attn`` finds what is installed, as in a fresh process."""
    _end_session()
    _provide.withdraw()


def _end_session() -> None:
    global _current
    if _current is not None and _current.live:
        _current.patch.remove()
    _current = None


def _ranks(group) -> tuple:
    if group is None or not dist.is_initialized():
        return ()
    return tuple(dist.get_process_group_ranks(group))


def install(owner: str, group, *, kernel: str, heads_k_stride: Optional[int], model: Optional[torch.nn.Module],
            verify: bool = True) -> Session:
    """``hfpatch.apply(group, kernel=kernel, model=model)``, or, while an earlier drop-in call's patch is live,
    ``model`` added to that patch's ring (module docstring)."""
    global _current
    if _current is not None and _current.live:
        return _join(_current, owner, group, kernel=kernel, heads_k_stride=heads_k_stride, model=model,
                     verify=verify)
    _end_session()  # not forget(): the provided import name stays (this call may have come through it)
    patch = hfpatch.apply(group, kernel=kernel, model=model, verify=verify)
    if patch.active:
        patch.reconfigure(heads_k_stride=heads_k_stride)
    _current = Session(patch=patch, group=group, kernel=kernel, heads_k_stride=heads_k_stride, owner=owner)
    return _current


def _join(session: Session, owner: str, group, *, kernel: str, heads_k_stride: Optional[int],
          model: Optional[torch.nn.Module], verify: bool) -> Session:
    """A later drop-in call while ``session`` is live: the same patch, ``model`` added to its ring."""
    same = (_ranks(group) == _ranks(session.group) and kernel == session.kernel
            and heads_k_stride == session.heads_k_stride)
    if not same:
        raise PatchError(
            f"a {owner} drop-in call asks for ring attention over ranks {list(_ranks(group))} with kernel {kernel!r} "
            f"and heads_k_stride={heads_k_stride!r}, while the patch of an earlier {session.owner} call is live over "
            f"ranks {list(_ranks(session.group))} with kernel {session.kernel!r} and heads_k_stride="
            f"{session.heads_k_stride!r}; replacing it would take the earlier call's models off the ring. Fix: call "
            "it with the same group and arguments to add a model to the ring, or patch.remove() the earlier patch "
            "first.")
    if model is not None:
        on_ring = {id(attached.model) for attached in session.patch.models}
        if id(inner_model(model)) not in on_ring:
            session.patch.add_model(model, verify=bool(verify))
    return session


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
    modes.refresh_from_env()  # a step boundary: RING_ATTN_SWITCH, flipped since the last one, takes effect
    if not session.live:
        return

    ctx = session.patch.ctx
    if session.patch.reach is not None:
        session.patch.reach.step(source)  # RingNotReached: the last step's forward never reached the ring
    if seq_global % ctx.world_size:
        raise ValueError(f"{source}: the global sequence has {seq_global} tokens, not divisible by the CP group "
                         f"size {ctx.world_size}; pad it to a multiple of {ctx.world_size}")
    ctx.set_step(StepState(kernel=kernel, layout=layout, packed=cu_seqlens is not None, batch_size=batch,
                           seq_len_global=seq_global, seq_len_local=seq_global // ctx.world_size,
                           cu_seqlens=cu_seqlens, source=source))
