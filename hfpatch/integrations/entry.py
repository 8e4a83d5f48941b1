"""``enable(trainer)``: which integration a trainer gets, and the checks every one of them runs first.

- transformers' ``Trainer`` and TRL's ``SFTTrainer`` (or a subclass): ``hfpatch.integrations.trainer.TrainerCP``,
  which splits each batch and averages the token loss over the CP group;
- TRL's ``DPOTrainer`` and ``KTOTrainer``: ``hfpatch.integrations.preference.PreferenceCP``, which scores whole
  batches exactly;
- TRL's ``RewardTrainer``: ``hfpatch.integrations.reward.RewardCP``, which pools each row's reward exactly on every
  rank and keeps TRL's loss and metrics;
- TRL's ``GRPOTrainer`` and ``RLOOTrainer``: ``hfpatch.integrations.policy_gradient.PolicyGradientCP``, which
  scores whole batches exactly and lets the CP ranks of a group act as one process in TRL's step;
- the TRL trainers it does not make exact (GKD, online DPO, CPO, ORPO, ...): refused by name under CP
  (``hfpatch.integrations.preference``).
"""
from __future__ import annotations

import logging
from typing import Any

import hfpatch
from hfpatch.integrations.policy_gradient import PolicyGradientCP, is_policy_gradient_trainer
from hfpatch.integrations.preference import PreferenceCP, is_preference_trainer, refuse_unsupported_trl_trainer
from hfpatch.integrations.requirements import check_releases
from hfpatch.integrations.reward import RewardCP, is_reward_trainer
from hfpatch.integrations.trainer import (TrainerCP, cp_mesh, is_trl_trainer, refuse_unsupported_losses,
                                          require_checkpointing, summary_line)
from hfpatch.undo import AllOrNothing

__all__ = ["enable"]

logger = logging.getLogger("hfpatch")


def _model_prepared(trainer) -> bool:
    """Whether the accelerator has prepared the trainer's own model (``train()`` ran); a reference model a
    DPOTrainer prepared while it was built does not count."""
    accelerator = trainer.accelerator
    return any(prepared is trainer.model or accelerator.unwrap_model(prepared) is trainer.model
               for prepared in getattr(accelerator, "_models", None) or ())


def enable(trainer, *, kernel: str = "auto", on_unsupported: str = "raise", verify: Any = True,
           keep_attention: Any = None) -> TrainerCP:
    """Give ``trainer`` (transformers' ``Trainer``, TRL's ``SFTTrainer``, ``DPOTrainer``, ``KTOTrainer``,
    ``RewardTrainer``, ``GRPOTrainer`` or ``RLOOTrainer``, built, not yet trained) context parallelism over the
    "cp" dimension of its ``ParallelismConfig``; returns the handle (``TrainerCP``, or its ``PreferenceCP`` for a
    DPOTrainer or KTOTrainer, ``RewardCP`` for a RewardTrainer, ``PolicyGradientCP`` for a GRPOTrainer or
    RLOOTrainer).

    Call it on every rank after building the trainer and before ``trainer.train()``. ``kernel``,
    ``on_unsupported`` and ``verify`` are ``hfpatch.apply``'s. Without a ``ParallelismConfig`` or with
    ``cp_size=1`` it applies nothing and the trainer trains as it would without hfpatch.

    ``keep_attention``: None (default), or ``hfpatch.keep_attention``'s budget (GiB, ``"auto"``, ``"all"``): the
    checkpointing the trainer sets up (``gradient_checkpointing=True``, or FSDP's ``activation_checkpointing``)
    keeps each layer's attention output, so the recomputation skips the ring forward (``TrainerCP.kept``). It
    needs one of those two on (``UnsupportedArgument`` otherwise) and CP active (ignored without CP).

    Raises ``UnsupportedRelease`` for transformers / accelerate / TRL older than
    ``hfpatch.integrations.requirements``; ``UnsupportedArgument`` for what it cannot combine with CP (tensor or
    sequence parallelism, label smoothing, ``compute_loss_func``, a MoE auxiliary loss, a TRL trainer it does not
    make exact, a pooled head without a pad token); ``RuntimeError`` when the trainer's model was already prepared
    (``train()`` ran).
    """
    check_releases(trl=is_trl_trainer(trainer))
    if _model_prepared(trainer):
        raise RuntimeError("hfpatch.integrations.enable(trainer) must run before trainer.train(): the accelerator "
                           "has already prepared the model. Fix: call it right after building the trainer.")
    mesh, cp_size = cp_mesh(trainer)
    refuse_unsupported_trl_trainer(trainer, cp_size)
    if cp_size > 1:
        refuse_unsupported_losses(trainer)
    if keep_attention is not None and cp_size > 1:
        require_checkpointing(trainer, keep_attention)
    model = trainer.model
    patch = hfpatch.apply(mesh, model=model, kernel=kernel, on_unsupported=on_unsupported, verify=verify)
    kind = (PreferenceCP if is_preference_trainer(trainer) else PolicyGradientCP if is_policy_gradient_trainer(trainer)
            else RewardCP if is_reward_trainer(trainer) else TrainerCP)
    handle = kind(trainer, patch, cp_size)
    with AllOrNothing(f"the CP of {type(trainer).__name__}", handle) as undo:  # a failure removes the patch too
        handle._install()
        if keep_attention is not None and handle.active:
            handle.kept = hfpatch.keep_attention(model, budget=keep_attention)
        undo.pop_all()  # enabled: the handle removes it all from now on
    trainer.hfpatch_cp = handle
    logger.info("%s", summary_line(handle, keep_attention))
    return handle
