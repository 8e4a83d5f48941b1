"""``hfpatch.integrations`` end to end: transformers' Trainer and TRL's SFTTrainer with accelerate's
``ParallelismConfig``, launched as a user launches them (``torchrun``, ``accelerate launch``), on gloo CPU processes.

Every case of ``tests/integrations/_trainer_cases.py`` (model family x trainer kind) trains 3 optimiser steps of 2
accumulated micro-batches with SGD and gradient clipping, once with CP through ``hfpatch.integrations.enable`` and
once without CP (the same script, same seed, same global batches: the trainer with ``cp_size=1``). Per step the
logged loss and grad norm, and the final parameters, must be equal (fp32: loss and grad norm within 1e-5 relative,
parameters within 2e-6; measured over all 18 pairs: loss 1.7e-7 and grad norm 3.6e-7 relative, parameters
1.2e-7 absolute), and the CP run must have run the ring in
every attention layer of every micro-batch. Evaluation too (``hfpatch.integrations.evaluation``): every eval loss
(evaluation during training at steps 2 and 3, then ``trainer.evaluate()``) and ``predict()``'s loss within 1e-5
relative, ``predict()``'s whole-sequence logits within 5e-5 absolute at every labelled position (padded positions
of right-padded rows are not compared: the non-CP model attends with the padding mask there), the labels equal,
no logits gathered by ``evaluate()`` (loss only), one gather per batch by ``predict()`` (measured over all 14
CP runs: eval and predict loss 1.6e-7 relative, logits 8.8e-6 absolute).

Three launches (the costly part is starting processes: each imports torch, transformers, accelerate, TRL and
datasets, seconds apiece; so each launch runs many cases):

    python tests/integrations/_trainer_cases.py  the non-CP runs of dp=1 (for the 1x2 cases): one process, as a
                                                 non-distributed script is run (no launcher process)
    accelerate launch --num_processes 2          dp=1 x cp=2 for every case, and the non-CP runs of dp=2
    torchrun --nproc-per-node 4                  dp=2 x cp=2, one kind per model family (every family and every
                                                 kind once); under the CI pin only: the other supported releases
                                                 run every case at 1x2 (the launch is most of a release's time)

``HFPATCH_TEST_TRAINER_FULL=1`` runs every case at 2x2 too (six more runs in the 4-process launch and their
non-CP runs in the 2-process one; the launches, not the runs, are most of the module's time).
Families: llama; gemma2 (sliding window on every other layer, attention and final logit softcapping); qwen2
(biased q/k/v projections), all exact in MODELS.md. Kinds: ``trainer`` (Trainer, fixed-length rows padded by the
integration, prompt labels -100), ``sft_plain`` (SFTTrainer, right-padded rows with an attention mask),
``sft_packed`` (SFTTrainer, padding-free rows of bin-packed documents: position ids and cu_seq_lens); and, where
peft is installed, ``llama:sft_lora`` (SFTTrainer with ``peft_config=``: LoRA on q/v, trained exactly as non-CP).
Mixtral trains with its MoE load-balancing loss on (coefficient 0.5): Trainer (its rows padded by the integration),
SFTTrainer padded (the attention mask weighs the padding out of the aux loss) and padding-free, and Trainer at 2x2;
``predict()`` then also returns the aux loss per batch and the router logits per layer, compared at the labelled
tokens, and SFTTrainer logs ``aux_loss``. Measured (Mixtral, 1x2): every loss, eval loss and parameter within the
bounds above; SFTTrainer's logged ``aux_loss`` equal.

TRL's DPOTrainer (``tests/integrations/_preference_cases.py``; llama, qwen3 and gemma2): the sigmoid loss against a
given ``ref_model``, IPO with ``precompute_ref_log_probs=True``, and, where peft is installed, the sigmoid loss on a
LoRA adapter whose disabled adapter is the reference; at 1x2, and IPO on Gemma-2 at 2x2. Every metric DPOTrainer logs,
per step and per evaluation, equals the non-CP one: the counts (``rewards/accuracies``, ``mean_token_accuracy``,
``num_tokens``) exactly, every other metric within 1e-5 of the largest magnitude of its series; a reward is beta x a
difference of two summed log-probs, so its scale is beta x the largest summed log-prob. Parameters within 2e-6.
Measured over six CP runs (the sigmoid loss on Llama at 2x2 among them): loss 3.4e-6, grad norm 2.4e-6, log-probs
1.2e-7, rewards 1.5e-7, logits 2.0e-6, entropy 6.5e-8 relative; parameters 1.2e-7 absolute. One exception is named:
with a precomputed reference the first step's policy IS the reference, every reward is rounding noise (checked:
within 1e-5 of its scale), and ``rewards/accuracies`` of that step compares the signs of noise, so it is not
compared.

TRL's RewardTrainer (``tests/integrations/_reward_cases.py``; tiny Llama, Qwen3 and Gemma-2
``*ForSequenceClassification``, one label): the loss with margins and ``center_rewards_coefficient``, and the plain
loss with a pad token that is not id 0 on odd-sized datasets (accelerate cuts the last batch of an epoch and of the
eval set); four at 1x2, one at 2x2. Every metric it logs on EVERY rank, per step and per evaluation, equals the
non-CP one (``accuracy`` and ``num_tokens`` exactly; ``margin``, a difference of rewards, within 1e-5 of the largest
reward), and so do ``predict()``'s rewards (5e-5 absolute) and the final parameters. Measured over the four CP runs:
loss 8.5e-8, grad norm 2.0e-7, rewards 2.8e-6, margin 1.6e-7 relative; rewards 1.8e-7 and parameters 1.2e-7
absolute.

TRL's KTOTrainer (``tests/integrations/_preference_cases.py``; llama and gemma2 at 1x2, qwen3 at 2x2): unpaired
completions against a given ``ref_model``, its KL term included. Every metric on every rank: counts equal, rewards
within 1e-5 of beta x the largest summed log-prob, ``kl`` (a difference of summed log-probs) within 1e-5 of the
largest summed log-prob, the rest within 1e-5 of their series; parameters within 2e-6. Measured over the three CP
runs, each against its own series: loss 9.4e-7, grad norm 8.7e-8, log-probs 9.5e-8, rewards 2e-4 (1.2e-7 of beta x
the summed log-probs), kl 7.7e-5; parameters 1.2e-7 absolute.

TRL's GRPOTrainer and RLOOTrainer (``tests/integrations/_policy_cases.py``; llama GRPO with the dapo loss and a
reference model, qwen3 GRPO with bnpo, batch-scaled rewards and two iterations per generation, gemma2 RLOO;
llama GRPO and gemma2 RLOO at 2x2), completions from a test double: every metric on every rank, per step and per
evaluation. What the model does not compute (completions, rewards, their spread, the token counts, the schedule) is
equal; the rest within 1e-5 of its scale: ``kl`` of the per-token log-probs' (the ``entropy`` metric), the loss of
the advantages' (a mean of advantage-weighted ratios whose advantages sum to zero per group: RLOO's loss is rounding
noise), the others of their series. The ring ran in every layer of every scoring forward (policy, reference, old
policy). Measured over the five CP runs: grad norm 3.7e-6, entropy 1.3e-7 relative, kl 6.3e-5 of its own series
(4e-7 absolute), the loss 2e-7 relative (GRPO) and 1.8e-6 of the rewards' spread (RLOO); parameters 1.2e-7 absolute.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# Found, not imported: the launched processes import them (this process only launches and compares).
for _module, _reason in (("accelerate", "hfpatch.integrations needs accelerate (pip install 'hfpatch[trainer]')"),
                         ("trl", "hfpatch.integrations' SFTTrainer cases need TRL (pip install 'hfpatch[trainer]')"),
                         ("datasets", "the trainer cases build datasets (pip install 'hfpatch[trainer]')")):
    if importlib.util.find_spec(_module) is None:
        pytest.skip(_reason, allow_module_level=True)

from _paths import ROOT  # noqa: E402
from _release import ci_pin, skip_unless_ci_pin  # noqa: E402
from hfpatch.integrations import requirements  # noqa: E402

for _name, _minimum in (("transformers", requirements.TRANSFORMERS_MIN), ("accelerate", requirements.ACCELERATE_MIN),
                        ("trl", requirements.TRL_MIN)):
    _found = requirements.installed(_name)
    if _found is None or _found < _minimum:
        pytest.skip(f"hfpatch.integrations supports {_name}>={_minimum}; {_found} is installed "
                    "(tests/integrations/test_integrations_units.py checks the refusal)", allow_module_level=True)

SCRIPT = Path(__file__).resolve().with_name("_trainer_cases.py")
_AT_PIN = str(requirements.installed("transformers")) == ci_pin()
LOSS_RTOL = 1e-5
GRAD_NORM_RTOL = 1e-5
PARAM_ATOL = 2e-6
MODELS = ("llama", "gemma2", "qwen2")
KINDS = ("trainer", "sft_plain", "sft_packed")
# SFTTrainer with peft_config= (a LoRA adapter on the model), where peft is installed
PEFT_CASES = ["llama:sft_lora"] if importlib.util.find_spec("peft") is not None else []
# Under the CI pin every family runs every kind; on the other releases each kind (and each loss below) runs once,
# on one family: what differs between releases is the Trainer and TRL path, which the families share.
# Mixtral with its load-balancing loss on (hfpatch.model.router_loss): Trainer, and SFTTrainer padded (the mask
# weighs the padding out) and padding-free.
MOE_CASES = ["mixtral:trainer", "mixtral:sft_plain", "mixtral:sft_packed"]
CASES = [f"{model}:{kind}" for model in MODELS for kind in KINDS] + PEFT_CASES + MOE_CASES if _AT_PIN else \
    ["llama:trainer", "gemma2:sft_packed", "qwen2:sft_plain", "mixtral:sft_plain"] + PEFT_CASES
# 2x2: every family and every kind once (all nine with HFPATCH_TEST_TRAINER_FULL=1).
CASES_2X2 = CASES if os.environ.get("HFPATCH_TEST_TRAINER_FULL") == "1" else \
    ["llama:trainer", "gemma2:sft_packed", "qwen2:sft_plain", "mixtral:trainer"]
LAYERS, MICRO_BATCHES = 2, 3 * 2   # tiny models: 2 layers; 3 steps x 2 accumulated micro-batches
EVAL_ROWS, EVAL_BATCH = 8, 2   # _trainer_cases' eval set and per-device eval batch


def _evaluations_in_training(reference: dict) -> int:
    """How many evaluations the trainer ran during training, read from the run without CP: the release's schedule
    (eval_steps=2 of 3 steps: 5.0 evaluates after step 2; later releases after steps 2 and 3). Its eval losses are
    those of the log, then evaluate()'s own log entry and its return value."""
    evaluations = len(reference["eval_loss"]) - 2
    assert evaluations >= 1, reference["eval_loss"]
    return evaluations
LOGITS_ATOL = 5e-5
# enable(trainer, keep_attention="all") with gradient checkpointing: against the same cases' non-CP runs
KEEP_CASES = ["llama:trainer", "gemma2:sft_packed"] if _AT_PIN else ["gemma2:sft_packed"]
# TRL's DPOTrainer (tests/integrations/_preference_cases.py): the sigmoid loss with a reference model, IPO with
# precomputed reference log-probs, and the sigmoid loss on a LoRA adapter whose disabled adapter is the reference
DPO_CASES = (["llama:dpo_sigmoid", "qwen3:dpo_ipo", "gemma2:dpo_sigmoid"] if _AT_PIN else
             ["llama:dpo_sigmoid", "qwen3:dpo_ipo"]) + \
    (["llama:dpo_lora"] if importlib.util.find_spec("peft") is not None else [])
DPO_CASES_2X2 = ["gemma2:dpo_ipo"]   # 2x2 adds the mesh; the sigmoid loss with a given reference runs at 1x2
# the DPO metrics that count (equal, not close) and those that are differences of summed log-probs
DPO_COUNTS = ("rewards/accuracies", "mean_token_accuracy", "num_tokens")
DPO_LOG_RATIOS = ("rewards/chosen", "rewards/rejected", "rewards/margins")
DPO_BETA = 0.5
# TRL's RewardTrainer (tests/integrations/_reward_cases.py): margins and center_rewards_coefficient with the pad
# token at id 0, and the plain loss with a pad token at another id (the integration's end padding must not be
# pooled)
REWARD_CASES = ["llama:reward", "qwen3:reward", "gemma2:reward", "llama:reward_pad"] if _AT_PIN else \
    ["gemma2:reward", "llama:reward_pad"]
REWARD_CASES_2X2 = ["qwen3:reward_pad"]
REWARD_COUNTS = ("accuracy", "num_tokens")
# TRL's KTOTrainer (tests/integrations/_preference_cases.py): unpaired completions against a given ref_model, its KL
# term on
KTO_CASES = ["llama:kto", "gemma2:kto"] if _AT_PIN else ["gemma2:kto"]
KTO_CASES_2X2 = ["qwen3:kto"]
KTO_COUNTS = ("num_tokens", "learning_rate", "epoch", "step")
# TRL's GRPOTrainer and RLOOTrainer (tests/integrations/_policy_cases.py), completions from a test double
POLICY_CASES = ["llama:grpo", "qwen3:grpo_bnpo", "gemma2:rloo"] if _AT_PIN else \
    ["qwen3:grpo_bnpo", "gemma2:rloo"]
POLICY_CASES_2X2 = ["llama:grpo", "gemma2:rloo"]
# what TRL logs that the model does not compute: the completions, the rewards and the schedule (equal, not close)
POLICY_MODEL_FREE = ("completions/", "rewards/", "reward", "reward_std", "frac_reward_zero_std", "num_tokens",
                     "learning_rate", "epoch", "step")


def _launch(launcher: list, cases: list, out: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               HF_DATASETS_DISABLE_PROGRESS_BARS="1", TRANSFORMERS_VERBOSITY="error")
    command = [sys.executable, *(["-m", *launcher] if launcher else []), str(SCRIPT), "--out", str(out), *cases]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=480)
    if result.returncode != 0:
        raise AssertionError(f"{' '.join(command)} failed ({result.returncode}):\n{result.stdout[-3000:]}\n"
                             f"{result.stderr[-6000:]}")
    return {r["case"]: dict(r, out=out) for r in json.loads((out / "results.json").read_text())}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("trainer_cases")
    results = {}
    at_1x2 = CASES + DPO_CASES + REWARD_CASES + KTO_CASES + POLICY_CASES
    # the 2x2 mesh under the CI pin only (every case runs at 1x2 on every release the integration supports)
    at_2x2 = CASES_2X2 + DPO_CASES_2X2 + REWARD_CASES_2X2 + KTO_CASES_2X2 + POLICY_CASES_2X2 if _AT_PIN else []
    results.update(_launch([], [f"{c}:1:1" for c in at_1x2], base / "world1"))
    results.update(_launch(["accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines",
                            "1", "--mixed_precision", "no", "--dynamo_backend", "no"],
                           [f"{c}:1:2" for c in at_1x2] + [f"{c}:2:1" for c in at_2x2]
                           + [f"{c}:1:2:keep" for c in KEEP_CASES], base / "world2"))
    if at_2x2:
        results.update(_launch(["torch.distributed.run", "--nproc-per-node", "4"],
                               [f"{c}:2:2" for c in at_2x2], base / "world4"))
    return results


def _mesh_under_the_pin() -> None:
    skip_unless_ci_pin("the 2x2 dp x cp mesh (every case runs at 1x2 on every supported release)")


def _parameters(run: dict) -> dict:
    return torch.load(run["out"] / (run["case"].replace(":", "_") + ".pt"))


def _compare(runs: dict, case: str, dp: int, keep: bool = False) -> None:
    cp_run, reference = runs[f"{case}:{dp}:2" + (":keep" if keep else "")], runs[f"{case}:{dp}:1"]
    assert cp_run["active"] and not reference["active"]
    eval_batches = EVAL_ROWS // (EVAL_BATCH * dp)
    assert cp_run["calls"] == LAYERS * (MICRO_BATCHES + _evaluations_in_training(reference) * eval_batches), \
        "the ring did not run in every layer of every micro-batch and eval batch"
    assert len(cp_run["loss"]) == len(reference["loss"]) == 3
    torch.testing.assert_close(torch.tensor(cp_run["loss"]), torch.tensor(reference["loss"]),
                               rtol=LOSS_RTOL, atol=0)
    torch.testing.assert_close(torch.tensor(cp_run["grad_norm"]), torch.tensor(reference["grad_norm"]),
                               rtol=GRAD_NORM_RTOL, atol=0)
    cp_params, ref_params = _parameters(cp_run), _parameters(reference)
    assert cp_params.keys() == ref_params.keys()
    worst = max((cp_params[n] - ref_params[n]).abs().max().item() for n in ref_params)
    assert worst <= PARAM_ATOL, f"{case} dp={dp} cp=2: parameters differ by {worst:.3g} after 3 steps"
    _compare_evaluation(cp_run, reference, eval_batches)


def _compare_evaluation(cp_run: dict, reference: dict, eval_batches: int) -> None:
    assert len(cp_run["eval_loss"]) == len(reference["eval_loss"]) == _evaluations_in_training(reference) + 2
    torch.testing.assert_close(torch.tensor(cp_run["eval_loss"] + [cp_run["predict_loss"]]),
                               torch.tensor(reference["eval_loss"] + [reference["predict_loss"]]),
                               rtol=LOSS_RTOL, atol=0)
    assert cp_run["gathered_by_evaluate"] == 0, "evaluate() without compute_metrics gathered logits"
    assert cp_run["gathered_logits"] == eval_batches
    ours = torch.load(cp_run["out"] / (cp_run["case"].replace(":", "_") + ".predict.pt"))
    theirs = torch.load(reference["out"] / (reference["case"].replace(":", "_") + ".predict.pt"))
    assert torch.equal(ours["labels"], theirs["labels"]) and ours["logits"].shape == theirs["logits"].shape
    labelled = theirs["labels"] != -100
    worst = (ours["logits"] - theirs["logits"])[labelled].abs().max().item()
    assert worst <= LOGITS_ATOL, f"{cp_run['case']}: predict() logits differ by {worst:.3g}"
    # every field predict() returns (a MoE model's aux_loss per batch and router_logits per layer too), per token at
    # the labelled positions (the padding's are the model's business)
    assert [f.shape for f in ours["fields"]] == [f.shape for f in theirs["fields"]], cp_run["case"]
    for index, (mine, want) in enumerate(zip(ours["fields"], theirs["fields"])):
        if labelled.dim() == 2 and want.dim() >= 2 and want.shape[:2] == labelled.shape:
            mine, want = mine[labelled], want[labelled]
        elif labelled.dim() == 2 and want.dim() >= 1 and want.shape[0] == labelled.numel():
            mine, want = mine[labelled.flatten()], want[labelled.flatten()]
        error = (mine - want).abs().max().item()
        assert error <= LOGITS_ATOL * max(1.0, want.abs().max().item()), \
            f"{cp_run['case']}: predict() field {index} differs by {error:.3g}"


@pytest.mark.parametrize("case", CASES)
def test_cp_1x2_equals_non_cp(runs, case):
    _compare(runs, case, dp=1)


@pytest.mark.parametrize("case", CASES_2X2)
def test_cp_2x2_equals_non_cp(runs, case):
    _mesh_under_the_pin()
    _compare(runs, case, dp=2)


def _compare_dpo(runs: dict, case: str, dp: int) -> None:
    """Every metric TRL logs, per step and per evaluation, and the final parameters: the non-CP ones."""
    cp_run, reference = runs[f"{case}:{dp}:2"], runs[f"{case}:{dp}:1"]
    assert cp_run["active"] and not reference["active"]
    eval_batches = EVAL_ROWS // (EVAL_BATCH * dp)
    scored_models = 1 if case.endswith("dpo_ipo") else 2   # policy and reference, unless precomputed
    evaluations = _evaluations_in_training(reference)
    # precomputed: enable scores the reference again, every example once per CP group (16 + 8 examples, batch 2)
    rescored = (16 // 2 + EVAL_ROWS // EVAL_BATCH) if case.endswith("dpo_ipo") else 0
    assert cp_run["calls"] == LAYERS * (scored_models * (MICRO_BATCHES + evaluations * eval_batches) + rescored), \
        "the ring did not run in every layer of every scoring forward"
    assert len(cp_run["metrics_by_rank"]) == 2 * dp
    for rank, logged in enumerate(cp_run["metrics_by_rank"]):
        for which in ("metrics", "eval_metrics"):
            ours, theirs = logged[which], reference[which]
            assert ours.keys() == theirs.keys() and \
                len(theirs["loss"]) == (3 if which == "metrics" else evaluations + 2)
            # precomputed reference: the first step's policy is the reference, so its rewards are rounding noise
            at_reference = case.endswith("dpo_ipo") and which == "metrics"
            if at_reference:
                noise = max(abs(theirs["rewards/chosen"][0]), abs(theirs["rewards/rejected"][0]))
                assert noise <= LOSS_RTOL * DPO_BETA * abs(theirs["logps/chosen"][0]), (case, noise)
            for name, expected in theirs.items():
                _compare_metric(f"{case} dp={dp} rank {rank}: {which}[{name}]", name, ours[name], expected, theirs,
                                at_reference)
    _compare_parameters(cp_run, reference)


def _compare_parameters(cp_run: dict, reference: dict) -> None:
    cp_params, ref_params = _parameters(cp_run), _parameters(reference)
    assert cp_params.keys() == ref_params.keys()
    worst = max((cp_params[n] - ref_params[n]).abs().max().item() for n in ref_params)
    assert worst <= PARAM_ATOL, f"{cp_run['case']}: parameters differ by {worst:.3g} after 3 steps"


def _compare_metric(what: str, name: str, ours: list, theirs: list, reference: dict,
                    policy_is_reference_at_step_1: bool = False, counts: tuple = DPO_COUNTS,
                    scale: float | None = None) -> None:
    """Counts are equal. Every other metric is within LOSS_RTOL of ``scale``: by default the largest magnitude of
    its series (the project's max-relative measure); a DPO reward is beta x (summed log-probs - the reference's), a
    difference of two nearly equal sums, so its scale is beta x the largest summed log-prob it is the difference
    of; the caller gives the scale of other differences (a reward model's margin: the largest reward)."""
    ours, theirs = torch.tensor(ours, dtype=torch.float64), torch.tensor(theirs, dtype=torch.float64)
    if name == "rewards/accuracies" and policy_is_reference_at_step_1:
        # at step 1 every reward is rounding noise (_compare_dpo checks it): the accuracy compares noise's signs
        ours, theirs = ours[1:], theirs[1:]
    if name in counts:
        assert torch.equal(ours.nan_to_num(-1), theirs.nan_to_num(-1)), f"{what}: {ours.tolist()} != {theirs.tolist()}"
        return
    scale = theirs.abs().max().item() if scale is None else scale
    if name in DPO_LOG_RATIOS:
        scale = DPO_BETA * max(max(abs(v) for v in reference["logps/chosen"]),
                               max(abs(v) for v in reference["logps/rejected"]))
    worst = (ours - theirs).abs().max().item()
    assert worst <= LOSS_RTOL * scale, f"{what}: differs by {worst:.3g} (scale {scale:.3g}): {ours} vs {theirs}"


@pytest.mark.parametrize("case", DPO_CASES)
def test_dpo_1x2_equals_non_cp(runs, case):
    _compare_dpo(runs, case, dp=1)


@pytest.mark.parametrize("case", DPO_CASES_2X2)
def test_dpo_2x2_equals_non_cp(runs, case):
    _mesh_under_the_pin()
    _compare_dpo(runs, case, dp=2)


def _compare_reward(runs: dict, case: str, dp: int) -> None:
    """Every metric RewardTrainer logs on every rank, per step and per evaluation, ``predict()``'s rewards and the
    final parameters: the non-CP ones; the ring ran in every layer of every forward."""
    cp_run, reference = runs[f"{case}:{dp}:2"], runs[f"{case}:{dp}:1"]
    assert cp_run["active"] and not reference["active"]
    eval_batches = EVAL_ROWS // (EVAL_BATCH * dp)
    evaluations = _evaluations_in_training(reference)
    assert cp_run["calls"] == LAYERS * (MICRO_BATCHES + evaluations * eval_batches), \
        "the ring did not run in every layer of every micro-batch and eval batch"
    assert cp_run["eval_calls"] == LAYERS * 2 * eval_batches, "evaluate() and predict() did not run the ring"
    assert not cp_run["gather_for_metrics_left"], "the one-copy metrics gather outlived compute_loss"
    # margin: a difference of two rewards, so its scale is the largest reward
    reward_scale = {which: max(abs(v) for name in ("min_reward", "max_reward") for v in reference[which][name])
                    for which in ("metrics", "eval_metrics")}
    assert len(cp_run["metrics_by_rank"]) == 2 * dp
    for rank, logged in enumerate(cp_run["metrics_by_rank"]):
        for which in ("metrics", "eval_metrics"):
            ours, theirs = logged[which], reference[which]
            assert ours.keys() == theirs.keys() == set(_reward_metrics(which)), (which, sorted(ours))
            assert len(theirs["loss"]) == (3 if which == "metrics" else evaluations + 2)
            for name, expected in theirs.items():
                _compare_metric(f"{case} dp={dp} rank {rank}: {which}[{name}]", name, ours[name], expected, theirs,
                                counts=REWARD_COUNTS, scale=reward_scale[which] if name == "margin" else None)
    torch.testing.assert_close(torch.tensor(cp_run["eval_loss"] + [cp_run["predict_loss"]]),
                               torch.tensor(reference["eval_loss"] + [reference["predict_loss"]]),
                               rtol=LOSS_RTOL, atol=0)
    ours = torch.load(cp_run["out"] / (cp_run["case"].replace(":", "_") + ".predict.pt"))["logits"]
    theirs = torch.load(reference["out"] / (reference["case"].replace(":", "_") + ".predict.pt"))["logits"]
    assert ours.shape == theirs.shape and ours.shape[1:] == (1,), (ours.shape, theirs.shape)
    worst = (ours - theirs).abs().max().item()
    assert worst <= LOGITS_ATOL, f"{cp_run['case']}: predict() rewards differ by {worst:.3g}"
    _compare_parameters(cp_run, reference)


def _reward_metrics(which: str) -> tuple:
    """The metrics RewardTrainer logs: in training with the grad norm, in evaluation without."""
    names = ("loss", "grad_norm", "num_tokens", "min_reward", "mean_reward", "max_reward", "accuracy", "margin")
    return names if which == "metrics" else tuple(n for n in names if n != "grad_norm")


@pytest.mark.parametrize("case", REWARD_CASES)
def test_reward_1x2_equals_non_cp(runs, case):
    _compare_reward(runs, case, dp=1)


@pytest.mark.parametrize("case", REWARD_CASES_2X2)
def test_reward_2x2_equals_non_cp(runs, case):
    _mesh_under_the_pin()
    _compare_reward(runs, case, dp=2)


def _compare_kto(runs: dict, case: str, dp: int) -> None:
    """Every metric KTOTrainer logs on every rank, per step and per evaluation, and the final parameters: the
    non-CP ones; the ring ran in every layer of every scoring forward (its KL forwards included). A reward is beta
    x a difference of summed log-probs (as DPO's) and ``kl`` a difference of summed log-probs: their scale is that
    of the summed log-probs."""
    cp_run, reference = runs[f"{case}:{dp}:2"], runs[f"{case}:{dp}:1"]
    _assert_every_scoring_forward_ran_the_ring(cp_run, reference)
    assert len(cp_run["metrics_by_rank"]) == 2 * dp
    for rank, logged in enumerate(cp_run["metrics_by_rank"]):
        for which in ("metrics", "eval_metrics"):
            ours, theirs = logged[which], reference[which]
            assert ours.keys() == theirs.keys() and {"loss", "kl", "rewards/margins"} <= theirs.keys()
            assert len(theirs["loss"]) == (3 if which == "metrics" else _evaluations_in_training(reference) + 2)
            log_probs = max(abs(v) for name in ("logps/chosen", "logps/rejected") for v in theirs[name])
            for name, expected in theirs.items():
                scale = log_probs if name == "kl" else DPO_BETA * log_probs if name in DPO_LOG_RATIOS else None
                _compare_metric(f"{case} dp={dp} rank {rank}: {which}[{name}]", name, ours[name], expected, theirs,
                                counts=KTO_COUNTS, scale=scale)
    _compare_parameters(cp_run, reference)


@pytest.mark.parametrize("case", KTO_CASES)
def test_kto_1x2_equals_non_cp(runs, case):
    _compare_kto(runs, case, dp=1)


@pytest.mark.parametrize("case", KTO_CASES_2X2)
def test_kto_2x2_equals_non_cp(runs, case):
    _mesh_under_the_pin()
    _compare_kto(runs, case, dp=2)


def _assert_every_scoring_forward_ran_the_ring(cp_run: dict, reference: dict) -> None:
    assert cp_run["active"] and not reference["active"]
    assert cp_run["scoring_forwards"] > 0 and cp_run["calls"] == LAYERS * cp_run["scoring_forwards"], \
        "the ring did not run in every layer of every scoring forward"
    assert cp_run["scoring_forwards"] == reference["scoring_forwards"]


def _compare_policy(runs: dict, case: str, dp: int) -> None:
    """Every metric GRPOTrainer / RLOOTrainer logs on every rank, per step and per evaluation, and the final
    parameters: the non-CP ones; the ring ran in every layer of every scoring forward."""
    cp_run, reference = runs[f"{case}:{dp}:2"], runs[f"{case}:{dp}:1"]
    _assert_every_scoring_forward_ran_the_ring(cp_run, reference)
    assert len(cp_run["metrics_by_rank"]) == 2 * dp
    for rank, logged in enumerate(cp_run["metrics_by_rank"]):
        for which in ("metrics", "eval_metrics"):
            ours, theirs = logged[which], reference[which]
            assert ours.keys() == theirs.keys() and {"loss", "kl", "entropy", "reward"} <= theirs.keys()
            assert len(theirs["loss"]) == (3 if which == "metrics" else _evaluations_in_training(reference) + 2)
            for name, expected in theirs.items():
                what = f"{case} dp={dp} rank {rank}: {which}[{name}]"
                assert [v is None for v in ours[name]] == [v is None for v in expected], what
                ours_, theirs_ = ([v for v in values if v is not None] for values in (ours[name], expected))
                _compare_metric(what, name, ours_, theirs_, theirs, counts=(name,) if _model_free(name) else (),
                                scale=_policy_scale(name, theirs))
    _compare_parameters(cp_run, reference)


def _model_free(name: str) -> bool:
    return any(name == m or (m.endswith("/") and name.startswith(m)) for m in POLICY_MODEL_FREE)


def _policy_scale(name: str, logged: dict) -> float | None:
    """The scale a policy metric's difference is measured against (None: the largest magnitude of its series).
    ``kl`` is a difference of the policy's and the reference's log-probs of the same tokens, so its error scales
    with those log-probs, whose size the ``entropy`` metric gives (about log(vocab) for these random models). The
    loss is a mean of advantage-weighted probability ratios, and the advantages of a group sum to zero (RLOO), so
    its value is a cancellation: its terms have the scale of the advantages, at least the rewards' spread."""
    if name == "kl":
        return max(abs(v) for v in logged["entropy"] if v is not None)
    if name == "loss":
        return max(abs(v) for key in ("loss", "reward_std") for v in logged[key] if v is not None)
    return None


@pytest.mark.parametrize("case", POLICY_CASES)
def test_grpo_rloo_1x2_equals_non_cp(runs, case):
    _compare_policy(runs, case, dp=1)


@pytest.mark.parametrize("case", POLICY_CASES_2X2)
def test_grpo_rloo_2x2_equals_non_cp(runs, case):
    _mesh_under_the_pin()
    _compare_policy(runs, case, dp=2)


@pytest.mark.parametrize("case", KEEP_CASES)
def test_cp_with_kept_attention_equals_non_cp(runs, case):
    """Trainer / SFTTrainer with gradient checkpointing and ``enable(keep_attention="all")``: the non-CP result,
    and every layer's recomputation of every micro-batch took its kept attention output."""
    _compare(runs, case, dp=1, keep=True)
    kept = runs[f"{case}:1:2:keep"]["kept"]
    assert kept["kept"] == kept["replayed"] == LAYERS * MICRO_BATCHES and kept["gaps"] == 0, kept
    assert kept["live_bytes"] == 0, kept
