"""``enable(trainer)`` for TRL's RewardTrainer: reward-model training under context parallelism, exact.

A RewardTrainer batch (TRL's ``DataCollatorForPreference``): ``input_ids`` (2B, S), the B chosen rows then the B
rejected rows, right-padded with the pad token; ``attention_mask`` (2B, S); optionally ``margin`` (B,). The model,
a ``*ForSequenceClassification`` with one label, pools each row's last non-pad token, and hfpatch's pooled head
(``hfpatch.model.heads``) makes that reward the non-CP one on every rank. TRL's step is kept as it is: its loss
(``-logsigmoid(chosen - rejected - margin)``, plus ``center_rewards_coefficient`` x the mean squared reward) and
every metric it logs are computed on every rank from the exact rewards. What ``RewardCP`` replaces, on this trainer
instance only (``remove()`` undoes it):

- ``Trainer._prepare_context_parallel_inputs`` -> ``reward_batch``: the rows must be right-padded with the pad
  token (every token the mask leaves out is the pad token, so no real token sees one and the pooled token is the
  non-CP one; else ``UnsupportedArgument``); they are split as ``batch.prepare_batch`` splits them, its end padding
  being the pad token too, and the whole attention mask stays in the batch for TRL's token count;
- ``trainer.compute_loss`` -> TRL's, inside ``averaged_over_group()`` (the pooled head scales its gradient by the
  CP size: accelerate averages gradients over dp x cp, and the rank holding each pooled token gives the whole of
  it), on a model call without the attention mask (the ring attends causally; it honours no padding mask);
- accelerate's ``_prepare_cp`` -> nothing (attention is hfpatch's ring);
- ``trainer.prediction_step`` -> the trainer's own, with the evaluation loop's gather keeping one copy per CP group
  (``evaluation.OneCopyPerCPGroup``), so ``predict()`` returns each reward once and the eval loss is the non-CP one;
- ``accelerator.gather_for_metrics``, while TRL's ``compute_loss`` runs -> the same one-copy gather (then
  accelerate's cut of the last batch's remainder, as without CP): TRL's ``num_tokens``, ``accuracy`` and ``margin``
  gather one number per rank, and the CP ranks of a group hold the same batch.

``min_reward``, ``mean_reward`` and ``max_reward`` come from ``accelerator.gather`` of every rank's rewards: the CP
ranks of a group add identical copies of equal size, which leave a minimum, a maximum and a mean unchanged. With
``on_unsupported="fallback"`` every rank computes the whole batch with the model's own attention and mask, and the
same replacements keep the non-CP loss, gradient and metrics.
"""
from __future__ import annotations

import contextlib
import sys
from typing import Any, Mapping

import torch

from hfpatch.errors import UnsupportedArgument
from hfpatch.integrations import evaluation
from hfpatch.integrations.batch import padding_token, prepare_batch
from hfpatch.integrations.trainer import TrainerCP
from hfpatch.model.labels import averaged_over_group

__all__ = ["RewardCP", "is_reward_trainer", "reward_batch"]


def is_reward_trainer(trainer) -> bool:
    """Whether ``trainer`` is TRL's RewardTrainer (or a subclass)."""
    trl = sys.modules.get("trl")
    cls = getattr(trl, "RewardTrainer", None) if trl is not None else None
    return cls is not None and isinstance(trainer, cls)


def reward_batch(patch, inputs: Mapping[str, Any], pad_token: int) -> dict:
    """This rank's inputs for the reward model (module docstring): ``batch.prepare_batch``'s, plus the batch's
    whole ``attention_mask`` (2B, S) after it has been checked against ``pad_token``; ``patch``: an active
    ``hfpatch.Patch``."""
    rest = dict(inputs)
    mask = rest.pop("attention_mask", None)
    prepared = prepare_batch(patch, rest, pad_token=pad_token)   # checks input_ids
    if mask is not None:
        _check_padding(mask, inputs["input_ids"], pad_token)
        prepared["attention_mask"] = mask
    return prepared


def _check_padding(mask: torch.Tensor, input_ids: torch.Tensor, pad_token: int) -> None:
    """Every row: ones then zeros, and every token under a zero is ``pad_token``."""
    mask = mask.to(input_ids.device)
    if mask.shape != input_ids.shape:
        raise UnsupportedArgument(
            "attention_mask", mask, f"a mask of shape {tuple(mask.shape)} for input_ids {tuple(input_ids.shape)}: "
            "only a (batch, seq_len) padding mask can be checked and dropped under context parallelism.",
            "use TRL's DataCollatorForPreference (the RewardTrainer's default collator).")
    valid = mask != 0
    if not bool((valid[:, 1:] <= valid[:, :-1]).all()):
        raise UnsupportedArgument(
            "attention_mask", mask,
            "the mask has zeros before ones in a row (left padding or holes); ring attention runs causal attention "
            "without a padding mask, so the pooled token would attend to those padded ones.",
            "pad on the right (TRL's DataCollatorForPreference does), or train without CP.")
    if bool((input_ids[~valid] != pad_token).any()):
        raise UnsupportedArgument(
            "attention_mask", mask,
            f"the mask leaves out tokens that are not the pad token {pad_token}; the model pools each row's last "
            "token that is not the pad token, so without CP it would pool a masked-out token, which ring attention "
            "(no padding mask) cannot reproduce.",
            "pad with the tokenizer's pad token (TRL's DataCollatorForPreference does), the model's "
            "config.pad_token_id.")


class _WithoutMask:
    """The trainer's model, called without the batch's ``attention_mask`` (kept in the batch for TRL's token
    count; the padding it describes was checked by ``reward_batch``)."""

    def __init__(self, model) -> None:
        self.model = model

    def __call__(self, *args, **kwargs):
        kwargs.pop("attention_mask", None)
        return self.model(*args, **kwargs)


class RewardCP(TrainerCP):
    """``TrainerCP`` of a RewardTrainer (module docstring)."""

    def _install(self) -> None:
        if self.cp_size == 1:
            return
        trainer = self.trainer
        if self.active:   # before anything is installed: it refuses a pooled head without a pad token
            self.pad_token = padding_token(trainer.model)
        self._install_replacements(self._reward_batch, self._prediction_step)
        self.eval_step = "the trainer's own, on exact rewards"

    def _reward_batch(self, model, inputs):
        if not self.active:
            return contextlib.nullcontext, inputs
        return contextlib.nullcontext, reward_batch(self.patch, inputs, self.pad_token)

    def _compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        with evaluation.metrics_gathered_once(self.trainer.accelerator, self.gather_one_copy):
            if self.fallback:
                return self._fallback_loss(model, inputs, return_outputs, num_items_in_batch)
            with averaged_over_group():
                return self.original_compute_loss(_WithoutMask(model), inputs, return_outputs=return_outputs,
                                                  num_items_in_batch=num_items_in_batch)

    def _prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        self.trainer.gather_function = self.gather_one_copy   # the trainer resets it when its loop ends
        if self.active and not evaluation.prediction_step_prepares_cp():
            _, inputs = self._reward_batch(model, inputs)     # this release's prediction_step does not split it
        return self.original_prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
