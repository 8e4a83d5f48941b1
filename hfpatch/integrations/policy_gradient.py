"""``enable(trainer)`` for TRL's GRPOTrainer and RLOOTrainer: policy-gradient RL under context parallelism, exact.

A GRPO / RLOO step generates completions for a batch of prompts (each prompt ``num_generations`` times, the copies
spread over the data-parallel processes), gathers every process's rewards to normalise them per prompt group, slices
its own advantages back out by ``accelerator.process_index``, scores prompt + completion rows (left-padded prompts,
right-padded completions) with the policy, the reference and, where it reuses a generation, the old policy, and
gathers its metrics over every process. Without hfpatch, TRL refuses ``cp_size > 1`` for both (in the configs'
``__post_init__``): a CP rank holds the same batch as the other ranks of its group, so each of those gathers would
count the group's batch once per CP rank, and the transformers CP hooks cannot split a batch that is built inside
the step.

``PolicyGradientCP`` keeps TRL's step as it is and makes it exact:

- every scoring forward (``model(..., labels=..., fused_lm_head=True)``) takes the whole batch, runs it as one packed
  row split over the CP group and returns the whole batch's per-token log-probs and entropies on every rank
  (``hfpatch.integrations.fused_head``, as for DPO); the reference model joins the patch;
- inside the trainer's ``_prepare_inputs`` (generation, rewards, advantages) and ``compute_loss``, the trainer's
  ``accelerator`` is ``OneProcessPerCPGroup``: a view on which the CP ranks of a group are one process
  (``process_index`` and ``num_processes`` count CP groups; ``gather``, ``gather_for_metrics`` and the trainer
  module's ``gather`` / ``gather_object`` keep one copy per group), so rewards are normalised over the non-CP
  batch, advantages sliced as without CP, and every metric computed from the non-CP numbers;
- generation runs on whole sequences with the models' own attention (their routing onto the patched flash path
  suspended: padding masks and the KV cache as without hfpatch), and the group's first rank's completions are
  broadcast to the group, so every CP rank scores the same completions whatever the generator (sampling, vLLM, a
  ``rollout_func``);
- the loss's gradient is multiplied by the CP size (accelerate averages gradients over dp x cp ranks);
- every rank of a CP group is seeded as TRL seeds the data-parallel process the group stands for (seed + its
  index), so the group shuffles its generation batch alike;
- ``generation_batch_size`` is set to ``per_device_train_batch_size x dp x steps_per_generation``: TRL's config
  counts every CP rank as a data-parallel process, which would sample a larger generation batch than the same
  script without CP. ``steps_per_generation`` is kept.

TRL's configs refuse ``parallelism_config`` with ``cp_size > 1``: assign it after building the config
(``args.parallelism_config = ParallelismConfig(...)``), or configure CP through ``accelerate launch``; then
``enable(trainer)``. Refused by name: the MoE auxiliary loss (``refuse_unsupported_losses``). A trainer subclass's
own gathers outside ``_prepare_inputs`` and ``compute_loss`` see the accelerator itself (every CP rank a process).
"""
from __future__ import annotations

import contextlib
import sys
from typing import Iterator

import torch.distributed as dist

from hfpatch.errors import UnsupportedArgument
from hfpatch.integrations import evaluation
from hfpatch.integrations.preference import PreferenceCP, trl_classes
from hfpatch.model.labels import averaged_over_group
from hfpatch.modes import switch

__all__ = ["PolicyGradientCP", "OneProcessPerCPGroup", "is_policy_gradient_trainer", "POLICY_GRADIENT_TRAINERS"]

POLICY_GRADIENT_TRAINERS = ("GRPOTrainer", "RLOOTrainer")


def is_policy_gradient_trainer(trainer) -> bool:
    classes = trl_classes(*POLICY_GRADIENT_TRAINERS)
    return bool(classes) and isinstance(trainer, classes)


class OneProcessPerCPGroup:
    """The trainer's accelerator as TRL's RL step sees it under CP: the CP ranks of a group are one process.

    ``process_index``: the index of this rank's CP group (groups in the order of their first ranks);
    ``num_processes``: the number of CP groups (the data-parallel size); ``gather(tensor)``: accelerate's gather
    over every process, then one copy per group (``gather_one_copy``'s ranks); ``gather_for_metrics``: the same,
    with accelerate's cut of the last batch's remainder. Everything else is the accelerator's own."""

    def __init__(self, accelerator, gather_one_copy: evaluation.OneCopyPerCPGroup) -> None:
        mesh = accelerator.torch_device_mesh
        groups = mesh.mesh.movedim(mesh.mesh_dim_names.index("cp"), -1).reshape(-1, mesh["cp"].size())
        first_ranks = sorted(int(group[0]) for group in groups)
        mine = next(int(group[0]) for group in groups if dist.get_rank() in group.tolist())
        self._accelerator = accelerator
        self._one_copy = gather_one_copy
        self.process_index = first_ranks.index(mine)
        self.num_processes = len(first_ranks)

    def __getattr__(self, name):
        return getattr(self._accelerator, name)

    def gather(self, tensor):
        from accelerate.utils import recursively_apply

        return recursively_apply(self._one_copy.one_copy, self._accelerator.gather(tensor))

    def gather_for_metrics(self, input_data, use_gather_object: bool = False):
        if use_gather_object:
            return self.gather_object(input_data)
        return self._one_copy(input_data)

    def gather_object(self, value):
        """accelerate's ``gather_object`` (a list per process, concatenated in rank order), one copy per group."""
        values = [None] * dist.get_world_size()
        dist.all_gather_object(values, value)
        kept = [values[rank] for rank in self._one_copy.kept_ranks]
        return [item for part in kept for item in part] if isinstance(value, list) else kept


class PolicyGradientCP(PreferenceCP):
    """``TrainerCP`` of a GRPOTrainer or RLOOTrainer (module docstring)."""

    def _install(self) -> None:
        super()._install()
        if self.cp_size == 1:
            return
        self.view = OneProcessPerCPGroup(self.trainer.accelerator, self.gather_one_copy)
        self._trl_module = _trl_module(self.trainer)
        self._fit_generation_batch()
        self._seed_per_group()

    def _step_replacements(self) -> dict:
        trainer = self.trainer
        self.original_prepare_inputs, self.original_generate = trainer._prepare_inputs, trainer._generate
        return {(trainer, "_prepare_inputs"): self._prepare_generation_batch, (trainer, "_generate"): self._generate}

    def _fit_generation_batch(self) -> None:
        args = self.trainer.args
        dp = self.view.num_processes
        wanted = args.per_device_train_batch_size * dp * args.steps_per_generation
        if wanted % self.trainer.num_generations:
            raise UnsupportedArgument(
                "num_generations", self.trainer.num_generations,
                f"under CP the generation batch is per_device_train_batch_size x dp x steps_per_generation = "
                f"{args.per_device_train_batch_size} x {dp} x {args.steps_per_generation} = {wanted} prompts "
                "(the CP ranks of a group share one batch), which num_generations must divide.",
                "choose per_device_train_batch_size, steps_per_generation and num_generations so that it divides.")
        args.generation_batch_size = wanted

    def _seed_per_group(self) -> None:
        """TRL seeds every process apart (``set_seed(seed, device_specific=True)``: seed + process index, so that
        processes sample different completions); under CP the ranks of a group must draw the same numbers (its
        shuffle of the generation batch among them), the numbers of the data-parallel process they stand for:
        seed + the group's index."""
        from accelerate.utils import set_seed

        set_seed(self.trainer.args.seed + self.view.process_index)

    @contextlib.contextmanager
    def _one_process_per_group(self) -> Iterator[None]:
        """The trainer's accelerator, and its module's ``gather`` / ``gather_object``, as ``OneProcessPerCPGroup``
        while TRL's step runs; restored on exit."""
        trainer, module = self.trainer, self._trl_module
        replaced = {name: getattr(module, name) for name in ("gather", "gather_object") if hasattr(module, name)}
        accelerator = trainer.accelerator
        trainer.accelerator = self.view
        for name in replaced:
            setattr(module, name, getattr(self.view, name))
        try:
            yield
        finally:
            trainer.accelerator = accelerator
            for name, original in replaced.items():
                setattr(module, name, original)

    def _prepare_generation_batch(self, generation_batch):
        """TRL's ``_prepare_inputs``: generation, rewards, advantages and the old policy's and the reference's
        log-probs (scoring forwards: ``averaged_over_group``, as in ``compute_loss``)."""
        inside = self.trainer.accelerator is self.view   # evaluation: prediction_step -> _prepare_inputs
        with contextlib.nullcontext() if inside else self._one_process_per_group(), averaged_over_group():
            return self.original_prepare_inputs(generation_batch)

    def _generate(self, prompts: list):
        """The trainer's generation on whole sequences with the models' own attention (off the flash path the
        patch routes them to, so padding masks and the KV cache work as without hfpatch); the CP group's first
        rank's result for every rank of the group."""
        with contextlib.ExitStack() as own_attention:
            for attached in self.patch.models:
                if attached.routing is not None:
                    own_attention.enter_context(attached.routing.suspended())
            own_attention.enter_context(switch("local"))
            result = self.original_generate(prompts)
        group = self.trainer.accelerator.torch_device_mesh["cp"].get_group()
        shared = [result]
        dist.broadcast_object_list(shared, src=dist.get_global_rank(group, 0), group=group)
        return shared[0]

    def _prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        with self._one_process_per_group():
            return super()._prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)

    def _compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        if self.trainer.accelerator is self.view:
            return self._scaled_loss(model, inputs, return_outputs, num_items_in_batch)
        with self._one_process_per_group():
            return self._scaled_loss(model, inputs, return_outputs, num_items_in_batch)


def _trl_module(trainer):
    """The module of the TRL trainer class ``trainer`` is (or derives from): where its ``gather`` is looked up."""
    for cls in type(trainer).__mro__:
        if cls.__name__ in POLICY_GRADIENT_TRAINERS and cls.__module__.startswith("trl."):
            return sys.modules[cls.__module__]
    raise TypeError(f"{type(trainer).__name__} derives from none of TRL's {POLICY_GRADIENT_TRAINERS}")
