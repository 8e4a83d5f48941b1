"""The step a call belongs to: how the whole sequence is split over the group, and where its documents start.

``shard_inputs`` (``hfpatch.inputs``) sets the step on the context; each call is checked against it (its shape, its
position ids, its ``cu_seq_lens``). Without it the user split each row contiguously, and the step is derived from
HF's own arguments once per step (one all-gather of the position ids, cached on the tensor HF passes to every
layer). The rule for "packed" is HF's own (``_is_packed_sequence``: batch 1 and positions that are not
``arange + min``; documents start where the position equals the minimum).
"""
from __future__ import annotations

import functools
from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist

from hfpatch import version_gates
from hfpatch.attention.context import RingContext, StepState
from hfpatch.attention.kernel_choice import plan_step
from hfpatch.errors import UnsupportedArgument

__all__ = ["step_for_call", "packed_cu_seqlens", "global_cu_from_position_ids", "integration_passes_positions"]


def step_for_call(call: Mapping[str, Any], q: torch.Tensor, ctx: RingContext,
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
    if not ctx.cached("step_position_ids", position_ids, _same_positions, step.position_ids):
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
        if value is None or not ctx.cached("step_" + role, value, _same_cu, step.cu_seqlens):
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
        cu = ctx.cached("cu_seq_lens_q", cu_q if cu_q is not None else cu_k,
                     _global_cu_from_cu_seq_lens, cu_k, batch, seq_local, ctx)
    else:
        position_ids = get("position_ids")
        cu = None
        if position_ids is not None and batch == 1 and seq_local > 1:
            cu = ctx.cached("position_ids", position_ids, global_cu_from_position_ids, seq_local, ctx)
        source = "shape" if cu is None else "position_ids"
    # The same StepState object for every layer of the step (its identity keys the plans). It holds its ``cu``
    # alive, so ``is`` tells the step's own boundaries from a new step's.
    state = ctx.derived_steps.get(source)
    if state is None or state.cu_seqlens is not cu or state.seq_len_local != seq_local or state.batch_size != batch:
        packed = cu is not None
        kernel, layout = plan_step(ctx.variant, packed=packed, source=source)
        state = ctx.derived_steps[source] = StepState(
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
