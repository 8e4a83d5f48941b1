"""hfpatch: a compatibility guard and patch manager giving HuggingFace transformers context parallelism."""

__version__ = "0.1.0"
