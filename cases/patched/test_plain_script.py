"""A plain DeepSpeed training script, run in a subprocess without and with
``from harness.fixes import apply; apply()``: the stock bugs it hits are gone when patched.

Covers DSM-006 (ZeRO-3 takes the last Muon group's ns_method), which a harness ``Case`` cannot express
(one Muon param group), and re-checks DSM-001 and DSM-012 from the user's side."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.env import buildenv

pytestmark = pytest.mark.pipeline

SCRIPT = Path(__file__).with_name("plain_training.py")


def _built_libraries() -> dict[str, int]:
    return {str(p): p.stat().st_mtime_ns for p in buildenv.extensions_dir().glob("*/*.so")}


def _run(*args) -> dict:
    env = dict(os.environ)
    env.update(buildenv.base_env())
    env.pop("PYTHONPATH", None)  # the script must import the harness itself, as a user's would
    before = _built_libraries()
    p = subprocess.run([sys.executable, str(SCRIPT), "--harness-ops", *args], env=env, capture_output=True, text=True,
                       timeout=600, cwd=str(SCRIPT.parent))
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, f"script failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    assert _built_libraries() == before, "the script rebuilt an op (a JIT load), rewriting a library ranks load"
    return json.loads(lines[-1][len("RESULT "):])


def test_plain_script_stock_bugs_gone_when_patched():
    stock = _run()
    assert stock["ns_method"] == {"first": "standard", "second": "standard"}, stock  # DSM-006
    assert stock["momentum_dtype"] == ["bfloat16"], stock  # DSM-001
    assert stock["conv"].startswith("RuntimeError") and "must match" in stock["conv"], stock  # DSM-012

    patched = _run("--patched")
    assert patched["ns_method"] == {"first": "gram", "second": "standard"}, patched
    assert patched["momentum_dtype"] == ["float32"], patched
    assert patched["conv"] == "trained", patched
