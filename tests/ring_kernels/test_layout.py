"""ring_kernels.layout: positions per layout, shard/unshard round trips and gradients, errors.

The position tables are checked against each layout's definition written out independently here; the
collective parts (shard, unshard and its backward) run in one gloo world per world size.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from _dist import run_world
from ring_kernels import RingInputError
from ring_kernels.layout import (LAYOUTS, check_cu_seqlens, check_zigzag_documents, local_positions, rank_positions,
                                   rank_varlen, shard, unshard)


def _expected_positions(total, rank, n, layout, cu=None):
    """Each layout's definition, token by token (slow and obvious on purpose)."""
    if layout == "contiguous":
        per = total // n
        return [t for t in range(total) if t // per == rank]
    if layout == "stripe":
        return [t for t in range(total) if t % n == rank]
    docs = [(0, total)] if cu is None else [(int(cu[d]), int(cu[d + 1])) for d in range(len(cu) - 1)]
    out = []
    for start, end in docs:
        chunk = (end - start) // (2 * n)
        for c in (rank, 2 * n - 1 - rank):
            out += list(range(start + c * chunk, start + (c + 1) * chunk))
    return out


_CU_TABLE = [[0, 12], [0, 4, 4, 16, 24], [0, 8, 16, 40, 48]]  # multiples of 2*N for N in {1,2}; incl. empty doc


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_positions_match_definition_and_partition(n, layout):
    total = 2 * n * 7
    seen = []
    for rank in range(n):
        pos = rank_positions(total, rank, n, layout=layout)
        assert pos.dtype == torch.long and pos.numel() == total // n
        want = _expected_positions(total, rank, n, layout) if n > 1 else list(range(total))
        assert pos.tolist() == want
        seen += pos.tolist()
    assert sorted(seen) == list(range(total))


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_varlen_positions_and_local_metadata(n, layout):
    lengths = [2 * n * k for k in (3, 1, 0, 5, 2)]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    cu64 = check_cu_seqlens(cu)
    total = int(cu[-1])
    seen = []
    for rank in range(n):
        meta = rank_varlen(cu64, rank, n, layout)
        want = _expected_positions(total, rank, n, layout, cu) if layout == "zigzag" else \
            _expected_positions(total, rank, n, "contiguous")
        assert meta.positions.tolist() == (want if n > 1 else list(range(total)))
        seen += meta.positions.tolist()
        for p, d, dp in zip(meta.positions.tolist(), meta.doc_ids.tolist(), meta.doc_positions.tolist()):
            assert int(cu[d]) <= p < int(cu[d + 1]) and dp == p - int(cu[d])
        counts = [meta.doc_ids.tolist().count(d) for d in range(len(lengths))]
        assert meta.cu_seqlens.dtype == torch.int32
        assert meta.cu_seqlens.tolist() == [0] + torch.tensor(counts).cumsum(0).tolist()
        assert meta.max_seqlen == max(counts)
        if layout == "zigzag":  # the zigzag varlen convention: local cu_seqlens = global // N
            assert meta.cu_seqlens.tolist() == (cu // n).tolist()
    assert sorted(seen) == list(range(total))


def test_contiguous_varlen_documents_cross_rank_boundaries():
    cu = torch.tensor([0, 1, 6, 7, 12], dtype=torch.int32)  # length-1 documents, 12 tokens over 3 ranks
    metas = [rank_varlen(check_cu_seqlens(cu), r, 3, "contiguous") for r in range(3)]
    assert [m.doc_ids.tolist() for m in metas] == [[0, 1, 1, 1], [1, 1, 2, 3], [3, 3, 3, 3]]
    assert [m.doc_positions.tolist() for m in metas] == [[0, 0, 1, 2], [3, 4, 0, 0], [1, 2, 3, 4]]
    assert [m.cu_seqlens.tolist() for m in metas] == [[0, 1, 4, 4, 4], [0, 0, 2, 3, 4], [0, 0, 0, 0, 4]]


def test_single_process_is_identity_and_matches_local_positions():
    x = torch.randn(2, 7, 3, 4)
    for layout in LAYOUTS:
        assert shard(x, layout=layout) is x
        assert unshard(x, layout=layout) is x
        assert local_positions(7, layout=layout).tolist() == list(range(7))


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: rank_positions(10, 0, 4, layout="contiguous"), r"10 .*divisible by 4"),
        (lambda: rank_positions(12, 0, 4, layout="zigzag"), r"12 .*divisible by 8"),
        (lambda: rank_positions(10, 0, 3, layout="stripe"), r"divisible by 3"),
        (lambda: rank_positions(8, 0, 2, layout="diagonal"), r"layout='diagonal'.*contiguous"),
        (lambda: rank_positions(8, 0, 2, layout="stripe", cu_seqlens=torch.tensor([0, 8])), r"no varlen form"),
        (lambda: rank_positions(12, 0, 2, layout="zigzag", cu_seqlens=torch.tensor([0, 8, 10, 12])),
         r"document 1 of cu_seqlens \(tokens 8\.\.10\) has length 2.*4 equal chunks"),
        (lambda: rank_positions(12, 0, 2, layout="contiguous", cu_seqlens=torch.tensor([0, 8, 10])),
         r"cu_seqlens\[-1\] = 10 must equal the global token count 12"),
        (lambda: check_cu_seqlens(torch.tensor([1, 8])), r"start at 0"),
        (lambda: check_cu_seqlens(torch.tensor([0, 8, 4])), r"non-decreasing; document 1 has length -4"),
        (lambda: check_cu_seqlens(torch.tensor([0.0, 8.0])), r"integer"),
        (lambda: shard(torch.zeros(2, 8), layout="contiguous", dim=2), r"dim=2 is not a dimension"),
        (lambda: shard(torch.zeros(8, 2, 4), layout="zigzag", cu_seqlens=torch.tensor([0, 8])),
         r"cu_seqlens\[-1\] = 8 .*dim=1.*pass dim=0"),
    ],
)
def test_bad_input_raises_clear_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_zigzag_documents_are_one_rule():
    """The zigzag rule for documents (each a multiple of 2N), shared by shard and the zigzag kernels (their messages:
    tests/ring_kernels/test_ring_varlen.py, tests/ring_kernels/test_ring_ulysses.py): a RingInputError (a
    ValueError) naming cu_seqlens, the first bad document and length, and the fix; prefixed with the kernel's name
    where a kernel checks."""
    cu = torch.tensor([0, 8, 10, 13, 16])
    with pytest.raises(RingInputError, match=r"^document 1 of cu_seqlens \(tokens 8\.\.10\) has length 2, not "
                       r"divisible by 2 x world_size = 4 \(3 document\(s\) affected\); layout='zigzag' cuts every "
                       r"document into 4 equal chunks: pad each document to a multiple of 4, or shard") as info:
        rank_positions(16, 0, 2, layout="zigzag", cu_seqlens=cu)
    assert (info.value.argument, info.value.value) == ("cu_seqlens", 2)
    with pytest.raises(RingInputError, match=r"^ulysses_attn_varlen_func: document 1 .*, or use another layout$"):
        check_zigzag_documents(cu, 2, fn="ulysses_attn_varlen_func", instead="use another layout")


def test_bad_types_raise_type_error():
    with pytest.raises(TypeError, match="cu_seqlens must be a 1-D integer torch.Tensor"):
        check_cu_seqlens([0, 4])
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        shard([1, 2], layout="contiguous")
    with pytest.raises(TypeError, match="seqlen_global"):
        local_positions(-1, layout="contiguous")


# ------------------------------------------------------------------------------- distributed round trips


def _dist_cases(n):
    cases = []
    for layout in LAYOUTS:
        for dim, shape in ((1, (2, 2 * n * 5, 3, 4)), (0, (2 * n * 3, 5)), (2, (3, 2, 2 * n * 2))):
            for dtype in (torch.float32, torch.bfloat16):
                cases.append(dict(layout=layout, dim=dim, shape=shape, dtype=dtype, cu=None))
    for layout in ("contiguous", "zigzag"):
        lengths = [2 * n * 2, 2 * n, 0, 2 * n * 3] if layout == "zigzag" else [1, 2 * n * 3 - 2, 1, 2 * n]
        cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
        cases.append(dict(layout=layout, dim=0, shape=(int(cu[-1]), 3, 4), dtype=torch.float32, cu=cu))
    return cases


def subgroup_phases(rank, run):
    """Run ``run(group, group_rank, group_size)`` on groups of size 1 to 4 carved out of a world of 4.

    One spawned world instead of one per size (each process start costs seconds of CPU), and it exercises
    ``group=`` with group ranks that differ from global ranks: phase 1 runs the pairs [0, 1] and [2, 3]
    side by side, phase 2 the group [0] of one and the trio [1, 2, 3], phase 3 the default group (None).
    Every rank creates every group (``new_group`` is collective) before any phase starts.
    """
    assert dist.get_world_size() == 4
    phases = [[[0, 1], [2, 3]], [[0], [1, 2, 3]], [[0, 1, 2, 3]]]
    groups = {tuple(m): dist.new_group(m) for phase in phases[:2] for m in phase}
    for phase in phases:
        for members in phase:
            if rank in members:
                group = groups.get(tuple(members))  # None for the whole world: the default group
                run(group, members.index(rank), len(members))
        dist.barrier()


def _round_trip_ranks(rank, world):
    subgroup_phases(rank, lambda group, r, n: _round_trip_cases(group, r, n, _dist_cases(n)))


def _round_trip_cases(group, rank, n, cases):
    for i, case in enumerate(cases):
        torch.manual_seed(i)  # the same global tensor on every rank
        x = torch.randn(case["shape"]).to(case["dtype"])
        kw = dict(layout=case["layout"], dim=case["dim"], cu_seqlens=case["cu"], group=group)
        pos = local_positions(x.size(case["dim"]), group, layout=case["layout"], cu_seqlens=case["cu"])
        local = shard(x, **kw)
        assert torch.equal(local, x.index_select(case["dim"], pos)), case
        # shard of arange = the positions (the helper hfpatch uses for position ids agrees with shard)
        ar = torch.arange(x.size(case["dim"]))
        assert torch.equal(shard(ar, group, layout=case["layout"], dim=0, cu_seqlens=case["cu"]), pos), case
        local = local.detach().requires_grad_(True)
        full = unshard(local, **kw)
        assert torch.equal(full, x), case
        # backward: each rank weighs the gathered tensor differently; our gradient sums every rank's weight.
        weights = [torch.randn(x.shape, generator=torch.Generator().manual_seed(100 * i + r)) for r in range(n)]
        (full.float() * weights[rank]).sum().backward()
        want = sum(weights).index_select(case["dim"], pos).to(case["dtype"])
        # fp32: only the summation order differs from ours; bf16: the gradient itself is rounded to bf16.
        tol = 1e-6 if case["dtype"] == torch.float32 else 1e-2
        torch.testing.assert_close(local.grad, want, rtol=tol, atol=tol * 4, msg=lambda m: f"{case}: {m}")


def test_shard_unshard_round_trip_and_gradient_in_groups_of_1_to_4():
    run_world(4, _round_trip_ranks)
