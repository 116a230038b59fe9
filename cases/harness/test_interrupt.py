"""A gate or a check that is cancelled, killed or interrupted dies cleanly: nothing of it runs on, what
it judged is kept and reported as INCOMPLETE, Ctrl-C prints a summary (no traceback), and
``--resume`` finishes the run to the statuses an uninterrupted run gives. Also: a verdict does not
depend on the order the case-columns ran in, nor on the other column running beside it."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.launch import lifecycle
from harness.report import statuses

ROOT = Path(__file__).resolve().parents[2]
# 14 CI cases of the most stateful stage, ~10 s of case time: ~4 s of the two shards' wall time is left
# after the first progress line that counts a judged case-column (printed within 1 s of it), so Ctrl-C
# lands before the end. The overflow family's ~3.5 s left under 1 s: with the shards taking each other's
# cases it ended first, and the stopped run was complete (no INCOMPLETE line to check, nothing to resume)
FAMILY = ORDER_FAMILY = "z3-none-fp16"
# a family that cannot finish between its first progress line and a signal: ~50 s of case time over both
# columns (the SIGTERM test needs no uninterrupted run to compare with, so the long family costs it little)
LONG_FAMILY = "resume"
START_S = 600  # imports, pool start-up and op loads on a loaded 2-core machine

pytestmark = pytest.mark.pipeline


def _start(tmp_path: Path, name: str, *args: str) -> tuple[subprocess.Popen, Path]:
    scratch_base = tmp_path / f"{name}-scratch"
    scratch_base.mkdir()
    log = tmp_path / f"{name}.log"
    env = dict(os.environ, PYTHONPATH=str(ROOT), MUON_HARNESS_SCRATCH_BASE=str(scratch_base),
               MUON_HARNESS_PROGRESS_S="1")
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "harness", *args], cwd=ROOT, stdout=out,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return proc, log


JUDGED = r"gate: [1-9]\d*/\d+ case-columns"  # the --jobs progress line once something is judged


def _wait_for(proc: subprocess.Popen, log: Path, pattern: str) -> None:
    deadline = time.monotonic() + START_S
    while not re.search(pattern, log.read_text()):
        assert proc.poll() is None, f"ended before {pattern!r}:\n" + log.read_text()[-3000:]
        assert time.monotonic() < deadline, f"no {pattern!r} in {START_S}s:\n" + log.read_text()[-3000:]
        time.sleep(0.2)


def _run_ids(tmp_path: Path, name: str) -> list[str]:
    return [lifecycle.run_id_of(p) for p in (tmp_path / f"{name}-scratch").glob(lifecycle.SCRATCH_PREFIX + "*")]


def _term_then_kill(proc: subprocess.Popen, run_ids: list[str]) -> None:
    """As a CI runner cancels a job: SIGTERM, SIGKILL a second later; then nothing may be alive 5 s on."""
    assert run_ids
    proc.send_signal(signal.SIGTERM)
    time.sleep(1.0)
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=60)
    time.sleep(5.0)
    for run_id in run_ids:
        assert lifecycle.survivors(run_id, group=proc.pid, parent=proc.pid) == []


def _gate(tmp_path: Path, name: str, *args: str) -> tuple[int, str, Path]:
    report = tmp_path / f"{name}.html"
    proc = subprocess.run([sys.executable, "-m", "harness", "gate", "--no-mutate", "--report", str(report), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=1800)
    return proc.returncode, proc.stdout + proc.stderr, tmp_path / f"{name}-results"


def test_sigterm_then_sigkill_of_gate_jobs_leaves_nothing_and_an_incomplete_folder(tmp_path):
    report = tmp_path / "g.html"
    proc, log = _start(tmp_path, "g", "gate", "--jobs", "2", "--only", LONG_FAMILY, "--no-mutate", "--report",
                       str(report))
    _wait_for(proc, log, JUDGED)
    _term_then_kill(proc, _run_ids(tmp_path, "g"))
    folder = tmp_path / "g-results"
    rendered = subprocess.run([sys.executable, "-m", "harness", "report", str(folder), "-o", str(tmp_path / "r.html")],
                              cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert rendered.returncode == 4, rendered.stdout + rendered.stderr
    assert "verdict: INCOMPLETE: judged" in rendered.stdout
    assert "class='vword'>INCOMPLETE" in (tmp_path / "r.html").read_text()


def test_sigterm_then_sigkill_of_check_leaves_nothing(tmp_path):
    proc, log = _start(tmp_path, "c", "check", "--ds-config", str(ROOT / "examples" / "zero1_fp32.json"),
                       "--no-report")
    deadline = time.monotonic() + START_S
    while not list((tmp_path / "c-scratch").glob(f"{lifecycle.SCRATCH_PREFIX}*/muon-pool-*")):
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)
    _term_then_kill(proc, _run_ids(tmp_path, "c"))


def test_ctrl_c_prints_a_summary_and_resume_gives_the_uninterrupted_statuses(tmp_path):
    rc, out, whole = _gate(tmp_path, "whole", "--only", FAMILY, "-q")
    assert rc in (0, 1), out[-3000:]
    proc, log = _start(tmp_path, "i", "gate", "--jobs", "2", "--only", FAMILY, "--no-mutate", "--report",
                       str(tmp_path / "i.html"))
    _wait_for(proc, log, JUDGED)
    os.killpg(proc.pid, signal.SIGINT)  # as the terminal sends Ctrl-C: to the foreground process group
    assert proc.wait(timeout=120) == 130
    text = log.read_text()
    assert "gate STOPPED by SIGINT" in text, text[-3000:]
    assert "INCOMPLETE: judged" in text and "--resume" in text, "the family ended before Ctrl-C:\n" + text[-3000:]
    assert "Traceback" not in text and "KeyboardInterrupt" not in text
    rc, out, resumed = _gate(tmp_path, "resumed", "--resume", str(tmp_path / "i-results"))
    assert rc in (0, 1) and "INCOMPLETE" not in out, out[-3000:]
    assert not resumed.exists()  # a resume appends to the folder it was given
    assert statuses.differences(statuses.outcomes(whole), statuses.outcomes(tmp_path / "i-results")) == []


def test_statuses_do_not_depend_on_order_or_the_other_column(tmp_path):
    """Three gates, not four: each column alone *and* shuffled against both columns in order. A verdict
    that leaked from the other column or from the order differs from the first run's either way."""
    rc, out, normal = _gate(tmp_path, "normal", "--only", ORDER_FAMILY, "-q")
    assert rc in (0, 1), out[-3000:]
    base = statuses.outcomes(normal)
    assert {col for _, col in base} == {"stock", "patched"}
    for col in ("stock", "patched"):
        rc, out, alone = _gate(tmp_path, col, "--only", ORDER_FAMILY, "-q", "--column", col, "--shuffle", "1")
        assert rc in (0, 1), out[-3000:]
        mine = statuses.outcomes(alone)
        assert {c for _, c in mine} == {col} and len(mine) == len(base) // 2
        assert statuses.differences(base, mine, common=True) == []
