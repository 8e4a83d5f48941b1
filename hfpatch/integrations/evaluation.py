"""``Trainer.evaluate()``, evaluation during training and ``Trainer.predict()`` under context parallelism.

Without CP the trainer's evaluation loop calls ``prediction_step`` on each rank's batch and gathers every rank's
loss (repeated once per row), logits and labels over all processes (``trainer.gather_function``); the logged loss
is their mean. Under CP every rank of a CP group holds the same batch. ``prediction_step`` below (installed on the
trainer instance by ``enable``) keeps the non-CP results:

- loss: the batch is sharded as a training step shards it (``batch.prepare_batch``) and scored by the trainer's
  ``compute_loss`` inside ``averaged_over_group``, with the divisor the trainer's own non-CP prediction step
  uses: transformers' Trainer counts the unsharded batch (``_get_num_items_in_batch``); TRL's SFTTrainer passes
  none, so its fused head's mean over the batch is reproduced by passing ``count / cp_size`` (times the processes
  its loss is multiplied by). Each rank's loss is then its share; one all-reduce of one number over the CP group
  gives every rank of the group the non-CP loss of the batch.
- ``prediction_loss_only=True`` (``evaluate()`` without ``compute_metrics``): the loss alone, no logits gathered.
- otherwise the whole-sequence logits ``(B, S, V)``: the shards gathered over the CP group
  (``ring_kernels.layout.unshard`` in the step's layout), back in token order, the integration's end padding cut;
  and the batch's own labels. transformers' Trainer gets every output field as its own ``prediction_step`` returns
  them (all but the loss and ``ignore_keys``: a MoE model's ``aux_loss``, the group's value, and its per-layer
  ``router_logits`` gathered like the logits); a field that is neither per token nor a scalar is refused by name.
  SFTTrainer gets the ``logits`` field.
- the loop's ``gather_function`` is set for the running evaluation (the trainer resets it when the loop ends) to
  keep one copy per CP group (the processes of CP rank 0), so losses, logits and labels are gathered as often as
  without CP.

With ``on_unsupported="fallback"`` every rank computes the whole batch with the model's own attention; the loss is
divided by the CP size where the divisor above scaled it, and the same one-copy gather applies.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Any, Iterator, Optional

import torch

from hfpatch.errors import UnsupportedArgument
from hfpatch.inputs import IGNORE_INDEX
from hfpatch.integrations.batch import prepare_batch
from hfpatch.model.labels import averaged_over_group
from ring_kernels.layout import unshard

__all__ = ["prediction_step", "OneCopyPerCPGroup", "metrics_gathered_once", "prediction_step_prepares_cp"]


class OneCopyPerCPGroup:
    """A ``gather_function`` for the trainer's evaluation loop: ``accelerator.gather`` over every process, then the
    parts of the processes of CP rank 0 only (rank order), then accelerate's cut of the last batch's remainder.
    ``calls``: how many tensors (nested structures count once) it gathered."""

    def __init__(self, accelerator) -> None:
        mesh = accelerator.torch_device_mesh
        ranks = mesh.mesh.movedim(mesh.mesh_dim_names.index("cp"), -1)[..., 0]
        self.accelerator = accelerator
        self.kept_ranks = sorted(int(r) for r in ranks.flatten())
        self.world_size = accelerator.num_processes
        self.calls = 0

    def __call__(self, data):
        from accelerate.utils import recursively_apply

        self.calls += 1
        gathered = self.accelerator.gather(data)
        data = recursively_apply(self.one_copy, gathered)
        state = self.accelerator.gradient_state
        if state.end_of_dataloader and state.remainder > 0:
            data = recursively_apply(lambda t: t[: state.remainder], data)
        return data

    def one_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """Of a tensor gathered over every process (dim 0, rank order): the parts of CP rank 0's processes."""
        parts = tensor.chunk(self.world_size, dim=0)
        return torch.cat([parts[rank] for rank in self.kept_ranks], dim=0)


@functools.lru_cache(maxsize=None)
def prediction_step_prepares_cp() -> bool:
    """Whether the installed transformers' own ``Trainer.prediction_step`` calls
    ``_prepare_context_parallel_inputs`` on its batch (recent 5.x releases; 5.0 does not): read from its source, so
    that a trainer keeping that prediction step has its evaluation batches split once, wherever the release splits
    them."""
    from transformers import Trainer

    try:
        return "_prepare_context_parallel_inputs" in inspect.getsource(Trainer.prediction_step)
    except (OSError, TypeError):
        return False


@contextlib.contextmanager
def metrics_gathered_once(accelerator, gather_one_copy: OneCopyPerCPGroup) -> Iterator[None]:
    """Inside it, ``accelerator.gather_for_metrics`` keeps one copy per CP group (``gather_one_copy``, then
    accelerate's cut of the last batch's remainder, as without CP): TRL's trainers gather their metrics (token
    counts, accuracies, margins) with it, one number per rank, and the CP ranks of a group hold the same batch.
    Restored on exit (left as it is if someone else replaced it meanwhile)."""
    def gather_for_metrics(input_data, use_gather_object: bool = False):
        if use_gather_object:
            raise UnsupportedArgument(
                "use_gather_object", True, "under CP the trainer's metrics are gathered as tensors, one copy per CP "
                "group; objects are not.", "gather tensors (TRL's trainers do).")
        return gather_one_copy(input_data)

    accelerator.gather_for_metrics = gather_for_metrics
    try:
        yield
    finally:
        if accelerator.__dict__.get("gather_for_metrics") is gather_for_metrics:
            del accelerator.gather_for_metrics


def _labels_of(trainer, inputs) -> Any:
    """The labels the trainer's own prediction step returns (None when the batch has none)."""
    names = trainer.label_names
    if not names or any(inputs.get(name) is None for name in names):
        return None
    labels = tuple(inputs[name].detach() for name in names)
    return labels[0] if len(labels) == 1 else labels


def _counted_targets(inputs) -> torch.Tensor:
    """Targets with a label in the unsharded batch (each token's label is the next token's: the shifted count)."""
    shift = inputs.get("shift_labels")
    counted = shift if shift is not None else inputs["labels"][..., 1:]
    return (counted != IGNORE_INDEX).sum()


def _divisor(handle, inputs) -> Optional[Any]:
    """``num_items_in_batch`` that makes each CP rank's loss its share of the non-CP loss (module docstring)."""
    trainer = handle.trainer
    if not handle.sft:
        return trainer._get_num_items_in_batch([inputs], trainer.args.device)
    scale = trainer.accelerator.num_processes // trainer.get_tp_size() if trainer.args.average_tokens_across_devices \
        else 1
    return _counted_targets(inputs).to(torch.float64) * scale / handle.cp_size


def _whole_logits(handle, outputs, step, seq_len: int) -> torch.Tensor:
    logits = outputs.logits if hasattr(outputs, "logits") else outputs[1]
    if handle.fallback:
        return logits.detach()
    handle.gathered_logits += 1
    return _whole(handle, "logits", logits, step, seq_len)


def _whole(handle, name, value, step, seq_len: int):
    """One output field of this rank's tokens as the non-CP run returns it (the whole batch, the end padding cut):
    a scalar as it is (the group's value: the MoE ``aux_loss``), per-token tensors (B, S_local, ...) or rows of
    tokens (B x S_local, ...) (the MoE ``router_logits``) gathered over the CP group, tuples field by field."""
    if isinstance(value, (tuple, list)):
        return tuple(_whole(handle, name, item, step, seq_len) for item in value)
    if not isinstance(value, torch.Tensor):
        raise UnsupportedArgument(name, value, f"prediction under CP returns the model's output field {name!r}, "
                                  "which is not a tensor hfpatch can gather over the CP group.",
                                  f"add {name!r} to the trainer's ignore_keys (or the model config's "
                                  "keys_to_ignore_at_inference).")
    value = value.detach()
    if handle.fallback or value.dim() == 0:
        return value
    batch, local = step.batch_size, step.seq_len_local
    per_token = value.dim() >= 2 and value.shape[:2] == (batch, local)
    rows = not per_token and value.shape[0] == batch * local
    tokens = value.reshape(batch, local, *value.shape[1:]) if rows else value
    if tokens.dim() < 2 or tokens.shape[:2] != (batch, local):
        raise UnsupportedArgument(name, value, f"prediction under CP returns the model's output field {name!r} of "
                                  f"shape {tuple(value.shape)}, which is neither per token of this rank's "
                                  f"{batch} x {local} tokens nor a scalar.",
                                  f"add {name!r} to the trainer's ignore_keys (or the model config's "
                                  "keys_to_ignore_at_inference).")
    whole = unshard(tokens, handle.patch.ctx.group, layout=step.layout, dim=1,
                    cu_seqlens=step.cu_seqlens)[:, :seq_len]
    return whole.reshape(batch * seq_len, *value.shape[1:]) if rows else whole


def _whole_outputs(handle, model, outputs, step, seq_len: int, ignore_keys):
    """What transformers' ``prediction_step`` returns as logits: every output field but the loss and the ignored
    ones, whole (``_whole``); one field alone, not in a tuple."""
    if ignore_keys is None:
        config = getattr(model, "config", None)
        ignore_keys = getattr(config, "keys_to_ignore_at_inference", ["past_key_values"]) if config is not None \
            else []
    if isinstance(outputs, dict):
        fields = [(key, value) for key, value in outputs.items() if key not in list(ignore_keys) + ["loss"]]
    else:
        fields = [(f"output {index}", value) for index, value in enumerate(outputs[1:], start=1)]
    if not handle.fallback:
        handle.gathered_logits += 1
    whole = tuple(_whole(handle, name, value, step, seq_len) for name, value in fields)
    return whole[0] if len(whole) == 1 else whole


def prediction_step(handle, model, inputs, prediction_loss_only: bool, ignore_keys=None):
    """The trainer's ``prediction_step`` under CP (module docstring): ``(loss, logits, labels)``, each optional."""
    trainer = handle.trainer
    trainer.gather_function = handle.gather_one_copy
    inputs = trainer._prepare_inputs(inputs)
    labels = _labels_of(trainer, inputs)
    seq_len = inputs["input_ids"].shape[1]
    num_items = _divisor(handle, inputs) if labels is not None else None
    step = None
    if handle.active:
        inputs = prepare_batch(handle.patch, inputs, pad_token=handle.pad_token)
        step = handle.patch.ctx.step
    want_outputs = not prediction_loss_only or not handle.sft   # SFTTrainer recomputes its outputs: only if needed
    loss, outputs = None, None
    with torch.no_grad(), trainer.compute_loss_context_manager():
        if labels is None:
            outputs = model(**inputs)
        else:
            with averaged_over_group(), _sft_accumulation_of_one(handle):
                result = handle.original_compute_loss(model, inputs, return_outputs=want_outputs,
                                                      num_items_in_batch=num_items)
            loss, outputs = result if want_outputs else (result, None)
            loss = _non_cp_loss(handle, loss.detach().mean(), num_items)
        if prediction_loss_only:
            return loss, None, None
        if handle.sft:   # SFTTrainer's outputs: its fused head's, the logits recomputed
            return loss, _whole_logits(handle, outputs, step, seq_len), labels
        return loss, _whole_outputs(handle, model, outputs, step, seq_len, ignore_keys), labels


@contextlib.contextmanager
def _sft_accumulation_of_one(handle) -> Iterator[None]:
    """SFTTrainer's own ``prediction_step`` passes no ``num_items_in_batch``, so its loss adds the MoE aux loss
    divided by 1; given one (``_divisor``), it divides by the trainer's gradient accumulation steps. For SFTTrainer
    the steps read 1 during the call, as they do for its aux term without CP."""
    trainer = handle.trainer
    if not handle.sft or not hasattr(trainer, "current_gradient_accumulation_steps"):
        yield
        return
    steps, trainer.current_gradient_accumulation_steps = trainer.current_gradient_accumulation_steps, 1
    try:
        yield
    finally:
        trainer.current_gradient_accumulation_steps = steps


def _non_cp_loss(handle, share: torch.Tensor, num_items) -> torch.Tensor:
    """The non-CP loss of the batch on every rank of the CP group, from this rank's share."""
    if handle.fallback:   # the whole batch on every rank: scaled by the CP size only where the divisor was given
        return share / handle.cp_size if num_items is not None else share
    import torch.distributed as dist

    total = share.to(torch.float64).reshape(1)
    dist.all_reduce(total, group=handle.patch.ctx.group)
    return (total[0] / handle.cp_size).to(share.dtype)
