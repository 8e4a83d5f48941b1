"""What ring attention refuses, and how a call's tensors reach the kernels.

Every check runs on every call (a refusal is never cached): a paged KV cache, keys longer than the queries, a
padding mask with a zero in it, dropout, a negative softcap, a window that is not a positive int
(``refuse``); a malformed attention sink (``sink_of``). ``cast_to_target`` casts q, k, v as the installed release's
flash path does. The user's copy of these rules: docs/user-guide.md, "What ring attention honours and what it
refuses"; ``hfpatch.attention.semantics`` holds the argument table.
"""
from __future__ import annotations

import functools
from typing import Any, Mapping, Optional, Tuple

import torch

from hfpatch import version_gates
from hfpatch.attention.context import RingContext
from hfpatch.errors import UnsupportedArgument

__all__ = ["refuse", "refuse_unsupported", "sink_of", "cast_to_target", "target_dtype_by_query"]

# Kwargs that HF's own function would act on; every other kwarg is ignored by it and by us.
_PAGED_KWARGS = ("cache", "cache_seqlens")
# The fixes of a KV cache's refusal: each works whether or not flash-attn is installed (the model's own attention,
# restored by remove(), runs any cache; a forward without a cache is what CP computes).
_PAGED_CACHE_FIX = ("generate after patch.remove() (the model's own attention and its cache are back); CP is for "
                    "training and prefill of whole sequences.")
_KV_CACHE_FIX = ("call the model with use_cache=False under CP (training and prefill need no cache), or generate "
                 "after patch.remove() (the model's own attention and its cache are back).")


def refuse_unsupported(call: Mapping[str, Any], extra: Mapping[str, Any], q: torch.Tensor, k: torch.Tensor,
                        ctx: RingContext) -> None:
    """Raise ``UnsupportedArgument`` for anything ring attention cannot honour (``hfpatch.attention.semantics``'
    table)."""
    refuse(call, extra, q.shape, k, ctx, call.get("sliding_window"), call.get("softcap"))


def refuse(call: Mapping[str, Any], extra: Mapping[str, Any], q_shape: torch.Size, k: torch.Tensor,
            ctx: RingContext, window: Any, softcap: Any) -> None:
    """``refuse_unsupported`` on the hot path: every check runs on every call (a refusal is never cached), but
    the common case -- nothing to refuse -- costs one ``is None`` per role. ``window``/``softcap``: the call's."""
    get = call.get
    if get("block_table") is not None or get("k_cache") is not None or get("v_cache") is not None:
        role = next(r for r in ("block_table", "k_cache", "v_cache") if get(r) is not None)
        raise UnsupportedArgument(
            role, call[role],
            "a paged KV cache cannot be used with context parallelism (each rank holds a slice of the sequence).",
            _PAGED_CACHE_FIX,
        )
    if extra and (extra.get("cache") is not None or extra.get("cache_seqlens") is not None):
        name = next(n for n in _PAGED_KWARGS if extra.get(n) is not None)
        raise UnsupportedArgument(
            name, extra[name],
            "a KV cache cannot be used with context parallelism (each rank holds a slice of the sequence).",
            _KV_CACHE_FIX,
        )
    if k.shape[1] != q_shape[1]:
        raise UnsupportedArgument(
            "key", k,
            f"keys cover {k.shape[1]} tokens but queries {q_shape[1]}: a KV cache (generation) cannot be used with "
            f"context parallelism, where every rank holds an equal slice of one sequence.",
            _KV_CACHE_FIX,
        )
    mask = get("attention_mask")
    if mask is not None:
        _refuse_padding_mask(mask, ctx)
    dropout = get("dropout")
    if dropout and float(dropout) > 0.0:
        raise UnsupportedArgument(
            "dropout", dropout,
            "attention dropout cannot be applied by the ring kernels; HF passes a non-zero dropout only when the "
            "attention module is in training mode.",
            "set the model's attention_dropout to 0.0 for CP training (config.attention_dropout = 0.0).",
        )
    if softcap is not None and float(softcap) < 0:
        raise UnsupportedArgument("softcap", softcap, "softcap must be >= 0 (0 or None: no capping).")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window <= 0):
        raise UnsupportedArgument(
            "sliding_window", window, "sliding_window must be None or a positive int (the window in tokens).",
            "set config.sliding_window to None to disable the window.",
        )


def sink_of(extra: Optional[Mapping[str, Any]], q: torch.Tensor) -> Optional[torch.Tensor]:
    """The call's attention sink (``s_aux``, one logit per query head: (H,), floating, on q's device) or None;
    ``UnsupportedArgument`` naming ``s_aux`` for anything else. q: (B, S, H, D)."""
    sink = extra.get("s_aux") if extra else None
    if sink is None:
        return None
    heads = q.shape[2]
    if not isinstance(sink, torch.Tensor):
        raise UnsupportedArgument(
            "s_aux", sink, f"attention sinks must be a tensor of shape (num_heads,) = ({heads},), got "
            f"{type(sink).__name__}.")
    if sink.shape != (heads,):
        raise UnsupportedArgument(
            "s_aux", sink, f"attention sinks have shape {tuple(sink.shape)}; expected (num_heads,) = ({heads},): one "
            f"logit per query head of this call (query {tuple(q.shape)}).",
            "pass the attention module's per-head sink parameter (e.g. gpt-oss's `self.sinks`).")
    if not sink.is_floating_point():
        raise UnsupportedArgument(
            "s_aux", sink, f"attention sinks have dtype {sink.dtype}; expected a floating dtype (logits).")
    if sink.device != q.device:
        raise UnsupportedArgument(
            "s_aux", sink, f"attention sinks are on {sink.device} but the query on {q.device}.",
            "keep the sink parameter on the attention layer's device.")
    return sink


def cast_to_target(target_dtype: Optional[torch.dtype], q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as the installed release's flash path casts them (``fa_peft_integration_check``): all three to
    ``target_dtype`` when it is given and the query (before 4.49: the value) is fp32; else unchanged."""
    if target_dtype is None or (q if target_dtype_by_query() else v).dtype is not torch.float32:
        return q, k, v
    if q.dtype is target_dtype and k.dtype is target_dtype and v.dtype is target_dtype:
        return q, k, v
    return q.to(target_dtype), k.to(target_dtype), v.to(target_dtype)


@functools.lru_cache(maxsize=None)
def target_dtype_by_query() -> bool:
    """The installed release casts to ``target_dtype`` when the query (4.49+; before: the value) is fp32 (read once;
    ``cache_clear()`` reads it again)."""
    version = version_gates.installed_transformers_version()
    return version is None or version >= version_gates.TRANSFORMERS_TARGET_DTYPE_BY_QUERY


def _refuse_padding_mask(mask: Optional[torch.Tensor], ctx: RingContext) -> None:
    """A mask with a zero somewhere is refused; an all-ones mask is harmless (checked once per tensor)."""
    if mask is None:
        return
    if not isinstance(mask, torch.Tensor):
        raise UnsupportedArgument("attention_mask", mask, "expected a padding mask tensor or None.")
    if ctx.cached("attention_mask", mask, _all_ones):
        return  # all ones: there is no padding to honour (HF >= 4.53 drops such a mask itself)
    raise UnsupportedArgument(
        "attention_mask", mask,
        "a padding mask cannot be honoured under context parallelism: each rank holds a slice of the sequence, "
        "and padding would be attended to or shift the shards.",
        "pack the documents into one row without padding (hfpatch shard_inputs with position_ids that restart at 0 "
        "per document), or pad with tokens whose labels are -100 and pass no attention_mask (causal models never "
        "attend to trailing padding).",
    )


def _all_ones(mask: torch.Tensor) -> bool:
    return bool(mask.bool().all())
