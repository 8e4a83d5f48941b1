"""``hfpatch.apply`` and the ``Patch`` handle it returns.

The flow of one apply: resolve the group -> read ``RING_ATTN_SWITCH`` -> match the live
``_flash_attention_forward`` against the registry -> render the wrapper -> plan every binding site -> install
all-or-nothing -> switch the model (``model=``) -> verify identity -> numeric probe -> ``Patch``. Any failure
after the install removes everything again before the error propagates.

A ``Patch`` holds every part it installed in one ``hfpatch.undo.UndoStack`` (the attention patch, the model's
routing, its position, mixer, tracking, labels and inputs hooks, the switch default), in install order;
``remove()`` takes them out newest first, each even if another fails. The parts it reads keep typed fields.
"""
from __future__ import annotations

import dataclasses
import inspect
import logging
import threading
from collections import Counter
from typing import Any, Optional

import torch
import torch.distributed as dist

from hfpatch import inputs, modes, verify as verify_module, version_gates
from hfpatch.attention import codegen, patcher
from hfpatch.model import audit
from hfpatch.attention.dispatch import Dispatcher, original_caller
from hfpatch.errors import (AlreadyRemoved, HfpatchError, PatchError, SignatureMismatch, UnsupportedArgument,
                            UnsupportedModel, UnsupportedRelease, VerificationError)
from hfpatch.undo import AllOrNothing, UndoStack, is_wrapper, mark_wrapper
from hfpatch.model.attach import AttachedModel, attach
from hfpatch.model.heads import head_of
from hfpatch.model.labels import install_labels_hook
from hfpatch.model.reach import ReachWatch
from hfpatch.mixers import MixerInstallation
from hfpatch.model.probe import ProbeResult, probe_model
from hfpatch.attention.discovery import attention_modules
from hfpatch.model.wrappers import inner_model
from hfpatch.attention.context import RingContext, check_grid, parse_kernel
from hfpatch.signatures import registry
from hfpatch.verify import group_max
from ring_kernels.backends import choices

__all__ = ["apply", "Patch", "active_patch"]

logger = logging.getLogger("hfpatch")

_ON_UNSUPPORTED = ("raise", "fallback")
_VERIFY = (True, "fast", False)
_active: Optional["Patch"] = None
_active_lock = threading.RLock()  # re-entered by Patch.remove() inside apply's final check


def active_patch() -> Optional["Patch"]:
    """The installed (active) patch of this process, or None."""
    return _active


# ------------------------------------------------------------------------------------------------ Patch


class Patch:
    """Handle of one ``apply``: what was installed, the switch, counters, and ``remove()``.

    ``active``: False for a fallback (no group, a group of one, an unsupported release with
    ``on_unsupported="fallback"``): transformers is untouched and the input helpers are the identity.
    ``reason``: why it is inactive (None when active). ``signature_id``: the registry entry matched
    (e.g. "S7-5.19.0"). ``sites``: "module.attr" of every binding site holding the wrapper (modules imported
    after apply included). ``calls``: Counter layer -> calls that ran the ring. ``switch``: the switch,
    ``hfpatch.modes.switch`` (``patch.switch.current_mode()``, ``patch.switch.set_switch(mode)``,
    ``with patch.switch(mode):``).
    ``ctx``: the ``hfpatch.attention.context.RingContext`` (None when inactive). ``removed``: whether ``remove()`` ran.
    """

    def __init__(self, *, active: bool, reason: Optional[str], signature_id: Optional[str] = None,
                 ctx: Optional[RingContext] = None, dispatcher: Optional[Dispatcher] = None, match: Any = None) -> None:
        self.active = active
        self.reason = reason
        self.signature_id = signature_id
        self._ctx = ctx  # the context of an inactive patch; an active one's is its dispatcher's (``ctx``)
        self.switch = modes.switch
        self._match = match
        # Every part this patch installed, in install order; remove() takes them out newest first.
        self._undo = UndoStack("hfpatch")
        # The parts it reads (each also on the undo stack, where installed): None until installed.
        self._dispatcher: Optional[Dispatcher] = dispatcher
        self._installation: Optional[patcher.Installation] = None
        self._version: Any = None  # the transformers release matched (for routing models added later)
        # Every model on this patch's ring (apply's model= first, then add_model's), in the order added.
        self._models: list[AttachedModel] = []
        # The check that each CP step's forward reached the ring (hfpatch.model.reach); None when inactive.
        self.reach: Optional[ReachWatch] = None

    # ------------------------------------------------------------------------------------ inspection
    @property
    def ctx(self) -> Optional[RingContext]:
        """The ``RingContext`` the patch's calls run on (None when inactive)."""
        return self._dispatcher.ctx if self._dispatcher is not None else self._ctx

    def reconfigure(self, **changes: Any) -> RingContext:
        """Run the following calls on a context with ``changes`` (``RingContext`` fields, e.g.
        ``heads_k_stride=1``; ``dataclasses.replace``); returns it. An active patch only."""
        if self._dispatcher is None:
            raise PatchError("reconfigure: this patch is inactive (no ring to configure).")
        self._dispatcher.ctx = dataclasses.replace(self._dispatcher.ctx, **changes)
        return self._dispatcher.ctx

    def running_on(self, ctx: RingContext):
        """A context manager: every attention call made inside runs on ``ctx`` (a ``dataclasses.replace`` of this
        patch's context: the whole-model probe's, on its own group), this patch's context back afterwards."""
        return self._dispatcher.using(ctx)

    @property
    def removed(self) -> bool:
        return self._undo.removed

    @property
    def sites(self) -> list[str]:
        if self._installation is None or self.removed:
            return []
        injected = [f"{module.__name__}._flash_attention_forward (injected by model=)"
                    for attached in self.models if attached.routing is not None
                    for module, _ in attached.routing.injected]
        return [site.label for site in self._installation.sites] + injected

    @property
    def models(self) -> list[AttachedModel]:
        """Every model on this patch's ring (``apply(model=)``'s first, then each ``add_model``'s), in the order
        added; a removed one drops out."""
        return [attached for attached in self._models if not attached.removed]

    # The whole-model probe's verdicts for the model of apply(model=) (its AttachedModel has them; None / "shifted"
    # without one): why model(labels=) is refused under CP, how its own loss pairs logits with labels, the
    # probe's ProbeResult (None where it did not run: no model=, verify="fast" or False, an inactive patch).
    @property
    def labels_refusal(self) -> Optional[str]:
        return self._models[0].labels_refusal if self._models else None

    @property
    def labels_alignment(self) -> str:
        return self._models[0].labels_alignment if self._models else "shifted"

    @property
    def probe(self) -> Optional[ProbeResult]:
        return self._models[0].probe if self._models else None

    @property
    def calls(self) -> Counter:
        return self._dispatcher.calls if self._dispatcher is not None else Counter()

    @property
    def mode_calls(self) -> Counter:
        """Counter mode -> calls ("ring", "original", "reference") since apply or ``reset_calls``."""
        return self._dispatcher.mode_calls if self._dispatcher is not None else Counter()

    @property
    def recomputed_calls(self) -> Counter:
        """Counter layer -> calls made while autograd ran a backward (activation checkpointing recomputing a
        layer); kept out of ``calls``, ``mode_calls`` and the per-forward record."""
        return self._dispatcher.recomputed if self._dispatcher is not None else Counter()

    @property
    def backend_choices(self) -> list:
        """Which block backend ring_kernels chose for which shape class, why, and how many calls made each choice
        (``ring_kernels.backends.choices()``: ``BackendChoice`` records of this process, since it started or
        ``ring_kernels.backends.reset_choices()``; a backend's own fallback has ``fallback=True``). Every kernel
        records its choice: a ring variant for its blocks, Ulysses for its attention over the whole sequence of
        its heads, USP through the ring it runs across its Ulysses groups. Which kernel kernel="auto" chose for
        which calls, and why: ``layout_choices``."""
        return choices()

    @property
    def layout_choices(self) -> list:
        """kernel="auto"'s decisions (``hfpatch.attention.kernel_choice.AutoChoice``): the kernel that computed which
        calls (form, tokens per rank, heads), why -- the cost model's prediction for every candidate and what it
        left out and why, or why the cost model did not choose -- and how many (step, call shape) pairs decided
        it; the latest 64 (kernel, shape) pairs. Empty for a pinned kernel or an inactive patch."""
        return [] if self.ctx is None else list(self.ctx.auto_choices.values())

    @property
    def mixers(self) -> Optional[MixerInstallation]:
        """The sequence mixers of the model of ``apply(model=)`` that run under CP: the ``MixerInstallation``
        (``modules``: (path, class, family) of every recognised mixer; ``sites``: "module.name" of every rebound
        kernel, each holding a wrapper whose ``__wrapped__`` is the kernel the release picked; ``calls``: Counter
        (kernel role, switch mode) -> calls). None without ``model=``, when inactive, or after ``remove()``. For
        reading: ``remove()`` takes the mixers out with the rest of the patch."""
        return None if self.removed or not self._models else self._models[0].mixers

    def reset_calls(self) -> None:
        """Clear ``calls``, ``mode_calls`` and the per-forward record."""
        if self._dispatcher is not None:
            self._dispatcher.reset()

    def wrapper_source(self) -> str:
        """The generated wrapper's source (what tracebacks and ``inspect.getsource`` show)."""
        if self._installation is None:
            raise PatchError(f"this patch is inactive ({self.reason}); no wrapper was generated")

        return codegen.wrapper_source(self._installation.wrapper)

    def __repr__(self) -> str:
        if not self.active:
            return f"<hfpatch.Patch inactive: {self.reason}>"
        state = "removed" if self.removed else f"{len(self.sites)} sites"
        return f"<hfpatch.Patch {self.signature_id} {self.ctx.variant}:{self.ctx.backend} " \
               f"world={self.ctx.world_size} {state}>"

    # ----------------------------------------------------------------------------- layer accounting
    def track(self, model: torch.nn.Module) -> None:
        """Mark each forward of ``model`` as a new "last forward" for ``layers_seen``/``unpatched_layers``
        (``apply(model=...)`` does this for its model)."""
        if self._dispatcher is None:
            return
        # also binds its attention layers' call sites
        self._undo.push(self._dispatcher.track(model), f"the forward tracking of {type(model).__name__}")

    def layers_seen(self) -> list:
        """Layer keys (layer index, or "Class@id") that ran the ring in the last forward of a tracked model
        (without tracking: since apply or ``reset_calls``)."""
        if self._dispatcher is None:
            return []
        keys = {r.key for r in self._dispatcher.forward_records() if r.mode == "ring"}
        return sorted(keys, key=lambda k: (not isinstance(k, int), str(k) if not isinstance(k, int) else k))

    def unpatched_layers(self, model: torch.nn.Module) -> list[dict]:
        """The attention modules of ``model`` that did NOT run the ring in the last forward: a list of
        ``{"name", "class", "attn_implementation"}`` (e.g. a model left on "sdpa" or "eager"). Empty when every
        attention layer went through the ring."""
        records = self._dispatcher.forward_records() if self._dispatcher is not None else []
        ring_ids = {r.module_id for r in records if r.mode == "ring" and r.module_id is not None}
        missing = []
        for name, module in attention_modules(model):
            if any(id(m) in ring_ids for m in module.modules()):
                continue
            config = getattr(module, "config", None) or getattr(model, "config", None)
            missing.append({"name": name, "class": type(module).__name__,
                            "attn_implementation": getattr(config, "_attn_implementation", None)})
        return missing

    # ------------------------------------------------------------------------------------------- models
    def add_model(self, model: torch.nn.Module, *, verify: bool = True) -> AttachedModel:
        """Put another model on this patch's ring (a reference, critic or reward model beside the policy of
        ``apply(model=)``): audited, switched onto the patched flash path and hooked exactly as ``apply(model=)``
        does (``hfpatch.model.attach``), then, with ``verify=True``, checked by the whole-model probe. A wrapper is
        resolved to its transformers model (``hfpatch.model.wrappers``). Returns its ``AttachedModel``:
        ``remove()`` takes this model off the ring and changes no other model; ``patch.remove()`` takes every
        model off. Collective over the CP group (every rank must call it, with the same model). Refused:
        ``UnsupportedModel`` (the audit), ``ModelDivergence`` (the probe), ``PatchError`` (a model already on the
        ring, or a removed patch). On an inactive patch only the labels hook is installed, as ``apply(model=)``
        does there."""
        if not (verify is True or verify is False):
            raise TypeError(f"add_model(verify={verify!r}) must be True (the whole-model probe) or False")
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"add_model(model={type(model).__name__}) must be a transformers model (torch.nn.Module)")
        model = inner_model(model)
        if self.removed:
            raise PatchError(f"{self!r} was removed; a model added now would never reach the ring. Fix: apply again.")
        if any(attached.model is model for attached in self.models):
            raise PatchError(f"{type(model).__name__} is already on this patch's ring; adding it twice would hook it "
                             "twice. Fix: add each model once (patch.models lists them).")
        if not self.active:
            return self._attach_inactive(model)
        group = self.ctx.group
        failure: Optional[BaseException] = None
        # Leaving this block before pop_all() takes the model off the ring again, before the error propagates.
        with AllOrNothing(f"the model {type(model).__name__}") as undo:
            try:
                findings = audit.audit(model)
                if findings:
                    raise UnsupportedModel(audit.describe(findings, model), findings=findings)
                attached = undo.push(self._attach(model), "the model")
            except BaseException as exc:  # re-raised below, after the other ranks have been told
                failure = exc
            if group_max(_FAILED if failure is not None else _OK, group) != _OK:
                if failure is not None:
                    raise failure
                raise PatchError(f"add_model({type(model).__name__}) failed on another rank of the CP group (see "
                                 "that rank's error); nothing was added on this rank either.")
            if verify:
                probed = _probe_named(model, self)
                attached.labels_refusal, attached.labels_alignment = probed.labels_refusal, probed.labels_alignment
                attached.probe = probed
                self._dispatcher.reset()  # the probe's calls are not the user's
            undo.pop_all()  # on the ring: patch.remove() (or the model's own remove()) takes it off from now on
        return attached

    def _attach(self, model: torch.nn.Module) -> AttachedModel:
        attached = attach(model, wrapper=self._installation.wrapper, context=lambda: self.ctx,
                          track=self._dispatcher.track,
                          ctx_of=self.live_ctx_or_none, transformers_version=self._version)
        self._models.append(attached)
        return attached

    def _attach_inactive(self, model: torch.nn.Module) -> AttachedModel:
        undo = UndoStack(f"the model {type(model).__name__}")
        if head_of(model).kind == "per-token":
            undo.push(install_labels_hook(model, lambda: None), "the labels hook")
        attached = AttachedModel(model=model, undo=undo)
        self._models.append(attached)
        return attached

    def _remove_models(self) -> None:
        for attached in reversed(self._models):
            if not attached.removed:
                attached.remove()

    # ----------------------------------------------------------------------------------- input helpers
    def shard_inputs(self, input_ids: torch.Tensor, labels: Optional[torch.Tensor] = None,
                     position_ids: Optional[torch.Tensor] = None) -> dict:
        """This rank's ``input_ids``, ``position_ids`` (global) and ``labels`` (already shifted) in the step's
        layout; the identity (labels shifted the same way) when the patch is inactive. See
        ``hfpatch.inputs.shard_inputs``."""
        ctx = self._live_ctx()
        if ctx is not None:
            self.reach.step("shard_inputs")  # RingNotReached: the last step's forward never reached the ring
        return inputs.shard_inputs(ctx, input_ids, labels=labels, position_ids=position_ids)

    def describe_split(self, *, batch_size: int, seq_len_global: int,
                       cu_seqlens: Optional[torch.Tensor] = None) -> None:
        """The next forward runs on inputs the caller split itself (contiguous chunks, global positions), in
        place of the last ``shard_inputs`` step; see ``hfpatch.inputs.describe_split``. No-op when inactive."""
        ctx = self._live_ctx()
        if ctx is not None:
            self.reach.step("describe_split")  # RingNotReached: the last step's forward never reached the ring
        inputs.describe_split(ctx, batch_size=batch_size, seq_len_global=seq_len_global, cu_seqlens=cu_seqlens)

    def reduce_loss(self, loss_sum: torch.Tensor, num_tokens) -> torch.Tensor:
        """Token-weighted mean loss over the CP group (``loss_sum / num_tokens`` when inactive)."""
        ctx = self._live_ctx()
        if ctx is not None:
            self.reach.check("reduce_loss")
        return inputs.reduce_loss(ctx, loss_sum, num_tokens)

    def live_ctx_or_none(self):
        """The ``RingContext`` while this patch is active and not removed, else None (what the labels hook of
        ``apply(model=)`` reads per forward)."""
        return self.ctx if self.active and not self.removed else None

    def _live_ctx(self):
        # After remove() attention is no longer ring attention: sharding inputs would feed shards to the
        # original function silently. Refuse instead.
        if self.active and self.removed:
            raise PatchError("this patch was removed; shard_inputs/reduce_loss would feed shards to unpatched "
                             "attention. Fix: apply again, or use the full batch without hfpatch.")
        return self.ctx if self.active else None

    # ------------------------------------------------------------------------------------------ removal
    def remove(self) -> None:
        """Take out every part, newest first: the model's hooks, its routing, the wrapper at every binding site
        (by identity) and the import hook, the switch default. Every part is removed even if another fails; then
        ``RemovalFailed`` (a ``PatchError``) names each failure (``SitesRebound`` among them for sites someone
        else rebound after apply, left as they are). A second ``remove()`` raises ``AlreadyRemoved``."""
        global _active
        if self.removed:
            raise AlreadyRemoved(f"{self!r} was already removed; remove() is not idempotent (a second call would "
                                 "hide a double-remove bug). Fix: call remove() once, or use "
                                 "`with hfpatch.apply(...)`.", what=repr(self))
        try:
            self._undo.remove()
        finally:
            with _active_lock:
                if _active is self:
                    _active = None
        if self.active:
            logger.info("hfpatch: removed (%s); transformers restored", self.signature_id)

    def __enter__(self) -> "Patch":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self.removed:
            self.remove()


# ------------------------------------------------------------------------------------------------ apply


def _resolve_group(cp_group):
    """A ProcessGroup, or None; a 1-D DeviceMesh gives its group; anything else is a TypeError."""
    if cp_group is None:
        return None
    if isinstance(cp_group, dist.ProcessGroup):
        return cp_group
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # torch without device meshes: only process groups exist
        DeviceMesh = ()
    if DeviceMesh and isinstance(cp_group, DeviceMesh):
        if cp_group.ndim != 1:
            raise ValueError(
                f"cp_group is a {cp_group.ndim}-D DeviceMesh {tuple(cp_group.mesh_dim_names or ())}; context "
                "parallelism needs its 1-D CP dimension. Fix: pass mesh['cp'] (the sub-mesh of the CP dimension)."
            )
        return cp_group.get_group()
    raise TypeError(
        f"cp_group={type(cp_group).__name__} {cp_group!r:.80} is neither a torch.distributed ProcessGroup nor a 1-D "
        "DeviceMesh. Fix: pass dist.new_group(cp_ranks), mesh['cp'], or None (no context parallelism)."
    )


def _validate_arguments(kernel, on_unsupported, verify, model) -> None:
    if on_unsupported not in _ON_UNSUPPORTED:
        raise ValueError(
            f"on_unsupported={on_unsupported!r} is not allowed; expected 'raise' (SignatureMismatch / "
            "UnsupportedRelease on a release hfpatch cannot patch) or 'fallback' (run without CP, inactive Patch)."
        )
    parse_kernel(kernel)  # ValueError naming the kernel and the allowed variants
    if not (verify is True or verify is False or verify == "fast"):
        raise TypeError(f"verify={verify!r} must be True (the numeric probe of the wrapper, and with model= the "
                        "whole-model probe), 'fast' (the numeric probe only) or False (no probe)")
    if model is not None and not isinstance(model, torch.nn.Module):
        raise TypeError(f"model={type(model).__name__} must be a transformers model (torch.nn.Module) or None")


def _inactive(reason: str, *, level: int = logging.INFO, model: Optional[torch.nn.Module] = None) -> Patch:
    """An inactive Patch; with ``model``, its labels hook (``hfpatch.model.labels``) so that the shifted labels of
    ``shard_inputs`` give the non-CP loss when passed to the model."""
    logger.log(level, "hfpatch: not active (%s); transformers untouched, input helpers are the identity", reason)
    patch = Patch(active=False, reason=reason)
    patch._undo.callback(patch._remove_models, "the models")
    if model is not None:
        patch._attach_inactive(model)
    return patch


def _check_no_active_patch() -> None:
    if _active is not None:
        raise PatchError(
            f"hfpatch is already applied in this process: {_active!r}. A second apply would wrap the wrapper and "
            "leave two patches to remove in order. Fix: call patch.remove() first (or use `with hfpatch.apply(...)`)."
        )


def apply(cp_group=None, *, kernel: str = "auto", on_unsupported: str = "raise", verify: bool = True,
          model: Optional[torch.nn.Module] = None) -> Patch:
    """Give transformers' flash-attention path ring attention over ``cp_group``; returns the ``Patch``.

    cp_group:        a ProcessGroup or a 1-D DeviceMesh of the context-parallel ranks; None (or a group of one
                     rank) -> an inactive Patch (no CP), transformers untouched.
    kernel:          "auto" | "zigzag" | "ring" | "stripe" | "llama3" (ring variants: the sequence split), or
                     "ulysses" | "usp:UxR" (head-parallel: Ulysses groups of U consecutive ranks split the query
                     heads, a ring of R = world / U across them; U must divide the query heads), optionally
                     ":backend" ("zigzag:reference", "usp:2x2:torch_cudnn"). "auto": each call's kernel chosen by
                     the cost model calibrated on this GPU (``hfpatch.attention.kernel_choice``: the zigzag ring,
                     Ulysses or USP for batch rows; llama3, the ring, Ulysses or USP for packed rows), else zigzag
                     for batch rows and llama3 for packed rows; ``layout_choices`` says which and why. "usp:UxR"
                     makes the Ulysses and ring groups of ``cp_group`` (kept on ``patch.ctx.heads``; U x R must
                     equal the group's size).
    on_unsupported:  "raise" (SignatureMismatch with a diff, or UnsupportedRelease) or "fallback" (inactive Patch
                     and one warning) when the installed transformers cannot be patched.
    verify:          True: after installing, the numeric probe of the wrapper over the group and, with ``model``,
                     the whole-model probe (``hfpatch.model.probe``: the model's CP forward against its non-CP
                     forward on a few tokens per rank; ``ModelDivergence`` names the first diverging module).
                     "fast": the numeric probe only. False: no probe.
    model:           the model to train. It is audited first (``hfpatch.model.audit``: sequence mixers outside
                     attention, positions from the input's length, a per-rank router loss -> ``UnsupportedModel``
                     naming module and class, before anything is installed), then switched onto the patched
                     flash-attention path (even without flash-attn installed), and its forward takes
                     ``labels`` from ``shard_inputs`` to give the non-CP loss (``hfpatch.model.labels``); all restored by
                     ``remove()``. Raises ``UnsupportedArgument`` for a model without a flash path.

    ``RING_ATTN_SWITCH`` is read here (``1``/unset ring, ``0`` original, ``reference``, ``local``) and becomes the
    process-wide switch default until ``remove()``; it is read again at every step boundary (``shard_inputs``, the
    drop-ins' ``update_*_params``, each forward of a model on the ring), so flipping it between steps A/Bs a
    suspicious loss curve (``hfpatch.modes.refresh_from_env``).

    Collective over a group of two or more ranks: every rank must call it. The ranks agree (one all-reduce)
    before installing, so all of them install, all fall back, or all raise; with ``verify`` the probe's verdict
    is shared the same way.

    Only one patch may be active per process: a second ``apply`` while one is active raises ``PatchError``
    (naming it; call ``patch.remove()`` first). All-or-nothing: if anything fails, nothing is left installed.
    """
    _validate_arguments(kernel, on_unsupported, verify, model)
    model = inner_model(model) if model is not None else None  # a wrapper's transformers model (model.wrappers)

    env_mode = modes.mode_from_env()  # a bad RING_ATTN_SWITCH is an error even without CP
    group = _resolve_group(cp_group)
    if group is None or dist.get_world_size(group) == 1:
        with _active_lock:
            _check_no_active_patch()
        return _inactive("no CP group given (cp_group=None)" if group is None else "the CP group has a single rank",
                         model=model)
    check_grid(parse_kernel(kernel)[0], dist.get_world_size(group))  # usp:UxR against the group's size, on every rank
    match, version, fallback_reason = _agreed_match(group, on_unsupported, model)  # checks for an active patch too
    if fallback_reason is not None:
        return _inactive(fallback_reason, level=logging.WARNING, model=model)
    return _install(group, kernel, verify, model, match, version, env_mode, on_unsupported)


# What each rank reports before installing; the group acts on the worst (one rank falling back while the others
# run the ring would give wrong attention; one rank raising while the others wait in the probe would hang).
_OK, _FALLBACK, _FAILED = 0.0, 1.0, 2.0


def _agreed_match(group, on_unsupported: str, model: Optional[torch.nn.Module]):
    """``_match_live_signature`` and ``_audit_model`` on every rank, then one all-reduce so that all ranks do the
    same thing."""
    try:
        with _active_lock:
            _check_no_active_patch()
        match, version, reason = _match_live_signature(on_unsupported)
        if reason is None and model is not None:
            reason = _audit_model(model, on_unsupported)
    except BaseException:
        group_max(_FAILED, group)
        raise
    agreed = group_max(_FALLBACK if reason is not None else _OK, group)
    if agreed == _FAILED:
        raise PatchError("hfpatch.apply failed on another rank of the CP group (see that rank's error); nothing was "
                         "installed on this rank either. Fix: make every rank run the same transformers release.")
    if agreed == _FALLBACK and reason is None:
        return None, None, "another rank of the CP group fell back to non-CP mode, so all ranks do"
    return match, version, reason


def _match_live_signature(on_unsupported: str):
    """(match, version, None), or (None, None, reason) for a fallback; raises for on_unsupported="raise"."""
    version = version_gates.installed_transformers_version()
    if version is None or not version_gates.is_supported_release(version):
        what = "transformers is not installed" if version is None else f"transformers {version} is older than " \
            f"{version_gates.TRANSFORMERS_MIN_SUPPORTED} (no module-level _flash_attention_forward to patch)"
        if on_unsupported == "fallback":
            return None, None, what
        raise UnsupportedRelease(f"{what}. Fix: install transformers>={version_gates.TRANSFORMERS_MIN_SUPPORTED}.",
                                 transformers_version=None if version is None else str(version),
                                 requirement=f">={version_gates.TRANSFORMERS_MIN_SUPPORTED}")
    import transformers.modeling_flash_attention_utils as mfau  # not at the top: importing hfpatch must not load it

    live = mfau._flash_attention_forward
    try:
        return registry.require(inspect.signature(live), str(version)), version, None
    except SignatureMismatch as exc:
        if on_unsupported == "fallback":
            return None, None, f"unsupported _flash_attention_forward signature in transformers {version} " \
                               f"(nearest registry entry {exc.expected}); see hfpatch check"
        raise


def _audit_model(model: torch.nn.Module, on_unsupported: str) -> Optional[str]:
    """None when ``model_audit`` finds nothing; the reason to fall back, or ``UnsupportedModel`` raised."""
    findings = audit.audit(model)
    if not findings:
        return None
    message = audit.describe(findings, model)
    if on_unsupported == "fallback":
        return message
    raise UnsupportedModel(message, findings=findings)


def _install(group, kernel, verify, model, match, version, env_mode, on_unsupported="raise") -> Patch:
    global _active
    failure: Optional[BaseException] = None
    refusal: Optional[Exception] = None
    # Leaving this block before pop_all() removes the patch again (an error, or a refusal under "fallback").
    with AllOrNothing("the patch") as undo:
        try:
            patch = undo.push(_install_here(group, kernel, model, match, version,
                                            fallback=on_unsupported == "fallback"), "the patch")
            # the default, and the reading step boundaries compare RING_ATTN_SWITCH with (modes.refresh_from_env)
            patch._undo.callback(modes.follow_env(env_mode), "the switch default")
        except BaseException as exc:  # re-raised below, after the other ranks have been told
            failure = exc
        # Agree before the probe: its ring exchanges blocks between ranks, so a rank that failed and skipped it
        # would leave the others waiting forever. Every rank that installed removes again if any rank failed.
        if verify_module.group_max(_FAILED if failure is not None else _OK, group) != _OK:
            if failure is not None:
                raise failure
            raise VerificationError("hfpatch.apply failed on another rank of the CP group (see that rank's error); "
                                    "what was installed here was removed again.")
        try:
            if verify:
                verify_module.numeric(patch._installation.wrapper, match, patch.ctx)
            if verify is True and model is not None:
                probed = _probe_named(model, patch)
                attached = patch._models[0]
                attached.labels_refusal, attached.labels_alignment = probed.labels_refusal, probed.labels_alignment
                attached.probe = probed
            patch._dispatcher.reset()  # the probes' calls are not the user's
        except (VerificationError, UnsupportedArgument, UnsupportedModel) as exc:  # a named refusal of the model
            if on_unsupported != "fallback":
                raise
            refusal = exc
        else:
            undo.pop_all()  # applied: from now on the patch's own remove() takes it out
    if refusal is not None:
        return _inactive(str(refusal), level=logging.WARNING, model=model)
    with _active_lock:
        if _active is not None:  # another thread applied meanwhile: keep theirs, undo ours
            patch.remove()
            _check_no_active_patch()
        _active = patch
    mixers = patch.mixers.modules if patch.mixers is not None else []
    logger.info("hfpatch: active: %s, %d binding sites, kernel %s:%s over %d ranks, switch=%s; exact: attention%s%s; "
                "refused: %s", match.id, len(patch.sites), patch.ctx.variant, patch.ctx.backend, patch.ctx.world_size,
                env_mode, f", {len(mixers)} sequence mixers ({', '.join(sorted({m[2] for m in mixers}))})" if mixers
                else "", f", model probe worst rel. error {patch.probe.worst:.2g}" if patch.probe is not None else "",
                f"model(labels=) ({patch.labels_refusal})" if patch.labels_refusal else "nothing")
    return patch


def _probe_named(model: torch.nn.Module, patch: Patch) -> ProbeResult:
    """``probe_model``, where an error of the probe's own code (not the model's: ``probe_model`` names those)
    becomes a ``VerificationError`` naming the probe, so that ``on_unsupported="fallback"`` honours it."""
    try:
        return probe_model(model, patch)
    except (HfpatchError, KeyboardInterrupt):
        raise
    except Exception as exc:
        raise VerificationError(
            f"whole-model probe: checking {type(model).__name__} failed ({type(exc).__name__}: {exc}); nothing is "
            "left installed. Fix: train it without CP (apply(..., on_unsupported='fallback')), or skip the probe "
            "with verify='fast' only if you have compared its CP and non-CP outputs yourself.") from exc


def _install_here(group, kernel, model, match, version, *, fallback: bool = False) -> Patch:
    """This rank's part of apply: render, install at every site, switch the model, check identity. On failure
    everything it did is undone before the error propagates."""
    import transformers.modeling_flash_attention_utils as mfau  # not at the top: importing hfpatch must not load it

    original = mfau._flash_attention_forward
    if is_wrapper(original):
        raise PatchError("transformers' _flash_attention_forward is already an hfpatch wrapper from a patch that was "
                         "not removed cleanly. Fix: restart the process.")
    ctx = RingContext.for_group(group, kernel=kernel, call_original=original_caller(original, match))
    dispatcher = Dispatcher(original=original, match=match, ctx=ctx)
    wrapper = mark_wrapper(codegen.render(match, dispatcher.entry, original=original))  # a later apply sees it
    patch = Patch(active=True, reason=None, signature_id=match.id, ctx=ctx, dispatcher=dispatcher, match=match)

    def retire_dispatcher() -> None:
        dispatcher.removed = True  # a stale wrapper reference now calls the original

    with AllOrNothing("hfpatch") as undo:  # a failure undoes every step below, newest first, before it propagates
        undo.callback(retire_dispatcher, "the dispatcher")
        installation = patcher.install(patcher.binding_sites(original), wrapper)  # all-or-nothing by itself
        patch._installation = undo.push(installation, "the attention patch")
        patch._version = version
        patch.reach = ReachWatch(dispatcher, fallback=fallback)
        undo.push(patch.reach.install(), "the ring-reach watch")
        undo.callback(patch._remove_models, "the models")  # every model on the ring, before the attention patch
        if model is not None:
            patch._attach(model)
        verify_module.identity(installation)
        patch._undo = undo.pop_all()  # installed: the patch holds every step from now on
    return patch

