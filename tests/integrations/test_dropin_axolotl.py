"""hfpatch.dropin.axolotl: axolotl's ring-attention flow through a DeviceMesh with a "cp" dimension.

Per RingAttnFunc, the flow axolotl runs: ``register_ring_attn_from_device_mesh(mesh, ("cp",), stride, func)``, then
per step ``update_ring_attn_params(position_ids)`` with the WHOLE batch's position ids, then each CP rank feeds
the model its part of input_ids/position_ids in the function's layout (axolotl's own split: ``chunk`` for
ring/llama3, chunks r and 2N-1-r for zigzag, ``[:, r::N]`` for stripe). The CP rank's logits equal the same part
of the non-CP eager logits, and the parameter gradients summed over the CP group equal the non-CP ones.

Worlds: 2 ranks = mesh (dp 1, cp 2); 4 ranks = mesh (dp 2, cp 2): two CP groups side by side, so the group really
comes from the mesh's "cp" dimension and not from the world.
Tolerances (fp32) as in tests/model/test_e2e_models.py. The distributed part runs in
``tests/integrations/_dropin_world.py``'s shared world (one per world size, with the ring-flash-attn part); its code
is there.
"""
from __future__ import annotations

import pytest
import torch

from _dropin_world import failure_of
from hfpatch import dropin
from hfpatch.dropin import axolotl
from hfpatch.dropin.axolotl import RingAttnFunc
from hfpatch.errors import PatchError


@pytest.mark.parametrize("world", [2, 4])
def test_axolotl_on_device_mesh(world):
    failure = failure_of("axolotl", world)
    assert failure is None, failure


# --------------------------------------------------------------------------------- one process


def test_ring_attn_func_choices():
    assert [f.value for f in RingAttnFunc] == ["varlen_llama3", "batch_ring", "batch_zigzag", "batch_stripe",
                                               "varlen_ring", "varlen_zigzag"]
    assert RingAttnFunc("batch_zigzag") is RingAttnFunc.BATCH_ZIGZAG and RingAttnFunc.VARLEN_LLAMA3 == "varlen_llama3"


def test_group_accessors_and_order_errors():
    axolotl.set_ring_attn_group(None)
    with pytest.raises(PatchError, match="no ring-attention group yet"):
        axolotl.get_ring_attn_group()
    with pytest.raises(TypeError, match="ring_attn_group='cp'"):
        axolotl.set_ring_attn_group("cp")
    dropin.forget()
    with pytest.raises(PatchError, match="before register_ring_attn_from_device_mesh"):
        axolotl.update_ring_attn_params(torch.arange(8)[None])
    with pytest.raises(TypeError, match="device_mesh must be a torch DeviceMesh"):
        axolotl.register_ring_attn_from_device_mesh(object(), ("cp",), None, "varlen_llama3")
