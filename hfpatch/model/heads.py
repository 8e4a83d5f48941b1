"""The outputs of a model's head under context parallelism: which heads are exact as they are, which hfpatch makes
exact, and which it refuses by name.

The token stack of a model is exact under CP (every rank's hidden states equal the non-CP ones on its tokens).
What the head does with them decides whether the OUTPUT is:

``per-token``    a causal LM's logits, a token classifier's scores, a QA model's start/end logits: one row per
                 token, so each rank's rows are the non-CP rows of its tokens. Exact as they are. (Losses over
                 them: ``hfpatch.model.labels``; a QA model's ``start_positions`` / ``end_positions`` loss scores
                 one global token per row against this rank's shard and is refused under CP.)
``last-token``   a sequence classifier, reward or value model (``*ForSequenceClassification``) that pools ONE token
                 per row -- transformers' rule: the rightmost token that is not ``pad_token_id`` (4.48 on) or the
                 token before the first ``pad_token_id`` (earlier releases), the row's last token when the config
                 has no pad token -- and scores it. Under CP that token lives on one rank, while every rank would
                 pool its own local last token. ``install_pooled_head`` makes the pooled output the non-CP one on
                 EVERY rank: each rank finds the row's pooled token among the GLOBAL positions of its shard (one
                 all-reduce of the candidate index), the rank that holds it contributes its scores, one all-reduce
                 (sum) gives them to all. The gradient flows into the holding rank's scores only (as with
                 ``inputs.reduce_loss``: the parameter gradients summed over the CP group are the non-CP ones;
                 inside ``labels.averaged_over_group()`` it is scaled by the group size, as that reduction needs).
                 With ``labels`` the loss is computed from the exact pooled scores (transformers' rule by
                 ``config.problem_type``: regression, single- or multi-label classification).
``refused``      any other pooled head (an encoder's first-token pooler, a mean over the sequence, a pooling rule
                 of a release hfpatch does not recognise): ``head_finding`` reports it, and ``apply(model=)``
                 refuses the model by name before installing anything.
"""
from __future__ import annotations

import inspect
import re
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from hfpatch.errors import UnsupportedArgument
from hfpatch.undo import UndoStack
from hfpatch.modes import current_mode
from ring_kernels.layout import rank_positions

__all__ = ["Head", "head_of", "head_finding_reason", "install_pooled_head", "pad_token_id", "pooled_logits",
           "probe_labels"]

RIGHTMOST_NON_PAD = "rightmost-non-pad"   # 4.48+: (positions * (ids != pad)).argmax(-1)
BEFORE_FIRST_PAD = "before-first-pad"     # earlier: (ids == pad).argmax(-1) - 1, modulo the length
_POOLED_SUFFIXES = ("ForSequenceClassification",)
_SPAN_LABELS = ("start_positions", "end_positions")
_SCORE_CALL = re.compile(r"logits\s*=\s*self\.(\w+)\(")


@dataclass(frozen=True)
class Head:
    """What a model's head outputs (module docstring). ``kind``: "per-token" | "last-token" | "refused";
    ``rule``: the last-token pooling rule (``RIGHTMOST_NON_PAD`` or ``BEFORE_FIRST_PAD``); ``score``: the
    attribute of the per-token scoring module whose output is pooled; ``reason``: why it is refused."""

    kind: str
    rule: Optional[str] = None
    score: Optional[str] = None
    reason: Optional[str] = None


def _forward_source(model: torch.nn.Module) -> str:
    """The source of the model's forward, followed through ``super().forward(...)`` delegations (transformers 5
    writes a model's head as a forward that only hands its arguments to ``GenericForSequenceClassification``'s)."""
    sources = []
    for cls in type(model).__mro__:
        if "forward" not in vars(cls):
            continue
        try:
            source = inspect.getsource(vars(cls)["forward"])
        except (OSError, TypeError):
            break
        sources.append(source)
        if "super().forward(" not in source:
            break
    return "\n".join(sources)


def head_of(model: torch.nn.Module) -> Head:
    """The ``Head`` of ``model``, read from its class name and its forward's source (nothing is run)."""
    name = type(model).__name__
    if not name.endswith(_POOLED_SUFFIXES):
        return Head("per-token")
    source = _forward_source(model)
    if "last_non_pad_token" in source:
        rule = RIGHTMOST_NON_PAD
    elif re.search(r"argmax\(-1\)\s*-\s*1", source):
        rule = BEFORE_FIRST_PAD
    else:
        return Head("refused", reason=(
            f"{name} pools its sequence into one output per row by a rule hfpatch does not reproduce across a "
            "sharded sequence (not the last non-pad token: a first-token pooler, a mean over the sequence, or a "
            "rule of another release), so under CP each rank would pool only its own shard."))
    match = _SCORE_CALL.search(source)
    score = match.group(1) if match else None
    if score is None or not isinstance(getattr(model, score, None), torch.nn.Module):
        return Head("refused", reason=(
            f"{name} pools its last non-pad token, but hfpatch cannot find the module that scores each token "
            f"before the pooling (looked for `logits = self.<module>(...)` in its forward)."))
    return Head("last-token", rule=rule, score=score)


def head_finding_reason(model: torch.nn.Module) -> Optional[str]:
    """Why ``model``'s head cannot be made exact under CP (``apply(model=)`` refuses it), or None."""
    head = head_of(model)
    return head.reason if head.kind == "refused" else None


def pad_token_id(model: torch.nn.Module) -> Optional[int]:
    """The pad token a last-token head pools around: the text config's ``pad_token_id``, else the config's."""
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    pad = getattr(text, "pad_token_id", None)
    return getattr(config, "pad_token_id", None) if pad is None else pad


def _global_index(step, ctx, device) -> torch.Tensor:
    """The global token index of each of this rank's tokens, in local order, for the current step."""
    return rank_positions(step.seq_len_global, ctx.rank, ctx.world_size, layout=step.layout,
                          cu_seqlens=step.cu_seqlens).to(device)


def pooled_index(rule: str, input_ids: Optional[torch.Tensor], pad: Optional[int], index: torch.Tensor,
                 seq_len: int, batch: int, group) -> torch.Tensor:
    """(B,) the global position transformers' ``rule`` pools in each row, from this rank's ``input_ids`` shard and
    the global ``index`` of its tokens (identical on every rank: one all-reduce)."""
    device = index.device
    if pad is None or input_ids is None:
        return torch.full((batch,), seq_len - 1, dtype=torch.long, device=device)
    ids = input_ids.to(device)
    if rule == RIGHTMOST_NON_PAD:
        candidate = (index[None, :] * (ids != pad)).amax(dim=1)
        dist.all_reduce(candidate, op=dist.ReduceOp.MAX, group=group)
        return candidate
    # BEFORE_FIRST_PAD: the token before the first pad (argmax of an all-False row is 0: the row's last token)
    first = torch.where(ids == pad, index[None, :], torch.full_like(ids, seq_len, dtype=torch.long)).amin(dim=1)
    dist.all_reduce(first, op=dist.ReduceOp.MIN, group=group)
    first = torch.where(first == seq_len, torch.zeros_like(first), first)
    return (first - 1) % seq_len


def pooled_logits(scores: torch.Tensor, index: torch.Tensor, pooled_at: torch.Tensor, group, *,
                  gradient_scale: int = 1) -> torch.Tensor:
    """(B, L) the scores of each row's pooled token, on every rank: ``scores`` (B, S_local, L) of this rank's
    tokens, ``index`` (S_local,) their global positions, ``pooled_at`` (B,) the pooled global position. The value
    is all-reduced; the gradient flows into this rank's ``scores`` only, times ``gradient_scale``."""
    holds = (index[None, :] == pooled_at[:, None]).to(scores.dtype)  # (B, S_local): 1 at the pooled token
    mine = torch.einsum("bs,bsl->bl", holds, scores)
    total = mine.detach().clone()
    dist.all_reduce(total, group=group)
    scaled = mine * gradient_scale
    return scaled + (total - scaled.detach())


def classification_loss(pooled: torch.Tensor, labels: torch.Tensor, config: Any) -> torch.Tensor:
    """transformers' sequence-classification loss of ``pooled`` (B, L) against ``labels``, chosen by
    ``config.problem_type`` (set from ``num_labels`` and the labels' dtype when unset, as transformers does)."""
    labels = labels.to(pooled.device)
    num_labels = pooled.shape[-1]
    problem = getattr(config, "problem_type", None)
    if problem is None:
        if num_labels == 1:
            problem = "regression"
        elif labels.dtype in (torch.long, torch.int):
            problem = "single_label_classification"
        else:
            problem = "multi_label_classification"
        config.problem_type = problem
    if problem == "regression":
        mse = torch.nn.functional.mse_loss
        return mse(pooled.squeeze(), labels.squeeze()) if num_labels == 1 else mse(pooled, labels)
    if problem == "single_label_classification":
        return torch.nn.functional.cross_entropy(pooled.view(-1, num_labels), labels.view(-1))
    return torch.nn.functional.binary_cross_entropy_with_logits(pooled, labels.to(pooled.dtype))


def probe_labels(model: torch.nn.Module, batch: int, generator: torch.Generator) -> Optional[torch.Tensor]:
    """Labels the whole-model probe passes to a last-token head so that its loss is compared too; None for
    other heads."""
    if head_of(model).kind != "last-token":
        return None
    num_labels = int(getattr(model.config, "num_labels", 2))
    problem = getattr(model.config, "problem_type", None)
    if problem == "regression" or (problem is None and num_labels == 1):
        return torch.randn(batch, generator=generator) if num_labels == 1 else torch.randn(batch, num_labels,
                                                                                           generator=generator)
    if problem == "multi_label_classification":
        return torch.randint(0, 2, (batch, num_labels), generator=generator).float()
    return torch.randint(0, num_labels, (batch,), generator=generator)


class _Forward(threading.local):
    """Per thread: the current forward's input ids, labels and the scores its scoring module returned (a forward
    that raised leaves its entry behind; the next forward replaces it)."""

    def __init__(self) -> None:
        self.entry: Optional[dict] = None


def install_pooled_head(model: torch.nn.Module, ctx_of: Callable[[], Any],
                        averaged: Callable[[], bool] = lambda: False) -> Optional[UndoStack]:
    """For a last-token head (``head_of``), hook ``model`` so that its pooled output (and its loss, with
    ``labels``) is the non-CP one on every rank while the patch is active (module docstring); a QA model's
    ``start_positions`` / ``end_positions`` are refused under CP. None for a head that needs neither.
    ``ctx_of()``: the ``RingContext`` (None when inactive or removed); ``averaged()``: whether the call runs inside
    ``labels.averaged_over_group()``."""
    head = head_of(model)
    takes_spans = any(name in _forward_parameters(model) for name in _SPAN_LABELS)
    if head.kind != "last-token" and not takes_spans:
        return None
    forward = _Forward()

    def live():
        ctx = ctx_of()
        return ctx if ctx is not None and ctx.world_size > 1 and current_mode() != "local" else None

    def before(module, args, kwargs):
        ctx = live()
        if takes_spans and ctx is not None:
            for name in _SPAN_LABELS:
                if kwargs.get(name) is not None:
                    raise UnsupportedArgument(
                        name, kwargs[name],
                        f"{type(module).__name__}'s span loss scores one global token per row against this rank's "
                        "shard of the start/end logits, which under context parallelism holds only some tokens.",
                        "call the model without start_positions/end_positions and compute the span loss from the "
                        "start/end logits gathered over the CP group (ring_kernels.unshard), or train it without CP.")
        if head.kind != "last-token":
            return None
        ids = kwargs.get("input_ids", args[0] if args else None)
        labels = kwargs.pop("labels", None) if ctx is not None else None
        forward.entry = {"ids": ids, "labels": labels, "scores": None, "ctx": ctx}
        return (args, kwargs) if labels is not None else None

    def scored(module, args, output):
        if forward.entry is not None and isinstance(output, torch.Tensor):
            forward.entry["scores"] = output

    def after(module, args, kwargs, output):
        entry, forward.entry = forward.entry, None
        if entry is None:
            return None
        ctx, scores = entry["ctx"], entry["scores"]
        if ctx is None:
            return None
        step = ctx.step
        if step is None or scores is None or scores.dim() != 3 or scores.shape[1] != step.seq_len_local:
            raise UnsupportedArgument(
                "input_ids", entry["ids"],
                f"{type(module).__name__} pools one token per row, and under context parallelism hfpatch pools the "
                "row's global last token from the step's layout; this forward "
                + ("has no step (no patch.shard_inputs or drop-in update call before it)." if step is None else
                   f"scored {None if scores is None else tuple(scores.shape)} tokens, not the step's "
                   f"{step.seq_len_local} per rank."),
                "shard the batch with patch.shard_inputs(input_ids) and pass the input_ids it returns.")
        index = _global_index(step, ctx, scores.device)
        at = pooled_index(head.rule, entry["ids"], pad_token_id(module), index, step.seq_len_global,
                          scores.shape[0], ctx.group)
        pooled = pooled_logits(scores, index, at, ctx.group, gradient_scale=ctx.world_size if averaged() else 1)
        loss = classification_loss(pooled, entry["labels"], module.config) if entry["labels"] is not None else None
        if isinstance(output, tuple):
            return ((loss,) if loss is not None else ()) + (pooled,) + tuple(output[1:])
        fields = {key: value for key, value in output.items() if key not in ("loss", "logits")}
        return type(output)(loss=loss, logits=pooled, **fields)

    parts = [model.register_forward_pre_hook(before, with_kwargs=True)]
    if head.kind == "last-token":
        parts += [getattr(model, head.score).register_forward_hook(scored),
                  model.register_forward_hook(after, with_kwargs=True)]
    return UndoStack(f"the pooled head of {type(model).__name__}", *parts)


def _forward_parameters(model: torch.nn.Module) -> dict:
    try:
        return dict(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return {}
