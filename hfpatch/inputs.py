"""Input helpers for a training step under context parallelism: split a batch over the CP group in the layout
the ring kernels need, and reduce the loss over the group. Without an active patch (``ctx`` None or a world of
one) they are the identity, so one training loop serves both.

A step, the way ``hfpatch demo`` runs it::

    batch = patch.shard_inputs(input_ids, labels=input_ids, position_ids=None)   # every rank: the whole batch
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    loss_sum, count = token_loss_sum(logits, batch["labels"])      # labels are already shifted: do not shift
    loss = patch.reduce_loss(loss_sum, count)                      # the token-weighted mean over the group
    loss.backward()

Labels are shifted exactly as HF's causal-LM loss shifts them (``labels[t + 1]`` is the target of token t, the
last token has none): the CP loss equals ``model(input_ids, labels=labels).loss`` of the non-CP run.
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import weakref

import torch
import torch.distributed as dist

from hfpatch import modes
from hfpatch.errors import UnsupportedArgument
from hfpatch.attention.context import RingContext, StepState
from hfpatch.attention.kernel_choice import plan_step
from hfpatch.attention.step import packed_cu_seqlens
from ring_kernels.layout import local_positions

__all__ = ["IGNORE_INDEX", "shard_inputs", "describe_split", "reduce_loss", "global_loss_sum", "shift_labels",
           "token_loss_sum", "mark_shifted", "is_shifted", "aligned_labels"]

IGNORE_INDEX = -100

# Labels shard_inputs returned (already shifted), by identity and held weakly: how hfpatch.model.labels tells them from
# labels of the caller's own when they are passed to the model.
_shifted: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()


def mark_shifted(labels: Optional[torch.Tensor], aligned: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """Record ``labels`` as already shifted by ``shard_inputs``; returns it. ``aligned``: the same tokens' labels
    before the shift (what a model whose own loss does not shift scores them against; ``aligned_labels``)."""
    if labels is not None:
        _shifted[id(labels)] = labels
        labels._hfpatch_aligned = aligned
    return labels


def aligned_labels(labels: torch.Tensor) -> Optional[torch.Tensor]:
    """The unshifted labels of the tokens of ``labels`` (a tensor ``shard_inputs`` returned), in the same layout,
    or None when not recorded."""
    return getattr(labels, "_hfpatch_aligned", None) if is_shifted(labels) else None


def is_shifted(labels) -> bool:
    """True for a tensor ``mark_shifted`` recorded (that very object, not an equal copy)."""
    return isinstance(labels, torch.Tensor) and _shifted.get(id(labels)) is labels


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """(B, S) -> (B, S): position t holds ``labels[t + 1]``; the last position holds -100 (HF's causal-LM shift)."""
    pad = torch.full_like(labels[:, :1], IGNORE_INDEX)
    return torch.cat([labels[:, 1:], pad], dim=1)


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sum of the token cross-entropies and the number of counted tokens (labels != -100), computed in fp32.

    logits (B, S, V), labels (B, S) already shifted -> (loss_sum: scalar, num_tokens: int64 scalar).
    """
    loss_sum = torch.nn.functional.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1).to(logits.device),
        ignore_index=IGNORE_INDEX, reduction="sum",
    )
    return loss_sum, (labels != IGNORE_INDEX).sum()


def _active(ctx: Optional[RingContext]) -> bool:
    return ctx is not None and ctx.world_size > 1


def _check_inputs(input_ids, labels, position_ids) -> None:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise TypeError(
            f"shard_inputs: input_ids must be a 2-D tensor (batch, seq_len) holding the WHOLE sequence on every "
            f"rank, got {type(input_ids).__name__} with shape {tuple(getattr(input_ids, 'shape', ()))}"
        )
    if labels is not None and (not isinstance(labels, torch.Tensor) or labels.shape != input_ids.shape):
        raise ValueError(
            f"shard_inputs: labels must be a tensor shaped like input_ids {tuple(input_ids.shape)} (unshifted, HF "
            f"convention), got shape {tuple(getattr(labels, 'shape', ()))}"
        )
    if position_ids is not None:
        if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2 or \
                position_ids.shape[1] != input_ids.shape[1] or position_ids.shape[0] not in (1, input_ids.shape[0]):
            raise ValueError(
                f"shard_inputs: position_ids must be a (batch or 1, seq_len) tensor matching input_ids "
                f"{tuple(input_ids.shape)}, got shape {tuple(getattr(position_ids, 'shape', ()))}"
            )


def _whole_position_ids(input_ids: torch.Tensor, position_ids: Optional[torch.Tensor]) -> torch.Tensor:
    """(B, S) global position ids: the given ones (broadcast over the batch), or 0..S-1 for every row."""
    batch, seq = input_ids.shape
    if position_ids is None:
        return torch.arange(seq, device=input_ids.device).unsqueeze(0).expand(batch, seq)
    return position_ids.to(input_ids.device).expand(batch, seq)


def _packing(positions: torch.Tensor) -> Optional[torch.Tensor]:
    """Global cu_seqlens (int32) when the batch is one packed row (HF's rule), None for ordinary rows."""
    if positions.shape[0] == 1:
        return packed_cu_seqlens(positions[0])
    lows = positions.min(dim=1, keepdim=True).values
    expected = torch.arange(positions.shape[1], device=positions.device).unsqueeze(0) + lows
    if not bool((positions == expected).all()):
        raise UnsupportedArgument(
            "position_ids", positions,
            f"rows restart their positions (packed documents) in a batch of {positions.shape[0]} rows; HF treats "
            f"packing only in a batch of one row.",
            "flatten the packed documents into one row: input_ids of shape (1, total_tokens).",
        )
    return None


def shard_inputs(ctx: Optional[RingContext], input_ids: torch.Tensor, labels: Optional[torch.Tensor] = None,
                 position_ids: Optional[torch.Tensor] = None) -> dict:
    """This rank's part of a batch, in the layout of the step's ring kernel; records the step in ``ctx.step``.

    input_ids:    (B, S) the whole batch, identical on every rank.
    labels:       (B, S) unshifted labels (HF convention; -100 = ignored), or None.
    position_ids: (B or 1, S) or None (0..S-1). A single row whose positions restart (each document 0..n-1) is
                  a packed batch: documents attend only to themselves (HF's rule).

    Returns ``{"input_ids": (B, S_local), "position_ids": (B, S_local) GLOBAL positions (within each document when
    packed), "labels": (B, S_local) already shifted or None}``. Pass ``input_ids`` and ``position_ids`` to the model;
    either compute the loss from the local logits and ``labels`` (``token_loss_sum`` + ``reduce_loss``), or, on a
    model given to ``apply(model=)``, pass these very ``labels`` to the model: hfpatch recognises them (by
    identity) and the model's ``loss`` is the non-CP loss (``hfpatch.model.labels``).

    The layout: batch -> the variant's (zigzag for "auto", "ulysses" and "usp:UxR"); packed -> contiguous (llama3,
    Ulysses, USP), or zigzag/ring varlen if pinned. S must split evenly (zigzag: 2 x world size chunks, each
    document when packed): pad with tokens labelled -100 at the end of the row otherwise (exact for causal models).
    With ``ctx`` None or a world of one this is the identity (labels shifted the same way) and no state is recorded.
    """
    modes.refresh_from_env()  # a step boundary: RING_ATTN_SWITCH, flipped since the last one, takes effect
    _check_inputs(input_ids, labels, position_ids)
    positions = _whole_position_ids(input_ids, position_ids)
    cu = _packing(positions)
    shifted = shift_labels(labels) if labels is not None else None
    if not _active(ctx):
        return {"input_ids": input_ids, "position_ids": positions, "labels": mark_shifted(shifted, labels)}

    batch, seq = input_ids.shape
    kernel, layout = plan_step(ctx.variant, packed=cu is not None)
    try:
        index = local_positions(seq, ctx.group, layout=layout, cu_seqlens=cu).to(input_ids.device)
    except ValueError as exc:
        raise ValueError(
            f"shard_inputs: input_ids of shape {tuple(input_ids.shape)} cannot be split over {ctx.world_size} ranks "
            f"for the {kernel!r} kernel ({layout!r} layout): {exc}. Pad the row at the end with tokens whose labels "
            f"are -100 (exact for causal models)."
        ) from exc
    local_pos = positions.index_select(1, index)
    ctx.set_step(StepState(
        kernel=kernel, layout=layout, packed=cu is not None, batch_size=batch, seq_len_global=seq,
        seq_len_local=index.numel(), cu_seqlens=cu, source="shard_inputs", position_ids=local_pos,
        positions_given=position_ids is not None,
    ))
    return {
        "input_ids": input_ids.index_select(1, index),
        "position_ids": local_pos,
        "labels": (mark_shifted(shifted.index_select(1, index), labels.index_select(1, index))
                   if shifted is not None else None),
    }


def describe_split(ctx: Optional[RingContext], *, batch_size: int, seq_len_global: int,
                   cu_seqlens: Optional[torch.Tensor] = None) -> None:
    """Declare that the next forward runs on inputs the user split: every row cut into ``world_size`` contiguous
    chunks (rank r holds chunk r), positions GLOBAL. Replaces the step ``shard_inputs`` recorded, so that
    own-split inputs are accepted at any point of a run, and ``hfpatch.scoring.gather_tokens`` gathers in that
    layout.

    batch_size:      B of the model input.
    seq_len_global:  S: tokens per row of the whole sequence (a multiple of the group size).
    cu_seqlens:      (num_docs + 1,) GLOBAL cumulative document lengths of one packed row (B = 1), or None.
    A no-op without CP (``ctx`` None or a world of one).
    """
    modes.refresh_from_env()  # a step boundary: RING_ATTN_SWITCH, flipped since the last one, takes effect
    if not _active(ctx):
        return
    if seq_len_global % ctx.world_size:
        raise UnsupportedArgument(
            "seq_len_global", seq_len_global, f"a row of {seq_len_global} tokens does not split into "
            f"{ctx.world_size} equal contiguous chunks.", f"pad every row to a multiple of {ctx.world_size}.")
    if cu_seqlens is not None:
        if batch_size != 1 or int(cu_seqlens[-1]) != seq_len_global or int(cu_seqlens[0]) != 0:
            raise UnsupportedArgument(
                "cu_seqlens", cu_seqlens, f"describe one packed row of {seq_len_global} tokens: batch_size 1 and "
                f"cumulative lengths from 0 to {seq_len_global}, got batch_size {batch_size} and "
                f"{cu_seqlens.tolist()}.", "pass the GLOBAL cu_seqlens of the whole packed row.")
        cu_seqlens = cu_seqlens.to("cpu", torch.int32)
    packed = cu_seqlens is not None and cu_seqlens.numel() > 2
    kernel, layout = plan_step(ctx.variant, packed=packed, source="describe_split")
    ctx.set_step(StepState(
        kernel=kernel, layout=layout, packed=packed, batch_size=batch_size, seq_len_global=seq_len_global,
        seq_len_local=seq_len_global // ctx.world_size, cu_seqlens=cu_seqlens if packed else None,
        source="describe_split"))


def reduce_loss(ctx: Optional[RingContext], loss_sum: torch.Tensor,
                num_tokens: Union[int, torch.Tensor]) -> torch.Tensor:
    """The token-weighted mean loss over the CP group: sum of every rank's ``loss_sum`` / sum of ``num_tokens``.

    The value is the same on every rank. Its gradient flows only into this rank's ``loss_sum`` (scaled by
    1 / total tokens): the ring's backward carries each rank's share to the K/V of the others, so the parameter
    gradients SUMMED over the CP group equal the gradient of the non-CP mean loss. (With data parallelism that
    averages gradients over dp x cp ranks, multiply the loss by the CP size, or average over dp only.)
    One all-reduce of two numbers. With ``ctx`` None or a world of one: ``loss_sum / num_tokens``.
    """
    count = torch.as_tensor(num_tokens, device=loss_sum.device).to(torch.float64)
    if not _active(ctx):
        return loss_sum / count.clamp(min=1).to(loss_sum.dtype)
    totals = torch.stack([loss_sum.detach().to(torch.float64), count])
    dist.all_reduce(totals, group=ctx.group)
    others = (totals[0] - loss_sum.detach().to(torch.float64)).to(loss_sum.dtype)
    # Zero counted tokens in the whole group: 0 (not NaN), still attached to the graph.
    return (loss_sum + others) / totals[1].clamp(min=1).to(loss_sum.dtype)


def global_loss_sum(ctx: Optional[RingContext], loss_sum: torch.Tensor) -> torch.Tensor:
    """The sum of every rank's ``loss_sum`` over the CP group (``loss_sum`` itself when inactive), with the gradient
    of ``reduce_loss``: it flows into this rank's ``loss_sum`` only. One all-reduce of one number."""
    if not _active(ctx):
        return loss_sum
    total = loss_sum.detach().to(torch.float64).reshape(1)
    dist.all_reduce(total, group=ctx.group)
    return loss_sum + (total[0] - loss_sum.detach().to(torch.float64)).to(loss_sum.dtype)
