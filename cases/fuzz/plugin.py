"""pytest plugin of the fuzz tests: profile registration and the worst-case summary.

Loaded by ``cases/fuzz/conftest.py`` whenever fuzz tests are collected. Registering it from the
root ``conftest.py`` (``pytest_plugins = ["cases.fuzz.plugin"]``) additionally makes
``--hypothesis-profile dev|nightly`` acceptable from the repository root and prints the summary in
the pytest-xdist controller (which never imports ``cases/fuzz/conftest.py``).

Each fuzz test keeps the case with the largest normalised error it judged (``support.TRACKERS``).
After the test, that case goes into the report's ``user_properties`` (pytest-xdist ships them to
the controller), into ``.cache/fuzz-worst/<test>-<profile>.json`` and into the terminal summary --
whether or not the test failed, since Hypothesis' shrinking reports the simplest failing case, not
the worst one.
"""
from __future__ import annotations

import json

import pytest

from cases.fuzz import support

WORST_KEY = "fuzz_worst"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when != "call" or not hasattr(item, "originalname"):
        return
    worst = support.TRACKERS.pop(item.originalname, None)
    if worst is None or worst.case is None:
        return
    profile = support.active_profile_name()
    path = worst.save(item.originalname, profile)
    data = worst.as_dict(item.originalname, profile)
    data["file"] = str(path.relative_to(support.ROOT)) if path else None
    report.user_properties.append((WORST_KEY, json.dumps(data)))


def pytest_terminal_summary(terminalreporter):
    lines = []
    for reports in terminalreporter.stats.values():
        for rep in reports:
            for key, value in getattr(rep, "user_properties", ()) or ():
                if key != WORST_KEY:
                    continue
                d = json.loads(value)
                lines.append(f"{rep.nodeid} [profile {d['profile']}]: {d['examples']} cases judged in "
                             f"{d['seconds']:.0f}s, {d['failures']} out of tolerance; worst normalised error "
                             f"{d['ratio']:.4g}: {d['summary']}")
                if d.get("split_text"):
                    lines.append(f"    throughput: {d['split_text']}")
                if d.get("file"):
                    lines.append(f"    worst case as JSON: {d['file']}")
    if lines:
        terminalreporter.section("muon fuzz: worst cases")
        for line in lines:
            terminalreporter.write_line(line)
    sweep_lines = _sweep_summary(terminalreporter)
    if sweep_lines:
        terminalreporter.section("layout sweep: coverage and outcomes")
        for line in sweep_lines:
            terminalreporter.write_line(line)


SWEEP_KEY = "layout_sweep"  # cases/pipelines/test_layout_sweep.py records each case's outcome under it


def _sweep_summary(terminalreporter) -> list[str]:
    """The layout sweep's coverage table with every case's outcome and time per column, if the
    session ran any sweep case (outcomes arrive through ``user_properties``, so xdist works too)."""
    runs: dict[str, dict[str, tuple[str, float]]] = {}
    for reports in terminalreporter.stats.values():
        for rep in reports:
            for key, value in getattr(rep, "user_properties", ()) or ():
                if key == SWEEP_KEY:
                    d = json.loads(value)
                    runs.setdefault(d["column"], {})[d["case"]] = (d["status"], d["seconds"])
    if not runs:
        return []
    from harness.catalog import sweep

    cases = sweep.sweep_cases()
    lines = []
    for column, got in sorted(runs.items()):
        statuses = {name: s for name, (s, _) in got.items()}
        seconds = {name: t for name, (_, t) in got.items()}
        lines.append(f"[{column}] {len(got)} of {len(cases)} sweep cases ran in {sum(seconds.values()):.1f}s")
        lines += sweep.coverage_table(cases, statuses, seconds).splitlines()
    return lines
