"""TRL's GRPOTrainer (or RLOOTrainer) with context parallelism through hfpatch: completions sampled by the model
itself, scored by reward functions, the policy trained against a reference model; the same script as without CP plus
two lines (the parallelism assigned after the config, TRL's own config refusing it, and ``enable``).

    # CPU (gloo), cp=2, then the same steps without CP (one process) and the comparison:
    torchrun --nproc-per-node 2 examples/grpo_cp.py --cp 2
    torchrun --nproc-per-node 2 examples/grpo_cp.py --cp 2 --trainer rloo
    # without CP only, one process:
    python examples/grpo_cp.py --cp 1
    # GPUs (NCCL), bf16 weights, about 1B parameters, 4k-token prompts:
    torchrun --nproc-per-node 2 examples/grpo_cp.py --device cuda --cp 2 --model small --dtype bfloat16 \
        --prompt-len 4096

Generation runs on whole sequences with the model's own attention and each CP group scores its first rank's
completions; every scoring forward (policy, reference) runs as one packed row split over the CP group, and inside
TRL's step the CP ranks of a group count as one process (``hfpatch.integrations.policy_gradient``), so TRL's loss
and every metric it logs are the non-CP ones. One data-parallel replica (``dp=1``): the completions a process
samples depend on its seed, so a run with dp > 1 compares against one without CP on as many processes
(tests/integrations/test_integrations.py does, at 2 x 2). The model is built from a config, with a word-level
tokenizer over its vocabulary. What rank 0 prints, and ``--no-compare``, ``--plot FILE`` and ``--log-json PATH``: as
in examples/trainer_cp.py (every step with the mean reward and the KL, the throughput, then the same steps without
CP as one process, side by side with the verdict).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile

import torch

from _report import check_plot_argument
from dpo_cp import word_tokenizer_for
from trainer_cp import SIZES, add_report_arguments, build_model, check_world, end_run, on_cpu


def build_prompts(count: int, prompt_len: int, vocab: int):
    """``count`` prompts of about ``prompt_len`` random words, the same on every rank."""
    from datasets import Dataset

    g = torch.Generator().manual_seed(2)
    lengths = torch.randint(max(1, prompt_len // 2), prompt_len * 3 // 2 + 1, (count,), generator=g).tolist()
    return Dataset.from_dict({"prompt": [" ".join(f"t{int(t)}" for t in torch.randint(3, vocab, (n,), generator=g))
                                         for n in lengths]})


def even_words(completions, **_) -> list:
    """A reward: the share of a completion's words whose token id is even."""
    return [sum(int(w[1:]) % 2 == 0 for w in c.split() if w[1:].isdigit()) / max(len(c.split()), 1)
            for c in completions]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="examples/grpo_cp.py", description=__doc__.split("\n")[0])
    p.add_argument("--trainer", choices=("grpo", "rloo"), default="grpo")
    p.add_argument("--cp", type=int, default=2, help="context-parallel size (1: no CP)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--model", choices=tuple(SIZES), default="tiny")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--prompt-len", type=int, default=24, help="mean prompt length (words)")
    p.add_argument("--completion-len", type=int, default=16, help="the most tokens generated per completion")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch", type=int, default=4, help="completions per step (num_generations divides it)")
    p.add_argument("--generations", type=int, default=2, help="completions per prompt (num_generations)")
    add_report_arguments(p)
    options = p.parse_args(argv)
    options.dp = 1
    check_world(p, options)
    check_plot_argument(options.plot, "examples/grpo_cp.py")
    return options


def train(options) -> dict:
    """Train on every rank; returns the run's record, which rank 0 writes to ``--log-json``."""
    import datasets
    import hfpatch.integrations
    from accelerate import ParallelismConfig
    from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

    from _step_clock import train_timed

    datasets.disable_progress_bars()
    model = build_model(options.model, getattr(torch, options.dtype))
    tokenizer = word_tokenizer_for(model)
    # TRL builds the reference model from the policy's path: the model, saved (each process its own copy)
    path = os.path.join(tempfile.gettempdir(), f"hfpatch-grpo-cp-model-{os.environ.get('RANK', '0')}")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    prompts = build_prompts(options.steps * options.batch // options.generations, options.prompt_len,
                            model.config.vocab_size)
    settings = dict(output_dir=os.path.join(tempfile.gettempdir(), "hfpatch-grpo-cp"), max_steps=options.steps,
                    per_device_train_batch_size=options.batch, learning_rate=1e-3, logging_steps=1,
                    save_strategy="no", report_to=[], seed=0, bf16=False, use_cpu=options.device == "cpu",
                    disable_tqdm=True, ddp_find_unused_parameters=False, num_generations=options.generations,
                    max_completion_length=options.completion_len, beta=0.05)
    Config, Trainer = (GRPOConfig, GRPOTrainer) if options.trainer == "grpo" else (RLOOConfig, RLOOTrainer)
    with on_cpu(options.device):
        config = Config(**settings)
        config.parallelism_config = ParallelismConfig(cp_size=options.cp)   # TRL's config refuses it as an argument
        trainer = Trainer(model=path, reward_funcs=[even_words], args=config, train_dataset=prompts,
                          processing_class=tokenizer)
        cp_handle = hfpatch.integrations.enable(trainer)    # every rank, after building the trainer, before train()
    steps, run = train_timed(trainer, cp_handle, options.cp)
    # The loss is a mean of advantage-weighted probability ratios, and each prompt's advantages sum to zero (RLOO) or
    # nearly (GRPO): a cancellation, compared at the advantages' scale (GRPO's are divided by their group's spread,
    # of order 1; RLOO's are differences of rewards, of the rewards' spread).
    advantages = 1.0 if options.trainer == "grpo" else max(e["reward_std"] for e in steps)
    run = dataclasses.replace(run, loss_scale=advantages)
    record = {"argv": vars(options), "cp": options.cp, "dp": 1, "dtype": options.dtype, "active": cp_handle.active,
              "handle": repr(cp_handle), "ring_calls": sum(cp_handle.patch.calls.values()),
              "layers": model.config.num_hidden_layers, "rows_per_step": options.batch,
              "steps": [{"step": e["step"], "loss": e["loss"], "grad_norm": e["grad_norm"], "reward": e["reward"],
                         "kl": e["kl"]} for e in steps],
              "throughput": run.to_dict()}
    if options.log_json and trainer.is_world_process_zero():
        with open(options.log_json, "w") as f:
            json.dump(record, f, indent=1)
    return record


def command_without_cp(options) -> list:
    """This script with ``--cp 1`` as one process: the same steps."""
    return [sys.executable, os.path.abspath(__file__), "--cp", "1", "--trainer", options.trainer,
            "--device", options.device, "--model", options.model, "--dtype", options.dtype,
            "--prompt-len", str(options.prompt_len), "--completion-len", str(options.completion_len),
            "--steps", str(options.steps), "--batch", str(options.batch), "--generations", str(options.generations)]


def main() -> None:
    options = parse_args()
    record = train(options)
    trainer = "GRPOTrainer" if options.trainer == "grpo" else "RLOOTrainer"
    end_run(options, record, command_without_cp(options), f"examples/grpo_cp.py, {options.model} Llama, {trainer}")


if __name__ == "__main__":
    main()
