"""What ``apply(model=)`` refuses before installing anything: the parts of a model that context parallelism
cannot make exact, found by reading the model (its module tree, its ``forward`` signature, its config).

Patching attention makes attention exact; training is exact only if nothing else mixes tokens along the
sequence on a rank that holds a shard of it. ``audit(model)`` returns one ``Finding`` per such part:

``sequence-mixer``   a module that carries a state along the sequence outside the patched attention: state-space
                     scans (Mamba, Mamba2/SSD), gated delta rules and other linear attention, recurrences
                     (RG-LRU), short convolutions. Recognised by class name (``MIXER_CLASS_PATTERN``) and
                     structurally: any ``nn.Conv1d`` outside such a module (a causal convolution over tokens).
                     Under CP each rank would run it from a zero state on its own shard. Modules the mixer
                     registry recognises (``hfpatch.mixers.recognise``: class, forward fingerprint and kernel
                     signatures of a known release) are no finding: ``apply`` runs them exactly under CP.
``positions``        the model's ``forward`` takes no ``position_ids`` while it has a position module (a learned
                     or sinusoidal table, rotary embeddings) that ``hfpatch.model.positions`` does not recognise:
                     positions then come from the input's length, so rank r would number its tokens from 0. The
                     recognised ones (the BART-family, Whisper and MusicGen decoders' tables) are fed each rank's
                     global positions instead.
``wrapper``          a wrapper (``hfpatch.model.wrappers``) whose forward cannot take the step's positions and
                     which does not hold exactly one transformers model that could (the fix names
                     ``apply(model=wrapper.<attribute>)``); ``adapter``: PEFT prompt learning (virtual tokens on
                     every rank). Either replaces the ``positions`` finding of the same wrapper.
``router-aux-loss``  ``output_router_logits`` is on and the model's mixture-of-experts load-balancing loss is not
                     one ``hfpatch.model.router_loss`` recognises (a recognised one is made the group's).
``pooled-head``      the head pools the sequence into one output per row by a rule ``hfpatch.model.heads`` does not
                     reproduce across shards (the last non-pad token's rule is made exact there).
``expert-parallel``  transformers loaded the model with expert parallelism (``hfpatch.model.expert_parallel``: its
                     experts sharded over a device mesh); CP over it is not verified exact. Listed first; where the
                     same load split the model by tensor parallelism too, this finding names both.
``tensor-parallel``  transformers loaded the model with tensor parallelism and no expert parallelism
                     (``hfpatch.model.tensor_parallel``: its weights split over a device mesh, each rank's attention
                     gets its heads only); CP over it is not verified exact. Listed first.

Each finding names the module path and class, the reason and the fix; a finding never depends on anything but
the model, so every rank of a CP group reaches the same verdict. What no rule here knows (a future release's
new mixer, a user's custom module) is caught by the whole-model probe (``hfpatch.model.probe``).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from hfpatch import mixers as _mixers
from hfpatch.model import heads as model_heads, positions as model_positions, router_loss
from hfpatch.model.expert_parallel import expert_parallelism
from hfpatch.model.tensor_parallel import tensor_parallelism
from hfpatch.model.routing import modality_towers
from hfpatch.model.wrappers import accepts_position_ids, wrapper_refusal

__all__ = ["Finding", "MIXER_CLASS_PATTERN", "audit", "describe"]

# Class names of sequence mixers in transformers' model code (matched at the end of the class name, so the model's
# prefix -- "FalconMamba", "RecurrentGemma" -- never matches on its own): Mamba/Mamba2 mixers and layers, gated
# delta nets, linear and lightning attention, short convolutions, RG-LRU and the recurrent block around it.
MIXER_CLASS_PATTERN = re.compile(
    r"(Mixer|MambaLayer|GatedDeltaNet|DeltaNet|DeltaRule|DeltaAttention|LinearAttention|LightningAttention"
    r"|ShortConv|ShortConvolution|RecurrentBlock|Rglru|RgLru|RGLRU)$"
)
# Submodule names and class-name parts that compute token positions.
_POSITION_NAMES = ("embed_positions", "wpe", "position_embeddings", "pos_emb", "rotary_emb", "embed_pos")
_POSITION_CLASS_PARTS = ("Positional", "PositionEmbedding", "PositionalEmbedding", "Rotary")

_FALLBACK_FIX = ("train this model without context parallelism; hfpatch.apply(..., on_unsupported='fallback') "
                 "runs it without CP and says why")


@dataclass(frozen=True)
class Finding:
    """One part of a model that CP cannot make exact. ``path``: the module's qualified name ("" for the model
    itself, or its config); ``module_class``: its class name; ``kind``: "sequence-mixer" | "positions" |
    "wrapper" | "adapter" | "router-aux-loss" | "pooled-head" | "expert-parallel" | "tensor-parallel"; ``reason``
    and ``fix``: sentences for the error message."""

    path: str
    module_class: str
    kind: str
    reason: str
    fix: str

    def describe(self) -> str:
        where = self.path or "<model>"
        return f"{where} ({self.module_class}): {self.reason} Fix: {self.fix}."


def audit(model: torch.nn.Module) -> list[Finding]:
    """Every ``Finding`` of ``model`` (empty: nothing outside attention mixes tokens along the sequence, positions
    come from ``position_ids``). Reads the model only; changes nothing."""
    wrapper = _wrapper_findings(model)
    positions = [] if wrapper else _position_findings(model)
    return (_parallel_load_findings(model) + _mixer_findings(model) + wrapper + positions + _router_findings(model)
            + _head_findings(model))


def describe(findings: list[Finding], model: torch.nn.Module) -> str:
    """The message of ``UnsupportedModel`` for ``findings`` of ``model``: every finding, at most 6 listed."""
    shown = findings[:6]
    more = f" (and {len(findings) - len(shown)} more of the same kinds)" if len(findings) > len(shown) else ""
    lines = "; ".join(f.describe() for f in shown)
    return (f"{type(model).__name__} cannot be trained exactly under context parallelism: {lines}{more} "
            "hfpatch refuses it before training rather than train it silently wrong.")


def _parallel_load_findings(model: torch.nn.Module) -> list[Finding]:
    """Expert or tensor parallelism of transformers' load: one finding, expert parallelism's where it is there (an
    expert-parallel load may split the attention by tensor parallelism too: the finding then names both)."""
    expert, tensor = expert_parallelism(model), tensor_parallelism(model)
    if expert is not None:
        also = "" if tensor is None else (f" The same load split its weights by tensor parallelism too ({tensor}), "
                                          "which hfpatch refuses as well.")
        return [Finding(
            "", type(model).__name__, "expert-parallel",
            f"transformers loaded it with expert parallelism ({expert}): its experts are sharded over a device mesh "
            "and each token is sent to the rank that holds its expert, while context parallelism splits those same "
            "tokens over the CP group; hfpatch has not verified that composition exact (which tokens meet which "
            "experts, the routing statistics, the sharded experts' gradients)." + also,
            "load the model without expert parallelism for CP training (no distributed_config, or ep_size=1 / "
            "enable_expert_parallel=False" + ("" if tensor is None else "; and no tp_plan, tp_size=1") + "), or "
            + _FALLBACK_FIX,
        )]
    if tensor is None:
        return []
    return [Finding(
        "", type(model).__name__, "tensor-parallel",
        f"transformers loaded it with tensor parallelism ({tensor}): its projections are split over a device mesh, so "
        "each rank's attention receives this rank's heads only, while context parallelism exchanges keys and values "
        "between the ranks of the CP group; a CP group that is not orthogonal to the TP group would exchange keys "
        "and values of different heads, and hfpatch has not verified that composition exact.",
        "load the model without tensor parallelism for CP training (no tp_plan, tp_size or device_mesh argument, "
        "no distributed_config with tp_size > 1) and shard it with FSDP2 (fully_shard over the data-parallel "
        "mesh, which hfpatch supports: docs/training-stack.md), or " + _FALLBACK_FIX,
    )]


def _mixer_findings(model: torch.nn.Module) -> list[Finding]:
    found: list[Finding] = []
    flagged: list[str] = list(modality_towers(model))  # their sub-trees never see the token sequence
    for name, module in model.named_modules():
        if name in flagged or any(name.startswith(outer + ".") for outer in flagged):
            continue
        cls = type(module).__name__
        if _mixers.recognise(module) is not None:  # run exactly under CP by hfpatch.mixers: it and its children
            flagged.append(name)
            continue
        if MIXER_CLASS_PATTERN.search(_family_part(cls, model)):
            reason = (f"a sequence mixer (state-space scan, linear attention, recurrence or short convolution) "
                      f"carries a state along the sequence outside the patched attention; under CP each rank "
                      f"would run it from a zero state on its own shard, and hfpatch's mixer registry does not "
                      f"recognise it: {_mixers.unrecognised_reason(module)}.")
        elif isinstance(module, torch.nn.Conv1d):
            reason = (f"a 1-D convolution over tokens (kernel {module.kernel_size[0]}) outside the patched "
                      f"attention: under CP the first tokens of each rank's shard would miss their predecessors.")
        else:
            continue
        flagged.append(name)
        found.append(Finding(name, cls, "sequence-mixer", reason, _FALLBACK_FIX))
    return found


def _family_part(class_name: str, model: torch.nn.Module) -> str:
    """``class_name`` without the prefix it shares with the model's class name, so that the pattern sees only what
    the module's name adds to the model's: KimiLinearForCausalLM's softmax attention ``KimiLinearAttention`` ->
    "Attention" (no mixer), its ``KimiLinearDeltaAttention`` -> "DeltaAttention"."""
    shared = 0
    for a, b in zip(class_name, type(model).__name__):
        if a != b:
            break
        shared += 1
    return class_name[shared:]


def _position_findings(model: torch.nn.Module) -> list[Finding]:
    """The first position module that numbers tokens by the input's length and that ``hfpatch.model.positions``
    does not recognise (a recognised one is fed each rank's global positions by ``apply``)."""
    if accepts_position_ids(model):
        return []

    towers = modality_towers(model)  # their positions number audio frames or patches, never shards of tokens
    for name, module in model.named_modules():
        if any(name == tower or name.startswith(tower + ".") for tower in towers):
            continue
        cls = type(module).__name__
        if name.rsplit(".", 1)[-1] in _POSITION_NAMES or any(part in cls for part in _POSITION_CLASS_PARTS):
            if model_positions.recognise(model, module) is not None:
                continue
            refusal = wrapper_refusal(model)  # a wrapper around a model that does take them: name that model
            if refusal is not None:
                return [Finding("", type(model).__name__, refusal.kind, refusal.reason, refusal.fix)]
            return [Finding(
                name, cls, "positions",
                f"{type(model).__name__}.forward takes no position_ids, so this module numbers the tokens by the "
                f"input's length: under CP every rank's shard would get positions 0, 1, ... instead of its global "
                f"ones; {model_positions.why_unrecognised(model, module)}",
                _FALLBACK_FIX,
            )]
    return []


def _wrapper_findings(model: torch.nn.Module) -> list[Finding]:
    """A wrapper ``hfpatch.model.wrappers.inner_model`` could not unwrap that no other rule would refuse: PEFT
    prompt learning, and a module that is no transformers model (no ``config``) holding transformers models.
    (A wrapper whose forward takes no ``position_ids`` is named where its positions would be refused.)"""
    refusal = wrapper_refusal(model)
    if refusal is None or not (refusal.kind == "adapter" or not hasattr(model, "config")):
        return []
    return [Finding("", type(model).__name__, refusal.kind, refusal.reason, refusal.fix)]


def _router_findings(model: torch.nn.Module) -> list[Finding]:
    config = getattr(model, "config", None)
    for candidate in (config, getattr(config, "text_config", None)):
        if candidate is not None and getattr(candidate, "output_router_logits", False) is True:
            found = router_loss.recognise(model)
            if not isinstance(found, str):
                return []   # the group's load-balancing loss replaces the model's (hfpatch.model.router_loss)
            return [Finding(
                "", type(candidate).__name__, "router-aux-loss",
                "output_router_logits=True adds the mixture-of-experts load-balancing loss, a product of per-token "
                f"means that each rank would compute from its own tokens only, and hfpatch does not recognise this "
                f"model's: {found}.",
                "set config.output_router_logits = False for CP training, or " + _FALLBACK_FIX,
            )]
    return []


def _head_findings(model: torch.nn.Module) -> list[Finding]:
    reason = model_heads.head_finding_reason(model)
    if reason is None:
        return []
    return [Finding("", type(model).__name__, "pooled-head", reason,
                    "train the per-token model under CP (its hidden states are exact) and pool them yourself from "
                    "the gathered sequence, or " + _FALLBACK_FIX)]
