"""The host-side counter behind issue 8's varlen guard (``benchmarks/host_path.py``), and the forward yield's
once-per-setting lookup.

``tests/ring_kernels/test_ring_varlen.py::_host_syncs_of_repeated_calls`` asserts that a repeated varlen call does
no op that would synchronise with the GPU; that is only worth something if the counter does see every such op. Here
each sync-class op is run on a "device" tensor (one the counter was told lives on the device, or computed from one)
and must be counted, and the same op on a host tensor must not.
"""
from __future__ import annotations

import gc
import sys
import weakref

import pytest
import torch
import torch.distributed as dist

from _paths import BENCHMARKS
from ring_kernels import engine, options
from ring_kernels.backends import torch_cuda_varlen as tcv

sys.path.insert(0, str(BENCHMARKS))

from host_path import HostOpCounter  # noqa: E402

_DEVICE_READS = {
    "_local_scalar_dense": lambda t: (int(t[0]), bool(t[1] > 0), t[2].item()),
    "tolist": lambda t: t.tolist(),
    "to_cpu": lambda t: t.to("cpu", torch.int64),
    "cpu": lambda t: t.cpu(),
    "nonzero": lambda t: torch.nonzero(t),
    "index": lambda t: t[t > 1],                       # a boolean mask: its size depends on the values
    "repeat_interleave": lambda t: torch.repeat_interleave(t.abs()),
    "equal": lambda t: torch.equal(t, t),
}


@pytest.mark.parametrize("name", sorted(_DEVICE_READS))
def test_counter_sees_each_sync_on_device_tensors_only(name):
    read = _DEVICE_READS[name]
    on_device = torch.tensor([3, 1, 2, 0])
    counter = HostOpCounter()
    counter.device(on_device)
    with counter:
        derived = on_device * 2                        # computed from a device tensor: on the device too
        read(derived)
    counts = dict(counter.syncs)
    assert counts.get(name, 0) >= 1 and set(counts) == {name}, counts
    counter.reset()
    with counter:
        read(torch.tensor([3, 1, 2, 0]) * 2)           # the same on the host: nothing to wait for
    assert dict(counter.syncs) == {}, counter.summary()


def test_counter_h2d_kinds_and_what_it_leaves_out():
    """A host tensor moved to the device is an h2d copy, by kind; a repeat_interleave given its output size, a
    kernel's own ops (``paused``) and the host copy's later reads are not syncs."""
    counter = HostOpCounter()
    dev = torch.arange(4)
    counter.device(dev)
    with counter:
        torch.tensor([1, 2]).to(dev.device)
        torch.tensor([1, 2]).to(dev.device, non_blocking=True)
        moved = torch.tensor([1, 2]).pin_memory().to(dev.device, non_blocking=True) \
            if torch.cuda.is_available() else None
        torch.repeat_interleave(dev, dev, output_size=6)
        with counter.paused():
            dev.tolist()
        host = dev.to("cpu")
        int(host[0])
    want = {"blocking": 1, "non_blocking_pageable": 1}
    if moved is not None:
        want["non_blocking_pinned"] = 1
    assert dict(counter.h2d) == want, counter.summary()
    assert dict(counter.syncs) == {"to_cpu": 1}, counter.summary()


def test_counter_counts_collectives_by_name_and_blocking(tmp_path):
    """torch.distributed calls are counted (world of one, gloo, torn down after): async and blocking apart."""
    assert not dist.is_initialized(), "another test left a process group behind"
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        counter = HostOpCounter()
        x = torch.ones(2)
        with counter:
            dist.all_reduce(x)
            dist.all_reduce(x, async_op=True).wait()
        assert dict(counter.collectives) == {"all_reduce": 2}, counter.summary()
        assert dict(counter.blocking) == {"all_reduce": 1}, counter.summary()
    finally:
        dist.destroy_process_group()


def test_forward_yield_setting_is_parsed_once_per_value(monkeypatch):
    """The yield's setting is parsed once (when the options are read) and the device clock looked up once per
    (setting, device), not on every call; off CUDA the pause is always 0 cycles; a bad environment value is
    never cached: it raises on every call."""
    parsed = []
    real = options.from_environment
    monkeypatch.setattr(options, "from_environment", lambda *a: parsed.append(1) or real(*a))
    monkeypatch.setattr(engine, "YIELD_CYCLES", {})
    monkeypatch.setenv(options.ENVIRONMENT["forward_yield_us"], "40")
    options.reload_environment()
    cpu = torch.zeros(1)
    try:
        for _ in range(2):
            engine.yield_to_transfer(cpu)
            with options.use_options(forward_yield_us=25):
                engine.yield_to_transfer(cpu)
        assert len(parsed) == 1 and engine.YIELD_CYCLES == {(40.0, cpu.device): 0, (25.0, cpu.device): 0}
        monkeypatch.setenv(options.ENVIRONMENT["forward_yield_us"], "fast")
        options.reload_environment()
        for _ in range(2):
            with pytest.raises(ValueError, match=options.ENVIRONMENT["forward_yield_us"]):
                engine.yield_to_transfer(cpu)
    finally:
        monkeypatch.undo()
        options.reload_environment()


def test_flash_varlen_padded_lse_index_is_built_once_per_segments(monkeypatch):
    """Builds whose varlen flash op returns the LSE padded (B, H, max_q) need the packed rows' flat index on the
    device, in forward and backward: built once per segments object and device (a host->device copy that waits for
    the stream) and kept with it, by identity (equal content is a miss), gone with the segments."""
    built = []
    real = tcv.packed_to_padded_index
    monkeypatch.setattr(tcv, "packed_to_padded_index", lambda seg, device: built.append(device) or real(seg, device))
    seg = tcv.segments_from_lengths([2, 3, 1], [2, 3, 1], True, "cpu")
    first = seg.padded_index("cpu")
    assert first.tolist() == [0, 1, 3, 4, 5, 6]          # document b, row i -> b * max_q + i (max_q = 3)
    assert seg.padded_index(torch.device("cpu")) is first and len(built) == 1
    equal = tcv.segments_from_lengths([2, 3, 1], [2, 3, 1], True, "cpu")
    assert equal.padded_index("cpu").tolist() == first.tolist() and len(built) == 2
    live = tcv.segments_from_lengths([1], [1], False, "cpu")
    dead = tcv.segments_from_lengths([4], [4], False, "cpu")
    index_ref = weakref.ref(dead.padded_index("cpu"))
    del dead
    gc.collect()
    assert index_ref() is None                           # the index lives and dies with its segments
    assert live.padded_index("cpu").tolist() == [0] and len(built) == 4
