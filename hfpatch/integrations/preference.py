"""``enable(trainer)`` for TRL's DPOTrainer and KTOTrainer: preference training under context parallelism, exact.

A DPO step (KTO's alike, on unpaired completions and, for its KL term, each batch's completions against the batch's
other prompts) scores whole sequences: the policy's and the reference's summed log-probs of each completion (the
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

from hfpatch.errors import UnsupportedArgument
from hfpatch.undo import UndoStack
from hfpatch.integrations import evaluation
from hfpatch.integrations.fused_head import install_whole_batch_scoring, model_scored_by
from hfpatch.integrations.trainer import TrainerCP
from hfpatch.model.labels import averaged_over_group
from hfpatch.scoring.gather import scale_gradient

__all__ = ["PreferenceCP", "is_preference_trainer", "refuse_unsupported_trl_trainer", "trl_classes"]

# The TRL trainers enable() makes exact under CP: TRL's own classes of these names (trl.<name>), or subclasses.
MADE_EXACT = ("SFTTrainer", "DPOTrainer", "KTOTrainer", "RewardTrainer", "GRPOTrainer", "RLOOTrainer")
# Why the others are refused (a TRL trainer named here or not: refused under CP, before anything is installed).
_REFUSED = {
    "DistillationTrainer": "its distillation loss reads the whole logits of teacher and student",
    "GKDTrainer": "its distillation loss reads the whole logits of teacher and student",
    "OnlineDPOTrainer": "it generates completions inside the step and scores them with its own forwards",
    "NashMDTrainer": "it generates completions inside the step and scores them with its own forwards",
    "XPOTrainer": "it generates completions inside the step and scores them with its own forwards",
    "PPOTrainer": "it generates completions inside the step and scores them with its own forwards",
    "BCOTrainer": "its batches pair prompts and completions inside the step",
    "CPOTrainer": "its loss reads the logits of the policy's own forward",
    "ORPOTrainer": "its loss reads the logits of the policy's own forward",
    "PRMTrainer": "its token-classification labels mark step separators the integration does not split yet",
}
_NOT_VERIFIED = "hfpatch has not verified its step under context parallelism"


def trl_classes(*names) -> tuple:
    """TRL's classes of these names that the imported TRL has (none when TRL is not imported)."""
    trl = sys.modules.get("trl")
    return tuple(getattr(trl, name) for name in names if trl is not None and hasattr(trl, name))


# the preference trainers PreferenceCP makes exact, and the dataset columns of their precomputed reference log-probs
# (TRL's names; the second column is absent where the trainer computes no second score)
PRECOMPUTED_COLUMNS = {"DPOTrainer": ("ref_chosen_logps", "ref_rejected_logps"),
                       "KTOTrainer": ("ref_logps", "ref_KL_logps")}


def is_preference_trainer(trainer) -> bool:
    """Whether ``trainer`` is TRL's DPOTrainer or KTOTrainer (or a subclass)."""
    classes = trl_classes(*PRECOMPUTED_COLUMNS)
    return bool(classes) and isinstance(trainer, classes)


def refuse_unsupported_trl_trainer(trainer, cp_size: int) -> None:
    """``UnsupportedArgument`` naming the trainer and the reason, under CP (``cp_size`` > 1), for a TRL trainer
    that is not one of ``MADE_EXACT`` (TRL's own class, ``trl.<name>``, or a subclass of it): every other TRL
    trainer, ``trl.experimental``'s included, whether ``_REFUSED`` names it or not."""
    if cp_size == 1:
        return
    trl_trainer = _most_derived_trl_trainer(type(trainer))
    if trl_trainer is None:
        return
    name = trl_trainer.__name__
    if name in MADE_EXACT and trl_classes(name) == (trl_trainer,):
        return
    raise UnsupportedArgument(
        "trainer", type(trainer).__name__,
        f"hfpatch.integrations.enable does not make TRL's {name} ({trl_trainer.__module__}) exact under context "
        f"parallelism: {_REFUSED.get(name, _NOT_VERIFIED)}.",
        "train it without CP (cp_size=1: the same script, enable changes nothing), or use one of TRL's "
        f"{', '.join(MADE_EXACT)} or transformers' Trainer, which enable makes exact.")


def _most_derived_trl_trainer(cls):
    """The first class of ``cls``'s MRO that TRL defines and names ``*Trainer`` (TRL's base classes after it)."""
    for klass in cls.__mro__:
        if klass.__module__.split(".")[0] == "trl" and klass.__name__.endswith("Trainer") \
                and klass.__name__ != "BaseTrainer":
            return klass
    return None


class PreferenceCP(TrainerCP):
    """``TrainerCP`` of a DPOTrainer or KTOTrainer (module docstring). ``verify``: ``hfpatch.apply``'s, for the
    reference model too."""

    def __init__(self, trainer, patch, cp_size: int, *, verify=True) -> None:
        super().__init__(trainer, patch, cp_size)
        self.verify = verify

    def _install(self) -> None:
        if self.cp_size == 1:
            return
        self._install_replacements(self._whole_batch, self._prediction_step, self._step_replacements())
        self.eval_step = "the trainer's own, on exact forwards"
        if self.active:
            self.scoring = self._install_scoring()
            if getattr(self.trainer, "precompute_ref_logps", False):
                self._rescore_precomputed_reference()

    def _step_replacements(self) -> dict:
        """The trainer methods a trainer kind replaces besides ``TrainerCP``'s (none for DPO and KTO)."""
        return {}

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

        trainer = self.trainer
        names = next(columns for name, columns in PRECOMPUTED_COLUMNS.items() if isinstance(trainer, trl_classes(name)))
        columns = [column for column in names if column in dataset.column_names]
        if names[0] not in columns:
            return dataset
        base = dataset.remove_columns(columns)
        model = trainer.ref_model if trainer.ref_model is not None else trainer.model
        scores: list = [[] for _ in columns]
        loader = DataLoader(base, batch_size=batch_size, collate_fn=trainer.data_collator, shuffle=False)
        for batch in loader:
            batch = {k: v.to(trainer.accelerator.device) if hasattr(v, "to") else v for k, v in batch.items()}
            with averaged_over_group():  # as in _compute_loss
                scored = trainer.compute_ref_log_probs(model, batch)
            for column, score in zip(scores, scored):
                column += score.float().cpu().tolist()
        for name, values in zip(columns, scores):
            base = base.add_column(name, values, feature=Value("float32"))
        return base

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
