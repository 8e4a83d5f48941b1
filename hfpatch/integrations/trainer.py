"""``enable(trainer)``: context parallelism through hfpatch for transformers' ``Trainer`` and TRL's ``SFTTrainer``.

What the stack keeps: accelerate's ``ParallelismConfig(dp_shard_size=D, cp_size=C)`` builds the mesh and gives every
rank of a CP group the same batch; accelerate shards the model over dp x cp (FSDP2 on GPUs; DDP over every rank on
CPU) and averages the gradients there. What ``enable`` replaces, on this trainer instance only (``remove()`` undoes
it):

- ``Trainer._prepare_context_parallel_inputs`` (SDPA only, PyTorch's ``context_parallel`` buffers) ->
  ``hfpatch.integrations.batch.prepare_batch``: this rank's ``input_ids``, global ``position_ids`` and
  ``shift_labels`` in the ring's layout, packed documents from the position ids (TRL's padding-free batches);
- accelerate's ``_prepare_cp`` (PyTorch CP hooks that drop the attention mask and refuse every non-full-attention
  layer) -> nothing: attention is hfpatch's ring, installed by ``hfpatch.apply(mesh["cp"], model=model)``;
- ``trainer.compute_loss`` runs inside ``hfpatch.model.labels.averaged_over_group()``: each rank's loss is its share of
  the token-weighted loss of the global batch, scaled so that the trainer's own reductions (the mean of the logged
  loss over every rank, gradients averaged over dp x cp) give exactly the non-CP loss and gradient, with
  ``num_items_in_batch`` and gradient accumulation as the trainer handles them without CP;
- SFTTrainer's ``num_tokens`` metric: counted on the whole batch as without CP (the attention mask it reads is
  dropped under CP, and each rank holds a shard of the position ids it reads otherwise);
- ``trainer.prediction_step`` (transformers' or TRL's own; a subclass's own is left alone) ->
  ``hfpatch.integrations.evaluation.prediction_step``: ``evaluate()`` and evaluation during training log the
  non-CP eval loss, ``predict()`` returns the whole-sequence logits gathered over the CP group, and
  ``prediction_loss_only`` gathers no logits.

Without CP (no ``ParallelismConfig``, or ``cp_size=1``) ``enable`` changes nothing: the same script trains without
CP. With ``on_unsupported="fallback"`` and a model or release hfpatch refuses, every rank of a CP group computes
the whole batch with the model's own attention, and the loss is rescaled so that the result is still the non-CP
one (the CP ranks then only repeat work).
"""
from __future__ import annotations

import sys
from typing import Any

import torch

from hfpatch.errors import MissingEnable, UnsupportedArgument
from hfpatch.integrations import evaluation
from hfpatch.integrations.batch import padding_token, prepare_batch
from hfpatch.model import router_loss
from hfpatch.model.labels import averaged_over_group

__all__ = ["TrainerCP", "guard_missing_enable", "summary_line", "cp_mesh", "is_trl_trainer"]

_REPLACED = ("_prepare_context_parallel_inputs", "compute_loss", "prediction_step")


def is_trl_trainer(trainer) -> bool:
    """Whether ``trainer``'s class is one of TRL's (or derives from one)."""
    return any(cls.__module__.split(".")[0] == "trl" for cls in type(trainer).__mro__)


def _is_sft_trainer(trainer) -> bool:
    trl = sys.modules.get("trl")
    return trl is not None and isinstance(trainer, getattr(trl, "SFTTrainer", ()))


class TrainerCP:
    """What ``enable`` installed on one trainer. ``patch``: the ``hfpatch.Patch`` (inactive without CP);
    ``cp_size``: the CP size of the trainer's ``ParallelismConfig`` (1 without); ``active``: True when the ring
    runs (``patch.active``); ``fallback``: True when CP was asked for but hfpatch fell back (``patch.reason``);
    ``kept``: the ``hfpatch.KeptAttention`` of ``enable(keep_attention=...)`` (None without);
    ``eval_step``: "cp" when evaluation and prediction run through ``hfpatch.integrations.evaluation``, or
    "trainer's own" (no CP, or a trainer class with its own ``prediction_step``, left as it is);
    ``gathered_logits``: how many batches of logits were gathered over the CP group (``predict()``);
    ``pad_token``: the token ``batch.prepare_batch`` pads rows with (``batch.padding_token``)."""

    def __init__(self, trainer, patch, cp_size: int) -> None:
        self.trainer = trainer
        self.patch = patch
        self.cp_size = cp_size
        self.active = bool(patch.active)
        self.fallback = cp_size > 1 and not patch.active
        self.kept = None                 # the hfpatch.KeptAttention of enable(keep_attention=...), or None
        self.sft = _is_sft_trainer(trainer)
        self.eval_step = "trainer's own"
        self.gathered_logits = 0
        self.pad_token = 0
        self._installed: dict = {}
        self._batch_tokens = None  # the tokens SFTTrainer counts in the whole batch (_tokens_sft_counts)
        self._removed = False

    def __repr__(self) -> str:
        state = "ring" if self.active else ("fallback: " + str(self.patch.reason) if self.fallback else "no CP")
        return f"<hfpatch.integrations.TrainerCP {type(self.trainer).__name__} cp={self.cp_size} {state}>"

    # ------------------------------------------------------------------------------------------- install
    def _install(self) -> None:
        if self.cp_size == 1:
            return
        trainer = self.trainer
        if self.active:   # before anything is installed: it refuses a pooled head without a pad token
            self.pad_token = padding_token(trainer.model)
        known = _has_known_prediction_step(trainer)
        self._install_replacements(self._prepare_inputs, self._prediction_step if known else None)
        if known:
            self.eval_step = "cp"

    def _install_replacements(self, prepare_inputs, prediction_step, more: dict | None = None) -> None:
        """Replace the trainer's ``_prepare_context_parallel_inputs`` with ``prepare_inputs``, its ``compute_loss``
        with ``self._compute_loss``, its ``prediction_step`` with ``prediction_step`` (None: kept) and the
        accelerator's ``_prepare_cp`` with a no-op, keeping the trainer's own methods as ``original_*`` and a
        one-copy-per-CP-group gatherer for evaluation; ``more``: further ``{(owner, name): replacement}`` of a
        trainer kind (``remove()`` takes every replacement off)."""
        trainer = self.trainer
        self.original_compute_loss = trainer.compute_loss
        self._installed = {
            (trainer, "_prepare_context_parallel_inputs"): prepare_inputs,
            (trainer, "compute_loss"): self._compute_loss,
            (trainer.accelerator, "_prepare_cp"): self._without_torch_cp,
        }
        if prediction_step is not None:
            self.original_prediction_step = trainer.prediction_step
            self.gather_one_copy = evaluation.OneCopyPerCPGroup(trainer.accelerator)
            self._installed[(trainer, "prediction_step")] = prediction_step
        self._installed.update(more or {})
        for (owner, name), replacement in self._installed.items():
            setattr(owner, name, replacement)

    def remove(self) -> None:
        """Restore the trainer's and the accelerator's own methods and remove the hfpatch patch. Twice: error."""
        if self._removed:
            raise RuntimeError(f"{self!r} was already removed")
        self._removed = True
        if self.kept is not None:
            self.kept.remove()
        for (owner, name), replacement in self._installed.items():
            if owner.__dict__.get(name) is replacement:
                delattr(owner, name)
        self.patch.remove()

    # ------------------------------------------------------------------------------ the replaced steps
    def _without_torch_cp(self, *args):
        """accelerate's ``_prepare_cp`` attaches PyTorch CP hooks to the model; hfpatch's ring replaces them."""
        return args

    def _prepare_inputs(self, model, inputs):
        import contextlib

        if not self.active:
            return contextlib.nullcontext, inputs
        self._batch_tokens = _tokens_sft_counts(inputs) if self.sft else None
        return contextlib.nullcontext, prepare_batch(self.patch, inputs, pad_token=self.pad_token)

    def _prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        return evaluation.prediction_step(self, model, inputs, prediction_loss_only, ignore_keys)

    def _compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        if self.fallback:
            return self._fallback_loss(model, inputs, return_outputs, num_items_in_batch)
        if num_items_in_batch is None and _is_sft_trainer(self.trainer) and self.trainer.model.training:
            raise UnsupportedArgument(
                "num_items_in_batch", None,
                "SFTTrainer divides each rank's loss by the local token count when the trainer passes no "
                "num_items_in_batch; under CP that is a per-rank mean, not the loss of the global batch.",
                "keep average_tokens_across_devices and a model whose forward accepts loss kwargs (every causal LM "
                "of transformers 5 does).",
            )
        counted = getattr(self.trainer, "_total_train_tokens", None)
        with averaged_over_group():
            result = self.original_compute_loss(model, inputs, return_outputs=return_outputs,
                                                num_items_in_batch=num_items_in_batch)
        if self.sft and self.trainer.model.training and counted is not None and self._batch_tokens is not None:
            self._count_tokens_as_without_cp(counted)
        return result

    def _count_tokens_as_without_cp(self, counted: int) -> None:
        """SFTTrainer's ``num_tokens`` as without CP. It adds the attention mask's ones of the batch, or without a
        mask the length of the position ids, summed over every process; under CP the mask is dropped and each rank
        holds a shard of the position ids, so it would add the padded row's length once per CP group. Replaced by
        the count of the whole batch (``_tokens_sft_counts``), summed over the dp groups. ``counted``: the total
        before this micro-batch."""
        trainer = self.trainer
        count = torch.tensor(self._batch_tokens, device=trainer.accelerator.device)
        added = int(trainer.accelerator.gather_for_metrics(count).sum().item()) // self.cp_size  # each CP rank: one
        trainer._total_train_tokens = counted + added
        trainer._metrics["train"]["num_tokens"] = [trainer._total_train_tokens]

    def _fallback_loss(self, model, inputs, return_outputs, num_items_in_batch):
        """Every CP rank holds the whole batch. The trainer divided ``num_items_in_batch`` by the CP size (for ranks
        that share a batch) and, with ``average_tokens_across_devices``, multiplies the loss by the number of
        processes (which counts the CP ranks): undo both, so the mean over every rank is the non-CP loss."""
        cp = self.cp_size
        if num_items_in_batch is not None:
            num_items_in_batch = num_items_in_batch * cp
        result = self.original_compute_loss(model, inputs, return_outputs=return_outputs,
                                             num_items_in_batch=num_items_in_batch)
        if num_items_in_batch is None or not self.trainer.args.average_tokens_across_devices:
            return result
        if return_outputs:
            return result[0] / cp, result[1]
        return result / cp


def _tokens_sft_counts(inputs) -> int:
    """The tokens SFTTrainer adds to ``num_tokens`` for the whole batch without CP: the attention mask's ones, or
    without a mask the length of its (packed) row."""
    mask = inputs.get("attention_mask")
    return int(mask.sum()) if mask is not None else int(inputs["input_ids"].shape[1])


def _has_known_prediction_step(trainer) -> bool:
    """True when the trainer's class evaluates with transformers' or TRL's own ``prediction_step`` (the ones
    ``hfpatch.integrations.evaluation`` reproduces under CP); a subclass's own one is left as it is."""
    from transformers import Trainer

    known = [Trainer.prediction_step]
    trl = sys.modules.get("trl")
    if trl is not None and hasattr(trl, "SFTTrainer"):
        known.append(trl.SFTTrainer.prediction_step)
    return type(trainer).prediction_step in known


def guard_missing_enable() -> None:
    """Make a forgotten ``enable(trainer)`` a named error where it would otherwise fail inside torch.

    A trainer with ``cp_size > 1`` and no ``enable`` lets accelerate prepare PyTorch's own context parallelism
    (``Accelerator._prepare_cp``), which shards only SDPA attention: any other model (the flash path hfpatch
    switches a model to, eager attention) fails later with torch's "no sharding strategy" error. This wraps
    accelerate's class method once (idempotent) so that it raises ``MissingEnable`` first, naming the fix; an SDPA
    model goes on to PyTorch's CP as before, and a trainer ``enable`` prepared never reaches it (``enable``
    replaces the method on that accelerator instance). Called when ``hfpatch.integrations`` is imported; without
    accelerate installed it does nothing."""
    try:
        from accelerate import Accelerator
    except ImportError:
        return
    original = Accelerator.__dict__.get("_prepare_cp")
    if original is None or getattr(original, "hfpatch_guard", False):
        return

    def _prepare_cp(self, *args):
        for arg in args:
            config = getattr(arg, "config", None)
            implementation = getattr(config, "_attn_implementation", None)
            if isinstance(arg, torch.nn.Module) and implementation not in (None, "sdpa"):
                raise MissingEnable(
                    f"accelerate is about to run PyTorch's context parallelism (cp_size > 1) on a "
                    f"{type(arg).__name__} whose attention is {implementation!r}; PyTorch's CP shards only SDPA "
                    "attention and would fail inside torch ('no sharding strategy'). Fix: call "
                    "hfpatch.integrations.enable(trainer) after building the trainer and before trainer.train()")
        return original(self, *args)

    _prepare_cp.hfpatch_guard = True
    _prepare_cp.__wrapped__ = original
    Accelerator._prepare_cp = _prepare_cp


def require_checkpointing(trainer, keep_attention) -> None:
    """``keep_attention`` keeps outputs through activation checkpointing: the trainer must set it up."""
    plugin = getattr(getattr(trainer.accelerator, "state", None), "fsdp_plugin", None)
    if trainer.args.gradient_checkpointing or getattr(plugin, "activation_checkpointing", False):
        return
    raise UnsupportedArgument(
        "keep_attention", keep_attention,
        "kept attention outputs skip the ring forward in activation checkpointing's recomputation, and this "
        "trainer checkpoints nothing (gradient_checkpointing is off and FSDP's activation_checkpointing too).",
        "set gradient_checkpointing=True (with gradient_checkpointing_kwargs={'use_reentrant': False}) in the "
        "training arguments, or activation_checkpointing in the FSDP config; or drop keep_attention.")


def cp_mesh(trainer):
    """(the CP mesh or None, cp_size); refuses what the integration does not combine with CP."""
    pc = getattr(trainer.accelerator, "parallelism_config", None)
    if pc is None or not pc.cp_enabled:
        return None, 1
    for name in ("tp_size", "sp_size"):
        size = getattr(pc, name, None) or 1
        if size > 1:
            raise UnsupportedArgument(
                f"parallelism_config.{name}", size,
                "hfpatch.integrations combines context parallelism with data parallelism (dp_shard / "
                "dp_replicate) only.", f"set {name}=1.")
    return trainer.accelerator.torch_device_mesh["cp"], pc.cp_size


def refuse_unsupported_losses(trainer) -> None:
    if getattr(trainer, "label_smoother", None) is not None:
        raise UnsupportedArgument(
            "label_smoothing_factor", trainer.args.label_smoothing_factor,
            "the label smoother shifts this rank's shard of the labels itself under CP.", "set it to 0.")
    # TRL (transformers < 5.19) stores a string there, never called, to mark that its compute_loss scales the loss
    # for gradient accumulation itself: only a callable is a loss function that would see a shard.
    if callable(getattr(trainer, "compute_loss_func", None)):
        raise UnsupportedArgument(
            "compute_loss_func", trainer.compute_loss_func,
            "it receives this rank's logits and the unshifted labels of a shard.",
            "compute the loss in a compute_loss override from outputs.logits and inputs['shift_labels'] "
            "(hfpatch.inputs.token_loss_sum), or train without CP.")
    model = getattr(trainer, "model", None)
    balancing = getattr(trainer, "aux_loss_enabled", False) or (model is not None and router_loss.requested(model, {}))
    # Trainer and SFTTrainer: the model's output aux_loss is the group's (hfpatch.model.router_loss, padding weighed
    # out through the step's token weights), and their loss adds it as the gradient averaging expects.
    if balancing and is_trl_trainer(trainer) and not _is_sft_trainer(trainer):
        raise UnsupportedArgument(
            "router_aux_loss_coef", getattr(trainer, "router_aux_loss_coef", None),
            f"{type(trainer).__name__} adds the mixture-of-experts load-balancing loss to a loss it scales its own "
            "way, which hfpatch has not made exact under CP (it is exact through transformers' Trainer, TRL's "
            "SFTTrainer, and hfpatch.apply(model=) with patch.shard_inputs: hfpatch.model.router_loss).",
            "set router_aux_loss_coef=0.0 (and output_router_logits=False) under CP, or train this model without "
            "context parallelism.")


def summary_line(handle: TrainerCP, keep_attention: Any = None) -> str:
    """The one line ``enable`` logs: what runs under CP, what was made exact, what was refused or fell back."""
    name = type(handle.trainer).__name__
    if handle.cp_size == 1:
        return f"hfpatch.integrations: {name} without CP (no ParallelismConfig with cp_size > 1): trainer unchanged"
    world = handle.trainer.accelerator.num_processes
    if handle.fallback:
        return (f"hfpatch.integrations: {name} cp={handle.cp_size} of {world} processes FELL BACK to the model's own "
                f"attention on the whole batch ({handle.patch.reason}); losses rescaled to the non-CP ones")
    ctx = handle.patch.ctx
    mixers = handle.patch.mixers.modules if handle.patch.mixers is not None else []
    exact = ["attention", "loss (averaged over the CP group)"] + ([f"{len(mixers)} sequence mixers"] if mixers else [])
    exact.append("evaluate()/predict()" if handle.eval_step != "trainer's own" else "training only (the trainer's "
                 "own prediction_step is left as it is)")
    kept = f"; kept attention outputs (budget {keep_attention!r})" if handle.kept is not None else ""
    return (f"hfpatch.integrations: {name} ring attention, kernel {ctx.variant}:{ctx.backend}, cp={handle.cp_size} "
            f"of {world} processes; exact: {', '.join(exact)}{kept}; refused: "
            f"{handle.patch.labels_refusal or 'nothing'}")
