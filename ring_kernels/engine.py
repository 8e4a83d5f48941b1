"""The ring engine: blocks, the forward and backward ring loops, and the autograd function every ring layout
(``ring``, ``zigzag``, ``stripe``, and their varlen forms in ``varlen``) runs on.

A *layout* only decides which blocks one ring step computes: ``steps[s]`` lists the ``Block``s (local query
rows x rows of the visiting K/V, and a mask) of step s, whose K/V come from rank (r - s) mod N. Standard (no
window) blocks are FULL or aligned CAUSAL, so fast backends never need a dense mask. Steps with no block (keys
out of every query's reach) still pass K/V and partial sums along: every rank issues the same sequence of
exchanges. ``run_batch`` is the batch front end (validate, build the steps, pick the backend, run); ``varlen``
builds its steps from documents and calls ``RingAttention`` itself.

Attention sinks: an optional per-head logit joins every query's softmax as an extra key of value 0. The ring
computes the attention without it; ``merge.fold_sink`` folds it into the final (out, lse) once, and the backward
runs unchanged on the folded (out, lse) -- which are the probabilities with the sink -- plus ``merge.sink_grad``.

Forward: step s computes our queries against the K/V block of rank (r - s) mod N while the next block is
already in flight (``transport.make_exchange``: NCCL/gloo P2P by default, r -> r+1) and merges each block's
(out, lse) by their log-sum-exp (``merge``). After the last step rank r holds the block of rank (r + 1) mod N;
it is kept (saved for backward) rather than dropped.

Backward: the blocks in reverse order: step t = 0..N-1 revisits forward step N-1-t, i.e. the K/V of rank
(r + 1 + t) mod N: the saved block at t = 0 (no communication), our own k, v at t = N-1, and the blocks of
t = 1..N-2 received from rank r+1, one step ahead (K/V travel r -> r-1: N-2 hops; none with 2 ranks). The
dK/dV partial sum of a block travels with it, one step behind, also towards r-1: at step t rank r folds its
blocks' dk/dv into the partial received from r+1 (computed there at step t-1) and sends the sum on; at
t = N-1 the received partial holds the other N-1 ranks' contributions to our own K/V, our own blocks' are
folded in and the gradients are done: no hop follows the last compute.

Rounding (``rounding``): every value is rounded to its output dtype exactly once, and fp32 intermediates exist
only where a value receives >= 3 contributions. ``plan_steps`` plans the rows of the forward (out/lse), of dq
and of each dK/dV step from the blocks alone. With 2 ranks every row of every layout gets <= 2 contributions,
so there is no fp32 output or gradient buffer at all, and the dK/dV partial sums travel in k's dtype. With more
ranks the partial sums travel in fp32 and the last fold adds and casts in one pass. A world of one returns
the block's own tensors, no copy.

Memory: the saved last block costs one extra K/V block (the size of local k + v) per attention call, held
from forward to backward and freed after backward (under activation checkpointing it lives only during that
layer's recompute); the backward needs no K/V receive buffer with 2 ranks, one with 3, two with more. With
2 ranks the saved block is dead after the backward's first step, and its memory receives the dK/dV partial sum
(the backward's peak is one K/V block lower; measured in benchmarks/results/README.md, "Ring backward
memory"); a second backward through the same graph (``retain_graph=True``) then fetches the block again, one
K/V hop. Receive buffers and accumulators are allocated before the loops, the first dK/dV receive buffer when
step 0's compute is done; inside the loops only the backends allocate their block results.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from . import validation
from .backends import CAUSAL, FULL, GENERAL, get_backend
from .backends.base import BlockBackend, BlockMask
from .checkpointing import kept_forward
from .entry import KernelCall
from .merge import sink_grad
from .options import get_options
from .rounding import Part, RowPlan, accumulator, adoptable, fold_grads, fold_outputs, plan_rows, row_bounds
from .transport import make_exchange

__all__ = ["ALL", "Block", "RingConfig", "Plan", "plan_steps", "backward_order", "RingAttention", "run_batch",
           "positional_steps", "yield_to_transfer"]

ALL = slice(None)     # every row of a block


@dataclass(frozen=True)
class Block:
    """One backend call of a ring step: local query rows x rows of the visiting K/V block, and its mask."""

    q_rows: slice
    kv_rows: slice
    mask: BlockMask


@dataclass
class RingConfig:
    """Everything one call needs besides the tensors; ``steps[s]`` = blocks of step s (K/V from rank - s).
    ``plan`` (the contribution counts of ``steps``) is derived on first use and shared by forward and backward."""

    steps: List[List[Block]]
    backend: BlockBackend
    scale: float
    softcap: float
    group: object
    rank: int
    world: int
    plan: Optional["Plan"] = None


@dataclass(frozen=True)
class Plan:
    """Forward query rows (``q``): one plan over every block of every step, in forward order (out, lse).
    Backward query rows (``dq``): the same blocks in the backward's visiting order (steps reversed).
    K/V rows (``kv[t]``): backward step t over the blocks of forward step N-1-t; a step after the first starts
    from the partial sum received from the next rank (initial = 1)."""

    q: RowPlan
    dq: RowPlan
    kv: Tuple[RowPlan, ...]


def backward_order(steps: List[List[Block]]) -> List[List[Block]]:
    """The blocks of each backward step t: those of forward step N-1-t (K/V of rank (r + 1 + t) mod N)."""
    return steps[::-1]


def plan_steps(steps: List[List[Block]], seqlen_q: int, seqlen_k: int) -> Plan:
    """The rounding plans (``rounding.plan_rows``) of ``steps`` over seqlen_q query rows and seqlen_k K/V rows."""
    def q_ranges(order):
        return [row_bounds(b.q_rows, seqlen_q) for blocks in order for b in blocks]
    backward = backward_order(steps)
    kv = tuple(plan_rows([row_bounds(b.kv_rows, seqlen_k) for b in blocks], seqlen_k, initial=min(t, 1))
               for t, blocks in enumerate(backward))
    return Plan(plan_rows(q_ranges(steps), seqlen_q), plan_rows(q_ranges(backward), seqlen_q), kv)


def _plan_of(cfg: RingConfig, q: torch.Tensor, k: torch.Tensor) -> Plan:
    if cfg.plan is None:
        cfg.plan = plan_steps(cfg.steps, q.shape[1], k.shape[1])
    return cfg.plan


# ----------------------------------------------------------------------------------------------- forward

class _Outputs:
    """The forward's result buffers: out (B, S, H, D) in q's dtype, lse (B, H, S) fp32, and the fp32
    accumulator of rows with >= 3 blocks (out itself when q is fp32)."""

    def __init__(self, q: torch.Tensor, plan: RowPlan):
        b, s, h, _ = q.shape
        self.out = self.lse = None
        if not plan.adopt:
            self.out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
            self.lse = torch.empty((b, h, s), dtype=torch.float32, device=q.device)
            for rows in plan.untouched:                  # rows that see no key at all: out 0, lse -inf
                self.out[:, rows] = 0
                self.lse[:, :, rows] = float("-inf")
        wide = plan.accumulates and q.dtype != torch.float32
        self._acc = torch.empty(q.shape, dtype=torch.float32, device=q.device) if wide else None

    @property
    def acc(self) -> torch.Tensor:
        return self._acc if self._acc is not None else self.out

    def take(self, parts: Sequence[Part], out: torch.Tensor, lse: torch.Tensor, first: bool, dtype) -> None:
        """Fold one block's (out, lse) into the result, part by part (``first``: the adoptable block)."""
        if first and self.out is None:
            if adoptable(out, dtype) and lse.dtype == torch.float32:
                self.out, self.lse = out, lse            # the block's own buffers become the result
                return
            self.out = torch.empty(out.shape, dtype=dtype, device=out.device)
            self.lse = torch.empty(lse.shape, dtype=torch.float32, device=lse.device)
        fold_outputs(parts, out, lse, self.out, self.lse, self.acc)


def yield_to_transfer(q: torch.Tensor) -> None:
    """Hold the compute stream for the option ``forward_yield_us`` microseconds (``ring_kernels.options``;
    default 25, 0 turns it off; a one-thread spin kernel) right after the forward's first K/V transfer was
    issued, before the first block's attention kernel. CUDA only.

    Why: an attention kernel that fills every SM, launched at the same moment as NCCL's SendRecv kernel, keeps
    that kernel from getting SMs until its own tail, and the transfer then runs exposed. With the pause the
    transfer's kernel is resident before the attention kernel starts (the measured effect of the default:
    benchmarks/results/README.md, "Forward yield"). The backward does not need it: cuDNN's small pre-kernel
    (dO.O) gives NCCL the moment."""
    cycles = _yield_cycles(get_options().forward_yield_us, q.device)
    if cycles > 0:
        torch.cuda._sleep(cycles)


# (microseconds, device) -> spin cycles (0: no pause; always 0 off CUDA). The device's clock is looked up once
# per (setting, device), not on every call (varlen calls are host-bound: every host microsecond shows).
YIELD_CYCLES = {}


def _yield_cycles(us: float, device: torch.device) -> int:
    key = (us, device)
    cycles = YIELD_CYCLES.get(key)
    if cycles is None:
        cycles = 0
        if us > 0.0 and device.type == "cuda":
            rate_khz = getattr(torch.cuda.get_device_properties(device), "clock_rate", 0) or 1_980_000
            cycles = int(us * rate_khz / 1000.0)
        YIELD_CYCLES[key] = cycles
    return cycles


def forward_pass(q, k, v, cfg: RingConfig):
    """Ring forward: q (B, S, H, D), k/v (B, S, Hk, D) -> out (B, S, H, D) in q's dtype, lse (B, H, S) fp32,
    and the K/V block of the last step (that of rank (r + 1) mod N, in a receive buffer; None for a world of
    one), which the backward visits first."""
    plan = _plan_of(cfg, q, k).q
    result = _Outputs(q, plan)
    exchange = make_exchange(cfg.group, tag=0)
    # Two receive buffers alternate (the one just computed on may still be read by the send in flight).
    buffers = [(torch.empty_like(k), torch.empty_like(v)) for _ in range(min(2, cfg.world - 1))]
    current = (k, v)
    contributor = 0
    for step, blocks in enumerate(cfg.steps):
        incoming = buffers[step % 2] if step + 1 < cfg.world else None
        if incoming is not None:
            exchange.start(current, incoming)       # next block travels while this one computes
            if step == 0:
                yield_to_transfer(q)
        for block in blocks:
            out, lse = cfg.backend.forward(
                q[:, block.q_rows], current[0][:, block.kv_rows], current[1][:, block.kv_rows],
                scale=cfg.scale, mask=block.mask, softcap=cfg.softcap)
            result.take(plan.parts[contributor], out, lse, plan.adopt and contributor == 0, q.dtype)
            contributor += 1
        if incoming is not None:
            exchange.wait()
            current = incoming
    return result.out, result.lse, (current if cfg.world > 1 else None)


# ---------------------------------------------------------------------------------------------- backward


class _QueryGrads:
    """dq (B, S, H, D) in q's dtype: the first block's own dq when it covers every row, else a buffer."""

    def __init__(self, q: torch.Tensor, plan: RowPlan):
        self.plan, self.dtype = plan, q.dtype
        self.dq = None if plan.adopt else torch.zeros_like(q) if plan.untouched else torch.empty_like(q)
        wide = plan.accumulates and q.dtype != torch.float32
        self.spare = torch.empty(q.shape, dtype=torch.float32, device=q.device) if wide else None

    def take(self, index: int, dq: torch.Tensor) -> None:
        if index == 0 and self.dq is None:
            if adoptable(dq, self.dtype):
                self.dq = dq
                return
            self.dq = torch.empty(dq.shape, dtype=self.dtype, device=dq.device)
        fold_grads(self.plan.parts[index], dq, self.dq, self.dq, accumulator(self.dq, self.dq, self.spare))


def _fold_hop(hop: RowPlan, grads, holder, result, spare, skip_first: bool = False) -> None:
    """One step of the dK/dV partial sums: ``result = holder + this rank's blocks``, per K/V tensor (dk, dv).
    ``holder`` is None on step 0 (nothing received: rows no block reaches are zeroed); ``skip_first``: the
    first block's gradients are ``result`` itself (adopted)."""
    for i in range(2):
        held, res = holder[i] if holder is not None else None, result[i]
        acc = accumulator(res, held if held is not None else res, spare[i] if spare is not None else None)
        for rows in hop.untouched:
            if held is None:
                res[:, rows] = 0                      # K/V rows that no query of ours sees
            elif held is not res:
                res[:, rows] = held[:, rows]          # passed on (cast on the last step)
        for index, (parts, g) in enumerate(zip(hop.parts, grads)):
            if not (skip_first and index == 0):
                fold_grads(parts, g[i], held if held is not None else res, res, acc)


def _backward(dout, q, k, v, out, lse, last, cfg: RingConfig, first_recv: Optional[tuple] = None):
    """Ring backward from the merged ``out`` (q's dtype) and ``lse`` (fp32): (dq, dk, dv) like q, k, v.

    ``last``: the K/V block the forward ended on (rank (r + 1) mod N's; None for a world of one). Step t
    visits the K/V of rank (r + 1 + t) mod N: ``last`` at t = 0, our own k, v at t = N-1, received from the
    next rank in between. The dK/dV partial sum of that block comes from the next rank (it started there one
    step earlier), takes our blocks' gradients and goes on to the previous rank; at t = N-1 it is ours, whole.
    ``first_recv`` (2 ranks only): the buffers (k's and v's shapes, k's dtype) that receive the first partial
    sum instead of new ones: ``RingAttention`` passes the memory of ``last``, dead after step 0 (the receive is
    ordered after step 0's kernels: it starts after them, and both transports order their streams after the
    current one), so the backward holds one K/V-sized buffer less at its peak.
    """
    plan, world = _plan_of(cfg, q, k), cfg.world
    order = backward_order(cfg.steps)
    dq = _QueryGrads(q, plan.dq)
    # Partial sums travel in k's dtype with 2 ranks (each K/V row: the next rank's contribution, then ours,
    # rounded once), in fp32 with more (the last fold casts). A world of one: step 0 is the last, in k's dtype.
    travel = k.dtype if world <= 2 else torch.float32
    adopt_first = plan.kv[0].adopt and travel == k.dtype

    def kv_like(dtype):
        return (torch.empty(k.shape, dtype=dtype, device=k.device), torch.empty(v.shape, dtype=dtype, device=v.device))

    # partial[0]: step 0's result (adopted from the first block when it covers every K/V row), partial[1]: what
    # the next rank sends. They alternate as holders (a holder is folded into in place and sent on). partial[1]
    # is allocated when step 0's compute is done (it is not alive during it), or is the memory of ``last`` (see first_recv).
    if first_recv is not None and not (world == 2 and travel == k.dtype):
        raise AssertionError("first_recv needs 2 ranks (partial sums in k's dtype, of k's and v's shapes)")
    partial = [None if adopt_first else kv_like(travel), None]
    lean = k.dtype != torch.float32 and world <= 2 and any(h.accumulates for h in plan.kv)
    spare = kv_like(torch.float32) if lean else None
    # K/V blocks of steps 1..N-2 are received (N-2 hops); two buffers alternate as in the forward. With
    # N >= 3 and k not fp32 the finished dK/dV land in buffers[0], free by the last step.
    hops = max(0, world - 2)
    buffers = [(torch.empty_like(k), torch.empty_like(v)) for _ in range(min(2, hops))]
    kv_exchange = make_exchange(cfg.group, tag=0, reverse=True)
    dkv_exchange = make_exchange(cfg.group, tag=1, reverse=True)
    current = last if world > 1 else (k, v)
    contributor, result = 0, None
    for t, blocks in enumerate(order):
        final = t == world - 1
        incoming = buffers[t % 2] if t < hops else None
        if incoming is not None:
            kv_exchange.start(current, incoming)      # the block of step t+1 travels while this one computes
        grads = []
        for block in blocks:
            rows = block.q_rows
            dq_b, dk_b, dv_b = cfg.backend.backward(
                dout[:, rows], q[:, rows], current[0][:, block.kv_rows], current[1][:, block.kv_rows],
                out[:, rows], lse[:, :, rows], scale=cfg.scale, mask=block.mask, softcap=cfg.softcap)
            dq.take(contributor, dq_b)
            contributor += 1
            grads.append((dk_b, dv_b))
        if dkv_exchange.in_flight:
            dkv_exchange.wait()                       # the next rank's partial sum for this K/V block
        if t == 0:
            adopted = False
            if partial[0] is None:                    # the first block covers every K/V row: keep its grads
                adopted = all(adoptable(g, k.dtype) for g in grads[0])
                partial[0] = grads[0] if adopted else kv_like(k.dtype)
            result = partial[0]
            _fold_hop(plan.kv[0], grads, None, result, spare, skip_first=adopted)
        else:
            holder = partial[t % 2]
            result = holder if (not final or holder[0].dtype == k.dtype) else buffers[0]
            _fold_hop(plan.kv[t], grads, holder, result, spare)
        if not final:
            if partial[1] is None:                    # t == 0: the receive buffer of the first hop
                partial[1] = first_recv if first_recv is not None else kv_like(travel)
            dkv_exchange.start(result, partial[(t + 1) % 2])   # on to the previous rank, one step behind K/V
        if incoming is not None:
            kv_exchange.wait()
            current = incoming
        elif t + 1 == world - 1:
            current = (k, v)                          # the last step visits our own block: nothing to receive
    return dq.dq, result[0], result[1]


def _alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor on ``t``'s memory with its own version counter: writing through it does not make autograd's
    check of the saved ``t`` fail (``ctx.last_reused`` says the content is gone instead)."""
    return t.new_empty(0).set_(t.untyped_storage(), t.storage_offset(), t.shape, t.stride())


def _refetch_last(k: torch.Tensor, v: torch.Tensor, cfg: RingConfig) -> Tuple[torch.Tensor, torch.Tensor]:
    """The K/V block of rank (r + 1) mod N again (one K/V hop r -> r-1, every rank at once): for a second
    backward through the same graph (``retain_graph=True``) after the first reused the kept block's memory."""
    again = (torch.empty_like(k), torch.empty_like(v))
    exchange = make_exchange(cfg.group, tag=0, reverse=True)
    exchange.start((k, v), again)
    exchange.wait()
    return again


class RingAttention(torch.autograd.Function):
    """q (B, S, H, D), k, v (B, S, Hk, D), sink (H,) or None -> out (B, S, H, D): the ring of ``cfg.steps``."""

    @staticmethod
    def forward(ctx, q, k, v, sink, cfg: RingConfig):
        # out in q's dtype, each row rounded once; a recomputation of a kept checkpoint region takes the
        # forward's own out and lse and runs no ring (ring_kernels.checkpointing).
        forward = kept_forward(q, "ring attention", sink, lambda: forward_pass(q, k, v, cfg))
        out, lse = forward.out, forward.lse
        if forward.replayed:
            # k and v stand in the last K/V block's saved slots (shapes, dtypes and count as the forward saved
            # them: non-reentrant checkpointing compares the two); the backward fetches the block again.
            last = (k, v) if cfg.world > 1 else None
        else:
            (last,) = forward.extra
        # Whether the saved "last" slots will hold k, v: a kept output's recomputation saves those. The flag must
        # be set in the forward too: non-reentrant checkpointing runs the backward on the forward's ctx with the
        # tensors the recomputation saved (reentrant checkpointing, on the recomputation's own ctx).
        stand_in = forward.replayed or forward.kept
        ctx.cfg = cfg
        # The last K/V block (one extra K/V block, freed after backward) saves the backward's first hop. It is a
        # saved tensor (not a ctx attribute) so that activation checkpointing drops and recomputes it.
        # Saved: q, k, v, out, lse, then the kept K/V block (2 tensors, N > 1), then the sink (when given).
        ctx.has_sink = sink is not None
        ctx.save_for_backward(q, k, v, out, lse, *(last or ()), *((sink,) if ctx.has_sink else ()))
        ctx.last_reused = False                       # set by a backward that received into the kept block
        ctx.last_stand_in = stand_in
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, *rest = ctx.saved_tensors
        sink = rest.pop() if ctx.has_sink else None
        cfg = ctx.cfg
        last = tuple(rest) or None
        dout = dout.contiguous()
        dsink = sink_grad(dout, out, lse, sink) if sink is not None and ctx.needs_input_grad[3] else None
        if last is not None and (ctx.last_reused or ctx.last_stand_in):
            last = _refetch_last(k, v, cfg)           # retain_graph after the block's reuse, or a kept output's call
        # With 2 ranks the kept block is dead after the backward's first step: its memory receives the partial sum.
        first_recv = None
        if last is not None and cfg.world == 2:
            first_recv = tuple(_alias(t) for t in last)
            ctx.last_reused = True
        dq, dk, dv = _backward(dout, q, k, v, out, lse, last, cfg, first_recv)
        return dq, dk, dv, dsink, None


# ------------------------------------------------------------------------------------ batch front end

def _mask_kind(causal: bool, window: Tuple[int, int]) -> str:
    if window != (-1, -1):
        return GENERAL
    return CAUSAL if causal else FULL


def _out_of_reach(q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool, window: Tuple[int, int]) -> bool:
    """True when no query can see any key, judged from position ranges only (O(S), no dense mask)."""
    q_min, q_max, k_min, k_max = int(q_pos.min()), int(q_pos.max()), int(k_pos.min()), int(k_pos.max())
    left, right = window
    return ((causal and k_min > q_max) or (left >= 0 and k_max < q_min - left)
            or (right >= 0 and k_min > q_max + right))


def positional_steps(positions: Callable[[int], torch.Tensor], rank: int, world: int, causal: bool,
                      window: Tuple[int, int]) -> List[List[Block]]:
    """Blocks for any layout given the global positions of each rank's tokens: one masked block per step;
    steps whose keys are out of every query's reach are dropped (the rest may still be EMPTY for the backend).
    Used when a window makes the blocks irregular."""
    q_pos = positions(rank)
    steps = []
    for step in range(world):
        k_pos = positions((rank - step) % world)
        skip = _out_of_reach(q_pos, k_pos, causal, window)
        steps.append([] if skip else [Block(ALL, ALL, BlockMask(causal=causal, q_pos=q_pos, k_pos=k_pos,
                                                                    window=window))])
    return steps


def _positions_to(steps: List[List[Block]], device: torch.device) -> List[List[Block]]:
    """Move masks' position tensors to the device of q, where backends build dense masks from them."""
    def moved(mask: BlockMask) -> BlockMask:
        if mask.q_pos is None or mask.q_pos.device == device:
            return mask
        return replace(mask, q_pos=mask.q_pos.to(device), k_pos=mask.k_pos.to(device))
    return [[Block(b.q_rows, b.kv_rows, moved(b.mask)) for b in blocks] for blocks in steps]


def run_batch(fn: str, q, k, v, *, group, causal, softmax_scale, backend, window_size, softcap, dropout_p, sink,
              layout_code: validation.LayoutCode,
              make_steps: Callable[[int, int, int, bool, Tuple[int, int]], List[List[Block]]]):
    """Validate (``entry.KernelCall``), build the per-step blocks for this rank, pick the backend, and run the
    autograd ring."""
    call = KernelCall(fn, q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                      softcap=softcap, dropout_p=dropout_p, sink=sink)
    call.agree_batch(group, q, k, layout_code)
    chosen = get_backend(backend, device=q.device, dtype=q.dtype, head_dim=q.shape[-1],
                         mask_kind=_mask_kind(causal, call.window), softcap=call.softcap)
    steps = _positions_to(make_steps(call.rank, call.world, q.shape[1], call.causal, call.window), q.device)
    cfg = RingConfig(steps, chosen, call.scale, call.softcap, group, call.rank, call.world)
    return RingAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), sink, cfg)
