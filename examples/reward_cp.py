"""TRL's RewardTrainer with context parallelism through hfpatch: a reward model (a Llama with a one-label
sequence-classification head) trained on preference pairs ``[chosen; rejected]`` of different lengths, the same
script as without CP plus one ``enable`` line.

    # CPU (gloo), dp=1 x cp=2, then the same steps without CP (one process) and the comparison:
    torchrun --nproc-per-node 2 examples/reward_cp.py --cp 2
    # without CP only, one process:
    python examples/reward_cp.py --cp 1
    # GPUs (NCCL), bf16 weights, about 1B parameters, pairs of 8k + 8k tokens:
    torchrun --nproc-per-node 2 examples/reward_cp.py --device cuda --cp 2 --model small --dtype bfloat16 \
        --prompt-len 4096 --completion-len 4096

Every forward of the trainer takes the whole batch; hfpatch runs it as one packed row split over the CP group and
pools each sequence's reward at its last real token on every rank (``hfpatch.integrations.reward``), so TRL's
Bradley-Terry loss and every metric it logs (the rewards, their margin and accuracy) are the non-CP ones. The model
is built from a config, with a word-level tokenizer over its vocabulary. What rank 0 prints, and ``--no-compare``,
``--plot FILE`` and ``--log-json PATH``: as in examples/trainer_cp.py (every step with the reward margin, the
throughput, then the same steps without CP as one process, side by side with the verdict).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

from _report import check_plot_argument
from dpo_cp import build_pairs, build_tokenizer
from trainer_cp import SIZES, add_report_arguments, build_config, check_world, end_run, on_cpu


def build_reward_model(size: str, dtype: torch.dtype, tokenizer):
    """The Llama of ``size`` (examples/trainer_cp.py's ``SIZES``) as a ``LlamaForSequenceClassification`` with one
    label (the reward); its pad and eos tokens are ``tokenizer``'s (the head pools each row at its last non-pad
    token)."""
    from transformers import LlamaForSequenceClassification

    config = build_config(size)
    config.num_labels, config.pad_token_id, config.eos_token_id = 1, tokenizer.pad_token_id, tokenizer.eos_token_id
    torch.manual_seed(0)
    return LlamaForSequenceClassification(config).to(dtype)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="examples/reward_cp.py", description=__doc__.split("\n")[0])
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--cp", type=int, default=2, help="context-parallel size (1: no CP)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--model", choices=tuple(SIZES), default="tiny")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--prompt-len", type=int, default=24, help="mean prompt length (words)")
    p.add_argument("--completion-len", type=int, default=20, help="mean completion length (words)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch", type=int, default=2, help="pairs per dp replica and step")
    add_report_arguments(p)
    options = p.parse_args(argv)
    check_world(p, options)
    check_plot_argument(options.plot, "examples/reward_cp.py")
    return options


def train(options) -> dict:
    """Train on every rank; returns the run's record, which rank 0 writes to ``--log-json``."""
    import datasets
    import hfpatch.integrations
    from accelerate import ParallelismConfig
    from trl import RewardConfig, RewardTrainer

    from _step_clock import train_timed

    datasets.disable_progress_bars()
    vocab = build_config(options.model).vocab_size
    tokenizer = build_tokenizer(vocab)
    model = build_reward_model(options.model, getattr(torch, options.dtype), tokenizer)
    pairs = build_pairs(options.steps * options.batch * options.dp, options.prompt_len, options.completion_len, vocab)
    settings = dict(output_dir=os.path.join(tempfile.gettempdir(), "hfpatch-reward-cp"), max_steps=options.steps,
                    per_device_train_batch_size=options.batch, learning_rate=1e-3, logging_steps=1,
                    save_strategy="no", report_to=[], seed=0, bf16=False, use_cpu=options.device == "cpu",
                    disable_tqdm=True, ddp_find_unused_parameters=False, max_length=None, dataset_num_proc=None)
    dp, cp = options.dp, options.cp
    with on_cpu(options.device):
        config = RewardConfig(**settings, parallelism_config=ParallelismConfig(dp_shard_size=dp, cp_size=cp))
        trainer = RewardTrainer(model=model, args=config, train_dataset=pairs, processing_class=tokenizer)
        cp_handle = hfpatch.integrations.enable(trainer)    # every rank, after building the trainer, before train()
    steps, run = train_timed(trainer, cp_handle, cp)
    record = {"argv": vars(options), "cp": cp, "dp": dp, "dtype": options.dtype, "active": cp_handle.active,
              "handle": repr(cp_handle), "ring_calls": sum(cp_handle.patch.calls.values()),
              "layers": model.config.num_hidden_layers, "rows_per_step": 2 * options.batch,
              "steps": [{"step": e["step"], "loss": e["loss"], "grad_norm": e["grad_norm"], "margin": e["margin"],
                         "accuracy": e["accuracy"]} for e in steps],
              "throughput": run.to_dict()}
    if options.log_json and trainer.is_world_process_zero():
        with open(options.log_json, "w") as f:
            json.dump(record, f, indent=1)
    return record


def command_without_cp(options) -> list:
    """This script with ``--cp 1`` as one process: the global batch of every step (``--batch`` x dp pairs)."""
    return [sys.executable, os.path.abspath(__file__), "--cp", "1", "--dp", "1", "--device", options.device,
            "--model", options.model, "--dtype", options.dtype, "--prompt-len", str(options.prompt_len),
            "--completion-len", str(options.completion_len), "--steps", str(options.steps),
            "--batch", str(options.batch * options.dp)]


def main() -> None:
    options = parse_args()
    record = train(options)
    end_run(options, record, command_without_cp(options),
            f"examples/reward_cp.py, {options.model} Llama, RewardTrainer")


if __name__ == "__main__":
    main()
