"""TRL's fused LM head on whole batches under context parallelism: the call a preference trainer makes, exact.

TRL's DPO (and its other sequence-scoring trainers) call ``model(input_ids, attention_mask, labels=labels,
fused_lm_head=True)`` on the WHOLE batch, right-padded rows of ``[chosen; rejected]``, and read per-token fields
of the ``FusedCausalLMOutput``: ``log_probs`` (B, S-1), ``entropy``, ``mean_logits``, ``is_top1``,
``log_sum_sq_probs``, ``label_mask``. ``install_whole_batch_scoring(patch, model)`` hooks the model that
``add_fused_lm_head`` patched, around every other hook hfpatch put on it:

- before the forward (first of all pre-hooks): the batch becomes one packed row of its real tokens
  (``hfpatch.scoring.rows``), this rank's shard of it (``patch.shard_inputs``), and the labels TRL's head scores
  pre-shifted (``shift_labels``); ``attention_mask`` and the unshifted ``labels`` are dropped (the packing honours
  them);
- after it (last of all hooks): every per-token field of this rank's tokens is gathered over the CP group
  (``hfpatch.scoring.gather``: one number per token per field, never the logits) and put back in the batch's shape,
  and ``loss`` is recomputed from the gathered log-probs as TRL's head computes it.

So the trainer computes its loss and every metric from the non-CP numbers, on every rank; the parameter gradients
summed over the CP group are the non-CP ones. Under an inactive patch the hooks do nothing. A call without
``fused_lm_head=True`` (``return_outputs=True``, the deprecated logits path) would run the whole batch as one
rank's shard and is refused by name, as are MoE router logits (their auxiliary loss would be this rank's).
"""
from __future__ import annotations

import threading
from typing import Callable, Optional

import torch

from hfpatch.errors import UnsupportedArgument
from hfpatch.undo import UndoStack
from hfpatch.modes import current_mode
from hfpatch.scoring import gather
from hfpatch.scoring.rows import PackedRows, pack_for_ring

__all__ = ["install_whole_batch_scoring", "PER_TOKEN_FIELDS"]

# FusedCausalLMOutput's per-token fields (TRL 1.16): floats, and the bools gathered as bytes.
PER_TOKEN_FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1", "label_mask")


class _Pending(threading.local):
    """The packed rows of the current whole-batch forward of this thread, per model (set before, read after)."""

    def __init__(self) -> None:
        self.rows: dict = {}


def install_whole_batch_scoring(patch, model: torch.nn.Module) -> UndoStack:
    """Hook ``model`` (the module whose forward TRL's ``add_fused_lm_head`` replaced) as the module docstring
    says; ``patch``: the active ``hfpatch.Patch`` the model is on. Returns both hooks as one ``UndoStack``."""
    pending = _Pending()

    def live():
        ctx = patch.live_ctx_or_none()
        return ctx if ctx is not None and ctx.world_size > 1 and current_mode() != "local" else None

    def before(module, args, kwargs):
        ctx = live()
        if ctx is None:
            return None
        kwargs = dict(kwargs)
        if args:
            kwargs["input_ids"], args = args[0], args[1:]
        _refuse(kwargs, module)
        rows = pack_for_ring(ctx, kwargs.pop("input_ids"), attention_mask=kwargs.pop("attention_mask", None),
                             position_ids=kwargs.pop("position_ids", None), labels=kwargs.pop("labels", None))
        shard = patch.shard_inputs(rows.input_ids, labels=rows.labels, position_ids=rows.position_ids)
        pending.rows[id(module)] = (rows, kwargs.get("num_items_in_batch"))
        kwargs.update(input_ids=shard["input_ids"], position_ids=shard["position_ids"], shift_labels=shard["labels"])
        return args, kwargs

    def after(module, args, kwargs, output):
        entry = pending.rows.pop(id(module), None)
        if entry is None:
            return None
        rows, num_items = entry
        return _whole_batch_output(live(), rows, output, num_items)

    return UndoStack(f"the whole-batch scoring of {type(model).__name__}",
                     model.register_forward_pre_hook(before, with_kwargs=True, prepend=True),
                     model.register_forward_hook(after, with_kwargs=True))


def _refuse(kwargs: dict, module) -> None:
    if not kwargs.get("fused_lm_head"):
        raise UnsupportedArgument(
            "fused_lm_head", kwargs.get("fused_lm_head"),
            f"the trainer called {type(module).__name__} on the whole batch without TRL's fused LM head (the "
            "return_outputs=True / logits path): under CP every rank would run the whole batch as its shard.",
            "leave evaluation's prediction_loss_only on (the default without compute_metrics), and drop "
            "compute_metrics from a preference trainer under CP.")
    if kwargs.get("output_router_logits"):
        raise UnsupportedArgument(
            "output_router_logits", True,
            "the mixture-of-experts load-balancing loss would be computed from this rank's tokens only.",
            "set router_aux_loss_coef=0.0 (and output_router_logits=False) under CP.")
    if kwargs.get("shift_labels") is not None:
        raise UnsupportedArgument(
            "shift_labels", kwargs["shift_labels"],
            "whole-batch scoring shifts the labels itself, within each sequence.",
            "pass the unshifted labels (HF convention), as TRL's preference trainers do.")
    if kwargs.get("inputs_embeds") is not None:
        raise UnsupportedArgument("inputs_embeds", kwargs["inputs_embeds"],
                                  "whole-batch scoring splits token ids.", "pass input_ids.")


def _whole_batch_output(ctx, rows: PackedRows, output, num_items):
    """This rank's FusedCausalLMOutput -> the whole batch's (module docstring)."""
    fields = {}
    for name in PER_TOKEN_FIELDS:
        local = getattr(output, name, None)
        if local is None:
            continue
        as_float = local.dtype == torch.bool
        whole = gather.gather_tokens(ctx, local.to(torch.uint8) if as_float else local)
        whole = rows.unpack(whole)[:, :-1]
        fields[name] = whole.to(torch.bool) if as_float else whole
    log_probs = fields["log_probs"]
    counted = fields["label_mask"].sum() if "label_mask" in fields else (log_probs != 0).sum()
    divisor = counted.clamp(min=1) if num_items is None else num_items
    fields["loss"] = -log_probs.sum() / divisor
    for name, value in output.items():
        fields.setdefault(name, value)
    return type(output)(**fields)


def model_scored_by(trainer_model: torch.nn.Module, unwrap: Callable) -> Optional[torch.nn.Module]:
    """The module whose forward TRL's ``add_fused_lm_head`` replaced: the PEFT base model of a PEFT policy, else
    the model itself; None when it carries no fused head."""
    model = unwrap(trainer_model)
    base = model.get_base_model() if hasattr(model, "get_base_model") and hasattr(model, "peft_config") else model
    return base if "forward" in vars(base) else None

