"""Two mechanisms trained at real depth and width in bf16, CP against the non-CP model, 2 gloo ranks: the loss and
every parameter's gradient (summed over the group), on every rank.

- **The MoE load-balancing loss** (``hfpatch.model.router_loss``): a Mixtral of hidden 2048 x 48 layers (16 query /
  4 key-value heads; 8 experts of 1408, top 2: a fine-grained MoE's expert width), ``output_router_logits`` on,
  coefficient 0.02; its ``aux_loss`` too, and the router weights' gradients.
- **Images** (``hfpatch.model.multimodal``): a Qwen2-VL whose text model is hidden 2048 x 48 layers and whose vision
  tower is Qwen2-VL's own (32 layers of 1280), two images of 64 and 96 placeholders, each straddling a zigzag
  boundary, the model numbering its 3-D rotary positions over the whole row; the vision tower's gradients included.
  In bf16 a tower parameter's gradient is a sum over every patch whose terms cancel (a LayerNorm bias: 1e-3 of
  terms far larger), so two bf16 runs of it differ by up to half its size whatever the split (measured on a tiny
  Qwen2-VL: non-CP bf16 against CP bf16 0.48, while in fp32 CP matches to 8e-7). The tower's gradients are
  therefore compared with an fp32 run of the same weights: CP in bf16 must be no further from it than
  ``TOWER_RATIO`` x the non-CP bf16 run (or within GRAD of it).

The non-CP reference is a copy of the model made before ``apply`` (its own attention implementation). Tolerances:
``ring_kernels.tolerances`` "cp" bfloat16 "loss", and "grad" for each parameter against the larger of its
reference's largest entry and its largest share on a rank (``_compare_grads`` says why).

These models take about 60 GB and minutes of 8 cores a rank: the test runs on a machine of at least 16 cores and
96 GiB (such as the device machine's CPU) and skips, saying so, on the 2-core CI machine, where
tests/model/test_model_probe_scale.py checks the image scatter at this depth and width with the probe, and the
tiny tests (tests/model/test_vlm_images.py, tests/model/test_router_loss.py) every family in fp32.
"""
from __future__ import annotations

import copy
import inspect
import os
import sys
import time

import pytest
import torch
import torch.distributed as dist

import hfpatch
from _dist import run_world
from _paths import BENCHMARKS
from ring_kernels.tolerances import assert_close, relative_error, tolerance

if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

import probe_margin as pm  # noqa: E402

transformers = pytest.importorskip("transformers")

LOSS = tolerance("cp", torch.bfloat16, "loss")
GRAD = tolerance("cp", torch.bfloat16, "grad")
CORES, MEMORY_GIB = 16, 96
# The vision tower's gradient under CP in bf16 is at most this many times as far from the fp32 run as the non-CP
# bf16 run's (or within GRAD of it)
TOWER_RATIO = 3.0


def _machine_is_big_enough() -> None:
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30
    if (os.cpu_count() or 1) < CORES or memory < MEMORY_GIB:
        pytest.skip(f"real-scale training needs {CORES} cores and {MEMORY_GIB} GiB ({os.cpu_count()} cores, "
                    f"{memory:.0f} GiB here): run it on a machine that has them")


def _mixtral():
    config = transformers.MixtralConfig(vocab_size=32000, hidden_size=2048, intermediate_size=1408,
                                        num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=4,
                                        num_local_experts=8, num_experts_per_tok=2, output_router_logits=True,
                                        router_aux_loss_coef=0.02, max_position_embeddings=131072, use_cache=False)
    return pm.build_seeded(transformers.MixtralForCausalLM, config, torch.bfloat16, torch.device("cpu"))


IMAGE, VIDEO, START, END = 31996, 31997, 31998, 31999


def _qwen2_vl():
    text = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=48,
                num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=131072,
                rope_parameters={"rope_type": "default", "mrope_section": [16, 24, 24], "rope_theta": 1000000.0})
    config = transformers.Qwen2VLConfig(text_config=text, vision_config=dict(hidden_size=2048),
                                        image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START,
                                        vision_end_token_id=END, use_cache=False)
    return pm.build_seeded(transformers.Qwen2VLForConditionalGeneration, config, torch.bfloat16,
                           torch.device("cpu"))


def _grads(model):
    return {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}


def _compare_grads(model, reference, what):
    """Every gradient summed over the group against the reference's, each parameter within ``GRAD`` of the larger
    of its reference's and its ranks' addends' largest entries: a rank's share of a gradient (the tower's, through
    its placeholders) can be larger than the sum when the shares cancel, and the sum of bf16 shares rounds at
    their scale. Returns the worst difference so measured, over all parameters and over those whose names
    contain each of ``what``'s keys."""
    ref, got = _grads(reference), _grads(model)
    assert ref.keys() == got.keys()
    worst = {"all": 0.0, **{key: 0.0 for key in what}}
    for name, grad in got.items():
        share = grad.abs().max().reshape(1)
        dist.all_reduce(share, op=dist.ReduceOp.MAX)
        dist.all_reduce(grad)
        scale = max(float(ref[name].abs().max()), float(share))
        error = float((grad - ref[name]).abs().max()) / scale if scale else 0.0
        assert error <= GRAD.bound, (f"gradient of {name}: max|err| {error * scale:.3g} > {GRAD.bound} x {scale:.3g} "
                                     f"(the larger of the reference's and a rank's share's largest entry)")
        worst["all"] = max(worst["all"], error)
        for key in what:
            if key in name:
                worst[key] = max(worst[key], error)
    return worst


def _router(rank, world):
    torch.manual_seed(0)
    model = _mixtral()
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 32000, (2, 256), generator=g)
    start = time.perf_counter()
    want = reference(input_ids=ids, labels=ids)
    want.loss.backward()
    with hfpatch.apply(dist.group.WORLD, model=model, verify="fast") as patch:
        batch = patch.shard_inputs(ids, labels=ids)
        got = model(**batch)
        got.loss.backward()
        assert_close(got.loss.detach().float(), want.loss.detach().float(), LOSS, f"loss on rank {rank}")
        assert_close(got.aux_loss.detach().float(), want.aux_loss.detach().float(), LOSS, f"aux loss on rank {rank}")
        worst = _compare_grads(model, reference, ("gate.weight",))
    return {"loss": relative_error(got.loss.detach().float(), want.loss.detach().float()),
            "aux_loss": relative_error(got.aux_loss.detach().float(), want.aux_loss.detach().float()),
            **{f"grad {k}": v for k, v in worst.items()},
            "seconds": time.perf_counter() - start}


def _image_row(g):
    """A row of 256 tokens: images of 64 (grid 1 x 16 x 16 patches) and 96 placeholders (1 x 16 x 24) across the
    zigzag boundaries at 64 and 128 (2 ranks: chunks of 64)."""
    row = torch.randint(0, IMAGE, (256,), generator=g)
    for start, n in ((40, 64), (110, 96)):
        row[start - 1], row[start:start + n], row[start + n] = START, IMAGE, END
    grids = torch.tensor([[1, 16, 16], [1, 16, 24]])
    pixels = torch.randn(int(grids.prod(-1).sum()), 3 * 2 * 14 * 14, generator=g)
    return row[None], {"pixel_values": pixels.to(torch.bfloat16), "image_grid_thw": grids}


def _images(rank, world):
    torch.manual_seed(0)
    model = _qwen2_vl()
    ids, images = _image_row(torch.Generator().manual_seed(1))
    takes_types = "mm_token_type_ids" in inspect.signature(type(model.model).forward).parameters
    types = {"mm_token_type_ids": (ids == IMAGE).int()} if takes_types else {}
    start = time.perf_counter()
    exact, exact_loss = _reference_run(model, torch.float32, ids, images, types)
    bf16, bf16_loss = _reference_run(model, torch.bfloat16, ids, images, types)
    with hfpatch.apply(dist.group.WORLD, model=model, verify="fast") as patch:
        batch = patch.shard_inputs(ids, labels=ids)
        got = model(**batch, **images, **types)
        got.loss.backward()
    assert_close(got.loss.detach().float(), bf16_loss, LOSS, f"loss on rank {rank}")
    worst = {"loss": relative_error(got.loss.detach().float(), bf16_loss), "grad text": 0.0, "grad tower": 0.0,
             "tower: CP / non-CP bf16 error": 0.0}
    for name, param in model.named_parameters():
        grad = param.grad.float()
        dist.all_reduce(grad)
        key = "grad tower" if ".visual." in name else "grad text"
        if key == "grad text":
            assert_close(grad, bf16[name].float(), GRAD, f"gradient of {name}")
            worst[key] = max(worst[key], relative_error(grad, bf16[name].float()))
            continue
        # the tower's: against the fp32 run, as far from it as the non-CP bf16 run is (module docstring)
        cp_error, bf16_error = relative_error(grad, exact[name]), relative_error(bf16[name].float(), exact[name])
        assert cp_error <= max(TOWER_RATIO * bf16_error, GRAD.bound), (
            f"gradient of {name}: CP bf16 is {cp_error:.3g} from the fp32 run, non-CP bf16 {bf16_error:.3g}")
        worst[key] = max(worst[key], cp_error)
        worst["tower: CP / non-CP bf16 error"] = max(worst["tower: CP / non-CP bf16 error"],
                                                     cp_error / max(bf16_error, 1e-30))
    return {**worst, "seconds": time.perf_counter() - start}


def _reference_run(model, dtype, ids, images, types):
    """The non-CP step of a copy of ``model`` in ``dtype``: its gradients ({name: tensor}) and its loss (fp32)."""
    reference = copy.deepcopy(model).to(dtype)
    moved = {k: v.to(dtype) if v.is_floating_point() else v for k, v in images.items()}
    output = reference(input_ids=ids, labels=ids, **moved, **types)
    output.loss.backward()
    grads = {n: p.grad for n, p in reference.named_parameters()}
    loss = output.loss.detach().float()
    del reference, output
    return grads, loss


def _report(name, results):
    print(f"\n{name}, bf16, 2 ranks ({os.cpu_count()} cores):")
    for rank, result in enumerate(results):
        print(f"  rank {rank}: " + ", ".join(f"{k} {v:.3g}" for k, v in result.items()))


def test_router_loss_at_real_scale_bf16():
    _machine_is_big_enough()
    _report("Mixtral 2048 x 48, 8 experts of 1408, aux loss 0.02", run_world(2, _router, timeout=1800.0))


def test_images_at_real_scale_bf16():
    _machine_is_big_enough()
    _report("Qwen2-VL, text 2048 x 48, its 32-layer vision tower, 2 images", run_world(2, _images, timeout=1800.0))
