"""hfpatch.dropin.axolotl: axolotl's ring-attention flow through a DeviceMesh with a "cp" dimension.

Per RingAttnFunc, the flow axolotl runs: ``register_ring_attn_from_device_mesh(mesh, ("cp",), stride, func)``, then
per step ``update_ring_attn_params(position_ids)`` with the WHOLE batch's position ids, then each CP rank feeds
the model its part of input_ids/position_ids in the function's layout (axolotl's own split: ``chunk`` for
ring/llama3, chunks r and 2N-1-r for zigzag, ``[:, r::N]`` for stripe). The CP rank's logits equal the same part
of the non-CP eager logits, and the parameter gradients summed over the CP group equal the non-CP ones.

Worlds: 2 ranks = mesh (dp 1, cp 2); 4 ranks = mesh (dp 2, cp 2): two CP groups side by side, so the group really
comes from the mesh's "cp" dimension and not from the world.
Tolerances (fp32) as in tests/test_e2e_models.py.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist


LOGIT_RTOL = 1e-5
GRAD_RTOL = 2e-5
SEQ = 32
DOCS = [5, 11, 1, 7, 8]              # packed: uneven documents crossing rank boundaries
ZIGZAG_DOCS = [8, 4, 12, 8]          # per-document zigzag: every document divisible by 2 x cp = 4


def _split(func, x, rank, cp, cu=None):
    """axolotl's split of dim 1 for ``func`` (varlen_zigzag: ring_kernels' per-document zigzag)."""
    if func in ("varlen_llama3", "batch_ring", "varlen_ring"):
        return x.chunk(cp, dim=1)[rank]
    if func == "batch_zigzag":
        chunks = x.chunk(2 * cp, dim=1)
        return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim=1)
    if func == "batch_stripe":
        return x[:, rank::cp]
    pieces = []
    for a, b in zip(cu[:-1], cu[1:]):
        chunks = x[:, int(a):int(b)].chunk(2 * cp, dim=1)
        pieces += [chunks[rank], chunks[2 * cp - 1 - rank]]
    return torch.cat(pieces, dim=1)


def _inputs(kind):
    g = torch.Generator().manual_seed(77)
    if kind == "batch":
        ids = torch.randint(0, 128, (2, SEQ), generator=g)
        return ids, torch.arange(SEQ).expand(2, SEQ), None
    docs = DOCS if kind == "packed" else ZIGZAG_DOCS
    ids = torch.randint(0, 128, (1, sum(docs)), generator=g)
    return ids, torch.cat([torch.arange(n) for n in docs]).unsqueeze(0), docs


def _baseline(model_name, ids, docs, proj):
    """Non-CP eager logits and gradients of sum(logits * proj); packed rows document by document."""
    from hfpatch.cli.demo_models import build_model, eager_reference_overrides

    model = build_model(model_name, **eager_reference_overrides(model_name))
    from hfpatch.cli.demo_models import reference_logits

    logits = reference_logits(model, ids, docs)
    (logits * proj).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _run_case(mesh, func, model_name, kind):
    from hfpatch.cli.demo_models import build_model
    from hfpatch.dropin import axolotl

    cp_group = mesh["cp"].get_group()
    rank, cp = dist.get_rank(cp_group), dist.get_world_size(cp_group)
    ids, pos, docs = _inputs(kind)
    cu = None if docs is None else torch.tensor([0] + docs).cumsum(0)
    proj = torch.randn(*ids.shape, 128, generator=torch.Generator().manual_seed(5))
    ref_logits, ref_grads = _baseline(model_name, ids, docs, proj)

    model = build_model(model_name)
    patch = axolotl.register_ring_attn_from_device_mesh(mesh, ("cp",), 1, axolotl.RingAttnFunc(func), model=model)
    assert axolotl.get_ring_attn_group() is cp_group
    axolotl.update_ring_attn_params(position_ids=pos)
    local = lambda x: _split(func, x, rank, cp, cu)  # noqa: E731
    logits = model(input_ids=local(ids), position_ids=local(pos), use_cache=False).logits
    (logits * local(proj)).sum().backward()

    label = f"{func}/{model_name}/{kind}/cp {cp}"
    assert patch.mode_calls == {"ring": model.config.num_hidden_layers}, f"{label}: {patch.mode_calls}"
    want = local(ref_logits)
    err = (logits.detach() - want).abs().max().item()
    assert err <= LOGIT_RTOL * want.abs().max().item(), f"{label}: logits differ by {err:.3e}"
    for name, ref in ref_grads.items():
        grad = model.get_parameter(name).grad
        grad = torch.zeros_like(ref) if grad is None else grad.clone()
        dist.all_reduce(grad, group=cp_group)
        gerr = (grad - ref).abs().max().item()
        assert gerr <= GRAD_RTOL * ref.abs().max().item() + 1e-9, f"{label}: grad {name} differs by {gerr:.3e}"
    return model, patch


def _refusals(mesh, model):
    """What axolotl's patch would compute wrongly is refused here."""
    from hfpatch.dropin import axolotl
    from hfpatch.errors import UnsupportedArgument

    cp_group = mesh["cp"].get_group()
    cp = dist.get_world_size(cp_group)
    ids = torch.zeros(1, SEQ // cp, dtype=torch.long)
    patch = axolotl.register_ring_attn_from_device_mesh(mesh, "cp", None, "batch_zigzag", model=model)
    # Zigzag chunks taken for contiguous ones: no step described yet.
    with pytest.raises(UnsupportedArgument, match="update_ring_attn_params described this step"):
        model(input_ids=ids, position_ids=torch.arange(SEQ // cp)[None], use_cache=False)
    # A packed row cut by the row-level zigzag split would let documents see each other.
    _, pos, _ = _inputs("packed")
    with pytest.raises(UnsupportedArgument, match="packed row"):
        axolotl.update_ring_attn_params(position_ids=pos)
    with pytest.raises(UnsupportedArgument, match="needs each rank's global positions"):
        axolotl.update_ring_attn_params(position_ids=None)
    with pytest.raises(ValueError, match="context_parallel_dim=\\('tp',\\)"):
        axolotl.register_ring_attn_from_device_mesh(mesh, ("tp",), None, "batch_ring")
    with pytest.raises(ValueError, match="ring_attn_func='ring'"):
        axolotl.register_ring_attn_from_device_mesh(mesh, ("cp",), None, "ring")
    patch.remove()


# (RingAttnFunc, model, input kind) per world size: every function once, the 4-rank world with two CP groups.
# On transformers 4.47.x Gemma2's own flash path is broken (tests/test_e2e_models.py proves it: it crashes without
# a mask and gives every layer the sliding window); there the windowed Gemma2 case runs on Mistral instead.
CASES = {
    2: [("batch_ring", "llama", "batch"), ("batch_stripe", "mistral", "batch"),
        ("varlen_zigzag", "llama", "zigzag-packed")],
    4: [("batch_zigzag", "llama", "batch"), ("varlen_llama3", "llama", "packed"),
        ("varlen_ring", "gemma2", "packed")],
}


def _axolotl_part(rank, world):
    """Every case of this world size, then the refusals; run inside tests/_dropin_world.py's shared world."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "cp"))
    from test_e2e_models import gemma2_flash_path_broken

    model = None
    for func, model_name, kind in CASES[world]:  # each register replaces the previous patch
        if model_name == "gemma2" and gemma2_flash_path_broken():
            model_name = "mistral"
        model, _ = _run_case(mesh, func, model_name, kind)
    _refusals(mesh, model)


@pytest.mark.parametrize("world", [2, 4])
def test_axolotl_on_device_mesh(world):
    from _dropin_world import failure_of

    failure = failure_of("axolotl", world)
    assert failure is None, failure


# --------------------------------------------------------------------------------- one process


def test_ring_attn_func_choices():
    from hfpatch.dropin.axolotl import RingAttnFunc

    assert [f.value for f in RingAttnFunc] == ["varlen_llama3", "batch_ring", "batch_zigzag", "batch_stripe",
                                               "varlen_ring", "varlen_zigzag"]
    assert RingAttnFunc("batch_zigzag") is RingAttnFunc.BATCH_ZIGZAG and RingAttnFunc.VARLEN_LLAMA3 == "varlen_llama3"


def test_group_accessors_and_order_errors():
    from hfpatch.dropin import _session, axolotl
    from hfpatch.errors import PatchError

    axolotl.set_ring_attn_group(None)
    with pytest.raises(PatchError, match="no ring-attention group yet"):
        axolotl.get_ring_attn_group()
    with pytest.raises(TypeError, match="ring_attn_group='cp'"):
        axolotl.set_ring_attn_group("cp")
    _session._current = None
    with pytest.raises(PatchError, match="before register_ring_attn_from_device_mesh"):
        axolotl.update_ring_attn_params(torch.arange(8)[None])
    with pytest.raises(TypeError, match="device_mesh must be a torch DeviceMesh"):
        axolotl.register_ring_attn_from_device_mesh(object(), ("cp",), None, "varlen_llama3")
