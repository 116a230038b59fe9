"""The CI sample of source mutation: a seeded handful of Cosmic Ray mutants of DeepSpeed's
``muon_update`` (real edits of the private copy), judged on two cheap gate cases; every reached
mutant must be killed or listed equivalent, and the same seed must name the same mutants.

Cost here (2 shared cores, load ~10): 58 s with the coverage map cached (the judging zygote forks a
child and its ranks per mutant), ~45 s more to record the three cases' map once per machine.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from harness.env import buildenv
from harness.selfcheck.source_mutation.cli import engine_executable

pytestmark = [pytest.mark.pipeline, pytest.mark.mutate]

CI_CASES = "z1-none-fp16-ws1-clip0.05-heads,z2-none-fp32-ws2,sweep-z3-none-ws2-L0-standard"
# --no-ledger: a test run must neither take verdicts from the checked-in ledger nor write to it
ARGS = ["--sample", "3", "--seed", "1", "--only", "muon_update", "--no-ledger"]


def _run(extra, tmp_path):
    env = dict(os.environ, MUON_MUTATION_CASES=CI_CASES)
    return subprocess.run([sys.executable, "-m", "harness", "mutate", "--engine", "cosmic-ray", *ARGS, *extra],
                          cwd=buildenv.PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=900)


def _copy_free_or_fail():
    """The CLI waits for the machine's one private copy of DeepSpeed (``workspace.lock_copy``): beside a
    whole-scope run that is hours, and the test would only time out. Say so at once instead."""
    import fcntl

    from harness.selfcheck.source_mutation import workspace

    lock = workspace.state_dir() / "copy.lock"
    if not lock.exists():
        return
    with open(lock, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pytest.fail(f"another source-mutation run holds {lock} (python -m harness mutate on this machine): "
                        "the CI sample edits the same private copy of DeepSpeed and cannot run beside it")
        fcntl.flock(f, fcntl.LOCK_UN)


def _keys(text: str, prefix: str) -> list[str]:
    line = next(ln for ln in text.splitlines() if ln.startswith(prefix))
    return [re.sub(r"=\w[\w-]*$", "", k.strip()) for k in line[len(prefix):].split(";") if k.strip()]


@pytest.mark.skipif(engine_executable() is None, reason="Cosmic Ray not installed: bash scripts/run.sh makes "
                                                        ".venv-mutation")
def test_ci_sample_is_deterministic_and_every_reached_mutant_is_killed(tmp_path):
    _copy_free_or_fail()
    report = tmp_path / "mutation-ci.html"
    r = _run(["--fresh", "--report", str(report)], tmp_path)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-6000:]
    assert "verdict: PASS" in out, out[-3000:]
    line = next(ln for ln in out.splitlines() if ln.startswith("mutants: "))
    statuses = dict(k.strip().rsplit("=", 1) for k in line[len("mutants: "):].split(";"))
    assert len(statuses) == 3, line
    assert all(k.startswith("runtime/zero/muon/original_muon.py:") for k in statuses), line  # muon_update only
    # every one judged on a case (none unreached) and killed, or listed equivalent with a reason
    assert set(statuses.values()) <= {"killed", "equivalent"} and "killed" in statuses.values(), line
    ran = list(statuses)
    assert report.exists() and "Per function" in report.read_text()
    again = _run(["--fresh", "--prepare"], tmp_path)
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    assert _keys(again.stdout, "session mutants: ") == ran
