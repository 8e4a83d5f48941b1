"""``hfpatch.integrations`` in one process: the release gates, the CPU-only accelerate context, the batch
preparation's padding and refusals, the loss conventions of ``hfpatch.model.labels.averaged_over_group`` and TRL's fused
LM head, and ``enable`` without CP (the trainer left exactly as it was). The multi-process equality of whole
training runs is tests/integrations/test_integrations.py."""
from __future__ import annotations

import types

import pytest
import torch

import hfpatch.integrations
from hfpatch.cli.demo_models import build_model
from hfpatch.errors import MissingEnable, UnsupportedArgument, UnsupportedRelease
from hfpatch.integrations import batch, parallelism_config_on_cpu, requirements
from hfpatch.integrations.evaluation import OneCopyPerCPGroup
from hfpatch.integrations.preference import refuse_unsupported_trl_trainer
from hfpatch.integrations.reward import reward_batch
from hfpatch.integrations.trainer import refuse_unsupported_losses, require_checkpointing, summary_line
from hfpatch.model.labels import averaged_over_group, install_labels_hook

IGNORE = -100


class _StubPatch:
    """What prepare_batch reads of a Patch: ``ctx.world_size`` and ``shard_inputs`` (recorded, identity split)."""

    def __init__(self, world_size: int = 2) -> None:
        self.ctx = types.SimpleNamespace(world_size=world_size)
        self.seen = None

    def shard_inputs(self, input_ids, labels=None, position_ids=None):
        self.seen = (input_ids, labels, position_ids)
        shifted = None if labels is None else torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE)], 1)
        return {"input_ids": input_ids, "position_ids": position_ids, "labels": shifted}


# ----------------------------------------------------------------------------------------------- releases


@pytest.mark.parametrize("distribution, minimum", [("transformers", requirements.TRANSFORMERS_MIN),
                                                   ("accelerate", requirements.ACCELERATE_MIN),
                                                   ("trl", requirements.TRL_MIN)])
def test_older_release_is_refused_by_name(monkeypatch, distribution, minimum):
    from packaging.version import Version

    newest = {"transformers": Version("5.23.0"), "accelerate": Version("1.15.0"), "trl": Version("1.16.0")}
    older = Version(f"{minimum.major}.{minimum.minor - 1}.0") if minimum.minor else Version(f"{minimum.major - 1}.99")
    monkeypatch.setattr(requirements, "installed", lambda name: older if name == distribution else newest[name])
    with pytest.raises(UnsupportedRelease, match=f"{distribution}>={minimum}") as info:
        requirements.check_releases(trl=True)
    assert info.value.requirement == f"{distribution}>={minimum}"
    if distribution == "trl":
        requirements.check_releases(trl=False)   # a plain Trainer does not need TRL


def test_missing_package_is_refused(monkeypatch):
    monkeypatch.setattr(requirements, "installed", lambda name: None if name == "accelerate" else
                        requirements.Version("99.0"))
    with pytest.raises(UnsupportedRelease, match="accelerate>=.*is not installed"):
        requirements.check_releases(trl=False)


# ---------------------------------------------------------------------------------------------------- CPU


def test_cpu_context_restores_accelerate_by_identity():
    pytest.importorskip("accelerate")
    from accelerate.parallelism_config import ParallelismConfig

    original = ParallelismConfig.__dict__["_validate_accelerator"]
    with pytest.raises(KeyError):
        with parallelism_config_on_cpu():
            assert ParallelismConfig.__dict__["_validate_accelerator"].__wrapped__ is original
            raise KeyError("inside")
    assert ParallelismConfig.__dict__["_validate_accelerator"] is original


# -------------------------------------------------------------------------------------------------- batch


def test_rows_are_padded_to_the_zigzag_multiple_with_ignored_labels():
    patch = _StubPatch(world_size=2)
    ids = torch.arange(2 * 6).reshape(2, 6) + 3
    out = batch.prepare_batch(patch, {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones(2, 6)})
    padded_ids, labels, positions = patch.seen
    assert padded_ids.shape == (2, 8) and bool((padded_ids[:, 6:] == 0).all())
    assert bool((labels[:, 6:] == IGNORE).all()) and torch.equal(labels[:, :6], ids)
    # none given: none passed on (StepState.positions_given False); shard_inputs numbers the padded row 0..7
    assert positions is None
    assert set(out) == {"input_ids", "position_ids", "shift_labels"}    # the mask is dropped after the check


def test_packed_row_keeps_documents_and_pads_with_a_new_document():
    patch = _StubPatch(world_size=2)
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3, 4]])
    cu = torch.tensor([0, 3, 5, 10], dtype=torch.int32)
    ids = torch.arange(10)[None] + 3
    out = batch.prepare_batch(patch, {"input_ids": ids, "labels": ids, "position_ids": positions,
                                      "cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": 5,
                                      "max_length_k": 5, "seq_idx": torch.zeros(1, 10, dtype=torch.int32)})
    assert torch.equal(patch.seen[2], torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3, 4, 0, 1]]))
    assert not set(out) & set(batch.PACKING_KEYS)


def test_shift_labels_are_shifted_back_to_labels():
    patch = _StubPatch(world_size=2)
    labels = torch.tensor([[IGNORE, 5, 6, 7]])
    shift = torch.tensor([[5, 6, 7, IGNORE]])
    batch.prepare_batch(patch, {"input_ids": torch.tensor([[3, 4, 5, 6]]), "shift_labels": shift})
    assert torch.equal(patch.seen[1], labels)


@pytest.mark.parametrize("extra, parameter", [
    ({"attention_mask": torch.tensor([[0, 1, 1, 1]])}, "attention_mask"),                   # left padding
    ({"attention_mask": torch.tensor([[1, 1, 1, 0]])}, "attention_mask"),                   # pad token counted
    ({"position_ids": torch.tensor([[0, 1, 0, 1]]),
      "cu_seq_lens_q": torch.tensor([0, 3, 4], dtype=torch.int32)}, "cu_seq_lens_q"),       # other documents
    ({"token_type_ids": torch.zeros(1, 4, dtype=torch.long)}, "token_type_ids"),            # unsplit per-token
    ({"shift_labels": torch.tensor([[9, 9, 9, 9]])}, "shift_labels"),                       # disagrees with labels
])
def test_what_cannot_be_made_exact_is_refused_by_name(extra, parameter):
    inputs = {"input_ids": torch.tensor([[3, 4, 5, 6]]), "labels": torch.tensor([[3, 4, 5, 6]]), **extra}
    with pytest.raises(UnsupportedArgument) as info:
        batch.prepare_batch(_StubPatch(), inputs)
    assert info.value.parameter == parameter and info.value.fix


def test_right_padding_with_ignored_labels_is_accepted():
    inputs = {"input_ids": torch.tensor([[3, 4, 5, 0]]), "labels": torch.tensor([[3, 4, 5, IGNORE]]),
              "attention_mask": torch.tensor([[1, 1, 1, 0]])}
    assert "attention_mask" not in batch.prepare_batch(_StubPatch(), inputs)


# ------------------------------------------------------------------------------------------ reward models


def _reward_model(pad_token_id):
    """A tiny LlamaForSequenceClassification with one label (a reward model)."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, num_labels=1, pad_token_id=pad_token_id)
    return LlamaForSequenceClassification(config)


def test_a_pooled_head_is_padded_with_its_pad_token():
    """A head that pools the last non-pad token never pools the integration's end padding: it is the pad token."""
    assert batch.padding_token(build_model("llama")) == 0
    assert batch.padding_token(_reward_model(5)) == 5
    patch = _StubPatch(world_size=2)
    batch.prepare_batch(patch, {"input_ids": torch.tensor([[3, 4, 5]])}, pad_token=5)
    assert patch.seen[0].tolist() == [[3, 4, 5, 5]]


def test_a_pooled_head_without_a_pad_token_is_refused():
    with pytest.raises(UnsupportedArgument) as info:
        batch.padding_token(_reward_model(None))
    assert info.value.parameter == "pad_token_id" and "pad_token_id" in info.value.fix


def test_a_reward_batch_keeps_its_whole_mask_for_the_token_count():
    ids = torch.tensor([[3, 4, 5, 7, 7], [6, 0, 7, 7, 7]])     # pad 7; token 0 is a real token
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0]])
    patch = _StubPatch(world_size=2)
    out = reward_batch(patch, {"input_ids": ids, "attention_mask": mask, "margin": torch.ones(1)}, pad_token=7)
    assert out["attention_mask"] is mask and "margin" in out
    assert patch.seen[0].shape == (2, 8) and bool((patch.seen[0][:, 5:] == 7).all())


@pytest.mark.parametrize("ids, mask", [
    ([[7, 3, 4, 5]], [[0, 1, 1, 1]]),     # left padding: the pooled token would attend to the padding
    ([[3, 4, 5, 6]], [[1, 1, 1, 0]]),     # a masked-out token that is not the pad token: pooled without CP
])
def test_reward_padding_that_cannot_be_dropped_is_refused(ids, mask):
    with pytest.raises(UnsupportedArgument) as info:
        reward_batch(_StubPatch(), {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask)}, 7)
    assert info.value.parameter == "attention_mask" and info.value.fix


@pytest.mark.parametrize("module, name", [
    ("trl", "DistillationTrainer"),                  # TRL 1.16's top-level trainer that enable does not make exact
    ("trl.experimental.orpo", "ORPOTrainer"),        # named in the refusal table
    ("trl.experimental.gkd", "GKDTrainer"),
    ("trl.experimental.kto", "KTOTrainer"),          # the experimental KTO: not TRL's trl.KTOTrainer
    ("trl.experimental.tpo", "TPOTrainer"),          # named nowhere: refused as not verified
])
def test_trl_trainers_not_made_exact_are_refused_by_name_under_cp_only(module, name):
    pytest.importorskip("trl")
    cls = getattr(pytest.importorskip(module), name, None)
    if cls is None:
        pytest.skip(f"{module} has no {name} in this TRL")
    trainer = cls.__new__(cls)
    refuse_unsupported_trl_trainer(trainer, cp_size=1)   # without CP: the same script, nothing refused
    with pytest.raises(UnsupportedArgument) as info:
        refuse_unsupported_trl_trainer(trainer, cp_size=2)
    assert info.value.parameter == "trainer" and name in str(info.value) and info.value.fix
    subclass = type("MyTrainer", (cls,), {})         # a user's subclass: refused as its TRL base
    with pytest.raises(UnsupportedArgument, match=name):
        refuse_unsupported_trl_trainer(subclass.__new__(subclass), cp_size=2)


def test_the_trainers_made_exact_are_not_refused():
    trl = pytest.importorskip("trl")
    for name in ("SFTTrainer", "DPOTrainer", "KTOTrainer", "RewardTrainer", "GRPOTrainer", "RLOOTrainer"):
        cls = getattr(trl, name)
        refuse_unsupported_trl_trainer(cls.__new__(cls), cp_size=2)
        subclass = type("MyTrainer", (cls,), {})
        refuse_unsupported_trl_trainer(subclass.__new__(subclass), cp_size=2)


# ------------------------------------------------------------------------------------------------- labels


def _hooked_model(world_size: int):
    model = build_model("llama")
    ctx = types.SimpleNamespace(world_size=world_size, group=None)
    return model, install_labels_hook(model, lambda: ctx)


def test_averaged_share_without_cp_is_the_model_loss():
    model, hooks = _hooked_model(world_size=1)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    shift = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], IGNORE)], 1)
    own = model(input_ids=ids, labels=ids).loss
    with averaged_over_group():
        share = model(input_ids=ids, shift_labels=shift).loss
        counted = model(input_ids=ids, shift_labels=shift, num_items_in_batch=torch.tensor(15.0)).loss
    torch.testing.assert_close(share, own)
    torch.testing.assert_close(counted, own * 30 / 15)      # the trainer's divisor, as given
    hooks.remove()


def test_fused_lm_head_under_cp_needs_shift_labels_and_the_averaged_convention():
    model, hooks = _hooked_model(world_size=2)
    ids = torch.randint(0, 128, (1, 8))
    with pytest.raises(UnsupportedArgument) as info:
        model(input_ids=ids, shift_labels=ids, fused_lm_head=True)
    assert info.value.parameter == "fused_lm_head"
    with averaged_over_group(), pytest.raises(UnsupportedArgument) as info:
        model(input_ids=ids, labels=ids, fused_lm_head=True)
    assert info.value.parameter == "labels"
    hooks.remove()


# ------------------------------------------------------------------------------------------------- enable


def test_enable_without_cp_leaves_the_trainer_as_it_was(tmp_path):
    pytest.importorskip("accelerate")
    for name, minimum in (("transformers", requirements.TRANSFORMERS_MIN),
                          ("accelerate", requirements.ACCELERATE_MIN)):
        found = requirements.installed(name)
        if found is None or found < minimum:
            pytest.skip(f"hfpatch.integrations supports {name}>={minimum}; {found} is installed")
    from transformers import Trainer, TrainingArguments

    trainer = Trainer(model=build_model("llama"), args=TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=1))
    handle = hfpatch.integrations.enable(trainer)
    assert not handle.active and not handle.fallback and handle.cp_size == 1
    assert "compute_loss" not in vars(trainer) and "_prepare_context_parallel_inputs" not in vars(trainer)
    assert trainer.hfpatch_cp is handle
    handle.remove()
    with pytest.raises(RuntimeError, match="already removed"):
        handle.remove()


def test_losses_that_see_a_shard_are_refused():
    base = dict(label_smoother=None, compute_loss_func=None, aux_loss_enabled=False,
                args=types.SimpleNamespace(label_smoothing_factor=0.1))
    refuse_unsupported_losses(types.SimpleNamespace(**base))
    # TRL's marker on transformers < 5.19 (GRPOTrainer: its compute_loss scales for accumulation), never called
    marker = "non-None value to disable scaling"
    refuse_unsupported_losses(types.SimpleNamespace(**{**base, "compute_loss_func": marker}))
    for field, value, parameter in (("label_smoother", object(), "label_smoothing_factor"),
                                    ("compute_loss_func", len, "compute_loss_func")):
        with pytest.raises(UnsupportedArgument) as info:
            refuse_unsupported_losses(types.SimpleNamespace(**{**base, field: value}))
        assert info.value.parameter == parameter
    # The MoE load-balancing loss: transformers' Trainer (the model adds it) and TRL's SFTTrainer are exact
    # (test_integrations.py's mixtral cases); a TRL trainer that adds it with its own scaling is refused by name.
    moe = types.SimpleNamespace(config=types.SimpleNamespace(output_router_logits=True))
    refuse_unsupported_losses(types.SimpleNamespace(**base, model=moe))
    refuse_unsupported_losses(types.SimpleNamespace(**{**base, "aux_loss_enabled": True}))
    dpo = type("DPOTrainer", (types.SimpleNamespace,), {"__module__": "trl.trainer.dpo_trainer"})
    for trainer in (dpo(**{**base, "aux_loss_enabled": True}), dpo(**base, model=moe)):
        with pytest.raises(UnsupportedArgument, match="load-balancing loss to a loss it scales") as info:
            refuse_unsupported_losses(trainer)
        assert info.value.parameter == "router_aux_loss_coef" and "DPOTrainer" in info.value.reason


def test_keep_attention_without_checkpointing_is_refused():
    """``enable(keep_attention=...)`` needs the trainer's checkpointing (transformers' or FSDP's) to keep through."""
    def trainer(gradient_checkpointing, fsdp_checkpointing):
        plugin = types.SimpleNamespace(activation_checkpointing=fsdp_checkpointing)
        return types.SimpleNamespace(args=types.SimpleNamespace(gradient_checkpointing=gradient_checkpointing),
                                     accelerator=types.SimpleNamespace(state=types.SimpleNamespace(fsdp_plugin=plugin)))

    require_checkpointing(trainer(True, False), "auto")
    require_checkpointing(trainer(False, True), "auto")
    with pytest.raises(UnsupportedArgument) as info:
        require_checkpointing(trainer(False, False), 12)
    assert info.value.parameter == "keep_attention" and info.value.value == 12
    assert "gradient_checkpointing=True" in str(info.value)


# --------------------------------------------------------------------------------------------- evaluation


def test_eval_gather_keeps_one_copy_per_cp_group():
    """dp=2 x cp=2 (mesh ranks [[0, 1], [2, 3]]): of the four gathered parts, those of ranks 0 and 2 remain."""
    pytest.importorskip("accelerate", reason="the gather applies accelerate's recursively_apply")
    mesh = types.SimpleNamespace(mesh=torch.tensor([[0, 1], [2, 3]]), mesh_dim_names=("dp_shard", "cp"))
    accelerator = types.SimpleNamespace(
        torch_device_mesh=mesh, num_processes=4,
        gather=lambda x: torch.cat([x + 10 * rank for rank in range(4)]),
        gradient_state=types.SimpleNamespace(end_of_dataloader=False, remainder=0))
    gather = OneCopyPerCPGroup(accelerator)
    assert gather.kept_ranks == [0, 2]
    assert gather(torch.tensor([1.0, 2.0])).tolist() == [1.0, 2.0, 21.0, 22.0] and gather.calls == 1


def test_enable_logs_what_runs_and_what_fell_back():
    trainer = types.SimpleNamespace(accelerator=types.SimpleNamespace(num_processes=4))
    ctx = types.SimpleNamespace(variant="zigzag", backend="reference")
    mixers = types.SimpleNamespace(modules=[("model.layers.0.mixer", "Mamba2Mixer", "mamba2")])
    active = types.SimpleNamespace(trainer=trainer, cp_size=2, fallback=False, kept=object(), eval_step="cp",
                                   patch=types.SimpleNamespace(ctx=ctx, mixers=mixers, labels_refusal=None))
    line = summary_line(active, "all")
    for part in ("zigzag:reference", "cp=2 of 4", "1 sequence mixers", "evaluate()/predict()", "'all'",
                 "refused: nothing"):
        assert part in line, (part, line)
    fallback = types.SimpleNamespace(trainer=trainer, cp_size=2, fallback=True,
                                     patch=types.SimpleNamespace(reason="model refused"))
    assert "FELL BACK" in summary_line(fallback) and "model refused" in summary_line(fallback)
    assert "without CP" in summary_line(types.SimpleNamespace(trainer=trainer, cp_size=1))


def test_a_forgotten_enable_is_named_before_torch_fails():
    """Importing hfpatch.integrations guards accelerate's preparation of PyTorch's CP: a model it cannot shard (not
    SDPA) raises MissingEnable naming enable(trainer); an SDPA model goes on to accelerate's own method."""
    pytest.importorskip("accelerate")
    from accelerate import Accelerator

    guarded = Accelerator._prepare_cp
    assert guarded.hfpatch_guard
    with pytest.raises(MissingEnable, match=r"LlamaForCausalLM whose attention is 'eager'.*Fix: call "
                                            r"hfpatch.integrations.enable\(trainer\)"):
        guarded(object(), build_model("llama"))
    # accelerate's own method runs (and fails on this bare stand-in for an accelerator, past the guard)
    with pytest.raises(AttributeError, match="parallelism_config"):
        guarded(object(), build_model("llama", attn_implementation="sdpa"))
    hfpatch.integrations.guard_missing_enable()
    assert Accelerator._prepare_cp is guarded                     # wrapped once
