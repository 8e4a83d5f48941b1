"""Two mechanisms trained at real depth and width in bf16, CP against the non-CP model, 2 gloo ranks: the loss and
the gradients (summed over the group), on every rank.

- **The MoE load-balancing loss** (``hfpatch.model.router_loss``): a Mixtral of hidden 2048 x 48 layers (16 query /
  4 key-value heads; 8 experts of 1408, top 2: a fine-grained MoE's expert width), ``output_router_logits`` on,
  coefficient 0.02: the loss and its ``aux_loss`` within "cp" bfloat16 "loss" of the non-CP bf16 run; the whole
  gradient no further from an fp32 run of the same weights than ``RATIO`` x the non-CP bf16 run's (a router's top-2
  choice flips between two bf16 runs wherever two experts are within a rounding, so single experts' gradients
  differ by far more than the rounding: ``_router`` says what was measured).
- **Images** (``hfpatch.model.multimodal``): a Qwen2-VL whose text model is hidden 2048 x 48 layers and whose vision
  tower is Qwen2-VL's own (32 layers of 1280), two images of 64 and 96 placeholders, each straddling a zigzag
  boundary, the model numbering its 3-D rotary positions over the whole row: the loss and each text parameter's
  gradient within "cp" bfloat16 "loss" and "grad" of the non-CP bf16 run. In bf16 a tower parameter's gradient is a
  sum over every patch whose terms cancel (a LayerNorm bias: 1e-3 of terms far larger), so two bf16 runs of it
  differ by up to half its size whatever the split (measured on a tiny Qwen2-VL: non-CP bf16 against CP bf16 0.48,
  while in fp32 CP matches to 8e-7). Each tower parameter's gradient is therefore compared with an fp32 run of the
  same weights: CP in bf16 no further from it than ``RATIO`` x the non-CP bf16 run (or within GRAD of it).

The non-CP references are copies of the model made before ``apply`` (their own attention implementation).

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
# A gradient under CP in bf16 is at most this many times as far from the fp32 run as the non-CP bf16 run's: the
# vision tower's, each parameter (or within GRAD of it); the MoE model's, the whole gradient
RATIO = 3.0


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


def _router(rank, world):
    torch.manual_seed(0)
    model = _mixtral()
    ids = torch.randint(0, 32000, (2, 256), generator=torch.Generator().manual_seed(1))
    start = time.perf_counter()
    exact, exact_out = _reference_run(model, torch.float32, {"input_ids": ids, "labels": ids})
    bf16, bf16_out = _reference_run(model, torch.bfloat16, {"input_ids": ids, "labels": ids})
    with hfpatch.apply(dist.group.WORLD, model=model, verify="fast") as patch:
        got = model(**patch.shard_inputs(ids, labels=ids))
        got.loss.backward()
    result = {}
    for field in ("loss", "aux_loss"):
        value = getattr(got, field).detach().float()
        assert_close(value, bf16_out[field], LOSS, f"{field} on rank {rank}")
        result[field] = relative_error(value, bf16_out[field])
    grads = {}
    for name, param in model.named_parameters():
        grads[name] = param.grad.float()
        dist.all_reduce(grads[name])
    # against the fp32 run, the whole gradient: a router's top-2 choice flips between two bf16 runs on the tokens
    # whose two best experts are within a rounding, so one expert's gradient differs by far more than the rounding
    # of either run (measured, 8 layers: 0.1 of its largest entry), while the whole gradient moves by the rounding
    cp_error, bf16_error = _whole_error(grads, exact), _whole_error({n: g.float() for n, g in bf16.items()}, exact)
    assert cp_error <= max(RATIO * bf16_error, LOSS.bound), (
        f"rank {rank}: the whole gradient under CP is {cp_error:.3g} from the fp32 run, non-CP bf16 {bf16_error:.3g}")
    routers = [n for n in grads if n.endswith("gate.weight")]
    result.update({"grad (whole, vs fp32)": cp_error, "non-CP bf16 grad (whole, vs fp32)": bf16_error,
                   "router grads (whole, vs fp32)": _whole_error({n: grads[n] for n in routers},
                                                                  {n: exact[n] for n in routers}),
                   "seconds": time.perf_counter() - start})
    return result


def _whole_error(grads: dict, exact: dict) -> float:
    """||grads - exact|| / ||exact|| over every parameter together (L2)."""
    difference = sum(float((grads[n].float() - exact[n].float()).pow(2).sum()) for n in exact)
    return (difference / sum(float(g.float().pow(2).sum()) for g in exact.values())) ** 0.5


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
    inputs = {"input_ids": ids, "labels": ids, **images, **types}
    exact, _ = _reference_run(model, torch.float32, inputs)
    bf16, bf16_out = _reference_run(model, torch.bfloat16, inputs)
    bf16_loss = bf16_out["loss"]
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
        assert cp_error <= max(RATIO * bf16_error, GRAD.bound), (
            f"gradient of {name}: CP bf16 is {cp_error:.3g} from the fp32 run, non-CP bf16 {bf16_error:.3g}")
        worst[key] = max(worst[key], cp_error)
        worst["tower: CP / non-CP bf16 error"] = max(worst["tower: CP / non-CP bf16 error"],
                                                     cp_error / max(bf16_error, 1e-30))
    return {**worst, "seconds": time.perf_counter() - start}


def _reference_run(model, dtype, inputs: dict):
    """The non-CP step of a copy of ``model`` in ``dtype`` on ``inputs`` (floating ones cast to ``dtype``): its
    gradients ({name: tensor}) and its output's loss and aux loss, where it has them (fp32 scalars)."""
    reference = copy.deepcopy(model).to(dtype)
    output = reference(**{k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs.items()})
    output.loss.backward()
    grads = {n: p.grad for n, p in reference.named_parameters()}
    fields = {f: getattr(output, f).detach().float() for f in ("loss", "aux_loss")
              if isinstance(getattr(output, f, None), torch.Tensor)}
    del reference, output
    return grads, fields


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
