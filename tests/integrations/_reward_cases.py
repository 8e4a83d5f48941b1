"""TRL's RewardTrainer cases of tests/integrations/_trainer_cases.py (launched the same way): the dataset, the
arguments and the trainer of each ``reward*`` kind.

Kinds (``model:kind``; model ``llama``, ``qwen3`` or ``gemma2`` (sliding window, softcapping): a tiny
``*ForSequenceClassification`` with one label, random weights, fp32):

- ``reward``: the Bradley-Terry loss with a ``margin`` column and ``center_rewards_coefficient``; the pad token is
  id 0;
- ``reward_pad``: the plain loss with a pad token that is not id 0 (the integration's own end padding must be the
  pad token, or the pooled head would pool it), on odd-sized datasets without ``dataloader_drop_last``: the last
  batch of an epoch and of the eval set is cut to its remainder by accelerate, in the loss and in TRL's gathered
  metrics.

Rows: a prompt and two completions of different lengths per example (TRL pads ``[chosen; rejected]`` on the right
with the pad token; row lengths are rarely a multiple of 2 x cp, so the integration pads most batches too). Every
metric TRL logs is recorded.
"""
from __future__ import annotations

import os

import torch

from _preference_cases import VOCAB, random_words

EXAMPLES = 16
EVAL_EXAMPLES = 8
REWARD_KINDS = ("reward", "reward_pad")
# metrics TRL's RewardTrainer logs per optimiser step (and "eval_" + each in evaluation)
METRICS = ("loss", "grad_norm", "num_tokens", "min_reward", "mean_reward", "max_reward", "accuracy", "margin")
PAD_ID = {"reward": 0, "reward_pad": 5}
CENTER_REWARDS = 0.01


def tokenizer(pad_id: int):
    """A word-level tokenizer over "t3" .. "t127" (split on spaces) with <eos> at 1 and <pad> at ``pad_id`` (the
    word it displaces takes id 0)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    words = {"<eos>": 1, "<unk>": 2, **{f"t{i}": i for i in range(3, VOCAB)}}
    displaced = next((word for word, i in words.items() if i == pad_id), None)
    if displaced is not None:
        words[displaced] = 0
    backend = Tokenizer(WordLevel({**words, "<pad>": pad_id}, unk_token="<unk>"))
    backend.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>",
                                   unk_token="<unk>")


def dataset(kind: str, split: str = "train"):
    """Prompt / chosen / rejected texts: prompts of 3-9 tokens, completions of 2-12 (then <eos>); ``reward`` adds a
    margin per example."""
    from datasets import Dataset

    g = torch.Generator().manual_seed(20 if split == "train" else 21)
    rows = {"prompt": [], "chosen": [], "rejected": []}
    odd = 1 if kind == "reward_pad" else 0
    for _ in range((EXAMPLES if split == "train" else EVAL_EXAMPLES) - odd):
        rows["prompt"].append(random_words(g, 3, 10))
        rows["chosen"].append(" " + random_words(g, 2, 13) + " <eos>")
        rows["rejected"].append(" " + random_words(g, 2, 13) + " <eos>")
    if kind == "reward":
        rows["margin"] = (torch.rand(len(rows["prompt"]), generator=g) * 0.5).tolist()
    return Dataset.from_dict(rows)


def build_model(name: str, pad_id: int):
    """A tiny ``*ForSequenceClassification`` of family ``name`` (one label: the reward): Llama, Qwen3, or Gemma-2
    with a sliding window on every other layer and attention logit softcapping (its final-logit softcapping
    applies to the LM head only)."""
    import transformers

    family = {"llama": ("LlamaConfig", "LlamaForSequenceClassification", {}),
              "qwen3": ("Qwen3Config", "Qwen3ForSequenceClassification", {}),
              "gemma2": ("Gemma2Config", "Gemma2ForSequenceClassification", dict(
                  sliding_window=8, attn_logit_softcapping=2.0, query_pre_attn_scalar=8,
                  hidden_activation="gelu_pytorch_tanh"))}[name]
    config = getattr(transformers, family[0])(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_labels=1, pad_token_id=pad_id, attn_implementation="eager",
        **family[2])
    torch.manual_seed(0)
    return getattr(transformers, family[1])(config)


def arguments(kind: str, common: dict):
    from trl import RewardConfig

    common = dict(common, dataloader_drop_last=kind != "reward_pad")
    return RewardConfig(**common, max_length=None, dataset_num_proc=None,
                        center_rewards_coefficient=CENTER_REWARDS if kind == "reward" else None)


def trainer(model_name: str, kind: str, args):
    from trl import RewardTrainer

    pad_id = PAD_ID[kind]
    os.makedirs(args.output_dir, exist_ok=True)
    return RewardTrainer(model=build_model(model_name, pad_id), args=args, train_dataset=dataset(kind),
                         eval_dataset=dataset(kind, "eval"), processing_class=tokenizer(pad_id))
