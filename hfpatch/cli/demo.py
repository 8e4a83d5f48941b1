"""``hfpatch demo``: the main job in one command. A small Llama (or another tiny model) built from its config runs
on N CPU processes joined by gloo, with context parallelism (``hfpatch.apply``) and without (the same model with
eager attention on the whole sequence); both losses and the largest gradient difference are printed.
Exit status 0 when they agree within tolerance, 1 otherwise (or when a rank fails).
"""
from __future__ import annotations

import argparse
import os
import socket
import time
import traceback
from dataclasses import dataclass

import hfpatch
from hfpatch._models import MODEL_NAMES, build_model, eager_reference_overrides
from hfpatch.inputs import shift_labels, token_loss_sum

__all__ = ["add_parser", "run", "LOSS_RTOL", "GRAD_RTOL"]

# fp32: the ring merges blocks through an fp32 log-sum-exp and sums gradients over ranks in another order, so CP
# and non-CP differ by rounding only (~1e-7 relative); a semantic error is >= 1e-3.
LOSS_RTOL = 1e-5
GRAD_RTOL = 2e-5
_BATCH = 2
_LR = 0.1


@dataclass
class StepResult:
    step: int
    loss_reference: float
    loss_cp: float
    grad_max_diff: float      # max over parameters of max |g_cp - g|
    grad_scale: float         # max over parameters of max |g|

    def agrees(self) -> bool:
        return (abs(self.loss_cp - self.loss_reference) <= LOSS_RTOL * abs(self.loss_reference)
                and self.grad_max_diff <= GRAD_RTOL * self.grad_scale)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "demo", help="train a tiny HF model on N CPU processes with and without CP; compare loss and gradients",
        description=__doc__,
    )
    p.add_argument("--world-size", type=_positive_int, default=2, help="CPU processes in the CP group (default 2)")
    p.add_argument("--model", choices=MODEL_NAMES, default="llama", help="tiny model family (default llama)")
    p.add_argument("--steps", type=_positive_int, default=1, help="training steps (SGD), compared at each step")
    p.add_argument("--seq-len", type=_positive_int, default=64, help="tokens per row of the whole sequence")
    p.add_argument("--kernel", default="auto", help="ring variant[:backend], as hfpatch.apply(kernel=...)")
    p.add_argument("--packed", action="store_true", help="one row of packed documents instead of a batch")
    p.set_defaults(func=run)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args) -> int:
    """Spawn the ranks, collect rank 0's results, print them; the exit status."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    port = _free_port()
    options = dict(model=args.model, steps=args.steps, seq_len=args.seq_len, kernel=args.kernel, packed=args.packed)
    print(f"hfpatch demo: tiny {args.model} (2 layers, hidden 64, 4 heads / 2 KV heads), {args.world_size} CPU "
          f"processes (gloo), kernel {args.kernel!r}, "
          f"{'1 packed row' if args.packed else f'batch {_BATCH}'} x {args.seq_len} tokens, {args.steps} step(s)",
          flush=True)
    start = time.time()
    procs = [ctx.Process(target=_rank_main, args=(r, args.world_size, port, options, results))
             for r in range(args.world_size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    messages = []
    while not results.empty():
        messages.append(results.get())
    failures = [m for m in messages if m[0] == "error"]
    if failures or any(p.exitcode != 0 for p in procs):
        for _, rank, text in sorted(failures, key=lambda m: m[1]):
            print(f"--- rank {rank} failed ---\n{text}")
        print("FAILED: a rank did not finish (see above)")
        return 1
    steps = [m[1] for m in messages if m[0] == "result"][0]
    return _report(steps, time.time() - start)


def _report(steps: list, seconds: float) -> int:
    for s in steps:
        print(f"step {s.step}: loss non-CP {s.loss_reference:.8f}   CP {s.loss_cp:.8f}   "
              f"|diff| {abs(s.loss_cp - s.loss_reference):.2e}   max grad diff {s.grad_max_diff:.2e} "
              f"(largest gradient {s.grad_scale:.2e})")
    ok = all(s.agrees() for s in steps)
    verdict = "OK: CP matches non-CP" if ok else "MISMATCH: CP differs from non-CP"
    print(f"{verdict} (tolerance: loss rtol {LOSS_RTOL:g}, gradients {GRAD_RTOL:g} x largest gradient) "
          f"in {seconds:.1f} s")
    return 0 if ok else 1


# --------------------------------------------------------------------------------------------- a rank


def _rank_main(rank: int, world: int, port: int, options: dict, results) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        try:
            steps = _train(rank, options)
        finally:
            dist.destroy_process_group()
        if rank == 0:
            results.put(("result", steps))
    except BaseException:
        results.put(("error", rank, traceback.format_exc()))
        raise SystemExit(1)


def _inputs(options: dict, step: int):
    """(input_ids (B, S), position_ids or None, document lengths or None), the same on every rank."""
    import torch

    g = torch.Generator().manual_seed(1000 + step)
    seq = options["seq_len"]
    if not options["packed"]:
        return torch.randint(0, 128, (_BATCH, seq), generator=g), None, None
    docs, left = [], seq
    while left > 0:  # documents of 1..seq/2 tokens
        n = min(left, int(torch.randint(1, max(2, seq // 2), (1,), generator=g)))
        docs.append(n)
        left -= n
    positions = torch.cat([torch.arange(n) for n in docs]).unsqueeze(0)
    return torch.randint(0, 128, (1, seq), generator=g), positions, docs


def _reference_step(model, ids, docs):
    """Non-CP: the whole sequence (packed: each document on its own), HF's shifted-label mean loss."""
    import torch

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


def _train(rank: int, options: dict) -> list:
    import torch
    import torch.distributed as dist

    # Only rank 0 compares. The reference is eager attention with the semantics of the installed release's flash
    # path (the path the ring replaces; see eager_reference_overrides).
    name = options["model"]
    reference = build_model(name, **eager_reference_overrides(name)) if rank == 0 else None
    model = build_model(options["model"])
    results = []
    with hfpatch.apply(dist.group.WORLD, kernel=options["kernel"], model=model) as patch:
        for step in range(1, options["steps"] + 1):
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
    return results
