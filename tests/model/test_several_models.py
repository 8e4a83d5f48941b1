"""Several models on one CP group (``Patch.add_model``, a second drop-in call) and no silent no-ring
(``hfpatch.model.reach``), on 2 gloo ranks, fp32, every rank compared.

- A policy (causal LM), its reference (causal LM, other weights, under ``no_grad``), a critic (value head:
  ``*ForSequenceClassification`` with one label) and a reward model (two labels) on one patch: every model's
  outputs equal its non-CP outputs on every rank, the policy's gradients too; removing the reference changes
  nothing of the others, and ``patch.remove()`` restores every model.
- The drop-in: a second ``substitute_hf_flash_attn(group, 1, model=ref)`` keeps the policy on the ring (both
  exact); other arguments while the first patch is live are refused by name.
- OpenRLHF's order -- the drop-in first, no ``model=``, an SDPA model built afterwards -- reaches no ring layer:
  the next ``update_ring_flash_attn_params`` raises ``RingNotReached`` naming the model; ``Patch.reduce_loss``
  after such a forward raises too; with ``on_unsupported="fallback"`` it warns once. A step where the policy reaches
  the ring and a model outside CP (scoring the whole sequence) does not is not flagged.
"""
from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist

import hfpatch
from _dist import run_world
from hfpatch.dropin.ring_flash_attn import substitute_hf_flash_attn, update_ring_flash_attn_params
from hfpatch.errors import PatchError, RingNotReached
from ring_kernels.tolerances import assert_close, tolerance

OUT = tolerance("cp", torch.float32, "out")
GRAD = tolerance("cp", torch.float32, "grad")
SEQ = 16


def _config(**overrides):
    import transformers

    shape = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0)
    shape.update(overrides)
    return transformers.LlamaConfig(**shape)


def _build(head="ForCausalLM", seed=0, **overrides):
    import transformers

    torch.manual_seed(seed)
    return getattr(transformers, "Llama" + head)(_config(**overrides)).float()


def _ids():
    return torch.randint(1, 64, (2, SEQ), generator=torch.Generator().manual_seed(5))


def _log_probs(model, ids, positions=None):
    logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits
    return torch.log_softmax(logits.float(), -1).gather(-1, ids[..., None]).squeeze(-1)


def _summed_grads(model):
    out = {}
    for name, p in model.named_parameters():
        g = (p.grad if p.grad is not None else torch.zeros_like(p)).clone()
        dist.all_reduce(g)
        out[name] = g
    return out


def _four_models(rank, world):
    ids = _ids()
    models = {"policy": _build(), "reference": _build(seed=1), "critic": _build("ForSequenceClassification", 2,
              num_labels=1), "reward": _build("ForSequenceClassification", 3, num_labels=2)}
    expected = {}
    for name, model in models.items():
        out = _log_probs(model, ids) if "ForCausalLM" in type(model).__name__ else model(input_ids=ids).logits
        if name == "policy":
            out.sum().backward()
            policy_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            model.zero_grad(set_to_none=True)
        expected[name] = out.detach()

    patch = hfpatch.apply(dist.group.WORLD, model=models["policy"])
    attached = {name: patch.add_model(models[name]) for name in ("reference", "critic", "reward")}
    assert [a.model for a in patch.models] == list(models.values())
    batch = patch.shard_inputs(ids)
    index = batch["position_ids"][0]

    def check(names, label):
        for name in names:
            model = models[name]
            if name in ("policy", "reference"):
                with torch.set_grad_enabled(name == "policy"):
                    got = _log_probs(model, batch["input_ids"], batch["position_ids"])
                want = expected[name].index_select(1, index)
            else:
                with torch.no_grad():
                    got = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
                want = expected[name]
            assert_close(got.detach(), want, OUT, f"{label}: {name}, rank {rank}")
            if name == "policy":
                models["policy"].zero_grad(set_to_none=True)
                got.sum().backward()
                for n, g in _summed_grads(models["policy"]).items():
                    assert_close(g, policy_grads[n], GRAD, f"{label}: policy gradient of {n}")

    check(models, "four models")
    attached["reference"].remove()
    assert models["reference"].config._attn_implementation != "flash_attention_2"
    check(("policy", "critic", "reward"), "reference removed")
    with pytest.raises(PatchError, match="already on this patch's ring"):
        patch.add_model(models["critic"])
    patch.remove()
    assert all(m.config._attn_implementation != "flash_attention_2" for m in models.values())
    assert hfpatch.active_patch() is None


def _dropin_second_model(rank, world):
    ids = _ids()[:1]
    policy, reference = _build(), _build(seed=1)
    want = {"policy": _log_probs(policy, ids).detach(), "reference": _log_probs(reference, ids).detach()}
    patch = substitute_hf_flash_attn(dist.group.WORLD, 1, model=policy)
    again = substitute_hf_flash_attn(dist.group.WORLD, 1, model=reference)
    assert again is patch and [a.model for a in patch.models] == [policy, reference]
    with pytest.raises(PatchError, match="replacing it would take the earlier call's models off the ring"):
        substitute_hf_flash_attn(dist.group.WORLD, 2)
    update_ring_flash_attn_params(torch.tensor([0, SEQ], dtype=torch.int32), dist.group.WORLD)
    chunk = torch.chunk(ids, world, dim=1)[rank]
    positions = torch.chunk(torch.arange(SEQ)[None], world, dim=1)[rank]
    for name, model in (("policy", policy), ("reference", reference)):
        got = _log_probs(model, chunk, positions).detach()
        assert_close(got, torch.chunk(want[name], world, dim=1)[rank], OUT, f"drop-in: {name}, rank {rank}")
    patch.remove()


def _openrlhf_order(rank, world):
    patch = substitute_hf_flash_attn(dist.group.WORLD, 1)          # before the model exists, no model=
    model = _build(attn_implementation="sdpa")
    cu = torch.tensor([0, SEQ], dtype=torch.int32)
    update_ring_flash_attn_params(cu, dist.group.WORLD)
    chunk = torch.chunk(_ids()[:1], world, dim=1)[rank]
    model(input_ids=chunk, position_ids=torch.chunk(torch.arange(SEQ)[None], world, dim=1)[rank], use_cache=False)
    with pytest.raises(RingNotReached) as info:
        update_ring_flash_attn_params(cu, dist.group.WORLD)
    assert info.value.model_class == "LlamaForCausalLM" and info.value.attn_implementation == "sdpa"
    assert "model=" in str(info.value)
    patch.remove()


def _reduce_loss_and_fallback(rank, world):
    ids = _ids()
    sdpa = _build(attn_implementation="sdpa")
    patch = hfpatch.apply(dist.group.WORLD)                        # no model=: the SDPA model is not routed
    batch = patch.shard_inputs(ids, labels=ids)
    logits = sdpa(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    loss_sum, count = hfpatch.inputs.token_loss_sum(logits, batch["labels"])
    with pytest.raises(RingNotReached):
        patch.reduce_loss(loss_sum, count)
    patch.remove()

    # The policy on the ring, a model outside CP scoring the whole sequence beside it: not flagged.
    policy, outside = _build(), _build(seed=1, attn_implementation="sdpa")
    with hfpatch.apply(dist.group.WORLD, model=policy) as patch:
        batch = patch.shard_inputs(ids)
        outside(input_ids=ids, use_cache=False)                    # the whole sequence, no CP
        policy(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)
        patch.shard_inputs(ids)

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("hfpatch").addHandler(handler)
    try:
        patch = hfpatch.apply(dist.group.WORLD, on_unsupported="fallback")
        for _ in range(3):
            batch = patch.shard_inputs(ids)
            sdpa(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)
        patch.shard_inputs(ids)
        patch.remove()
    finally:
        logging.getLogger("hfpatch").removeHandler(handler)
    warned = [r for r in records if "none of its attention reached hfpatch's ring" in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in records]


def _world(rank, world):
    _four_models(rank, world)
    _dropin_second_model(rank, world)
    _openrlhf_order(rank, world)
    _reduce_loss_and_fallback(rank, world)


def test_several_models_and_no_silent_no_ring():
    run_world(2, _world, timeout=300.0)
