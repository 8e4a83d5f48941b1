"""Position modules that number tokens by the input's length, fed each rank's GLOBAL positions under CP.

The BART-family decoders (Bart, mBART, PLBart, Blenderbot, BlenderbotSmall, Marian, Pegasus), Whisper's and
MusicGen's decoders take their positions from a module (``embed_positions``: a learned table, with Bart's offset
of 2, or a sinusoidal one) that computes ``arange(past_key_values_length, past_key_values_length + seq_len)``
from the length of its input. Without CP that numbers the whole row 0..S-1 (a packed row too: these decoders
ignore document boundaries in their positions). Under CP each rank holds a shard, so the module would number
every shard from 0.

``install(model, ctx_of)`` hooks every recognised position module of ``model`` (a forward hook, removed with the
patch). While a patch is live and the switch runs the ring (or the reference), the hook replaces the module's
output with the module's OWN forward evaluated at this rank's global positions -- the token indices in the
whole row that this rank holds, in its order (``ring_kernels.layout.local_positions`` of the step's layout:
zigzag, stripe, contiguous for ring and llama3, packed or not; contiguous when no ``shard_inputs`` step was
recorded, as the attention assumes then). How the positions reach the module's forward depends on its
signature (``RECOGNISED``):

``position_ids``  the forward takes ``position_ids`` and looks them up when given: it is called with the global
                  positions (plus the start position below), shaped like what the caller passed.
``past_length``   the forward takes only the position of its first token (the start position below) and reads
                  the length from its first argument: it is called once per run of consecutive global positions
                  with the start position = the run's first position and a first argument of the run's
                  length (a stride-0 view: only its shape is read), and the runs are concatenated; with more
                  than ``MAX_RUNS`` runs (stripe), once over the covering span, then the rows are selected.

The start position is the parameter after the first (``PositionEntry.start``): ``past_key_values_length`` up to
5.23, ``cache_length`` from 5.24 (the same value, the length of the cache, renamed with the cache argument).

Positions the CALLER gave are left alone: where the module's owner (the decoder) takes ``position_ids`` itself
(Whisper) and received some, they reach the module as given -- on each rank the ones ``shard_inputs`` returned,
exactly as the non-CP model would use the whole row's. Such an owner keeps them from its attention, so a packed
row (``shard_inputs`` found documents) is refused there (``UnsupportedArgument``): without CP its documents
would attend to each other.

Recognition is by class (name and defining transformers module) and by the forward's signature (parameter names,
kinds and defaults), per release generation; the owner model must not be an encoder-decoder (its encoder's
sequence is not sharded the same way). A position module hfpatch does not recognise -- another class, a subclass,
a forward whose signature changed -- stays refused by ``hfpatch.model.audit`` (finding kind "positions").
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

import torch

from hfpatch.modes import current_mode
from hfpatch.errors import UnsupportedArgument
from hfpatch.undo import AllOrNothing, UndoStack
from hfpatch.model.routing import modality_towers
from ring_kernels.layout import local_positions

__all__ = ["PositionEntry", "RECOGNISED", "MAX_RUNS", "recognise", "why_unrecognised", "signature_text",
           "global_positions", "install", "position_kwargs"]

FEEDS = ("position_ids", "past_length")
# Switch modes whose attention treats this rank's tokens as a shard of the whole row.
_SHARDED_MODES = ("ring", "reference")
MAX_RUNS = 8


@dataclass(frozen=True)
class PositionEntry:
    """One recognised position module: ``class_name`` defined in ``transformers.models.<family>.modeling_<family>``
    (``family``), whose ``forward`` has ``signature`` (the parameters after ``self``, as ``signature_text`` renders
    them); ``feed``: how global positions reach it (module docstring); ``length_axis``: the axis of the first
    argument that holds the sequence length (``past_length`` only); ``releases``: where it was read; ``start``: the
    parameter that holds the position of the first token (module docstring)."""

    class_name: str
    family: str
    signature: str
    feed: str
    length_axis: int = 1
    releases: str = ""
    start: str = "past_key_values_length"

    @property
    def modeling_module(self) -> str:
        return f"transformers.models.{self.family}.modeling_{self.family}"


def _family(class_name: str, family: str, *, old: str, new: Optional[str], old_releases: str, new_releases: str,
            length_axis: int = 1) -> list[PositionEntry]:
    entries = [PositionEntry(class_name, family, old, "past_length", length_axis, old_releases)]
    if new is not None:
        entries.append(PositionEntry(class_name, family, new, "position_ids", length_axis, new_releases))
    return entries


# forward(input_ids | input_ids_shape, past_key_values_length=0[, position_ids=None]): position_ids was added in
# the 4.53 series (read: 4.43.4, 4.44.2, 4.47.1, 4.48.3 without; 4.53.3, 4.54.1, 5.0.0, 5.19.0, 5.23.0 with);
# 5.24 renames past_key_values_length to cache_length (read: 5.24.0).
_IDS = "input_ids, past_key_values_length=0"
_SHAPE = "input_ids_shape, past_key_values_length=0"
_OLD, _NEW, _CACHE = "4.43-4.48", "4.53-5.23", "5.24"
_UP_TO_5_23: tuple[PositionEntry, ...] = tuple(
    # learned tables, offset 2 (Bart, mBART, PLBart) or none (Blenderbot, BlenderbotSmall)
    _family("BartLearnedPositionalEmbedding", "bart", old=_IDS, new=_IDS + ", position_ids=None",
            old_releases=_OLD, new_releases=_NEW)
    + _family("MBartLearnedPositionalEmbedding", "mbart", old=_IDS, new=_IDS + ", position_ids=None",
              old_releases=_OLD, new_releases=_NEW)
    + _family("PLBartLearnedPositionalEmbedding", "plbart", old=_IDS, new=_IDS + ", position_ids=None",
              old_releases=_OLD, new_releases=_NEW)
    + _family("BlenderbotLearnedPositionalEmbedding", "blenderbot", old=_SHAPE, new=_SHAPE + ", position_ids=None",
              old_releases=_OLD, new_releases=_NEW)
    + _family("BlenderbotSmallLearnedPositionalEmbedding", "blenderbot_small", old=_SHAPE,
              new=_SHAPE + ", position_ids=None", old_releases=_OLD, new_releases=_NEW)
    # sinusoidal tables (frozen nn.Embedding weights, forward under no_grad)
    + _family("MarianSinusoidalPositionalEmbedding", "marian", old=_SHAPE, new=_SHAPE + ", position_ids=None",
              old_releases=_OLD, new_releases=_NEW)
    + _family("PegasusSinusoidalPositionalEmbedding", "pegasus", old=_SHAPE, new=_SHAPE + ", position_ids=None",
              old_releases=_OLD, new_releases=_NEW)
    # MusicGen: a sinusoidal buffer grown on demand; input (batch, codebooks, seq) resp. (batch, seq, hidden)
    + _family("MusicgenSinusoidalPositionalEmbedding", "musicgen", old=_IDS, new=None, length_axis=2,
              old_releases="4.43-5.23", new_releases="")
    + _family("MusicgenMelodySinusoidalPositionalEmbedding", "musicgen_melody",
              old="inputs_embeds, past_key_values_length=0", new=None, old_releases="4.43-5.23", new_releases="")
    # Whisper: weight[past:past + seq] or weight[position_ids]
    + [PositionEntry("WhisperPositionalEmbedding", "whisper", _IDS + ", position_ids=None", "position_ids",
                     1, "4.43-5.23")]
)


def _cache_length(entry: PositionEntry) -> PositionEntry:
    """``entry`` as 5.24 writes it: ``past_key_values_length`` renamed ``cache_length``, the body otherwise the same
    (read: every class above, 5.23.0 against 5.24.0; Marian, Pegasus and MusicGen also drop ``@torch.no_grad()``
    from the forward, whose tables need no gradient either way)."""
    return replace(entry, signature=entry.signature.replace("past_key_values_length", "cache_length"),
                   start="cache_length", releases=_CACHE)


RECOGNISED: tuple[PositionEntry, ...] = _UP_TO_5_23 + tuple(
    _cache_length(entry) for entry in _UP_TO_5_23 if entry.releases.endswith("5.23"))
_BY_CLASS: dict[tuple[str, str], list[PositionEntry]] = {}
for _entry in RECOGNISED:
    _BY_CLASS.setdefault((_entry.modeling_module, _entry.class_name), []).append(_entry)


def signature_text(function: Callable) -> str:
    """The parameters of ``function`` after ``self`` without annotations: ``"input_ids, past_key_values_length=0"``
    (names, kinds -- ``*``, ``**`` -- and defaults: what a caller's binding depends on)."""
    parameters = list(inspect.signature(function).parameters.values())[1:]
    return ", ".join(str(p.replace(annotation=inspect.Parameter.empty)) for p in parameters)


def _is_encoder_decoder(model: torch.nn.Module) -> bool:
    return bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))


def recognise(model: torch.nn.Module, module: torch.nn.Module) -> Optional[PositionEntry]:
    """The ``RECOGNISED`` entry of ``module`` (a submodule of ``model``), or None: its class must be one of
    transformers' (by name and defining module, not a subclass), its ``forward`` transformers' own with the
    entry's signature, and ``model`` a decoder (not an encoder-decoder)."""
    cls = type(module)
    entries = _BY_CLASS.get((cls.__module__, cls.__name__))
    if not entries or _is_encoder_decoder(model):
        return None
    forward = cls.__dict__.get("forward")
    if forward is None or "forward" in module.__dict__:  # inherited or replaced on the instance: not its code
        return None
    try:
        text = signature_text(forward)
    except (TypeError, ValueError):
        return None
    return next((entry for entry in entries if entry.signature == text), None)


def why_unrecognised(model: torch.nn.Module, module: torch.nn.Module) -> str:
    """Why ``recognise`` returned None for ``module``: a sentence for the audit's refusal."""
    cls = type(module)
    entries = _BY_CLASS.get((cls.__module__, cls.__name__))
    if not entries:
        return (f"hfpatch feeds global positions only into the position modules it recognises "
                f"(hfpatch.model.positions.RECOGNISED), and {cls.__module__}.{cls.__name__} is not one of them.")
    if _is_encoder_decoder(model):
        return ("hfpatch feeds global positions into this module only in a decoder-only model; this model is an "
                "encoder-decoder, whose encoder sequence CP does not shard.")
    try:
        found = signature_text(cls.forward)
    except (TypeError, ValueError):
        found = "<no signature>"
    known = " or ".join(f"({e.signature})" for e in entries)
    return (f"its forward is not the one hfpatch recognises for {cls.__name__}: found ({found}), known {known}; "
            f"hfpatch does not feed positions into code it has not read.")


def position_kwargs(model: torch.nn.Module, positions: torch.Tensor) -> dict:
    """``{"position_ids": positions}`` for ``model(...)``, or ``{}`` when its forward takes neither
    ``position_ids`` nor ``**kwargs`` (the BART-family, Whisper and MusicGen causal LMs before 5.0: there the
    positions come from the input's length, fed by ``install`` under CP)."""
    try:
        parameters = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):  # no introspectable signature: pass them, as a caller would
        return {"position_ids": positions}
    takes = any(p.name == "position_ids" or p.kind is p.VAR_KEYWORD for p in parameters)
    return {"position_ids": positions} if takes else {}


# ---------------------------------------------------------------------------------------- global positions


@dataclass
class _Memo:
    step: Any = None
    rank: int = -1
    positions: Optional[torch.Tensor] = None


def global_positions(ctx, seq_local: int, *, memo: Optional[_Memo] = None) -> torch.Tensor:
    """LongTensor (seq_local,) on the CPU: the index in the whole row (0..S-1, across documents when packed) of
    each token this rank holds, in its order. From ``ctx.step`` (the layout ``shard_inputs`` or a compat setter
    recorded), else the contiguous split the attention assumes without one. ``UnsupportedArgument`` when the
    step was recorded for another local length."""
    step = ctx.step
    if step is None:
        return torch.arange(seq_local) + ctx.rank * seq_local
    if step.seq_len_local != seq_local:
        raise UnsupportedArgument(
            "input_ids", torch.empty(step.batch_size, seq_local),
            f"a position module numbers {seq_local} local tokens, but {step.source} prepared this step for "
            f"{step.seq_len_local} local tokens per row: the model does not run on the inputs of this step.",
            "call patch.shard_inputs(...) for every batch and pass its input_ids to the model.",
        )
    if memo is not None and memo.step is step and memo.rank == ctx.rank:
        return memo.positions

    positions = local_positions(step.seq_len_global, ctx.group, layout=step.layout, cu_seqlens=step.cu_seqlens)
    if memo is not None:
        memo.step, memo.rank, memo.positions = step, ctx.rank, positions
    return positions


def _runs(positions: torch.Tensor) -> list[tuple[int, int]]:
    """(start position, length) of each run of consecutive values of ``positions`` (1-D, CPU), in order."""
    breaks = torch.nonzero(positions[1:] != positions[:-1] + 1).flatten() + 1
    edges = [0] + breaks.tolist() + [positions.numel()]
    return [(int(positions[a]), b - a) for a, b in zip(edges[:-1], edges[1:])]


# ------------------------------------------------------------------------------------------------ feeding


def _with_length(first: Any, axis: int, length: int) -> Any:
    """``first`` (a tensor, or a shape) with ``length`` along ``axis``; a tensor becomes a stride-0 view."""
    if isinstance(first, torch.Tensor):
        shape = list(first.shape)
        shape[axis] = length
        return first.narrow(axis, 0, 1).expand(shape)
    shape = list(first)
    shape[axis] = length
    return torch.Size(shape) if isinstance(first, torch.Size) else type(first)(shape)


def _fed_position_ids(forward, module, bound, positions: torch.Tensor, past: int) -> torch.Tensor:
    given = bound.arguments.get("position_ids")
    ids = positions.to(_device(module, given)) + past
    if given is not None:
        ids = ids.to(given.dtype).expand(given.shape)
    bound.arguments["position_ids"] = ids
    return forward(*bound.args, **bound.kwargs)


def _fed_past_length(forward, module, bound, positions: torch.Tensor, past: int, entry: PositionEntry):
    first = list(bound.signature.parameters)[1]  # after self: the input the module reads its length from
    original = bound.arguments[first]

    def call(start: int, length: int) -> torch.Tensor:
        arguments = dict(bound.arguments)
        arguments[first] = _with_length(original, entry.length_axis, length)
        arguments[entry.start] = past + start
        return forward(**arguments)

    runs = _runs(positions)
    if len(runs) <= MAX_RUNS:
        return torch.cat([call(start, length) for start, length in runs], dim=-2)
    low, high = int(positions.min()), int(positions.max())
    span = call(low, high - low + 1)
    return span.index_select(span.dim() - 2, (positions - low).to(span.device))


def _device(module: torch.nn.Module, given: Optional[torch.Tensor]) -> torch.device:
    if given is not None:
        return given.device
    for tensor in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)):
        return tensor.device
    return torch.device("cpu")


class _OwnerPositions:
    """Forward pre-hook of a position module's owner that takes ``position_ids``: whether its current call got any
    (then they reach the position module as the caller gave them)."""

    def __init__(self, owner: torch.nn.Module) -> None:
        self.signature = inspect.signature(owner.forward)
        self.owner_class = type(owner).__name__
        self.given = False

    def __call__(self, owner, args, kwargs) -> None:
        try:
            bound = self.signature.bind_partial(*args, **kwargs)
        except TypeError:  # the owner's own call fails the same way, with its own message
            self.given = False
            return None
        self.given = bound.arguments.get("position_ids") is not None
        return None


def _refuse_packed_owner(ctx, owner: "_OwnerPositions") -> None:
    """A packed step whose position ids the owner took as a parameter of its own: they number its position table,
    but nothing shows they reach its attention (WhisperDecoder keeps them: without CP its documents attend to
    each other, while the packed CP step would separate them). Refused rather than trained differently."""
    step = ctx.step
    if step is None or not step.packed:
        return
    raise UnsupportedArgument(
        "position_ids", step.position_ids,
        f"{owner.owner_class}.forward takes position_ids as a parameter of its own, for its position table; they "
        f"do not reach its attention (WhisperDecoder's do not), so without CP the documents of a packed row attend "
        f"to each other, while shard_inputs packed this row (its positions restart) and CP would keep them apart.",
        "pass the documents as rows of a batch (or one document per row), or train this model without CP.",
    )


def _feed_hook(entry: PositionEntry, ctx_of: Callable[[], Any], owner: Optional[_OwnerPositions]):
    memo = _Memo()

    def hook(module, args, kwargs, output):
        ctx = ctx_of()
        if ctx is None or ctx.world_size < 2 or current_mode() not in _SHARDED_MODES:
            return None
        forward = type(module).forward
        bound = inspect.signature(forward).bind(module, *args, **kwargs)
        if entry.feed == "position_ids" and bound.arguments.get("position_ids") is not None \
                and owner is not None and owner.given:
            _refuse_packed_owner(ctx, owner)
            return None  # the caller's position ids: already this rank's global ones
        bound.apply_defaults()
        past = int(bound.arguments.get(entry.start) or 0)
        positions = global_positions(ctx, output.shape[-2], memo=memo)
        if entry.feed == "position_ids":
            fed = _fed_position_ids(forward, module, bound, positions, past)
        else:
            fed = _fed_past_length(forward, module, bound, positions, past, entry)
        assert fed.shape == output.shape, (entry, tuple(fed.shape), tuple(output.shape))
        return fed

    return hook


def _owner(model: torch.nn.Module, name: str) -> Optional[torch.nn.Module]:
    parent = name.rpartition(".")[0]
    return model.get_submodule(parent) if parent else model


def install(model: torch.nn.Module, ctx_of: Callable[[], Any]) -> UndoStack:
    """Hook every recognised position module of ``model`` (module docstring); returns the hooks as one
    ``UndoStack`` (``remove()`` takes them all off). ``ctx_of()``: the live ``RingContext`` (None once the patch is
    inactive or removed)."""
    towers = modality_towers(model)  # vision/audio encoders: their positions number frames, never token shards
    owners: dict[int, _OwnerPositions] = {}
    with AllOrNothing(f"the position hooks of {type(model).__name__}") as handles:  # a failure takes every hook off
        for name, module in model.named_modules():
            if any(name == tower or name.startswith(tower + ".") for tower in towers):
                continue
            entry = recognise(model, module)
            if entry is None:
                continue
            owner_module = _owner(model, name)
            owner = None
            if entry.feed == "position_ids" and "position_ids" in inspect.signature(owner_module.forward).parameters:
                owner = owners.get(id(owner_module))
                if owner is None:
                    owner = owners[id(owner_module)] = _OwnerPositions(owner_module)
                    handles.push(owner_module.register_forward_pre_hook(owner, with_kwargs=True), f"{name}'s owner")
            handles.push(module.register_forward_hook(_feed_hook(entry, ctx_of, owner), with_kwargs=True), name)
        return handles.pop_all()
