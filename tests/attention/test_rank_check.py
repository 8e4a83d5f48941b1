"""The cross-rank metadata check: per call by default, once per distinct call inside ``rank_check_scope``.

Counts the all_gathers the check issues (dist.all_gather wrapped inside each rank) and proves that a scope
skips only repeats of a signature already checked, while a disagreement on a new signature still raises on
every rank with the per-rank values.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import hfpatch
import ring_kernels as rk
from _dist import run_world
from hfpatch.cli.demo_models import build_model
from ring_kernels import validation


def _counting_all_gather():
    calls = []
    original = dist.all_gather

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    dist.all_gather = counted
    return calls, lambda: setattr(dist, "all_gather", original)


def _scoped_world(rank, world):
    torch.manual_seed(rank)
    q, k = torch.randn(1, 8, 4, 16), torch.randn(1, 8, 2, 16)
    calls, restore = _counting_all_gather()
    try:
        for _ in range(3):                                   # no scope: every call checks
            rk.zigzag_ring_attn_func(q, k, k, causal=True, backend="reference")
        assert len(calls) == 3, calls
        step_one: set = set()
        with rk.rank_check_scope(step_one):
            for _ in range(3):                               # one check for three identical calls
                rk.zigzag_ring_attn_func(q, k, k, causal=True, backend="reference")
            assert len(calls) == 4, calls
            rk.ring_attn_func(q, k, k, causal=True, backend="reference")    # another function: checked
            rk.zigzag_ring_attn_func(q[:, :6], k[:, :6], k[:, :6], causal=True, backend="reference")  # new shape
            assert len(calls) == 6, calls
            assert len(step_one) == 3
        with rk.rank_check_scope(set()):                     # a new step checks again
            rk.zigzag_ring_attn_func(q, k, k, causal=True, backend="reference")
        assert len(calls) == 7, calls
        # A disagreement on a signature not yet checked is still caught, on every rank, inside a scope.
        local = 8 if rank == 0 else 6
        with rk.rank_check_scope(step_one), pytest.raises(ValueError, match=r"ranks disagree on seqlen_local "
                                                                            r"\(rank 0: 8, rank 1: 6\)"):
            rk.ring_attn_func(q[:, :local], k[:, :local], k[:, :local], causal=False, backend="reference")
    finally:
        restore()


def test_rank_check_scope_checks_each_signature_once():
    run_world(2, _scoped_world)


def test_rank_check_scope_restores_per_call_checking_on_exit():
    with rk.rank_check_scope(set()) as seen:
        assert validation.RANK_CHECKED.get() is seen
    assert validation.RANK_CHECKED.get() is None


def _hfpatch_world(rank, world):
    """Through hfpatch: one cross-rank check per step (the first layer), none for the other layers."""
    model = build_model("llama", num_hidden_layers=3)
    ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(0))
    with hfpatch.apply(dist.group.WORLD, model=model, verify=False) as patch:
        for step in range(2):
            batch = patch.shard_inputs(ids)
            calls, restore = _counting_all_gather()
            try:
                model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)
            finally:
                restore()
            assert patch.mode_calls.get("ring") == 3 * (step + 1), patch.mode_calls
            assert len(calls) == 1, f"step {step}: {len(calls)} cross-rank checks for 3 layers"


def test_hfpatch_checks_ranks_once_per_step():
    run_world(2, _hfpatch_world)
