"""Packed-document (varlen) blocks on torch's own CUDA flash op: every document of a step in one call.

The block backends compute one (query rows x key rows) block per call; with dozens of packed documents a
ring step is dozens of small calls, each far below the kernel's rate. ``aten._flash_attention_forward`` /
``_backward`` (FlashAttention-2 inside torch) take packed tensors with cumulative lengths instead:

    q:    (Tq, H,  D)   documents back to back; document i is q[cu_q[i]:cu_q[i+1]]
    k, v: (Tk, Hk, D)   document i is k[cu_k[i]:cu_k[i+1]]; H % Hk == 0 (GQA native, nothing repeated)
    out:  (Tq, H,  D)   dtype of q
    lse:  (H,  Tq)      float32 (this module converts the padded (B, H, max_q) form older builds return)

``is_causal`` is BOTTOM-RIGHT aligned (a document's last query sees its last key); every caller here passes
aligned documents (same query and key positions) or non-causal ones, where the alignment does not matter.
Checked against the ops' schemas and meta kernels on torch 2.13 (outputs 3/4 are called ``rng_state``/
``unused`` there, ``philox_seed``/``philox_offset`` on 2.4-2.11; both are passed back positionally, and
only ``scale`` is passed by keyword, so the same call works on both).

A ``VarlenSegments`` describes one call's documents; ``varlen_kernel_for`` says whether this path serves a
backend choice (the ``"torch_flash"`` backend, or ``"auto"`` when its per-document calls would cost more), and
notes each time it does in ``choices`` (backend ``"torch_flash_varlen"``, mask ``documents``).

What "cost more" counts (``CudnnShapes``): cuDNN builds an execution graph for every new (query rows, key rows)
shape, whose host time (``_CUDNN_GRAPH_BUILD_S``, forward and backward together) is far above that of a call on
a shape it has built, and packed documents of varied lengths bring new shapes at every step. So a shape cuDNN has
not built costs its graph, unless the calls that went to flash for it already lost that much against cuDNN's
kernel (rent or buy: a shape that keeps coming back is built, one seen a few times is not). The measurements
behind it: docs/performance.md#sfttrainer-on-2-gpus.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Protocol, Sequence, Tuple

import torch

from .choices import note, shape_class

__all__ = ["VarlenSegments", "VarlenKernel", "TorchFlashVarlen", "varlen_kernel_for", "CudnnShapes", "CUDNN_SHAPES",
           "segments_from_rows", "segments_from_lengths"]

_HALF = (torch.float16, torch.bfloat16)
# Measured on H200, causal fwd+bwd, 32 heads x 128: torch flash
# 286 TFLOP/s, cuDNN 528. A per-document call costs Python, launches and an fp32 merge/accumulate besides
# its kernel: ~100 us fwd+bwd estimated (dozens of documents ran at 14-30 TFLOP/s), not calibrated per GPU.
_FLASH_FLOPS_PER_S = 286e12
_CUDNN_FLOPS_PER_S = 528e12
_PER_BLOCK_OVERHEAD_S = 100e-6
# Host time of cuDNN's graph build for a shape it has not seen, forward + backward: 0.3 s on average over 30 new
# causal lengths of 512-1536 tokens, 32 heads x 128, bf16, on one H100 (docs/performance.md#sfttrainer-on-2-gpus).
_CUDNN_GRAPH_BUILD_S = 0.3


@dataclass(frozen=True)
class VarlenSegments:
    """The documents of one varlen call.

    ``q_rows``/``k_rows``: the contiguous rows of the caller's q and k/v the call reads (documents back to
    back, in order, no gaps); ``cu_q``/``cu_k`` (n + 1,) int32 on the device, relative to those rows;
    ``lengths_q``/``lengths_k``: the same on the host; ``causal``: bottom-right causal within each document.
    """

    q_rows: slice
    k_rows: slice
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    lengths_q: Tuple[int, ...]
    lengths_k: Tuple[int, ...]
    causal: bool

    # device -> the packed query rows' flat index into the padded LSE layout (builds whose varlen op returns the
    # LSE padded), built on first use: building it copies a host tensor to the device, which waits for the stream,
    # and the varlen callers keep their segments in cached plans, so a repeated call finds it here.
    _padded_index: Dict[torch.device, torch.Tensor] = field(default_factory=dict, init=False, repr=False,
                                                            compare=False)

    def padded_index(self, device) -> torch.Tensor:
        """``packed_to_padded_index(self, device)``, built once per device and kept with these segments."""
        device = torch.device(device)
        index = self._padded_index.get(device)
        if index is None:
            index = self._padded_index[device] = packed_to_padded_index(self, device)
        return index

    @property
    def max_q(self) -> int:
        return max(self.lengths_q)

    @property
    def max_k(self) -> int:
        return max(self.lengths_k)


def _cumulative(lengths: Sequence[int], device) -> torch.Tensor:
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(list(lengths), dtype=torch.int64), 0).to(torch.int32)
    return cu.to(device, non_blocking=True)


def segments_from_lengths(lengths_q: Sequence[int], lengths_k: Sequence[int], causal: bool,
                          device) -> VarlenSegments:
    """Segments of documents packed back to back (rows 0.. of already packed q and k/v)."""
    lq, lk = tuple(int(x) for x in lengths_q), tuple(int(x) for x in lengths_k)
    return VarlenSegments(slice(0, sum(lq)), slice(0, sum(lk)), _cumulative(lq, device), _cumulative(lk, device),
                          lq, lk, causal)


def segments_from_rows(q_rows: Sequence[slice], k_rows: Sequence[slice], causal: bool,
                       device) -> Optional[VarlenSegments]:
    """Segments of documents whose query rows (and key rows) follow each other without gaps; None when the
    blocks do not tile contiguous row ranges (the caller then keeps one call per block)."""
    if not q_rows:
        return None
    for rows in (q_rows, k_rows):
        if any(a.stop != b.start for a, b in zip(rows, rows[1:])) or any(r.stop <= r.start for r in rows):
            return None
    lq = tuple(r.stop - r.start for r in q_rows)
    lk = tuple(r.stop - r.start for r in k_rows)
    return VarlenSegments(slice(q_rows[0].start, q_rows[-1].stop), slice(k_rows[0].start, k_rows[-1].stop),
                          _cumulative(lq, device), _cumulative(lk, device), lq, lk, causal)


class VarlenKernel(Protocol):
    """Attention of packed documents and its backward (shapes in the module docstring)."""

    name: str

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg: VarlenSegments, *,
                scale: float) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(out (Tq, H, D), lse (H, Tq) fp32)``."""

    def backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, seg: VarlenSegments, *, scale: float
                 ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Gradients ``(dq, dk, dv)`` given the merged ``out`` and ``lse`` (H, Tq) over all keys of each row."""


def packed_to_padded_index(seg: VarlenSegments, device) -> torch.Tensor:
    """Flat index b * max_q + i of every packed query row (document b, offset i): (Tq,) int64."""
    doc = torch.repeat_interleave(torch.arange(len(seg.lengths_q)), torch.tensor(seg.lengths_q))
    starts = torch.tensor((0,) + seg.lengths_q).cumsum(0)[:-1]
    offset = torch.arange(doc.numel()) - starts[doc]
    return (doc * seg.max_q + offset).to(device)


class TorchFlashVarlen:
    """``aten._flash_attention_forward``/``_backward`` on packed documents (fp16/bf16, head_dim % 8 == 0, <= 256)."""

    name = "torch_flash_varlen"

    def __init__(self):
        self._rng: Dict[torch.device, tuple] = {}      # outputs 3/4 of the last forward (dropout 0: unused)
        self._padded: Dict[torch.device, bool] = {}    # whether this build returns the LSE padded
        self.calls = 0                                 # forward + backward calls, for tests that count

    def forward(self, q, k, v, seg: VarlenSegments, *, scale: float):
        out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, seg.cu_q, seg.cu_k, seg.max_q, seg.max_k, 0.0, seg.causal, False, scale=scale)
        self._rng[q.device] = (rng, unused)
        self._padded[q.device] = lse.dim() == 3
        self.calls += 1
        if lse.dim() == 3:                             # padded (B, H, max_q): older builds
            lse = lse.transpose(0, 1).reshape(q.shape[1], -1)[:, seg.padded_index(q.device)]
        return out, lse.contiguous()

    def backward(self, dout, q, k, v, out, lse, seg: VarlenSegments, *, scale: float):
        rng, unused = self._rng_for(q, scale)
        lse = torch.nan_to_num(lse, neginf=0.0).contiguous()   # -inf rows (no key) must give p = 0, not NaN
        if self._padded_lse(q, scale):
            padded = lse.new_zeros(q.shape[1], len(seg.lengths_q) * seg.max_q)
            padded[:, seg.padded_index(q.device)] = lse
            lse = padded.reshape(q.shape[1], len(seg.lengths_q), seg.max_q).transpose(0, 1).contiguous()
        self.calls += 1
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            dout, q, k, v, out, lse, seg.cu_q, seg.cu_k, seg.max_q, seg.max_k, 0.0, seg.causal, rng, unused,
            scale=scale)
        return dq, dk, dv

    def _rng_for(self, q, scale) -> tuple:
        if q.device not in self._rng:
            self._probe(q, scale)
        return self._rng[q.device]

    def _padded_lse(self, q, scale) -> bool:
        if q.device not in self._padded:
            self._probe(q, scale)
        return self._padded[q.device]

    def _probe(self, q, scale) -> None:
        """One tiny forward: learn the rng outputs' types and whether this build pads the LSE."""
        tiny = torch.zeros(2, 1, q.shape[-1], dtype=q.dtype, device=q.device)
        cu = torch.tensor([0, 1, 2], dtype=torch.int32, device=q.device)
        _, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
            tiny, tiny, tiny, cu, cu, 1, 1, 0.0, False, False, scale=scale)
        self._rng[q.device] = (rng, unused)
        self._padded[q.device] = lse.dim() == 3


FLASH_VARLEN: Optional[TorchFlashVarlen] = None


def _flash_varlen() -> TorchFlashVarlen:
    global FLASH_VARLEN
    if FLASH_VARLEN is None:
        FLASH_VARLEN = TorchFlashVarlen()
    return FLASH_VARLEN


def op_available(device) -> bool:
    return (torch.device(device).type == "cuda" and torch.cuda.is_available()
            and hasattr(torch.ops.aten, "_flash_attention_forward")
            and hasattr(torch.ops.aten, "_flash_attention_backward"))


def _attention_flops(sq: int, sk: int) -> float:
    """Forward + backward FLOPs of one (sq x sk) block at H x D = 4096 (32 heads x 128, the measured configuration;
    the common factor cancels in the comparisons only approximately)."""
    return 4.0 * 4096 * 3.5 * sq * sk


def _flash_loss(flops: float) -> float:
    return max(flops / _FLASH_FLOPS_PER_S - flops / _CUDNN_FLOPS_PER_S - _PER_BLOCK_OVERHEAD_S, 0.0)


class CudnnShapes:
    """The per-document block shapes cuDNN has built graphs for in this process, and what flash cost the calls
    that left the others unbuilt (module docstring).

    ``per_block_calls_cost_more(lengths, key)`` decides one call: per-document cuDNN calls cost their kernels at
    cuDNN's rate, a fixed overhead per call, and, for each distinct shape not yet built, its graph build less the
    regret already gathered for it; one flash varlen call costs the kernels at flash's rate. Choosing cuDNN marks
    the call's shapes built; choosing flash adds, to each unbuilt shape's regret, what its blocks would have saved
    on cuDNN's kernel. ``key`` (device, dtype, head dim) separates graphs that cannot be shared. Bounded: at most
    ``limit`` regret entries (the oldest half are dropped when full); built shapes are kept, as cuDNN keeps them.

    A shape is (query rows, key rows): whether the block is causal is not part of it, so a shape built for one mask
    counts as built for the other (an underestimate of cuDNN's cost, never a refusal of a built shape). Each call
    decides anew, so a checkpointed layer's recomputation may take the other kernel than its forward did (when its
    shapes were bought in between); both compute the same attention, to rounding, and a call's backward always
    runs the kernel its forward chose.
    """

    def __init__(self, build_s: float = _CUDNN_GRAPH_BUILD_S, limit: int = 1 << 16) -> None:
        self.build_s = build_s
        self.limit = limit
        self.built: set = set()
        self.regret: Dict[tuple, float] = {}

    @staticmethod
    def flash_loss(sq: int, sk: int) -> float:
        """Seconds one (sq x sk) block loses on flash against a cuDNN call with a built graph (0 if none)."""
        return _flash_loss(_attention_flops(sq, sk))

    def per_block_calls_cost_more(self, document_lengths: Sequence[Tuple[int, int]], key: tuple = ()) -> bool:
        flops = [_attention_flops(sq, sk) for sq, sk in document_lengths]
        flash = sum(flops) / _FLASH_FLOPS_PER_S
        shapes: Dict[tuple, float] = {}                # unbuilt shape -> what its blocks lose on flash this call
        for (sq, sk), f in zip(document_lengths, flops):
            shape = (key, sq, sk)
            if shape not in self.built:
                shapes[shape] = shapes.get(shape, 0.0) + _flash_loss(f)
        builds = sum(max(self.build_s - self.regret.get(shape, 0.0), 0.0) for shape in shapes)
        per_block = sum(flops) / _CUDNN_FLOPS_PER_S + len(document_lengths) * _PER_BLOCK_OVERHEAD_S + builds
        if per_block > flash:
            for shape, loss in shapes.items():
                self.regret[shape] = self.regret.get(shape, 0.0) + loss
            if len(self.regret) > self.limit:
                for shape in list(self.regret)[: len(self.regret) // 2]:
                    del self.regret[shape]
            return True
        for shape in shapes:
            self.built.add(shape)
            self.regret.pop(shape, None)
        return False


CUDNN_SHAPES = CudnnShapes()


def varlen_kernel_for(requested: str, chosen_name: str, *, device, dtype: torch.dtype, head_dim: int,
                      softcap: float, document_lengths: List[Tuple[int, int]]) -> Optional[VarlenKernel]:
    """The varlen kernel to use for a call whose block backend is ``chosen_name`` (resolved from ``requested``),
    or None to keep one backend call per block.

    ``"torch_flash"`` always uses it (same kernel, one call); ``"auto"`` uses it instead of cuDNN when the
    per-block calls would cost more for these documents (``(query rows, key rows)`` per block): many and short, or
    of lengths cuDNN would first have to build graphs for (``CudnnShapes``, ``CUDNN_SHAPES``).
    """
    if not op_available(device) or dtype not in _HALF or head_dim % 8 or head_dim > 256 or softcap > 0.0:
        return None
    if chosen_name == "torch_flash":
        _note_varlen(requested, "one torch flash varlen call per step for all packed documents (the same kernel "
                                "as torch_flash's per-document calls)", device, dtype, head_dim)
        return _flash_varlen()
    if requested == "auto" and chosen_name == "torch_cudnn" and \
            CUDNN_SHAPES.per_block_calls_cost_more(document_lengths, (str(torch.device(device)), dtype, head_dim)):
        _note_varlen(requested, "auto: one torch flash varlen call estimated faster than per-document torch_cudnn "
                                "calls for these documents (many and short, or lengths cuDNN has no graph for)",
                     device, dtype, head_dim)
        return _flash_varlen()
    return None


def _note_varlen(requested: str, reason: str, device, dtype, head_dim: int) -> None:
    dt = torch.device(device).type
    note(("varlen", requested, reason, dt, dtype, head_dim),
         lambda: ("torch_flash_varlen", requested, reason, shape_class(dt, dtype, head_dim, "documents", False)))
