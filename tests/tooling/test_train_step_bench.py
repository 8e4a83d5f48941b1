"""benchmarks/train_step.py measures a correct step: on 2 gloo CPU processes, tiny Llama, fp32.

1. The hfpatch mode's step -- FSDP2 (fully_shard per decoder layer + root, over both ranks; it runs on CPU gloo with
   this torch), full activation checkpointing, ``patch.shard_inputs``, the chunked LM-head loss, ``reduce_loss`` and
   the backward on ``loss x world`` -- gives the loss and the parameter gradients (``DTensor.full_tensor()`` of the
   FSDP2-reduced gradients) of one process running the whole sequence without CP (eager attention, the full logits
   and transformers' own loss convention), batch and packed documents; every decoder layer ran the ring.
2. The script's CLI (``main``) on the same world: every mode gives a row -- hfpatch rows measured, with the loss of
   the non-CP step; native rows ``unavailable`` with the reason (PyTorch's context_parallel needs CUDA) instead of a
   crash; single rows measured (same loss) where transformers has an AttentionInterface (4.48+), else unavailable
   with that reason -- and the JSON and markdown files carry the stamp and the FLOP formula.

Tolerances: ring_kernels.tolerances' "cp" entries (fp32 loss 1e-5 relative, gradients 2e-5 of each parameter's
largest entry).
"""
from __future__ import annotations

import json
import sys

import torch

from _dist import run_world
from _paths import BENCHMARKS
from hfpatch.cli.demo_models import reference_logits
from hfpatch.inputs import shift_labels, token_loss_sum
from ring_kernels.tolerances import assert_close, tolerance

_BENCH = str(BENCHMARKS)
sys.path.insert(0, _BENCH)

import train_step as ts  # noqa: E402

WORLD = 2
TOKENS = 64                      # per rank
TINY = ["--device", "cpu", "--dtype", "fp32", "--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2",
        "--intermediate", "128", "--vocab", "256", "--seq-per-gpu", str(TOKENS), "--loss-chunk", "48"]
SHAPE = ts.ModelShape(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab=256)
LOSS = tolerance("cp", torch.float32, "loss")
GRAD = tolerance("cp", torch.float32, "grad")


def _name(name: str) -> str:
    """A ChunkedLoss parameter's name as the bare LlamaForCausalLM names it."""
    return name.replace("_checkpoint_wrapped_module.", "").removeprefix("model.")


def _world(rank, world, out_dir):
    args = ts.parse_args(TINY + ["--optimizer", "none"])
    device = torch.device("cpu")
    runner = ts.make_runner("hfpatch", args, SHAPE, device, torch.float32)
    steps = {}
    try:
        for layout in ts.LAYOUTS:
            data = ts.step_data(layout, TOKENS, world, SHAPE.vocab, device)
            runner.setup(data, {"layout": layout})
            loss = runner.step(data)
            # numpy: tensors would travel to the parent through shared memory that dies with this process
            grads = {_name(n): p.grad.full_tensor().numpy() for n, p in runner.loss_module.named_parameters()}
            steps[layout] = {"loss": loss.item(), "grads": grads, "backend": runner.backend(),
                             "ring_layers": runner.extra()["ring_layers"],
                             "layout_choices": runner.extra()["layout_choices"]}
    finally:
        runner.close()
    code = ts.main(TINY + ["--modes", "hfpatch,keep,native,single", "--steps", "1", "--warmup", "0", "--optimizer",
                           "sgd", "--keep-budget", "all", "--out", out_dir, "--tag", "cpu_test"])
    return {"code": code, "steps": steps} if rank == 0 else None


def _reference(layout: str, world: int = WORLD):
    """Loss and gradients of one process on the whole sequence of ``world`` ranks' tokens without CP (eager
    attention, full logits)."""
    model = ts.build_model(SHAPE, torch.device("cpu"), torch.float32, attn_implementation="eager")
    data = ts.step_data(layout, TOKENS, world, SHAPE.vocab, torch.device("cpu"))
    logits = reference_logits(model, data.input_ids, data.docs if layout == "packed" else None)
    loss_sum, count = token_loss_sum(logits, shift_labels(data.labels))
    assert int(count) == data.count
    loss = loss_sum / count
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_train_step_benchmark_measures_a_correct_step(tmp_path):
    result = run_world(WORLD, _world, str(tmp_path), timeout=240)[0]
    references = {layout: _reference(layout) for layout in ts.LAYOUTS}
    for layout, (ref_loss, ref_grads) in references.items():
        got = result["steps"][layout]
        assert_close(torch.tensor(got["loss"]), ref_loss, LOSS, f"{layout}: FSDP2+CP loss {got['loss']:.8f} vs "
                                                                f"non-CP {ref_loss.item():.8f}")
        assert set(got["grads"]) == set(ref_grads), sorted(set(got["grads"]) ^ set(ref_grads))
        for name, ref in ref_grads.items():
            assert_close(torch.from_numpy(got["grads"][name]), ref, GRAD, f"{layout}: gradient of {name}")
        assert got["ring_layers"] == SHAPE.layers, got
        expected_kernel = "zigzag" if layout == "batch" else "llama3"
        assert got["backend"].startswith(expected_kernel + " x torch_cpu"), got["backend"]
        # kernel="auto" (the benchmark's default) decided this case alone: no calibration on a CPU group
        [decision] = got["layout_choices"]
        assert decision["kernel"] == expected_kernel and decision["steps"] >= 1, decision
        assert "no layout-cost calibration for this device" in decision["reason"], decision

    assert result["code"] == 0
    with open(tmp_path / "cpu_test.json") as f:
        report = json.load(f)
    assert report["complete"] is True
    assert report["stamp"]["world_size"] == WORLD and report["stamp"]["git_commit"]
    assert report["flop_formula"] == ts.FLOP_FORMULA and "6*P*T" in report["flop_formula"]
    rows = {(r["mode"], r["layout"]): r for r in report["rows"]}
    assert set(rows) == {(m, layout) for m in ts.MODES for layout in ts.LAYOUTS}, sorted(rows)
    no_attention_interface = ts.attention_interface_unavailable()
    for (mode, layout), row in rows.items():
        what = f"{mode}/{layout}: {row}"
        if mode == "native":
            assert row["status"] == "unavailable", what
            assert ("AttentionInterface" if no_attention_interface else "CUDA") in row["reason"], what
            continue
        if mode == "single" and no_attention_interface:
            assert row["status"] == "unavailable" and "AttentionInterface" in row["reason"], what
            continue
        assert row["status"] == "ok", what
        assert row["gpus"] == (1 if mode == "single" else WORLD), what
        assert row["tokens_per_gpu"] == TOKENS and row["step_ms"] > 0 and row["mfu"] is None, what
        # The first step runs before any update: its loss is the non-CP loss of the same model and data (single:
        # one rank's tokens).
        expected = references[layout][0] if mode in ("hfpatch", "keep") else _reference(layout, world=1)[0]
        assert_close(torch.tensor(row["loss_first"]), expected, LOSS, what)
        assert len(row["rank_step_ms"]) == WORLD and "slow" not in row or row["slow"].startswith("SLOW"), what
        if mode == "keep":   # every decoder layer's recomputation took its kept attention output
            assert row["keep"]["replayed"] == row["keep"]["kept"] > 0 and row["keep"]["gaps"] == 0, what
    markdown = (tmp_path / "cpu_test.md").read_text()
    assert ts.FLOP_FORMULA in markdown and "unavailable:" in markdown


def test_a_slow_machine_or_rank_is_named_not_averaged():
    """``slow_reason``: an MFU under the floor, far under the run's best, or one rank much slower than the others."""
    good = dict(status="ok", mfu=0.37, rank_step_ms=[8550.0, 8549.0])
    assert ts.slow_reason(good, []) is None
    assert ts.slow_reason(dict(good, mfu=0.35), [good]) is None
    three_times = ts.slow_reason(dict(good, mfu=0.12, rank_step_ms=[45100.0, 45000.0]), [good])
    assert three_times.startswith("SLOW: MFU 12.0% < 20%") and "gpu_facts" in three_times
    relative = ts.slow_reason(dict(good, mfu=0.21), [good])
    assert "MFU 21.0% < 60% of this run's best (37.0%)" in relative
    rank = ts.slow_reason(dict(good, rank_step_ms=[8550.0, 11000.0]), [good])
    assert "rank 1 11000 ms against 8550 ms for the fastest" in rank
    assert ts.slow_reason(dict(good, mfu=None, rank_step_ms=None), [good]) is None   # CPU rows: no MFU
