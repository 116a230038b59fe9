"""The private copy of installed DeepSpeed that the mutation engine edits, and where a run keeps its
state.

Why a copy: the engine rewrites a source file in place for each mutant; doing that to the venv's
DeepSpeed would break every other process on the machine mid-run, and a killed engine would leave a
mutant installed. The copy lives outside the checkout (beside the op build cache, keyed by the same
torch and DeepSpeed versions) and is imported by putting its folder first on ``sys.path``; the JIT
ops are not part of it (the ranks load them from the version-keyed extensions cache,
``harness.rank.runtime_state.preload_built_ops``), so no mutant rebuilds an op.

Byte code: a mutant can keep a file's size and land within the same second as the original, and
Python would then run the stale ``.pyc`` of the unmutated file. The copy is compiled once except the
scoped files, whose ``__pycache__`` entries are removed before every run, and every process that
imports the copy runs with ``PYTHONDONTWRITEBYTECODE=1``.
"""
from __future__ import annotations

import compileall
import hashlib
import os
import shutil
from pathlib import Path

from harness.env import buildenv
from harness.selfcheck.source_mutation import scope


def installed_deepspeed() -> Path:
    """The package folder of the DeepSpeed this interpreter imports (never mutated)."""
    import importlib.util

    spec = importlib.util.find_spec("deepspeed")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("deepspeed is not installed in this interpreter")
    return Path(list(spec.submodule_search_locations)[0])


def tree_key() -> str | None:
    """Names the tree ``scope.TREE_ENV`` points at (None: the installed release's own run). Why not its
    version: a pull request on a master commit says "0.19.6+unknown", as does its base."""
    root = os.environ.get(scope.TREE_ENV)
    return hashlib.sha1(str(Path(root).resolve()).encode()).hexdigest()[:10] if root else None


def state_dir() -> Path:
    name = f"torch{buildenv.TORCH_VERSION}-ds{buildenv.deepspeed_version()}"
    key = tree_key()
    return buildenv.cache_root() / "source-mutation" / (name + (f"-tree-{key}" if key else ""))


def site_dir() -> Path:
    """The folder put first on ``sys.path``; it holds one package, ``deepspeed``."""
    return state_dir() / "site"


def copy_root() -> Path:
    return site_dir() / "deepspeed"


def _digest(root: Path, rels) -> str:
    h = hashlib.sha256()
    for rel in sorted(rels):
        h.update(rel.encode())
        h.update((root / rel).read_bytes())
    return h.hexdigest()


def ensure_copy(src: Path | None = None) -> Path:
    """Make (once) or repair the private copy; returns the copy's package folder. A scoped file that
    differs from the installed one (a killed engine left a mutant behind) is restored."""
    src = src or installed_deepspeed()
    dst = copy_root()
    marker = state_dir() / "copy.ok"
    if not marker.exists():
        if dst.exists():
            shutil.rmtree(dst)
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        skip = {str(dst / rel) for rel in scope.files()}
        compileall.compile_dir(str(dst), quiet=2, workers=1,
                               rx=_NotScoped(skip))
        marker.write_text(_digest(src, scope.files()))
    for rel in scope.files():
        if (dst / rel).read_bytes() != (src / rel).read_bytes():
            shutil.copyfile(src / rel, dst / rel)
    _copy_metadata(dst.parent)
    clear_scoped_bytecode(dst)
    return dst


def _copy_metadata(site: Path) -> None:
    """The installed release's ``.dist-info`` beside the copy. The copy shadows the installed package
    on ``sys.path``, and ``harness.env.versions`` refuses a ``deepspeed`` whose nearest metadata describes
    another folder (a tree without metadata would be judged as some other release); with its own
    metadata the copy is, as it should be, the installed release."""
    from importlib import metadata

    dist = metadata.distribution("deepspeed")
    info = Path(str(dist._path))  # the .dist-info / .egg-info folder of the installed release
    target = site / info.name
    if not target.exists():
        shutil.copytree(info, target)


class _NotScoped:
    """compileall's ``rx``: a match means "skip this file"."""

    def __init__(self, skip: set[str]):
        self.skip = skip

    def search(self, path: str):
        return path in self.skip


def clear_scoped_bytecode(root: Path | None = None) -> None:
    root = root or copy_root()
    for rel in scope.files():
        p = root / rel
        cache = p.parent / "__pycache__"
        if cache.is_dir():
            for pyc in cache.glob(p.stem + ".*.pyc"):
                pyc.unlink(missing_ok=True)


def use_copy(site: Path | None = None) -> None:
    """Make this process, and every rank it spawns (spawn hands the parent's ``sys.path`` over), import
    DeepSpeed from the copy. Must run before anything imports deepspeed."""
    import sys

    site = Path(site or site_dir())
    if "deepspeed" in sys.modules:
        mod = sys.modules["deepspeed"].__file__ or ""
        if not mod.startswith(str(site)):
            raise RuntimeError(f"deepspeed already imported from {mod}; the mutated copy must come first")
    sys.path.insert(0, str(site))
    os.environ["PYTHONPATH"] = str(site) + os.pathsep + os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONDONTWRITEBYTECODE"] = "1"
    sys.dont_write_bytecode = True


def lock_copy(progress=print):
    """Hold the copy for this process: the engine edits it in place, so two runs on one machine would
    judge each other's mutants. Blocks until the other run ends; released when the process exits."""
    import fcntl

    state_dir().mkdir(parents=True, exist_ok=True)
    f = open(state_dir() / "copy.lock", "w")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        progress(f"another source-mutation run holds {state_dir() / 'copy.lock'}; waiting for it")
        fcntl.flock(f, fcntl.LOCK_EX)
    return f
