"""Pay DeepSpeed's one-off costs once, outside any test timeout.

Cold JIT builds of cpu_adam, fused_adam, async_io and the shm comm op cost ~12 CPU-minutes on this
machine, and the first torch.compile of ``muon_update`` ~40 CPU-s. A test that paid either would
blow its per-case timeout, so the set-up script runs ``python -m harness.launch.warmup`` and every later
process only loads from the project's own cache (see ``harness.env.buildenv``).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

from harness.env import buildenv
from harness.rank import runtime_state
from harness.rank import compiled

OPS = buildenv.OPS
OPTIONAL = ("PinMemoryBuilder",)  # a cpu builder only from 0.19.5 (async_io resolves symbols from it there)
STALE_LOCK_AGE_S = 20 * 60
# Two build lanes of about equal cold cost, async_io after pin_memory, whose build it loads; the compile
# cache goes with the second lane. With async_io's precompiled header, shm comm belongs in the first:
# on a fresh container the lanes then ended 12 s apart (docs/measurements.md, the fresh-container row).
LANES = (("PinMemoryBuilder", "AsyncIOBuilder", "ShareMemCommBuilder"), ("CPUAdamBuilder", "FusedAdamBuilder"))
LANE_MEMORY_GIB = 3.0  # memory a lane may need: ninja runs a few compilers, each holding torch's headers


def fill_cpuinfo_cache() -> dict:
    """Probe the CPU once (py-cpuinfo starts a subprocess, ~1.1 s) and store the answer for the ranks;
    this process then serves it from memory too: each op's key asks twice (``cxx_args``: ``cpu_arch``
    and ``simd_width``), which was ~4.5 s of a warm lane that only found its ops present."""
    path = buildenv.cpuinfo_cache()
    path.parent.mkdir(parents=True, exist_ok=True)
    import cpuinfo  # late: only when the machine is described

    info = cpuinfo.get_cpu_info()
    # written whole under another name, then renamed: the other lane (and any rank) reads it meanwhile,
    # and a file truncated for writing read as empty JSON and failed that lane's set-up
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(info))
    os.replace(tmp, path)
    runtime_state.install_cpuinfo_cache()
    return info


HEARTBEAT_S = 15.0


def _say(msg: str) -> None:
    print(msg, flush=True)


@contextlib.contextmanager
def heartbeat(what: str, say=_say, every_s: float = HEARTBEAT_S):
    """A line every ``every_s`` while ``what`` runs: a cold async_io build is minutes without output of
    its own, which reads as a hung set-up."""
    done = threading.Event()
    t0 = time.perf_counter()

    def beat() -> None:
        while not done.wait(every_s):
            say(f"warmup: {what} still running, {time.perf_counter() - t0:.0f}s")

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def build_ops(names=OPS, say=_say) -> dict[str, float]:
    """Build (or load from the cache) each op in turn, saying which one before it starts and how long
    it took when done: a cold build is minutes of silence otherwise.

    Each op is built once per content key (``harness.env.buildenv.ensure_op``): a release whose op sources
    and flags match another's links to that build instead of rebuilding it. Ranks import the ``.so``
    directly (``harness.rank.runtime_state.preload_built_ops``): a JIT load would rebuild it whenever the
    build file names other absolute paths than the ones that built it."""
    seconds = {}
    keys: dict[str, str] = {}
    for name in names:
        say(f"warmup: op {name} ...")
        t0 = time.perf_counter()
        builder = buildenv.create_builder(name)
        if builder is None and name in OPTIONAL:
            say(f"warmup: op {name}: not in this DeepSpeed release (skipped)")
            continue
        if builder is None:
            raise RuntimeError(f"DeepSpeed's cpu accelerator has no op builder {name}")
        if not builder.is_compatible(verbose=True):
            hint = " (install Debian's libaio-dev)" if name == "AsyncIOBuilder" else ""
            raise RuntimeError(f"op {builder.NAME} is not compatible with this machine{hint}")
        deps = (keys["pin_memory"],) if builder.NAME == "async_io" and "pin_memory" in keys else ()
        keys[builder.NAME] = key = buildenv.builder_key(builder, deps)
        if deps:
            # async_io's load() loads pin_memory first; have it in memory so the build does not rebuild it.
            # pin_memory alone: an async_io recorded under an older key (a cache from before a key change)
            # would sit in DeepSpeed's op cache, and load() would return it without building this key.
            runtime_state.preload_built_ops(only=("PinMemoryBuilder",))
        with heartbeat(f"op {builder.NAME}", say):
            how = buildenv.ensure_op(builder.NAME, key, lambda b=builder, k=key: _build(b, k))
        seconds[builder.NAME] = time.perf_counter() - t0
        say(f"warmup: op {builder.NAME} ready in {seconds[builder.NAME]:.1f}s ({how}, key {key})")
    return seconds


def _build(builder, key: str):
    """DeepSpeed's own JIT build of the op, torch's header precompiled where the op has many units."""
    with buildenv.precompiled_header(builder, buildenv.op_build_root(builder.NAME, key)):
        return builder.load(verbose=False)


TORCH_OWN = (FutureWarning, DeprecationWarning)  # torch deprecating its own helpers to itself


def fill_compile_cache(say=_say) -> float:
    """Compile muon_update once so the compiled subset of cases reads inductor's on-disk cache. torch's
    own deprecation warnings (``TORCH_OWN`` raised from a file inside torch: inductor's lowering calls a
    deprecated torch helper, a dozen identical blocks per fill, and ``torch.jit.script_method`` warns
    from torch's own jit module) are not the user's business: counted and named in one line; any other
    warning is shown as it is."""
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled.warm_compiled_muon_update()
    torch_own = [w for w in caught if issubclass(w.category, TORCH_OWN) and "/torch/" in w.filename]
    for w in caught:
        if w not in torch_own:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    if torch_own:
        where = sorted({f"{w.category.__name__} {Path(w.filename).name}:{w.lineno}" for w in torch_own})
        say(f"warmup: {len(torch_own)} deprecation warning(s) raised inside torch itself filtered ({', '.join(where)})")
    return time.perf_counter() - t0


def ensure_compile_cache(say=_say) -> str:
    """Fill the compile cache unless a warm-up of the same key already did (``compiled.warm_stamp``):
    refilling a full cache traced every graph again, ~7 s of every later set-up for nothing.
    Returns how: "present" or "filled"."""
    key = compiled.warm_key()
    stamp = compiled.warm_stamp(key)
    if stamp.exists():
        say(f"warmup: torch.compile cache for muon_update present (key {key})")
        return "present"
    say("warmup: torch.compile cache for muon_update ...")
    with heartbeat("the torch.compile cache", say):
        seconds = fill_compile_cache(say)
    stamp.parent.mkdir(parents=True, exist_ok=True)
    stamp.touch()
    say(f"warmup: torch.compile cache for muon_update filled in {seconds:.1f}s (key {key})")
    return "filled"


def lanes_fit() -> int:
    """How many build lanes this machine runs side by side: one per core, as memory allows, at most
    ``len(LANES)``."""
    try:
        avail_gib = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
    except (ValueError, OSError):
        avail_gib = 0.0
    return max(1, min(len(LANES), os.cpu_count() or 1, int(avail_gib // LANE_MEMORY_GIB)))


def build_in_lanes(skip_compile: bool) -> int:
    """The default warm-up as ``LANES`` in parallel processes (each this module with ``--ops``), the
    compile cache in the second. Each lane prints its own lines (with their heartbeat); the first
    failure's exit status is returned after every lane has ended."""
    t0 = time.perf_counter()
    procs = []
    for i, lane in enumerate(LANES):
        cmd = [sys.executable, "-m", "harness.launch.warmup", "--ops", ",".join(lane), "--lane"]
        cmd += ["--skip-compile"] if skip_compile or i == 0 else []
        procs.append(subprocess.Popen(cmd))
    try:
        codes = [p.wait() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    bad = next((c for c in codes if c), 0)
    _say(f"warmup: {len(LANES)} lanes done in {time.perf_counter() - t0:.1f}s" + (f" (exit {bad})" if bad else ""))
    return bad


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--skip-compile", action="store_true", help="do not fill the torch.compile cache")
    ap.add_argument("--ops", default=os.environ.get("MUON_HARNESS_OPS", ",".join(OPS)),
                    help="comma-separated op builders to build (default: MUON_HARNESS_OPS, else all)")
    ap.add_argument("--lane", action="store_true", help=argparse.SUPPRESS)  # one lane of build_in_lanes
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    buildenv.apply_base_env({"TORCHDYNAMO_DISABLE": "0"})
    # A lock is stale once it is older than any build here takes (cold async_io: ~7 min wall on 2
    # cores); a younger one may belong to a live build or load in another process, and removing it
    # breaks that process (seen: FileNotFoundError on .../cpu_adam/lock), so it is waited for.
    removed = buildenv.clear_stale_locks(max_age_s=STALE_LOCK_AGE_S)
    for lock in removed:
        print(f"warmup: removed stale build lock {lock}")
    fill_cpuinfo_cache()
    if args.ops == ",".join(OPS) and not args.lane and lanes_fit() > 1:
        return build_in_lanes(args.skip_compile)
    ops = build_ops(tuple(o for o in args.ops.split(",") if o)) if args.ops != ",".join(OPS) else build_ops()
    if not args.skip_compile:
        ensure_compile_cache()
    _say(f"warmup: done in {time.perf_counter() - t0:.1f}s ({len(ops)} ops: {sum(ops.values()):.1f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
