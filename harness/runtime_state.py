"""Process-wide caches a reused rank installs once.

py-cpuinfo answers by starting a subprocess (~1.5 s per DeepSpeedCPUAdam construction on this
machine); the warm-up stores its answer and every rank serves it from memory.
"""
from __future__ import annotations

import json

from harness import buildenv


def install_process_caches() -> None:
    try:
        import cpuinfo
    except ImportError:
        return
    path = buildenv.cpuinfo_cache()
    if path.exists():
        info = json.loads(path.read_text())
    else:
        info = cpuinfo.get_cpu_info()
    cpuinfo.get_cpu_info = lambda: info
    try:
        import cpuinfo.cpuinfo as inner

        inner.get_cpu_info = cpuinfo.get_cpu_info
    except ImportError:
        pass
