"""The pytest plugin end to end, in a separate pytest session (a subprocess): option, fixtures,
clearing stale results, one results file per xdist worker, one merged report rendered by the
controller only."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import synth

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent

CONFTEST = '''
import os
import harness.report.build as R

pytest_plugins = ["harness.report.pytest_plugin"]

_render = R.render


def _logged(*args, **kwargs):  # who renders: must be the controller only
    with open(os.environ["RENDER_LOG"], "a") as f:
        f.write(os.environ.get("PYTEST_XDIST_WORKER", "controller") + "\\n")
    return _render(*args, **kwargs)


R.render = _logged
'''

TESTS = '''
import synth


def test_a(result_store, report_extra):
    result_store.add(*synth.failing("-a"))
    report_extra["mutations"] = [{"mutant": "M-drop-tail", "description": "skip the padded tail",
                                  "killed": {"z1-none-fp16-ws2-a": True}}]


def test_b(result_store):
    result_store.add(*synth.passing("-b"))


def test_c(request):  # what cases/pipelines uses: the store through the config stash
    from harness.report.pytest_plugin import RESULT_STORE_KEY

    request.config.stash[RESULT_STORE_KEY].add(*synth.passing("-c", stage=2))
'''


def _session(tmp: Path, *args: str, tests: str = TESTS) -> subprocess.CompletedProcess:
    (tmp / "pytest.ini").write_text("[pytest]\naddopts = -p no:cacheprovider\n")
    (tmp / "conftest.py").write_text(CONFTEST)
    (tmp / "test_inner.py").write_text(tests)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(HERE)]), RENDER_LOG=str(tmp / "render.log"))
    env.pop("PYTEST_XDIST_WORKER", None)
    env.pop("PYTEST_ADDOPTS", None)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", *args], cwd=tmp, env=env, capture_output=True,
                          text=True, timeout=300)


def test_xdist_session_renders_one_merged_report(tmp_path):
    out = tmp_path / "out"
    stale = out / "results"
    synth.write(stale, [synth.passing("-stale")], writer="old")  # a previous session's leftovers
    proc = _session(tmp_path, "-n", "2", f"--divergence-report={out / 'report.html'}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    page = (out / "report.html").read_text()
    for name in ("z1-none-fp16-ws2-a", "z1-none-fp32-ws2-b", "z2-none-fp32-ws2-c"):
        assert name in page
    assert "-stale" not in page, "results of the previous session were not cleared"
    assert "M-drop-tail" in page  # report_extra from a worker reached the report
    files = sorted(p.name for p in stale.glob("results-*.jsonl"))
    assert files and all(f in ("results-gw0.jsonl", "results-gw1.jsonl") for f in files), files
    assert (tmp_path / "render.log").read_text() == "controller\n"  # workers never render
    assert "divergence report: " in proc.stdout and "python -m harness report" in proc.stdout


def test_session_without_outcomes_renders_nothing(tmp_path):
    proc = _session(tmp_path, f"--divergence-report={tmp_path / 'r' / 'x.html'}",
                    tests="def test_unrelated():\n    assert True\n")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not (tmp_path / "r" / "x.html").exists()
    assert not (tmp_path / "render.log").exists()


def test_report_can_be_turned_off(tmp_path):
    proc = _session(tmp_path, "--divergence-report=none")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not (tmp_path / "render.log").exists()
    assert not list(tmp_path.rglob("*.html"))
