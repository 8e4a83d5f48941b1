"""SFTTrainer throughput with hfpatch's context parallelism against one GPU at its share and against accelerate's own
context parallelism: examples/sft_cp.py launched three times, one after the other, on the same model and tokens per
GPU (T = ``--tokens-per-gpu``, N = ``--cp``):

- ``hfpatch``: ``--cp N`` on N GPUs, packed rows of N x T tokens (documents of mean ``--doc-len``), hfpatch's
  ring (accelerate launch with FSDP2 on GPUs, torchrun on CPU);
- ``one GPU``: ``--cp 1`` as one plain process on one GPU, packed rows of T tokens: the same script at its share
  (the model's own SDPA attention; for packed rows transformers builds a dense document mask from the position
  ids, so this baseline computes every one of the T x T scores);
- ``accelerate``: ``--cp N --cp-impl accelerate --plain`` on N GPUs: accelerate's own CP (torch's
  ``context_parallel`` over SDPA), one document of N x T tokens per row (documents drawn at least that long and
  cut at it: every row full), since it cannot train packed rows;
- ``hfpatch unpacked``: ``--cp N --plain`` on N GPUs, the accelerate run's rows under hfpatch's ring: the
  like-for-like comparison with accelerate (the same rows, the same attention work).

    # 2 GPUs, the ~1B Llama at 32k tokens per GPU, bf16 (benchmarks/README.md):
    python benchmarks/sft_throughput.py --device cuda --out benchmarks/results --model small --dtype bfloat16 \\
        --tokens-per-gpu 32768 --steps 6 --timeout 180
    # CPU (gloo), tiny (what tests/tooling/test_sft_throughput.py runs; the accelerate row is refused on CPU):
    python benchmarks/sft_throughput.py --device cpu --out DIR --model tiny --dtype float32 --tokens-per-gpu 128 \\
        --doc-len 32 --steps 2

Each launch writes its record with ``--log-json`` and its output to ``<out>/<tag>_<run>.log``; it has ``--timeout``
seconds (its process group is killed beyond). A launch that fails, is refused, runs out of memory or out of time is
a row with its status and reason; the others still run. ``<out>/<tag>.json`` and ``<tag>.md``: one row per run
(tokens/s of the global batches and per GPU over the steps after the first, step time, peak memory allocated and
reserved, the largest over the ranks, on CUDA; the first and last loss, the attention that ran, the command, the
status), the ratios of hfpatch's tokens/s per GPU to one GPU's and to accelerate's, and the stamp
(benchmarks/_stamp.py: commit, device, versions, date; taken after the launches, so that this process holds no GPU
memory while they run). Files are rewritten after every launch. Exit status 0 when every run is ok, 1 otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
from typing import List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.dirname(os.path.abspath(__file__))
for _path in (ROOT, HERE):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import torch  # noqa: E402

from _stamp import stamp  # noqa: E402
from sft_cp_compare import launch_command, one_gpu  # noqa: E402

__all__ = ["RUNS", "run_arguments", "row_of", "failure", "ratios", "markdown", "main"]

RUNS = ("hfpatch", "one GPU", "accelerate", "hfpatch unpacked")
_SLUG = {"hfpatch": "hfpatch", "one GPU": "one_gpu", "accelerate": "accelerate", "hfpatch unpacked": "hfpatch_unpacked"}
_OUT_OF_MEMORY = re.compile(r"OutOfMemoryError|CUDA out of memory|out of memory", re.I)


def run_arguments(run: str, args) -> List[str]:
    """examples/sft_cp.py's arguments of ``run`` (``--cp``, ``--device`` and ``--log-json`` come from
    ``launch_command``)."""
    common = ["--model", args.model, "--dtype", args.dtype, "--steps", str(args.steps), "--no-compare"]
    t, n = args.tokens_per_gpu, args.cp
    if run == "hfpatch":
        return [*common, "--pack-len", str(n * t), "--doc-len", str(args.doc_len)]
    if run == "one GPU":
        return [*common, "--pack-len", str(t), "--doc-len", str(args.doc_len)]
    # one document per row, drawn between 1 and 3 rows long and cut at the row: every row has n x t tokens
    unpacked = [*common, "--plain", "--batch", "1", "--pack-len", str(n * t), "--doc-len", str(2 * n * t)]
    return [*unpacked, "--cp-impl", "accelerate"] if run == "accelerate" else unpacked


def _timed_steps(timed: str) -> int:
    first, _, last = timed.partition("-")
    return int(last or first) - int(first) + 1


def row_of(run: str, gpus: int, command: List[str], record: Optional[dict], status: str, reason: str = "") -> dict:
    """One table row from a launch's ``--log-json`` record (None when it wrote none)."""
    row = {"run": run, "gpus": gpus, "command": " ".join(command), "status": status, "reason": reason}
    if record is None:
        return row
    t = record["throughput"]
    rate = t["tokens"] / t["seconds"] if t["seconds"] > 0 else None
    steps = _timed_steps(t["timed"])
    row.update(attention=record.get("attention"), rows_per_step=record.get("rows_per_step"),
               packed=record.get("packed"), tokens_per_step=t["tokens"] / steps, timed_steps=t["timed"],
               tokens_per_s=rate, tokens_per_s_per_gpu=None if rate is None else rate / gpus,
               step_s=t["seconds"] / steps, peak_allocated_gib=t.get("peak_allocated_gib"),
               peak_reserved_gib=t.get("peak_reserved_gib"), loss_first=t["losses"][0] if t["losses"] else None,
               loss_last=t["losses"][-1] if t["losses"] else None)
    return row


def ratios(rows: List[dict]) -> dict:
    """hfpatch's tokens/s per GPU over one GPU's and over accelerate's, and on accelerate's own rows (unpacked) over
    accelerate's (None where a run has no number)."""
    rate = {r["run"]: r.get("tokens_per_s_per_gpu") if r["status"] == "ok" else None for r in rows}

    def over(run: str, other: str) -> Optional[float]:
        return rate[run] / rate[other] if rate.get(run) and rate.get(other) else None

    return {"hfpatch_vs_one_gpu": over("hfpatch", "one GPU"), "hfpatch_vs_accelerate": over("hfpatch", "accelerate"),
            "unpacked_hfpatch_vs_accelerate": over("hfpatch unpacked", "accelerate")}


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown(rows: List[dict], meta: dict) -> str:
    s = meta.get("stamp")
    head = [f"# SFTTrainer throughput: {meta['title']}", ""]
    if s:
        head += [f"{s['device_name']}, up to {s['world_size']} processes; commit {s['git_commit']} ({s['provenance']}); torch "
                 f"{s['torch']}, transformers {s['transformers']}, CUDA {s['cuda']}; {s['date']}.", ""]
    else:
        head += ["(not stamped yet: the launches are still running)", ""]
    head += [f"Runs: {meta['runs']}", "",
             "| run | GPUs | attention | tokens/step | tokens/s | tokens/s/GPU | step s | peak GiB allocated | "
             "peak GiB reserved | loss first, last | status | command |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    body = []
    for r in rows:
        status = _cell(r["status"] if not r["reason"] else f"{r['status']}: {r['reason']}")
        losses = "-" if r.get("loss_first") is None else f"{r['loss_first']:.4f}, {r['loss_last']:.4f}"
        body.append(f"| {r['run']} | {r['gpus']} | {r.get('attention') or '-'} | "
                    f"{_fmt(r.get('tokens_per_step'), '.0f')} | {_fmt(r.get('tokens_per_s'), ',.0f')} | "
                    f"{_fmt(r.get('tokens_per_s_per_gpu'), ',.0f')} | "
                    f"{_fmt(r.get('step_s'), '.3f')} | {_fmt(r.get('peak_allocated_gib'), '.2f')} | "
                    f"{_fmt(r.get('peak_reserved_gib'), '.2f')} | {losses} | {status} | `{_cell(r['command'])}` |")
    q = meta["ratios"]
    tail = ["", f"hfpatch vs one GPU (tokens/s per GPU): {_fmt(q['hfpatch_vs_one_gpu'], '.3f')}x; "
                f"hfpatch vs accelerate's CP (tokens/s per GPU): {_fmt(q['hfpatch_vs_accelerate'], '.3f')}x; on "
                f"accelerate's rows (unpacked, the same work): {_fmt(q.get('unpacked_hfpatch_vs_accelerate'), '.3f')}x.",
            "", "The one-GPU run trains packed rows with the model's own SDPA attention and a dense document mask "
                "(transformers builds it from the position ids): it computes every score of its row, where hfpatch's "
                "varlen kernel computes only each document's."]
    return "\n".join(head + body + tail) + "\n"


_USAGE_ERROR = re.compile(r"sft_cp\.py: error: (.*)")
_ERROR_LINE = re.compile(r"\b\w*(Error|Exception)\b:")


def failure(output: str, code: int) -> tuple:
    """(status, reason) of a launch that exited ``code`` without a record, from its ``output``: the example's
    refusal (a usage error, whatever exit status the launcher turned it into), out of memory, or the last error
    line other than the launcher's own summary."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    for line in lines:
        refusal = _USAGE_ERROR.search(line)
        if refusal:
            return "refused", refusal.group(1)
    errors = [line for line in lines if _ERROR_LINE.search(line) and "ChildFailedError" not in line]
    reason = (errors[-1] if errors else lines[-1] if lines else f"exit status {code}, no output")[-400:]
    if _OUT_OF_MEMORY.search(output):
        return "out of memory", reason
    return f"failed (exit {code})", reason


def launch(run: str, args, env: dict) -> dict:
    """Run one launch within ``--timeout``; its row (never raises for a failed run)."""
    slug = _SLUG[run]
    log_json = os.path.join(args.out, f"{args.tag}_{slug}.json")
    log_path = os.path.join(args.out, f"{args.tag}_{slug}.log")
    if os.path.exists(log_json):
        os.remove(log_json)
    cp = 1 if run == "one GPU" else args.cp
    command = launch_command(args.device, cp, log_json, run_arguments(run, args))
    print(f"[{run}] $ {' '.join(command)}", flush=True)
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, env=one_gpu(env) if cp == 1 else env, stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = process.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)      # the launcher and every rank it started
            process.wait()
            return row_of(run, cp, command, None, "timeout", f"no result within {args.timeout} s (--timeout)")
    record = None
    if os.path.exists(log_json):
        with open(log_json) as f:
            record = json.load(f)
    if code == 0 and record is not None:
        return row_of(run, cp, command, record, "ok")
    with open(log_path, errors="replace") as f:
        status, reason = failure(f.read(), code)
    return row_of(run, cp, command, record, status, reason)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    p.add_argument("--cp", type=int, default=2, help="GPUs (processes) of the CP runs")
    p.add_argument("--model", default="small", help="examples/trainer_cp.py's SIZES: small (~1B Llama) or tiny")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    p.add_argument("--tokens-per-gpu", type=int, default=32768)
    p.add_argument("--doc-len", type=int, default=2048, help="mean document length of the packed rows")
    p.add_argument("--steps", type=int, default=8, help="optimizer steps per run (the first is not timed)")
    p.add_argument("--timeout", type=int, default=300, help="seconds per launch")
    p.add_argument("--runs", default=",".join(_SLUG.values()),
                   help="comma-separated subset of " + ",".join(_SLUG.values()))
    p.add_argument("--out", required=True, help="folder of the result files and the launches' logs")
    p.add_argument("--tag", default=None, help="file stem (default sft_throughput_<model>_<T>_<dtype>)")
    args = p.parse_args(argv)
    chosen = args.runs.split(",")
    unknown = sorted(set(chosen) - set(_SLUG.values()))
    if unknown:
        p.error(f"--runs {args.runs}: unknown {unknown}; choose from {','.join(_SLUG.values())}")
    args.selected = [run for run in RUNS if _SLUG[run] in chosen]
    if args.cp < 2:
        p.error(f"--cp {args.cp}: the CP runs need 2 or more GPUs")
    if args.tokens_per_gpu % 2:
        p.error(f"--tokens-per-gpu {args.tokens_per_gpu}: must be even (the rows are split into 2 x cp chunks)")
    args.tag = args.tag or f"sft_throughput_{args.model}_{args.tokens_per_gpu}_{args.dtype}"
    return args


def _stamp(device: str, world: int) -> dict:
    return stamp(torch.device(device, 0) if device == "cuda" else torch.device("cpu"), world)


def main(argv=None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p),
               TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", HF_DATASETS_DISABLE_PROGRESS_BARS="1")
    meta = {"title": f"examples/sft_cp.py, {args.model} Llama, {args.tokens_per_gpu} tokens per GPU, {args.dtype}, "
                     f"{args.device}",
            "runs": f"hfpatch cp={args.cp} packed rows of {args.cp * args.tokens_per_gpu} tokens; one GPU packed rows "
                    f"of {args.tokens_per_gpu}; accelerate cp_size={args.cp} (SDPA) unpacked rows of "
                    f"{args.cp * args.tokens_per_gpu}, and hfpatch on those rows; documents of mean {args.doc_len} "
                    "in the packed rows; "
                    f"{args.steps} steps each, the first untimed",
            "argv": sys.argv if argv is None else argv, "stamp": None}
    rows: List[dict] = []
    for run in args.selected:
        rows.append(launch(run, args, env))
        print(f"[{run}] {rows[-1]['status']} {rows[-1]['reason']}".rstrip(), flush=True)
        _write(args, rows, meta)
    meta["stamp"] = _stamp(args.device, args.cp)
    text = _write(args, rows, meta)
    print(text, flush=True)
    return 0 if all(r["status"] == "ok" for r in rows) else 1


def _write(args, rows: List[dict], meta: dict) -> str:
    meta = dict(meta, ratios=ratios(rows), complete=meta["stamp"] is not None)
    with open(os.path.join(args.out, f"{args.tag}.json"), "w") as f:
        json.dump(dict(meta, rows=rows), f, indent=1, default=str)
    text = markdown(rows, meta)
    with open(os.path.join(args.out, f"{args.tag}.md"), "w") as f:
        f.write(text)
    return text


if __name__ == "__main__":
    sys.exit(main())
