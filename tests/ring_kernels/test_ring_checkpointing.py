"""ring_kernels.checkpointing: checkpointing that keeps the ring's outputs equals plain checkpointing bitwise, and
its recomputation runs no ring forward.

A stack of small attention layers (q/k/v projections, a ring function, an output projection, a residual), each
checkpointed by torch's ``checkpoint`` with and without ``keeping``, on 2 and 4 gloo ranks, for every layout
(ring, zigzag, stripe, their varlen forms, llama3), with a sink, and with reentrant checkpointing. The loss and
every gradient (parameters and the stack's input) must be equal bit for bit; the ring forwards run are counted
(``engine.forward_pass`` / ``llama3.forward_pass``): 2 per layer plainly, 1 kept. Then the budget (gaps), the
release of unused outputs, "auto"'s calibration (with stand-in memory counters), and the refusals.
"""
from __future__ import annotations

import functools
import gc
import logging

import pytest
import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import ring_kernels as rk
from ring_kernels import engine, llama3
from ring_kernels.checkpointing import KeptOutputMismatch, OutputKeeper, cuda_memory_stats, keeping
from ring_kernels.errors import RingInputError
from _dist import run_world

D_MODEL, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 32, 4, 2, 8, 3
DOCS = (5, 11, 9, 7)          # varlen: document lengths of the global packed row (32 tokens; 2 and 4 ranks)
ZIGZAG_DOCS = (8, 16, 8)      # zigzag varlen: each document cut in 2 x world chunks


class _Layer(torch.nn.Module):
    def __init__(self, attention):
        super().__init__()
        self.qkv = torch.nn.Linear(D_MODEL, (HEADS + 2 * KV_HEADS) * HEAD_DIM)
        self.o = torch.nn.Linear(HEADS * HEAD_DIM, D_MODEL)
        self.attention = attention

    def forward(self, x):
        q, k, v = self.qkv(x).split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
        shape = x.shape[:-1]
        out = self.attention(q.reshape(*shape, HEADS, HEAD_DIM), k.reshape(*shape, KV_HEADS, HEAD_DIM),
                             v.reshape(*shape, KV_HEADS, HEAD_DIM))
        return x + self.o(out.reshape(*shape, HEADS * HEAD_DIM))


def _attention(variant: str, sink=None):
    """variant -> a function of this rank's (q, k, v) (batch: (B, S, H, D); varlen: (T, H, D))."""
    cu = torch.tensor([0, *torch.tensor(DOCS).cumsum(0).tolist()], dtype=torch.int32)
    zigzag_cu = torch.tensor([0, *torch.tensor(ZIGZAG_DOCS).cumsum(0).tolist()], dtype=torch.int32)
    options = {} if sink is None else {"sink": sink}
    return {
        "ring": functools.partial(rk.ring_attn_func, causal=True, **options),
        "zigzag": functools.partial(rk.zigzag_ring_attn_func, causal=True, **options),
        "stripe": functools.partial(rk.stripe_attn_func, causal=True, **options),
        "ring_varlen": lambda q, k, v: rk.ring_attn_varlen_func(q, k, v, cu, causal=True, **options),
        "zigzag_varlen": lambda q, k, v: rk.zigzag_ring_attn_varlen_func(q, k, v, zigzag_cu, causal=True, **options),
        "llama3": lambda q, k, v: rk.llama3_attn_varlen_func(q, k, v, cu, causal=True, **options),
    }[variant]


def _stack(variant: str, dtype=torch.float32, sink: bool = False):
    torch.manual_seed(0)                       # the same weights on every rank
    sink_logits = torch.nn.Parameter(torch.randn(HEADS)) if sink else None
    layers = torch.nn.ModuleList(_Layer(_attention(variant, sink_logits)) for _ in range(LAYERS)).to(dtype)
    return layers, sink_logits


def _input(variant: str, dtype, rank: int, world: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1 + rank)
    local = sum(DOCS) // world
    shape = (local, D_MODEL) if "varlen" in variant or variant == "llama3" else (2, local, D_MODEL)
    return torch.randn(*shape, generator=g).to(dtype).requires_grad_()


class _CountForwards:
    """Counts the ring forwards run (the batch engine's and llama3's) while entered."""

    def __enter__(self):
        self.calls = 0
        self._saved = (engine.forward_pass, llama3.forward_pass)

        def counting(original):
            def run(*args, **kwargs):
                self.calls += 1
                return original(*args, **kwargs)
            return run

        engine.forward_pass, llama3.forward_pass = (counting(f) for f in self._saved)
        return self

    def __exit__(self, *exc):
        engine.forward_pass, llama3.forward_pass = self._saved
        return False


def _train_once(variant, dtype, rank, world, checkpoint_fn, sink=False):
    """Loss, gradients (by name, and "input") and ring forwards of one forward + backward of the stack."""
    layers, sink_logits = _stack(variant, dtype, sink)
    x = _input(variant, dtype, rank, world)
    with _CountForwards() as counted:
        h = x
        for layer in layers:
            h = checkpoint_fn(layer, h)
        loss = h.float().pow(2).mean()
        loss.backward()
    grads = {n: p.grad for n, p in layers.named_parameters()}
    grads["input"] = x.grad
    if sink_logits is not None:
        grads["sink"] = sink_logits.grad
    return loss.detach(), grads, counted.calls


def _kept_equals_plain(rank, world, cases):
    results = []
    for variant, dtype, reentrant, sink in cases:
        plain = functools.partial(torch_checkpoint, use_reentrant=reentrant)
        keeper = OutputKeeper(None)
        loss_p, grads_p, calls_p = _train_once(variant, dtype, rank, world, plain, sink)
        loss_k, grads_k, calls_k = _train_once(variant, dtype, rank, world, keeping(plain, keeper), sink)
        gc.collect()
        differ = [n for n in grads_p if not torch.equal(grads_p[n], grads_k[n])]
        results.append(dict(case=(variant, str(dtype), reentrant, sink), loss_equal=bool(torch.equal(loss_p, loss_k)),
                            differ=differ, calls=(calls_p, calls_k), stats=keeper.stats()))
    return results


def _cases(world):
    cases = [(v, torch.float32, False, False) for v in ("ring", "zigzag", "stripe", "ring_varlen", "zigzag_varlen",
                                                        "llama3")]
    cases += [("zigzag", torch.bfloat16, False, False), ("zigzag", torch.float32, True, False),
              ("zigzag", torch.float32, False, True), ("llama3", torch.float32, False, True)]
    return cases


@pytest.mark.parametrize("world", [2, 4])
def test_kept_outputs_equal_plain_checkpointing_and_skip_the_ring(world):
    for rank_results in run_world(world, _kept_equals_plain, _cases(world), timeout=300):
        for r in rank_results:
            assert r["loss_equal"] and not r["differ"], r
            # plain: every layer's ring forward twice (forward, recomputation); kept: once
            assert r["calls"] == (2 * LAYERS, LAYERS), r
            stats = r["stats"]
            assert (stats["kept"], stats["replayed"], stats["gaps"], stats["released_unused"]) == (LAYERS, LAYERS, 0, 0)
            assert stats["live_bytes"] == 0 and stats["peak_bytes"] > 0, r


def _budget_and_release(rank, world):
    plain = functools.partial(torch_checkpoint, use_reentrant=False)
    layers, _ = _stack("zigzag")
    x = _input("zigzag", torch.float32, rank, world)
    out_bytes = x.shape[0] * x.shape[1] * HEADS * HEAD_DIM * 4
    pair = out_bytes + x.shape[0] * HEADS * x.shape[1] * 4          # out + fp32 lse (B, H, S)
    # a budget of one layer's pair: the first layer kept, the others recomputed as plainly
    keeper = OutputKeeper(pair)
    loss_p, grads_p, _ = _train_once("zigzag", torch.float32, rank, world, plain)
    loss_k, grads_k, calls = _train_once("zigzag", torch.float32, rank, world, keeping(plain, keeper))
    gc.collect()
    budgeted = dict(equal=bool(torch.equal(loss_p, loss_k)) and all(torch.equal(grads_p[n], grads_k[n])
                                                                   for n in grads_p),
                    calls=calls, stats=keeper.stats(), pair=pair)
    # a forward whose backward never runs: its kept pairs are released with its graph
    unused = OutputKeeper(None)
    h = x.detach().requires_grad_()
    for layer in layers:
        h = keeping(plain, unused)(layer, h)
    while_alive = unused.stats()["live_bytes"]
    del h
    gc.collect()
    return budgeted, while_alive, unused.stats()


@pytest.mark.parametrize("world", [2])
def test_budget_keeps_what_fits_and_unused_outputs_are_released(world):
    for budgeted, while_alive, unused in run_world(world, _budget_and_release, timeout=120):
        assert budgeted["equal"], budgeted
        stats = budgeted["stats"]
        assert (stats["kept"], stats["gaps"], stats["replayed"]) == (1, LAYERS - 1, 1), stats
        assert stats["peak_bytes"] == budgeted["pair"] and stats["live_bytes"] == 0, stats
        assert budgeted["calls"] == 2 * LAYERS - 1, budgeted           # one recomputation skipped the ring
        assert while_alive == LAYERS * budgeted["pair"]
        assert unused["live_bytes"] == 0 and unused["released_unused"] == LAYERS, unused


def test_a_recomputation_that_differs_from_its_forward_is_named():
    """World of one (no process group): a region whose recomputation makes another ring call than its forward."""
    plain = functools.partial(torch_checkpoint, use_reentrant=False)
    q = torch.randn(1, 8, 2, 4, requires_grad=True)
    runs = []

    def region(q):
        runs.append(1)
        out = rk.zigzag_ring_attn_func(q, q, q, causal=True)
        if len(runs) > 1:                      # the recomputation makes one ring call more
            out = out + rk.zigzag_ring_attn_func(q, q, q, causal=True)
        return out

    # reentrant: the recomputation runs the whole region (non-reentrant stops once the saved tensors are back)
    reentrant = functools.partial(torch_checkpoint, use_reentrant=True)
    out = keeping(reentrant, OutputKeeper(None))(region, q)
    with pytest.raises(KeptOutputMismatch, match=r"made ring call #2, but its forward made 1"):
        out.sum().backward()
    runs.clear()

    def reshaped(q):
        runs.append(1)
        t = q[:, :4] if len(runs) > 1 else q   # the recomputation attends over fewer tokens
        return rk.zigzag_ring_attn_func(t, t, t, causal=True).sum()

    out = keeping(plain, OutputKeeper(None))(reshaped, q)
    with pytest.raises(KeptOutputMismatch, match=r"queries \(1, 4, 2, 4\).*kept output .*\(1, 8, 2, 4\)"):
        out.backward()


class _Memory:
    """Stand-in device counters for "auto": peak, allocated, total (bytes)."""

    def __init__(self, total):
        self.peak, self.allocated, self.total = 0, 0, total

    def __call__(self):
        return self.peak, self.allocated, self.total


def test_auto_budget_measures_one_step_then_keeps_what_fits(caplog):
    mib = 2**20
    memory = _Memory(total=1000 * mib)
    keeper = OutputKeeper("auto", headroom=0.10, memory_stats=memory)
    plain = functools.partial(torch_checkpoint, use_reentrant=False)
    layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(LAYERS))
    pair = 1 * 8 * 2 * 4 * 4 + 1 * 2 * 8 * 4           # out (1, 8, 2, 4) fp32 + lse (1, 2, 8) fp32

    def step():
        q = torch.randn(1, 8, 2, 4, requires_grad=True)
        h = q
        for layer in layers:
            h = keeping(plain, keeper)(lambda t, layer=layer: rk.zigzag_ring_attn_func(layer(t), t, t, causal=True), h)
        h.sum().backward()

    memory.allocated, memory.peak = 100 * mib, 700 * mib
    step()                                             # measured: keeps nothing
    assert keeper.stats()["kept"] == 0 and keeper.stats()["gaps"] == LAYERS and not keeper.stats()["calibrated"]
    memory.allocated = 150 * mib                       # optimizer states appeared after the first step
    step()
    # budget = 0.9 x 1000 - 700 (peak) - 50 (growth) MiB
    assert keeper.stats()["calibrated"] and keeper.budget_bytes == 150 * mib
    assert keeper.stats()["kept"] == LAYERS and keeper.stats()["replayed"] == LAYERS
    memory.allocated = 100 * mib + 900 * mib - 700 * mib - pair + 1    # now one pair no longer fits
    with caplog.at_level(logging.WARNING, logger="ring_kernels.checkpointing"):
        step()
    assert keeper.budget_bytes < pair and keeper.stats()["kept"] == LAYERS
    assert "nothing fits: one ring output takes" in caplog.text


@pytest.mark.parametrize("conf, peak_gib", [("", 125 + 10), ("expandable_segments:True", 118 + 10),
                                             ("max_split_size_mb:512,expandable_segments:True", 118 + 10)])
def test_auto_counts_what_the_process_must_hold(monkeypatch, conf, peak_gib):
    """The CUDA counters behind "auto": the tensors' peak where expandable segments let freed memory serve any
    size, else the allocator's peak reservation (its fragments cannot take a kept output); plus the memory
    outside the allocator."""
    gib = 2**30
    counters = dict(mem_get_info=lambda index: (10 * gib, 140 * gib), memory_reserved=lambda index: 120 * gib,
                    max_memory_reserved=lambda index: 125 * gib, memory_allocated=lambda index: 100 * gib,
                    max_memory_allocated=lambda index: 118 * gib, current_device=lambda: 0)
    for name, value in counters.items():
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", conf)
    # held outside the allocator: 140 - 10 free - 120 reserved = 10 GiB
    assert cuda_memory_stats(None)() == (peak_gib * gib, 100 * gib, 140 * gib)


def test_bad_budgets_are_refused():
    for bad in (-1, "most", True, [1]):
        with pytest.raises(RingInputError, match="budget_bytes=.*must be a number of bytes"):
            OutputKeeper(bad)
    with pytest.raises(RingInputError, match="headroom=1.5 must be in"):
        OutputKeeper(None, headroom=1.5)
    if not torch.cuda.is_available():
        with pytest.raises(RingInputError, match="no CUDA device is available"):
            OutputKeeper("auto")
    with pytest.raises(TypeError, match="keeper must be an OutputKeeper"):
        keeping(torch_checkpoint, None)
