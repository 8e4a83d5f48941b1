"""transformers' Trainer with context parallelism through hfpatch: accelerate's ParallelismConfig gives the mesh
(dp x cp) and the same batch to every rank of a CP group; hfpatch.integrations.enable(trainer) runs ring attention
over the cp dimension and makes the loss, the gradients and the logged loss equal to the run without CP.

    # CPU (gloo), dp=1 x cp=2, then the same steps without CP (one process) and the comparison:
    torchrun --nproc-per-node 2 examples/trainer_cp.py --cp 2
    accelerate launch --multi_gpu --num_processes 2 examples/trainer_cp.py --cp 2   # the same, accelerate's launcher
    # CPU, dp=2 x cp=2 (--multi_gpu only picks accelerate's multi-process launcher):
    accelerate launch --multi_gpu --num_processes 4 examples/trainer_cp.py --dp 2 --cp 2
    # without CP only, one process:
    python examples/trainer_cp.py --cp 1
    # GPUs (NCCL), FSDP2 over dp x cp as accelerate shards it, bf16 weights:
    accelerate launch --use_fsdp --fsdp_version 2 --num_processes 2 examples/trainer_cp.py --device cuda --cp 2 \
        --model small --seq-len 32768 --dtype bfloat16

What rank 0 prints: every optimizer step's loss and grad norm, and the throughput (tokens of the global batches per
second over the steps after the first). With CP it then runs the same steps without CP: this script with ``--cp 1``
as one process holding the whole global batch (``--batch`` x dp rows per step), outside the launch; its lines are
marked "[no CP]". Last come both runs' losses side by side, the largest relative difference against
ring_kernels.tolerances' "cp" loss bound of the dtype (exit status 1 beyond it), both throughputs and their ratio.

``--no-compare`` skips the run without CP; ``--plot FILE`` draws the loss curves of both runs (needs matplotlib);
``--log-json PATH``: rank 0 writes its steps and throughput there, and the run compares nothing itself (it is one
half of a comparison made elsewhere). Every rank ends by destroying its process group and exiting without
interpreter finalization (examples/_processes.py says why).

The model is a Llama built from its config with random weights (no download); replace ``build_model`` with
``AutoModelForCausalLM.from_pretrained(...)`` for a real one. Rows are random tokens, one document per row.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile

import torch

from _processes import exit_now, is_main_process, leave_process_group, run_without_cp
from _report import Run, check_plot_argument, compare, plot_losses, throughput_line

SIZES = {  # hidden, layers, heads, kv heads, intermediate
    "tiny": (64, 2, 4, 2, 128),
    "small": (2048, 16, 32, 8, 8192),   # about 1B parameters
}


def build_config(size: str):
    """The ``LlamaConfig`` of ``size`` (``SIZES``)."""
    from transformers import LlamaConfig

    hidden, layers, heads, kv_heads, inter = SIZES[size]
    return LlamaConfig(vocab_size=32000 if size != "tiny" else 128, hidden_size=hidden, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=inter,
                       max_position_embeddings=131072, tie_word_embeddings=False)


def build_model(size: str, dtype: torch.dtype):
    from transformers import LlamaForCausalLM

    config = build_config(size)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(dtype)


def build_dataset(rows: int, seq_len: int, vocab: int):
    from datasets import Dataset

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (rows, seq_len), generator=g).tolist()
    return Dataset.from_dict({"input_ids": ids, "labels": ids})


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="examples/trainer_cp.py", description=__doc__.split("\n")[0])
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--cp", type=int, default=2, help="context-parallel size (1: no CP)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--model", choices=tuple(SIZES), default="tiny")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per row (split over the cp ranks)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch", type=int, default=2, help="rows per dp replica and step")
    add_report_arguments(p)
    options = p.parse_args(argv)
    check_world(p, options)
    check_plot_argument(options.plot, "examples/trainer_cp.py")
    return options


def check_world(parser: argparse.ArgumentParser, options) -> None:
    """Usage error (exit 2) unless the launch started dp x cp processes."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if options.dp < 1 or options.cp < 1 or options.dp * options.cp != world:
        launch = (f"torchrun --nproc-per-node {options.dp * options.cp} {parser.prog}" if options.dp * options.cp > 1
                  else f"python {parser.prog}")
        parser.error(f"--dp {options.dp} x --cp {options.cp} needs {options.dp * options.cp} processes, this launch "
                     f"has {world}. Fix: {launch} --dp {options.dp} --cp {options.cp}")


def add_report_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of what the Trainer examples report at their end (module docstring)."""
    parser.add_argument("--no-compare", action="store_true", help="with CP: skip the run without CP")
    parser.add_argument("--plot", metavar="FILE", help="write the loss curves with and without CP to FILE "
                                                       "(.png, .svg, .pdf; needs matplotlib)")
    parser.add_argument("--log-json", metavar="PATH", help="rank 0 writes the steps and the throughput here "
                                                           "(and compares nothing itself)")


def on_cpu(device: str):
    """accelerate refuses a ParallelismConfig without accelerators: on CPU the trainer is built inside this
    context (hfpatch/integrations/cpu.py). GPUs need nothing."""
    import hfpatch.integrations

    return hfpatch.integrations.parallelism_config_on_cpu() if device == "cpu" else contextlib.nullcontext()


def train(options) -> dict:
    """Train on every rank; returns the run's record, which rank 0 writes to ``--log-json``."""
    import hfpatch.integrations
    from accelerate import ParallelismConfig
    from transformers import Trainer, TrainingArguments, default_data_collator

    from _step_clock import train_timed

    model = build_model(options.model, getattr(torch, options.dtype))
    dataset = build_dataset(options.steps * options.batch * options.dp, options.seq_len, model.config.vocab_size)
    settings = dict(output_dir=os.path.join(tempfile.gettempdir(), "hfpatch-trainer-cp"), max_steps=options.steps,
                    per_device_train_batch_size=options.batch, learning_rate=1e-3, logging_steps=1,
                    save_strategy="no", report_to=[], seed=0, bf16=False, use_cpu=options.device == "cpu",
                    disable_tqdm=True, ddp_find_unused_parameters=False)
    dp, cp = options.dp, options.cp
    with on_cpu(options.device):
        # README.md shows the lines from here up to "README.md: end" (tests/integrations/test_examples.py compares)
        # README.md: begin
        training_args = TrainingArguments(**settings,
                                          parallelism_config=ParallelismConfig(dp_shard_size=dp, cp_size=cp))
        trainer = Trainer(model=model, args=training_args, train_dataset=dataset, data_collator=default_data_collator)
        cp_handle = hfpatch.integrations.enable(trainer)    # every rank, after building the trainer, before train()
        # README.md: end
    steps, run = train_timed(trainer, cp_handle, cp)      # this script prints its own line per step
    record = {"argv": vars(options), "cp": cp, "dp": dp, "dtype": options.dtype, "active": cp_handle.active,
              "handle": repr(cp_handle), "ring_calls": sum(cp_handle.patch.calls.values()),
              "layers": model.config.num_hidden_layers, "rows_per_step": options.batch,
              "steps": [{"step": e["step"], "loss": e["loss"], "grad_norm": e["grad_norm"]} for e in steps],
              "throughput": run.to_dict()}
    if options.log_json and trainer.is_world_process_zero():
        with open(options.log_json, "w") as f:
            json.dump(record, f, indent=1)
    return record


def print_steps(record: dict) -> None:
    print(record["handle"])
    for entry in record["steps"]:
        print(f"step {entry['step']}  loss {entry['loss']:.8f}  grad_norm {entry['grad_norm']:.6f}")
    print(throughput_line(Run.from_dict(record["throughput"])), flush=True)


def compare_without_cp(options, record: dict, command: list, title: str) -> int:
    """Rank 0, after the launch's work: run ``command`` (this script with ``--cp 1``, without ``--log-json``) as
    one process, print both runs side by side and draw ``--plot``. Returns the exit status: 0, or 1 when the run
    without CP failed or the losses differ beyond the tolerance. Nothing to compare without CP or with
    ``--no-compare`` / ``--log-json``: only the plot of this run."""
    runs, status = [Run.from_dict(record["throughput"])], 0
    if options.cp > 1 and not options.no_compare and not options.log_json:
        without_cp = run_without_cp(command, options.device)
        if without_cp is None:
            status = 1
        else:
            runs.append(Run.from_dict(without_cp["throughput"]))
            lines, agree = compare(runs[0], runs[1], options.dtype)
            print("\n".join(lines), flush=True)
            status = 0 if agree else 1
    if options.plot:
        plot_losses(options.plot, runs, title)
        print(f"loss curves: {options.plot}", flush=True)
    return status


def command_without_cp(options) -> list:
    """This script with ``--cp 1`` as one process: the global batch of every step (``--batch`` x dp rows)."""
    return [sys.executable, os.path.abspath(__file__), "--cp", "1", "--dp", "1", "--device", options.device,
            "--model", options.model, "--dtype", options.dtype, "--seq-len", str(options.seq_len),
            "--steps", str(options.steps), "--batch", str(options.batch * options.dp)]


def end_run(options, record: dict, command: list, title: str) -> None:
    """Every rank, after training: leave the process group; rank 0 prints the steps, then compares with the run
    without CP (``compare_without_cp``, whose status is rank 0's exit status); then every rank exits."""
    leave_process_group()
    status = 0
    if is_main_process():
        print_steps(record)
        status = compare_without_cp(options, record, command, title)
    exit_now(status)


def main() -> None:
    options = parse_args()
    record = train(options)
    end_run(options, record, command_without_cp(options), f"examples/trainer_cp.py, {options.model} Llama, Trainer")


if __name__ == "__main__":
    main()
