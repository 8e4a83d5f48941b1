"""One training step of a ~1B hybrid model (Qwen3.5-text or Nemotron-H style) with context parallelism: hfpatch vs
one GPU on its share, and what the sequence mixers' exchange costs.

Launch (one process per GPU; the same script on 1, 2, 4 or 8 GPUs)::

    torchrun --nproc-per-node 2 benchmarks/hybrid_step.py --modes hfpatch,single --seq-per-gpu 32k --out DIR
    torchrun --nproc-per-node 1 benchmarks/hybrid_step.py --modes single --seq-per-gpu 16k,32k --out DIR
    torchrun --nproc-per-node 2 benchmarks/hybrid_step.py --family nemotron_h --modes hfpatch,single --out DIR

(``python benchmarks/hybrid_step.py ...`` without torchrun runs one process.) On CPU, tiny, over gloo (what
``tests/tooling/test_hybrid_step_bench.py`` runs): ``torchrun --nproc-per-node 2 benchmarks/hybrid_step.py
--device cpu --dtype fp32 --size tiny --seq-per-gpu 64 --optimizer sgd --steps 1 --warmup 0``.

**The model.** A transformers hybrid class built from its own config class, random weights (the same seed on every
rank), ``--dtype`` (bf16), train mode, no dropout. ``--family`` (``FAMILIES``):

- ``qwen3_5`` (default): ``Qwen3_5ForCausalLM`` from a ``Qwen3_5TextConfig``; ``--size 1b``: 24 layers, three
  Gated DeltaNet layers (causal conv of 4 taps + chunked gated delta rule; 16 key and 16 value heads of 128) to
  one full-attention layer (8 query / 2 K/V heads of 256, partial RoPE 0.25, output gate), hidden 1536, MLP 3584,
  vocabulary 248320, tied embeddings: 1.13B parameters.
- ``nemotron_h``: ``NemotronHForCausalLM`` from a ``NemotronHConfig``; ``--size 1b``: 24 blocks, Mamba2 (64 heads
  of 64, state 128, 8 groups, conv 4, chunk 128) and attention (16 query / 4 K/V heads of 128) mixers 3:1, each
  followed by an MLP block (6144, relu2); hidden 2048, vocabulary 131072, tied embeddings: 1.14B parameters.

``--size tiny`` is the same structure at toy sizes (the CPU test); ``--layers``/``--hidden``/``--intermediate``/
``--vocab`` override the preset. The output states the config and the parameter count.

**The step** (as ``train_step.py``'s, whose helpers it imports): FSDP2 (``fully_shard`` on every decoder layer and
on the root, over all ranks -- the CP ranks reduce their gradients anyway, and FSDP2 does it layer by layer while
halving the memory of parameters, gradients and AdamW states), full activation checkpointing of every decoder layer
(non-reentrant; each layer's forward, its mixer exchange included, runs again in backward), the LM head and the
fp32 cross-entropy in chunks of ``--loss-chunk`` tokens (recomputed in backward), backward, the optimizer step
(``--optimizer``, AdamW by default). Every rank holds ``--seq-per-gpu`` tokens of one causal sequence (batch 1).

**Modes.**

- ``hfpatch``: ``hfpatch.apply(mesh, model=model)`` (attention on the model's flash path with the ring kernels,
  zigzag for the batch; the recognised sequence mixers run their CP form), ``patch.shard_inputs``, the loss reduced
  by ``patch.reduce_loss`` (the user guide's step); backward on ``loss x world size`` (FSDP2 averages).
- ``single``: one GPU, no CP, no FSDP, the same checkpointing, loss and optimizer, on ``--seq-per-gpu`` tokens (a
  GPU's share); attention: causal SDPA pinned to ``--sdpa-backend`` (train_step.py's); the mixers: the kernels the
  release picked, from a zero state. Every rank of the job runs it on its own GPU.
- PyTorch's native CP (``context_parallel``) cannot run a hybrid: it shards the sequence and rings only SDPA, so
  every Gated DeltaNet / Mamba2 layer would see its rank's shard as a whole sequence starting from a zero state --
  wrong results, no error. The output states this instead of a row.

**Numbers per row.** Step time: CUDA events around each step after the warm-up steps, the slowest rank per step,
median over ``--steps`` with min and max. tokens/s per GPU = tokens per GPU / median step. Peak memory:
``torch.cuda.max_memory_allocated`` over the steps, max over ranks. The attention kernel (hfpatch:
``Patch.backend_choices``). The mixer kernels (``mixer_kernels``): for every kernel name the mixer registry binds
(``hfpatch.mixers.recognise``), the implementation that name runs -- flash-linear-attention, causal-conv1d or
mamba-ssm where they are installed, else transformers' torch fallback -- and, for hfpatch, how many calls ran the
CP form (``Patch.mixers.calls``, switch mode "ring"). Loss of the first and last step.

**The mixers' exchange share** (hfpatch rows; by substitution, like ``_nocomm.py`` for the ring): the step is timed
a second time with the mixers' one collective -- ``hfpatch.mixers.segments.all_gather_differentiable``, the
all-gather of every segment's state summary in the forward (and its recomputation), whose backward is one
all-reduce of the gathered summaries' gradient -- replaced by a local stand-in of the same shapes (this rank's
summaries copied into every rank's slot; the backward returns this rank's slice, no all-reduce). Everything else,
the mixers' summaries, composition and correction included, runs unchanged. ``exchange share = (T - T_no_exchange) /
T``: the exchange's communication and the waiting for the slowest rank it implies. The stand-in counts its calls;
a measurement that replaced nothing is refused. The step is timed a third time with each rebound kernel name
holding the kernel the release picked (``Patch.mixers.sites``' ``__wrapped__``): every rank's mixers run on its
shard from a zero state, as without CP: ``mixers' CP share = (T - T_mixers_local) / T`` is everything the CP form
adds (summaries, the exchange, composition, correction; for Mamba2 also the unfused path CP takes instead of
mamba-ssm's fused kernel). Both substitutes give wrong values by design and are only timed.

**Exchange bytes** (``exchange_bytes``): one step with the real collective recorded: per kernel role, the bytes
each rank contributes per call (its segments' summaries, fp32 or the activation dtype, padded to the same rows on
every rank) and the calls per step; per mixer layer, what one forward sends (each rank's part; every rank
receives ``world - 1`` times that, and the backward all-reduces ``world`` times it). It does not depend on the
sequence length.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.metadata
import json
import os
import sys
import time
from collections import Counter
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path[:0] = [_HERE, os.path.dirname(_HERE)]

import train_step as ts  # noqa: E402
from _stamp import stamp  # noqa: E402
from _timing import time_callable  # noqa: E402

__all__ = ["FAMILIES", "HybridSpec", "family_unavailable", "build_config", "build_model", "mixer_kernels",
           "no_mixer_exchange", "recording_exchange", "local_mixers", "make_runner", "run_rows", "main",
           "NATIVE_CP_NOTE"]

MODES = ("hfpatch", "single")
SIZES = ("1b", "tiny")
NATIVE_CP_NOTE = ("PyTorch's native CP (context_parallel) is not measured: it shards the sequence and rings only "
                  "SDPA, so every Gated DeltaNet / Mamba2 mixer would run its rank's shard as a whole sequence from "
                  "a zero state -- wrong results without an error")
# Where a kernel the release bound comes from, by its top-level module.
_PACKAGES = {"fla": "flash-linear-attention", "causal_conv1d": "causal-conv1d", "mamba_ssm": "mamba-ssm",
             "kernels": "hub kernel (kernels)", "transformers": "torch fallback (transformers)",
             "hfpatch": "hfpatch"}
_FAST_DISTRIBUTIONS = ("flash-linear-attention", "fla-core", "causal-conv1d", "mamba-ssm", "kernels")


# ------------------------------------------------------------------------------------------------ the models


@dataclasses.dataclass(frozen=True)
class HybridSpec:
    """A hybrid family: its causal-LM and config classes, its mixer class, and a config per ``--size``."""

    model_class: str
    config_class: str
    mixer_class: str
    mixer: str
    sizes: Dict[str, dict]
    layer_key: str          # the config field listing the layer kinds

    def available(self) -> Optional[str]:
        """Why this transformers cannot build the family (None when it can)."""
        import transformers

        missing = [n for n in (self.model_class, self.config_class) if not hasattr(transformers, n)]
        if missing:
            return f"transformers {transformers.__version__} has no {' / '.join(missing)}"
        return None


def _qwen3_5_layers(n: int) -> List[str]:
    return [("full_attention" if i % 4 == 3 else "linear_attention") for i in range(n)]


def _nemotron_h_blocks(n: int) -> List[str]:
    """``n`` blocks: (mixer, MLP) pairs, every fourth mixer attention (the last one when there are fewer than four
    mixers), the others Mamba2."""
    mixers = n // 2
    attention = {i for i in range(mixers) if i % 4 == 3} or {mixers - 1}
    return [kind for i in range(mixers) for kind in ("full_attention" if i in attention else "linear_attention", "mlp")]


FAMILIES: Dict[str, HybridSpec] = {
    "qwen3_5": HybridSpec(
        model_class="Qwen3_5ForCausalLM", config_class="Qwen3_5TextConfig", mixer_class="Qwen3_5GatedDeltaNet",
        mixer="Gated DeltaNet (causal conv + chunked gated delta rule)", layer_key="layer_types",
        sizes={
            "1b": dict(hidden_size=1536, num_hidden_layers=24, intermediate_size=3584, num_attention_heads=8,
                       num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
                       linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                       vocab_size=248320, tie_word_embeddings=True),
            "tiny": dict(hidden_size=64, num_hidden_layers=4, intermediate_size=128, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                         linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                         vocab_size=256, tie_word_embeddings=True),
        }),
    "nemotron_h": HybridSpec(
        model_class="NemotronHForCausalLM", config_class="NemotronHConfig", mixer_class="NemotronHMamba2Mixer",
        mixer="Mamba2 (causal conv + SSD chunked scan)", layer_key="layers_block_type",
        sizes={
            "1b": dict(hidden_size=2048, num_hidden_layers=24, intermediate_size=6144, num_attention_heads=16,
                       num_key_value_heads=4, head_dim=128, mamba_num_heads=64, mamba_head_dim=64,
                       ssm_state_size=128, n_groups=8, conv_kernel=4, chunk_size=128, vocab_size=131072,
                       tie_word_embeddings=True),
            "tiny": dict(hidden_size=64, num_hidden_layers=4, intermediate_size=128, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, mamba_num_heads=4, mamba_head_dim=16,
                         ssm_state_size=16, n_groups=2, conv_kernel=4, chunk_size=16, vocab_size=256,
                         tie_word_embeddings=True),
        }),
}


def family_unavailable(family: str) -> Optional[str]:
    return FAMILIES[family].available()


def config_fields(args) -> dict:
    """The config keyword arguments of ``args.family`` at ``args.size`` with the command line's overrides."""
    spec = FAMILIES[args.family]
    fields = dict(spec.sizes[args.size])
    for flag, key in (("layers", "num_hidden_layers"), ("hidden", "hidden_size"),
                      ("intermediate", "intermediate_size"), ("vocab", "vocab_size")):
        if getattr(args, flag, None) is not None:
            fields[key] = getattr(args, flag)
    layers = fields.pop("num_hidden_layers")
    if args.family == "qwen3_5":
        fields.update(num_hidden_layers=layers, layer_types=_qwen3_5_layers(layers))
    else:
        if layers % 2:
            raise ValueError(f"--layers {layers}: Nemotron-H blocks come in (mixer, MLP) pairs; give an even count")
        fields[spec.layer_key] = _nemotron_h_blocks(layers)
    return dict(fields, attention_dropout=0.0, use_cache=False)


def build_config(args, attn_implementation: str = "eager"):
    import transformers

    config_cls = getattr(transformers, FAMILIES[args.family].config_class)
    return config_cls(**config_fields(args), attn_implementation=attn_implementation)


def build_model(args, device: torch.device, dtype: torch.dtype):
    """The family's causal LM from ``build_config(args)`` on ``device`` in ``dtype``, random weights from
    ``args.seed`` (equal on every rank), train mode."""
    import transformers

    model_cls = getattr(transformers, FAMILIES[args.family].model_class)
    torch.manual_seed(args.seed)
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = model_cls(build_config(args))
    finally:
        torch.set_default_dtype(saved)
    return model.train()


def describe_model(model, args) -> dict:
    config = model.config
    kinds = Counter(getattr(config, FAMILIES[args.family].layer_key))
    return {"class": type(model).__name__, "family": args.family, "size": args.size,
            "parameters": sum(p.numel() for p in model.parameters()),
            "layer_kinds": dict(kinds), "config": config_fields(args)}


# ------------------------------------------------------------------------------------------------ mixer kernels


def _implementation(function) -> tuple:
    """(qualified name, package) of what ``function`` (a kernel name's value in a modeling module) runs: hfpatch's
    mixer wrapper unwrapped to the kernel the release bound; transformers' ``use_kernel_func_from_hub_with_fallback``
    resolved to the implementation it picked at import (the fast package, or the torch function itself)."""
    from hfpatch.undo import is_wrapper
    while is_wrapper(function):
        function = function.__wrapped__
    cells = {}
    code = getattr(function, "__code__", None)
    for name, cell in zip(code.co_freevars if code else (), getattr(function, "__closure__", None) or ()):
        try:
            cells[name] = cell.cell_contents
        except ValueError:
            continue
    target = cells.get("implementation", function)
    if not callable(target):
        target = function
    module = getattr(target, "__module__", "") or ""
    name = f"{module}.{getattr(target, '__qualname__', getattr(target, '__name__', repr(target)))}"
    return name, _PACKAGES.get(module.split(".")[0], module.split(".")[0] or "?")


def mixer_kernels(model, installation=None) -> List[dict]:
    """One entry per kernel name the mixer registry binds for ``model``'s recognised mixers: ``site``
    ("module.name"), ``role``, ``implementation`` (qualified name), ``package`` (flash-linear-attention,
    causal-conv1d, mamba-ssm, or the torch fallback), ``mixers`` (modules calling it) and, given the patch's
    ``installation`` (``Patch.mixers``), ``cp_calls``: calls that ran its CP form (switch mode "ring")."""
    from hfpatch.mixers import recognise

    sites: Dict[str, dict] = {}
    for _, module in model.named_modules():
        found = recognise(module)
        if found is None:
            continue
        for name, role in found.family.bindings:
            key = f"{found.module.__name__}.{name}"
            if key in sites:
                sites[key]["mixers"] += 1
                continue
            implementation, package = _implementation(getattr(sys.modules[found.module.__name__], name))
            sites[key] = {"site": key, "role": role, "implementation": implementation, "package": package,
                          "mixers": 1}
    if installation is not None:
        for entry in sites.values():
            entry["cp_calls"] = installation.calls.get((entry["role"], "ring"), 0)
    return list(sites.values())


def _kernels_text(kernels: List[dict]) -> str:
    parts = []
    for k in kernels:
        ran = "" if "cp_calls" not in k else (f", CP form x{k['cp_calls']}" if k["cp_calls"] else ", not called")
        parts.append(f"{k['site'].rsplit('.', 1)[-1]}: {k['package']}{ran}")
    return "; ".join(parts) or "-"


def fast_packages() -> Dict[str, Optional[str]]:
    """Installed versions of the fast mixer packages (None: not installed)."""
    out = {}
    for name in _FAST_DISTRIBUTIONS:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


# ------------------------------------------------------------------------------------------------ the exchange


class ExchangeCounter:
    """Calls of the mixers' collective made inside ``no_mixer_exchange`` / ``recording_exchange``, and (recording)
    the bytes each rank contributed per call, by kernel role."""

    def __init__(self) -> None:
        self.calls = 0
        self.by_role: Counter = Counter()
        self.bytes_by_role: Dict[str, int] = {}


class _LocalGather(torch.autograd.Function):
    """The all-gather's stand-in: (R, F) -> (world, R, F) holding this rank's rows in every slot (copies); backward:
    this rank's slice of the gradient, no all-reduce."""

    @staticmethod
    def forward(ctx, x, rank, world_size):
        ctx.rank = rank
        return torch.stack([x.contiguous()] * world_size)

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.rank].contiguous(), None, None


def _caller_role() -> str:
    """The role of the ``SequenceKernel`` whose ``run_cp`` called the exchange (read from the call stack)."""
    from hfpatch.mixers.kernel import SequenceKernel

    frame = sys._getframe(2)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, SequenceKernel):
            return owner.role
        frame = frame.f_back
    return "?"


@contextlib.contextmanager
def _replaced_gather(replacement):
    import hfpatch.mixers.segments as segments

    original = segments.__dict__["all_gather_differentiable"]
    segments.all_gather_differentiable = replacement
    try:
        yield
    finally:
        segments.all_gather_differentiable = original


@contextlib.contextmanager
def no_mixer_exchange():
    """Within the block, the mixers' all-gather (``hfpatch.mixers.segments.all_gather_differentiable``) copies
    this rank's summaries into every slot instead of communicating; yields an ``ExchangeCounter``."""
    counter = ExchangeCounter()

    def local_gather(x, group, rank, world_size):
        counter.calls += 1
        return _LocalGather.apply(x, rank, world_size)

    with _replaced_gather(local_gather):
        yield counter


@contextlib.contextmanager
def recording_exchange():
    """Within the block, the mixers' all-gather runs as usual and is recorded (calls and bytes per kernel role)."""
    import hfpatch.mixers.segments as segments

    counter = ExchangeCounter()
    original = segments.__dict__["all_gather_differentiable"]

    def recorded(x, group, rank, world_size):
        role = _caller_role()
        counter.calls += 1
        counter.by_role[role] += 1
        counter.bytes_by_role[role] = x.numel() * x.element_size()
        return original(x, group, rank, world_size)

    with _replaced_gather(recorded):
        yield counter


@contextlib.contextmanager
def local_mixers(installation):
    """Within the block, every kernel name ``installation`` (``Patch.mixers``) rebound holds the kernel the release
    picked again (its wrapper's ``__wrapped__``): each rank's mixers run on its shard from a zero state, as
    without CP. Restored on exit."""
    from hfpatch.undo import is_wrapper
    swapped = []
    try:
        for site in installation.sites:
            module_name, name = site.rsplit(".", 1)
            module = sys.modules[module_name]
            wrapper = module.__dict__[name]
            if is_wrapper(wrapper):
                setattr(module, name, wrapper.__wrapped__)
                swapped.append((module, name, wrapper))
        yield len(swapped)
    finally:
        for module, name, wrapper in swapped:
            setattr(module, name, wrapper)


def exchange_bytes(counter: ExchangeCounter, mixer_layers: int, forwards_per_step: int, world: int) -> dict:
    """The recorded step's exchange, per kernel role and per mixer layer (see the module docstring)."""
    roles = {role: {"calls_per_step": n, "bytes_per_rank_per_call": counter.bytes_by_role[role]}
             for role, n in sorted(counter.by_role.items())}
    per_forward = sum(r["calls_per_step"] * r["bytes_per_rank_per_call"] for r in roles.values()) / forwards_per_step
    per_layer = per_forward / mixer_layers if mixer_layers else 0.0
    return {"by_role": roles, "forwards_per_step": forwards_per_step, "mixer_layers": mixer_layers,
            "per_layer_sent_bytes": per_layer, "per_layer_received_bytes": per_layer * (world - 1),
            "per_layer_backward_allreduce_bytes": per_layer * world}


# ------------------------------------------------------------------------------------------------ runners


@dataclasses.dataclass
class Runner:
    """One mode's model ready to step: ``step(data) -> loss`` (detached, the global mean), ``info()`` (attention,
    mixer kernels), ``close()``; ``patch``/``loss_module``/``model`` for the measurements and the test."""

    mode: str
    world: int
    step: Callable
    info: Callable[[], dict]
    close: Callable[[], None]
    model: object = None
    loss_module: object = None
    patch: object = None


def _hfpatch_runner(args, device, dtype) -> Runner:
    import hfpatch

    world = dist.get_world_size()
    mesh = ts.world_mesh(device)
    model = build_model(args, device, dtype)
    patch = hfpatch.apply(mesh["cp"], kernel=args.kernel, model=model)
    try:
        if args.checkpointing == "full":
            ts.checkpoint_layers(model)
        loss_module = ts.ChunkedLoss(model, args.loss_chunk)
        ts.shard_fsdp(loss_module, mesh["cp"])
        opt = ts.make_optimizer(args.optimizer, loss_module.parameters(), args.lr, device)
    except BaseException:
        patch.remove()
        raise

    def step(data) -> torch.Tensor:
        loss_module.zero_grad(set_to_none=True)
        batch = patch.shard_inputs(data.input_ids, labels=data.labels)
        loss_sum, count = loss_module(batch["input_ids"], batch["position_ids"], batch["labels"])
        loss = patch.reduce_loss(loss_sum, count)
        (loss * world).backward()          # FSDP2 averages over the ranks; the CP gradient is their sum
        if opt is not None:
            opt.step()
        return loss.detach()

    def info() -> dict:
        names = list(dict.fromkeys(c.backend for c in patch.backend_choices))
        kernel = patch.ctx.step.kernel if patch.ctx.step is not None else "?"
        return {"attention": f"ring {kernel} x {'+'.join(names) or '?'}",
                "mixer_kernels": mixer_kernels(model, patch.mixers),
                "mixer_modules": len(patch.mixers.modules) if patch.mixers is not None else 0,
                "patch": repr(patch)}

    return Runner("hfpatch", world, step, info, patch.remove, model, loss_module, patch)


def _single_runner(args, device, dtype) -> Runner:
    from torch.nn.attention import sdpa_kernel

    import native_cp
    from hfpatch.inputs import shift_labels

    ts.register_bench_attention()
    model = build_model(args, device, dtype)
    ts.set_attention(model, ts.BENCH_SDPA)
    if args.checkpointing == "full":
        ts.checkpoint_layers(model)
    loss_module = ts.ChunkedLoss(model, args.loss_chunk)
    opt = ts.make_optimizer(args.optimizer, loss_module.parameters(), args.lr, device)

    def step(data) -> torch.Tensor:
        loss_module.zero_grad(set_to_none=True)
        pin = (sdpa_kernel([native_cp._sdpa_backend(args.sdpa_backend)]) if device.type == "cuda"
               else contextlib.nullcontext())
        with pin:
            loss_sum, count = loss_module(data.input_ids, data.position_ids, shift_labels(data.labels))
            loss = loss_sum / count
            loss.backward()
        if opt is not None:
            opt.step()
        return loss.detach()

    def info() -> dict:
        return {"attention": f"sdpa:{args.sdpa_backend if device.type == 'cuda' else 'cpu default'}",
                "mixer_kernels": mixer_kernels(model)}

    return Runner("single", 1, step, info, lambda: None, model, loss_module)


def make_runner(mode: str, args, device, dtype) -> Runner:
    return {"hfpatch": _hfpatch_runner, "single": _single_runner}[mode](args, device, dtype)


def mode_unavailable(mode: str, world: int, family: str) -> Optional[str]:
    reason = family_unavailable(family)
    if reason:
        return reason
    if mode == "hfpatch" and world < 2:
        return "CP needs 2 or more ranks (torchrun --nproc-per-node N, N >= 2)"
    if mode == "single":
        return ts.attention_interface_unavailable()
    return None


# ------------------------------------------------------------------------------------------------ measuring


def _timed(runner: Runner, data, device, warmup: int, iters: int, losses: Optional[list] = None):
    record = losses if losses is not None else []
    return time_callable(lambda: record.append(runner.step(data)), device=device, warmup=warmup, iters=iters)


def measure(runner: Runner, data, args, device, case: dict) -> dict:
    """Time ``runner`` on ``data``: a result row (see the module docstring)."""
    tokens_global = data.input_ids.shape[1]
    warmup, iters = ts.steps_for(tokens_global, args)
    row = dict(case)
    losses: List[torch.Tensor] = []
    if runner.patch is not None:    # one step with the collective recorded (also a warm-up step)
        runner.patch.reset_calls()
        with recording_exchange() as recorded:
            losses.append(runner.step(data))
        mixers = runner.patch.mixers
        forwards = 2 if args.checkpointing == "full" else 1
        row["exchange_bytes"] = exchange_bytes(recorded, len(mixers.modules) if mixers else 0, forwards,
                                               runner.world)
        if mixers is not None:
            mixers.calls.clear()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    timing = _timed(runner, data, device, warmup, iters, losses)
    peak = (ts.max_over_ranks(float(torch.cuda.max_memory_allocated(device)), device)
            if device.type == "cuda" else None)
    info = runner.info()   # before the substitutes: the CP form's calls are the timed steps' (+ warm-up)
    tokens_per_gpu = tokens_global // runner.world
    row.update(status="ok", gpus=runner.world, tokens_global=tokens_global, tokens_per_gpu=tokens_per_gpu,
               warmup=warmup, steps=iters, timing=timing.as_dict(), step_ms=timing.median_ms,
               spread=(timing.max_ms - timing.min_ms) / timing.median_ms,
               tokens_per_s_per_gpu=tokens_per_gpu / (timing.median_ms / 1e3), peak_memory_bytes=peak,
               loss_first=float(losses[0].float()), loss_last=float(losses[-1].float()), **info)
    if runner.patch is not None:
        row.update(_substituted(runner, data, device, warmup, iters, timing.median_ms))
    return row


def _substituted(runner: Runner, data, device, warmup: int, iters: int, step_ms: float) -> dict:
    """The step timed without the mixers' exchange, and with the mixers as without CP (module docstring)."""
    out = {}
    with no_mixer_exchange() as counter:
        nocomm = _timed(runner, data, device, warmup, iters)
    if counter.calls == 0:
        out["no_exchange"] = {"status": "refused", "reason": "the stand-in replaced no exchange: the mixers did "
                                                             "not call hfpatch.mixers.segments' all-gather"}
    else:
        out["no_exchange"] = {"status": "ok", "timing": nocomm.as_dict(), "step_ms": nocomm.median_ms,
                              "replaced_calls": counter.calls}
        out["exchange_share"] = (step_ms - nocomm.median_ms) / step_ms
    mixers = runner.patch.mixers
    with (local_mixers(mixers) if mixers is not None else contextlib.nullcontext(0)) as swapped:
        local = _timed(runner, data, device, warmup, iters) if swapped else None
    if local is None:
        out["mixers_local"] = {"status": "refused", "reason": "no rebound mixer kernel to swap"}
    else:
        out["mixers_local"] = {"status": "ok", "timing": local.as_dict(), "step_ms": local.median_ms,
                               "swapped_sites": swapped}
        out["mixer_cp_share"] = (step_ms - local.median_ms) / step_ms
    return out


def run_rows(args, device, emit: Callable[[dict], None], meta: dict) -> List[dict]:
    """Every mode x tokens per GPU: one row each, passed to ``emit`` as it is made. A mode that cannot run gets a
    row saying why; one that fails, its error."""
    world = dist.get_world_size()
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[args.dtype]
    rows: List[dict] = []
    started = time.monotonic()
    for mode in args.modes:
        gpus = 1 if mode == "single" else world
        reason = mode_unavailable(mode, world, args.family)
        if reason:
            for tokens in args.seq_per_gpu:
                _emit(rows, emit, {"mode": mode, "status": "unavailable", "reason": reason, "gpus": gpus,
                                   "tokens_per_gpu": tokens})
            continue
        runner = None
        try:
            runner = make_runner(mode, args, device, dtype)
            meta.setdefault("model", describe_model(runner.model, args))
            for tokens in args.seq_per_gpu:
                case = {"mode": mode, "gpus": gpus, "tokens_per_gpu": tokens}
                if args.max_minutes and time.monotonic() - started > 60 * args.max_minutes:
                    _emit(rows, emit, dict(case, status="unavailable",
                                           reason=f"not started: --max-minutes {args.max_minutes} reached"))
                    continue
                data = ts.step_data("batch", tokens, runner.world, args.vocab_size, device, args.seed)
                try:
                    row = measure(runner, data, args, device, case)
                except Exception as exc:  # noqa: BLE001 - out of memory etc.: recorded, the next size still runs
                    row = dict(case, status="failed", reason=ts.error_text(exc))
                del data
                ts.free_memory(device)
                _emit(rows, emit, row)
        except Exception as exc:  # noqa: BLE001 - a mode that cannot be built is a row, the others still run
            _emit(rows, emit, {"mode": mode, "status": "failed", "gpus": gpus, "reason": ts.error_text(exc)})
        finally:
            if runner is not None:
                runner.close()
            del runner
            ts.free_memory(device)
    return rows


def _emit(rows: List[dict], emit, row: dict) -> None:
    rows.append(row)
    emit(row)


# ------------------------------------------------------------------------------------------------ output


def _pct(value) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _size(value) -> str:
    if value is None:
        return "-"
    return f"{value / 2 ** 20:.2f} MiB" if value >= 2 ** 20 else f"{value / 2 ** 10:.1f} KiB"


def _tok(tokens) -> str:
    return f"{tokens // 1024}k" if tokens and tokens % 1024 == 0 else str(tokens)


def _sub_ms(row: dict, key: str) -> str:
    sub = row.get(key) or {}
    return f"{sub['step_ms']:.1f}" if sub.get("status") == "ok" else (sub.get("status") or "-")


def _model_text(meta: dict) -> str:
    m = meta.get("model")
    if not m:
        return "(no model built)"
    return (f"{m['class']} ({m['family']}, {m['size']}), {m['parameters']:,} parameters "
            f"({m['parameters'] / 1e9:.2f}B), layers "
            f"{m['layer_kinds']}; config {json.dumps(m['config'], default=str)}")


def _bytes_text(rows: List[dict]) -> str:
    row = next((r for r in rows if r.get("exchange_bytes")), None)
    if row is None:
        return "exchange bytes: no hfpatch row"
    e = row["exchange_bytes"]
    roles = ", ".join(f"{role}: {_size(v['bytes_per_rank_per_call'])} per call x {v['calls_per_step']} per step"
                      for role, v in e["by_role"].items())
    return (f"exchange per mixer layer and forward ({row['gpus']} ranks, {_tok(row['tokens_per_gpu'])} tokens per "
            f"GPU; independent of the length): each rank sends {_size(e['per_layer_sent_bytes'])}, receives "
            f"{_size(e['per_layer_received_bytes'])}; backward all-reduce "
            f"{_size(e['per_layer_backward_allreduce_bytes'])} ({e['mixer_layers']} mixer layers, "
            f"{e['forwards_per_step']} forwards per step; "
            f"per role and rank: {roles})")


def markdown(rows: List[dict], meta: dict) -> str:
    s = meta["stamp"]
    head = [f"# Hybrid training step: {meta['family']}", "",
            f"{s['device_name']} x {meta['world_size']} ranks; commit {s['git_commit']} ({s['provenance']}); "
            f"torch {s['torch']}, transformers {s['transformers']}, CUDA {s['cuda']}; {s['date']}.", "",
            f"Model: {_model_text(meta)}", "", f"Step: {meta['step']}", "",
            f"Fast mixer packages installed: {json.dumps(meta['fast_packages'])}", "",
            f"{NATIVE_CP_NOTE}.", "", _bytes_text(rows), "",
            "| mode | GPUs | tokens/GPU | step ms (median) | spread (min-max) | tokens/s/GPU | peak mem GiB | "
            "exchange share | step ms, no exchange | mixers' CP share | step ms, mixers local | attention | "
            "mixer kernels | loss (first, last) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    body = []
    for r in rows:
        tok = _tok(r.get("tokens_per_gpu"))
        if r["status"] != "ok":
            body.append(f"| {r['mode']} | {r.get('gpus', '-')} | {tok} | {r['status']}: {r['reason']} "
                        f"| - | - | - | - | - | - | - | - | - | - |")
            continue
        t = r["timing"]
        mem = "-" if r["peak_memory_bytes"] is None else f"{r['peak_memory_bytes'] / 2 ** 30:.1f}"
        body.append(f"| {r['mode']} | {r['gpus']} | {tok} | {r['step_ms']:.1f} | {100 * r['spread']:.1f}% "
                    f"({t['min_ms']:.1f}-{t['max_ms']:.1f}, {r['steps']} steps) | {r['tokens_per_s_per_gpu']:.0f} | "
                    f"{mem} | {_pct(r.get('exchange_share'))} | {_sub_ms(r, 'no_exchange')} | "
                    f"{_pct(r.get('mixer_cp_share'))} | {_sub_ms(r, 'mixers_local')} | {r['attention']} | "
                    f"{_kernels_text(r['mixer_kernels'])} | {r['loss_first']:.4f}, {r['loss_last']:.4f} |")
    method = ("Exchange share = (T - T with the mixers' all-gather replaced by a local copy of the same shapes) / T; "
              "mixers' CP share = (T - T with every mixer kernel on its rank's shard from a zero state) / T; "
              "both substitutes compute wrong values by design and are only timed (benchmarks/hybrid_step.py).")
    return "\n".join(head + body + ["", method]) + "\n"


def _step_text(args) -> str:
    return (f"hfpatch: FSDP2 (fully_shard per decoder layer + root) over all ranks; single: one GPU, no FSDP; "
            f"activation checkpointing {'full' if args.checkpointing == 'full' else 'off'}; LM head + fp32 "
            f"cross-entropy in chunks of {args.loss_chunk} tokens; optimizer {args.optimizer} (lr {args.lr}); "
            f"{args.dtype}; batch 1, one causal sequence")


def _writer(args, device, world, meta: dict) -> Callable[[List[dict], bool], None]:
    """The rows' writer (``train_step.result_writer``): ``meta`` with this run's stamp."""
    stem = args.tag or ts.result_stem(f"hybrid_step_{args.family}", device, world)
    return ts.result_writer(args.out, stem, lambda: dict(meta, stamp=stamp(device, world)), markdown)


def _row_line(r: dict) -> str:
    head = f"{r['mode']} {r.get('gpus')} GPU {r.get('tokens_per_gpu')}/GPU"
    if r["status"] != "ok":
        return f"{head}: {r['status']}: {r['reason']}"
    mem = "-" if r["peak_memory_bytes"] is None else f"{r['peak_memory_bytes'] / 2 ** 30:.1f} GiB"
    extra = ""
    if r["mode"] == "hfpatch":
        extra = (f", exchange share {_pct(r.get('exchange_share'))} (no exchange {_sub_ms(r, 'no_exchange')} ms), "
                 f"mixers' CP share {_pct(r.get('mixer_cp_share'))} (local {_sub_ms(r, 'mixers_local')} ms)")
    return (f"{head}: step {r['step_ms']:.1f} ms (spread {100 * r['spread']:.1f}%), {r['tokens_per_s_per_gpu']:.0f} "
            f"tokens/s/GPU, peak {mem}{extra}, {r['attention']}, mixers [{_kernels_text(r['mixer_kernels'])}], "
            f"loss {r['loss_first']:.4f}->{r['loss_last']:.4f}")


# ------------------------------------------------------------------------------------------------ CLI


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--family", choices=tuple(FAMILIES), default="qwen3_5")
    p.add_argument("--size", choices=SIZES, default="1b", help="the family's preset (1b, or tiny for CPU tests)")
    p.add_argument("--modes", type=ts.names_argument(MODES), default=list(MODES), help="comma-separated: hfpatch,single")
    p.add_argument("--seq-per-gpu", type=ts.tokens_argument, default=[32768], help="tokens per GPU, e.g. 16k,32k")
    for flag in ("--layers", "--hidden", "--intermediate", "--vocab"):
        p.add_argument(flag, type=int, default=None, help="override the preset")
    p.add_argument("--dtype", choices=("bf16", "fp32", "fp16"), default="bf16")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--steps", type=int, default=None,
                   help="timed steps per measurement (default: 2+5 up to 64k tokens per step, 1+3 up to 256k, "
                        "1+2 above)")
    p.add_argument("--kernel", default="auto", help="hfpatch.apply's kernel= (auto, zigzag, ring, llama3[:backend])")
    p.add_argument("--sdpa-backend", choices=("cudnn", "flash", "efficient"), default="cudnn",
                   help="SDPA backend of the single mode")
    p.add_argument("--checkpointing", choices=("full", "none"), default="full")
    p.add_argument("--optimizer", choices=("adamw", "sgd", "none"), default="adamw")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--loss-chunk", type=int, default=4096)
    p.add_argument("--max-minutes", type=float, default=None, help="start no size after this many minutes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="directory for <tag>.json and <tag>.md")
    p.add_argument("--tag", default=None, help="file stem (default hybrid_step_<family>_<N>x<GPU>_<date>)")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    for tokens in args.seq_per_gpu:
        if tokens % 16:
            p.error(f"--seq-per-gpu {tokens}: must be a multiple of 16 (the zigzag split of 1 to 8 GPUs)")
    try:
        args.vocab_size = config_fields(args)["vocab_size"]
    except ValueError as exc:
        p.error(str(exc))
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    created = ts.join_process_group(args.device)
    try:
        device = (torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda"
                  else torch.device("cpu"))
        world = dist.get_world_size()
        meta = {"family": args.family, "world_size": world, "step": _step_text(args), "native_cp": NATIVE_CP_NOTE,
                "fast_packages": fast_packages(), "argv": args.argv}
        write = _writer(args, device, world, meta)
        rank0 = dist.get_rank() == 0
        rows: List[dict] = []

        def emit(row: dict) -> None:
            rows.append(row)
            write(rows, False)
            if rank0:
                print(_row_line(row), flush=True)

        run_rows(args, device, emit, meta)
        write(rows, True)
        if rank0:
            print(f"model: {_model_text(meta)}", flush=True)
            print(_bytes_text(rows), flush=True)
            print(f"fast mixer packages: {json.dumps(meta['fast_packages'])}; {NATIVE_CP_NOTE}", flush=True)
            if args.out:
                print(f"wrote {os.path.join(args.out, write.stem)}.json and .md", flush=True)
        return 0
    finally:
        if created:
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
