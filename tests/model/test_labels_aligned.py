"""``model(labels=...)`` for causal LMs whose own loss does not shift (each position scored against its own label:
the BART family, Whisper): under CP the loss and gradients equal the model's own non-CP ones, ``shift_labels=`` is
refused by name, and without CP (an inactive patch) the labels ``shard_inputs`` returned give the model's own loss.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import hfpatch
from _dist import run_world
from hfpatch.errors import UnsupportedArgument
from hfpatch.model.positions import position_kwargs
from hfpatch.release.sweep.catalog import flash_causal_lm_classes
from hfpatch.release.sweep.run import check_class
from hfpatch.release.sweep.tiny import build_tiny


def _bart_entry():
    entry = next((e for e in flash_causal_lm_classes() if e.model_type == "bart"), None)
    if entry is None:
        pytest.skip("BartForCausalLM has no flash-attention path on this transformers release")
    return entry


def _aligned_world(rank, world, entry):
    group = dist.group.WORLD
    verdict = check_class(entry, group)  # CP model(labels=shard labels) vs non-CP model(ids, labels=ids)
    assert verdict.verdict == "exact", verdict

    model = build_tiny(entry)
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(3))
    with hfpatch.apply(group, model=model) as patch:
        assert patch.labels_alignment == "aligned" and patch.labels_refusal is None
        batch = patch.shard_inputs(ids, labels=ids)
        with pytest.raises(UnsupportedArgument) as info:
            model(input_ids=batch["input_ids"], shift_labels=batch["labels"].clone(), use_cache=False,
                  **position_kwargs(model, batch["position_ids"]))
        assert info.value.parameter == "shift_labels" and "own label" in info.value.reason
    return True


def test_aligned_loss_under_cp_2_ranks():
    entry = _bart_entry()
    assert run_world(2, _aligned_world, entry) == [True, True]


def test_inactive_patch_gives_the_models_own_loss():
    """No CP: the shifted labels shard_inputs returned stand for the caller's labels, so an aligned model's loss
    is its own loss on them (not a shifted cross-entropy)."""
    entry = _bart_entry()
    model = build_tiny(entry)
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(3))
    own = model(input_ids=ids, labels=ids, use_cache=False).loss
    with hfpatch.apply(None, model=model) as patch:
        assert not patch.active
        batch = patch.shard_inputs(ids, labels=ids)
        loss = model(input_ids=batch["input_ids"], labels=batch["labels"], use_cache=False).loss
    assert torch.equal(loss, own)
