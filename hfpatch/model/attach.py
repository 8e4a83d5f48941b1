"""One model on a patch's ring: everything ``apply(model=)`` and ``Patch.add_model`` install on a model, as one
removable part, so that several models (a policy, its reference, a critic, a reward model) share one patch and
one CP group, and adding or removing one never changes another.

``attach(model, ...)`` installs, in order: the routing onto the patched flash path (``routing``), the global
position hooks (``positions``), the CP form of its recognised sequence mixers (``hfpatch.mixers``), the forward
tracking of the dispatcher, the pooled head (``heads``), the labels hook (``labels``, for per-token heads) and, for a
vision-language model, the image scatter (``multimodal``) where its family is recognised, else the inputs guard. The ``AttachedModel`` it returns removes them all, newest first. The whole-model probe's verdicts
for the model (``labels_refusal``, ``labels_alignment``, ``probe``) are kept on it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from hfpatch.undo import AllOrNothing, UndoStack
from hfpatch.mixers import MixerInstallation, install_mixers
from hfpatch.model import multimodal, positions, router_loss
from hfpatch.model.heads import head_of, install_pooled_head
from hfpatch.model.inputs_guard import install_inputs_guard
from hfpatch.model.labels import averaged_over_group_now, install_labels_hook
from hfpatch.model.routing import ModelRouting, route_model

__all__ = ["AttachedModel", "attach"]


@dataclass
class AttachedModel:
    """A model on the ring of a patch. ``model``: the transformers model (a wrapper's inner one); ``routing``:
    what switched it onto the flash path; ``mixers``: its sequence mixers under CP; ``labels_refusal``: why its
    ``model(labels=)`` is refused under CP, or None; ``labels_alignment``: "shifted" or "aligned" (the whole-model
    probe's finding); ``probe``: the probe's ``ProbeResult``, or None where it did not run. ``remove()`` takes
    every part off (``AlreadyRemoved`` the second time)."""

    model: torch.nn.Module
    undo: UndoStack
    routing: Optional[ModelRouting] = None
    mixers: Optional[MixerInstallation] = None
    labels_refusal: Optional[str] = None
    labels_alignment: str = "shifted"
    probe: Any = None
    on_removal: list = field(default_factory=list)

    @property
    def removed(self) -> bool:
        return self.undo.removed

    def remove(self) -> None:
        try:
            self.undo.remove()
        finally:
            for callback in self.on_removal:
                callback(self)

    def __repr__(self) -> str:
        return f"<hfpatch model {type(self.model).__name__}{' removed' if self.removed else ''}>"


def attach(model: torch.nn.Module, *, wrapper: Callable, context: Callable[[], Any], track: Callable,
           ctx_of: Callable[[], Any],
           transformers_version=None) -> AttachedModel:
    """Install every per-model part on ``model`` (module docstring). ``wrapper``: the patch's generated wrapper;
    ``context()``: the ``RingContext`` its calls run on now; ``track(model)``: the dispatcher's forward tracking (an ``UndoStack``);
    ``ctx_of()``: the context while the patch is live, else None. All-or-nothing: on failure nothing is left."""
    with AllOrNothing(f"the model {type(model).__name__}") as undo:  # a failure undoes every part installed
        attached = AttachedModel(model=model, undo=undo)
        attached.routing = undo.push(route_model(model, wrapper, transformers_version=transformers_version),
                                     "the model routing")
        undo.push(positions.install(model, ctx_of), "the position hooks")  # global positions
        attached.mixers = undo.push(install_mixers(model, context), "the sequence mixers")
        undo.push(track(model), f"the forward tracking of {type(model).__name__}")
        pooled = install_pooled_head(model, ctx_of, averaged_over_group_now)
        if pooled is not None:
            undo.push(pooled, "the pooled head")
        if head_of(model).kind == "per-token":  # token labels; a pooled head's loss is the pooled head's
            undo.push(install_labels_hook(model, ctx_of, lambda: attached.labels_refusal,
                                          lambda: attached.labels_alignment), "the labels hook")
        scatter = multimodal.install(model, ctx_of)
        if scatter is not None:  # images scattered over the whole row, then the row sharded
            undo.push(scatter, "the image scatter")
        else:
            undo.push(install_inputs_guard(model, ctx_of), "the inputs guard")  # images/audio refused
        balancing = router_loss.install(model, ctx_of, averaged_over_group_now)
        if balancing is not None:  # a MoE model's load-balancing loss: the group's
            undo.push(balancing, "the load-balancing loss")
        attached.undo = undo.pop_all()
    return attached
