"""``hfpatch demo``: the README's main-job command runs from the command line, prints both losses and the largest
gradient difference, and its exit status says whether CP matched non-CP."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from hfpatch.cli import main
from hfpatch.cli.demo_world import GRAD_RTOL, LOSS_RTOL, StepResult, report


def test_demo_command_agrees_and_exits_0():
    proc = subprocess.run([sys.executable, "-m", "hfpatch", "demo", "--world-size", "2", "--steps", "2"],
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out}\n{proc.stderr[-3000:]}"
    steps = re.findall(r"step (\d): loss non-CP (\S+)\s+CP (\S+)\s+\|diff\| (\S+)\s+max grad diff (\S+)", out)
    assert [s[0] for s in steps] == ["1", "2"], out
    for _, ref, cp, _, grad in steps:
        assert abs(float(cp) - float(ref)) <= LOSS_RTOL * abs(float(ref))
        assert float(grad) < 1e-4
    assert steps[0][1] != steps[1][1], "the second step must train on an updated model and new data"
    assert "OK: CP matches non-CP" in out


def test_report_exit_status(capsys):
    good = StepResult(1, loss_reference=4.0, loss_cp=4.0 + 1e-6, grad_max_diff=1e-7, grad_scale=0.5)
    assert report([good], 1.0) == 0
    bad_loss = StepResult(1, loss_reference=4.0, loss_cp=4.0 * (1 + 10 * LOSS_RTOL), grad_max_diff=0.0, grad_scale=1.0)
    bad_grad = StepResult(2, loss_reference=4.0, loss_cp=4.0, grad_max_diff=10 * GRAD_RTOL, grad_scale=1.0)
    assert report([good, bad_loss], 1.0) == 1
    assert report([bad_grad], 1.0) == 1
    assert "MISMATCH" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["demo", "--world-size", "0"], ["demo", "--steps", "x"], ["demo", "--model", "gpt9"]])
def test_bad_arguments_are_refused(argv, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert "demo" in capsys.readouterr().err
