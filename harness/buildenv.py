"""Process-wide environment every harness process (parent, rank, warm-up) must share.

Why this exists: DeepSpeed's JIT-built ops are cached by torch under TORCH_EXTENSIONS_DIR. The shared
default (/tmp/torch_extensions) is poisoned as soon as another DeepSpeed version builds into it
(``module 'deepspeed_shm_comm' has no attribute 'vector_kernel_level'``), and a stale ``lock`` file
left by a killed build makes the next load wait forever. So the harness keeps a cache of its own,
keyed by the torch and DeepSpeed versions, and clears stale locks before any process loads an op.
"""
from __future__ import annotations

import os
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent

# Pinned runtime under test; the cache key uses it. DeepSpeed's is the installed one (the pinned 0.19.8
# in .venv; another release in its own venv, ``scripts/run.sh --deepspeed``), so every release builds
# its ops once into its own folder.
TORCH_VERSION = "2.13.0"


def deepspeed_version() -> str:
    from harness import versions

    return versions.installed().version.replace("+", "-")


def cache_root() -> Path:
    """Outside the checkout on purpose: CI runs in a fresh clone, and a 12-minute op build per
    clone would eat a third of its budget. Override with MUON_HARNESS_CACHE."""
    default = Path.home() / ".cache" / "muon-zero-harness"
    return Path(os.environ.get("MUON_HARNESS_CACHE", default))


def extensions_dir() -> Path:
    return cache_root() / "torch_extensions" / f"torch{TORCH_VERSION}-ds{deepspeed_version()}"


def cpuinfo_cache() -> Path:
    return cache_root() / "cpuinfo.json"


def base_env() -> dict[str, str]:
    """Variables that must be set before torch/deepspeed are imported in any harness process."""
    return {
        "DS_ACCELERATOR": "cpu",
        "TORCH_EXTENSIONS_DIR": str(extensions_dir()),
        # Eager by default: a compiled muon_update costs ~40 CPU-s per process and, in a reused rank,
        # hits dynamo's recompile limit after a few configs and silently changes code path.
        "TORCHDYNAMO_DISABLE": "1",
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "TORCHINDUCTOR_CACHE_DIR": str(cache_root() / "inductor" / f"torch{TORCH_VERSION}"),
        "PYTHONHASHSEED": "0",
    }


def apply_base_env(overrides: dict[str, str] | None = None) -> None:
    env = base_env()
    if overrides:
        env.update(overrides)
    os.environ.update(env)


def clear_stale_locks(max_age_s: float) -> list[Path]:
    """Remove ``lock`` files in the extensions cache older than ``max_age_s``: torch's FileBaton
    waits forever on a lock a killed build left behind."""
    import time

    removed = []
    root = extensions_dir()
    if not root.exists():
        return removed
    now = time.time()
    for lock in root.rglob("lock"):
        try:
            if now - lock.stat().st_mtime >= max_age_s:
                lock.unlink()
                removed.append(lock)
        except FileNotFoundError:
            pass
    return removed
