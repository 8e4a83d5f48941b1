"""One trainer batch -> this rank's part of it under context parallelism.

A batch as transformers' and TRL's collators build it (every rank of a CP group holds the same one):
``input_ids`` (B, S); ``labels`` (B, S, unshifted) or ``shift_labels`` (already shifted); optional
``position_ids``; optional ``attention_mask`` (right padding only); TRL's padding-free extras ``cu_seq_lens_q/k``,
``max_length_q/k``, ``seq_idx`` (one row of packed documents). ``prepare_batch`` returns the inputs of this rank:
``input_ids`` and GLOBAL ``position_ids`` (within each document when packed) in the ring's layout, and
``shift_labels`` (already shifted, recognised by the labels hook of ``hfpatch.model.labels`` and by TRL's fused LM
head). Everything the ring derives itself is dropped after it has been checked:

- ``attention_mask``: accepted when every row is ones followed by zeros (right padding) and every padded
  token's label is -100; then, causally, no counted token sees a pad token and dropping the mask is exact.
  Left padding or holes are refused (``UnsupportedArgument``).
- ``cu_seq_lens_q/k``: must equal the documents the position ids give (HF's rule: a document starts where the
  position is 0), else refused; ``max_length_q/k`` and ``seq_idx`` follow from them.

Images (a vision-language model of ``hfpatch.model.multimodal``'s families, ``multimodal.FAMILIES``): the image
inputs (``pixel_values``, ``image_grid_thw``, ...: ``inputs_guard.is_modality_input``) pass whole to every rank;
Qwen-VL's token types (``mm_token_type_ids``, and ``token_type_ids`` in a batch with images) are padded with 0
(text) and split as the token ids are, and the image hooks gather them back to the whole row before the base model.
Position ids the batch does not give stay "not given" (``StepState.positions_given`` False), so the model numbers
its own positions over the whole row (Qwen-VL's 3-D rotary ones); multimodal rotary position ids given in the
batch ((3, B, S)) are refused, as the end padding cannot continue them.

The row is padded at its end to a multiple of 2 x the CP size (the zigzag layout's chunks) with the token
``padding_token(model)`` gives (0, or the pad token of a head that pools each row's last non-pad token, which that
rule never pools), label -100, positions continuing the row (a new document when packed): exact for causal
models, and the count of labelled tokens (``num_items_in_batch``) is unchanged. The tokens the non-CP run does not
count -- the end padding, and those the dropped attention mask leaves out -- are recorded on the step
(``StepState.token_weights``), which the model's own means over tokens (the MoE load-balancing loss,
``hfpatch.model.router_loss``) weigh by, as the non-CP model weighs by its attention mask.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping, Optional

import torch

from hfpatch.errors import UnsupportedArgument
from hfpatch.inputs import IGNORE_INDEX
from hfpatch.attention.step import packed_cu_seqlens
from hfpatch.model.heads import head_of, pad_token_id
from hfpatch.model.inputs_guard import is_modality_input
from hfpatch.model.multimodal import PER_TOKEN_INPUTS
from hfpatch.model.wrappers import inner_model
from ring_kernels.layout import shard

__all__ = ["prepare_batch", "padding_token", "PACKING_KEYS"]

# TRL's padding-free collator (and transformers' DataCollatorWithFlattening): derived from the position ids.
PACKING_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")
# Per-token inputs of a vision-language model (Qwen-VL's token types), split with the token ids; the image hooks
# of hfpatch.model.multimodal gather them back to the whole row before the base model.
_TOKEN_TYPES = tuple(key for key in PER_TOKEN_INPUTS if key not in ("input_ids", "attention_mask", "position_ids"))


def padding_token(model) -> int:
    """The token ``prepare_batch`` pads rows with for ``model`` (a transformers model, or a wrapper of one): 0; for
    a head that pools each row's last non-pad token (``hfpatch.model.heads``), its ``pad_token_id``. Such a head
    without a pad token pools each row's last token, which the end padding would move: ``UnsupportedArgument``."""
    inner = inner_model(model)
    if head_of(inner).kind != "last-token":
        return 0
    pad = pad_token_id(inner)
    if pad is None:
        raise UnsupportedArgument(
            "pad_token_id", None,
            f"{type(inner).__name__} pools each row's last token when its config has no pad token, and under context "
            "parallelism the integration pads every row at its end to a multiple of 2 x the CP size, which would "
            "move that token.", "set model.config.pad_token_id to the tokenizer's pad token id.")
    return int(pad)


def prepare_batch(patch, inputs: Mapping[str, Any], *, pad_token: int = 0) -> dict:
    """This rank's inputs for the model (see the module docstring); ``patch``: an active ``hfpatch.Patch``;
    ``pad_token``: the token of the end padding (``padding_token(model)``)."""
    rest = dict(inputs)
    input_ids = rest.pop("input_ids", None)
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise UnsupportedArgument(
            "input_ids", input_ids,
            "context parallelism splits the token ids of each row; this batch has no 2-D input_ids "
            f"(keys: {sorted(inputs)}).",
            "feed token ids (batch, seq_len); inputs_embeds cannot be split by hfpatch.integrations.",
        )
    labels = _unshifted_labels(rest.pop("labels", None), rest.pop("shift_labels", None), input_ids)
    positions = _two_d_positions(rest.pop("position_ids", None), input_ids)
    mask = rest.pop("attention_mask", None)
    _check_attention_mask(mask, labels, input_ids)
    packed = _check_packing(rest, positions, input_ids)
    token_types = _token_types(rest, input_ids)
    _refuse_other_sequences(rest, input_ids)
    seq = input_ids.shape[1]
    given = positions is not None
    input_ids, labels, positions = _pad(input_ids, labels, positions, packed, 2 * patch.ctx.world_size, pad_token)
    # Position ids the collator did not give stay "not given" (shard_inputs numbers the padded row 0..S-1 itself,
    # as _pad did): the image hooks of hfpatch.model.multimodal recognise the ones it returns and let the model
    # number its own positions over the whole row (Qwen-VL's 3-D rotary ones), also as copied by a trainer's
    # device move.
    shard = patch.shard_inputs(input_ids, labels=labels, position_ids=positions if given else None)
    _weigh_tokens(patch.ctx, mask, seq, input_ids.shape[1])
    rest.update(_shard_token_types(patch.ctx, token_types, input_ids.shape[1] - seq))
    rest.update(input_ids=shard["input_ids"], position_ids=shard["position_ids"])
    if shard["labels"] is not None:
        rest["shift_labels"] = shard["labels"]
    return rest


def _weigh_tokens(ctx, mask, seq: int, padded: int) -> None:
    """Record on the step which of this rank's tokens the non-CP run counts (``StepState.token_weights``): the
    batch's attention mask (the model's own means over tokens, the MoE load-balancing loss, weigh by it), 0 on the
    end padding. Nothing when every token counts, or when ``shard_inputs`` recorded no step."""
    step = getattr(ctx, "step", None)
    if step is None or (mask is None and padded == seq):
        return
    weights = torch.ones(step.batch_size, seq) if mask is None else (mask.to("cpu") != 0).float()
    weights = torch.cat([weights, weights.new_zeros(step.batch_size, padded - seq)], dim=1)
    ctx.set_step(replace(step, token_weights=shard(weights, ctx.group, layout=step.layout, dim=1,
                                                   cu_seqlens=step.cu_seqlens)))


def _unshifted_labels(labels, shift, input_ids) -> Optional[torch.Tensor]:
    """The unshifted labels (HF convention) of the batch: ``labels``, or ``shift_labels`` shifted back."""
    if shift is None:
        return labels
    if labels is not None and not torch.equal(shift[:, :-1], labels[:, 1:].to(shift.device)):
        raise UnsupportedArgument(
            "shift_labels", shift, "the batch holds labels and shift_labels that disagree (shift_labels[:, t] must "
            "be labels[:, t + 1]).", "give one of them.")
    if shift.shape != input_ids.shape or bool((shift[:, -1] != IGNORE_INDEX).any()):
        raise UnsupportedArgument(
            "shift_labels", shift,
            f"expected shift_labels shaped like input_ids {tuple(input_ids.shape)} whose last position is -100 "
            "(the last token has no next token).",
            "pass the unshifted labels instead (HF convention).",
        )
    return torch.cat([torch.full_like(shift[:, :1], IGNORE_INDEX), shift[:, :-1]], dim=1)


def _check_attention_mask(mask, labels, input_ids) -> None:
    if mask is None:
        return
    mask = mask.to(input_ids.device)
    if mask.shape != input_ids.shape:
        raise UnsupportedArgument(
            "attention_mask", mask, f"a {mask.dim()}-D mask of shape {tuple(mask.shape)}: only a (batch, seq_len) "
            "padding mask can be checked and dropped under context parallelism.",
            "let the model build its causal mask (no attention_mask), or pack documents with position ids.")
    valid = mask != 0
    right_padded = bool((valid[:, 1:] <= valid[:, :-1]).all())  # once a row has a zero, it has only zeros
    if not right_padded:
        raise UnsupportedArgument(
            "attention_mask", mask,
            "the mask has zeros before ones in a row (left padding or holes); ring attention runs causal attention "
            "without a padding mask, so real tokens would attend to those padded ones.",
            "pad on the right (tokenizer.padding_side = 'right'), or use TRL's padding_free=True.",
        )
    if bool(valid.all()):
        return
    if labels is None or bool((labels.to(mask.device)[~valid] != IGNORE_INDEX).any()):
        raise UnsupportedArgument(
            "attention_mask", mask,
            "padded tokens (mask 0) have labels other than -100; without the mask they would be counted with "
            "attention over the padding, unlike the non-CP run.",
            "label padding -100 (DataCollatorForLanguageModeling and TRL's collators do).",
        )


def _check_packing(rest: dict, positions, input_ids) -> bool:
    """Pop TRL's padding-free keys after checking them against the position ids; True for a packed row."""
    found = {key: rest.pop(key) for key in PACKING_KEYS if key in rest}
    cu = packed_cu_seqlens(positions[0]) if positions is not None and positions.shape[0] == 1 else None
    for key in ("cu_seq_lens_q", "cu_seq_lens_k"):
        if key not in found:
            continue
        expected = cu if cu is not None else torch.tensor([0, input_ids.shape[1]], dtype=torch.int32)
        given = found[key]
        if input_ids.shape[0] != 1 or not torch.equal(given.to("cpu", torch.int64), expected.to("cpu", torch.int64)):
            raise UnsupportedArgument(
                key, given,
                f"the documents it describes differ from those of the position ids ({expected.tolist()}); hfpatch "
                "derives the documents from the global position ids (each starts at position 0).",
                "give each document positions 0..len-1 in one row (TRL's padding-free collator does).",
            )
    return cu is not None


def _two_d_positions(positions, input_ids) -> Optional[torch.Tensor]:
    """The batch's position ids broadcast to (B, S), or None. Multimodal rotary positions ((3, B, S) or (4, B, S):
    Qwen-VL) are refused: the integration pads the row at its end, and those cannot be continued over it here."""
    if positions is None:
        return None
    if positions.dim() > 2:
        raise UnsupportedArgument(
            "position_ids", positions,
            f"position ids of shape {tuple(positions.shape)}; hfpatch.integrations splits (batch, seq_len) position "
            "ids, and pads the rows at their end, which multimodal rotary positions (3, batch, seq_len) cannot be "
            "continued over.",
            "leave position_ids out of the batch: a Qwen-VL model numbers its own multimodal positions over the "
            "whole row under CP (hfpatch.model.multimodal).")
    return positions.to(input_ids.device).expand(input_ids.shape)


def _token_types(rest: dict, input_ids) -> dict:
    """Pop the per-token inputs ``hfpatch.model.multimodal`` gathers back to the whole row before a
    vision-language base model, (B, S) each, to be padded and split as the token ids are: ``mm_token_type_ids``
    (Qwen-VL's processors give it with every batch, with images or without), and ``token_type_ids`` in a batch
    with image inputs (without images, no hook takes it: it stays refused as any other per-token input). Another
    shape is refused by name."""
    images = any(is_modality_input(key, value) for key, value in rest.items())
    found = {}
    for key in _TOKEN_TYPES if images else ("mm_token_type_ids",):
        value = rest.pop(key, None)
        if value is None:
            continue
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(input_ids.shape):
            raise UnsupportedArgument(
                key, value, f"a per-token input of shape {tuple(getattr(value, 'shape', ()))}, not that of "
                f"input_ids {tuple(input_ids.shape)}; hfpatch.integrations splits it with the token ids.",
                "give it per token, shaped like input_ids (the model's processor does).")
        found[key] = value.to(input_ids.device)
    return found


def _shard_token_types(ctx, token_types: dict, extra: int) -> dict:
    """This rank's part of each token-type tensor: padded at the end with ``extra`` zeros (text tokens) like the
    token ids, then split in the step's layout (identity when no step was recorded)."""
    step = getattr(ctx, "step", None)
    out = {}
    for key, value in token_types.items():
        value = torch.cat([value, value.new_zeros(value.shape[0], extra)], dim=1)
        out[key] = value if step is None else shard(value, ctx.group, layout=step.layout, dim=1,
                                                    cu_seqlens=step.cu_seqlens)
    return out


def _refuse_other_sequences(rest: dict, input_ids) -> None:
    """Refuse a per-token tensor the integration does not split; the image inputs (``pixel_values``,
    ``image_grid_thw``, ...: ``inputs_guard.is_modality_input``) pass whole to every rank."""
    for key, value in rest.items():
        if is_modality_input(key, value):
            continue
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and tuple(value.shape[:2]) == tuple(input_ids.shape):
            raise UnsupportedArgument(
                key, value,
                "a per-token input hfpatch.integrations does not split over the CP ranks (it splits input_ids, "
                "labels and position_ids).",
                "drop it from the batch (remove_unused_columns=True), or train without CP.",
            )


def _pad(input_ids, labels, positions, packed: bool, multiple: int, pad_token: int):
    """Pad the rows at their end to a multiple of ``multiple`` tokens (see the module docstring)."""
    batch, seq = input_ids.shape
    extra = -seq % multiple
    if positions is None:
        positions = torch.arange(seq, device=input_ids.device).unsqueeze(0).expand(batch, seq)
    if extra == 0:
        return input_ids, labels, positions
    input_ids = torch.cat([input_ids, input_ids.new_full((batch, extra), pad_token)], dim=1)
    if labels is not None:
        labels = torch.cat([labels, labels.new_full((batch, extra), IGNORE_INDEX)], dim=1)
    tail = torch.arange(extra, device=positions.device).unsqueeze(0).expand(batch, extra)
    start = 0 if packed else positions[:, -1:] + 1
    return input_ids, labels, torch.cat([positions, tail + start], dim=1)
