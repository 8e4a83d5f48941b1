"""Ulysses attention: sequence parallelism by heads -- one all-to-all before attention, one after.

Inputs are sequence-sharded as for every ring variant: rank r of N holds q (B, S, H, D) and k, v (B, S, Hk, D)
of its S = L / N tokens, in one of ``ring_kernels.layout``'s layouts (``layout=``: ``"contiguous"``,
``"zigzag"``, ``"stripe"``), so a caller that sharded for a ring variant calls Ulysses unchanged. Three steps:

1. an all-to-all swaps the split: rank r sends rank j head group j of its tokens and receives head group r of
   every rank's tokens; the copy that unpacks the receive buffer also undoes the layout's permutation. Rank r
   then holds the whole sequence, in natural order, for query heads [r*H/N, (r+1)*H/N) and the K/V heads
   they read: q (B, L, H/N, D), k, v (B, L, Hk', D).
2. ordinary attention over the whole sequence on those heads, through the block backends the ring variants
   use (``backends.get_backend``: torch's CPU flash, cuDNN, flash, Triton, the reference), with causal masks,
   sliding windows, softcap and sinks as on one device. Packed documents (``ulysses_attn_varlen_func``) need
   no ring logic: every rank sees whole documents, one block per document -- or one packed-document kernel
   call for all of them where ``varlen_kernel_for`` serves the backend (CUDA).
3. the inverse all-to-all returns out (B, S, H, D) in the caller's shard order.

Both all-to-alls are autograd functions whose backward is the inverse all-to-all: 4 all-to-alls forward (q, k,
v, then out) and 4 backward (dout, then dq, dk, dv). q, k and v are issued at once (asynchronously), and each
is unpacked as soon as its own transfer is done, while the next ones are still in flight; so are dq, dk, dv.

Heads: nheads must divide by N (``RingInputError`` otherwise, naming the fix). K/V heads: when Hk divides by N
each rank gets Hk/N of them. When it does not, every K/V head is sent ``kv_replication(H, Hk, N)`` = N /
gcd(Hk, N) times (that number divides H/Hk, so each rank's query heads read whole K/V heads): the K/V traffic
of the head split grows by that factor, and the replicas' gradients are summed on the way back.

Traffic per rank and call: (N-1)/N of q, k, v and out forward, of their gradients backward, for any N (a
ring moves the whole K/V N-1 times). Memory: the gathered q, k, v, out of H/N heads over the whole sequence
(the size of the local ones), plus one send and one receive buffer per tensor in flight.

Sinks: rank r folds the logits of its heads [r*H/N, (r+1)*H/N); its sink gradient is 0 for the other heads,
and the sum over the group is the whole gradient, as in every ring variant. ``dropout_p`` must be 0.

``head_exchange`` and ``head_parallel`` are the all-to-all pair around any attention on the head split;
``usp`` runs a ring variant between them.
"""
from __future__ import annotations

import math
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .backends import CAUSAL, EMPTY, FULL, get_backend
from .backends.base import BlockBackend
from .backends.torch_cuda_varlen import VarlenKernel, VarlenSegments, segments_from_lengths, varlen_kernel_for
from .checkpointing import kept_forward
from .comm import group_rank_and_size
from .documents import StepBuilder, VarlenCall, classify
from .engine import ALL, Block
from .entry import KernelCall
from .layout import LAYOUTS, check_zigzag_documents, rank_positions
from .merge import sink_grad
from .validation import LayoutCode, RingInputError

__all__ = ["ulysses_attn_func", "ulysses_attn_varlen_func", "kv_replication", "check_heads", "check_zigzag_length",
           "HeadExchange", "ExchangeIndices", "exchange_indices", "head_exchange", "head_parallel",
           "all_to_all_single", "cached_indices"]

# The one collective, looked up at every call: replaceable (tests count the calls through it, and
# benchmarks/_nocomm.py times Ulysses without communication by putting a local copy in its place).
all_to_all_single = dist.all_to_all_single

_VARLEN_LAYOUTS = ("contiguous", "zigzag")
# The "layout" field of the ranks' agreement check, per (layout, varlen).
_LAYOUT_CODES = {("contiguous", False): LayoutCode.ULYSSES, ("zigzag", False): LayoutCode.ULYSSES_ZIGZAG,
                 ("stripe", False): LayoutCode.ULYSSES_STRIPE, ("contiguous", True): LayoutCode.ULYSSES_VARLEN,
                 ("zigzag", True): LayoutCode.ULYSSES_VARLEN_ZIGZAG}


# -------------------------------------------------------------------------------------------- checks


def kv_replication(nheads: int, nheads_k: int, world: int) -> int:
    """How many times each K/V head is sent so that every rank's H/N query heads read whole K/V heads: 1 when
    N divides Hk, else N / gcd(Hk, N). That divides the GQA group H/Hk whenever N divides H (N | Hk*G), so the
    replicated heads still form groups of query heads (requires nheads % world == 0)."""
    replicas = world // math.gcd(nheads_k, world)
    assert (nheads // nheads_k) % replicas == 0, (nheads, nheads_k, world)
    return replicas


def check_heads(fn: str, nheads: int, world: int, group: str = "group") -> None:
    """Ulysses gives each of the ``world`` ranks of ``group`` nheads / world query heads."""
    if nheads % world:
        divisors = [n for n in range(2, nheads + 1) if nheads % n == 0]
        raise RingInputError(
            f"{fn}: nheads={nheads} is not divisible by the size of {group}, {world}; Ulysses gives every rank "
            f"nheads / world_size query heads. Use a {group} of {divisors or [1]} ranks (USP: a smaller "
            f"ulysses_group and the other ranks in ring_group), or a ring variant (ring_attn_func, "
            f"zigzag_ring_attn_func), which splits only the sequence", argument="nheads", value=nheads)


def _layout_code(fn: str, layout, *, varlen: bool) -> LayoutCode:
    if layout not in LAYOUTS:
        raise RingInputError(
            f"{fn}: layout={layout!r} is not a layout; expected one of {LAYOUTS} (how the sequence was sharded: "
            f"ring_kernels.shard's layout)", argument="layout", value=layout)
    if varlen and layout not in _VARLEN_LAYOUTS:
        raise RingInputError(
            f"{fn}: layout={layout!r} has no varlen form (ring_kernels.shard splits packed documents "
            f"{' or '.join(map(repr, _VARLEN_LAYOUTS))}); shard the packed sequence with one of those",
            argument="layout", value=layout)
    return _LAYOUT_CODES[layout, varlen]


def check_zigzag_length(fn: str, seqlen: int) -> None:
    """A zigzag shard holds two equal chunks: ``seqlen`` (this rank's tokens per row) must be even."""
    if seqlen % 2:
        raise RingInputError(
            f"{fn}: q has seqlen_local={seqlen}; layout='zigzag' holds two chunks per rank, so seqlen_local must be "
            f"even: make the global length a multiple of 2 * world_size (pad it)", argument="q", value=seqlen)


# ------------------------------------------------------------------------------------------ exchange


@dataclass(frozen=True)
class HeadExchange:
    """Where the all-to-alls of one call move rows: ``group`` of ``world`` ranks (this one is ``rank``), local
    tensors of ``batch`` rows x ``seqlen`` tokens.

    The receive buffer of the sequence-to-heads all-to-all is (world, batch, seqlen, h, D): block j is rank j's
    tokens. ``gather`` (batch * world * seqlen,) int64 on the device: row b*L + p of the head-split tensor
    (B, L, h, D) -- position p of batch row b in the order the attention takes (the natural order for Ulysses,
    the ring shard's local order for USP) -- is row ``gather[b*L + p]`` of that buffer flattened;
    ``scatter`` is its inverse, for the way back. Both None when the buffer already is in natural order (one
    batch row, contiguous layout: the unpacking is a view)."""

    group: object
    rank: int
    world: int
    batch: int
    seqlen: int
    gather: Optional[torch.Tensor] = None
    scatter: Optional[torch.Tensor] = None


class ExchangeIndices:
    """The host (gather, scatter) of one layout and shape (``HeadExchange``'s fields), and their copies per device
    (made once)."""

    def __init__(self, gather: Optional[torch.Tensor], scatter: Optional[torch.Tensor]):
        self.host = (gather, scatter)
        self._devices: Dict[torch.device, Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]] = {}

    def on(self, device: torch.device):
        found = self._devices.get(device)
        if found is None:
            found = self._devices[device] = tuple(None if t is None else t.to(device) for t in self.host)
        return found


def exchange_indices(order: torch.Tensor, world: int, batch: int, seqlen: int) -> ExchangeIndices:
    """The indices of an exchange over ``world`` ranks of (``batch``, ``seqlen``) tensors. ``order[i]``: the
    position in the head-split sequence (of world * seqlen tokens) of row i = j*seqlen + s of the rank-major
    concatenation (rank j's local token s): its natural position for Ulysses, its place in the ring shard for
    USP."""
    total = world * seqlen
    if batch == 1 and torch.equal(order, torch.arange(total)):
        return ExchangeIndices(None, None)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(total)
    b = torch.arange(batch).view(batch, 1)
    gather = (inverse // seqlen) * (batch * seqlen) + b * seqlen + inverse % seqlen         # (batch, total)
    scatter = b.view(1, batch, 1) * total + order.view(world, 1, seqlen)                    # (world, batch, seqlen)
    return ExchangeIndices(gather.reshape(-1), scatter.reshape(-1))


def _order(layout: str, world: int, seqlen: int, cu: Optional[torch.Tensor] = None) -> torch.Tensor:
    total = world * seqlen
    return torch.cat([rank_positions(total, j, world, layout=layout, cu_seqlens=cu) for j in range(world)])


_BATCH_INDICES: "OrderedDict[tuple, ExchangeIndices]" = OrderedDict()   # key -> indices, newest last
_BATCH_INDICES_SIZE = 32
_LOCK = threading.Lock()


def cached_indices(key: tuple, build: Callable[[], ExchangeIndices]) -> ExchangeIndices:
    """The exchange indices of ``key`` (Ulysses' and USP's batch calls), built once by ``build``; the
    ``_BATCH_INDICES_SIZE`` most recent are kept."""
    with _LOCK:
        found = _BATCH_INDICES.get(key)
        if found is not None:
            _BATCH_INDICES.move_to_end(key)
            return found
    found = build()
    with _LOCK:
        _BATCH_INDICES[key] = found
        while len(_BATCH_INDICES) > _BATCH_INDICES_SIZE:
            _BATCH_INDICES.popitem(last=False)
    return found


def _batch_indices(layout: str, world: int, batch: int, seqlen: int) -> ExchangeIndices:
    return cached_indices(("ulysses", layout, world, batch, seqlen),
                          lambda: exchange_indices(_order(layout, world, seqlen), world, batch, seqlen))


def head_exchange(group, layout: str, batch: int, seqlen: int, device: torch.device) -> HeadExchange:
    """The exchange of a call over ``group`` whose local tensors are (batch, seqlen, ...) in ``layout``."""
    rank, world = group_rank_and_size(group)
    if world == 1:
        return HeadExchange(group, 0, 1, batch, seqlen)
    gather, scatter = _batch_indices(layout, world, batch, seqlen).on(device)
    return HeadExchange(group, rank, world, batch, seqlen, gather, scatter)


def _pack_heads(x: torch.Tensor, world: int, replicas: int) -> torch.Tensor:
    """(B, S, Hx, D) -> the send buffer (world, B, S, Hx * replicas / world, D): block j is head group j (each
    head ``replicas`` times in a row)."""
    b, s, hx, d = x.shape
    if replicas > 1:
        x = x.unsqueeze(3).expand(b, s, hx, replicas, d).reshape(b, s, hx * replicas, d)
    return x.reshape(b, s, world, -1, d).permute(2, 0, 1, 3, 4).contiguous()


def _unpack_sequence(recv: torch.Tensor, ex: HeadExchange) -> torch.Tensor:
    """Receive buffer (world, B, S, h, D) -> (B, world * S, h, D) in natural order (one copy, or a view)."""
    rows = recv.view(-1, *recv.shape[3:])
    if ex.gather is not None:
        rows = rows.index_select(0, ex.gather)
    return rows.view(ex.batch, ex.world * ex.seqlen, *recv.shape[3:])


def _pack_sequence(y: torch.Tensor, ex: HeadExchange) -> torch.Tensor:
    """(B, world * S, h, D) in natural order -> the send buffer (world, B, S, h, D): block j is rank j's tokens."""
    rows = y.reshape(-1, *y.shape[2:])
    rows = rows.index_select(0, ex.scatter) if ex.scatter is not None else rows.contiguous()
    return rows.view(ex.world, ex.batch, ex.seqlen, *y.shape[2:])


def _unpack_heads(recv: torch.Tensor, replicas: int) -> torch.Tensor:
    """Receive buffer (world, B, S, h, D) -> (B, S, world * h / replicas, D): the head groups side by side, the
    replicas of each head summed (torch accumulates half-precision sums in fp32: one rounding)."""
    n, b, s, h, d = recv.shape
    x = recv.permute(1, 2, 0, 3, 4).reshape(b, s, n * h, d)
    if replicas > 1:
        x = x.view(b, s, n * h // replicas, replicas, d).sum(3)
    return x


def _exchange(sends: Sequence[torch.Tensor], group, unpack: Callable[[int, torch.Tensor], torch.Tensor]):
    """All-to-all of every send buffer, all issued at once; buffer i is unpacked as soon as it has arrived."""
    pending = []
    for send in sends:
        recv = torch.empty_like(send)
        pending.append((recv, all_to_all_single(recv, send, group=group, async_op=True)))
    results = []
    for i, (recv, work) in enumerate(pending):
        work.wait()
        results.append(unpack(i, recv))
    return results


def seq_to_heads(xs: Sequence[torch.Tensor], replicas: Sequence[int], ex: HeadExchange) -> List[torch.Tensor]:
    """Sequence split -> head split: each (B, S, Hx, D) -> (B, world * S, Hx * replicas / world, D)."""
    sends = [_pack_heads(x, ex.world, r) for x, r in zip(xs, replicas)]
    return _exchange(sends, ex.group, lambda i, recv: _unpack_sequence(recv, ex))


def heads_to_seq(ys: Sequence[torch.Tensor], replicas: Sequence[int], ex: HeadExchange) -> List[torch.Tensor]:
    """Head split -> sequence split (``seq_to_heads``' inverse; replicated heads summed)."""
    sends = [_pack_sequence(y, ex) for y in ys]
    return _exchange(sends, ex.group, lambda i, recv: _unpack_heads(recv, replicas[i]))


class _SeqToHeads(torch.autograd.Function):
    """q, k, v sequence-sharded -> their head split (``seq_to_heads``); backward: ``heads_to_seq``."""

    @staticmethod
    def forward(ctx, ex: HeadExchange, replicas: Tuple[int, ...], *xs):
        ctx.ex, ctx.replicas = ex, replicas
        return tuple(seq_to_heads(xs, replicas, ex))

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, *heads_to_seq(grads, ctx.replicas, ctx.ex))


class _HeadsToSeq(torch.autograd.Function):
    """out's head split -> out sequence-sharded (``heads_to_seq``); backward: ``seq_to_heads``."""

    @staticmethod
    def forward(ctx, ex: HeadExchange, y):
        ctx.ex = ex
        return heads_to_seq([y], (1,), ex)[0]

    @staticmethod
    def backward(ctx, grad):
        return None, seq_to_heads([grad], (1,), ctx.ex)[0]


def head_parallel(q, k, v, sink, ex: HeadExchange, attend: Callable) -> torch.Tensor:
    """q (B, S, H, D), k, v (B, S, Hk, D), sequence-sharded over ``ex.group`` -> out (B, S, H, D), where
    ``attend(qh, kh, vh, sink_h)`` computes the attention of this rank's head split (qh (B, world * S, H /
    world, D), kh, vh with the K/V heads they read, sink_h the sink logits of its heads or None), differentiable.
    Requires H % world == 0 (``check_heads``)."""
    if ex.world == 1:
        return attend(q.contiguous(), k.contiguous(), v.contiguous(), sink).contiguous()
    h, hk = q.shape[2], k.shape[2]
    replicas = kv_replication(h, hk, ex.world)
    qh, kh, vh = _SeqToHeads.apply(ex, (1, replicas, replicas), q, k, v)
    heads = h // ex.world
    sink_h = sink[ex.rank * heads:(ex.rank + 1) * heads] if sink is not None else None
    return _HeadsToSeq.apply(ex, attend(qh, kh, vh, sink_h))


# ----------------------------------------------------------------------------------------- attention


@dataclass
class _Attention:
    """The attention of the head split: ``blocks`` with disjoint query rows and disjoint key rows that cover
    every row (one block of all rows, or one per document), or -- ``kernel`` given -- one packed-document
    kernel call over ``segments``."""

    blocks: List[Block]
    backend: BlockBackend
    scale: float
    softcap: float
    kernel: Optional[VarlenKernel] = None
    segments: Optional[VarlenSegments] = None

    def whole(self) -> Optional[Block]:
        """The one block of every row, or None."""
        return self.blocks[0] if len(self.blocks) == 1 and self.blocks[0].q_rows == ALL else None


def _attend(q, k, v, cfg: _Attention):
    """out (B, T, h, D) in q's dtype and lse (B, h, T) fp32; every row is computed by exactly one block."""
    if cfg.kernel is not None:
        out, lse = cfg.kernel.forward(q[0], k[0], v[0], cfg.segments, scale=cfg.scale)
        return out.unsqueeze(0), lse.unsqueeze(0)
    whole = cfg.whole()
    if whole is not None:
        return cfg.backend.forward(q, k, v, scale=cfg.scale, mask=whole.mask, softcap=cfg.softcap)
    b, t, h, _ = q.shape
    out = torch.empty_like(q)
    lse = torch.empty((b, h, t), dtype=torch.float32, device=q.device)
    for blk in cfg.blocks:
        o, l = cfg.backend.forward(q[:, blk.q_rows], k[:, blk.kv_rows], v[:, blk.kv_rows], scale=cfg.scale,
                                   mask=blk.mask, softcap=cfg.softcap)
        out[:, blk.q_rows] = o
        lse[:, :, blk.q_rows] = l
    return out, lse


def _attend_backward(dout, q, k, v, out, lse, cfg: _Attention):
    """(dq, dk, dv) like q, k, v from the (sink-folded) out and lse; each row written by one block."""
    if cfg.kernel is not None:
        grads = cfg.kernel.backward(dout[0], q[0], k[0], v[0], out[0], lse[0], cfg.segments, scale=cfg.scale)
        return tuple(g.unsqueeze(0) for g in grads)
    whole = cfg.whole()
    if whole is not None:
        return cfg.backend.backward(dout, q, k, v, out, lse, scale=cfg.scale, mask=whole.mask, softcap=cfg.softcap)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    for blk in cfg.blocks:
        qr, kr = blk.q_rows, blk.kv_rows
        dq[:, qr], dk[:, kr], dv[:, kr] = cfg.backend.backward(
            dout[:, qr], q[:, qr], k[:, kr], v[:, kr], out[:, qr], lse[:, :, qr], scale=cfg.scale, mask=blk.mask,
            softcap=cfg.softcap)
    return dq, dk, dv


class _HeadAttention(torch.autograd.Function):
    """qh (B, T, h, D), kh, vh (B, T, hk, D), sink (h,) or None -> out (B, T, h, D): ``_Attention`` on the head
    split. A sink is folded into the finished (out, lse) as the ring engine does (``merge.fold_sink``); in a
    kept checkpoint region (``ring_kernels.checkpointing``) the recomputation takes the forward's out and lse."""

    @staticmethod
    def forward(ctx, q, k, v, sink, cfg: _Attention):
        forward = kept_forward(q, "ulysses attention", sink, lambda: _attend(q, k, v, cfg))
        ctx.cfg = cfg
        ctx.save_for_backward(q, k, v, forward.out, forward.lse, *((sink,) if sink is not None else ()))
        return forward.out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, *sink = ctx.saved_tensors
        sink = sink[0] if sink else None
        dout = dout.contiguous()
        dsink = sink_grad(dout, out, lse, sink) if sink is not None and ctx.needs_input_grad[3] else None
        dq, dk, dv = _attend_backward(dout, q, k, v, out, lse, ctx.cfg)
        return dq, dk, dv, dsink, None


def _run(cfg: _Attention) -> Callable:
    return lambda qh, kh, vh, sink_h: _HeadAttention.apply(qh, kh, vh, sink_h, cfg)


# ------------------------------------------------------------------------------------------ batch


def ulysses_attn_func(q, k, v, *, group=None, causal=False, softmax_scale=None, backend="auto",
                      window_size=(-1, -1), softcap=0.0, dropout_p=0.0, sink=None, layout="contiguous"):
    """Attention over a sequence sharded across ``group`` in ``layout``, by Ulysses' head split.

    q: (B, S_local, H, D); k, v: (B, S_local, Hk, D), H % Hk == 0 and H % world_size == 0 (K/V heads are
    replicated where Hk % world_size != 0: module docstring); rank r holds the tokens ``ring_kernels.shard(x,
    group, layout=layout)`` gives it (``"contiguous"``, ``"zigzag"`` (S_local even) or ``"stripe"``). Returns
    out (B, S_local, H, D) in q's dtype, in the same shard order; differentiable in q, k, v and sink.
    ``causal`` True or False with every layout (each rank attends over the whole sequence). ``window_size``
    (left, right) and ``softcap`` follow flash-attn (computed where the chosen backend can: ``backend="auto"``
    picks one); ``dropout_p`` must be 0.
    ``sink``: None, or attention-sink logits (H,) -- any float dtype, on q's device, may require grad: every
    query's softmax gets one extra key per head with this logit and value 0 (gpt-oss's ``s_aux``). Its
    gradient on each rank is the partial sum over that rank's queries; the sum over the group is the whole
    gradient (what the usual gradient all-reduce computes). Every rank passes a sink or none does.
    """
    fn = "ulysses_attn_func"
    call = KernelCall(fn, q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                      softcap=softcap, dropout_p=dropout_p, sink=sink)
    code = _layout_code(fn, layout, varlen=False)
    call.agree_batch(group, q, k, code)
    b, s, h, d = q.shape
    world = call.world
    check_heads(fn, h, world)
    if layout == "zigzag" and world > 1:
        check_zigzag_length(fn, s)
    kind, mask = classify(0, world * s, 0, world * s, call.causal, call.window)
    chosen = get_backend(backend, device=q.device, dtype=q.dtype, head_dim=d, mask_kind=kind, softcap=call.softcap)
    cfg = _Attention([Block(ALL, ALL, mask)], chosen, call.scale, call.softcap)
    return head_parallel(q, k, v, sink, head_exchange(group, layout, b, s, q.device), _run(cfg))


# ----------------------------------------------------------------------------------------- varlen


class _VarlenPlan:
    """One varlen call's host plan (cached per cu_seqlens: ``CuEntry.get``): the exchange's indices, and one
    block per non-empty document over the whole packed sequence (``documents.classify``: FULL, aligned CAUSAL,
    or GENERAL with a window), their most general ``kind`` and ``lengths``; per device the packed-document
    kernel's segments."""

    def __init__(self, cu: torch.Tensor, layout: str, world: int, local: int, causal: bool,
                 window: Tuple[int, int]):
        self.indices = exchange_indices(_order(layout, world, local, cu), world, 1, local) if world > 1 else None
        builder = StepBuilder()
        self.blocks: List[Block] = []
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
            if b > a:
                kind, mask = classify(a, b, a, b, causal, window)
                builder.add(self.blocks, kind, mask, slice(a, b), slice(a, b))
        self.kind = builder.kind
        self.lengths = [blk.q_rows.stop - blk.q_rows.start for blk in self.blocks]
        self.causal = causal
        self._segments: Dict[torch.device, VarlenSegments] = {}

    def exchange(self, group, rank: int, world: int, local: int, device: torch.device) -> HeadExchange:
        if self.indices is None:
            return HeadExchange(group, 0, 1, 1, local)
        return HeadExchange(group, rank, world, 1, local, *self.indices.on(device))

    def segments(self, device: torch.device) -> VarlenSegments:
        if device not in self._segments:
            self._segments[device] = segments_from_lengths(self.lengths, self.lengths, self.causal, device)
        return self._segments[device]


def ulysses_attn_varlen_func(q, k, v, cu_seqlens, *, group=None, causal=False, softmax_scale=None,
                             backend="auto", window_size=(-1, -1), softcap=0.0, dropout_p=0.0, sink=None,
                             layout="contiguous"):
    """Attention over packed documents sharded across ``group`` in ``layout``, by Ulysses' head split.

    q: (T_local, H, D); k, v: (T_local, Hk, D) -- or all three as HF's packed row (1, T_local, H|Hk, D); H %
    world_size == 0. ``cu_seqlens`` (int32 (num_docs + 1,), identical on every rank) are the cumulative lengths
    of the global packed sequence, as for ``ring_attn_varlen_func``; rank r holds what ``ring_kernels.shard(x,
    group, layout=layout, dim=0, cu_seqlens=cu_seqlens)`` gives it: ``"contiguous"`` (documents may cross rank
    boundaries) or ``"zigzag"`` (every document length divisible by 2 x world_size). A token attends to its own
    document only (causally when ``causal``). Returns out of q's shape and dtype, in the same shard order;
    differentiable. ``window_size``, ``softcap``, ``dropout_p`` and ``sink``: as ``ulysses_attn_func``.
    """
    fn = "ulysses_attn_varlen_func"
    code = _layout_code(fn, layout, varlen=True)
    call = VarlenCall(fn, q, k, v, cu_seqlens, group=group, causal=causal, softmax_scale=softmax_scale,
                      window_size=window_size, softcap=softcap, dropout_p=dropout_p, sink=sink, layout_code=code)
    check_heads(fn, q.shape[-2], call.world)
    if layout == "zigzag" and call.world > 1:
        # Cached only once it passed (a failing check raises again on every call).
        call.entry.get(("ulysses zigzag documents", call.world), lambda: check_zigzag_documents(
            call.cu, call.world, fn=fn, instead="shard with layout='contiguous'"))
    plan = call.entry.get(("ulysses", layout, call.world, call.local, call.causal, call.window),
                          lambda: _VarlenPlan(call.cu, layout, call.world, call.local, call.causal, call.window))
    head_dim = q.shape[-1]
    chosen = get_backend(backend, device=q.device, dtype=q.dtype, head_dim=head_dim,
                         mask_kind=FULL if plan.kind == EMPTY else plan.kind, softcap=call.softcap)
    kernel = None
    if plan.kind in (FULL, CAUSAL):                   # no window: one packed-document call can do every block
        kernel = varlen_kernel_for(backend, chosen.name, device=q.device, dtype=q.dtype, head_dim=head_dim,
                                   softcap=call.softcap, document_lengths=[(n, n) for n in plan.lengths])
    cfg = _Attention(plan.blocks, chosen, call.scale, call.softcap, kernel,
                     plan.segments(q.device) if kernel is not None else None)
    ex = plan.exchange(group, call.rank, call.world, call.local, q.device)
    if q.dim() == 4:                                  # HF's packed row (1, T, H, D): the batch layout itself
        return head_parallel(q, k, v, sink, ex, _run(cfg))
    out = head_parallel(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), sink, ex, _run(cfg))
    return out.squeeze(0)
