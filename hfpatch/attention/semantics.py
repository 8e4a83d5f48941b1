"""The one semantic implementation behind every generated wrapper: what each argument of
``_flash_attention_forward`` means under context parallelism, and how it reaches ``ring_kernels``.

The wrapper (``hfpatch.attention.codegen``) maps the caller's arguments, by name, onto roles (``hfpatch.signatures.roles``)
and calls the dispatcher, which plans a ring call here -- ``ring_plan`` (every refusal, the step, the kernel's
arguments) -- runs it (``RingPlan.run``) and keeps the plan for the calls it computes as is
(``hfpatch.attention.dispatch``); ``ring_attention`` is the two in one. ``call`` maps role -> value,
``extra`` holds the trailing ``**kwargs`` (4.48+). Shapes (flash-attn layout, this rank's shard):

    query:            (B, S_local, H,  D)
    key, value:       (B, S_local, Hk, D)     H % Hk == 0 (GQA: the kernels never repeat K/V heads)
    returned output:  (B, S_local, H,  D)     dtype of query

What each role means here (docs/user-guide.md's "What ring attention honours and what it refuses" is the user's
copy of this table):

- ``is_causal``, ``softmax_scale`` (None: D ** -0.5), GQA: passed to the kernels.
- the kernel: a ring variant splits only the sequence; ``"ulysses"`` and ``"usp:UxR"`` (``RingContext.heads``)
  also split the query heads, on the same layouts (``plan_step``), so positions, labels and the mixers' state
  passing are those of the ring. The query heads must divide by the Ulysses degree (``UnsupportedArgument``
  naming ``query``, with the grids that fit); whatever a kernel refuses reaches the caller as
  ``UnsupportedArgument`` naming the kernel's argument (a block backend's refusal: ``kernel``).
- ``sliding_window``: converted to flash-attn's ``window_size`` exactly as the installed release converts it
  (``(w - 1, w - 1)`` from 4.56, ``(w, w)`` before; see ``version_gates.TRANSFORMERS_SLIDING_WINDOW_INCLUSIVE``), and
  like HF only when the (global) key length exceeds the window.
- ``softcap``: passed to the kernels (scores -> softcap * tanh(scores / softcap)).
- packing: the step's layout and GLOBAL ``cu_seqlens`` come from ``ctx.step`` (set once per step by
  ``hfpatch.inputs.shard_inputs``), or, without it, are derived once per step from the ``position_ids`` /
  ``cu_seq_lens_*`` HF passes (cached on the tensor's identity and version: one all-gather per step, none per
  layer). The rule for "packed" is HF's own (``_is_packed_sequence``: batch 1 and positions that are not
  ``arange + min``; documents start where the position equals the minimum).
- ``attention_mask``: a padding mask cannot be honoured (the local mask does not describe the global sequence):
  refused, unless it is all ones, in which case it changes nothing and is dropped (HF >= 4.53 itself drops an
  all-ones mask before calling flash attention).
- ``block_table`` / ``k_cache`` / ``v_cache``, a ``cache`` or ``cache_seqlens`` kwarg, or keys longer than the
  queries (a KV cache during generation): refused. CP is for training and prefill of whole sequences.
- ``dropout`` > 0: refused. HF passes the module's dropout only when ``module.training`` is True
  (``dropout=0.0 if not self.training else ...``), so a non-zero value *is* the training signal, whatever the
  grad mode; the ring kernels have no dropout.
- ``s_aux`` (attention sinks: a ``**kwargs`` entry wherever a model passes it -- gpt-oss from 4.55; from 5.6 the
  integration names it and casts it to the query's dtype): one logit per query head, an extra key of value 0 in
  every query's softmax (HF's eager sink attention). A tensor (H,), floating, on the query's device, else
  ``UnsupportedArgument``; passed to the kernels as ``sink=`` (folded into the final log-sum-exp); its gradient on
  each rank is the partial sum over that rank's queries (summed over the group like every parameter's).
- ``use_top_left_mask``: only matters when query and key lengths differ (flash-attn < 2.1 aligned the causal mask
  top-left); under CP they never do (refused above), so it is ignored.
- ``target_dtype``: as HF's flash path (``fa_peft_integration_check``): when it is given and the query is fp32,
  q, k and v are all cast to it before attention (e.g. an fp32 model under ``torch.autocast``: RoPE leaves q/k
  fp32 and v in the autocast dtype, and the integration passes the autocast dtype). Otherwise nothing is cast, and
  q, k and v must share one dtype (the kernels refuse a mix).
- ``deterministic``, ``implementation``: no effect; the ring kernels are deterministic by construction.
- other ``**kwargs`` (``layer_idx``, ``output_attentions``, ...): ignored, as HF's own function ignores them.
"""
from __future__ import annotations

import functools
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

import torch
import torch.distributed as dist

import ring_kernels
from hfpatch import version_gates
from hfpatch.attention.layout_choice import auto_kernel, device_machine
from hfpatch.errors import UnsupportedArgument
from ring_kernels.backends.reference import plain_attention
from ring_kernels import RingInputError, shard, unshard
from ring_kernels.backends import UnknownBackendError, UnsupportedBackendError
from ring_kernels.layout_costs import usp_grid

__all__ = [
    "VARIANTS",
    "HEAD_KERNELS",
    "StepState",
    "HeadSplit",
    "RingContext",
    "parse_kernel",
    "usp_degrees",
    "check_grid",
    "head_split",
    "make_usp_groups",
    "auto_head_splits",
    "FROM_DEVICE",
    "plan_step",
    "RingPlan",
    "ring_plan",
    "ring_attention",
    "reference_attention",
    "local_attention",
    "flash_path_runs",
    "plain_attention",
    "sink_of",
    "cast_to_target",
    "window_size_of",
    "packed_cu_seqlens",
    "global_cu_from_position_ids",
    "target_dtype_by_query",
    "window_is_inclusive",
    "integration_passes_positions",
]

VARIANTS = ("zigzag", "ring", "stripe", "llama3")
# The head-parallel kernels: "ulysses" (every rank of the group splits heads), "usp:UxR" (Ulysses groups of U
# consecutive ranks x a ring of R ranks across them).
HEAD_KERNELS = ("ulysses", "usp")
_AUTO = "auto"
# ``RingContext.for_group``'s machine: the calibration of this rank's CUDA device (``layout_choice.device_machine``).
FROM_DEVICE = "device"
_USP_FORM = "'usp:UxR' (U ranks per Ulysses group x R ring ranks, U x R = the CP group's size, e.g. 'usp:2x2')"

# Kwargs that HF's own function would act on; every other kwarg is ignored by it and by us.
_PAGED_KWARGS = ("cache", "cache_seqlens")
# The fixes of a KV cache's refusal: each works whether or not flash-attn is installed (the model's own attention,
# restored by remove(), runs any cache; a forward without a cache is what CP computes).
_PAGED_CACHE_FIX = ("generate after patch.remove() (the model's own attention and its cache are back); CP is for "
                    "training and prefill of whole sequences.")
_KV_CACHE_FIX = ("call the model with use_cache=False under CP (training and prefill need no cache), or generate "
                 "after patch.remove() (the model's own attention and its cache are back).")

# RingContext fields a RingPlan is built from: assigning any of them increments ``RingContext.version``.
_PLAN_INPUTS = frozenset({"group", "rank", "world_size", "variant", "backend", "heads_k_stride", "heads", "step",
                          "machine", "auto_heads"})
_EMPTY: Mapping[str, Any] = {}


# ----------------------------------------------------------------------------------------------- context


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
    # Call signatures whose shapes the ranks were found to agree on in this step: the kernels' cross-rank check
    # (an all_gather + host sync, ~0.8 ms of idle GPU per call on 2xH200) runs once per step and shape, not per
    # layer (ring_kernels.rank_check_scope). A new StepState per step starts empty.
    rank_checked: set = field(default_factory=set, compare=False, repr=False)
    # device -> ``cu_seqlens`` on that device: copied once per step and device, for every plan of the step.
    cu_by_device: dict = field(default_factory=dict, compare=False, repr=False)
    # kernel="auto": (causal, window, heads, K/V heads, head dim) -> (the StepState to plan: this one or a copy with
    # the kernel chosen, the HeadSplit of a head-parallel pick) (``hfpatch.attention.layout_choice.auto_kernel``).
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
    """

    ulysses: int
    ring: int
    ulysses_group: Any = None
    ring_group: Any = None


@dataclass
class RingContext:
    """Everything ``ring_attention`` needs besides the call: the group, the variant, and the step's layout.

    group:           the CP ProcessGroup (None: the default group).
    rank, world_size: this rank in ``group`` and its size.
    variant:         "auto" | "zigzag" | "ring" | "stripe" | "llama3" ("auto": zigzag for batch inputs, balanced
                     causal work; llama3 for packed inputs -- on a calibrated ``machine``, each call's kernel on
                     that split by the cost model, ``hfpatch.attention.layout_choice``), or a head-parallel kernel:
                     "ulysses" | "usp:UxR". See ``plan_step``.
    backend:         the ring_kernels block backend ("auto" picks the fastest that can compute the block).
    heads_k_stride:  llama3 only: K/V heads exchanged at a time (None: all at once).
    heads:           the ``HeadSplit`` of a head-parallel variant (``head_split``), else None.
    machine:         "auto" only: the calibrated machine whose cost model chooses each call's kernel
                     (``hfpatch.attention.layout_choice``), e.g. "H100"; None: plan_step's ring variants.
                     ``machine_note``: how the device maps to it (a GPU using another's calibration), or "".
    auto_heads:      "auto" with a machine: kernel -> ``HeadSplit`` of the head-parallel kernels auto may pick
                     ("ulysses": every rank; "usp": the squarest grid, ``ring_kernels.layout_costs.usp_grid``).
    auto_choices:    "auto": (kernel, call shape) -> the latest ``AutoChoice`` of it, with the (step, call shape) pairs
                     that decided it (``layout_choice.record``; ``Patch.layout_choices``).
    step:            the current step's ``StepState`` (set by ``hfpatch.inputs.shard_inputs``), or None.
    call_original:   optional ``(call, extra) -> Tensor`` that re-calls transformers' original function (set by
                     the dispatcher); ``reference_attention`` uses it on the gathered sequence when flash-attn can
                     run, else computes the same semantics in plain math.
    version:         incremented whenever a field a plan is built from is assigned (group, rank, world_size,
                     variant, backend, heads_k_stride, heads, step), like a tensor's ``_version``: a kept plan whose
                     inputs hold another version is stale (``hfpatch.attention.dispatch`` compares it on every call).
    """

    group: Any = None
    rank: int = 0
    world_size: int = 1
    variant: str = _AUTO
    backend: str = "auto"
    heads_k_stride: Optional[int] = None
    heads: Optional[HeadSplit] = None
    machine: Optional[str] = None
    machine_note: str = ""
    auto_heads: Optional[Dict[str, HeadSplit]] = None
    auto_choices: "OrderedDict[tuple, Any]" = field(default_factory=OrderedDict, repr=False, compare=False)
    step: Optional[StepState] = None
    call_original: Optional[Callable[[dict, dict], torch.Tensor]] = None
    # role -> (tensor, tensor._version, result): per-step derivations keyed on the tensor HF passes to every layer.
    _seen: dict = field(default_factory=dict, repr=False)
    # source -> the StepState last derived from HF's arguments (no shard_inputs): one object per step, so that
    # every layer of the step shares its rank-check set and its cu_seqlens copies.
    _derived: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    version: int = field(default=0, init=False, repr=False, compare=False)

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        if name in _PLAN_INPUTS:  # the group, variant, backend, stride or step a plan was built from changed
            object.__setattr__(self, "version", self.__dict__.get("version", 0) + 1)
            derived = self.__dict__.get("_derived")
            if derived:  # derived states bake in the variant and the world size
                derived.clear()

    def __post_init__(self) -> None:
        if self.variant != _AUTO and self.variant not in VARIANTS and self.variant != "ulysses" \
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
    def ulysses_degree(self) -> int:
        """The ranks that split each call's query heads: U of a head-parallel kernel, 1 for a ring variant."""
        return self.heads.ulysses if self.heads is not None else 1

    @classmethod
    def for_group(cls, group=None, *, kernel: str = "auto", heads_k_stride: Optional[int] = None,
                  machine: Optional[str] = FROM_DEVICE) -> "RingContext":
        """A context for ``group`` (None: the default group) with ``kernel`` = "variant" or "variant:backend".
        For "usp:UxR" it makes the Ulysses and ring groups (``head_split``): collective over ``group``.
        "auto": ``machine`` names the cost model's calibration (``FROM_DEVICE``: this rank's CUDA device's, when
        ``group`` is NCCL's and the GPU is calibrated; None: none, plan_step's ring variants); with one, the
        head-parallel kernels' groups are made here too (collective over ``group``)."""
        variant, backend = parse_kernel(kernel)
        rank, world_size = (dist.get_rank(group), dist.get_world_size(group)) if dist.is_initialized() else (0, 1)
        note = ""
        if variant != _AUTO or world_size == 1:
            machine = None
        elif machine == FROM_DEVICE:
            found = device_machine(group)
            machine, note = found if found is not None else (None, "")
        return cls(group=group, rank=rank, world_size=world_size, variant=variant, backend=backend,
                   heads_k_stride=heads_k_stride, heads=head_split(group, variant, world_size), machine=machine,
                   machine_note=note, auto_heads=auto_head_splits(group, world_size) if machine else None)

    def set_step(self, step: Optional[StepState]) -> None:
        """Install the state of a new step (None: derive it from each call's arguments again)."""
        self.step = step  # a new version, and the derived states dropped (__setattr__)
        self._seen.clear()


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
    elif variant != _AUTO and variant not in VARIANTS and variant != "ulysses":
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


def _grids(world: int) -> list:
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
        grids = _grids(world_size)
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
    grid (``ring_kernels.layout_costs.usp_grid``; its groups made as ``head_split`` makes them: collective)."""
    splits = {"ulysses": HeadSplit(ulysses=world_size, ring=1)}
    grid = usp_grid(world_size)
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
    new (``dist.new_group``, of ``group``'s backend unless ``backend`` is given). Only the members of each group make
    it (``use_local_synchronization``), the Ulysses group first: every rank of ``group`` calls this, the same way."""
    ranks = dist.get_process_group_ranks(group)                  # global ranks, in the rank order of ``group``
    rank = dist.get_rank(group)
    first = rank - rank % ulysses
    backend = backend or dist.get_backend(group)
    ulysses_group = dist.new_group([ranks[g] for g in range(first, first + ulysses)], backend=backend,
                                   use_local_synchronization=True)
    ring_group = dist.new_group([ranks[g] for g in range(rank % ulysses, ulysses * ring, ulysses)], backend=backend,
                                use_local_synchronization=True)
    return HeadSplit(ulysses=ulysses, ring=ring, ulysses_group=ulysses_group, ring_group=ring_group)


def plan_step(variant: str, *, packed: bool, source: str = "shard_inputs") -> Tuple[str, str]:
    """(kernel, layout) for a step. ``source`` != "shard_inputs" means the user split the inputs themselves:
    the only split we can assume is contiguous.

    batch:  auto/zigzag -> zigzag; stripe -> stripe; ring/llama3 -> ring (contiguous; llama3 is varlen-only).
    packed: zigzag (pinned) -> zigzag varlen; ring (pinned) -> ring varlen; auto/llama3/stripe -> llama3
            (stripe has no varlen form).
    head-parallel: "ulysses" -> ulysses, "usp:UxR" -> usp, on zigzag batches (the layout that balances the ring's
            causal work across USP's Ulysses groups), and contiguous packed rows (each document whole where it can
            be: no padding to 2N per document) or inputs the user split.
    """
    head = "usp" if usp_degrees(variant) is not None else "ulysses" if variant == "ulysses" else None
    if head is not None:
        return head, "zigzag" if source == "shard_inputs" and not packed else "contiguous"
    if source != "shard_inputs":
        if packed:
            return ("ring", "contiguous") if variant == "ring" else ("llama3", "contiguous")
        return "ring", "contiguous"
    if packed:
        if variant == "zigzag":
            return "zigzag", "zigzag"
        if variant == "ring":
            return "ring", "contiguous"
        return "llama3", "contiguous"
    if variant in (_AUTO, "zigzag"):
        return "zigzag", "zigzag"
    if variant == "stripe":
        return "stripe", "stripe"
    return "ring", "contiguous"


# ------------------------------------------------------------------------------------------- refusals


def _refuse_unsupported(call: Mapping[str, Any], extra: Mapping[str, Any], q: torch.Tensor, k: torch.Tensor,
                        ctx: RingContext) -> None:
    """Raise ``UnsupportedArgument`` for anything ring attention cannot honour (see the module docstring)."""
    _refuse(call, extra, q.shape, k, ctx, call.get("sliding_window"), call.get("softcap"))


def _refuse(call: Mapping[str, Any], extra: Mapping[str, Any], q_shape: torch.Size, k: torch.Tensor,
            ctx: RingContext, window: Any, softcap: Any) -> None:
    """``_refuse_unsupported`` on the hot path: every check runs on every call (a refusal is never cached), but
    the common case -- nothing to refuse -- costs one ``is None`` per role. ``window``/``softcap``: the call's."""
    get = call.get
    if get("block_table") is not None or get("k_cache") is not None or get("v_cache") is not None:
        role = next(r for r in ("block_table", "k_cache", "v_cache") if get(r) is not None)
        raise UnsupportedArgument(
            role, call[role],
            "a paged KV cache cannot be used with context parallelism (each rank holds a slice of the sequence).",
            _PAGED_CACHE_FIX,
        )
    if extra and (extra.get("cache") is not None or extra.get("cache_seqlens") is not None):
        name = next(n for n in _PAGED_KWARGS if extra.get(n) is not None)
        raise UnsupportedArgument(
            name, extra[name],
            "a KV cache cannot be used with context parallelism (each rank holds a slice of the sequence).",
            _KV_CACHE_FIX,
        )
    if k.shape[1] != q_shape[1]:
        raise UnsupportedArgument(
            "key", k,
            f"keys cover {k.shape[1]} tokens but queries {q_shape[1]}: a KV cache (generation) cannot be used with "
            f"context parallelism, where every rank holds an equal slice of one sequence.",
            _KV_CACHE_FIX,
        )
    mask = get("attention_mask")
    if mask is not None:
        _refuse_padding_mask(mask, ctx)
    dropout = get("dropout")
    if dropout and float(dropout) > 0.0:
        raise UnsupportedArgument(
            "dropout", dropout,
            "attention dropout cannot be applied by the ring kernels; HF passes a non-zero dropout only when the "
            "attention module is in training mode.",
            "set the model's attention_dropout to 0.0 for CP training (config.attention_dropout = 0.0).",
        )
    if softcap is not None and float(softcap) < 0:
        raise UnsupportedArgument("softcap", softcap, "softcap must be >= 0 (0 or None: no capping).")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window <= 0):
        raise UnsupportedArgument(
            "sliding_window", window, "sliding_window must be None or a positive int (the window in tokens).",
            "set config.sliding_window to None to disable the window.",
        )


def sink_of(extra: Optional[Mapping[str, Any]], q: torch.Tensor) -> Optional[torch.Tensor]:
    """The call's attention sink (``s_aux``, one logit per query head: (H,), floating, on q's device) or None;
    ``UnsupportedArgument`` naming ``s_aux`` for anything else. q: (B, S, H, D)."""
    sink = extra.get("s_aux") if extra else None
    if sink is None:
        return None
    heads = q.shape[2]
    if not isinstance(sink, torch.Tensor):
        raise UnsupportedArgument(
            "s_aux", sink, f"attention sinks must be a tensor of shape (num_heads,) = ({heads},), got "
            f"{type(sink).__name__}.")
    if sink.shape != (heads,):
        raise UnsupportedArgument(
            "s_aux", sink, f"attention sinks have shape {tuple(sink.shape)}; expected (num_heads,) = ({heads},): one "
            f"logit per query head of this call (query {tuple(q.shape)}).",
            "pass the attention module's per-head sink parameter (e.g. gpt-oss's `self.sinks`).")
    if not sink.is_floating_point():
        raise UnsupportedArgument(
            "s_aux", sink, f"attention sinks have dtype {sink.dtype}; expected a floating dtype (logits).")
    if sink.device != q.device:
        raise UnsupportedArgument(
            "s_aux", sink, f"attention sinks are on {sink.device} but the query on {q.device}.",
            "keep the sink parameter on the attention layer's device.")
    return sink


def cast_to_target(target_dtype: Optional[torch.dtype], q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as the installed release's flash path casts them (``fa_peft_integration_check``): all three to
    ``target_dtype`` when it is given and the query (before 4.49: the value) is fp32; else unchanged."""
    if target_dtype is None or (q if target_dtype_by_query() else v).dtype is not torch.float32:
        return q, k, v
    if q.dtype is target_dtype and k.dtype is target_dtype and v.dtype is target_dtype:
        return q, k, v
    return q.to(target_dtype), k.to(target_dtype), v.to(target_dtype)


@functools.lru_cache(maxsize=None)
def target_dtype_by_query() -> bool:
    """The installed release casts to ``target_dtype`` when the query (4.49+; before: the value) is fp32 (read once;
    ``cache_clear()`` reads it again)."""
    version = version_gates.installed_transformers_version()
    return version is None or version >= version_gates.TRANSFORMERS_TARGET_DTYPE_BY_QUERY


def _refuse_padding_mask(mask: Optional[torch.Tensor], ctx: RingContext) -> None:
    """A mask with a zero somewhere is refused; an all-ones mask is harmless (checked once per tensor)."""
    if mask is None:
        return
    if not isinstance(mask, torch.Tensor):
        raise UnsupportedArgument("attention_mask", mask, "expected a padding mask tensor or None.")
    if _cached(ctx, "attention_mask", mask, _all_ones):
        return  # all ones: there is no padding to honour (HF >= 4.53 drops such a mask itself)
    raise UnsupportedArgument(
        "attention_mask", mask,
        "a padding mask cannot be honoured under context parallelism: each rank holds a slice of the sequence, "
        "and padding would be attended to or shift the shards.",
        "pack the documents into one row without padding (hfpatch shard_inputs with position_ids that restart at 0 "
        "per document), or pad with tokens whose labels are -100 and pass no attention_mask (causal models never "
        "attend to trailing padding).",
    )


def _all_ones(mask: torch.Tensor) -> bool:
    return bool(mask.bool().all())


def _cached(ctx: RingContext, key: str, tensor: torch.Tensor, compute: Callable[..., Any], *args: Any) -> Any:
    """``compute(tensor, *args)``, cached while the same tensor object (unmodified) comes back: once per step, not
    per layer. The entry keeps a reference to the tensor, so its id cannot be reused while cached."""
    hit = ctx._seen.get(key)
    if hit is not None and hit[0] is tensor and hit[1] == tensor._version:
        return hit[2]
    result = compute(tensor, *args)
    ctx._seen[key] = (tensor, tensor._version, result)
    return result


# --------------------------------------------------------------------------------------- kernel arguments


def window_size_of(sliding_window: Optional[int], seq_len_global: int) -> Tuple[int, int]:
    """flash-attn ``window_size`` for HF's ``sliding_window``, converted as the installed release converts it."""
    # HF applies the window only when the keys outnumber it (the key length is the GLOBAL length here: that is
    # what the non-CP run sees); a window at least as long as the sequence excludes nothing anyway.
    if sliding_window is None or seq_len_global <= sliding_window:
        return (-1, -1)
    if window_is_inclusive():
        return (sliding_window - 1, sliding_window - 1)
    return (sliding_window, sliding_window)


@functools.lru_cache(maxsize=None)
def window_is_inclusive() -> bool:
    """True when the installed release gives flash-attn (w - 1, w - 1) for sliding_window w (read once: the
    metadata lookup is too slow for the per-layer hot path)."""
    version = version_gates.installed_transformers_version()
    return version is None or version >= version_gates.TRANSFORMERS_SLIDING_WINDOW_INCLUSIVE


# -------------------------------------------------------------------------------------------- the step


def _step_for_call(call: Mapping[str, Any], q: torch.Tensor, ctx: RingContext,
                   q_shape: Optional[torch.Size] = None) -> StepState:
    """The step's layout: from ``shard_inputs`` (checked against the call), else derived once per step.
    ``q_shape``: ``q.shape`` when the caller has it already (the hot path reads it once)."""
    shape = q.shape if q_shape is None else q_shape
    batch, seq_local = shape[0], shape[1]
    step = ctx.step
    if step is not None:
        if step.batch_size != batch or step.seq_len_local != seq_local:
            if step.source != "shard_inputs":  # a step set from outside (hfpatch.dropin: update_*_params)
                raise UnsupportedArgument(
                    "query", q,
                    f"{step.source} described this step as batch {step.batch_size} x {step.seq_len_local} local "
                    f"tokens, but the model now runs on batch {batch} x {seq_local}.",
                    f"call {step.source}(...) with this batch's metadata before every forward.",
                )
            raise UnsupportedArgument(
                "query", q,
                f"shard_inputs prepared this step for batch {step.batch_size} x {step.seq_len_local} local tokens, "
                f"but the model now runs on batch {batch} x {seq_local}: the inputs are not the ones shard_inputs "
                f"returned.",
                "call patch.shard_inputs(...) for every batch and pass its input_ids and position_ids to the model.",
            )
        # From 4.48 every model reaches this function through transformers' attention integration, which hands
        # on the position_ids (or cu_seq_lens) the model passes; a call without them comes from a model that
        # drops them. Before 4.48 the flash path of most models takes none, and a shard_inputs step is computed
        # document by document as declared (docs/user-guide.md).
        if step.packed and step.source == "shard_inputs" and call.get("position_ids") is None \
                and call.get("cu_seq_lens_q") is None and call.get("cu_seq_lens_k") is None \
                and integration_passes_positions():
            raise UnsupportedArgument(
                "position_ids", None,
                "shard_inputs found several documents in this packed row (position ids that restart), but this "
                "attention call carries neither position_ids nor cu_seq_lens: without CP the model's attention "
                "would run the row as one sequence (documents attending to each other) while the ring keeps them "
                "apart, so the results would differ.",
                "pass the position_ids returned by patch.shard_inputs(...) to the model; a model whose attention "
                "never receives them cannot train packed rows the same way under CP -- give it padded rows (one "
                "document per row, labels -100 on the padding) instead.",
            )
        _check_step_position_ids(call.get("position_ids"), step, ctx)
        _check_step_cu_seq_lens(call, step, ctx)
        return step
    return _derived_step(call, batch, seq_local, ctx)


@functools.lru_cache(maxsize=None)
def integration_passes_positions() -> bool:
    """The installed release routes every model's attention through its integration (4.48+), which hands on the
    position ids a model passes."""
    version = version_gates.installed_transformers_version()
    return version is None or version >= version_gates.TRANSFORMERS_ATTENTION_FUNCTIONS


def _check_step_position_ids(position_ids, step: StepState, ctx: RingContext) -> None:
    if position_ids is None or step.position_ids is None or position_ids is step.position_ids:
        return
    if not _cached(ctx, "step_position_ids", position_ids, _same_positions, step.position_ids):
        raise UnsupportedArgument(
            "position_ids", position_ids,
            "the model received position ids other than those shard_inputs returned for this step (the ring "
            "layout and document boundaries were computed from those).",
            "pass the position_ids returned by patch.shard_inputs(...) to the model, and call shard_inputs for "
            "every new batch.",
        )


def _check_step_cu_seq_lens(call: Mapping[str, Any], step: StepState, ctx: RingContext) -> None:
    cu = call.get("cu_seq_lens_q")
    if cu is None and call.get("cu_seq_lens_k") is None:
        return
    for role in ("cu_seq_lens_q", "cu_seq_lens_k"):
        value = call.get(role)
        if value is None or not _cached(ctx, "step_" + role, value, _same_cu, step.cu_seqlens):
            raise UnsupportedArgument(
                role, value,
                "these cu_seq_lens differ from the document boundaries shard_inputs computed for this step.",
                "do not pass cu_seq_lens_* to the model when using shard_inputs (it derives them from position_ids).",
            )


def _same_positions(p: torch.Tensor, expected: torch.Tensor) -> bool:
    if p.dim() != expected.dim() or p.shape[-1] != expected.shape[-1] or p.shape[0] not in (1, expected.shape[0]):
        return False
    return bool(torch.equal(p.expand_as(expected).to(expected.device), expected))


def _same_cu(t: torch.Tensor, expected: Optional[torch.Tensor]) -> bool:
    return expected is not None and torch.equal(t.to("cpu", torch.int64), expected.to("cpu", torch.int64))


def _derived_step(call: Mapping[str, Any], batch: int, seq_local: int, ctx: RingContext) -> StepState:
    """No ``shard_inputs``: the user split each row contiguously; packing comes from HF's own arguments."""
    get = call.get
    cu_q, cu_k = get("cu_seq_lens_q"), get("cu_seq_lens_k")
    if cu_q is not None or cu_k is not None:
        source = "cu_seq_lens"
        cu = _cached(ctx, "cu_seq_lens_q", cu_q if cu_q is not None else cu_k,
                     _global_cu_from_cu_seq_lens, cu_k, batch, seq_local, ctx)
    else:
        position_ids = get("position_ids")
        cu = None
        if position_ids is not None and batch == 1 and seq_local > 1:
            cu = _cached(ctx, "position_ids", position_ids, global_cu_from_position_ids, seq_local, ctx)
        source = "shape" if cu is None else "position_ids"
    # The same StepState object for every layer of the step (its identity keys the plans). It holds its ``cu``
    # alive, so ``is`` tells the step's own boundaries from a new step's.
    state = ctx._derived.get(source)
    if state is None or state.cu_seqlens is not cu or state.seq_len_local != seq_local or state.batch_size != batch:
        packed = cu is not None
        kernel, layout = plan_step(ctx.variant, packed=packed, source=source)
        state = ctx._derived[source] = StepState(
            kernel=kernel, layout=layout, packed=packed, batch_size=batch, seq_len_global=seq_local * ctx.world_size,
            seq_len_local=seq_local, cu_seqlens=cu, source=source)
    return state


def global_cu_from_position_ids(position_ids: torch.Tensor, seq_local: int, ctx: RingContext):
    """All-gather this row's positions (contiguous split) and apply HF's packing rule to the whole row.

    Returns the GLOBAL int32 cu_seqlens, or None when the row is one sequence. One collective, once per step.
    """
    local = position_ids.reshape(-1)
    if local.numel() != seq_local:
        raise UnsupportedArgument(
            "position_ids", position_ids, f"expected {seq_local} positions (one row of the local shard)."
        )
    parts = [torch.empty_like(local) for _ in range(ctx.world_size)]
    dist.all_gather(parts, local.contiguous(), group=ctx.group)
    return packed_cu_seqlens(torch.cat(parts), argument="position_ids")


def packed_cu_seqlens(positions: torch.Tensor, *, argument: str = "position_ids") -> Optional[torch.Tensor]:
    """HF's rule on one whole row of positions (S,): None if they are ``arange(S) + min`` (one sequence), else the
    int32 cu_seqlens (num_docs + 1,) with a document starting wherever the position equals the minimum."""
    low = positions.min()
    if bool((positions == torch.arange(positions.numel(), device=positions.device) + low).all()):
        return None
    starts = (positions == low).nonzero().flatten()
    if starts.numel() == 0 or int(starts[0]) != 0:
        raise UnsupportedArgument(
            argument, positions,
            "packed position ids must start every document, including the first token, at the same minimum "
            f"position (found {int(positions[0])} at token 0, minimum {int(low)}).",
            "give each document positions 0, 1, ..., len-1 (HF's DataCollatorWithFlattening does).",
        )
    total = torch.tensor([positions.numel()], device=starts.device)
    return torch.cat([starts, total]).to(torch.int32)


def _global_cu_from_cu_seq_lens(cu_q: torch.Tensor, cu_k: Optional[torch.Tensor], batch: int, seq_local: int,
                                ctx: RingContext) -> torch.Tensor:
    """Accept cu_seq_lens of the GLOBAL packed row (no collective); local ones are ambiguous and refused."""
    if cu_k is not None and not torch.equal(cu_q.to("cpu"), cu_k.to("cpu")):
        raise UnsupportedArgument(
            "cu_seq_lens_k", cu_k, "query and key documents differ (cross-attention), which ring attention cannot do."
        )
    if batch != 1:
        raise UnsupportedArgument(
            "cu_seq_lens_q", cu_q, f"packed sequences must be one row (batch 1), got batch {batch}.",
            "flatten the documents into one row.",
        )
    total = int(cu_q[-1])
    seq_global = seq_local * ctx.world_size
    if total == seq_global:
        return cu_q.to(torch.int32)
    raise UnsupportedArgument(
        "cu_seq_lens_q", cu_q,
        f"cu_seq_lens_q[-1] = {total}, but under CP they must describe the GLOBAL packed row of {seq_global} tokens "
        f"({ctx.world_size} ranks x {seq_local}); cumulative lengths of this rank's slice cannot say which "
        f"documents continue from the previous rank.",
        "pass the cu_seq_lens of the whole packed row (identical on every rank), or position_ids only, or use "
        "patch.shard_inputs(...).",
    )


# ---------------------------------------------------------------------------------------- ring attention


def _kernel(name: str) -> Callable:
    fn = getattr(ring_kernels, name, None)
    if fn is None:
        raise RuntimeError(f"ring_kernels.{name} is not available in this installation of ring_kernels")
    return fn


_BATCH_KERNELS = {"zigzag": "zigzag_ring_attn_func", "stripe": "stripe_attn_func", "ring": "ring_attn_func",
                  "llama3": "ring_attn_func"}
_VARLEN_KERNELS = {"zigzag": "zigzag_ring_attn_varlen_func", "ring": "ring_attn_varlen_func",
                   "llama3": "llama3_attn_varlen_func"}
# (head-parallel kernel, packed) -> the ring_kernels function.
_HEAD_KERNELS = {("ulysses", False): "ulysses_attn_func", ("ulysses", True): "ulysses_attn_varlen_func",
                 ("usp", False): "usp_attn_func", ("usp", True): "usp_attn_varlen_func"}
# The ring variant USP runs across its Ulysses groups, by the step's (layout, packed): the choice of the ring
# variants themselves (zigzag on shard_inputs' zigzag batches, the contiguous ring on batches the user split,
# llama3 on packed rows; a pinned zigzag layout keeps the zigzag ring). A stripe over N is none over R.
_USP_RING = {("zigzag", False): "zigzag", ("contiguous", False): "ring", ("contiguous", True): "llama3",
             ("zigzag", True): "zigzag"}


# ring_kernels' namespace: a plan looks its kernel up here per call (a dict subscript), so a replaced
# ``ring_kernels.<name>`` (setattr writes this very dict) takes effect on the next call.
_KERNELS = vars(ring_kernels)
# The kernels' once-per-step cross-rank check is scoped by ring_kernels' public context variable RANK_CHECKED, set and
# reset around each kernel call (``rank_check_scope`` does the same through a context-manager object).
_RANK_CHECKED = ring_kernels.RANK_CHECKED


class RingPlan:
    """What a ring call runs: the ring_kernels function (by name: looked up per call, so a replaced
    ``ring_kernels`` attribute takes effect) and its keyword arguments, for one step and one configuration
    (causal, softmax_scale, sliding_window, softcap). Built by ``ring_plan``; ``run`` is the only place hfpatch
    calls a ring kernel.

    step:        the StepState it was built for.
    kernel:      the ring_kernels function name; ``kwargs``: its keyword arguments (the kernel gets its own copy).
    packed:      the step is one packed row: the kernel also takes the step's GLOBAL int32 ``cu_seqlens``
                 (``StepState.cu_seqlens_on``: one copy per step and device).
    inputs:      what its caller built it for (``ring_plan(..., inputs=)``), compared with a later call's to reuse
                 it (``hfpatch.attention.dispatch``); None: not to be reused.
    """

    __slots__ = ("step", "kernel", "kwargs", "packed", "cu_by_device", "rank_checked", "inputs")

    def __init__(self, step: StepState, kernel: str, kwargs: dict, packed: bool, inputs: Optional[tuple] = None
                 ) -> None:
        self.step = step
        self.kernel = kernel
        self.kwargs = kwargs
        self.packed = packed
        self.cu_by_device = step.cu_by_device
        self.rank_checked = step.rank_checked
        self.inputs = inputs

    def __repr__(self) -> str:
        return f"<RingPlan {self.kernel} {self.step.layout} packed={self.packed}>"

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sink: Optional[torch.Tensor] = None
            ) -> torch.Tensor:
        """The kernel on this rank's q (B, S_local, H, D), k/v (B, S_local, Hk, D) -> (B, S_local, H, D), inside the
        step's rank-check scope (the kernels' cross-rank shape check runs once per step and shape, not per layer).
        A packed row (1, T, H, D) goes to the varlen kernel as is and comes back as (1, T, H, D). ``sink``: the
        attention sinks (H,) (``sink_of``) or None."""
        kernel = _KERNELS[self.kernel]
        token = _RANK_CHECKED.set(self.rank_checked)
        try:
            if self.packed:
                cu = self.cu_by_device.get(q.device)
                if cu is None:
                    cu = self.step.cu_seqlens_on(q.device)
                if sink is None:
                    return kernel(q, k, v, cu, **self.kwargs)
                return kernel(q, k, v, cu, sink=sink, **self.kwargs)
            if sink is None:  # (an extra keyword would make the call merge it into a copy of kwargs)
                return kernel(q, k, v, **self.kwargs)
            return kernel(q, k, v, sink=sink, **self.kwargs)
        except (RingInputError, UnknownBackendError, UnsupportedBackendError) as exc:
            raise _kernel_refusal(exc, self.kernel, self.kwargs.get("backend"), q) from exc
        finally:
            _RANK_CHECKED.reset(token)


def _kernel_refusal(exc: ValueError, kernel: str, backend: Optional[str], q: torch.Tensor) -> UnsupportedArgument:
    """What a kernel refused, as hfpatch's refusal: the kernel's argument (a backend's refusal: the kernel's
    ``:backend``) and its message."""
    if isinstance(exc, RingInputError):
        return UnsupportedArgument(
            exc.argument or "query", exc.value if exc.argument else tuple(q.shape),
            f"ring_kernels.{kernel} refused this call: {exc}",
            "pin another kernel (hfpatch.apply(kernel=...)), or change what the message names.")
    return UnsupportedArgument(
        "kernel", backend, f"the block backend of ring_kernels.{kernel} cannot compute this call: {exc}",
        "leave the backend to the kernel (kernel='<variant>' or '<variant>:auto' picks one that can).")


def _build_plan(step: StepState, causal: Any, scale: Any, window: Any, softcap: Any, ctx: RingContext,
                inputs: Optional[tuple], nheads: int, kv_heads: int, head_dim: int) -> RingPlan:
    kwargs = dict(
        group=ctx.group,
        causal=bool(causal),
        softmax_scale=None if scale is None else float(scale),
        backend=ctx.backend,
        window_size=window_size_of(window, step.seq_len_global),
        softcap=float(softcap or 0.0),
    )
    heads = ctx.heads
    if ctx.variant == _AUTO:
        step, picked = auto_kernel(step, kwargs["causal"], kwargs["window_size"], nheads, kv_heads, head_dim, ctx)
        heads = picked or heads
    if step.kernel in HEAD_KERNELS:
        return _head_plan(step, kwargs, ctx, inputs, nheads, heads)
    if step.packed:
        if step.kernel == "llama3":
            kwargs["heads_k_stride"] = ctx.heads_k_stride
        name = _VARLEN_KERNELS[step.kernel]
        _kernel(name)  # fails now, with the name, if this ring_kernels lacks it
        return RingPlan(step, name, kwargs, True, inputs)
    kernel = step.kernel
    if not kwargs["causal"] and kwargs["window_size"] == (-1, -1):
        # Full attention does not depend on where the keys sit, so the contiguous ring computes it for any layout
        # (zigzag and stripe are causal-only kernels).
        kernel = "ring"
    name = _BATCH_KERNELS[kernel]
    _kernel(name)
    return RingPlan(step, name, kwargs, False, inputs)


def _head_plan(step: StepState, kwargs: dict, ctx: RingContext, inputs: Optional[tuple], nheads: int,
               heads: Optional[HeadSplit]) -> RingPlan:
    """The plan of a head-parallel step on ``heads`` (the context's, or auto's pick): Ulysses on the step's
    layout, or USP with the ring variant of ``_USP_RING`` across its Ulysses groups; every refusal by name first."""
    if heads is None:
        raise RuntimeError(f"this step runs the {step.kernel!r} kernel but the RingContext has no HeadSplit (variant "
                           f"{ctx.variant!r}); make the context with RingContext.for_group(group, kernel=...)")
    if nheads % heads.ulysses:
        _refuse_heads(nheads, ctx, heads.ulysses)
    if step.kernel == "ulysses":
        kwargs["layout"] = step.layout
    else:
        ring_variant = _USP_RING.get((step.layout, step.packed))
        if ring_variant is None:
            raise UnsupportedArgument(
                "layout", step.layout,
                f"kernel {ctx.variant!r} cannot run on this step's {step.layout!r} layout: USP gathers the pieces of "
                f"{heads.ulysses} consecutive ranks, and a stripe over the {ctx.world_size} ranks is no stripe over "
                f"the {heads.ring} ring ranks.",
                "let shard_inputs split the inputs (zigzag), split them contiguously, or use kernel='ulysses'.")
        if not step.packed and not kwargs["causal"] and kwargs["window_size"] == (-1, -1):
            # Full attention does not depend on where the keys sit: the contiguous ring computes it on any layout's
            # gathered pieces, as it does for the ring variants (the zigzag ring is causal-only).
            ring_variant = "ring"
        if ring_variant == "zigzag" and not kwargs["causal"]:
            raise UnsupportedArgument(
                "is_causal", False,
                f"kernel {ctx.variant!r} runs the zigzag ring across its Ulysses groups on this step's zigzag layout, "
                f"and the zigzag ring computes causal attention only; this call is non-causal with a sliding window "
                f"{kwargs['window_size']}.",
                "kernel='ulysses' (every mask on every layout), or split the inputs contiguously yourself (then the "
                "contiguous ring runs across the Ulysses groups).")
        kwargs.update(ulysses_group=heads.ulysses_group, ring_group=heads.ring_group, ring_variant=ring_variant)
    name = _HEAD_KERNELS[step.kernel, step.packed]
    _kernel(name)
    return RingPlan(step, name, kwargs, step.packed, inputs)


def _refuse_heads(nheads: int, ctx: RingContext, degree: int) -> None:
    world = ctx.world_size
    usable = [g for g in _grids(world) if nheads % usp_degrees(g)[0] == 0]
    raise UnsupportedArgument(
        "query", f"{nheads} heads",
        f"{nheads} query heads do not divide by the Ulysses degree {degree}: kernel {ctx.variant!r} gives each of "
        f"the {degree} ranks of a Ulysses group {nheads} / {degree} of the heads.",
        (f"kernel={usable[0]!r} (Ulysses groups whose size divides {nheads}: {', '.join(usable)}), or " if usable
         else "") + "a ring variant (kernel='auto'), which splits only the sequence.")


def ring_plan(call: Mapping[str, Any], extra: Mapping[str, Any], ctx: RingContext, *,
              inputs: Optional[tuple] = None) -> RingPlan:
    """The plan that computes this call: every refusal runs (``UnsupportedArgument`` for what ring attention cannot
    honour), the step's layout comes from ``ctx.step`` or is derived once per step, and the kernel's arguments come
    from the call's configuration. ``call``: role -> value; ``extra``: the caller's other keywords; ``inputs``:
    kept as ``RingPlan.inputs`` (what a caller that reuses the plan compares later calls with; not read here).
    Nothing is cached here: a caller that reuses plans keeps them (``hfpatch.attention.dispatch``)."""
    q, k = call["query"], call["key"]
    get = call.get
    window, softcap = get("sliding_window"), get("softcap")
    q_shape = q.shape
    _refuse(call, extra or _EMPTY, q_shape, k, ctx, window, softcap)
    step = _step_for_call(call, q, ctx, q_shape)
    return _build_plan(step, get("is_causal", True), get("softmax_scale"), window, softcap, ctx, inputs, q_shape[2],
                       k.shape[2], q_shape[3])


def ring_attention(call: Mapping[str, Any], extra: Mapping[str, Any], ctx: RingContext) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence, by ring attention over ``ctx.group``.

    ``call``: role -> value (``query`` (B, S_local, H, D), ``key``/``value`` (B, S_local, Hk, D), ...);
    ``extra``: the caller's other keyword arguments. Returns (B, S_local, H, D) in the query's dtype.
    ``ring_plan(call, extra, ctx).run(q, k, v, sink)`` on q, k, v cast as HF casts them (``cast_to_target``): no
    collective outside the kernels' own, no Python loop over tokens; every refusal runs on every call.
    """
    q, k, v = cast_to_target(call.get("target_dtype"), call["query"], call["key"], call["value"])
    sink = sink_of(extra, q)
    return ring_plan(call, extra, ctx).run(q, k, v, sink)



# ------------------------------------------------------------------------------------ reference attention


def reference_attention(call: Mapping[str, Any], extra: Mapping[str, Any], ctx: RingContext) -> torch.Tensor:
    """The same semantics as ``ring_attention`` without the ring: all-gather q/k/v, run plain (non-CP) attention
    on the whole sequence, return this rank's slice (B, S_local, H, D). Differentiable (the gather's backward sums
    the gradients over the ranks). For A/B checks; it holds the whole sequence on every rank.
    """
    q, k, v = cast_to_target(call.get("target_dtype"), call["query"], call["key"], call["value"])
    extra = extra or {}
    _refuse_unsupported(call, extra, q, k, ctx)
    sink = sink_of(extra, q)
    step = _step_for_call(call, q, ctx)
    causal = bool(call.get("is_causal", True))
    window = window_size_of(call.get("sliding_window"), step.seq_len_global)
    if step.packed:
        cu = step.cu_seqlens.to(q.device)
        gathered = [unshard(t[0], ctx.group, layout=step.layout, dim=0, cu_seqlens=cu).unsqueeze(0) for t in (q, k, v)]
    else:
        cu = None
        gathered = [unshard(t, ctx.group, layout=step.layout, dim=1) for t in (q, k, v)]
    out = _original_on_whole(call, extra, ctx, gathered, cu)
    if out is None:
        out = plain_attention(*gathered, causal=causal, softmax_scale=call.get("softmax_scale"), window_size=window,
                              softcap=float(call.get("softcap") or 0.0), cu_seqlens=cu, sink=sink)
    if step.packed:
        return shard(out[0], ctx.group, layout=step.layout, dim=0, cu_seqlens=cu).unsqueeze(0)
    return shard(out, ctx.group, layout=step.layout, dim=1)


def local_attention(call: Mapping[str, Any], extra: Mapping[str, Any], ctx: RingContext) -> torch.Tensor:
    """Non-CP attention of exactly the tensors given (switch mode ``"local"``): what transformers' flash path
    computes for them as a whole sequence, with the same refusals as the ring. q (B, S, H, D), k/v (B, S, Hk, D)
    -> (B, S, H, D). A packed row (B = 1) is told by HF's own ``cu_seq_lens_q`` or by ``position_ids`` that restart
    (HF's rule); its documents are independent. No collective."""
    q, k, v = cast_to_target(call.get("target_dtype"), call["query"], call["key"], call["value"])
    extra = extra or {}
    _refuse_unsupported(call, extra, q, k, ctx)
    sink = sink_of(extra, q)
    cu = call.get("cu_seq_lens_q")
    position_ids = call.get("position_ids")
    if cu is None and position_ids is not None and q.shape[0] == 1 and q.shape[1] > 1:
        cu = packed_cu_seqlens(position_ids.reshape(-1).to(q.device))
    out = _original_on_whole(call, extra, ctx, (q, k, v), cu)
    if out is None:
        out = plain_attention(q, k, v, causal=bool(call.get("is_causal", True)),
                              softmax_scale=call.get("softmax_scale"),
                              window_size=window_size_of(call.get("sliding_window"), q.shape[1]),
                              softcap=float(call.get("softcap") or 0.0), cu_seqlens=cu, sink=sink)
    return out.contiguous()  # as flash-attn returns it: some models .view() the output


# transformers' availability check of the flash-attn package an ``attn_implementation`` loads (None: flash-attn 2,
# what ``apply(model=)`` switches a model to, or 3; each check exists from the release that introduced the package).
_FLASH_CHECKS = {None: ("is_flash_attn_2_available", "is_flash_attn_3_available"),
                 "flash_attention_2": ("is_flash_attn_2_available",),
                 "flash_attention_3": ("is_flash_attn_3_available",),
                 "flash_attention_4": ("is_flash_attn_4_available",)}
_PAGED_PREFIX = "paged|"  # continuous batching's names of the same implementations (5.x)


@functools.lru_cache(maxsize=None)
def flash_path_runs(implementation: Optional[str] = None) -> bool:
    """Whether transformers' original ``_flash_attention_forward`` can load its kernel for a call whose
    ``attn_implementation`` is ``implementation``: transformers' own check of the flash-attn package that
    implementation imports (installed, a supported version, a device it runs on); a hub kernel (``"org/name"``)
    was loaded when the model was set to it. Without it the original raises transformers' ImportError at its first
    line. Read once per process per implementation (``cache_clear()`` reads again); a call on CPU tensors still
    cannot run flash-attn (the caller checks the device)."""
    name = implementation[len(_PAGED_PREFIX):] if isinstance(implementation, str) and implementation.startswith(
        _PAGED_PREFIX) else implementation
    if isinstance(name, str) and "/" in name:
        return True
    import transformers.utils as hf_utils  # not at the top: importing hfpatch must not load transformers

    checks = [getattr(hf_utils, check, None) for check in _FLASH_CHECKS.get(name, ())]
    return any(check is not None and bool(check()) for check in checks)


def _original_on_whole(call, extra, ctx: RingContext, gathered, cu) -> Optional[torch.Tensor]:
    """Run transformers' original function on the gathered sequence when its flash path can (``flash_path_runs``,
    CUDA, half precision); None otherwise (the caller then computes the same semantics in plain math)."""
    q = gathered[0]
    if ctx.call_original is None or not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16):
        return None
    if cu is not None and "cu_seq_lens_q" not in call:
        return None  # a release (< 4.47) whose function cannot be told the documents: plain math honours them
    if not flash_path_runs(call.get("implementation")):
        return None
    whole = dict(call)
    whole.update(query=gathered[0], key=gathered[1], value=gathered[2], query_length=q.shape[1], attention_mask=None)
    if "position_ids" in whole:
        whole["position_ids"] = None
    if cu is not None:
        max_len = int((cu[1:] - cu[:-1]).max())
        whole.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max_len, max_length_k=max_len)
    return ctx.call_original(whole, dict(extra))
