"""Qwen3-Next (Gated DeltaNet) and Kimi-Linear (Kimi delta attention) under CP on every release that has them,
through the registry entry of that release (``hfpatch.mixers.families.gated_deltanet`` / ``kimi_delta``; on 5.0
Qwen3-Next's kernels are instance attributes and the CP form of ``hfpatch.mixers.forms.gated_deltanet`` replaces
its forward).

What the model sweep does not exercise: the contiguous layout as well as zigzag, packed rows (documents given by
position_ids), 4 ranks with segments shorter than the convolution's window (1 token against K-1 = 3), switch mode
"reference", a cache refused by name, the stripe layout refused by name at ``apply`` (its one-token segments
would make the state summaries as long as the sequence), and ``remove()`` taking every replacement off. Each case: CP loss and every
gradient equal to the model's non-CP run on the same rows (the sweep's fp32 tolerances), and both kernels of the
mixer ran in switch mode "ring"."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from _dist import run_world
from _mixer_cases import batch_or_packed_rows, catalog_entries, cp_step, recognised_entries
import hfpatch
from hfpatch.errors import UnsupportedArgument
from hfpatch.mixers.forms.gated_deltanet import causal_conv1d, chunk_gated_delta_rule
from hfpatch.release.sweep.tiny import build_tiny

# causal-LM class -> (model type, its mixer class)
MIXERS = {"Qwen3NextForCausalLM": ("qwen3_next", "Qwen3NextGatedDeltaNet"),
          "KimiLinearForCausalLM": ("kimi_linear", "KimiLinearDeltaAttention")}
ROLES = ("causal_conv1d", "chunk_gated_delta_rule")

# (kernel, packed): "auto" is zigzag for batch rows; "ring" contiguous.
_CASES_2 = (("auto", False), ("ring", False), ("auto", True), ("ring", True))
_CASES_4 = (("auto", False), ("auto", True))


def _model(entry):
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    return build_tiny(entry)


def _exact_step(world, entry, kernel, packed):
    """CP loss and gradients against the non-CP run on the same rows (the sweep's verdict rule); returns the ring
    calls of each kernel role."""
    ids, positions = batch_or_packed_rows(world, packed)
    step = cp_step(dist.group.WORLD, _model(entry), kernel, ids, positions)
    step.check_verdict_rule((entry.class_name, kernel, "packed" if packed else "batch", world))
    return tuple(step.calls[(role, "ring")] for role in ROLES)


def _reference_cache_and_remove(world, entry):
    """Switch mode "reference" gives the ring's logits; a cache is refused by name; remove() takes the
    replacements off (releases whose entry replaces ``forward``). Returns (refused parameter, replaced)."""
    model = _model(entry).eval()
    mixers = [m for m in model.modules() if type(m).__name__ == MIXERS[entry.class_name][1]]
    ids, _ = batch_or_packed_rows(world, packed=False)
    logits = {}
    with hfpatch.apply(dist.group.WORLD, model=model) as patch:
        batch = patch.shard_inputs(ids)
        for mode in ("ring", "reference"):
            with torch.no_grad(), hfpatch.switch(mode):
                logits[mode] = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                                     use_cache=False).logits
        with pytest.raises(UnsupportedArgument) as info, torch.no_grad():
            model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=True)
        replaced = [m for m in mixers if "forward" in m.__dict__]
    torch.testing.assert_close(logits["ring"], logits["reference"], rtol=1e-4, atol=1e-4)
    assert not any("forward" in m.__dict__ for m in mixers), "remove() takes the replacements off"
    return info.value.parameter, bool(replaced) and len(replaced) == len(mixers)


def _stripe_refused(entry):
    """``apply(model=, kernel="stripe")`` on a model with these mixers: the refusal (parameter, value). apply is
    all-or-nothing: afterwards no mixer's forward is replaced and transformers' function is its own again."""
    import transformers.modeling_flash_attention_utils as flash_utils

    model = _model(entry)
    mixers = [m for m in model.modules() if type(m).__name__ == MIXERS[entry.class_name][1]]
    with pytest.raises(UnsupportedArgument) as info:
        hfpatch.apply(dist.group.WORLD, model=model, kernel="stripe")
    assert not any("forward" in m.__dict__ for m in mixers), "a refused apply leaves the mixers as they were"
    assert not getattr(flash_utils._flash_attention_forward, "__hfpatch_wrapper__", False)
    return info.value.parameter, info.value.value


def _world(rank, world, cases):
    result = {}
    for entry in catalog_entries(MIXERS):
        for kernel, packed in cases:
            result[(entry.class_name, kernel, packed)] = _exact_step(world, entry, kernel, packed)
        if world == 2:
            result[(entry.class_name, "reference, cache, remove")] = _reference_cache_and_remove(world, entry)
            result[(entry.class_name, "stripe")] = _stripe_refused(entry)
    return result


def _recognised_entries():
    return recognised_entries(MIXERS, "this release has neither Qwen3-Next nor Kimi-Linear")


def _pop_exact_steps(result: dict, entries: list, cases: tuple) -> None:
    """Each entry's exact step of each of ``cases`` ran both kernels of the mixer in switch mode "ring"."""
    for entry in entries:
        for kernel, packed in cases:
            calls = result.pop((entry.class_name, kernel, packed))
            assert all(n > 0 for n in calls), (entry.class_name, kernel, packed, calls)


def test_exact_zigzag_contiguous_packed_reference_cache_2_ranks():
    entries = _recognised_entries()
    result = run_world(2, _world, _CASES_2)[0]
    _pop_exact_steps(result, entries, _CASES_2)
    for entry in entries:
        parameter, replaced = result.pop((entry.class_name, "reference, cache, remove"))
        if replaced:  # the CP form refuses the cache its release's forward receives, by that name
            assert parameter == "cache_params", parameter
        else:  # the kernels' check refuses the cached state they would carry
            assert parameter in ("initial_state", "output_final_state", "past_key_values", "use_cache"), parameter
        assert result.pop((entry.class_name, "stripe")) == ("kernel", "stripe")
    assert not result


def test_exact_one_token_segments_4_ranks():
    entries = _recognised_entries()
    result = run_world(4, _world, _CASES_4)[0]
    _pop_exact_steps(result, entries, _CASES_4)
    assert not result


def test_instance_kernel_names_call_the_kernels_as_hf_does():
    """The CP form's kernel names (``hfpatch.mixers.forms.gated_deltanet``) run the instance's kernel with the
    keywords HF 5.0 passes (causal-conv1d: ``x=``, ``seq_idx=None``; flash-linear-attention's delta rule: no
    ``chunk_size``), and without a conv kernel compute what ``nn.Conv1d(padding=K-1)`` + silu gives."""
    seen = {}

    def fast_conv(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
                  final_states_out=None, activation=None):
        seen["conv"] = (x.shape, seq_idx, activation)
        return x

    def fla_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
                 use_qk_l2norm_in_kernel=False):
        seen["rule"] = (initial_state, output_final_state, use_qk_l2norm_in_kernel)
        return v, None

    x = torch.randn(2, 6, 9)
    conv = torch.nn.Conv1d(6, 6, 4, groups=6, padding=3, bias=False)
    causal_conv1d(x, conv.weight.squeeze(1), None, activation="silu", implementation=fast_conv)
    assert seen["conv"] == (x.shape, None, "silu")
    torch.testing.assert_close(causal_conv1d(x, conv.weight.squeeze(1), None, activation="silu"),
                               torch.nn.functional.silu(conv(x)[..., :9]), rtol=0, atol=0)
    q = torch.randn(1, 5, 2, 4)
    chunk_gated_delta_rule(q, q, q, q[..., 0], q[..., 0], fla_rule, use_qk_l2norm_in_kernel=True)
    assert seen["rule"] == (None, False, True)
