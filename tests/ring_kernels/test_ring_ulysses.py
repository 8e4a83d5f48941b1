"""Ulysses (head-split) and USP (Ulysses x ring) attention against plain float64 attention, forward and backward.

The reference is written here: softmax(QK^T * scale) V in float64 on the whole (unsharded) sequence, with the
causal / window / document mask, softcap and a sink column, K/V heads repeated for GQA, gradients (q, k, v and
the sink) by autograd. One gloo world per world size (2 and 4) runs a table of cases -- layout x causal x GQA
(K/V heads divisible by the group or replicated) x window / softcap / sinks x batch / packed documents, and USP
on the 2 x 2 grid with every ring variant, its inputs sharded over the whole group (``ring_kernels.shard`` in
``usp_layout``) -- and compares each rank's shard of out, dq, dk, dv with the same shard of the reference, and
the sum over ranks of the sink gradient with the reference's, within the kernel entries of ring_kernels.tolerances.
The same worlds count the all-to-alls, run a kept checkpoint region, and check every refusal that needs a group;
on the grid, what the ring variant is given is exactly the ring shard of its layout over the ring group.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import ring_kernels as rk
from _dist import run_world
from ring_kernels import ulysses, usp
from ring_kernels.backends.base import BlockMask
from ring_kernels.backends.reference import ReferenceBackend
from ring_kernels.checkpointing import OutputKeeper
from ring_kernels.checkpointing import checkpoint as kept_checkpoint
from ring_kernels.layout import rank_positions
from ring_kernels.tolerances import assert_close, tolerance
from torch.utils.checkpoint import checkpoint

_LAYOUTS = ("contiguous", "zigzag", "stripe")


# -------------------------------------------------------------------------------------------- reference


def reference(q, k, v, sink, *, causal, scale, window=(-1, -1), softcap=0.0, documents=None):
    """Plain attention, float64: q (B, L, H, D), k, v (B, L, Hk, D), sink (H,) or None -> (B, L, H, D)."""
    b, length, h, _ = q.shape
    group = h // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    pos = torch.arange(length)
    seen = torch.ones(length, length, dtype=torch.bool)
    if documents is not None:
        doc = torch.repeat_interleave(torch.arange(len(documents)), torch.tensor(documents))
        seen &= doc[:, None] == doc[None, :]
    if causal:
        seen &= pos[None, :] <= pos[:, None]
    if window[0] >= 0:
        seen &= pos[None, :] >= pos[:, None] - window[0]
    if window[1] >= 0:
        seen &= pos[None, :] <= pos[:, None] + window[1]
    scores = scores.masked_fill(~seen, float("-inf"))
    if sink is not None:
        scores = torch.cat([scores, sink.view(1, h, 1, 1).expand(b, h, length, 1)], dim=-1)
    probs = torch.softmax(scores, dim=-1)[..., :length]
    return torch.einsum("bhqk,bkhd->bqhd", probs, v)


# ---------------------------------------------------------------------------------------------- cases


def make_case(variant="ulysses", layout="contiguous", causal=True, h=8, hk=2, d=16, dtype=torch.float32,
          backend="torch_cpu", **extra):
    return dict(variant=variant, layout=layout, causal=causal, h=h, hk=hk, d=d, dtype=dtype, backend=backend,
                **extra)


def documents_for(world: int):
    """Global document lengths, each a multiple of 2N (zigzag), one empty, crossing rank boundaries."""
    unit = 2 * world
    return [3 * unit, unit, 0, 2 * unit, unit]


def ulysses_cases(world: int):
    """Batch: layout x causal x (MHA | GQA with Hk % N == 0 | Hk % N != 0: replicated K/V heads); then bf16, the
    reference backend, a batch of one (the unpacking is a view), windows, softcap, sinks. Varlen: both layouts,
    causal and not, GQA, window, sink, the packed row, and the packed-document kernel path (a CPU stand-in)."""
    replicated = (6, 3) if world == 2 else (4, 1)      # Hk % N != 0 (and H % N == 0)
    cases = []
    for layout in _LAYOUTS:
        for causal in (True, False):
            for h, hk in ((4, 4), (8, 2), replicated):
                cases.append(make_case(layout=layout, causal=causal, h=h, hk=hk, seqlen_local=6))
        cases.append(make_case(layout=layout, window=(3, 0), seqlen_local=6))                       # causal window
        cases.append(make_case(layout=layout, causal=False, window=(2, 3), seqlen_local=6, h=replicated[0],
                           hk=replicated[1]))
        cases.append(make_case(layout=layout, sink=True, seqlen_local=4))
    cases += [
        make_case(dtype=torch.bfloat16, seqlen_local=8),
        make_case(layout="zigzag", dtype=torch.bfloat16, h=replicated[0], hk=replicated[1], seqlen_local=6),
        make_case(layout="stripe", backend="reference", causal=False, d=24, seqlen_local=5),
        make_case(layout="contiguous", batch=1, seqlen_local=6),
        make_case(layout="zigzag", batch=1, seqlen_local=6, causal=False),
        make_case(layout="zigzag", backend="auto", softcap=3.0, softmax_scale=0.3, seqlen_local=6),   # picks reference
        make_case(layout="stripe", window=(4, 0), sink=True, h=replicated[0], hk=replicated[1], seqlen_local=6),
    ]
    docs = documents_for(world)
    for layout in ("contiguous", "zigzag"):
        for causal in (True, False):
            cases.append(make_case("ulysses_varlen", layout, causal, documents=docs))
        cases.append(make_case("ulysses_varlen", layout, True, h=replicated[0], hk=replicated[1], documents=docs,
                           sink=True))
        cases.append(make_case("ulysses_varlen", layout, True, window=(3, 0), documents=docs, packed_row=True))
        cases.append(make_case("ulysses_varlen", layout, True, documents=docs, standin=True))
    cases.append(make_case("ulysses_varlen", "contiguous", False, documents=docs, standin=True, dtype=torch.bfloat16,
                       packed_row=True))
    cases.append(make_case("ulysses_varlen", "contiguous", True, documents=[5, 14, 13, 4], backend="reference",
                       softcap=2.0))                    # documents need not divide by 2N with 'contiguous'
    for i, case in enumerate(cases):
        case["seed"] = 1000 * world + i
    return cases


def usp_cases():
    """The 2 x 2 grid (Ulysses groups {0, 1}, {2, 3}; rings {0, 2}, {1, 3}), inputs sharded over all 4 ranks:
    every ring variant, causal and not, GQA with Hk % U == 0 and replicated, window, sink, a batch of one, packed
    documents (zigzag: each a multiple of 2N = 8; contiguous: documents crossing rank boundaries)."""
    cases = []
    for ring_variant, causal in (("zigzag", True), ("ring", True), ("ring", False)):
        for h, hk in ((8, 2), (4, 1)):
            cases.append(make_case("usp", ring_variant=ring_variant, causal=causal, h=h, hk=hk, seqlen_local=4))
    cases += [
        make_case("usp", ring_variant="zigzag", window=(5, 0), sink=True, seqlen_local=4),
        make_case("usp", ring_variant="ring", causal=False, window=(3, 2), seqlen_local=3, batch=1),
        make_case("usp", ring_variant="zigzag", sink=True, dtype=torch.bfloat16, seqlen_local=4),
        make_case("usp", ring_variant="zigzag", batch=1, h=4, hk=1, seqlen_local=6),
    ]
    docs = [8, 16, 0, 8, 8]                            # multiples of 2N = 8 (zigzag over the whole group)
    for ring_variant, causal in (("zigzag", True), ("ring", True), ("ring", False), ("llama3", True)):
        cases.append(make_case("usp_varlen", ring_variant=ring_variant, causal=causal, documents=docs))
    cases.append(make_case("usp_varlen", ring_variant="llama3", causal=False, h=4, hk=1, documents=docs, sink=True,
                       packed_row=True))
    cases.append(make_case("usp_varlen", ring_variant="zigzag", window=(3, 0), documents=docs, packed_row=True))
    cases.append(make_case("usp_varlen", ring_variant="llama3", documents=[5, 14, 13, 4]))
    for i, case in enumerate(cases):
        case["seed"] = 9000 + i
    return cases


# ---------------------------------------------------------------------------------------------- running


def build_grid(rank: int) -> usp.UspGroups:
    """The 2 x 2 grid of the default group, built by ring_kernels (Ulysses groups of consecutive ranks, {0, 1} and
    {2, 3}, rings {0, 2}, {1, 3}): the grid the kernel itself checks groups against, and this rank's place in it."""
    grid = rk.build_usp_groups(None, 2, 2)
    assert grid.grid == usp.UspGrid(4, rank, 2, rank % 2, 2, rank // 2), grid.grid
    assert usp.usp_grid("usp_attn_func", None, grid.ulysses_group, grid.ring_group) == grid.grid
    return grid


def _sharder(case, cu):
    """x (B, L, ...) global -> this rank's part along dim 1 (the case's layout; USP: its ring variant's layout over
    the whole group)."""
    layout = case.get("layout")
    if case["variant"].startswith("usp"):
        layout = rk.usp_layout(case["ring_variant"], varlen=cu is not None)
    return lambda x: rk.shard(x, layout=layout, dim=1, cu_seqlens=cu)


def _call(case, grid, local, cu, sink):
    options = dict(causal=case["causal"], backend=case["backend"], window_size=case.get("window", (-1, -1)),
                   softcap=case.get("softcap", 0.0), softmax_scale=case.get("softmax_scale"), sink=sink)
    variant = case["variant"]
    if variant.startswith("usp"):
        options.update(groups=grid, ring_variant=case["ring_variant"])   # no grid (no process group): one rank
    else:
        options["layout"] = case["layout"]
    fn = {"ulysses": rk.ulysses_attn_func, "ulysses_varlen": rk.ulysses_attn_varlen_func,
          "usp": rk.usp_attn_func, "usp_varlen": rk.usp_attn_varlen_func}[variant]
    return fn(*local, *((cu,) if cu is not None else ()), **options)


class DocumentKernel:
    """A CPU stand-in for torch's packed-document flash kernel (``torch_cuda_varlen.VarlenKernel``'s contract):
    every document of the segments through the reference block backend (aligned causal when ``seg.causal``), out
    (T, H, D) and lse (H, T); counts its calls, so a test can prove that one call served every document."""

    name = "document_standin"

    def __init__(self):
        self.forward_calls = self.backward_calls = 0
        self.block = ReferenceBackend()

    @staticmethod
    def _documents(seg):
        cu = seg.cu_q.tolist()
        return [slice(a, b) for a, b in zip(cu, cu[1:])]

    def forward(self, q, k, v, seg, *, scale):
        self.forward_calls += 1
        out, lse = torch.empty_like(q), torch.empty(q.shape[1], q.shape[0])
        for rows in self._documents(seg):
            o, l = self.block.forward(q[None, rows], k[None, rows], v[None, rows], scale=scale,
                                      mask=BlockMask(causal=seg.causal))
            out[rows], lse[:, rows] = o[0], l[0]
        return out, lse

    def backward(self, dout, q, k, v, out, lse, seg, *, scale):
        self.backward_calls += 1
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        for rows in self._documents(seg):
            grads = self.block.backward(dout[None, rows], q[None, rows], k[None, rows], v[None, rows],
                                        out[None, rows], lse[None, :, rows], scale=scale,
                                        mask=BlockMask(causal=seg.causal))
            dq[rows], dk[rows], dv[rows] = (g[0] for g in grads)
        return dq, dk, dv


class _StandinKernel:
    """Within the block, ulysses' packed-document kernel is ``kernel`` (None: unchanged)."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __enter__(self):
        self.saved = ulysses.varlen_kernel_for
        if self.kernel is not None:
            ulysses.varlen_kernel_for = lambda *args, **kwargs: self.kernel
        return self

    def __exit__(self, *exc):
        ulysses.varlen_kernel_for = self.saved


def run_case(rank: int, world: int, case: dict, grid=None, device="cpu") -> None:
    """One case on this rank: shard the global inputs, run on ``device``, compare out, dq, dk, dv and the summed
    d sink (inputs and the reference are made on the host)."""
    gen = torch.Generator().manual_seed(case["seed"])
    docs = case.get("documents")
    batch, length = (1, sum(docs)) if docs else (case.get("batch", 2), case["seqlen_local"] * world)
    h, hk, d, dtype = case["h"], case["hk"], case["d"], case["dtype"]
    q, k, v, dout = (torch.randn(batch, length, n, d, generator=gen).to(dtype) for n in (h, hk, hk, h))
    sink = (torch.randn(h, generator=gen) * 1.5 + 1.0) if case.get("sink") else None
    leaves = [x.double().requires_grad_() for x in (q, k, v)] + ([sink.double().requires_grad_()] if sink is not None
                                                                 else [])
    scale = case.get("softmax_scale") or d ** -0.5
    ref = reference(*leaves[:3], leaves[3] if sink is not None else None, causal=case["causal"], scale=scale,
                    window=case.get("window", (-1, -1)), softcap=case.get("softcap", 0.0), documents=docs)
    ref_grads = torch.autograd.grad(ref, leaves, dout.double())

    cu = None
    if docs:
        cu = torch.zeros(len(docs) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(torch.tensor(docs), 0)
    sharded = _sharder(case, cu)
    row = (lambda x: x) if (not docs or case.get("packed_row")) else (lambda x: x[0])   # noqa: E731
    part = lambda x: row(sharded(x))  # noqa: E731
    local = [part(x).to(device).contiguous().requires_grad_() for x in (q, k, v)]
    sink_leaf = sink.clone().to(device).requires_grad_() if sink is not None else None
    standin = DocumentKernel() if case.get("standin") else None
    with _StandinKernel(standin):
        out = _call(case, grid, local, cu.to(device) if cu is not None else None, sink_leaf)
        out.backward(part(dout).to(device))
    if standin is not None:                          # every document in one call, forward and backward
        assert (standin.forward_calls, standin.backward_calls) == (1, 1), case
    where = f"rank {rank}/{world} {case}"
    assert out.dtype == dtype and out.shape == local[0].shape, where
    for name, got, want in (("out", out, ref), *zip(("dq", "dk", "dv"), (x.grad for x in local), ref_grads)):
        assert torch.isfinite(got).all(), f"{name} has NaN/Inf: {where}"
        assert_close(got.cpu(), part(want), tolerance("kernel", dtype, "out" if name == "out" else "grad"),
                     f"{where}: {name}")
    if sink is not None:
        total = sink_leaf.grad.double()
        if dist.is_initialized():
            dist.all_reduce(total)                       # each rank's is the part of its heads and queries
        assert_close(total.cpu(), ref_grads[3], tolerance("kernel", dtype, "grad"), f"{where}: d sink")


# ------------------------------------------------------------------------------- counts and checkpointing


class _CountingAllToAll:
    """Within the block, every all-to-all of ``ring_kernels.ulysses`` is counted: (send shape, dtype)."""

    def __enter__(self):
        self.calls, self.saved = [], ulysses.all_to_all_single

        def counting(output, input, *args, **kwargs):
            self.calls.append((tuple(input.shape), input.dtype))
            return self.saved(output, input, *args, **kwargs)

        ulysses.all_to_all_single = counting
        return self

    def __exit__(self, *exc):
        ulysses.all_to_all_single = self.saved


def _all_to_all_counts(rank: int, world: int) -> None:
    """4 all-to-alls forward (q, k, v, out) and 4 backward, each of the local tensor's size (K/V heads times their
    replication); a group of one makes none."""
    b, s, d = 2, 4, 16
    for h, hk in ((8, 2), (6, 3) if world == 2 else (4, 1)):
        replicas = ulysses.kv_replication(h, hk, world)
        q = torch.randn(b, s, h, d, requires_grad=True)
        k, v = (torch.randn(b, s, hk, d, requires_grad=True) for _ in range(2))
        with _CountingAllToAll() as counted:
            out = rk.ulysses_attn_func(q, k, v, causal=True, layout="zigzag", backend="torch_cpu")
            forward = list(counted.calls)
            torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
        shape = lambda heads: (world, b, s, heads // world, d)   # noqa: E731
        kv = shape(hk * replicas)
        assert forward == [(shape(h), q.dtype), (kv, q.dtype), (kv, q.dtype), (shape(h), q.dtype)], (rank, forward)
        assert counted.calls[4:] == [(shape(h), q.dtype), (shape(h), q.dtype), (kv, q.dtype), (kv, q.dtype)], \
            (rank, counted.calls)
    if world == 2:
        groups = [dist.new_group([0]), dist.new_group([1])]     # every rank makes every group, in one order
        q = torch.randn(1, 4, 4, 16, requires_grad=True)
        with _CountingAllToAll() as counted:
            out = rk.ulysses_attn_func(q, q, q, group=groups[rank], backend="torch_cpu")
            out.sum().backward()
        assert counted.calls == [], counted.calls


def _kept_checkpoint(rank: int, world: int) -> None:
    """In a kept checkpoint region the recomputation takes the forward's out and lse (the attention is not run
    again; the all-to-alls are), and the gradients are those of plain checkpointing, bit for bit."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 6, n, 16, generator=gen, requires_grad=True) for n in (8, 2, 2))
    def layer(q, k, v):
        return rk.ulysses_attn_func(q, k, v, causal=True, layout="zigzag", backend="torch_cpu") * 2

    keeper = OutputKeeper(None)
    kept = kept_checkpoint(layer, q, k, v, keeper=keeper, use_reentrant=False)
    grads = torch.autograd.grad(kept.sum(), (q, k, v))
    plain = checkpoint(layer, q, k, v, use_reentrant=False)
    for got, want in zip(grads, torch.autograd.grad(plain.sum(), (q, k, v))):
        assert torch.equal(got, want), rank
    assert keeper.stats()["kept"] == keeper.stats()["replayed"] == 1, keeper.stats()


# ------------------------------------------------------------------------------------------ refusals


def _refused(rank, call, match, argument):
    with pytest.raises(rk.RingInputError, match=match) as info:
        call()
    assert info.value.argument == argument, (rank, info.value.argument)


def _refusals_in_a_group(rank: int, world: int, grid) -> None:
    """Refusals that need a group (every rank raises the same error, none waits in a collective)."""
    x = torch.randn(1, 6, 6 if world == 4 else 3, 16)
    _refused(rank, lambda: rk.ulysses_attn_func(x, x, x), rf"nheads={x.shape[2]} is not divisible by the size of "
             rf"group, {world}; .*ring variant", "nheads")
    odd = torch.randn(1, 5, 8, 16)
    _refused(rank, lambda: rk.ulysses_attn_func(odd, odd, odd, layout="zigzag"),
             r"seqlen_local=5; layout='zigzag' holds two chunks per rank", "q")
    cu = torch.tensor([0, 2 * world + 2, 4 * world], dtype=torch.int32)      # document 0 not a multiple of 2N
    y = torch.randn(4, 8, 16)
    _refused(rank, lambda: rk.ulysses_attn_varlen_func(y, y, y, cu, layout="zigzag"),
             rf"document 0 of cu_seqlens .* not divisible by 2 x world_size = {2 * world}", "cu_seqlens")
    if grid is not None:
        z = torch.randn(1, 4, 8, 16)
        ug, rg = grid.ulysses_group, grid.ring_group
        _refused(rank, lambda: rk.usp_attn_func(z, z, z, ulysses_group=ug, ring_group=ug),
                 rf"ring_group holds the ranks \[{rank // 2 * 2}, {rank // 2 * 2 + 1}\] of group .* belongs to the "
                 rf"ring_group of ranks \[{rank % 2}, {rank % 2 + 2}\]", "ring_group")
        _refused(rank, lambda: rk.usp_attn_func(z, z, z, ulysses_group=rg, ring_group=ug),
                 r"ulysses_group holds the ranks .* Ulysses groups are 2 consecutive ranks of group", "ulysses_group")
        _refused(rank, lambda: rk.usp_attn_func(z, z, z, ulysses_group=dist.group.WORLD, ring_group=rg),
                 r"ulysses_group has 4 ranks and ring_group 2, 4 x 2 = 8, but group has 4", "ring_group")
        _refused(rank, lambda: rk.usp_attn_func(z, z, z, ulysses_group=ug, ring_group=rg, group=ug),
                 r"but group has 2", "ring_group")
        _refused(rank, lambda: rk.usp_attn_func(z, z, z, groups=grid, ring_group=rg),
                 r"groups= carries group, ulysses_group and ring_group", "groups")
        _refused(rank, lambda: rk.usp_attn_varlen_func(z[0], z[0], z[0], torch.tensor([0, 4, 16], dtype=torch.int32),
                                                       ulysses_group=ug, ring_group=rg),
                 r"document 0 of cu_seqlens .* not divisible by 2 x world_size = 8", "cu_seqlens")
        w = torch.randn(1, 4, 3, 16)
        _refused(rank, lambda: rk.usp_attn_func(w, w, w, groups=grid),
                 r"nheads=3 is not divisible by the size of ulysses_group, 2", "nheads")


class _RecordingRing:
    """Within the block, USP's ``ring_variant`` is a stand-in that records the positions it is given (written
    into q's values) and returns zeros."""

    def __init__(self, ring_variant: str, varlen: bool):
        self.table = usp.VARLEN_RING_VARIANTS if varlen else usp.RING_VARIANTS
        self.ring_variant, self.positions = ring_variant, None

    def __enter__(self):
        self.saved = self.table[self.ring_variant]

        def ring_fn(q, k, v, *extra, **options):
            self.positions = q[0, :, 0, 0].tolist()
            return torch.zeros_like(q)

        self.table[self.ring_variant] = (ring_fn, *self.saved[1:])
        return self

    def __exit__(self, *exc):
        self.table[self.ring_variant] = self.saved


def _usp_gathers_the_ring_shard(rank: int, grid: usp.UspGroups) -> None:
    """Inputs sharded over the 4 ranks in the ring variant's layout: on ring rank r (rank // 2), the ring variant
    is given exactly ring rank r's shard of that layout over the 2 ring ranks, in its local order (positions
    written into q here), batch and packed. Zigzag over 4 ranks, 8 chunks of 4: ranks 0, 1 hold chunks 0, 7 and
    1, 6, which are the 4-chunks 0 and 3 of the zigzag over the ring (tokens 0-7 and 24-31)."""
    length, ring_rank = 32, rank // 2
    zigzag = {0: list(range(8)) + list(range(24, 32)), 1: list(range(8, 24))}
    x = torch.arange(float(length)).view(1, length, 1, 1).expand(1, length, 2, 4)
    cu = torch.tensor([0, 16, 16, 32], dtype=torch.int32)             # documents of 2N x 2 tokens, one empty
    groups = dict(ulysses_group=grid.ulysses_group, ring_group=grid.ring_group)   # checked by the call
    for ring_variant, varlen in (("zigzag", False), ("ring", False), ("zigzag", True), ("llama3", True)):
        layout = rk.usp_layout(ring_variant, varlen=varlen)
        with _RecordingRing(ring_variant, varlen) as recorded:
            if varlen:
                local = rk.shard(x[0], layout=layout, dim=0, cu_seqlens=cu)
                rk.usp_attn_varlen_func(local, local, local, cu, ring_variant=ring_variant, **groups)
            else:
                local = rk.shard(x, layout=layout, dim=1)
                rk.usp_attn_func(local, local, local, ring_variant=ring_variant, **groups)
        want = rank_positions(length, ring_rank, 2, layout=layout, cu_seqlens=cu if varlen else None).tolist()
        assert recorded.positions == want, (rank, ring_variant, varlen, recorded.positions)
        if layout == "zigzag" and not varlen:
            assert want == zigzag[ring_rank]


def _world(rank: int, world: int, cases) -> None:
    grid = build_grid(rank) if world == 4 else None
    if grid is not None:
        _usp_gathers_the_ring_shard(rank, grid)
    for case in cases:
        run_case(rank, world, case, grid)
    _all_to_all_counts(rank, world)
    _refusals_in_a_group(rank, world, grid)
    if world == 2:
        _kept_checkpoint(rank, world)


# -------------------------------------------------------------------------------------------- tests


def test_ulysses_on_two_ranks():
    run_world(2, _world, ulysses_cases(2))


def test_ulysses_and_usp_on_four_ranks():
    """Ulysses over 4 ranks (a covering subset of the 2-rank table) and USP on the 2 x 2 grid."""
    subset = [c for i, c in enumerate(ulysses_cases(4)) if i % 3 == 0 or c.get("sink") or c.get("standin")]
    run_world(4, _world, subset + usp_cases())


def test_world_of_one_is_plain_attention():
    """No process group: Ulysses and USP are plain attention over the whole sequence, without an all-to-all."""
    cases = ulysses_cases(1)[::4] + usp_cases()[::3]
    with _CountingAllToAll() as counted:
        for case in cases:
            run_case(0, 1, case)
    assert counted.calls == []


@pytest.mark.parametrize("nheads, nheads_k, world, replicas", [
    (8, 2, 2, 1), (8, 8, 4, 1), (6, 3, 2, 2), (8, 2, 4, 2), (4, 1, 4, 4), (12, 3, 4, 4), (16, 4, 8, 2),
    (24, 6, 4, 2), (32, 8, 16, 2),
])
def test_kv_replication(nheads, nheads_k, world, replicas):
    """N / gcd(Hk, N) replicas: every rank's H / N query heads read whole replicated K/V heads."""
    assert ulysses.kv_replication(nheads, nheads_k, world) == replicas
    group = nheads // nheads_k
    per_rank_q, per_rank_kv = nheads // world, nheads_k * replicas // world
    for rank in range(world):
        needed = {q // group for q in range(rank * per_rank_q, (rank + 1) * per_rank_q)}
        sent = {kv // replicas for kv in range(rank * per_rank_kv, (rank + 1) * per_rank_kv)}
        assert needed == sent, (rank, needed, sent)


_Q, _K = torch.randn(1, 8, 4, 16), torch.randn(1, 8, 2, 16)
_CU = torch.tensor([0, 3, 8], dtype=torch.int32)


@pytest.mark.parametrize("call, match, argument", [
    (lambda: rk.ulysses_attn_func(_Q, _K, _K, layout="diagonal"), r"layout='diagonal' is not a layout; expected "
     r"one of \('contiguous', 'zigzag', 'stripe'\)", "layout"),
    (lambda: rk.ulysses_attn_varlen_func(_Q[0], _K[0], _K[0], _CU, layout="stripe"),
     r"layout='stripe' has no varlen form .* 'contiguous' or 'zigzag'", "layout"),
    (lambda: rk.ulysses_attn_func(_Q, _K, _K, dropout_p=0.1), r"dropout_p=0.1; .* pass 0.0", "dropout_p"),
    (lambda: rk.ulysses_attn_varlen_func(_Q[0], _K[0], _K[0], _CU, dropout_p=0.5), r"dropout_p=0.5", "dropout_p"),
    (lambda: rk.ulysses_attn_func(_Q, _K, _K, sink=torch.zeros(3)), r"sink has shape \(3,\); expected "
     r"\(nheads,\) = \(4,\)", "sink"),
    (lambda: rk.ulysses_attn_func(_Q, _K, _K, window_size=(-2, 0)), r"each side must be >= 0 or -1", "window_size"),
    (lambda: rk.usp_attn_func(_Q, _K, _K, ulysses_group=None, ring_group=None, ring_variant="llama3"),
     r"ring_variant='llama3' is not one of \('ring', 'zigzag'\) \('llama3' exists only with cu_seqlens\)",
     "ring_variant"),
    (lambda: rk.usp_attn_func(_Q, _K, _K, ulysses_group=None, ring_group=None, ring_variant="stripe"),
     r"ring_variant='stripe' cannot run across Ulysses groups: a stripe over the whole group is not a stripe over "
     r"the ring group .* use ring_variant='zigzag'", "ring_variant"),
    (lambda: rk.usp_attn_varlen_func(_Q[0], _K[0], _K[0], _CU, ulysses_group=None, ring_group=None,
                                     ring_variant="stripe"),
     r"ring_variant='stripe' cannot run across Ulysses groups", "ring_variant"),
    (lambda: rk.usp_attn_func(_Q, _K, _K, ulysses_group=None, ring_group=None, causal=False),
     r"causal=False is not supported .* use ring_variant='ring'", "causal"),
    (lambda: rk.usp_attn_func(_Q, _K, _K, ulysses_group=None, ring_group=None, dropout_p=0.2), r"dropout_p=0.2",
     "dropout_p"),
    (lambda: rk.build_usp_groups(None, 2, 2), r"ulysses=2 x ring=2 is not a grid of the group's 1 ranks; .* one of "
     r"1 x 1", "ulysses"),
])
def test_refused_by_name(call, match, argument):
    with pytest.raises(rk.RingInputError, match=match) as info:
        call()
    assert info.value.argument == argument


def test_what_the_backend_cannot_do_is_refused_not_dropped():
    """softcap on aten's CPU kernel: the backend's refusal names softcap (nothing computed without it); 'auto'
    picks a backend that can."""
    for call in (lambda **kw: rk.ulysses_attn_func(_Q, _K, _K, **kw),
                 lambda **kw: rk.ulysses_attn_varlen_func(_Q[0], _K[0], _K[0], _CU, **kw)):
        with pytest.raises(ValueError, match="softcap is not supported by aten's CPU flash kernel"):
            call(softcap=2.0, backend="torch_cpu")
        assert torch.isfinite(call(softcap=2.0, backend="auto")).all()
