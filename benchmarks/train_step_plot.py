"""Plot benchmarks/train_step.py results: tokens per second per GPU (or MFU) of every ok row, grouped by the job's
GPUs, tokens per GPU and layout, one bar per mode (the median over the files given for the same point, whiskers at
the other runs).

    python benchmarks/train_step_plot.py benchmarks/results/train_step_2xH200_*.json --out PLOT.png
    python benchmarks/train_step_plot.py A.json B.json --metric mfu --out PLOT.png   # MFU: the one-GPU ceiling's
                                                                                    # fewer layers compare too

Needs matplotlib (``pip install matplotlib``); without it the script exits 2 saying so.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from typing import Dict, List, Tuple

__all__ = ["points", "plot", "main"]

MODE_ORDER = ("single", "native", "hfpatch", "keep")
MODE_LABEL = {"single": "one GPU (ceiling)", "native": "PyTorch native CP", "hfpatch": "hfpatch",
              "keep": "hfpatch + keep_attention"}


METRICS = {"tokens": ("tokens_per_s_per_gpu", "tokens / s per GPU (higher is better)", "{:.0f}"),
           "mfu": ("mfu", "MFU, % of dense bf16 peak (higher is better)", "{:.1f}")}


def points(files: List[str], metric: str = "tokens") -> Dict[Tuple[int, str, int, str], List[float]]:
    """(the job's GPUs, layout, tokens per GPU, mode) -> ``metric`` ("tokens": tokens/s per GPU; "mfu": percent) of
    every ok row with that key, over ``files``. The job's GPUs are its world size (a one-GPU row of a 4-GPU job
    counts under 4), or the row's own count in a file without one."""
    field = METRICS[metric][0]
    scale = 100.0 if metric == "mfu" else 1.0
    found: Dict[Tuple[int, str, int, str], List[float]] = defaultdict(list)
    for path in files:
        with open(path) as f:
            report = json.load(f)
        for row in report["rows"]:
            if row.get("status") == "ok":
                world = report.get("world_size", row.get("gpus", 1))
                found[(world, row["layout"], row["tokens_per_gpu"], row["mode"])].append(row[field] * scale)
    return dict(found)


def plot(found: Dict[Tuple[int, str, int, str], List[float]], title: str, out: str, metric: str = "tokens") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({key[:3] for key in found})
    modes = [m for m in MODE_ORDER if any(key[3] == m for key in found)]
    label, number = METRICS[metric][1], METRICS[metric][2]
    width = 0.8 / max(1, len(modes))
    fig, ax = plt.subplots(figsize=(1.8 + 1.6 * len(groups), 4.2))
    for i, mode in enumerate(modes):
        xs, heights, low, high = [], [], [], []
        for g, group in enumerate(groups):
            values = found.get((*group, mode))
            if not values:
                continue
            middle = statistics.median(values)
            xs.append(g + (i - (len(modes) - 1) / 2) * width)
            heights.append(middle)
            low.append(middle - min(values))
            high.append(max(values) - middle)
        ax.bar(xs, heights, width, yerr=[low, high], capsize=3, label=MODE_LABEL.get(mode, mode))
        for x, h in zip(xs, heights):
            ax.text(x, h, number.format(h), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(groups)))
    several = len({world for world, _, _ in groups}) > 1
    ax.set_xticklabels([(f"{world} GPUs\n" if several else "") + f"{tokens // 1024}k {layout}"
                        for world, layout, tokens in groups])
    ax.set_ylabel(label)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("files", nargs="+", help="train_step.py JSON results")
    p.add_argument("--out", required=True, help="the PNG to write")
    p.add_argument("--title", default="Llama-3-8B training step (FSDP2, full checkpointing, bf16)")
    p.add_argument("--metric", choices=tuple(METRICS), default="tokens",
                   help="tokens: tokens/s per GPU; mfu: model FLOP utilisation (default tokens)")
    args = p.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("train_step_plot: needs matplotlib (pip install matplotlib)", file=sys.stderr)
        return 2
    found = points(args.files, args.metric)
    if not found:
        print(f"train_step_plot: no ok row in {args.files}", file=sys.stderr)
        return 1
    plot(found, args.title, args.out, args.metric)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
