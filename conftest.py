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

from harness import buildenv  # noqa: E402

buildenv.apply_base_env()


def pytest_addoption(parser):
    group = parser.getgroup("muon-harness")
    group.addoption("--full", action="store_true", help="run the full product of pipelines, not the CI covering subset")
    group.addoption("--seed", type=int, default=int(os.environ.get("MUON_HARNESS_SEED", "0")),
                    help="seed for the pipeline cases (the no-false-alarm check runs three)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--full"):
        return
    skip_full = pytest.mark.skip(reason="part of --full only (CI runs the covering subset)")
    for item in items:
        if "full" in item.keywords:
            item.add_marker(skip_full)


@pytest.fixture(scope="session")
def pool_manager(tmp_path_factory):
    from harness.pool import PoolManager

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
