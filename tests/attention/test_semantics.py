"""``hfpatch.attention.semantics.ring_attention`` / ``whole.reference_attention`` called the way the generated wrapper calls them
(HF-style roles, q/k/v (B, S_local, H, D)), against plain attention on the whole sequence written here in float64,
forward and gradients; plus the refusals and the input helpers.

Tolerance (fp32): max |err| <= 2e-5 x max |ref| (scale-relative). The ring merges blocks through an fp32
log-sum-exp, so it differs from one fp32 softmax by a few ulps of the largest values; 2e-5 is ~100 ulps of fp32
at the tensor's scale and far below any semantic error (a wrong mask or window moves outputs by ~1e-1).
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from _dist import run_world
from hfpatch import version_gates
from hfpatch.attention import context, refusals, step as step_stage, whole
from hfpatch.attention import plan as plan_stage
from hfpatch.errors import UnsupportedArgument
from hfpatch.inputs import reduce_loss, shard_inputs, shift_labels, token_loss_sum
from hfpatch.attention.context import RingContext, parse_kernel
from hfpatch.attention.kernel_choice import plan_step
from hfpatch.attention.semantics import ring_attention
from hfpatch.attention.whole import reference_attention
from ring_kernels.layout import local_positions

RTOL = 2e-5

# transformers < 4.56 gave flash-attn window_size (w, w) for sliding_window w (one key more than eager's window);
# the ring must match the installed release's flash path.
_INSTALLED = version_gates.installed_transformers_version()
_WINDOW_EXTRA = 0 if _INSTALLED is None or _INSTALLED >= version_gates.TRANSFORMERS_SLIDING_WINDOW_INCLUSIVE else 1


# ------------------------------------------------------------------------------------------ reference


def _expected(q, k, v, *, causal, scale=None, window=None, softcap=None, docs=None, sink=None):
    """Plain attention in float64, one document at a time. ``window`` is HF's sliding_window (a window of that many
    tokens including the current one, transformers >= 4.56); docs: list of document lengths (one row); sink (H,):
    attention sinks as HF's eager sink attention (gpt-oss) computes them -- one more logit per head in every row's
    softmax, dropped after it."""
    q, k, v = (t.double() for t in (q, k, v))
    heads, dim = q.shape[2], q.shape[3]
    k = k.repeat_interleave(heads // k.shape[2], dim=2)
    v = v.repeat_interleave(heads // v.shape[2], dim=2)
    bounds = [(0, q.shape[1])] if docs is None else [
        (sum(docs[:i]), sum(docs[: i + 1])) for i in range(len(docs))]
    out = torch.zeros_like(q)
    for lo, hi in bounds:
        s = torch.einsum("bqhd,bkhd->bhqk", q[:, lo:hi], k[:, lo:hi]) * (scale if scale else dim ** -0.5)
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        i = torch.arange(hi - lo)
        ok = torch.ones(hi - lo, hi - lo, dtype=torch.bool)
        if causal:
            ok &= i[None, :] <= i[:, None]
        if window is not None:
            ok &= (i[:, None] - i[None, :]).abs() < window + _WINDOW_EXTRA
        s = s.masked_fill(~ok, float("-inf"))
        if sink is not None:
            column = sink.double().reshape(1, -1, 1, 1).expand(s.shape[0], -1, s.shape[2], 1)
            probs = torch.softmax(torch.cat([s, column], -1), -1)[..., :-1]
        else:
            probs = torch.softmax(s, -1)
        out[:, lo:hi] = torch.einsum("bhqk,bkhd->bqhd", probs, v[:, lo:hi])
    return out


def _close(name, got, want):
    err = (got.double() - want.double()).abs().max().item()
    scale = want.double().abs().max().item()
    assert err <= RTOL * max(scale, 1e-6), f"{name}: max err {err:.3e} vs scale {scale:.3e}"


def hf_call(q, k, v, *, causal=True, position_ids=None, scale=None, window=None, softcap=None, **more):
    """The roles dict the generated wrapper builds for transformers 5.23 (S7), for an fp32 model (target_dtype: the
    dtype of its Linear weights, what 5.23's ``get_target_dtype`` gives for an fp32 query outside autocast)."""
    call = dict(query=q, key=k, value=v, attention_mask=None, query_length=q.shape[1], is_causal=causal,
                dropout=0.0, position_ids=position_ids, softmax_scale=scale, sliding_window=window,
                use_top_left_mask=False, softcap=softcap, deterministic=None, cu_seq_lens_q=None, cu_seq_lens_k=None,
                max_length_q=None, max_length_k=None, target_dtype=torch.float32, implementation="flash_attention_2",
                block_table=None, k_cache=None, v_cache=None)
    call.update(more)
    return call


# ------------------------------------------------------------------------------------- distributed cases

# (name, variant, batch?, causal, window, softcap, scale, mode) -- mode: "shard_inputs" (layout from the helper),
# "derived" (contiguous chunks + HF's position_ids), "cu" (contiguous chunks + global cu_seq_lens kwargs)
_DOCS = [5, 11, 1, 7, 8]  # packed row of 32 tokens: uneven, a length-1 document, documents crossing ranks
_CASES = [
    ("zigzag causal GQA", "auto", "batch", True, None, None, None, "shard_inputs"),
    ("zigzag window+softcap", "zigzag", "batch", True, 6, 5.0, None, "shard_inputs"),
    ("stripe causal scale", "stripe", "batch", True, None, None, 0.3, "shard_inputs"),
    ("ring non-causal", "ring", "batch", False, None, None, None, "shard_inputs"),
    ("zigzag layout non-causal", "zigzag", "batch", False, None, None, None, "shard_inputs"),
    ("derived batch window", "auto", "batch", True, 5, None, None, "derived"),
    ("packed llama3", "auto", "packed", True, None, None, None, "shard_inputs"),
    ("packed ring varlen window", "ring", "packed", True, 4, 3.0, None, "shard_inputs"),
    ("packed derived from position_ids", "auto", "packed", True, None, None, None, "derived"),
    ("packed from global cu_seq_lens", "auto", "packed", True, None, None, None, "cu"),
]


def _global_tensors(packed: bool, seed: int, docs=_DOCS):
    g = torch.Generator().manual_seed(seed)
    batch, seq = (1, sum(docs)) if packed else (2, 32)
    q = torch.randn(batch, seq, 4, 8, generator=g)
    k = torch.randn(batch, seq, 2, 8, generator=g)
    v = torch.randn(batch, seq, 2, 8, generator=g)
    dout = torch.randn(batch, seq, 4, 8, generator=g)
    if packed:
        pos = torch.cat([torch.arange(n) for n in docs]).unsqueeze(0)
    else:
        pos = torch.arange(seq).unsqueeze(0)
    return q, k, v, dout, pos


# The same forms with attention sinks (``s_aux``): every kernel variant, batch and packed, every source of the layout.
SINK_CASES = [
    ("sinks zigzag causal GQA", "auto", "batch", True, None, None, None, "shard_inputs"),
    ("sinks zigzag window+softcap", "zigzag", "batch", True, 6, 5.0, None, "shard_inputs"),
    ("sinks stripe causal scale", "stripe", "batch", True, None, None, 0.3, "shard_inputs"),
    ("sinks ring non-causal", "ring", "batch", False, None, None, None, "shard_inputs"),
    ("sinks derived batch window", "auto", "batch", True, 5, None, None, "derived"),
    ("sinks packed llama3", "auto", "packed", True, None, None, None, "shard_inputs"),
    ("sinks packed ring varlen window", "ring", "packed", True, 4, 3.0, None, "shard_inputs"),
    ("sinks packed zigzag varlen", "zigzag", "packed", True, None, None, None, "shard_inputs"),
    ("sinks packed from global cu_seq_lens", "auto", "packed", True, None, None, None, "cu"),
]
# The zigzag layout splits every document into 2 x world chunks: documents of a multiple of 4 tokens (2 ranks).
_CASE_DOCS = {"sinks packed zigzag varlen": [8, 12, 4, 8]}


def _run_case(case, fn, rank, world):
    name, variant, kind, causal, window, softcap, scale, mode = case
    with_sink = name.startswith("sinks ")
    packed = kind == "packed"
    docs = _CASE_DOCS.get(name, _DOCS)
    q, k, v, dout, pos = _global_tensors(packed, seed=sum(map(ord, name)), docs=docs)
    ctx = RingContext(group=None, rank=rank, world_size=world, variant=variant)
    batch, seq = q.shape[:2]
    extra = {}
    if mode == "shard_inputs":
        local = shard_inputs(ctx, torch.zeros(batch, seq, dtype=torch.long), position_ids=pos)
        index = semantics_index(ctx, seq, pos)
        local_pos = local["position_ids"]
    else:  # the user split the rows contiguously and passes HF's own arguments
        per = seq // world
        index = torch.arange(rank * per, (rank + 1) * per)
        local_pos = pos[:, index]
    sink = torch.randn(q.shape[2], generator=torch.Generator().manual_seed(len(name))) if with_sink else None
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v) + ((sink,) if with_sink else ())]
    ql, kl, vl = (t.index_select(1, index) for t in leaves[:3])
    if with_sink:
        extra = {"s_aux": leaves[3]}
    more = {}
    if mode == "cu":
        cu = torch.tensor([0] + list(torch.tensor(docs).cumsum(0)), dtype=torch.int32)
        more = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(docs), max_length_k=max(docs))
        local_pos = None
    call = hf_call(ql, kl, vl, causal=causal, position_ids=local_pos, scale=scale, window=window, softcap=softcap, **more)
    out = fn(call, extra, ctx)
    assert out.shape == ql.shape and out.dtype == ql.dtype
    (out * dout.index_select(1, index)).sum().backward()
    grads = [t.grad.clone() for t in leaves]
    for g in grads:
        dist.all_reduce(g)  # each rank holds the gradient of its own slice's outputs: sum them
    ref_leaves = [t.clone().double().requires_grad_(True) for t in (q, k, v) + ((sink,) if with_sink else ())]
    want = _expected(*ref_leaves[:3], causal=causal, scale=scale, window=window, softcap=softcap,
                     docs=docs if packed else None, sink=ref_leaves[3] if with_sink else None)
    (want * dout.double()).sum().backward()
    _close(f"{name} [{fn.__name__}] out", out, want.index_select(1, index))
    for label, got, ref in zip(("q", "k", "v", "s_aux"), grads, ref_leaves):
        _close(f"{name} [{fn.__name__}] d{label}", got, ref.grad)


def semantics_index(ctx, seq, pos):
    """The global token indices this rank holds for the step shard_inputs just recorded."""
    step = ctx.step
    return local_positions(seq, ctx.group, layout=step.layout, cu_seqlens=step.cu_seqlens)


_FUNCTIONS = {"ring_attention": ring_attention, "reference_attention": reference_attention,
              "local_attention": whole.local_attention}


def cases_world(rank, world, cases, fns):
    torch.manual_seed(0)
    for fn_name in fns:
        fn = _FUNCTIONS[fn_name]
        for case in cases:
            _run_case(case, fn, rank, world)


def _collective_counting_world(rank, world):
    """The state of a step without shard_inputs is derived once (one all-gather), not once per layer."""
    calls = []
    original = step_stage.global_cu_from_position_ids

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    step_stage.global_cu_from_position_ids = counting
    try:
        q, k, v, _, pos = _global_tensors(packed=True, seed=3)
        per = q.shape[1] // world
        index = torch.arange(rank * per, (rank + 1) * per)
        local_pos = pos[:, index]
        ctx = RingContext(rank=rank, world_size=world)
        for _layer in range(4):  # HF passes the same position_ids tensor to every layer
            ring_attention(hf_call(*(t[:, index] for t in (q, k, v)), position_ids=local_pos), {}, ctx)
        assert len(calls) == 1, f"derived the packing {len(calls)} times for 4 layers of one step"
        new_step_pos = local_pos.clone()
        ring_attention(hf_call(*(t[:, index] for t in (q, k, v)), position_ids=new_step_pos), {}, ctx)
        assert len(calls) == 2, "a new position_ids tensor (a new step) must be derived again"
    finally:
        step_stage.global_cu_from_position_ids = original


def _two_rank_world(rank, world, cases, fns):
    cases_world(rank, world, cases, fns)
    _shard_and_loss_world(rank, world)
    _collective_counting_world(rank, world)


def test_semantics_2_ranks():
    """One world (spawning costs seconds): ring and reference attention vs plain attention for every case, with
    and without attention sinks (forward, dq/dk/dv and d s_aux summed over the ranks), shard_inputs/reduce_loss,
    and one derivation of the packing per step."""
    run_world(2, _two_rank_world, _CASES + SINK_CASES, ["ring_attention", "reference_attention"])


# The same cases on 4 ranks run inside the 4-rank world of test_e2e_models (one world fewer to spawn).
CASES_4_RANKS = [c for c in _CASES if c[0] in ("zigzag window+softcap", "packed llama3", "derived batch window",
                                               "packed from global cu_seq_lens")]


# ------------------------------------------------------------------------------------------ single process


def _local_ctx():
    return RingContext(rank=0, world_size=1)


def _qkv(batch=1, seq=8):
    g = torch.Generator().manual_seed(1)
    return (torch.randn(batch, seq, 4, 8, generator=g), torch.randn(batch, seq, 2, 8, generator=g),
            torch.randn(batch, seq, 2, 8, generator=g))


@pytest.mark.parametrize("role, value, words", [
    ("attention_mask", torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0]]), "padding mask"),
    ("dropout", 0.1, "dropout"),
    ("block_table", torch.zeros(1, 4, dtype=torch.int32), "paged KV cache"),
    ("k_cache", torch.zeros(2, 4, 2, 8), "paged KV cache"),
    ("sliding_window", 0, "positive int"),
    ("softcap", -1.0, ">= 0"),
])
def test_refusals_name_the_parameter_value_reason_and_fix(role, value, words):
    q, k, v = _qkv()
    with pytest.raises(UnsupportedArgument) as info:
        ring_attention(hf_call(q, k, v, **{role: value}), {}, _local_ctx())
    err = info.value
    assert err.parameter == role and err.value is value
    assert words in err.reason
    assert isinstance(err, ValueError) and role in str(err)
    if role in ("attention_mask", "dropout", "block_table", "k_cache"):
        assert err.fix, "a refusal of something a user can change must say how"


@pytest.mark.parametrize("name, value", [("cache", object()), ("cache_seqlens", torch.zeros(1))])
def test_refused_kwargs(name, value):
    q, k, v = _qkv()
    with pytest.raises(UnsupportedArgument) as info:
        ring_attention(hf_call(q, k, v), {name: value}, _local_ctx())
    assert info.value.parameter == name


@pytest.mark.parametrize("value, words", [
    (torch.zeros(2), "expected (num_heads,) = (4,)"),      # one per K/V head, not per query head
    (torch.zeros(1, 4), "expected (num_heads,) = (4,)"),
    (torch.zeros(4, dtype=torch.long), "floating dtype"),
    ([0.0] * 4, "must be a tensor"),
])
@pytest.mark.parametrize("fn", [ring_attention, reference_attention, whole.local_attention])
def test_malformed_sinks_are_refused_by_name(fn, value, words):
    q, k, v = _qkv()
    with pytest.raises(UnsupportedArgument, match=r"s_aux") as info:
        fn(hf_call(q, k, v), {"s_aux": value}, _local_ctx())
    assert info.value.parameter == "s_aux" and info.value.value is value and words in info.value.reason


@pytest.mark.parametrize("fn", [ring_attention, reference_attention, whole.local_attention])
@pytest.mark.parametrize("packed", [False, True])
def test_sinks_in_a_world_of_one_and_in_local_mode(fn, packed):
    """Every mode honours the sinks exactly as HF's eager sink attention: forward and the gradients of q, k, v and
    the sinks, batch and a packed row (documents told by position_ids)."""
    q, k, v = _qkv(batch=1 if packed else 2, seq=8)
    sink = torch.tensor([0.5, -1.0, 2.0, 0.0])
    docs = [3, 5] if packed else None
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    more = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=5, max_length_k=5) if packed else {}
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, sink)]
    out = fn(hf_call(*leaves[:3], **more), {"s_aux": leaves[3]}, _local_ctx())
    ref = [t.clone().double().requires_grad_(True) for t in (q, k, v, sink)]
    want = _expected(*ref[:3], causal=True, docs=docs, sink=ref[3])
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(2))
    (out * dout).sum().backward()
    (want * dout.double()).sum().backward()
    _close("out", out, want)
    for label, got, r in zip(("q", "k", "v", "s_aux"), leaves, ref):
        _close(f"d{label}", got.grad, r.grad)
    no_sink = fn(hf_call(q, k, v, **more), {"s_aux": None}, _local_ctx())
    _close("s_aux=None", no_sink, _expected(q, k, v, causal=True, docs=docs))


@pytest.mark.parametrize("more, extra, parameter", [
    ({}, {}, "key"),  # a decode step: one query over the cached keys
    ({}, {"cache_seqlens": torch.zeros(1)}, "cache_seqlens"),
    ({"block_table": torch.zeros(1, 4, dtype=torch.int32)}, {}, "block_table"),
])
def test_kv_cache_refusals_give_fixes_that_work_without_flash_attn(more, extra, parameter):
    """Generating after ``patch.remove()`` (every cache) or ``use_cache=False`` (a model's own cache): neither needs
    flash-attn, unlike transformers' flash function."""
    q, k, v = _qkv(seq=8)
    q = q[:, :1] if parameter == "key" else q
    with pytest.raises(UnsupportedArgument) as info:
        ring_attention(hf_call(q, k, v, query_length=q.shape[1], **more), extra, _local_ctx())
    fix = info.value.fix
    assert info.value.parameter == parameter and "patch.remove()" in fix and "RING_ATTN_SWITCH" not in fix
    assert ("use_cache=False" in fix) is (parameter != "block_table")


def test_all_ones_mask_is_dropped_and_ignored_kwargs_change_nothing():
    q, k, v = _qkv()
    plain = ring_attention(hf_call(q, k, v), {}, _local_ctx())
    masked = ring_attention(hf_call(q, k, v, attention_mask=torch.ones(1, 8, dtype=torch.bool)),
                            {"layer_idx": 3, "output_attentions": False}, _local_ctx())
    assert torch.equal(plain, masked)
    _close("world of one", plain, _expected(q, k, v, causal=True))


@pytest.mark.parametrize("fn", [ring_attention, reference_attention, whole.local_attention])
def test_target_dtype_casts_as_the_installed_release(fn):
    """HF's flash path casts q, k and v to ``target_dtype`` when the query (before 4.49: the value) is fp32 -- e.g.
    an fp32 model under autocast, where RoPE leaves q/k fp32 and v bf16; every mode does the same."""
    q, k, v = _qkv()
    by_query = _INSTALLED is None or _INSTALLED >= version_gates.TRANSFORMERS_TARGET_DTYPE_BY_QUERY
    mixed_v = v.to(torch.bfloat16)
    if by_query:
        out = fn(hf_call(q, k, mixed_v, target_dtype=torch.bfloat16), {}, _local_ctx())
        want = fn(hf_call(*(t.to(torch.bfloat16) for t in (q, k, v)), target_dtype=None), {}, _local_ctx())
        assert out.dtype == torch.bfloat16 and torch.equal(out, want)
    out = fn(hf_call(q, k, v, target_dtype=torch.bfloat16), {}, _local_ctx())
    assert out.dtype == torch.bfloat16
    assert fn(hf_call(q, k, v, target_dtype=torch.float32), {}, _local_ctx()).dtype == torch.float32
    assert fn(hf_call(q, k, v, target_dtype=None), {}, _local_ctx()).dtype == torch.float32
    half = [t.to(torch.bfloat16) for t in (q, k, v)]
    assert fn(hf_call(*half, target_dtype=torch.float16), {}, _local_ctx()).dtype == torch.bfloat16  # only fp32 is cast


def test_the_release_rule_of_target_dtype(monkeypatch):
    from packaging.version import Version

    q, k, v = _qkv()
    mixed = (q, k, v.to(torch.bfloat16))
    try:
        for version, cast in (("4.48.3", False), ("4.49.0", True), ("5.23.0", True)):
            monkeypatch.setattr(refusals.version_gates, "installed_transformers_version", lambda: Version(version))
            refusals.target_dtype_by_query.cache_clear()
            got = refusals.cast_to_target(torch.bfloat16, *mixed)
            assert [t.dtype for t in got] == ([torch.bfloat16] * 3 if cast else [t.dtype for t in mixed]), version
            # before 4.49 the value's dtype decides: an fp32 value with a bf16 query casts all three
            got = refusals.cast_to_target(torch.bfloat16, q.to(torch.bfloat16), k, v)
            assert [t.dtype for t in got] == ([torch.bfloat16, torch.float32, torch.float32] if cast
                                              else [torch.bfloat16] * 3), version
    finally:
        monkeypatch.undo()
        refusals.target_dtype_by_query.cache_clear()


def test_sliding_window_follows_the_installed_release(monkeypatch):
    from packaging.version import Version

    def installed(version):
        monkeypatch.setattr(plan_stage.version_gates, "installed_transformers_version", lambda: Version(version))
        plan_stage.window_is_inclusive.cache_clear()

    try:
        installed("5.23.0")
        assert plan_stage.window_size_of(4, 32) == (3, 3)
        assert plan_stage.window_size_of(40, 32) == (-1, -1)  # HF applies a window only when keys outnumber it
        installed("4.56.2")
        assert plan_stage.window_size_of(4, 32) == (3, 3)
        installed("4.55.4")
        assert plan_stage.window_size_of(4, 32) == (4, 4)
    finally:
        monkeypatch.undo()
        plan_stage.window_is_inclusive.cache_clear()


def test_stale_step_is_refused():
    ctx = RingContext(rank=0, world_size=2)
    ctx.set_step(context.StepState(kernel="zigzag", layout="zigzag", packed=False, batch_size=2,
                                     seq_len_global=16, seq_len_local=8, position_ids=torch.arange(8)[None]))
    q, k, v = _qkv(batch=2, seq=8)
    with pytest.raises(UnsupportedArgument, match="shard_inputs"):
        ring_attention(hf_call(q, k, v, position_ids=torch.arange(8, 16)[None]), {}, ctx)
    q, k, v = _qkv(batch=1, seq=8)
    with pytest.raises(UnsupportedArgument, match="batch 2"):
        ring_attention(hf_call(q, k, v), {}, ctx)


def test_local_cu_seq_lens_are_refused():
    ctx = RingContext(rank=0, world_size=2)
    q, k, v = _qkv(seq=8)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    with pytest.raises(UnsupportedArgument, match="GLOBAL packed row"):
        ring_attention(hf_call(q, k, v, cu_seq_lens_q=cu, cu_seq_lens_k=cu), {}, ctx)


def test_packed_step_without_positions_in_the_call_is_refused():
    """A packed row from shard_inputs, but an attention call that carries neither position_ids nor cu_seq_lens
    (a model whose attention never receives them): non-CP attention would run the row as one sequence, the ring
    would keep the documents apart -- refused, never run (4.48+: every model reaches the flash path through the
    integration, which hands on the position ids the model passes)."""
    if not step_stage.integration_passes_positions():
        pytest.skip("before 4.48 most models' flash path takes no position ids: a shard_inputs step is computed "
                    "document by document as declared")
    ctx = RingContext(rank=0, world_size=2)
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])
    ctx.set_step(context.StepState(kernel="llama3", layout="contiguous", packed=True, batch_size=1,
                                     seq_len_global=16, seq_len_local=8,
                                     cu_seqlens=torch.tensor([0, 3, 16], dtype=torch.int32), position_ids=positions))
    q, k, v = _qkv(seq=8)
    with pytest.raises(UnsupportedArgument, match="neither position_ids nor cu_seq_lens") as info:
        ring_attention(hf_call(q, k, v), {}, ctx)
    assert info.value.parameter == "position_ids" and "padded rows" in info.value.fix


def test_parse_kernel_and_plan():
    assert parse_kernel("auto") == ("auto", "auto")
    assert parse_kernel("zigzag:reference") == ("zigzag", "reference")
    for bad in ("ringg", "", "zigzag:", 3):
        with pytest.raises(ValueError):
            parse_kernel(bad)
    assert plan_step("auto", packed=False) == ("zigzag", "zigzag")
    assert plan_step("auto", packed=True) == ("llama3", "contiguous")
    assert plan_step("stripe", packed=True) == ("llama3", "contiguous")
    assert plan_step("zigzag", packed=True) == ("zigzag", "zigzag")
    assert plan_step("llama3", packed=False) == ("ring", "contiguous")
    assert plan_step("zigzag", packed=False, source="position_ids") == ("ring", "contiguous")
    with pytest.raises(ValueError, match="variant"):
        RingContext(variant="fast")


# --------------------------------------------------------------------------------------------- inputs


def test_shard_inputs_identity_without_cp():
    ids = torch.arange(12).reshape(2, 6)
    out = shard_inputs(None, ids, labels=ids)
    assert out["input_ids"] is ids
    assert torch.equal(out["labels"], torch.tensor([[1, 2, 3, 4, 5, -100], [7, 8, 9, 10, 11, -100]]))
    assert torch.equal(out["position_ids"], torch.arange(6).expand(2, 6))
    assert torch.equal(shift_labels(ids), out["labels"])


def test_shard_inputs_refuses_bad_input():
    with pytest.raises(TypeError, match="input_ids"):
        shard_inputs(None, torch.zeros(6, dtype=torch.long))
    with pytest.raises(ValueError, match="labels"):
        shard_inputs(None, torch.zeros(1, 6, dtype=torch.long), labels=torch.zeros(1, 5, dtype=torch.long))
    with pytest.raises(UnsupportedArgument, match="one row"):
        shard_inputs(None, torch.zeros(2, 4, dtype=torch.long), position_ids=torch.tensor([[0, 1, 0, 1], [0, 1, 2, 3]]))
    with pytest.raises(UnsupportedArgument, match="first token"):
        shard_inputs(None, torch.zeros(1, 4, dtype=torch.long), position_ids=torch.tensor([[1, 0, 1, 2]]))


def test_token_loss_and_reduce_without_cp():
    logits = torch.randn(1, 5, 7, requires_grad=True)
    labels = torch.tensor([[1, 2, -100, 4, -100]])
    loss_sum, count = token_loss_sum(logits, labels)
    assert int(count) == 3
    mean = reduce_loss(None, loss_sum, count)
    ref = torch.nn.functional.cross_entropy(logits[0], labels[0], ignore_index=-100)
    assert torch.allclose(mean, ref)


def _shard_and_loss_world(rank, world):
    ctx = RingContext(rank=rank, world_size=world)
    ids = torch.arange(1, 17).reshape(1, 16)
    out = shard_inputs(ctx, ids, labels=ids)
    # zigzag over 2 ranks: chunks of 4; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    want = {0: [1, 2, 3, 4, 13, 14, 15, 16], 1: [5, 6, 7, 8, 9, 10, 11, 12]}[rank]
    assert out["input_ids"].tolist() == [want]
    assert out["position_ids"].tolist() == [[t - 1 for t in want]]
    assert out["labels"].tolist() == [[t + 1 if t < 16 else -100 for t in want]]
    assert ctx.step.layout == "zigzag" and not ctx.step.packed
    with pytest.raises(ValueError, match="cannot be split"):
        shard_inputs(ctx, torch.zeros(1, 10, dtype=torch.long))
    # token-weighted mean over the group, gradient only into the local sum
    local = torch.tensor(float(rank + 1) * 10, requires_grad=True)
    loss = reduce_loss(ctx, local, rank + 1)  # sums 10 + 20 over 1 + 2 tokens
    assert math.isclose(loss.item(), 30.0 / 3.0, rel_tol=1e-6)
    loss.backward()
    assert math.isclose(local.grad.item(), 1.0 / 3.0, rel_tol=1e-6)

