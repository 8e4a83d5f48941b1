"""MiniMax (lightning attention) and LFM2 (gated short conv) under CP on every release that has them, through the
registry entry of that release (``hfpatch.mixers.families.lightning`` / ``short_conv``; before 5.19 / 5.23 the
CP forms of ``hfpatch.mixers.forms.lightning`` and ``hfpatch.mixers.forms.short_conv`` replace the inline
recurrence).

What the model sweep does not exercise: the contiguous layout as well as zigzag, packed rows (documents given by
position_ids), 4 ranks with segments shorter than the windows (1 token against the conv's 2 and MiniMax blocks of
3), switch mode "reference", a cache refused by name, and ``remove()`` taking every replacement off. Each case:
CP loss and every gradient equal to the model's non-CP run on the same rows (the sweep's fp32 tolerances), and
the mixer's kernel ran in switch mode "ring"."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from _dist import run_world
from _mixer_cases import batch_or_packed_rows, cp_step, recognised_entries, with_lightning_blocks
import hfpatch
from hfpatch.errors import UnsupportedArgument
from hfpatch.mixers.families.short_conv import FAMILIES, SLOW_FORWARD_OF
from hfpatch.mixers.registry import forward_fingerprint
from hfpatch.release.sweep.tiny import build_tiny

# causal-LM class -> (model_type, mixer class, the kernel role its CP form runs)
MIXERS = {"MiniMaxForCausalLM": ("minimax", "MiniMaxLightningAttention", "lightning_attention"),
          "Lfm2ForCausalLM": ("lfm2", "Lfm2ShortConv", "causal_conv1d")}

# (kernel, packed): "auto" is zigzag for batch rows; "ring" contiguous.
_CASES_2 = (("auto", False), ("ring", False), ("auto", True), ("ring", True))
_CASES_4 = (("auto", False), ("auto", True))


def _model(entry):
    """The sweep's tiny model; MiniMax rebuilt with lightning blocks of 3 tokens, so that HF's block loop runs
    several (partial) blocks in every segment."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    return with_lightning_blocks(build_tiny(entry), 3)


def _exact_step(world, entry, kernel, packed):
    """CP loss and gradients against the non-CP run on the same rows (the sweep's verdict rule; a rank whose tokens
    routed to no expert has no gradient for it: zeros); returns the ring calls of the mixer's kernel."""
    ids, positions = batch_or_packed_rows(world, packed)
    step = cp_step(dist.group.WORLD, _model(entry), kernel, ids, positions)
    step.check_verdict_rule((entry.class_name, kernel, "packed" if packed else "batch", world))
    return step.calls[(MIXERS[entry.class_name][2], "ring")]


def _reference_cache_and_remove(world, entry):
    """Switch mode "reference" gives the ring's logits; where the release's entry replaces ``forward`` by a CP
    form, a cache is refused by the name the release gives it and remove() takes the replacements off. Returns
    (the refused parameter or None where the entry rebinds kernels only, whether the entry replaces forward)."""
    model = _model(entry).eval()
    mixers = [m for m in model.modules() if type(m).__name__ == MIXERS[entry.class_name][1]]
    ids, _ = batch_or_packed_rows(world, packed=False)
    logits, refused = {}, None
    with hfpatch.apply(dist.group.WORLD, model=model) as patch:
        replaced = all("forward" in m.__dict__ for m in mixers)
        batch = patch.shard_inputs(ids)
        for mode in ("ring", "reference"):
            with torch.no_grad(), hfpatch.switch(mode):
                logits[mode] = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                                     use_cache=False).logits
        if replaced:
            with pytest.raises(UnsupportedArgument) as info, torch.no_grad():
                model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=True)
            refused = info.value.parameter
    torch.testing.assert_close(logits["ring"], logits["reference"], rtol=1e-4, atol=1e-4)
    assert not any("forward" in m.__dict__ for m in mixers), "remove() takes the replacements off"
    return refused, replaced


def _cache_parameter(entry) -> str:
    """The name the release's mixer forward gives its cache (``past_key_value`` before 5.0, ``cache`` from 5.24)."""
    import inspect

    mixer = next(m for m in build_tiny(entry).modules() if type(m).__name__ == MIXERS[entry.class_name][1])
    return next(n for n in ("past_key_value", "past_key_values", "cache")
                if n in inspect.signature(mixer.forward).parameters)


def _world(rank, world, entries, cases):
    result = {}
    for entry in entries:
        for kernel, packed in cases:
            result[(entry.class_name, kernel, packed)] = _exact_step(world, entry, kernel, packed)
        if world == 2:
            result[(entry.class_name, "reference, cache, remove")] = _reference_cache_and_remove(world, entry)
    return result


def _recognised_entries():
    return recognised_entries(MIXERS, "this release has neither MiniMax nor LFM2")


def test_exact_zigzag_contiguous_packed_reference_cache_2_ranks():
    entries = _recognised_entries()
    result = run_world(2, _world, entries, _CASES_2)[0]
    for entry in entries:
        for kernel, packed in _CASES_2:
            assert result.pop((entry.class_name, kernel, packed)) > 0, (entry.class_name, kernel, packed)
        refused, replaced = result.pop((entry.class_name, "reference, cache, remove"))
        if replaced:  # the CP form refuses the cache by the name the release's forward gives it
            assert refused == _cache_parameter(entry), refused
    assert not result


def test_exact_short_segments_4_ranks():
    """4 ranks: zigzag segments of one token (batch rows of 2 tokens per rank) and documents cut across ranks
    (packed)."""
    entries = _recognised_entries()
    result = run_world(4, _world, entries, _CASES_4)[0]
    assert sorted(result) == sorted((e.class_name, k, p) for e in entries for k, p in _CASES_4)
    assert all(calls > 0 for calls in result.values()), result


def test_inline_short_conv_entry_reads_this_releases_slow_forward():
    """The LFM2 entry whose CP form follows ``slow_forward`` is keyed by ``forward``'s fingerprint: wherever it
    recognises a class, that class's ``slow_forward`` must be the one read with that forward."""
    import importlib

    inline = next(f for f in FAMILIES if f.replaces)
    checked = 0
    for model_type, name in (("lfm2", "Lfm2ShortConv"), ("lfm2_moe", "Lfm2MoeShortConv")):
        try:
            cls = getattr(importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}"), name)
        except (ImportError, AttributeError):
            continue
        key = forward_fingerprint(cls.forward)
        if key in inline.forwards:
            assert SLOW_FORWARD_OF[key] == forward_fingerprint(cls.slow_forward), f"{name}.slow_forward changed"
            checked += 1
    if not checked:
        pytest.skip("no LFM2 class of this release is written inline (4.54 - 5.0)")
