"""RecurrentGemma's Griffin block (causal conv + RG-LRU) and ZAYA's convolutional q/k projection under CP on
every release whose forwards the registry lists (5.19 and 5.23), beyond what the model sweep runs (2 ranks,
zigzag): on 4 ranks, where the windows (conv K-1 = 3, ZAYA W = 4) span several one-token segments, the kernels'
exchange against the whole sequence on zigzag, contiguous and zigzag-varlen layouts (forward and gradients, with
the installed release's ``ZayaCCAProjection`` and its cache interface); the real HF classes exact on zigzag and
contiguous shards; switch mode "reference" equal to the ring; a cache and packed rows refused by name."""
from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed as dist

from _dist import run_world
import hfpatch
from hfpatch.errors import UnsupportedArgument
from hfpatch.mixers import recognise
from hfpatch.mixers.kernel import KernelCall
from hfpatch.mixers.kinds.cca import CcaProjection, cca_projection
from hfpatch.mixers.kinds.rglru import DiagonalRecurrence, linear_recurrence
from hfpatch.mixers.segments import SegmentPlan, segments_of_layout
from hfpatch.release.sweep.catalog import CatalogEntry, declares_flash
from hfpatch.release.sweep.run import check_class
from hfpatch.release.sweep.tiny import build_tiny
from ring_kernels.layout import shard

# causal-LM class -> the mixer classes the registry must recognise in it
CLASSES = {
    "RecurrentGemmaForCausalLM": ("RecurrentGemmaRecurrentBlock", "RecurrentGemmaRglru"),
    "ZayaForCausalLM": ("ZayaCCAProjection",),
}
WORLD = 4
# (layout, tokens per rank, document starts (in tokens per rank) of a packed row or None)
KERNEL_CASES = (("zigzag", 2, None), ("contiguous", 3, None), ("zigzag", 8, (0, 2)))


def _quiet():
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()


def _entries():
    """The sweep's catalog entries of CLASSES in the installed release (flash-capable, importable), built from
    transformers' auto mappings for these two model types only (the whole catalog imports every model)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    entries = []
    for model_type, name in (("recurrent_gemma", "RecurrentGemmaForCausalLM"), ("zaya", "ZayaForCausalLM")):
        if MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type) != name:
            continue
        entry = CatalogEntry(model_type, name, CONFIG_MAPPING_NAMES.get(model_type))
        if declares_flash(entry.model_class()):
            entries.append(entry)
    return entries


def _zaya_projection():
    """The installed release's ZayaCCAProjection, kernels 3 and 3 (window 4), random weights and biases."""
    from transformers.models.zaya.configuration_zaya import ZayaConfig
    from transformers.models.zaya.modeling_zaya import ZayaCCAProjection

    config = ZayaConfig(hidden_size=16, num_attention_heads=4, num_key_value_heads=2, head_dim=4, cca_time0=3,
                        cca_time1=3, attention_bias=True, num_hidden_layers=1)
    torch.manual_seed(3)
    module = ZayaCCAProjection(config, 0)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.3)
    return module


def _compare(local, cp_fn, whole_fn, leaves, out_dims, what):
    """This rank's CP outputs equal the whole sequence's on its tokens; every leaf's gradient (summed over the
    ranks) within 1e-4 of its largest, for a random weighting of the outputs."""
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
        assert (got - leaf.grad).abs().max() <= 1e-4 * leaf.grad.abs().max(), (what, i)
        leaf.grad = None


def _kernel_cases(rank, world, with_zaya):
    cca_module = _zaya_projection() if with_zaya else None
    done = []
    for layout, per_rank, starts in KERNEL_CASES:
        seq = per_rank * world
        cu = None if starts is None else torch.tensor([s * world for s in starts] + [seq], dtype=torch.int32)
        batch = 1 if cu is not None else 2
        plan = SegmentPlan(segments_of_layout(layout, world, per_rank, cu), rank=rank, world_size=world, group=None,
                           layout=layout, cu_seqlens=cu)

        def local(x, dim):
            return shard(x, None, layout=layout, dim=dim, cu_seqlens=cu)

        gen = torch.Generator().manual_seed(seq)
        what = f"{layout} {per_rank}/rank {starts}"

        # The RG-LRU's recurrence, reset where a document starts and at one more token.
        x = (torch.randn(batch, seq, 5, generator=gen)).requires_grad_()
        a = torch.rand(batch, seq, 5, generator=gen).requires_grad_()
        positions = torch.arange(seq) if cu is None else torch.cat(
            [torch.arange(int(e - s)) for s, e in zip(cu[:-1], cu[1:])])
        reset = ((positions == 0) | (torch.arange(seq) == seq // 2 + 1))[None, :, None].expand(batch, seq, 1)

        def recurrence_cp():
            call = KernelCall(linear_recurrence, inspect.signature(linear_recurrence),
                              (local(x, 1), local(a, 1), local(reset, 1), None), {})
            return DiagonalRecurrence().run_cp(call, plan)[:1]

        _compare(local, recurrence_cp, lambda: linear_recurrence(x, a, reset)[:1], [x, a], [1], f"rg-lru {what}")

        # ZAYA's projection: the installed release's forward continues each segment from the composed window.
        if cca_module is not None:
            hidden = (torch.randn(batch, seq, cca_module.hidden_size, generator=gen)).requires_grad_()

            def cca_cp():
                call = KernelCall(cca_projection, inspect.signature(cca_projection), (cca_module, local(hidden, 1)), {})
                return CcaProjection().run_cp(call, plan)

            _compare(local, cca_cp, lambda: cca_projection(cca_module, hidden),
                     [hidden] + list(cca_module.parameters()), [1, 1, 1], f"zaya-cca {what}")
        done.append(what)
    return done


def _reference_and_refusals(rank, world, entry):
    """Switch mode "reference" gives the ring's logits; a cache (use_cache=True) and a packed row (documents by
    position_ids: the attention gets no position_ids) are refused by name."""
    model = build_tiny(entry).eval()
    ids = torch.randint(0, 128, (2, 4 * world), generator=torch.Generator().manual_seed(2))
    with hfpatch.apply(dist.group.WORLD, model=model) as patch:
        batch = patch.shard_inputs(ids)
        logits = {}
        for mode in ("ring", "reference"):
            with torch.no_grad(), hfpatch.switch(mode):
                logits[mode] = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                                     use_cache=False).logits
        torch.testing.assert_close(logits["ring"], logits["reference"], rtol=1e-4, atol=1e-4)
        with pytest.raises(UnsupportedArgument) as info:
            model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=True)
        refused = [info.value.parameter]
        positions = torch.cat([torch.arange(n) for n in (2 * world, 2 * world)])[None]
        packed_ids = ids[:1, :positions.shape[1]]
        with pytest.raises(UnsupportedArgument) as info:
            packed = patch.shard_inputs(packed_ids, labels=packed_ids, position_ids=positions)
            model(input_ids=packed["input_ids"], position_ids=packed["position_ids"], labels=packed["labels"],
                  use_cache=False)
        refused.append(info.value.parameter)
    return refused


def _world(rank, world, names):
    """Every rank: which of ``names`` the registry recognises, then the kernel cases and the classes' checks."""
    _quiet()
    entries = {e.class_name: e for e in _entries() if e.class_name in names}
    known = {}
    for name, entry in entries.items():
        mixers = [m for m in build_tiny(entry).modules() if type(m).__name__ in CLASSES[name]]
        known[name] = bool(mixers) and all(recognise(m) is not None for m in mixers)
    entries = {name: entry for name, entry in entries.items() if known[name]}
    results = {"recognised": sorted(entries)}
    if not entries:  # the sweep proves such a release's classes refused by name
        return results
    results["kernel cases"] = _kernel_cases(rank, world, "ZayaForCausalLM" in entries)
    for name, entry in sorted(entries.items()):
        for kernel in ("auto", "ring"):  # zigzag, contiguous
            verdict = check_class(entry, dist.group.WORLD, kernel=kernel)
            assert verdict.verdict == "exact", (name, kernel, verdict)
            results[(name, kernel)] = verdict.verdict
        results[(name, "refused")] = _reference_and_refusals(rank, world, entry)
    return results


def test_griffin_and_zaya_exact_4_ranks():
    """4 ranks: the kernels' exchange, both HF classes exact (zigzag and contiguous), reference mode, refusals."""
    names = sorted(e.class_name for e in _entries())
    if not names:
        pytest.skip("this release has no RecurrentGemma / ZAYA class with a flash path")
    results = run_world(WORLD, _world, names)[0]
    if not results["recognised"]:  # the sweep proves such a release's classes refused by name
        pytest.skip(f"this release's {' / '.join(names)} mixer code is not in hfpatch's registry (refused by name)")
    assert len(results.pop("kernel cases")) == len(KERNEL_CASES)
    for name in results.pop("recognised"):
        assert results[(name, "auto")] == results[(name, "ring")] == "exact"
        assert results[(name, "refused")] == ["use_cache" if name == "RecurrentGemmaForCausalLM"
                                              else "past_key_values", "position_ids"], name
