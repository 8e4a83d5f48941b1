"""hfpatch.keep_attention: a real HF Llama under hfpatch.apply on 2 gloo ranks trains to the same loss and
gradients, bit for bit, with and without kept attention outputs, through each way of checkpointing it wraps
(transformers' ``gradient_checkpointing_enable``, enabled before or after ``keep_attention``, and torch's
``checkpoint_wrapper``), while each layer's recomputation runs no ring forward. Then its refusals, ``remove()``,
and the same at real depth and width in bf16 (hidden 2048 x 48 layers).
"""
from __future__ import annotations

import hashlib
import sys

import pytest
import torch
import torch.distributed as dist

import hfpatch
from _dist import run_world
from _paths import BENCHMARKS
from _release import skip_unless_ci_pin
from hfpatch.cli.demo_models import build_model, tiny_config
from hfpatch.errors import KeepAttentionError
from hfpatch.inputs import token_loss_sum
from ring_kernels import engine

sys.path.insert(0, str(BENCHMARKS))

import probe_margin as pm  # noqa: E402

SEQ = 64
# The real-scale case's tokens (8 per rank): what it tests is depth, width and dtype. On a CPU without AVX-512, torch
# computes a bf16 linear's input gradient (grad @ W) at ~0.15 GFLOP/s, in time linear in the tokens (0.87 s per
# 32 x 2048 x 2048 product): 32 tokens per rank took 15 minutes there.
REAL_SCALE_SEQ = 16


def _model(route: str, dtype=torch.float32, shape=None):
    """A Llama (tiny, or ``shape`` = (hidden, layers, heads, kv heads, mlp)) checkpointed the way ``route`` says."""
    if shape is None:
        model = build_model("llama", dtype=dtype)
    else:   # built in its dtype (no fp32 copy first): two ranks' weights and gradients stay within a CI machine
        import transformers

        hidden, layers, heads, kv_heads, mlp = shape
        config = tiny_config("llama", hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                             num_key_value_heads=kv_heads, head_dim=hidden // heads, intermediate_size=mlp,
                             vocab_size=1024, initializer_range=0.02)
        model = pm.build_seeded(transformers.LlamaForCausalLM, config, dtype, torch.device("cpu"))
    model.train()
    if route == "transformers":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif route == "checkpoint_wrapper":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

        layer_cls = type(model.model.layers[0])
        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, layer_cls))
    return model


def _step(model, patch, rank, seq):
    """Loss and gradients (by name) of one CP step on a fixed batch of ``seq`` tokens; the ring forwards run
    (engine.forward_pass)."""
    ids = torch.randint(0, model.config.vocab_size, (1, seq), generator=torch.Generator().manual_seed(7))
    calls = []
    forward = engine.forward_pass

    def counting(*args, **kwargs):
        calls.append(1)
        return forward(*args, **kwargs)

    engine.forward_pass = counting
    try:
        batch = patch.shard_inputs(ids, labels=ids)
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        loss = patch.reduce_loss(*token_loss_sum(logits, batch["labels"]))
        loss.backward()
    finally:
        engine.forward_pass = forward
    # each gradient as a digest of its bytes: bitwise comparison without holding a second model's gradients
    grads = {n.replace("_checkpoint_wrapped_module.", ""): _digest(p.grad) for n, p in model.named_parameters()}
    return loss.detach(), grads, len(calls)


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _routes(rank, world, dtype, shape, routes, seq=SEQ):
    results = []
    for route, keep_first in routes:
        layers = _model("none", dtype, shape).config.num_hidden_layers if shape is None else shape[1]
        plain_model = _model(route, dtype, shape)
        patch = hfpatch.apply(dist.group.WORLD, model=plain_model, verify="fast")
        loss_p, grads_p, calls_p = _step(plain_model, patch, rank, seq)
        patch.remove()
        del plain_model

        if keep_first:                      # keep_attention before the checkpointing it wraps
            kept_model = _model("none", dtype, shape)
            kept = hfpatch.keep_attention(kept_model, budget="all")
            kept_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            kept_model = _model(route, dtype, shape)
            kept = hfpatch.keep_attention(kept_model, budget="all")
        patch = hfpatch.apply(dist.group.WORLD, model=kept_model, verify="fast")
        loss_k, grads_k, calls_k = _step(kept_model, patch, rank, seq)
        patch.remove()
        stats = kept.stats()
        kept.remove()
        restored = [n for n, m in kept_model.named_modules()
                    if getattr(getattr(m, "checkpoint_fn", None), "keeper", None) is not None
                    or getattr(getattr(m, "_gradient_checkpointing_func", None), "keeper", None) is not None]
        results.append(dict(route=route, keep_first=keep_first, layers=layers,
                            loss_equal=bool(torch.equal(loss_p, loss_k)),
                            differ=[n for n in grads_p if grads_p[n] != grads_k[n]],
                            calls=(calls_p, calls_k), stats=stats, still_wrapped=restored))
        del kept_model
    return results


def _check(results):
    for rank_results in results:
        for r in rank_results:
            assert r["loss_equal"] and not r["differ"], r
            layers = r["layers"]
            assert r["calls"] == (2 * layers, layers), r        # the recomputation ran no ring forward
            stats = r["stats"]
            assert (stats["kept"], stats["replayed"], stats["gaps"], stats["live_bytes"]) == (layers, layers, 0, 0), r
            # transformers 5.x checkpoints each decoder layer (and gives the decoder stack a function it does not
            # call); 4.x, the decoder stack (one function for every layer)
            assert stats["modules"] >= 1 and not r["still_wrapped"], r


def test_kept_attention_equals_plain_checkpointing_on_every_route():
    routes = [("transformers", False), ("transformers", True), ("checkpoint_wrapper", False)]
    _check(run_world(2, _routes, torch.float32, None, routes, timeout=300))


@pytest.mark.timeout(600)
def test_real_scale_bf16_kept_attention_equals_plain_checkpointing():
    """Hidden 2048 x 48 layers (16 heads over 4 K/V heads: an 8B's width and depth; a narrower MLP keeps two ranks'
    weights and gradients within the CI machine), bf16, 2 ranks: bitwise the plain checkpointed step."""
    skip_unless_ci_pin("the real-scale cases")
    _check(run_world(2, _routes, torch.bfloat16, (2048, 48, 16, 4, 2048), [("transformers", False)], REAL_SCALE_SEQ,
                     timeout=570))


def test_refusals_name_the_problem():
    model = _model("none")
    for bad in (-1, "most", True, None):
        with pytest.raises(KeepAttentionError, match=r"budget=.* is not a budget; pass GiB"):
            hfpatch.keep_attention(model, budget=bad)
    if not torch.cuda.is_available():
        with pytest.raises(KeepAttentionError, match="budget='auto' measures CUDA memory"):
            hfpatch.keep_attention(model)
    with pytest.raises(KeepAttentionError, match="headroom=2 must be in"):
        hfpatch.keep_attention(model, budget=1, headroom=2)
    with pytest.raises(KeepAttentionError, match="model must be a torch.nn.Module"):
        hfpatch.keep_attention("llama", budget=1)

    ids = torch.randint(0, 128, (1, 16))
    kept = hfpatch.keep_attention(model, budget=1)              # nothing checkpointed yet: allowed until training
    with torch.no_grad():
        model(input_ids=ids)                                     # no training forward: fine
    with pytest.raises(KeepAttentionError, match="training with no checkpointed layer"):
        model(input_ids=ids)
    kept.remove()
    model(input_ids=ids)                                         # removed: plain training again

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    twice = _model("transformers")
    layer_cls = type(twice.model.layers[0])
    apply_activation_checkpointing(twice, check_fn=lambda m: isinstance(m, layer_cls))
    with pytest.raises(KeepAttentionError, match=r"'model.layers.0' is checkpointed twice"):
        hfpatch.keep_attention(twice, budget=1)


def test_remove_restores_checkpoint_functions_and_is_idempotent():
    model = _model("transformers")
    originals = {n: m._gradient_checkpointing_func for n, m in model.named_modules()
                 if getattr(m, "gradient_checkpointing", False)}
    kept = hfpatch.keep_attention(model, budget=0.5)
    assert kept.wrapped == list(originals) and "budget 0.50 GiB" in repr(kept.keeper)
    assert all(m._gradient_checkpointing_func.keeper is kept.keeper for n, m in model.named_modules() if n in originals)
    kept.remove()
    kept.remove()
    assert {n: m._gradient_checkpointing_func for n, m in model.named_modules() if n in originals} == originals
    assert not model._forward_pre_hooks


def _compiled_kept_forward(model, patch, ids):
    """The message of the ``KeepAttentionError`` a compiled forward of ``model`` raised, or None."""
    batch = patch.shard_inputs(ids, labels=ids)
    compiled = torch.compile(model, backend="eager")
    try:
        compiled(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits.sum()
    except KeepAttentionError as exc:
        return str(exc)
    return None


def _compiled_is_refused(rank, world):
    """A kept, compiled model is refused on its first forward, and again after a compiled step of the same model
    without kept attention ran and trained in the process (Dynamo's caches and state from other compiles)."""
    ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(3))
    messages = []
    model = _model("transformers")
    patch = hfpatch.apply(dist.group.WORLD, model=model, verify="fast")
    try:
        kept = hfpatch.keep_attention(model, budget="all")
        messages.append(_compiled_kept_forward(model, patch, ids))
        kept.remove()
        torch._dynamo.reset()
        batch = patch.shard_inputs(ids, labels=ids)
        plain = torch.compile(model, backend="eager")
        plain(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"],
              use_cache=False).loss.backward()
        kept = hfpatch.keep_attention(model, budget="all")
        messages.append(_compiled_kept_forward(model, patch, ids))
        messages.append(kept.keeper.stats()["kept"])
        kept.remove()
    finally:
        patch.remove()
        torch._dynamo.reset()
    return messages


def test_a_compiled_model_is_refused():
    """Under torch.compile the attention is one opaque operator whose backward recomputes its forward: kept outputs
    would only cost memory, so a kept checkpoint function refuses to be compiled."""
    skip_unless_ci_pin("how torch.compile traces transformers' checkpointing differs by release; the refusal is "
                       "the same code on every release")
    for first, after_a_compiled_step, kept in run_world(2, _compiled_is_refused, timeout=300):
        for message in (first, after_a_compiled_step):
            assert message is not None and "does not apply to a compiled model" in message, message
        assert kept == 0
