"""The mixture-of-experts load-balancing loss under CP (``hfpatch.model.router_loss``): with
``output_router_logits=True`` the model's ``aux_loss``, its loss (which adds ``router_aux_loss_coef`` times it)
and every parameter gradient, router weights included, equal the non-CP ones, on every rank.

Families: the MoE causal LMs of the installed release that hfpatch's sweep builds (Mixtral, Qwen2-MoE, Qwen3-MoE,
OLMoE, GraniteMoE, gpt-oss where the release has them), tiny, random weights, fp32, on 2 gloo ranks (Mixtral on
4), under the CI pin; on the other releases every family's function and call are checked statically (the worlds
were run by hand on 4.43.4, 4.53.3 and 5.19.0).
Rows: a batch of two rows (against the model's own loss), and one packed row of three documents (position ids
restarting at 0; the first token of each later document carries no label), against each document run alone and
the release's own ``load_balancing_loss_func`` of all their router logits. The loss is asked for in the config
(and, for the first family, at the call), with the coefficient 0.5 (large enough that a wrong aux loss moves the
loss and the router gradients far beyond the bounds). The non-CP reference runs while the patch is live: a model
of the same class off the patch keeps its own loss. The first family also runs inside ``averaged_over_group()``
(each rank's loss is its share: the mean over the group is the non-CP loss, and the gradients AVERAGED over the
group are the non-CP ones), and there with ``num_items_in_batch`` (the shares of the batch's token count: their
SUM is the non-CP loss, and so is the sum of the gradients). Refused by name: a load-balancing loss whose code
hfpatch has not read (its fingerprint taken out of ``router_loss.READ``).

Tolerances: ``ring_kernels.tolerances`` "cp" float32 ("loss" for the losses, "grad" for the gradients).
"""
from __future__ import annotations

import copy
import sys

import pytest
import torch
import torch.distributed as dist

import hfpatch
from _dist import run_world
from _release import skip_unless_ci_pin
from hfpatch.errors import UnsupportedArgument
from hfpatch.inputs import shift_labels, token_loss_sum
from hfpatch.model import router_loss
from hfpatch.model.labels import averaged_over_group
from hfpatch.release.sweep.catalog import flash_causal_lm_classes
from hfpatch.release.sweep.tiny import NotBuilt, build_tiny
from ring_kernels.tolerances import assert_close, relative_error, tolerance

LOSS = tolerance("cp", torch.float32, "loss")
GRAD = tolerance("cp", torch.float32, "grad")
FAMILIES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM",
            "GraniteMoeForCausalLM", "GptOssForCausalLM")
COEFFICIENT = 0.5
SEQ = 16


def _entries(names=FAMILIES):
    return [e for e in flash_causal_lm_classes() if e.class_name in names and e.importable]


def _model(entry, in_config: bool):
    model = build_tiny(entry)
    model.config.output_router_logits = in_config
    model.router_aux_loss_coef = model.config.router_aux_loss_coef = COEFFICIENT
    return model


def _rows(vocab: int):
    """name -> (input_ids, position_ids, labels): every rank builds the same ones."""
    g = torch.Generator().manual_seed(3)
    batch = torch.randint(0, vocab, (2, SEQ), generator=g)
    packed = torch.randint(0, vocab, (1, SEQ), generator=g)
    positions = torch.cat([torch.arange(n) for n in (5, 7, 4)])[None]
    labels = packed.masked_fill(positions == 0, -100)
    labels[0, 0] = packed[0, 0]
    return {"batch": (batch, torch.arange(SEQ)[None].expand(2, -1), batch),
            "packed": (packed, positions, labels)}


def _reference(model, form, ids, positions, labels):
    """(loss, aux_loss) without CP. A batch: the model's own loss with labels. A packed row: each document run
    alone (its own attention), the router logits of all of them given to the release's own
    ``load_balancing_loss_func`` (the tokens of the whole row), the cross-entropy the mean over the row's labels."""
    if form == "batch":
        out = model(input_ids=ids, position_ids=positions, labels=labels, output_router_logits=True)
        return out.loss, out.aux_loss
    starts = torch.nonzero(positions[0] == 0).flatten().tolist() + [ids.shape[1]]
    outs = [model(input_ids=ids[:, a:b], position_ids=positions[:, a:b], output_router_logits=True)
            for a, b in zip(starts[:-1], starts[1:])]
    layers = zip(*(out.router_logits for out in outs))
    found = router_loss.recognise(model)
    lbl = sys.modules[type(model).__module__].load_balancing_loss_func
    aux = lbl(tuple(torch.cat(layer, 0) for layer in layers), found.read(model, found.experts),
              found.read(model, found.top_k), None)
    loss_sum, count = token_loss_sum(torch.cat([out.logits for out in outs], 1), shift_labels(labels))
    return loss_sum / count + COEFFICIENT * aux, aux


def _run(model, ids, positions, labels, in_config: bool, patch, **extra):
    call = dict(extra) if in_config else dict(extra, output_router_logits=True)
    batch = patch.shard_inputs(ids, labels=labels, position_ids=positions)
    return model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"], **call)


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _case(rank, world, entry, in_config, conventions, worst):
    reference = _model(entry, in_config)
    model = copy.deepcopy(reference)
    router = [n for n, _ in model.named_parameters() if n.endswith("gate.weight") or "router" in n]
    assert router, f"{entry.class_name}: no router weight found"
    with hfpatch.apply(dist.group.WORLD, model=model) as patch:
        for form, (ids, positions, labels) in _rows(model.config.vocab_size).items():
            for averaged in conventions:
                convention = {False: "", True: ", averaged", "num_items": ", averaged by num_items_in_batch"}
                what = f"{entry.class_name} {form} ({'config' if in_config else 'call'}{convention[averaged]}) " \
                       f"on rank {rank}"
                reference.zero_grad(set_to_none=True)
                model.zero_grad(set_to_none=True)
                want_loss, want_aux = _reference(reference, form, ids, positions, labels)
                want_loss.backward()
                if averaged == "num_items":   # the shares of the batch's token count SUM to the loss
                    count = int((shift_labels(labels) != -100).sum())
                    with averaged_over_group():
                        got = _run(model, ids, positions, labels, in_config, patch, num_items_in_batch=count)
                    loss = got.loss.detach().clone()
                    dist.all_reduce(loss)
                elif averaged:
                    with averaged_over_group():
                        got = _run(model, ids, positions, labels, in_config, patch)
                    loss = got.loss.detach().clone()
                    dist.all_reduce(loss)
                    loss /= world
                else:
                    got = _run(model, ids, positions, labels, in_config, patch)
                    loss = got.loss.detach()
                got.loss.backward()
                assert_close(got.aux_loss.detach(), want_aux.detach(), LOSS, f"{what}: aux_loss")
                assert_close(loss, want_loss.detach(), LOSS, f"{what}: loss")
                worst["aux"] = max(worst["aux"], relative_error(got.aux_loss.detach(), want_aux.detach()))
                worst["loss"] = max(worst["loss"], relative_error(loss, want_loss.detach()))
                ref_grads, grads = _grads(reference), _grads(model)
                assert ref_grads.keys() == grads.keys(), what
                assert all(n in grads for n in router), f"{what}: a router weight has no gradient"
                for name, grad in grads.items():
                    dist.all_reduce(grad)
                    if averaged is True:
                        grad /= world
                    assert_close(grad, ref_grads[name], GRAD, f"{what}: gradient of {name}")
                    worst["grad"] = max(worst["grad"], relative_error(grad, ref_grads[name]))
                    if name in router:
                        worst["router grad"] = max(worst["router grad"], relative_error(grad, ref_grads[name]))


def _unread_loss_is_refused(rank, entry):
    model = _model(entry, True)
    fingerprints = dict(router_loss.READ)
    router_loss.READ.clear()
    router_loss.recognise_class.cache_clear()
    try:
        with pytest.raises(hfpatch.errors.UnsupportedModel, match="router-aux-loss|output_router_logits"):
            hfpatch.apply(dist.group.WORLD, model=model)
        model.config.output_router_logits = False
        with hfpatch.apply(dist.group.WORLD, model=model) as patch:
            ids, positions, labels = _rows(model.config.vocab_size)["batch"]
            with pytest.raises(UnsupportedArgument, match="not a load-balancing loss hfpatch has read") as info:
                _run(model, ids, positions, labels, False, patch)
            assert info.value.parameter == "output_router_logits"
    finally:
        router_loss.READ.update(fingerprints)
        router_loss.recognise_class.cache_clear()


def _world(rank, world, names):
    """The first family in every form (the loss asked for in the config and at the call; the three gradient
    conventions), the others with the config's loss and the default convention."""
    worst = {"aux": 0.0, "loss": 0.0, "grad": 0.0, "router grad": 0.0}
    entries = _entries(names)
    assert entries, f"none of {names} is in this release"
    for i, entry in enumerate(entries):
        try:
            _model(entry, True)
        except NotBuilt as exc:
            print(f"{entry.class_name}: not built ({exc.reason})")
            continue
        _case(rank, world, entry, True, (False, True, "num_items") if i == 0 else (False,), worst)
        if i == 0:
            _case(rank, world, entry, False, (False,), worst)
    if world == 2:
        _unread_loss_is_refused(rank, entries[0])
    return worst


def test_every_moe_family_of_the_release_has_a_read_load_balancing_loss():
    """The families tested here are recognised on this release (a new release's changed code fails here first)."""
    for entry in _entries():
        found = router_loss.recognise(entry.model_class()(build_tiny(entry).config))
        assert not isinstance(found, str), f"{entry.class_name}: {found}"


def test_aux_loss_matches_non_cp_on_2_ranks():
    skip_unless_ci_pin("the load-balancing loss worlds (every release's function and each family's call of it are "
                       "checked statically above)")
    worst = run_world(2, _world, FAMILIES)
    print("worst relative errors per rank:", worst)


def test_aux_loss_matches_non_cp_on_4_ranks():
    skip_unless_ci_pin("the 4-rank load-balancing loss world")
    worst = run_world(4, _world, ("MixtralForCausalLM",))
    print("worst relative errors per rank:", worst)
