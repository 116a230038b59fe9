"""pytest plugin: the divergence report of a test session.

* ``--divergence-report=PATH`` (default ``reports/divergence.html`` under the rootdir; ``none``
  turns rendering off). Results are stored next to it, in ``<dir of PATH>/results/``.
* session fixture ``result_store``: a :class:`harness.report.results.ResultStore` writing to that folder.
  Under pytest-xdist every worker writes its own ``results-<worker>.jsonl``; the controller clears
  the folder when its session starts and, when the session finishes, renders the merged report
  (workers never render). A session that stored no outcome renders nothing.
* session fixture ``report_extra``: a dict saved at the end of the session as
  ``extra-<worker>.json`` and merged into the report (``"mutations"`` rows of the kill matrix,
  ``"notes"``, ``"environment"``; see :mod:`harness.report.build`).

The same folder renders again without rerunning anything: ``python -m harness report reports/results``.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

DEFAULT_REPORT = "reports/divergence.html"
_STATE = pytest.StashKey[dict]()
# The session's ResultStore, for code that has ``config`` but no fixture request (e.g.
# ``request.config.stash.get(RESULT_STORE_KEY, None)`` in cases/pipelines).
RESULT_STORE_KEY = pytest.StashKey[object]()


def pytest_addoption(parser):
    group = parser.getgroup("divergence-report", "HTML divergence report")
    group.addoption("--divergence-report", action="store", default=None, metavar="PATH",
                    help=f"write the HTML divergence report here (default {DEFAULT_REPORT} under the rootdir; "
                         "'none' to skip); the stored results go to PATH's folder/results/")


def _is_worker(config) -> bool:
    return hasattr(config, "workerinput")


def _runs_tests(config) -> bool:
    """False for --collect-only, --help, --version, --fixtures, ...: those must not clear results."""
    opt = config.option
    return not any(getattr(opt, name, False) for name in
                   ("collectonly", "help", "version", "showfixtures", "show_fixtures_per_test", "markers",
                    "setuponly", "setupplan"))


def report_paths(config) -> tuple[Path | None, Path]:
    """(report html or None when disabled, results folder)."""
    opt = config.getoption("--divergence-report", default=None)
    if opt is None:
        report = Path(config.rootpath) / DEFAULT_REPORT
    elif str(opt).lower() in ("", "none", "off", "no"):
        report = None
    else:
        report = Path(opt)
        if not report.is_absolute():
            report = Path(config.invocation_params.dir) / report
    base = report if report is not None else Path(config.rootpath) / DEFAULT_REPORT
    return report, base.parent / "results"


def clear_results(results: Path) -> None:
    """Remove what a previous session stored (only the store's own files)."""
    if not results.is_dir():
        return
    for pattern in ("results-*.jsonl", "extra-*.json", "maps/*.npz"):
        for path in results.glob(pattern):
            try:
                path.unlink()
            except FileNotFoundError:
                pass


def pytest_configure(config):
    report, results = report_paths(config)
    if _is_worker(config):
        results = Path(config.workerinput.get("divergence_results", results))
        writer = config.workerinput.get("workerid", os.environ.get("PYTEST_XDIST_WORKER", "worker"))
    else:
        writer = "main"
    config.stash[_STATE] = {"report": report, "results": results, "writer": writer, "rendered": None}
    if not _is_worker(config) and _runs_tests(config):
        clear_results(results)
    from harness.report.results import ResultStore  # late: keeps this module numpy-free at import

    try:
        config.stash[RESULT_STORE_KEY] = ResultStore(results, writer=writer)
    except OSError as exc:  # a read-only checkout must not break the test session
        config.stash[_STATE]["error"] = f"cannot store results in {results}: {exc}"
    if _is_worker(config):
        return
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(_XdistHooks(results), "divergence-report-xdist")
    if not _runs_tests(config):
        return
    from harness.report.build import environment_info, save_extra  # late: keeps this module numpy-free at import

    env = environment_info(seed=config.getoption("--seed", default=None))
    env["pytest args"] = " ".join(config.invocation_params.args) or "(none)"
    workers = config.getoption("numprocesses", default=None)
    if workers:
        env["xdist workers"] = str(workers)
    try:
        save_extra(results, {"environment": env}, name="session")
    except OSError as exc:  # a read-only checkout must not break the test session
        config.stash[_STATE]["error"] = f"cannot write {results}: {exc}"


class _XdistHooks:
    def __init__(self, results: Path):
        self.results = results

    def pytest_configure_node(self, node):  # xdist: tell each worker where to store
        node.workerinput["divergence_results"] = str(self.results)


@pytest.fixture(scope="session")
def result_store(request):
    """The session's :class:`harness.report.results.ResultStore` (one file per xdist worker)."""
    store = request.config.stash.get(RESULT_STORE_KEY, None)
    if store is None:
        pytest.skip(request.config.stash[_STATE].get("error", "no result store"))
    return store


@pytest.fixture(scope="session")
def report_extra(request):
    """A dict merged into the report (e.g. ``{"mutations": [...]}``); saved when the session ends."""
    extra: dict = {}
    yield extra
    if extra:
        from harness.report.build import save_extra

        st = request.config.stash[_STATE]
        save_extra(st["results"], extra, name=st["writer"])


def _has_records(results: Path) -> bool:
    return any(p.stat().st_size > 0 for p in results.glob("results-*.jsonl")) if results.is_dir() else False


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    config = session.config
    st = config.stash.get(_STATE, None)
    if st is None or _is_worker(config) or st["report"] is None or not _has_records(st["results"]):
        return
    from harness.report.build import render  # late: keeps this module numpy-free at import

    extra = {}
    if int(exitstatus) not in (0, 5):
        extra["notes"] = [f"pytest session exit status {int(exitstatus)}: see the pytest log for failures "
                          "outside the stored outcomes"]
    try:
        st["rendered"] = render(st["results"], st["report"], extra=extra)
    except Exception as exc:  # the report must never hide the test results
        st["error"] = f"rendering the divergence report failed: {exc!r}"


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    st = config.stash.get(_STATE, None)
    if st is None or _is_worker(config):
        return
    if st.get("error"):
        terminalreporter.write_line(f"divergence report: {st['error']}", red=True)
    if st.get("rendered"):
        terminalreporter.write_line(f"divergence report: {st['rendered']}  (results: {st['results']}; rebuild with "
                                    f"`python -m harness report {st['results']}`)")
