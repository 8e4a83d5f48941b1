"""transformers' Trainer with context parallelism through hfpatch: accelerate's ParallelismConfig gives the mesh
(dp x cp) and the same batch to every rank of a CP group; hfpatch.integrations.enable(trainer) runs ring attention
over the cp dimension and makes the loss, the gradients and the logged loss equal to the run without CP.

    # CPU (gloo), dp=1 x cp=2, then the same script without CP (same losses):
    torchrun --nproc-per-node 2 examples/trainer_cp.py --cp 2
    torchrun --nproc-per-node 1 examples/trainer_cp.py --cp 1
    # CPU, dp=2 x cp=2 through accelerate's launcher (--multi_gpu only picks its multi-process launcher):
    accelerate launch --multi_gpu --num_processes 4 examples/trainer_cp.py --dp 2 --cp 2
    # GPUs (NCCL), FSDP2 over dp x cp as accelerate shards it, bf16 weights:
    accelerate launch --use_fsdp --fsdp_version 2 --num_processes 2 examples/trainer_cp.py --device cuda --cp 2 \
        --model small --seq-len 32768 --dtype bfloat16

The model is a Llama built from its config with random weights (no download); replace ``build_model`` with
``AutoModelForCausalLM.from_pretrained(...)`` for a real one. Rows are random tokens, one document per row.
"""
from __future__ import annotations

import argparse
import contextlib

import torch

SIZES = {  # hidden, layers, heads, kv heads, intermediate
    "tiny": (64, 2, 4, 2, 128),
    "small": (2048, 16, 32, 8, 8192),   # about 1B parameters
}


def build_model(size: str, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, layers, heads, kv_heads, inter = SIZES[size]
    config = LlamaConfig(vocab_size=32000 if size != "tiny" else 128, hidden_size=hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=inter,
                         max_position_embeddings=131072, tie_word_embeddings=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(dtype)


def build_dataset(rows: int, seq_len: int, vocab: int):
    from datasets import Dataset

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (rows, seq_len), generator=g).tolist()
    return Dataset.from_dict({"input_ids": ids, "labels": ids})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--cp", type=int, default=2, help="context-parallel size (1: no CP)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--model", choices=tuple(SIZES), default="tiny")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per row (split over the cp ranks)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch", type=int, default=2, help="rows per dp replica and step")
    args = p.parse_args()

    import hfpatch.integrations
    from accelerate import ParallelismConfig
    from transformers import Trainer, TrainingArguments, default_data_collator

    dtype = getattr(torch, args.dtype)
    model = build_model(args.model, dtype)
    dataset = build_dataset(args.steps * args.batch * args.dp, args.seq_len, model.config.vocab_size)
    parallelism = ParallelismConfig(dp_shard_size=args.dp, cp_size=args.cp) if args.dp * args.cp > 1 else None
    training = TrainingArguments(
        output_dir="/tmp/hfpatch-trainer-cp", max_steps=args.steps, per_device_train_batch_size=args.batch,
        learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[], seed=0, bf16=False,
        use_cpu=args.device == "cpu", parallelism_config=parallelism, disable_tqdm=True)
    # CPU only: accelerate refuses a ParallelismConfig without accelerators (hfpatch/integrations/cpu.py).
    on_cpu = hfpatch.integrations.parallelism_config_on_cpu() if args.device == "cpu" else contextlib.nullcontext()
    with on_cpu:
        trainer = Trainer(model=model, args=training, train_dataset=dataset, data_collator=default_data_collator)
    cp = hfpatch.integrations.enable(trainer)       # every rank, before train(); no CP: changes nothing
    trainer.train()
    if trainer.is_world_process_zero():
        print(cp)
        for entry in trainer.state.log_history:
            if "loss" in entry and "train_runtime" not in entry:
                print(f"step {entry['step']}  loss {entry['loss']:.8f}  grad_norm {entry['grad_norm']:.6f}")


if __name__ == "__main__":
    main()
