"""The tests' worlds: ``ring_kernels.world.run_world`` runs a function on N processes joined in a process group
(gloo on CPU, or NCCL with one GPU per rank). One spawner serves the package, its command line and the tests; this
module keeps the names the test modules import (``run_world(4, _cases_fn, cases)``, ``DistributedFailure``,
``exit_now``)."""
from ring_kernels.world import DistributedFailure, exit_now, run_world

__all__ = ["DistributedFailure", "exit_now", "run_world"]
