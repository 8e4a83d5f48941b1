"""CI runs ``examples/train_cp.py`` as a user would: ``torchrun --nproc-per-node 4`` on CPU (gloo), dp=2 x cp=2,
FSDP2 over dp, hfpatch over cp, packed documents, activation checkpointing, three AdamW steps, then the same steps
without CP on the same mesh. The losses of its CP run must equal a single-process, non-CP run of the same model on
the same global batch, computed here from the example's own model and data functions (each document on its own:
the definition of independent documents on every transformers release). Tolerance: 1e-5 relative per step (fp32;
CP differs by rounding only, measured ~5e-8). The example's own comparison with its run without CP must say that
they match. tests/integrations/test_examples.py runs every example on 2 processes (under the CI pin).
"""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest
import torch

from _paths import ROOT
from hfpatch.inputs import shift_labels, token_loss_sum

EXAMPLE = ROOT / "examples" / "train_cp.py"
ARGS = ["--steps", "3", "--seq-len", "64", "--checkpointing"]
DP = 2
LOSS_RTOL = 1e-5


def _example_module():
    if str(EXAMPLE.parent) not in sys.path:   # the example imports its helpers from its own folder
        sys.path.insert(0, str(EXAMPLE.parent))
    spec = importlib.util.spec_from_file_location("train_cp_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _reference_losses(example, args) -> list:
    """Non-CP, one process: per step the mean over the dp replicas of each replica's token-mean loss; AdamW."""
    model = example.build_model(args, torch.device("cpu"), torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    losses = []
    for step in range(args.steps):
        total = 0.0
        for dp_index in range(DP):
            ids, pos, labels = example.packed_row(step, dp_index, args, model.config.vocab_size)
            starts = (pos[0] == 0).nonzero().flatten().tolist() + [ids.shape[1]]
            logits = torch.cat([model(input_ids=ids[:, a:b], position_ids=pos[:, a:b], use_cache=False).logits
                                for a, b in zip(starts, starts[1:])], dim=1)
            loss_sum, count = token_loss_sum(logits, shift_labels(labels))
            total = total + loss_sum / count
        loss = total / DP
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _run_example(extra=()) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", str(EXAMPLE),
           *ARGS, *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert done.returncode == 0, f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr[-6000:]}"
    return done.stdout


def test_example_runs_with_torchrun_and_matches_single_process():
    out = _run_example()
    both = [float(x) for x in re.findall(r"^step \d+/\d+  loss (\S+)", out, flags=re.M)]
    assert len(both) == 6, out     # the CP run's steps, then those of the run without CP
    losses = both[:3]
    assert "mesh dp=2 x cp=2" in out and "CP: <hfpatch.Patch" in out, out
    assert re.search(r"^summary: cp dp=2 cp=2 seq=64 .*checkpointing=True", out, flags=re.M), out
    assert re.search(r"^summary: no-cp dp=2 cp=2 seq=64 .*checkpointing=True", out, flags=re.M), out
    assert re.search(r"^largest relative difference \S+, bound 1e-05 .*: CP matches no CP$", out, flags=re.M), out
    assert re.search(r"^throughput: cp=2 [\d,]+ tokens/s on 4 processes, no CP [\d,]+ tokens/s on 4: ", out,
                     flags=re.M), out
    example = _example_module()
    reference = _reference_losses(example, example.parse_args(ARGS))
    for step, (got, want) in enumerate(zip(losses, reference), 1):
        assert abs(got - want) <= LOSS_RTOL * abs(want), f"step {step}: example {got:.8f} != reference {want:.8f}"
    assert losses[-1] < losses[0], f"the loss did not fall: {losses}"


def test_example_rejects_a_mesh_that_does_not_fit():
    example = _example_module()
    args = example.parse_args(["--dp", "3"])
    assert args.dp == 3
    with pytest.raises(SystemExit, match="torchrun"):
        env_rank = os.environ.pop("RANK", None)
        try:
            example.init_distributed(args)
        finally:
            if env_rank is not None:
                os.environ["RANK"] = env_rank
