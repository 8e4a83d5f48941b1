"""Drop-in for ring-flash-attn's public API, on hfpatch's guarantees: change the import, keep the script.

    - from ring_flash_attn import substitute_hf_flash_attn, update_ring_flash_attn_params
    + from hfpatch.dropin.ring_flash_attn import substitute_hf_flash_attn, update_ring_flash_attn_params

HF adapter (``substitute_hf_flash_attn``, ``update_ring_flash_attn_params``, ``use_ring_attn``): the script packs
documents into one row, calls ``update_ring_flash_attn_params(cu_seqlens, group)`` with the GLOBAL cu_seqlens
every step, and feeds each rank ``torch.chunk(input_ids, world, dim=1)[rank]`` (and the same chunk of the
position ids). Underneath is ``hfpatch.apply(group, kernel="llama3")``: every binding site and transformers
release, verification, masks/windows/softcap/sinks honoured or refused, ``remove()``.

Kernel entry points: ring-flash-attn's names, argument order and layouts, computed by ``ring_kernels``:

====================================  =====================================================================
function (+ ``_kvpacked``/``_qkvpacked``)  what each rank holds
====================================  =====================================================================
``ring_flash_attn_func``              q (B, S/N, H, D): contiguous chunk r of the sequence
``zigzag_ring_flash_attn_func``       chunks r and 2N-1-r of 2N (causal only)
``stripe_flash_attn_func``            tokens t with t mod N == r (causal only)
``ring_flash_attn_varlen_func``       q (T/N, H, D): the r-th of N equal pieces of EVERY document;
                                      ``cu_seqlens`` LOCAL (= global // N); every length divisible by N
``zigzag_ring_flash_attn_varlen_func``  pieces r and 2N-1-r of 2N of every document; LOCAL ``cu_seqlens``
``llama3_flash_attn_varlen_func``     contiguous chunk r of the packed row; metadata from
                                      ``llama3_flash_attn_prepare_cu_seqlens(cu_seqlens, causal, rank, N)``
====================================  =====================================================================

Every function returns the output only; ``dropout_p`` > 0, ``alibi_slopes`` and ``return_attn_probs=True``
raise ``UnsupportedArgument`` (see ``_flash_args``). Extensions (keyword-only, after ring-flash-attn's
arguments): ``softcap`` (flash-attn's logit soft-capping) on every kernel function, ``model=`` on
``substitute_hf_flash_attn``.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

import ring_kernels
from hfpatch import switch
from hfpatch.dropin import _llama3_meta, _relayout, _session
from hfpatch.dropin._flash_args import check_flash_options, unpack

__all__ = [
    "substitute_hf_flash_attn", "update_ring_flash_attn_params", "use_ring_attn",
    "ring_flash_attn_func", "ring_flash_attn_kvpacked_func", "ring_flash_attn_qkvpacked_func",
    "zigzag_ring_flash_attn_func", "zigzag_ring_flash_attn_kvpacked_func", "zigzag_ring_flash_attn_qkvpacked_func",
    "stripe_flash_attn_func", "stripe_flash_attn_kvpacked_func", "stripe_flash_attn_qkvpacked_func",
    "ring_flash_attn_varlen_func", "ring_flash_attn_varlen_kvpacked_func", "ring_flash_attn_varlen_qkvpacked_func",
    "zigzag_ring_flash_attn_varlen_func", "zigzag_ring_flash_attn_varlen_kvpacked_func",
    "zigzag_ring_flash_attn_varlen_qkvpacked_func",
    "llama3_flash_attn_varlen_func", "llama3_flash_attn_varlen_kvpacked_func",
    "llama3_flash_attn_varlen_qkvpacked_func", "llama3_flash_attn_prepare_cu_seqlens",
]

_SUBSTITUTE = "substitute_hf_flash_attn"
_UPDATE = "update_ring_flash_attn_params"


# ------------------------------------------------------------------------------------------ HF adapter


def substitute_hf_flash_attn(process_group: dist.ProcessGroup, heads_k_stride: Optional[int], *,
                             model: Optional[torch.nn.Module] = None, verify: bool = True):
    """Give transformers' flash-attention path llama3 ring attention over ``process_group``; returns the ``Patch``.

    heads_k_stride: K/V heads exchanged at a time (must divide the model's K/V heads; None: all at once).
    model:          (extension) also switch this model onto the patched flash path, even without flash-attn
                    installed; a model loaded with ``attn_implementation="flash_attention_2"`` needs nothing.
    verify:         (extension) run hfpatch's numeric probe over the group (a collective: call on every rank).

    Collective: call it on every rank of the group (None: the default group, as in ring-flash-attn). A second
    call replaces the first patch (ring-flash-attn's second call fails); ``patch.remove()`` restores transformers
    exactly. A group of one rank (or no process group at all) gives an inactive patch and leaves transformers
    untouched: the script then runs without CP.
    """
    stride = _session.check_stride(_SUBSTITUTE, heads_k_stride)
    if process_group is None and dist.is_initialized():
        process_group = dist.group.WORLD  # ring-flash-attn's None is torch.distributed's default group
    return _session.install("ring_flash_attn", process_group, kernel="llama3", heads_k_stride=stride,
                            model=model, verify=verify).patch


def update_ring_flash_attn_params(cu_seqlens: torch.Tensor, process_group: dist.ProcessGroup) -> None:
    """Describe this step's packed row: ``cu_seqlens`` are the GLOBAL cumulative document lengths (int,
    (num_docs + 1,), identical on every rank, ``cu_seqlens[-1]`` = the whole row). Each rank then feeds the
    model its contiguous chunk (``torch.chunk(x, world_size, dim=1)[rank]``). No collective."""
    session = _session.current(_UPDATE, needs=_SUBSTITUTE)
    cu = _llama3_meta.check_cu_seqlens(_UPDATE, "cu_seqlens", cu_seqlens)
    _check_same_group(_UPDATE, process_group, session)
    _session.set_step(session, _UPDATE, kernel="llama3", layout="contiguous", batch=1, seq_global=int(cu[-1]),
                      cu_seqlens=cu.to(torch.int32))


def _check_same_group(fn: str, process_group, session) -> None:
    if not session.live or not dist.is_initialized():
        return
    ctx = session.patch.ctx
    given = (dist.get_rank(process_group), dist.get_world_size(process_group))
    if given != (ctx.rank, ctx.world_size):
        raise ValueError(f"{fn}: process_group has rank {given[0]} of {given[1]}, but the patch runs over rank "
                         f"{ctx.rank} of {ctx.world_size}; pass the group given to {_SUBSTITUTE}")


def use_ring_attn(flag: bool) -> None:
    """True: attention runs the ring (default); False: transformers' original function on the local tensors.

    Sets hfpatch's process-wide switch (``hfpatch.set_switch``); a ``with hfpatch.switch(...)`` block still
    overrides it per thread, and ``patch.remove()`` restores the previous default."""
    if not isinstance(flag, bool):
        raise TypeError(f"use_ring_attn(flag={flag!r}): flag must be True (ring attention) or False (original)")

    switch.set_switch("ring" if flag else "original")


# ------------------------------------------------------------------------------------------- batch


def _batch(fn: str, kernel: str, q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
           deterministic, return_attn_probs, group, softcap):
    window = check_flash_options(fn, dropout_p=dropout_p, alibi_slopes=alibi_slopes, deterministic=deterministic,
                                 return_attn_probs=return_attn_probs, window_size=window_size)
    return getattr(ring_kernels, kernel)(q, k, v, group=group, causal=causal, softmax_scale=softmax_scale,
                                         window_size=window, softcap=softcap)


def ring_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                         alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None, *, softcap=0.0):
    """q (B, S/N, H, D), k/v (B, S/N, Hk, D): contiguous chunk r of the sequence -> out (B, S/N, H, D)."""
    return _batch("ring_flash_attn_func", "ring_attn_func", q, k, v, dropout_p, softmax_scale, causal, window_size,
                  alibi_slopes, deterministic, return_attn_probs, group, softcap)


def ring_flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                  alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None, *,
                                  softcap=0.0):
    """q (B, S/N, H, D), kv (B, S/N, 2, Hk, D) -> out (B, S/N, H, D)."""
    fn = "ring_flash_attn_kvpacked_func"
    k, v = unpack(fn, "kv", kv, 2, dim=2)
    return _batch(fn, "ring_attn_func", q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
                  deterministic, return_attn_probs, group, softcap)


def ring_flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                   alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None, *,
                                   softcap=0.0):
    """qkv (B, S/N, 3, H, D) -> out (B, S/N, H, D)."""
    fn = "ring_flash_attn_qkvpacked_func"
    q, k, v = unpack(fn, "qkv", qkv, 3, dim=2)
    return _batch(fn, "ring_attn_func", q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
                  deterministic, return_attn_probs, group, softcap)


def zigzag_ring_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None, *,
                                softcap=0.0):
    """q (B, S/N, H, D): chunks r and 2N-1-r of the sequence cut in 2N -> out (B, S/N, H, D). Causal only."""
    return _batch("zigzag_ring_flash_attn_func", "zigzag_ring_attn_func", q, k, v, dropout_p, softmax_scale, causal,
                  window_size, alibi_slopes, deterministic, return_attn_probs, group, softcap)


def zigzag_ring_flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                                         window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                                         return_attn_probs=False, group=None, *, softcap=0.0):
    """q (B, S/N, H, D), kv (B, S/N, 2, Hk, D) in the zigzag split -> out (B, S/N, H, D)."""
    fn = "zigzag_ring_flash_attn_kvpacked_func"
    k, v = unpack(fn, "kv", kv, 2, dim=2)
    return _batch(fn, "zigzag_ring_attn_func", q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
                  deterministic, return_attn_probs, group, softcap)


def zigzag_ring_flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                                          window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                                          return_attn_probs=False, group=None, *, softcap=0.0):
    """qkv (B, S/N, 3, H, D) in the zigzag split -> out (B, S/N, H, D)."""
    fn = "zigzag_ring_flash_attn_qkvpacked_func"
    q, k, v = unpack(fn, "qkv", qkv, 3, dim=2)
    return _batch(fn, "zigzag_ring_attn_func", q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
                  deterministic, return_attn_probs, group, softcap)


def stripe_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                           alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None, *,
                           softcap=0.0):
    """q (B, S/N, H, D): tokens t with t mod N == r -> out (B, S/N, H, D). Causal only."""
    return _batch("stripe_flash_attn_func", "stripe_attn_func", q, k, v, dropout_p, softmax_scale, causal,
                  window_size, alibi_slopes, deterministic, return_attn_probs, group, softcap)


def stripe_flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None, *,
                                    softcap=0.0):
    """q (B, S/N, H, D), kv (B, S/N, 2, Hk, D) in the stripe split -> out (B, S/N, H, D)."""
    fn = "stripe_flash_attn_kvpacked_func"
    k, v = unpack(fn, "kv", kv, 2, dim=2)
    return _batch(fn, "stripe_attn_func", q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
                  deterministic, return_attn_probs, group, softcap)


def stripe_flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                     alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None, *,
                                     softcap=0.0):
    """qkv (B, S/N, 3, H, D) in the stripe split -> out (B, S/N, H, D)."""
    fn = "stripe_flash_attn_qkvpacked_func"
    q, k, v = unpack(fn, "qkv", qkv, 3, dim=2)
    return _batch(fn, "stripe_attn_func", q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
                  deterministic, return_attn_probs, group, softcap)


# ------------------------------------------------------------------------------------------ varlen


def _rank_world(group):
    return (dist.get_rank(group), dist.get_world_size(group)) if dist.is_initialized() else (0, 1)


def _global_from_local(fn: str, cu_seqlens, q: torch.Tensor, world: int, pieces: int) -> torch.Tensor:
    """GLOBAL cu_seqlens (CPU int64) from ring-flash-attn's LOCAL ones (every document split into ``pieces``)."""
    cu = _llama3_meta.check_cu_seqlens(fn, "cu_seqlens", cu_seqlens)
    if isinstance(q, torch.Tensor) and q.dim() >= 1 and int(cu[-1]) != q.shape[0]:
        raise ValueError(
            f"{fn}: cu_seqlens[-1]={int(cu[-1])} but q holds {q.shape[0]} local tokens; ring-flash-attn's varlen "
            f"functions take this rank's LOCAL cu_seqlens (the global ones // world_size={world})")
    if pieces > world and bool(((cu[1:] - cu[:-1]) % (pieces // world)).any()):
        raise ValueError(f"{fn}: local document lengths {(cu[1:] - cu[:-1]).tolist()[:16]} must be even: every "
                         f"document is split into 2 x world_size pieces, two per rank")
    return cu * world


def _varlen(fn: str, q, k, v, cu_seqlens, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
            deterministic, return_attn_probs, group, softcap, *, zigzag: bool):
    window = check_flash_options(fn, dropout_p=dropout_p, alibi_slopes=alibi_slopes, deterministic=deterministic,
                                 return_attn_probs=return_attn_probs, window_size=window_size)
    rank, world = _rank_world(group)
    cu = _global_from_local(fn, cu_seqlens, q, world, 2 * world if zigzag else world)
    options = dict(group=group, causal=causal, softmax_scale=softmax_scale, window_size=window, softcap=softcap)
    if zigzag:  # ring-flash-attn's per-document zigzag is ring_kernels' varlen "zigzag" layout
        return ring_kernels.zigzag_ring_attn_varlen_func(q, k, v, cu.to(torch.int32), **options)
    if world == 1:
        return ring_kernels.ring_attn_varlen_func(q, k, v, cu.to(torch.int32), **options)
    # ring-flash-attn splits every document over the ranks; ring_kernels' ring splits the packed stream: move the
    # tokens there and back (one all-gather each way; the backward is the adjoint reduce-scatter).
    source = [_relayout.per_document_positions(cu, r, world) for r in range(world)]
    target = _relayout.contiguous_positions(int(cu[-1]), rank, world)
    moved = [_relayout.relayout(t, source, target, group, world) for t in (q, k, v)]
    out = ring_kernels.ring_attn_varlen_func(*moved, cu.to(torch.int32), **options)
    back = [_relayout.contiguous_positions(int(cu[-1]), r, world) for r in range(world)]
    return _relayout.relayout(out, back, source[rank], group, world)


def ring_flash_attn_varlen_func(q, k, v, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                                return_attn_probs=False, group=None, *, softcap=0.0):
    """q (T/N, H, D), k/v (T/N, Hk, D): the r-th of N equal pieces of every document, documents in order;
    ``cu_seqlens`` LOCAL (global // N). ``max_seqlen`` is not needed. -> out (T/N, H, D)."""
    return _varlen("ring_flash_attn_varlen_func", q, k, v, cu_seqlens, dropout_p, softmax_scale, causal,
                   window_size, alibi_slopes, deterministic, return_attn_probs, group, softcap, zigzag=False)


def ring_flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None,
                                         causal=False, window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                                         return_attn_probs=False, group=None, *, softcap=0.0):
    """q (T/N, H, D), kv (T/N, 2, Hk, D) in the per-document split -> out (T/N, H, D)."""
    fn = "ring_flash_attn_varlen_kvpacked_func"
    k, v = unpack(fn, "kv", kv, 2, dim=1)
    return _varlen(fn, q, k, v, cu_seqlens, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
                   deterministic, return_attn_probs, group, softcap, zigzag=False)


def ring_flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None,
                                          causal=False, window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                                          return_attn_probs=False, group=None, *, softcap=0.0):
    """qkv (T/N, 3, H, D) in the per-document split -> out (T/N, H, D)."""
    fn = "ring_flash_attn_varlen_qkvpacked_func"
    q, k, v = unpack(fn, "qkv", qkv, 3, dim=1)
    return _varlen(fn, q, k, v, cu_seqlens, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
                   deterministic, return_attn_probs, group, softcap, zigzag=False)


def zigzag_ring_flash_attn_varlen_func(q, k, v, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None,
                                       causal=False, window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                                       return_attn_probs=False, group=None, *, softcap=0.0):
    """q (T/N, H, D): pieces r and 2N-1-r of 2N of every document; ``cu_seqlens`` LOCAL (global // N). Causal."""
    return _varlen("zigzag_ring_flash_attn_varlen_func", q, k, v, cu_seqlens, dropout_p, softmax_scale, causal,
                   window_size, alibi_slopes, deterministic, return_attn_probs, group, softcap, zigzag=True)


def zigzag_ring_flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None,
                                                causal=False, window_size=(-1, -1), alibi_slopes=None,
                                                deterministic=False, return_attn_probs=False, group=None, *,
                                                softcap=0.0):
    """q (T/N, H, D), kv (T/N, 2, Hk, D) in the per-document zigzag split -> out (T/N, H, D)."""
    fn = "zigzag_ring_flash_attn_varlen_kvpacked_func"
    k, v = unpack(fn, "kv", kv, 2, dim=1)
    return _varlen(fn, q, k, v, cu_seqlens, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
                   deterministic, return_attn_probs, group, softcap, zigzag=True)


def zigzag_ring_flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None,
                                                 causal=False, window_size=(-1, -1), alibi_slopes=None,
                                                 deterministic=False, return_attn_probs=False, group=None, *,
                                                 softcap=0.0):
    """qkv (T/N, 3, H, D) in the per-document zigzag split -> out (T/N, H, D)."""
    fn = "zigzag_ring_flash_attn_varlen_qkvpacked_func"
    q, k, v = unpack(fn, "qkv", qkv, 3, dim=1)
    return _varlen(fn, q, k, v, cu_seqlens, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
                   deterministic, return_attn_probs, group, softcap, zigzag=True)


# ------------------------------------------------------------------------------------------- llama3


def llama3_flash_attn_prepare_cu_seqlens(cu_seqlens: torch.Tensor, causal: bool, rank: int, world_size: int):
    """This rank's llama3 metadata for the GLOBAL ``cu_seqlens``: ``(cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
    max_seqlen_k, local_k_slice)``, the same values as ring-flash-attn's function (see ``_llama3_meta``)."""
    return _llama3_meta.prepare(cu_seqlens, causal, rank, world_size)


def _llama3(fn: str, q, k, v, cu_seqlens_q, local_k_slice, heads_k_stride, dropout_p, softmax_scale, causal,
            window_size, alibi_slopes, deterministic, return_attn_probs, group, softcap):
    window = check_flash_options(fn, dropout_p=dropout_p, alibi_slopes=alibi_slopes, deterministic=deterministic,
                                 return_attn_probs=return_attn_probs, window_size=window_size)
    local = q.shape[0] if isinstance(q, torch.Tensor) and q.dim() == 3 else -1
    cu = _llama3_meta.global_cu_seqlens(cu_seqlens_q, local_k_slice, local, group)
    return ring_kernels.llama3_attn_varlen_func(q, k, v, cu.to(q.device), group=group, causal=causal,
                                                softmax_scale=softmax_scale, window_size=window, softcap=softcap,
                                                heads_k_stride=heads_k_stride)


def llama3_flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, heads_k_stride,
                                  local_k_slice, dropout_p=0.0, softmax_scale=None, causal=False,
                                  window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                                  return_attn_probs=False, group=None, *, softcap=0.0):
    """q (T/N, H, D), k/v (T/N, Hk, D): contiguous chunk r of the packed row; the metadata comes from
    ``llama3_flash_attn_prepare_cu_seqlens`` (``cu_seqlens_k``/``max_seqlen_*`` are implied by it).
    ``heads_k_stride`` K/V heads are exchanged at a time. -> out (T/N, H, D)."""
    return _llama3("llama3_flash_attn_varlen_func", q, k, v, cu_seqlens_q, local_k_slice, heads_k_stride, dropout_p,
                   softmax_scale, causal, window_size, alibi_slopes, deterministic, return_attn_probs, group,
                   softcap)


def llama3_flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                           heads_k_stride, local_k_slice, dropout_p=0.0, softmax_scale=None,
                                           causal=False, window_size=(-1, -1), alibi_slopes=None,
                                           deterministic=False, return_attn_probs=False, group=None, *, softcap=0.0):
    """q (T/N, H, D), kv (T/N, 2, Hk, D), contiguous chunk r -> out (T/N, H, D)."""
    fn = "llama3_flash_attn_varlen_kvpacked_func"
    k, v = unpack(fn, "kv", kv, 2, dim=1)
    return _llama3(fn, q, k, v, cu_seqlens_q, local_k_slice, heads_k_stride, dropout_p, softmax_scale, causal,
                   window_size, alibi_slopes, deterministic, return_attn_probs, group, softcap)


def llama3_flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                            heads_k_stride, local_k_slice, dropout_p=0.0, softmax_scale=None,
                                            causal=False, window_size=(-1, -1), alibi_slopes=None,
                                            deterministic=False, return_attn_probs=False, group=None, *,
                                            softcap=0.0):
    """qkv (T/N, 3, H, D), contiguous chunk r -> out (T/N, H, D)."""
    fn = "llama3_flash_attn_varlen_qkvpacked_func"
    q, k, v = unpack(fn, "qkv", qkv, 3, dim=1)
    return _llama3(fn, q, k, v, cu_seqlens_q, local_k_slice, heads_k_stride, dropout_p, softmax_scale, causal,
                   window_size, alibi_slopes, deterministic, return_attn_probs, group, softcap)
