"""Mamba2 (SSD scan) and Mamba (selective scan) mixers under CP (hfpatch.mixers.ssd, .selective_scan): the segment
exchange against the whole sequence, forward and gradients (zigzag, contiguous, zigzag varlen; several SSD chunks
per segment and segments shorter than a chunk; the selective scan's token chunks), with transformers' own torch
kernels and with the token-by-token definition; then the real HF classes the registry recognises: CP loss and every
gradient equal to non-CP (the sweep's check_class, zigzag and contiguous, 2 ranks; Nemotron-H on 4), packed rows,
implementations bound like HF's hub wrappers (another parameter order, a fused Mamba2 kernel that must not run under
CP), the refusals (a cache, seq_idx, a changed forward) and ``remove()``."""
from __future__ import annotations

import functools
import inspect

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from _dist import run_world
from ring_kernels.tolerances import assert_close, tolerance

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


def _inputs(seed, batch, seq):
    """Global leaf tensors, identical on every rank: Mamba2 (4 heads in 2 groups) and Mamba (6 channels)."""
    gen = torch.Generator().manual_seed(seed)
    heads, groups, head_dim, state, channels = 4, 2, 3, 5, 6

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).requires_grad_()

    return dict(
        x2=r(batch, seq, heads, head_dim), dt2=r(batch, seq, heads), A2=(-torch.rand(heads, generator=gen) - 0.5)
        .requires_grad_(), B2=r(batch, seq, groups, state), C2=r(batch, seq, groups, state), D2=r(heads),
        dt_bias=r(heads, scale=0.5),
        x1=r(batch, channels, seq), dt1=r(batch, channels, seq), A1=(-torch.rand(channels, state, generator=gen) * 2
                                                                     - 0.1).requires_grad_(),
        B1=r(batch, state, seq), C1=r(batch, state, seq), D1=r(channels), z1=r(batch, channels, seq),
        delta_bias=r(channels, scale=0.5),
        w2=torch.randn(batch, seq, heads, head_dim, generator=gen), w1=torch.randn(batch, channels, seq, generator=gen),
    )


def _exchange_case(rank, world, layout, seq, cu, ssd_kernel, scan_kernel):
    """CP (this rank's segments) against the whole sequence: outputs and summed input gradients."""
    from hfpatch.mixers.kernel import KernelCall
    from hfpatch.mixers.segments import SegmentPlan, segments_of_layout
    from hfpatch.mixers.selective_scan import SelectiveScan
    from hfpatch.mixers.ssd import SSDChunkScan
    from ring_kernels.layout import shard

    batch = 1 if cu is not None else 2
    t = _inputs(seq + world, batch, seq)
    plan = SegmentPlan(segments_of_layout(layout, world, seq // world, cu), rank=rank, world_size=world, group=None,
                       layout=layout, cu_seqlens=cu)

    def local(x, dim):
        return shard(x, None, layout=layout, dim=dim, cu_seqlens=cu)

    # A non-default dt_limit clamps; chunks of 4 tokens: several per segment, segments shorter than one.
    ssd_kwargs = dict(chunk_size=4, D=t["D2"], dt_bias=t["dt_bias"], dt_softplus=True, dt_limit=(0.05, 1.5), z=None)
    ssd_call = KernelCall(ssd_kernel, inspect.signature(ssd_kernel),
                          (local(t["x2"], 1), local(t["dt2"], 1), t["A2"], local(t["B2"], 1), local(t["C2"], 1)),
                          ssd_kwargs)
    ssd_cp = SSDChunkScan().run_cp(ssd_call, plan)
    scan_kwargs = dict(D=t["D1"], z=local(t["z1"], 2), delta_bias=t["delta_bias"], delta_softplus=True)
    scan_call = KernelCall(scan_kernel, inspect.signature(scan_kernel),
                           (local(t["x1"], 2), local(t["dt1"], 2), t["A1"], local(t["B1"], 2), local(t["C1"], 2)),
                           scan_kwargs)
    scan_cp = SelectiveScan().run_cp(scan_call, plan)
    # Two backwards: in one graph the two independent exchanges could run their backward collectives in a
    # different order on different ranks (in a model, layers are sequential and the order is fixed).
    (ssd_cp * local(t["w2"], 1)).sum().backward()
    (scan_cp * local(t["w1"], 2)).sum().backward()
    leaves = [n for n, v in t.items() if v.requires_grad]
    grads = {n: t[n].grad.clone() for n in leaves}
    for g in grads.values():
        dist.all_reduce(g)

    whole_ssd = ssd_kernel(t["x2"], t["dt2"], t["A2"], t["B2"], t["C2"], **ssd_kwargs)
    whole_scan = scan_kernel(t["x1"], t["dt1"], t["A1"], t["B1"], t["C1"], **{**scan_kwargs, "z": t["z1"]})
    for n in leaves:
        t[n].grad = None
    ((whole_ssd * t["w2"]).sum() + (whole_scan * t["w1"]).sum()).backward()
    what = f"{layout} {ssd_kernel.__name__}"
    assert_close(ssd_cp, local(whole_ssd, 1), tolerance("cp", torch.float32, "out"), f"{what} ssd")
    assert_close(scan_cp, local(whole_scan, 2), tolerance("cp", torch.float32, "out"), f"{what} selective scan")
    for n in leaves:
        assert_close(grads[n], t[n].grad, tolerance("cp", torch.float32, "grad"), f"{what} d{n}")


def _exchange_world(rank, world):
    from hfpatch.mixers import selective_scan

    cases = [("zigzag", 12 * world, None), ("contiguous", 10 * world, None),
             ("zigzag", 2 * world, None),   # one-token segments
             ("zigzag", 16 * world, torch.tensor([0, 4 * world, 16 * world], dtype=torch.int32)),  # zigzag varlen
             ("contiguous", 8 * world, torch.tensor([0, 3, 8 * world], dtype=torch.int32))]
    selective_scan.CHUNK_ELEMENTS = 2 * 6 * 5 * 3  # three tokens per chunk: F and the correction span chunks
    # transformers' own kernels where they exist (what the models run) on every case, the definition on two.
    runs = [(case, (ssd_reference, scan_reference)) for case in cases[:1] + cases[3:4]]
    runs += [(case, _hf_kernels()) for case in cases] if _hf_kernels() else [(case, runs[0][1]) for case in cases]
    for (layout, seq, cu), (ssd_kernel, scan_kernel) in runs:
        _exchange_case(rank, world, layout, seq, cu, ssd_kernel, scan_kernel)
    return len(runs)


def test_exchange_matches_whole_sequence_2_ranks():
    assert run_world(2, _exchange_world)[0] >= 5


# ------------------------------------------------------------------------------------ the registry

# The causal-LM classes whose Mamba mixers the registry recognises on transformers 5.23, and the mixer each has.
FAMILY_CLASSES = {
    "BambaForCausalLM": "BambaMixer",
    "FalconH1ForCausalLM": "FalconH1Mixer",
    "GraniteMoeHybridForCausalLM": "GraniteMoeHybridMambaLayer",
    "NemotronHForCausalLM": "NemotronHMamba2Mixer",
    "Zamba2ForCausalLM": "Zamba2MambaMixer",
    "JambaForCausalLM": "JambaMambaMixer",
    "ZambaForCausalLM": "ZambaMambaMixer",
}


@functools.lru_cache(maxsize=None)
def _entries() -> tuple:
    """The catalog entries (``hfpatch.release.sweep.catalog``) of the FAMILY_CLASSES this release has with a flash path,
    found without importing every model class."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from hfpatch.release.sweep.catalog import CatalogEntry, declares_flash

    entries = []
    for model_type, names in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        for name in (names,) if isinstance(names, str) else names:
            if name not in FAMILY_CLASSES:
                continue
            entry = CatalogEntry(model_type, name, CONFIG_MAPPING_NAMES.get(model_type))
            try:
                flash = declares_flash(entry.model_class())
            except Exception:  # noqa: BLE001 -- not importable here (the catalog records why): not one of ours
                continue
            if flash:
                entries.append(entry)
    return tuple(sorted(entries, key=lambda e: e.class_name))


def _recognised(model) -> list:
    from hfpatch.mixers import recognise

    return [name for name, m in model.named_modules() if recognise(m) is not None]


def test_registry_recognises_exactly_the_known_mixers():
    """On a release whose mixer code the registry lists, every Mamba mixer of these classes is recognised and the
    audit finds nothing; a changed forward is not recognised and the audit names the failed check."""
    from hfpatch.model_audit import audit
    from hfpatch.release.sweep.tiny import build_tiny

    entries = _entries()
    if not entries:
        pytest.skip("no Mamba hybrid class in this transformers release")
    for entry in entries:
        model = build_tiny(entry)
        mixers = [n for n, m in model.named_modules() if type(m).__name__ == FAMILY_CLASSES[entry.class_name]]
        assert mixers, entry
        if not _recognised(model):  # a release the registry has not read: refused by name, never silent
            assert {f.path for f in audit(model)} >= set(mixers)
            continue
        assert _recognised(model) == mixers
        assert [f for f in audit(model) if f.kind == "sequence-mixer"] == []
        module = model.get_submodule(mixers[0])
        base = type(module)

        def forward(self, *args, **kwargs):  # another release's forward, as far as the registry can tell
            return base.forward(self, *args, **kwargs)

        module.__class__ = type(base.__name__, (base,), {"forward": forward, "__module__": base.__module__})
        finding = next(f for f in audit(model) if f.path == mixers[0])
        assert finding.kind == "sequence-mixer" and "fingerprint" in finding.reason


# ------------------------------------------------------------------------------- real HF classes (CP)


def _classes_world(rank, world, kernels, names):
    from transformers.utils import logging as hf_logging

    from hfpatch.mixers import recognise
    from hfpatch.release.sweep.run import check_class
    from hfpatch.release.sweep.tiny import build_tiny

    hf_logging.set_verbosity_error()
    results = {}
    for entry in (e for e in _entries() if names is None or e.class_name in names):
        known = any(recognise(m) is not None for m in build_tiny(entry).modules())
        for kernel in kernels:
            verdict = check_class(entry, dist.group.WORLD, kernel=kernel)
            assert verdict.verdict == ("exact" if known else "refused"), (kernel, verdict)
            results[(entry.class_name, kernel)] = verdict.verdict
    return results


def test_hf_classes_exact_2_ranks():
    """CP loss and every gradient equal to non-CP within the sweep's entries of ring_kernels.tolerances (fp32:
    loss 1e-5 relative, each gradient 1e-4 of its largest entry): zigzag and contiguous."""
    if not _entries():
        pytest.skip("no Mamba hybrid class in this transformers release")
    results = run_world(2, _classes_world, ("auto", "ring"), None)[0]
    assert {name for name, _ in results} == {e.class_name for e in _entries()}


def _four_ranks_world(rank, world):
    from hfpatch.mixers import selective_scan

    selective_scan.CHUNK_ELEMENTS = 1 << 24
    verdicts = _classes_world(rank, world, ("auto",), {"NemotronHForCausalLM"})
    _exchange_case(rank, world, "zigzag", 8 * world, None, ssd_reference, scan_reference)
    return verdicts


def test_hf_classes_and_exchange_4_ranks():
    if "NemotronHForCausalLM" not in {e.class_name for e in _entries()}:
        pytest.skip("Nemotron-H has no flash-attention path in this transformers release")
    assert run_world(4, _four_ranks_world)[0]


# ------------------------------------------------------ packed rows, hub-bound kernels, refusals, remove


def _packed_step(rank, world, entry, kernel):
    """A packed row (documents given by position_ids): CP loss and gradients against the model's non-CP run on
    the same row. HF's Mamba mixers do not read position_ids: both runs go over the documents as one sequence."""
    import hfpatch
    from hfpatch.release.sweep.tiny import build_tiny

    model = build_tiny(entry)
    lengths = [8 * world, 4 * world, 20 * world]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    ids = torch.randint(0, 128, (1, positions.shape[1]), generator=torch.Generator().manual_seed(5))
    with hfpatch.apply(dist.group.WORLD, model=model, kernel=kernel) as patch:
        with hfpatch.switch("local"):
            ref = model(input_ids=ids, position_ids=positions, labels=ids, use_cache=False).loss
            ref.backward()
        ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        batch = patch.shard_inputs(ids, labels=ids, position_ids=positions)
        loss = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"],
                     use_cache=False).loss
        loss.backward()
        installation = next(h for h in patch._hooks if type(h).__name__ == "MixerInstallation")
        ran = {role for (role, mode), n in installation.calls.items() if mode == "ring" and n}
        largest = max(float(g.abs().max()) for g in ref_grads.values())
        assert_close(loss, ref, tolerance("sweep", torch.float32, "loss"), f"{entry.class_name} {kernel} loss")
        for name, ref_grad in ref_grads.items():
            got = model.get_parameter(name).grad.clone()
            dist.all_reduce(got)
            assert_close(got, ref_grad, tolerance("sweep", torch.float32, "grad"),
                         f"{entry.class_name} {kernel} d{name}", largest=largest)
    return sorted(ran)


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
    from hfpatch.switch import current_mode

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


def _refusals(rank, world, entry, passes_kwargs):
    """``passes_kwargs``: the model hands its forward's extra keywords on to the mixer (Bamba does, Jamba's
    decoder layer drops them, in the non-CP run too)."""
    import hfpatch
    from hfpatch.errors import UnsupportedArgument
    from hfpatch.release.sweep.tiny import build_tiny

    model = build_tiny(entry)
    modeling = __import__(type(model).__module__, fromlist=["x"])
    names = ("mamba2_split_conv1d_scan_combined", "causal_conv1d_fn", "mamba2_chunk_scan", "causal_conv1d_update",
             "mamba2_selective_state_update", "mamba_selective_scan", "mamba_selective_state_update")
    before = {n: getattr(modeling, n) for n in names if hasattr(modeling, n)}
    patch = hfpatch.apply(dist.group.WORLD, model=model)
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


def _hub_bound_world(rank, world, entry):
    """Bamba with its kernels bound as they are on a GPU machine with causal-conv1d and mamba-ssm: exact under
    CP (zigzag), the fused kernel never called, the conv and the scan through the CP forms."""
    modeling = __import__(entry.model_class().__module__, fromlist=["x"])
    saved = {n: getattr(modeling, n) for n in ("causal_conv1d_fn", "mamba2_chunk_scan",
                                               "mamba2_split_conv1d_scan_combined")}
    try:
        for name, fast in _fast_kernels(modeling).items():
            setattr(modeling, name, fast)
        return _packed_step(rank, world, entry, "zigzag")
    finally:
        for name, original in saved.items():
            setattr(modeling, name, original)


def _packed_world(rank, world):
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    entries = {e.class_name: e for e in _entries()}
    ran = {"bamba": _packed_step(rank, world, entries["BambaForCausalLM"], "zigzag"),
           "jamba": _packed_step(rank, world, entries["JambaForCausalLM"], "ring"),
           "hub-bound": _hub_bound_world(rank, world, entries["BambaForCausalLM"])}
    _refusals(rank, world, entries["BambaForCausalLM"], passes_kwargs=True)
    _refusals(rank, world, entries["JambaForCausalLM"], passes_kwargs=False)
    return ran


def test_packed_rows_hub_bound_kernels_refusals_and_remove_2_ranks():
    entries = {e.class_name: e for e in _entries()}
    if not {"BambaForCausalLM", "JambaForCausalLM"} <= set(entries):
        pytest.skip("no Bamba / Jamba class in this transformers release")
    from hfpatch.release.sweep.tiny import build_tiny

    if not (_recognised(build_tiny(entries["BambaForCausalLM"]))
            and _recognised(build_tiny(entries["JambaForCausalLM"]))):
        pytest.skip("this release's mixer code is not in hfpatch's registry (refused by name: see the 2-rank test)")
    ran = run_world(2, _packed_world)[0]
    assert ran["bamba"] == ran["hub-bound"] == ["causal_conv1d", "mamba2_split_conv1d_scan", "ssd_chunk_scan"]
    assert ran["jamba"] == ["causal_conv1d", "selective_scan"]
