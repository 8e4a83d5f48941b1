"""OpenRLHF 0.11.2 as a client of ``hfpatch.dropin.ring_flash_attn``: its own functions, unmodified, exact under CP.

OpenRLHF's ring path imports ring-flash-attn by name (``from ring_flash_attn import substitute_hf_flash_attn`` in
its strategy, ``from ring_flash_attn import update_ring_flash_attn_params`` in ``ring_attn_utils``). Here
``hfpatch.dropin.provide_ring_flash_attn()`` answers that name with hfpatch's drop-in, and OpenRLHF's own code runs:
its strategy's ring setup (a DeviceMesh ``(dp, sp, tp)``, ``mesh["sp"].get_group()``, ``set_ring_attn_group``,
``substitute_hf_flash_attn(group, heads_k_stride)``: on CPU with the drop-in's ``model=`` keyword, which switches
the model onto transformers' flash path that a GPU model loaded with flash_attention_2 is on already), then the
forwards of its ``Actor`` (action log-probs), ``CriticModel`` (values) and ``RewardModel`` (the reward at each
row's eos token), built by OpenRLHF's loaders from a saved checkpoint with ``packing_samples=True``. Their
``unpad_and_slice_tensor`` packs the rows into one row, pads it to a multiple of the ring size, calls
``update_ring_flash_attn_params`` and slices this rank's chunk; ``gather_and_pad_tensor`` all-gathers the result
and pads it back to (batch, seqlen).

Compared on EVERY rank with the same OpenRLHF function called without a ring group (its non-CP path: the same
packed row, no slicing, the model's eager or SDPA attention over it): the forward outputs, the loss of random
per-token weights, and every parameter's gradient summed over the CP group. flash-attn's ``all_gather`` backward
reduce-scatters, so the ranks of a ring group, each computing the same loss on the gathered outputs, give each
rank's tokens cp x their gradient; each rank's loss is divided by cp (DeepSpeed, given no sp group, averages the
gradients over all dp x sp ranks, which divides the same factor out). Cases: 2 ranks (cp=2); 4 ranks as a 2 x 2
dp x cp mesh (two ring groups, each dp group its own batch, compared with its own non-CP run), then as one ring of
4 (Llama); right-padded rows of different lengths (the packed row is padded to the ring size) and full rows (no padding);
Llama, Qwen2, Qwen3 and Mistral with a sliding window, eager and SDPA. The
actor, critic and reward of one architecture are on the ring at once (later ``substitute_hf_flash_attn`` calls
with the same group add their model to the first call's patch). Every CP forward ran the ring in every layer
(``patch.mode_calls``) and described its step through ``update_ring_flash_attn_params`` with OpenRLHF's padded
cu_seqlens. OpenRLHF's own call without ``model=`` on an eager model is refused at the next step
(``RingNotReached``). In one process: ``provide_ring_flash_attn``'s refusals, ``force`` and ``remove()``, and its
``.pth`` line (docs/migration.md) loading no torch.

Outside hfpatch: flash-attn's CUDA-only imports are stood in for, and its pure-Python ``bert_padding.py`` and
``utils/distributed.py`` run as its own files, fetched from its PyPI sdist (tests/_openrlhf.py says how). Skipped
only when openrlhf is not installed. Tolerances: ``ring_kernels.tolerances`` "cp" float32 ("out": log-probs,
values, rewards; "loss"; "grad"). One world per size runs every case (spawning costs seconds).
"""
from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

import hfpatch.dropin
import hfpatch.dropin.ring_flash_attn as drop_in
from _dist import run_world
from _openrlhf import fetch, import_openrlhf, openrlhf_installed
from hfpatch.errors import AlreadyRemoved, ModuleNameTaken, RingNotReached, SitesRebound
from ring_kernels.tolerances import assert_close, relative_error, tolerance

if not openrlhf_installed():
    pytest.skip("openrlhf is not installed (pip install --no-deps openrlhf==0.11.2): its ring path cannot run",
                allow_module_level=True)

OUT = tolerance("cp", torch.float32, "out")
LOSS = tolerance("cp", torch.float32, "loss")
GRAD = tolerance("cp", torch.float32, "grad")
SEQLEN, PROMPT = 12, 4
PADDED = [12, 7, 10]    # right-padded rows: 29 tokens, the packed row padded by OpenRLHF to the ring size
EVEN = [12, 12]         # full rows: 24 tokens, no padding at all
_TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8)
# name -> (config class, extra config, attn_implementation, heads_k_stride)
ARCHS = {
    "llama": ("LlamaConfig", {}, "eager", 1),
    "qwen2": ("Qwen2Config", {}, "sdpa", 2),
    "qwen3": ("Qwen3Config", {}, "eager", 1),
    "mistral": ("MistralConfig", {"sliding_window": 6}, "sdpa", 1),  # a window inside the documents
}
KINDS = ("actor", "critic", "reward")


# ------------------------------------------------------------------------------------------ the models


def _save(arch: str, directory: str) -> str:
    """A tiny causal LM of ``arch`` with random weights, saved by rank 0; every rank loads it from the path."""
    import transformers

    path = os.path.join(directory, arch)
    if dist.get_rank() == 0:
        config_class, extra, _, _ = ARCHS[arch]
        torch.manual_seed(0)
        config = getattr(transformers, config_class)(**_TINY, **extra)
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    dist.barrier()
    return path


def _load(openrlhf, kind: str, path: str, attn: str) -> torch.nn.Module:
    """OpenRLHF's own loader of ``kind`` (bf16 is the lowest precision it loads; the test runs in fp32)."""
    torch.manual_seed(1)  # the value head is not in the checkpoint: the same random head on every rank
    if kind == "actor":
        model = openrlhf.actor.Actor(path, attn_implementation=attn, param_dtype="bf16", packing_samples=True)
    else:
        model = openrlhf.model.get_llm_for_sequence_regression(
            path, kind, param_dtype="bf16", attn_implementation=attn, init_value_head=True, packing_samples=True)
    return model.float().train()


def _forward(kind: str, model, batch, group):
    """The OpenRLHF forward of ``kind`` as its trainers call it; ``group`` None is its non-CP path."""
    sequences, mask, action_mask = batch
    if kind == "reward":
        return model(sequences, attention_mask=mask, ring_attn_group=group)
    return model(sequences, action_mask=action_mask, attention_mask=mask, ring_attn_group=group)


# ------------------------------------------------------------------------------------------- the data


def _batch(lengths, seed):
    """Right-padded rows of ``lengths`` tokens (of SEQLEN): sequences, attention mask, the response's action mask."""
    g = torch.Generator().manual_seed(seed)
    mask = (torch.arange(SEQLEN)[None] < torch.tensor(lengths)[:, None]).long()
    sequences = torch.randint(1, 128, (len(lengths), SEQLEN), generator=g) * mask
    action_mask = mask[:, 1:][:, PROMPT - 1:].clone()
    return sequences, mask, action_mask


def _weights(kind, batch, seed):
    shape = batch[0].shape[:1] if kind == "reward" else batch[2].shape
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _cp_cu_seqlens(mask, cp):
    """The GLOBAL cu_seqlens OpenRLHF describes the step with: the rows' lengths, the ring padding on the last."""
    lengths = mask.sum(1)
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    cu[-1] += (-int(cu[-1])) % cp
    return cu.to(torch.int32)


# ------------------------------------------------------------------------------------------- one case


def _summed_grads(model, group):
    grads = {}
    for name, p in model.named_parameters():
        g = (p.grad if p.grad is not None else torch.zeros_like(p)).clone()
        dist.all_reduce(g, group=group)
        grads[name] = g
    return grads


def _case(label, kind, cp_model, ref_model, batch, seed, patch, group, worst):
    """One OpenRLHF forward + backward under CP against its non-CP call, on this rank (module docstring)."""
    cp = dist.get_world_size(group)
    weights = _weights(kind, batch, seed)
    ref_model.zero_grad(set_to_none=True)
    cp_model.zero_grad(set_to_none=True)
    want = _forward(kind, ref_model, batch, None)
    (want * weights).sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in ref_model.named_parameters()}

    patch.reset_calls()
    got = _forward(kind, cp_model, batch, group)
    loss = (got * weights).sum()
    (loss / cp).backward()  # every ring rank's loss reaches each rank's tokens (module docstring)
    layers = cp_model.config.num_hidden_layers if kind != "actor" else cp_model.model.config.num_hidden_layers
    assert patch.mode_calls == {"ring": layers}, f"{label}: {dict(patch.mode_calls)}"
    step = patch.ctx.step
    assert step.source == "update_ring_flash_attn_params", f"{label}: the step came from {step.source}"
    assert torch.equal(step.cu_seqlens.cpu(), _cp_cu_seqlens(batch[1], cp)), f"{label}: {step.cu_seqlens}"

    rank = dist.get_rank()
    assert_close(got.detach(), want.detach(), OUT, f"{label}: {kind} output on rank {rank}")
    assert_close(loss.detach(), (want * weights).sum().detach(), LOSS, f"{label}: loss on rank {rank}")
    grads = _summed_grads(cp_model, group)
    assert set(grads) == set(ref_grads), f"{label}: parameters differ"
    errors = {"out": relative_error(got.detach(), want.detach()),
              "loss": relative_error(loss.detach(), (want * weights).sum().detach()), "grad": 0.0}
    for name, expected in ref_grads.items():
        assert_close(grads[name], expected, GRAD, f"{label}: gradient of {name} on rank {rank}")
        errors["grad"] = max(errors["grad"], relative_error(grads[name], expected))
    worst[label] = errors


# ---------------------------------------------------------------------------------------------- a world


def _ring_group(world, cp):
    """OpenRLHF's strategy's groups (``DeepspeedStrategy.setup_ring_attn``): a ``(dp, sp, tp)`` DeviceMesh, this
    rank's ``sp`` group; returns it and this rank's dp index."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world // cp, cp, 1), mesh_dim_names=("dp", "sp", "tp"))
    return mesh["sp"].get_group(), mesh["dp"].get_local_rank()


def _arch(openrlhf, arch, directory, group, dp, worst):
    """Actor, critic and reward of ``arch`` on one ring at once, each through padded and full rows."""
    _, _, attn, stride = ARCHS[arch]
    path = _save(arch, directory)
    models = {kind: _load(openrlhf, kind, path, attn) for kind in KINDS}
    references = {kind: copy.deepcopy(model) for kind, model in models.items()}
    from ring_flash_attn import substitute_hf_flash_attn  # what OpenRLHF's strategy imports

    assert substitute_hf_flash_attn is drop_in.substitute_hf_flash_attn
    patch = None
    for kind in KINDS:  # one call per model: the later ones join the first one's patch
        joined = substitute_hf_flash_attn(openrlhf.ring.get_ring_attn_group(), stride, model=models[kind])
        assert patch is None or joined is patch, f"{arch}: a second call replaced the patch"
        patch = joined
    assert len(patch.models) == len(KINDS) and patch.active, patch.models
    cp = dist.get_world_size(group)
    for rows, lengths in (("padded", PADDED), ("full", EVEN)):
        assert (sum(lengths) % cp != 0) == (rows == "padded"), f"{rows}: {lengths} on {cp} ranks"
        batch = _batch(lengths, seed=100 + dp)  # each dp group its own batch
        for index, kind in enumerate(KINDS):
            label = f"cp {cp}/dp {dp}/{arch}/{rows} rows/{kind}"
            _case(label, kind, models[kind], references[kind], batch, 7 + index, patch, group, worst)
    patch.remove()


def _unrouted_model_is_refused(openrlhf, path):
    """OpenRLHF's own call, ``substitute_hf_flash_attn(group, stride)``, with an eager model (a CPU, or a GPU model
    not loaded with flash_attention_2): its attention never reaches the ring, and the next step's
    ``update_ring_flash_attn_params`` raises ``RingNotReached`` instead of training on per-rank attention."""
    from ring_flash_attn import substitute_hf_flash_attn

    group = openrlhf.ring.get_ring_attn_group()
    actor = _load(openrlhf, "actor", path, "eager")
    patch = substitute_hf_flash_attn(group, 1)
    batch = _batch(PADDED, seed=5)
    with torch.no_grad():
        _forward("actor", actor, batch, group)
        with pytest.raises(RingNotReached, match="LlamaForCausalLM"):
            _forward("actor", actor, batch, group)
    patch.remove()


def _world(rank, world, directory, runs):
    """Every ``(cp, archs)`` of ``runs`` on this world's ranks, OpenRLHF's name ``ring_flash_attn`` provided by
    hfpatch throughout; returns {case: {quantity: relative error}} of this rank."""
    openrlhf = import_openrlhf(fetch_flash_attn=True)
    provided = hfpatch.dropin.provide_ring_flash_attn()
    worst = {}
    for cp, archs in runs:
        group, dp = _ring_group(world, cp)
        openrlhf.ring.set_ring_attn_group(group)  # OpenRLHF's strategy does this before its substitute call
        for arch in archs:
            _arch(openrlhf, arch, os.path.join(directory, f"cp{cp}"), group, dp, worst)
    _unrouted_model_is_refused(openrlhf, os.path.join(directory, f"cp{runs[-1][0]}", runs[-1][1][0]))
    hfpatch.dropin.forget()
    assert provided.removed and "ring_flash_attn" not in sys.modules
    return worst


def _report(title, worsts):
    """Print each case's worst relative errors over the ranks (every rank asserted its own)."""
    print(f"\n{title}: worst relative errors over the ranks (out, loss, grad)")
    labels = dict.fromkeys(label for w in worsts for label in w)  # a dp x cp mesh: each dp group its own cases
    for label in labels:
        errors = [max(w[label][q] for w in worsts if label in w) for q in ("out", "loss", "grad")]
        print(f"  {label:40s} " + "  ".join(f"{e:.1e}" for e in errors))


@pytest.fixture(scope="module")
def flash_attn_files():
    return fetch()  # once, before the ranks start: they load the files from the cache


def test_actor_critic_reward_on_2_ranks(tmp_path, flash_attn_files):
    worsts = run_world(2, _world, str(tmp_path), ((2, tuple(ARCHS)),))
    _report("2 ranks", worsts)


def test_actor_critic_reward_on_a_2x2_dp_cp_mesh_and_on_4_ranks(tmp_path, flash_attn_files):
    """A 2 x 2 dp x cp mesh (two ring groups), then one ring over all 4 ranks (Llama; the padded row: 3 tokens of
    padding, documents across three ranks)."""
    worsts = run_world(4, _world, str(tmp_path), ((2, tuple(ARCHS)), (4, ("llama",))))
    _report("4 ranks", worsts)


# ------------------------------------------------------------------------------- the provided import name


def test_provided_name_refuses_an_installed_or_imported_ring_flash_attn(tmp_path, monkeypatch):
    """``provide_ring_flash_attn`` changes nothing where another ring_flash_attn exists, takes the name with
    ``force=True``, and ``remove()`` puts back exactly what was there."""
    (tmp_path / "ring_flash_attn").mkdir()
    (tmp_path / "ring_flash_attn" / "__init__.py").write_text("REAL = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    before = list(sys.meta_path)
    with pytest.raises(ModuleNameTaken, match="ring_flash_attn is installed") as refused:
        hfpatch.dropin.provide_ring_flash_attn()
    assert refused.value.name == "ring_flash_attn" and str(tmp_path) in refused.value.path
    assert isinstance(refused.value, ImportError) and sys.meta_path == before

    handle = hfpatch.dropin.provide_ring_flash_attn(force=True)
    try:
        import ring_flash_attn

        assert ring_flash_attn is drop_in and drop_in.__spec__.name == "hfpatch.dropin.ring_flash_attn"
        assert hfpatch.dropin.provide_ring_flash_attn() is handle
        with pytest.raises(ModuleNotFoundError):
            import ring_flash_attn.adapters  # noqa: F401  (only the top-level name is provided)
    finally:
        handle.remove()
    import ring_flash_attn

    assert ring_flash_attn.REAL and sys.meta_path == before
    with pytest.raises(AlreadyRemoved):
        handle.remove()

    with pytest.raises(ModuleNameTaken, match="already imported"):
        hfpatch.dropin.provide_ring_flash_attn()  # the real one is imported now
    handle = hfpatch.dropin.provide_ring_flash_attn(force=True)
    assert "ring_flash_attn" not in sys.modules and handle.displaced is ring_flash_attn
    sys.modules["ring_flash_attn"] = stranger = type(sys)("ring_flash_attn")
    with pytest.raises(SitesRebound):
        handle.remove()  # someone else's binding is left as it is
    assert sys.modules.pop("ring_flash_attn") is stranger and sys.meta_path == before


def test_a_pth_line_provides_the_name_without_loading_torch(tmp_path):
    """The ``.pth`` line of docs/migration.md, in a fresh interpreter: torch stays unloaded until the first
    ``import ring_flash_attn``, which then gets hfpatch's drop-in."""
    (tmp_path / "hfpatch-ring-flash-attn.pth").write_text(
        "import hfpatch.dropin; hfpatch.dropin.provide_ring_flash_attn()\n")
    script = textwrap.dedent(f"""
        import site, sys
        site.addsitedir({str(tmp_path)!r})
        assert "torch" not in sys.modules, "the .pth line loaded torch"
        from ring_flash_attn import update_ring_flash_attn_params
        import hfpatch.dropin.ring_flash_attn as drop_in
        assert update_ring_flash_attn_params is drop_in.update_ring_flash_attn_params
        print("provided")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "provided" in done.stdout, done.stderr


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([os.path.abspath(__file__), "-q", "-s"]))
