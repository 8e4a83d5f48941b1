"""Vision-language training through ``hfpatch.integrations.enable``: transformers' Trainer and TRL's SFTTrainer on
a tiny Qwen2-VL (random weights, fp32, built from its config class), with images whose placeholders straddle the
shard boundaries, CP on 2 gloo ranks against the same script without CP (1 rank).

- ``trainer``: transformers' Trainer, rows of 30 tokens (padded by the integration to 32), one image each (4 or 6
  placeholders at 6..9, 21..26, 13..16, 14..19: across the zigzag chunk boundaries 8, 16, 24 of 2 ranks), the
  first labels -100, ``mm_token_type_ids`` as Qwen2-VL's processor gives them, no position ids (the model numbers
  its own 3-D rotary positions over the whole row); a collator of this module concatenates the images.
- ``sft``: TRL's SFTTrainer with its own ``DataCollatorForVisionLanguageModeling`` (the trainer builds it for a
  dataset with ``images``): rows of different lengths, right-padded with an attention mask, labels -100 on the
  padding. The processor is a stand-in (``_Processor``): no Qwen processor can be downloaded here, and Qwen's own
  image processor needs Pillow and torchvision, which this environment lacks. It returns what
  ``Qwen2VLProcessor`` returns (``input_ids``, ``attention_mask``, ``pixel_values`` (patches, 3 x 2 x 2 x 2),
  ``image_grid_thw``, ``mm_token_type_ids``), each ``<|image_pad|>`` expanded to the image's placeholders.

Two optimiser steps of 2 accumulated micro-batches (2 rows each), SGD, gradient clipping, fp32 (``bf16=False``:
SFTConfig's default autocast would round CP and non-CP differently), then ``trainer.evaluate()`` on 4 rows (batches
of 2). On every rank of the CP run: every logged value (loss, grad norm, learning rate, and SFTTrainer's entropy,
mean token accuracy and ``num_tokens``, the last equal; the eval loss and eval metrics) equals the non-CP log, and
the parameters after the steps equal the non-CP ones; the ring ran and the vision tower moved. Bounds:
tests/integrations/test_integrations.py's (loss and every float metric 1e-5 relative, parameters 2e-6 absolute).
Measured: loss 9.5e-8 relative, every metric equal, parameters 7.5e-9 absolute; with the model handed 2-D text
positions instead of numbering its own 3-D ones (the bug this guards), the first loss is off by 1.3e-5 relative
and the parameters by 5e-5. One world of each size runs both kinds (about 30 s on 2 cores); on the matrix's older
releases, the Trainer alone.

Refused by name (``UnsupportedArgument``, ``test_what_the_batch_cannot_split_exactly_is_refused_by_name``):
multimodal rotary position ids given in the batch, and a token-type tensor not shaped like ``input_ids``.
"""
from __future__ import annotations

import importlib.util
import types

import pytest
import torch

for _module in ("accelerate", "trl", "datasets"):
    if importlib.util.find_spec(_module) is None:
        pytest.skip(f"the trainer cases need {_module} (pip install 'hfpatch[trainer]')", allow_module_level=True)

import transformers  # noqa: E402
from accelerate.state import AcceleratorState  # noqa: E402

import hfpatch.integrations  # noqa: E402
from _dist import run_world  # noqa: E402
from _release import ci_pin, skip_unless_ci_pin  # noqa: E402
from hfpatch import version_gates  # noqa: E402
from hfpatch.errors import UnsupportedArgument  # noqa: E402
from hfpatch.integrations import requirements  # noqa: E402
from hfpatch.integrations.batch import prepare_batch  # noqa: E402

if version_gates.installed_transformers_version() < version_gates.TRANSFORMERS_IMAGES_UNDER_CP:
    pytest.skip("images under CP from transformers " f"{version_gates.TRANSFORMERS_IMAGES_UNDER_CP}",
                allow_module_level=True)
for _name, _minimum in (("transformers", requirements.TRANSFORMERS_MIN), ("accelerate", requirements.ACCELERATE_MIN),
                        ("trl", requirements.TRL_MIN)):
    _found = requirements.installed(_name)
    if _found is None or _found < _minimum:
        pytest.skip(f"hfpatch.integrations supports {_name}>={_minimum}", allow_module_level=True)

_AT_PIN = transformers.__version__ == ci_pin()
LOSS_RTOL = 1e-5
PARAM_ATOL = 2e-6
VOCAB = 160
IMAGE, VIDEO, START, END = 150, 151, 152, 153   # Qwen2-VL's special tokens in the tiny vocabulary
PATCH = 3 * 2 * 2 * 2                          # channels x temporal x patch x patch: one row of pixel_values
SEQ = 30                                       # the Trainer rows (padded to 32 by the integration under CP)
# (placeholder start, placeholders) of each Trainer row: across the chunk boundaries 8, 16 and 24
IMAGES_AT = ((6, 4), (21, 6), (13, 4), (14, 6), (6, 6), (22, 4), (7, 4), (15, 6))


def _model():
    torch.manual_seed(0)
    text = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=96, vocab_size=VOCAB,
                rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0})
    config = transformers.Qwen2VLConfig(
        text_config=text,
        vision_config=dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=2,
                           spatial_merge_size=2, temporal_patch_size=2, in_channels=3),
        image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)
    return transformers.Qwen2VLForConditionalGeneration(config)


def _image(g, placeholders: int) -> torch.Tensor:
    """One image as Qwen2-VL's image processor gives it: (4 x placeholders) patches of PATCH values (grid 1 x 4 x
    placeholders: 2 x 2 patches merge into one placeholder)."""
    return torch.randn(4 * placeholders, PATCH, generator=g)


def _grid(image: torch.Tensor) -> list:
    return [1, 4, image.shape[0] // 4]


# ------------------------------------------------------------------------------------- transformers' Trainer

def _trainer_rows() -> list:
    g = torch.Generator().manual_seed(1)
    rows = []
    for at, count in IMAGES_AT:
        ids = torch.randint(3, IMAGE, (SEQ,), generator=g)
        ids[at:at + count] = IMAGE
        ids[at - 1], ids[at + count] = START, END
        labels = ids.clone()
        labels[:3] = -100
        rows.append({"input_ids": ids, "labels": labels, "mm_token_type_ids": (ids == IMAGE).int(),
                     "pixel_values": _image(g, count)})
    return rows


def collate_images(rows: list) -> dict:
    """Rows of one image each -> a Qwen2-VL batch: per-token tensors stacked, the images' patches concatenated."""
    batch = {key: torch.stack([row[key] for row in rows]) for key in ("input_ids", "labels", "mm_token_type_ids")}
    batch["pixel_values"] = torch.cat([row["pixel_values"] for row in rows])
    batch["image_grid_thw"] = torch.tensor([_grid(row["pixel_values"]) for row in rows])
    return batch


# ------------------------------------------------------------------------------------------- TRL's SFTTrainer

def _tokenizer():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"t{i}": i for i in range(3, IMAGE)}, "<|image_pad|>": IMAGE,
             "<|video_pad|>": VIDEO, "<|vision_start|>": START, "<|vision_end|>": END}
    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>",
                                                unk_token="<unk>")


class _Processor(transformers.ProcessorMixin):
    """A stand-in for ``Qwen2VLProcessor`` (module docstring): the same outputs for images given as their patches
    (nested lists, as a datasets column holds them)."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer)

    def __call__(self, images=None, text=None, return_tensors="pt", **kwargs):
        images = [[torch.as_tensor(image, dtype=torch.float32) for image in row] for row in images or []]
        expanded = []
        for i, line in enumerate(text):
            pieces = line.split("<|image_pad|>")
            assert len(pieces) == len(images[i]) + 1, "one <|image_pad|> per image"
            tokens = [pieces[0]]
            for image, piece in zip(images[i], pieces[1:]):
                tokens += [" <|image_pad|>" * (image.shape[0] // 4) + " ", piece]
            expanded.append("".join(tokens))
        kwargs = {k: v for k, v in kwargs.items() if k in ("padding", "padding_side", "pad_to_multiple_of",
                                                            "truncation", "max_length", "add_special_tokens")}
        out = dict(self.tokenizer(expanded, return_tensors=return_tensors, **kwargs))
        out["mm_token_type_ids"] = (out["input_ids"] == IMAGE).int()
        flat = [image for row in images for image in row]
        if flat:
            out["pixel_values"] = torch.cat(flat)
            out["image_grid_thw"] = torch.tensor([_grid(image) for image in flat])
        return transformers.BatchFeature(out)


def _sft_rows():
    from datasets import Dataset

    g = torch.Generator().manual_seed(2)
    texts, images = [], []
    for i, (at, count) in enumerate(IMAGES_AT):
        words = [f"t{int(t)}" for t in torch.randint(3, IMAGE, (SEQ - count - 2 - 3 * (i % 3),), generator=g)]
        texts.append(" ".join(words[:at - 1] + ["<|vision_start|> <|image_pad|> <|vision_end|>"] + words[at - 1:]))
        images.append([_image(g, count).tolist()])
    return Dataset.from_dict({"text": texts, "images": images})


# ------------------------------------------------------------------------------------------------ the runs

def _arguments(kind: str, out: str, cp: int):
    common = dict(output_dir=out, max_steps=2, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                  learning_rate=0.1, optim="sgd", max_grad_norm=1.0, logging_steps=1, save_strategy="no",
                  report_to=[], seed=0, use_cpu=True, dataloader_drop_last=True, disable_tqdm=True,
                  remove_unused_columns=False, bf16=False, per_device_eval_batch_size=2)
    if cp > 1:
        from accelerate import ParallelismConfig

        common["parallelism_config"] = ParallelismConfig(dp_shard_size=1, cp_size=cp)
    if kind == "trainer":
        return transformers.TrainingArguments(**common)
    from trl import SFTConfig

    return SFTConfig(**common, max_length=None, dataset_num_proc=None)


def _trainer(kind: str, out: str, cp: int):
    args = _arguments(kind, out, cp)
    with hfpatch.integrations.parallelism_config_on_cpu():
        if kind == "trainer":
            rows = _trainer_rows()
            return transformers.Trainer(model=_model(), args=args, train_dataset=rows, eval_dataset=rows[:4],
                                        data_collator=collate_images)
        from trl import SFTTrainer

        rows = _sft_rows()
        return SFTTrainer(model=_model(), args=args, train_dataset=rows, eval_dataset=rows.select(range(4)),
                          processing_class=_Processor(_tokenizer()))


def train(rank: int, world: int, kinds: tuple, out: str) -> dict:
    """The runs of ``kinds`` in one world (CP over the world when it has 2 ranks), kind -> every logged entry of
    training, the collator's name, the ring calls, and (rank 0) the parameters after the steps."""
    return {kind: _train_one(rank, world, kind, out) for kind in kinds}


def _train_one(rank: int, world: int, kind: str, out: str) -> dict:
    trainer = _trainer(kind, f"{out}/{kind}{world}", world)
    handle = hfpatch.integrations.enable(trainer)
    try:
        trainer.train()
        calls = sum(handle.patch.calls.values())
        trainer.evaluate()   # logs its metrics (eval_loss, ...) as the last entry
    finally:
        handle.remove()
    logs = [{k: v for k, v in entry.items() if "runtime" not in k and "per_second" not in k}
            for entry in trainer.state.log_history if "train_runtime" not in entry]
    model = trainer.accelerator.unwrap_model(trainer.model)
    # numpy arrays: a tensor would travel through shared memory that the rank's exit takes away
    params = {n: p.detach().numpy().copy() for n, p in model.named_parameters()} if rank == 0 else None
    AcceleratorState._reset_state(reset_partial_state=False)   # the next kind builds its own accelerator
    return {"logs": logs, "calls": calls, "active": handle.active, "params": params,
            "collator": type(trainer.data_collator).__name__}


# Under the CI pin both kinds; on the older releases of the matrix the Trainer alone (the model's path is what
# differs between releases; TRL's collator and SFTTrainer are the same there, and CI's time is short).
KINDS = ("trainer", "sft") if _AT_PIN else ("trainer",)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """kind -> (the non-CP run, the CP run of every rank): one world of each size runs both kinds (a world's start
    imports transformers and TRL in every rank)."""
    out = str(tmp_path_factory.mktemp("vlm_trainer"))
    reference = run_world(1, train, KINDS, out)[0]
    cp = run_world(2, train, KINDS, out)
    return {kind: (reference[kind], [ranks[kind] for ranks in cp]) for kind in KINDS}


def _compare(kind: str, reference: dict, runs: list) -> dict:
    worst = {"loss": 0.0, "metric": 0.0, "param": 0.0}
    assert reference["calls"] == 0 and len(reference["logs"]) == 3, reference["logs"]   # 2 steps, evaluate()
    for rank, run in enumerate(runs):
        what = f"{kind} rank {rank}"
        assert run["active"] and run["calls"] > 0, what
        assert len(run["logs"]) == len(reference["logs"]), what
        for step, (ours, theirs) in enumerate(zip(run["logs"], reference["logs"])):
            assert ours.keys() == theirs.keys(), f"{what} step {step}: {sorted(ours)} vs {sorted(theirs)}"
            for name, want in theirs.items():
                got = ours[name]
                if isinstance(want, int) or name in ("epoch", "learning_rate", "step", "num_tokens"):
                    assert got == want, f"{what} step {step}: {name} {got} vs {want}"
                    continue
                error = abs(got - want) / max(abs(want), 1e-12)
                assert error <= LOSS_RTOL, f"{what} step {step}: {name} {got} vs {want}"
                key = "loss" if name in ("loss", "eval_loss") else "metric"
                worst[key] = max(worst[key], error)
    for name, want in reference["params"].items():
        error = float(abs(runs[0]["params"][name] - want).max())
        assert error <= PARAM_ATOL, f"{kind}: parameter {name} differs by {error}"
        worst["param"] = max(worst["param"], error)
    assert any(float(abs(want - _model().state_dict()[name].numpy()).max()) > 1e-4
               for name, want in reference["params"].items() if ".visual." in name), f"{kind}: the tower never moved"
    return {"worst": worst, "collator": runs[0]["collator"]}


def test_trainer_with_images_equals_non_cp(runs):
    result = _compare("trainer", *runs["trainer"])
    print("Trainer, Qwen2-VL, 2 ranks, worst differences:", result["worst"])


def test_sft_trainer_with_trl_vision_collator_equals_non_cp(runs):
    if "sft" not in runs:
        skip_unless_ci_pin("SFTTrainer with TRL's vision collator runs under the CI pin")
    result = _compare("sft", *runs["sft"])
    assert result["collator"] == "DataCollatorForVisionLanguageModeling", result["collator"]
    print("SFTTrainer, Qwen2-VL, 2 ranks, worst differences:", result["worst"])


# ---------------------------------------------------------------------------------------- the batch, alone

class _Patch:
    """What prepare_batch reads of a Patch: ``ctx`` (no step recorded: an identity split) and ``shard_inputs``."""

    def __init__(self) -> None:
        self.ctx = types.SimpleNamespace(world_size=2, step=None)
        self.given = None

    def shard_inputs(self, input_ids, labels=None, position_ids=None):
        self.given = position_ids
        positions = torch.arange(input_ids.shape[1]).expand(input_ids.shape)
        return {"input_ids": input_ids, "position_ids": positions, "labels": labels}


def test_images_pass_whole_and_token_types_are_padded_with_the_row():
    rows = collate_images(_trainer_rows()[:2])   # 30 tokens: padded to 32
    patch = _Patch()
    out = prepare_batch(patch, dict(rows))
    assert patch.given is None                   # no position ids given: none made up for the model to keep
    assert out["pixel_values"] is rows["pixel_values"] and out["image_grid_thw"] is rows["image_grid_thw"]
    types_ = out["mm_token_type_ids"]
    assert types_.shape == (2, 32) and torch.equal(types_[:, :SEQ], rows["mm_token_type_ids"])
    assert not bool(types_[:, SEQ:].any())      # the end padding is text
    assert out["input_ids"].shape == (2, 32)


@pytest.mark.parametrize("extra, parameter, why", [
    ({"position_ids": torch.zeros(3, 2, SEQ, dtype=torch.long)}, "position_ids", "multimodal rotary"),
    ({"mm_token_type_ids": torch.zeros(2, SEQ - 1, dtype=torch.int32)}, "mm_token_type_ids", "per-token"),
    ({"token_type_ids": torch.zeros(2, SEQ - 1, dtype=torch.int32)}, "token_type_ids", "per-token"),
])
def test_what_the_batch_cannot_split_exactly_is_refused_by_name(extra, parameter, why):
    rows = collate_images(_trainer_rows()[:2])
    rows.update(extra)
    with pytest.raises(UnsupportedArgument) as info:
        prepare_batch(_Patch(), rows)
    assert info.value.parameter == parameter and why in str(info.value) and info.value.fix, str(info.value)
