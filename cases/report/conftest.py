"""Fixtures of the report tests: a gate-sized result set rendered once per run (shared by the
pytest-xdist workers through a lock file, since rendering ~120 plots is the slow part)."""
from __future__ import annotations

import fcntl
import json
import os
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # synth, _chromium

GATE_CASES, GATE_FAILING = 75, 40  # x (stock, patched) = 150 outcomes, 40 not passing


@pytest.fixture(scope="session")
def gate_report(tmp_path_factory):
    """(html path, results folder, render seconds) of a gate-sized report: 150 outcomes, 40 failing."""
    import synth
    from harness.report.build import render

    # xdist workers' basetemps (pytest-N/popen-gwK) share their parent; a plain run uses its own
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent
    base = shared / "gate-sized-report"
    base.mkdir(parents=True, exist_ok=True)
    html, results, meta = base / "gate.html", base / "results", base / "meta.json"
    with open(base / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not meta.exists():
            synth.gate_sized(results, n_cases=GATE_CASES, n_failing=GATE_FAILING)
            t0 = time.perf_counter()
            render(results, html, title="gate-sized synthetic report")
            meta.write_text(json.dumps({"seconds": time.perf_counter() - t0}))
        seconds = json.loads(meta.read_text())["seconds"]
    return html, results, seconds
