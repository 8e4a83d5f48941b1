"""TRL's SFTTrainer with context parallelism through hfpatch, on padding-free packed documents: each step's row
holds several documents (position ids restart at 0 for each, TRL's collator adds cu_seq_lens); hfpatch splits the
row over the cp ranks and every document attends only to itself, sliding windows and softcapping included.

    # CPU (gloo), dp=1 x cp=2, then the same steps without CP (one process) and the comparison:
    torchrun --nproc-per-node 2 examples/sft_cp.py --cp 2
    accelerate launch --multi_gpu --num_processes 2 examples/sft_cp.py --cp 2   # the same, accelerate's launcher
    # without CP only, one process:
    python examples/sft_cp.py --cp 1
    # GPUs (NCCL), FSDP2 over dp x cp, bf16 weights, 32k tokens per GPU:
    accelerate launch --use_fsdp --fsdp_version 2 --num_processes 2 examples/sft_cp.py --device cuda --cp 2 \
        --model small --pack-len 65536 --dtype bfloat16

TRL refuses ``packing=True`` when ``cp_size > 1`` (its check assumes PyTorch's CP, which drops the document mask).
So the documents are bin-packed first with TRL's own ``pack_dataset`` and trained with ``padding_free=True`` (an
``SFTConfig`` field): the same rows, the same collator. ``--plain`` trains right-padded rows of one document
instead (documents longer than ``--pack-len`` cut at it). The model is built from a config, so SFTTrainer gets its
tokenizer as ``processing_class`` (a model loaded with ``from_pretrained`` has one to load beside it).

``--cp-impl accelerate`` trains with accelerate's own context parallelism instead of hfpatch, as its documentation
sets it up: the same ``ParallelismConfig(cp_size=N)``, no ``enable``; the Trainer shards each batch with PyTorch's
``context_parallel`` over SDPA (``attn_implementation="sdpa"``, which it requires) and accelerate's hooks drop the
attention mask for ``is_causal=True``; rows padded to a multiple of 2 x CP size (``pad_to_multiple_of``: the
head-tail load balancing needs it). GPUs only, launched with FSDP2 (accelerate requires it for ``cp_size > 1``)::

    accelerate launch --use_fsdp --fsdp_version 2 --num_processes 2 examples/sft_cp.py --device cuda --cp 2 \
        --cp-impl accelerate --plain --batch 1 --model small --pack-len 65536 --doc-len 131072 --dtype bfloat16

Refused before any work (usage error, exit 2, naming the fix): ``--cp-impl accelerate`` on packed rows (torch's
``context_parallel`` has no document mask: packed documents would attend across their boundaries; TRL refuses
``packing=True`` under CP for that reason) and on CPU with ``--cp`` > 1 (``context_parallel`` shards only the CUDA
SDPA kernels; CPU SDPA fails with "does not have a sharding strategy registered"). benchmarks/sft_throughput.py
times hfpatch (packed, and on accelerate's rows), one GPU and accelerate's CP against each other with this script.

What rank 0 prints, and the options ``--no-compare``, ``--plot FILE`` and ``--log-json PATH``: as in
examples/trainer_cp.py (every step, the throughput, then the same steps without CP as one process, side by side
with the verdict). ``--log-json PATH``: rank 0 writes every step's logged loss, grad norm and token count there,
with the run's throughput and, on CUDA, its peak memory (benchmarks/sft_cp_compare.py runs the script with and
without CP on the same global batches and compares those). Every rank ends by destroying its process group and
exiting without interpreter finalization (examples/_processes.py says why).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Optional

import torch

from _report import check_plot_argument
from trainer_cp import SIZES, add_report_arguments, build_model, check_world, end_run, on_cpu

CP_IMPLEMENTATIONS = ("hfpatch", "accelerate")


def build_tokenizer(vocab: int):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"t{i}": i for i in range(3, vocab)}}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(words, unk_token="<unk>")),
                                   pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def build_documents(count: int, mean_len: int, vocab: int, longest: Optional[int] = None):
    """``count`` random documents of mean length ``mean_len`` (each at most ``longest`` tokens), the same on every
    rank. The dataset is given its fingerprint (what it is made from) rather than letting ``datasets`` hash the Arrow
    table with dill, which fails on Python 3.12 with pyarrow 26 (``Can't pickle <class 'MonthDayNano'>``)."""
    from datasets import Dataset
    from datasets.table import InMemoryTable

    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(mean_len // 2, mean_len * 3 // 2 + 1, (count,), generator=g)
    if longest is not None:
        lengths = lengths.clamp(max=longest)
    documents = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths.tolist()]
    table = InMemoryTable.from_pydict({"input_ids": documents})
    return Dataset(table, fingerprint=f"sft-cp-documents-{count}-{mean_len}-{longest}-{vocab}-seed1")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="examples/sft_cp.py", description=__doc__.split("\n")[0])
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--cp", type=int, default=2, help="context-parallel size (1: no CP)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--model", choices=tuple(SIZES), default="tiny")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--pack-len", type=int, default=256, help="tokens per packed row (split over the cp ranks)")
    p.add_argument("--doc-len", type=int, default=40, help="mean document length")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--plain", action="store_true",
                   help="right-padded rows of one document (no packing), documents cut at --pack-len tokens")
    p.add_argument("--batch", type=int, default=None,
                   help="rows per dp replica and step (default: 1 packed row; 2 with --plain)")
    p.add_argument("--cp-impl", choices=CP_IMPLEMENTATIONS, default="hfpatch",
                   help="whose context parallelism: hfpatch's ring (default) or accelerate's own (torch's "
                        "context_parallel over SDPA; GPUs, --plain rows)")
    add_report_arguments(p)
    options = p.parse_args(argv)
    if options.batch is None:
        options.batch = 2 if options.plain else 1
    refusal = unrunnable(options)
    if refusal is not None:
        p.error(refusal)
    check_world(p, options)
    check_plot_argument(options.plot, "examples/sft_cp.py")
    return options


def unrunnable(options) -> Optional[str]:
    """Why this combination of options cannot train (None when it can): accelerate's CP on packed rows or on CPU."""
    if options.cp_impl != "accelerate" or options.cp == 1:
        return None
    if not options.plain:
        return ("--cp-impl accelerate cannot train packed rows: torch's context_parallel, which accelerate's CP runs, "
                "shards one causal sequence and drops the attention mask, so packed documents would attend across "
                "their boundaries (TRL refuses packing=True under cp_size > 1 for the same reason). Fix: add --plain "
                "(one document per row), or use --cp-impl hfpatch for packed rows")
    if options.device != "cuda":
        return ("--cp-impl accelerate needs --device cuda: torch's context_parallel shards only the CUDA SDPA "
                "kernels (flash, efficient, cuDNN); CPU SDPA fails under it (aten._scaled_dot_product_flash_"
                "attention_for_cpu \"does not have a sharding strategy registered\"). Fix: run it on GPUs with "
                "accelerate launch --use_fsdp --fsdp_version 2, or use --cp-impl hfpatch on CPU")
    return None


def train(options) -> dict:
    """Train on every rank; returns the steps and the throughput; rank 0 writes ``--log-json``."""
    import datasets
    from trl import pack_dataset

    from _step_clock import train_timed

    datasets.disable_progress_bars()
    model = build_model(options.model, getattr(torch, options.dtype))
    tokenizer = build_tokenizer(model.config.vocab_size)
    _align_special_tokens(model, tokenizer)
    docs_per_row = max(1, options.pack_len // options.doc_len)
    packed = not options.plain
    dataset = build_documents(2 * options.steps * options.dp * options.batch * docs_per_row, options.doc_len,
                              model.config.vocab_size, longest=None if packed else options.pack_len)
    if packed:
        dataset = pack_dataset(dataset, options.pack_len, strategy="bfd")
    settings = dict(output_dir=os.path.join(tempfile.gettempdir(), "hfpatch-sft-cp"), max_steps=options.steps,
                    per_device_train_batch_size=options.batch, learning_rate=1e-3, logging_steps=1,
                    save_strategy="no", report_to=[], seed=0, bf16=False, use_cpu=options.device == "cpu",
                    disable_tqdm=True, ddp_find_unused_parameters=False)
    if options.cp_impl == "accelerate":
        trainer, cp_handle = accelerate_cp_trainer(model, dataset, tokenizer, settings, options.dp, options.cp), None
    else:
        trainer, cp_handle = hfpatch_cp_trainer(options, model, dataset, tokenizer, settings, packed)
    cp = options.cp
    steps, run = train_timed(trainer, cp_handle, cp)      # this script prints its own line per step
    handle = repr(cp_handle) if cp_handle is not None else f"<accelerate context_parallel SDPA cp={cp}>"
    if options.log_json and trainer.is_world_process_zero():
        _write_log(options, model, cp_handle, handle, steps, run.to_dict())
    return {"handle": handle, "throughput": run.to_dict(),
            "steps": [{"step": e["step"], "loss": e["loss"], "grad_norm": e["grad_norm"]} for e in steps]}


def hfpatch_cp_trainer(options, model, dataset, tokenizer, settings: dict, packed: bool):
    """SFTTrainer with hfpatch's context parallelism (the default): (trainer, its ``TrainerCP`` handle)."""
    import hfpatch.integrations
    from accelerate import ParallelismConfig
    from trl import SFTConfig, SFTTrainer

    dp, cp = options.dp, options.cp
    with on_cpu(options.device):
        # README.md shows the lines from here up to "README.md: end" (tests/integrations/test_examples.py compares)
        # README.md: begin
        config = SFTConfig(**settings, padding_free=packed, max_length=None,  # an SFTConfig field, not SFTTrainer's
                           parallelism_config=ParallelismConfig(dp_shard_size=dp, cp_size=cp))
        trainer = SFTTrainer(model=model, args=config, train_dataset=dataset,
                             processing_class=tokenizer)    # a model built from a config has no tokenizer: pass one
        cp_handle = hfpatch.integrations.enable(trainer)    # every rank, after building the trainer, before train()
        # README.md: end
    return trainer, cp_handle


def accelerate_cp_trainer(model, dataset, tokenizer, settings: dict, dp: int, cp: int):
    """SFTTrainer with accelerate's own context parallelism (``--cp-impl accelerate``; module docstring): SDPA
    attention, unpacked rows padded to a multiple of 2 x ``cp``, no hfpatch."""
    from accelerate import ParallelismConfig
    from trl import SFTConfig, SFTTrainer

    model.set_attn_implementation("sdpa")   # the Trainer refuses anything else under torch's context_parallel
    config = SFTConfig(**settings, padding_free=False, max_length=None, pad_to_multiple_of=2 * cp,
                       parallelism_config=ParallelismConfig(dp_shard_size=dp, cp_size=cp))
    return SFTTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer)


def _align_special_tokens(model, tokenizer) -> None:
    """The model's pad and eos ids are the tokenizer's (SFTTrainer otherwise aligns them itself, with a warning)."""
    for config in (model.config, model.generation_config):
        config.pad_token_id, config.eos_token_id, config.bos_token_id = \
            tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.bos_token_id


def _write_log(args, model, cp, handle: str, steps, throughput=None) -> None:
    """``cp``: the ``TrainerCP`` handle, None under accelerate's own CP."""
    record = {"argv": vars(args), "cp": args.cp, "dp": args.dp, "dtype": args.dtype, "cp_impl": args.cp_impl,
              "active": cp is not None and cp.active,
              "ring_calls": sum(cp.patch.calls.values()) if cp is not None else 0,
              "layers": model.config.num_hidden_layers, "rows_per_step": args.batch, "packed": not args.plain,
              "attention": _attention(args, model, cp),
              "steps": [{"step": e["step"], "loss": e["loss"], "grad_norm": e["grad_norm"],
                         "num_tokens": e.get("num_tokens")} for e in steps],
              "handle": handle, "throughput": throughput}
    with open(args.log_json, "w") as f:
        json.dump(record, f, indent=1)


def _attention(args, model, cp) -> str:
    """What computed the attention, for the log: hfpatch's ring and its block backends, torch's context_parallel
    over SDPA, or the model's own attention (packed rows: transformers builds a dense document mask for SDPA)."""
    if cp is not None and cp.active:
        backends = "+".join(dict.fromkeys(c.backend for c in cp.patch.backend_choices)) or "?"
        return f"hfpatch ring ({backends})"
    own = model.config._attn_implementation
    if args.cp_impl == "accelerate" and args.cp > 1:
        return f"torch context_parallel over {own}"
    return f"{own}, document mask from the position ids" if not args.plain else own


def command_without_cp(options) -> list:
    """This script with ``--cp 1`` as one process: the global batch of every step (``--batch`` x dp rows)."""
    return [sys.executable, os.path.abspath(__file__), "--cp", "1", "--dp", "1", "--device", options.device,
            "--model", options.model, "--dtype", options.dtype, "--pack-len", str(options.pack_len),
            "--doc-len", str(options.doc_len), "--steps", str(options.steps), "--batch",
            str(options.batch * options.dp), *(["--plain"] if options.plain else [])]


def main() -> None:
    options = parse_args()
    record = train(options)
    end_run(options, record, command_without_cp(options), f"examples/sft_cp.py, {options.model} Llama, SFTTrainer")


if __name__ == "__main__":
    main()
