"""Lightning attention, the RG-LRU, Kimi delta attention and ZAYA's convolutional projection under CP
(hfpatch.mixers.kinds.lightning / rglru / cca, and the gated delta rule kind with per-channel gates), and the real HF
classes MiniMax, RecurrentGemma, Kimi-Linear, BailingHybrid and ZAYA.

Every case runs in one gloo world of the module (tests/mixers/_mixer_cases.py), each its own test:

- ``exchange-*``: each kernel's segment exchange against the whole sequence, forward and every input's gradient
  (ZAYA's module parameters included), on zigzag, contiguous, zigzag with one-token chunks (shorter than every
  window here: conv K-1 = 3, ZAYA W = 4), zigzag varlen and contiguous packed layouts, on 2 and 4 ranks, in fp32
  (the ``cp`` tolerances) and bf16 (what CP adds within the ``kernel`` bf16 tolerances); Kimi's and ZAYA's
  kernels only on releases that have them;
- ``class-*``: the sweep's check_class, CP loss and every gradient equal to non-CP (zigzag and contiguous), or
  refused by name where the registry does not recognise the release's code;
- ``packed-*``: packed rows against the model's non-CP run (RecurrentGemma and ZAYA refused by name: their
  attention layers get no position_ids); ``reference-mode-*``: switch mode "reference" gives the ring's logits;
  ``refusals-and-remove-*``: a refused apply and ``remove()`` leave no replacement behind, a cache is refused by
  name; ``registry-*``: recognition, and refusal of a changed RG-LRU scan by its fingerprint.
"""
from __future__ import annotations

import copy
import inspect

import pytest
import torch
import torch.distributed as dist

from _mixer_cases import (Case, Exchange, Layout, Skip, compare_exchange, entries, is_recognised,
                          kernel_and_class_cases, leaves_from, packed_step, reference_mode, with_due,
                          with_lightning_blocks)
import hfpatch
from hfpatch.errors import UnsupportedArgument
from hfpatch.mixers import recognise
from hfpatch.mixers.kernel import KernelCall
from hfpatch.mixers.kinds.cca import CcaProjection, cca_projection
from hfpatch.mixers.kinds.delta_rule import GatedDeltaRule
from hfpatch.mixers.kinds.lightning import LightningAttention, lightning_attention
from hfpatch.mixers.kinds.rglru import DiagonalRecurrence, linear_recurrence
from hfpatch.release.sweep.tiny import build_tiny

# The causal-LM classes of transformers 5.24 whose mixers these kinds run, and the mixer classes each has.
FAMILY_CLASSES = {
    "MiniMaxForCausalLM": ("MiniMaxLightningAttention",),
    "RecurrentGemmaForCausalLM": ("RecurrentGemmaRecurrentBlock", "RecurrentGemmaRglru"),
    "KimiLinearForCausalLM": ("KimiLinearDeltaAttention",),
    "BailingHybridForCausalLM": ("BailingHybridDeltaAttention",),
    "ZayaForCausalLM": ("ZayaCCAProjection",),
}
NAMES = tuple(sorted(FAMILY_CLASSES))

# Their attention layers get no position_ids (the decoder layers pass the rotary table only): hfpatch's attention
# refuses packed rows by name there, before any mixer runs.
PACKED_REFUSED = ("RecurrentGemmaForCausalLM", "ZayaForCausalLM")

# ------------------------------------------------------------------------- exchange vs whole sequence

# One-token zigzag chunks are shorter than every window here (conv K-1 = 3, ZAYA W = 4).
LAYOUTS = (Layout("zigzag", "zigzag", 8), Layout("contiguous", "contiguous", 8),
           Layout("zigzag-1-token-chunks", "zigzag", 2), Layout("zigzag-packed", "zigzag", 16, (0, 4)),
           Layout("contiguous-packed", "contiguous", 8, (0, 3)))
HEADS, DK, DV, WIDTH = 2, 4, 3, 5


def _lightning(seed, batch, seq):
    """Lightning attention, blocks of 3 tokens (segments are not multiples of the block)."""
    shapes = {n: ((batch, HEADS, seq, DV if n == "v" else DK), None) for n in ("q", "k", "v")}
    slope = torch.tensor([0.3, 0.05])[:, None, None]

    def make(cast):
        t = leaves_from(seed, cast, shapes)
        rate = cast(slope).detach()  # a buffer of the model: in the model's dtype

        def run(ex):
            if ex is None:
                return lightning_attention(t["q"], t["k"], t["v"], rate, 3)[:1]
            call = KernelCall(lightning_attention, inspect.signature(lightning_attention),
                              (ex.local(t["q"], 2), ex.local(t["k"], 2), ex.local(t["v"], 2), rate, 3), {})
            return LightningAttention().run_cp(call, ex.plan)[:1]

        return t, run, (2,)

    return make


def _recurrence(seed, batch, seq, cu):
    """The RG-LRU's diagonal recurrence, reset where a document starts and at one more token."""
    shapes = {"x": ((batch, seq, WIDTH), None), "a": ((batch, seq, WIDTH), lambda g, s: torch.rand(*s, generator=g))}
    positions = torch.arange(seq) if cu is None else torch.cat(
        [torch.arange(int(e - s)) for s, e in zip(cu[:-1], cu[1:])])
    reset = ((positions == 0) | (torch.arange(seq) == seq // 2 + 1))[None, :, None].expand(batch, seq, 1)

    def make(cast):
        t = leaves_from(seed, cast, shapes)

        def run(ex):
            if ex is None:
                return linear_recurrence(t["x"], t["a"], reset)[:1]
            call = KernelCall(linear_recurrence, inspect.signature(linear_recurrence),
                              (ex.local(t["x"], 1), ex.local(t["a"], 1), ex.local(reset, 1), None), {})
            return DiagonalRecurrence().run_cp(call, ex.plan)[:1]

        return t, run, (1,)

    return make


def _kda(seed, batch, seq, kda):
    """Kimi delta attention: the gated delta rule with one gate per key channel (HF's torch chunked kernel)."""
    names = ("q", "k", "v", "g", "beta")
    shapes = {"q": ((batch, seq, HEADS, DK), None), "k": ((batch, seq, HEADS, DK), None),
              "v": ((batch, seq, HEADS, DV), None),
              "g": ((batch, seq, HEADS, DK), lambda gen, s: -torch.rand(*s, generator=gen) * 0.5),
              "beta": ((batch, seq, HEADS), lambda gen, s: torch.rand(*s, generator=gen))}

    def make(cast):
        t = leaves_from(seed, cast, shapes)

        def run(ex):
            if ex is None:
                return kda(*(t[n] for n in names), use_qk_l2norm_in_kernel=True)[:1]
            call = KernelCall(kda, inspect.signature(kda), tuple(ex.local(t[n], 1) for n in names),
                              {"use_qk_l2norm_in_kernel": True})
            return GatedDeltaRule().run_cp(call, ex.plan)[:1]

        return t, run, (1,)

    return make


def _cca(seed, batch, seq, base):
    """ZAYA's projection (window W = 4 > a one-token segment), HF's module on the whole sequence as reference."""
    def make(cast):
        module = cast.module(base)
        t = {**leaves_from(seed, cast, {"hidden": ((batch, seq, base.hidden_size), None)}),
             **dict(module.named_parameters())}

        def run(ex):
            if ex is None:
                return cca_projection(module, t["hidden"])
            call = KernelCall(cca_projection, inspect.signature(cca_projection), (module, ex.local(t["hidden"], 1)),
                              {})
            return CcaProjection().run_cp(call, ex.plan)

        return t, run, (1, 1, 1)

    return make


def _exchange(group, layout, dtype):
    """Every kernel on ``layout``: lightning, the RG-LRU; KDA and ZAYA's projection where this release has them."""
    ex = Exchange(layout, group)
    seed = ex.seq + ex.world
    kinds = [("lightning", _lightning(seed, ex.batch, ex.seq)), ("rg-lru", _recurrence(seed + 1, ex.batch, ex.seq,
                                                                                        ex.cu))]
    kda, cca = _hf_function("kimi_linear", "chunk_kimi_delta_attention"), _zaya_projection()
    if kda is not None:
        kinds.append(("kda", _kda(seed + 2, ex.batch, ex.seq, kda)))
    if cca is not None:
        kinds.append(("zaya-cca", _cca(seed + 3, ex.batch, ex.seq, cca)))
    for kind, make in kinds:
        compare_exchange(ex, make, dtype, kind)
    return [kind for kind, _ in kinds]


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

    if recognise(module) is None:  # another release's projection (its cache API differs): refused there by name
        return None
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.3)
    return module


# ------------------------------------------------------------------------------------ real HF classes


# ``registry-*``: every mixer of the class is recognised (the audit finds nothing, Kimi-Linear's softmax attention
# ``KimiLinearAttention`` included); a changed RG-LRU scan makes the RG-LRU and the block around it unrecognised,
# and the audit names the block (on a release the registry has not read: refused by name, with at least one
# sequence-mixer finding).
REGISTRY_CHANGES = {"RecurrentGemmaForCausalLM": ("rg_lru", "_rnn_scan")}


def _packed_due():
    """None when the packed-row, reference-mode and refusal cases run on this release, else why not (their
    ``Case.due``)."""
    if set(entries(NAMES)) != set(NAMES):
        return Skip("this release lacks one of MiniMax / RecurrentGemma / Kimi-Linear / BailingHybrid / ZAYA")
    if not all(is_recognised(name, NAMES) for name in NAMES):
        return Skip("this release's mixer code is not in hfpatch's registry (refused by name: see the class cases)")
    return None


def _model(class_name):
    """The tiny model; MiniMax rebuilt with lightning blocks of 6 tokens, so that HF's block loop runs several
    (partial) blocks on the packed row."""
    return with_lightning_blocks(build_tiny(entries(NAMES)[class_name]), 6)


def _packed(group, class_name, kernel, roles):
    """A packed row (documents given by position_ids) against the model's non-CP run on the same row; the
    kernels that ran under CP are ``roles``, or the attention refuses the row by name (``roles`` is then the
    parameter the refusal names)."""
    world = dist.get_world_size(group)
    lengths = [8 * world, 4 * world, 12 * world]
    if class_name in PACKED_REFUSED:
        with pytest.raises(UnsupportedArgument) as info:
            packed_step(group, _model(class_name), kernel, lengths, class_name)
        assert info.value.parameter == roles, f"{class_name} kernel={kernel}: refused {info.value.parameter}"
        return info.value.parameter
    return packed_step(group, _model(class_name), kernel, lengths, class_name, roles)


def _reference_mode(group, class_name):
    return reference_mode(group, _model(class_name), class_name)


def _refusals_and_remove(group, class_name):
    """A refused apply (stripe) and remove() leave no replacement behind; a cache is refused by name."""
    world = dist.get_world_size(group)
    model = build_tiny(entries(NAMES)[class_name])
    mixers = [m for m in model.modules() if type(m).__name__ in FAMILY_CLASSES[class_name]]
    with pytest.raises(UnsupportedArgument) as info:
        hfpatch.apply(group, model=model, kernel="stripe")
    assert info.value.parameter == "kernel"
    assert not any("forward" in m.__dict__ or "_rnn_scan" in m.__dict__ for m in mixers)
    patch = hfpatch.apply(group, model=model)
    try:
        assert all(("forward" in m.__dict__) != ("_rnn_scan" in m.__dict__) for m in mixers)
        twin = copy.deepcopy(model)  # e.g. an EMA copy: its replacements are bound to its own modules
        for m in (m for m in twin.modules() if type(m).__name__ in FAMILY_CLASSES[class_name]):
            assert next(v for k, v in m.__dict__.items() if k in ("forward", "_rnn_scan")).__self__ is m
        ids = torch.randint(0, 128, (1, 8 * world), generator=torch.Generator().manual_seed(1))
        batch = patch.shard_inputs(ids)
        with pytest.raises(UnsupportedArgument) as info:  # generation: the block would carry a cached state
            model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=True)
        assert info.value.parameter == "use_cache"
    finally:
        patch.remove()
    assert not any("forward" in m.__dict__ or "_rnn_scan" in m.__dict__ for m in mixers), "remove() takes them off"
    return "refused"


# What runs under CP on a packed row, per class; a parameter name: the attention refuses the row by that name.
_PACKED = {"MiniMaxForCausalLM": ("lightning_attention",),
           "RecurrentGemmaForCausalLM": "position_ids",
           "KimiLinearForCausalLM": ("causal_conv1d", "chunk_gated_delta_rule"),
           "BailingHybridForCausalLM": ("causal_conv1d", "chunk_gated_delta_rule"),
           "ZayaForCausalLM": "position_ids"}

CASES = (
    kernel_and_class_cases(_exchange, LAYOUTS, FAMILY_CLASSES, changed=REGISTRY_CHANGES, every_mixer_named=False)
    + with_due(_packed_due,
               [Case(f"packed-{name}-{kernel}", 2, _packed, (name, kernel, roles), weight=2)
                for name, roles in _PACKED.items() for kernel in ("auto", "ring")]
               + [Case(f"reference-mode-{name}", 2, _reference_mode, (name,))
                  for name in ("MiniMaxForCausalLM", "RecurrentGemmaForCausalLM", "ZayaForCausalLM")]
               + [Case("refusals-and-remove-RecurrentGemmaForCausalLM", 2, _refusals_and_remove,
                       ("RecurrentGemmaForCausalLM",))])
)


@pytest.mark.parametrize("name", [c.name for c in CASES])
def test_case(world, name):
    world.check(name)
