"""Release source trees for the probe tests: each release's sdist, fetched once into the cache.

Why real trees: a probe (``harness.env.tree``) is only as good as its reading of the code it was written
for; a test on a hand-made tree would check the probe against our idea of the code. The installed
0.19.8 is the installed package itself; an older release comes from PyPI (its sdist, 1-2 MB, from the
simple index with its sha256 checked; ``pip download`` where that fails, which is much slower: it prepares
the sdist's metadata, docs/measurements.md) and the test is skipped, saying so, where PyPI cannot be reached.
"""
from __future__ import annotations

import hashlib
import html
import re
import subprocess
import sys
import tarfile
import urllib.request
from pathlib import Path

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
        archive = store / f"deepspeed-{release}.tar.gz"
        if not _from_index(release, archive):
            got = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                                  f"deepspeed=={release}", "-d", str(store)], capture_output=True, text=True,
                                 timeout=300)
            if got.returncode != 0 or not archive.is_file():
                pytest.skip(f"DeepSpeed {release}'s sdist could not be fetched from PyPI: {got.stderr[-300:]}")
        with tarfile.open(archive) as tar:
            tar.extractall(store, filter="data")
    return str(root)


INDEX = "https://pypi.org/simple/deepspeed/"


def _from_index(release: str, archive: Path) -> bool:
    """The sdist from PyPI's simple index (PEP 503: each file's link carries its sha256); False where
    the index, the file or its hash is not there."""
    try:
        page = urllib.request.urlopen(INDEX, timeout=60).read().decode()
        link = re.search(rf'href="([^"]*/{re.escape(archive.name)}#sha256=([0-9a-f]{{64}}))"', page)
        if link is None:
            return False
        data = urllib.request.urlopen(html.unescape(link.group(1)), timeout=120).read()
    except OSError:
        return False
    if hashlib.sha256(data).hexdigest() != link.group(2):
        return False
    tmp = archive.with_name(archive.name + ".part")
    tmp.write_bytes(data)
    tmp.replace(archive)
    return True


def caps(release: str) -> tree.Capabilities:
    """The probes of a release's own source."""
    return tree.capabilities(release_root(release))
