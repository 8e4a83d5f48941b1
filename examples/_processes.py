"""Process handling shared by the examples: ending a launched rank cleanly, and running an example's non-CP
counterpart as one fresh process.

Ending (``leave_process_group`` then ``exit_now``): every rank waits for the others, destroys the default process
group, then leaves without interpreter finalization (``os._exit`` after flushing stdout and stderr). A gloo thread
still alive at finalization aborts the process after its work is done ("terminate called without an active
exception", SIGABRT), and the launcher then fails the whole run; destroying the group alone does not prevent it.
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tempfile
from typing import List, NoReturn, Optional

__all__ = ["is_main_process", "leave_process_group", "exit_now", "run_without_cp"]

# What torchrun and accelerate launch tell their processes; a process started without them runs on its own.
_LAUNCHER_VARIABLES = frozenset({"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                                 "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR",
                                 "MASTER_PORT"})
_LAUNCHER_PREFIXES = ("TORCHELASTIC_", "ACCELERATE_", "FSDP_")


def is_main_process() -> bool:
    """Rank 0 of a launch, or a process started without a launcher."""
    return os.environ.get("RANK", "0") == "0"


def leave_process_group() -> None:
    """Every rank: wait for the others, then destroy the default process group (if one was started)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()


def exit_now(status: int) -> NoReturn:
    """End this process with ``status`` without interpreter finalization (module docstring), output flushed."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):   # a closed stream has nothing left to flush
            pass
    os._exit(status)


def _alone_environment(device: str) -> dict:
    """This process's environment without the launcher's variables; on CUDA only this rank's GPU is visible (one
    process that sees several GPUs makes the Trainer wrap the model in ``nn.DataParallel``)."""
    env = {name: value for name, value in os.environ.items()
           if name not in _LAUNCHER_VARIABLES and not name.startswith(_LAUNCHER_PREFIXES)}
    if device == "cuda":
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        local = int(os.environ.get("LOCAL_RANK", "0"))
        env["CUDA_VISIBLE_DEVICES"] = visible.split(",")[local] if visible else str(local)
    return env


def run_without_cp(command: List[str], device: str) -> Optional[dict]:
    """Run ``command`` (an example with ``--cp 1``) as one process outside the launch, with ``--log-json`` added,
    and return the record it writes there (None when it fails). Its output is shown as it comes, each line marked
    "[no CP]", and its error output only when it fails."""
    _release_device_memory()
    shown = shlex.join(["python" if part == sys.executable else _relative(part) for part in command])
    print(f"the same steps without CP, one process: {shown}", flush=True)
    with tempfile.TemporaryDirectory() as folder, tempfile.TemporaryFile(mode="w+") as errors:
        record_path = os.path.join(folder, "without_cp.json")
        process = subprocess.Popen([*command, "--log-json", record_path], env=_alone_environment(device),
                                   stdout=subprocess.PIPE, stderr=errors, text=True, bufsize=1)
        for line in process.stdout:
            print(f"[no CP] {line}", end="", flush=True)
        status = process.wait()
        if status == 0:
            with open(record_path) as f:
                return json.load(f)
        errors.seek(0)
        print(f"the run without CP failed (exit {status}); its error output ends with:\n{errors.read()[-6000:]}",
              flush=True)
    return None


def _release_device_memory() -> None:
    """Hand the GPU memory this process no longer uses back to the driver, for the process started next to it."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _relative(part: str) -> str:
    """A path under the working folder, relative to it (as a user would type it); anything else as it is."""
    if os.path.isabs(part) and os.path.exists(part):
        relative = os.path.relpath(part)
        return part if relative.startswith("..") else relative
    return part
