"""Attention on whole sequences, without the ring: the switch modes ``"reference"`` (the CP group's shards
gathered, plain attention on the whole sequence, this rank's slice back) and ``"local"`` (plain attention on
exactly the tensors given), with the ring's refusals. Both re-call transformers' original function on the whole
sequence where its flash path can run (``flash_path_runs``: flash-attn installed, CUDA, half precision), else
compute the same semantics in plain math (``ring_kernels.backends.reference.plain_attention``).
"""
from __future__ import annotations

import functools
from typing import Any, Mapping, Optional

import torch

from hfpatch.attention.context import RingContext
from hfpatch.attention.plan import window_size_of
from hfpatch.attention.refusals import cast_to_target, refuse_unsupported, sink_of
from hfpatch.attention.step import packed_cu_seqlens, step_for_call
from ring_kernels import shard, unshard
from ring_kernels.backends.reference import plain_attention

__all__ = ["reference_attention", "local_attention", "flash_path_runs"]


def reference_attention(call: Mapping[str, Any], extra: Mapping[str, Any], ctx: RingContext) -> torch.Tensor:
    """The same semantics as ``ring_attention`` without the ring: all-gather q/k/v, run plain (non-CP) attention
    on the whole sequence, return this rank's slice (B, S_local, H, D). Differentiable (the gather's backward sums
    the gradients over the ranks). For A/B checks; it holds the whole sequence on every rank.
    """
    q, k, v = cast_to_target(call.get("target_dtype"), call["query"], call["key"], call["value"])
    extra = extra or {}
    refuse_unsupported(call, extra, q, k, ctx)
    sink = sink_of(extra, q)
    step = step_for_call(call, q, ctx)
    causal = bool(call.get("is_causal", True))
    window = window_size_of(call.get("sliding_window"), step.seq_len_global)
    if step.packed:
        cu = step.cu_seqlens.to(q.device)
        gathered = [unshard(t[0], ctx.group, layout=step.layout, dim=0, cu_seqlens=cu).unsqueeze(0) for t in (q, k, v)]
    else:
        cu = None
        gathered = [unshard(t, ctx.group, layout=step.layout, dim=1) for t in (q, k, v)]
    out = _original_on_whole(call, extra, ctx, gathered, cu)
    if out is None:
        out = plain_attention(*gathered, causal=causal, softmax_scale=call.get("softmax_scale"), window_size=window,
                              softcap=float(call.get("softcap") or 0.0), cu_seqlens=cu, sink=sink)
    if step.packed:
        return shard(out[0], ctx.group, layout=step.layout, dim=0, cu_seqlens=cu).unsqueeze(0)
    return shard(out, ctx.group, layout=step.layout, dim=1)


def local_attention(call: Mapping[str, Any], extra: Mapping[str, Any], ctx: RingContext) -> torch.Tensor:
    """Non-CP attention of exactly the tensors given (switch mode ``"local"``): what transformers' flash path
    computes for them as a whole sequence, with the same refusals as the ring. q (B, S, H, D), k/v (B, S, Hk, D)
    -> (B, S, H, D). A packed row (B = 1) is told by HF's own ``cu_seq_lens_q`` or by ``position_ids`` that restart
    (HF's rule); its documents are independent. No collective."""
    q, k, v = cast_to_target(call.get("target_dtype"), call["query"], call["key"], call["value"])
    extra = extra or {}
    refuse_unsupported(call, extra, q, k, ctx)
    sink = sink_of(extra, q)
    cu = call.get("cu_seq_lens_q")
    position_ids = call.get("position_ids")
    if cu is None and position_ids is not None and q.shape[0] == 1 and q.shape[1] > 1:
        cu = packed_cu_seqlens(position_ids.reshape(-1).to(q.device))
    out = _original_on_whole(call, extra, ctx, (q, k, v), cu)
    if out is None:
        out = plain_attention(q, k, v, causal=bool(call.get("is_causal", True)),
                              softmax_scale=call.get("softmax_scale"),
                              window_size=window_size_of(call.get("sliding_window"), q.shape[1]),
                              softcap=float(call.get("softcap") or 0.0), cu_seqlens=cu, sink=sink)
    return out.contiguous()  # as flash-attn returns it: some models .view() the output


# transformers' availability check of the flash-attn package an ``attn_implementation`` loads (None: flash-attn 2,
# what ``apply(model=)`` switches a model to, or 3; each check exists from the release that introduced the package).
_FLASH_CHECKS = {None: ("is_flash_attn_2_available", "is_flash_attn_3_available"),
                 "flash_attention_2": ("is_flash_attn_2_available",),
                 "flash_attention_3": ("is_flash_attn_3_available",),
                 "flash_attention_4": ("is_flash_attn_4_available",)}
_PAGED_PREFIX = "paged|"  # continuous batching's names of the same implementations (5.x)


@functools.lru_cache(maxsize=None)
def flash_path_runs(implementation: Optional[str] = None) -> bool:
    """Whether transformers' original ``_flash_attention_forward`` can load its kernel for a call whose
    ``attn_implementation`` is ``implementation``: transformers' own check of the flash-attn package that
    implementation imports (installed, a supported version, a device it runs on); a hub kernel (``"org/name"``)
    was loaded when the model was set to it. Without it the original raises transformers' ImportError at its first
    line. Read once per process per implementation (``cache_clear()`` reads again); a call on CPU tensors still
    cannot run flash-attn (the caller checks the device)."""
    name = implementation[len(_PAGED_PREFIX):] if isinstance(implementation, str) and implementation.startswith(
        _PAGED_PREFIX) else implementation
    if isinstance(name, str) and "/" in name:
        return True
    import transformers.utils as hf_utils  # not at the top: importing hfpatch must not load transformers

    checks = [getattr(hf_utils, check, None) for check in _FLASH_CHECKS.get(name, ())]
    return any(check is not None and bool(check()) for check in checks)


def _original_on_whole(call, extra, ctx: RingContext, gathered, cu) -> Optional[torch.Tensor]:
    """Run transformers' original function on the gathered sequence when its flash path can (``flash_path_runs``,
    CUDA, half precision); None otherwise (the caller then computes the same semantics in plain math)."""
    q = gathered[0]
    if ctx.call_original is None or not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16):
        return None
    if cu is not None and "cu_seq_lens_q" not in call:
        return None  # a release (< 4.47) whose function cannot be told the documents: plain math honours them
    if not flash_path_runs(call.get("implementation")):
        return None
    whole = dict(call)
    whole.update(query=gathered[0], key=gathered[1], value=gathered[2], query_length=q.shape[1], attention_mask=None)
    if "position_ids" in whole:
        whole["position_ids"] = None
    if cu is not None:
        max_len = int((cu[1:] - cu[:-1]).max())
        whole.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max_len, max_length_k=max_len)
    return ctx.call_original(whole, dict(extra))
