"""The rounding rule of the ring engine: counting contributions per row, and the merges/adds that use them.

(a) ``engine.plan_steps`` against a brute-force count written here, for every layout (ring, zigzag, stripe, ring/zigzag
    varlen) x world 1..4 x causal / non-causal / window: each row's actions are FIRST, then LAST_OF_TWO (2 in
    all) or OPEN, MIDDLE..., CLOSE (>= 3); with 2 ranks no row of a standard layout gets more than 2, so
    neither the output, dq nor the dK/dV partial sums need an fp32 buffer.
(b) ``merge.merge_`` / ``merge.add_`` (eager, CPU) against float64 math, every dtype of dst/a/b, dst aliasing a,
    rows without keys; the Triton kernels under ``TRITON_INTERPRET=1`` against the eager ones (a child process:
    the variable must be set before triton is imported).
(c) A world of one returns the block's own output and gradients (no copy). The bf16 2-rank "rounded once"
    check runs inside tests/ring_kernels/test_ring_batch.py's 2-rank world (no extra start-up).
"""
from __future__ import annotations

import importlib.util
import itertools
import os
import subprocess
import sys

import pytest
import torch

import ring_kernels as rk
from ring_kernels import engine, merge, options
from ring_kernels.torch_releases import triton_unsupported_reason
from ring_kernels.backends import get_backend
from ring_kernels.ring import ring_steps
from ring_kernels.rounding import CLOSE, FIRST, LAST_OF_TWO, MIDDLE, OPEN
from ring_kernels.stripe import stripe_steps
from ring_kernels.tolerances import assert_close, tolerance
from ring_kernels.varlen import ring_varlen_steps, zigzag_varlen_steps
from ring_kernels.zigzag import zigzag_steps

# ---------------------------------------------------------------------------------- (a) contribution plan


def _bounds(rows: slice, n: int):
    start, stop, _ = rows.indices(n)
    return start, max(start, stop)


def _expected_actions(total: int, initial: int):
    """The actions a row with ``total`` contributions (``initial`` of them already held) goes through."""
    if total <= initial:
        return []
    sequence = [FIRST] if total == 1 else [FIRST, LAST_OF_TWO] if total == 2 else \
        [FIRST, OPEN] + [MIDDLE] * (total - 3) + [CLOSE]
    return sequence[initial:]


def _check_row_plan(plan, ranges, n, initial):
    """Replay the plan row by row and compare with the brute-force count; returns max contributions per row."""
    per_row = [[] for _ in range(n)]
    for contributor, (parts, (a, b)) in enumerate(zip(plan.parts, ranges)):
        covered = []
        for part in parts:
            rows, brows = _bounds(part.rows, n), part.block_rows
            assert (brows.start, brows.stop) == (rows[0] - a, rows[1] - a), (part, a)
            covered.extend(range(*rows))
            for row in range(*rows):
                per_row[row].append(part.action)
        assert covered == list(range(a, b)), (contributor, covered, (a, b))   # every row once, in order
    untouched = {row for rows in plan.untouched for row in range(*_bounds(rows, n))}
    totals = []
    for row in range(n):
        total = initial + sum(a <= row < b for a, b in ranges)
        totals.append(total)
        assert per_row[row] == _expected_actions(total, initial), (row, per_row[row], total)
        assert (row in untouched) == (total == initial), row
    assert plan.accumulates == any(t >= 3 for t in totals)
    assert plan.adopt == (initial == 0 and bool(ranges) and ranges[0] == (0, n))
    return max(totals, default=0)


def _steps_of(layout, rank, world, seqlen, causal, window):
    if layout == "ring":
        return ring_steps(rank, world, seqlen, causal, window)
    if layout == "zigzag":
        return zigzag_steps(rank, world, seqlen, causal, window)
    if layout == "stripe":
        return stripe_steps(rank, world, seqlen, causal, window)
    lengths = [4 * world, 2 * world, 6 * world, 4 * world]           # every document divisible by 2N
    cu = torch.tensor([0, *itertools.accumulate(lengths)])
    if layout == "ring_varlen":
        return ring_varlen_steps(cu, rank, world, int(cu[-1]) // world, causal, window)[0]
    return zigzag_varlen_steps(cu, rank, world, causal, window)[0]


_LAYOUTS = {  # layout -> the (causal, window) options it supports
    "ring": [(False, (-1, -1)), (True, (-1, -1)), (True, (3, 0)), (False, (2, 5))],
    "zigzag": [(True, (-1, -1)), (True, (3, 0))],
    "stripe": [(True, (-1, -1)), (True, (5, 0))],
    "ring_varlen": [(False, (-1, -1)), (True, (-1, -1)), (True, (3, 0))],
    "zigzag_varlen": [(True, (-1, -1)), (True, (3, 0))],
}


def _global_kv_counts(layout, world, seqlen, causal, window):
    """owner -> per K/V row, the contributions it receives from every rank's blocks (all hops of its partial)."""
    counts = {owner: [0] * seqlen for owner in range(world)}
    for rank in range(world):
        for step, blocks in enumerate(_steps_of(layout, rank, world, seqlen, causal, window)):
            owner = (rank - step) % world
            for block in blocks:
                for row in range(*_bounds(block.kv_rows, seqlen)):
                    counts[owner][row] += 1
    return counts


@pytest.mark.parametrize("layout", sorted(_LAYOUTS))
def test_contribution_plan_matches_brute_force(layout):
    for world, (causal, window) in itertools.product((1, 2, 3, 4), _LAYOUTS[layout]):
        seqlen = 12 if "varlen" not in layout else 16
        standard = window == (-1, -1)
        for rank in range(world):
            steps = _steps_of(layout, rank, world, seqlen, causal, window)
            plan = engine.plan_steps(steps, seqlen, seqlen)
            q_ranges = [_bounds(b.q_rows, seqlen) for blocks in steps for b in blocks]
            most = _check_row_plan(plan.q, q_ranges, seqlen, 0)
            # the backward visits the steps in reverse order: dq and the dK/dV steps are planned in that order
            backward = steps[::-1]
            _check_row_plan(plan.dq, [_bounds(b.q_rows, seqlen) for blocks in backward for b in blocks], seqlen, 0)
            assert len(plan.kv) == len(steps)
            for step, (hop, blocks) in enumerate(zip(plan.kv, backward)):
                _check_row_plan(hop, [_bounds(b.kv_rows, seqlen) for b in blocks], seqlen, min(step, 1))
            if world == 2 and (standard or "varlen" not in layout):
                # the rule's premise: with 2 ranks no output or dq row needs an fp32 accumulator
                assert most <= 2 and not plan.q.accumulates, (layout, causal, window, rank)
        if world == 2 and (standard or "varlen" not in layout):
            # each K/V row: its own rank's contribution, then the other's -> a k-dtype partial sum is exact
            for owner, rows in _global_kv_counts(layout, world, seqlen, causal, window).items():
                assert max(rows) <= 2, (layout, causal, window, owner, rows)


def test_contribution_counts_of_the_standard_layouts():
    """Known numbers: contributions per query row on each rank, N = 2 and 3 (S = 12)."""
    def counts(layout, rank, world, causal=True):
        plan = engine.plan_steps(_steps_of(layout, rank, world, 12, causal, (-1, -1)), 12, 12).q
        per_row = [0] * 12
        for parts in plan.parts:
            for part in parts:
                for row in range(*_bounds(part.rows, 12)):
                    per_row[row] += 1
        return per_row

    assert counts("ring", 0, 3, causal=False) == [3] * 12 and counts("ring", 2, 3) == [3] * 12
    assert counts("ring", 0, 2) == [1] * 12 and counts("ring", 1, 2) == [2] * 12
    assert counts("zigzag", 0, 2) == [1] * 6 + [2] * 6 and counts("zigzag", 1, 2) == [2] * 12
    assert counts("zigzag", 1, 3) == [2] * 6 + [3] * 6            # first chunk: own + rank 0's
    assert counts("stripe", 0, 2) == [1] + [2] * 11 and counts("stripe", 1, 2) == [2] * 12
    # N = 3: the second query chunk of zigzag rank 1 opens an fp32 accumulator, the first never does
    plan = engine.plan_steps(_steps_of("zigzag", 1, 3, 12, True, (-1, -1)), 12, 12).q
    assert [[(p.rows.start, p.rows.stop, p.action) for p in parts] for parts in plan.parts] == [
        [(0, 12, FIRST)], [(0, 6, LAST_OF_TWO), (6, 12, OPEN)], [(6, 12, CLOSE)]]
    assert plan.adopt and plan.accumulates


# ---------------------------------------------------------------------------------- (b) merge and add


def _merge64(a, lse_a, b, lse_b):
    """float64 reference: (merged out, merged lse); rows with no key stay 0 / -inf."""
    a, b, la, lb = a.double(), b.double(), lse_a.double(), lse_b.double()
    new = torch.logaddexp(la, lb)
    safe = new.masked_fill(new == float("-inf"), 0.0)
    weight = lambda lse: torch.exp(lse - safe).transpose(1, 2).unsqueeze(-1)   # noqa: E731
    return a * weight(la) + b * weight(lb), new


def _inputs(shape, dtype_a, dtype_b, seed):
    gen = torch.Generator().manual_seed(seed)
    bsz, s, h, d = shape
    a, b = torch.randn(shape, generator=gen).to(dtype_a), torch.randn(shape, generator=gen).to(dtype_b)
    lse_a, lse_b = torch.randn(bsz, h, s, generator=gen), torch.randn(bsz, h, s, generator=gen)
    lse_a[:, 0, 0] = lse_b[:, 0, 0] = float("-inf")                     # no key in either block
    a[:, 0, 0] = b[:, 0, 0] = 0
    lse_a[:, -1, 1] = float("-inf")                                     # no key in a only
    a[:, 1, -1] = 0
    lse_b[:, 0, -1] = float("-inf")                                     # no key in b only
    b[:, -1, 0] = 0
    return a, lse_a, b, lse_b


_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_LSE = tolerance("merge", torch.float32, "lse")   # lse is fp32 whatever the dtype of the outputs


def test_eager_merge_rounds_once_into_any_dtype():
    combos = itertools.product(itertools.product(_DTYPES, repeat=3), (False, True))
    for seed, ((da, db, dd), alias) in enumerate(combos):
        if alias and dd != da:
            continue
        a, lse_a, b, lse_b = _inputs((2, 5, 3, 16), da, db, seed=seed)
        want, want_lse = _merge64(a, lse_a, b, lse_b)
        dst = a if alias else torch.full(a.shape, float("nan"), dtype=dd)
        merge.merge_into_eager_(dst, a, lse_a, b, lse_b)
        assert dst.dtype == dd and not dst.isnan().any() and not lse_a.isnan().any()
        # one rounding of the (fp32-computed) merge to dd: at most one ulp of dd from the float64 value
        ulp = torch.finfo(dd).eps * want.abs().clamp_min(torch.finfo(dd).tiny)
        assert bool(((dst.double() - want).abs() <= ulp + 1e-6 * want.abs() + 1e-7).all()), (da, db, dd, alias)
        assert torch.equal(torch.isinf(lse_a), torch.isinf(want_lse))
        finite = torch.isfinite(want_lse)
        assert_close(lse_a[finite], want_lse[finite], _LSE, f"lse {(da, db, dd, alias)}")
        assert torch.equal(dst[:, 0, 0], torch.zeros_like(dst[:, 0, 0]))


def test_merge_of_row_views_leaves_other_rows_alone():
    a, lse_a, b, lse_b = _inputs((1, 8, 2, 8), torch.bfloat16, torch.bfloat16, seed=3)
    dst = torch.zeros(1, 8, 2, 8, dtype=torch.float32)
    rows = slice(2, 6)
    want, want_lse = _merge64(a[:, rows], lse_a[:, :, rows].clone(), b[:, rows], lse_b[:, :, rows])
    merge.merge_(dst[:, rows], a[:, rows], lse_a[:, :, rows], b[:, rows], lse_b[:, :, rows])
    assert_close(dst[:, rows], want, tolerance("merge", torch.float32, "out"), "merged rows")
    assert not dst[:, :2].any() and not dst[:, 6:].any()
    assert_close(lse_a[:, :, rows], want_lse, _LSE, "merged rows' lse")


def test_add_computes_in_fp32_and_rounds_once():
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(2, 7, 3, 8, generator=gen).bfloat16()
    b = (torch.randn(2, 7, 3, 8, generator=gen) * 1e-3).bfloat16()     # small: bf16 + bf16 would lose it
    widened = torch.empty(a.shape, dtype=torch.float32)
    merge.add_(widened, a, b)                                           # bf16 + bf16 -> fp32 without rounding
    assert torch.equal(widened, (a.double() + b.double()).float())
    assert not torch.equal(widened, (a + b).float())                    # what torch.add(out=fp32) would give
    narrowed = a.clone()
    acc = torch.randn(a.shape, generator=gen)
    merge.add_(narrowed, acc, b)                                        # fp32 + bf16 -> bf16: one rounding
    assert torch.equal(narrowed, (acc.double() + b.double()).float().bfloat16())
    in_place = a.clone()
    merge.add_(in_place, in_place, b)                                   # bf16 += bf16: fp32 math, one rounding
    assert torch.equal(in_place, (a.double() + b.double()).float().bfloat16())


def fused_kernels_match_eager() -> None:
    """Run in a child with TRITON_INTERPRET=1: the generalised Triton merge and widening add on CPU tensors
    against the eager ones: dst fp32/fp16 (bf16 too: loads and stores convert without tl.dot), dst aliasing a,
    row views, rows with no key."""
    for (da, db, dd), alias in itertools.product(
            [(torch.float32, torch.bfloat16, torch.float32), (torch.float16, torch.float16, torch.float16),
             (torch.bfloat16, torch.bfloat16, torch.float32), (torch.float32, torch.float16, torch.bfloat16)],
            (False, True)):
        if alias and dd != da:
            continue
        for shape, rows in (((1, 6, 3, 24), slice(None)), ((2, 8, 2, 16), slice(3, 8))):
            a, lse_a, b, lse_b = _inputs(shape, da, db, seed=11)
            eager_lse, fused_lse = lse_a.clone(), lse_a.clone()
            eager_dst = a.clone() if alias else torch.zeros(shape, dtype=dd)
            fused_dst = a.clone() if alias else torch.zeros(shape, dtype=dd)
            eager_a = eager_dst if alias else a
            fused_a = fused_dst if alias else a
            merge.merge_into_eager_(eager_dst[:, rows], eager_a[:, rows], eager_lse[:, :, rows], b[:, rows],
                                    lse_b[:, :, rows])
            merge.merge_into_fused_(fused_dst[:, rows], fused_a[:, rows], fused_lse[:, :, rows], b[:, rows],
                                    lse_b[:, :, rows])
            assert not fused_dst.isnan().any() and not fused_lse.isnan().any(), (da, db, dd, alias)
            assert_close(fused_dst, eager_dst, tolerance("merge", dd, "out"), f"fused {(da, db, dd, alias)}")
            assert torch.equal(torch.isinf(fused_lse), torch.isinf(eager_lse))
            finite = torch.isfinite(eager_lse)
            assert_close(fused_lse[finite], eager_lse[finite], _LSE, f"fused lse {(da, db, dd, alias)}")
    for low in (torch.float16, torch.bfloat16):
        a, _, b, _ = _inputs((2, 5, 3, 20), low, low, seed=5)
        eager, fused = torch.empty(a.shape), torch.empty(a.shape)
        merge.add_eager_(eager[:, 1:], a[:, 1:], b[:, 1:])
        merge.add_fused_(fused[:, 1:], a[:, 1:], b[:, 1:])
        assert torch.equal(fused[:, 1:], eager[:, 1:]), low
    _fused_in_place_accumulator_merge_matches_eager()


def _fused_in_place_accumulator_merge_matches_eager() -> None:
    """The in-place form a ring uses on an fp32 accumulator (dst = a): full and half-row views, rows that have
    no key in the accumulator, the block, or both."""
    torch.manual_seed(0)
    for b, s, h, d, rows in [(2, 6, 4, 80, slice(None)), (1, 10, 3, 64, slice(5, 10)), (1, 3, 2, 16, slice(None))]:
        acc, lse = torch.randn(b, s, h, d), torch.randn(b, h, s)
        lse[0, 0, 0], acc[0, 0, 0] = float("-inf"), 0.0
        blk, blk_lse = torch.randn(b, s, h, d).bfloat16(), torch.randn(b, h, s)
        blk_lse[0, 0, 0] = float("-inf")
        blk_lse[:, 1, 1] = float("-inf")
        eager = (acc.clone(), lse.clone())
        fused = (acc.clone(), lse.clone())
        merge.merge_into_eager_(eager[0][:, rows], eager[0][:, rows], eager[1][:, :, rows], blk[:, rows],
                                blk_lse[:, :, rows])
        merge.merge_into_fused_(fused[0][:, rows], fused[0][:, rows], fused[1][:, :, rows], blk[:, rows],
                                blk_lse[:, :, rows])
        assert not fused[0].isnan().any() and not fused[1].isnan().any()
        assert_close(fused[0], eager[0], tolerance("merge", torch.float32, "out"), "fused in-place out")
        assert torch.equal(torch.isinf(fused[1]), torch.isinf(eager[1]))
        finite = torch.isfinite(eager[1])
        assert_close(fused[1][finite], eager[1][finite], _LSE, "fused in-place lse")


@pytest.mark.skipif(triton_unsupported_reason() is not None, reason=str(triton_unsupported_reason()))
def test_fused_kernels_match_eager_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    code = "import test_merge as t; t.fused_kernels_match_eager()"
    done = subprocess.run([sys.executable, "-c", code], cwd=os.path.dirname(__file__), env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]


def test_eager_path_when_fused_merge_is_off(monkeypatch):
    """The option fused_merge=False (or RING_KERNELS_FUSED_MERGE=0) keeps every merge and add eager (the only
    path on CPU as well)."""
    with options.use_options(fused_merge=False):
        assert not merge.use_fused()
    monkeypatch.setenv("RING_KERNELS_FUSED_MERGE", "0")
    options.reload_environment()
    try:
        assert not merge.use_fused()
    finally:
        monkeypatch.undo()
        options.reload_environment()


# ---------------------------------------------------------------------------- (c) a world of one: no copy


def test_world_of_one_returns_the_blocks_own_tensors():
    """A single block's out, dq, dk, dv are returned as they came from the backend: same storage, no copy."""
    impl = get_backend("torch_cpu", device="cpu", dtype=torch.bfloat16, head_dim=64, mask_kind="causal")
    seen = {}
    forward, backward = impl.forward, impl.backward

    def recording_forward(*args, **kwargs):
        out, lse = forward(*args, **kwargs)
        seen["out"] = out.data_ptr()
        return out, lse

    def recording_backward(*args, **kwargs):
        grads = backward(*args, **kwargs)
        seen["grads"] = [g.data_ptr() for g in grads]
        return grads

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 10, h, 64, generator=gen).bfloat16().requires_grad_() for h in (8, 2, 2))
    impl.forward, impl.backward = recording_forward, recording_backward
    try:
        for fn in (rk.ring_attn_func, rk.zigzag_ring_attn_func, rk.stripe_attn_func):
            out = fn(q, k, v, causal=True, backend="torch_cpu")
            assert out.data_ptr() == seen["out"], fn.__name__
            grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
            assert [g.data_ptr() for g in grads] == seen["grads"], fn.__name__
            assert all(g.dtype == torch.bfloat16 for g in grads)
    finally:
        del impl.forward, impl.backward
