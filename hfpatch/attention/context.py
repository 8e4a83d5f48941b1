"""The context of a patch's ring: the CP group, the kernel asked for, and the per-step state.

``RingContext`` is frozen: a changed configuration is a new context (``dataclasses.replace``; the whole-model probe
runs on one with its own group, ``Dispatcher.using``), and only ``set_step`` writes the per-step state (the step,
its version, and the derivations cached for it). Also here: the kernel names (``parse_kernel``), the head-parallel
grids (``HeadSplit``, ``head_split``: the USP groups, made by ``ring_kernels.usp``), and the calibrated machine of
this rank's device.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from hfpatch.errors import UnsupportedArgument
from ring_kernels import build_usp_groups, layout_costs
from ring_kernels.layout_costs import squarest_usp_grid

__all__ = ["VARIANTS", "HEAD_KERNELS", "AUTO", "FROM_DEVICE", "StepState", "HeadSplit", "RingContext",
           "parse_kernel", "usp_degrees", "usp_grids", "check_grid", "head_split", "make_usp_groups",
           "auto_head_splits", "device_machine"]

VARIANTS = ("zigzag", "ring", "stripe", "llama3")
# The head-parallel kernels: "ulysses" (every rank of the group splits heads), "usp:UxR" (Ulysses groups of U
# consecutive ranks x a ring of R ranks across them).
HEAD_KERNELS = ("ulysses", "usp")
AUTO = "auto"
# ``RingContext.for_group``'s machine: the calibration of this rank's CUDA device (``device_machine``).
FROM_DEVICE = "device"
_USP_FORM = "'usp:UxR' (U ranks per Ulysses group x R ring ranks, U x R = the CP group's size, e.g. 'usp:2x2')"
# Every context's step versions come from one counter: a version names one step of one context, so a plan kept for
# one context is never taken for another's (a replaced context starts at a new version).
_VERSIONS = itertools.count(1)


@dataclass
class StepState:
    """How the current step's sequence is laid out over the group (identical on every rank).

    kernel:          "zigzag" | "ring" | "stripe" | "llama3": the ring variant that computes the step; or
                     "ulysses" | "usp": the head-parallel kernel (``RingContext.heads``), on the same layouts.
    layout:          "contiguous" | "zigzag" | "stripe": how the global sequence was split (ring_kernels.layout).
    packed:          True when the batch is one row of several documents (varlen kernels).
    batch_size:      B of the model input.
    seq_len_global:  S: tokens per row of the whole sequence (S_local * world_size).
    seq_len_local:   S_local: tokens per row on this rank.
    cu_seqlens:      IntTensor (num_docs + 1,) int32, cumulative lengths of the GLOBAL packed row; None if not packed.
    source:          "shard_inputs" | "position_ids" | "cu_seq_lens" | "shape": where the state came from; or
                     the name of the ``hfpatch.dropin`` function that set it (e.g. "update_ring_flash_attn_params").
    position_ids:    the local position ids ``shard_inputs`` returned (to detect a model fed other inputs), or None.
    positions_given: True when the caller gave ``shard_inputs`` position ids; False when it made them up (0..S-1).
    token_weights:   (B, S_local) float32, the weight of each of this rank's tokens in the model's own means over
                     tokens other than the labelled loss (the MoE load-balancing loss): 0 for tokens the non-CP run
                     does not count (the integration's end padding, the batch's padding mask), 1 otherwise; None:
                     every token counts.
    """

    kernel: str
    layout: str
    packed: bool
    batch_size: int
    seq_len_global: int
    seq_len_local: int
    cu_seqlens: Optional[torch.Tensor] = None
    source: str = "shard_inputs"
    position_ids: Optional[torch.Tensor] = None
    positions_given: bool = False
    token_weights: Optional[torch.Tensor] = None
    # Call signatures whose shapes the ranks were found to agree on in this step: the kernels' cross-rank check
    # (an all_gather and a host sync) runs once per step and shape, not per layer (ring_kernels.rank_check_scope).
    # A new StepState per step starts empty.
    rank_checked: set = field(default_factory=set, compare=False, repr=False)
    # device -> ``cu_seqlens`` on that device: copied once per step and device, for every plan of the step.
    cu_by_device: dict = field(default_factory=dict, compare=False, repr=False)
    # kernel="auto": (causal, window, heads, K/V heads, head dim) -> (the StepState to plan: this one or a copy with
    # the kernel chosen, the HeadSplit of a head-parallel pick) (``hfpatch.attention.kernel_choice.auto_kernel``).
    auto_kernels: dict = field(default_factory=dict, compare=False, repr=False)

    def cu_seqlens_on(self, device: torch.device) -> torch.Tensor:
        """The step's GLOBAL ``cu_seqlens`` on ``device`` (a packed step only)."""
        cu = self.cu_by_device.get(device)
        if cu is None:
            cu = self.cu_by_device[device] = self.cu_seqlens.to(device)
        return cu


@dataclass(frozen=True)
class HeadSplit:
    """How a head-parallel kernel splits the CP group of N ranks (``RingContext.heads``).

    ulysses:        U, the ranks that split the query heads of one sequence piece (an all-to-all among them).
    ring:           R, the ranks a ring variant runs across (N = U x R; 1 for "ulysses").
    ulysses_group:  "usp": this rank's group of U consecutive ranks of the CP group; None for "ulysses" (the CP
                    group itself).
    ring_group:     "usp": this rank's group of R ranks, one of each Ulysses group; None for "ulysses".
    groups:         "usp": the three groups as ``ring_kernels.build_usp_groups`` made them (``UspGroups``: the
                    kernel takes its grid as built), None for "ulysses" and a world of one.
    """

    ulysses: int
    ring: int
    ulysses_group: Any = None
    ring_group: Any = None
    groups: Any = None


class _StepSlot:
    """The per-step state of a context, written by ``RingContext.set_step`` only: the step, its version, and the
    derivations cached for it (``RingContext.cached``, ``RingContext.derived_steps``)."""

    __slots__ = ("step", "version", "seen", "derived")

    def __init__(self) -> None:
        self.step: Optional[StepState] = None
        self.version = next(_VERSIONS)
        # role -> (tensor, tensor._version, result): per-step derivations keyed on the tensor HF passes every layer
        self.seen: dict = {}
        # source -> the StepState last derived from HF's arguments (no shard_inputs): one object per step, so
        # that every layer of the step shares its rank-check set and its cu_seqlens copies
        self.derived: dict = {}


@dataclass(frozen=True, eq=False)
class RingContext:
    """Everything ring attention needs besides the call: the group, the kernel, and the step's layout. Frozen
    (``dataclasses.replace`` makes a changed one, with its own per-step state); ``set_step`` is its one writer.

    group:           the CP ProcessGroup (None: the default group).
    rank, world_size: this rank in ``group`` and its size.
    variant:         "auto" | "zigzag" | "ring" | "stripe" | "llama3" ("auto": zigzag for batch inputs, balanced
                     causal work; llama3 for packed inputs -- on a calibrated ``machine``, each call's kernel on
                     that split by the cost model, ``hfpatch.attention.kernel_choice``), or a head-parallel kernel:
                     "ulysses" | "usp:UxR". See ``kernel_choice.plan_step``.
    backend:         the ring_kernels block backend ("auto" picks the fastest that can compute the block).
    heads_k_stride:  llama3 only: K/V heads exchanged at a time (None: all at once).
    heads:           the ``HeadSplit`` of a head-parallel variant (``head_split``), else None.
    machine:         "auto" only: the calibrated machine whose cost model chooses each call's kernel, e.g. "H100";
                     None: plan_step's ring variants. ``machine_note``: how the device maps to it, or "".
    auto_heads:      "auto" with a machine: kernel -> ``HeadSplit`` of the head-parallel kernels auto may pick
                     ("ulysses": every rank; "usp": the squarest grid, ``ring_kernels.layout_costs.squarest_usp_grid``).
    call_original:   optional ``(call, extra) -> Tensor`` that re-calls transformers' original function;
                     ``whole.reference_attention`` uses it on the gathered sequence when flash-attn can run, else
                     computes the same semantics in plain math.
    auto_choices:    "auto": (kernel, call shape) -> the latest ``AutoChoice`` of it, with the (step, call shape)
                     pairs that decided it (``kernel_choice.record``; ``Patch.layout_choices``).
    step:            the current step's ``StepState`` (``set_step``; ``hfpatch.inputs.shard_inputs`` sets it), or
                     None: derived from each call's arguments.
    version:         a number no other step of any context has: a new one at every ``set_step`` and for every new
                     context. A plan kept with another version is stale (``hfpatch.attention.dispatch``).
    """

    group: Any = None
    rank: int = 0
    world_size: int = 1
    variant: str = AUTO
    backend: str = "auto"
    heads_k_stride: Optional[int] = None
    heads: Optional[HeadSplit] = None
    machine: Optional[str] = None
    machine_note: str = ""
    auto_heads: Optional[Dict[str, HeadSplit]] = None
    call_original: Optional[Callable[[dict, dict], torch.Tensor]] = None
    auto_choices: "OrderedDict[tuple, Any]" = field(default_factory=OrderedDict, repr=False)
    _slot: _StepSlot = field(default_factory=_StepSlot, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.variant != AUTO and self.variant not in VARIANTS and self.variant != "ulysses" \
                and usp_degrees(self.variant) is None:
            raise ValueError(
                f"RingContext: variant={self.variant!r} is not a kernel; expected 'auto', one of {VARIANTS}, "
                f"'ulysses' or {_USP_FORM}"
            )
        if self.heads_k_stride is not None and (
            isinstance(self.heads_k_stride, bool) or not isinstance(self.heads_k_stride, int) or self.heads_k_stride < 1
        ):
            raise ValueError(f"RingContext: heads_k_stride={self.heads_k_stride!r} must be None or a positive int")

    @property
    def step(self) -> Optional[StepState]:
        return self._slot.step

    @property
    def version(self) -> int:
        return self._slot.version

    @property
    def derived_steps(self) -> dict:
        """source -> the StepState derived from HF's arguments in the current step (``hfpatch.attention.step``)."""
        return self._slot.derived

    @property
    def ulysses_degree(self) -> int:
        """The ranks that split each call's query heads: U of a head-parallel kernel, 1 for a ring variant."""
        return self.heads.ulysses if self.heads is not None else 1

    @classmethod
    def for_group(cls, group=None, *, kernel: str = "auto", heads_k_stride: Optional[int] = None,
                  machine: Optional[str] = FROM_DEVICE,
                  call_original: Optional[Callable[[dict, dict], torch.Tensor]] = None) -> "RingContext":
        """A context for ``group`` (None: the default group) with ``kernel`` = "variant" or "variant:backend".
        For "usp:UxR" it makes the Ulysses and ring groups (``head_split``): collective over ``group``.
        "auto": ``machine`` names the cost model's calibration (``FROM_DEVICE``: this rank's CUDA device's, when
        ``group`` is NCCL's and the GPU is calibrated; None: none, plan_step's ring variants); with one, the
        head-parallel kernels' groups are made here too (collective over ``group``)."""
        variant, backend = parse_kernel(kernel)
        rank, world_size = (dist.get_rank(group), dist.get_world_size(group)) if dist.is_initialized() else (0, 1)
        note = ""
        if variant != AUTO or world_size == 1:
            machine = None
        elif machine == FROM_DEVICE:
            found = device_machine(group)
            machine, note = found if found is not None else (None, "")
        return cls(group=group, rank=rank, world_size=world_size, variant=variant, backend=backend,
                   heads_k_stride=heads_k_stride, heads=head_split(group, variant, world_size), machine=machine,
                   machine_note=note, auto_heads=auto_head_splits(group, world_size) if machine else None,
                   call_original=call_original)

    def set_step(self, step: Optional[StepState]) -> None:
        """Install the state of a new step (None: derive it from each call's arguments again): a new version, and
        the derivations of the last step dropped."""
        slot = self._slot
        slot.step = step
        slot.version = next(_VERSIONS)
        slot.seen.clear()
        slot.derived.clear()

    def cached(self, key: str, tensor: torch.Tensor, compute: Callable[..., Any], *args: Any) -> Any:
        """``compute(tensor, *args)``, cached while the same tensor object (unmodified) comes back in this step:
        once per step, not per layer. The entry keeps a reference to the tensor, so its id cannot be reused while
        cached."""
        seen = self._slot.seen
        hit = seen.get(key)
        if hit is not None and hit[0] is tensor and hit[1] == tensor._version:
            return hit[2]
        result = compute(tensor, *args)
        seen[key] = (tensor, tensor._version, result)
        return result


def parse_kernel(kernel: str) -> Tuple[str, str]:
    """``"zigzag"`` -> ("zigzag", "auto"); ``"zigzag:reference"`` -> ("zigzag", "reference"); "auto" -> ("auto",
    "auto"); ``"ulysses:torch_cudnn"`` -> ("ulysses", "torch_cudnn"); ``"usp:2x2:reference"`` -> ("usp:2x2",
    "reference"). ``ValueError`` naming the kernel and the allowed forms otherwise."""
    allowed = f"'auto', one of {VARIANTS}, 'ulysses' or {_USP_FORM}, optionally followed by ':<backend>'"
    if not isinstance(kernel, str) or not kernel:
        raise ValueError(f"kernel={kernel!r} must be a string: {allowed}")
    variant, sep, backend = kernel.partition(":")
    if variant == "usp":
        degrees, sep, backend = backend.partition(":")
        variant = f"usp:{degrees}"
        if usp_degrees(variant) is None:
            raise ValueError(f"kernel={kernel!r}: expected {_USP_FORM}, optionally followed by ':<backend>' (e.g. "
                             f"'usp:2x2:reference')")
    elif variant != AUTO and variant not in VARIANTS and variant != "ulysses":
        raise ValueError(f"kernel={kernel!r}: unknown kernel {variant!r}; expected {allowed} (e.g. 'zigzag:reference')")
    if sep and not backend:
        raise ValueError(f"kernel={kernel!r}: empty backend after ':'; e.g. 'zigzag:reference' or 'zigzag:auto'")
    return variant, backend or "auto"


def usp_degrees(variant: str) -> Optional[Tuple[int, int]]:
    """(U, R) of ``"usp:UxR"`` (positive ints), None for anything else."""
    if not isinstance(variant, str) or not variant.startswith("usp:"):
        return None
    parts = variant[4:].split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) >= 1 for p in parts):
        return None
    return int(parts[0]), int(parts[1])


def usp_grids(world: int) -> list:
    """The 'usp:UxR' kernels of a group of ``world`` ranks with both sides >= 2."""
    return [f"usp:{u}x{world // u}" for u in range(2, world // 2 + 1) if world % u == 0]


def check_grid(variant: str, world_size: int) -> None:
    """``UnsupportedArgument`` naming the kernel when ``variant`` is "usp:UxR" with U x R != ``world_size`` (the
    fix lists the grids of that many ranks); nothing for any other variant."""
    degrees = usp_degrees(variant)
    if degrees is None:
        return
    ulysses, ring = degrees
    if ulysses * ring != world_size:
        grids = usp_grids(world_size)
        raise UnsupportedArgument(
            "kernel", variant,
            f"{variant!r} asks for {ulysses} x {ring} = {ulysses * ring} ranks (Ulysses groups of {ulysses} x a "
            f"ring of {ring}), but the CP group has {world_size}.",
            f"kernel={grids[0]!r} (U x R = {world_size}: {', '.join(grids)}), or 'ulysses' (all {world_size} ranks "
            f"split the heads), or a ring variant ('auto')." if grids else
            f"the CP group's {world_size} ranks make no grid of two sides >= 2: kernel='ulysses' (all "
            f"{world_size} ranks split the heads) or a ring variant ('auto').",
        )


def auto_head_splits(group, world_size: int) -> Dict[str, HeadSplit]:
    """The head-parallel kernels "auto" may pick on ``group``: "ulysses" over every rank, and "usp" on the squarest
    grid (``ring_kernels.layout_costs.squarest_usp_grid``; its groups made as ``head_split`` makes them:
    collective)."""
    splits = {"ulysses": HeadSplit(ulysses=world_size, ring=1)}
    grid = squarest_usp_grid(world_size)
    if grid is not None:
        splits["usp"] = head_split(group, f"usp:{grid[0]}x{grid[1]}", world_size)
    return splits


def head_split(group, variant: str, world_size: int) -> Optional[HeadSplit]:
    """The ``HeadSplit`` of ``variant`` over ``group`` of ``world_size`` ranks (None for a ring variant or "auto").
    "usp:UxR": ``check_grid``, then the Ulysses and ring groups of ``group`` (``ring_kernels.usp``'s grid), made
    on first use and kept for the process's life like the group itself -- collective: every rank of ``group``
    calls it, in the same order as any other group it makes."""
    if variant == "ulysses":
        return HeadSplit(ulysses=world_size, ring=1)
    degrees = usp_degrees(variant)
    if degrees is None:
        return None
    check_grid(variant, world_size)
    ulysses, ring = degrees
    if world_size == 1 or not dist.is_initialized():
        return HeadSplit(ulysses=ulysses, ring=ring)
    return _usp_groups(group, ulysses, ring)


# (group, U, R) -> the HeadSplit of this rank: the subgroups of a CP group are made once and kept, as the group is.
_USP_GROUPS: dict = {}


def _usp_groups(group, ulysses: int, ring: int) -> HeadSplit:
    key = (group if group is not None else dist.group.WORLD, ulysses, ring)
    found = _USP_GROUPS.get(key)
    if found is None:
        found = _USP_GROUPS[key] = make_usp_groups(key[0], ulysses, ring)
    return found


def make_usp_groups(group, ulysses: int, ring: int, *, backend: Optional[str] = None) -> HeadSplit:
    """This rank's Ulysses group (U consecutive ranks of ``group``) and ring group (one rank of each Ulysses group),
    new, made by ``ring_kernels.build_usp_groups`` (of ``group``'s backend unless ``backend`` is given): every rank
    of ``group`` calls this, the same way."""
    built = build_usp_groups(group, ulysses, ring, backend=backend)
    return HeadSplit(ulysses=ulysses, ring=ring, ulysses_group=built.ulysses_group, ring_group=built.ring_group,
                     groups=built)


def device_machine(group) -> Optional[Tuple[str, str]]:
    """(calibrated machine, note) of this rank's CUDA device when ``group`` exchanges over NCCL; None otherwise
    (no process group, a CPU group, no calibration for the GPU)."""
    if not dist.is_initialized() or not torch.cuda.is_available():
        return None
    if "nccl" not in str(dist.get_backend(group)).lower():
        return None
    return layout_costs.machine_of(torch.cuda.get_device_name(torch.cuda.current_device()))


