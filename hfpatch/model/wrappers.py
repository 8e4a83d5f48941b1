"""The transformers model inside a wrapper: what ``apply(model=)`` routes, audits, probes and hooks.

Users often hand hfpatch a module that is not the transformers model itself but wraps one. ``inner_model(model)``
returns the ``PreTrainedModel`` whose attention layers run the ring and whose forward receives the token sequence
and the step's global ``position_ids``; every part of ``apply(model=)`` works on it. It unwraps, one layer at a
time, as deep as the wrappers go:

``peft``        a PEFT ``PeftModel`` of any task type (``PeftModelForCausalLM``, ``...ForSequenceClassification``,
                ...), a ``PeftMixedModel`` or a bare tuner (``LoraModel``, ...): their forward hands every argument
                on to the model they wrap, whose layers carry the adapters (LoRA, DoRA, IA3, ...). Prompt learning
                (prompt tuning, prefix tuning, P-tuning) is NOT unwrapped: its forward prepends virtual tokens and
                drops ``position_ids``, so the audit refuses it (``wrapper_refusal``).
``holder``      a module of a class not defined by transformers whose forward cannot take the step's positions
                -- no transformers model (no ``config``: OpenRLHF's ``Actor``, ``DistributedDataParallel``, a
                user's ``nn.Module``), or a forward without ``position_ids`` that numbers the tokens itself
                (OpenRLHF's ``CriticModel`` and ``RewardModel``) -- holding exactly one transformers model,
                outermost (``held_models``), whose forward takes ``position_ids`` and which has a flash-attention
                path. The CP step then calls that inner model (and the wrapper's head on its output), not the
                wrapper's forward.

A class of transformers' own is its own inner model (its positions are the audit's and
``hfpatch.model.positions``' concern), and so is any model whose forward takes ``position_ids`` or whose position
modules ``hfpatch.model.positions`` feeds. A holder hfpatch cannot see into (several transformers models inside, or
one it cannot route) is left as it is; ``wrapper_refusal`` says why and which ``apply(model=wrapper.<attribute>)``
to pass instead, and the audit raises it as a ``"wrapper"`` finding.

Reads the model only; changes nothing. PEFT is recognised only when it is already imported (hfpatch never
imports it).
"""
from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass
from typing import Optional

import torch

from hfpatch.model import positions
from hfpatch.model.routing import has_flash_path

__all__ = ["WrapperRefusal", "accepts_position_ids", "held_models", "inner_model", "wrapper_refusal"]

_MAX_DEPTH = 16  # wrappers of wrappers; far more than any real stack (PEFT over a critic over a backbone is 3)


@dataclass(frozen=True)
class WrapperRefusal:
    """Why ``inner_model`` stopped at a wrapper that CP cannot train as given: ``kind`` ("wrapper": a holder it
    cannot see into; "adapter": PEFT prompt learning), ``reason`` and ``fix`` (sentences for the error)."""

    kind: str
    reason: str
    fix: str


def inner_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model ``model`` wraps (see the module docstring); ``model`` itself when it is one, or when
    it is a wrapper that cannot be unwrapped (then ``wrapper_refusal(model)`` says why)."""
    current = model
    for _ in range(_MAX_DEPTH):
        inner = _peft_inner(current)
        if inner is None:
            inner = _held_inner(current)
        if inner is None or inner is current:
            return current
        current = inner
    return current


def wrapper_refusal(model: torch.nn.Module) -> Optional[WrapperRefusal]:
    """Why ``model`` (as ``inner_model`` left it) is a wrapper CP cannot train as given, or None: PEFT prompt
    learning, or a holder (module docstring) whose transformers models inside are not exactly one routable one."""
    prompt = _prompt_learning_type(model)
    if prompt is not None:
        return WrapperRefusal(
            "adapter",
            f"PEFT {prompt} is prompt learning: the PeftModel's forward prepends its virtual tokens to the input of "
            "every call and drops position_ids, so under CP every rank's shard would get the virtual tokens and "
            "positions counted from 0.",
            "use an adapter that changes weights only (LoRA, DoRA, IA3, LoHa, LoKr, OFT, ...), or train prompt "
            "learning without context parallelism",
        )
    if _takes_step(model):
        return None
    held = held_models(model)
    if not held:
        return None  # nothing inside to point at: the audit's other rules and routing speak
    why = "; ".join(f"{path} ({type(inner).__name__}) {_unroutable(inner) or 'takes position_ids'}"
                    for path, inner in held)
    count = "one transformers model" if len(held) == 1 else f"{len(held)} transformers models"
    return WrapperRefusal(
        "wrapper",
        f"{_why_not_step(model)}, and hfpatch looks inside only for exactly one transformers model whose forward "
        f"takes position_ids and that has a flash-attention path; it holds {count}: {why}.",
        "pass the inner model: " + " or ".join(f"apply(model=wrapper.{path})" for path, _ in held)
        + f" (wrapper: the {type(model).__name__} given), and call that model with the shard's input_ids and "
        "position_ids, its head on the output",
    )


def accepts_position_ids(model: torch.nn.Module) -> bool:
    """``model.forward`` takes ``position_ids``: by name, or through ``**kwargs`` handed on to a text model
    that takes them by name (composite models: MOSS-Transcribe-Diarize's ``language_model``)."""
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # no introspectable signature: assume it does, the probe still checks
        return True
    if "position_ids" in parameters:
        return True
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return False
    from transformers import PreTrainedModel  # not at the top: importing hfpatch must not load transformers

    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return any(module is not model and isinstance(module, PreTrainedModel) and module.config is text
               and "position_ids" in inspect.signature(module.forward).parameters
               for module in model.modules())


def held_models(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(path, module) of every outermost ``PreTrainedModel`` inside ``model`` (not ``model`` itself, none inside
    another one listed), in module order."""
    from transformers import PreTrainedModel  # not at the top: importing hfpatch must not load transformers

    found: list[tuple[str, torch.nn.Module]] = []
    for path, module in model.named_modules():
        if not path or any(path.startswith(outer + ".") for outer, _ in found):
            continue
        if isinstance(module, PreTrainedModel):
            found.append((path, module))
    return found


# ----------------------------------------------------------------------------------------------------- PEFT


def _peft():
    """PEFT's module when it is imported, else None: only then can ``model`` be one of its wrappers."""
    return sys.modules.get("peft")


def _prompt_learning_type(model: torch.nn.Module) -> Optional[str]:
    """The PEFT type of a ``PeftModel`` whose active adapter is prompt learning, else None."""
    peft = _peft()
    if peft is None or not isinstance(model, peft.PeftModel):
        return None
    config = model.active_peft_config
    if not getattr(config, "is_prompt_learning", False):
        return None
    return str(getattr(getattr(config, "peft_type", None), "value", config.peft_type))


def _peft_inner(model: torch.nn.Module) -> Optional[torch.nn.Module]:
    """The module a PEFT wrapper hands its forward to, or None (not a PEFT wrapper, or prompt learning)."""
    peft = _peft()
    if peft is None:
        return None
    if isinstance(model, peft.PeftModel):
        # get_base_model(): the transformers model (LoRA-family tuners), or the tuner itself (Poly), which the
        # next step unwraps; prompt learning is refused instead (wrapper_refusal).
        return None if _prompt_learning_type(model) is not None else model.get_base_model()
    mixed = getattr(peft, "PeftMixedModel", None)
    if mixed is not None and isinstance(model, mixed):
        return model.base_model.model
    tuners = sys.modules.get("peft.tuners.tuners_utils")
    if tuners is not None and isinstance(model, tuners.BaseTuner):
        return model.model
    return None


# --------------------------------------------------------------------------------------------------- holders


def _takes_step(model: torch.nn.Module) -> bool:
    """``model`` is a transformers model that takes the step's positions itself: a class of transformers' own (its
    position rules are the audit's and ``hfpatch.model.positions``'), or one whose forward takes ``position_ids``,
    or whose position modules ``hfpatch.model.positions`` feeds."""
    if type(model).__module__.split(".", 1)[0] == "transformers":
        return True
    if not hasattr(model, "config"):
        return False
    return accepts_position_ids(model) or any(positions.recognise(model, m) is not None
                                              for m in model.modules())


def _why_not_step(model: torch.nn.Module) -> str:
    cls = type(model).__name__
    if not hasattr(model, "config"):
        return f"{cls} is not a transformers model (it has no .config)"
    return (f"{cls}.forward takes no position_ids (it numbers the tokens itself, from their count or the attention "
            "mask), so it cannot be handed a shard's global positions")


def _unroutable(inner: torch.nn.Module) -> Optional[str]:
    """Why ``inner`` cannot be the model of ``apply(model=)``, or None."""
    if not accepts_position_ids(inner):
        return "takes no position_ids"
    if not has_flash_path(inner):
        return "has no flash-attention path"
    return None


def _held_inner(model: torch.nn.Module) -> Optional[torch.nn.Module]:
    """The one routable transformers model a holder holds (module docstring), else None."""
    if _takes_step(model):
        return None
    held = held_models(model)
    if len(held) != 1 or _unroutable(held[0][1]) is not None:
        return None
    return held[0][1]
