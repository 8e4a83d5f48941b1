"""Attention sinks (``s_aux``) exact under CP on the real HF classes that pass them: the sweep's ``check_class``
(one training step, CP loss and every gradient -- the sinks' included -- against non-CP, 2 gloo ranks) must give
"exact" for each sink class the installed release has, and a packed row (documents told by position_ids) must
match too, through the varlen kernels (llama3 and zigzag varlen) -- one world for all of it.

The classes pass ``s_aux`` from transformers 4.55 (gpt-oss) on; a release without any of them skips."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import hfpatch
from _dist import run_world
from hfpatch.release.sweep.catalog import flash_causal_lm_classes
from hfpatch.release.sweep.run import check_class
from hfpatch.release.sweep.tiny import build_tiny
from ring_kernels.tolerances import assert_close, tolerance

SINK_CLASSES = ("GptOssForCausalLM", "GraniteSWAForCausalLM", "GraniteMoeSWAForCausalLM", "FlintForCausalLM",
                "MiMoV2FlashForCausalLM")
# (class, kernel) of the packed-row cases: the default (llama3 varlen) and zigzag varlen.
PACKED = (("GptOssForCausalLM", "auto"), ("GptOssForCausalLM", "zigzag"), ("MiMoV2FlashForCausalLM", "auto"))


def _entries():
    return [e for e in flash_causal_lm_classes() if e.class_name in SINK_CLASSES and e.importable]


def _sink_parameters(model) -> list:
    return [name for name, _ in model.named_parameters() if name.endswith("sinks")]


def _packed_step(entry, kernel: str, world: int) -> list:
    """A packed row of three documents: CP loss and every gradient (the sinks' summed over the ranks) against the
    model's non-CP run on the same row (switch "local"). Returns the sink parameters compared."""
    model = build_tiny(entry)
    lengths = [8 * world, 4 * world, 12 * world]  # multiples of 2 x world: zigzag varlen splits each document
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    vocab = model.get_input_embeddings().num_embeddings
    ids = torch.randint(0, vocab, (1, positions.shape[1]), generator=torch.Generator().manual_seed(7))
    with hfpatch.apply(dist.group.WORLD, model=model, kernel=kernel) as patch:
        with hfpatch.switch("local"):
            ref = model(input_ids=ids, position_ids=positions, labels=ids, use_cache=False).loss
            ref.backward()
        ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        patch.reset_calls()
        batch = patch.shard_inputs(ids, labels=ids, position_ids=positions)
        assert batch["position_ids"].shape[1] * world == positions.shape[1]
        loss = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"],
                     use_cache=False).loss
        loss.backward()
        assert sum(patch.calls.values()) > 0 and not patch.unpatched_layers(model), "a layer did not run the ring"
    largest = max(g.abs().max().item() for g in ref_grads.values())
    assert_close(loss, ref, tolerance("sweep", torch.float32, "loss"), f"{entry.class_name} {kernel} loss")
    sinks = _sink_parameters(model)
    assert sinks and all(name in ref_grads for name in sinks), sinks
    for name, ref_grad in ref_grads.items():
        got = model.get_parameter(name).grad.clone()
        dist.all_reduce(got)
        assert_close(got, ref_grad, tolerance("sweep", torch.float32, "grad"),
                     f"{entry.class_name} {kernel} {name}", largest=largest)
    return sinks


def _sinks_world(rank, world):
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    entries = {e.class_name: e for e in _entries()}
    results = {}
    for name, entry in entries.items():
        verdict = check_class(entry, dist.group.WORLD)
        results[name] = (verdict.verdict, verdict.detail)
    for name, kernel in PACKED:
        if name in entries:
            results[(name, kernel, "packed")] = len(_packed_step(entries[name], kernel, world))
    return results


def test_sink_classes_exact_2_ranks():
    if not _entries():
        pytest.skip("no causal-LM class with attention sinks (s_aux) in this transformers release")
    results = run_world(2, _sinks_world)[0]
    verdicts = {k: v for k, v in results.items() if isinstance(k, str)}
    assert verdicts and all(v[0] == "exact" for v in verdicts.values()), verdicts
    assert all(n > 0 for k, n in results.items() if not isinstance(k, str))
