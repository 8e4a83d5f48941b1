"""Launched by tests/integrations/test_integrations.py with torchrun / accelerate launch (as a user launches a
training script): runs several trainer cases in one launch and writes, per case, the logged loss and grad norm of
every optimiser step, the eval losses (evaluation during training at step 2, then ``trainer.evaluate()``), and the
final parameters and ``trainer.predict()`` logits (rank 0) to ``--out``.

A case is ``model:kind:dp:cp`` or ``model:kind:dp:cp:keep``: model a tiny family of ``hfpatch.cli.demo_models``
(``mixtral`` with its load-balancing loss on); kind ``trainer`` (transformers'
Trainer, rows of one document, some labels -100), ``sft_plain`` (TRL SFTTrainer, right-padded rows of one
document each, attention mask), ``sft_lora`` (the same with ``peft_config=``: a LoRA adapter that SFTTrainer puts
on the model) or ``sft_packed`` (TRL SFTTrainer, padding-free rows of bin-packed documents: position ids and
cu_seq_lens); TRL's DPOTrainer kinds ``dpo_*`` (``tests/integrations/_preference_cases.py``), RewardTrainer kinds
``reward*`` (``tests/integrations/_reward_cases.py``) and GRPOTrainer / RLOOTrainer kinds ``grpo*``, ``rloo``
(``tests/integrations/_policy_cases.py``), which also record every metric TRL logs; the world must be dp x cp
processes. cp == 1 is the non-CP run of the same script
(same global batches); cp > 1 runs through ``hfpatch.integrations.enable``. ``keep``: the trainer checkpoints
every layer (``gradient_checkpointing=True``, non-reentrant) and ``enable(trainer, keep_attention="all")`` keeps
each layer's attention output through it; the case also reports the keeper's counters.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

# Launched as a script, this folder is sys.path[0]; the harness (_dist) is in tests/, one folder up, and the
# repository root goes first (with tests/ on sys.path, tests/ring_kernels/ would be taken for a namespace package
# named ring_kernels where the root is not on it).
_TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _folder in (_TESTS, os.path.dirname(_TESTS)):
    if _folder not in sys.path:
        sys.path.insert(1, _folder)

import hfpatch.integrations  # noqa: E402
import _policy_cases as policy  # noqa: E402
import _preference_cases as preference  # noqa: E402
import _reward_cases as reward  # noqa: E402
from _dist import exit_now  # noqa: E402
from hfpatch.cli.demo_models import build_model  # noqa: E402
from hfpatch.integrations.fused_head import model_scored_by  # noqa: E402
from hfpatch.modes import current_mode  # noqa: E402

STEPS = 3
BATCH = 2          # per device (per CP group)
ACCUMULATION = 2   # micro-batches per optimiser step: num_items_in_batch spans both
EVAL_ROWS = 8      # a multiple of the eval batch x dp: no remainder for the loop to cut
EVAL_STEPS = 2     # evaluation during training after this optimiser step
LR = 0.1
VOCAB = 128
# The mixture-of-experts model trains with its load-balancing loss on (hfpatch.model.router_loss), with a
# coefficient large enough that a wrong aux loss moves the loss and the gradients far beyond the bounds.
MODEL_OVERRIDES = {"mixtral": dict(output_router_logits=True, router_aux_loss_coef=0.5)}


def _tokenizer():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"t{i}": i for i in range(3, VOCAB)}}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<unk>")),
                                   pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def _documents(count: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, 21, (count,), generator=g).tolist()
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


def _lora():
    """The ``sft_lora`` kind's adapter: LoRA on the attention's query and value projections, no dropout."""
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                      task_type="CAUSAL_LM")


def _dataset(kind: str, split: str = "train"):
    """The training rows, or (``split="eval"``) EVAL_ROWS other rows of the same kind."""
    from datasets import Dataset

    seed = 0 if split == "train" else 10
    if kind == "trainer":  # rows of 22 tokens (not a multiple of 2 x cp: padded by the integration)
        docs = [(d * 5)[:22] for d in _documents(32 if split == "train" else EVAL_ROWS, 1 + seed)]
        return Dataset.from_dict({"input_ids": docs, "labels": [[-100] * 3 + d[3:] for d in docs]})
    if kind in ("sft_plain", "sft_lora"):
        return Dataset.from_dict({"input_ids": _documents(32 if split == "train" else EVAL_ROWS, 2 + seed)})
    from trl import pack_dataset

    packed = pack_dataset(Dataset.from_dict({"input_ids": _documents(96 if split == "train" else 40, 3 + seed)}),
                          32, strategy="bfd")
    return packed if split == "train" else packed.select(range(EVAL_ROWS))


def _arguments(kind: str, out: str, dp: int, cp: int, keep: bool = False):
    common = dict(output_dir=out, max_steps=STEPS, per_device_train_batch_size=BATCH, learning_rate=LR,
                  gradient_accumulation_steps=ACCUMULATION,
                  optim="sgd", max_grad_norm=1.0, logging_steps=1, save_strategy="no", report_to=[], seed=0,
                  use_cpu=True, dataloader_drop_last=True, disable_tqdm=True, bf16=False,
                  eval_strategy="steps", eval_steps=EVAL_STEPS, per_device_eval_batch_size=BATCH)
    if keep:
        common.update(gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False})
    if dp * cp > 1:
        from accelerate import ParallelismConfig

        common["parallelism_config"] = ParallelismConfig(dp_shard_size=dp, cp_size=cp)
    if kind == "trainer":
        from transformers import TrainingArguments

        return TrainingArguments(**common)
    if kind in preference.DPO_KINDS + preference.KTO_KINDS:
        return preference.arguments(kind, common)
    if kind in reward.REWARD_KINDS:
        return reward.arguments(kind, common)
    if kind in policy.POLICY_KINDS:
        return policy.arguments(kind, common)
    from trl import SFTConfig

    return SFTConfig(**common, padding_free=kind == "sft_packed", max_length=None, dataset_num_proc=None)


def _trainer(model_name: str, kind: str, dp: int, cp: int, out: str, keep: bool = False):
    args = _arguments(kind, out, dp, cp, keep)
    if kind in preference.DPO_KINDS + preference.KTO_KINDS + reward.REWARD_KINDS + policy.POLICY_KINDS:
        cases = reward if kind in reward.REWARD_KINDS else policy if kind in policy.POLICY_KINDS else preference
        with hfpatch.integrations.parallelism_config_on_cpu():
            trainer = cases.trainer(model_name, kind, args)
        return trainer, hfpatch.integrations.enable(trainer)
    model = build_model(model_name, **MODEL_OVERRIDES.get(model_name, {}))
    dataset = _dataset(kind)
    with hfpatch.integrations.parallelism_config_on_cpu():
        if kind == "trainer":
            from transformers import Trainer, default_data_collator

            trainer = Trainer(model=model, args=args, train_dataset=dataset, eval_dataset=_dataset(kind, "eval"),
                              data_collator=default_data_collator)
        else:
            from trl import SFTTrainer

            trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, eval_dataset=_dataset(kind, "eval"),
                                 processing_class=_tokenizer(), peft_config=_lora() if kind == "sft_lora" else None)
    return trainer, hfpatch.integrations.enable(trainer, keep_attention="all" if keep else None)


def run_case(spec: str, out_dir: str) -> dict:
    from accelerate.state import AcceleratorState, PartialState

    model_name, kind, dp, cp, *options = spec.split(":")
    dp, cp, keep = int(dp), int(cp), options == ["keep"]
    trainer, handle = _trainer(model_name, kind, dp, cp, os.path.join(out_dir, "trainer"), keep)
    scores_sequences = kind in preference.DPO_KINDS + preference.KTO_KINDS + policy.POLICY_KINDS
    metrics = preference.METRICS if kind in preference.DPO_KINDS else reward.METRICS \
        if kind in reward.REWARD_KINDS else None
    scoring = _ScoringForwards(trainer) if kind in policy.POLICY_KINDS + preference.KTO_KINDS else None
    try:
        trainer.train()
        forwards = scoring.remove() if scoring is not None else None
        kept = handle.kept.stats() if handle.kept is not None else None
        calls = sum(handle.patch.calls.values())
        handle.patch.reset_calls()
        final_eval = trainer.evaluate()
        gathered_by_evaluate = handle.gathered_logits
        # predict() returns logits: TRL's preference trainers build none (their fused LM head scores tokens)
        predicted = None if scores_sequences else trainer.predict(trainer.eval_dataset)
    finally:
        handle.remove()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry and "train_runtime" not in entry]
    result = {"case": spec, "loss": [e["loss"] for e in logs], "grad_norm": [e["grad_norm"] for e in logs],
              "active": handle.active, "calls": calls, "kept": kept, "scoring_forwards": forwards,
              "eval_loss": [e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e]
              + [final_eval["eval_loss"]],
              "predict_loss": predicted.metrics["test_loss"] if predicted is not None else None,
              "eval_calls": sum(handle.patch.calls.values()),
              "gathered_by_evaluate": gathered_by_evaluate, "gathered_logits": handle.gathered_logits,
              "gather_for_metrics_left": "gather_for_metrics" in vars(trainer.accelerator)}
    if kind in policy.POLICY_KINDS + preference.KTO_KINDS:  # every metric TRL logs but its timings
        metrics = sorted({name for e in logs for name in e if not any(t in name for t in ("time", "per_second"))})
    if metrics is not None:  # every metric TRL logs, per optimiser step and per evaluation
        # None where a step logged no such metric (a GRPO step that reuses a generation logs no completions)
        result["metrics"] = {name: [e.get(name) for e in logs] for name in metrics}
        evaluations = [e for e in trainer.state.log_history if "eval_loss" in e] + [final_eval]
        result["eval_metrics"] = {name: [e.get("eval_" + name) for e in evaluations]
                                  for name in metrics if "eval_" + name in evaluations[0]}
        # each rank's own log: TRL computes its metrics on every rank
        result["metrics_by_rank"] = _every_rank({"metrics": result["metrics"], "eval_metrics": result["eval_metrics"]})
    if PartialState().process_index == 0:
        model = trainer.accelerator.unwrap_model(trainer.model)
        stem = os.path.join(out_dir, spec.replace(":", "_"))
        torch.save({n: p.detach().clone() for n, p in model.named_parameters()}, stem + ".pt")
        if predicted is not None:  # a reward model's predictions are its rewards, without labels
            labels = predicted.label_ids if kind not in reward.REWARD_KINDS else ()
            fields = _fields(predicted.predictions)   # the logits; a MoE model's aux_loss and router_logits too
            torch.save({"logits": fields[0] if len(fields) == 1 else next(
                f for f in fields if f.dim() >= 2 and f.shape[:2] == torch.as_tensor(labels).shape[:2]),
                "fields": fields, "labels": torch.as_tensor(labels)}, stem + ".predict.pt")
    AcceleratorState._reset_state(reset_partial_state=False)
    return result


def _fields(predictions) -> list:
    """``predict()``'s predictions (an array, or a tuple of them, nested) as a flat list of tensors, in order."""
    if isinstance(predictions, (tuple, list)):
        return [field for item in predictions for field in _fields(item)]
    return [torch.as_tensor(predictions)]


class _ScoringForwards:
    """Counts the scoring forwards (``fused_lm_head=True``) of the trainer's policy and reference model, outside
    generation (which runs without the ring)."""

    def __init__(self, trainer) -> None:
        self.count = 0

        def count(module, args, kwargs):
            if kwargs.get("fused_lm_head") and current_mode() != "local":
                self.count += 1

        unwrap = trainer.accelerator.unwrap_model
        models = [trainer.model] + ([trainer.ref_model] if trainer.ref_model is not None else [])
        self.hooks = [model_scored_by(m, unwrap).register_forward_pre_hook(count, with_kwargs=True) for m in models]

    def remove(self) -> int:
        for hook in self.hooks:
            hook.remove()
        return self.count


def _every_rank(value) -> list:
    """``value`` of every rank, in rank order (this process's alone without a process group)."""
    if not dist.is_initialized():
        return [value]
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("cases", nargs="+")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    results = [run_case(spec, args.out) for spec in args.cases]
    from accelerate.state import PartialState

    if PartialState().process_index == 0:
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump(results, f, indent=1)


def _end() -> None:
    """Destroy the process group, then end without interpreter finalization (``_dist.exit_now``: a gloo thread
    outliving the interpreter aborted a rank at exit after its results were written, failing the launch)."""
    if dist.is_initialized():
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()
    exit_now(0)


if __name__ == "__main__":
    main()
    _end()
