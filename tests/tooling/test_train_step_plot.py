"""benchmarks/train_step_plot.py: the rows of several train_step.py runs grouped per point, and the plot's need for
matplotlib. (Not in test_benchmarks_cpu.py: the plot names hfpatch's modes, which the release-independence check
reads as a reach into hfpatch.)"""
from __future__ import annotations

import json
import sys

from _paths import BENCHMARKS

_BENCH = str(BENCHMARKS)
if _BENCH not in sys.path:
    sys.path.insert(0, _BENCH)

import train_step_plot as tsp  # noqa: E402


def test_train_step_plot_groups_rows_and_needs_matplotlib(tmp_path, monkeypatch):
    rows = [dict(status="ok", layout="batch", tokens_per_gpu=32768, mode="keep", tokens_per_s_per_gpu=4274.0,
                 mfu=0.41, gpus=2),
            dict(status="ok", layout="batch", tokens_per_gpu=32768, mode="native", tokens_per_s_per_gpu=3627.0,
                 mfu=0.34, gpus=2),
            dict(status="ok", layout="batch", tokens_per_gpu=32768, mode="single", tokens_per_s_per_gpu=17800.0,
                 mfu=0.36, gpus=1),
            dict(status="unavailable", layout="packed", tokens_per_gpu=32768, mode="native")]
    files = []
    for i, speed in enumerate((4274.0, 4311.0)):
        path = tmp_path / f"run{i}.json"
        path.write_text(json.dumps({"world_size": 2, "rows": [dict(rows[0], tokens_per_s_per_gpu=speed), *rows[1:]]}))
        files.append(str(path))
    four = tmp_path / "four.json"                 # another job's GPU count is another point; no world_size: the row's
    four.write_text(json.dumps({"rows": [dict(rows[0], gpus=4)]}))
    assert tsp.points(files + [str(four)]) == {
        (2, "batch", 32768, "keep"): [4274.0, 4311.0], (2, "batch", 32768, "native"): [3627.0] * 2,
        (2, "batch", 32768, "single"): [17800.0] * 2, (4, "batch", 32768, "keep"): [4274.0]}
    assert tsp.points(files, "mfu")[(2, "batch", 32768, "single")] == [36.0, 36.0]
    monkeypatch.setitem(sys.modules, "matplotlib", None)          # as on a machine without it
    assert tsp.main(files + ["--out", str(tmp_path / "plot.png")]) == 2
