"""The launcher's promises: reuse, isolation after failure, no hangs, no orphans.

Each failure test would catch a specific launcher bug: a pool reused after a crash (the next case
would see a half-dead process group), a parent that waits on a blocked peer forever, a kill that
misses grandchildren, a traceback that loses the rank number.
"""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.catalog.matrix import gate_cases
from harness.env import buildenv
from harness.fixes._registry import Refusal
from harness.launch.pool import CaseTimeout, RankDied, RankFailed, RankPool, RankRefused, marked_processes
from harness.case.scenarios import pipeline_case

pytestmark = pytest.mark.pipeline


def _wait_gone(pids, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in pids if p in set(marked_processes())]
        if not alive:
            return []
        time.sleep(0.2)
    return alive


def _pool_pids(manager, ws):
    pool = manager.pools.get((ws, False))
    return pool.pids() if pool else []


def _pool_uid(manager, ws):
    """The marker value of this process's pool: other pytest-xdist workers start pools of their own
    at any time, so process-table checks look only for this pool's marker."""
    return manager.pools[(ws, False)].uid


def _wait_marker_gone(uid, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = marked_processes(uid)
        if not left:
            return []
        time.sleep(0.2)
    return marked_processes(uid)


def test_pool_is_reused_across_cases(pool_manager):
    a = pool_manager.run(pipeline_case(1, world_size=2, steps=1))
    pids = _pool_pids(pool_manager, 2)
    b = pool_manager.run(pipeline_case(2, world_size=2, steps=1, seed=1))
    assert _pool_pids(pool_manager, 2) == pids, "a healthy pool must be reused, not restarted"
    assert a.result is not None and b.result is not None
    assert len(a.result.steps) == 1 and len(b.result.steps) == 1


def test_raising_rank_names_itself_and_pool_recovers(pool_manager):
    pool_manager.run(pipeline_case(1, world_size=2, steps=1))  # make sure a pool is up
    old = _pool_pids(pool_manager, 2)
    uid = _pool_uid(pool_manager, 2)
    assert sorted(marked_processes(uid)) == sorted(old)
    with pytest.raises(RankFailed) as err:
        pool_manager.run(pipeline_case(1, world_size=2, steps=1).replace(fault="raise:1"))
    assert err.value.rank == 1
    assert "injected fault on rank 1" in str(err.value)
    assert "Traceback" in str(err.value)
    # The peer (rank 0) was inside deepspeed.initialize's collectives; it must be gone too.
    assert _wait_gone(old) == []
    assert _wait_marker_gone(uid) == []
    after = pool_manager.run(pipeline_case(1, world_size=2, steps=1))
    assert after.result is not None and len(after.result.steps) == 1
    assert set(_pool_pids(pool_manager, 2)).isdisjoint(old), "the broken pool must have been replaced"


def test_a_case_every_rank_refuses_keeps_the_ranks_and_the_next_case_runs_as_in_fresh_ranks(pool_manager):
    """The patched runtime refuses ZeRO-1 with NVMe offload on every rank inside ``deepspeed.initialize``
    (``harness.fixes.z12``): a case failure naming the refusal, and the same ranks run the next case to
    the bits fresh ranks give (a restart per refusal was 99 in ``--full``)."""
    pool_manager.run(pipeline_case(1, world_size=2, steps=1))
    pids = _pool_pids(pool_manager, 2)
    with pytest.raises(RankRefused) as err:
        pool_manager.run(pipeline_case(1, "nvme", "fp32", 2, steps=1).replace(patched=True))
    assert "do not implement NVMe optimizer offload" in err.value.details and "Traceback" in err.value.details
    after = pool_manager.run(pipeline_case(2, "none", "fp16", 2, steps=2, seed=3))
    assert _pool_pids(pool_manager, 2) == pids, "ranks that all refused must be kept"
    fresh = RankPool(2)
    try:
        alone = fresh.run(pipeline_case(2, "none", "fp16", 2, steps=2, seed=3))
    finally:
        fresh.close()
    assert after.result.fingerprint() == alone.result.fingerprint()


def refuse_on_rank_1(case, rank, world_size, workdir):
    """Rank entry for the test below: one rank refuses, the other completes."""
    if rank == 1:
        raise Refusal("declined on rank 1 only")
    return None


def test_a_refusal_on_some_ranks_only_is_a_failure_and_the_pool_is_replaced(pool_manager):
    pool_manager.run(pipeline_case(1, world_size=2, steps=1))
    pids = _pool_pids(pool_manager, 2)
    with pytest.raises(RankFailed) as err:
        pool_manager.run(pipeline_case(1, world_size=2, steps=1), f"{__name__}:refuse_on_rank_1")
    assert not isinstance(err.value, RankRefused) and "only ranks [1] refused" in err.value.details
    assert _wait_gone(pids) == []
    pool_manager.run(pipeline_case(1, world_size=2, steps=1))
    assert set(_pool_pids(pool_manager, 2)).isdisjoint(pids)


def test_dying_rank_is_reported_with_exit_code(pool_manager):
    with pytest.raises(RankDied) as err:
        pool_manager.run(pipeline_case(1, world_size=2, steps=1).replace(fault="exit:0"))
    assert err.value.rank == 0 and err.value.exitcode == 17
    assert pool_manager.run(pipeline_case(1, world_size=2, steps=1)).result is not None


def test_aborted_rank_is_reported_with_its_python_stack(pool_manager):
    """A rank killed by a fatal signal (a C++ assert in a DeepSpeed op) leaves no traceback in its log; the
    report carries the stack faulthandler wrote, so a crash bug can name its frame."""
    with pytest.raises(RankDied) as err:
        pool_manager.run(pipeline_case(1, world_size=2, steps=1).replace(fault="abort:1"))
    assert err.value.rank == 1 and err.value.exitcode == -6
    assert "Fatal Python error: Aborted" in str(err.value) and "in apply_fault" in str(err.value)
    assert pool_manager.run(pipeline_case(1, world_size=2, steps=1)).result is not None


def test_hung_rank_times_out_with_stacks_and_leaves_nothing(pool_manager):
    pool_manager.run(pipeline_case(1, world_size=2, steps=1))  # make sure a pool is up
    uid = _pool_uid(pool_manager, 2)
    case = pipeline_case(1, world_size=2, steps=1).replace(fault="spawn-child:0", timeout_s=8.0)
    t0 = time.monotonic()
    with pytest.raises(CaseTimeout) as err:
        pool_manager.run(case)
    assert time.monotonic() - t0 < 8.0 + 30.0, "the timeout must bound the case"
    stacks = err.value.stacks
    assert set(stacks) == {0, 1}
    assert "apply_fault" in stacks[0], stacks[0]
    # Rank 1 is blocked in DeepSpeed's start-up collectives waiting for rank 0: its stack shows it.
    assert "Thread" in stacks[1] or "File" in stacks[1]
    # The grandchild rank 0 started carries the pool marker; a session kill must reap it too.
    leftover = _wait_marker_gone(uid)
    assert not leftover, f"processes left behind: {leftover}"
    assert pool_manager.run(pipeline_case(1, world_size=2, steps=1)).result is not None


def test_world_sizes_one_to_four(pool_manager):
    for ws in (1, 3, 4):
        out = pool_manager.run(pipeline_case(2, world_size=ws, steps=1))
        assert len(out.result.steps) == 1
        assert len(out.rank_seconds) == ws


def test_no_orphans_after_close(tmp_path):
    from harness.launch.pool import PoolManager

    manager = PoolManager(root=tmp_path)
    manager.run(pipeline_case(1, world_size=2, steps=1))
    pids = _pool_pids(manager, 2)
    assert pids and all(p in set(marked_processes()) for p in pids)
    manager.close()
    assert _wait_gone(pids) == []
    assert not list(tmp_path.iterdir()), "pool folders must be removed"



def run_with_one_compile_allowed(case, rank, world_size, workdir):
    """Rank entry for the test below: dynamo may compile each function once, so a function left
    compiled by an earlier case (for other dtypes) silently falls back to eager in the next one."""
    import torch._dynamo

    from harness.rank.ds_run import run_case_on_rank

    torch._dynamo.config.recompile_limit = 1
    return run_case_on_rank(case, rank, world_size, workdir)


def test_a_compiled_case_in_reused_ranks_gives_the_bits_of_fresh_ranks():
    """Compiled pools are reused, each compiled case resetting dynamo first (``pool._fresh_dynamo``).
    With the recompile limit at 1, ranks that kept the first case's compiled graphs (other dtypes)
    would run the second case's ``muon_update`` eager, and the compiled 16-bit path rounds
    differently from eager: its bits would differ from the same case in fresh ranks."""
    from harness.launch.pool import PoolManager, RankPool

    entry = f"{__name__}:run_with_one_compile_allowed"
    cases = {c.name: c for c in gate_cases(False) if c.compiled}
    first, second = cases["z1-none-bf16-ws2-compiled-exact"], cases["z3-none-fp16-ws2-compiled-hpns"]
    manager = PoolManager()
    try:
        manager.run(first, entry)
        pool = manager.pools[(2, True)]
        reused = manager.run(second, entry).result
        assert manager.pools[(2, True)] is pool  # really the same ranks
    finally:
        manager.close()
    fresh_pool = RankPool(2, compiled=True)
    try:
        fresh = fresh_pool.run(second, entry).result
    finally:
        fresh_pool.close()
    assert reused.fingerprint() == fresh.fingerprint()


def run_and_name_the_precompiled_headers(case, rank, world_size, workdir):
    """Rank entry for the test below: the case, and the precompiled headers its compiles used."""
    import torch._inductor.codecache as codecache

    from harness.rank.ds_run import run_case_on_rank

    used, real = [], codecache._precompile_header

    def recorded(*args, **kwargs):
        used.append(real(*args, **kwargs))
        return used[-1]

    codecache._precompile_header = recorded
    try:
        run_case_on_rank(case, rank, world_size, workdir)
    finally:
        codecache._precompile_header = real
    return used


def test_a_compiled_rank_keeps_inductors_precompiled_header_beside_the_compile_cache(tmp_path, monkeypatch):
    """inductor puts its precompiled header under ``tempfile.gettempdir()``, which in a rank is the
    run's scratch folder: every run compiled the header again before its first compiled case. A
    compiled rank's compiles use one kept beside the compile cache (``compiled.keep_precompiled_headers``)."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))  # what a spawned rank reads its temporary folder from
    case = next(c for c in gate_cases(False) if c.compiled)
    pool = RankPool(case.world_size, compiled=True, root=tmp_path / "pools")
    try:
        used = pool.run(case, f"{__name__}:run_and_name_the_precompiled_headers").result
    finally:
        pool.close()
    kept = Path(buildenv.base_env()["TORCHINDUCTOR_CACHE_DIR"]) / "precompiled_headers"
    assert used, "the compiles used no precompiled header (torch's default is to use one)"
    assert all(Path(h).parent == kept for h in used), f"precompiled headers outside {kept}: {used}"
    assert not list(scratch.rglob("precompiled_headers")), "a precompiled header was built in the scratch folder"


def test_forked_ranks_give_the_same_bits_and_leave_nothing(tmp_path, monkeypatch):
    """Forked ranks (torch inherited; what a single-threaded gate process uses) run a case to the same
    bits as spawned ones, are found by their pool's name although their environ is the parent's, and
    are gone after close."""
    import numpy as np

    from harness.launch.pool import RankPool

    case = pipeline_case(2, "none", "bf16", 2, steps=2)
    out = {}
    for method in ("spawn", "fork"):
        monkeypatch.setattr(RankPool, "START_METHOD", method)
        pool = RankPool(2, root=tmp_path)
        try:
            assert pool.start_method == method
            assert sorted(marked_processes(pool.uid)) == sorted(pool.pids())
            out[method] = pool.run(case).result
        finally:
            pool.close()
        assert _wait_marker_gone(pool.uid) == []
    for a, b in zip(out["spawn"].steps, out["fork"].steps):
        for n, ps in a.params.items():
            assert np.array_equal(ps.master, b.params[n].master) and np.array_equal(ps.update, b.params[n].update)


def test_fork_only_where_nothing_else_runs(monkeypatch):
    """Another thread (pytest-xdist's execnet has some) or a compiled pool means spawn."""
    import threading

    from harness.launch import pool as pool_mod

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert pool_mod._fork_is_safe(compiled=True) is False
    if threading.active_count() == 1:
        assert pool_mod._fork_is_safe(compiled=False) is True
    stop = threading.Event()
    t = threading.Thread(target=stop.wait)
    t.start()
    try:
        assert pool_mod._fork_is_safe(compiled=False) is False
    finally:
        stop.set()
        t.join()
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert pool_mod._fork_is_safe(compiled=False) is False
    # a parent whose modules may have been imported with dynamo on never forks eager ranks
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "0")
    assert pool_mod._fork_is_safe(compiled=False) is False


_RANK_START = """
import subprocess, sys
from harness.env import buildenv
buildenv.apply_base_env()
from harness.rank import runtime_state
runtime_state.import_case_modules()  # what a forking parent does before its first pool
started = []
real_init = subprocess.Popen.__init__
def record(self, args, *a, **k):
    started.append(args)
    real_init(self, args, *a, **k)
subprocess.Popen.__init__ = record
before = set(sys.modules)
import deepspeed.ops
deepspeed.ops.__compatible_ops__  # what DeepSpeed's comm backend reads when a rank joins
import torch.utils.cpp_extension  # what preload_built_ops loads the ops with
new = sorted(m for m in set(sys.modules) - before if m.split(".")[0] == "setuptools")
assert not started, f"a forked rank would start: {started}"
assert not new, f"a forked rank would import: {new[:5]}"
import inspect
from harness import fixes
from harness.env import tree
def again(*a, **k):
    raise AssertionError("computed again in a forked rank")
inspect.getsource = tree.probe_all = again  # DeepSpeed's sources read back: the guard's hashes, the probes
tree.capabilities()  # what the capture's adapter reads
if deepspeed.__version__ == fixes.EXPECTED_DEEPSPEED:
    fixes.apply()  # the guard hashes every function it replaces
    fixes.remove()
"""


def test_a_forked_rank_starts_without_a_compiler_setuptools_or_reading_deepspeeds_sources():
    """What a rank needs at start-up is computed once in the parent that forks it: DeepSpeed's table
    of compatible ops (its probe compiles and links a test program), torch's extension loader (it
    imports setuptools), the installed tree's capabilities and the patched runtime's source hashes
    (both read DeepSpeed's sources back). Every rank of every pool used to pay them."""
    done = subprocess.run([sys.executable, "-c", _RANK_START], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_cause_is_the_rank_that_did_not_just_lose_a_peer():
    """Which rank's error reaches the parent first is a race once ranks start fast (a raise on rank 1
    makes rank 0's collective fail at once): the verdict names the rank whose error is its own."""
    from harness.launch.pool import _root_error

    lost = "Traceback ...\nRuntimeError: [gloo] Connection closed by peer [127.0.0.1]:1234"
    own = "Traceback ...\nRuntimeError: injected fault on rank 2"
    assert _root_error({0: lost, 2: own, 1: lost}) == 2
    assert _root_error({1: own, 0: own}) == 0
    assert _root_error({2: lost, 1: lost}) == 1  # nothing but lost peers: the lowest (a silent death is checked apart)


# A signal that lands while a rank is forked: os.register_at_fork puts it exactly there, in the parent's
# callbacks after the fork or in the child's, where Python would print the command's Interrupted as
# "Exception ignored" and drop it.
_SIGNAL_IN_FORK = """
import os, signal, sys
from harness.launch import lifecycle
from harness.launch.pool import RankPool

RankPool.START_METHOD = "fork"  # at-fork callbacks run for os.fork only
with lifecycle.command_scope():
    side = sys.argv[1]
    hook = lambda: os.kill(os.getpid(), signal.SIGINT)
    os.register_at_fork(**{"after_in_parent" if side == "parent" else "after_in_child": hook})
    try:
        pool = RankPool(1)
    except lifecycle.Interrupted:
        print("interrupted", flush=True)
        sys.exit(130)
    print("ready", flush=True)
    pool.close(kill=True)
"""


@pytest.mark.parametrize("side", ["parent", "child"])
def test_a_signal_during_a_ranks_fork_is_neither_dropped_nor_a_traceback(side):
    """The parent's Ctrl-C stops the command once the rank is started (and the rank is ended with the
    pool); the child's copy of the handler never prints the parent's exception."""
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", _SIGNAL_IN_FORK, side], cwd=root, capture_output=True, text=True,
                          timeout=600)
    out = proc.stdout + proc.stderr
    assert "Exception ignored" not in out and "Traceback" not in out, out[-3000:]
    if side == "parent":
        assert proc.returncode == 130 and "interrupted" in proc.stdout, out[-3000:]
    else:
        assert proc.returncode == 0 and "ready" in proc.stdout, out[-3000:]
