"""The whole-model probe measures CP, not rounding: exact models are accepted at the depth, width and dtypes users
train, and every seeded CP divergence is refused, far above the rounding of the exact models (benchmarks/
probe_margin.py builds the cases; these tests hold its verdicts and margin).

- seeded divergences, each planted where ``model_audit`` cannot see it, on 2 and 4 gloo ranks, bf16 and fp32: a
  short convolution running its shard from a zero state, a token-mixing module no rule knows, positions off by a
  shard at the rotary embedding, a module numbering positions by its input's length, attention called non-causal
  under CP. Each is refused by the probe (naming where) and by ``apply(model=)`` itself; the smallest seeded error
  is at least 10x the largest error of the exact models of the same world and dtype.
- real scale, 2 ranks: ``apply(model=)`` with the default ``verify=True`` accepts a Llama of hidden 2048 x 48
  layers in bf16 (GQA 4:1: an 8B's width and depth), which the probe comparing free-running forwards refused
  (relative error 0.054 > 0.05), and one of hidden 1024 x 80 layers (a 70B's depth) in fp16 (in bf16 it is accepted
  as well, worst 7.7e-3 on 2026-12-06; left out of CI for time, as the bf16 rounding per module does not depend on
  depth: the probe feeds every module the non-CP inputs); a value head
  (``LlamaForSequenceClassification``, one label) on the 2048 x 48 decoder is accepted with its pooled score and
  loss compared on every rank, and refused by name when each rank pools its own last token; and the image scatter
  (``hfpatch.model.multimodal``): a Llava whose text model is the same 2048 x 48 decoder, with a CLIP tower of
  CLIP-L's width (1024, 16 heads; 2 layers, 28-pixel images of 4 patches: the tower's depth and the image count do
  not change the scatter), is accepted with the probe's two images straddling shard boundaries, and rejected by
  name when the images are written as a scatter on each rank's shard would write them
  (tests/model/_seeded_image_bugs.py).

All of it runs under the CI pin only (1.5 minutes on 2 cores): the cases are built from that release's classes,
and the probe's code does not depend on the release. Under the older releases of the matrix the model sweep runs
the probe on every class (no false refusal there), and tests/model/test_whole_model.py a refused token-mixing
module.
"""
from __future__ import annotations

import math
import sys

import pytest
import torch
import torch.distributed as dist

import hfpatch
from _dist import run_world
from _paths import BENCHMARKS
from _release import skip_unless_ci_pin
import _seeded_image_bugs as seeded
from hfpatch.model import attach
from hfpatch.errors import ModelDivergence
from hfpatch.model.probe import probe_model, probe_tolerance

_BENCH = str(BENCHMARKS)
sys.path.insert(0, _BENCH)

import probe_margin as pm  # noqa: E402

MARGIN = 10.0


def _seeded(rank, world, dtypes):
    group = dist.group.WORLD
    rows = pm.run(("small",), pm.SEEDED, dtypes, torch.device("cpu"), group)
    for dtype in dtypes:
        name = str(dtype).replace("torch.", "")
        exact = [r for r in rows if r.dtype == name and r.kind == "exact"]
        seeded = [r for r in rows if r.dtype == name and r.kind == "seeded"]
        assert len(exact) == 2 and len(seeded) == len(pm.SEEDED)
        assert [r.case for r in exact if r.verdict != "accepted"] == [], rows
        assert [r.case for r in seeded if r.verdict != "refused"] == [], rows
        smallest, largest = min(r.error for r in seeded), max(r.error for r in exact)
        assert smallest >= MARGIN * largest, f"{name}: seeded {smallest:.3g} vs exact {largest:.3g}"
        assert largest < probe_tolerance(dtype) < smallest
        # apply(model=) itself refuses each one that needs no planting after apply
        for case in pm.SEEDED:
            model, after = pm.seeded_case(case, dtype, torch.device("cpu"))
            if case == "zero_state_mixer":
                continue  # planted by taking the mixers' exchange out of an applied patch: probed above
            with pytest.raises(ModelDivergence) as info:
                hfpatch.apply(group, model=model)
            assert info.value.error > info.value.tolerance and info.value.check, case
            assert hfpatch.active_patch() is None
    if rank == 0:
        print("\n" + pm.report(rows, world, torch.device("cpu")))


@pytest.mark.parametrize("world", [2, 4])
def test_seeded_divergences_are_refused_with_margin(world):
    skip_unless_ci_pin("the seeded cases (built from 5.24's Llama, LFM2 and rotary modules)")
    run_world(world, _seeded, [torch.bfloat16, torch.float32], timeout=600.0)


def _value_head_on(causal, dtype):
    """A ``LlamaForSequenceClassification`` with one label (a value / reward head) on ``causal``'s decoder (the same
    modules: no second real-scale build), its score head drawn fresh and ``pad_token_id`` set."""
    import copy

    import transformers

    config = copy.deepcopy(causal.config)
    config.num_labels, config.pad_token_id = 1, 0
    shell = copy.deepcopy(config)
    shell.num_hidden_layers = 1
    with torch.device("meta"):
        model = transformers.LlamaForSequenceClassification(shell)
    model.config, model.model = config, causal.model
    torch.manual_seed(1)
    model.score = torch.nn.Linear(config.hidden_size, 1, bias=False, dtype=dtype)
    torch.nn.init.normal_(model.score.weight, std=config.initializer_range)
    return model


def _real_scale(rank, world, dtype, shapes, value_head=False):
    for hidden, layers, heads, kv_heads, mlp in shapes:
        model = pm._llama(hidden, layers, heads, kv_heads, mlp, 32000, dtype, torch.device("cpu"))
        patch = hfpatch.apply(dist.group.WORLD, model=model)      # the default verify=True
        probe = patch.probe
        patch.remove()
        assert patch.probe is not None and probe.compared > layers * 10
        if rank == 0:
            print(f"\n{dtype} {hidden}x{layers}: accepted, worst {probe.worst:.3g} at {probe.worst_at}")
        if value_head and (hidden, layers) == (2048, 48):
            _real_scale_value_head(rank, model, dtype)
            _real_scale_images(rank, model, dtype)
        del model


def _real_scale_value_head(rank, causal, dtype):
    """The pooled output at real scale: the value head is accepted with its pooled score and loss compared on every
    rank, and refused (naming the output field) when each rank pools its own last token."""
    model = _value_head_on(causal, dtype)
    with hfpatch.apply(dist.group.WORLD, model=model) as patch:
        probe = patch.probe
    assert {"logits", "loss"} <= set(probe.outputs) and probe.worst <= probe_tolerance(dtype), probe
    original = attach.install_pooled_head
    attach.install_pooled_head = lambda *args, **kwargs: None
    try:
        with pytest.raises(ModelDivergence) as info:
            hfpatch.apply(dist.group.WORLD, model=model)
    finally:
        attach.install_pooled_head = original
    assert "output field" in info.value.check and info.value.error > 10 * probe.worst, info.value.check
    if rank == 0:
        print(f"{dtype} value head on 2048x48: accepted, worst {probe.worst:.3g}; without the pooling refused at "
              f"{info.value.check} ({info.value.error:.3g})")


def _llava_on(causal, dtype):
    """A ``LlavaForConditionalGeneration`` whose text model and LM head are ``causal``'s (no second real-scale
    build), with a CLIP tower of CLIP-L's width (2 layers, 28-pixel images: 4 placeholders each) and its projector
    drawn fresh; the image token is the vocabulary's last id."""
    import copy

    import transformers

    text = copy.deepcopy(causal.config)
    vision = transformers.CLIPVisionConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=2,
                                           num_attention_heads=16, image_size=28, patch_size=14)
    config = transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_index=text.vocab_size - 1,
                                      image_seq_length=4, vision_feature_select_strategy="default",
                                      vision_feature_layer=-1)
    shell = copy.deepcopy(config)
    shell.text_config.num_hidden_layers = 1
    with torch.device("meta"):
        model = transformers.LlavaForConditionalGeneration(shell)
    torch.manual_seed(2)
    model.model.vision_tower = transformers.CLIPVisionModel(vision).to(dtype)
    model.model.multi_modal_projector = type(model.model.multi_modal_projector)(config).to(dtype)
    model.config = config
    model.model.language_model, model.lm_head = causal.model, causal.lm_head
    return model


def _real_scale_images(rank, causal, dtype):
    """The image scatter at real scale: accepted with two images compared module by module on every rank; rejected
    in the text model when the images are written as a scatter on this rank's shard would write them."""
    model = _llava_on(causal, dtype)
    with hfpatch.apply(dist.group.WORLD, model=model) as patch:
        probe = patch.probe
        assert probe.images == 2 and probe.worst <= probe_tolerance(dtype), probe
        handles = seeded.scatter_on_the_shard(model, model.config.image_token_id)
        with pytest.raises(ModelDivergence) as info:
            probe_model(model, patch)
        for handle in handles:
            handle.remove()
    assert info.value.error > 10 * probe.worst, info.value.check
    if rank == 0:
        print(f"{dtype} Llava on the 2048x48 decoder, 2 images over {probe.tokens} tokens: accepted, worst "
              f"{probe.worst:.3g} at {probe.worst_at}; the shard's scatter rejected at the {info.value.check} "
              f"({info.value.error:.3g})")


def test_real_scale_bf16_is_accepted():
    skip_unless_ci_pin("the real-scale cases")
    run_world(2, _real_scale, torch.bfloat16, [(2048, 48, 16, 4, 5632)], value_head=True,
              timeout=900.0)


def test_real_depth_fp16_is_accepted():
    skip_unless_ci_pin("the real-scale cases")
    run_world(2, _real_scale, torch.float16, [(1024, 80, 8, 2, 2816)], timeout=900.0)


def test_margin_report_names_a_wrong_verdict():
    rows = [pm.Row("exact", "a", "bfloat16", 1.0, 0.2, "output of x", 0.05, 0.1),
            pm.Row("seeded", "b", "bfloat16", 1.0, 0.5, "output of y", 0.05, 0.1)]
    text = pm.report(rows, 2, torch.device("cpu"))
    assert "WRONG VERDICT" in text and "wrong verdicts: 1 of 2" in text
    assert "margin bfloat16: smallest seeded 5.00e-01 / largest exact 2.00e-01 = 2.5x" in text
    assert math.isclose(rows[1].error / rows[0].error, 2.5)
