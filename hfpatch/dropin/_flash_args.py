"""flash-attn's argument conventions, checked once for every drop-in kernel entry point.

ring-flash-attn's functions take flash-attn's trailing arguments
``(dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic, return_attn_probs, group)``.
What each becomes here:

- ``softmax_scale`` (None: headdim ** -0.5), ``causal``, ``window_size`` (left, right; -1 unbounded), ``group``:
  passed to ``ring_kernels`` unchanged (same conventions).
- ``dropout_p`` > 0, ``alibi_slopes`` (not None), ``return_attn_probs=True``: refused with ``UnsupportedArgument``
  (the ring kernels implement no attention dropout and no ALiBi bias, and return no log-sum-exp); ring-flash-attn
  would honour them on flash-attn, so dropping them silently would change the model.
- ``deterministic``: accepted and without effect: the ring kernels are deterministic by construction (no atomics
  in the merge, a fixed ring order).
- ``max_seqlen*`` of the varlen functions: accepted and not needed (derived from ``cu_seqlens``).
"""
from __future__ import annotations

from typing import Any, Tuple

import torch

from hfpatch.errors import UnsupportedArgument

__all__: list = []


def check_flash_options(fn: str, *, dropout_p: Any, alibi_slopes: Any, deterministic: Any,
                        return_attn_probs: Any, window_size: Any) -> Tuple[int, int]:
    """Refuse what the ring kernels cannot honour; return ``window_size`` as a tuple of two ints."""
    if alibi_slopes is not None:
        raise UnsupportedArgument(
            "alibi_slopes", alibi_slopes,
            f"{fn}: ALiBi biases are not implemented by hfpatch's ring kernels, and dropping them would change "
            f"the attention.",
            "pass alibi_slopes=None (a model with ALiBi needs ring-flash-attn's flash-attn kernels).",
        )
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or dropout_p < 0 or dropout_p >= 1:
        raise UnsupportedArgument("dropout_p", dropout_p, f"{fn}: dropout_p must be a float in [0, 1).")
    if dropout_p > 0:
        raise UnsupportedArgument(
            "dropout_p", dropout_p, f"{fn}: attention dropout is not implemented by the ring kernels.",
            "pass dropout_p=0.0 (set the model's attention_dropout to 0 for context-parallel training).",
        )
    if not isinstance(return_attn_probs, bool):
        raise TypeError(f"{fn}: return_attn_probs={return_attn_probs!r} must be a bool")
    if return_attn_probs:
        raise UnsupportedArgument(
            "return_attn_probs", return_attn_probs,
            f"{fn}: the ring kernels return the attention output only (no softmax log-sum-exp or probabilities).",
            "pass return_attn_probs=False and use the returned tensor as the output.",
        )
    if deterministic is not None and not isinstance(deterministic, bool):
        raise TypeError(f"{fn}: deterministic={deterministic!r} must be a bool or None (it has no effect: the ring "
                        f"kernels are deterministic by construction)")
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or not all(isinstance(w, int) and not isinstance(w, bool) for w in window_size)):
        raise TypeError(f"{fn}: window_size={window_size!r} must be a pair of ints (left, right), -1 = unbounded")
    return int(window_size[0]), int(window_size[1])


def unpack(fn: str, name: str, packed: torch.Tensor, parts: int, dim: int) -> Tuple[torch.Tensor, ...]:
    """Split a packed ``kv`` (parts=2) or ``qkv`` (parts=3) along ``dim`` into views, checking the shape.

    Batch: kv (B, S, 2, Hk, D), qkv (B, S, 3, H, D), dim=2. Varlen: kv (T, 2, Hk, D), qkv (T, 3, H, D), dim=1.
    """
    rank = dim + 3
    if not isinstance(packed, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(packed).__name__}")
    if packed.dim() != rank or packed.shape[dim] != parts:
        layout = ("B, S, " if dim == 2 else "T, ") + f"{parts}, " + ("Hk" if parts == 2 else "H") + ", D"
        raise ValueError(f"{fn}: {name} has shape {tuple(packed.shape)}; expected ({layout}) (flash-attn's packed "
                         f"layout: {parts} tensors stacked at dim {dim})")
    return packed.unbind(dim)
