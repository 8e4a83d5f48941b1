"""Route one model's attention through the (patched) flash-attention path, even where flash-attn is not installed,
and undo it. (``hfpatch.switch`` is the other, per-call choice: ring, original, reference or local.)

Only the flash path calls ``_flash_attention_forward``; a model built with ``attn_implementation="eager"`` or
``"sdpa"`` never reaches the ring. ``apply(model=...)`` therefore switches the model deliberately, bypassing
transformers' flash-attn availability check (the bundled ring kernels do not need flash-attn):

- 4.48+: models pick their attention function per call from ``config._attn_implementation``
  (``ALL_ATTENTION_FUNCTIONS[...]`` / ``.get_interface(...)``, 5.1+), and the mask builders return no mask for
  flash attention when there is no padding (``masking_utils`` in 4.53+, ``_update_causal_mask`` before). Setting
  ``_attn_implementation = "flash_attention_2"`` on the model's config and every sub-config is enough.
- 4.43-4.47 (every model), and models that kept the old design later (qwen2_moe until 4.57; falcon, gpt_neo,
  bark through 5.24; gptj through 5.23): the attention class is chosen at construction (``LLAMA_ATTENTION_CLASSES[...]``),
  so each attention module's class is swapped to the ``"flash_attention_2"`` class of the same table in its
  own modeling module (the weights are the same: the flash class subclasses the eager one), and the config is
  switched too (the mask builder reads it). This is done on every release where such a table lists the
  module's class, not behind a version gate.
- Modeling modules that bind ``_flash_attention_forward`` only ``if is_flash_attn_available()`` (falcon, gpt_neo,
  ... in 5.x; several in 4.43-4.47) lack the name without flash-attn: it is injected (the wrapper) and deleted
  again on restore.

Everything changed is recorded in a ``ModelRouting`` whose ``remove()`` puts it back exactly.

``modality_towers(model)`` names the sub-models that encode another modality (vision, audio): the parts of a model
that never see the token sequence, which the routing, the audit's rules and the position hooks leave alone (a
tower keeps its own attention implementation: it attends over its own patches, whole on every rank).
"""
from __future__ import annotations

import contextlib
import sys
import types
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from hfpatch import version_gates
from hfpatch.attention.discovery import attention_modules
from hfpatch.errors import AlreadyRemoved, UnsupportedArgument
from hfpatch.undo import AllOrNothing, is_wrapper, mark_wrapper

__all__ = ["FLASH_IMPLEMENTATION", "ModelRouting", "has_flash_path", "route_model", "modality_towers"]

FLASH_IMPLEMENTATION = "flash_attention_2"
_FLASH_NAME = "_flash_attention_forward"
_UNSET = object()
# Every ModelRouting not yet removed: module-level names two routed models share come off with the last of them.
_live: "weakref.WeakSet[ModelRouting]" = weakref.WeakSet()


@dataclass(eq=False)  # compared (and hashed) by identity: ``_live`` holds it
class ModelRouting:
    """What ``route_model`` changed: configs (config, previous internal value), modules whose class was
    swapped (module, previous class), attributes added to modules, names injected into modeling modules."""

    configs: list[tuple[Any, Any]] = field(default_factory=list)
    classes: list[tuple[torch.nn.Module, type]] = field(default_factory=list)
    added_attrs: list[tuple[torch.nn.Module, str]] = field(default_factory=list)
    injected: list[tuple[types.ModuleType, Any]] = field(default_factory=list)
    # (module, previous value) of an ``_attn_implementation`` instance attribute copied from the config at
    # construction (4.43-4.47 mistral, mixtral, qwen2, phi3, ...: their mask builder reads it, not the config).
    module_impls: list[tuple[torch.nn.Module, Any]] = field(default_factory=list)
    # (module, name, previous, replacement): module-level functions of transformers replaced while switched.
    replaced: list[tuple[types.ModuleType, str, Any, Any]] = field(default_factory=list)
    removed: bool = field(default=False, init=False)

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """Inside it the model runs its own attention (the implementation and the attention classes it had before
        ``route_model``), off the flash path: what generation with a padding mask and a KV cache needs; routed
        again on exit."""
        if self.removed:
            raise AlreadyRemoved("this model's attention routing was already removed. Fix: suspend it while it is "
                                 "installed.", what="routing.ModelRouting")
        routed = [(config, config.__dict__.get("_attn_implementation_internal", _UNSET)) for config, _ in self.configs]
        swapped = [(module, module.__class__) for module, _ in self.classes]
        copies = [(module, module.__dict__.get("_attn_implementation")) for module, _ in self.module_impls]
        _put_back(self.configs, [(m, cls) for m, cls in self.classes], self.module_impls)
        try:
            yield
        finally:
            _put_back(routed, swapped, copies)

    def remove(self) -> None:
        """Undo every change, newest first; a second call raises ``AlreadyRemoved``."""
        if self.removed:
            raise AlreadyRemoved("this model's attention routing was already removed. Fix: remove it once.",
                                 what="routing.ModelRouting")
        self.removed = True
        _live.discard(self)
        # A module-level name another live routing also relies on (two models of one patch) stays until the last
        # of them is removed: removing one model never changes another.
        shared = {(id(m), name) for other in _live for m, name, _, _ in other.replaced}
        shared |= {(id(m), _FLASH_NAME) for other in _live for m, _ in other.injected}
        for module, name, previous, replacement in reversed(self.replaced):
            if module.__dict__.get(name) is replacement and (id(module), name) not in shared:
                setattr(module, name, previous)
        for module, previous in reversed(self.module_impls):
            module.__dict__["_attn_implementation"] = previous
        for module, wrapper in reversed(self.injected):
            if module.__dict__.get(_FLASH_NAME) is wrapper and (id(module), _FLASH_NAME) not in shared:
                delattr(module, _FLASH_NAME)
        for module, name in reversed(self.added_attrs):
            module.__dict__.pop(name, None)
        for module, cls in reversed(self.classes):
            module.__class__ = cls
        for config, previous in reversed(self.configs):
            # Written to the storage directly: 5.x's setter would also overwrite the sub-configs, which carry
            # their own records.
            if previous is _UNSET:
                config.__dict__.pop("_attn_implementation_internal", None)
            else:
                config.__dict__["_attn_implementation_internal"] = previous
        self.replaced.clear()
        self.injected.clear()
        self.module_impls.clear()
        self.added_attrs.clear()
        self.classes.clear()
        self.configs.clear()


def _configs(model: torch.nn.Module) -> list[Any]:
    """Every distinct config object of the model that token attention reads: its own, its submodules', and their
    sub-configs, less those of its modality towers (``modality_towers``: a vision or audio encoder attends over
    its own patches or frames, whole on every rank, never over the sharded sequence, so it keeps its own
    attention)."""
    towers = [model.get_submodule(path) for path in modality_towers(model)]
    inside = {id(m) for tower in towers for m in tower.modules()}
    skip = {id(tower.config) for tower in towers}
    seen: dict[int, Any] = {}
    pending = [getattr(m, "config", None) for m in model.modules() if id(m) not in inside]
    while pending:
        config = pending.pop()
        if config is None or id(config) in seen or id(config) in skip or not hasattr(config, "to_dict"):
            continue
        seen[id(config)] = config
        for key in getattr(config, "sub_configs", None) or ():
            pending.append(getattr(config, key, None))
    return list(seen.values())


def _supports_flash(model: torch.nn.Module) -> bool:
    cls = type(model)
    return bool(getattr(cls, "_supports_flash_attn", False) or getattr(cls, "_supports_flash_attn_2", False))


def _flash_class_for(module: torch.nn.Module) -> type | None:
    """4.43-4.47: the "flash_attention_2" class of ``module``'s modeling module, from the ``*_ATTENTION_CLASSES``
    dict that lists ``module``'s class; None when there is none."""
    modeling = sys.modules.get(type(module).__module__)
    if modeling is None:
        return None
    for name, value in modeling.__dict__.items():
        if name.endswith("_ATTENTION_CLASSES") and isinstance(value, dict) and type(module) in value.values():
            return value.get(FLASH_IMPLEMENTATION)
    return None


def _swap_classes(model: torch.nn.Module, record: ModelRouting) -> int:
    """Swap every attention module that has a flash sibling class; returns how many are on the flash class."""
    on_flash = 0
    for _, module in model.named_modules():
        flash_cls = _flash_class_for(module)
        if flash_cls is None:
            continue
        if type(module) is not flash_cls:
            record.classes.append((module, type(module)))
            module.__class__ = flash_cls
        if "_flash_attn_uses_top_left_mask" not in module.__dict__:
            # Set by the flash class's __init__ from the flash-attn version; the ring kernels align causal masks
            # bottom-right (flash-attn >= 2.1 behaviour), and under CP q and k lengths are equal anyway.
            module.__dict__["_flash_attn_uses_top_left_mask"] = False
            record.added_attrs.append((module, "_flash_attn_uses_top_left_mask"))
        on_flash += 1
    return on_flash


def _inject_missing_bindings(model: torch.nn.Module, wrapper: Callable, record: ModelRouting) -> None:
    """Bind the wrapper in modeling modules whose code calls ``_flash_attention_forward`` by name but which did
    not import it (the import is guarded by ``is_flash_attn_available()``)."""
    names = {type(m).__module__ for m in model.modules()}
    for name in sorted(names):
        modeling = sys.modules.get(name)
        if modeling is None:
            continue
        bound = modeling.__dict__.get(_FLASH_NAME)
        if bound is not None:
            if bound is wrapper and any(m is modeling for other in _live for m, _ in other.injected):
                record.injected.append((modeling, wrapper))  # injected for another model: shared until both go
            continue
        if any(_FLASH_NAME in _code_names(obj) for obj in modeling.__dict__.values() if _defined_in(obj, name)):
            setattr(modeling, _FLASH_NAME, wrapper)
            record.injected.append((modeling, wrapper))


def _defined_in(obj: Any, module_name: str) -> bool:
    """A class, or a module-level function (4.47 Gemma2's ``flash_attention_forward``), of that module."""
    return isinstance(obj, (type, types.FunctionType)) and getattr(obj, "__module__", None) == module_name


def _code_names(cls: Any) -> set[str]:
    """Global names read by a function, or by the methods defined on a class itself, nested code included
    (comprehensions and inner functions: 3.12 inlines comprehensions into their function's code, earlier
    Pythons compile them to code objects of their own, so the set is the same on every Python)."""
    codes = [cls.__code__] if isinstance(cls, types.FunctionType) else [
        value.__code__ for value in vars(cls).values() if hasattr(value, "__code__")]
    names: set[str] = set()
    while codes:
        code = codes.pop()
        names.update(code.co_names)
        codes.extend(const for const in code.co_consts if isinstance(const, types.CodeType))
    return names


def _switch_module_copies(model: torch.nn.Module, record: ModelRouting) -> None:
    """Switch the ``_attn_implementation`` that some models copy from the config into a module attribute at
    construction (e.g. ``MistralModel`` in 4.43.4: its ``_update_causal_mask`` reads ``self._attn_implementation``
    and would otherwise still build the eager 4-D mask for the flash path)."""
    for module in model.modules():
        previous = module.__dict__.get("_attn_implementation", _UNSET)
        if isinstance(previous, str) and previous != FLASH_IMPLEMENTATION:
            record.module_impls.append((module, previous))
            module.__dict__["_attn_implementation"] = FLASH_IMPLEMENTATION
        # The same copy under other names (4.43-4.52 decoders whose flash branch drops the all-ones mask): Bart's
        # and Whisper's flag ``_use_flash_attention_2``, MusicGen's ``attn_implementation``.
        for name, value in (("_use_flash_attention_2", True), ("attn_implementation", FLASH_IMPLEMENTATION)):
            previous = module.__dict__.get(name, _UNSET)
            if previous is False or previous in ("eager", "sdpa"):
                record.replaced.append((module, name, previous, value))
                module.__dict__[name] = value


def _guard_target_dtype(model: torch.nn.Module, record: ModelRouting) -> None:
    """transformers' flash integration (4.48+) picks an fp32 query's flash dtype from the first ``nn.Linear`` of
    the attention module (``get_target_dtype``) and raises a bare ``StopIteration`` for modules that have none
    (GPT-2 and GPT-SW3 project with transformers' ``Conv1D``). While the model is switched, that lookup falls
    back to the module's first floating-point parameter -- the dtype the same rule means -- and is restored by
    ``remove()``. The ring ignores the target dtype (it computes in the inputs' dtype)."""
    integration = sys.modules.get("transformers.integrations.flash_attention")
    if integration is None:
        try:
            import transformers.integrations.flash_attention as integration
        except ImportError:  # before 4.48: no shared integration
            return
    original = integration.__dict__.get("get_target_dtype")
    if original is not None and is_wrapper(original):
        # guarded for another model already: shared, restored when the last model that needs it goes
        if any(m is integration and name == "get_target_dtype" for other in _live for m, name, _, _ in other.replaced):
            record.replaced.append((integration, "get_target_dtype", original.__wrapped__, original))
        return
    without_linear = [name for name, module in attention_modules(model)
                      if not any(isinstance(m, torch.nn.Linear) for m in module.modules())]
    if not without_linear:
        return
    if original is None:  # 4.48 until get_target_dtype: the same lookup inline, nothing to guard
        _refuse_fp32_without_linear(model, without_linear[0])
        return

    def get_target_dtype(query, module):
        try:
            return original(query, module)
        except StopIteration:  # no nn.Linear in the module: the dtype of its first floating-point weight
            weights = [p for p in module.parameters() if p.is_floating_point()]
            return weights[0].dtype if weights and query.dtype == torch.float32 else None

    mark_wrapper(get_target_dtype)
    get_target_dtype.__wrapped__ = original
    integration.get_target_dtype = get_target_dtype
    record.replaced.append((integration, "get_target_dtype", original, get_target_dtype))


def _refuse_fp32_without_linear(model: torch.nn.Module, attention: str) -> None:
    """Releases whose flash integration looks up an fp32 query's dtype inline (``next(...nn.Linear...)``) raise a
    bare ``StopIteration`` there for an attention module without ``nn.Linear``: refused by name instead."""
    if not any(p.dtype == torch.float32 for p in model.parameters()):
        return
    raise UnsupportedArgument(
        "model", type(model).__name__,
        f"in fp32, this transformers release's flash-attention integration takes the query's target dtype from an "
        f"nn.Linear inside the attention module, and {attention} has none (it projects with transformers' Conv1D): "
        "the model's flash path fails with a bare StopIteration before any attention runs.",
        "train in bf16 or fp16 (model.to(torch.bfloat16)), or use a transformers release whose flash integration "
        "has get_target_dtype (hfpatch guards that lookup there).",
    )


def has_flash_path(model: torch.nn.Module, *, transformers_version=None) -> bool:
    """Whether ``route_model`` can switch ``model`` onto the flash-attention path: an attention class table that
    lists a ``"flash_attention_2"`` class (4.43-4.47 and the models that kept that design), or a model class that
    declares flash support and dispatches per call (4.48+). Reads the model only."""
    version = transformers_version or version_gates.installed_transformers_version()
    # 4.48+: models that dispatch per call through ALL_ATTENTION_FUNCTIONS need only the config switched.
    per_call_dispatch = version is None or version >= version_gates.TRANSFORMERS_ATTENTION_FUNCTIONS
    has_class_table = any(_flash_class_for(m) is not None for m in model.modules())
    # 4.47: Gemma2 already dispatches per call from config._attn_implementation (its own GEMMA2_ATTENTION_FUNCTION
    # dict, the forerunner of ALL_ATTENTION_FUNCTIONS): a flash-capable model without a class table is switched
    # by its config on every release.
    per_call_dispatch = per_call_dispatch or not has_class_table
    return has_class_table or (per_call_dispatch and _supports_flash(model))


def _put_back(configs, classes, module_impls) -> None:
    """Set each config's implementation, each module's class and attribute copy to the values given."""
    for module, cls in reversed(classes):
        module.__class__ = cls
    for module, value in reversed(module_impls):
        module.__dict__["_attn_implementation"] = value
    for config, value in reversed(configs):
        if value is _UNSET:
            config.__dict__.pop("_attn_implementation_internal", None)
        else:
            config.__dict__["_attn_implementation_internal"] = value


def route_model(model: Any, wrapper: Callable, *, transformers_version=None) -> ModelRouting:
    """Switch ``model`` onto the flash-attention path (see the module docstring); returns the record to undo it.

    Raises ``TypeError`` if ``model`` is not a ``torch.nn.Module`` with a ``config``, and ``UnsupportedArgument``
    if the model has no flash-attention path to switch to. Nothing is changed when it raises.
    """
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
        raise TypeError(
            f"model={type(model).__name__} is not a transformers model (a torch.nn.Module with a .config); "
            "pass the PreTrainedModel you will train, e.g. model=AutoModelForCausalLM.from_config(...)"
        )
    version = transformers_version or version_gates.installed_transformers_version()
    if not has_flash_path(model, transformers_version=version):
        raise UnsupportedArgument(
            "model", type(model).__name__,
            f"{type(model).__name__} has no flash-attention path (no '{FLASH_IMPLEMENTATION}' attention class and "
            "_supports_flash_attn is not set), so its attention never reaches _flash_attention_forward and cannot "
            "run as ring attention.",
            "use a model class that supports flash attention, or train this one without context parallelism.",
        )
    record = ModelRouting()
    _live.add(record)
    with AllOrNothing(f"the routing of {type(model).__name__}", record) as undo:  # a failure undoes what it changed
        _swap_classes(model, record)
        for config in _configs(model):
            record.configs.append((config, config.__dict__.get("_attn_implementation_internal", _UNSET)))
        for config in _configs(model):
            config.__dict__["_attn_implementation_internal"] = FLASH_IMPLEMENTATION
        _switch_module_copies(model, record)
        _inject_missing_bindings(model, wrapper, record)
        _guard_target_dtype(model, record)
        undo.pop_all()  # routed: the record undoes it from now on
    return record


def modality_towers(model: torch.nn.Module) -> list[str]:
    """Paths of the sub-models that encode another modality (vision, audio): a ``PreTrainedModel`` inside
    ``model`` whose config is neither the model's nor its text config. They read pixels or audio features,
    which hfpatch never shards (every rank encodes them whole), not the token sequence; the token-mixing rules
    do not apply inside them."""
    from transformers import PreTrainedModel  # not at the top: importing hfpatch must not load transformers

    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return [name for name, module in model.named_modules()
            if name and isinstance(module, PreTrainedModel)
            and getattr(module, "config", None) is not None
            and module.config is not config and module.config is not text
            and type(module.config) is not type(text) and type(module.config) is not type(config)]
