"""Ring attention kernels: ring, zigzag, stripe and llama3 context parallelism over torch.distributed."""

from ring_kernels.layout import LAYOUTS, LocalVarlen, local_positions, local_varlen, shard, unshard

__all__ = ["LAYOUTS", "LocalVarlen", "local_positions", "local_varlen", "shard", "unshard"]
