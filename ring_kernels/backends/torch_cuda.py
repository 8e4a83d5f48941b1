"""Block backends on torch's own CUDA attention ops: flash (FA2), cuDNN and memory-efficient attention.

Each ``aten._scaled_dot_product_{flash,cudnn,efficient}_attention`` takes (B, H, S, D) tensors — strided views of
our (B, S, H, D) layout, so no copy — returns the output with its log-sum-exp, and its ``_backward`` accepts an
externally merged output and LSE (the ring's merged result), which is what a block backward needs.

Per-op facts handled here (checked against the ops' meta kernels):
- flash: lse (B, H, Sq); backward needs the forward's ``cum_seq`` (None for dense batches), ``max_q/max_k`` and
  philox tensors (unused without dropout, but their type/shape differ between torch releases, so the ones the
  last forward returned are reused).
- cuDNN: lse (B, H, Sq, 1); backward takes it in that shape and needs ``dout`` strided like ``out``.
- efficient: lse padded to a multiple of 32 rows; fp32 supported; an additive ``attn_bias`` gives GENERAL masks
  (its last dimension must be 16-element aligned, hence the padded allocation).

GQA: the ops take fewer K/V heads on recent torch. If an op refuses (older releases: a ``RuntimeError`` on the
first GQA call), K/V are expanded to the query heads *inside this backend* and dK/dV summed back over each group;
nothing repeated travels. The backend keeps expanding for every later GQA call; that fallback is logged once at
WARNING with the op's error text and noted in ``choices`` (counted on every expanded call). If the expanded
call fails too, the error was not a GQA refusal: it propagates and the backend stays undecided.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from .base import CAUSAL, EMPTY, FULL, GENERAL, BlockMask
from .choices import note, shape_class
from .reference import ReferenceBackend

__all__ = ["TorchFlashBackend", "TorchCudnnBackend", "TorchEfficientBackend"]

_HALF = (torch.float16, torch.bfloat16)
aten = torch.ops.aten


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    """(B, S, H, D) -> (B, H, S, D) as a view."""
    return x.transpose(1, 2)


def _empty_block(q: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    b, sq, h, _ = q.shape
    return q.new_zeros(q.shape), torch.full((b, h, sq), float("-inf"), dtype=torch.float32, device=q.device)


def _expand_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, S, Hk, D) -> (B, S, Hk*groups, D), query head h reading K/V head h // groups."""
    return x.repeat_interleave(groups, dim=2) if groups > 1 else x


def _fold_kv_grad(dx: torch.Tensor, heads_k: int) -> torch.Tensor:
    """(B, S, Hk*G, D) gradient of expanded K/V -> (B, S, Hk, D), summed over each group."""
    b, s, h, d = dx.shape
    if h == heads_k:
        return dx
    return dx.reshape(b, s, heads_k, h // heads_k, d).sum(3)


class _TorchCudaBackend:
    """Shared logic: support checks, GQA fallback, the EMPTY fast path; subclasses call one aten op pair."""

    name = "torch_cuda"
    dtypes: Tuple[torch.dtype, ...] = _HALF
    max_head_dim = 256
    mask_kinds = (FULL, CAUSAL, EMPTY)

    def __init__(self):
        self._native_gqa: Optional[bool] = None          # learnt on the first GQA call
        self._gqa_refusal: Optional[str] = None          # the op's error that made this backend expand K/V
        self._philox: Dict[torch.device, tuple] = {}     # from the last forward, per device

    def unsupported_reason(self, *, device, dtype, head_dim, mask_kind, softcap) -> Optional[str]:
        if torch.device(device).type != "cuda":
            return f"runs on CUDA only, not {device}"
        if dtype not in self.dtypes:
            return f"dtype {dtype} not supported (supported: {self.dtypes})"
        if head_dim % 8 != 0 or head_dim > self.max_head_dim:
            return f"head_dim {head_dim} not supported (needs a multiple of 8, at most {self.max_head_dim})"
        if mask_kind not in self.mask_kinds:
            return f"mask kind {mask_kind!r} not supported (only {self.mask_kinds}: no sliding window or doc masks)"
        if softcap > 0.0:
            return "softcap is not supported by torch's attention ops (use 'flash_attn', 'triton' or 'reference')"
        return None

    # --- GQA: try the op with fewer K/V heads once; fall back to expanding inside the backend.
    def _with_gqa(self, call, q, k, v):
        groups = q.shape[2] // k.shape[2]
        if groups == 1 or self._native_gqa:
            return call(k, v), False
        if self._native_gqa is None:
            try:
                result = call(k, v)
                self._native_gqa = True
                return result, False
            except torch.cuda.OutOfMemoryError:
                raise                                    # not a GQA refusal: expanding would need more memory
            except RuntimeError as exc:
                # Raises (chained to exc) when expanding does not help either: then exc was no GQA refusal.
                result = call(_expand_kv(k, groups), _expand_kv(v, groups))
                self._native_gqa = False
                self._gqa_refusal = f"{type(exc).__name__}: {exc}"
                self._note_expanded(q, k)
                return result, True
        self._note_expanded(q, k)
        return call(_expand_kv(k, groups), _expand_kv(v, groups)), True

    def _note_expanded(self, q, k) -> None:
        """Note one call computed with repeated K/V (logged the first time per shape class: at WARNING when it
        is a fallback after the op's error, at INFO when this op never takes fewer K/V heads)."""
        refusal = self._gqa_refusal
        h, hk = q.shape[2], k.shape[2]
        note(("gqa expanded", self.name, refusal, q.device.type, q.dtype, q.shape[3], h, hk),
             lambda: (self.name, self.name,
                      f"repeats K/V heads inside the backend for grouped-query attention ({h} query heads over "
                      f"{hk} K/V heads: {h // hk}x the K/V memory and reads of each call) because "
                      + (f"the op refused fewer K/V heads on the first GQA call: {refusal}" if refusal else
                         "the op needs as many K/V heads as query heads"),
                      shape_class(q.device.type, q.dtype, q.shape[3], "any", False)),
             fallback=refusal is not None)

    def forward(self, q, k, v, *, scale: float, mask: BlockMask, softcap: float = 0.0):
        sq, sk = q.shape[1], k.shape[1]
        kind = mask.kind(sq, sk)
        if kind == EMPTY:
            return _empty_block(q)
        (out, lse), _ = self._with_gqa(lambda kk, vv: self._fwd(q, kk, vv, scale, kind, mask), q, k, v)
        return out, lse

    def backward(self, dout, q, k, v, out, lse, *, scale: float, mask: BlockMask, softcap: float = 0.0):
        sq, sk = q.shape[1], k.shape[1]
        kind = mask.kind(sq, sk)
        if kind == EMPTY:
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        # No safe_lse pass per block: in a FULL or aligned CAUSAL block every query row sees >= 1 key, so its
        # merged lse is finite; only GENERAL blocks (efficient backend) can hold rows with lse = -inf, and the
        # efficient backward zeroes those in the padded copy it makes anyway.
        lse = lse.float()
        (dq, dk, dv), expanded = self._with_gqa(
            lambda kk, vv: self._bwd(dout, q, kk, vv, out, lse, scale, kind, mask), q, k, v)
        if expanded or dk.shape[2] != k.shape[2]:
            dk, dv = _fold_kv_grad(dk, k.shape[2]), _fold_kv_grad(dv, v.shape[2])
        return dq, dk, dv

    def _philox_for(self, q: torch.Tensor) -> tuple:
        """Philox tensors of a forward on this device (dropout is 0: only their type matters)."""
        if q.device not in self._philox:
            tiny = torch.zeros(1, 1, 1, max(8, q.shape[-1]), dtype=q.dtype, device=q.device)
            self._fwd(tiny, tiny, tiny, 1.0, FULL, BlockMask())
        return self._philox[q.device]


class TorchFlashBackend(_TorchCudaBackend):
    """``aten._scaled_dot_product_flash_attention`` (FlashAttention-2 in torch): fp16/bf16, head_dim <= 256."""

    name = "torch_flash"

    def _fwd(self, q, k, v, scale, kind, mask):
        out, lse, _cq, _ck, _mq, _mk, seed, offset, _dbg = aten._scaled_dot_product_flash_attention(
            _bhsd(q), _bhsd(k), _bhsd(v), 0.0, kind == CAUSAL, False, scale=scale)
        self._philox[q.device] = (seed, offset)
        return out.transpose(1, 2), lse

    def _bwd(self, dout, q, k, v, out, lse, scale, kind, mask):
        seed, offset = self._philox_for(q)
        dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
            _bhsd(dout), _bhsd(q), _bhsd(k), _bhsd(v), _bhsd(out), lse.contiguous(), None, None,
            q.shape[1], k.shape[1], 0.0, kind == CAUSAL, seed, offset, scale=scale)
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


class TorchCudnnBackend(_TorchCudaBackend):
    """``aten._scaled_dot_product_cudnn_attention``: the fastest on Hopper; fp16/bf16, head_dim <= 128."""

    name = "torch_cudnn"
    max_head_dim = 128

    def _fwd(self, q, k, v, scale, kind, mask):
        out, lse, _cq, _ck, _mq, _mk, seed, offset, _dbg = aten._scaled_dot_product_cudnn_attention(
            _bhsd(q), _bhsd(k), _bhsd(v), None, True, 0.0, kind == CAUSAL, False, scale=scale)
        self._philox[q.device] = (seed, offset)
        return out.transpose(1, 2), lse.reshape(lse.shape[0], lse.shape[1], lse.shape[2])

    def backward(self, dout, q, k, v, out, lse, *, scale: float, mask: BlockMask, softcap: float = 0.0):
        if q.shape[1] == 1 and k.shape[1] == 1:
            # cuDNN's backward refuses one query against one key ("s_q = s_kv = 1 is not supported"): a block of
            # a one-token document piece. It is one score per head: plain math, exact, negligible cost.
            return _ONE_TOKEN.backward(dout, q, k, v, out, lse, scale=scale, mask=mask, softcap=softcap)
        return super().backward(dout, q, k, v, out, lse, scale=scale, mask=mask, softcap=softcap)

    def _bwd(self, dout, q, k, v, out, lse, scale, kind, mask):
        seed, offset = self._philox_for(q)
        # cuDNN wants dout strided exactly like out (both are (B, S, H, D) rows here; make sure of it).
        if dout.stride() != out.stride():
            dout = torch.empty_like(out).copy_(dout)
        dq, dk, dv = aten._scaled_dot_product_cudnn_attention_backward(
            _bhsd(dout), _bhsd(q), _bhsd(k), _bhsd(v), _bhsd(out), lse.unsqueeze(-1).contiguous(), seed, offset,
            None, None, None, q.shape[1], k.shape[1], 0.0, kind == CAUSAL, scale=scale)
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


_ONE_TOKEN = ReferenceBackend()


def _additive_bias(mask: BlockMask, sq: int, sk: int, dtype, device) -> Tuple[torch.Tensor, torch.Tensor]:
    """(bias (Sq, Sk) view of a 16-aligned buffer with 0 / -inf, visible-rows (Sq,) bool)."""
    visible = mask.dense(sq, sk, device)
    padded = (sk + 15) // 16 * 16
    bias = torch.zeros(sq, padded, dtype=dtype, device=device)[:, :sk]
    bias.masked_fill_(~visible, float("-inf"))
    return bias, visible.any(-1)


class TorchEfficientBackend(_TorchCudaBackend):
    """``aten._scaled_dot_product_efficient_attention``: slowest, but fp32 and GENERAL masks (additive bias)."""

    name = "torch_efficient"
    dtypes = (torch.float16, torch.bfloat16, torch.float32)
    mask_kinds = (FULL, CAUSAL, EMPTY, GENERAL)

    def __init__(self):
        super().__init__()
        self._native_gqa = False      # the efficient kernel needs equal head counts: expand K/V in here

    def _bias(self, q, k, kind, mask):
        if kind != GENERAL:
            return None, None
        b, sq, h, _ = q.shape
        bias, rows = _additive_bias(mask, sq, k.shape[1], q.dtype, q.device)
        return bias.expand(b, h, sq, k.shape[1]), rows

    def _fwd(self, q, k, v, scale, kind, mask):
        bias, rows = self._bias(q, k, kind, mask)
        out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(
            _bhsd(q), _bhsd(k), _bhsd(v), bias, True, 0.0, kind == CAUSAL, scale=scale)
        self._philox[q.device] = (seed, offset)
        out, lse = out.transpose(1, 2), lse[:, :, : q.shape[1]]
        if rows is not None and not bool(rows.all()):       # rows with no key: out 0, lse -inf, never NaN
            out = out.masked_fill(~rows[None, :, None, None], 0.0)
            lse = lse.masked_fill(~rows, float("-inf"))
        return out, lse

    def _bwd(self, dout, q, k, v, out, lse, scale, kind, mask):
        # The efficient backward returns a wrong dq for a head slice of a larger tensor (llama3's heads_k_stride
        # passes q[:, rows, heads]: not contiguous); measured on 2xH200, torch 2.11: dq error 0.2-0.8 relative,
        # dk/dv right. Dense inputs give the right result; such slices are copied (only llama3 with a stride).
        dout, q, k, v, out = (x if x.is_contiguous() else x.contiguous() for x in (dout, q, k, v, out))
        seed, offset = self._philox_for(q)
        bias, _ = self._bias(q, k, kind, mask)
        sq = q.shape[1]
        padded = torch.zeros(lse.shape[0], lse.shape[1], (sq + 31) // 32 * 32, dtype=torch.float32, device=lse.device)
        padded[:, :, :sq] = lse
        if kind == GENERAL:                # rows that see no key: lse 0, so p = exp(-inf - 0) = 0, not NaN
            padded.masked_fill_(padded == float("-inf"), 0.0)
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            _bhsd(dout), _bhsd(q), _bhsd(k), _bhsd(v), bias, _bhsd(out), padded, seed, offset, 0.0,
            [True, True, True, False], kind == CAUSAL, scale=scale)
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
