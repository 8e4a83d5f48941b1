"""Ring attention kernels: ring, zigzag, stripe and llama3 context parallelism over torch.distributed.

Tensors use flash-attn's layout: q (batch, seqlen_local, nheads, headdim), k/v with nheads_k dividing nheads.
Shard a global sequence with ``shard(x, layout=...)`` (``"contiguous"`` for ring, ``"zigzag"``, ``"stripe"``),
call the matching attention function on every rank of the group, and ``unshard`` the result if needed.

Each call checks that every rank passes the same shapes and options (one small all_gather). A caller making many
identical calls per step checks once per step and shape inside ``with rank_check_scope(seen):``, or, on a hot
path, by setting ``RANK_CHECKED`` (a ``contextvars.ContextVar``) to ``seen`` and resetting it with the token in a
``finally`` (see ``ring_kernels.validation``).

Bad input raises ``RingInputError`` (a ``ValueError``). Process-wide knobs (transport, fused merge, the rank
check, the forward's yield) are one options object: ``get_options`` / ``set_options`` / ``use_options``, with
the environment only an override (``ring_kernels.options`` documents every option and its variable).

Modules: ``engine`` (blocks, ring loops, autograd) and ``rounding`` (each row rounded once) under the batch
layouts ``ring``, ``zigzag``, ``stripe``; ``documents`` (packed-document planning, the cu_seqlens cache) under
``varlen`` (ring and zigzag over documents) and ``llama3`` (all-gathered K/V); ``backends`` compute blocks;
``checkpointing`` keeps each ring call's output through activation checkpointing (the recomputation skips the ring).
"""

from ring_kernels.errors import RingInputError
from ring_kernels.options import RingOptions, get_options, set_options, use_options
from ring_kernels.validation import RANK_CHECKED, rank_check_scope
from ring_kernels.layout import LAYOUTS, LocalVarlen, local_positions, local_varlen, shard, unshard
from ring_kernels.ring import ring_attn_func
from ring_kernels.stripe import stripe_attn_func
from ring_kernels.zigzag import zigzag_ring_attn_func
from ring_kernels.varlen import ring_attn_varlen_func, zigzag_ring_attn_varlen_func
from ring_kernels.llama3 import llama3_attn_varlen_func

__all__ = [
    "ring_attn_func", "zigzag_ring_attn_func", "stripe_attn_func",
    "ring_attn_varlen_func", "zigzag_ring_attn_varlen_func", "llama3_attn_varlen_func",
    "LAYOUTS", "LocalVarlen", "local_positions", "local_varlen", "shard", "unshard", "rank_check_scope",
    "RANK_CHECKED", "RingInputError", "RingOptions", "get_options", "set_options", "use_options",
]
