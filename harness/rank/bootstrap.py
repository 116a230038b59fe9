"""The start-up of one rank process, whichever launcher started it (``harness.launch.pool`` or
``harness.launch.torchrun``): one place that decides how a rank joins its process group and what it loads
before the first case, so that the two launch modes run cases in identical processes.
"""
from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from harness.case.spec import Case
import torch
import torch.distributed as dist
from harness.rank import runtime_state


def set_parent_death_signal() -> None:
    """A rank dies with the process that started it (no orphans when a parent is killed)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def redirect_output(log_path: Path):
    """Send file descriptors 1 and 2 (C extensions included) to ``log_path``; returns a file object
    open on it for faulthandler, which needs one that stays open."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    return open(log_path, "a")


def bootstrap_rank(rank: int, world_size: int, *, backend: str = "gloo", init_method: str = "env://",
                   cpu: bool = True, preload_ops: bool = True) -> None:
    """Join the process group and load what every case needs, once per rank process.

    On CPU ranks torch gets one thread (ranks share the cores; more threads only contend). The cpuinfo
    cache spares every DeepSpeed import a slow CPU probe. ``harness.rank.ds_run`` (and with it DeepSpeed)
    is imported here, not in the first case, so a case's time is the case's. ``preload_ops`` imports
    the built ops straight from their ``.so``: a rank killed inside torch's JIT ``load`` would leave
    a lock that hangs every later load, and a ``build.ninja`` written from another checkout's path
    makes ``load`` rebuild the op under that lock (``harness.rank.runtime_state.preload_built_ops``).
    Seen with torchrun ranks, which did not preload: every case waited on another checkout's
    rebuild of ``pin_memory`` until its timeout.
    """

    if cpu:
        torch.set_num_threads(1)

    runtime_state.install_process_caches()
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
    runtime_state.import_case_modules()  # harness.rank.ds_run and what the first case would import
    if preload_ops:
        runtime_state.preload_built_ops()


def apply_fault(case: Case, rank: int) -> None:
    """Test-only fault injection (``Case.fault``): lets the suite prove crash and hang handling."""
    if not case.fault:
        return
    kind, _, which = case.fault.partition(":")
    if which and int(which) != rank:
        return
    if kind == "raise":
        raise RuntimeError(f"injected fault on rank {rank}")
    if kind == "exit":
        os._exit(17)
    if kind == "abort":
        os.abort()  # a fatal signal, as a C++ assert inside a DeepSpeed op raises
    if kind == "hang":
        while True:
            time.sleep(1)
    if kind == "spawn-child":
        # A grandchild that would outlive a careless kill; the session kill must take it.
        import subprocess

        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
        while True:
            time.sleep(1)
    raise ValueError(f"unknown fault {case.fault!r}")
