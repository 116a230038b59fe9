"""The test command's heartbeat line (``cases/heartbeat.py``): what it says while tests run."""
from __future__ import annotations

import types

from cases.heartbeat import Heartbeat


def test_the_heartbeat_names_the_ended_count_and_the_longest_running_tests():
    lines: list[str] = []
    reporter = types.SimpleNamespace(write=lambda s: None, write_line=lines.append)
    beat = Heartbeat(reporter, every_s=0.01)
    beat.t0 = 100.0
    for nodeid in ("a.py::test_one", "a.py::test_two", "b.py::test_three"):
        beat.pytest_runtest_logstart(nodeid, None)
    beat.running = {"a.py::test_one": 110.0, "a.py::test_two": 150.0, "b.py::test_three": 130.0}
    beat.pytest_runtest_logreport(types.SimpleNamespace(when="call", nodeid="a.py::test_two"))
    assert beat.ended == 0  # a test has ended at its teardown report, not at its call
    beat.pytest_runtest_logreport(types.SimpleNamespace(when="teardown", nodeid="a.py::test_two"))
    line = beat.line(160.0)
    assert line == "[heartbeat] 1 tests ended, 60s elapsed; running: test_one (50s), test_three (30s)", line
    beat.thread.start()
    try:
        beat.stop.wait(0.2)
    finally:
        beat.pytest_sessionfinish()
        beat.thread.join(1)
    assert lines and all(x.startswith("[heartbeat] 1 tests ended") for x in lines)
