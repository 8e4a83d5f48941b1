"""Checks run by ``apply`` after installing: identity at every site, and a numeric probe over the group.

- ``identity``: every planned site (and every module adopted by the import hook) holds the exact wrapper object,
  every attention-interface route reaches it, and the import hook is on ``sys.meta_path``. By identity, never
  by comparing names or source text.
- ``numeric``: small tensors, identical on every rank, are split in the step's layout (``inputs.shard_inputs``),
  run through the installed wrapper in ring mode, and compared with plain softmax attention computed on the
  whole sequence; causal and non-causal, with grouped-query heads. The largest error is max-reduced over the
  group, so every rank reaches the same verdict (one rank raising while the others carry on would hang the
  next collective).

Both raise ``VerificationError``; ``apply`` then removes everything it installed.
"""
from __future__ import annotations

import math
import sys
from typing import Any, Callable

import torch
import torch.distributed as dist

from hfpatch import inputs, modes
from hfpatch.attention.patcher import Installation
from hfpatch.errors import VerificationError
from ring_kernels.backends.reference import plain_attention

__all__ = ["identity", "numeric", "group_max", "PROBE_TOLERANCE"]

# Largest absolute error allowed per probe dtype. fp32 (CPU): the ring merges blocks in fp32 via log-sum-exp,
# so it differs from one softmax by rounding only. bf16 (CUDA, where the fast block backends are half-precision
# only): the kernels round P and the output to bf16 (eps 2**-8 ~ 3.9e-3) on outputs of magnitude < 1; a wrong
# mask or a missing block is off by ~0.1 or more.
PROBE_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
_PROBE_SHAPE = dict(batch=2, heads=4, kv_heads=2, head_dim=8, tokens_per_rank=8)


def identity(installation: Installation) -> None:
    """Raise ``VerificationError`` unless every site and interface route holds ``installation.wrapper``."""
    wrapper = installation.wrapper
    wrong = [f"{s.label} holds {s.current()!r}" for s in installation.sites if s.current() is not wrapper]
    wrong += [f"{r.label} reaches {r.reaches()!r}" for r in installation.routes if r.reaches() is not wrapper]
    if installation.hook is not None and installation.hook not in sys.meta_path:
        wrong.append("the import hook is not on sys.meta_path")
    if wrong:
        raise VerificationError(
            "after install, these do not hold the hfpatch wrapper: " + "; ".join(wrong)
            + ". Something rebound them during apply; nothing is left installed. Fix: apply again, and make sure "
            "no other patcher (e.g. ring-flash-attn's adapter) runs at the same time."
        )


def _probe_device(group) -> torch.device:
    backend = dist.get_backend(group)
    if "nccl" in str(backend).lower() and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _probe_call(names: dict, q, k, v, causal: bool, position_ids) -> dict:
    """Keyword arguments for the wrapper, by the live parameter names of each role."""
    kwargs = {names["query"]: q, names["key"]: k, names["value"]: v, names["attention_mask"]: None,
              names["query_length"]: q.shape[1], names["is_causal"]: causal}
    if "position_ids" in names:
        kwargs[names["position_ids"]] = position_ids
    return kwargs


def numeric(wrapper: Callable, match: Any, ctx: Any, *, tolerance: float | None = None) -> float:
    """Run the probe through ``wrapper`` (ring mode, this thread only); returns the group's largest error.

    fp32 on CPU groups; bf16 on CUDA (NCCL) groups, the training dtype, which every CUDA block backend computes.
    ``tolerance``: the largest absolute error allowed (default: ``PROBE_TOLERANCE`` of the probe dtype).

    Collective: every rank of ``ctx.group`` must call it (the ring exchanges blocks between ranks, so a rank
    that skipped it would leave the others waiting). Raises ``VerificationError`` (on every rank) when the error
    exceeds ``tolerance`` or the wrapper raised on any rank.
    """
    names = {role: name for name, role in match.roles.items()}
    # a head-parallel kernel splits the heads over its Ulysses degree: as many heads as divide by it
    shape = dict(_PROBE_SHAPE, heads=math.lcm(_PROBE_SHAPE["heads"], ctx.ulysses_degree))
    seq = shape["tokens_per_rank"] * ctx.world_size
    device = _probe_device(ctx.group)
    generator = torch.Generator().manual_seed(20240611)  # same tensors on every rank, whatever the global seed
    q = torch.randn(shape["batch"], seq, shape["heads"], shape["head_dim"], generator=generator)
    k, v = (torch.randn(shape["batch"], seq, shape["kv_heads"], shape["head_dim"], generator=generator)
            for _ in range(2))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tolerance = PROBE_TOLERANCE[dtype] if tolerance is None else tolerance
    q, k, v = (t.to(device=device, dtype=dtype) for t in (q, k, v))
    worst = 0.0
    failure = ""
    previous_step = ctx.step
    try:
        with modes.switch("ring"):
            for causal in (True, False):
                batch = inputs.shard_inputs(ctx, torch.zeros(shape["batch"], seq, dtype=torch.long, device=device))
                index = batch["position_ids"][0].to(device)  # global positions this rank holds, in order
                out = wrapper(**_probe_call(names, q[:, index], k[:, index], v[:, index], causal,
                                            batch["position_ids"]))
                expected = plain_attention(q.float(), k.float(), v.float(), causal=causal)[:, index]
                worst = max(worst, (out.float() - expected).abs().max().item())
    except Exception as exc:  # reported on every rank below, so that no rank is left waiting
        failure = f"{type(exc).__name__}: {exc}"
        worst = math.inf
    finally:
        ctx.set_step(previous_step)
    worst = _group_max(worst, ctx.group, device)
    if failure or not worst <= tolerance:
        if failure:
            where = f"on this rank: {failure}"
        elif worst == math.inf:
            where = "it failed on another rank of the group; see that rank's error"
        else:
            where = f"largest error {worst:.3g} > tolerance {tolerance:g}"
        raise VerificationError(
            f"numeric probe through the installed wrapper failed ({where}; world size {ctx.world_size}, "
            f"kernel {ctx.variant}:{ctx.backend}). Nothing is left installed. Fix: pin another kernel "
            "(apply(kernel='zigzag:reference')) to locate the fault, or pass verify=False to skip the probe."
        )
    return worst


def group_max(value: float, group) -> float:
    """The largest ``value`` over ``group`` (one all-reduce on the group's device): how apply's ranks agree."""
    return _group_max(value, group, _probe_device(group))


def _group_max(value: float, group, device: torch.device) -> float:
    """The largest ``value`` over the group (inf stays inf: a failure on one rank fails all)."""
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return float(tensor.item())
