"""No silent no-ring: a CP step whose model forward never reached the patch is an error, not a local computation.

A model whose attention does not go through transformers' flash path (built with ``attn_implementation="sdpa"``
or ``"eager"`` and never given to ``apply(model=)``, ``Patch.add_model`` or a drop-in's ``model=``) runs its own
attention on this rank's shard of the sequence while the patch is active: its outputs are silently those of a
model that sees a few tokens. ``ReachWatch`` notices it at the next step boundary:

- every forward of a transformers ``PreTrainedModel`` in the process is counted (one global forward hook:
  ``torch.nn.modules.module.register_module_forward_hook``), with the class and attention implementation of the
  outermost one;
- a step boundary -- ``Patch.shard_inputs``, the drop-ins' ``update_*_params``, ``Patch.reduce_loss`` -- checks the
  step since the previous boundary that described a step: if a model forward ran and NO attention call reached the
  patch's wrappers in any switch mode (``Dispatcher.total_calls``), it raises ``RingNotReached`` naming the model
  and the fix; with ``apply(..., on_unsupported="fallback")`` it warns once instead.

A step where the policy reaches the ring and another model (a reward model scoring the whole, unsharded sequence)
does not is not flagged: the check is per step, so it never refuses a model run outside CP beside one run under it.
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Optional

import torch

from hfpatch.errors import RingNotReached
from hfpatch.undo import UndoStack

__all__ = ["ReachWatch"]

logger = logging.getLogger("hfpatch")
_is_compiling = torch.compiler.is_compiling


class _Depth(threading.local):
    def __init__(self) -> None:
        self.depth = 0


class ReachWatch:
    """The check of one patch (module docstring). ``dispatcher``: the patch's; ``fallback``: warn once instead of
    raising. ``install()`` returns the global hooks as an ``UndoStack``."""

    def __init__(self, dispatcher: Any, *, fallback: bool) -> None:
        self.dispatcher = dispatcher
        self.fallback = fallback
        self.forwards = 0
        self.last_model: Optional[tuple[str, Any]] = None  # (class, attn_implementation) of the last outermost
        self._armed: Optional[tuple[int, int, str]] = None  # (forwards, wrapper calls, boundary) at the step
        self._warned = False
        self._depth = _Depth()

    def install(self) -> UndoStack:
        from transformers import PreTrainedModel  # not at the top: importing hfpatch must not load transformers

        depth = self._depth

        def before(module, args):
            if isinstance(module, PreTrainedModel) and not _is_compiling():
                depth.depth += 1

        def after(module, args, output):
            if isinstance(module, PreTrainedModel) and not _is_compiling():
                depth.depth = max(depth.depth - 1, 0)
                self.forwards += 1
                if depth.depth == 0:
                    config = getattr(module, "config", None)
                    self.last_model = (type(module).__name__, getattr(config, "_attn_implementation", None))

        hooks = torch.nn.modules.module
        return UndoStack("the ring-reach watch", hooks.register_module_forward_pre_hook(before),
                         hooks.register_module_forward_hook(after))

    def step(self, boundary: str) -> None:
        """A boundary that describes a new step (``shard_inputs``, ``update_*_params``): check the last step, then
        start this one."""
        self.check(boundary)
        self._armed = (self.forwards, self.dispatcher.total_calls(), boundary)

    def check(self, boundary: str) -> None:
        """Raise ``RingNotReached`` (or warn once, with fallback) if a model forward ran since the last step's
        boundary and no attention call reached the patch."""
        if self._armed is None:
            return
        forwards, calls, began = self._armed
        if self.forwards == forwards or self.dispatcher.total_calls() != calls:
            return
        self._armed = None  # said once per step
        cls, implementation = self.last_model or ("the model", None)
        message = (
            f"{cls} (attn_implementation={implementation!r}) ran a forward after {began}() described a CP step, and "
            f"none of its attention reached hfpatch's ring (0 calls through the patched flash-attention path, found "
            f"at {boundary}()): it attended within this rank's shard of the sequence only, which is not the non-CP "
            "computation. Fix: give the model to hfpatch -- apply(group, model=model), patch.add_model(model), or the "
            "drop-in's model= (substitute_hf_flash_attn(group, stride, model=model)) -- or build it with "
            "attn_implementation='flash_attention_2'.")
        if not self.fallback:
            raise RingNotReached(message, model_class=cls, attn_implementation=implementation)
        if not self._warned:
            self._warned = True
            logger.warning("hfpatch: %s (on_unsupported='fallback': warned once, not raised)", message)
