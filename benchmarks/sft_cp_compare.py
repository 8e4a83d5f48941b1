"""examples/sft_cp.py with context parallelism against the same script without it, on the same global batches: the
per-step losses side by side, compared with ring_kernels.tolerances' "cp" loss entry of the run's dtype.

    # 2 GPUs (NCCL; accelerate launch with FSDP2, as the example's docstring launches it), bf16 weights:
    python benchmarks/sft_cp_compare.py --device cuda --cp 2 --out DIR -- --model small --dtype bfloat16 \
        --pack-len 16384 --doc-len 2048 --steps 6
    # CPU (gloo, torchrun), tiny, fp32 (what tests/tooling/test_sft_cp_compare.py runs):
    python benchmarks/sft_cp_compare.py --device cpu --cp 2 --out DIR -- --steps 3

Two launches of the example, each writing its steps with ``--log-json``: ``--cp N`` on N processes (dp = 1: one CP
group, every rank gets the whole packed row and hfpatch splits it), then ``--cp 1`` as one plain process (no launcher,
no process group, no CP). With dp = 1 and the same seed, dataset and batch size, both train on the same rows in the
same order. TRL's logged token count is the length of the rows each rank was given, so under CP it includes
hfpatch's zigzag padding (hfpatch.integrations.batch: each row padded at its end to a multiple of 2 x CP size): a
step's count with CP must be its count without, plus less than 2 x CP size tokens per row. The arguments after
``--`` go to both runs.

Exit status 0 when both runs logged the same steps and tokens (up to that padding), the CP run ran the ring (``TrainerCP.active``) in
every attention layer of every step (``Patch.calls``, recomputations apart), and every step's loss is within the
entry (``max_relative``: |loss_cp - loss_ref| / |loss_ref|); 1 otherwise; a launch that fails exits with its
status. The grad norms are shown for reference, not compared (the table has no entry for a norm).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "sft_cp.py")
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from ring_kernels.tolerances import error_of, tolerance  # noqa: E402

__all__ = ["launch_command", "one_gpu", "compare", "table", "main"]


def launch_command(device: str, cp: int, log: str, extra: List[str]) -> List[str]:
    """The command that runs the example at ``cp`` (1: one plain process)."""
    script = [EXAMPLE, "--cp", str(cp), "--device", device, "--log-json", log, *extra]
    if cp == 1:
        return [sys.executable, *script]
    if device == "cuda":   # accelerate requires an FSDP2 plugin for cp_size > 1 on GPUs (docs/training-stack.md)
        return [sys.executable, "-m", "accelerate.commands.launch", "--use_fsdp", "--fsdp_version", "2",
                "--num_processes", str(cp), "--num_machines", "1", "--mixed_precision", "no",
                "--dynamo_backend", "no", *script]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(cp), *script]


def one_gpu(env: dict) -> dict:
    """``env`` with one GPU visible: the first of those visible. A single process that sees several GPUs makes
    Trainer wrap the model in ``nn.DataParallel``, which SFTTrainer refuses."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    first = visible.split(",")[0] if visible else "0"
    return dict(env, CUDA_VISIBLE_DEVICES=first)


def _run(command: List[str], env: dict) -> int:
    print("$ " + " ".join(command), flush=True)
    return subprocess.run(command, env=env).returncode


def compare(cp_log: dict, ref_log: dict) -> List[str]:
    """What differs between the CP run's log and the reference's (empty: equal within the table)."""
    problems = []
    entry = tolerance("cp", ref_log["dtype"], "loss")
    cp_steps, ref_steps = cp_log["steps"], ref_log["steps"]
    if [s["step"] for s in cp_steps] != [s["step"] for s in ref_steps] or not ref_steps:
        problems.append(f"logged steps differ: CP {[s['step'] for s in cp_steps]}, no CP "
                        f"{[s['step'] for s in ref_steps]}")
        return problems
    if not cp_log["active"]:
        problems.append(f"the CP run (cp={cp_log['cp']}) did not run the ring (TrainerCP.active is False)")
    expected_calls = cp_log["layers"] * len(cp_steps)
    if cp_log["ring_calls"] != expected_calls:
        problems.append(f"the ring ran {cp_log['ring_calls']} attention calls, expected {cp_log['layers']} layers x "
                        f"{len(cp_steps)} steps = {expected_calls}")
    problems += _token_differences(cp_log, ref_log)
    for a, b in zip(cp_steps, ref_steps):
        if error_of(a["loss"], b["loss"], entry) > 1.0:
            problems.append(f"step {a['step']}: loss {a['loss']:.8f} with CP vs {b['loss']:.8f} without: relative "
                            f"error {abs(a['loss'] - b['loss']) / abs(b['loss']):.3g} > {entry.bound:g} "
                            f"({entry.comparison}/{entry.dtype}/{entry.quantity})")
    return problems


def _token_differences(cp_log: dict, ref_log: dict) -> List[str]:
    """Steps whose tokens differ by more than the zigzag padding (module docstring): each step's count with CP
    minus its count without must lie in [0, rows x (2 x CP size - 1)]."""
    pad_per_row = 2 * cp_log["cp"] - 1
    rows = ref_log.get("rows_per_step", 1)
    problems, cp_before, ref_before = [], 0.0, 0.0
    for a, b in zip(cp_log["steps"], ref_log["steps"]):
        cp_tokens, ref_tokens = a.get("num_tokens"), b.get("num_tokens")
        if cp_tokens is None or ref_tokens is None:
            if cp_tokens != ref_tokens:
                problems.append(f"step {a['step']}: a token count is missing (CP {cp_tokens}, without {ref_tokens})")
            continue
        padding = (cp_tokens - cp_before) - (ref_tokens - ref_before)
        if not 0 <= padding <= rows * pad_per_row:
            problems.append(f"step {a['step']}: {cp_tokens - cp_before:.0f} tokens with CP, {ref_tokens - ref_before:.0f} "
                            f"without: not the same batches (the zigzag padding adds 0 to {rows * pad_per_row})")
        cp_before, ref_before = cp_tokens, ref_tokens
    return problems


def table(cp_log: dict, ref_log: dict) -> str:
    """The steps side by side (Markdown)."""
    entry = tolerance("cp", ref_log["dtype"], "loss")
    n = cp_log["cp"]
    lines = [f"| step | tokens so far | loss, cp=1 | loss, cp={n} | relative error | bound ({entry.comparison}/"
             f"{entry.dtype}/{entry.quantity}) | grad norm, cp=1 | grad norm, cp={n} |",
             "|---|---|---|---|---|---|---|---|"]
    for a, b in zip(cp_log["steps"], ref_log["steps"]):
        rel = abs(a["loss"] - b["loss"]) / abs(b["loss"]) if b["loss"] else float("inf")
        tokens = "-" if b.get("num_tokens") is None else f"{b['num_tokens']:.0f}"
        lines.append(f"| {b['step']} | {tokens} | {b['loss']:.8f} | {a['loss']:.8f} | {rel:.3g} | "
                     f"{entry.bound:g} | {b['grad_norm']:.6f} | {a['grad_norm']:.6f} |")
    return "\n".join(lines) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--cp", type=int, default=2, help="CP size of the CP run (its process count)")
    p.add_argument("--out", required=True, help="directory for the two runs' logs and the table")
    p.add_argument("--tag", default="sft_cp_compare", help="file stem of the table in --out")
    p.add_argument("example", nargs="*", help="after --: arguments of examples/sft_cp.py for both runs")
    args = p.parse_args(argv)
    if args.cp < 2:
        p.error(f"--cp {args.cp}: the CP run needs 2 or more processes")
    for flag in ("--cp", "--dp", "--device", "--log-json"):
        if flag in args.example:
            p.error(f"{flag} is set by this script, not in the example's arguments")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p),
               TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", HF_DATASETS_DISABLE_PROGRESS_BARS="1")
    logs = {}
    for cp in (args.cp, 1):
        path = os.path.join(args.out, f"{args.tag}_cp{cp}.json")
        if os.path.exists(path):
            os.remove(path)
        code = _run(launch_command(args.device, cp, path, args.example), one_gpu(env) if cp == 1 else env)
        if code != 0:
            print(f"the cp={cp} run failed with exit status {code}", flush=True)
            return code
        with open(path) as f:
            logs[cp] = json.load(f)
    text = table(logs[args.cp], logs[1])
    problems = compare(logs[args.cp], logs[1])
    verdict = "EQUAL within the table" if not problems else "DIFFERENT:\n" + "\n".join(f"- {p}" for p in problems)
    report = (f"examples/sft_cp.py, cp={args.cp} ({args.device}) vs cp=1, same global batches; arguments "
              f"{' '.join(args.example) or '(defaults)'}\n\n{text}\n{verdict}\n")
    with open(os.path.join(args.out, f"{args.tag}.md"), "w") as f:
        f.write(report)
    print(report, flush=True)
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
