"""A batch of sequences as one packed row of their real tokens, and back.

RL and preference steps score batches padded on either side: GRPO left-pads prompts and right-pads completions,
DPO stacks ``[chosen; rejected]`` rows of different lengths. Ring attention runs causal attention without a
padding mask, so a padded row cannot be split as it is. ``PackedRows`` drops the padding: every sequence becomes
one document of a single packed row, numbered from position 0, so that each document attends only to itself (HF's
packing rule, which the ring kernels honour). That is the computation of each sequence run alone, which is what the
padded batch computes with its ``attention_mask`` and ``position_ids = attention_mask.cumsum(-1) - 1``.

Then the row is padded at its end for the ring's layout (pad tokens join the last document, after its real tokens,
or each document for the zigzag layout: causal attention never lets a real token see them), and every per-token
result of the packed row is scattered back to the batch's shape.

Shapes: B rows of S tokens (batch input), or one packed row of T tokens whose position ids restart at each document
(packed input); N sequences (B rows, or the documents of the packed row); P tokens in the packed row.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from hfpatch.attention.kernel_choice import plan_step
from hfpatch.attention.step import packed_cu_seqlens
from hfpatch.errors import UnsupportedArgument
from hfpatch.inputs import IGNORE_INDEX

__all__ = ["PackedRows", "pack_rows", "pack_for_ring"]


@dataclass(frozen=True)
class PackedRows:
    """One packed row of every sequence's real tokens, with what it takes to go back.

    input_ids:     (1, P) the real tokens, sequence after sequence, with the padding the layout needs.
    position_ids:  (1, P) each sequence's positions 0..n-1 (the pad tokens continue their document's).
    labels:        (1, P) unshifted labels (HF convention): the caller's labels at the real tokens, -100 at each
                   sequence's first token (it is no sequence's next token) and at the padding.
    where:         (R,) index of each of the R real tokens in the flattened (B * S) input, in packed order.
    slots:         (R,) index of each real token in the packed row (they differ from 0..R-1 after padding).
    shape:         (B, S) of the input.
    lengths:       (N,) real tokens per sequence.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    where: torch.Tensor
    slots: torch.Tensor
    shape: tuple
    lengths: torch.Tensor

    def unpack(self, packed: torch.Tensor, fill: float = 0) -> torch.Tensor:
        """(1, P, ...) per-token results of the packed row -> (B, S, ...) at the input's tokens (``fill`` at the
        input's padding). Differentiable."""
        values = packed[0].index_select(0, self.slots.to(packed.device))
        out = values.new_full((self.shape[0] * self.shape[1],) + tuple(values.shape[1:]), fill)
        out = out.index_copy(0, self.where.to(values.device), values)
        return out.view(*self.shape, *values.shape[1:])

    def last_tokens(self) -> torch.Tensor:
        """(N,) index in the packed row of each sequence's last real token."""
        return self.slots[torch.cumsum(self.lengths, 0) - 1]

    def per_sequence(self, packed: torch.Tensor) -> torch.Tensor:
        """(1, P) per-token numbers of the packed row -> (N,) their sum over each sequence's real tokens."""
        values = packed[0].index_select(0, self.slots.to(packed.device))
        owner = torch.repeat_interleave(torch.arange(self.lengths.numel()), self.lengths).to(values.device)
        return values.new_zeros(self.lengths.numel()).index_add(0, owner, values)


def _real_tokens(input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor],
                 position_ids: Optional[torch.Tensor]) -> tuple:
    """(is_real (B, S) bool, positions (B, S), lengths (N,))."""
    batch, seq = input_ids.shape
    if attention_mask is None and position_ids is not None and batch == 1:
        cu = packed_cu_seqlens(position_ids.reshape(-1).to(input_ids.device), argument="position_ids")
        if cu is not None:  # one packed row of documents
            lengths = (cu[1:] - cu[:-1]).to(torch.long)
            positions = position_ids.reshape(1, seq).to(input_ids.device)
            return torch.ones_like(input_ids, dtype=torch.bool), positions, lengths
    if attention_mask is None:
        is_real = torch.ones_like(input_ids, dtype=torch.bool)
    else:
        if attention_mask.shape != input_ids.shape:
            raise UnsupportedArgument(
                "attention_mask", attention_mask,
                f"expected a (batch, seq_len) padding mask shaped like input_ids {tuple(input_ids.shape)}.",
                "pass the tokenizer's attention_mask (1 = real token, 0 = padding).")
        is_real = attention_mask.to(input_ids.device) != 0
    positions = is_real.long().cumsum(-1) - 1
    if position_ids is not None:
        given = position_ids.to(input_ids.device).expand(batch, seq)
        if not bool((given[is_real] == positions[is_real]).all()):
            raise UnsupportedArgument(
                "position_ids", position_ids,
                "scoring runs every sequence as one document numbered 0..n-1 over its real tokens (what the padded "
                "batch computes with position_ids = attention_mask.cumsum(-1) - 1); these position ids number the "
                "real tokens otherwise, which one packed row cannot reproduce.",
                "drop position_ids (they are derived from the attention mask), or give 0..n-1 over each row's real "
                "tokens.")
    lengths = is_real.sum(-1)
    if bool((lengths == 0).any()):
        row = int(torch.nonzero(lengths == 0)[0])
        raise UnsupportedArgument(
            "attention_mask", attention_mask, f"row {row} has no real token: there is nothing to score.",
            "drop empty rows from the batch.")
    return is_real, positions.clamp(min=0), lengths


def _pad_amounts(lengths: torch.Tensor, layout_multiple: int, per_document: bool) -> torch.Tensor:
    """(N,) pad tokens appended to each document: every document to a multiple (zigzag), or the last one so that
    the row is a multiple (contiguous and stripe)."""
    if per_document:
        return -lengths % layout_multiple
    pads = torch.zeros_like(lengths)
    pads[-1] = -int(lengths.sum()) % layout_multiple
    return pads


def pack_rows(input_ids: torch.Tensor, *, attention_mask: Optional[torch.Tensor] = None,
              position_ids: Optional[torch.Tensor] = None, labels: Optional[torch.Tensor] = None,
              multiple: int = 1, per_document: bool = False) -> PackedRows:
    """The batch as one packed row (module docstring).

    input_ids:       (B, S) rows, padded on either side (``attention_mask`` 0 at padding, anywhere in the row), or
                     (1, T) one packed row whose ``position_ids`` restart at each document (no mask).
    labels:          (B, S) unshifted labels (HF convention; -100 = not scored), or None to score every real token.
    multiple:        the row is padded to a multiple of it: the CP group size (contiguous layout) or 2 x it
                     (zigzag), per document when ``per_document``.
    """
    if input_ids.dim() != 2:
        raise UnsupportedArgument("input_ids", input_ids, "expected token ids of shape (batch, seq_len).",
                                  "pass a 2-D tensor of token ids.")
    is_real, positions, lengths = _real_tokens(input_ids, attention_mask, position_ids)
    if labels is None:
        labels = input_ids
    elif labels.shape != input_ids.shape:
        raise UnsupportedArgument("labels", labels, f"expected unshifted labels shaped like input_ids "
                                  f"{tuple(input_ids.shape)}.", "pass labels aligned with input_ids (HF convention).")
    flat_real = is_real.reshape(-1)
    where = torch.nonzero(flat_real).flatten()
    ids = input_ids.reshape(-1)[where]
    pos = positions.reshape(-1)[where]
    lab = labels.to(input_ids.device).reshape(-1)[where].clone()
    lab[pos == 0] = IGNORE_INDEX  # a document's first token is no token's next token
    pads = _pad_amounts(lengths.to("cpu"), multiple, per_document)
    ids, pos, lab, slots = _append_padding(ids, pos, lab, lengths.to("cpu"), pads)
    return PackedRows(input_ids=ids[None], position_ids=pos[None], labels=lab[None], where=where, slots=slots,
                      shape=tuple(input_ids.shape), lengths=lengths.to("cpu"))


def _append_padding(ids, pos, lab, lengths, pads):
    """Insert ``pads[i]`` pad tokens after document i: token 0, label -100, positions continuing the document.
    Returns the new (ids, pos, lab) and the packed-row index of every real token."""
    if int(pads.sum()) == 0:
        return ids, pos, lab, torch.arange(ids.numel())
    pieces_ids, pieces_pos, pieces_lab, slots = [], [], [], []
    start = out = 0
    for length, pad in zip(lengths.tolist(), pads.tolist()):
        pieces_ids += [ids[start:start + length], ids.new_zeros(pad)]
        pieces_pos += [pos[start:start + length], torch.arange(length, length + pad, dtype=pos.dtype).to(pos.device)]
        pieces_lab += [lab[start:start + length], lab.new_full((pad,), IGNORE_INDEX)]
        slots.append(torch.arange(out, out + length))
        start += length
        out += length + pad
    return torch.cat(pieces_ids), torch.cat(pieces_pos), torch.cat(pieces_lab), torch.cat(slots)


def pack_for_ring(ctx, input_ids: torch.Tensor, *, attention_mask: Optional[torch.Tensor] = None,
                  position_ids: Optional[torch.Tensor] = None, labels: Optional[torch.Tensor] = None) -> PackedRows:
    """``pack_rows`` padded for the layout the ring splits the packed row in (``ctx``: the ``RingContext``, or None
    without CP: no padding): every document to a multiple of 2 x the group size for the zigzag layout, else the
    row to a multiple of the group size."""
    if ctx is None:
        return pack_rows(input_ids, attention_mask=attention_mask, position_ids=position_ids, labels=labels)
    documents = pack_rows(input_ids, attention_mask=attention_mask, position_ids=position_ids).lengths.numel()
    _, layout = plan_step(ctx.variant, packed=documents > 1)
    zigzag = layout == "zigzag"
    return pack_rows(input_ids, attention_mask=attention_mask, position_ids=position_ids, labels=labels,
                     multiple=(2 if zigzag else 1) * ctx.world_size, per_document=zigzag)
