"""Install the CP form of a model's sequence mixers, and take it out again.

``install_mixers(model, context)`` finds every module the registry recognises, and rebinds each kernel name their
modeling modules' forwards call (e.g. ``modeling_qwen3_next.causal_conv1d_fn``) to a wrapper. The wrapper reads
the switch on every call, like the attention wrapper:

``"ring"``                  the kernel's CP form (``SequenceKernel.run_cp``) over the step's ``SegmentPlan``;
``"reference"``             the original kernel on the all-gathered sequence, this rank's tokens returned;
``"original"``, ``"local"`` the original kernel on the tensors it was given.

The step's layout is the one ``shard_inputs`` recorded in ``ctx.step`` (checked against the call's batch and
length, as the attention checks it), or, without it, contiguous shards (what the attention assumes then too).
Everything rebound is recorded; ``MixerInstallation.remove()`` restores each name that still holds its wrapper.

Families whose recurrence HF computes inline (``MixerFamily.replaces``) also get those methods replaced on each
recognised instance: in switch modes "ring" and "reference" on two ranks or more the replacement runs the
family's CP form (which calls its kernels through the rebound names), otherwise the class's own method;
``remove()`` takes the replacements off again.
"""
from __future__ import annotations

import functools
import inspect
import logging
import types
from collections import Counter
from typing import Any, Callable, Optional

import torch

from hfpatch.errors import PatchError, UnsupportedArgument
from hfpatch.undo import AllOrNothing, is_wrapper, mark_wrapper
from hfpatch.mixers.kernel import KernelCall, SequenceKernel
from hfpatch.mixers.kinds import KERNELS
from hfpatch.mixers.registry import recognise
from hfpatch.mixers.segments import SegmentPlan, segments_of_layout
from hfpatch.modes import current_mode

__all__ = ["MixerInstallation", "install_mixers"]

logger = logging.getLogger("hfpatch")


class MixerInstallation:
    """What ``install_mixers`` did. ``modules``: (qualified name, class name, family name) of every recognised
    mixer; ``sites``: "module.name" of every rebound kernel; ``calls``: Counter (kernel role, mode) -> calls."""

    def __init__(self, context: Callable[[], Any]) -> None:
        self._context = context
        self.modules: list[tuple[str, str, str]] = []
        self.calls: Counter = Counter()
        self._rebound: list[tuple[Any, str, Callable, Callable]] = []  # (modeling module, name, original, wrapper)
        # (mixer module, method, replacement, the instance attribute it replaced or None)
        self._replaced: list[tuple[torch.nn.Module, str, Callable, Optional[Callable]]] = []
        self._plan_key: Any = None
        self._plan: Optional[SegmentPlan] = None

    @property
    def ctx(self) -> Any:
        """The ``RingContext`` the patch's calls run on now (the whole-model probe runs on its own)."""
        return self._context()

    @property
    def sites(self) -> list[str]:
        return [f"{module.__name__}.{name}" for module, name, _, _ in self._rebound]

    def remove(self) -> None:
        """Restore every rebound name that still holds its wrapper, and take off every method replacement that is
        still in place (newest first)."""
        for module, name, original, wrapper in reversed(self._rebound):
            if module.__dict__.get(name) is wrapper:
                setattr(module, name, original)
        self._rebound.clear()
        for mixer, method, replacement, previous in reversed(self._replaced):
            if mixer.__dict__.get(method) is replacement:
                if previous is None:
                    delattr(mixer, method)
                else:
                    setattr(mixer, method, previous)
        self._replaced.clear()

    # ------------------------------------------------------------------------------------------- the step
    def plan(self, batch: int, seq_local: int, probe: torch.Tensor) -> SegmentPlan:
        """The ``SegmentPlan`` of the current step for a call on (batch, seq_local) tokens; cached per step."""
        ctx = self.ctx
        step = ctx.step
        if step is not None and (step.batch_size != batch or step.seq_len_local != seq_local):
            raise UnsupportedArgument(
                "hidden_states", probe,
                f"shard_inputs prepared this step for batch {step.batch_size} x {step.seq_len_local} local tokens, "
                f"but a sequence mixer now runs on batch {batch} x {seq_local}: the inputs are not the ones "
                f"shard_inputs returned.",
                "call patch.shard_inputs(...) for every batch and pass its input_ids and position_ids to the model.",
            )
        key = (id(step), step, batch, seq_local, ctx.group)  # the group: the whole-model probe runs on its own
        if self._plan is None or self._plan_key[1] is not step or self._plan_key[2:] != key[2:]:
            layout = step.layout if step is not None else "contiguous"
            cu = step.cu_seqlens if step is not None and step.packed else None
            segments = segments_of_layout(layout, ctx.world_size, seq_local, cu if layout == "zigzag" else None)
            self._plan = SegmentPlan(segments, rank=ctx.rank, world_size=ctx.world_size, group=ctx.group,
                                     layout=layout, cu_seqlens=cu)
            self._plan_key = key
        return self._plan

    # ---------------------------------------------------------------------------------------- the wrapper
    def wrap(self, original: Callable, kernel: SequenceKernel) -> Callable:
        """The wrapper installed in place of ``original`` (same name and signature, ``__wrapped__`` set)."""
        signature = inspect.signature(original)
        installation = self

        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            mode = current_mode()
            installation.calls[(kernel.role, mode)] += 1
            if mode in ("original", "local") or installation.ctx.world_size < 2:
                return original(*args, **kwargs)
            call = KernelCall(original, signature, args, kwargs)
            kernel.check(call)
            batch, seq_local = kernel.shape(call)
            plan = installation.plan(batch, seq_local, call.arg(next(iter(kernel.token_args))))
            if mode == "reference":
                return kernel.reference(call, plan)
            return kernel.run_cp(call, plan)

        return mark_wrapper(wrapper)

    def rebind(self, module: Any, name: str, kernel: SequenceKernel) -> None:
        original = module.__dict__[name]
        if is_wrapper(original):
            raise PatchError(f"{module.__name__}.{name} is already an hfpatch mixer wrapper from a patch that was not "
                             "removed cleanly. Fix: restart the process.")
        wrapper = self.wrap(original, kernel)
        setattr(module, name, wrapper)
        self._rebound.append((module, name, original, wrapper))

    def replace(self, mixer: torch.nn.Module, method: str, cp_form: Callable) -> None:
        """Set ``mixer.<method>`` on the instance: ``cp_form(mixer, ...)`` in switch modes "ring" and "reference"
        on two ranks or more, otherwise what was there (the class's method, or an instance-level one such as
        accelerate's hooks set). A bound method, so that ``copy.deepcopy`` binds the copy's to the copy."""
        previous = mixer.__dict__.get(method)
        if is_wrapper(previous):
            raise PatchError(f"{type(mixer).__name__}.{method} is already an hfpatch mixer replacement from a patch "
                             "that was not removed cleanly. Fix: restart the process.")
        installation = self

        @functools.wraps(getattr(type(mixer), method))
        def replacement(self, *args, **kwargs):
            if current_mode() in ("original", "local") or installation.ctx.world_size < 2:
                if previous is not None:
                    return previous(*args, **kwargs)
                return getattr(type(self), method)(self, *args, **kwargs)
            return cp_form(self, *args, **kwargs)

        mark_wrapper(replacement)
        bound = types.MethodType(replacement, mixer)
        setattr(mixer, method, bound)
        self._replaced.append((mixer, method, bound, previous))


def install_mixers(model: torch.nn.Module, context: Callable[[], Any]) -> MixerInstallation:
    """Rebind the kernels of every recognised mixer of ``model`` (see the module docstring); all-or-nothing.

    ``context()``: the ``RingContext`` the patch's calls run on now. Raises ``UnsupportedArgument`` (kernel) when
    the model has mixers and the context pins the stripe layout.
    """
    installation = MixerInstallation(context)
    ctx = context()
    targets: dict[tuple[int, str], tuple[Any, str, SequenceKernel]] = {}
    replacements: list[tuple[torch.nn.Module, str, Callable]] = []
    for path, module in model.named_modules():
        found = recognise(module)
        if found is None:
            continue
        installation.modules.append((path, type(module).__name__, found.family.name))
        replacements += [(module, method, cp_form) for method, cp_form in found.family.replaces]
        for name, role in found.family.bindings:
            targets.setdefault((id(found.module), name), (found.module, name, KERNELS[role]))
    if targets and ctx.variant == "stripe":
        segments_of_layout("stripe", ctx.world_size, 0)  # raises the named refusal
    with AllOrNothing("the sequence mixers", installation) as undo:  # a failure undoes every rebinding made
        for module, name, kernel in targets.values():
            installation.rebind(module, name, kernel)
        for mixer, method, cp_form in replacements:
            installation.replace(mixer, method, cp_form)
        undo.pop_all()  # installed: the installation undoes it from now on
    if installation.modules:
        logger.info("hfpatch: %d sequence mixers run under CP (%s)", len(installation.modules),
                    ", ".join(sorted({family for _, _, family in installation.modules})))
    return installation
