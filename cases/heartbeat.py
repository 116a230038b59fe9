"""pytest plugin: a line every ``MUON_HARNESS_HEARTBEAT_S`` seconds (default 20) while tests run.

Why: pytest's progress is a row of dots that ends its line only every ~80 tests, and a pipeline
test can take a minute; a set-up log with minutes between lines reads as a hang. The line says how
many tests ended, the elapsed time and the tests running now (pytest-xdist forwards each worker's
``logstart`` / ``logreport`` to the controller, where this runs; ``pytest -n N`` only, as the test
command runs). Set the variable to 0 to turn it off.
"""
from __future__ import annotations

import os
import threading
import time

import pytest

EVERY_S = float(os.environ.get("MUON_HARNESS_HEARTBEAT_S", "20"))


class Heartbeat:
    def __init__(self, reporter, every_s: float):
        self.reporter, self.every_s = reporter, every_s
        self.running: dict[str, float] = {}
        self.ended = 0
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.t0 = time.perf_counter()
        self.thread = threading.Thread(target=self._beat, daemon=True)

    def line(self, now: float) -> str:
        with self.lock:
            running = sorted(self.running.items(), key=lambda kv: kv[1])
            ended = self.ended
        names = ", ".join(f"{nodeid.rsplit('::', 1)[-1][:60]} ({now - t:.0f}s)" for nodeid, t in running[:2])
        more = f" and {len(running) - 2} more" if len(running) > 2 else ""
        return (f"[heartbeat] {ended} tests ended, {now - self.t0:.0f}s elapsed"
                + (f"; running: {names}{more}" if running else ""))

    def _beat(self) -> None:
        while not self.stop.wait(self.every_s):
            self.reporter.write("\n")  # end the row of dots (xdist writes them past the writer's line count)
            self.reporter.write_line(self.line(time.perf_counter()))

    @pytest.hookimpl
    def pytest_runtest_logstart(self, nodeid, location):
        with self.lock:
            self.running[nodeid] = time.perf_counter()

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report):
        if report.when == "teardown":
            with self.lock:
                self.running.pop(report.nodeid, None)
                self.ended += 1

    @pytest.hookimpl
    def pytest_sessionfinish(self):
        self.stop.set()


@pytest.hookimpl(trylast=True)  # after the terminal reporter is registered (it is None before)
def pytest_configure(config):
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    # Only in a pytest-xdist controller: it runs no test itself, so nothing captures what the thread
    # writes (in a single process a line written mid-test would land in that test's captured output).
    controller = bool(getattr(config.option, "numprocesses", None)) and "PYTEST_XDIST_WORKER" not in os.environ
    if EVERY_S > 0 and reporter is not None and controller and not config.option.collectonly:
        beat = Heartbeat(reporter, EVERY_S)
        config.pluginmanager.register(beat, "muon-heartbeat")
        beat.thread.start()
