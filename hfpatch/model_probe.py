"""The whole-model probe of ``apply(model=)``: the model's CP forward against its non-CP forward on the same
whole sequence, module by module, so that whatever mixes tokens in a way no rule of ``model_audit`` knows (a
future release's new mixer, a user's custom module, positions taken from the input's length) is refused before
the first step, naming the first module whose output diverges.

One probe: random token ids (the same on every rank), ``tokens_per_rank`` x world size of them, one row.

1. non-CP: every rank runs the model on the whole row with the switch in ``"local"`` mode (plain attention on
   the whole sequence: what the flash path computes without a CP group);
2. CP: every rank runs its shard (``inputs.shard_inputs``, the layout of a batch step) in ``"ring"`` mode;
3. every module whose output is sequence-shaped, ``(1, S, ...)`` in the non-CP run and ``(1, S_local, ...)`` in
   the CP run, is compared on this rank's tokens: the largest difference relative to the largest non-CP output
   of that module. One all-reduce (max) of those errors makes the verdict the same on every rank.

The first module in execution order (forward hooks fire when a module finishes, so inner modules come before
the ones that contain them) whose error exceeds the tolerance of the model's dtype is named in a
``ModelDivergence``. Runs under ``torch.no_grad()`` with every module in eval mode (no dropout, deterministic
routing), restoring each module's training flag afterwards; costs two forwards of the model on a few tokens.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from hfpatch import inputs as _inputs
from hfpatch.model_positions import position_kwargs
from hfpatch import switch as _switch
from hfpatch.errors import HfpatchError, ModelDivergence, VerificationError

__all__ = ["ProbeResult", "probe_model", "MODEL_PROBE_TOLERANCE", "PROBE_TOKENS_PER_RANK"]

# Largest error allowed, relative to the largest non-CP output of the module, per dtype of the model. CP differs
# from non-CP by the ring's rounding only (fp32: ~1e-6 relative through a few layers); a module that sees only its
# shard, or positions off by a shard, is off by 1e-2 .. 1 on the tokens near a shard boundary.
MODEL_PROBE_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-8, torch.bfloat16: 5e-2, torch.float16: 1e-2}
PROBE_TOKENS_PER_RANK = 8
_SEED = 20261124  # the same token ids on every rank, whatever the global seed


@dataclass(frozen=True)
class ProbeResult:
    """``worst``: the largest relative error over the compared modules (max over ranks); ``compared``: how many
    module outputs were compared; ``tokens``: the probe's whole sequence length; ``dtype``: the model's dtype;
    ``labels_refusal``: why ``model(labels=)`` cannot be made equal to the model's own non-CP loss (its loss is
    not the token-mean cross-entropy of its logits), or None; ``labels_alignment``: how the model's own loss pairs
    logits with labels -- "shifted" (HF's causal-LM one-token shift) or "aligned" (each position scored against its
    own label, no shift: the BART-family and Whisper causal LMs)."""

    worst: float
    compared: int
    tokens: int
    dtype: torch.dtype
    labels_refusal: Optional[str] = None
    labels_alignment: str = "shifted"


class _Recorder:
    """Forward hooks on every module: the first sequence-shaped tensor output of each call, in completion order."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.outputs: list[tuple[str, str, torch.Tensor]] = []
        self.seq_len: Optional[int] = None
        self._handles = [module.register_forward_hook(self._hook(name)) for name, module in model.named_modules()]

    def _hook(self, name: str):
        def hook(module, args, output):
            tensor = _first_tensor(output)
            if tensor is not None and tensor.dim() >= 2 and tensor.shape[0] == 1 and tensor.shape[1] == self.seq_len:
                tensor = torch.view_as_real(tensor) if tensor.is_complex() else tensor  # complex rotary tables
                self.outputs.append((name, type(module).__name__, tensor.detach().float()))
        return hook

    def run(self, model, seq_len: int, **kwargs) -> list[tuple[str, str, torch.Tensor]]:
        self.outputs, self.seq_len = [], seq_len
        model(**kwargs)
        return self.outputs

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def _first_tensor(output: Any) -> Optional[torch.Tensor]:
    """The tensor a module returned: the output itself, the first element of a tuple, the logits of a ModelOutput
    that has them, or its first field."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(getattr(output, "logits", None), torch.Tensor):
        return output.logits
    if isinstance(output, (tuple, list)) and output:
        return output[0] if isinstance(output[0], torch.Tensor) else None
    if hasattr(output, "to_tuple"):
        values = output.to_tuple()
        return values[0] if values and isinstance(values[0], torch.Tensor) else None
    return None


def _device_and_dtype(model: torch.nn.Module) -> tuple[torch.device, torch.dtype]:
    for p in model.parameters():
        if p.is_floating_point():
            return p.device, p.dtype
    return torch.device("cpu"), torch.float32


def _vocab_size(model: torch.nn.Module) -> int:
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    size = getattr(text, "vocab_size", None) or getattr(config, "vocab_size", None)
    if not isinstance(size, int) or size < 1:
        embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        size = getattr(embeddings, "num_embeddings", 2)
    return size


def _compare(whole: list, local: list, index: torch.Tensor) -> tuple[list[str], list[str], torch.Tensor]:
    """(paths, classes, relative errors) of the whole run's recorded outputs, each against this rank's CP output
    of the same module and call; inf where the CP run recorded nothing comparable."""
    by_call: dict = {}
    for name, cls, tensor in local:
        by_call.setdefault(name, []).append(tensor)
    seen: dict = {}
    paths, classes, errors = [], [], []
    for name, cls, tensor in whole:
        call = seen[name] = seen.get(name, -1) + 1
        calls = by_call.get(name, [])
        expected = tensor.index_select(1, index.to(tensor.device))
        got = calls[call] if call < len(calls) else None
        if got is None or got.shape != expected.shape:
            error = math.inf
        else:
            scale = expected.abs().max().item()
            error = (got - expected).abs().max().item() / max(scale, 1e-30)
            if math.isnan(error):
                error = math.inf
        paths.append(name)
        classes.append(cls)
        errors.append(error)
    return paths, classes, torch.tensor(errors, dtype=torch.float64)


def _training_flags(model: torch.nn.Module) -> list[tuple[torch.nn.Module, bool]]:
    return [(m, m.training) for m in model.modules()]


def probe_model(model: torch.nn.Module, ctx: Any, *, tokens_per_rank: int = PROBE_TOKENS_PER_RANK,
                tolerance: Optional[float] = None) -> ProbeResult:
    """Run the probe (module docstring) on ``model`` over ``ctx.group``; raise ``ModelDivergence`` naming the first
    diverging module, or return the ``ProbeResult``. ``tolerance``: relative error allowed (default:
    ``MODEL_PROBE_TOLERANCE`` of the model's dtype). Collective: every rank of the group must call it. The model's
    forward must already reach the installed wrapper (``apply(model=)`` switches it first). An exception inside
    either forward propagates (on every rank: the inputs and the model are the same on all of them)."""
    device, dtype = _device_and_dtype(model)
    tolerance = MODEL_PROBE_TOLERANCE.get(dtype, 5e-2) if tolerance is None else tolerance
    seq = tokens_per_rank * ctx.world_size
    generator = torch.Generator().manual_seed(_SEED)
    ids = torch.randint(0, _vocab_size(model), (1, seq), generator=generator).to(device)
    flags = _training_flags(model)
    recorder = _Recorder(model)
    previous_step = ctx.step
    try:
        model.eval()
        with torch.no_grad():
            with _switch.switch("local"), _named_failure(model, "non-CP"):
                whole = recorder.run(model, seq, input_ids=ids, use_cache=False,
                                     **position_kwargs(model, torch.arange(seq, device=device)[None]))
            recorder.seq_len = None  # record nothing during the labels forward
            labels_alignment, labels_refusal = _own_loss_check(model, ids, tolerance=tolerance)
            batch = _inputs.shard_inputs(ctx, ids)
            with _switch.switch("ring"), _named_failure(model, "CP"):
                local = recorder.run(model, batch["input_ids"].shape[1], input_ids=batch["input_ids"],
                                     use_cache=False, **position_kwargs(model, batch["position_ids"]))
        index = batch["position_ids"][0]  # the global token indices this rank holds, in its order
    finally:
        recorder.remove()
        ctx.set_step(previous_step)
        for module, training in flags:
            module.training = training
    paths, classes, errors = _compare(whole, local, index)
    if errors.numel():
        errors = _all_max(errors, ctx.group, device)
    bad = [i for i, e in enumerate(errors.tolist()) if not e <= tolerance]
    if bad:
        i = bad[0]
        raise ModelDivergence(_message(model, paths[i], classes[i], errors[i].item(), tolerance, dtype, ctx),
                              module_path=paths[i], module_class=classes[i], error=errors[i].item(),
                              tolerance=tolerance, dtype=dtype)
    return ProbeResult(worst=max(errors.tolist(), default=0.0), compared=len(paths), tokens=seq, dtype=dtype,
                       labels_refusal=labels_refusal, labels_alignment=labels_alignment)


def _own_loss_check(model, ids: torch.Tensor, *, tolerance: float) -> tuple[str, Optional[str]]:
    """(alignment, refusal) of the model's own non-CP ``model(ids, labels=ids).loss``: ("shifted", None) when it is
    the token-mean cross-entropy of its logits with HF's one-token shift, ("aligned", None) when it is that without
    a shift (each position against its own label) -- the two losses ``hfpatch.labels`` computes under CP --, else
    ("shifted", the reason it is neither: a model that shifts twice, adds a term, or fails with labels)."""
    try:
        with _switch.switch("local"):
            output = model(input_ids=ids, labels=ids, use_cache=False,
                           **position_kwargs(model, torch.arange(ids.shape[1], device=ids.device)[None]))
    except Exception as exc:  # the model's own labels path; CP's loss path is ours
        return "shifted", f"model(labels=...) fails even without CP ({type(exc).__name__}: {exc})"
    loss = getattr(output, "loss", None) if not isinstance(output, tuple) else output[0]
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        return "shifted", None  # no loss of its own to match: hfpatch's loss is the causal-LM loss
    logits = output.logits if hasattr(output, "logits") else output[1]
    expected = {}
    for alignment, targets in (("shifted", _inputs.shift_labels(ids)), ("aligned", ids)):
        loss_sum, count = _inputs.token_loss_sum(logits, targets)
        expected[alignment] = (loss_sum / count.clamp(min=1)).item()
        if abs(loss.item() - expected[alignment]) / max(abs(expected[alignment]), 1e-30) <= tolerance:
            return alignment, None
    return "shifted", (
        f"{type(model).__name__}'s own loss for labels= ({loss.item():.6g}) is neither the token-mean causal-LM "
        f"cross-entropy of its logits with a one-token shift ({expected['shifted']:.6g}) nor without one "
        f"({expected['aligned']:.6g}): it shifts differently or adds a term, which hfpatch cannot reproduce across "
        "a sharded sequence.")


@contextlib.contextmanager
def _named_failure(model: torch.nn.Module, which: str):
    """An exception of the model's own code during a probe forward becomes a ``VerificationError`` that says which
    forward failed (the cause chained); hfpatch's own errors (a refusal naming its argument) pass unchanged."""
    try:
        yield
    except HfpatchError:
        raise
    except Exception as exc:
        raise VerificationError(
            f"whole-model probe: {type(model).__name__}'s {which} forward raised {type(exc).__name__}: {exc}. "
            + ("Under CP the model's code fails where it runs fine on the whole sequence, so hfpatch cannot train "
               "it under context parallelism; nothing is left installed. Fix: train it without CP "
               "(apply(..., on_unsupported='fallback'))." if which == "CP" else
               "The model fails on the flash-attention path even without CP, so hfpatch cannot check it; nothing is "
               "left installed. Fix: make model(input_ids, position_ids=...) run with attn_implementation="
               "'flash_attention_2', or pass verify='fast' to skip this probe.")
        ) from exc


def _all_max(errors: torch.Tensor, group, device: torch.device) -> torch.Tensor:
    on_device = errors.to(device)
    dist.all_reduce(on_device, op=dist.ReduceOp.MAX, group=group)
    return on_device.cpu()


def _message(model, path: str, cls: str, error: float, tolerance: float, dtype, ctx) -> str:
    where = path or "<the model's output>"
    size = "no comparable output under CP" if error == math.inf else f"relative error {error:.3g} > {tolerance:g}"
    return (f"whole-model probe: {type(model).__name__}'s CP forward differs from its non-CP forward first at "
            f"{where} ({cls}): {size} ({dtype}, {ctx.world_size} ranks, kernel {ctx.variant}). This module (or one "
            "it reads from) mixes tokens along the sequence outside the patched attention or numbers positions by "
            "the input's length, so training under CP would be silently wrong; nothing is left installed. Fix: "
            "train this model without context parallelism (apply(..., on_unsupported='fallback')), or, if you "
            "know the difference is harmless, apply(..., verify='fast') skips this probe.")
