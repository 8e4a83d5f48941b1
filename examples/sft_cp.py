"""TRL's SFTTrainer with context parallelism through hfpatch, on padding-free packed documents: each step's row
holds several documents (position ids restart at 0 for each, TRL's collator adds cu_seq_lens); hfpatch splits the
row over the cp ranks and every document attends only to itself, sliding windows and softcapping included.

    # CPU (gloo), dp=1 x cp=2, then the same script without CP (same losses):
    torchrun --nproc-per-node 2 examples/sft_cp.py --cp 2
    torchrun --nproc-per-node 1 examples/sft_cp.py --cp 1
    # GPUs (NCCL), FSDP2 over dp x cp, bf16 weights, 32k tokens per GPU:
    accelerate launch --use_fsdp --fsdp_version 2 --num_processes 2 examples/sft_cp.py --device cuda --cp 2 \
        --model small --pack-len 65536 --dtype bfloat16

TRL refuses ``packing=True`` when ``cp_size > 1`` (its check assumes PyTorch's CP, which drops the document mask).
So the documents are bin-packed first with TRL's own ``pack_dataset`` and trained with ``padding_free=True``: the
same rows, the same collator. ``--plain`` trains right-padded rows of one document instead. ``--log-json PATH``:
rank 0 writes every step's logged loss, grad norm and token count there (benchmarks/sft_cp_compare.py runs the
script with and without CP on the same global batches and compares those). The script ends by destroying its
process group (``Accelerator.end_training``).
"""
from __future__ import annotations

import argparse
import contextlib
import json

import torch

from trainer_cp import SIZES, build_model


def build_tokenizer(vocab: int):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"t{i}": i for i in range(3, vocab)}}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(words, unk_token="<unk>")),
                                   pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def build_documents(count: int, mean_len: int, vocab: int):
    """``count`` random documents of mean length ``mean_len``, the same on every rank. The dataset is given its
    fingerprint (what it is made from) rather than letting ``datasets`` hash the Arrow table with dill, which fails
    on Python 3.12 with pyarrow 26 (``Can't pickle <class 'MonthDayNano'>``)."""
    from datasets import Dataset
    from datasets.table import InMemoryTable

    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(mean_len // 2, mean_len * 3 // 2 + 1, (count,), generator=g).tolist()
    documents = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]
    table = InMemoryTable.from_pydict({"input_ids": documents})
    return Dataset(table, fingerprint=f"sft-cp-documents-{count}-{mean_len}-{vocab}-seed1")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--cp", type=int, default=2, help="context-parallel size (1: no CP)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--model", choices=tuple(SIZES), default="tiny")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--pack-len", type=int, default=256, help="tokens per packed row (split over the cp ranks)")
    p.add_argument("--doc-len", type=int, default=40, help="mean document length")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--plain", action="store_true", help="right-padded rows of one document (no packing)")
    p.add_argument("--log-json", default=None, help="rank 0 writes the steps' loss, grad norm and tokens here")
    args = p.parse_args()

    import hfpatch.integrations
    from accelerate import ParallelismConfig
    from trl import SFTConfig, SFTTrainer, pack_dataset

    dtype = getattr(torch, args.dtype)
    model = build_model(args.model, dtype)
    vocab = model.config.vocab_size
    docs_per_row = max(1, args.pack_len // args.doc_len)
    dataset = build_documents(2 * args.steps * args.dp * docs_per_row, args.doc_len, vocab)
    if not args.plain:
        dataset = pack_dataset(dataset, args.pack_len, strategy="bfd")
    parallelism = ParallelismConfig(dp_shard_size=args.dp, cp_size=args.cp) if args.dp * args.cp > 1 else None
    config = SFTConfig(
        output_dir="/tmp/hfpatch-sft-cp", max_steps=args.steps, per_device_train_batch_size=1 if not args.plain
        else 2, learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[], seed=0, bf16=False,
        use_cpu=args.device == "cpu", parallelism_config=parallelism, padding_free=not args.plain, max_length=None,
        disable_tqdm=True)
    # CPU only: accelerate refuses a ParallelismConfig without accelerators (hfpatch/integrations/cpu.py).
    on_cpu = hfpatch.integrations.parallelism_config_on_cpu() if args.device == "cpu" else contextlib.nullcontext()
    with on_cpu:
        trainer = SFTTrainer(model=model, args=config, train_dataset=dataset, processing_class=build_tokenizer(vocab))
    cp = hfpatch.integrations.enable(trainer)       # every rank, before train(); no CP: changes nothing
    try:
        trainer.train()
        steps = [e for e in trainer.state.log_history if "loss" in e and "train_runtime" not in e]
        if trainer.is_world_process_zero():
            print(cp)
            for entry in steps:
                print(f"step {entry['step']}  loss {entry['loss']:.8f}  grad_norm {entry['grad_norm']:.6f}")
            if args.log_json:
                _write_log(args, model, cp, steps)
    finally:
        cp.remove()
        trainer.accelerator.end_training()          # destroys the process group (launched runs)


def _write_log(args, model, cp, steps) -> None:
    record = {"argv": vars(args), "cp": args.cp, "dp": args.dp, "dtype": args.dtype, "active": cp.active,
              "ring_calls": sum(cp.patch.calls.values()), "layers": model.config.num_hidden_layers,
              "rows_per_step": 2 if args.plain else 1,
              "steps": [{"step": e["step"], "loss": e["loss"], "grad_norm": e["grad_norm"],
                         "num_tokens": e.get("num_tokens")} for e in steps]}
    with open(args.log_json, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
