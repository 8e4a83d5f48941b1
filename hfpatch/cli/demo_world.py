"""The demo's world: N spawned CPU processes joined by gloo train a tiny model with context parallelism
(``hfpatch.apply``) and without (the same model, eager attention on the whole sequence), and rank 0 compares the
losses and gradients of every step. ``hfpatch.cli.demo`` checks the arguments and calls ``run_demo``.

``run_demo`` returns the exit status: 0 when CP matched non-CP at every step (or, with a world of one, when CP
did not run and the output says so), 1 on a mismatch or when a rank fails.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

import hfpatch
from hfpatch.cli.demo_models import build_model, eager_reference_overrides
from hfpatch.inputs import shift_labels, token_loss_sum
from ring_kernels.world import DistributedFailure, run_world

__all__ = ["run_demo", "report", "DemoOptions", "StepResult", "LOSS_RTOL", "GRAD_RTOL", "BATCH"]

# fp32: the ring merges blocks through an fp32 log-sum-exp and sums gradients over ranks in another order, so CP
# and non-CP differ by rounding only (~1e-7 relative); a semantic error is >= 1e-3.
LOSS_RTOL = 1e-5
GRAD_RTOL = 2e-5
BATCH = 2
_LR = 0.1


@dataclass
class StepResult:
    """One step as rank 0 saw it: both losses, and the largest gradient difference against the largest gradient."""

    step: int
    loss_reference: float
    loss_cp: float
    grad_max_diff: float      # max over parameters of max |g_cp - g|
    grad_scale: float         # max over parameters of max |g|

    def agrees(self) -> bool:
        return (abs(self.loss_cp - self.loss_reference) <= LOSS_RTOL * abs(self.loss_reference)
                and self.grad_max_diff <= GRAD_RTOL * self.grad_scale)


@dataclass(frozen=True)
class DemoOptions:
    """What the demo runs, already checked by ``hfpatch.cli.demo``: the tiny ``model`` family, ``world_size``
    processes, ``steps`` SGD steps over rows of ``seq_len`` tokens (one row of packed documents when ``packed``,
    each document a multiple of ``document_unit`` tokens), ring ``kernel`` as for ``hfpatch.apply(kernel=)``."""

    model: str = "llama"
    world_size: int = 2
    steps: int = 1
    seq_len: int = 64
    kernel: str = "auto"
    packed: bool = False
    document_unit: int = 1


def run_demo(options: DemoOptions) -> int:
    """Spawn the ranks, collect rank 0's results, print them; the exit status."""
    rows = "1 packed row" if options.packed else f"batch {BATCH}"
    processes = f"{options.world_size} CPU process{'es' if options.world_size > 1 else ''}"
    print(f"hfpatch demo: tiny {options.model} (2 layers, hidden 64, 4 heads / 2 KV heads), {processes} (gloo), "
          f"kernel {options.kernel!r}, {rows} x {options.seq_len} tokens, {options.steps} step(s)", flush=True)
    start = time.time()
    try:
        ranks = run_world(options.world_size, _rank_main, options, timeout=None)
    except DistributedFailure as exc:
        print(exc)
        print("FAILED: a rank did not finish (see above)")
        return 1
    steps, inactive_reason = ranks[0]
    return report(steps, time.time() - start, inactive_reason=inactive_reason)


def report(steps: list, seconds: float, *, inactive_reason: str | None = None) -> int:
    """Print every step and the verdict; the exit status. ``inactive_reason``: why the patch was inactive (CP did
    not run, so there was nothing to compare: status 0 with a warning), or None."""
    for s in steps:
        print(f"step {s.step}: loss non-CP {s.loss_reference:.8f}   CP {s.loss_cp:.8f}   "
              f"|diff| {abs(s.loss_cp - s.loss_reference):.2e}   max grad diff {s.grad_max_diff:.2e} "
              f"(largest gradient {s.grad_scale:.2e})")
    if inactive_reason is not None:
        print(f"WARNING: CP did not run ({inactive_reason}): hfpatch.apply was inactive, so both sides trained "
              f"without context parallelism and this run says nothing about CP. Fix: --world-size 2 or more.")
        return 0
    ok = all(s.agrees() for s in steps)
    verdict = "OK: CP matches non-CP" if ok else "MISMATCH: CP differs from non-CP"
    print(f"{verdict} (tolerance: loss rtol {LOSS_RTOL:g}, gradients {GRAD_RTOL:g} x largest gradient) "
          f"in {seconds:.1f} s")
    return 0 if ok else 1


# --------------------------------------------------------------------------------------------- a rank


def _rank_main(rank: int, world_size: int, options: DemoOptions) -> tuple[list, str | None]:
    """One rank of the demo's world: ``_train``'s steps and the patch's inactive reason."""
    return _train(rank, options)


def _inputs(options: DemoOptions, step: int):
    """(input_ids (B, S), position_ids or None, document lengths or None), the same on every rank."""
    g = torch.Generator().manual_seed(1000 + step)
    seq, unit = options.seq_len, options.document_unit
    if not options.packed:
        return torch.randint(0, 128, (BATCH, seq), generator=g), None, None
    docs, left = [], seq
    while left > 0:  # documents of 1..seq/2 tokens, in multiples of `unit` (seq is one)
        n = unit * min(left // unit, int(torch.randint(1, max(2, seq // unit // 2), (1,), generator=g)))
        docs.append(n)
        left -= n
    positions = torch.cat([torch.arange(n) for n in docs]).unsqueeze(0)
    return torch.randint(0, 128, (1, seq), generator=g), positions, docs


def _reference_step(model, ids, docs):
    """Non-CP: the whole sequence (packed: each document on its own), HF's shifted-label mean loss."""
    if docs is None:
        logits = model(input_ids=ids, use_cache=False).logits
    else:
        bounds = torch.tensor([0] + docs).cumsum(0).tolist()
        logits = torch.cat([model(input_ids=ids[:, a:b], position_ids=torch.arange(b - a)[None], use_cache=False)
                            .logits for a, b in zip(bounds[:-1], bounds[1:])], dim=1)
    loss_sum, count = token_loss_sum(logits, shift_labels(ids))
    loss = loss_sum / count
    loss.backward()
    return loss.item()


def _cp_step(patch, model, ids, positions):
    batch = patch.shard_inputs(ids, labels=ids, position_ids=positions)
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    loss_sum, count = token_loss_sum(logits, batch["labels"])
    loss = patch.reduce_loss(loss_sum, count)
    loss.backward()
    return loss.item()


def _train(rank: int, options: DemoOptions) -> tuple[list, str | None]:
    """Rank 0's ``StepResult`` of every step (empty elsewhere), and why the patch was inactive (None if active)."""
    # Only rank 0 compares. The reference is eager attention with the semantics of the installed release's flash
    # path (the path the ring replaces; see eager_reference_overrides).
    name = options.model
    reference = build_model(name, **eager_reference_overrides(name)) if rank == 0 else None
    model = build_model(name)
    results = []
    with hfpatch.apply(dist.group.WORLD, kernel=options.kernel, model=model) as patch:
        inactive_reason = None if patch.active else patch.reason
        for step in range(1, options.steps + 1):
            ids, positions, docs = _inputs(options, step)
            loss_cp = _cp_step(patch, model, ids, positions)
            for p in model.parameters():   # each rank holds its share of the gradient: sum them
                dist.all_reduce(p.grad)
            if rank == 0:
                loss_ref = _reference_step(reference, ids, docs)
                diff = max((a.grad - b.grad).abs().max().item()
                           for a, b in zip(model.parameters(), reference.parameters()))
                scale = max(b.grad.abs().max().item() for b in reference.parameters())
                results.append(StepResult(step, loss_ref, loss_cp, diff, scale))
            with torch.no_grad():
                for m in (model, reference) if rank == 0 else (model,):
                    for p in m.parameters():
                        p -= _LR * p.grad
                        p.grad = None
    return results, inactive_reason
