"""One training step of a Llama-3-8B-shaped model with context parallelism: hfpatch vs PyTorch's native CP vs one GPU.

Launch (one process per GPU; the same script on 1, 2, 4 or 8 GPUs)::

    torchrun --nproc-per-node N benchmarks/train_step.py --modes hfpatch,native --seq-per-gpu 32k,64k,128k --out DIR
    torchrun --nproc-per-node 1 benchmarks/train_step.py --modes single --layers 8 --seq-per-gpu 32k,64k --out DIR

(``python benchmarks/train_step.py ...`` without torchrun runs one process.) On CPU, tiny, over gloo:
``torchrun --nproc-per-node 2 benchmarks/train_step.py --device cpu --dtype fp32 --layers 2 --hidden 64 --heads 4
--kv-heads 2 --intermediate 128 --vocab 256 --seq-per-gpu 64 --optimizer sgd --steps 1 --warmup 0``.

**The model.** ``transformers.LlamaForCausalLM`` built from a ``LlamaConfig`` (default: Llama-3-8B's shape, 32
layers, hidden 4096, 32 query / 8 K/V heads of 128, MLP 14336, vocabulary 128256, RoPE theta 500000, untied
embeddings), random weights (the same seed on every rank), in ``--dtype`` (bf16), no dropout.

**The step** (identical in every mode except the attention and how the sequence is split): FSDP2
(``fully_shard`` on every decoder layer and on the root, over all ranks; the root's parameters -- embeddings,
final norm, LM head -- stay gathered from forward to backward), full activation checkpointing of every decoder
layer (``checkpoint_wrapper``, non-reentrant: each layer's forward runs again in backward, nothing inside a layer
is saved), the LM head and the cross-entropy in chunks of ``--loss-chunk`` tokens, each chunk recomputed in
backward (no logits tensor of the whole sequence exists), backward, optimizer step (``--optimizer``, AdamW
by default, states in the parameters' dtype). Every rank holds ``--seq-per-gpu`` tokens of the global sequence.

**Modes.**

- ``hfpatch``: ``hfpatch.apply(mesh, model=model)`` (the model's flash path, switched by ``model=``, with the ring
  kernels; ``--kernel`` as in ``apply``), ``patch.shard_inputs`` (zigzag for a batch, llama3 for packed documents),
  the loss reduced by ``patch.reduce_loss`` over the shifted labels ``shard_inputs`` returns (the user guide's
  step).
- ``keep``: ``hfpatch`` with ``hfpatch.keep_attention(model, budget=--keep-budget)`` on the checkpointed layers:
  each kept layer's recomputation takes its attention output and LSE from the forward instead of running the ring
  (``hfpatch/model/checkpointing.py``). ``--keep-budget auto`` (default) keeps nothing in the first (warm-up) step,
  which measures the peak, then keeps what fits below 90% of the GPU's memory; a number is GiB. The row records the
  keeper's counters (``keep``: kept, replayed, gaps, budget).
- ``native``: PyTorch's ``context_parallel`` (``native_cp.py``'s settings: causal load balancing, rotate method)
  over the same mesh, the model's attention an SDPA call with ``is_causal`` and K/V heads repeated (registered in
  transformers' ``AttentionInterface``; no mask is built), SDPA pinned to each of ``--native-backends`` x
  ``--native-rotate``. Inputs, shifted labels and position ids are sharded by ``context_parallel``; the loss is each
  rank's token sum divided by the global token count. Packed documents: not possible (``context_parallel`` runs one
  causal sequence, no document mask), the row says so.
- ``single``: one GPU, no CP, no FSDP, the same checkpointing and loss, ``--seq-per-gpu`` tokens, ``--single-layers``
  decoder layers (fewer when the whole model does not fit). Attention: batch -> the same SDPA call as native
  (``--sdpa-backend``); packed -> ``ring_kernels``' llama3 varlen attention on a process group of one rank (plain
  attention over the documents, no communication), the kernel hfpatch's packed rows run. Every rank of the job runs
  it independently. The ceiling of the issue's MFU target: compare MFU (and ms per decoder layer), not step time,
  when the layer counts differ.

In every CP mode the parameter gradients of the global mean loss are the SUM over the ranks of each rank's
gradient; FSDP2 averages over the ranks, so the backward runs on ``loss x world size``.

**Numbers per row.** Step time: CUDA events around each step after ``--warmup`` steps, the slowest rank per step,
median over ``--steps`` steps with min and max (spread = (max - min) / median). tokens/s per GPU = tokens per GPU /
median step time. MFU = model FLOPs / (GPUs x median step time x peak), peak = the GPU's dense bf16 peak (H100 SXM
and H200: 989 TFLOP/s; ``--peak-tflops`` otherwise). Model FLOPs of one step (``FLOP_FORMULA``): 6 x P x T +
6 x L x H x D x sum(s^2) -- P the parameters that multiply every token (each decoder layer's q, k, v, o, gate, up
and down projections, and the LM head; not the embedding lookup, the norms or RoPE), T the tokens of the step over
all GPUs, L decoder layers, H query heads, D head dim, s the length of each causal sequence (one per batch row,
each document when packed): the attention matmuls QK^T and PV, 4 x s^2 x H x D forward, halved for causality, x3
for forward + backward. The recomputation by checkpointing (decoder layers and loss chunks) is not counted: it is
overhead, as in PaLM's MFU. Peak memory: ``torch.cuda.max_memory_allocated`` over warm-up and timed steps, max over
ranks (parameters, gradients, optimizer states and activations). Backend: the block backends hfpatch chose
(``Patch.backend_choices``), the SDPA backend pinned for native and single. ``rank_step_ms``: each rank's own
median; a row whose MFU is far below the run's best (or below 20%), or with one rank much slower than the others,
is named SLOW in its note (``slow_reason``), next to the stamp's per-GPU clocks, throttling and topology.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import json
import math
import os
import re
import statistics
import sys
import time
import traceback
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path[:0] = [_HERE, os.path.dirname(_HERE)]

from _cases import global_document_mix, local_document_mix  # noqa: E402
from _stamp import gpu_model, stamp  # noqa: E402
from _timing import time_callable  # noqa: E402
from ring_kernels.world import free_port  # noqa: E402

__all__ = ["ModelShape", "LLAMA3_8B", "FLOP_FORMULA", "model_flops", "peak_flops", "step_data", "build_model",
           "ChunkedLoss", "make_runner", "run_rows", "main",
           # the step's pieces that benchmarks/hybrid_step.py shares
           "checkpoint_layers", "shard_fsdp", "make_optimizer", "world_mesh", "join_process_group",
           "register_bench_attention", "set_attention", "steps_for", "max_over_ranks", "free_memory", "error_text",
           "device_slug", "names_argument", "tokens_argument", "result_writer", "result_stem", "slow_reason"]

MODES = ("hfpatch", "keep", "native", "single")
LAYOUTS = ("batch", "packed")
IGNORE_INDEX = -100
# Packed documents are multiples of 2 x 8 tokens, so one GPU's mix splits for 1, 2, 4 and 8 GPUs alike.
MIX_WORLD = 8
BENCH_SDPA = "train_step_sdpa"          # AttentionInterface names registered by this script
BENCH_LOCAL_VARLEN = "train_step_local_varlen"

FLOP_FORMULA = ("model FLOPs per step = 6*P*T + 6*L*H*D*sum(s^2): P = parameters multiplying every token (decoder "
                "q,k,v,o,gate,up,down + LM head; no embedding lookup, norms, RoPE), T = tokens of the step on all "
                "GPUs, L layers, H query heads, D head dim, s = each causal sequence's length (batch row, or each "
                "packed document); attention = 4*s^2*H*D forward, /2 causal, x3 fwd+bwd; checkpointing's "
                "recomputation not counted. MFU = model FLOPs / (GPUs x median step time x peak bf16 dense FLOP/s)")

# Dense bf16 peak per GPU (no sparsity), by the device name torch reports.
_PEAKS = ((re.compile(r"H200"), 989e12), (re.compile(r"H100.*(PCIe)"), 756e12), (re.compile(r"H100"), 989e12))


# ------------------------------------------------------------------------------------------------ model


@dataclasses.dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    rope_theta: float = 500000.0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def matmul_params(self) -> int:
        """Parameters that multiply every token: each decoder layer's projections and the LM head."""
        d = self.head_dim
        attn = self.hidden * (self.heads * d) * 2 + self.hidden * (self.kv_heads * d) * 2
        mlp = 3 * self.hidden * self.intermediate
        return self.layers * (attn + mlp) + self.hidden * self.vocab

    def with_layers(self, layers: int) -> "ModelShape":
        return dataclasses.replace(self, layers=layers)


LLAMA3_8B = ModelShape(layers=32, hidden=4096, heads=32, kv_heads=8, intermediate=14336, vocab=128256)


def model_flops(shape: ModelShape, tokens: int, sequences: Sequence[int]) -> float:
    """FLOP_FORMULA for one step of ``tokens`` tokens whose causal sequences have the lengths ``sequences``."""
    attention = 6.0 * shape.layers * shape.heads * shape.head_dim * sum(float(s) ** 2 for s in sequences)
    return 6.0 * shape.matmul_params() * tokens + attention


def peak_flops(device: torch.device, override_tflops: Optional[float]) -> Optional[float]:
    """Dense bf16 FLOP/s of one GPU: ``override_tflops`` if given, else by the device's name; None if unknown."""
    if override_tflops:
        return override_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for pattern, peak in _PEAKS if pattern.search(name)), None)


def build_config(shape: ModelShape, attn_implementation: str):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=shape.hidden, num_hidden_layers=shape.layers,
                       num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                       intermediate_size=shape.intermediate, vocab_size=shape.vocab, rope_theta=shape.rope_theta,
                       max_position_embeddings=131072, tie_word_embeddings=False, attention_dropout=0.0,
                       attn_implementation=attn_implementation)


def build_model(shape: ModelShape, device: torch.device, dtype: torch.dtype, *, seed: int = 0,
                attn_implementation: str = "eager"):
    """``LlamaForCausalLM`` of ``shape`` on ``device`` in ``dtype``, random weights from ``seed`` (equal on every
    rank), created in place (the RoPE frequencies stay fp32 as transformers computes them)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(build_config(shape, attn_implementation))
    finally:
        torch.set_default_dtype(saved)
    return model


def _chunk_loss_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = F.linear(hidden, weight).float()
    return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")


class ChunkedLoss(torch.nn.Module):
    """A causal LM's summed token loss without a whole-sequence logits tensor.

    ``forward(input_ids (B, S), position_ids (B, S), labels (B, S) already shifted)`` -> ``(loss_sum, count)``:
    the decoder's final hidden states, then the LM head and the fp32 cross-entropy over ``chunk`` tokens at a time,
    each chunk recomputed in backward (non-reentrant checkpoint). ``count`` = labels != -100.
    """

    def __init__(self, model: torch.nn.Module, chunk: int) -> None:
        super().__init__()
        self.model = model
        self.chunk = chunk

    def forward(self, input_ids, position_ids, labels):
        from torch.utils.checkpoint import checkpoint

        out = self.model.model(input_ids=input_ids, position_ids=position_ids, use_cache=False)
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        hidden = hidden.reshape(-1, hidden.shape[-1])
        flat = labels.reshape(-1).to(hidden.device)
        weight = self.model.lm_head.weight
        total = None
        for start in range(0, hidden.shape[0], self.chunk):
            part = checkpoint(_chunk_loss_sum, hidden[start:start + self.chunk], weight,
                              flat[start:start + self.chunk], use_reentrant=False)
            total = part if total is None else total + part
        return total, (flat != IGNORE_INDEX).sum()


def checkpoint_layers(model) -> None:
    """Full activation checkpointing of every decoder layer (``checkpoint_wrapper``, non-reentrant)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    layer_cls = type(model.model.layers[0])
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, layer_cls))


def shard_fsdp(loss_module: ChunkedLoss, mesh) -> None:
    """FSDP2 over ``mesh``: every decoder layer, then the root (embeddings, norm, LM head), kept gathered from
    forward to backward (the loss chunks' recomputation reads the LM head's weight)."""
    from torch.distributed.fsdp import fully_shard

    for layer in loss_module.model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(loss_module, mesh=mesh, reshard_after_forward=False)


def make_optimizer(name: str, params, lr: float, device: torch.device):
    params = list(params)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, foreach=device.type == "cuda")
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    return None     # "none": gradients only (each step starts from zero gradients)


# ------------------------------------------------------------------------------------------------ data


@dataclasses.dataclass
class StepData:
    """The global step, identical on every rank: (1, S) ``input_ids``, ``labels`` (unshifted; -100 at each
    document's first token when packed), ``position_ids`` (restarting per document when packed), ``docs``
    (causal sequence lengths), ``count`` (tokens with a target after the shift, over the whole sequence)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    docs: List[int]
    count: int


def step_data(layout: str, tokens_per_gpu: int, world: int, vocab: int, device: torch.device,
              seed: int = 0) -> StepData:
    """``batch``: one sequence of ``world x tokens_per_gpu`` tokens. ``packed``: one row of documents, ``world``
    copies of one GPU's fixed mix (``_cases.local_document_mix``, lengths multiples of 16) shuffled, so every GPU
    count sees the same per-GPU attention work."""
    from hfpatch.inputs import shift_labels

    total = world * tokens_per_gpu
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (1, total), generator=g)
    labels = ids.clone()
    if layout == "batch":
        docs = [total]
        positions = torch.arange(total)
    else:
        docs = global_document_mix(local_document_mix(tokens_per_gpu, MIX_WORLD, seed), world, seed)
        positions = torch.cat([torch.arange(n) for n in docs])
        starts = torch.tensor([0] + list(_cumsum(docs[:-1])))
        labels[0, starts] = IGNORE_INDEX
    count = int((shift_labels(labels) != IGNORE_INDEX).sum())
    return StepData(ids.to(device), labels.to(device), positions.unsqueeze(0).to(device), docs, count)


def _cumsum(values):
    total = 0
    for v in values:
        total += v
        yield total


# ------------------------------------------------------------------------------------------------ attention


def _sdpa_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """HF attention function: causal SDPA, K/V heads repeated to the query heads; q (B, H, S, D) -> (B, S, H, D).
    ``F.scaled_dot_product_attention`` is looked up per call (``context_parallel`` replaces it while active)."""
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = (t.repeat_interleave(groups, dim=1) for t in (key, value))
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


class _LocalVarlen:
    """HF attention function for one GPU's packed row: ``ring_kernels.llama3_attn_varlen_func`` on a process
    group of one rank over the documents ``cu_seqlens`` (set per step)."""

    def __init__(self) -> None:
        self.group = None
        self.cu_seqlens: Optional[torch.Tensor] = None

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        from ring_kernels import llama3_attn_varlen_func

        q, k, v = (t.transpose(1, 2) for t in (query, key, value))      # (1, S, H, D)
        out = llama3_attn_varlen_func(q, k, v, self.cu_seqlens, group=self.group, causal=True,
                                      softmax_scale=scaling)
        return out, None


_LOCAL_VARLEN = _LocalVarlen()


def attention_interface_unavailable() -> Optional[str]:
    """Why this transformers cannot take a registered attention function (None when it can)."""
    try:
        from transformers import AttentionInterface  # noqa: F401
    except ImportError:
        import transformers

        return (f"transformers {transformers.__version__} has no AttentionInterface (from 4.48): the native and "
                f"single modes register their attention functions there")
    return None


def register_bench_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(BENCH_SDPA, _sdpa_attention)
    AttentionInterface.register(BENCH_LOCAL_VARLEN, _LOCAL_VARLEN)


def set_attention(model, name: str) -> None:
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            config._attn_implementation = name


# ------------------------------------------------------------------------------------------------ runners


@dataclasses.dataclass
class Runner:
    """One mode's model, ready to step: ``step(data) -> loss`` (detached, the global mean), ``setup(data)`` before a
    case (labels, attention), ``info`` (backend etc. after a case), ``close()``."""

    mode: str
    layers: int
    world: int                                   # GPUs the step's tokens are spread over
    step: Callable[[StepData], torch.Tensor]
    backend: Callable[[], str]
    close: Callable[[], None]
    setup: Callable[[StepData, dict], None] = lambda data, case: None
    extra: Callable[[], dict] = dict


def world_mesh(device: torch.device):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("cp",))


def _hfpatch_runner(args, shape: ModelShape, device, dtype, keep: bool = False) -> Runner:
    import hfpatch

    world = dist.get_world_size()
    mesh = world_mesh(device)
    model = build_model(shape, device, dtype, seed=args.seed, attn_implementation="eager")
    patch = hfpatch.apply(mesh["cp"], kernel=args.kernel, model=model)
    if args.checkpointing == "full":
        checkpoint_layers(model)
    kept = hfpatch.keep_attention(model, budget=args.keep_budget) if keep else None
    loss_module = ChunkedLoss(model, args.loss_chunk)
    shard_fsdp(loss_module, mesh["cp"])
    opt = make_optimizer(args.optimizer, loss_module.parameters(), args.lr, device)

    def step(data: StepData) -> torch.Tensor:
        loss_module.zero_grad(set_to_none=True)
        position_ids = data.position_ids if len(data.docs) > 1 else None
        batch = patch.shard_inputs(data.input_ids, labels=data.labels, position_ids=position_ids)
        loss_sum, count = loss_module(batch["input_ids"], batch["position_ids"], batch["labels"])
        loss = patch.reduce_loss(loss_sum, count)
        (loss * world).backward()          # FSDP2 averages over the ranks; the CP gradient is their sum
        if opt is not None:
            opt.step()
        return loss.detach()

    def setup(data, case):
        from ring_kernels.backends import reset_choices

        reset_choices()
        patch.reset_calls()
        patch.ctx.auto_choices.clear()      # kernel="auto"'s decisions of this case alone

    def backend() -> str:
        names = list(dict.fromkeys(c.backend for c in patch.backend_choices))
        picked = list(dict.fromkeys(c.kernel for c in patch.layout_choices))   # what ran, under kernel="auto"
        kernel = "+".join(picked) or (patch.ctx.step.kernel if patch.ctx.step is not None else "?")
        return f"{kernel} x {'+'.join(names) or '?'}"

    def extra() -> dict:
        info = {"backend_choices": [c.as_dict() for c in patch.backend_choices],
                "layout_choices": [{"kernel": c.kernel, "reason": c.reason, "shape": c.shape, "steps": c.steps}
                                   for c in patch.layout_choices],
                "ring_layers": len(patch.layers_seen()), "patch": repr(patch)}
        if kept is not None:
            info["keep"] = kept.stats()
        return info

    def close():
        if kept is not None:
            kept.remove()
        patch.remove()

    runner = Runner("keep" if keep else "hfpatch", shape.layers, world, step, backend, close, setup, extra)
    runner.loss_module = loss_module
    return runner


def _native_runner(args, shape: ModelShape, device, dtype) -> Runner:
    import native_cp
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import sdpa_kernel

    world = dist.get_world_size()
    mesh = world_mesh(device)
    register_bench_attention()
    model = build_model(shape, device, dtype, seed=args.seed, attn_implementation="eager")
    set_attention(model, BENCH_SDPA)
    if args.checkpointing == "full":
        checkpoint_layers(model)
    loss_module = ChunkedLoss(model, args.loss_chunk)
    shard_fsdp(loss_module, mesh["cp"])
    opt = make_optimizer(args.optimizer, loss_module.parameters(), args.lr, device)
    settings = {"sdpa": "cudnn", "rotate": "allgather"}
    from hfpatch.inputs import shift_labels

    def step(data: StepData) -> torch.Tensor:
        loss_module.zero_grad(set_to_none=True)
        # context_parallel shards its buffers in place: fresh copies every step.
        buffers = [data.input_ids.clone(), shift_labels(data.labels), data.position_ids.clone()]
        with native_cp._cp_settings(True, settings["rotate"]), \
                sdpa_kernel([native_cp._sdpa_backend(settings["sdpa"])]), \
                context_parallel(mesh["cp"], buffers=buffers, buffer_seq_dims=[1, 1, 1],
                                 no_restore_buffers=set(buffers)):
            ids, labels, positions = buffers
            loss_sum, _ = loss_module(ids, positions, labels)
            loss = loss_sum / data.count                  # this rank's share of the global mean
            (loss * world).backward()
        if opt is not None:
            opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        return total

    def setup(data, case):
        settings.update(sdpa=case["sdpa"], rotate=case["rotate"])

    runner = Runner("native", shape.layers, world, step, lambda: f"sdpa:{settings['sdpa']} rotate "
                    f"{settings['rotate']}", lambda: None, setup)
    runner.loss_module = loss_module
    return runner


def _single_runner(args, shape: ModelShape, device, dtype) -> Runner:
    from torch.nn.attention import sdpa_kernel

    import native_cp

    register_bench_attention()
    rank = dist.get_rank()
    # Every rank its own one-rank group (new_group is collective: all ranks create all of them).
    solo = [dist.new_group([r]) for r in range(dist.get_world_size())][rank]
    _LOCAL_VARLEN.group = solo
    model = build_model(shape, device, dtype, seed=args.seed, attn_implementation="eager")
    if args.checkpointing == "full":
        checkpoint_layers(model)
    loss_module = ChunkedLoss(model, args.loss_chunk)
    opt = make_optimizer(args.optimizer, loss_module.parameters(), args.lr, device)
    state = {"attention": BENCH_SDPA}
    from hfpatch.inputs import shift_labels

    def step(data: StepData) -> torch.Tensor:
        loss_module.zero_grad(set_to_none=True)
        pin = (sdpa_kernel([native_cp._sdpa_backend(args.sdpa_backend)])
               if device.type == "cuda" and state["attention"] == BENCH_SDPA else contextlib.nullcontext())
        with pin:
            loss_sum, count = loss_module(data.input_ids, data.position_ids, shift_labels(data.labels))
            loss = loss_sum / count
            loss.backward()
        if opt is not None:
            opt.step()
        return loss.detach()

    def setup(data, case):
        from ring_kernels.backends import reset_choices

        reset_choices()
        state["attention"] = BENCH_SDPA if case["layout"] == "batch" else BENCH_LOCAL_VARLEN
        set_attention(model, state["attention"])
        _LOCAL_VARLEN.cu_seqlens = torch.tensor([0] + list(_cumsum(data.docs)), dtype=torch.int32, device=device)

    def backend() -> str:
        if state["attention"] == BENCH_SDPA:
            return f"sdpa:{args.sdpa_backend if device.type == 'cuda' else 'cpu default'}"
        from ring_kernels.backends import choices

        return "llama3 (1 rank) x " + ("+".join(dict.fromkeys(c.backend for c in choices())) or "?")

    runner = Runner("single", shape.layers, 1, step, backend, lambda: None, setup)
    runner.loss_module = loss_module
    return runner


def make_runner(mode: str, args, shape: ModelShape, device, dtype) -> Runner:
    if mode == "keep":
        return _hfpatch_runner(args, shape, device, dtype, keep=True)
    return {"hfpatch": _hfpatch_runner, "native": _native_runner, "single": _single_runner}[mode](
        args, shape, device, dtype)


def mode_unavailable(mode: str, device: torch.device, world: int) -> Optional[str]:
    """Why ``mode`` cannot run here (None when it can)."""
    if mode in ("hfpatch", "keep", "native") and world < 2:
        return "CP needs 2 or more ranks (torchrun --nproc-per-node N, N >= 2)"
    if mode in ("native", "single"):
        reason = attention_interface_unavailable()
        if reason:
            return reason
    if mode == "native":
        import native_cp

        return native_cp.native_cp_unavailable_reason(device)
    return None


def case_unavailable(mode: str, layout: str) -> Optional[str]:
    if mode == "native" and layout == "packed":
        return ("PyTorch's context_parallel cannot run packed documents: it shards one causal sequence and its SDPA "
                "ring takes no document mask (is_causal only), so documents would attend across each other; "
                "this row is hfpatch's alone")
    return None


# ------------------------------------------------------------------------------------------------ measuring


def max_over_ranks(value: float, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def steps_for(tokens_global: int, args) -> tuple:
    if args.steps is not None:
        return (args.warmup if args.warmup is not None else 1), args.steps
    if tokens_global <= 65536:
        return 2, 5
    return (1, 3) if tokens_global <= 262144 else (1, 2)


def measure(runner: Runner, data: StepData, case: dict, args, device, shape: ModelShape, peak) -> dict:
    """Time ``runner`` on ``data``: a result row (see the module docstring)."""
    runner.setup(data, case)
    tokens_global = data.input_ids.shape[1]
    warmup, iters = steps_for(tokens_global, args)
    losses: List[torch.Tensor] = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    timing = time_callable(lambda: losses.append(runner.step(data)), device=device, warmup=warmup, iters=iters)
    peak_bytes = (max_over_ranks(float(torch.cuda.max_memory_allocated(device)), device)
                  if device.type == "cuda" else None)
    seconds = timing.median_ms / 1e3
    used = shape.with_layers(runner.layers)
    flops = model_flops(used, tokens_global, data.docs)
    tokens_per_gpu = tokens_global // runner.world
    row = dict(case, status="ok", layers=runner.layers, gpus=runner.world, tokens_global=tokens_global,
               tokens_per_gpu=tokens_per_gpu, warmup=warmup, steps=iters, timing=timing.as_dict(),
               step_ms=timing.median_ms, spread=(timing.max_ms - timing.min_ms) / timing.median_ms,
               tokens_per_s_per_gpu=tokens_per_gpu / seconds, model_flops=flops,
               tflops_per_gpu=flops / runner.world / seconds / 1e12,
               mfu=(flops / (runner.world * seconds * peak)) if peak else None,
               ms_per_layer=timing.median_ms / runner.layers, peak_memory_bytes=peak_bytes,
               loss_first=float(losses[0].float()), loss_last=float(losses[-1].float()),
               backend=runner.backend(), rank_step_ms=timing.rank_median_ms)
    row.update(runner.extra())
    return row


# A step slower than this share of the run's best MFU, or than this MFU on a GPU of known peak, is named SLOW.
SLOW_RELATIVE, SLOW_MFU = 0.6, 0.20
RANK_IMBALANCE = 1.2   # one rank's median step time above the fastest rank's by this factor


def slow_reason(row: dict, earlier: Sequence[dict]) -> Optional[str]:
    """Why ``row`` (an ok row) looks like a slow machine or rank rather than the configuration, or None: its MFU
    below ``SLOW_MFU``, or below ``SLOW_RELATIVE`` of the best MFU among ``earlier`` ok rows of the run; a rank
    whose own median step time exceeds the fastest rank's by ``RANK_IMBALANCE``. The stamp's ``gpu_facts`` (clocks,
    throttle reasons, power, temperature) and ``topology`` are where to look next."""
    reasons = []
    mfu = row.get("mfu")
    best = max((r["mfu"] for r in earlier if r.get("status") == "ok" and r.get("mfu")), default=None)
    if mfu is not None and mfu < SLOW_MFU:
        reasons.append(f"MFU {mfu:.1%} < {SLOW_MFU:.0%}")
    elif mfu is not None and best is not None and mfu < SLOW_RELATIVE * best:
        reasons.append(f"MFU {mfu:.1%} < {SLOW_RELATIVE:.0%} of this run's best ({best:.1%})")
    ranks = row.get("rank_step_ms") or []
    if len(ranks) > 1 and max(ranks) > RANK_IMBALANCE * min(ranks):
        slowest = max(range(len(ranks)), key=ranks.__getitem__)
        reasons.append(f"rank {slowest} {ranks[slowest]:.0f} ms against {min(ranks):.0f} ms for the fastest")
    if not reasons:
        return None
    return "SLOW: " + "; ".join(reasons) + " (see the stamp's gpu_facts and topology)"


def _cases(mode: str, layouts: Sequence[str], args) -> List[dict]:
    if mode != "native":
        return [{"mode": mode, "layout": layout} for layout in layouts]
    return [{"mode": mode, "layout": layout, "sdpa": sdpa, "rotate": rotate} for layout in layouts
            for sdpa in args.native_backends for rotate in args.native_rotate]


def _best_native(rows: List[dict]) -> Optional[tuple]:
    ok = [r for r in rows if r["mode"] == "native" and r["status"] == "ok" and r["layout"] == "batch"]
    if not ok:
        return None
    best = min(ok, key=lambda r: r["step_ms"])
    return best["sdpa"], best["rotate"]


def run_rows(args, device: torch.device, emit: Callable[[dict], None]) -> List[dict]:
    """Every mode x tokens per GPU x layout x (native: SDPA backend x rotate method): one row each, passed to
    ``emit`` as it is made. A mode or case that cannot run gets a row saying why; one that fails, its error."""
    world = dist.get_world_size()
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[args.dtype]
    shape = ModelShape(args.layers, args.hidden, args.heads, args.kv_heads, args.intermediate, args.vocab,
                       args.rope_theta)
    peak = peak_flops(device, args.peak_tflops)
    rows: List[dict] = []
    started = time.monotonic()
    for mode in args.modes:
        mode_shape = shape.with_layers(args.single_layers or shape.layers) if mode == "single" else shape
        gpus = 1 if mode == "single" else world
        reason = mode_unavailable(mode, device, world)
        if reason:
            for tokens in args.seq_per_gpu:
                for layout in args.layouts:
                    _emit(rows, emit, {"mode": mode, "layout": layout, "status": "unavailable", "reason": reason,
                                       "gpus": gpus, "tokens_per_gpu": tokens, "layers": mode_shape.layers})
            continue
        runner = None
        try:
            runner = make_runner(mode, args, mode_shape, device, dtype)
            _mode_rows(runner, mode, args, device, mode_shape, peak, gpus, rows, emit, started)
        except Exception as exc:  # noqa: BLE001 - a mode that cannot be built is a row, the others still run
            _emit(rows, emit, {"mode": mode, "status": "failed", "gpus": gpus, "layers": mode_shape.layers,
                               "reason": error_text(exc)})
        finally:
            if runner is not None:
                runner.close()
            del runner
            free_memory(device)
    return rows


def _mode_rows(runner, mode, args, device, shape, peak, gpus, rows, emit, started) -> None:
    pick = None
    for tokens in args.seq_per_gpu:
        for case in _cases(mode, args.layouts, args):
            case = dict(case, tokens_per_gpu=tokens, gpus=gpus, layers=shape.layers)
            if pick is not None and (case["sdpa"], case["rotate"]) != pick and case["layout"] == "batch":
                continue
            reason = case_unavailable(mode, case["layout"])
            if reason is None and args.max_minutes and time.monotonic() - started > 60 * args.max_minutes:
                reason = f"not started: --max-minutes {args.max_minutes} reached"
            if reason:
                if case.get("rotate", args.native_rotate[0]) == args.native_rotate[0] and \
                        case.get("sdpa", args.native_backends[0]) == args.native_backends[0]:
                    _emit(rows, emit, dict(case, status="unavailable", reason=reason))
                continue
            data = step_data(case["layout"], tokens, runner.world, args.vocab, device, args.seed)
            try:
                row = measure(runner, data, case, args, device, shape, peak)
                slow = slow_reason(row, rows)
                if slow:
                    row["slow"] = slow
                    row["note"] = f"{row['note']}; {slow}" if row.get("note") else slow
            except Exception as exc:  # noqa: BLE001 - out of memory etc.: recorded, the next case still runs
                row = dict(case, status="failed", reason=error_text(exc))
            del data
            free_memory(device)
            _emit(rows, emit, row)
        if mode == "native" and args.native_pick_once and pick is None:
            pick = _best_native(rows)


def error_text(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) < 600 else text[:600] + " ..."


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _emit(rows: List[dict], emit, row: dict) -> None:
    rows.append(row)
    emit(row)


# ------------------------------------------------------------------------------------------------ output


def _fmt(value, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def markdown(rows: List[dict], meta: dict) -> str:
    s = meta["stamp"]
    head = [f"# Training step: {meta['model']}", "",
            f"{s['device_name']} x {meta['world_size']} ranks; commit {s['git_commit']} ({s['provenance']}); "
            f"torch {s['torch']}, transformers {s['transformers']}, CUDA {s['cuda']}, cuDNN {s['cudnn']}; "
            f"{s['date']}.", "",
            f"Step: {meta['step']}", "", f"FLOPs: {FLOP_FORMULA}; peak {meta['peak_tflops']} TFLOP/s per GPU.", "",
            "| mode | GPUs | tokens/GPU | layout | layers | attention | step ms (median) | spread (min-max) | "
            "tokens/s/GPU | MFU | peak mem GiB | ms/layer | loss (first, last) | note |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    body = []
    for r in rows:
        tokens = r.get("tokens_per_gpu")
        tok = f"{tokens // 1024}k" if tokens and tokens % 1024 == 0 else str(tokens)
        if r["status"] != "ok":
            body.append(f"| {r['mode']} | {r.get('gpus', '-')} | {tok} | {r.get('layout', '-')} | "
                        f"{r.get('layers', '-')} | {_native_label(r)} | - | - | - | - | - | - | - | "
                        f"{r['status']}: {r['reason']} |")
            continue
        t = r["timing"]
        mem = None if r["peak_memory_bytes"] is None else r["peak_memory_bytes"] / 2 ** 30
        body.append(f"| {r['mode']} | {r['gpus']} | {tok} | {r['layout']} | {r['layers']} | {r['backend']} | "
                    f"{r['step_ms']:.1f} | {100 * r['spread']:.1f}% ({t['min_ms']:.1f}-{t['max_ms']:.1f}, "
                    f"{r['steps']} steps) | {r['tokens_per_s_per_gpu']:.0f} | {_fmt(r['mfu'], '.1%')} | "
                    f"{_fmt(mem, '.1f')} | {r['ms_per_layer']:.2f} | {r['loss_first']:.4f}, {r['loss_last']:.4f} | "
                    f"{_note(r)} |")
    return "\n".join(head + body) + "\n"


def _note(r: dict) -> str:
    """The row's note; mode keep adds its keeper's counters (kept and replayed layer calls, gaps, budget)."""
    keep = r.get("keep")
    if not keep:
        return r.get("note", "")
    budget = "none" if keep["budget_bytes"] is None else f"{keep['budget_bytes'] / 2**30:.1f} GiB"
    text = (f"kept {keep['kept']}, replayed {keep['replayed']}, gaps {keep['gaps']} (all steps); budget {budget}, "
            f"kept peak {keep['peak_bytes'] / 2**30:.1f} GiB")
    return f"{r['note']}; {text}" if r.get("note") else text


def _native_label(r: dict) -> str:
    return f"sdpa:{r['sdpa']} rotate {r['rotate']}" if r.get("mode") == "native" and "sdpa" in r else "-"


def device_slug(name: str) -> str:
    return gpu_model(name)


def _step_text(args) -> str:
    return (f"CP modes: FSDP2 (fully_shard per decoder layer + root) over all ranks; single: one GPU, no FSDP; "
            f"activation checkpointing "
            f"{'full (every decoder layer recomputed in backward)' if args.checkpointing == 'full' else 'off'}; "
            f"LM head + fp32 cross-entropy in chunks of {args.loss_chunk} tokens (recomputed in backward); "
            f"optimizer {args.optimizer} (lr {args.lr}); {args.dtype}")


def result_writer(out: Optional[str], stem: str, meta: Callable[[], dict],
                  render: Callable[[List[dict], dict], str]) -> Callable[[List[dict], bool], None]:
    """``write(rows, complete)``: rank 0 writes ``<out>/<stem>.json`` (``meta()`` with ``complete`` and the rows)
    and ``<stem>.md`` (``render(rows, that meta)``) after every row, so a run cut short keeps what it measured;
    nothing without ``out``. ``write.stem`` is the stem."""

    def write(rows: List[dict], complete: bool) -> None:
        if dist.get_rank() != 0 or not out:
            return
        os.makedirs(out, exist_ok=True)
        full = dict(meta(), complete=complete)
        with open(os.path.join(out, stem + ".json"), "w") as f:
            json.dump(dict(full, rows=rows), f, indent=1, default=str)
        with open(os.path.join(out, stem + ".md"), "w") as f:
            f.write(render(rows, full))

    write.stem = stem
    return write


def result_stem(prefix: str, device: torch.device, world: int) -> str:
    """``<prefix>_<N>x<GPU>_<UTC time>``: a run's default file stem."""
    return (f"{prefix}_{world}x{device_slug(stamp(device, world)['device_name'])}_"
            f"{datetime.datetime.now(datetime.timezone.utc).strftime('%Y%m%dT%H%M%S')}")


def _writer(args, device, world) -> Callable[[List[dict], bool], None]:
    """The rows' writer (``result_writer``) of this run, its meta: stamp, model, step, FLOP formula, peak."""
    model = (f"LlamaForCausalLM, {args.layers} layers, hidden {args.hidden}, {args.heads}/{args.kv_heads} heads, "
             f"MLP {args.intermediate}, vocab {args.vocab}, rope theta {args.rope_theta:g}")
    peak = peak_flops(device, args.peak_tflops)

    def meta() -> dict:
        return {"stamp": stamp(device, world), "world_size": world, "model": model, "step": _step_text(args),
                "flop_formula": FLOP_FORMULA, "peak_tflops": None if peak is None else peak / 1e12,
                "argv": args.argv}

    return result_writer(args.out, args.tag or result_stem("train_step", device, world), meta, markdown)


# ------------------------------------------------------------------------------------------------ CLI


def tokens_argument(text: str) -> List[int]:
    out = []
    for part in filter(None, text.split(",")):
        part = part.strip().lower()
        out.append(int(part[:-1]) * 1024 if part.endswith("k") else int(part))
    return out


def _keep_budget(text: str):
    if text in ("auto", "all"):
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: GiB (a number), 'auto' or 'all'") from None


def names_argument(allowed: Sequence[str]):
    def parse(text: str) -> List[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        bad = [n for n in names if n not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"{bad} not in {list(allowed)}")
        return names
    return parse


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--modes", type=names_argument(MODES), default=["hfpatch", "native"],
                   help="comma-separated: hfpatch,keep,native,single (default hfpatch,native)")
    p.add_argument("--seq-per-gpu", type=tokens_argument, default=[32768], help="tokens per GPU, e.g. 32k,64k,128k")
    p.add_argument("--layouts", type=names_argument(LAYOUTS), default=list(LAYOUTS), help="batch,packed")
    for flag, default in (("--layers", 32), ("--hidden", 4096), ("--heads", 32), ("--kv-heads", 8),
                          ("--intermediate", 14336), ("--vocab", 128256)):
        p.add_argument(flag, type=int, default=default)
    p.add_argument("--rope-theta", type=float, default=500000.0)
    p.add_argument("--single-layers", type=int, default=None, help="decoder layers of the single mode (default "
                   "--layers; fewer when the whole model does not fit one GPU)")
    p.add_argument("--dtype", choices=("bf16", "fp32", "fp16"), default="bf16")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--steps", type=int, default=None,
                   help="timed steps (default: 2+5 up to 64k tokens per step, 1+3 up to 256k, 1+2 above)")
    p.add_argument("--kernel", default="auto", help="hfpatch.apply's kernel= (auto, zigzag, llama3:torch_cudnn...)")
    p.add_argument("--native-backends", type=names_argument(("cudnn", "flash", "efficient")), default=["cudnn", "flash"])
    p.add_argument("--native-rotate", type=names_argument(("allgather", "alltoall")), default=["allgather", "alltoall"])
    p.add_argument("--no-native-pick-once", dest="native_pick_once", action="store_false",
                   help="time every native backend x rotate at every size (default: only at the first size, then "
                        "the fastest)")
    p.add_argument("--sdpa-backend", choices=("cudnn", "flash", "efficient"), default="cudnn",
                   help="SDPA backend of the single mode's batch rows")
    p.add_argument("--checkpointing", choices=("full", "none"), default="full")
    p.add_argument("--keep-budget", type=_keep_budget, default="auto",
                   help="mode keep: GiB of kept attention outputs, 'auto' (what fits) or 'all'")
    p.add_argument("--optimizer", choices=("adamw", "sgd", "none"), default="adamw")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--loss-chunk", type=int, default=4096)
    p.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak per GPU (default: by name)")
    p.add_argument("--max-minutes", type=float, default=None, help="start no case after this many minutes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="directory for <tag>.json and <tag>.md")
    p.add_argument("--tag", default=None, help="file stem (default train_step_<N>x<GPU>_<date>)")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    for tokens in args.seq_per_gpu:
        if tokens % (2 * MIX_WORLD):
            p.error(f"--seq-per-gpu {tokens}: must be a multiple of {2 * MIX_WORLD} (packed documents and the "
                    f"zigzag split of 1 to 8 GPUs)")
    return args


def join_process_group(device_type: str) -> bool:
    """Join torchrun's group, or make a one-process group; True when this call created it."""
    if dist.is_initialized():
        return False
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    if device_type == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    else:
        dist.init_process_group("gloo")
    return True


def main(argv=None) -> int:
    args = parse_args(argv)
    created = join_process_group(args.device)
    try:
        device = (torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda"
                  else torch.device("cpu"))
        world = dist.get_world_size()
        write = _writer(args, device, world)
        rank0 = dist.get_rank() == 0
        rows: List[dict] = []

        def emit(row: dict) -> None:
            rows.append(row)
            write(rows, False)
            if rank0:
                print(_row_line(row), flush=True)

        run_rows(args, device, emit)
        write(rows, True)
        if rank0:
            if args.out:
                print(f"wrote {os.path.join(args.out, write.stem)}.json and .md", flush=True)
            print(FLOP_FORMULA, flush=True)
        return 0
    finally:
        if created:
            dist.destroy_process_group()


def _row_line(r: dict) -> str:
    head = (f"{r['mode']} {r.get('gpus')} GPU {r.get('tokens_per_gpu')}/GPU {r.get('layout', '-')} "
            f"{_native_label(r) if r.get('mode') == 'native' else ''}").rstrip()
    if r["status"] != "ok":
        return f"{head}: {r['status']}: {r['reason']}"
    mfu = "-" if r["mfu"] is None else f"{r['mfu']:.1%}"
    mem = "-" if r["peak_memory_bytes"] is None else f"{r['peak_memory_bytes'] / 2 ** 30:.1f} GiB"
    return (f"{head}: step {r['step_ms']:.1f} ms (spread {100 * r['spread']:.1f}%), "
            f"{r['tokens_per_s_per_gpu']:.0f} tokens/s/GPU, MFU {mfu}, peak {mem}, {r['backend']}, "
            f"loss {r['loss_first']:.4f}->{r['loss_last']:.4f}")


if __name__ == "__main__":
    sys.exit(main())
