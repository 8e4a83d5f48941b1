"""Scoring under context parallelism: one CP forward -> whole-sequence results on every rank.

RL and preference steps read per-token log-probs of the sequence's own tokens (the policy's, the reference's under
``no_grad``), their sums per sequence, the entropy, and a value or reward model's value per token and at each
sequence's last token. ``score`` gives all of them for the whole batch, the same on every rank of the CP group and
equal to the model run without CP, forward and backward::

    patch = hfpatch.apply(cp_group, model=policy)
    out = hfpatch.scoring.score(policy, input_ids, attention_mask=mask, labels=labels, entropy=True)
    out.log_probs            # (B, S-1): log p(next token), 0 where not scored (labels -100, padding)
    out.sequence_log_probs   # (B,): their sum over each sequence
    values = hfpatch.scoring.score(critic.model, input_ids, attention_mask=mask, log_probs=False,
                                   values=lambda out: critic.score(out.last_hidden_state)[..., 0])
    values.last_values       # (B,): each sequence's value at its last real token (a reward model's reward)

The batch is every rank's whole batch, as the RL framework holds it: rows padded on either side, or one packed row
(``hfpatch.scoring.rows``). Without CP (no active patch, a group of one) the same call computes the same numbers,
from every sequence run as a right-padded row with the attention mask.

Gradients: every rank computes the same loss from these results; the parameter gradients summed over the CP group
are the non-CP ones (``hfpatch.scoring.gather``). A trainer that AVERAGES gradients over the dp x cp ranks needs
them multiplied by the CP size (``scale_gradient(loss, cp_size)``: the value is unchanged).

Memory: the logits are never gathered. Each rank holds its own tokens' logits (the forward's own, (P/C, V)) and one
fp32 copy of them while a quantity is computed; each gathered quantity is one fp32 number per token of the packed
row (P), plus its (B, S) copy in the batch's shape.

Inputs the user split (contiguous chunks of one packed row, global positions, as OpenRLHF and verl split them):
describe the step with ``patch.describe_split(...)`` before the forward, then ``gather_tokens(patch, local)`` gives
any per-token number of the whole row.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from hfpatch.api import Patch, active_patch
from hfpatch.errors import UnsupportedArgument
from hfpatch.inputs import IGNORE_INDEX, shift_labels
from hfpatch.model.heads import head_of
from hfpatch.model.wrappers import inner_model
from hfpatch.scoring import gather
from hfpatch.scoring.gather import scale_gradient
from hfpatch.scoring.quantities import token_entropy, token_log_probs
from hfpatch.scoring.rows import PackedRows, pack_for_ring, pack_rows

__all__ = ["score", "Scores", "gather_tokens", "scale_gradient", "pack_rows", "PackedRows"]


@dataclass(frozen=True)
class Scores:
    """Whole-sequence results of one forward, identical on every rank of the CP group (fp32).

    log_probs:           (B, S-1) at column t, log p(the sequence's next real token after token t); 0 where not
                         scored (label -100, padding, each sequence's last token). None with ``log_probs=False``.
    entropy:             (B, S-1) entropy of the next-token distribution at the same positions, or None.
    mask:                (B, S-1) bool: the scored positions.
    values:              (B, S) the ``values`` callable's per-token values (0 at padding), or None.
    sequence_log_probs:  (N,) sum of ``log_probs`` over each sequence (N = B rows, or the documents of a packed
                         row), or None.
    last_values:         (N,) each sequence's value at its last real token, or None.
    """

    log_probs: Optional[torch.Tensor]
    entropy: Optional[torch.Tensor]
    mask: torch.Tensor
    values: Optional[torch.Tensor]
    sequence_log_probs: Optional[torch.Tensor]
    last_values: Optional[torch.Tensor]


def gather_tokens(patch: Optional[Patch], local: torch.Tensor) -> torch.Tensor:
    """(B, S_local, ...) per-token numbers of this rank's shard of the current step -> (B, S, ...) of the whole
    step, in global token order, on every rank (``hfpatch.scoring.gather``). The identity without an active
    patch."""
    return gather.gather_tokens(patch.live_ctx_or_none() if patch is not None else None, local)


def _refuse_pooled(model: torch.nn.Module) -> None:
    target = inner_model(model)
    if head_of(target).kind == "last-token":
        raise UnsupportedArgument(
            "model", type(target).__name__,
            "its head pools one token per row, and scoring packs every sequence into one row.",
            "score its backbone and read the head's per-token values: score(model.model, ..., log_probs=False, "
            "values=lambda out: model.score(out.last_hidden_state)[..., 0]).last_values")


def score(model: torch.nn.Module, input_ids: torch.Tensor, *, attention_mask: Optional[torch.Tensor] = None,
          position_ids: Optional[torch.Tensor] = None, labels: Optional[torch.Tensor] = None,
          log_probs: bool = True, entropy: bool = False, temperature: float = 1.0,
          values: Optional[Callable[[Any], torch.Tensor]] = None, patch: Optional[Patch] = None,
          **model_kwargs) -> Scores:
    """Run ``model`` once on the whole batch under CP and return its ``Scores`` on every rank (module docstring).

    input_ids:       (B, S) rows padded on either side, with ``attention_mask`` (1 = real token), or (1, T) one
                     packed row with ``position_ids`` restarting at each document. Identical on every rank.
    labels:          (B, S) unshifted (HF convention, -100 = not scored), or None: every next real token.
    log_probs:       read ``logits`` from the output and score the labels (a causal LM); False for a backbone.
    entropy:         also the next-token entropy.
    temperature:     the logits are divided by it first (GRPO's sampling temperature).
    values:          output -> (1, P_local) per-token values (a critic or reward head on the hidden states).
    patch:           the ``hfpatch.Patch`` the model is on (default: the active one; none: no CP).
    model_kwargs:    passed to the model; per-token tensors cannot be split and are refused.

    Raises ``UnsupportedArgument`` for inputs it cannot score exactly (naming the fix).
    """
    patch = patch if patch is not None else active_patch()
    ctx = patch.live_ctx_or_none() if patch is not None else None
    _refuse_pooled(model)
    _refuse_per_token_kwargs(model_kwargs, input_ids)
    rows = pack_for_ring(ctx, input_ids, attention_mask=attention_mask, position_ids=position_ids, labels=labels)
    if ctx is not None:
        shard = patch.shard_inputs(rows.input_ids, labels=rows.labels, position_ids=rows.position_ids)
        local_ids, next_labels = shard["input_ids"], shard["labels"]
        out = model(input_ids=local_ids, position_ids=shard["position_ids"], use_cache=False, **model_kwargs)

        def to_packed(local):
            return gather.gather_tokens(ctx, local)
    else:
        padded = _padded(rows)
        local_ids, next_labels = padded["input_ids"], padded["next_labels"]
        out = model(input_ids=local_ids, attention_mask=padded["attention_mask"],
                    position_ids=padded["position_ids"], use_cache=False, **model_kwargs)

        def to_packed(local):
            return local.reshape(-1, *local.shape[2:]).index_select(0, padded["slots"].to(local.device))[None]
    scored = rows.unpack(shift_labels(rows.labels) != IGNORE_INDEX)[:, :-1]
    token_lp = ent = per_token_values = sums = last = None
    if log_probs or entropy:
        logits = _logits(out)
        if log_probs:
            packed_lp = to_packed(token_log_probs(logits, next_labels, temperature))
            token_lp = rows.unpack(packed_lp)[:, :-1]
            sums = rows.per_sequence(packed_lp)
        if entropy:
            ent = rows.unpack(to_packed(token_entropy(logits, next_labels, temperature)))[:, :-1]
    if values is not None:
        packed_values = to_packed(_values(values, out, local_ids).float())
        per_token_values = rows.unpack(packed_values)
        last = packed_values[0].index_select(0, rows.last_tokens().to(packed_values.device))
    return Scores(log_probs=token_lp, entropy=ent, mask=scored, values=per_token_values, sequence_log_probs=sums,
                  last_values=last)


def _padded(rows: PackedRows) -> dict:
    """Without CP: every sequence of the (unpadded) packed row as a right-padded row of its own, run with the
    attention mask (what every release computes alike); ``slots``: the padded batch's flat index of each token of
    the packed row, in order."""
    lengths = rows.lengths
    count, longest = lengths.numel(), int(lengths.max())
    slots = torch.cat([torch.arange(n) + i * longest for i, n in enumerate(lengths.tolist())])
    device = rows.input_ids.device
    ids = rows.input_ids.new_zeros(count * longest).index_copy(0, slots.to(device), rows.input_ids[0])
    labels = rows.labels.new_full((count * longest,), IGNORE_INDEX).index_copy(0, slots.to(device), rows.labels[0])
    mask = torch.zeros(count * longest, dtype=torch.long, device=device).index_fill(0, slots.to(device), 1)
    positions = torch.arange(longest, device=device).expand(count, longest)
    return {"input_ids": ids.view(count, longest), "attention_mask": mask.view(count, longest),
            "position_ids": positions, "next_labels": shift_labels(labels.view(count, longest)), "slots": slots}


def _logits(out) -> torch.Tensor:
    logits = getattr(out, "logits", None)
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
        raise UnsupportedArgument(
            "log_probs", True, f"the model's output ({type(out).__name__}) has no (batch, seq, vocab) logits to "
            "score.", "pass log_probs=False (and values=...) for a backbone or a value model.")
    return logits


def _values(values: Callable, out, local_ids: torch.Tensor) -> torch.Tensor:
    got = values(out)
    if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(local_ids.shape):
        shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
        raise UnsupportedArgument(
            "values", values, f"it returned {shape}; expected one value per token of this rank's inputs "
            f"{tuple(local_ids.shape)}.", "return the head's per-token values, e.g. head(out.last_hidden_state)"
            "[..., 0].")
    return got


def _refuse_per_token_kwargs(model_kwargs: dict, input_ids: torch.Tensor) -> None:
    for key, value in model_kwargs.items():
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and tuple(value.shape[:2]) == tuple(input_ids.shape):
            raise UnsupportedArgument(
                key, value, "a per-token input scoring does not split over the CP ranks (it splits input_ids, "
                "labels and position_ids).", "drop it, or score without CP.")
