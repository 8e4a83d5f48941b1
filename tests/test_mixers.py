"""Sequence mixers under CP (hfpatch.mixers): the segment exchange against the whole sequence, forward and
gradients, for the causal convolution and the gated delta rule on zigzag, contiguous and zigzag-varlen layouts
(2 and 4 ranks, segments shorter than the convolution's window included); then the real HF classes the registry
recognises: CP loss and every gradient equal to non-CP (the sweep's check_class), packed rows, the refusals, and
``remove()`` restoring every rebound kernel."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from _dist import run_world
from ring_kernels.tolerances import assert_close, tolerance

# ------------------------------------------------------------------------------- plain reference kernels


def conv_reference(hidden_states, weight, bias=None, activation=None, **kwargs):
    """Causal depthwise convolution (B, C, L), weight (C, K): HF's torch causal_conv1d_fn."""
    length = hidden_states.shape[-1]
    out = F.conv1d(hidden_states, weight.unsqueeze(1), bias, padding=weight.shape[-1] - 1,
                   groups=hidden_states.shape[1])[..., :length]
    return F.silu(out) if activation == "silu" else out


def delta_reference(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
                    use_qk_l2norm_in_kernel=False, **kwargs):
    """The gated delta rule token by token (the definition): q, k (B, L, Hk, dk), v (B, L, Hv, dv)."""
    heads = value.shape[2]
    q, k = (x.repeat_interleave(heads // x.shape[2], dim=2).float() for x in (query, key))
    if use_qk_l2norm_in_kernel:
        q, k = F.normalize(q, dim=-1, eps=1e-6), F.normalize(k, dim=-1, eps=1e-6)
    q = q * q.shape[-1] ** -0.5
    batch, length = value.shape[:2]
    state = (torch.zeros(batch, heads, k.shape[-1], value.shape[-1]) if initial_state is None
             else initial_state.float())
    outs = []
    for t in range(length):
        state = state * g[:, t].float().exp()[..., None, None]
        delta = (value[:, t].float() - torch.einsum("bhkv,bhk->bhv", state, k[:, t])) * beta[:, t].float()[..., None]
        state = state + k[:, t][..., None] * delta[..., None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t]))
    return torch.stack(outs, dim=1).to(value.dtype), state if output_final_state else None


def _hf_delta_rule():
    """transformers' own torch chunked gated delta rule (what the real models run on CPU), or None."""
    try:
        from transformers.models.qwen3_next import modeling_qwen3_next
    except ImportError:
        return None
    from hfpatch.mixers.registry import FAMILIES, KERNEL_PARAMETERS, forward_fingerprint, parameter_spec

    rule = getattr(modeling_qwen3_next, "torch_chunk_gated_delta_rule", None)
    # only a release whose module and kernel hfpatch recognises (older ones differ; the family is refused there)
    family = next(f for f in FAMILIES if "Qwen3NextGatedDeltaNet" in f.classes)
    known = forward_fingerprint(modeling_qwen3_next.Qwen3NextGatedDeltaNet.forward) in family.forwards
    return rule if known and rule is not None and parameter_spec(rule) in KERNEL_PARAMETERS[
        "chunk_gated_delta_rule"] else None


# ------------------------------------------------------------------------- exchange vs whole sequence


def _inputs(seed, batch, seq):
    """Global leaf tensors, identical on every rank."""
    gen = torch.Generator().manual_seed(seed)
    hk, hv, dk, dv, channels, width = 2, 4, 8, 6, 5, 4

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).requires_grad_()

    return dict(
        x=r(batch, channels, seq), weight=r(channels, width, scale=0.5), bias=r(channels),
        q=r(batch, seq, hk, dk), k=r(batch, seq, hk, dk), v=r(batch, seq, hv, dv),
        g=(-torch.rand(batch, seq, hv, generator=gen) * 0.5).requires_grad_(),
        beta=torch.rand(batch, seq, hv, generator=gen).requires_grad_(),
        w_conv=torch.randn(batch, channels, seq, generator=gen), w_delta=torch.randn(batch, seq, hv, dv, generator=gen),
    )


def _exchange_case(rank, world, layout, seq, cu, delta_rule):
    """CP (this rank's segments) against the whole sequence: outputs and summed input gradients."""
    import inspect

    from hfpatch.mixers.conv import CausalConv1d
    from hfpatch.mixers.delta_rule import GatedDeltaRule
    from hfpatch.mixers.kernel import KernelCall
    from hfpatch.mixers.segments import SegmentPlan, segments_of_layout
    from ring_kernels.layout import local_positions, shard

    batch = 1 if cu is not None else 2
    t = _inputs(seq + world, batch, seq)
    segments = segments_of_layout(layout, world, seq // world, cu)
    plan = SegmentPlan(segments, rank=rank, world_size=world, group=None, layout=layout, cu_seqlens=cu)
    mine = torch.cat([torch.arange(s.global_start, s.global_start + s.length) for s in plan.local])
    assert torch.equal(mine, local_positions(seq, None, layout=layout, cu_seqlens=cu))

    def local(x, dim):
        return shard(x, None, layout=layout, dim=dim, cu_seqlens=cu)

    conv_call = KernelCall(conv_reference, inspect.signature(conv_reference),
                           (local(t["x"], 2), t["weight"], t["bias"]), {"activation": "silu"})
    conv_cp = CausalConv1d().run_cp(conv_call, plan)
    delta_call = KernelCall(delta_rule, inspect.signature(delta_rule),
                            tuple(local(t[n], 1) for n in ("q", "k", "v", "g", "beta")),
                            {"use_qk_l2norm_in_kernel": True, "cu_seqlens": None})
    delta_cp, no_state = GatedDeltaRule().run_cp(delta_call, plan)
    assert no_state is None
    # Two backwards: in one graph the two independent exchanges could run their backward collectives in a
    # different order on different ranks (in a model, layers are sequential and the order is fixed).
    (conv_cp * local(t["w_conv"], 2)).sum().backward()
    (delta_cp * local(t["w_delta"], 1)).sum().backward()
    leaves = ("x", "weight", "bias", "q", "k", "v", "g", "beta")
    grads = {n: t[n].grad.clone() for n in leaves}
    for g in grads.values():
        dist.all_reduce(g)

    whole_conv = conv_reference(t["x"], t["weight"], t["bias"], activation="silu")
    whole_delta, _ = delta_rule(t["q"], t["k"], t["v"], t["g"], t["beta"], use_qk_l2norm_in_kernel=True)
    for n in leaves:
        t[n].grad = None
    ((whole_conv * t["w_conv"]).sum() + (whole_delta * t["w_delta"]).sum()).backward()
    assert_close(conv_cp, local(whole_conv, 2), tolerance("cp", torch.float32, "out"), f"{layout} conv")
    assert_close(delta_cp, local(whole_delta, 1), tolerance("cp", torch.float32, "out"), f"{layout} delta")
    for n in leaves:
        assert_close(grads[n], t[n].grad, tolerance("cp", torch.float32, "grad"), f"{layout} d{n}")


def _exchange_world(rank, world):
    cases = [("zigzag", 8 * world, None), ("contiguous", 8 * world, None),
             ("zigzag", 2 * world, None),   # zigzag chunks of one token: shorter than the window (K - 1 = 3)
             ("zigzag", 16 * world, torch.tensor([0, 4 * world, 16 * world], dtype=torch.int32)),  # zigzag varlen
             ("contiguous", 8 * world, torch.tensor([0, 3, 8 * world], dtype=torch.int32))]
    # transformers' own chunked rule where it exists (what the models run), else the token-by-token definition.
    rules = [_hf_delta_rule() or delta_reference]
    for layout, seq, cu in cases:
        for rule in rules:
            _exchange_case(rank, world, layout, seq, cu, rule)
    return len(cases) * len(rules)


def test_exchange_matches_whole_sequence_2_ranks():
    assert run_world(2, _exchange_world)[0] >= 5


def _four_ranks_world(rank, world):
    """The exchange cases, and Qwen3-Next (conv + delta rule) through the sweep's check_class: one world."""
    from transformers.utils import logging as hf_logging

    from hfpatch.mixers import recognise
    from hfpatch.release.sweep.run import check_class
    from hfpatch.release.sweep.tiny import build_tiny

    hf_logging.set_verbosity_error()
    verdicts = {"exchange cases": _exchange_world(rank, world)}
    for entry in (e for e in _entries() if e.class_name == "Qwen3NextForCausalLM"):
        if any(recognise(m) is not None for m in build_tiny(entry).modules()):
            verdicts[entry.class_name] = check_class(entry, dist.group.WORLD).verdict
    return verdicts


def test_exchange_and_hf_class_4_ranks():
    verdicts = run_world(4, _four_ranks_world)[0]
    assert verdicts.pop("exchange cases") >= 5
    assert set(verdicts.values()) <= {"exact"}, verdicts


def test_stripe_is_refused_by_name():
    from hfpatch.errors import UnsupportedArgument
    from hfpatch.mixers.segments import segments_of_layout

    with pytest.raises(UnsupportedArgument) as info:
        segments_of_layout("stripe", 2, 8)
    assert info.value.parameter == "kernel" and "zigzag" in info.value.fix


def test_segments_of_layout_cover_the_sequence_once():
    from hfpatch.mixers.segments import segments_of_layout

    cu = torch.tensor([0, 8, 8, 24], dtype=torch.int32)
    for layout, world, local, packed in [("contiguous", 3, 5, None), ("zigzag", 4, 6, None), ("zigzag", 2, 12, cu)]:
        segments = segments_of_layout(layout, world, local, packed)
        covered = torch.cat([torch.arange(s.global_start, s.global_start + s.length) for s in segments])
        assert torch.equal(covered, torch.arange(world * local)), (layout, segments)
        assert [s.global_start for s in segments] == sorted(s.global_start for s in segments)


# ------------------------------------------------------------------------------------ the registry

# The causal-LM classes whose mixers the registry recognises on transformers 5.23, and the mixer each has.
FAMILY_CLASSES = {
    "Lfm2ForCausalLM": "Lfm2ShortConv",
    "Lfm2MoeForCausalLM": "Lfm2MoeShortConv",
    "Lfm3ForCausalLM": "Lfm3ShortConv",
    "Qwen3NextForCausalLM": "Qwen3NextGatedDeltaNet",
    "Qwen3_5ForCausalLM": "Qwen3_5GatedDeltaNet",
    "Qwen3_5MoeForCausalLM": "Qwen3_5MoeGatedDeltaNet",
    "OlmoHybridForCausalLM": "OlmoHybridGatedDeltaNet",
}


def _entries():
    from hfpatch.release.sweep.catalog import flash_causal_lm_classes

    return [e for e in flash_causal_lm_classes() if e.class_name in FAMILY_CLASSES and e.importable]


def _recognised(model) -> list:
    from hfpatch.mixers import recognise

    return [name for name, m in model.named_modules() if recognise(m) is not None]


def test_registry_recognises_exactly_the_known_mixers():
    """On a release whose mixer code the registry lists, every mixer of these classes is recognised and the audit
    finds nothing; a changed forward is not recognised and the audit names the failed check."""
    from hfpatch.model_audit import audit
    from hfpatch.release.sweep.tiny import build_tiny

    entries = _entries()
    if not entries:
        pytest.skip("no Lfm2 / Qwen3-Next / Qwen3.5 class in this transformers release")
    for entry in entries:
        model = build_tiny(entry)
        mixers = [n for n, m in model.named_modules() if type(m).__name__ == FAMILY_CLASSES[entry.class_name]]
        assert mixers, entry
        if not _recognised(model):  # a release the registry has not read: refused by name, never silent
            assert {f.path for f in audit(model)} >= set(mixers)
            continue
        assert _recognised(model) == mixers
        assert [f for f in audit(model) if f.kind == "sequence-mixer"] == []
        module = model.get_submodule(mixers[0])
        base = type(module)

        def forward(self, *args, **kwargs):  # another release's forward, as far as the registry can tell
            return base.forward(self, *args, **kwargs)

        module.__class__ = type(base.__name__, (base,), {"forward": forward, "__module__": base.__module__})
        finding = next(f for f in audit(model) if f.path == mixers[0])
        assert finding.kind == "sequence-mixer" and "fingerprint" in finding.reason


# ------------------------------------------------------------------------------- real HF classes (CP)


def _classes_world(rank, world, kernels):
    from transformers.utils import logging as hf_logging

    from hfpatch.mixers import recognise
    from hfpatch.release.sweep.run import check_class
    from hfpatch.release.sweep.tiny import build_tiny

    hf_logging.set_verbosity_error()
    results = {}
    for entry in _entries():
        known = any(recognise(m) is not None for m in build_tiny(entry).modules())
        for kernel in kernels:
            verdict = check_class(entry, dist.group.WORLD, kernel=kernel)
            expected = "exact" if known else "refused"
            assert verdict.verdict == expected, (kernel, verdict)
            results[(entry.class_name, kernel)] = verdict.verdict
    return results


def test_hf_classes_exact_2_ranks():
    """CP loss and every gradient equal to non-CP within the sweep's entries of ring_kernels.tolerances (the
    sweep's check_class): zigzag and contiguous."""
    if not _entries():
        pytest.skip("no Lfm2 / Qwen3-Next / Qwen3.5 class in this transformers release")
    results = run_world(2, _classes_world, ("auto", "ring"))[0]
    assert results


# ------------------------------------------------------------- packed rows, counting, refusals, remove


def _packed_step(rank, world, entry, kernel):
    """A packed row (documents given by position_ids): CP loss and gradients against the model's non-CP run on
    the same row, which runs its mixers over the documents as one sequence (HF's torch path)."""
    import hfpatch
    from hfpatch.release.sweep.tiny import build_tiny

    model = build_tiny(entry)
    lengths = [8 * world, 4 * world, 20 * world]
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
        ran = {role for (role, mode), n in installation.calls.items() if mode == "ring" and n}
        assert "causal_conv1d" in ran
        largest = max(g.abs().max().item() for g in ref_grads.values())
        assert_close(loss, ref, tolerance("sweep", torch.float32, "loss"), f"{entry.class_name} {kernel} loss")
        for name, ref_grad in ref_grads.items():
            got = model.get_parameter(name).grad.clone()
            dist.all_reduce(got)
            assert_close(got, ref_grad, tolerance("sweep", torch.float32, "grad"),
                         f"{entry.class_name} {kernel} {name}", largest=largest)
    return sorted(ran)


def _refusals(rank, world, entry):
    import hfpatch
    from hfpatch.errors import UnsupportedArgument
    from hfpatch.release.sweep.tiny import build_tiny

    model = build_tiny(entry)
    modeling = __import__(type(model).__module__, fromlist=["x"])
    before = {n: getattr(modeling, n) for n in ("causal_conv1d_fn", "torch_chunk_gated_delta_rule")
              if hasattr(modeling, n)}
    with pytest.raises(UnsupportedArgument) as info:
        hfpatch.apply(dist.group.WORLD, model=model, kernel="stripe")
    assert info.value.parameter == "kernel"
    assert {n: getattr(modeling, n) for n in before} == before, "a refused apply leaves nothing installed"
    patch = hfpatch.apply(dist.group.WORLD, model=model)
    try:
        assert all(getattr(modeling, n) is not f and getattr(modeling, n).__wrapped__ is f for n, f in before.items())
        ids = torch.randint(0, 128, (1, 8 * world), generator=torch.Generator().manual_seed(1))
        batch = patch.shard_inputs(ids)
        seq_local = batch["input_ids"].shape[1]
        cu = torch.tensor([0, seq_local * world], dtype=torch.int32)
        with pytest.raises(UnsupportedArgument) as info:  # HF hands cu_seq_lens_q to the delta rule
            model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], cu_seq_lens_q=cu,
                  cu_seq_lens_k=cu, max_length_q=seq_local * world, max_length_k=seq_local * world, use_cache=False)
        assert info.value.parameter in ("cu_seq_lens_q", "cu_seqlens", "seq_idx")
        with pytest.raises(UnsupportedArgument) as info:  # a cache: the recurrent state would come in from it
            modeling.torch_chunk_gated_delta_rule(*(torch.zeros(1, seq_local, 2, 4) for _ in range(3)),
                                                  torch.zeros(1, seq_local, 2), torch.zeros(1, seq_local, 2),
                                                  initial_state=torch.zeros(1, 2, 4, 4))
        assert info.value.parameter == "initial_state"
    finally:
        patch.remove()
    assert {n: getattr(modeling, n) for n in before} == before, "remove() restores every rebound kernel"


def _reference_mode(rank, world, entry):
    """Switch mode "reference" (the original kernels on the all-gathered sequence) gives the ring's logits."""
    import hfpatch
    from hfpatch.release.sweep.tiny import build_tiny

    model = build_tiny(entry).eval()
    ids = torch.randint(0, 128, (2, 8 * world), generator=torch.Generator().manual_seed(2))
    logits = {}
    with hfpatch.apply(dist.group.WORLD, model=model) as patch:
        batch = patch.shard_inputs(ids)
        for mode in ("ring", "reference"):
            with torch.no_grad(), hfpatch.switch(mode):
                logits[mode] = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                                     use_cache=False).logits
    assert_close(logits["ring"], logits["reference"], tolerance("cp", torch.float32, "out"), "ring vs reference")


def _packed_world(rank, world):
    entries = {e.class_name: e for e in _entries()}
    _reference_mode(rank, world, entries["Qwen3NextForCausalLM"])
    ran = {kernel: _packed_step(rank, world, entries["Qwen3NextForCausalLM"], kernel) for kernel in ("auto", "zigzag")}
    ran["lfm2"] = _packed_step(rank, world, entries["Lfm2ForCausalLM"], "zigzag")
    _refusals(rank, world, entries["Qwen3NextForCausalLM"])
    return ran


def test_packed_rows_counting_refusals_and_remove_2_ranks():
    entries = {e.class_name: e for e in _entries()}
    if not {"Qwen3NextForCausalLM", "Lfm2ForCausalLM"} <= set(entries):
        pytest.skip("no Lfm2 / Qwen3-Next class in this transformers release")
    from hfpatch.release.sweep.tiny import build_tiny

    if not _recognised(build_tiny(entries["Qwen3NextForCausalLM"])):
        pytest.skip("this release's mixer code is not in hfpatch's registry (refused by name: see the 2-rank test)")
    ran = run_world(2, _packed_world)[0]
    assert ran["auto"] == ran["zigzag"] == ["causal_conv1d", "chunk_gated_delta_rule"]
