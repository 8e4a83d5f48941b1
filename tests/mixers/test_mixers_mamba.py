"""Mamba2 (SSD scan) and Mamba (selective scan) mixers under CP (hfpatch.mixers.kinds.ssd, .selective_scan), and
the real HF classes that run them (Bamba, Falcon-H1, Granite 4 hybrid, Nemotron-H, Zamba2; Jamba, Zamba).

Every case runs in one gloo world of the module (tests/mixers/_mixer_cases.py), each its own test:

- ``exchange-*``: each scan's segment exchange against the whole sequence, forward and every input's gradient, on
  zigzag (several SSD chunks per segment), contiguous, zigzag with one-token chunks (shorter than an SSD chunk),
  zigzag varlen and contiguous packed layouts, with transformers' own torch kernels (and, on the zigzag layouts,
  the token-by-token definitions too), the selective scan in token chunks of 3 (its final state and correction
  span chunks); on 2 and 4 ranks, in fp32 (the ``cp`` tolerances) and bf16 (the ``kernel`` bf16 tolerances
  against float64);
- ``class-*``: the sweep's check_class, CP loss and every gradient equal to non-CP (zigzag and contiguous on 2
  ranks; Nemotron-H on 4), or refused by name where the registry does not recognise the release's code;
- ``packed-*``: packed rows against the model's non-CP run; ``hub-bound-*``: Bamba with its kernels bound as HF's
  hub wrappers bind the fast packages (another parameter order; a fused Mamba2 kernel that must not run under
  CP); ``refusals-and-remove-*``: a cache, seq_idx and a decode step refused by name, ``remove()`` restoring every
  rebound kernel; ``registry-*``: recognition, and refusal of a changed forward by its fingerprint.
"""
from __future__ import annotations

import functools
import inspect

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from _mixer_cases import (Case, Exchange, Layout, Skip, compare_exchange, entries, is_recognised,
                          kernel_and_class_cases, kernels_bound_by_name, leaves_from, packed_step, with_due)
import hfpatch
from hfpatch.errors import UnsupportedArgument
from hfpatch.mixers.kernel import KernelCall
from hfpatch.mixers.kinds import selective_scan
from hfpatch.mixers.kinds.selective_scan import SelectiveScan
from hfpatch.mixers.kinds.ssd import SSDChunkScan
from hfpatch.modes import current_mode
from hfpatch.release.sweep.tiny import build_tiny

# ------------------------------------------------------------------------------- plain reference kernels


def ssd_reference(hidden_states, dt, A, B, C, chunk_size, D=None, dt_bias=None, initial_states=None,
                  dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False, **kwargs):
    """Mamba2's scan token by token (the definition): x (b, L, H, P), dt (b, L, H), A (H,), B, C (b, L, G, N)."""
    heads, groups = hidden_states.shape[2], B.shape[2]
    dt = dt.float() + (dt_bias.float() if dt_bias is not None else 0.0)
    dt = (F.softplus(dt) if dt_softplus else dt).clamp(min=dt_limit[0], max=dt_limit[1])
    Bh, Ch = (t.float().repeat_interleave(heads // groups, dim=2) for t in (B, C))
    x = hidden_states.float()
    state = (torch.zeros(x.shape[0], heads, x.shape[3], B.shape[3]) if initial_states is None
             else initial_states.float())
    outs = []
    for t in range(x.shape[1]):
        state = (torch.exp(A.float() * dt[:, t])[..., None, None] * state
                 + (dt[:, t, :, None] * x[:, t])[..., None] * Bh[:, t, :, None, :])
        y = torch.einsum("bhpn,bhn->bhp", state, Ch[:, t])
        outs.append(y if D is None else y + D.float()[:, None] * x[:, t])
    out = torch.stack(outs, dim=1)
    return (out, state) if return_final_states else out


def scan_reference(hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                   return_last_state=False, use_mambapy=False, use_associative_scan=False, **kwargs):
    """Mamba's selective scan token by token (the definition): x, dt, z (b, D, L), A (D, N), B, C (b, N, L)."""
    dt = dt.float() + (delta_bias.float()[:, None] if delta_bias is not None else 0.0)
    dt = F.softplus(dt) if delta_softplus else dt
    x = hidden_states.float()
    state = torch.zeros(x.shape[0], x.shape[1], A.shape[1])
    outs = []
    for t in range(x.shape[2]):
        state = torch.exp(A.float() * dt[..., t, None]) * state + (dt[..., t] * x[..., t])[..., None] * B[:, None, :, t]
        y = (state * C[:, None, :, t]).sum(-1)
        outs.append(y if D is None else y + D.float() * x[..., t])
    out = torch.stack(outs, dim=-1)
    out = out * F.silu(z.float()) if z is not None else out
    return (out, state) if return_last_state else out


def _hf_kernels():
    """transformers' own torch kernels (what the models run on CPU), or None on a release without them."""
    try:
        from transformers.models.bamba import modeling_bamba
        from transformers.models.jamba import modeling_jamba
    except ImportError:
        return None
    ssd, scan = (getattr(modeling_bamba, "mamba2_chunk_scan", None),
                 getattr(modeling_jamba, "mamba_selective_scan", None))
    return (ssd, scan) if ssd is not None and scan is not None else None


# ------------------------------------------------------------------------- exchange vs whole sequence

# Several SSD chunks (4 tokens) per zigzag segment; one-token segments shorter than a chunk.
LAYOUTS = (Layout("zigzag", "zigzag", 12), Layout("contiguous", "contiguous", 10),
           Layout("zigzag-1-token-chunks", "zigzag", 2), Layout("zigzag-packed", "zigzag", 16, (0, 4)),
           Layout("contiguous-packed", "contiguous", 8, (0, 3), scale_starts=False))
# The layouts on which the token-by-token definitions run as well as transformers' kernels.
DEFINITION_LAYOUTS = ("zigzag", "zigzag-packed")
# Three tokens per selective-scan chunk (batch 2 x 6 channels x state 5): F and the correction span chunks.
SCAN_CHUNK_ELEMENTS = 2 * 6 * 5 * 3


def _negative(low, spread):
    return lambda gen, shape: -torch.rand(*shape, generator=gen) * spread - low


def _scaled(scale):
    return lambda gen, shape: torch.randn(*shape, generator=gen) * scale


def _ssd(seed, batch, seq, kernel):
    """Mamba2's scan: 4 heads in 2 groups, head dim 3, state 5; a non-default dt_limit clamps."""
    heads, groups, head_dim, state = 4, 2, 3, 5
    shapes = {"x": ((batch, seq, heads, head_dim), None), "dt": ((batch, seq, heads), None),
              "A": ((heads,), _negative(0.5, 1.0)), "B": ((batch, seq, groups, state), None),
              "C": ((batch, seq, groups, state), None), "D": ((heads,), None), "dt_bias": ((heads,), _scaled(0.5))}

    def make(cast):
        t = leaves_from(seed, cast, shapes)
        kwargs = dict(chunk_size=4, D=t["D"], dt_bias=t["dt_bias"], dt_softplus=True, dt_limit=(0.05, 1.5), z=None)

        def run(ex):
            if ex is None:
                return (kernel(t["x"], t["dt"], t["A"], t["B"], t["C"], **kwargs),)
            call = KernelCall(kernel, inspect.signature(kernel), (ex.local(t["x"], 1), ex.local(t["dt"], 1), t["A"],
                                                                  ex.local(t["B"], 1), ex.local(t["C"], 1)), kwargs)
            return (SSDChunkScan().run_cp(call, ex.plan),)

        return t, run, (1,)

    return make


def _selective_scan(seed, batch, seq, kernel):
    """Mamba's scan: 6 channels, state 5, gated by z."""
    channels, state = 6, 5
    shapes = {"x": ((batch, channels, seq), None), "dt": ((batch, channels, seq), None),
              "A": ((channels, state), _negative(0.1, 2.0)), "B": ((batch, state, seq), None),
              "C": ((batch, state, seq), None), "D": ((channels,), None), "z": ((batch, channels, seq), None),
              "delta_bias": ((channels,), _scaled(0.5))}

    def make(cast):
        t = leaves_from(seed, cast, shapes)
        kwargs = dict(D=t["D"], delta_bias=t["delta_bias"], delta_softplus=True)

        def run(ex):
            if ex is None:
                return (kernel(t["x"], t["dt"], t["A"], t["B"], t["C"], z=t["z"], **kwargs),)
            args = (ex.local(t["x"], 2), ex.local(t["dt"], 2), t["A"], ex.local(t["B"], 2), ex.local(t["C"], 2))
            call = KernelCall(kernel, inspect.signature(kernel), args, {**kwargs, "z": ex.local(t["z"], 2)})
            return (SelectiveScan().run_cp(call, ex.plan),)

        return t, run, (2,)

    return make


def _exchange(group, layout, dtype):
    """Both scans on ``layout``: transformers' kernels where this release has them (what the models run), and
    the definitions on DEFINITION_LAYOUTS in fp32 (the only kernels where the release has none)."""
    ex = Exchange(layout, group)
    runs = [_hf_kernels()] if _hf_kernels() else []
    if not runs or (layout.name in DEFINITION_LAYOUTS and dtype == torch.float32):
        runs.append((ssd_reference, scan_reference))
    saved, selective_scan.CHUNK_ELEMENTS = selective_scan.CHUNK_ELEMENTS, SCAN_CHUNK_ELEMENTS
    try:
        for ssd_kernel, scan_kernel in runs:
            seed = ex.seq + ex.world
            compare_exchange(ex, _ssd(seed, ex.batch, ex.seq, ssd_kernel), dtype, f"ssd {ssd_kernel.__name__}")
            compare_exchange(ex, _selective_scan(seed + 1, ex.batch, ex.seq, scan_kernel), dtype,
                             f"selective scan {scan_kernel.__name__}")
    finally:
        selective_scan.CHUNK_ELEMENTS = saved
    return [ssd.__name__ for ssd, _ in runs]


# ------------------------------------------------------------------------------------ real HF classes

# The causal-LM classes whose Mamba mixers the registry recognises on transformers 5.24, and the mixer each has.
# ``registry-*``: every Mamba mixer of the class is recognised and the audit finds nothing; a changed forward is not
# recognised and the audit names the failed check (on a release the registry has not read: refused by name).
FAMILY_CLASSES = {
    "BambaForCausalLM": ("BambaMixer",),
    "FalconH1ForCausalLM": ("FalconH1Mixer",),
    "GraniteMoeHybridForCausalLM": ("GraniteMoeHybridMambaLayer",),
    "NemotronHForCausalLM": ("NemotronHMamba2Mixer",),
    "Zamba2ForCausalLM": ("Zamba2MambaMixer",),
    "JambaForCausalLM": ("JambaMambaMixer",),
    "ZambaForCausalLM": ("ZambaMambaMixer",),
}
NAMES = tuple(sorted(FAMILY_CLASSES))


def _packed_due():
    """None when the packed-row, hub-bound and refusal cases run on this release, else why not (their
    ``Case.due``): they are written for releases whose Bamba and Jamba mixers call their kernels by module-level
    names (releases that compute the mixers inline run through CP forms of their methods:
    tests/mixers/test_mixers_mamba_releases.py covers those)."""
    found = entries(NAMES)
    if not {"BambaForCausalLM", "JambaForCausalLM"} <= set(found):
        return Skip("no Bamba / Jamba class in this transformers release")
    if not (is_recognised("BambaForCausalLM", NAMES) and is_recognised("JambaForCausalLM", NAMES)):
        return Skip("this release's mixer code is not in hfpatch's registry (refused by name: see the class cases)")
    if not (kernels_bound_by_name("BambaForCausalLM", NAMES) and kernels_bound_by_name("JambaForCausalLM", NAMES)):
        return Skip("this release computes Bamba's or Jamba's mixer inline: it runs through CP forms of its methods "
                    "(tests/mixers/test_mixers_mamba_releases.py covers packed rows, refusals and remove() there)")
    return None


def _tiny(class_name):
    return build_tiny(entries(NAMES)[class_name])


_LENGTHS = (8, 4, 20)  # x world: the documents of a packed row


def _packed(group, class_name, kernel, roles):
    """A packed row (documents given by position_ids) against the model's non-CP run on the same row (HF's Mamba
    mixers do not read position_ids: both runs go over the documents as one sequence); the kernels that ran
    under CP are ``roles``."""
    world = dist.get_world_size(group)
    return packed_step(group, _tiny(class_name), kernel, [n * world for n in _LENGTHS], class_name, roles)


def _hub_bound(torch_function, implementation):
    """What HF's ``use_kernel_func_from_hub_with_fallback`` binds when a fast package is installed: the torch
    function's signature, calls forwarded to ``implementation`` with the keywords it does not take dropped."""
    accepted = set(inspect.signature(implementation).parameters)

    @functools.wraps(torch_function)
    def wrapped(*args, **kwargs):
        return implementation(*args, **{k: v for k, v in kwargs.items() if k in accepted})

    return wrapped


def _fast_kernels(modeling):
    """Stand-ins for causal-conv1d's and mamba-ssm's kernels, in their parameter order (not the torch
    functions'), computing through the torch functions by keyword; and a fused Mamba2 kernel that must never run
    under CP. Returns {name: replacement}."""
    conv, ssd, fused = modeling.causal_conv1d_fn, modeling.mamba2_chunk_scan, modeling.mamba2_split_conv1d_scan_combined

    def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
                         final_states_out=None, activation=None):
        assert seq_idx is None and activation in (None, "silu", "swish"), (seq_idx, activation)
        return conv(x, weight, bias=bias, activation=activation)

    def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
                                  seq_idx=None, cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf")),
                                  return_final_states=False, return_varlen_states=False):
        assert z is None and seq_idx is None and isinstance(chunk_size, int)
        return ssd(x, dt, A, B, C, chunk_size=chunk_size, D=D, dt_bias=dt_bias, initial_states=initial_states,
                   dt_softplus=dt_softplus, dt_limit=dt_limit, return_final_states=return_final_states)

    def fused_kernel(*args, **kwargs):  # the non-CP run ("local") falls back to the unfused path, as on CPU
        assert current_mode() == "local", "the fused Mamba2 kernel ran under CP"
        return None

    return {"causal_conv1d_fn": _hub_bound(conv, causal_conv1d_fn),
            "mamba2_chunk_scan": _hub_bound(ssd, mamba_chunk_scan_combined),
            "mamba2_split_conv1d_scan_combined": _hub_bound(fused, fused_kernel)}


def _hub_bound_case(group, class_name, roles):
    """Bamba with its kernels bound as they are on a GPU machine with causal-conv1d and mamba-ssm: exact under
    CP (zigzag), the fused kernel never called, the conv and the scan through the CP forms."""
    entry = entries(NAMES)[class_name]
    modeling = __import__(entry.model_class().__module__, fromlist=["x"])
    saved = {n: getattr(modeling, n) for n in ("causal_conv1d_fn", "mamba2_chunk_scan",
                                               "mamba2_split_conv1d_scan_combined")}
    try:
        for name, fast in _fast_kernels(modeling).items():
            setattr(modeling, name, fast)
        world = dist.get_world_size(group)
        ran = packed_step(group, _tiny(class_name), "zigzag", [n * world for n in _LENGTHS],
                          f"{class_name} (hub-bound kernels)")
    finally:
        for name, original in saved.items():
            setattr(modeling, name, original)
    assert ran == list(roles), f"{class_name} hub-bound: ran {ran}, expected {list(roles)}"
    return ran


def _refusals(group, class_name, passes_kwargs):
    """``passes_kwargs``: the model hands its forward's extra keywords on to the mixer (Bamba does, Jamba's
    decoder layer drops them, in the non-CP run too)."""
    world = dist.get_world_size(group)
    model = _tiny(class_name)
    modeling = __import__(type(model).__module__, fromlist=["x"])
    names = ("mamba2_split_conv1d_scan_combined", "causal_conv1d_fn", "mamba2_chunk_scan", "causal_conv1d_update",
             "mamba2_selective_state_update", "mamba_selective_scan", "mamba_selective_state_update")
    before = {n: getattr(modeling, n) for n in names if hasattr(modeling, n)}
    patch = hfpatch.apply(group, model=model)
    try:
        assert all(getattr(modeling, n) is not f and getattr(modeling, n).__wrapped__ is f for n, f in before.items())
        ids = torch.randint(0, 128, (1, 8 * world), generator=torch.Generator().manual_seed(1))
        batch = patch.shard_inputs(ids)
        seq_local = batch["input_ids"].shape[1]
        if passes_kwargs:
            with pytest.raises(UnsupportedArgument) as info:  # packing metadata the fast kernels would honour
                model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False,
                      seq_idx=torch.zeros(1, seq_local, dtype=torch.int32))
            assert info.value.parameter == "seq_idx"
        with pytest.raises(UnsupportedArgument) as info:  # a cache: the recurrent state would come in from it
            model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=True)
        assert info.value.parameter in ("return_final_states", "return_last_state", "initial_states", "state",
                                        "conv_state", "past_key_values"), info.value.parameter
        step = next(n for n in ("mamba2_selective_state_update", "mamba_selective_state_update") if n in before)
        with pytest.raises(UnsupportedArgument):  # a decode step from the cached state, called directly
            getattr(modeling, step)(torch.zeros(1, 4, 2), torch.zeros(1, 4), torch.zeros(1, 4),
                                    torch.zeros(4, 2), torch.zeros(1, 2), torch.zeros(1, 2))
    finally:
        patch.remove()
    assert {n: getattr(modeling, n) for n in before} == before, "remove() restores every rebound kernel"
    return "refused"


_MAMBA2 = ("causal_conv1d", "mamba2_split_conv1d_scan", "ssd_chunk_scan")
_MAMBA = ("causal_conv1d", "selective_scan")

CASES = (
    kernel_and_class_cases(_exchange, LAYOUTS, FAMILY_CLASSES, four_ranks=("NemotronHForCausalLM",))
    + with_due(_packed_due, [
        Case("packed-BambaForCausalLM-zigzag", 2, _packed, ("BambaForCausalLM", "zigzag", _MAMBA2), weight=2),
        Case("packed-JambaForCausalLM-ring", 2, _packed, ("JambaForCausalLM", "ring", _MAMBA), weight=2),
        Case("hub-bound-BambaForCausalLM-zigzag", 2, _hub_bound_case, ("BambaForCausalLM", _MAMBA2), weight=2),
        Case("refusals-and-remove-BambaForCausalLM", 2, _refusals, ("BambaForCausalLM", True)),
        Case("refusals-and-remove-JambaForCausalLM", 2, _refusals, ("JambaForCausalLM", False))])
)


@pytest.mark.parametrize("name", [c.name for c in CASES])
def test_case(world, name):
    world.check(name)
