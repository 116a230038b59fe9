"""Process-wide environment every harness process (parent, rank, warm-up) must share.

Why this exists: DeepSpeed's JIT-built ops are cached by torch under TORCH_EXTENSIONS_DIR. The shared
default (/tmp/torch_extensions) is poisoned as soon as another DeepSpeed version builds into it
(``module 'deepspeed_shm_comm' has no attribute 'vector_kernel_level'``), and a stale ``lock`` file
left by a killed build makes the next load wait forever. So the harness keeps a cache of its own,
keyed by the torch and DeepSpeed versions, and clears stale locks before any process loads an op.

Op builds are shared across DeepSpeed releases: each op is built once per *content key* (a hash of the
source and header files the builder lists and they include, the compiler flags and link flags it
passes, the torch and Python versions and the compiler) into ``op_store()``; a release's own
extensions folder holds a copy of it, and ranks import the store's build (``built-ops.json``). A cold
build costs 8-18 minutes per op on two cores, and most releases do not touch most ops
(``python -m harness.env.buildenv --share SDIST...`` shows which share).
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from harness.env import pch, versions

PROJECT_ROOT = Path(__file__).resolve().parents[2]

# Pinned runtime under test; the cache key uses it. DeepSpeed's is the installed one (the pinned 0.19.8
# in .venv; another release in its own venv, ``scripts/run.sh --deepspeed``), so every release builds
# its ops once into its own folder.
TORCH_VERSION = "2.13.0"


def deepspeed_version() -> str:

    return versions.installed().version.replace("+", "-")


def cache_root() -> Path:
    """Outside the checkout on purpose: CI runs in a fresh clone, and a 12-minute op build per
    clone would eat a third of its budget. Override with MUON_HARNESS_CACHE."""
    default = Path.home() / ".cache" / "muon-zero-harness"
    return Path(os.environ.get("MUON_HARNESS_CACHE", default))


def extensions_dir() -> Path:
    return cache_root() / "torch_extensions" / f"torch{TORCH_VERSION}-ds{deepspeed_version()}"


def cpuinfo_cache() -> Path:
    return cache_root() / "cpuinfo.json"


def base_env() -> dict[str, str]:
    """Variables that must be set before torch/deepspeed are imported in any harness process."""
    return {
        "DS_ACCELERATOR": "cpu",
        "TORCH_EXTENSIONS_DIR": str(extensions_dir()),
        # Eager by default: a compiled muon_update costs ~40 CPU-s per process and, in a reused rank,
        # hits dynamo's recompile limit after a few configs and silently changes code path.
        "TORCHDYNAMO_DISABLE": "1",
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "TORCHINDUCTOR_CACHE_DIR": str(cache_root() / "inductor" / f"torch{TORCH_VERSION}"),
        "PYTHONHASHSEED": "0",
    }


def apply_base_env(overrides: dict[str, str] | None = None) -> None:
    env = base_env()
    if overrides:
        env.update(overrides)
    os.environ.update(env)


def clear_stale_locks(max_age_s: float) -> list[Path]:
    """Remove ``lock`` files in the extensions cache older than ``max_age_s``: torch's FileBaton
    waits forever on a lock a killed build left behind."""

    removed = []
    root = extensions_dir()
    if not root.exists():
        return removed
    now = time.time()
    locks = list(root.rglob("lock")) + (list(op_store().rglob("lock")) if op_store().exists() else [])
    for lock in locks:
        try:
            if now - lock.stat().st_mtime >= max_age_s:
                lock.unlink()
                removed.append(lock)
        except FileNotFoundError:
            pass
    return removed


# ------------------------------------------------------------------------------------------------
# op builds keyed by what goes into them, shared across DeepSpeed releases

# The builders the harness needs on the cpu accelerator, in load order: async_io resolves symbols from
# pin_memory (0.19.5+ load pin_memory first), so pin_memory is built (and loaded) before it.
OPS = ("CPUAdamBuilder", "FusedAdamBuilder", "PinMemoryBuilder", "AsyncIOBuilder", "ShareMemCommBuilder")
_INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', re.M)


def op_store() -> Path:
    """Where each op is built once per content key: ``<name>-<key>/`` is the TORCH_EXTENSIONS_DIR of
    that one build (torch puts it in ``<name>-<key>/<name>/<name>.so``)."""
    return cache_root() / "ops" / f"torch{TORCH_VERSION}-py{sys.version_info[0]}{sys.version_info[1]}"


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def source_closure(sources: list[str], include_dirs: list[str]) -> dict[str, str]:
    """Every file that goes into the build, by path, with its sha256: the sources and, transitively,
    each header they ``#include`` that resolves to a file next to the includer or in one of the
    builder's include folders (conditional includes too: over-counting only splits the cache). Headers
    that resolve nowhere are torch's, Python's or the system's: the torch/Python versions and the
    compiler in the key stand for them. Paths are given relative to the longest common folder, so the
    same tree in two venvs hashes the same."""
    seen: dict[Path, str] = {}
    todo = [Path(s).resolve() for s in sources]  # resolved: a venv reached through a link hashes the same
    incs = [Path(d).resolve() for d in include_dirs]
    while todo:
        f = todo.pop()
        if f in seen:
            continue
        data = f.read_bytes()  # a listed source that is missing fails here, naming the file
        seen[f] = _sha(data)
        for name in _INCLUDE.findall(data.decode("utf-8", "replace")):
            for d in [f.parent, *incs]:
                cand = (d / name).resolve()
                if cand.is_file():
                    todo.append(cand)
                    break
    root = Path(os.path.commonpath([str(p) for p in seen] + [str(d) for d in incs]))
    return {str(p.relative_to(root)): h for p, h in sorted(seen.items())}


def _compiler() -> str:
    cxx = os.environ.get("CXX", "c++")  # what torch's cpp_extension compiles with
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{cxx}: {exc}"
    return out.splitlines()[0] if out else cxx


def op_inputs(builder) -> dict:
    """What DeepSpeed's ``OpBuilder.jit_load`` hands torch's ``load`` for a cpu op (0.18.9-0.19.8
    builder.py ``jit_load``: the sources and include folders made absolute with ``deepspeed_src_path``,
    ``cxx_args()`` plus ``-UC10_USE_GLOG``, ``extra_ldflags()``; no nvcc on the cpu accelerator), with
    the files' contents in place of their paths."""
    src = [os.path.abspath(builder.deepspeed_src_path(p)) for p in builder.strip_empty_entries(builder.sources())]
    inc = [os.path.abspath(builder.deepspeed_src_path(p))
           for p in builder.strip_empty_entries(builder.include_paths())]
    import torch  # late: keeps this module torch-free at import

    return {
        "name": builder.NAME,
        "files": source_closure(src, inc),
        "include_dirs": _relative_dirs(src, inc),
        "cxx_args": builder.strip_empty_entries(builder.cxx_args()) + ["-UC10_USE_GLOG"],
        "ldflags": builder.strip_empty_entries(builder.extra_ldflags()),
        "torch": torch.__version__,
        "python": f"{sys.version_info[0]}.{sys.version_info[1]}",
        "compiler": _compiler(),
    }


def _relative_dirs(src: list[str], inc: list[str]) -> list[str]:
    real = [os.path.realpath(p) for p in src + inc]
    root = os.path.commonpath(real)
    return [os.path.relpath(os.path.realpath(d), root) for d in inc]


def op_key(inputs: dict, depends_on: tuple[str, ...] = ()) -> str:
    """16 hex digits of the inputs (and the keys of the ops this one resolves symbols from)."""
    blob = json.dumps({"inputs": inputs, "depends_on": list(depends_on)}, sort_keys=True).encode()
    return _sha(blob)[:16]


def builder_key(builder, depends_on: tuple[str, ...] = ()) -> str:
    return op_key(op_inputs(builder), depends_on)


def op_build_root(name: str, key: str) -> Path:
    return op_store() / f"{name}-{key}"


@contextlib.contextmanager
def environ(extra: dict[str, str]):
    """``extra`` set in this process's environment while the block runs; each variable as it was after
    (unset again where it was unset). Not thread-safe: a caller with threads holds its own lock."""
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


PCH_MIN_UNITS = 4  # a .gch costs about two units' parse of torch's headers (docs/measurements.md): worth it from here


@contextlib.contextmanager
def precompiled_header(builder, root: Path):
    """Build the op with torch's extension header precompiled (``harness.env.pch``) when it has
    ``PCH_MIN_UNITS`` translation units or more; the ``.gch`` (~0.8 GB) is removed afterwards.

    The op's key does not change: the objects are those of a compile that parses the header itself.
    ``CXX`` names a launcher script whose name contains ``g++``, so torch's compiler check accepts it
    without asking it for its version."""
    units = [s for s in builder.sources() if str(s).endswith(pch.SOURCE_SUFFIXES)]
    if len(units) < PCH_MIN_UNITS:
        yield
        return
    folder = root / "pch"
    folder.mkdir(parents=True, exist_ok=True)
    front = folder / "g++-pch"
    front.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{Path(pch.__file__).resolve()}" "$@"\n')
    front.chmod(0o755)
    try:
        with environ({"CXX": str(front), pch.CXX_ENV: os.environ.get("CXX") or "c++", pch.DIR_ENV: str(folder)}):
            yield
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def without_debug_info(builder):
    """The builder, compiling without ``-g``. Why: debug info is a large share of each file's compile
    time (docs/measurements.md, "debug info in an op build") and nothing in a run reads it; GCC's code
    generation does not depend on ``-g``. Every build and every key goes through this, so the
    key names the flags the build used."""
    if getattr(builder, "_muon_no_debug_info", False):
        return builder
    args = builder.cxx_args
    builder.cxx_args = lambda: [a for a in args() if a != "-g"]
    builder._muon_no_debug_info = True
    return builder


def create_builder(name: str):
    """DeepSpeed's cpu op builder ``name`` (``without_debug_info``), or None where the release lacks it."""
    from deepspeed.accelerator import get_accelerator  # late: DeepSpeed, rank side

    try:
        b = get_accelerator().create_op_builder(name)
    except (AttributeError, ImportError, ValueError):
        return None
    if b is None or type(b).__name__ == "NotImplementedBuilder":
        return None
    return without_debug_info(b)


def release_op_keys(names=OPS) -> dict[str, str]:
    """The content key of each op the installed DeepSpeed offers on the cpu accelerator (ops the
    release lacks are left out); async_io's key includes pin_memory's where the release has it."""
    keys: dict[str, str] = {}
    for name in names:
        b = create_builder(name)
        if b is None:
            continue
        deps = (keys["pin_memory"],) if b.NAME == "async_io" and "pin_memory" in keys else ()
        keys[b.NAME] = builder_key(b, deps)
    return keys


def built_ops_file(ext_dir: Path | None = None) -> Path:
    """Which store build each op of a release's extensions folder was copied from (``{op: {"key",
    "folder"}}``): ranks import the ``.so`` from that store folder, never from the release's own copy."""
    return Path(ext_dir or extensions_dir()) / "built-ops.json"


def read_built_ops(ext_dir: Path | None = None) -> dict[str, dict[str, str]]:
    path = built_ops_file(ext_dir)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}


def _record_built_op(name: str, key: str, folder: Path) -> None:
    path = built_ops_file()
    entries = read_built_ops()
    entries[name] = {"key": key, "folder": str(folder)}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(entries, indent=1, sort_keys=True))
    os.replace(tmp, path)  # a rank reading it sees the old file or the new one


def _copy_into_release(mine: Path, built: Path) -> None:
    """Make the release's extensions folder for one op a private copy of the store's build.

    Why a copy and not a link: any process that loads the op through torch's JIT ``load`` (a user's own
    script, or one that did not preload) rebuilds it in that folder whenever its build file names other
    absolute paths than the ones that built it (another checkout's venv), and the linker rewrites the
    ``.so`` in place: through a link that is the store's file, and every rank importing it meanwhile fails
    with ``invalid ELF header`` (seen in CI). A copy takes the rebuild; the store stays as built."""
    tmp = mine.with_name(f".{mine.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(built, tmp, symlinks=True, ignore=shutil.ignore_patterns("lock"))
    old = mine.with_name(f".{mine.name}.{os.getpid()}.old")
    if mine.is_symlink():
        mine.unlink()
    elif mine.exists():
        os.replace(mine, old)  # a rank that has the old .so open keeps it; a new reader finds the copy below
    os.replace(tmp, mine)
    shutil.rmtree(old, ignore_errors=True)


def _adopt(built: Path, root: Path, name: str) -> None:
    """Copy a build made before the store existed (the release's own folder) into the store, so
    other releases with the same key share it. Copied whole, then renamed in place (atomic)."""
    tmp = op_store() / f".{root.name}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(built, tmp / name, symlinks=True, ignore=shutil.ignore_patterns("lock"))
    try:
        os.replace(tmp, root)
    except OSError:  # another process adopted it first
        shutil.rmtree(tmp, ignore_errors=True)


def ensure_op(name: str, key: str, build) -> str:
    """Make the installed release's op available from the store build of its content key, building it
    only if no release has built this key yet. ``build()`` JIT-builds the op (DeepSpeed's own ``load``)
    with TORCH_EXTENSIONS_DIR pointing at the key's folder. The release's own folder gets a copy of that
    build (``_copy_into_release``) and ``built-ops.json`` names the store folder ranks import from.
    Returns how: "present" (the release's folder already held this key, or a build from before the
    store, adopted into it), "shared" (a build of the same key by another release) or "built"."""
    root = op_build_root(name, key)
    stored = root / name / f"{name}.so"
    mine = extensions_dir() / name
    recorded = read_built_ops().get(name, {}).get("key")
    own_build = (mine / f"{name}.so").exists() and not mine.is_symlink()
    how = "shared"
    if not stored.exists() and own_build and recorded is None:
        op_store().mkdir(parents=True, exist_ok=True)  # built before the store existed: its key is this one
        _adopt(mine, root, name)
        how = "present"
    elif not stored.exists():
        root.mkdir(parents=True, exist_ok=True)
        with environ({"TORCH_EXTENSIONS_DIR": str(root)}):
            build()
        if not stored.exists():
            raise RuntimeError(f"op {name}: DeepSpeed's build left no {stored}")
        how = "built"
    if recorded == key and own_build:
        how = "present" if how == "shared" else how
    else:
        mine.parent.mkdir(parents=True, exist_ok=True)
        _copy_into_release(mine, root / name)
    _record_built_op(name, key, root / name)
    return how


def tree_op_keys(tree: str | Path, python: str | None = None) -> dict[str, str]:
    """The op keys of a DeepSpeed tree that is not installed (an extracted sdist or a source checkout),
    computed in a child interpreter with the tree first on its path (its ``deepspeed`` and ``op_builder``
    are imported, never built)."""
    env = dict(os.environ, **base_env(), PYTHONPATH=os.pathsep.join([str(Path(tree).resolve()), str(PROJECT_ROOT)]))
    code = "import json; from harness.env import buildenv; print(json.dumps(buildenv.release_op_keys()))"
    out = subprocess.run([python or sys.executable, "-c", code], env=env, cwd=str(tree), capture_output=True,
                         text=True, timeout=600)
    if out.returncode:
        raise RuntimeError(f"op keys of {tree}: {out.stderr.strip().splitlines()[-1:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def sharing(keys_by_release: dict[str, dict[str, str]]) -> dict[str, list[list[str]]]:
    """op -> the groups of releases that share one build (each group one key), in release order."""
    out: dict[str, list[list[str]]] = {}
    ops = sorted({op for keys in keys_by_release.values() for op in keys})
    for op in ops:
        groups: dict[str, list[str]] = {}
        for rel, keys in keys_by_release.items():
            if op in keys:
                groups.setdefault(keys[op], []).append(rel)
        out[op] = list(groups.values())
    return out


def main(argv=None) -> int:

    ap = argparse.ArgumentParser(description="op build keys: which DeepSpeed releases share which op builds")
    ap.add_argument("--share", nargs="+", metavar="TREE", required=True,
                    help="extracted DeepSpeed sdists / source checkouts (their version.txt names them)")
    args = ap.parse_args(argv)
    keys = {}
    for tree in args.share:
        label = (Path(tree) / "version.txt").read_text().strip() if (Path(tree) / "version.txt").exists() else tree
        if (Path(tree) / ".git").exists():
            label += " (source checkout)"
        keys[label] = tree_op_keys(tree)
    for op, groups in sharing(keys).items():
        print(f"{op}: {len(groups)} build(s) for {sum(map(len, groups))} release(s): "
              + "; ".join(",".join(g) for g in groups))
    print(json.dumps(keys, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
