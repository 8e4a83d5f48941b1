"""benchmarks/sft_cp_compare.py: examples/sft_cp.py with CP (torchrun, 2 gloo CPU processes) against the same
script without CP (one process) on the same global batches; the steps side by side, the verdict from
ring_kernels.tolerances' "cp" loss entry. Also: ``compare`` reports each way two logs can differ (a loss beyond the
entry, other batches, a CP run that did not run the ring in every layer of every step, other steps)."""
from __future__ import annotations

import copy
import importlib.util
import os
import subprocess
import sys

import pytest

for _module in ("accelerate", "trl", "datasets"):
    if importlib.util.find_spec(_module) is None:
        pytest.skip(f"examples/sft_cp.py needs {_module} (pip install 'hfpatch[trainer]')", allow_module_level=True)

from _paths import ROOT  # noqa: E402
from hfpatch.integrations import requirements  # noqa: E402

for _name, _minimum in (("transformers", requirements.TRANSFORMERS_MIN), ("accelerate", requirements.ACCELERATE_MIN),
                        ("trl", requirements.TRL_MIN)):
    _found = requirements.installed(_name)
    if _found is None or _found < _minimum:
        pytest.skip(f"hfpatch.integrations supports {_name}>={_minimum}; {_found} is installed",
                    allow_module_level=True)

sys.path.insert(0, str(ROOT / "benchmarks"))

import sft_cp_compare as sc  # noqa: E402


def _log(cp: int, losses, tokens=None, *, active=None, calls=None, dtype="float32") -> dict:
    tokens = tokens or [100 * (i + 1) for i in range(len(losses))]
    return {"cp": cp, "dp": 1, "dtype": dtype, "active": cp > 1 if active is None else active,
            "ring_calls": (2 * len(losses) if cp > 1 else 0) if calls is None else calls, "layers": 2,
            "steps": [{"step": i + 1, "loss": loss, "grad_norm": 1.0, "num_tokens": t}
                      for i, (loss, t) in enumerate(zip(losses, tokens))]}


def test_cpu_run_equals_the_run_without_cp(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sft_cp_compare.py"), "--device", "cpu",
                             "--out", str(tmp_path), "--", "--steps", "2"],
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = (tmp_path / "sft_cp_compare.md").read_text()
    assert "EQUAL within the table" in report and "cp/float32/loss" in report, report
    assert report.count("\n| ") == 3, report     # the header and 2 steps
    assert (tmp_path / "sft_cp_compare_cp2.json").exists() and (tmp_path / "sft_cp_compare_cp1.json").exists()


def test_compare_reports_every_difference():
    ref = _log(1, [4.0, 3.9])
    assert sc.compare(_log(2, [4.0, 3.9 * (1 + 5e-6)]), ref) == []
    assert "relative error" in sc.compare(_log(2, [4.0, 3.9 * (1 + 2e-5)]), ref)[0]          # fp32 entry: 1e-5
    assert sc.compare(_log(2, [4.0, 3.9 * (1 + 2e-5)], dtype="bfloat16"), _log(1, [4.0, 3.9], dtype="bfloat16")) == []
    assert "not the same batches" in sc.compare(_log(2, [4.0, 3.9], [100, 205]), ref)[0]
    assert "not the same batches" in sc.compare(_log(2, [4.0, 3.9], [100, 199]), ref)[0]
    # the zigzag padding: up to 2 x cp - 1 tokens more per row and step (the 2-GPU bf16 run: 16212 for 16211)
    assert sc.compare(_log(2, [4.0, 3.9], [103, 203]), ref) == []
    assert sc.compare(_log(4, [4.0, 3.9], [107, 207]), _log(1, [4.0, 3.9])) == []   # 7 + 0
    assert sc.compare(_log(4, [4.0, 3.9], [107, 214]), _log(1, [4.0, 3.9])) == []   # 7 + 7
    assert "did not run the ring" in sc.compare(_log(2, [4.0, 3.9], active=False), ref)[0]
    assert "attention calls" in sc.compare(_log(2, [4.0, 3.9], calls=3), ref)[0]
    fewer = copy.deepcopy(ref)
    fewer["steps"].pop()
    assert "logged steps differ" in sc.compare(_log(2, [4.0, 3.9]), fewer)[0]
    assert "| 2 | 200 | 3.90000000 |" in sc.table(_log(2, [4.0, 3.9]), ref)
