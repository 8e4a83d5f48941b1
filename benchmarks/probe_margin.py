"""The whole-model probe's margin: how far every seeded CP divergence lies above the rounding of exact models.

Run under torchrun (one process per rank)::

    torchrun --nproc-per-node 2 benchmarks/probe_margin.py --device cpu                  # margin, bf16 + fp32
    torchrun --nproc-per-node 2 benchmarks/probe_margin.py --device cpu --exact wide,deep --seeded none
    torchrun --nproc-per-node 4 benchmarks/probe_margin.py --device cuda --exact 8b --seeded none

Two kinds of case, each in every ``--dtypes``:

- *exact*: a model hfpatch runs exactly under CP. Its probe error is the dtype's rounding of one module; the
  verdict must be "accepted". ``--exact`` picks the set: ``small`` (the seeded cases' base models unseeded),
  ``wide`` (a CPU proxy of an 8B's width and depth: Llama 2048 x 48, GQA 4:1), ``deep`` (Llama 1024 x 80, as deep
  as a 70B, and Gemma-2, Qwen3-MoE and the Qwen3.5 hybrid at 1024 x 24: the exact families with the most layers
  for their size, with windows and softcaps, routers, and gated delta nets), ``8b`` (Llama-3-8B's shape: CUDA),
  or several, comma-separated.
- *seeded*: a model with one CP bug planted where the audit cannot see it, probed directly (``probe_model`` on a
  patch applied with ``verify="fast"``): a sequence mixer that runs its shard from a zero state, a token-mixing
  module no rule knows, positions off by a shard, a module that numbers positions by its input's length, and an
  attention call with the wrong (non-causal) mask under CP. The verdict must be "refused".

Every case is probed with the tolerance lifted, so the printed error is the largest over all compared tensors
(``ProbeResult.worst``, where it was); the verdict is that error against ``model_probe.probe_tolerance``. The last
lines give, per dtype, the smallest seeded error, the largest exact error and their ratio: the margin.
"""
from __future__ import annotations

import argparse
import math
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

SEEDED = ("zero_state_mixer", "unknown_mixer", "positions_off_by_a_shard", "reads_input_length",
          "non_causal_mask")
EXACT_SETS = ("small", "wide", "deep", "8b")


@dataclass
class Row:
    kind: str
    case: str
    dtype: str
    params: float
    error: float
    where: str
    tolerance: float
    seconds: float

    @property
    def verdict(self) -> str:
        return "accepted" if self.error <= self.tolerance else "refused"

    @property
    def right(self) -> bool:
        return self.verdict == ("accepted" if self.kind == "exact" else "refused")


def _llama(hidden, layers, heads, kv_heads, mlp, vocab, dtype, device):
    import transformers

    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=mlp,
                                      num_hidden_layers=layers, num_attention_heads=heads,
                                      num_key_value_heads=kv_heads, max_position_embeddings=131072,
                                      use_cache=False)
    return build_seeded(transformers.LlamaForCausalLM, config, dtype, device)


def build_seeded(model_cls, config, dtype, device):
    """``model_cls`` of ``config`` in ``dtype`` on ``device``, seeded, its weights drawn once by the model's own
    scheme (``init_weights``: what ``_from_config`` would give, from another draw). torch's per-module defaults,
    which that scheme overwrites, are skipped: they cost as much again, half a real-scale build on a CPU."""
    from transformers import initialization

    torch.manual_seed(0)
    with torch.device(device):
        with initialization.no_init_weights():
            model = model_cls._from_config(config, dtype=dtype)
        model.init_weights()
    return model.train()


def _family(name, dtype, device, **shape):
    """A Gemma-2 / Qwen3-MoE / Qwen3.5-text model of ``shape`` (hidden, layers, heads, kv_heads, mlp, vocab)."""
    import transformers

    h, n, heads, kv, mlp, vocab = (shape[k] for k in ("hidden", "layers", "heads", "kv_heads", "mlp", "vocab"))
    common = dict(vocab_size=vocab, hidden_size=h, intermediate_size=mlp, num_hidden_layers=n,
                  num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=131072,
                  use_cache=False)
    if name == "gemma2":
        config = transformers.Gemma2Config(**common, head_dim=h // heads, sliding_window=8, query_pre_attn_scalar=64)
        return build_seeded(transformers.Gemma2ForCausalLM, config, dtype, device)
    if name == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**common, num_experts=8, num_experts_per_tok=2,
                                             moe_intermediate_size=mlp // 4, head_dim=h // heads)
        return build_seeded(transformers.Qwen3MoeForCausalLM, config, dtype, device)
    config = transformers.Qwen3_5TextConfig(**common, head_dim=h // heads, linear_num_key_heads=heads // 2,
                                            linear_num_value_heads=heads, linear_key_head_dim=64,
                                            linear_value_head_dim=64,
                                            layer_types=["linear_attention", "linear_attention",
                                                         "linear_attention", "full_attention"] * (n // 4))
    return build_seeded(transformers.Qwen3_5ForCausalLM, config, dtype, device)


def exact_cases(sets, device):
    """(name, builder(dtype)) of the exact models of ``sets``."""
    cases = []
    if "small" in sets:
        cases.append(("llama 256x4", lambda dt: _llama(256, 4, 8, 2, 688, 1024, dt, device)))
        cases.append(("lfm2 256x4", lambda dt: _lfm2(dt, device)))
    if "wide" in sets:
        cases.append(("llama 2048x48 gqa4", lambda dt: _llama(2048, 48, 16, 4, 5632, 32000, dt, device)))
    if "deep" in sets:
        cases.append(("llama 1024x80 gqa4", lambda dt: _llama(1024, 80, 8, 2, 2816, 32000, dt, device)))
        shape = dict(hidden=1024, layers=24, heads=8, kv_heads=2, mlp=2816, vocab=32000)
        for family in ("gemma2", "qwen3_moe", "qwen3_5"):
            cases.append((f"{family} 1024x24", lambda dt, f=family: _family(f, dt, device, **shape)))
    if "8b" in sets:
        cases.append(("llama-3-8b", lambda dt: _llama(4096, 32, 32, 8, 14336, 128256, dt, device)))
    return cases


def _lfm2(dtype, device):
    import transformers

    config = transformers.Lfm2Config(vocab_size=1024, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                     num_attention_heads=8, num_key_value_heads=2,
                                     layer_types=["conv", "full_attention", "conv", "full_attention"],
                                     use_cache=False)
    return build_seeded(transformers.Lfm2ForCausalLM, config, dtype, device)


# ---------------------------------------------------------------------------------------------- seeded bugs


class CausalEma(torch.nn.Module):
    """A token-mixing module no rule knows (a user's own): ``inner``'s output plus a causal running mean of it
    along the sequence. Under CP a rank averages over its own tokens only."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        y = self.inner(x)
        counts = torch.arange(1, y.shape[1] + 1, device=y.device, dtype=torch.float32).view(1, -1, 1)
        return y + (y.float().cumsum(1) / counts).to(y.dtype)


class LengthPositions(torch.nn.Module):
    """Token embeddings plus a learned position table indexed by ``arange`` of the input's length (what GPT-2-style
    position modules do when no position ids reach them): under CP every rank numbers its tokens from 0."""

    def __init__(self, embed: torch.nn.Embedding) -> None:
        super().__init__()
        self.embed = embed
        self.table = torch.nn.Parameter(torch.randn(4096, embed.embedding_dim, generator=torch.Generator()
                                                    .manual_seed(1)).to(embed.weight) * embed.weight.std())

    def forward(self, input_ids):
        return self.embed(input_ids) + self.table[torch.arange(input_ids.shape[1], device=input_ids.device)][None]


def _in_ring() -> bool:
    from hfpatch import switch

    return switch.current_mode() == "ring"


def _positions_off_by_a_shard(model):
    """Under CP the rotary embedding gets this rank's position ids less the rank's first position (a rank's tokens
    numbered from its shard's start), while the attention still gets the right ones: hfpatch's own check of the
    position ids the attention receives cannot see it."""
    rotary = model.model.rotary_emb
    forward = rotary.forward

    def shifted(x, position_ids, *args, **kwargs):
        if _in_ring():
            position_ids = position_ids - position_ids.min()
        return forward(x, position_ids, *args, **kwargs)

    rotary.forward = shifted


def _non_causal_under_cp(model):
    """Every attention layer is called non-causal under CP (a mask lost on the way to the kernel)."""
    for layer in model.model.layers:
        attention = layer.self_attn
        forward = attention.forward

        def forward_with_mask_lost(*args, _attention=attention, _forward=forward, **kwargs):
            _attention.is_causal = not _in_ring()
            try:
                return _forward(*args, **kwargs)
            finally:
                _attention.is_causal = True

        attention.forward = forward_with_mask_lost


def seeded_case(name, dtype, device):
    """(model, after_apply) for seeded case ``name``; ``after_apply(patch)`` plants what needs the patch."""
    if name == "zero_state_mixer":  # LFM2's short convolutions, their CP exchange taken out after apply
        return _lfm2(dtype, device), lambda patch: patch.mixers.remove()
    model = _llama(256, 4, 8, 2, 688, 1024, dtype, device)
    if name == "unknown_mixer":
        model.model.layers[1].mlp = CausalEma(model.model.layers[1].mlp)
    elif name == "positions_off_by_a_shard":
        _positions_off_by_a_shard(model)
    elif name == "reads_input_length":
        model.model.embed_tokens = LengthPositions(model.model.embed_tokens)
    elif name == "non_causal_mask":
        _non_causal_under_cp(model)
    else:
        raise ValueError(f"unknown seeded case {name!r}; known: {', '.join(SEEDED)}")
    return model, lambda patch: None


# ---------------------------------------------------------------------------------------------- the run


def probe_case(model, after_apply, group):
    """(largest error, where, seconds) of the probe on ``model`` with the tolerance lifted."""
    import hfpatch
    from hfpatch.model.probe import probe_model

    with hfpatch.apply(group, model=model, verify="fast") as patch:
        after_apply(patch)
        start = time.perf_counter()
        result = probe_model(model, patch, tolerance=math.inf)
        return result.worst, result.worst_at, time.perf_counter() - start


def run(exact_sets, seeded, dtypes, device, group, progress=None) -> list[Row]:
    """Probe every case in every dtype; ``progress(row)`` is called as each finishes (rank 0 prints it)."""
    from hfpatch.model.probe import probe_tolerance

    rows = []
    for dtype in dtypes:
        cases = [("exact", name, build, lambda patch: None) for name, build in exact_cases(exact_sets, device)]
        cases += [("seeded", name, None, None) for name in seeded]
        for kind, name, build, after in cases:
            if build is None:
                model, after = seeded_case(name, dtype, device)
            else:
                model = build(dtype)
            params = sum(p.numel() for p in model.parameters()) / 1e9
            error, where, seconds = probe_case(model, after, group)
            rows.append(Row(kind, name, str(dtype).replace("torch.", ""), params, error, where,
                            probe_tolerance(dtype), seconds))
            if progress is not None:
                progress(rows[-1])
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


HEADER = (f"{'kind':7s} {'case':26s} {'dtype':9s} {'params':>7s} {'error':>9s} {'tolerance':>9s} {'verdict':9s} "
          f"{'probe s':>8s}  where")


def row_line(r: Row) -> str:
    return (f"{r.kind:7s} {r.case:26s} {r.dtype:9s} {r.params:6.2f}B {r.error:9.2e} {r.tolerance:9.1e} "
            f"{r.verdict:9s} {r.seconds:8.2f}  {r.where}{'' if r.right else '   <-- WRONG VERDICT'}")


def report(rows, world, device) -> str:
    import transformers

    lines = [f"# probe_margin: {world} ranks, {device.type} "
             f"({torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}), torch {torch.__version__}, "
             f"transformers {transformers.__version__}", HEADER]
    lines += [row_line(r) for r in rows]
    for dtype in dict.fromkeys(r.dtype for r in rows):
        exact = [r.error for r in rows if r.dtype == dtype and r.kind == "exact"]
        seeded = [r.error for r in rows if r.dtype == dtype and r.kind == "seeded"]
        if exact and seeded:
            lines.append(f"margin {dtype}: smallest seeded {min(seeded):.2e} / largest exact {max(exact):.2e} = "
                         f"{min(seeded) / max(max(exact), 1e-30):.1f}x")
    lines.append(f"wrong verdicts: {sum(not r.right for r in rows)} of {len(rows)}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--exact", default="small", help=f"comma-separated sets of {EXACT_SETS} or 'none'")
    parser.add_argument("--seeded", default="all", help=f"comma-separated cases of {SEEDED}, 'all' or 'none'")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--watchdog", type=float, default=None, metavar="SECONDS",
                        help="each rank prints every thread's stack and exits if the run takes longer")
    args = parser.parse_args()
    if args.watchdog:
        import faulthandler

        faulthandler.dump_traceback_later(args.watchdog, exit=True)
    exact = () if args.exact == "none" else tuple(args.exact.split(","))
    seeded = SEEDED if args.seeded == "all" else () if args.seeded == "none" else tuple(args.seeded.split(","))
    unknown = [s for s in exact if s not in EXACT_SETS] + [s for s in seeded if s not in SEEDED]
    if unknown:
        parser.error(f"unknown case set(s) {unknown}; --exact takes {EXACT_SETS}, --seeded {SEEDED}")
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    if not cuda:
        torch.set_num_threads(1)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtypes = [getattr(torch, name) for name in args.dtypes.split(",")]
    rank0 = dist.get_rank() == 0
    if rank0:
        print(f"as each case finishes:\n{HEADER}", flush=True)
    rows = run(exact, seeded, dtypes, device, dist.group.WORLD,
               progress=(lambda row: print(row_line(row), flush=True)) if rank0 else None)
    if rank0:
        print(report(rows, dist.get_world_size(), device), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 1 if any(not r.right for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
