"""Input checks shared by every ring variant (batch and varlen). Each failure is a ``RingInputError``
(a ``ValueError``) naming the argument, the value given, the requirement and the fix.

The cross-rank metadata check (``check_ranks_agree``) runs once per call unless a set of already checked call
signatures is in effect. Two public ways to put one in effect, the same context variable underneath:

- ``with rank_check_scope(seen): ...`` -- the readable form;
- ``token = RANK_CHECKED.set(seen); try: ... finally: RANK_CHECKED.reset(token)`` -- the same scope without the
  scope object and its two Python methods (~1 us a call on CPython 3.11), for a caller on a per-layer hot path
  (hfpatch). Always reset with the token, in a ``finally``: a set that outlives its call would let other calls on
  this thread skip their check.
"""
from __future__ import annotations

import contextvars
import enum
import math
from typing import Optional, Sequence, Set, Tuple

import torch
import torch.distributed as dist

from .errors import RingInputError
from .options import get_options

__all__ = ["RingInputError", "check_qkv", "check_options", "check_sink", "resolve_scale", "check_ranks_agree",
           "require_causal", "rank_check_scope", "RANK_CHECKED", "LayoutCode"]

def check_qkv(fn: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, varlen: bool = False) -> None:
    """q (B, S, H, D) and k, v (B, S, Hk, D) consistent, H % Hk == 0. With ``varlen``: (T, H, D)/(T, Hk, D), or
    all three as one packed row (1, T, H, D)/(1, T, Hk, D) (HF's packed layout, see ``_check_varlen_rank``)."""
    layout = "(local_tokens, nheads, headdim)" if varlen else "(batch, seqlen_local, nheads, headdim)"
    ndim = _check_varlen_rank(fn, q, k, v) if varlen else 4
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != ndim:
            raise RingInputError(f"{fn}: {name} has shape {tuple(t.shape)}; expected {ndim} dims {layout}")
        if not t.is_floating_point():
            raise RingInputError(f"{fn}: {name} has dtype {t.dtype}; expected a floating dtype (bf16, fp16, fp32)")
    if k.shape != v.shape:
        raise RingInputError(f"{fn}: k has shape {tuple(k.shape)} but v has {tuple(v.shape)}; they must be equal")
    if q.shape[:-2] != k.shape[:-2]:
        what = "local token count" if varlen else "(batch, seqlen_local)"
        raise RingInputError(
            f"{fn}: q has {what} {tuple(q.shape[:-2])} but k/v have {tuple(k.shape[:-2])}; they must be equal "
            f"(self-attention over the same tokens; layout {layout})")
    if q.shape[-1] != k.shape[-1]:
        raise RingInputError(f"{fn}: q has head dim {q.shape[-1]} but k/v have {k.shape[-1]}; they must be equal")
    h, hk = q.shape[-2], k.shape[-2]
    if hk == 0 or h % hk != 0:
        raise RingInputError(
            f"{fn}: q has {h} heads and k/v have {hk}; nheads % nheads_k must be 0 (GQA groups of equal size)",
            argument="k", value=tuple(k.shape))
    if not (q.dtype == k.dtype == v.dtype):
        raise RingInputError(f"{fn}: dtypes differ (q {q.dtype}, k {k.dtype}, v {v.dtype}); cast them to one dtype")
    if not (q.device == k.device == v.device):
        raise RingInputError(f"{fn}: devices differ (q {q.device}, k {k.device}, v {v.device})")


def _check_varlen_rank(fn: str, q, k, v) -> int:
    """3 when q, k, v are all (T, H|Hk, D); 4 when all are one packed row (1, T, H|Hk, D); else an error."""
    # On every call of hfpatch's hot path: one comparison chain first, the messages only when it fails.
    if isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor):
        ndim = q.dim()
        if ndim == k.dim() == v.dim() and (ndim == 3 or (ndim == 4 and q.size(0) == k.size(0) == v.size(0) == 1)):
            return ndim
    tensors = (("q", q), ("k", k), ("v", v))
    for name, t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
    dims = {q.dim(), k.dim(), v.dim()}
    shapes = ", ".join(f"{name} {tuple(t.shape)}" for name, t in tensors)
    if dims == {4}:
        fix = ("a packed sequence is one row: concatenate the documents into batch 1 and describe them with "
               "cu_seqlens, or use the batch functions (ring_attn_func, ...) for a batch of separate sequences")
    elif dims <= {3, 4}:
        fix = "pass all three with the same number of dims (x[0] drops the batch dim of 1, x[None] adds it)"
    else:
        fix = "reshape them to (local_tokens, nheads, headdim)"
    raise RingInputError(
        f"{fn}: {shapes}; expected q, k, v all 3-D (local_tokens, nheads, headdim) or all 4-D with batch 1 "
        f"(1, local_tokens, nheads, headdim); {fix}", argument="q", value=tuple(q.shape))


def check_options(fn: str, *, window_size, softcap, dropout_p) -> Tuple[int, int]:
    """Validate window/softcap/dropout; return the window as a tuple of two ints."""
    if dropout_p:
        raise RingInputError(
            f"{fn}: dropout_p={dropout_p!r}; ring attention does not implement attention dropout, pass 0.0 "
            f"(e.g. run the model in eval mode or set attention_dropout=0)", argument="dropout_p", value=dropout_p)
    if (not isinstance(window_size, Sequence) or len(window_size) != 2
            or not all(isinstance(w, int) and not isinstance(w, bool) for w in window_size)):
        raise RingInputError(f"{fn}: window_size={window_size!r}; expected a pair of ints (left, right), -1 = unbounded",
                             argument="window_size", value=window_size)
    left, right = window_size
    if left < -1 or right < -1:
        raise RingInputError(f"{fn}: window_size={window_size!r}; each side must be >= 0 or -1 (unbounded)",
                             argument="window_size", value=window_size)
    if not isinstance(softcap, (int, float)) or isinstance(softcap, bool) or softcap < 0 or math.isnan(softcap):
        raise RingInputError(f"{fn}: softcap={softcap!r}; expected a float >= 0 (0 disables it)",
                             argument="softcap", value=softcap)
    return int(left), int(right)


def check_sink(fn: str, sink, nheads: int, device: torch.device) -> None:
    """``sink`` is None or a floating tensor (nheads,) on q's device (metadata only: no device sync)."""
    if sink is None:
        return
    if not isinstance(sink, torch.Tensor):
        raise TypeError(f"{fn}: sink must be a torch.Tensor of shape (nheads,) or None, got {type(sink).__name__}")
    if sink.shape != (nheads,):
        raise RingInputError(f"{fn}: sink has shape {tuple(sink.shape)}; expected (nheads,) = ({nheads},): one "
                             f"logit per query head", argument="sink", value=tuple(sink.shape))
    if not sink.is_floating_point():
        raise RingInputError(f"{fn}: sink has dtype {sink.dtype}; expected a floating dtype (the per-head logits)",
                             argument="sink", value=str(sink.dtype))
    if sink.device != device:
        raise RingInputError(f"{fn}: sink is on {sink.device} but q is on {device}; move it to q's device",
                             argument="sink", value=str(sink.device))


def require_causal(fn: str, causal: bool, alternative: str = "ring_attn_func") -> None:
    """Zigzag and stripe layouts exist to balance causal work; they do not implement non-causal attention."""
    if not causal:
        raise RingInputError(
            f"{fn}: causal=False is not supported by this layout (it balances causal work only); "
            f"use {alternative} for non-causal attention", argument="causal", value=causal)


def resolve_scale(fn: str, softmax_scale: Optional[float], head_dim: int) -> float:
    if softmax_scale is None:
        return head_dim ** -0.5
    if not isinstance(softmax_scale, (int, float)) or isinstance(softmax_scale, bool) or not math.isfinite(softmax_scale):
        raise RingInputError(f"{fn}: softmax_scale={softmax_scale!r}; expected a finite float or None (1/sqrt(headdim))",
                             argument="softmax_scale", value=softmax_scale)
    return float(softmax_scale)


_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float64: 3}


# The set of call signatures already checked in the current scope (None, the default: check every call). Public:
# see the module docstring (set/reset it with a token, or use rank_check_scope).
RANK_CHECKED: contextvars.ContextVar[Optional[Set[tuple]]] = contextvars.ContextVar("ring_kernels_rank_checked",
                                                                                    default=None)


class rank_check_scope:  # noqa: N801 -- used like a function: ``with rank_check_scope(seen):``
    """Within this scope a call whose metadata this rank already checked (recorded in ``checked``) is trusted.

    The cross-rank check is one all_gather plus a host synchronisation per call: ~0.8 ms of idle GPU per call on
    2×H200 (benchmarks/results/README.md). A caller that makes many identical calls per step (one per attention
    layer) passes one set per step: the first call of each distinct shape runs the collective, the others skip it.
    All ranks make the same calls in the same order, so they skip together; what a per-call check would still
    catch inside the scope is a rank whose shapes change while the others' do not, which then meets the next
    collective out of step (a hang, not a wrong result). hfpatch scopes each training step this way.
    (A class, not a generator context manager: it sits on hfpatch's per-layer hot path.)
    """

    __slots__ = ("checked", "_token")

    def __init__(self, checked: Set[tuple]):
        self.checked = checked
        self._token = None

    def __enter__(self) -> Set[tuple]:
        self._token = RANK_CHECKED.set(self.checked)
        return self.checked

    def __exit__(self, *exc) -> None:
        RANK_CHECKED.reset(self._token)


class LayoutCode(enum.IntEnum):
    """The "layout" field of a kernel's ``check_ranks_agree``: which kernel, and so which split of the sequence, a
    call was made for. Two ranks that call different kernels then fail together, naming the field, instead of
    exchanging blocks of different shapes. The values are what the ranks gather (numbers, never compared across
    releases of ring_kernels)."""

    RING = 0               # ring_attn_func: contiguous
    ZIGZAG = 1             # zigzag_ring_attn_func
    STRIPE = 2             # stripe_attn_func
    RING_VARLEN = 10       # ring_attn_varlen_func: contiguous documents
    ZIGZAG_VARLEN = 11     # zigzag_ring_attn_varlen_func
    LLAMA3_VARLEN = 12     # llama3_attn_varlen_func: contiguous, crossing K/V rows exchanged
    ULYSSES = 20           # ulysses_attn_func on contiguous shards (+ 1: zigzag, + 2: stripe)
    ULYSSES_ZIGZAG = 21
    ULYSSES_STRIPE = 22
    ULYSSES_VARLEN = 23    # ulysses_attn_varlen_func on contiguous documents (+ 1: zigzag)
    ULYSSES_VARLEN_ZIGZAG = 24
    USP_RING = 30          # usp_attn_func over ring_attn_func (+ 1: zigzag), checked on the whole group
    USP_ZIGZAG = 31
    USP_RING_VARLEN = 33   # usp_attn_varlen_func over ring_attn_varlen_func (+ 1: zigzag, + 2: llama3)
    USP_ZIGZAG_VARLEN = 34
    USP_LLAMA3_VARLEN = 35


def check_ranks_agree(fn: str, group, fields: Sequence[Tuple[str, float]], device: torch.device) -> None:
    """One all_gather of (name, value) metadata; raise on every rank if any rank differs.

    ``fields`` are numbers (shapes, flags, scale); call on every rank with the same names in the same order.
    Inside ``rank_check_scope`` a signature already checked is not checked again; with the option
    ``skip_rank_check`` (``ring_kernels.options``) nothing is checked.
    """
    world = dist.get_world_size(group)
    if world == 1 or get_options().skip_rank_check:
        return
    checked = RANK_CHECKED.get()
    key = (id(group), fn, tuple(fields))
    if checked is not None and key in checked:
        return
    gather_and_compare(fn, group, fields, device, world)
    if checked is not None:
        checked.add(key)


def gather_and_compare(fn: str, group, fields: Sequence[Tuple[str, float]], device: torch.device, world: int) -> None:
    on = device if dist.get_backend(group) == "nccl" else torch.device("cpu")
    mine = torch.tensor([float(v) for _, v in fields], dtype=torch.float64, device=on)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    table = torch.stack(gathered).cpu()
    for i, (name, _) in enumerate(fields):
        column = table[:, i].tolist()
        if any(x != column[0] for x in column):
            per_rank = ", ".join(f"rank {r}: {_fmt(x)}" for r, x in enumerate(column))
            raise RingInputError(
                f"{fn}: ranks disagree on {name} ({per_rank}); every rank of the group must call with the same "
                f"shapes and options (shard each sequence with ring_kernels.shard)",
                argument=name, value=[_fmt(x) for x in column])


def dtype_code(dtype: torch.dtype) -> int:
    return _DTYPE_CODES.get(dtype, -1)


def _fmt(x: float):
    return int(x) if float(x).is_integer() else x
