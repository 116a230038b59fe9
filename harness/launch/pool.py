"""A pool of CPU ranks kept alive across cases, so a case costs a DeepSpeed engine rather than a
process start, an import of torch and DeepSpeed, and a process-group rendezvous.

Why it looks the way it does:
* ``file://`` rendezvous in a private folder: no ports, so pools in different pytest-xdist workers
  never collide. MASTER_PORT is still set (DeepSpeed's shm comm op names its shared memory after
  it) to a value unique to the pool; nothing listens on it.
* Every rank is the leader of its own session, started with a parent-death signal, and marked with
  ``MUON_HARNESS_POOL`` in its environment: killing the session takes its children (JIT builds,
  helpers) with it, a dying parent takes the ranks with it, and a test can prove from /proc that
  nothing is left behind.
* The parent, not the ranks, decides the outcome of a case. A rank that raises reports its
  traceback and the parent tears the whole pool down, because its peers may be blocked in a
  collective that will never complete. A case that outlives its timeout gets every rank's Python
  stack dumped through faulthandler (SIGUSR1) before the ranks are killed.
* After any failure the pool is discarded; the next case gets a fresh one.
* A rank's messages carry their arrays out of band (``harness.launch.wire``): a trajectory is tens of
  megabytes, and pickling it in band copied it several times on each side.
"""
from __future__ import annotations

import contextlib
import faulthandler
import gc
import importlib
import multiprocessing as mp
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
import uuid
from multiprocessing.connection import Connection, wait
from pathlib import Path

from harness.env import buildenv
from harness.rank import runtime_state
from harness.rank.bootstrap import apply_fault, bootstrap_rank, redirect_output, set_parent_death_signal
from harness.rank.compiled import keep_precompiled_headers
from harness.case.spec import Case
from harness.launch import wire
from harness.launch.launcher import (DEFAULT_ENTRY, CaseFailure, CaseOutcome, CaseTimeout, RankDied, RankFailed,
                                     RankRefused)
from harness.fixes._registry import Refusal
import torch._dynamo
from multiprocessing import resource_tracker

POOL_MARKER = "MUON_HARNESS_POOL"
STARTUP_TIMEOUT_S = float(os.environ.get("MUON_HARNESS_STARTUP_TIMEOUT", "600"))
STACK_DUMP_GRACE_S = 3.0
_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


# --------------------------------------------------------------------------------------------------
# rank side


def _fresh_dynamo() -> None:
    """A compiled case starts from the dynamo state of a fresh process, without paying for one.

    Dynamo keeps, per compiled function, its guards and a recompile counter; past the limit it
    silently runs the function eager, so a long-lived rank would judge later cases on another code
    path. ``torch._dynamo.reset()`` drops both (the frame caches and counters), which is what a
    fresh process has; inductor's compiled kernels stay cached on disk and in memory, keyed by their
    source, so the case pays dynamo's tracing only. ``cases/harness/test_pool.py`` checks that a
    compiled case run after another in the same ranks gives the same bits as in fresh ranks."""

    torch._dynamo.reset()


def _process_name(uid: str) -> str:
    """The name (``/proc/PID/comm``, 15 characters at most) a rank of pool ``uid`` gives itself: a
    forked rank's ``/proc/PID/environ`` is its parent's, so the pool marker cannot be read there."""
    return f"muonr{uid[:10]}"


def _name_process(name: str) -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except OSError:
        pass


def _rank_main(rank: int, world_size: int, pool_dir: str, conn: Connection, env: dict) -> None:
    os.setsid()
    set_parent_death_signal()
    for sig in _STOP_SIGNALS:  # a forked rank must not raise the parent's Interrupted
        signal.signal(sig, signal.SIG_DFL)
    os.environ.update(env)
    _name_process(_process_name(env.get(POOL_MARKER, "")))
    pool = Path(pool_dir)
    redirect_output(pool / f"rank{rank}.log")
    stack_file = open(pool / f"rank{rank}.stack", "w")
    faulthandler.enable(file=stack_file, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True, chain=False)
    compiled = os.environ.get("TORCHDYNAMO_DISABLE") == "0"
    try:
        bootstrap_rank(rank, world_size, init_method=f"file://{pool / 'rendezvous'}")
        if compiled:
            keep_precompiled_headers()  # once per rank: inductor reads the folder at each header build
        wire.send(conn, ("ready", os.getpid()))
    except BaseException:
        wire.send(conn, ("error", traceback.format_exc()))
        return
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg[0] == "stop":
            # Skip interpreter teardown: gloo and DeepSpeed destructors can take seconds or block.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        _, case, workdir, entry = msg
        t0 = time.perf_counter()
        refused = False
        try:
            if compiled:
                _fresh_dynamo()
            apply_fault(case, rank)
            module_name, _, func_name = entry.partition(":")
            func = getattr(importlib.import_module(module_name), func_name)
            result = func(case, rank, world_size, Path(workdir))
            wire.send(conn, ("done", result if rank == 0 else None, time.perf_counter() - t0))
        except Refusal:
            wire.send(conn, ("refused", traceback.format_exc()))
            refused = True
        except BaseException:
            wire.send(conn, ("error", traceback.format_exc()))
            return  # a failed rank never runs another case: its process state is suspect
        if refused:
            # The half-built engine is garbage once its traceback is gone: collected now, or the next
            # case's gc.freeze() (harness.rank.ds_run) would keep it. A case that ran collected its own.
            gc.collect()


# --------------------------------------------------------------------------------------------------
# parent side

_ENV_LOCK = threading.Lock()


@contextlib.contextmanager
def _stop_signals_held():
    """SIGINT and SIGTERM are noted while a rank is started, and acted on after. The command's handler
    (``lifecycle``: raise ``Interrupted``) would otherwise run inside ``os.fork``'s at-fork callbacks,
    where Python prints the exception as ignored and drops it: in the parent a Ctrl-C lost, in the child
    (until ``_rank_main`` sets the default action) a traceback in the command's output. A signal noted
    here goes to the handler it was held from; the child, whose copy notes and drops it, is ended by its
    parent's stop. Only the main thread handles signals (and may set handlers)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    noted: list[int] = []
    saved = {s: signal.getsignal(s) for s in _STOP_SIGNALS}
    for s in saved:
        signal.signal(s, lambda signum, _frame: noted.append(signum))
    try:
        yield
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
        if noted and callable(saved[noted[0]]):
            saved[noted[0]](noted[0], None)
        elif noted and saved[noted[0]] == signal.SIG_DFL:
            os.kill(os.getpid(), noted[0])


@contextlib.contextmanager
def _environ(extra: dict):
    with _ENV_LOCK, buildenv.environ(extra):
        yield


def _fork_is_safe(compiled: bool) -> bool:
    """Whether this process may fork its ranks instead of spawning them.

    A forked rank inherits torch and the harness already imported: a pool starts in ~2 s instead of
    ~11 s (measured here under load, two ranks), which is most of what a crashing case costs (a
    stock DSM-012 conv case discards its pool: 75 of them in ``--full``). Forking is safe only when
    nothing else runs in this process at the fork: no other Python thread (pytest-xdist's execnet
    threads, for one, could hold a lock the child then never sees released) and no OpenMP team
    (``buildenv.apply_base_env`` keeps torch at one thread; a process with more forks no ranks).
    Compiled pools always spawn: ``torch.compile`` reads ``TORCHDYNAMO_DISABLE`` when it is called, and
    DeepSpeed calls it at import for some functions, so a rank forked from a process that imported them
    disabled would run a compiled case eagerly (and the other way round for an eager rank)."""
    if compiled or threading.active_count() != 1:
        return False
    if os.environ.get("OMP_NUM_THREADS") != "1":
        return False
    if "torch" in sys.modules and sys.modules["torch"].get_num_threads() != 1:
        return False
    if os.environ.get("TORCHDYNAMO_DISABLE") != "1":
        # torch.compile reads it when called, and DeepSpeed calls it at import for some functions: a
        # module imported here with dynamo on would be inherited compiled by an eager rank.
        return False
    return True


# What a rank's traceback says when its own collective failed because a peer went away (gloo): a
# consequence, never the cause, whichever reaches the parent first.
PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "remote worker crash", "Broken pipe",
             "Connection refused")


def _peer_lost(traceback_text: str) -> bool:
    return any(s in traceback_text for s in PEER_LOST)


def _root_error(errors: dict[int, str]) -> int:
    """The rank whose error is the cause: the lowest rank that did not just lose a peer."""
    own = [r for r, text in errors.items() if not _peer_lost(text)]
    return min(own) if own else min(errors)


class RankPool:
    # "spawn": every rank a fresh interpreter. harness.selfcheck.source_mutation.zygote sets "fork" in its judging
    # child (torch imported, one thread, DeepSpeed from the mutated copy): a rank then skips torch's import.
    # "auto" (the default): fork where it is safe (``_fork_is_safe``), else spawn.
    START_METHOD = "auto"

    def __init__(self, world_size: int, *, compiled: bool = False, root: Path | None = None):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.compiled = compiled
        self.uid = uuid.uuid4().hex[:12]
        base = root or Path(tempfile.gettempdir())
        base.mkdir(parents=True, exist_ok=True)
        self.dir = Path(tempfile.mkdtemp(prefix=f"muon-pool-ws{world_size}-", dir=base))
        self.cases_run = 0
        self.broken = False
        env = buildenv.base_env()
        env.update({
            POOL_MARKER: self.uid,
            "MASTER_ADDR": "127.0.0.1",
            # Never listened on (the rendezvous is file://); unique so shm names never collide.
            "MASTER_PORT": str(20000 + int(self.uid[:6], 16) % 40000),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
        })
        if compiled:
            env["TORCHDYNAMO_DISABLE"] = "0"
        self.env = env
        self.start_method = self.START_METHOD if self.START_METHOD != "auto" else (
            "fork" if _fork_is_safe(compiled) else "spawn")
        if self.start_method == "fork":
            # the ranks inherit DeepSpeed and what a case imports (``runtime_state.import_case_modules``)
            runtime_state.import_case_modules()
            if self.START_METHOD == "auto" and not _fork_is_safe(compiled):
                self.start_method = "spawn"  # an import started a thread or an OpenMP team
        ctx = mp.get_context(self.start_method)
        # spawn starts a resource tracker with the first process; start it now, before the pool's
        # marker is in the environment, so it is not mistaken for a leftover rank.

        resource_tracker.ensure_running()
        self.procs: list = []
        self.conns: list[Connection] = []
        try:
            for r in range(world_size):
                parent_end, child_end = ctx.Pipe()
                env_r = dict(env, RANK=str(r), LOCAL_RANK=str(r))
                p = ctx.Process(target=_rank_main, args=(r, world_size, str(self.dir), child_end, env_r),
                                name=f"muon-rank{r}", daemon=True)
                # The environment must be in place at exec time: /proc/PID/environ (which the orphan
                # check reads) shows only what the process was started with.
                with _environ(env_r), _stop_signals_held():
                    p.start()
                    child_end.close()
                    self.procs.append(p)  # before a held signal is raised: ``close`` must see this rank
                    self.conns.append(parent_end)
            self._await_ready()
        except BaseException:
            self.close(kill=True)
            raise

    # -- lifecycle ---------------------------------------------------------------------------------
    def _await_ready(self) -> None:
        pending = set(range(self.world_size))
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while pending:
            msgs = self._collect(pending, deadline, case_name="<pool start-up>")
            for r, msg in msgs.items():
                if msg[0] == "error":
                    raise RankFailed("<pool start-up>", r, msg[1])
                pending.discard(r)

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p.pid is not None]

    def close(self, kill: bool = False) -> None:
        if not kill:
            for c in self.conns:
                try:
                    c.send(("stop",))
                except (OSError, BrokenPipeError):
                    kill = True
            for p in self.procs:
                p.join(timeout=10)
                if p.is_alive():
                    kill = True
        if kill:
            for p in self.procs:
                if p.pid is None:
                    continue
                try:
                    os.killpg(p.pid, signal.SIGKILL)  # the rank is its session's leader
                except (ProcessLookupError, PermissionError):
                    pass
            for p in self.procs:
                p.join(timeout=10)
        for c in self.conns:
            c.close()
        self.broken = True
        shutil.rmtree(self.dir, ignore_errors=True)

    # -- running a case ----------------------------------------------------------------------------
    def _collect(self, pending: set[int], deadline: float, case_name: str) -> dict[int, tuple]:
        """Wait for the next message(s) from ``pending`` ranks; raise on death or timeout."""
        conn_rank = {self.conns[r]: r for r in pending}
        sentinel_rank = {self.procs[r].sentinel: r for r in pending}
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError
        ready = wait(list(conn_rank) + list(sentinel_rank), timeout=remaining)
        if not ready:
            raise TimeoutError
        msgs = {}
        for obj in ready:
            if obj in conn_rank:
                r = conn_rank[obj]
                try:
                    msgs[r] = wire.recv(obj)
                except EOFError:
                    pass
        for obj in ready:
            if obj in sentinel_rank and sentinel_rank[obj] not in msgs:
                r = sentinel_rank[obj]
                self.procs[r].join(timeout=1)
                raise RankDied(case_name, r, self.procs[r].exitcode, self.died_tail(r))
        return msgs

    def _later_errors(self, silent: set[int], grace_s: float = 0.5) -> dict[int, str]:
        """The errors ranks of ``silent`` report within ``grace_s`` of another rank's (until each has
        spoken or exited): the rank that raised first and its peers, whose collectives then fail,
        report in a race the parent must not judge by arrival."""
        out: dict[int, str] = {}
        waiting = set(silent)
        deadline = time.monotonic() + grace_s
        while waiting and time.monotonic() < deadline:
            for r in list(waiting):
                try:
                    if self.conns[r].poll():
                        msg = wire.recv(self.conns[r])
                        waiting.discard(r)
                        if msg[0] == "error":
                            out[r] = msg[1]
                        continue
                except (EOFError, OSError):
                    waiting.discard(r)
                    continue
                if self.procs[r].exitcode is not None:
                    waiting.discard(r)
            time.sleep(0.01)
        return out

    def _dead_peer(self, reporter: int, pending: set[int], grace_s: float = 0.3) -> int | None:
        """A rank of ``pending`` (those not heard from yet) other than ``reporter`` that has exited
        without a word (or does within ``grace_s``): a peer that died makes the others' collectives
        fail ("Connection reset by peer"), and which of the two the parent hears of first is a race. A
        peer that reported its own error before exiting (its collective failed because ``reporter``
        raised) is not a death."""
        others = [r for r in pending if r != reporter]
        deadline = time.monotonic() + grace_s
        while others:
            for r in list(others):
                if self.procs[r].exitcode is None:
                    continue
                try:
                    if self.conns[r].poll():
                        wire.recv(self.conns[r])
                        others.remove(r)  # it said something before exiting: not a silent death
                        continue
                except (EOFError, OSError):
                    pass
                return r
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.02)
        return None

    def log_tail(self, rank: int, chars: int = 4000) -> str:
        try:
            text = (self.dir / f"rank{rank}.log").read_text(errors="replace")
        except FileNotFoundError:
            return ""
        return text[-chars:]

    def died_tail(self, rank: int) -> str:
        """A dead rank's log tail, and the Python stack faulthandler wrote when a fatal signal killed it (a C++
        ``assert`` in a DeepSpeed op aborts the rank with no Python traceback in its log: measured, 0.19.3's
        async_io handle), so a crash bug can name the frame it happens in."""
        tail = self.log_tail(rank)
        try:
            stack = (self.dir / f"rank{rank}.stack").read_text(errors="replace")
        except FileNotFoundError:
            stack = ""
        fatal = stack.rfind("Fatal Python error")  # the dump of the signal that killed it, current thread first
        stack = stack[fatal:][:6000] if fatal >= 0 else stack[-4000:]
        return tail + ("\n" + stack if stack.strip() else "")

    def _dump_stacks(self) -> dict[int, str]:
        for p in self.procs:
            if p.is_alive():
                try:
                    os.kill(p.pid, signal.SIGUSR1)
                except ProcessLookupError:
                    pass
        time.sleep(STACK_DUMP_GRACE_S)
        stacks = {}
        for r in range(self.world_size):
            try:
                stacks[r] = (self.dir / f"rank{r}.stack").read_text(errors="replace")
            except FileNotFoundError:
                stacks[r] = ""
        return stacks

    def _raise_refusal(self, case_name: str, results: dict[int, tuple]) -> None:
        """The patched runtime's refusal (``Refusal``) is a case failure; the ranks are kept only when
        every one of them refused (they stopped at the same point, with no collective half done)."""
        refused = sorted(r for r, msg in results.items() if msg[0] == "refused")
        if not refused:
            return
        if len(refused) < self.world_size:
            raise RankFailed(case_name, refused[0], results[refused[0]][1] + "\n(only ranks "
                             f"{refused} refused the case; the others ran it)")
        self.cases_run += 1
        raise RankRefused(case_name, 0, results[0][1])

    def run(self, case: Case, entry: str = DEFAULT_ENTRY) -> CaseOutcome:
        """Run ``entry(case, rank, world_size, workdir)`` on every rank; rank 0's value is the result."""
        if self.broken:
            raise RuntimeError("this pool was discarded after a failure; get a fresh one")
        if case.world_size != self.world_size:
            raise ValueError(f"case {case.name!r} needs {case.world_size} ranks, pool has {self.world_size}")
        workdir = Path(tempfile.mkdtemp(prefix="case-", dir=self.dir))
        t0 = time.perf_counter()
        try:
            for c in self.conns:
                c.send(("run", case, str(workdir), entry))
            pending = set(range(self.world_size))
            results: dict[int, tuple] = {}
            deadline = time.monotonic() + case.timeout_s
            while pending:
                try:
                    msgs = self._collect(pending, deadline, case.name)
                except TimeoutError:
                    stacks = self._dump_stacks()
                    self.close(kill=True)
                    raise CaseTimeout(case.name, case.timeout_s, stacks) from None
                errors = {r: msg[1] for r, msg in msgs.items() if msg[0] == "error"}
                if errors:
                    silent = pending - set(msgs)  # those in msgs have spoken
                    errors.update(self._later_errors(silent))
                    root = _root_error(errors)
                    if _peer_lost(errors[root]):
                        dead = self._dead_peer(root, silent - set(errors))
                        if dead is not None:  # the root cause: the peer's error is its broken connection
                            code, tail = self.procs[dead].exitcode, self.died_tail(dead)
                            self.close(kill=True)
                            raise RankDied(case.name, dead, code, tail)
                    self.close(kill=True)
                    raise RankFailed(case.name, root, errors[root])
                for r, msg in msgs.items():
                    results[r] = msg
                    pending.discard(r)
            self._raise_refusal(case.name, results)
            self.cases_run += 1
            return CaseOutcome(result=results[0][1], seconds=time.perf_counter() - t0,
                               rank_seconds=[results[r][2] for r in range(self.world_size)])
        except RankRefused:
            raise  # every rank refused and is ready for the next case
        except CaseFailure:
            self.close(kill=True)
            raise
        except BaseException:
            self.close(kill=True)
            raise
        finally:
            shutil.rmtree(workdir, ignore_errors=True)


# --------------------------------------------------------------------------------------------------
# the per-process registry the pytest fixture and the CLI use


class PoolManager:
    """Keeps one live pool per (world size, compiled) in this process; replaces broken ones.

    Compiled pools are reused like the others: each compiled case resets dynamo in its ranks first
    (``_fresh_dynamo``), which is what fresh ranks gave it at ~5 s of start-up per case.
    """

    def __init__(self, root: Path | None = None):
        self.root = root
        self.pools: dict[tuple[int, bool], RankPool] = {}

    def run(self, case: Case, entry: str = DEFAULT_ENTRY) -> CaseOutcome:
        key = (case.world_size, case.compiled)
        pool = self.pools.get(key)
        if pool is None or pool.broken:
            pool = self.pools[key] = RankPool(case.world_size, compiled=case.compiled, root=self.root)
        try:
            return pool.run(case, entry)
        finally:
            if pool.broken:
                self.pools.pop(key, None)

    def close(self, kill: bool = False) -> None:
        """``kill``: the command is being stopped; do not wait for ranks to finish a case."""
        for pool in self.pools.values():
            if not pool.broken:
                pool.close(kill=kill)
        self.pools.clear()


def marked_processes(marker: str | None = None) -> list[int]:
    """PIDs whose environment carries the pool marker (any pool, or one pool's uid), or that are
    named as a pool's rank (``_process_name``: a forked rank, whose environ is its parent's)."""
    prefix = POOL_MARKER.encode() + b"="
    found = []
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{entry}/comm") as f:
                comm = f.read().strip()
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, PermissionError, ProcessLookupError):
            continue
        if marker is None:
            marked = any(kv.startswith(prefix) for kv in env) or (comm.startswith("muonr") and len(comm) == 15)
        else:
            marked = prefix + marker.encode() in env or comm == _process_name(marker)
        if marked and state != "Z":  # a zombie keeps its environ readable only until reaped
            found.append(int(entry))
    return found
