"""TRL's DPOTrainer with context parallelism through hfpatch: preference pairs ``[chosen; rejected]`` of different
lengths, scored against a reference model, the same script as without CP plus one ``enable`` line.

    # CPU (gloo), dp=1 x cp=2, then the same steps without CP (one process) and the comparison:
    torchrun --nproc-per-node 2 examples/dpo_cp.py --cp 2
    # without CP only, one process:
    python examples/dpo_cp.py --cp 1
    # GPUs (NCCL), bf16 weights, about 1B parameters, pairs of 8k + 8k tokens:
    torchrun --nproc-per-node 2 examples/dpo_cp.py --device cuda --cp 2 --model small --dtype bfloat16 \
        --prompt-len 4096 --completion-len 4096

Every model call of the trainer (the policy, and ``ref_model``) takes the whole batch; hfpatch runs it as one packed
row split over the CP group and hands TRL the whole batch's per-token log-probs on every rank
(``hfpatch.integrations.preference``), so TRL's loss and every metric it logs are the non-CP ones. The model is
built from a config, so DPOTrainer gets a word-level tokenizer over the model's vocabulary as
``processing_class``. What rank 0 prints, and ``--no-compare``, ``--plot FILE`` and ``--log-json PATH``: as in
examples/trainer_cp.py (every step with DPO's reward margin, the throughput, then the same steps without CP as one
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
from trainer_cp import SIZES, add_report_arguments, build_model, check_world, end_run, on_cpu


def build_tokenizer(vocab: int):
    """Words "t3" .. "t<vocab-1>" split on spaces, with <pad> and <eos>."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"t{i}": i for i in range(3, vocab)}}
    backend = Tokenizer(WordLevel(words, unk_token="<unk>"))
    backend.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>",
                                   unk_token="<unk>")


def word_tokenizer_for(model):
    """``build_tokenizer`` over ``model``'s vocabulary, its pad and eos ids set on the model's configs."""
    tokenizer = build_tokenizer(model.config.vocab_size)
    for config in (model.config, model.generation_config):
        config.pad_token_id, config.eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    return tokenizer


def build_pairs(count: int, prompt_len: int, completion_len: int, vocab: int):
    """``count`` preference pairs of random words, the same on every rank: prompts of about ``prompt_len`` words,
    completions of about ``completion_len`` (each ends with <eos>)."""
    from datasets import Dataset

    g = torch.Generator().manual_seed(1)

    def text(mean: int) -> str:
        n = int(torch.randint(max(1, mean // 2), mean * 3 // 2 + 1, (1,), generator=g))
        return " ".join(f"t{int(t)}" for t in torch.randint(3, vocab, (n,), generator=g))

    rows = [(text(prompt_len), " " + text(completion_len) + " <eos>", " " + text(completion_len) + " <eos>")
            for _ in range(count)]
    return Dataset.from_dict({"prompt": [r[0] for r in rows], "chosen": [r[1] for r in rows],
                              "rejected": [r[2] for r in rows]})


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="examples/dpo_cp.py", description=__doc__.split("\n")[0])
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--cp", type=int, default=2, help="context-parallel size (1: no CP)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--model", choices=tuple(SIZES), default="tiny")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--prompt-len", type=int, default=24, help="mean prompt length (words)")
    p.add_argument("--completion-len", type=int, default=20, help="mean completion length (words)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch", type=int, default=2, help="pairs per dp replica and step")
    p.add_argument("--loss", default="sigmoid", help="DPOConfig's loss_type (sigmoid, ipo, hinge, ...)")
    add_report_arguments(p)
    options = p.parse_args(argv)
    check_world(p, options)
    check_plot_argument(options.plot, "examples/dpo_cp.py")
    return options


def train(options) -> dict:
    """Train on every rank; returns the run's record, which rank 0 writes to ``--log-json``."""
    import datasets
    import hfpatch.integrations
    from accelerate import ParallelismConfig
    from trl import DPOConfig, DPOTrainer

    from _step_clock import train_timed

    datasets.disable_progress_bars()
    model = build_model(options.model, getattr(torch, options.dtype))
    tokenizer = word_tokenizer_for(model)
    pairs = build_pairs(options.steps * options.batch * options.dp, options.prompt_len, options.completion_len,
                        model.config.vocab_size)
    settings = dict(output_dir=os.path.join(tempfile.gettempdir(), "hfpatch-dpo-cp"), max_steps=options.steps,
                    per_device_train_batch_size=options.batch, learning_rate=1e-3, logging_steps=1,
                    save_strategy="no", report_to=[], seed=0, bf16=False, use_cpu=options.device == "cpu",
                    disable_tqdm=True, ddp_find_unused_parameters=False, loss_type=[options.loss],
                    max_length=None, dataset_num_proc=None)
    dp, cp = options.dp, options.cp
    with on_cpu(options.device):
        config = DPOConfig(**settings, parallelism_config=ParallelismConfig(dp_shard_size=dp, cp_size=cp))
        trainer = DPOTrainer(model=model, ref_model=copy.deepcopy(model), args=config, train_dataset=pairs,
                             processing_class=tokenizer)
        cp_handle = hfpatch.integrations.enable(trainer)    # every rank, after building the trainer, before train()
    steps, run = train_timed(trainer, cp_handle, cp)
    record = {"argv": vars(options), "cp": cp, "dp": dp, "dtype": options.dtype, "active": cp_handle.active,
              "handle": repr(cp_handle), "ring_calls": sum(cp_handle.patch.calls.values()),
              "layers": model.config.num_hidden_layers, "rows_per_step": 2 * options.batch,
              "steps": [{"step": e["step"], "loss": e["loss"], "grad_norm": e["grad_norm"],
                         "margin": e["rewards/margins"]} for e in steps],
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
            "--batch", str(options.batch * options.dp), "--loss", options.loss]


def main() -> None:
    options = parse_args()
    record = train(options)
    end_run(options, record, command_without_cp(options), f"examples/dpo_cp.py, {options.model} Llama, DPOTrainer")


if __name__ == "__main__":
    main()
