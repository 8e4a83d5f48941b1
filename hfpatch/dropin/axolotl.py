"""Drop-in for axolotl's ring-attention patch (``axolotl.monkeypatch.ring_attn``), on hfpatch's guarantees.

    - from axolotl.monkeypatch.ring_attn import register_ring_attn_from_device_mesh, update_ring_attn_params
    + from hfpatch.dropin.axolotl import register_ring_attn_from_device_mesh, update_ring_attn_params

The flow: ``register_ring_attn_from_device_mesh(mesh, ("cp",), heads_k_stride, RingAttnFunc.X)`` once on every
rank; per step ``update_ring_attn_params(position_ids)`` with the WHOLE batch's position ids (before the split),
then each rank feeds the model its part of ``input_ids``/``position_ids`` in the layout of ``RingAttnFunc.X``:

===================  =================================================================  ======================
RingAttnFunc         what rank r of N holds (dim 1 of input_ids / position_ids)          packed rows (batch 1)
===================  =================================================================  ======================
``varlen_llama3``    ``x.chunk(N, dim=1)[r]``                                             llama3 (exchanged K/V)
``batch_ring``       ``x.chunk(N, dim=1)[r]``                                             ring varlen
``varlen_ring``      ``x.chunk(N, dim=1)[r]``                                             ring varlen
``batch_zigzag``     chunks r and 2N-1-r of ``x.chunk(2N, dim=1)``                         refused (see below)
``batch_stripe``     ``x[:, r::N]``                                                       refused (see below)
``varlen_zigzag``    ``ring_kernels.shard(x, layout="zigzag", dim=1, cu_seqlens=cu)``     zigzag varlen
                     (pieces r and 2N-1-r of every document)
===================  =================================================================  ======================

A packed row cut by the row-level zigzag/stripe split is refused: no ring kernel computes documents in that
layout, and ignoring the documents (what a batch kernel would do) lets them attend to each other. Use
``varlen_llama3``/``batch_ring`` or ``varlen_zigzag`` for packed rows.
"""
from __future__ import annotations

from enum import Enum
from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist

from hfpatch.dropin import _session
from hfpatch.errors import PatchError, UnsupportedArgument
from hfpatch.attention.step import packed_cu_seqlens

__all__ = [
    "RingAttnFunc",
    "register_ring_attn_from_device_mesh",
    "get_ring_attn_group",
    "set_ring_attn_group",
    "update_ring_attn_params",
]

_REGISTER = "register_ring_attn_from_device_mesh"
_UPDATE = "update_ring_attn_params"


class RingAttnFunc(str, Enum):
    """The ring-attention function (and with it the input layout) axolotl selects."""

    VARLEN_LLAMA3 = "varlen_llama3"
    BATCH_RING = "batch_ring"
    BATCH_ZIGZAG = "batch_zigzag"
    BATCH_STRIPE = "batch_stripe"
    VARLEN_RING = "varlen_ring"
    VARLEN_ZIGZAG = "varlen_zigzag"


# RingAttnFunc -> (hfpatch variant, batch (kernel, layout), packed (kernel, layout) or None: refused)
_PLANS = {
    RingAttnFunc.VARLEN_LLAMA3: ("llama3", ("ring", "contiguous"), ("llama3", "contiguous")),
    RingAttnFunc.BATCH_RING: ("ring", ("ring", "contiguous"), ("ring", "contiguous")),
    RingAttnFunc.VARLEN_RING: ("ring", ("ring", "contiguous"), ("ring", "contiguous")),
    RingAttnFunc.BATCH_ZIGZAG: ("zigzag", ("zigzag", "zigzag"), None),
    RingAttnFunc.BATCH_STRIPE: ("stripe", ("stripe", "stripe"), None),
    RingAttnFunc.VARLEN_ZIGZAG: ("zigzag", ("zigzag", "zigzag"), ("zigzag", "zigzag")),
}

_group = None
_func: Optional[RingAttnFunc] = None


def get_ring_attn_group():
    """The CP process group registered by ``register_ring_attn_from_device_mesh`` / ``set_ring_attn_group``."""
    if _group is None:
        raise PatchError(f"get_ring_attn_group(): no ring-attention group yet. Fix: call {_REGISTER}(...) (or "
                         f"set_ring_attn_group(group)) first, on every rank.")
    return _group


def set_ring_attn_group(ring_attn_group) -> None:
    """Record ``ring_attn_group`` (a ProcessGroup, or None to forget it). Does not patch anything."""
    global _group
    if ring_attn_group is not None and not isinstance(ring_attn_group, dist.ProcessGroup):
        raise TypeError(f"set_ring_attn_group: ring_attn_group={ring_attn_group!r} must be a "
                        f"torch.distributed ProcessGroup or None")
    _group = ring_attn_group


def _parse_func(ring_attn_func) -> RingAttnFunc:
    if ring_attn_func is None:
        return RingAttnFunc.VARLEN_LLAMA3  # axolotl's default
    try:
        return RingAttnFunc(ring_attn_func)
    except ValueError:
        raise ValueError(f"{_REGISTER}: ring_attn_func={ring_attn_func!r} is not one of "
                         f"{[f.value for f in RingAttnFunc]}") from None


def _cp_group(device_mesh, context_parallel_dim: Union[str, Sequence[str]]):
    """The process group of ``device_mesh``'s context-parallel dimension (one dimension name, or a 1-tuple)."""
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(device_mesh, DeviceMesh):
        raise TypeError(f"{_REGISTER}: device_mesh must be a torch DeviceMesh, got {type(device_mesh).__name__}")
    dims = (context_parallel_dim,) if isinstance(context_parallel_dim, str) else tuple(context_parallel_dim)
    names = tuple(device_mesh.mesh_dim_names or ())
    if len(dims) != 1 or dims[0] not in names:
        raise ValueError(f"{_REGISTER}: context_parallel_dim={context_parallel_dim!r} must name one dimension of "
                         f"the mesh (dimensions: {names}), e.g. ('cp',)")
    return device_mesh[dims[0]].get_group()


def register_ring_attn_from_device_mesh(device_mesh, context_parallel_dim: Union[str, Sequence[str]],
                                        heads_k_stride: Optional[int] = None,
                                        ring_attn_func: Optional[Union[RingAttnFunc, str]] = None, *,
                                        model: Optional[torch.nn.Module] = None, verify: bool = True):
    """Record the CP group of ``device_mesh[context_parallel_dim]`` and patch transformers' flash-attention path
    with the ring function ``ring_attn_func`` (default ``varlen_llama3``); returns hfpatch's ``Patch``.

    heads_k_stride: llama3: K/V heads exchanged at a time (None: all at once).
    model:          (extension) also switch this model onto the patched flash path, even without flash-attn.
    verify:         (extension) hfpatch's numeric probe over the group (collective: call on every rank).

    Collective over the whole mesh. A second call replaces the first patch.
    """
    global _func
    func = _parse_func(ring_attn_func)
    stride = _session.check_stride(_REGISTER, heads_k_stride)
    group = _cp_group(device_mesh, context_parallel_dim)
    set_ring_attn_group(group)
    session = _session.install("axolotl", group, kernel=_PLANS[func][0], heads_k_stride=stride, model=model,
                               verify=verify)
    _func = func
    if func in (RingAttnFunc.BATCH_ZIGZAG, RingAttnFunc.BATCH_STRIPE, RingAttnFunc.VARLEN_ZIGZAG):
        # Until update_ring_attn_params describes a step, a call must not be taken for contiguous chunks.
        _session.set_step(session, _UPDATE, kernel="zigzag", layout="zigzag", batch=0,
                          seq_global=0, cu_seqlens=None)
    return session.patch


def update_ring_attn_params(position_ids: Optional[torch.Tensor]) -> None:
    """Describe this step from the WHOLE batch's ``position_ids`` (B, S), before it is split over the ranks:
    a single row whose positions restart (each document 0, 1, ...) is a packed row of documents.

    None: no position ids this step; accepted for the contiguous splits (the layout is then read from each
    call), refused for zigzag/stripe (their RoPE positions cannot be 0..S_local-1 anyway).
    """
    session = _session.current(_UPDATE, needs=_REGISTER)
    _, batch_plan, packed_plan = _PLANS[_func]
    if position_ids is None:
        if batch_plan[1] != "contiguous":
            raise UnsupportedArgument(
                "position_ids", None,
                f"ring_attn_func={_func.value} splits the sequence in the {batch_plan[1]} layout, which needs each "
                f"rank's global positions.",
                "pass the whole batch's position_ids (and each rank's part of them to the model).")
        if session.live:
            session.patch.ctx.set_step(None)
        return
    if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2:
        raise ValueError(f"{_UPDATE}: position_ids must be a (batch, seq_len) tensor of the WHOLE batch, got "
                         f"{type(position_ids).__name__} {tuple(getattr(position_ids, 'shape', ()))}")
    cu = _packed_cu_seqlens(position_ids)
    if cu is None:
        kernel, layout = batch_plan
    elif packed_plan is None:
        raise UnsupportedArgument(
            "position_ids", position_ids,
            f"a packed row (documents restarting at position 0) cannot be computed in ring_attn_func="
            f"{_func.value}'s row-level {batch_plan[1]} split without letting documents attend to each other.",
            "register with RingAttnFunc.VARLEN_LLAMA3 (or BATCH_RING) for packed rows, or VARLEN_ZIGZAG with the "
            "per-document zigzag split.")
    else:
        kernel, layout = packed_plan
    _session.set_step(session, _UPDATE, kernel=kernel, layout=layout, batch=position_ids.shape[0],
                      seq_global=position_ids.shape[1], cu_seqlens=cu)


def _packed_cu_seqlens(position_ids: torch.Tensor) -> Optional[torch.Tensor]:
    """GLOBAL int32 cu_seqlens of a packed single row (HF's rule), None for ordinary rows."""
    if position_ids.shape[0] != 1:
        return None  # HF treats packing only in a batch of one row
    return packed_cu_seqlens(position_ids[0].detach().cpu(), argument="position_ids")
