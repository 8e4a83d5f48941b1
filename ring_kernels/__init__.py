"""Ring attention kernels: ring, zigzag, stripe and llama3 context parallelism over torch.distributed."""
