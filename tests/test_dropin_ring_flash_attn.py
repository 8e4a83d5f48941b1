"""hfpatch.dropin.ring_flash_attn: ring-flash-attn's API on hfpatch, against plain references.

1. Every kernel entry point (plain, ``_kvpacked``, ``_qkvpacked``) on 2 and 4 gloo ranks, inputs split exactly as
   ring-flash-attn's own tests split them (contiguous, zigzag, stripe, per-document, per-document zigzag, llama3
   metadata), forward and input gradients against softmax(QK^T)V in float64 on the whole sequence.
2. ring-flash-attn's documented HF flow: packed documents of different lengths, ``substitute_hf_flash_attn``,
   ``update_ring_flash_attn_params(cu_seqlens, group)`` per step, ``torch.chunk`` of input_ids/position_ids per
   rank; the CP logits and parameter gradients (summed over ranks) equal the non-CP eager run of the same model.
3. Refusals and argument errors, in one process.

The distributed parts run in ``tests/_dropin_world.py``'s shared world (one per world size, with the axolotl part).

Tolerances: fp32 kernel inputs against the float64 reference, 2e-5 x the largest reference value (the kernels
accumulate in fp32: measured errors ~1e-7; a document boundary moved by one token or a window one token wider
changes these outputs by ~0.8 x their largest value);
fp32 models as in tests/test_e2e_models.py (loss/logits 1e-5, gradients 2e-5 relative to their largest value).
"""
from __future__ import annotations

import zlib

import pytest
import torch
import torch.distributed as dist


KERNEL_RTOL = 2e-5
LOGIT_RTOL = 1e-5
GRAD_RTOL = 2e-5
HEADS, HEADS_K, DIM = 4, 2, 8


# ------------------------------------------------------------------------------ plain float64 reference


def _reference(q, k, v, *, causal, softmax_scale=None, window=(-1, -1), softcap=0.0, cu=None):
    """softmax(QK^T)V on whole sequences: q (B, S, H, D), k/v (B, S, Hk, D); cu: documents of a batch-1 row."""
    s, h, d = q.shape[1], q.shape[2], q.shape[3]
    rep = h // k.shape[2]
    kk, vv = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, kk) * (d ** -0.5 if softmax_scale is None else softmax_scale)
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    allowed = torch.ones(s, s, dtype=torch.bool)
    if causal:
        allowed &= j <= i
    if window[0] >= 0:
        allowed &= j >= i - window[0]
    if window[1] >= 0:
        allowed &= j <= i + window[1]
    if cu is not None:
        doc = torch.bucketize(torch.arange(s), cu[1:].long(), right=True)
        allowed &= doc[:, None] == doc[None, :]
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return torch.einsum("bhqk,bkhd->bqhd", probs, vv)


# ----------------------------------------------- how ring-flash-attn's tests split inputs (dim = sequence)


def _contiguous(x, rank, world, dim):
    return x.chunk(world, dim=dim)[rank]


def _zigzag(x, rank, world, dim):
    chunks = x.chunk(2 * world, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * world - 1 - rank]], dim=dim)


def _stripe(x, rank, world, dim):
    return x.index_select(dim, torch.arange(rank, x.shape[dim], world))


def _per_document(split):
    def apply(x, rank, world, dim, cu):
        return torch.cat([split(x.narrow(dim, int(a), int(b - a)), rank, world, dim)
                          for a, b in zip(cu[:-1], cu[1:])], dim=dim)
    return apply


# ------------------------------------------------------------------------------------ kernel cases


def _leaves(kind, q, k, v, packed_dim):
    """Global leaf tensors for the call form: plain (q, k, v), kv-packed (q, kv) or qkv-packed (qkv)."""
    if kind == "plain":
        return [q, k, v]
    if kind == "kv":
        return [q, torch.stack([k, v], dim=packed_dim)]
    return [torch.stack([q, k, v], dim=packed_dim)]


def _unpacked(kind, leaves, packed_dim):
    if kind == "plain":
        return leaves
    if kind == "kv":
        return [leaves[0], *leaves[1].unbind(packed_dim)]
    return list(leaves[0].unbind(packed_dim))


def _kernel_cases(world):
    batch = [
        ("ring", dict(causal=True)), ("ring", dict(causal=False)), ("ring", dict(causal=True, window_size=(3, 0))),
        ("ring", dict(causal=False, softmax_scale=0.3, softcap=2.0)),
        ("zigzag_ring", dict(causal=True)), ("zigzag_ring", dict(causal=True, window_size=(5, 0))),
        ("stripe", dict(causal=True)),
    ]
    varlen = [("ring", dict(causal=True)), ("ring", dict(causal=False)),
              ("ring", dict(causal=True, window_size=(2, 0))), ("zigzag_ring", dict(causal=True))]
    llama3 = [dict(causal=True, stride=1), dict(causal=False, stride=None), dict(causal=True, stride=2, prepared=False),
              dict(causal=True, stride=1, window_size=(4, 0))]
    cases = [("batch", name, "plain", opts) for name, opts in batch]
    cases += [("varlen", name, "plain", opts) for name, opts in varlen]
    cases += [("llama3", "llama3", "plain", opts) for opts in llama3]
    # The packed forms only unpack their argument: one causal case per function and form.
    for kind in ("kv", "qkv"):
        cases += [("batch", name, kind, dict(causal=True)) for name in ("ring", "zigzag_ring", "stripe")]
        cases += [("varlen", name, kind, dict(causal=True)) for name in ("ring", "zigzag_ring")]
        cases += [("llama3", "llama3", kind, dict(causal=True, stride=1))]
    return cases


def _run_kernel_case(rank, world, family, name, kind, opts):
    import hfpatch.dropin.ring_flash_attn as rfa

    g = torch.Generator().manual_seed(zlib.crc32(f"{family}/{name}/{kind}/{opts}".encode()))  # same on every rank
    heads_k = HEADS if kind == "qkv" else HEADS_K      # qkv packing needs as many K/V heads as query heads
    opts = dict(opts)
    if family == "batch":
        shape, packed_dim, cu = (2, 8 * world), 2, None
    else:
        docs = [2 * world * n for n in (2, 1, 3, 2)]   # uneven, each divisible by 2N (zigzag pieces)
        shape, packed_dim = (sum(docs),), 1
        cu = torch.tensor([0] + docs).cumsum(0).to(torch.int32)
    q = torch.randn(*shape, HEADS, DIM, generator=g, dtype=torch.float64)
    k, v = (torch.randn(*shape, heads_k, DIM, generator=g, dtype=torch.float64) for _ in range(2))
    dout = torch.randn(*shape, HEADS, DIM, generator=g, dtype=torch.float64)
    leaves = [t.requires_grad_() for t in _leaves(kind, q, k, v, packed_dim)]
    ref_in = _unpacked(kind, leaves, packed_dim)
    if family != "batch":
        ref_in = [t.unsqueeze(0) for t in ref_in]
    ref = _reference(*ref_in, causal=opts["causal"], softmax_scale=opts.get("softmax_scale"),
                     window=opts.get("window_size", (-1, -1)), softcap=opts.get("softcap", 0.0), cu=cu)
    ref = ref if family == "batch" else ref[0]
    ref.backward(dout)

    if family == "batch":
        split = {"ring": _contiguous, "zigzag_ring": _zigzag, "stripe": _stripe}[name]
        local = lambda x: split(x, rank, world, 1)  # noqa: E731
    elif family == "varlen":
        split = _per_document(_contiguous if name == "ring" else _zigzag)
        local = lambda x: split(x, rank, world, 0, cu)  # noqa: E731
    else:
        local = lambda x: _contiguous(x, rank, world, 0)  # noqa: E731
    mine = [local(t.detach()).float().requires_grad_() for t in leaves]  # fp32, as the kernels are used
    suffix = {"plain": "", "kv": "_kvpacked", "qkv": "_qkvpacked"}[kind]
    flash = dict(softmax_scale=opts.get("softmax_scale"), causal=opts["causal"],
                 window_size=opts.get("window_size", (-1, -1)), group=dist.group.WORLD)
    if family == "batch":
        fn = getattr(rfa, f"{name}_flash_attn{suffix}_func")
        out = fn(*mine, softcap=opts.get("softcap", 0.0), **flash)
    elif family == "varlen":
        fn = getattr(rfa, f"{name}_flash_attn_varlen{suffix}_func")
        local_cu = cu // world
        out = fn(*mine, local_cu, int((local_cu[1:] - local_cu[:-1]).max()), **flash)
    else:
        meta = rfa.llama3_flash_attn_prepare_cu_seqlens(cu, opts["causal"], rank, world)
        if opts.get("prepared", True) is False:  # metadata made elsewhere: hfpatch rebuilds the global cu_seqlens
            meta = (meta[0].clone(),) + meta[1:]
        cu_q, cu_k, max_q, max_k, k_slice = meta
        fn = getattr(rfa, f"llama3_flash_attn_varlen{suffix}_func")
        out = fn(*mine, cu_q, cu_k, max_q, max_k, opts["stride"], k_slice, **flash)
    out.backward(local(dout).float())
    label = f"{family}/{name}/{kind}/{opts}/world {world}"
    _close(label + " out", out, local(ref.detach()))
    for i, (t, leaf) in enumerate(zip(mine, leaves)):
        _close(f"{label} grad {i}", t.grad, local(leaf.grad))


def _close(label, got, want):
    assert got.shape == want.shape, f"{label}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    err = (got.double() - want).abs().max().item()
    assert err <= KERNEL_RTOL * want.abs().max().item(), f"{label}: max error {err:.3e}"


# ----------------------------------------------------------------------------------- the HF flow


DOCS_STEPS = ([5, 11, 1, 7, 8], [16, 3, 13])   # two steps of 32 packed tokens; documents cross rank boundaries


def _baseline(model_name, ids, docs, proj):
    """Non-CP eager run, document by document: logits (1, T, V) and parameter gradients of sum(logits * proj)."""
    from hfpatch.cli.demo_models import build_model, eager_reference_overrides

    model = build_model(model_name, **eager_reference_overrides(model_name))
    pieces, start = [], 0
    for n in docs:
        pieces.append(model(input_ids=ids[:, start:start + n], position_ids=torch.arange(n)[None],
                            use_cache=False).logits)
        start += n
    logits = torch.cat(pieces, dim=1)
    (logits * proj).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _hf_flow(rank, world, model_name):
    """ring-flash-attn's README flow, only the import changed; two steps with different documents."""
    from hfpatch.cli.demo_models import build_model
    from hfpatch.dropin.ring_flash_attn import substitute_hf_flash_attn, update_ring_flash_attn_params

    group = dist.group.WORLD
    model = build_model(model_name)
    patch = substitute_hf_flash_attn(group, heads_k_stride=1, model=model)
    for step, docs in enumerate(DOCS_STEPS):
        g = torch.Generator().manual_seed(100 + step)
        ids = torch.randint(0, 128, (1, sum(docs)), generator=g)
        position_ids = torch.cat([torch.arange(n) for n in docs]).unsqueeze(0)
        cu_seqlens = torch.tensor([0] + docs).cumsum(0).to(torch.int32)
        proj = torch.randn(1, sum(docs), model.config.vocab_size, generator=g)
        ref_logits, ref_grads = _baseline(model_name, ids, docs, proj)

        model.zero_grad(set_to_none=True)
        patch.reset_calls()
        update_ring_flash_attn_params(cu_seqlens, group)
        local_ids = torch.chunk(ids, world, dim=1)[rank]
        local_pos = torch.chunk(position_ids, world, dim=1)[rank]
        logits = model(input_ids=local_ids, position_ids=local_pos, use_cache=False).logits
        (logits * torch.chunk(proj, world, dim=1)[rank]).sum().backward()

        label = f"{model_name}/step {step}/world {world}"
        assert patch.mode_calls == {"ring": model.config.num_hidden_layers}, f"{label}: {patch.mode_calls}"
        assert patch.ctx.step.kernel == "llama3" and patch.ctx.step.source == "update_ring_flash_attn_params"
        parts = [torch.empty_like(logits) for _ in range(world)]
        dist.all_gather(parts, logits.detach().contiguous())
        whole = torch.cat(parts, dim=1)
        err = (whole - ref_logits).abs().max().item()
        assert err <= LOGIT_RTOL * ref_logits.abs().max().item(), f"{label}: logits differ by {err:.3e}"
        for name, ref in ref_grads.items():
            grad = model.get_parameter(name).grad
            grad = torch.zeros_like(ref) if grad is None else grad.clone()
            dist.all_reduce(grad)
            gerr = (grad - ref).abs().max().item()
            assert gerr <= GRAD_RTOL * ref.abs().max().item() + 1e-9, f"{label}: grad {name} differs by {gerr:.3e}"
    return patch, model


def _hf_misuse(rank, world, patch, model):
    """A step described with other lengths than the model gets, and the switch."""
    import hfpatch
    from hfpatch.dropin.ring_flash_attn import update_ring_flash_attn_params, use_ring_attn
    from hfpatch.errors import UnsupportedArgument

    from hfpatch.dropin.ring_flash_attn import substitute_hf_flash_attn

    again = substitute_hf_flash_attn(None, 1, model=model)  # a second call replaces the first; None: default group
    assert again.active and again is not patch and patch.removed and hfpatch.active_patch() is again
    assert again.ctx.world_size == world
    patch = again
    update_ring_flash_attn_params(torch.tensor([0, 8, 24], dtype=torch.int32), dist.group.WORLD)
    ids = torch.zeros(1, 32 // world, dtype=torch.long)
    with pytest.raises(UnsupportedArgument, match="update_ring_flash_attn_params described this step"):
        model(input_ids=ids, position_ids=torch.arange(32 // world)[None], use_cache=False)
    use_ring_attn(False)
    assert hfpatch.current_mode() == "original"
    use_ring_attn(True)
    assert hfpatch.current_mode() == "ring"
    alone = dist.new_group([0])  # collective: every rank creates it
    if rank == 0:
        with pytest.raises(ValueError, match="process_group has rank 0 of 1"):
            update_ring_flash_attn_params(torch.tensor([0, 32], dtype=torch.int32), alone)
    patch.remove()


_MODELS = {2: "llama", 4: "mistral"}  # mistral: a sliding window inside the packed documents


def _rfa_part(rank, world):
    """Every kernel case, then the HF flow; run inside tests/_dropin_world.py's shared world."""
    for case in _kernel_cases(world):
        _run_kernel_case(rank, world, *case)
    patch, model = _hf_flow(rank, world, _MODELS[world])
    _hf_misuse(rank, world, patch, model)


@pytest.mark.parametrize("world", [2, 4])
def test_ring_flash_attn_on_gloo_ranks(world):
    from _dropin_world import failure_of

    failure = failure_of("ring_flash_attn", world)
    assert failure is None, failure


# --------------------------------------------------------------------------------- one process


def test_llama3_prepare_matches_ring_flash_attn_convention():
    """Per-rank metadata of cu_seqlens [0, 7, 14, 16] over 8 ranks (2 tokens each), worked by hand."""
    from hfpatch.dropin.ring_flash_attn import llama3_flash_attn_prepare_cu_seqlens as prepare

    cu = torch.tensor([0, 7, 14, 16], dtype=torch.int32)
    expected_causal = {  # rank: (cu_q, cu_k, max_q, max_k, k_slice)
        0: ([0, 2], [0, 2], 2, 2, slice(0, 2)),
        3: ([0, 1, 2], [0, 7, 8], 1, 7, slice(0, 8)),
        4: ([0, 2], [0, 3], 2, 3, slice(7, 10)),
        7: ([0, 2], [0, 2], 2, 2, slice(14, 16)),
    }
    for rank, (cu_q, cu_k, max_q, max_k, k_slice) in expected_causal.items():
        got = prepare(cu, True, rank, 8)
        assert got[0].tolist() == cu_q and got[1].tolist() == cu_k and got[0].dtype == torch.int32
        assert got[2:] == (max_q, max_k, k_slice), (rank, got)
    got = prepare(cu, False, 3, 8)  # non-causal: the keys run to the end of the last document
    assert got[1].tolist() == [0, 7, 14] and got[4] == slice(0, 14) and got[3] == 7
    with pytest.raises(ValueError, match="not divisible by world_size=3"):
        prepare(cu, True, 0, 3)
    with pytest.raises(ValueError, match="rank=8"):
        prepare(cu, True, 8, 8)


@pytest.mark.parametrize("kwargs, parameter", [
    (dict(dropout_p=0.1), "dropout_p"),
    (dict(alibi_slopes=torch.ones(4)), "alibi_slopes"),
    (dict(return_attn_probs=True), "return_attn_probs"),
])
def test_unhonourable_arguments_are_refused(kwargs, parameter):
    from hfpatch.dropin import ring_flash_attn as rfa
    from hfpatch.errors import UnsupportedArgument

    q = torch.randn(1, 8, 4, 8)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    calls = [
        lambda: rfa.ring_flash_attn_func(q, q, q, **kwargs),
        lambda: rfa.zigzag_ring_flash_attn_kvpacked_func(q, torch.stack([q, q], 2), causal=True, **kwargs),
        lambda: rfa.stripe_flash_attn_qkvpacked_func(torch.stack([q, q, q], 2), causal=True, **kwargs),
        lambda: rfa.ring_flash_attn_varlen_func(q[0], q[0], q[0], cu, 8, **kwargs),
        lambda: rfa.llama3_flash_attn_varlen_func(q[0], q[0], q[0], *rfa.llama3_flash_attn_prepare_cu_seqlens(
            cu, True, 0, 1)[:4], 1, slice(0, 8), **kwargs),
    ]
    for call in calls:
        with pytest.raises(UnsupportedArgument) as info:
            call()
        assert info.value.parameter == parameter and "Fix:" in str(info.value)


def test_argument_errors_name_the_argument():
    from hfpatch.dropin import _session
    from hfpatch.dropin import ring_flash_attn as rfa
    from hfpatch.errors import PatchError

    q = torch.randn(1, 8, 4, 8)
    with pytest.raises(ValueError, match=r"kv has shape \(1, 8, 4, 8\)"):
        rfa.ring_flash_attn_kvpacked_func(q, q)
    with pytest.raises(ValueError, match="LOCAL cu_seqlens"):
        rfa.ring_flash_attn_varlen_func(q[0], q[0], q[0], torch.tensor([0, 16], dtype=torch.int32), 16)
    with pytest.raises(TypeError, match="window_size"):
        rfa.ring_flash_attn_func(q, q, q, window_size=3)
    with pytest.raises(TypeError, match="flag must be True"):
        rfa.use_ring_attn("yes")
    with pytest.raises(ValueError, match="heads_k_stride=0"):
        rfa.substitute_hf_flash_attn(None, 0)
    _session._current = None
    with pytest.raises(PatchError, match="before substitute_hf_flash_attn"):
        rfa.update_ring_flash_attn_params(torch.tensor([0, 8], dtype=torch.int32), None)


def test_single_process_entry_points_equal_reference():
    """Without a process group every entry point is plain attention on the whole (local) sequence."""
    from hfpatch.dropin import ring_flash_attn as rfa

    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 12, 4, 8, generator=g, dtype=torch.float64) for _ in range(3))
    got = rfa.ring_flash_attn_func(q.float(), k.float(), v.float(), causal=True)
    _close("single ring", got, _reference(q, k, v, causal=True))
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    got = rfa.ring_flash_attn_varlen_func(q[0].float(), k[0].float(), v[0].float(), cu, 7, causal=True)
    _close("single varlen", got, _reference(q[:1], k[:1], v[:1], causal=True, cu=cu)[0])


def test_without_a_process_group_the_adapter_is_inactive():
    """No torch.distributed at all: an inactive patch, transformers untouched, the per-step update a no-op."""
    import transformers.modeling_flash_attention_utils as mfau

    from hfpatch.dropin.ring_flash_attn import substitute_hf_flash_attn, update_ring_flash_attn_params

    before = mfau._flash_attention_forward
    patch = substitute_hf_flash_attn(None, 1)
    assert not patch.active and "no CP group" in patch.reason
    update_ring_flash_attn_params(torch.tensor([0, 5, 8], dtype=torch.int32), None)
    assert mfau._flash_attention_forward is before
