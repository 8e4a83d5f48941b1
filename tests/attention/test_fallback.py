"""Fallback to non-CP mode: no group, or a group of one rank -> an inactive Patch, transformers untouched, one
log line, and input helpers that are the identity (labels shifted as HF shifts them), so a CP training loop
stays correct without CP. (The unsupported-release fallback needs a real multi-rank group: test_apply.py.)"""
from __future__ import annotations

import importlib
import logging
import sys

import pytest
import torch
import torch.distributed as dist

import hfpatch
from hfpatch.attention import patcher
from hfpatch.errors import PatchError

MFAU = "transformers.modeling_flash_attention_utils"
INTEG = "transformers.integrations.flash_attention"


def _bindings():
    """The function as bound by the defining module and by INTEG (4.48+; absent before)."""
    values = []
    for name in (MFAU, INTEG):
        try:
            values.append(importlib.import_module(name)._flash_attention_forward)
        except ImportError:
            continue
    return tuple(values)


@pytest.fixture
def untouched():
    before = _bindings()
    meta_path = list(sys.meta_path)
    yield
    assert _bindings() == before and sys.meta_path == meta_path and hfpatch.active_patch() is None


@pytest.fixture
def world_of_one():
    """An in-process gloo group of one rank (no spawn)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=16, vocab_size=64, attn_implementation="eager")
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def test_no_group_is_inactive_untouched_one_log_line(untouched, caplog):
    model = _tiny_llama()
    with caplog.at_level(logging.INFO, logger="hfpatch"):
        patch = hfpatch.apply(None, model=model)
    assert not patch.active and "cp_group=None" in patch.reason
    assert [r.name for r in caplog.records] == ["hfpatch"] and "not active" in caplog.records[0].getMessage()
    assert model.config._attn_implementation == "eager"  # model= is not applied without a patch
    assert patch.sites == [] and patch.calls == {} and patch.ctx is None and patch.layers_seen() == []
    with pytest.raises(PatchError, match="inactive"):
        patch.wrapper_source()
    patch.remove()
    with pytest.raises(PatchError, match="already removed"):
        patch.remove()


def test_identity_helpers_give_the_non_cp_loss(untouched):
    model = _tiny_llama()
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(3))
    labels = ids.clone()
    labels[0, 5] = -100
    with hfpatch.apply() as patch:
        batch = patch.shard_inputs(ids, labels=labels)
        assert batch["input_ids"] is ids
        assert torch.equal(batch["position_ids"], torch.arange(12).expand(2, 12))
        assert torch.equal(batch["labels"][:, :-1], labels[:, 1:]) and (batch["labels"][:, -1] == -100).all()
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        mask = batch["labels"] != -100
        loss_sum = torch.nn.functional.cross_entropy(logits[mask], batch["labels"][mask], reduction="sum")
        loss = patch.reduce_loss(loss_sum, mask.sum())
    # the same number as HF's own (shifting) loss on the whole batch
    torch.testing.assert_close(loss, model(input_ids=ids, labels=labels).loss)
    assert patch.removed  # the context manager removed it


def test_group_of_one_rank_is_inactive(untouched, world_of_one):
    patch = hfpatch.apply(world_of_one)
    assert not patch.active and "single rank" in patch.reason
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1,))
    assert not hfpatch.apply(mesh).active  # a 1-D mesh is resolved to its group
    with pytest.raises(ValueError, match=r"2-D DeviceMesh.*mesh\['cp'\]"):
        hfpatch.apply(init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "cp")))


def test_inactive_patch_context_manager_removes_on_exception(untouched):
    with pytest.raises(KeyError):
        with hfpatch.apply() as patch:
            raise KeyError("x")
    assert patch.removed
    with pytest.raises(PatchError):
        patch.remove()


def test_no_rebind_finder_left_behind_by_inactive_apply(untouched):
    hfpatch.apply()
    assert not any(isinstance(f, patcher.RebindFinder) for f in sys.meta_path)
