"""Images under context parallelism: the vision tower and the feature scatter run on the whole sequence, and only
then is the sequence sharded.

A vision-language model of a recognised family (``FAMILIES``) has a base model whose forward embeds the tokens,
encodes every image with its vision tower, writes the features over the image placeholders
(``inputs_embeds.masked_scatter``), works out its positions (Qwen2-VL's 3-D multimodal rotary positions and
``rope_deltas``) and then calls its text model with ``inputs_embeds=``. Each of those steps reads the WHOLE row: the
placeholders of an image may straddle two ranks' shards, and the rotary position of a text token after an image
depends on the image's grid. ``install`` puts two hooks on such a model; while a patch is live, its switch is not
``"local"`` and a call passes an image input (``pixel_values``, ``image_embeds``, ...):

1. before the base model (arguments passed positionally, as a ``*ForConditionalGeneration`` passes ``input_ids``,
   are named by the base model's forward): every per-token tensor the caller passed for this rank's shard
   (``input_ids``, ``attention_mask``, ``position_ids``, ``mm_token_type_ids``, ``token_type_ids``: the length of
   the step's shard) is gathered into the whole row in the step's layout (one all_gather of integers each), so the base
   model embeds, encodes, scatters and numbers positions exactly as it does without CP. Per-token tensors of the
   whole row's length are left whole. The position ids ``shard_inputs`` made up for a caller who gave none stand
   for no position ids: the model then computes its own, as it would without CP.
2. before the text model: ``inputs_embeds``, ``position_ids`` (their last axis: (B, S), (3, B, S) or
   (4, B, S)), a 2-D ``attention_mask``, ``cache_position`` and token types that reach it are cut to this rank's
   tokens, in the step's layout; position ids the base model left unset become the global positions of this
   rank's tokens. Qwen3-VL's ``visual_pos_masks`` (B, S) is cut the same way, and each of its DeepStack features
   (``deepstack_visual_embeds``: one (visual tokens of the whole batch, hidden) tensor per early decoder layer, in
   row-major order of the whole mask) is reduced to the rows of the visual tokens this rank holds, in the order
   its text model reads them (``visual_rows``). The text model, the labels hook and the heads then see exactly
   what a text-only step gives them.

A text model with recurrent layers (Qwen3.5's gated delta rule) runs under ``hfpatch.mixers``, which carries the
state across the documents of a packed row as transformers' torch path does: a packed row with images is exact
against the model's own run of that row, not against its documents run alone.

The vision tower therefore runs on every image on every rank (a modality tower is never routed onto the ring:
``hfpatch.model.routing.modality_towers``). Its gradient on a rank comes through that rank's placeholders only, so
summed over the CP group (as data parallelism over dp x cp sums every gradient) it is the non-CP gradient, as for
every other parameter. The whole row's embeddings (B x S x hidden) exist on every rank for the length of the scatter.

Anything else refuses by name (``UnsupportedArgument``): video inputs (``pixel_values_videos``, ...), an image
call without a step (``shard_inputs`` or ``describe_split`` first), ``inputs_embeds`` instead of ``input_ids``,
more positional arguments than the base model's forward names, a text-model argument of the whole row's length
that this module does not cut, a list of tensors handed to the text model that it has not read, DeepStack features
without their mask or with a row count other than the mask's. A model whose base model hfpatch does not
recognise (another family, a release before the family's ``first_release``, a base model without a separate text
model) keeps the inputs guard (``hfpatch.model.inputs_guard``).
"""
from __future__ import annotations

import inspect
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from packaging.version import Version

from hfpatch import version_gates
from hfpatch.errors import UnsupportedArgument
from hfpatch.model.inputs_guard import is_modality_input
from hfpatch.model.positions import global_positions
from hfpatch.modes import current_mode
from hfpatch.undo import UndoStack
from ring_kernels.layout import unshard

__all__ = ["FAMILIES", "PER_TOKEN_INPUTS", "ImageScatter", "first_release", "recognise", "install", "visual_rows"]

# transformers families whose base model scatters the encoded images into ``inputs_embeds`` and then calls
# ``self.language_model(inputs_embeds=...)``, read from their modeling files (Qwen3-VL adds its DeepStack
# arguments; Llava-NeXT's anyres packing and Mistral3's Pixtral tower run inside the base model, on the whole row);
# each is exact under CP in tests/model/test_vlm_images.py. Gemma-3 is not among them: its text model attends
# bidirectionally inside each image span, which the ring kernels' causal mask cannot express (and it has no flash
# path, so apply refuses it).
FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "llava", "llava_next", "mistral3")
# Families whose images are scattered from a later release than ``version_gates.TRANSFORMERS_IMAGES_UNDER_CP``
# (the comment of each constant says why).
_FIRST_RELEASE = {"qwen3_vl": version_gates.TRANSFORMERS_QWEN3_VL_IMAGES_UNDER_CP}
# Per-token inputs of the base model that describe the row (gathered to the whole row before it runs).
PER_TOKEN_INPUTS = ("input_ids", "attention_mask", "position_ids", "mm_token_type_ids", "token_type_ids")
# Text-model arguments cut to this rank's tokens, and the axis of each that holds the row (-1: the last).
_CUT = {"inputs_embeds": 1, "position_ids": -1, "attention_mask": 1, "cache_position": 0, "mm_token_type_ids": 1,
        "token_type_ids": 1, "visual_pos_masks": 1}
# Text-model arguments that hold one row per visual token of the whole batch, in row-major order of the named
# (B, S) mask of the whole row; each tensor (or each of a list of them) is reduced to the rows of the visual tokens
# this rank holds. Qwen3-VL's DeepStack features: one (visual tokens, hidden) tensor per early decoder layer, added
# to the hidden states at ``visual_pos_masks``.
_VISUAL_ROWS = {"deepstack_visual_embeds": "visual_pos_masks"}


@dataclass(frozen=True)
class ImageScatter:
    """A recognised vision-language model: ``base`` is the module whose forward scatters the image features (the
    model itself or its ``.model``), ``text`` its text model (``base.language_model``), ``family`` its transformers
    family."""

    base: torch.nn.Module
    text: torch.nn.Module
    family: str


def _family(module: torch.nn.Module) -> str:
    name = type(module).__module__
    prefix = "transformers.models."
    return name[len(prefix):].split(".")[0] if name.startswith(prefix) else ""


def _scatters_then_calls_text_model(base: torch.nn.Module) -> bool:
    """The base model's forward writes features over placeholders and hands ``inputs_embeds`` to its text model."""
    try:
        source = inspect.getsource(type(base).forward)
    except (OSError, TypeError):
        return False
    return "masked_scatter" in source and "self.language_model(" in source and "inputs_embeds=inputs_embeds" in source


def first_release(family: str) -> Version:
    """The first transformers release whose images of ``family`` (one of ``FAMILIES``) hfpatch scatters."""
    return _FIRST_RELEASE.get(family, version_gates.TRANSFORMERS_IMAGES_UNDER_CP)


def recognise(model: torch.nn.Module) -> Optional[ImageScatter]:
    """The ``ImageScatter`` of ``model`` (a ``*ForConditionalGeneration`` or its base model), or None when its
    family is not in ``FAMILIES``, the installed transformers is older than the family's ``first_release``, or its
    base model does not scatter then call its text model."""
    installed = version_gates.installed_transformers_version()
    for base in (model, getattr(model, "model", None)):
        if not isinstance(base, torch.nn.Module) or _family(base) not in FAMILIES:
            continue
        if installed is not None and installed < first_release(_family(base)):
            return None
        text = getattr(base, "language_model", None)
        if isinstance(text, torch.nn.Module) and _scatters_then_calls_text_model(base):
            return ImageScatter(base=base, text=text, family=_family(base))
    return None


@dataclass
class _Pending:
    """What the base model's hook hands to the text model's: this rank's token indices in the whole row."""

    index: torch.Tensor
    seq_whole: int
    batch: int


def _positional_names(module: torch.nn.Module) -> list:
    """The names of the parameters ``module``'s forward takes positionally, in order."""
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in inspect.signature(module.forward).parameters.values() if p.kind in kinds]


def _by_name(owner: str, positional: list, args: tuple, kwargs: dict) -> dict:
    """A call's arguments by name (a ``*ForConditionalGeneration`` hands ``input_ids`` to its base model
    positionally); more positional arguments than the forward names are refused."""
    if len(args) > len(positional):
        _refuse("args", args, f"{owner} was called with {len(args)} positional arguments; its forward names "
                f"{len(positional)}.", "pass input_ids, pixel_values and the rest as keywords.")
    return {**dict(zip(positional, args)), **kwargs}


def _whole_row(local: torch.Tensor, step, group) -> torch.Tensor:
    """The whole row of a per-token tensor whose last axis holds this rank's tokens, in global token order."""
    return unshard(local, group, layout=step.layout, dim=local.dim() - 1, cu_seqlens=step.cu_seqlens)


def _made_up(positions: Optional[torch.Tensor], step) -> bool:
    """Whether ``positions`` are the position ids ``shard_inputs`` made up for a caller who gave none (the step's
    ``position_ids`` when ``positions_given`` is False), or a copy of them (a trainer moves each batch to its
    device, which on the CPU copies it)."""
    made_up = step.position_ids
    if positions is None or step.positions_given or made_up is None:
        return False
    return positions is made_up or (positions.shape == made_up.shape
                                    and torch.equal(positions.cpu(), made_up.cpu()))


def _refuse(name: str, value: Any, reason: str, fix: str) -> None:
    raise UnsupportedArgument(name, value, reason, fix)


_UNREAD_FIX = ("train this model's image batches without CP (hfpatch.switch('local')), or report the model so its "
               "argument is added.")


def _is_tensors(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and any(isinstance(item, torch.Tensor) for item in value)


def visual_rows(mask: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Which rows of a whole-batch visual tensor (one row per True of ``mask``, (B, S) over the whole row, in
    row-major order) belong to this rank's tokens ``index`` (their global positions, in this rank's order: not
    increasing under zigzag), in the order a text model holding those tokens reads them: row-major over
    (B, this rank's tokens), as ``hidden[mask[:, index]]`` does."""
    ordinal = mask.flatten().long().cumsum(0).view_as(mask) - 1
    return ordinal.index_select(1, index)[mask.index_select(1, index)]


def _this_ranks_visual_rows(owner: str, name: str, value: Any, mask: Any, index: torch.Tensor) -> Any:
    """``value`` (a tensor or a list of tensors, one row per visual token of the whole batch) reduced to this rank's
    visual tokens (``visual_rows``); refused when the mask it is read with is missing or does not count its rows."""
    mask_name = _VISUAL_ROWS[name]
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.dim() != 2:
        _refuse(name, value, f"{owner} was handed {name} without the boolean (B, S) {mask_name} of the whole row "
                "that says which tokens its rows belong to.", _UNREAD_FIX)
    tensors = list(value) if isinstance(value, (list, tuple)) else [value]
    visual = int(mask.sum())
    if any(not isinstance(t, torch.Tensor) or t.dim() < 1 or t.shape[0] != visual for t in tensors):
        _refuse(name, value, f"{owner} was handed {name} whose tensors do not have one row per token of "
                f"{mask_name} ({visual}).", _UNREAD_FIX)
    rows = visual_rows(mask, index.to(mask.device))
    picked = [t.index_select(0, rows.to(t.device)) for t in tensors]
    return picked if isinstance(value, (list, tuple)) else picked[0]


def install(model: torch.nn.Module, ctx_of: Callable[[], Any]) -> Optional[UndoStack]:
    """Hook a recognised model as the module docstring says; None when ``recognise`` does not recognise it.
    ``ctx_of()``: the ``RingContext`` of the step (None when the patch is inactive or removed)."""
    found = recognise(model)
    if found is None:
        return None
    local = threading.local()
    positional = _positional_names(found.base)

    def before_base(module, args, kwargs):
        local.pending = None
        ctx = ctx_of()
        if ctx is None or ctx.world_size <= 1 or current_mode() == "local":
            return None
        kwargs = _by_name(type(module).__name__, positional, args, kwargs)
        images = [name for name, value in kwargs.items() if is_modality_input(name, value)]
        if not images:
            return None
        step = ctx.step
        owner = type(module).__name__
        videos = [name for name in images if "video" in name]
        if videos:
            _refuse(videos[0], kwargs[videos[0]], f"{owner} takes video under CP, which hfpatch has not tested (its "
                    "images are scattered over the whole row; its video frames are not checked).",
                    "train video batches without CP (hfpatch.switch('local')).")
        if step is None:
            _refuse(images[0], kwargs[images[0]],
                    f"{owner} scatters the encoded images over the whole row before sharding it, which needs the "
                    "step's layout, and no step was recorded.",
                    "call patch.shard_inputs(input_ids, ...) for every batch and pass the input_ids it returns.")
        if kwargs.get("inputs_embeds") is not None:
            _refuse("inputs_embeds", kwargs["inputs_embeds"],
                    f"{owner} scatters the images into embeddings of the whole row, and inputs_embeds given for one "
                    "shard cannot be put back together into it here.",
                    "pass the input_ids shard_inputs returned (the model embeds them).")
        changed = dict(kwargs)
        if _made_up(kwargs.get("position_ids"), step):
            changed["position_ids"] = None  # made up by shard_inputs: the caller gave none
        for name in PER_TOKEN_INPUTS:
            value = changed.get(name)
            if not isinstance(value, torch.Tensor) or value.dim() == 0:
                continue
            if value.shape[-1] == step.seq_len_local and value.shape[-1] != step.seq_len_global:
                changed[name] = _whole_row(value, step, ctx.group)
            elif value.shape[-1] != step.seq_len_global:
                _refuse(name, value,
                        f"{owner} got {name} of length {value.shape[-1]}, neither this rank's shard "
                        f"({step.seq_len_local} tokens) nor the whole row ({step.seq_len_global}).",
                        "pass the shard shard_inputs returned, or the whole row.")
        if changed.get("input_ids") is None or changed["input_ids"].shape[-1] != step.seq_len_global:
            _refuse("input_ids", changed.get("input_ids"), f"{owner} needs the input_ids of this step under CP "
                    "with images.", "pass the input_ids shard_inputs returned.")
        index = global_positions(ctx, step.seq_len_local)
        local.pending = _Pending(index=index, seq_whole=step.seq_len_global, batch=step.batch_size)
        return (), changed

    def after_base(module, args, kwargs, output):
        local.pending = None  # a text model the base model never reached must not cut a later call
        return None

    def before_text(module, args, kwargs):
        pending = getattr(local, "pending", None)
        if pending is None:
            return None
        local.pending = None
        changed = dict(kwargs)
        embeds = changed.get("inputs_embeds")
        index = pending.index.to(embeds.device if isinstance(embeds, torch.Tensor) else "cpu")
        owner = type(module).__name__
        for name, mask_name in _VISUAL_ROWS.items():
            if kwargs.get(name) is not None:
                changed[name] = _this_ranks_visual_rows(owner, name, kwargs[name], kwargs.get(mask_name), index)
        for name, value in kwargs.items():
            if _is_tensors(value) and name not in _VISUAL_ROWS:
                _refuse(name, value, f"{owner} was handed {name}, a list of tensors hfpatch has not read, which may "
                        "hold rows of the whole row's tokens.", _UNREAD_FIX)
            if not isinstance(value, torch.Tensor) or value.dim() == 0:
                continue
            axis = _CUT.get(name)
            if axis is not None:
                if value.dim() > max(axis, 0) and value.shape[axis] == pending.seq_whole:
                    changed[name] = value.index_select(axis % value.dim(), index.to(value.device))
            elif value.dim() >= 2 and pending.seq_whole in (value.shape[1], value.shape[-1]):
                _refuse(name, value, f"{owner} was handed {name}, a tensor of the whole row's length "
                        f"({pending.seq_whole}) that hfpatch does not cut to this rank's tokens.", _UNREAD_FIX)
        if changed.get("position_ids") is None:
            changed["position_ids"] = index.to(embeds.device).unsqueeze(0).expand(pending.batch, -1)
        return args, changed

    undo = UndoStack(f"the image scatter of {type(model).__name__}")
    undo.push(found.base.register_forward_pre_hook(before_base, with_kwargs=True))
    undo.push(found.base.register_forward_hook(after_base, with_kwargs=True, always_call=True))
    undo.push(found.text.register_forward_pre_hook(before_text, with_kwargs=True))
    return undo
