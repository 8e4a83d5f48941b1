"""What every example prints at its end: the throughput of each run, the losses of the run with CP beside those of
the same steps without CP (the largest relative difference and the verdict from ``ring_kernels.tolerances``' "cp"
loss entry of the run's dtype), and, with ``--plot FILE``, both loss curves in one picture.

matplotlib is optional: ``check_plot_argument`` refuses ``--plot`` without it (exit 2, before any work).
The examples import this module from their own folder, which Python puts first on ``sys.path`` for a script.
"""
from __future__ import annotations

import importlib.util
import math
import os
import sys
from dataclasses import asdict, dataclass
from typing import List, Optional, Sequence, Tuple

__all__ = ["Run", "timed_steps", "throughput_line", "compare", "check_plot_argument", "plot_losses"]


@dataclass(frozen=True)
class Run:
    """One training run as the report reads it.

    ``label`` names the run ("cp=2", "no CP"); ``losses``: the global loss of every optimizer step, step 1 first;
    ``tokens`` and ``seconds``: the tokens of the global batches of the timed steps and their wall time;
    ``timed``: which steps those are ("2-5": every step after the first, which pays one-time costs; "1" for a
    one-step run); ``processes``: how many processes ran it. ``peak_allocated_gib`` / ``peak_reserved_gib``: on
    CUDA, ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` since training began, the largest over the
    ranks, in GiB (None on CPU). ``loss_scale``: where the loss is a cancellation of larger terms (an RL loss: a mean
    of advantage-weighted terms whose advantages sum to zero in each group), the size of those terms; a step's
    difference is then measured against the larger of it and the loss (None: the loss)."""

    label: str
    losses: Tuple[float, ...]
    tokens: float
    seconds: float
    timed: str
    processes: int
    peak_allocated_gib: Optional[float] = None
    peak_reserved_gib: Optional[float] = None
    loss_scale: Optional[float] = None

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("nan")

    def to_dict(self) -> dict:
        return {**asdict(self), "losses": list(self.losses)}

    @classmethod
    def from_dict(cls, record: dict) -> "Run":
        return cls(**{**record, "losses": tuple(record["losses"])})


def timed_steps(count: int) -> Tuple[slice, str]:
    """The steps whose time the throughput counts, as (slice of the per-step lists, label): every step after the
    first when there are several, else the only one."""
    if count > 1:
        return slice(1, count), f"2-{count}" if count > 2 else "2"
    return slice(0, count), "1"


def throughput_line(run: Run) -> str:
    rate = run.tokens_per_second
    each = "" if run.processes == 1 else f", {rate / run.processes:,.0f} per process"
    plural = "es" if run.processes > 1 else ""
    memory = ("" if run.peak_allocated_gib is None else
              f"; peak memory {run.peak_allocated_gib:.2f} GiB allocated, {run.peak_reserved_gib:.2f} GiB reserved")
    return (f"throughput, {run.label}: {rate:,.0f} tokens/s on {run.processes} process{plural}{each} "
            f"({_steps(run.timed)}){memory}")


def compare(with_cp: Run, without_cp: Run, dtype: str) -> Tuple[List[str], bool]:
    """The report's lines and whether every step's loss agrees within the "cp" loss tolerance of ``dtype``."""
    from ring_kernels.tolerances import tolerance

    entry = tolerance("cp", dtype, "loss")
    lines = [f"CP vs no CP, the same global batches ({with_cp.label} on {with_cp.processes} processes, no CP on "
             f"{without_cp.processes}):",
             f"{'step':>4}  {'loss, ' + with_cp.label:>16}  {'loss, no CP':>16}  relative difference"]
    if len(with_cp.losses) != len(without_cp.losses) or not with_cp.losses:
        lines.append(f"the runs logged {len(with_cp.losses)} and {len(without_cp.losses)} steps: nothing to compare")
        return lines, False
    worst, agree = 0.0, True
    for step, (a, b) in enumerate(zip(with_cp.losses, without_cp.losses), 1):
        scale = max(abs(b), without_cp.loss_scale or 0.0)   # the loss's own measure: max_relative
        relative = abs(a - b) / scale if scale else (0.0 if a == b else math.inf)
        worst = max(worst, relative)
        agree = agree and relative <= entry.bound
        lines.append(f"{step:>4}  {a:>16.8f}  {b:>16.8f}  {relative:.2g}")
    verdict = "CP matches no CP" if agree else "CP DIFFERS from no CP"
    measured = "" if without_cp.loss_scale is None else f" (to the loss's terms' scale, {without_cp.loss_scale:.3g})"
    lines.append(f"largest relative difference{measured} {worst:.2g}, bound {entry.bound:g} ({dtype} loss, "
                 f"ring_kernels.tolerances): {verdict}")
    ratio = with_cp.tokens_per_second / without_cp.tokens_per_second if without_cp.tokens_per_second else float("nan")
    lines.append(f"throughput: {with_cp.label} {with_cp.tokens_per_second:,.0f} tokens/s on {with_cp.processes} "
                 f"processes, no CP {without_cp.tokens_per_second:,.0f} tokens/s on {without_cp.processes}: "
                 f"{ratio:.2f}x ({_steps(with_cp.timed)})")
    return lines, agree


def _steps(timed: str) -> str:
    return f"steps {timed}" if "-" in timed else f"step {timed}"


def check_plot_argument(path: Optional[str], prog: str) -> None:
    """Exit 2 with a one-line cause and fix when ``--plot`` cannot be written: matplotlib missing, or no such
    folder. Call it before any work; every rank exits, rank 0 prints."""
    problem = None
    if path and importlib.util.find_spec("matplotlib") is None:
        problem = "--plot needs matplotlib, which is not installed. Fix: pip install matplotlib"
    elif path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        problem = f"--plot {path}: the folder {os.path.dirname(os.path.abspath(path))} does not exist"
    if problem is None:
        return
    if os.environ.get("RANK", "0") == "0":
        print(f"{prog}: {problem}", file=sys.stderr, flush=True)
    sys.exit(2)


def plot_losses(path: str, runs: Sequence[Run], title: str) -> None:
    """The loss per optimizer step of each run, one picture (format from ``path``'s suffix, e.g. .png, .svg)."""
    import matplotlib

    matplotlib.use("Agg")   # files only, no display
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    styles = ({"marker": "o", "linestyle": "-"}, {"marker": "x", "linestyle": "--"})
    figure, axes = plt.subplots(figsize=(6.4, 4.0))
    for run, style in zip(runs, styles * len(runs)):
        axes.plot(range(1, len(run.losses) + 1), run.losses, label=run.label, **style)
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.set_xlabel("optimizer step")
    axes.set_ylabel("training loss")
    axes.set_title(title)
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
