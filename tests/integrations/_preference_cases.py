"""TRL's DPOTrainer cases of tests/integrations/_trainer_cases.py (launched the same way): the dataset, the
arguments and the trainer of each ``dpo_*`` kind.

Kinds (``model:kind``; model ``llama``, ``qwen3`` or ``gemma2``, tiny, random weights, fp32):

- ``dpo_sigmoid``: the sigmoid loss against a reference model given as ``ref_model=`` (a copy of the policy), which
  DPOTrainer prepares while it is built (before ``enable``);
- ``dpo_ipo``: the IPO loss (length-normalised) with ``precompute_ref_log_probs=True``: TRL scores the reference
  while the trainer is built, without CP;
- ``dpo_lora``: the sigmoid loss on a LoRA adapter (``peft_config=``); the reference is the policy with the adapter
  disabled;
- ``kto``: TRL's KTOTrainer on the same examples unpaired (each prompt with its chosen completion, labelled
  desirable, and with its rejected one, undesirable), against a given ``ref_model``; its KL term scores each
  batch's completions against the batch's other prompts.

Rows: a prompt and two completions of different lengths per example (TRL pads ``[chosen; rejected]`` on the right,
so every batch has padding). Every metric TRL logs is recorded.
"""
from __future__ import annotations

import copy
import os

import torch

from hfpatch.cli.demo_models import build_model as demo_model

VOCAB = 128
EXAMPLES = 16
EVAL_EXAMPLES = 8
DPO_KINDS = ("dpo_sigmoid", "dpo_ipo", "dpo_lora")
KTO_KINDS = ("kto",)
# metrics TRL's DPOTrainer logs per optimiser step (and "eval_" + each in evaluation)
METRICS = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
           "logps/chosen", "logps/rejected", "logits/chosen", "logits/rejected", "entropy", "mean_token_accuracy",
           "num_tokens")


def tokenizer():
    """A word-level tokenizer over "t3" .. "t127" (split on spaces), with <pad> and <eos>."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"t{i}": i for i in range(3, VOCAB)}}
    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>",
                                   unk_token="<unk>")


def random_words(g, low, high):
    """Between ``low`` and ``high`` - 1 random words "t3" .. "t127" (``g``: the torch generator), space-separated."""
    n = int(torch.randint(low, high, (1,), generator=g))
    return " ".join(f"t{int(t)}" for t in torch.randint(3, VOCAB, (n,), generator=g))


def dataset(directory: str, split: str = "train", unpaired: bool = False):
    """Prompt / chosen / rejected texts: prompts of 3-9 tokens, completions of 2-12 (then <eos>); ``unpaired``:
    KTO's prompt / completion / label rows of the same texts. Saved under ``directory`` by the main process and
    loaded from there by every rank: TRL caches precomputed reference log-probs next to the dataset's files, which
    every rank must share."""
    from accelerate import PartialState
    from datasets import load_from_disk

    path = os.path.join(directory, f"{'unpaired' if unpaired else 'preference'}_{split}")
    with PartialState().main_process_first():
        if PartialState().is_main_process and not os.path.exists(path):
            (_unpaired(_texts(split)) if unpaired else _texts(split)).save_to_disk(path)
    return load_from_disk(path)


def _unpaired(paired):
    from datasets import Dataset

    rows = {"prompt": [], "completion": [], "label": []}
    for example in paired:
        for completion, label in ((example["chosen"], True), (example["rejected"], False)):
            rows["prompt"].append(example["prompt"])
            rows["completion"].append(completion)
            rows["label"].append(label)
    return Dataset.from_dict(rows)


def _texts(split: str):
    from datasets import Dataset

    g = torch.Generator().manual_seed(0 if split == "train" else 1)
    rows = {"prompt": [], "chosen": [], "rejected": []}
    for _ in range(EXAMPLES if split == "train" else EVAL_EXAMPLES):
        rows["prompt"].append(random_words(g, 3, 10))
        rows["chosen"].append(" " + random_words(g, 2, 13) + " <eos>")
        rows["rejected"].append(" " + random_words(g, 2, 13) + " <eos>")
    return Dataset.from_dict(rows)


def build_model(name: str):
    """A tiny causal LM of family ``name``; qwen3 is built here (the demo families lack it)."""
    if name != "qwen3":
        return demo_model(name)
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, attn_implementation="eager")
    return Qwen3ForCausalLM(config)


def arguments(kind: str, common: dict):
    from trl import DPOConfig, KTOConfig

    if kind == "kto":
        return KTOConfig(**common, beta=0.5, max_length=None, dataset_num_proc=None)
    return DPOConfig(**common, loss_type=["ipo" if kind == "dpo_ipo" else "sigmoid"], beta=0.5,
                     precompute_ref_log_probs=kind == "dpo_ipo", max_length=None, dataset_num_proc=None)


def trainer(model_name: str, kind: str, args):
    from trl import DPOTrainer, KTOTrainer

    model = build_model(model_name)
    data = os.path.dirname(args.output_dir)
    if kind == "kto":
        return KTOTrainer(model=model, ref_model=copy.deepcopy(model), args=args,
                          train_dataset=dataset(data, unpaired=True), eval_dataset=dataset(data, "eval", unpaired=True),
                          processing_class=tokenizer())
    peft_config = None
    if kind == "dpo_lora":
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                                 task_type="CAUSAL_LM")
    reference = copy.deepcopy(model) if kind == "dpo_sigmoid" else None
    return DPOTrainer(model=model, ref_model=reference, args=args, train_dataset=dataset(data),
                      eval_dataset=dataset(data, "eval"), processing_class=tokenizer(), peft_config=peft_config)
