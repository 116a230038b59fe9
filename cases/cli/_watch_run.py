"""What the watch tests share: the environment a CPU user runs their training in, and the watch command."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from harness.env import buildenv

TIMEOUT_S = 240


def user_env() -> dict:
    """What a CPU user sets: the CPU accelerator, the ops this checkout built, eager Muon; the project on
    PYTHONPATH only for the scripts' own ``from harness.fixes import apply``."""
    return dict(os.environ, DS_ACCELERATOR="cpu", TORCH_EXTENSIONS_DIR=str(buildenv.extensions_dir()),
                TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1", PYTHONPATH=str(buildenv.PROJECT_ROOT))


def watch(out: Path, command: list[str], *options: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "harness", "watch", "--out", str(out), "--no-report", *options, "--", *command]
    return subprocess.run(argv, env=user_env(), capture_output=True, text=True, timeout=TIMEOUT_S,
                          cwd=buildenv.PROJECT_ROOT)


def verdict_line(res: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("verdict")]
    assert lines, res.stdout[-3000:] + res.stderr[-3000:]
    return lines[0]
