"""``python -m harness gate --jobs N``: the gate as N local shards run side by side, one report.

Why it looks the way it does: a gate case spends most of its time in one process at a time. The
ranks run the steps while the parent waits; then the parent replays the float64 oracle while the
ranks wait (the judge is ~60% of a synthetic case and ~80% of a real-model case). One gate
therefore keeps about one core busy, whatever the machine has. Running the gate's cost-balanced
shards (``harness.launch.shard``) as N processes overlaps one shard's judge with another's ranks.
Processes, not threads: the judge is Python-heavy and would serialise on the GIL.

Each shard is the ordinary ``gate --shard K/N`` command (its own rank pools, the patched mutation
self-check on shard 1 and the stock one on shard 2), writing into the one results folder under its own
writer name (``harness.report.results``), so a local run and N CI machines split the same way and a
stopped run leaves one folder to resume. Each shard leads its own session, so a Ctrl-C at the terminal
reaches the parent only, which stops the shards with SIGTERM and reports once; a shard also gets SIGTERM
when the parent dies (a parent-death signal), and the command's reaper (``harness.launch.lifecycle``)
ends anything left.
"""
from __future__ import annotations

import signal
import subprocess
import sys
import time

from harness.launch.lifecycle import Interrupted, set_parent_death_signal

STOP_GRACE_S = 10.0


PROGRESS_EVERY_S = 2.0


def run_shards(n: int, shard_args: list[list[str]], progress=None) -> tuple[list[int], float, Interrupted | None]:
    """Run ``python -m harness gate ARGS`` for each of the ``n`` argument lists at once.

    Returns the shards' exit codes, the wall seconds, and the signal that stopped the run (None when
    it ran to the end). Their output goes to this process's stdout as it comes; ``progress`` (if
    given) is called every ``PROGRESS_EVERY_S`` while they run, to report on all of them at once."""
    assert len(shard_args) == n
    procs: list[subprocess.Popen] = []
    t0 = time.perf_counter()
    stopped = None
    try:
        for args in shard_args:
            procs.append(subprocess.Popen([sys.executable, "-m", "harness", "gate", *args], start_new_session=True,
                                          preexec_fn=set_parent_death_signal))
        while any(p.poll() is None for p in procs):
            time.sleep(PROGRESS_EVERY_S)
            if progress is not None:
                progress()
        codes = [p.wait() for p in procs]
    except Interrupted as exc:
        stopped = exc
        codes = _stop(procs)
    except BaseException:
        _stop(procs)
        raise
    return codes, time.perf_counter() - t0, stopped


def _stop(procs: list[subprocess.Popen]) -> list[int]:
    """SIGTERM to every shard still running (each writes down what it judged), SIGKILL after the grace."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    return [p.returncode for p in procs]
