"""``model(..., labels=...)`` under context parallelism: the loss every trainer asks the model for, made equal to
the non-CP loss, or refused by name.

Left to itself, a causal LM shifts the labels it is given by one token and averages the cross-entropy over its
own tokens. Under CP each rank holds a shard, so that loss is wrong twice: the shift happens inside each shard
(the shard's last token loses its target, which lives on the next rank), and the mean is per rank, not over the
whole batch. ``apply(model=)`` therefore hooks the model's forward:

- the labels ``patch.shard_inputs`` returned (already shifted, in the step's layout; recognised by identity) or
  transformers' own ``shift_labels=`` (already shifted by the caller) are taken out of the call, the model runs
  without them, and the loss is computed from its logits: the sum of this rank's token cross-entropies (fp32,
  ignore index -100) divided by the number of counted tokens of the WHOLE batch (``reduce_loss``: one all-reduce),
  or by ``num_items_in_batch`` when given (the count over the whole, unsharded batch, as in the non-CP run). Its
  value is the non-CP ``model(input_ids, labels=labels).loss``; its gradient flows into this rank's tokens only, so
  the parameter gradients summed over the CP group equal the non-CP ones. The output carries it as ``loss``
  (first field, as the model would place it).
- any other ``labels`` tensor is refused (``UnsupportedArgument``): hfpatch cannot tell unshifted shards from
  shifted ones, and shifting a shard locally silently drops a target per rank.
- ``output_router_logits=True`` (at the call or in the config): the output's ``aux_loss`` is the group's
  load-balancing loss (``hfpatch.model.router_loss``: the non-CP value), and the loss adds the model's coefficient
  times it, as the model does; with labels, a load-balancing loss hfpatch does not recognise is refused by name.
- in switch mode ``"local"`` (the model run on the whole sequence, no CP) the model's own loss is left alone.
- a model whose own loss scores each position against its own label, without the shift (the BART-family and
  Whisper causal LMs; the whole-model probe tells, ``Patch.labels_alignment == "aligned"``) gets that loss: the
  unshifted labels of the same tokens, which ``shard_inputs`` keeps beside the shifted ones
  (``inputs.aligned_labels``); ``shift_labels=`` is refused for it.
- a model whose own loss is neither (the probe checks: one that shifts twice or adds a term) has its labels
  refused under CP, with the probe's reason.

Inside ``averaged_over_group()`` (what ``hfpatch.integrations`` wraps around a trainer's loss) each rank's loss is
instead its SHARE, scaled so that the MEAN over the CP group is the non-CP loss: ``loss_sum / num_items_in_batch``
with the divisor as the trainer passes it (transformers' Trainer passes the count of the global batch divided by
the number of ranks that share a batch, the CP size), or ``world_size x loss_sum / count of the whole CP group``
without it. Its gradient is ``world_size`` times this rank's share, so gradients AVERAGED over the CP group (DDP or
FSDP over dp x cp, as accelerate reduces them) equal the non-CP gradient, and the trainer's mean of the logged loss
over every rank equals the non-CP loss. There, a forward that scores pre-shifted ``shift_labels`` itself (TRL's
fused LM head, ``fused_lm_head=True``, which divides by ``num_items_in_batch`` the same way) is left alone.

With an inactive patch (no CP) the same hook hands the model the caller's own labels in place of the
already-shifted ones ``shard_inputs`` returned (an identity split that still shifts), so the model's own loss is
the plain non-CP loss whatever its convention, and leaves every other call to the model untouched.
"""
from __future__ import annotations

import contextlib
import inspect
import threading
from typing import Any, Callable, Iterator, Optional

import torch

from hfpatch import inputs
from hfpatch.model import router_loss
from hfpatch.model.wrappers import inner_model
from hfpatch.modes import current_mode
from hfpatch.errors import UnsupportedArgument
from hfpatch.undo import UndoStack
from hfpatch.inputs import aligned_labels, is_shifted

__all__ = ["install_labels_hook", "averaged_over_group", "averaged_over_group_now"]

_LABEL_NAMES = ("labels", "shift_labels", "num_items_in_batch")


class _Reduction(threading.local):
    """Per thread: True inside ``averaged_over_group()``."""

    def __init__(self) -> None:
        self.averaged = False


_reduction = _Reduction()


@contextlib.contextmanager
def averaged_over_group() -> Iterator[None]:
    """Inside it (this thread), ``model(labels=...)`` under CP gives each rank's share of the loss, scaled so that
    the mean over the CP group is the non-CP loss (see the module docstring); restored on exit."""
    previous, _reduction.averaged = _reduction.averaged, True
    try:
        yield
    finally:
        _reduction.averaged = previous


def averaged_over_group_now() -> bool:
    """Whether this thread runs inside ``averaged_over_group()``."""
    return _reduction.averaged


class _Pending(threading.local):
    """The labels taken out of the current forward of this thread (set by the pre-hook, read by the hook)."""

    def __init__(self) -> None:
        self.entry: Optional[tuple] = None


def install_labels_hook(model: torch.nn.Module, ctx_of: Callable[[], Any],
                        refusal_of: Callable[[], Optional[str]] = lambda: None,
                        alignment_of: Callable[[], str] = lambda: "shifted") -> UndoStack:
    """Hook ``model``'s forward as the module docstring says; returns both hooks as one ``UndoStack``
    (``remove()`` takes them off).
    ``ctx_of()``: the ``RingContext`` of the step (None when the patch is inactive or removed); ``refusal_of()``:
    why this model's labels cannot be honoured under CP (set from the whole-model probe), or None;
    ``alignment_of()``: how the model's own loss pairs logits with labels ("shifted" or "aligned", from the probe)."""
    pending = _Pending()
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        parameters = {}
    positional = [name for name, p in parameters.items()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]

    def before(module, args, kwargs):
        pending.entry = None
        kwargs = dict(kwargs)
        for position, value in enumerate(args):  # a label passed by position: treat it as by name
            if position < len(positional) and positional[position] in _LABEL_NAMES and value is not None:
                kwargs[positional[position]] = value
                args = args[:position] + (None,) + args[position + 1:]
        labels, shift = kwargs.get("labels"), kwargs.get("shift_labels")
        ctx = ctx_of()
        # Switch mode "local" runs the model on the whole sequence without CP: its own loss is the non-CP loss.
        active = ctx is not None and ctx.world_size > 1 and current_mode() != "local"
        if labels is None and shift is None:
            return None
        router = _router_loss(module, kwargs) if active else None
        if kwargs.get("fused_lm_head"):
            return _fused_head(active, labels, shift)
        if shift is None and not is_shifted(labels):
            if not active:
                return None  # no CP, labels of the caller's own: the model's loss is the non-CP loss
            raise UnsupportedArgument(
                "labels", labels,
                "under context parallelism the model would shift this rank's shard of the labels by one token "
                "(dropping the target of its last token, which lives on the next rank) and average over this rank "
                "only; hfpatch cannot tell an unshifted shard from a shifted one.",
                "pass the labels returned by patch.shard_inputs(input_ids, labels=...) (already shifted), or "
                "transformers' shift_labels=<already shifted labels of this rank>; or compute the loss with "
                "hfpatch.inputs.token_loss_sum + patch.reduce_loss.",
            )
        refusal = refusal_of() if active else None
        if refusal is not None:
            raise UnsupportedArgument(
                "labels", labels if labels is not None else shift, refusal,
                "compute the standard causal-LM loss yourself from the logits (hfpatch.inputs.token_loss_sum + "
                "patch.reduce_loss), or train this model without CP if its own loss is what you need.",
            )
        if not active and shift is None:
            # No CP: the labels shard_inputs returned stand for the caller's own labels; the model's own loss on
            # those is the non-CP loss, whatever its convention.
            kwargs["labels"] = aligned_labels(labels) if aligned_labels(labels) is not None else labels
            return (args, kwargs) if aligned_labels(labels) is not None else None
        shifted = shift if shift is not None else labels
        if active and alignment_of() == "aligned":
            if labels is None:
                raise UnsupportedArgument(
                    "shift_labels", shift,
                    f"{type(module).__name__}'s own loss scores each position against its own label (no shift), so "
                    "pre-shifted shift_labels do not describe its loss.",
                    "pass the labels returned by patch.shard_inputs(input_ids, labels=...) as labels=.",
                )
            shifted = aligned_labels(labels)
        pending.entry = (shifted, kwargs.get("num_items_in_batch"), router)
        for name in _LABEL_NAMES:
            kwargs.pop(name, None)
        return args, kwargs

    def after(module, args, kwargs, output):
        entry, pending.entry = pending.entry, None
        if entry is None:
            return None
        shifted, num_items, router = entry
        logits = output.logits if hasattr(output, "logits") else output[0]
        ctx = ctx_of() if current_mode() != "local" else None
        loss = _loss(ctx, logits, shifted, num_items, averaged=_reduction.averaged)
        if router is not None and router.coefficient is not None:   # the group's aux loss (router_loss.install)
            aux = output.aux_loss
            if _reduction.averaged and num_items is not None and ctx is not None and ctx.world_size > 1:
                # the shares of num_items_in_batch SUM to the loss over the group: so does aux / C, whose gradient
                # is then this rank's tokens' (the aux loss's averaged convention gives C times it)
                aux = aux / ctx.world_size
            loss = loss + router.read(inner_model(module), router.coefficient) * aux
        if isinstance(output, tuple):
            return (loss,) + output
        fields = {key: value for key, value in output.items() if key != "loss"}
        return type(output)(loss=loss, **fields)

    return UndoStack(f"the labels hook of {type(model).__name__}",
                     model.register_forward_pre_hook(before, with_kwargs=True),
                     model.register_forward_hook(after, with_kwargs=True))


def _router_loss(module: torch.nn.Module, kwargs: dict) -> Optional[router_loss.RouterLoss]:
    """The ``RouterLoss`` of a call that returns the load-balancing loss under CP, None for one that does not;
    ``UnsupportedArgument`` naming ``output_router_logits`` for a model whose loss hfpatch does not recognise."""
    if not router_loss.requested(module, kwargs):
        return None
    if kwargs.get("return_dict") is False or not getattr(module.config, "return_dict", True):
        raise UnsupportedArgument(
            "return_dict", False, "under CP the loss adds the load-balancing loss from the output's aux_loss field, "
            "which a tuple output has no name for.", "call the model with return_dict=True.")
    found = router_loss.recognise(module)
    if isinstance(found, str):
        raise UnsupportedArgument(
            "output_router_logits", True,
            "the model adds a mixture-of-experts load-balancing loss that each rank would compute from its own "
            f"tokens only, and hfpatch does not recognise this one: {found}.",
            "call the model with output_router_logits=False under CP (and config.router_aux_loss_coef unused), or "
            "train it without CP.")
    return found


def _fused_head(active: bool, labels, shift) -> None:
    """TRL's fused LM head computes its own loss: under CP only from pre-shifted ``shift_labels`` (it scores them
    without shifting) and only inside ``averaged_over_group()`` (its loss is this rank's share)."""
    if not active:
        return None
    if labels is not None and shift is None:
        raise UnsupportedArgument(
            "labels", labels,
            "with fused_lm_head=True the model shifts this rank's shard of the labels itself, dropping the target of "
            "its last token (which lives on the next rank).",
            "pass shift_labels=<already shifted labels of this rank> (hfpatch.integrations prepares them).",
        )
    if not _reduction.averaged:
        raise UnsupportedArgument(
            "fused_lm_head", True,
            "the fused LM head divides this rank's loss sum by num_items_in_batch: a per-rank share, not the loss "
            "of the whole CP group.",
            "train through hfpatch.integrations.enable(trainer), or compute the loss from the logits "
            "(hfpatch.inputs.token_loss_sum + patch.reduce_loss).",
        )
    return None


def _loss(ctx, logits: torch.Tensor, shifted: torch.Tensor, num_items: Any, *, averaged: bool = False) -> torch.Tensor:
    if shifted.shape != logits.shape[:2]:
        raise UnsupportedArgument(
            "labels", shifted,
            f"the labels cover {tuple(shifted.shape)} tokens but the model produced logits for "
            f"{tuple(logits.shape[:2])}.",
            "pass the labels shard_inputs returned together with the input_ids it returned.",
        )
    loss_sum, count = inputs.token_loss_sum(logits, shifted)
    if averaged:
        return _averaged_share(ctx, loss_sum, count, num_items)
    if num_items is None:
        return inputs.reduce_loss(ctx, loss_sum, count)
    total = inputs.global_loss_sum(ctx, loss_sum)
    return total / torch.as_tensor(num_items, device=total.device).to(total.dtype)


def _averaged_share(ctx, loss_sum: torch.Tensor, count: torch.Tensor, num_items: Any) -> torch.Tensor:
    """This rank's share of the loss, scaled so that its mean over the CP group is the non-CP loss."""
    if num_items is not None:
        return loss_sum / torch.as_tensor(num_items, device=loss_sum.device).to(loss_sum.dtype)
    world = ctx.world_size if ctx is not None and ctx.world_size > 1 else 1
    total = count.detach().to(torch.float64).reshape(1)
    if world > 1:
        torch.distributed.all_reduce(total, group=ctx.group)
    return loss_sum * world / total[0].clamp(min=1).to(loss_sum.dtype)
