"""TRL's GRPOTrainer and RLOOTrainer cases of tests/integrations/_trainer_cases.py (launched the same way): the
dataset, the arguments and the trainer of each kind, with completions from a test double in place of generation.

Kinds (``model:kind``; model ``llama``, ``qwen3`` or ``gemma2``, tiny, random weights, fp32, saved to disk and
passed by path, as TRL then builds the reference model from the same path; eager attention, see ``arguments``):

- ``grpo``: GRPOTrainer, its default loss (``dapo``), ``beta=0.1`` (a reference model, so the ``kl`` metric), two
  reward functions;
- ``grpo_bnpo``: GRPOTrainer with the ``bnpo`` loss, ``scale_rewards="batch"`` and two iterations per generation
  (the old policy's log-probs are scored too: importance ratios and clipping);
- ``rloo``: RLOOTrainer, ``beta=0.05`` (its default), the same rewards.

Completions: ``_generate_single_turn`` is replaced by a deterministic double (``completions``): each prompt's k-th
occurrence in a call gets 2-9 tokens drawn from a generator seeded by the prompt, k, the step and the mode, some
ending in <eos>. It is the same for every rank holding the same prompts, so a run with CP and one without see the
same completions. Rows: left-padded prompts of 3-9 tokens and right-padded completions. Every metric TRL logs is
recorded (tests/integrations/test_integrations.py compares them).
"""
from __future__ import annotations

import os
import zlib

import torch

import _preference_cases as preference

PROMPTS = 16
EVAL_PROMPTS = 4
POLICY_KINDS = ("grpo", "grpo_bnpo", "rloo")
NUM_GENERATIONS = 2


def dataset(directory: str, split: str = "train"):
    """Prompt texts of 3-9 tokens, saved under ``directory`` by the main process and loaded by every rank."""
    from accelerate import PartialState
    from datasets import Dataset, load_from_disk

    path = os.path.join(directory, f"prompts_{split}")
    with PartialState().main_process_first():
        if PartialState().is_main_process and not os.path.exists(path):
            g = torch.Generator().manual_seed(2 if split == "train" else 3)
            count = PROMPTS if split == "train" else EVAL_PROMPTS
            Dataset.from_dict({"prompt": [preference.random_words(g, 3, 10) for _ in range(count)]}).save_to_disk(path)
    return load_from_disk(path)


def saved_model(directory: str, name: str) -> str:
    """``preference.build_model(name)`` saved (with its tokenizer) under ``directory`` by the main process."""
    from accelerate import PartialState

    path = os.path.join(directory, f"model_{name}")
    with PartialState().main_process_first():
        if PartialState().is_main_process and not os.path.exists(path):
            preference.build_model(name).save_pretrained(path)
            preference.tokenizer().save_pretrained(path)
    return path


def completions(prompt_ids: list, step: int, mode: str) -> list:
    """The test double's completions (module docstring): token ids, one list per prompt row."""
    seen: dict = {}
    out = []
    for ids in prompt_ids:
        key = tuple(ids)
        k = seen[key] = seen.get(key, -1) + 1
        g = torch.Generator().manual_seed(zlib.crc32(repr((key, k, step, mode)).encode()))
        n = int(torch.randint(2, 10, (1,), generator=g))
        tokens = torch.randint(3, preference.VOCAB, (n,), generator=g).tolist()
        if int(torch.randint(0, 2, (1,), generator=g)):
            tokens[-1] = 1   # <eos>
        out.append(tokens)
    return out


def even_tokens(completions, **_) -> list:
    """A reward: the share of a completion's words whose token id is even."""
    return [sum(int(w[1:]) % 2 == 0 for w in c.split() if w.startswith("t")) / max(len(c.split()), 1)
            for c in completions]


def short(completions, **_) -> list:
    """A reward: minus a tenth of a completion's length in words."""
    return [-0.1 * len(c.split()) for c in completions]


def arguments(kind: str, common: dict):
    from trl import GRPOConfig, RLOOConfig

    common = dict(common)
    parallelism = common.pop("parallelism_config", None)
    # The non-CP reference attention is the model's eager path, on every release: from a path, transformers 5.0
    # builds Gemma-2 with SDPA, which drops its attention softcapping (later releases refuse SDPA for it).
    options = dict(num_generations=NUM_GENERATIONS, max_completion_length=12,
                   per_device_eval_batch_size=NUM_GENERATIONS, num_generations_eval=NUM_GENERATIONS,
                   model_init_kwargs={"attn_implementation": "eager"})
    common.pop("per_device_eval_batch_size", None)
    if kind == "rloo":
        args = RLOOConfig(**common, **options, beta=0.05)
    elif kind == "grpo":
        args = GRPOConfig(**common, **options, beta=0.1)
    else:
        args = GRPOConfig(**common, **options, beta=0.1, loss_type="bnpo", scale_rewards="batch", num_iterations=2)
    # TRL's configs refuse cp_size > 1 in __post_init__: assigned afterwards, as the integration's docs say
    args.parallelism_config = parallelism
    return args


def trainer(model_name: str, kind: str, args):
    from trl import GRPOTrainer, RLOOTrainer

    base = RLOOTrainer if kind == "rloo" else GRPOTrainer

    class WithTestDoubleCompletions(base):
        def _generate_single_turn(self, prompt_ids, images, multimodal_fields, *_, **__):
            mode = "train" if self.model.training else "eval"
            ids = completions(prompt_ids, self.state.global_step, mode)
            return ids if base is RLOOTrainer else (ids, None)

    data = os.path.dirname(args.output_dir)
    path = saved_model(data, model_name)
    return WithTestDoubleCompletions(model=path, reward_funcs=[even_tokens, short], args=args,
                                     train_dataset=dataset(data), eval_dataset=dataset(data, "eval"),
                                     processing_class=preference.tokenizer())
