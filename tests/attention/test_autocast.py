"""Mixed precision by autocast on an fp32 model (what ``bf16=True`` gives a Trainer whose model is loaded in fp32):
under CP the ring runs inside ``torch.autocast`` and the step equals the same step without CP under the same
autocast, loss and every gradient, within the bf16 "cp" entries of ``ring_kernels.tolerances`` (bf16 rounding of the
matmuls differs between one forward of the whole sequence and the ring's blocks). 2 gloo ranks, tiny Llama and
Gemma-2 (softcapping, sliding windows), fp32 weights; the reference is the eager model of what the release's flash
path computes (``eager_reference_overrides``). A release whose Gemma-2 flash path fails without CP (4.47) has it
refused by name by the probe, and 4.48 (its flash integration reads only CUDA's autocast state, so under CPU
autocast it hands on q and k in fp32 and v in bf16) has the step refused by name (``UnsupportedArgument`` naming the
dtypes), as flash-attn would; the test checks both.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist

import transformers

import hfpatch
from _dist import run_world
from _release import ci_pin
from hfpatch.errors import UnsupportedArgument, VerificationError
from hfpatch.cli.demo_models import build_model, eager_reference_overrides
from ring_kernels.tolerances import assert_close, relative_error, tolerance

LOSS = tolerance("cp", torch.bfloat16, "loss")
GRAD = tolerance("cp", torch.bfloat16, "grad")


def _world(rank, world):
    worst = {"loss": 0.0, "grad": 0.0, "refused": []}
    for family in ("llama", "gemma2"):
        model = build_model(family)
        # the eager reference of what this release's flash path computes (the ring reproduces that path)
        reference = build_model(family, **eager_reference_overrides(family))
        ids = torch.randint(3, 100, (2, 32), generator=torch.Generator().manual_seed(0))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            want = reference(input_ids=ids, labels=ids).loss
        want.backward()
        try:
            patch = hfpatch.apply(dist.group.WORLD, model=model)
        except VerificationError as refused:
            # transformers 4.47's Gemma-2 flash path fails even without CP: refused by name, as it must be
            assert family == "gemma2" and "non-CP forward raised" in str(refused), refused
            assert transformers.__version__ != ci_pin(), f"{family} refused under the CI pin: {refused}"
            worst["refused"].append(family)
            continue
        with patch:
            batch = patch.shard_inputs(ids, labels=ids)
            try:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    got = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                                labels=batch["labels"]).loss
            except UnsupportedArgument as refused:
                # transformers 4.48's flash integration reads CUDA's autocast state only: under CPU autocast it
                # hands on q and k in fp32 and v in bf16, which flash-attn refuses and so does the ring, by name
                assert "dtypes differ" in str(refused) and transformers.__version__.startswith("4.48."), refused
                worst["refused"].append(family)
                continue
            got.backward()
            assert patch.mode_calls.get("ring", 0) == model.config.num_hidden_layers, patch.mode_calls
        assert model.model.embed_tokens.weight.dtype == torch.float32
        assert_close(got.detach(), want.detach(), LOSS, f"{family}: autocast loss on rank {rank}")
        worst["loss"] = max(worst["loss"], relative_error(got.detach(), want.detach()))
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            grad = p.grad.clone()
            dist.all_reduce(grad)
            assert_close(grad, q.grad, GRAD, f"{family}: autocast gradient of {name}")
            worst["grad"] = max(worst["grad"], relative_error(grad, q.grad))
    return worst


def test_autocast_on_fp32_weights_matches_non_cp():
    print("worst errors per rank:", run_world(2, _world))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([os.path.abspath(__file__), "-q", "-s"]))
