"""benchmarks/hybrid_step.py measures a correct step: on 2 gloo CPU processes, tiny Qwen3.5-text and Nemotron-H
hybrids (the script's ``--size tiny``), fp32.

1. For each family, the hfpatch mode's step -- FSDP2 (fully_shard per decoder layer + root over both ranks), full
   activation checkpointing, ``patch.shard_inputs``, the chunked LM-head loss, ``reduce_loss`` and the backward on
   ``loss x world`` -- gives the loss and the parameter gradients (``DTensor.full_tensor()`` of the FSDP2-reduced
   gradients) of one process running the whole sequence without CP (eager attention, full logits); every mixer
   module is in ``Patch.mixers.modules`` and each of its sequence kernels (the convolution and the delta rule /
   the SSD scan) ran its CP form in the step, per mixer layer, in the forward and its recomputation.
2. ``Patch.mixers`` is None once the patch is removed.
3. The script's CLI (``main``) on the same world, Qwen3.5: the hfpatch row is measured, with the loss of the
   non-CP step, an exchange share from a run whose stand-in replaced the exchange, a "mixers local" time from a
   run with the kernels swapped back, and the exchange bytes equal to the summaries' sizes (per rank and call:
   the delta rule's (B, Hv, dk, dk + dv) and the convolution's (B, conv channels, K - 1), fp32, one per zigzag
   segment); the single row has the non-CP loss of one rank's tokens (where transformers has an
   AttentionInterface, 4.48+); the JSON and markdown carry the stamp and the native-CP statement.

Tolerances: the loss within ring_kernels.tolerances' "cp" entry (fp32, 1e-5 relative); the gradients within the
"sweep" entry, the project's entry for these mixer families (each parameter within 1e-4 of its own largest entry
plus 1e-6 of the model's largest gradient): the gates of the first Gated DeltaNet layer (``dt_bias``, ``A_log``) get
gradients of ~1e-8, 1e-7 of the model's largest, where the fp32 rounding of the recurrence composed from per-segment
summaries is as large as the gradient itself, so the "cp" entry's per-parameter bound alone cannot tell rounding
from error there. A family whose classes this transformers lacks, or whose mixer code hfpatch's registry has not
read for this release (it refuses them by name; the registry's own tests cover that), is skipped with the reason.
"""
from __future__ import annotations

import json
import sys

import pytest
import torch

from _dist import run_world
from _paths import BENCHMARKS
from hfpatch.inputs import shift_labels, token_loss_sum
from hfpatch.mixers import recognise, unrecognised_reason
from ring_kernels.tolerances import assert_close, tolerance

_BENCH = str(BENCHMARKS)
sys.path.insert(0, _BENCH)

import hybrid_step as hs  # noqa: E402
import train_step as ts  # noqa: E402

WORLD = 2
TOKENS = 64                      # per rank
TINY = ["--device", "cpu", "--dtype", "fp32", "--size", "tiny", "--seq-per-gpu", str(TOKENS), "--loss-chunk", "48"]
FAMILIES = tuple(hs.FAMILIES)
LOSS = tolerance("cp", torch.float32, "loss")
GRAD = tolerance("sweep", torch.float32, "grad")
# The sequence kernels each family's mixer calls in a training forward under CP (the fused Mamba2 kernel returns
# None under CP, so the mixer takes its convolution and scan).
KERNEL_ROLES = {"qwen3_5": ("causal_conv1d", "chunk_gated_delta_rule"),
                "nemotron_h": ("mamba2_split_conv1d_scan", "causal_conv1d", "ssd_chunk_scan")}


def _args(family: str, *more: str):
    return hs.parse_args(TINY + ["--family", family] + list(more))


def family_skip_reason(family: str):
    """Why ``family`` cannot be checked on this release (None when it can)."""
    reason = hs.family_unavailable(family)
    if reason:
        return reason
    model = hs.build_model(_args(family), torch.device("cpu"), torch.float32)
    mixers = [m for m in model.modules() if type(m).__name__ == hs.FAMILIES[family].mixer_class]
    assert mixers, f"{family}: the tiny model has no {hs.FAMILIES[family].mixer_class}"
    if recognise(mixers[0]) is None:
        return f"hfpatch's mixer registry does not know this release's mixer: {unrecognised_reason(mixers[0])}"
    return None


def _name(name: str) -> str:
    """A ChunkedLoss parameter's name as the bare causal LM names it."""
    return name.replace("_checkpoint_wrapped_module.", "").removeprefix("model.")


def _cp_step(family: str, world: int) -> dict:
    args = _args(family, "--optimizer", "none")
    device = torch.device("cpu")
    runner = hs.make_runner("hfpatch", args, device, torch.float32)
    try:
        data = ts.step_data("batch", TOKENS, world, args.vocab_size, device)
        runner.patch.mixers.calls.clear()
        loss = runner.step(data)
        mixers = runner.patch.mixers
        expected_mixers = [n.replace("_checkpoint_wrapped_module.", "") for n, m in runner.model.named_modules()
                           if type(m).__name__ == hs.FAMILIES[family].mixer_class]
        # numpy: tensors would travel to the parent through shared memory that dies with this process
        grads = {_name(n): p.grad.full_tensor().numpy() for n, p in runner.loss_module.named_parameters()}
        result = {"loss": loss.item(), "grads": grads, "mixer_paths": [p for p, _, _ in mixers.modules],
                  "expected_mixers": expected_mixers, "calls": dict(mixers.calls),
                  "kernels": runner.info()["mixer_kernels"]}
    finally:
        runner.close()
    result["mixers_after_remove"] = runner.patch.mixers
    return result


def _world(rank, world, out_dir, families):
    steps = {family: _cp_step(family, world) for family in families}
    code = None
    if "qwen3_5" in families:
        code = hs.main(TINY + ["--family", "qwen3_5", "--modes", "hfpatch,single", "--steps", "1", "--warmup", "0",
                               "--optimizer", "sgd", "--out", out_dir, "--tag", "cpu_test"])
    return {"code": code, "steps": steps} if rank == 0 else None


def _reference(family: str, world: int = WORLD):
    """Loss and gradients of one process on the whole sequence of ``world`` ranks' tokens without CP (eager
    attention, full logits)."""
    args = _args(family)
    model = hs.build_model(args, torch.device("cpu"), torch.float32)
    data = ts.step_data("batch", TOKENS, world, args.vocab_size, torch.device("cpu"))
    logits = model(input_ids=data.input_ids, use_cache=False).logits
    loss_sum, count = token_loss_sum(logits, shift_labels(data.labels))
    assert int(count) == data.count
    loss = loss_sum / count
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, model.config


def _summary_bytes(config) -> dict:
    """Bytes per rank and exchange call of the tiny Qwen3.5 (fp32 summaries, 2 zigzag segments per rank)."""
    dk, dv, hv = config.linear_key_head_dim, config.linear_value_head_dim, config.linear_num_value_heads
    conv_channels = 2 * config.linear_num_key_heads * dk + hv * dv
    return {"chunk_gated_delta_rule": 2 * hv * dk * (dk + dv) * 4,
            "causal_conv1d": 2 * conv_channels * (config.linear_conv_kernel_dim - 1) * 4}


@pytest.fixture(scope="module")
def world_result(tmp_path_factory):
    """One 2-rank world for the module: every family this release can check, then the CLI (Qwen3.5)."""
    skipped = {family: family_skip_reason(family) for family in FAMILIES}
    families = tuple(f for f in FAMILIES if skipped[f] is None)
    out = tmp_path_factory.mktemp("hybrid_step")
    result = run_world(WORLD, _world, str(out), families, timeout=240)[0] if families else None
    return {"skipped": skipped, "result": result, "out": out}


@pytest.mark.parametrize("family", FAMILIES)
def test_hfpatch_step_equals_the_non_cp_step(world_result, family):
    if world_result["skipped"][family]:
        pytest.skip(world_result["skipped"][family])
    got = world_result["result"]["steps"][family]
    ref_loss, ref_grads, _ = _reference(family)
    assert_close(torch.tensor(got["loss"]), ref_loss, LOSS, f"{family}: FSDP2+CP loss {got['loss']:.8f} vs "
                                                            f"non-CP {ref_loss.item():.8f}")
    assert set(got["grads"]) == set(ref_grads), sorted(set(got["grads"]) ^ set(ref_grads))
    largest = max(float(g.abs().max()) for g in ref_grads.values())
    for name, ref in ref_grads.items():
        assert_close(torch.from_numpy(got["grads"][name]), ref, GRAD, f"{family}: gradient of {name}",
                     largest=largest)
    assert got["mixer_paths"] and got["mixer_paths"] == got["expected_mixers"], got["mixer_paths"]
    layers = len(got["expected_mixers"])
    for role in KERNEL_ROLES[family]:   # each mixer layer, forward + the checkpoint's recomputation
        assert got["calls"].get((role, "ring")) == 2 * layers, (family, role, got["calls"])
    ran = {k["role"] for k in got["kernels"] if k["cp_calls"]}
    assert ran == set(KERNEL_ROLES[family]), (family, got["kernels"])
    assert got["mixers_after_remove"] is None


def test_cli_rows_measure_the_exchange(world_result):
    if world_result["skipped"]["qwen3_5"]:
        pytest.skip(world_result["skipped"]["qwen3_5"])
    result, tmp_path = world_result["result"], world_result["out"]
    assert result["code"] == 0
    report = json.loads((tmp_path / "cpu_test.json").read_text())
    assert report["complete"] is True
    assert report["stamp"]["world_size"] == WORLD and report["stamp"]["git_commit"]
    assert report["model"]["class"] == "Qwen3_5ForCausalLM" and report["model"]["parameters"] > 0
    rows = {r["mode"]: r for r in report["rows"]}
    assert set(rows) == {"hfpatch", "single"}, report["rows"]
    ref_loss, _, config = _reference("qwen3_5")

    cp = rows["hfpatch"]
    assert cp["status"] == "ok" and cp["gpus"] == WORLD and cp["tokens_per_gpu"] == TOKENS, cp
    assert_close(torch.tensor(cp["loss_first"]), ref_loss, LOSS, f"hfpatch row: {cp}")
    assert cp["no_exchange"]["status"] == "ok" and cp["no_exchange"]["replaced_calls"] > 0, cp["no_exchange"]
    assert cp["mixers_local"]["status"] == "ok" and cp["mixers_local"]["swapped_sites"] == 2, cp["mixers_local"]
    assert isinstance(cp["exchange_share"], float) and isinstance(cp["mixer_cp_share"], float), cp
    sent = cp["exchange_bytes"]
    assert {role: v["bytes_per_rank_per_call"] for role, v in sent["by_role"].items()} == _summary_bytes(config)
    assert sent["mixer_layers"] == 3 and sent["per_layer_sent_bytes"] == sum(_summary_bytes(config).values())

    single = rows["single"]
    if ts.attention_interface_unavailable():
        assert single["status"] == "unavailable" and "AttentionInterface" in single["reason"], single
    else:
        assert single["status"] == "ok" and single["gpus"] == 1, single
        assert_close(torch.tensor(single["loss_first"]), _reference("qwen3_5", world=1)[0], LOSS,
                     f"single row: {single}")
        assert "exchange_share" not in single
    markdown = (tmp_path / "cpu_test.md").read_text()
    assert hs.NATIVE_CP_NOTE in markdown and "exchange per mixer layer" in markdown
