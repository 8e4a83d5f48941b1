"""TRL's KTOTrainer with context parallelism through hfpatch: unpaired completions (each prompt with a desirable and
an undesirable completion, of different lengths), scored against a reference model with KTO's KL term, the same
script as without CP plus one ``enable`` line.

    # CPU (gloo), dp=1 x cp=2, then the same steps without CP (one process) and the comparison:
    torchrun --nproc-per-node 2 examples/kto_cp.py --cp 2
    # without CP only, one process:
    python examples/kto_cp.py --cp 1
    # GPUs (NCCL), bf16 weights, about 1B parameters, completions of about 8k tokens after 8k-token prompts:
    torchrun --nproc-per-node 2 examples/kto_cp.py --device cuda --cp 2 --model small --dtype bfloat16 \
        --prompt-len 8192 --completion-len 8192

Every model call of the trainer (the policy, ``ref_model``, and the KL forwards that pair each completion with
another row's prompt) takes the whole batch; hfpatch runs it as one packed row split over the CP group and hands TRL
the whole batch's per-token log-probs on every rank (``hfpatch.integrations.preference``), so TRL's loss and every
metric it logs are the non-CP ones. The model is built from a config, with a word-level tokenizer over its
vocabulary. What rank 0 prints, and ``--no-compare``, ``--plot FILE`` and ``--log-json PATH``: as in
examples/trainer_cp.py (every step with KTO's KL estimate, the throughput, then the same steps without CP as one
process, side by side with the verdict).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile

import torch

from _report import check_plot_argument
from dpo_cp import build_pairs, word_tokenizer_for
from trainer_cp import SIZES, add_report_arguments, build_model, check_world, end_run, on_cpu


def build_unpaired(count: int, prompt_len: int, completion_len: int, vocab: int):
    """``dpo_cp.build_pairs``'s ``count`` pairs as KTO's rows: each prompt with its chosen completion (label True)
    and with its rejected one (label False), one row each."""
    from datasets import Dataset

    rows = {"prompt": [], "completion": [], "label": []}
    for pair in build_pairs(count, prompt_len, completion_len, vocab):
        for completion, label in ((pair["chosen"], True), (pair["rejected"], False)):
            rows["prompt"].append(pair["prompt"])
            rows["completion"].append(completion)
            rows["label"].append(label)
    return Dataset.from_dict(rows)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="examples/kto_cp.py", description=__doc__.split("\n")[0])
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--cp", type=int, default=2, help="context-parallel size (1: no CP)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--model", choices=tuple(SIZES), default="tiny")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--prompt-len", type=int, default=24, help="mean prompt length (words)")
    p.add_argument("--completion-len", type=int, default=20, help="mean completion length (words)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch", type=int, default=4, help="rows per dp replica and step (KTO's KL term needs 2+)")
    add_report_arguments(p)
    options = p.parse_args(argv)
    check_world(p, options)
    check_plot_argument(options.plot, "examples/kto_cp.py")
    if options.batch < 2:
        p.error(f"--batch {options.batch}: KTO's KL term pairs each completion with another row's prompt, so a "
                "batch needs 2 rows or more. Fix: --batch 2")
    return options


def train(options) -> dict:
    """Train on every rank; returns the run's record, which rank 0 writes to ``--log-json``."""
    import datasets
    import hfpatch.integrations
    from accelerate import ParallelismConfig
    from trl import KTOConfig, KTOTrainer

    from _step_clock import train_timed

    datasets.disable_progress_bars()
    model = build_model(options.model, getattr(torch, options.dtype))
    tokenizer = word_tokenizer_for(model)
    rows = build_unpaired((options.steps * options.batch * options.dp + 1) // 2, options.prompt_len,
                          options.completion_len, model.config.vocab_size)
    settings = dict(output_dir=os.path.join(tempfile.gettempdir(), "hfpatch-kto-cp"), max_steps=options.steps,
                    per_device_train_batch_size=options.batch, learning_rate=1e-3, logging_steps=1,
                    save_strategy="no", report_to=[], seed=0, bf16=False, use_cpu=options.device == "cpu",
                    disable_tqdm=True, ddp_find_unused_parameters=False, max_length=None, dataset_num_proc=None)
    dp, cp = options.dp, options.cp
    with on_cpu(options.device):
        config = KTOConfig(**settings, parallelism_config=ParallelismConfig(dp_shard_size=dp, cp_size=cp))
        trainer = KTOTrainer(model=model, ref_model=copy.deepcopy(model), args=config, train_dataset=rows,
                             processing_class=tokenizer)
        cp_handle = hfpatch.integrations.enable(trainer)    # every rank, after building the trainer, before train()
    steps, run = train_timed(trainer, cp_handle, cp)
    record = {"argv": vars(options), "cp": cp, "dp": dp, "dtype": options.dtype, "active": cp_handle.active,
              "handle": repr(cp_handle), "ring_calls": sum(cp_handle.patch.calls.values()),
              "layers": model.config.num_hidden_layers, "rows_per_step": options.batch,
              "steps": [{"step": e["step"], "loss": e["loss"], "grad_norm": e["grad_norm"], "kl": e["kl"]}
                        for e in steps],
              "throughput": run.to_dict()}
    if options.log_json and trainer.is_world_process_zero():
        with open(options.log_json, "w") as f:
            json.dump(record, f, indent=1)
    return record


def command_without_cp(options) -> list:
    """This script with ``--cp 1`` as one process: the global batch of every step (``--batch`` x dp rows)."""
    return [sys.executable, os.path.abspath(__file__), "--cp", "1", "--dp", "1", "--device", options.device,
            "--model", options.model, "--dtype", options.dtype, "--prompt-len", str(options.prompt_len),
            "--completion-len", str(options.completion_len), "--steps", str(options.steps),
            "--batch", str(options.batch * options.dp)]


def main() -> None:
    options = parse_args()
    record = train(options)
    end_run(options, record, command_without_cp(options), f"examples/kto_cp.py, {options.model} Llama, KTOTrainer")


if __name__ == "__main__":
    main()
