"""Lightning attention, the RG-LRU, Kimi delta attention and ZAYA's convolutional projection under CP
(hfpatch.mixers.lightning / rglru / cca, and the gated delta rule kind with per-channel gates): each kernel's
segment exchange against the whole sequence, forward and gradients, on zigzag, contiguous and zigzag-varlen
layouts (segments shorter than the windows included); then the real HF classes MiniMax, RecurrentGemma,
Kimi-Linear, BailingHybrid and ZAYA: CP loss and every gradient equal to non-CP (the sweep's check_class), packed
rows, the refusals, switch mode "reference", and ``remove()`` taking every replacement off again."""
from __future__ import annotations

import copy
import inspect

import pytest
import torch
import torch.distributed as dist

from _dist import run_world

# The causal-LM classes of transformers 5.23 whose mixers these kinds run, and the mixer classes each has.
FAMILY_CLASSES = {
    "MiniMaxForCausalLM": ("MiniMaxLightningAttention",),
    "RecurrentGemmaForCausalLM": ("RecurrentGemmaRecurrentBlock", "RecurrentGemmaRglru"),
    "KimiLinearForCausalLM": ("KimiLinearDeltaAttention",),
    "BailingHybridForCausalLM": ("BailingHybridDeltaAttention",),
    "ZayaForCausalLM": ("ZayaCCAProjection",),
}


# Their attention layers get no position_ids (the decoder layers pass the rotary table only): hfpatch's attention
# refuses packed rows by name there, before any mixer runs.
PACKED_REFUSED = ("RecurrentGemmaForCausalLM", "ZayaForCausalLM")


def _entries():
    from hfpatch.release.sweep.catalog import flash_causal_lm_classes

    return [e for e in flash_causal_lm_classes() if e.class_name in FAMILY_CLASSES and e.importable]


def _recognised(model) -> list:
    from hfpatch.mixers import recognise

    return [name for name, m in model.named_modules() if recognise(m) is not None]


def _quiet():
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()


# ------------------------------------------------------------------------- exchange vs whole sequence

# (layout, tokens per rank, document starts of a packed row or None): one-token zigzag segments are shorter than
# every window here (conv K-1 = 3, ZAYA W = 4).
_CASES = (("zigzag", 8, None), ("contiguous", 8, None), ("zigzag", 2, None), ("zigzag", 16, (0, 4)),
          ("contiguous", 8, (0, 3)))


def _leaf(gen, *shape, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).requires_grad_()


def _compare(rank, world, plan, local, cp_fn, whole_fn, leaves, out_dims, what):
    """cp_fn() -> this rank's outputs, whole_fn() -> the whole sequence's: outputs on this rank's tokens equal, and
    every leaf's gradient (summed over ranks) within 1e-4 of its largest, for a random weighting of the outputs."""
    gen = torch.Generator().manual_seed(7)
    cp = cp_fn()
    whole = whole_fn()
    weights = [torch.randn(w.shape, generator=gen) for w in whole]
    sum((o * local(w, d)).sum() for o, w, d in zip(cp, weights, out_dims)).backward()
    grads = [leaf.grad.clone() for leaf in leaves]
    for g in grads:
        dist.all_reduce(g)
    for leaf in leaves:
        leaf.grad = None
    whole = whole_fn()
    sum((o * w).sum() for o, w in zip(whole, weights)).backward()
    for o, w, d in zip(cp, whole, out_dims):
        torch.testing.assert_close(o, local(w.detach(), d), rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")
    for i, (got, leaf) in enumerate(zip(grads, leaves)):
        ref = leaf.grad
        assert (got - ref).abs().max() <= 1e-4 * ref.abs().max(), (what, plan.layout, i)
        leaf.grad = None


def _kernel_cases(rank, world):
    from hfpatch.mixers.cca import CcaProjection, cca_projection
    from hfpatch.mixers.delta_rule import GatedDeltaRule
    from hfpatch.mixers.kernel import KernelCall
    from hfpatch.mixers.lightning import LightningAttention, lightning_attention
    from hfpatch.mixers.rglru import DiagonalRecurrence, linear_recurrence
    from hfpatch.mixers.segments import SegmentPlan, segments_of_layout
    from ring_kernels.layout import shard

    kda = _hf_function("kimi_linear", "chunk_kimi_delta_attention")
    cca_module = _zaya_projection()
    done = []
    for layout, per_rank, starts in _CASES:
        seq = per_rank * world
        cu = None if starts is None else torch.tensor([s * world for s in starts] + [seq], dtype=torch.int32)
        batch = 1 if cu is not None else 2
        plan = SegmentPlan(segments_of_layout(layout, world, per_rank, cu), rank=rank, world_size=world, group=None,
                           layout=layout, cu_seqlens=cu)

        def local(x, dim):
            return shard(x, None, layout=layout, dim=dim, cu_seqlens=cu)

        gen = torch.Generator().manual_seed(seq + world)
        heads, dk, dv, width = 2, 4, 3, 5

        # Lightning attention, blocks of 3 tokens (segments are not multiples of the block).
        q, k, v = _leaf(gen, batch, heads, seq, dk), _leaf(gen, batch, heads, seq, dk), _leaf(gen, batch, heads, seq, dv)
        slope = torch.tensor([0.3, 0.05])[:, None, None]

        def lightning_cp():
            call = KernelCall(lightning_attention, inspect.signature(lightning_attention),
                              (local(q, 2), local(k, 2), local(v, 2), slope, 3), {})
            return LightningAttention().run_cp(call, plan)[:1]

        _compare(rank, world, plan, local, lightning_cp, lambda: lightning_attention(q, k, v, slope, 3)[:1],
                 [q, k, v], [2], "lightning")

        # The RG-LRU's diagonal recurrence, reset where a document starts and at one more token.
        x = _leaf(gen, batch, seq, width)
        a = torch.rand(batch, seq, width, generator=gen).requires_grad_()
        positions = torch.arange(seq) if cu is None else torch.cat(
            [torch.arange(int(e - s)) for s, e in zip(cu[:-1], cu[1:])])
        reset = ((positions == 0) | (torch.arange(seq) == seq // 2 + 1))[None, :, None].expand(batch, seq, 1)

        def recurrence_cp():
            call = KernelCall(linear_recurrence, inspect.signature(linear_recurrence),
                              (local(x, 1), local(a, 1), local(reset, 1), None), {})
            return DiagonalRecurrence().run_cp(call, plan)[:1]

        _compare(rank, world, plan, local, recurrence_cp, lambda: linear_recurrence(x, a, reset)[:1], [x, a], [1],
                 "rg-lru")

        # Kimi delta attention: the gated delta rule with one gate per key channel (HF's torch chunked kernel).
        if kda is not None:
            kq, kk, kv = _leaf(gen, batch, seq, heads, dk), _leaf(gen, batch, seq, heads, dk), _leaf(gen, batch, seq,
                                                                                                      heads, dv)
            g = (-torch.rand(batch, seq, heads, dk, generator=gen) * 0.5).requires_grad_()
            beta = torch.rand(batch, seq, heads, generator=gen).requires_grad_()

            def kda_cp():
                call = KernelCall(kda, inspect.signature(kda), tuple(local(t, 1) for t in (kq, kk, kv, g, beta)),
                                  {"use_qk_l2norm_in_kernel": True})
                return GatedDeltaRule().run_cp(call, plan)[:1]

            _compare(rank, world, plan, local, kda_cp,
                     lambda: kda(kq, kk, kv, g, beta, use_qk_l2norm_in_kernel=True)[:1], [kq, kk, kv, g, beta], [1],
                     "kda")

        # ZAYA's projection (window W = 4 > a one-token segment), HF's module on the whole sequence as reference.
        if cca_module is not None:
            hidden = _leaf(gen, batch, seq, cca_module.hidden_size)
            params = list(cca_module.parameters())

            def cca_cp():
                call = KernelCall(cca_projection, inspect.signature(cca_projection), (cca_module, local(hidden, 1)), {})
                return CcaProjection().run_cp(call, plan)

            _compare(rank, world, plan, local, cca_cp, lambda: cca_projection(cca_module, hidden), [hidden] + params,
                     [1, 1, 1], "zaya-cca")
        done.append((layout, per_rank, starts))
    return done


def _hf_function(model_type, name):
    try:
        modeling = __import__(f"transformers.models.{model_type}.modeling_{model_type}", fromlist=["x"])
    except ImportError:
        return None
    return getattr(modeling, name, None)


def _zaya_projection():
    """A ZayaCCAProjection with kernels 3 and 3 (window 4), random weights and biases, or None before ZAYA."""
    try:
        from transformers.models.zaya.configuration_zaya import ZayaConfig
        from transformers.models.zaya.modeling_zaya import ZayaCCAProjection
    except ImportError:
        return None
    config = ZayaConfig(hidden_size=16, num_attention_heads=4, num_key_value_heads=2, head_dim=4, cca_time0=3,
                        cca_time1=3, attention_bias=True, num_hidden_layers=1)
    torch.manual_seed(3)
    module = ZayaCCAProjection(config, 0)
    from hfpatch.mixers import recognise

    if recognise(module) is None:  # another release's projection (its cache API differs): refused there by name
        return None
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.3)
    return module




# ------------------------------------------------------------------------------------ the registry


def test_registry_recognises_the_mixers_and_refuses_changed_code():
    """Every mixer of these classes is recognised (the audit finds nothing, Kimi-Linear's softmax attention
    ``KimiLinearAttention`` included); a changed RG-LRU scan makes the RG-LRU and the block around it unrecognised,
    and the audit names the block."""
    from hfpatch.model_audit import audit
    from hfpatch.release.sweep.tiny import build_tiny

    _quiet()
    entries = _entries()
    if not entries:
        pytest.skip("no MiniMax / RecurrentGemma / Kimi-Linear / BailingHybrid / ZAYA class in this release")
    for entry in entries:
        model = build_tiny(entry)
        mixers = [n for n, m in model.named_modules() if type(m).__name__ in FAMILY_CLASSES[entry.class_name]]
        assert mixers, entry
        if not _recognised(model):  # a release the registry has not read: refused by name, never silent
            assert [f for f in audit(model) if f.kind == "sequence-mixer"], entry
            continue
        assert _recognised(model) == mixers, entry
        assert [f for f in audit(model) if f.kind == "sequence-mixer"] == [], entry
        if entry.class_name != "RecurrentGemmaForCausalLM":
            continue
        block = model.get_submodule(mixers[0])
        base = type(block.rg_lru)

        def _rnn_scan(self, *args, **kwargs):  # another release's scan, as far as the registry can tell
            return base._rnn_scan(self, *args, **kwargs)

        block.rg_lru.__class__ = type(base.__name__, (base,), {"_rnn_scan": _rnn_scan, "__module__": base.__module__})
        finding = next(f for f in audit(model) if f.path == mixers[0])
        assert "rg_lru" in finding.reason and "fingerprint" in finding.reason, finding


# ------------------------------------------------------------------------------- real HF classes (CP)


def _kernels_and_classes_world(rank, world):
    from hfpatch.mixers import recognise
    from hfpatch.release.sweep.run import check_class
    from hfpatch.release.sweep.tiny import build_tiny

    _quiet()
    results = {"kernel cases": len(_kernel_cases(rank, world))}
    for entry in _entries():
        known = any(recognise(m) is not None for m in build_tiny(entry).modules())
        for kernel in ("auto", "ring"):
            verdict = check_class(entry, dist.group.WORLD, kernel=kernel)
            assert verdict.verdict == ("exact" if known else "refused"), (kernel, verdict)
            results[(entry.class_name, kernel)] = verdict.verdict
    return results


def test_kernels_and_hf_classes_exact_2_ranks():
    """Each kernel's CP form against the whole sequence (one world with the classes: spawning costs more than the
    cases); then the HF classes: CP loss (rtol 1e-5) and every gradient (1e-4 of the largest) equal to non-CP,
    zigzag and contiguous. Before these families exist only the kernels run (ZAYA's and KDA's skipped)."""
    results = run_world(2, _kernels_and_classes_world)[0]
    assert results.pop("kernel cases") == len(_CASES)
    assert len(results) == 2 * len(_entries())


# ------------------------------------------------------------- packed rows, reference mode, refusals, remove


def _model(entry):
    """The tiny model; MiniMax rebuilt with lightning blocks of 6 tokens, so that HF's block loop runs several
    (partial) blocks on the packed row."""
    from hfpatch.release.sweep.tiny import build_tiny

    model = build_tiny(entry)
    if entry.class_name == "MiniMaxForCausalLM":
        config = model.config
        config.block_size = 6
        torch.manual_seed(0)
        model = type(model)(config)
    return model


def _packed_step(rank, world, entry, kernel):
    """A packed row (documents given by position_ids): CP loss and every gradient against the model's non-CP run
    on the same row. Returns the kernel roles that ran in switch mode "ring"."""
    import hfpatch
    from hfpatch.release.sweep.run import GRAD_FLOOR, GRAD_RTOL, LOSS_RTOL

    model = _model(entry)
    lengths = [8 * world, 4 * world, 12 * world]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    ids = torch.randint(0, 128, (1, positions.shape[1]), generator=torch.Generator().manual_seed(5))
    with hfpatch.apply(dist.group.WORLD, model=model, kernel=kernel) as patch:
        with hfpatch.switch("local"):
            ref = model(input_ids=ids, position_ids=positions, labels=ids, use_cache=False).loss
            ref.backward()
        ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        batch = patch.shard_inputs(ids, labels=ids, position_ids=positions)
        loss = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"],
                     use_cache=False).loss
        loss.backward()
        installation = next(h for h in patch._hooks if type(h).__name__ == "MixerInstallation")
        ran = sorted({role for (role, mode), n in installation.calls.items() if mode == "ring" and n})
        largest = max(g.abs().max() for g in ref_grads.values())
        assert abs(loss.item() - ref.item()) <= LOSS_RTOL * abs(ref.item()), (entry.class_name, kernel)
        for name, ref_grad in ref_grads.items():
            got = model.get_parameter(name).grad.clone()
            dist.all_reduce(got)
            bound = GRAD_RTOL * ref_grad.abs().max() + GRAD_FLOOR * largest
            assert (got - ref_grad).abs().max() <= bound, (entry.class_name, kernel, name)
    return ran


def _reference_mode(rank, world, entry):
    """Switch mode "reference" (the kernels on the all-gathered sequence) gives the ring's logits."""
    import hfpatch

    model = _model(entry).eval()
    ids = torch.randint(0, 128, (2, 8 * world), generator=torch.Generator().manual_seed(2))
    logits = {}
    with hfpatch.apply(dist.group.WORLD, model=model) as patch:
        batch = patch.shard_inputs(ids)
        for mode in ("ring", "reference"):
            with torch.no_grad(), hfpatch.switch(mode):
                logits[mode] = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                                     use_cache=False).logits
    torch.testing.assert_close(logits["ring"], logits["reference"], rtol=1e-4, atol=1e-4)


def _refusals_and_remove(rank, world, entry):
    """A refused apply (stripe) and remove() leave no replacement behind; a cache is refused by name."""
    import hfpatch
    from hfpatch.errors import UnsupportedArgument
    from hfpatch.release.sweep.tiny import build_tiny

    model = build_tiny(entry)
    mixers = [m for m in model.modules() if type(m).__name__ in FAMILY_CLASSES[entry.class_name]]
    with pytest.raises(UnsupportedArgument) as info:
        hfpatch.apply(dist.group.WORLD, model=model, kernel="stripe")
    assert info.value.parameter == "kernel"
    assert not any("forward" in m.__dict__ or "_rnn_scan" in m.__dict__ for m in mixers)
    patch = hfpatch.apply(dist.group.WORLD, model=model)
    try:
        assert all(("forward" in m.__dict__) != ("_rnn_scan" in m.__dict__) for m in mixers)
        twin = copy.deepcopy(model)  # e.g. an EMA copy: its replacements are bound to its own modules
        for m in (m for m in twin.modules() if type(m).__name__ in FAMILY_CLASSES[entry.class_name]):
            assert next(v for k, v in m.__dict__.items() if k in ("forward", "_rnn_scan")).__self__ is m
        ids = torch.randint(0, 128, (1, 8 * world), generator=torch.Generator().manual_seed(1))
        batch = patch.shard_inputs(ids)
        with pytest.raises(UnsupportedArgument) as info:  # generation: the block would carry a cached state
            model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=True)
        assert info.value.parameter == "use_cache"
    finally:
        patch.remove()
    assert not any("forward" in m.__dict__ or "_rnn_scan" in m.__dict__ for m in mixers), "remove() takes them off"


def _packed_world(rank, world):
    _quiet()
    entries = {e.class_name: e for e in _entries()}
    ran = {}
    for name, entry in entries.items():
        for kernel in ("auto", "ring"):
            if name in PACKED_REFUSED:  # the attention gets no position_ids: hfpatch refuses packed rows by name
                from hfpatch.errors import UnsupportedArgument

                with pytest.raises(UnsupportedArgument) as info:
                    _packed_step(rank, world, entry, kernel)
                ran[(name, kernel)] = info.value.parameter
                continue
            ran[(name, kernel)] = _packed_step(rank, world, entry, kernel)
    for name in ("MiniMaxForCausalLM", "RecurrentGemmaForCausalLM", "ZayaForCausalLM"):
        _reference_mode(rank, world, entries[name])
    _refusals_and_remove(rank, world, entries["RecurrentGemmaForCausalLM"])
    return ran


def test_packed_rows_reference_refusals_and_remove_2_ranks():
    entries = {e.class_name: e for e in _entries()}
    if set(entries) != set(FAMILY_CLASSES):
        pytest.skip("this release lacks one of MiniMax / RecurrentGemma / Kimi-Linear / BailingHybrid / ZAYA")
    from hfpatch.release.sweep.tiny import build_tiny

    if not all(_recognised(build_tiny(e)) for e in entries.values()):
        pytest.skip("this release's mixer code is not in hfpatch's registry (refused by name: see the registry test)")
    ran = run_world(2, _packed_world)[0]
    expected = {"MiniMaxForCausalLM": ["lightning_attention"],
                "RecurrentGemmaForCausalLM": "position_ids",  # refused by the attention, by name
                "KimiLinearForCausalLM": ["causal_conv1d", "chunk_gated_delta_rule"],
                "BailingHybridForCausalLM": ["causal_conv1d", "chunk_gated_delta_rule"],
                "ZayaForCausalLM": "position_ids"}
    assert ran == {(name, kernel): roles for name, roles in expected.items() for kernel in ("auto", "ring")}
