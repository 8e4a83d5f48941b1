"""One gloo world per world size for BOTH drop-in test files (ring-flash-attn and axolotl), and the parts run in it.

Starting a rank costs ~8 CPU-seconds of imports (torch, transformers, the model classes); two files with two
worlds each would spend most of their budget there. So each world size runs once per pytest session, the
ring-flash-attn part first, then the axolotl part; each file's test asks for the outcome of its own part.
A failing part stops the world (the ranks would otherwise wait on each other's collectives): the parts after it
report "not run" with the failure, never a pass.

The parts live here, so that each test file imports this module and neither imports the other:
``_rfa_part`` (tests/integrations/test_dropin_ring_flash_attn.py: every kernel entry point against ``reference``,
then ring-flash-attn's HF flow) and ``_axolotl_part`` (tests/integrations/test_dropin_axolotl.py: axolotl's flow
through a DeviceMesh). Tolerances as those files' docstrings state them.
"""
from __future__ import annotations

import zlib
from typing import Dict, Optional

import pytest
import torch
import torch.distributed as dist

import hfpatch
import hfpatch.dropin.ring_flash_attn as rfa
from _dist import DistributedFailure, run_world
from hfpatch.cli.demo_models import build_model, eager_reference_overrides, reference_logits
from hfpatch.dropin import axolotl
from hfpatch.dropin.ring_flash_attn import substitute_hf_flash_attn, update_ring_flash_attn_params, use_ring_attn
from hfpatch.errors import PatchError, UnsupportedArgument
from test_e2e_models import gemma2_flash_path_broken

PARTS = ("ring_flash_attn", "axolotl")
_FUNCTIONS = {"ring_flash_attn": "_rfa_part", "axolotl": "_axolotl_part"}
_outcomes: Dict[int, Optional[str]] = {}


def _both(rank: int, world: int) -> None:
    _rfa_part(rank, world)
    _axolotl_part(rank, world)


def failure_of(part: str, world: int) -> Optional[str]:
    """None when ``part`` passed in the ``world``-rank world (run on first request), else why it did not."""
    if world not in _outcomes:
        try:
            run_world(world, _both)
            _outcomes[world] = None
        except DistributedFailure as exc:
            _outcomes[world] = str(exc)
    failure = _outcomes[world]
    if failure is None:
        return None
    failed = next((p for p in reversed(PARTS) if _FUNCTIONS[p] in failure), PARTS[0])
    if part == failed:
        return failure
    if PARTS.index(part) < PARTS.index(failed):
        return None  # it ran to the end before the failing part started
    return f"not run: the {failed} part failed first in the same {world}-rank world:\n{failure}"


KERNEL_RTOL = 2e-5
LOGIT_RTOL = 1e-5
GRAD_RTOL = 2e-5


# -------------------------------------------------------------------------- ring-flash-attn: float64 reference

HEADS, HEADS_K, DIM = 4, 2, 8


def reference(q, k, v, *, causal, softmax_scale=None, window=(-1, -1), softcap=0.0, cu=None):
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


# ------------------------------------------------------------------------------ ring-flash-attn: kernel cases


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
    ref = reference(*ref_in, causal=opts["causal"], softmax_scale=opts.get("softmax_scale"),
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
    close(label + " out", out, local(ref.detach()))
    for i, (t, leaf) in enumerate(zip(mine, leaves)):
        close(f"{label} grad {i}", t.grad, local(leaf.grad))


def close(label, got, want):
    assert got.shape == want.shape, f"{label}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    err = (got.double() - want).abs().max().item()
    assert err <= KERNEL_RTOL * want.abs().max().item(), f"{label}: max error {err:.3e}"


# -------------------------------------------------------------------------------- ring-flash-attn: the HF flow


DOCS_STEPS = ([5, 11, 1, 7, 8], [16, 3, 13])   # two steps of 32 packed tokens; documents cross rank boundaries


def _rfa_baseline(model_name, ids, docs, proj):
    """Non-CP eager run, document by document: logits (1, T, V) and parameter gradients of sum(logits * proj)."""
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
    group = dist.group.WORLD
    model = build_model(model_name)
    patch = substitute_hf_flash_attn(group, heads_k_stride=1, model=model)
    for step, docs in enumerate(DOCS_STEPS):
        g = torch.Generator().manual_seed(100 + step)
        ids = torch.randint(0, 128, (1, sum(docs)), generator=g)
        position_ids = torch.cat([torch.arange(n) for n in docs]).unsqueeze(0)
        cu_seqlens = torch.tensor([0] + docs).cumsum(0).to(torch.int32)
        proj = torch.randn(1, sum(docs), model.config.vocab_size, generator=g)
        ref_logits, ref_grads = _rfa_baseline(model_name, ids, docs, proj)

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
    again = substitute_hf_flash_attn(None, 1, model=model)  # a second call keeps the first; None: default group
    assert again is patch and not patch.removed and hfpatch.active_patch() is patch
    assert [attached.model for attached in patch.models] == [model]
    with pytest.raises(PatchError, match="replacing it would take the earlier call's models off the ring"):
        substitute_hf_flash_attn(None, 2, model=model)  # another stride: refused, the first patch kept
    assert not patch.removed
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
    """Every kernel case, then the HF flow; run inside the shared world."""
    for case in _kernel_cases(world):
        _run_kernel_case(rank, world, *case)
    patch, model = _hf_flow(rank, world, _MODELS[world])
    _hf_misuse(rank, world, patch, model)


# ------------------------------------------------------------------------------- axolotl on a DeviceMesh

SEQ = 32
DOCS = [5, 11, 1, 7, 8]              # packed: uneven documents crossing rank boundaries
ZIGZAG_DOCS = [8, 4, 12, 8]          # per-document zigzag: every document divisible by 2 x cp = 4


def _split(func, x, rank, cp, cu=None):
    """axolotl's split of dim 1 for ``func`` (varlen_zigzag: ring_kernels' per-document zigzag)."""
    if func in ("varlen_llama3", "batch_ring", "varlen_ring"):
        return x.chunk(cp, dim=1)[rank]
    if func == "batch_zigzag":
        chunks = x.chunk(2 * cp, dim=1)
        return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim=1)
    if func == "batch_stripe":
        return x[:, rank::cp]
    pieces = []
    for a, b in zip(cu[:-1], cu[1:]):
        chunks = x[:, int(a):int(b)].chunk(2 * cp, dim=1)
        pieces += [chunks[rank], chunks[2 * cp - 1 - rank]]
    return torch.cat(pieces, dim=1)


def _inputs(kind):
    g = torch.Generator().manual_seed(77)
    if kind == "batch":
        ids = torch.randint(0, 128, (2, SEQ), generator=g)
        return ids, torch.arange(SEQ).expand(2, SEQ), None
    docs = DOCS if kind == "packed" else ZIGZAG_DOCS
    ids = torch.randint(0, 128, (1, sum(docs)), generator=g)
    return ids, torch.cat([torch.arange(n) for n in docs]).unsqueeze(0), docs


def _axolotl_baseline(model_name, ids, docs, proj):
    """Non-CP eager logits and gradients of sum(logits * proj); packed rows document by document."""
    model = build_model(model_name, **eager_reference_overrides(model_name))
    logits = reference_logits(model, ids, docs)
    (logits * proj).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _axolotl_case(mesh, func, model_name, kind):
    cp_group = mesh["cp"].get_group()
    rank, cp = dist.get_rank(cp_group), dist.get_world_size(cp_group)
    ids, pos, docs = _inputs(kind)
    cu = None if docs is None else torch.tensor([0] + docs).cumsum(0)
    proj = torch.randn(*ids.shape, 128, generator=torch.Generator().manual_seed(5))
    ref_logits, ref_grads = _axolotl_baseline(model_name, ids, docs, proj)

    model = build_model(model_name)
    patch = axolotl.register_ring_attn_from_device_mesh(mesh, ("cp",), 1, axolotl.RingAttnFunc(func), model=model)
    assert axolotl.get_ring_attn_group() is cp_group
    axolotl.update_ring_attn_params(position_ids=pos)
    local = lambda x: _split(func, x, rank, cp, cu)  # noqa: E731
    logits = model(input_ids=local(ids), position_ids=local(pos), use_cache=False).logits
    (logits * local(proj)).sum().backward()

    label = f"{func}/{model_name}/{kind}/cp {cp}"
    assert patch.mode_calls == {"ring": model.config.num_hidden_layers}, f"{label}: {patch.mode_calls}"
    want = local(ref_logits)
    err = (logits.detach() - want).abs().max().item()
    assert err <= LOGIT_RTOL * want.abs().max().item(), f"{label}: logits differ by {err:.3e}"
    for name, ref in ref_grads.items():
        grad = model.get_parameter(name).grad
        grad = torch.zeros_like(ref) if grad is None else grad.clone()
        dist.all_reduce(grad, group=cp_group)
        gerr = (grad - ref).abs().max().item()
        assert gerr <= GRAD_RTOL * ref.abs().max().item() + 1e-9, f"{label}: grad {name} differs by {gerr:.3e}"
    return model, patch


def _refusals(mesh, model):
    """What axolotl's patch would compute wrongly is refused here."""
    cp_group = mesh["cp"].get_group()
    cp = dist.get_world_size(cp_group)
    ids = torch.zeros(1, SEQ // cp, dtype=torch.long)
    patch = axolotl.register_ring_attn_from_device_mesh(mesh, "cp", None, "batch_zigzag", model=model)
    # Zigzag chunks taken for contiguous ones: no step described yet.
    with pytest.raises(UnsupportedArgument, match="update_ring_attn_params described this step"):
        model(input_ids=ids, position_ids=torch.arange(SEQ // cp)[None], use_cache=False)
    # A packed row cut by the row-level zigzag split would let documents see each other.
    _, pos, _ = _inputs("packed")
    with pytest.raises(UnsupportedArgument, match="packed row"):
        axolotl.update_ring_attn_params(position_ids=pos)
    with pytest.raises(UnsupportedArgument, match="needs each rank's global positions"):
        axolotl.update_ring_attn_params(position_ids=None)
    with pytest.raises(ValueError, match="context_parallel_dim=\\('tp',\\)"):
        axolotl.register_ring_attn_from_device_mesh(mesh, ("tp",), None, "batch_ring")
    with pytest.raises(ValueError, match="ring_attn_func='ring'"):
        axolotl.register_ring_attn_from_device_mesh(mesh, ("cp",), None, "ring")
    # Another ring function while this patch is live: refused by name, this patch (and its model) kept.
    with pytest.raises(PatchError, match="replacing it would take the earlier call's models off the ring"):
        axolotl.register_ring_attn_from_device_mesh(mesh, "cp", None, "varlen_llama3", model=model)
    assert not patch.removed and [attached.model for attached in patch.models] == [model]
    patch.remove()


# (RingAttnFunc, model, input kind) per world size: every function once, the 4-rank world with two CP groups.
# On transformers 4.47.x Gemma2's own flash path is broken (tests/model/test_e2e_models.py proves it: it crashes
# without a mask and gives every layer the sliding window); there the windowed Gemma2 case runs on Mistral instead.
CASES = {
    2: [("batch_ring", "llama", "batch"), ("batch_stripe", "mistral", "batch"),
        ("varlen_zigzag", "llama", "zigzag-packed")],
    4: [("batch_zigzag", "llama", "batch"), ("varlen_llama3", "llama", "packed"),
        ("varlen_ring", "gemma2", "packed")],
}


def _axolotl_part(rank, world):
    """Every case of this world size, then the refusals; run inside the shared world."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "cp"))
    model = None
    for func, model_name, kind in CASES[world]:  # each case's patch removed before the next registers its own
        if model_name == "gemma2" and gemma2_flash_path_broken():
            model_name = "mistral"
        model, patch = _axolotl_case(mesh, func, model_name, kind)
        patch.remove()
    _refusals(mesh, model)
