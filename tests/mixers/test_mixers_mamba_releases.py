"""Jamba's Mamba mixer and Bamba's Mamba2 mixer on the releases that compute them inline (4.43 - 5.0; the CP
forms of hfpatch.mixers.forms.mamba and mamba2): what the model sweep (zigzag, batch rows, 2 ranks) does
not exercise. CP loss and every gradient equal to the model's own non-CP run on the contiguous layout, on packed
rows, and for Bamba with two B/C groups (4.48's torch path tiles the groups over the heads, later releases repeat
each group for its heads); the conv and the scan counted through the CP kinds; the refusals (a cache, seq_idx, a
dispatched method the CP form was not written for) and ``remove()``. The kinds' exchange on 4 ranks is
tests/mixers/test_mixers_mamba.py's; the CP forms hold nothing that depends on the number of ranks."""
from __future__ import annotations

import functools
import inspect

import pytest
import torch
import torch.distributed as dist

from _dist import run_world
from _mixer_cases import cp_step
import hfpatch
from hfpatch.errors import UnsupportedArgument, UnsupportedModel
from hfpatch.mixers import recognise
from hfpatch.mixers.forms import mamba as mamba_forms, mamba2 as mamba2_forms
from hfpatch.release.sweep.catalog import CatalogEntry, declares_flash
from hfpatch.release.sweep.tiny import build_tiny, tiny_config
from ring_kernels.layout import shard
from ring_kernels.tolerances import assert_close, tolerance

CLASSES = ("JambaForCausalLM", "BambaForCausalLM")
INLINE_FAMILIES = ("mamba-inline", "mamba2-inline", "mamba2-inline-tiled-groups")
SCAN_ROLE = {"JambaForCausalLM": "selective_scan", "BambaForCausalLM": "ssd_chunk_scan"}


@functools.lru_cache(maxsize=None)
def _entries() -> dict:
    """class name -> catalog entry, for the CLASSES of this release with a flash path whose mixers the registry
    recognises through an inline entry (the releases that compute the mixer inline)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    found = {}
    for model_type, name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        if name not in CLASSES:
            continue
        entry = CatalogEntry(model_type, name, CONFIG_MAPPING_NAMES.get(model_type))
        try:
            if not declares_flash(entry.model_class()):
                continue
        except Exception:  # noqa: BLE001 -- not importable in this release: not one of ours
            continue
        families = {r.family.name for r in map(recognise, build_tiny(entry).modules()) if r is not None}
        if families & set(INLINE_FAMILIES):
            found[name] = entry
    return found


def _need(name: str):
    entry = _entries().get(name)
    if entry is None:
        pytest.skip(f"{name}'s mixer is not computed inline in this transformers release (or the class is absent)")
    return entry


def _build(entry, groups: int = 1):
    """The sweep's tiny model of ``entry``; Bamba with ``groups`` B/C groups (4 heads)."""
    if groups == 1:
        return build_tiny(entry)
    config = tiny_config(entry)
    config.mamba_n_groups = groups
    torch.manual_seed(0)
    return entry.model_class()(config).float().train()


def _step(model, kernel: str, ids: torch.Tensor, positions: torch.Tensor, what: str) -> set:
    """CP loss and gradients against the model's own non-CP run on the same rows, within the sweep's entries;
    returns the kernel roles that ran under CP."""
    step = cp_step(dist.group.WORLD, model, kernel, ids, positions)
    step.check_sweep(what)
    assert not any("forward" in m.__dict__ for m in model.modules()), "remove() takes the CP forms off"
    return set(step.ran())


def _rows(world: int):
    """Two batch rows of 12 tokens per rank, and one packed row of three documents (position_ids restart)."""
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 128, (2, 12 * world), generator=gen)
    lengths = [8 * world, 4 * world, 20 * world]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    packed = torch.randint(0, 128, (1, positions.shape[1]), generator=gen)
    return (ids, torch.arange(ids.shape[1])[None].expand_as(ids)), (packed, positions)


def _packed_mixer_step(model, kernel: str, ids: torch.Tensor, positions: torch.Tensor, what: str) -> set:
    """A packed row (documents given by position_ids) through the model's first mixer alone: its CP output and
    gradients (input and parameters) against the mixer on the whole row, which HF's Mamba mixers run as one
    sequence. (At the model level a packed row also depends on whether the release's attention receives the
    position ids, which hfpatch's attention tests cover.)"""
    mixer = next(m for m in model.modules() if type(m).__name__ in ("JambaMambaMixer", "BambaMixer"))
    whole = torch.randn(1, ids.shape[1], model.config.hidden_size, generator=torch.Generator().manual_seed(7))
    weight = torch.randn(whole.shape, generator=torch.Generator().manual_seed(8))
    with hfpatch.apply(dist.group.WORLD, model=model, kernel=kernel) as patch:
        x = whole.clone().requires_grad_()
        with hfpatch.switch("local"):
            ref_out = mixer(x)
            (ref_out * weight).sum().backward()
        ref_grads = {n: p.grad.clone() for n, p in mixer.named_parameters() if p.grad is not None}
        ref_out, ref_dx = ref_out.detach(), x.grad
        mixer.zero_grad(set_to_none=True)
        patch.shard_inputs(ids, labels=ids, position_ids=positions)
        step = patch.ctx.step
        assert step.packed and step.layout == ("zigzag" if kernel == "zigzag" else "contiguous"), (what, step.layout)

        def local(t):
            return shard(t, dist.group.WORLD, layout=step.layout, dim=1, cu_seqlens=step.cu_seqlens)

        x = local(whole).requires_grad_()
        out = mixer(x)
        (out * local(weight)).sum().backward()
        installation = patch.mixers
        ran = {role for (role, mode), n in installation.calls.items() if mode == "ring" and n}
        assert_close(out, local(ref_out), tolerance("cp", torch.float32, "out"), f"{what} output")
        assert_close(x.grad, local(ref_dx), tolerance("cp", torch.float32, "grad"), f"{what} d(input)")
        largest = max(float(g.abs().max()) for g in ref_grads.values())
        for name, ref_grad in ref_grads.items():
            got = mixer.get_parameter(name).grad.clone()
            dist.all_reduce(got)
            assert_close(got, ref_grad, tolerance("sweep", torch.float32, "grad"), f"{what} d{name}", largest=largest)
    return ran


def _cases_world(rank, world, names):
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    (ids, positions), (packed, packed_positions) = _rows(world)
    done = []
    for name in names:
        entry = _entries()[name]
        runs = [(_step, "ring", ids, positions, 1), (_packed_mixer_step, "zigzag", packed, packed_positions, 1),
                (_packed_mixer_step, "ring", packed, packed_positions, 1)]
        if name == "BambaForCausalLM":
            runs += [(_step, "auto", ids, positions, 2), (_packed_mixer_step, "zigzag", packed, packed_positions, 2)]
        for check, kernel, rows, pos, groups in runs:
            what = f"{name} {check.__name__} {kernel} rows {tuple(rows.shape)} groups {groups}"
            ran = check(_build(entry, groups), kernel, rows, pos, what)
            assert ran == {"causal_conv1d", SCAN_ROLE[name]}, (what, ran)
            done.append(what)
    _refusals(names)
    return done


def test_contiguous_packed_two_groups_and_refusals_2_ranks():
    """Contiguous batch rows (the sweep runs zigzag); packed rows through the mixer, zigzag varlen and contiguous;
    Bamba with two B/C groups; then the refusals and remove()."""
    names = tuple(_entries())
    if not names:
        pytest.skip("neither Jamba's nor Bamba's mixer is computed inline in this transformers release")
    per_class = {"JambaForCausalLM": 3, "BambaForCausalLM": 5}
    assert len(run_world(2, _cases_world, names)[0]) == sum(per_class[n] for n in names)


def _refusals(names) -> None:
    """Under CP: a cache and seq_idx refused by name; the CP forms' kernel names rebound to wrappers of the
    originals while the patch is on, and restored by remove()."""
    sites = [(mamba_forms, "causal_conv1d"), (mamba_forms, "mamba_selective_scan"),
             (mamba2_forms, "causal_conv1d"), (mamba2_forms, "mamba2_chunk_scan")]
    before = [getattr(module, n) for module, n in sites]
    for name in names:
        model = _build(_entries()[name])
        mixer = next(m for m in model.modules() if type(m).__name__ in ("JambaMambaMixer", "BambaMixer"))
        x = torch.zeros(1, 4, model.config.hidden_size)
        with hfpatch.apply(dist.group.WORLD, model=model):
            with pytest.raises(UnsupportedArgument) as info:  # a cache: the state would come in from it
                mixer(x, cache_params=object())
            assert info.value.parameter == "cache_params"
            if "seq_idx" in inspect.signature(type(mixer).forward).parameters:
                with pytest.raises(UnsupportedArgument) as info:  # packing metadata
                    mixer(x, seq_idx=torch.zeros(1, 4, dtype=torch.int32))
                assert info.value.parameter == "seq_idx"
            rebound = [getattr(module, n).__wrapped__ is f for (module, n), f in zip(sites, before)
                       if getattr(module, n) is not f]
            assert rebound and all(rebound), "the CP form's kernel names are rebound to wrappers of the originals"
    assert [getattr(module, n) for module, n in sites] == before, "remove() restores every rebound kernel"


@pytest.mark.parametrize("name", CLASSES)
def test_a_changed_dispatched_method_is_refused(name):
    """The registry recognises the class by forward; the CP form checks the methods forward dispatches to."""
    model = _build(_need(name))
    mixer = next(m for m in model.modules() if type(m).__name__ in ("JambaMambaMixer", "BambaMixer"))
    base = type(mixer)
    method = "slow_forward" if hasattr(base, "slow_forward") else "torch_forward"

    def changed(self, *args, **kwargs):  # another release's method, as far as the fingerprint can tell
        return getattr(base, method)(self, *args, **kwargs)

    mixer.__class__ = type(base.__name__, (base,), {method: changed, "__module__": base.__module__})
    found = recognise(mixer)
    assert found is not None  # forward itself is one the registry lists
    cp_form = dict(found.family.replaces)["forward"]
    with pytest.raises(UnsupportedModel, match=method):
        cp_form(mixer, torch.zeros(1, 4, model.config.hidden_size))
