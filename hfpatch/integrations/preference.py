"""``enable(trainer)`` for TRL's DPOTrainer: preference training under context parallelism, exact.

A DPO step scores whole sequences: the policy's and the reference's summed log-probs of each completion (the
reference under ``no_grad``: a ``ref_model``, the policy with its PEFT adapter disabled, or precomputed), then a
loss over those sums and metrics over per-token fields. ``PreferenceCP`` keeps TRL's step as it is and makes each
scoring forward exact (``hfpatch.integrations.fused_head``): every model call of the trainer takes the whole
batch, runs it as one packed row split over the CP group, and returns the whole batch's per-token fields on every
rank. So every rank computes the non-CP loss and metrics. What it replaces, on this trainer instance only:

- ``Trainer._prepare_context_parallel_inputs`` -> the batch as it is (the scoring hooks split it);
- accelerate's ``_prepare_cp`` -> nothing (attention is hfpatch's ring);
- ``trainer.compute_loss`` -> TRL's, whose loss's gradient is multiplied by the CP size (its value unchanged):
  accelerate averages gradients over the dp x cp ranks, and each rank's gradient is its share of the non-CP one;
- ``accelerator.gather_for_metrics``, while TRL's ``compute_loss`` runs, and the evaluation loop's gather -> one
  copy per CP group (``evaluation.metrics_gathered_once``, ``evaluation.OneCopyPerCPGroup``): TRL's metrics (token
  counts, accuracies, logits) and the eval losses gather one number per rank, and the CP ranks of a group hold the
  same batch.

The reference model (``trainer.ref_model``) joins the patch (``Patch.add_model``). Evaluation runs TRL's own
``prediction_step``, through the same exact forwards. With ``precompute_ref_log_probs=True`` TRL scores the
reference while the trainer is built, before ``enable``, gathering over every process: under CP each batch comes back
once per CP rank and its cached columns are misaligned, so ``enable`` scores the reference again, exactly
(``PreferenceCP._rescore_precomputed_reference``). The cache file TRL wrote next to the dataset keeps TRL's values:
delete it before a run without CP reads it.
"""
from __future__ import annotations

import contextlib
import sys

from hfpatch.errors import UndoStack, UnsupportedArgument
from hfpatch.integrations import evaluation
from hfpatch.integrations.fused_head import install_whole_batch_scoring, model_scored_by
from hfpatch.integrations.trainer import TrainerCP
from hfpatch.model.labels import averaged_over_group
from hfpatch.scoring.gather import scale_gradient

__all__ = ["PreferenceCP", "is_dpo_trainer", "refuse_unsupported_trl_trainer"]

# TRL trainers enable() does not make exact under CP, with the reason (checked before anything is installed).
_REFUSED = {
    "GRPOTrainer": "it generates completions and scores them with per-token importance ratios over left-padded "
                   "prompts; TRL itself refuses cp_size > 1 for it",
    "RLOOTrainer": "it generates completions and scores them over left-padded prompts; TRL itself refuses "
                   "cp_size > 1 for it",
    "KTOTrainer": "its KL term scores mismatched prompt/completion pairs built inside the step, which the "
                  "whole-batch scoring does not cover yet",
    "GKDTrainer": "its distillation loss reads the whole logits of teacher and student",
    "OnlineDPOTrainer": "it generates completions inside the step",
    "PPOTrainer": "it generates completions inside the step",
    "NashMDTrainer": "it generates completions inside the step",
    "XPOTrainer": "it generates completions inside the step",
    "BCOTrainer": "its batches pair prompts and completions inside the step",
    "CPOTrainer": "its loss reads the logits of the policy's own forward",
    "ORPOTrainer": "its loss reads the logits of the policy's own forward",
    "PRMTrainer": "its token-classification labels mark step separators the integration does not split yet",
}


def _trl_classes(*names):
    trl = sys.modules.get("trl")
    return tuple(getattr(trl, name) for name in names if trl is not None and hasattr(trl, name))


def is_dpo_trainer(trainer) -> bool:
    classes = _trl_classes("DPOTrainer")
    return bool(classes) and isinstance(trainer, classes)


def refuse_unsupported_trl_trainer(trainer, cp_size: int) -> None:
    """``UnsupportedArgument`` naming the trainer and the reason for a TRL trainer ``enable`` cannot make exact
    under CP (``cp_size`` > 1)."""
    if cp_size == 1:
        return
    for name, reason in _REFUSED.items():
        classes = _trl_classes(name)
        if classes and isinstance(trainer, classes):
            raise UnsupportedArgument(
                "trainer", type(trainer).__name__,
                f"hfpatch.integrations.enable does not make TRL's {name} exact under context parallelism: {reason}.",
                "train it without CP (cp_size=1: the same script, enable changes nothing), or use SFTTrainer / "
                "DPOTrainer / RewardTrainer / Trainer, which enable makes exact.")


class PreferenceCP(TrainerCP):
    """``TrainerCP`` of a DPOTrainer (module docstring). ``verify``: ``hfpatch.apply``'s, for the reference model
    too."""

    def __init__(self, trainer, patch, cp_size: int, *, verify=True) -> None:
        super().__init__(trainer, patch, cp_size)
        self.verify = verify

    def _install(self) -> None:
        if self.cp_size == 1:
            return
        trainer = self.trainer
        self._install_replacements(self._whole_batch, self._prediction_step)
        self.eval_step = "the trainer's own, on exact forwards"
        if self.active:
            self.scoring = self._install_scoring()
            if trainer.precompute_ref_logps:
                self._rescore_precomputed_reference()

    def _install_scoring(self) -> UndoStack:
        trainer, patch = self.trainer, self.patch
        undo = UndoStack(f"the whole-batch scoring of {type(trainer).__name__}")
        unwrap = trainer.accelerator.unwrap_model
        models = [model_scored_by(trainer.model, unwrap)]
        if trainer.ref_model is not None:
            reference = unwrap(trainer.ref_model)
            patch.add_model(reference, verify=bool(self.verify))
            models.append(model_scored_by(reference, unwrap))
        for model in models:
            if model is None:
                raise UnsupportedArgument(
                    "model", type(trainer.model).__name__,
                    "it carries no TRL fused LM head (add_fused_lm_head), which DPOTrainer adds when it is built.",
                    "build the trainer with TRL >= 1.16 and call enable(trainer) right after.")
            undo.push(install_whole_batch_scoring(patch, model), f"the scoring hooks of {type(model).__name__}")
        return undo

    def _rescore_precomputed_reference(self) -> None:
        """Replace the reference log-probs TRL precomputed while the trainer was built: it gathered them over every
        process, and the CP ranks of a group hold the same batches, so each batch came back once per CP rank and
        the dataset's columns are misaligned. Every dataset is scored again here, in order, through the exact
        scoring forwards (each CP group scores every example; nothing is gathered over data parallelism)."""
        trainer = self.trainer
        sizes = {"train_dataset": trainer.args.precompute_ref_batch_size or trainer.args.per_device_train_batch_size,
                 "eval_dataset": trainer.args.precompute_ref_batch_size or trainer.args.per_device_eval_batch_size}
        for attribute, batch_size in sizes.items():
            datasets = getattr(trainer, attribute, None)
            if datasets is None:
                continue
            if isinstance(datasets, dict):
                setattr(trainer, attribute, {name: self._rescored(data, batch_size) for name, data in datasets.items()})
            else:
                setattr(trainer, attribute, self._rescored(datasets, batch_size))

    def _rescored(self, dataset, batch_size: int):
        from datasets import Value
        from torch.utils.data import DataLoader

        columns = ("ref_chosen_logps", "ref_rejected_logps")
        if not all(column in dataset.column_names for column in columns):
            return dataset
        trainer = self.trainer
        base = dataset.remove_columns(list(columns))
        model = trainer.ref_model if trainer.ref_model is not None else trainer.model
        chosen, rejected = [], []
        loader = DataLoader(base, batch_size=batch_size, collate_fn=trainer.data_collator, shuffle=False)
        for batch in loader:
            batch = {k: v.to(trainer.accelerator.device) if hasattr(v, "to") else v for k, v in batch.items()}
            with averaged_over_group():  # as in _compute_loss
                c, r = trainer.compute_ref_log_probs(model, batch)
            chosen += c.float().cpu().tolist()
            rejected += r.float().cpu().tolist()
        rescored = base.add_column(columns[0], chosen, feature=Value("float32"))
        return rescored.add_column(columns[1], rejected, feature=Value("float32"))

    def remove(self) -> None:
        if not self._removed:
            scoring = getattr(self, "scoring", None)
            if scoring is not None:
                scoring.remove()
        super().remove()

    def _whole_batch(self, model, inputs):
        return contextlib.nullcontext, inputs

    def _prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        self.trainer.gather_function = self.gather_one_copy   # the trainer resets it when its loop ends
        return self.original_prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)

    def _compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        with evaluation.metrics_gathered_once(self.trainer.accelerator, self.gather_one_copy):
            return self._scaled_loss(model, inputs, return_outputs, num_items_in_batch)

    def _scaled_loss(self, model, inputs, return_outputs, num_items_in_batch):
        if not self.active:  # fallback: every rank computes the whole batch; the average over ranks is exact
            return self.original_compute_loss(model, inputs, return_outputs=return_outputs,
                                              num_items_in_batch=num_items_in_batch)
        # averaged_over_group: hfpatch's labels hook leaves a fused head that scores pre-shifted labels alone
        # (the scoring hooks replace its per-rank loss with the whole batch's)
        with averaged_over_group():
            result = self.original_compute_loss(model, inputs, return_outputs=return_outputs,
                                                num_items_in_batch=num_items_in_batch)
        if return_outputs:
            return scale_gradient(result[0], float(self.cp_size)), result[1]
        return scale_gradient(result, float(self.cp_size))
