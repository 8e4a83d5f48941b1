"""Train a HuggingFace model with context parallelism (hfpatch) inside the usual stack: a 2-D DeviceMesh
(dp x cp), FSDP2 over dp, ring attention over cp, packed documents, optional activation checkpointing.

    torchrun --nproc-per-node 2 examples/train_cp.py                    # CPU, gloo: dp=1 x cp=2, then without CP
    torchrun --nproc-per-node 4 examples/train_cp.py                    # CPU, gloo: dp=2 x cp=2, then without CP
    torchrun --nproc-per-node 4 examples/train_cp.py --no-cp            # only the run without CP
    torchrun --nproc-per-node 2 examples/train_cp.py --device cuda --dp 1 --cp 2 --seq-len 32768 --model small

What one step does, on every rank (dp index d, cp index c):

1. The dp replica d takes its own packed row of documents (the same row on all cp ranks of the replica);
   ``--data batch``: one document per row instead (no packing; sdpa's causal kernel serves the run without CP).
2. ``patch.shard_inputs`` keeps this rank's part of the row (the layout the ring kernel needs) with GLOBAL
   position ids and labels already shifted; the model runs on that part; attention is ring attention over cp.
3. ``patch.reduce_loss``: the token-weighted mean loss over cp (each rank's gradient flows into its own tokens only).
4. backward: FSDP2 reduce-scatters the gradients over dp (mean over the replicas), then an all-reduce hook sums
   the shards over cp (the ranks of a cp group hold the same dp shard and each has the gradient of its tokens).
   Result: the gradient of the mean over replicas of each replica's token-mean loss, as without CP.

After the CP run the same launch trains the same model again without CP, on the same mesh and global batches:
``hfpatch.apply(None)`` is inactive, the input helpers are the identity, and every cp rank of a replica computes
the whole row with the model's own attention (sdpa; a packed row with ``document_mask``), so the losses equal the
CP run's and the step time and peak memory are those of one device holding the whole sequence. ``--no-cp`` runs
only that; ``--no-compare`` only the CP run.

Per step, rank 0 prints the global loss, the step time (max over ranks), tokens per second per device and the peak
memory (CUDA: ``max_memory_allocated``, max over ranks; CPU: the process's peak RSS); after each run a summary of
the steps after the first (warm-up). Last, both runs side by side: every step's loss, the largest relative
difference against ring_kernels.tolerances' "cp" loss bound of the dtype (exit status 1 beyond it), and both
throughputs (tokens of the global batch per second). ``--plot FILE`` draws both loss curves (needs matplotlib).
Every rank ends by destroying its process group and exiting without interpreter finalization
(examples/_processes.py says why).
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist

from _processes import exit_now, leave_process_group
from _report import Run, check_plot_argument, compare, plot_losses, timed_steps

# Model presets: (hidden, layers, heads, kv heads, intermediate, vocab). "tiny" is for CPU and CI.
MODELS = {
    "tiny": (64, 2, 4, 2, 128, 128),
    "small": (1024, 8, 16, 4, 2816, 32000),
    "medium": (2048, 16, 16, 8, 5632, 32000),
}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cpu: gloo (default); cuda: NCCL, one GPU per process (LOCAL_RANK)")
    parser.add_argument("--dp", type=int, default=None, help="data-parallel size (default: world size / cp)")
    parser.add_argument("--cp", type=int, default=None, help="context-parallel size (default: 2, or 1 for 1 rank)")
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps (default 5)")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per packed row (default 128)")
    parser.add_argument("--data", choices=("packed", "batch"), default="packed",
                        help="packed: one row of documents per replica (default); batch: one document per row")
    parser.add_argument("--doc-len", type=int, default=None,
                        help="mean document length in the packed row (default: seq-len / 4)")
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny", help="model size preset (default tiny)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                        help="parameter dtype (default: float32 on cpu, bfloat16 on cuda)")
    parser.add_argument("--lr", type=float, default=None,
                        help="AdamW learning rate (default 3e-3 for the tiny model, 3e-4 for the larger ones)")
    parser.add_argument("--kernel", default="auto", help="hfpatch ring variant, e.g. auto, llama3, zigzag:reference")
    parser.add_argument("--checkpointing", action="store_true", help="activation checkpointing around every layer")
    parser.add_argument("--compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
                        help="torch.compile the FSDP2 model (backend: inductor, or e.g. aot_eager)")
    parser.add_argument("--no-cp", action="store_true", help="only the run without CP (the same mesh and batches)")
    parser.add_argument("--no-compare", action="store_true", help="only the CP run (no run without CP after it)")
    parser.add_argument("--plot", metavar="FILE", help="write the loss curves with and without CP to FILE "
                                                       "(.png, .svg, .pdf; needs matplotlib)")
    parser.add_argument("--attn", default="sdpa",
                        help="the model's own attention, used without CP (default sdpa; e.g. flash_attention_2 on "
                             "GPUs with flash-attn for packed rows, which sdpa can only run with a dense mask)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.lr is None:   # bf16 models of 100M+ parameters diverge at the tiny model's rate
        args.lr = 3e-3 if args.model == "tiny" else 3e-4
    check_plot_argument(args.plot, "examples/train_cp.py")
    return args


# ------------------------------------------------------------------------------------------------ setup


def init_distributed(args):
    """Process group and the (dp, cp) mesh. Returns (mesh, device)."""
    from torch.distributed.device_mesh import init_device_mesh

    if "RANK" not in os.environ:
        sys.exit("run me with torchrun, e.g. torchrun --nproc-per-node 4 examples/train_cp.py")
    if args.device == "cuda":
        if not torch.cuda.is_available():
            sys.exit("--device cuda: no CUDA device is visible")
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    world = dist.get_world_size()
    cp = args.cp if args.cp is not None else (2 if world > 1 else 1)
    dp = args.dp if args.dp is not None else world // max(cp, 1)
    if cp < 1 or dp < 1 or dp * cp != world:
        sys.exit(f"--dp {dp} x --cp {cp} must equal the number of processes ({world})")
    if args.seq_len % cp:
        sys.exit(f"--seq-len {args.seq_len} must be a multiple of --cp {cp}")
    mesh = init_device_mesh(device.type, (dp, cp), mesh_dim_names=("dp", "cp"))
    return mesh, device


def build_model(args, device, dtype):
    """A Llama built from its config (random weights, the same on every rank), on ``device``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, layers, heads, kv_heads, intermediate, vocab = MODELS[args.model]
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=max(args.seq_len, 256), attention_dropout=0.0, use_cache=False,
                         tie_word_embeddings=False)
    config._attn_implementation = args.attn   # the non-CP attention; hfpatch.apply(model=) switches it to the ring
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    return model.to(dtype).train()


def parallelize(model, mesh, args, with_cp: bool):
    """hfpatch over cp, activation checkpointing, FSDP2 over dp with the gradient sum over cp. Returns the patch."""
    import hfpatch
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    cp_mesh = mesh["cp"]
    # Inactive (identity helpers) without CP: the run without CP, or a cp dimension of one rank.
    patch = hfpatch.apply(cp_mesh if with_cp else None, kernel=args.kernel, model=model)
    if args.checkpointing:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

        layer_cls = type(model.model.layers[0])
        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, layer_cls))
    # Gradients reduced in fp32 even for bf16 parameters.
    policy = MixedPrecisionPolicy(reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"], mp_policy=policy)
    fully_shard(model, mesh=mesh["dp"], mp_policy=policy)
    if patch.active:
        cp_group = cp_mesh.get_group()

        def sum_over_cp(reduce_output: torch.Tensor) -> None:
            # After FSDP2's reduce-scatter (mean over dp): every cp rank holds the same dp shard, with the
            # gradient of its own tokens; their sum is the replica's gradient.
            dist.all_reduce(reduce_output, group=cp_group)

        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_all_reduce_hook(sum_over_cp)
    return patch


# ------------------------------------------------------------------------------------------------- data


def packed_row(step: int, dp_index: int, args, vocab: int):
    """One packed row (1, seq_len) of documents for replica ``dp_index`` at ``step``: (input_ids, position_ids,
    labels). Every document counts up by a random stride from a random start (learnable, so the loss falls);
    its first token is labelled -100 (it has no predecessor in the document, as in DataCollatorWithFlattening)."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 1009 + dp_index)
    mean = args.doc_len or max(args.seq_len // 4, 2)
    ids, pos, labels, total = [], [], [], 0
    while total < args.seq_len:
        n = min(int(torch.randint(max(mean // 2, 1), mean * 3 // 2 + 1, (1,), generator=g)), args.seq_len - total)
        start, stride = torch.randint(0, vocab, (2,), generator=g).tolist()
        doc = (start + (stride % 7 + 1) * torch.arange(n)) % vocab
        ids.append(doc)
        pos.append(torch.arange(n))
        labels.append(torch.cat([torch.tensor([-100]), doc[1:]]))
        total += n
    return torch.cat(ids)[None], torch.cat(pos)[None], torch.cat(labels)[None]


def one_document_row(step: int, dp_index: int, args, vocab: int):
    """``--data batch``: one document filling the row (1, seq_len): (input_ids, None, labels)."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 1009 + dp_index)
    start, stride = torch.randint(0, vocab, (2,), generator=g).tolist()
    ids = ((start + (stride % 7 + 1) * torch.arange(args.seq_len)) % vocab)[None]
    return ids, None, ids.clone()


def document_mask(position_ids: torch.Tensor, dtype: torch.dtype, device) -> torch.Tensor:
    """The (1, 1, S, S) additive attention mask of one packed row (position ids (1, S), restarting at 0 for each
    document): 0 where a token may attend (an earlier or the same token of its own document), the dtype's lowest
    value elsewhere. The run without CP passes it to the model's own attention, so the documents of a row stay
    apart on every transformers release (sdpa and eager ignore packed position ids before 4.53)."""
    positions = position_ids[0]
    document = torch.cumsum(positions == 0, dim=0)
    index = torch.arange(positions.numel())
    allowed = (document[:, None] == document[None, :]) & (index[:, None] >= index[None, :])
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    return mask[None, None].to(device)


def make_batch(step: int, dp_index: int, args, vocab: int):
    """This replica's rows of the step: (input_ids, position_ids or None, unshifted labels), whole sequences."""
    row = packed_row if args.data == "packed" else one_document_row
    return row(step, dp_index, args, vocab)


# ------------------------------------------------------------------------------------------------- loop


def main(argv=None) -> None:
    """Every rank: the CP run, then the run without CP on the same mesh and batches, then rank 0's comparison."""
    args = parse_args(argv)
    mesh, device = init_distributed(args)
    runs = []
    if not args.no_cp:
        runs.append(train(args, mesh, device, with_cp=True))
    if args.no_cp or (not args.no_compare and mesh["cp"].size() > 1):
        runs.append(train(args, mesh, device, with_cp=False))
    status = report(args, runs) if dist.get_rank() == 0 else 0
    leave_process_group()
    exit_now(status)


def train(args, mesh, device, with_cp: bool) -> Run:
    """Run the steps with CP or without (every rank); returns the run (global losses, throughput)."""
    from hfpatch.inputs import token_loss_sum

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[_dtype_name(args, device)]
    model = build_model(args, device, dtype)
    n_params = sum(p.numel() for p in model.parameters())
    patch = parallelize(model, mesh, args, with_cp)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    # The attention call is one opaque operator for the compiler (hfpatch/attention/opaque.py); FSDP2's hooks may break
    # the graph between layers, so no fullgraph here.
    forward = torch.compile(model, backend=args.compile) if args.compile else model
    dp_group, dp_index = mesh["dp"].get_group(), mesh["dp"].get_local_rank()
    rank0 = dist.get_rank() == 0
    if rank0:
        mode = "no CP" if not patch.active else f"CP: {patch!r}"
        print(f"{args.model} Llama, {n_params:,} parameters, "
              f"{dtype}, {device.type}; mesh dp={mesh['dp'].size()} x cp={mesh['cp'].size()}; seq {args.seq_len} "
              f"tokens per replica; {mode}", flush=True)
    # Without CP, packed rows get an explicit document mask where the model's attention takes one (sdpa, eager).
    dense_mask = args.attn in ("sdpa", "eager")
    losses, times, peaks = [], [], []
    for step in range(args.steps):
        ids, pos, labels = make_batch(step, dp_index, args, model.config.vocab_size)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        batch = patch.shard_inputs(ids.to(device), labels=labels.to(device),
                                   position_ids=None if pos is None else pos.to(device))
        mask = document_mask(pos, dtype, device) if not patch.active and pos is not None and dense_mask else None
        logits = forward(input_ids=batch["input_ids"], position_ids=batch["position_ids"], attention_mask=mask,
                         use_cache=False).logits
        loss_sum, count = token_loss_sum(logits, batch["labels"])
        loss = patch.reduce_loss(loss_sum, count)       # token-weighted over cp (identity without CP)
        loss.backward()                                 # FSDP2: mean over dp; the hook sums over cp
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - start
        stats = torch.tensor([loss.detach().float().item(), elapsed, _peak_memory(device)], dtype=torch.float64,
                             device=device)
        dist.all_reduce(stats[:1], group=dp_group)      # mean over replicas (same on every cp rank)
        dist.all_reduce(stats[1:], op=dist.ReduceOp.MAX)
        global_loss, step_time, peak = stats[0].item() / mesh["dp"].size(), stats[1].item(), stats[2].item()
        losses.append(global_loss)
        times.append(step_time)
        peaks.append(peak)
        if rank0:
            tokens = args.seq_len / (1 if not patch.active else mesh["cp"].size())
            print(f"step {step + 1}/{args.steps}  loss {global_loss:.8f}  step time {step_time:.3f} s  "
                  f"{tokens / step_time:,.0f} tokens/s/device  peak memory {_format_bytes(peak, device)}", flush=True)
    if rank0 and args.steps > 1:
        timed = times[1:]
        print(f"summary: {'cp' if patch.active else 'no-cp'} dp={mesh['dp'].size()} cp={mesh['cp'].size()} "
              f"seq={args.seq_len} data={args.data} model={args.model} checkpointing={args.checkpointing}: median step "
              f"{statistics.median(timed):.3f} s over steps 2-{args.steps}, peak memory "
              f"{_format_bytes(max(peaks), device)}", flush=True)
    if patch.active:
        patch.remove()
    timed, label = timed_steps(len(times))
    return Run(label=f"cp={mesh['cp'].size()}" if patch.active else "no CP", losses=tuple(losses),
               tokens=float(mesh["dp"].size() * args.seq_len * len(times[timed])), seconds=sum(times[timed]),
               timed=label, processes=dist.get_world_size())


def report(args, runs) -> int:
    """Rank 0: both runs side by side and ``--plot``. Returns the exit status (1: the losses differ)."""
    status = 0
    if len(runs) == 2 and runs[0].label != "no CP":
        lines, agree = compare(runs[0], runs[1], _dtype_name(args, torch.device(args.device)))
        print("\n".join(lines), flush=True)
        status = 0 if agree else 1
    if args.plot:
        plot_losses(args.plot, runs, f"examples/train_cp.py, {args.model} Llama, FSDP2 over dp")
        print(f"loss curves: {args.plot}", flush=True)
    return status


def _dtype_name(args, device) -> str:
    return args.dtype or ("bfloat16" if device.type == "cuda" else "float32")


def _peak_memory(device) -> float:
    if device.type == "cuda":
        return float(torch.cuda.max_memory_allocated(device))
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def _format_bytes(value: float, device) -> str:
    label = "" if device.type == "cuda" else " (peak RSS)"
    return f"{value / 2**30:.2f} GiB{label}"


if __name__ == "__main__":
    main()
