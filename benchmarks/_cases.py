"""What the harness measures: attention shapes, variants, packed-document mixes and useful FLOPs.

A *case* is one (config, layout, causal) point; every variant x backend x mode is timed on it. Batch cases
use ``(1, S, H, D)`` tensors; varlen cases a packed ``(T, H, D)`` sequence of documents.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

__all__ = ["AttnConfig", "CONFIGS", "BATCH_VARIANTS", "VARLEN_VARIANTS", "CAUSAL_ONLY", "GRID_VARIANTS",
           "VARIANT_LAYOUT", "MODES", "local_document_mix", "global_document_mix", "attention_flops"]


@dataclass(frozen=True)
class AttnConfig:
    """Shape of one attention layer: ``nheads`` query heads over ``nheads_k`` K/V heads of ``head_dim``."""

    name: str
    nheads: int
    nheads_k: int
    head_dim: int


CONFIGS: Dict[str, AttnConfig] = {
    "llama3-8b": AttnConfig("llama3-8b", nheads=32, nheads_k=8, head_dim=128),   # GQA 4:1
    "mha": AttnConfig("mha", nheads=32, nheads_k=32, head_dim=128),
}

BATCH_VARIANTS = ("ring", "zigzag", "stripe", "ulysses", "usp")
VARLEN_VARIANTS = ("ring_varlen", "zigzag_varlen", "llama3", "ulysses_varlen", "usp_varlen")
# zigzag and stripe exist to balance causal work; the library refuses causal=False for them. usp runs the zigzag
# ring across its Ulysses groups.
CAUSAL_ONLY = frozenset({"zigzag", "stripe", "zigzag_varlen", "usp"})
# Variants that need a 2-D grid of ranks (a Ulysses group size and a ring group size, both >= 2).
GRID_VARIANTS = frozenset({"usp", "usp_varlen"})
# The ring_kernels layout of the inputs each variant expects over its group ("usp": its zigzag ring's layout over
# the whole group, ring_kernels.usp_layout("zigzag"); "usp_varlen": its llama3 ring's, contiguous -- what hfpatch
# runs for packed rows under "usp:UxR").
VARIANT_LAYOUT = {
    "ring": "contiguous", "zigzag": "zigzag", "stripe": "stripe", "ulysses": "contiguous", "usp": "zigzag",
    "ring_varlen": "contiguous", "zigzag_varlen": "zigzag", "llama3": "contiguous", "ulysses_varlen": "contiguous",
    "usp_varlen": "contiguous",
}
MODES = ("fwd", "fwd_bwd")


def local_document_mix(tokens: int, world_size: int, seed: int = 0) -> List[int]:
    """Document lengths summing to ``tokens`` (one GPU's share), each a multiple of ``2 * world_size``.

    Lengths are drawn log-uniformly between ``2N`` and ``tokens / 2`` (fixed seed), so the mix has many
    short documents and a few long ones, as packed pre-training data does. Every length is divisible by
    ``2N`` because the zigzag varlen layout splits each document into ``2N`` chunks.
    """
    unit = 2 * world_size
    if tokens % unit:
        raise ValueError(f"tokens={tokens} per rank must be a multiple of 2 * world_size = {unit} for varlen")
    rng = random.Random(seed)
    units_left = tokens // unit
    lengths: List[int] = []
    max_units = max(1, units_left // 2)
    while units_left > 0:
        draw = int(round(2 ** rng.uniform(0, math.log2(max_units)))) if max_units > 1 else 1
        take = max(1, min(draw, max_units, units_left))
        lengths.append(take * unit)
        units_left -= take
    return lengths


def global_document_mix(local_mix: Sequence[int], world_size: int, seed: int = 0) -> List[int]:
    """``world_size`` copies of the per-GPU mix, shuffled (fixed seed): the global packed sequence.

    The global sequence then holds exactly N times the per-GPU attention work, so each GPU's ideal share is
    ``T_single(local mix)`` (one GPU's mix at the single-GPU rate), and after shuffling documents cross rank
    boundaries as they do in real packing.
    """
    docs = list(local_mix) * world_size
    random.Random(seed + 1).shuffle(docs)
    return docs


def attention_flops(doc_lengths: Sequence[int], *, nheads: int, head_dim: int, causal: bool, mode: str) -> float:
    """Useful matmul FLOPs of attention over independent documents (batch = one document of length S).

    Forward: 2 matmuls of ``2 * L^2 * D`` per head (half when causal); backward: 2.5x the forward
    (5 matmuls instead of 2), the convention FlashAttention's papers use.
    """
    fwd = sum(4.0 * length * length * head_dim * nheads for length in doc_lengths)
    if causal:
        fwd /= 2
    return fwd if mode == "fwd" else 3.5 * fwd
