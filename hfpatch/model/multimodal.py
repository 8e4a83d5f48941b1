"""Images under context parallelism: the vision tower and the feature scatter run on the whole sequence, and only
then is the sequence sharded.

A vision-language model of a recognised family (``FAMILIES``) has a base model whose forward embeds the tokens,
encodes every image with its vision tower, writes the features over the image placeholders
(``inputs_embeds.masked_scatter``), works out its positions (Qwen2-VL's 3-D multimodal rotary positions and
``rope_deltas``) and then calls its text model with ``inputs_embeds=``. Each of those steps reads the WHOLE row: the
placeholders of an image may straddle two ranks' shards, and the rotary position of a text token after an image
depends on the image's grid. ``install`` puts two hooks on such a model; while a patch is live, its switch is not
``"local"`` and a call passes an image input (``pixel_values``, ``image_embeds``, ...):

1. before the base model: every per-token tensor the caller passed for this rank's shard (``input_ids``,
   ``attention_mask``, ``position_ids``, ``mm_token_type_ids``, ``token_type_ids``: the length of the step's
   shard) is gathered into the whole row in the step's layout (one all_gather of integers each), so the base
   model embeds, encodes, scatters and numbers positions exactly as it does without CP. Per-token tensors of the
   whole row's length are left whole. The position ids ``shard_inputs`` made up for a caller who gave none stand
   for no position ids: the model then computes its own, as it would without CP.
2. before the text model: ``inputs_embeds``, ``position_ids`` (their last axis: (B, S), (3, B, S) or
   (4, B, S)), a 2-D ``attention_mask``, ``cache_position`` and token types that reach it are cut to this rank's
   tokens, in the step's layout; position ids the base model left unset become the global positions of this
   rank's tokens. The text model, the labels hook and the heads then see exactly what a text-only step gives
   them.

The vision tower therefore runs on every image on every rank (a modality tower is never routed onto the ring:
``hfpatch.model.routing.modality_towers``). Its gradient on a rank comes through that rank's placeholders only, so
summed over the CP group (as data parallelism over dp x cp sums every gradient) it is the non-CP gradient, as for
every other parameter. The whole row's embeddings (B x S x hidden) exist on every rank for the length of the scatter.

Anything else refuses by name (``UnsupportedArgument``): an image call without a step (``shard_inputs`` or
``describe_split`` first), ``inputs_embeds`` instead of ``input_ids``, a text-model argument of the whole row's
length that this module does not cut. A model whose base model hfpatch does not recognise (another family, a
release before ``version_gates.TRANSFORMERS_IMAGES_UNDER_CP``, a base model without a separate text model) keeps
the inputs guard (``hfpatch.model.inputs_guard``).
"""
from __future__ import annotations

import inspect
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from hfpatch import version_gates
from hfpatch.errors import UnsupportedArgument
from hfpatch.model.inputs_guard import is_modality_input
from hfpatch.model.positions import global_positions
from hfpatch.modes import current_mode
from hfpatch.undo import UndoStack
from ring_kernels.layout import unshard

__all__ = ["FAMILIES", "PER_TOKEN_INPUTS", "ImageScatter", "recognise", "install"]

# transformers families whose base model scatters the encoded images into ``inputs_embeds`` and then calls
# ``self.language_model(inputs_embeds=...)``, read from their modeling files; each is exact under CP in
# tests/model/test_vlm_images.py. Gemma-3 is not among them: its text model attends bidirectionally inside each
# image span, which the ring kernels' causal mask cannot express (and it has no flash path, so apply refuses it).
FAMILIES = ("qwen2_vl", "qwen2_5_vl", "llava")
# Per-token inputs of the base model that describe the row (gathered to the whole row before it runs).
PER_TOKEN_INPUTS = ("input_ids", "attention_mask", "position_ids", "mm_token_type_ids", "token_type_ids")
# Text-model arguments cut to this rank's tokens, and the axis of each that holds the row (-1: the last).
_CUT = {"inputs_embeds": 1, "position_ids": -1, "attention_mask": 1, "cache_position": 0, "mm_token_type_ids": 1,
        "token_type_ids": 1}


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


def recognise(model: torch.nn.Module) -> Optional[ImageScatter]:
    """The ``ImageScatter`` of ``model`` (a ``*ForConditionalGeneration`` or its base model), or None when its
    family is not in ``FAMILIES``, the installed transformers is older than
    ``version_gates.TRANSFORMERS_IMAGES_UNDER_CP``, or its base model does not scatter then call its text model."""
    installed = version_gates.installed_transformers_version()
    if installed is not None and installed < version_gates.TRANSFORMERS_IMAGES_UNDER_CP:
        return None
    for base in (model, getattr(model, "model", None)):
        if not isinstance(base, torch.nn.Module) or _family(base) not in FAMILIES:
            continue
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


def _whole_row(local: torch.Tensor, step, group) -> torch.Tensor:
    """The whole row of a per-token tensor whose last axis holds this rank's tokens, in global token order."""
    return unshard(local, group, layout=step.layout, dim=local.dim() - 1, cu_seqlens=step.cu_seqlens)


def _refuse(name: str, value: Any, reason: str, fix: str) -> None:
    raise UnsupportedArgument(name, value, reason, fix)


def install(model: torch.nn.Module, ctx_of: Callable[[], Any]) -> Optional[UndoStack]:
    """Hook a recognised model as the module docstring says; None when ``recognise`` does not recognise it.
    ``ctx_of()``: the ``RingContext`` of the step (None when the patch is inactive or removed)."""
    found = recognise(model)
    if found is None:
        return None
    local = threading.local()

    def before_base(module, args, kwargs):
        local.pending = None
        ctx = ctx_of()
        if ctx is None or ctx.world_size <= 1 or current_mode() == "local":
            return None
        images = [name for name, value in kwargs.items() if is_modality_input(name, value)]
        if not images:
            return None
        step = ctx.step
        owner = type(module).__name__
        if step is None:
            _refuse(images[0], kwargs[images[0]],
                    f"{owner} scatters the encoded images over the whole row before sharding it, which needs the "
                    "step's layout, and no step was recorded.",
                    "call patch.shard_inputs(input_ids, ...) for every batch and pass the input_ids it returns.")
        if args:
            _refuse("args", args, f"{owner} was called with positional arguments under CP with images.",
                    "pass input_ids, pixel_values and the rest as keywords.")
        if kwargs.get("inputs_embeds") is not None:
            _refuse("inputs_embeds", kwargs["inputs_embeds"],
                    f"{owner} scatters the images into embeddings of the whole row, and inputs_embeds given for one "
                    "shard cannot be put back together into it here.",
                    "pass the input_ids shard_inputs returned (the model embeds them).")
        changed = dict(kwargs)
        positions = kwargs.get("position_ids")
        if positions is not None and positions is step.position_ids and not step.positions_given:
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
        return args, changed

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
        for name, value in kwargs.items():
            if not isinstance(value, torch.Tensor) or value.dim() == 0:
                continue
            axis = _CUT.get(name)
            if axis is not None:
                if value.dim() > max(axis, 0) and value.shape[axis] == pending.seq_whole:
                    changed[name] = value.index_select(axis % value.dim(), index.to(value.device))
            elif value.dim() >= 2 and pending.seq_whole in (value.shape[1], value.shape[-1]):
                _refuse(name, value, f"{type(module).__name__} was handed {name}, a tensor of the whole row's "
                        f"length ({pending.seq_whole}) that hfpatch does not cut to this rank's tokens.",
                        "train this model's image batches without CP (hfpatch.switch('local')), or report the "
                        "model so its argument is added.")
        if changed.get("position_ids") is None:
            changed["position_ids"] = index.to(embeds.device).unsqueeze(0).expand(pending.batch, -1)
        return args, changed

    undo = UndoStack(f"the image scatter of {type(model).__name__}")
    undo.push(found.base.register_forward_pre_hook(before_base, with_kwargs=True))
    undo.push(found.base.register_forward_hook(after_base, with_kwargs=True, always_call=True))
    undo.push(found.text.register_forward_pre_hook(before_text, with_kwargs=True))
    return undo
