"""hfpatch.dropin.ring_flash_attn: ring-flash-attn's API on hfpatch, against plain references.

1. Every kernel entry point (plain, ``_kvpacked``, ``_qkvpacked``) on 2 and 4 gloo ranks, inputs split exactly as
   ring-flash-attn's own tests split them (contiguous, zigzag, stripe, per-document, per-document zigzag, llama3
   metadata), forward and input gradients against softmax(QK^T)V in float64 on the whole sequence.
2. ring-flash-attn's documented HF flow: packed documents of different lengths, ``substitute_hf_flash_attn``,
   ``update_ring_flash_attn_params(cu_seqlens, group)`` per step, ``torch.chunk`` of input_ids/position_ids per
   rank; the CP logits and parameter gradients (summed over ranks) equal the non-CP eager run of the same model.
3. Refusals and argument errors, in one process.

The distributed parts (1, 2) run in ``tests/integrations/_dropin_world.py``'s shared world (one per world size, with
the axolotl part); their code is there.

Tolerances: fp32 kernel inputs against the float64 reference, 2e-5 x the largest reference value (the kernels
accumulate in fp32: measured errors ~1e-7; a document boundary moved by one token or a window one token wider
changes these outputs by ~0.8 x their largest value);
fp32 models as in tests/model/test_e2e_models.py (loss/logits 1e-5, gradients 2e-5 relative to their largest value).
"""
from __future__ import annotations

import pytest
import torch

from _dropin_world import close, failure_of, reference
from hfpatch import dropin
from hfpatch.dropin import ring_flash_attn as rfa
from hfpatch.dropin.ring_flash_attn import llama3_flash_attn_prepare_cu_seqlens as prepare
from hfpatch.dropin.ring_flash_attn import substitute_hf_flash_attn, update_ring_flash_attn_params
from hfpatch.errors import PatchError, UnsupportedArgument


@pytest.mark.parametrize("world", [2, 4])
def test_ring_flash_attn_on_gloo_ranks(world):
    failure = failure_of("ring_flash_attn", world)
    assert failure is None, failure


# --------------------------------------------------------------------------------- one process


def test_llama3_prepare_matches_ring_flash_attn_convention():
    """Per-rank metadata of cu_seqlens [0, 7, 14, 16] over 8 ranks (2 tokens each), worked by hand."""
    cu = torch.tensor([0, 7, 14, 16], dtype=torch.int32)
    expected_causal = {  # rank: (cu_q, cu_k, max_q, max_k, k_slice)
        0: ([0, 2], [0, 2], 2, 2, slice(0, 2)),
        3: ([0, 1, 2], [0, 7, 8], 1, 7, slice(0, 8)),
        4: ([0, 2], [0, 3], 2, 3, slice(7, 10)),
        7: ([0, 2], [0, 2], 2, 2, slice(14, 16)),
    }
    for rank, (cu_q, cu_k, max_q, max_k, k_slice) in expected_causal.items():
        got = prepare(cu, True, rank, 8)
        assert got[0].tolist() == cu_q and got[1].tolist() == cu_k and got[0].dtype == torch.int32
        assert got[2:] == (max_q, max_k, k_slice), (rank, got)
    got = prepare(cu, False, 3, 8)  # non-causal: the keys run to the end of the last document
    assert got[1].tolist() == [0, 7, 14] and got[4] == slice(0, 14) and got[3] == 7
    with pytest.raises(ValueError, match="not divisible by world_size=3"):
        prepare(cu, True, 0, 3)
    with pytest.raises(ValueError, match="rank=8"):
        prepare(cu, True, 8, 8)


@pytest.mark.parametrize("kwargs, parameter", [
    (dict(dropout_p=0.1), "dropout_p"),
    (dict(alibi_slopes=torch.ones(4)), "alibi_slopes"),
    (dict(return_attn_probs=True), "return_attn_probs"),
])
def test_unhonourable_arguments_are_refused(kwargs, parameter):
    q = torch.randn(1, 8, 4, 8)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    calls = [
        lambda: rfa.ring_flash_attn_func(q, q, q, **kwargs),
        lambda: rfa.zigzag_ring_flash_attn_kvpacked_func(q, torch.stack([q, q], 2), causal=True, **kwargs),
        lambda: rfa.stripe_flash_attn_qkvpacked_func(torch.stack([q, q, q], 2), causal=True, **kwargs),
        lambda: rfa.ring_flash_attn_varlen_func(q[0], q[0], q[0], cu, 8, **kwargs),
        lambda: rfa.llama3_flash_attn_varlen_func(q[0], q[0], q[0], *rfa.llama3_flash_attn_prepare_cu_seqlens(
            cu, True, 0, 1)[:4], 1, slice(0, 8), **kwargs),
    ]
    for call in calls:
        with pytest.raises(UnsupportedArgument) as info:
            call()
        assert info.value.parameter == parameter and "Fix:" in str(info.value)


def test_argument_errors_name_the_argument():
    q = torch.randn(1, 8, 4, 8)
    with pytest.raises(ValueError, match=r"kv has shape \(1, 8, 4, 8\)"):
        rfa.ring_flash_attn_kvpacked_func(q, q)
    with pytest.raises(ValueError, match="LOCAL cu_seqlens"):
        rfa.ring_flash_attn_varlen_func(q[0], q[0], q[0], torch.tensor([0, 16], dtype=torch.int32), 16)
    with pytest.raises(TypeError, match="window_size"):
        rfa.ring_flash_attn_func(q, q, q, window_size=3)
    with pytest.raises(TypeError, match="flag must be True"):
        rfa.use_ring_attn("yes")
    with pytest.raises(ValueError, match="heads_k_stride=0"):
        rfa.substitute_hf_flash_attn(None, 0)
    dropin.forget()
    with pytest.raises(PatchError, match="before substitute_hf_flash_attn"):
        rfa.update_ring_flash_attn_params(torch.tensor([0, 8], dtype=torch.int32), None)


def test_single_process_entry_points_equal_reference():
    """Without a process group every entry point is plain attention on the whole (local) sequence."""
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 12, 4, 8, generator=g, dtype=torch.float64) for _ in range(3))
    got = rfa.ring_flash_attn_func(q.float(), k.float(), v.float(), causal=True)
    close("single ring", got, reference(q, k, v, causal=True))
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    got = rfa.ring_flash_attn_varlen_func(q[0].float(), k[0].float(), v[0].float(), cu, 7, causal=True)
    close("single varlen", got, reference(q[:1], k[:1], v[:1], causal=True, cu=cu)[0])


def test_without_a_process_group_the_adapter_is_inactive():
    """No torch.distributed at all: an inactive patch, transformers untouched, the per-step update a no-op."""
    import transformers.modeling_flash_attention_utils as mfau

    before = mfau._flash_attention_forward
    patch = substitute_hf_flash_attn(None, 1)
    assert not patch.active and "no CP group" in patch.reason
    update_ring_flash_attn_params(torch.tensor([0, 5, 8], dtype=torch.int32), None)
    assert mfau._flash_attention_forward is before
