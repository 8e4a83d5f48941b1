"""hfpatch in the HuggingFace training stack: transformers' ``Trainer``, TRL's ``SFTTrainer`` and accelerate's
``ParallelismConfig``.

    args = TrainingArguments(..., parallelism_config=ParallelismConfig(dp_shard_size=dp, cp_size=cp))
    trainer = Trainer(model=model, args=args, ...)          # or trl.SFTTrainer / DPOTrainer / RewardTrainer
    cp = hfpatch.integrations.enable(trainer)               # ring attention over the "cp" mesh dimension
    trainer.train()

On a CPU-only machine build the trainer inside ``parallelism_config_on_cpu()`` (accelerate refuses a
``ParallelismConfig`` there; ``hfpatch.integrations.cpu`` says what that context changes). Supported releases:
``hfpatch.integrations.requirements``. docs/training-stack.md has the whole story.

Importing this package also guards against a forgotten ``enable``: ``guard_missing_enable`` (``trainer.py``).
"""
from hfpatch.integrations.cpu import parallelism_config_on_cpu
from hfpatch.integrations.entry import enable
from hfpatch.integrations.trainer import TrainerCP, guard_missing_enable

guard_missing_enable()

__all__ = ["enable", "TrainerCP", "parallelism_config_on_cpu"]
