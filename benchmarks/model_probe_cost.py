"""What the whole-model probe of ``hfpatch.apply(model=)`` costs: time and memory, next to one training step.

Run under torchrun (one process per rank)::

    torchrun --nproc-per-node 2 benchmarks/model_probe_cost.py --device cpu            # tiny models, gloo
    torchrun --nproc-per-node 2 benchmarks/model_probe_cost.py --device cuda --model 1b  # ~1.2B Llama, NCCL, bf16
    torchrun --nproc-per-node 1 benchmarks/model_probe_cost.py --device cuda --model 1b  # one GPU: see below
    torchrun --nproc-per-node 1 benchmarks/model_probe_cost.py --device cuda --model 8b  # Llama-3-8B's shape

With one rank, ``apply`` treats the group as no CP (an inactive patch), so the wrapper is installed through the
same internal step ``apply`` uses (``api._install_here``) over a group of one: the probe then runs its three
forwards (non-CP, CP, labels) with a ring of one rank (no block exchange). The ``apply`` columns are n/a there.

Per model it prints, measured in this one run (medians over ``--repeats``):
``apply fast``  ``apply(verify="fast")`` (install + numeric probe of the wrapper), then ``remove()``;
``apply full``  ``apply(verify=True)`` (the same plus the whole-model probe);
``probe``       ``model_probe.probe_model`` alone on the installed patch (what verify=True adds);
``probe mem``   the probe's peak memory above what was allocated before it (CUDA only);
``forward``     one forward of the same model on ``--tokens`` per rank under CP, without gradients, for scale;
``fwd mem``     that forward's peak memory above what was allocated before it (CUDA only);
``step``        one CP training step (forward + backward, ``--tokens`` per rank) of the same model, for scale.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _timed(fn, device, repeats):
    times = []
    for _ in range(repeats):
        dist.barrier()
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _models(name: str, device: torch.device):
    import transformers

    from hfpatch.cli.demo_models import build_model

    if name == "tiny":
        for family in ("llama", "mixtral", "gemma2"):
            yield family, build_model(family)
        return
    shapes = {"1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32),
              "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32)}
    config = transformers.LlamaConfig(vocab_size=128256, num_key_value_heads=8, max_position_embeddings=131072,
                                      attention_dropout=0.0, use_cache=False, **shapes[name])
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM._from_config(config, dtype=torch.bfloat16)
    yield f"llama-{sum(p.numel() for p in model.parameters()) / 1e9:.2f}B", model.train()


def _one_rank_patch(model):
    """The installed patch over a group of one rank (see the module docstring)."""
    import inspect

    import transformers
    import transformers.modeling_flash_attention_utils as mfau

    from hfpatch import api
    from hfpatch.signatures import registry

    match = registry.require(inspect.signature(mfau._flash_attention_forward), transformers.__version__)
    return api._install_here(dist.group.WORLD, "auto", model, match, None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--model", choices=("tiny", "1b", "8b"), default=None, help="default: tiny on cpu, 1b on cuda")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=None, help="tokens per rank of the step (cpu 32, cuda 8192)")
    args = parser.parse_args()
    import hfpatch
    from hfpatch.model.probe import probe_model

    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if not cuda:
        torch.set_num_threads(1)
    world = dist.get_world_size()
    tokens = args.tokens or (8192 if cuda else 32)
    rows = []
    for name, model in _models(args.model or ("1b" if cuda else "tiny"), device):
        group = dist.group.WORLD
        if world > 1:
            fast = _timed(lambda: hfpatch.apply(group, model=model, verify="fast").remove(), device, args.repeats)
            full = _timed(lambda: hfpatch.apply(group, model=model, verify=True).remove(), device, args.repeats)
        else:
            fast = full = None
        with (hfpatch.apply(group, model=model, verify="fast") if world > 1 else _one_rank_patch(model)) as patch:
            probe = _timed(lambda: probe_model(model, patch), device, args.repeats)
            memory = None
            if cuda:
                torch.cuda.empty_cache()
                before = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                probe_model(model, patch)
                memory = (torch.cuda.max_memory_allocated() - before) / 2**20
            vocab = model.config.vocab_size
            ids = torch.randint(0, vocab, (1, tokens * world), generator=torch.Generator().manual_seed(0)).to(device)

            def step():
                batch = patch.shard_inputs(ids, labels=ids)
                loss = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                             labels=batch["labels"], use_cache=False).loss
                loss.backward()
                model.zero_grad(set_to_none=True)

            def forward():
                batch = patch.shard_inputs(ids)
                with torch.no_grad():
                    model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)

            forward()  # warm-up
            forward_time = _timed(forward, device, args.repeats)
            forward_memory = None
            if cuda:
                torch.cuda.empty_cache()
                before = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                forward()
                forward_memory = (torch.cuda.max_memory_allocated() - before) / 2**20
            step()  # warm-up
            step_time = _timed(step, device, args.repeats)
        rows.append((name, fast, full, probe, memory, forward_time, forward_memory, step_time))
    if dist.get_rank() == 0:
        print(f"# model_probe_cost: {world} ranks, {args.device} "
              f"({torch.cuda.get_device_name() if cuda else 'CPU'}), torch {torch.__version__}, "
              f"transformers {__import__('transformers').__version__}, step = {tokens} tokens per rank fwd+bwd, "
              f"median of {args.repeats}")
        print(f"{'model':18s} {'apply fast':>11s} {'apply full':>11s} {'probe':>9s} {'probe mem':>10s} "
              f"{'forward':>9s} {'fwd mem':>10s} {'probe/fwd':>9s} {'step':>9s} {'probe/step':>10s}")
        for name, fast, full, probe, memory, forward_time, forward_memory, step_time in rows:
            mem = f"{memory:8.1f}MB" if memory is not None else "       n/a"
            fmem = f"{forward_memory:8.1f}MB" if forward_memory is not None else "       n/a"
            fast_text = f"{fast * 1e3:9.1f}ms" if fast is not None else "        n/a"
            full_text = f"{full * 1e3:9.1f}ms" if full is not None else "        n/a"
            print(f"{name:18s} {fast_text} {full_text} {probe * 1e3:7.1f}ms {mem:>10s} "
                  f"{forward_time * 1e3:7.1f}ms {fmem:>10s} {probe / forward_time:9.2f} "
                  f"{step_time * 1e3:7.1f}ms {probe / step_time:10.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
