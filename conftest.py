"""Suite-wide options and the rank-pool fixture.

The pool is per pytest process (each xdist worker owns its own ranks), reused across every case of
the same world size, and replaced after a failure by ``PoolManager``.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from harness.env import buildenv  # noqa: E402

buildenv.apply_base_env()

# --divergence-report, result_store, report_extra
pytest_plugins = ["harness.report.pytest_plugin", "cases.fuzz.plugin", "cases.heartbeat"]


def pytest_addoption(parser):
    group = parser.getgroup("muon-harness")
    group.addoption("--full", action="store_true", help="run the full product of pipelines, not the CI covering subset")
    group.addoption("--seed", type=int, default=int(os.environ.get("MUON_HARNESS_SEED", "0")),
                    help="seed for the pipeline cases (the no-false-alarm check runs three)")
    group.addoption("--shard", default=None, metavar="K/N",
                    help="run only shard K of N cost-balanced shards of the collected tests (harness/launch/shard.py)")


def pytest_collection_modifyitems(config, items):
    """Without --full, the cases outside the CI covering subset are deselected (not skipped): they
    are not part of this run at all, and the terminal summary says how many and how to run them.
    With --shard K/N only this shard's part of what is left runs (the same split on every machine)."""
    if not config.getoption("--full"):
        keep, full_only = [], []
        for item in items:
            (full_only if "full" in item.keywords else keep).append(item)
        if full_only:
            config.hook.pytest_deselected(items=full_only)
            items[:] = keep
            config._muon_full_only = len(full_only)
    if config.getoption("--shard"):
        _keep_shard(config, items)


def _keep_shard(config, items):
    from harness.launch import shard as sharding
    from harness.case.spec import Case

    part = sharding.Shard.parse(config.getoption("--shard"))
    times = sharding.load_times()
    costs = {}
    for item in items:
        case = next((v for v in getattr(getattr(item, "callspec", None), "params", {}).values()
                     if isinstance(v, Case)), None)
        # The recorded figure covers both columns of a case; a pytest item runs one of them.
        costs[item.nodeid] = (times.get(case.name, sharding.estimate(case)) / 2 if case is not None else 0.5)
    mine = sharding.select_names(costs, costs, part)
    gone = [i for i in items if i.nodeid not in mine]
    if gone:
        config.hook.pytest_deselected(items=gone)
        items[:] = [i for i in items if i.nodeid in mine]


def pytest_terminal_summary(terminalreporter, config):
    n = getattr(config, "_muon_full_only", 0)
    if n:
        terminalreporter.write_line(f"muon-harness: {n} cases of the full product deselected (run with --full)")


@pytest.fixture(scope="session")
def pool_manager(tmp_path_factory):
    from harness.launch.pool import PoolManager

    manager = PoolManager(root=tmp_path_factory.mktemp("pools"))
    yield manager
    manager.close()


@pytest.fixture
def run_case(pool_manager):
    """Run one case on the pool; returns its CaseOutcome (``.result`` is the Trajectory)."""
    return pool_manager.run


@pytest.fixture(scope="session")
def seed(request):
    return request.config.getoption("--seed")
