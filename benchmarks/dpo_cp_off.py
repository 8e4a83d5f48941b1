"""The cost of hfpatch's path with CP off: TRL's DPOTrainer step through ``hfpatch.integrations.enable`` with
``cp_size=1`` against the plain DPOTrainer step, in one process, side by side.

    # one GPU, bf16 weights, about 1B parameters, pairs of 8k + 8k tokens (16k per pair):
    python benchmarks/dpo_cp_off.py --device cuda --model small --dtype bfloat16 --prompt-len 4096 \
        --completion-len 4096 --steps 6
    # CPU, tiny, fp32:
    python benchmarks/dpo_cp_off.py --steps 3

After a warm-up run (not reported), four runs of the same steps from the same initial weights and pairs
(examples/dpo_cp.py's model, tokenizer and pairs), alternating: plain TRL, TRL with ``enable(trainer)`` (no
``ParallelismConfig``: the integration's promise is that it then changes nothing), and both again, so the two plain
runs show the machine's own run-to-run spread.
Printed: each run's per-step loss, grad norm and reward margin, their largest difference against the first plain
run, and the median step time of the steps after the first (which pays one-time costs); then the ratio of the
enabled runs' mean to the plain runs'. Exit status 0 when every run's losses equal the first plain run's within the
"cp" loss entry of ``ring_kernels.tolerances`` for the compute dtype, 1 otherwise.

bf16 weights make the comparison chaotic on a GPU: Adam's first update moves every weight by about the learning rate
whatever its gradient, and bf16 rounds most such moves away, so the nondeterministic attention backward (summation
order) decides which weights move; two plain runs then differ by tens of percent from step 2
(``benchmarks/results/dpo_cp_off_1xH200_16k_bf16weights_e9c60db.log``). ``--dtype float32 --autocast`` (fp32 weights
and optimizer, bf16 compute: mixed-precision training) is the comparison that means something.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for path in (ROOT, os.path.join(ROOT, "examples")):
    if path not in sys.path:
        sys.path.insert(0, path)

from _step_clock import StepClock  # noqa: E402
from dpo_cp import build_pairs, word_tokenizer_for  # noqa: E402
from ring_kernels.tolerances import tolerance  # noqa: E402
from trainer_cp import SIZES, build_model  # noqa: E402

__all__ = ["run", "main"]


def _built(options) -> torch.nn.Module:
    """examples/trainer_cp.py's model, built on the run's device (a 1B model is built in seconds on a GPU)."""
    with torch.device(options.device):
        return build_model(options.model, getattr(torch, options.dtype))


def run(options, initial: dict, with_enable: bool) -> dict:
    """One training run from ``initial`` (a state dict); returns its per-step log and step times."""
    import hfpatch.integrations
    from transformers import PrinterCallback
    from trl import DPOConfig, DPOTrainer

    model = _built(options)
    model.load_state_dict(initial)
    tokenizer = word_tokenizer_for(model)
    pairs = build_pairs(options.steps * options.batch, options.prompt_len, options.completion_len,
                        model.config.vocab_size)
    args = DPOConfig(output_dir=os.path.join(tempfile.gettempdir(), "hfpatch-dpo-cp-off"), max_steps=options.steps,
                     per_device_train_batch_size=options.batch, learning_rate=1e-5, logging_steps=1,
                     save_strategy="no", report_to=[], seed=0, bf16=options.autocast,
                     use_cpu=options.device == "cpu",
                     disable_tqdm=True, loss_type=["sigmoid"], optim=options.optim, max_length=None,
                     dataset_num_proc=None)
    trainer = DPOTrainer(model=model, ref_model=copy.deepcopy(model), args=args, train_dataset=pairs,
                         processing_class=tokenizer)
    trainer.remove_callback(PrinterCallback)
    handle = hfpatch.integrations.enable(trainer) if with_enable else None
    clock = StepClock.attach(trainer)   # examples/_step_clock.py: every optimizer step timed, CUDA synchronized
    try:
        trainer.train()
    finally:
        if handle is not None:
            handle.remove()
    steps = [e for e in trainer.state.log_history if "loss" in e and "train_runtime" not in e]
    result = {"enabled": with_enable, "handle": repr(handle) if handle is not None else None,
              "loss": [e["loss"] for e in steps], "grad_norm": [e["grad_norm"] for e in steps],
              "margin": [e["rewards/margins"] for e in steps], "seconds": clock.seconds,
              "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2 ** 30 if options.device == "cuda" else None}
    del trainer, model
    if options.device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return result


def _largest_relative(ours: list, theirs: list) -> float:
    return max(abs(a - b) / abs(b) if b else abs(a - b) for a, b in zip(ours, theirs))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks/dpo_cp_off.py", description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--model", choices=tuple(SIZES), default="tiny")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--prompt-len", type=int, default=24)
    p.add_argument("--completion-len", type=int, default=20)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch", type=int, default=1, help="pairs per step")
    p.add_argument("--autocast", action="store_true",
                   help="bf16 autocast (TrainingArguments bf16=True) over fp32 weights and optimizer states")
    p.add_argument("--deterministic", action="store_true",
                   help="torch.use_deterministic_algorithms(True) (set CUBLAS_WORKSPACE_CONFIG=:4096:8 on CUDA)")
    p.add_argument("--optim", default="adamw_torch", help="TrainingArguments' optim (sgd: an update proportional "
                                                         "to the gradient)")
    p.add_argument("--json", metavar="PATH", help="write every run's numbers here")
    options = p.parse_args(argv)
    import datasets

    datasets.disable_progress_bars()
    if options.deterministic:
        torch.use_deterministic_algorithms(True)
    initial = {k: v.clone() for k, v in _built(options).state_dict().items()}
    run(options, initial, False)   # warm-up (kernels, allocator, caches): not reported
    order = (False, True, False, True)
    runs = [run(options, initial, with_enable) for with_enable in order]
    labels = ("plain TRL", "enable, cp_size=1", "plain TRL again", "enable again")
    plain = runs[0]
    compute = "bfloat16" if options.autocast else options.dtype
    entry = tolerance("cp", compute, "loss")
    print(f"DPOTrainer, {options.model} Llama, {options.dtype} weights"
          f"{', bf16 autocast' if options.autocast else ''}, {options.device}, pairs of "
          f"{options.prompt_len}+{options.completion_len} words x 2, {options.batch} pair(s) per step")
    for label, result in zip(labels, runs):
        median = statistics.median(result["seconds"][1:]) if len(result["seconds"]) > 1 else result["seconds"][0]
        result["median_step_s"] = median
        peak = "" if result["peak_allocated_gib"] is None else f", peak {result['peak_allocated_gib']:.1f} GiB"
        print(f"{label:>18}: median step {median:.4f} s (steps 2-{len(result['seconds'])}){peak}; "
              f"loss vs plain {_largest_relative(result['loss'], plain['loss']):.2g}, grad norm "
              f"{_largest_relative(result['grad_norm'], plain['grad_norm']):.2g}, margin "
              f"{_largest_relative(result['margin'], plain['margin']):.2g} (largest relative difference)")
        for step, (loss, norm, margin) in enumerate(zip(result["loss"], result["grad_norm"], result["margin"]), 1):
            print(f"{'':>20}step {step}  loss {loss:.8f}  grad_norm {norm:.6f}  margin {margin:.6f}")
    enabled = [r["median_step_s"] for r, e in zip(runs, order) if e]
    plains = [r["median_step_s"] for r, e in zip(runs, order) if not e]
    ratio = statistics.mean(enabled) / statistics.mean(plains)
    spread = plains[1] / plains[0]
    agree = all(_largest_relative(r["loss"], plain["loss"]) <= entry.bound for r in runs)
    print(f"step time, enable / plain (mean of two runs each): {ratio:.3f}x (plain again / plain: {spread:.3f}x); "
          f"losses "
          f"{'equal' if agree else 'DIFFER'} within {entry.bound:g} ({compute} loss, ring_kernels.tolerances)")
    if options.json:
        with open(options.json, "w") as f:
            json.dump({"argv": vars(options), "runs": dict(zip(labels, runs)), "ratio": ratio, "spread": spread,
                       "agree": agree}, f, indent=1)
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
