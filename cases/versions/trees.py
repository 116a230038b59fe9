"""Release source trees for the probe tests: each release's sdist, fetched once into the cache.

Why real trees: a probe (``harness.env.tree``) is only as good as its reading of the code it was written
for; a test on a hand-made tree would check the probe against our idea of the code. The installed
0.19.8 is the installed package itself; an older release comes from PyPI (``pip download`` of its sdist,
1-2 MB) and the test is skipped, saying so, where PyPI cannot be reached.
"""
from __future__ import annotations

import subprocess
import sys
import tarfile

import pytest

from harness.env import buildenv, tree, versions


def release_root(release: str) -> str:
    inst = versions.installed()
    if release == inst.version and not inst.source_checkout:
        return str(tree.package_dir())
    store = buildenv.cache_root() / "sdists"
    root = store / f"deepspeed-{release}" / "deepspeed"
    if not (root / "runtime").is_dir():
        store.mkdir(parents=True, exist_ok=True)
        got = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                              f"deepspeed=={release}", "-d", str(store)], capture_output=True, text=True, timeout=300)
        archive = store / f"deepspeed-{release}.tar.gz"
        if got.returncode != 0 or not archive.is_file():
            pytest.skip(f"DeepSpeed {release}'s sdist could not be fetched from PyPI: {got.stderr[-300:]}")
        with tarfile.open(archive) as tar:
            tar.extractall(store, filter="data")
    return str(root)


def caps(release: str) -> tree.Capabilities:
    """The probes of a release's own source."""
    return tree.capabilities(release_root(release))
