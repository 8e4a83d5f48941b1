"""Sequence mixers under CP (hfpatch.mixers): the causal convolution and the gated delta rule, and the real HF
classes that run them (LFM2's short conv, Qwen3-Next, Qwen3.5, OLMo hybrid's Gated DeltaNet).

Every case runs in one gloo world of the module (tests/mixers/_mixer_cases.py), each its own test:

- ``exchange-*``: each kernel's segment exchange against the whole sequence, forward and every input's gradient,
  on zigzag, contiguous, zigzag with one-token chunks (shorter than the convolution's window), zigzag varlen and
  contiguous packed layouts, on 2 and 4 ranks, in fp32 (the ``cp`` tolerances) and bf16 (the ``kernel`` bf16
  tolerances against float64);
- ``class-*``: the sweep's check_class, CP loss and every gradient equal to non-CP (zigzag and contiguous on 2
  ranks; Qwen3-Next on 4), or refused by name where the registry does not recognise the release's code;
- ``packed-*``, ``reference-mode-*``, ``refusals-and-remove-*``: packed rows against the model's non-CP run,
  switch mode "reference", the refusals (stripe, packing metadata, a cache) and ``remove()`` restoring every
  rebound kernel; ``registry-*``: recognition, and refusal of a changed forward by its fingerprint.
"""
from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from _mixer_cases import (Case, Exchange, Layout, Skip, compare_exchange, entries, is_recognised,
                          kernel_and_class_cases, kernels_bound_by_name, leaves_from, packed_step, reference_mode,
                          with_due)
import hfpatch
from hfpatch.errors import UnsupportedArgument
from hfpatch.mixers.kernel import KernelCall
from hfpatch.mixers.kinds.conv import CausalConv1d
from hfpatch.mixers.kinds.delta_rule import GatedDeltaRule
from hfpatch.mixers.registry import FAMILIES, KERNEL_PARAMETERS, forward_fingerprint, parameter_spec
from hfpatch.mixers.segments import segments_of_layout
from hfpatch.release.sweep.tiny import build_tiny

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

    rule = getattr(modeling_qwen3_next, "torch_chunk_gated_delta_rule", None)
    # only a release whose module and kernel hfpatch recognises (older ones differ; the family is refused there)
    family = next(f for f in FAMILIES if "Qwen3NextGatedDeltaNet" in f.classes)
    known = forward_fingerprint(modeling_qwen3_next.Qwen3NextGatedDeltaNet.forward) in family.forwards
    return rule if known and rule is not None and parameter_spec(rule) in KERNEL_PARAMETERS[
        "chunk_gated_delta_rule"] else None


# ------------------------------------------------------------------------- exchange vs whole sequence

# One-token zigzag chunks are shorter than the convolution's window (K - 1 = 3).
LAYOUTS = (Layout("zigzag", "zigzag", 8), Layout("contiguous", "contiguous", 8),
           Layout("zigzag-1-token-chunks", "zigzag", 2), Layout("zigzag-packed", "zigzag", 16, (0, 4)),
           Layout("contiguous-packed", "contiguous", 8, (0, 3), scale_starts=False))


def _scaled(scale):
    return lambda gen, shape: torch.randn(*shape, generator=gen) * scale


def _conv(seed, batch, seq):
    channels, width = 5, 4

    def make(cast):
        t = leaves_from(seed, cast, {"x": ((batch, channels, seq), None), "weight": ((channels, width), _scaled(0.5)),
                                     "bias": ((channels,), None)})

        def run(ex):
            if ex is None:
                return (conv_reference(t["x"], t["weight"], t["bias"], activation="silu"),)
            call = KernelCall(conv_reference, inspect.signature(conv_reference),
                              (ex.local(t["x"], 2), t["weight"], t["bias"]), {"activation": "silu"})
            return (CausalConv1d().run_cp(call, ex.plan),)

        return t, run, (2,)

    return make


def _delta(seed, batch, seq, rule):
    hk, hv, dk, dv = 2, 4, 8, 6
    shapes = {"q": ((batch, seq, hk, dk), None), "k": ((batch, seq, hk, dk), None), "v": ((batch, seq, hv, dv), None),
              "g": ((batch, seq, hv), lambda gen, s: -torch.rand(*s, generator=gen) * 0.5),
              "beta": ((batch, seq, hv), lambda gen, s: torch.rand(*s, generator=gen))}

    def make(cast):
        t = leaves_from(seed, cast, shapes)
        names = ("q", "k", "v", "g", "beta")

        def run(ex):
            if ex is None:
                return (rule(*(t[n] for n in names), use_qk_l2norm_in_kernel=True)[0],)
            call = KernelCall(rule, inspect.signature(rule), tuple(ex.local(t[n], 1) for n in names),
                              {"use_qk_l2norm_in_kernel": True, "cu_seqlens": None})
            out, no_state = GatedDeltaRule().run_cp(call, ex.plan)
            assert no_state is None
            return (out,)

        return t, run, (1,)

    return make


def _exchange(group, layout, dtype):
    """The convolution and the delta rule (transformers' own chunked rule where hfpatch recognises it: what the
    models run; else the token-by-token definition) on ``layout``."""
    ex = Exchange(layout, group)
    rule = _hf_delta_rule() or delta_reference
    compare_exchange(ex, _conv(ex.seq + ex.world, ex.batch, ex.seq), dtype, "conv")
    compare_exchange(ex, _delta(ex.seq + ex.world + 1, ex.batch, ex.seq, rule), dtype, f"delta rule {rule.__name__}")
    return rule.__name__


def test_stripe_is_refused_by_name():
    with pytest.raises(UnsupportedArgument) as info:
        segments_of_layout("stripe", 2, 8)
    assert info.value.parameter == "kernel" and "zigzag" in info.value.fix


def test_segments_of_layout_cover_the_sequence_once():
    cu = torch.tensor([0, 8, 8, 24], dtype=torch.int32)
    for layout, world, local, packed in [("contiguous", 3, 5, None), ("zigzag", 4, 6, None), ("zigzag", 2, 12, cu)]:
        segments = segments_of_layout(layout, world, local, packed)
        covered = torch.cat([torch.arange(s.global_start, s.global_start + s.length) for s in segments])
        assert torch.equal(covered, torch.arange(world * local)), (layout, segments)
        assert [s.global_start for s in segments] == sorted(s.global_start for s in segments)


# ------------------------------------------------------------------------------------ real HF classes

# The causal-LM classes whose mixers the registry recognises on transformers 5.24, and the mixer each has
# (LaraMini from 5.24). ``registry-*``: every mixer of the class is recognised and the audit finds nothing; a
# changed forward is not recognised and the audit names the failed check (on a release the registry has not read:
# refused by name).
FAMILY_CLASSES = {
    "Lfm2ForCausalLM": ("Lfm2ShortConv",),
    "Lfm2MoeForCausalLM": ("Lfm2MoeShortConv",),
    "Lfm3ForCausalLM": ("Lfm3ShortConv",),
    "Qwen3NextForCausalLM": ("Qwen3NextGatedDeltaNet",),
    "Qwen3_5ForCausalLM": ("Qwen3_5GatedDeltaNet",),
    "Qwen3_5MoeForCausalLM": ("Qwen3_5MoeGatedDeltaNet",),
    "OlmoHybridForCausalLM": ("OlmoHybridGatedDeltaNet",),
    "LaraMiniForCausalLM": ("LaraMiniGatedDeltaNet",),
}
NAMES = tuple(sorted(FAMILY_CLASSES))


def _packed_due():
    """None when the packed-row, reference-mode and refusal cases run on this release, else why not (their
    ``Case.due``)."""
    found = entries(NAMES)
    if not {"Qwen3NextForCausalLM", "Lfm2ForCausalLM"} <= set(found):
        return Skip("no Lfm2 / Qwen3-Next class in this transformers release")
    if not is_recognised("Qwen3NextForCausalLM", NAMES):
        return Skip("this release's mixer code is not in hfpatch's registry (refused by name: see the class cases)")
    return None


def _tiny(class_name):
    return build_tiny(entries(NAMES)[class_name])


def _packed(group, class_name, kernel, roles):
    """A packed row (documents given by position_ids) against the model's non-CP run on the same row; the
    kernels that ran under CP are ``roles``."""
    world = dist.get_world_size(group)
    return packed_step(group, _tiny(class_name), kernel, [8 * world, 4 * world, 20 * world], class_name, roles)


def _reference_mode(group, class_name):
    return reference_mode(group, _tiny(class_name), class_name)


def _refusals(group, class_name):
    """A refused apply (stripe) installs nothing; under the patch, packing metadata handed to the delta rule and
    a cache are refused by name; ``remove()`` restores every rebound kernel."""
    if not kernels_bound_by_name(class_name, NAMES):
        return Skip(f"{class_name} of this release runs through CP forms of its methods, not rebound kernel names "
                    "(tests/mixers/test_mixers_delta_rule_releases.py covers its refusals and remove())")
    world = dist.get_world_size(group)
    model = _tiny(class_name)
    modeling = __import__(type(model).__module__, fromlist=["x"])
    before = {n: getattr(modeling, n) for n in ("causal_conv1d_fn", "torch_chunk_gated_delta_rule")
              if hasattr(modeling, n)}
    with pytest.raises(UnsupportedArgument) as info:
        hfpatch.apply(group, model=model, kernel="stripe")
    assert info.value.parameter == "kernel"
    assert {n: getattr(modeling, n) for n in before} == before, "a refused apply leaves nothing installed"
    patch = hfpatch.apply(group, model=model)
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
    return "refused"


_GDN = ("causal_conv1d", "chunk_gated_delta_rule")

CASES = (
    kernel_and_class_cases(_exchange, LAYOUTS, FAMILY_CLASSES, four_ranks=("Qwen3NextForCausalLM",))
    + with_due(_packed_due, [
        Case("packed-Qwen3NextForCausalLM-auto", 2, _packed, ("Qwen3NextForCausalLM", "auto", _GDN), weight=2),
        Case("packed-Qwen3NextForCausalLM-zigzag", 2, _packed, ("Qwen3NextForCausalLM", "zigzag", _GDN), weight=2),
        Case("packed-Lfm2ForCausalLM-zigzag", 2, _packed, ("Lfm2ForCausalLM", "zigzag", ("causal_conv1d",)),
             weight=2),
        Case("reference-mode-Qwen3NextForCausalLM", 2, _reference_mode, ("Qwen3NextForCausalLM",)),
        Case("refusals-and-remove-Qwen3NextForCausalLM", 2, _refusals, ("Qwen3NextForCausalLM",), weight=2)])
)


@pytest.mark.parametrize("name", [c.name for c in CASES])
def test_case(world, name):
    world.check(name)
