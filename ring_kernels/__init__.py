"""Context-parallel attention kernels over torch.distributed: ring, zigzag, stripe, llama3, Ulysses and USP.

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
``varlen`` (ring and zigzag over documents) and ``llama3`` (the K/V rows of crossing documents exchanged);
``backends`` compute blocks;
``checkpointing`` keeps each ring call's output through activation checkpointing (the recomputation skips the ring).
``ulysses`` splits heads instead of the sequence (an all-to-all before and after attention; any layout, batch and
varlen); ``usp`` runs a ring variant across groups of Ulysses ranks (a 2-D split of inputs sharded over the whole
group in the ring variant's layout, ``usp_layout``; ``build_usp_groups`` makes the grid's process groups).
``entry`` is every kernel's prologue (arguments, group, the ranks' agreement).

``torch_releases`` holds the supported torch range and its gates: importing ring_kernels on a torch outside the
range raises ``UnsupportedTorch``.
"""

from ring_kernels.torch_releases import UnsupportedTorch, check_supported_torch

check_supported_torch()

from ring_kernels.errors import RingInputError
from ring_kernels.options import RingOptions, get_options, set_options, use_options
from ring_kernels.validation import RANK_CHECKED, rank_check_scope
from ring_kernels.layout import LAYOUTS, LocalVarlen, local_positions, local_varlen, shard, unshard
from ring_kernels.ring import ring_attn_func
from ring_kernels.stripe import stripe_attn_func
from ring_kernels.zigzag import zigzag_ring_attn_func
from ring_kernels.varlen import ring_attn_varlen_func, zigzag_ring_attn_varlen_func
from ring_kernels.llama3 import llama3_attn_varlen_func
from ring_kernels.ulysses import ulysses_attn_func, ulysses_attn_varlen_func
from ring_kernels.usp import UspGroups, build_usp_groups, usp_attn_func, usp_attn_varlen_func, usp_layout

__all__ = [
    "ring_attn_func", "zigzag_ring_attn_func", "stripe_attn_func",
    "ring_attn_varlen_func", "zigzag_ring_attn_varlen_func", "llama3_attn_varlen_func",
    "ulysses_attn_func", "ulysses_attn_varlen_func", "usp_attn_func", "usp_attn_varlen_func", "usp_layout",
    "build_usp_groups", "UspGroups",
    "LAYOUTS", "LocalVarlen", "local_positions", "local_varlen", "shard", "unshard", "rank_check_scope",
    "RANK_CHECKED", "RingInputError", "UnsupportedTorch", "RingOptions", "get_options", "set_options", "use_options",
]
