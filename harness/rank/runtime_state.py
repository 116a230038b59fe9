"""Process-wide caches a reused rank installs once.

py-cpuinfo answers by starting a subprocess (~1.5 s per DeepSpeedCPUAdam construction on this
machine); the warm-up stores its answer and every rank serves it from memory.
"""
from __future__ import annotations

import ctypes
import importlib
import json
import os
import sys
from pathlib import Path

from harness.env import buildenv, device, tree


def install_process_caches() -> None:

    device.install_cpu_fp16_standin()
    install_cpuinfo_cache()


def install_cpuinfo_cache() -> None:
    import cpuinfo  # late: only when the machine is described
    import cpuinfo.cpuinfo as inner  # late: only when the machine is described

    path = buildenv.cpuinfo_cache()
    if path.exists():
        info = json.loads(path.read_text())
    else:
        info = cpuinfo.get_cpu_info()
    cpuinfo.get_cpu_info = lambda: info
    inner.get_cpu_info = cpuinfo.get_cpu_info


# What a rank's first case imports beyond ``harness.rank.ds_run`` (measured: ~850 modules, ~4 s on the loaded
# machine): DeepSpeed's engine, ZeRO optimizers, Muon, swappers and the torch subsystems they pull in
# (dynamo, sympy through the symbolic shapes, fsdp, onnx).
CASE_MODULES = (
    "harness.rank.ds_run",
    "deepspeed.runtime.engine", "deepspeed.runtime.zero.stage3", "deepspeed.runtime.zero.stage_1_and_2",
    "deepspeed.runtime.zero.muon.muon_optimizer", "deepspeed.runtime.bf16_optimizer",
    "deepspeed.runtime.fp16.unfused_optimizer", "deepspeed.runtime.swap_tensor.partitioned_optimizer_swapper",
    "deepspeed.runtime.swap_tensor.pipelined_optimizer_swapper", "deepspeed.module_inject.auto_ep_layer",
    "deepspeed.ops.op_builder.all_ops", "deepspeed.utils.pin_memory",
    "torch._dynamo", "torch.distributed.fsdp", "torch.onnx",
    "torch.utils.cpp_extension",  # preload_built_ops loads the ops through it; it imports setuptools
)


_case_modules_imported = False


def import_case_modules() -> None:
    """Import ``CASE_MODULES`` (those this DeepSpeed has; an older release may lack some).

    A parent that forks its ranks calls this first: every rank of every pool then starts with them, and
    a pool the gate starts afresh (after a crashing case, whose ranks are never reused: 75 stock crash
    cases in ``--full``) no longer pays them per rank (pool start and first case on a 3-rank pool: ~11
    -> ~6 s, loaded machine). Spawned ranks call it at start-up (``bootstrap_rank``), so a case's time
    is its own. Only imports and read-only caches (``probe_compatible_ops``, ``prime_rank_caches``): no
    op is loaded, no DeepSpeed class patched, no thread started here."""

    global _case_modules_imported
    if _case_modules_imported:  # every pool a parent forks calls it, and a forked rank again at start-up
        return
    _case_modules_imported = True
    install_cpuinfo_cache()  # DeepSpeed's CPU accelerator may probe the CPU (a subprocess) at import
    for name in CASE_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:
            continue
    probe_compatible_ops()
    prime_rank_caches()


def prime_rank_caches() -> None:
    """What each rank would otherwise compute once, on its first case: the installed tree's capabilities
    (``tree.capabilities``: DeepSpeed's sources parsed, ~0.7 s, read by the capture's adapter) and the
    source hashes the patched runtime's guard checks (``fixes.prime``). In a forking parent, once for
    every rank of every pool; the gate starts a pool afresh after each crashing case."""
    from harness import fixes  # late: the fixes import torch; keeps this module torch-free at import

    tree.capabilities()
    fixes.prime()


def probe_compatible_ops() -> dict | None:
    """DeepSpeed's table of the ops this machine can build, computed here once for every rank a parent
    forks. Its comm backend reads it when a rank joins (``build_shm_op``), and computing it compiles and
    links a test program per op that needs a library (async_io's ``io_submit``): ~0.1 s of compiler per
    rank start, which every rank of every pool paid. Releases that compute it at import need nothing."""
    ops = sys.modules.get("deepspeed.ops")
    return getattr(ops, "__compatible_ops__", None) if ops is not None else None


PRELOAD_BUILDERS = ("PinMemoryBuilder", "CPUAdamBuilder", "FusedAdamBuilder", "AsyncIOBuilder",
                    "ShareMemCommBuilder")


def preload_built_ops(only: tuple[str, ...] = PRELOAD_BUILDERS) -> list[str]:
    """Import every op the warm-up built straight from its ``.so``, into DeepSpeed's per-process op
    cache (``OpBuilder._loaded_ops``), so no case ever goes through torch's JIT ``load``.

    Why: that path takes a FileBaton ``lock`` in the shared extensions folder, even for an op that
    is already built, and a rank killed while holding it (the pool kills ranks on timeouts and
    failures) leaves a lock behind on which every later load waits forever. Ops not built yet are
    left to DeepSpeed's normal path. ``pin_memory`` goes first: async_io resolves symbols from it.

    Each ``.so`` comes from the content-keyed store build the warm-up recorded (``buildenv.read_built_ops``),
    not from the release's extensions folder: a process that JIT-loads the op there (a user's script run
    from another checkout) relinks that folder's ``.so`` in place, and a rank importing it meanwhile gets
    ``invalid ELF header``. The release folder is the fallback for a cache from before the record.

    ``only`` narrows the builders: the warm-up preloads pin_memory alone before it builds async_io, since
    an async_io recorded under an older key, once in DeepSpeed's op cache, would make the build a no-op.
    """

    from deepspeed.accelerator import get_accelerator  # late: DeepSpeed, rank side
    from deepspeed.ops.op_builder.builder import OpBuilder  # late: DeepSpeed, rank side
    from torch.utils.cpp_extension import _import_module_from_library  # late: keeps this module torch-free at import

    ext = os.environ.get("TORCH_EXTENSIONS_DIR")
    if not ext:
        return []
    loaded = []
    recorded = buildenv.read_built_ops(Path(ext))
    for name in (n for n in PRELOAD_BUILDERS if n in only):
        builder = get_accelerator().create_op_builder(name)
        if builder is None or builder.NAME in OpBuilder._loaded_ops or builder.NAME in builder._loaded_ops:
            continue
        folders = [Path(recorded[builder.NAME]["folder"])] if builder.NAME in recorded else []
        folder = next((f for f in [*folders, Path(ext) / builder.NAME] if (f / f"{builder.NAME}.so").exists()), None)
        if folder is None:
            continue
        module = _import_module_from_library(builder.NAME, str(folder), True)
        # The op cache DeepSpeed's load() reads is the class attribute of the OpBuilder the builder derives
        # from: with a release tree first on the path (an sdist, a source checkout) that is its top-level
        # ``op_builder`` package's OpBuilder, not ``deepspeed.ops.op_builder``'s (two classes, two caches).
        base = next((k for k in type(builder).__mro__ if "_loaded_ops" in vars(k)), OpBuilder)
        base._loaded_ops[builder.NAME] = module
        OpBuilder._loaded_ops[builder.NAME] = module
        if name == "PinMemoryBuilder":
            # What DeepSpeed's own pin_memory loader does (op_builder/pin_memory_load.py): publish the
            # module process-wide and re-open it RTLD_GLOBAL so async_io resolves its symbols.
            sys._deepspeed_pin_memory_op_module = module
            ctypes.CDLL(module.__file__, mode=ctypes.RTLD_GLOBAL)
        loaded.append(builder.NAME)
    return loaded
