"""hfpatch inside the real training stack, on 4 gloo CPU processes: a 2-D DeviceMesh (dp=2 x cp=2), FSDP2
(``fully_shard``) over the dp dimension, ``hfpatch.apply(mesh["cp"], model=model)``, activation checkpointing
around the decoder layers, and ``torch.compile``.

1. FSDP2 + CP + checkpointing: three SGD-with-momentum steps on unpacked, packed, unpacked batches. After every
   step the global loss and every updated parameter (``DTensor.full_tensor()``) equal a single-process, non-CP run
   of the same model (eager attention) on the same global batch. The reductions that make this true:
   token-weighted mean over cp (``patch.reduce_loss``: each rank's gradient flows only into its own tokens, so the
   gradient SUMMED over cp is the replica's gradient) and mean over dp (FSDP2's reduce-scatter averages over dp;
   an all-reduce hook then sums the shards over cp, the ranks holding the same dp shard).
2. Checkpointing: the recomputation in backward runs the ring again (counted apart: ``recomputed_calls``) and
   reproduces every attention output bit for bit; the per-forward counters still show exactly one ring call per
   layer per forward.
3. torch.compile: the attention call is one opaque operator (``hfpatch/attention/opaque.py``). The whole stack compiled
   (FSDP2 + CP + checkpointing + ``torch.compile(model)``) equals the single-process run on a batch step; and
   ``torch.compile(model, fullgraph=True)`` (CP only) traces the model without a graph break, one operator per
   layer, with loss and gradients equal to eager on a packed step. Backend ``aot_eager``: the full Dynamo +
   AOTAutograd pipeline with the operator's fake kernels and autograd, without inductor's C++ code generation,
   which takes minutes on 2 cores; ``HFPATCH_TEST_INDUCTOR=1`` runs the fullgraph check with inductor too.
4. PEFT (where peft is installed): a LoRA model (``apply(model=peft_model)``) under FSDP2 with FSDP's activation
   checkpointing (``checkpoint_wrapper`` on every decoder layer of the PEFT base model): two SGD steps (batch,
   packed) give the single-process LoRA run's loss and adapter weights, and every layer's recomputation ran the
   ring again.

Tolerances (fp32; ring_kernels.tolerances' "cp" loss and "cp_training" entries). Loss: relative 1e-5. Parameters
after step k: max |p_cp - p_ref| <= 2e-6 (weights of scale
0.2-1, updates ~1e-2 per step). The ring merges blocks through an fp32 log-sum-exp and the gradients are summed
over ranks in another order, so CP differs from the single-process run by rounding only (measured over the 3
steps: loss 8e-8 relative, parameters 1.3e-7 absolute); a missing reduction over cp moves the first update by
orders of magnitude more (``_missing_cp_reduction_is_detected`` proves the check can fail, printed with -s).
"""
from __future__ import annotations

import importlib.util
import os

import torch
import torch.distributed as dist

import hfpatch
from _dist import run_world
from hfpatch.attention.discovery import attention_modules
from hfpatch.cli.demo_models import build_model, reference_logits
from hfpatch.inputs import shift_labels, token_loss_sum
from hfpatch.version_gates import TRANSFORMERS_ATTENTION_FUNCTIONS, installed_transformers_version
from ring_kernels.tolerances import assert_close, tolerance

LOSS = tolerance("cp", torch.float32, "loss")
PARAM = tolerance("cp_training", torch.float32, "param")
GRAD = tolerance("cp", torch.float32, "grad")     # compiled vs eager CP: the same rounding as CP vs non-CP
SEQ = 32
LR, MOMENTUM = 0.1, 0.9
DP, CP = 2, 2
# Per dp rank: one packed row of SEQ tokens (uneven documents, a document crossing the cp boundary).
PACKED_DOCS = ([5, 11, 1, 7, 8], [16, 9, 7])
_HAS_PEFT = importlib.util.find_spec("peft") is not None   # the LoRA case needs peft (CI's venv installs it)


# ------------------------------------------------------------------------------------------------- data


def _global_batch(step: int):
    """The global batch of a step: per dp rank (input_ids (rows, SEQ), position_ids or None, docs or None)."""
    g = torch.Generator().manual_seed(100 + step)
    if step % 2 == 1:  # packed: one row of documents per dp rank
        parts = []
        for docs in PACKED_DOCS:
            ids = torch.randint(0, 128, (1, SEQ), generator=g)
            pos = torch.cat([torch.arange(n) for n in docs]).unsqueeze(0)
            parts.append((ids, pos, docs))
        return parts
    ids = torch.randint(0, 128, (DP * 2, SEQ), generator=g)
    return [(ids[2 * d:2 * d + 2], None, None) for d in range(DP)]


# ------------------------------------------------------------------------------------------- reference


def _replica_loss(model, ids, docs):
    """Non-CP token-mean loss of one dp replica's batch (packed: every document on its own, the definition of
    independent documents on every transformers release)."""
    logits = reference_logits(model, ids, docs)
    loss_sum, count = token_loss_sum(logits, shift_labels(ids))
    return loss_sum / count


def _reference_run(steps: int, model=None, momentum: float = MOMENTUM):
    """Single process, no CP, ``model`` (default: the tiny Llama): per step the mean over dp replicas of their
    token-mean losses; SGD steps on the trainable parameters. Returns [(loss, {name: trainable parameter after
    the step})]."""
    model = build_model("llama") if model is None else model
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(trainable, lr=LR, momentum=momentum)
    history = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = sum(_replica_loss(model, ids, docs) for ids, _, docs in _global_batch(step)) / DP
        loss.backward()
        opt.step()
        history.append((loss.detach(), {n: p.detach().clone() for n, p in model.named_parameters()
                                        if p.requires_grad}))
    return history


# ------------------------------------------------------------------------------------------- FSDP2 + CP


def _sum_over_cp_hook(cp_group, active: bool):
    """FSDP2 all-reduce hook: after the reduce-scatter (mean over dp) sum the gradient shards over cp."""
    def hook(reduce_output: torch.Tensor) -> None:
        if active:
            dist.all_reduce(reduce_output, group=cp_group)
    return hook


def _parallel_model(mesh, *, checkpointing: bool, cp_reduction: bool = True, model=None):
    """The stack: build (or ``model``: a PEFT model) -> hfpatch.apply(mesh["cp"], model=) -> checkpoint layers ->
    fully_shard over dp."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
    from torch.distributed.fsdp import FSDPModule, fully_shard

    model = build_model("llama") if model is None else model
    patch = hfpatch.apply(mesh["cp"], model=model)
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    layers = inner.model.layers
    if checkpointing:
        layer_cls = type(layers[0])
        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, layer_cls))
    for layer in inner.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    hook = _sum_over_cp_hook(mesh["cp"].get_group(), cp_reduction)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_all_reduce_hook(hook)
    return model, patch


def _cp_step(model, patch, opt, mesh, step: int, forward=None) -> torch.Tensor:
    """One training step on this rank's dp replica (``forward``: a compiled model); returns the global loss (mean
    over dp)."""
    ids, pos, _ = _global_batch(step)[mesh["dp"].get_local_rank()]
    opt.zero_grad(set_to_none=True)
    batch = patch.shard_inputs(ids, labels=ids, position_ids=pos)
    logits = (model if forward is None else forward)(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                                use_cache=False).logits
    loss_sum, count = token_loss_sum(logits, batch["labels"])
    loss = patch.reduce_loss(loss_sum, count)    # token-weighted mean over cp
    loss.backward()                              # FSDP2: mean over dp, then the hook sums over cp
    opt.step()
    global_loss = loss.detach().clone()
    dist.all_reduce(global_loss, group=mesh["dp"].get_group())
    return global_loss / mesh["dp"].size()


def _full_parameters(model) -> dict:
    return {n: p.full_tensor().detach() if hasattr(p, "full_tensor") else p.detach()
            for n, p in model.named_parameters()}


def _clean_name(name: str) -> str:
    """Parameter name without the wrappers' prefixes (checkpoint_wrapper)."""
    return name.replace("_checkpoint_wrapped_module.", "")


def _fsdp_cp_matches_reference(rank, world, mesh, reference):
    model, patch = _parallel_model(mesh, checkpointing=True)
    worst_loss = worst_param = 0.0
    try:
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
        layers = model.config.num_hidden_layers
        outputs = _record_attention_outputs(model)
        for step, (ref_loss, ref_params) in enumerate(reference):
            patch.reset_calls()
            outputs.clear()
            loss = _cp_step(model, patch, opt, mesh, step)
            # The recomputation ran the ring again and reproduced every layer's attention output bit for bit.
            assert len(outputs) == 2 * layers, len(outputs)
            for name in {n for n, _ in outputs}:
                first, again = [out for n, out in outputs if n == name]
                assert torch.equal(first, again), f"step {step}: recomputed attention of {name} differs"
            kind = "packed" if step % 2 else "batch"
            worst_loss = max(worst_loss, abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()))
            assert_close(loss, ref_loss, LOSS, f"step {step} ({kind}): FSDP2+CP loss {loss.item():.8f} vs "
                                               f"single-process {ref_loss.item():.8f}")
            params = {_clean_name(n): p for n, p in _full_parameters(model).items()}
            assert set(params) == set(ref_params), sorted(set(params) ^ set(ref_params))
            for name, ref in ref_params.items():
                worst_param = max(worst_param, (params[name] - ref).abs().max().item())
                assert_close(params[name], ref, PARAM, f"step {step} ({kind}): parameter {name}")
            # Checkpointing: one ring call per layer in the forward, one more per layer in the recomputation.
            assert dict(patch.calls) == {i: 1 for i in range(layers)}, f"step {step}: calls {patch.calls}"
            assert dict(patch.recomputed_calls) == {i: 1 for i in range(layers)}, \
                f"step {step}: recomputed {patch.recomputed_calls}"
            assert patch.layers_seen() == list(range(layers)), patch.layers_seen()
            assert patch.unpatched_layers(model) == [], patch.unpatched_layers(model)
            expected = "llama3" if kind == "packed" else "zigzag"
            assert patch.ctx.step.kernel == expected, (step, patch.ctx.step.kernel)
    finally:
        patch.remove()
    if rank == 0:  # shown with pytest -s: the margin under the tolerances
        print(f"FSDP2+CP vs single process over {len(reference)} steps: loss rel err {worst_loss:.2e}, "
              f"parameter abs err {worst_param:.2e}")


def _lora(seed: int = 0):
    """A LoRA adapter on q/v of the tiny Llama (random B: every adapter weight has a gradient), the same on every
    rank."""
    import peft

    torch.manual_seed(seed)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    return peft.get_peft_model(build_model("llama"), config)


def _lora_fsdp_cp_matches_reference(rank, world, mesh, reference):
    """PEFT under FSDP2 with FSDP's activation checkpointing (checkpoint_wrapper on every decoder layer): a LoRA
    model on the ring trains as the single-process LoRA model, adapter weights after every step included, and the
    recomputation ran the ring again in every layer."""
    model, patch = _parallel_model(mesh, checkpointing=True, model=_lora())
    try:
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
        layers = model.get_base_model().config.num_hidden_layers
        for step, (ref_loss, ref_params) in enumerate(reference):
            patch.reset_calls()
            loss = _cp_step(model, patch, opt, mesh, step)
            assert_close(loss, ref_loss, LOSS, f"step {step}: LoRA FSDP2+CP loss")
            params = {_clean_name(n): p for n, p in _full_parameters(model).items() if n and "lora_" in n}
            assert set(params) == set(ref_params), sorted(set(params) ^ set(ref_params))
            for name, ref in ref_params.items():
                assert_close(params[name], ref, PARAM, f"step {step}: adapter weight {name}")
            assert dict(patch.recomputed_calls) == {i: 1 for i in range(layers)}, patch.recomputed_calls
    finally:
        patch.remove()


def _compiled_fsdp_cp_matches_reference(rank, world, mesh, reference, backend: str):
    """The whole stack compiled: FSDP2 + CP + checkpointing + torch.compile (FSDP2's hooks may break the graph
    between layers: no fullgraph here) equals the single-process run (the batch step; the packed path through the
    compiled operator is checked with fullgraph below)."""
    model, patch = _parallel_model(mesh, checkpointing=True)
    try:
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=backend)
        for step, (ref_loss, ref_params) in enumerate(reference[:1]):   # one compilation: CPU time is scarce
            patch.reset_calls()
            loss = _cp_step(model, patch, opt, mesh, step, forward=compiled)
            label = f"compiled[{backend}] FSDP2+CP step {step} ({'packed' if step % 2 else 'batch'})"
            assert_close(loss, ref_loss, LOSS,
                         f"{label}: loss {loss.item():.8f} vs single-process {ref_loss.item():.8f}")
            params = {_clean_name(n): p for n, p in _full_parameters(model).items()}
            for name, ref in ref_params.items():
                assert_close(params[name], ref, PARAM, f"{label}: parameter {name}")
            assert patch.mode_calls == {"ring": model.config.num_hidden_layers}, f"{label}: {patch.mode_calls}"
    finally:
        patch.remove()


def _record_attention_outputs(model) -> list:
    """[(module name, attention output)] of every attention call, the recomputations included."""
    outputs: list = []
    for name, module in attention_modules(model):
        module.register_forward_hook(
            lambda mod, args, out, name=name: outputs.append((name, out[0].detach().clone())))
    return outputs


def _missing_cp_reduction_is_detected(rank, world, mesh, reference):
    """Without the sum over cp the first update already misses the tolerance by orders of magnitude."""
    model, patch = _parallel_model(mesh, checkpointing=False, cp_reduction=False)
    try:
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
        _cp_step(model, patch, opt, mesh, 0)
        params = {_clean_name(n): p for n, p in _full_parameters(model).items()}
        worst = max((params[n] - ref).abs().max().item() for n, ref in reference[0][1].items())
        assert worst > 100 * PARAM.bound, f"a missing cp reduction moved parameters by only {worst:.3e}"
        if rank == 0:
            print(f"without the sum over cp the first step is off by {worst:.2e} (tolerance {PARAM.bound:.0e})")
    finally:
        patch.remove()


# ------------------------------------------------------------------------------------------ torch.compile


def _compile_matches_eager(rank, world, mesh, backends):
    """Within one cp group: eager vs torch.compile(fullgraph=True) on a packed step (one compilation)."""
    model = build_model("llama")
    with hfpatch.apply(mesh["cp"], model=model, verify=False) as patch:
        def step(fn, ids, pos):
            model.zero_grad(set_to_none=True)
            batch = patch.shard_inputs(ids, labels=ids, position_ids=pos)
            logits = fn(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
            loss = patch.reduce_loss(*token_loss_sum(logits, batch["labels"]))
            loss.backward()
            return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

        _ignore_transformers_warning_once()
        inputs = [_global_batch(1)[0][:2]]   # a packed step (llama3 varlen inside the operator)
        eager = [step(model, ids, pos) for ids, pos in inputs]
        layers = model.config.num_hidden_layers
        for backend in backends:
            torch._dynamo.reset()
            graphs = []
            compiled = torch.compile(model, backend=_recording(backend, graphs), fullgraph=True)
            for (ids, pos), (ref_loss, ref_grads) in zip(inputs, eager):
                patch.reset_calls()
                loss, grads = step(compiled, ids, pos)
                label = f"compile[{backend}] {'packed' if pos is not None else 'batch'}"
                assert_close(loss, ref_loss, LOSS, f"{label}: loss {loss.item():.8f} vs eager {ref_loss.item():.8f}")
                for name, ref in ref_grads.items():
                    assert_close(grads[name], ref, GRAD, f"{label}: grad {name}")
                # The operator ran the ring once per layer (counted by layer_idx in compiled code).
                assert patch.mode_calls == {"ring": layers}, f"{label}: {patch.mode_calls}"
            # One graph per input shape (fullgraph: no breaks), each with one opaque operator per layer.
            assert graphs and all(_opaque_ops(g) == layers for g in graphs), [_opaque_ops(g) for g in graphs]


def _ignore_transformers_warning_once() -> None:
    """transformers < 4.48: the flash attention class (the model's attention under ``model=``) logs a warning for
    fp32 inputs inside its forward (``logger.warning_once``), a graph break in transformers' own code, not in
    hfpatch's. Dynamo skips logging calls listed in ``ignore_logging_functions``; a user compiling an fp32 model
    on those releases with ``fullgraph=True`` does the same (bf16 training never logs it)."""
    import logging

    from transformers.utils import logging as hf_logging  # installs Logger.warning_once

    if installed_transformers_version() >= TRANSFORMERS_ATTENTION_FUNCTIONS:
        return   # no such warning: nothing to ignore
    warning_once = getattr(logging.Logger, "warning_once", None) or getattr(hf_logging, "warning_once", None)
    if warning_once is not None:
        # torch 2.11 renamed Dynamo's ignore_logger_methods (2.9, 2.10) to ignore_logging_functions.
        config = torch._dynamo.config
        ignored = config.ignore_logging_functions if hasattr(config, "ignore_logging_functions") \
            else config.ignore_logger_methods
        ignored.add(warning_once)


def _recording(backend: str, graphs: list):
    """A Dynamo backend that keeps the traced FX graph and compiles it with ``backend``."""
    compile_with = torch._dynamo.lookup_backend(backend)

    def record(gm, example_inputs):
        graphs.append(gm)
        return compile_with(gm, example_inputs)
    return record


def _opaque_ops(gm) -> int:
    """Calls of hfpatch's opaque attention operator in a Dynamo graph (recorded as the packet or its overload)."""
    op = torch.ops.hfpatch.flash_attention
    return sum(1 for node in gm.graph.nodes if node.op == "call_function" and node.target in (op, op.default))


# ------------------------------------------------------------------------------------------------ world


def _stack_world(rank, world, backends):
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (DP, CP), mesh_dim_names=("dp", "cp"))
    # The reference is the same on every rank: rank 0 computes it, the others receive it (CPU time is scarce).
    holder = [None]
    if rank == 0:
        holder = [(_reference_run(3), _reference_run(2, _lora(), momentum=0.0) if _HAS_PEFT else None)]
    dist.broadcast_object_list(holder, src=0)
    reference, lora_reference = holder[0]
    _fsdp_cp_matches_reference(rank, world, mesh, reference)
    if lora_reference is not None:
        _lora_fsdp_cp_matches_reference(rank, world, mesh, lora_reference)
    _missing_cp_reduction_is_detected(rank, world, mesh, reference)
    _compiled_fsdp_cp_matches_reference(rank, world, mesh, reference, backends[0])
    # Compiling costs CPU time: one cp group (dp index 0) compiles; the other waits at the barrier.
    if mesh["dp"].get_local_rank() == 0:
        _compile_matches_eager(rank, world, mesh, backends)
    dist.barrier()


def test_fsdp2_cp_checkpointing_compile_match_single_process():
    backends = ["aot_eager"] + (["inductor"] if os.environ.get("HFPATCH_TEST_INDUCTOR") == "1" else [])
    run_world(DP * CP, _stack_world, backends, timeout=600)
