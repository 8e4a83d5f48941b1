"""The block-backend contract: compute attention of one (query block, key block) pair.

A ring variant splits the global attention into blocks: this rank's queries against the keys/values that
the ring brings in at each step. A *block backend* computes one such block and returns the output together
with the log-sum-exp (LSE) of the scores, so that blocks can be merged exactly (``ring_kernels.merge``); its
backward takes an externally merged output and LSE and returns the block's gradients.

Shapes (flash-attn layout, batch mode):
    q:    (B, Sq, H,  D)
    k, v: (B, Sk, Hk, D)      H % Hk == 0 (GQA; K/V heads are never repeated outside the backend)
    out:  (B, Sq, H,  D)      dtype of q
    lse:  (B, H,  Sq)         float32; a row that sees no key has lse = -inf and out = 0 (never NaN)
    dq:   like q; dk, dv: like k, v (already summed over the query heads of each K/V group)

Varlen is expressed through the mask: a packed sequence is batch 1 with document ids per row/column.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, Tuple

import torch

# What ``BlockMask.kind`` reports; backends that cannot apply an arbitrary mask serve only the first three.
FULL = "full"            # every query sees every key
CAUSAL = "causal"        # aligned causal: row i sees columns j <= i (q and k cover the same positions)
EMPTY = "empty"          # no query sees any key: the block is skipped (out = 0, lse = -inf)
GENERAL = "general"      # anything else: needs ``BlockMask.dense``


@dataclass(frozen=True)
class BlockMask:
    """Which keys each query row of a block may see, described by global token positions.

    Rows are queries at global positions ``q_pos`` (or ``q_start + arange(Sq)`` when ``q_pos`` is None);
    columns are keys at ``k_pos`` (or ``k_start + arange(Sk)``). A row may see a column when
      - ``not causal`` or ``k <= q``;
      - ``window == (left, right)``: ``q - left <= k <= q + right`` (``-1`` = unbounded), flash-attn semantics;
      - ``q_doc``/``k_doc`` (int tensors, one document id per row/column) are equal, when given (varlen).
    """

    causal: bool = False
    q_start: int = 0
    k_start: int = 0
    q_pos: Optional[torch.Tensor] = None
    k_pos: Optional[torch.Tensor] = None
    q_doc: Optional[torch.Tensor] = None
    k_doc: Optional[torch.Tensor] = None
    window: Tuple[int, int] = (-1, -1)

    def _positions(self, sq: int, sk: int, device) -> Tuple[torch.Tensor, torch.Tensor]:
        qp = self.q_pos.to(device) if self.q_pos is not None else torch.arange(sq, device=device) + self.q_start
        kp = self.k_pos.to(device) if self.k_pos is not None else torch.arange(sk, device=device) + self.k_start
        return qp, kp

    def kind(self, sq: int, sk: int) -> str:
        """Classify the block so a backend can use its fast path (no mask tensor) when one exists."""
        if sq == 0 or sk == 0:
            return EMPTY
        special = (
            self.q_pos is not None or self.k_pos is not None or self.q_doc is not None
            or self.k_doc is not None or self.window != (-1, -1)
        )
        if not special:
            q_first, q_last = self.q_start, self.q_start + sq - 1
            k_first, k_last = self.k_start, self.k_start + sk - 1
            if not self.causal or k_last <= q_first:
                return FULL
            if k_first > q_last:
                return EMPTY
            if self.q_start == self.k_start and sq == sk:
                return CAUSAL
            return GENERAL
        dense = self.dense(sq, sk, torch.device("cpu") if self.q_pos is None else self.q_pos.device)
        if not bool(dense.any()):
            return EMPTY
        if bool(dense.all()):
            return FULL
        return GENERAL

    def dense(self, sq: int, sk: int, device) -> torch.Tensor:
        """The mask as a boolean tensor of shape (Sq, Sk); True = visible."""
        qp, kp = self._positions(sq, sk, device)
        allowed = torch.ones(sq, sk, dtype=torch.bool, device=device)
        if self.causal:
            allowed &= kp[None, :] <= qp[:, None]
        left, right = self.window
        if left >= 0:
            allowed &= kp[None, :] >= qp[:, None] - left
        if right >= 0:
            allowed &= kp[None, :] <= qp[:, None] + right
        if self.q_doc is not None or self.k_doc is not None:
            if self.q_doc is None or self.k_doc is None:
                raise ValueError("BlockMask: q_doc and k_doc must be given together")
            allowed &= self.q_doc.to(device)[:, None] == self.k_doc.to(device)[None, :]
        return allowed


class BlockBackend(Protocol):
    """One way of computing a block. Implementations live in ``ring_kernels/backends/<name>.py``.

    Ownership: ``forward``/``backward`` return fresh tensors that the caller owns (never a view of an input,
    never a buffer the backend reuses): the ring engine adopts them as its results (the first block's out,
    lse, dq, dk, dv become the returned tensors, are sent to other ranks and merged into in place).
    """

    name: str

    def unsupported_reason(
        self, *, device: torch.device, dtype: torch.dtype, head_dim: int, mask_kind: str, softcap: float
    ) -> Optional[str]:
        """None if this backend can compute such a block, else a short human-readable reason."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, mask: BlockMask,
        softcap: float = 0.0,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Return ``(out, lse)`` for one block (shapes in the module docstring)."""

    def backward(
        self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
        lse: torch.Tensor, *, scale: float, mask: BlockMask, softcap: float = 0.0,
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Gradients of one block given the *merged* ``out`` and ``lse`` of all blocks: ``(dq, dk, dv)``."""
