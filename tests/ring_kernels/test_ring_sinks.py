"""Attention sinks (``sink=``, gpt-oss's ``s_aux``) in every ring variant against a float64 plain reference.

A sink is one learnable logit per query head that joins every query's softmax as an extra key whose value is
0. The reference is written here: softmax over [QK^T * scale (masked), sink] in float64 on the whole
(unsharded) sequence, the sink column dropped before multiplying by V; gradients (q, k, v and the sink) by
autograd. Each rank runs every case of a table (batch: ring, zigzag, stripe; packed documents: ring, zigzag,
llama3; causal, non-causal, sliding window) in one gloo world per world size, and compares its shard of out,
dq, dk, dv with the same shard of the reference, and the sum over ranks of its sink gradient (each rank's is
the partial sum over its own queries) with the reference's: max|err| / max|ref| within ring_kernels.tolerances'
fp32 kernel entries.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import ring_kernels as rk
from _dist import run_world
from ring_kernels.tolerances import assert_close, tolerance

_HEADS, _HEADS_K, _HEAD_DIM, _BATCH, _TOKENS = 4, 2, 16, 2, 32
_FP32_OUT, _FP32_GRAD = tolerance("kernel", torch.float32, "out"), tolerance("kernel", torch.float32, "grad")

_BATCH_FUNCTIONS = {"ring": rk.ring_attn_func, "zigzag": rk.zigzag_ring_attn_func, "stripe": rk.stripe_attn_func}
_VARLEN_FUNCTIONS = {"ring_varlen": rk.ring_attn_varlen_func, "zigzag_varlen": rk.zigzag_ring_attn_varlen_func,
                     "llama3": rk.llama3_attn_varlen_func}
_LAYOUTS = {"ring": "contiguous", "zigzag": "zigzag", "stripe": "stripe", "ring_varlen": "contiguous",
            "zigzag_varlen": "zigzag", "llama3": "contiguous"}
# Zigzag cuts every document into 2N chunks (N <= 4: lengths divide by 8); the others cross rank boundaries.
_DOCUMENTS = {"zigzag_varlen": [8, 16, 8], "ring_varlen": [5, 14, 13], "llama3": [5, 14, 13]}

_CASES = [  # (variant, causal, window)
    ("ring", False, (-1, -1)), ("ring", True, (-1, -1)), ("zigzag", True, (-1, -1)), ("stripe", True, (-1, -1)),
    ("ring", True, (3, 0)), ("zigzag", True, (5, 0)), ("stripe", True, (4, 0)), ("ring", False, (2, 3)),
    ("ring_varlen", True, (-1, -1)), ("ring_varlen", False, (-1, -1)), ("zigzag_varlen", True, (-1, -1)),
    ("llama3", True, (-1, -1)), ("llama3", False, (-1, -1)),
    ("ring_varlen", True, (3, 0)), ("zigzag_varlen", True, (3, 0)), ("llama3", True, (3, 0)),
]
# Four ranks (4 processes on CI's 2 cores): every variant once, causal and not, with and without a window.
_FOUR_RANK_CASES = [
    ("ring", False, (-1, -1)), ("zigzag", True, (-1, -1)), ("ring", True, (3, 0)), ("stripe", True, (4, 0)),
    ("ring_varlen", False, (-1, -1)), ("zigzag_varlen", True, (-1, -1)), ("llama3", True, (-1, -1)),
    ("zigzag_varlen", True, (3, 0)), ("llama3", True, (3, 0)),
]


# -------------------------------------------------------------------------------------------- reference


def _visible(causal: bool, window, documents=None) -> torch.Tensor:
    """(T, T) bool: query row i sees key column j (same document, causal, within the window)."""
    pos = torch.arange(_TOKENS)
    seen = torch.ones(_TOKENS, _TOKENS, dtype=torch.bool)
    if documents is not None:
        doc = torch.repeat_interleave(torch.arange(len(documents)), torch.tensor(documents))
        seen &= doc[:, None] == doc[None, :]
    if causal:
        seen &= pos[None, :] <= pos[:, None]
    if window[0] >= 0:
        seen &= pos[None, :] >= pos[:, None] - window[0]
    if window[1] >= 0:
        seen &= pos[None, :] <= pos[:, None] + window[1]
    return seen


def reference_with_sink(q, k, v, sink, visible, scale):
    """Plain attention with a sink column, float64: q (B, T, H, D), k, v (B, T, Hk, D), sink (H,)."""
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    scores = scores.masked_fill(~visible, float("-inf"))
    b, h, t, _ = scores.shape
    column = sink.view(1, h, 1, 1).expand(b, h, t, 1)
    probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
    return torch.einsum("bhqk,bkhd->bqhd", probs, v)


def _inputs(case_index: int, sink_dtype: torch.dtype = torch.float32):
    """Global q, k, v, dout (B, T, H|Hk, D) fp32 and the sink (H,), identical on every rank (packed documents
    use batch row 0)."""
    gen = torch.Generator().manual_seed(100 + case_index)
    q, k, v, dout = (torch.randn(_BATCH, _TOKENS, n, _HEAD_DIM, generator=gen)
                     for n in (_HEADS, _HEADS_K, _HEADS_K, _HEADS))
    # Sinks around the scores' scale, one strongly dominant head: every head's sink weight matters.
    sink = (torch.randn(_HEADS, generator=gen) * 1.5 + torch.tensor([0.0, 1.0, -1.0, 4.0])).to(sink_dtype)
    return q, k, v, dout, sink


def _reference_case(variant, causal, window, q, k, v, dout, sink):
    """Reference out and (dq, dk, dv, dsink), float64, global."""
    leaves = [x.double().requires_grad_(True) for x in (q, k, v, sink)]
    visible = _visible(causal, window, _DOCUMENTS.get(variant))
    out = reference_with_sink(*leaves, visible, _HEAD_DIM ** -0.5)
    grads = torch.autograd.grad(out, leaves, dout.double())
    return out.detach(), grads


# ---------------------------------------------------------------------------------------------- the ring


def _cu(variant):
    docs = _DOCUMENTS[variant]
    cu = torch.zeros(len(docs) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(docs), 0)
    return cu


def _ring_case(group, variant, causal, window, q, k, v, dout, sink):
    """This rank's out, (dq, dk, dv) shards and its own (partial) sink gradient."""
    layout = _LAYOUTS[variant]
    if variant in _BATCH_FUNCTIONS:
        local = [rk.shard(x, group, layout=layout, dim=1) for x in (q, k, v, dout)]
        fn, extra = _BATCH_FUNCTIONS[variant], ()
    else:                                           # one packed row of documents: (T, H, D)
        cu = _cu(variant)
        local = [rk.shard(x[0], group, layout=layout, dim=0, cu_seqlens=cu) for x in (q, k, v, dout)]
        fn, extra = _VARLEN_FUNCTIONS[variant], (cu,)
    leaves = [x.contiguous().requires_grad_(True) for x in local[:3]]
    sink_leaf = sink.clone().requires_grad_(True)
    out = fn(*leaves, *extra, group=group, causal=causal, window_size=window, sink=sink_leaf, backend="torch_cpu")
    out.backward(local[3])
    return out.detach(), [x.grad for x in leaves], sink_leaf.grad


def _shard_reference(group, variant, x):
    layout = _LAYOUTS[variant]
    if variant in _BATCH_FUNCTIONS:
        return rk.shard(x, group, layout=layout, dim=1)
    return rk.shard(x[0], group, layout=layout, dim=0, cu_seqlens=_cu(variant))


def _assert_close(got, want, what):
    """fp32 kernel vs float64 (ring_kernels.tolerances): out by the out entry, every gradient by the grad entry."""
    assert_close(got, want, _FP32_OUT if what.endswith(": out") else _FP32_GRAD, what)


def _world_cases(rank, world, cases):
    group = dist.group.WORLD
    for index, (variant, causal, window) in enumerate(cases):
        q, k, v, dout, sink = _inputs(index)
        if variant in _VARLEN_FUNCTIONS:            # one packed row
            q, k, v, dout = q[:1], k[:1], v[:1], dout[:1]
        out_ref, (dq_ref, dk_ref, dv_ref, dsink_ref) = _reference_case(variant, causal, window, q, k, v, dout, sink)
        out, (dq, dk, dv), dsink = _ring_case(group, variant, causal, window, q, k, v, dout, sink)
        what = f"rank {rank}/{world} {variant} causal={causal} window={window}"
        assert out.dtype == q.dtype and dsink.dtype == sink.dtype and dsink.shape == sink.shape, what
        for name, got, want in (("out", out, out_ref), ("dq", dq, dq_ref), ("dk", dk, dk_ref), ("dv", dv, dv_ref)):
            _assert_close(got, _shard_reference(group, variant, want), f"{what}: {name}")
        total = dsink.clone()
        dist.all_reduce(total, group=group)         # what a training step's gradient all-reduce does
        _assert_close(total, dsink_ref, f"{what}: d sink (sum over ranks)")


def _sink_options_world(rank, world):
    """A sink in another float dtype than q: its gradient comes back in the sink's dtype; a sink of -inf is no
    sink at all (same out, zero gradient); ranks that disagree on passing a sink all raise."""
    group = dist.group.WORLD
    q, k, v, dout, sink = _inputs(0, torch.bfloat16)
    out_ref, grads_ref = _reference_case("zigzag", True, (-1, -1), q, k, v, dout, sink)
    out, _, dsink = _ring_case(group, "zigzag", True, (-1, -1), q, k, v, dout, sink)
    _assert_close(out, _shard_reference(group, "zigzag", out_ref), "bf16 sink: out")
    assert dsink.dtype == torch.bfloat16
    total, magnitude = dsink.double(), dsink.double().abs()
    dist.all_reduce(total, group=group)
    dist.all_reduce(magnitude, group=group)
    # Each rank's partial is rounded once to bf16 (unit roundoff 2^-8: at most 2^-8 of its magnitude) on top of
    # the fp32 limit; the sum over ranks adds those bounds.
    bound = 2.0 ** -8 * magnitude + _FP32_GRAD.bound * grads_ref[3].abs().max()
    err = (total - grads_ref[3]).abs()
    assert bool((err <= bound).all()), f"bf16 d sink: error {err.tolist()} > bound {bound.tolist()}"

    local = [rk.shard(x, group, layout="zigzag", dim=1).contiguous() for x in (q, k, v)]
    none = torch.full((_HEADS,), float("-inf"), requires_grad=True)
    with_none = rk.zigzag_ring_attn_func(*local, group=group, sink=none, backend="torch_cpu")
    assert torch.equal(with_none, rk.zigzag_ring_attn_func(*local, group=group, backend="torch_cpu"))
    with_none.sum().backward()
    assert torch.equal(none.grad, torch.zeros(_HEADS))

    mine = sink.float() if rank == 0 else None
    with pytest.raises(rk.RingInputError, match="ranks disagree on sink") as info:
        rk.zigzag_ring_attn_func(*local, group=group, sink=mine, backend="torch_cpu")
    assert info.value.argument == "sink"


def _two_ranks(rank, world):
    _world_cases(rank, world, _CASES)
    _sink_options_world(rank, world)


def test_sinks_match_reference_on_two_ranks():
    """Every case, and the sink's dtype, a sink of -inf and the ranks' agreement (one world: start-up budget)."""
    run_world(2, _two_ranks)


def test_sinks_match_reference_on_four_ranks():
    run_world(4, _world_cases, _FOUR_RANK_CASES)


# ---------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("sink, error, match", [
    ([0.0] * _HEADS, TypeError, "sink must be a torch.Tensor"),
    (torch.zeros(_HEADS + 1), rk.RingInputError, r"sink has shape \(5,\); expected \(nheads,\) = \(4,\)"),
    (torch.zeros(1, _HEADS), rk.RingInputError, r"sink has shape \(1, 4\); expected \(nheads,\) = \(4,\)"),
    (torch.zeros(_HEADS, dtype=torch.int64), rk.RingInputError, "sink has dtype torch.int64; expected a floating"),
])
def test_bad_sink_is_refused_by_name(sink, error, match):
    q = torch.randn(1, 8, _HEADS, _HEAD_DIM)
    k = torch.randn(1, 8, _HEADS_K, _HEAD_DIM)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    calls = [lambda: rk.ring_attn_func(q, k, k, sink=sink), lambda: rk.zigzag_ring_attn_func(q, k, k, sink=sink),
             lambda: rk.stripe_attn_func(q, k, k, sink=sink),
             lambda: rk.ring_attn_varlen_func(q[0], k[0], k[0], cu, sink=sink),
             lambda: rk.zigzag_ring_attn_varlen_func(q[0], k[0], k[0], cu, sink=sink),
             lambda: rk.llama3_attn_varlen_func(q[0], k[0], k[0], cu, sink=sink)]
    for call in calls:
        with pytest.raises(error, match=match) as info:
            call()
        if error is rk.RingInputError:
            assert info.value.argument == "sink"
