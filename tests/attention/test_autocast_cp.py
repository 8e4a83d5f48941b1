"""An fp32 model trained under ``torch.autocast`` (Trainer's ``bf16=True``) under CP: RoPE leaves q and k fp32 while
v comes out of its projection in bf16, and transformers' flash path casts all three to the autocast dtype
(``target_dtype``); hfpatch casts them the same way (``refusals.cast_to_target``), so the CP step equals the non-CP
step (switch "local": the flash path's semantics on the whole sequence) within the bf16 CP tolerances -- loss and
every gradient, 2 gloo ranks, one world. The attention calls must really arrive with mixed dtypes (checked).

Releases whose flash path reads only CUDA's autocast state (``target_dtype`` = the weights' dtype under CPU
autocast) skip: there transformers' own flash path cannot run these mixed inputs either."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import hfpatch
from _dist import run_world
from hfpatch.attention import refusals
from hfpatch.release.sweep.catalog import flash_causal_lm_classes
from hfpatch.release.sweep.tiny import build_tiny
from ring_kernels.tolerances import assert_close, tolerance

CLASSES = ("LlamaForCausalLM", "GptOssForCausalLM")  # plain attention, and attention sinks


def _reads_cpu_autocast() -> bool:
    """True when the installed flash path gives the CPU autocast dtype as ``target_dtype`` for an fp32 query."""
    try:
        from transformers.integrations.flash_attention import get_target_dtype
    except ImportError:
        return False
    module = torch.nn.Sequential(torch.nn.Linear(2, 2))
    module.config = object()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return get_target_dtype(torch.zeros(1, dtype=torch.float32), module) is torch.bfloat16


def _entries():
    return [e for e in flash_causal_lm_classes() if e.class_name in CLASSES and e.importable]


def _step(model, ids, positions):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=ids, position_ids=positions, labels=ids, use_cache=False).loss
    loss.backward()
    return loss


def _autocast_world(rank, world):
    seen = []  # (q, k, v) dtypes as the attention calls arrive
    cast = refusals.cast_to_target

    def recording(target_dtype, q, k, v):
        seen.append((target_dtype, q.dtype, k.dtype, v.dtype))
        return cast(target_dtype, q, k, v)

    refusals.cast_to_target = recording  # before apply: the dispatcher binds it when the patch is made
    results = {}
    try:
        for entry in _entries():
            torch.manual_seed(0)
            model = build_tiny(entry)
            assert next(model.parameters()).dtype == torch.float32
            ids = torch.randint(0, model.get_input_embeddings().num_embeddings, (2, 16 * world),
                                generator=torch.Generator().manual_seed(3))
            positions = torch.arange(ids.shape[1])[None].expand_as(ids)
            with hfpatch.apply(dist.group.WORLD, model=model) as patch:
                with hfpatch.switch("local"):
                    ref = _step(model, ids, positions)
                ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
                model.zero_grad(set_to_none=True)
                seen.clear()
                batch = patch.shard_inputs(ids, labels=ids)
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                                 labels=batch["labels"], use_cache=False).loss
                loss.backward()
                assert sum(patch.calls.values()) > 0 and not patch.unpatched_layers(model)
            assert (torch.bfloat16, torch.float32, torch.float32, torch.bfloat16) in seen, seen
            largest = max(g.abs().max().item() for g in ref_grads.values())
            assert_close(loss.float(), ref.float(), tolerance("cp", torch.bfloat16, "loss"), f"{entry.class_name} loss")
            for name, ref_grad in ref_grads.items():
                got = model.get_parameter(name).grad.clone()
                dist.all_reduce(got)
                assert_close(got, ref_grad, tolerance("cp", torch.bfloat16, "grad"), f"{entry.class_name} {name}",
                             largest=largest)
            results[entry.class_name] = abs(loss.item() - ref.item())
    finally:
        refusals.cast_to_target = cast
    return results


def test_fp32_model_under_bf16_autocast_cp_equals_non_cp_2_ranks():
    if not _reads_cpu_autocast():
        pytest.skip("this release's flash path reads only CUDA's autocast state (target_dtype is the weights' dtype "
                    "under CPU autocast), so its own flash path cannot run the mixed q/k/v either")
    if not _entries():
        pytest.skip("no Llama / gpt-oss class in this transformers release")
    results = run_world(2, _autocast_world)[0]
    assert "LlamaForCausalLM" in results, results
