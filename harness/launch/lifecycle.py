"""Every process a harness command starts ends with the command, whatever ends it, and the command's
scratch folder goes with them.

Why it looks the way it does:
* Each command gets a run id. Every process it starts carries ``MUON_HARNESS_RUN=<id>`` in the
  environment it was exec'd with (shards, spawned and torchrun ranks, the compilers and inductor
  workers those start), which /proc shows. A forked rank shows its parent's initial environment
  instead, so the reaper also records the command's descendants while they live.
* The reaper is a small stdlib-only process in a session of its own: a signal to the command's
  process group (a CI job cancelled, Ctrl-C) does not reach it. It holds the read end of a pipe
  whose write end only the command has; the pipe closes when the command ends, by exit, exception
  or SIGKILL alike. It then terminates what is left, kills it after a grace, and removes the
  scratch folder.
* The scratch folder is the TMPDIR of the command and its children (rank pools, NVMe swap folders,
  checkpoints, torch's own temporary folders), named ``muon-run-<id>`` with an ``owner`` file (pid and
  start time), so the next command tells a dead owner's folder from a live one and cleans it.
* SIGTERM and SIGINT become :class:`Interrupted` in the main thread, so a command unwinds through its
  ``finally`` blocks (pools closed, results kept, the run marked incomplete) and exits 128 + the
  signal number with a summary instead of a traceback. A second signal ends it at once; the reaper
  still cleans up.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from harness.env import buildenv

RUN_MARKER = "MUON_HARNESS_RUN"
SCRATCH_PREFIX = "muon-run-"
TERM_GRACE_S = 2.0
SNAPSHOT_EVERY_S = 0.5


class Interrupted(BaseException):
    """The command was asked to stop (SIGTERM, SIGINT); not an ``Exception`` so no handler of a case's
    failure swallows it."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


# --------------------------------------------------------------------------------------------------
# /proc readings


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks (field 22 of /proc/PID/stat): with the pid, an identity
    that a reused pid does not share."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return None if fields[0] == "Z" else int(fields[19])


def _parents() -> dict[int, int]:
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                out[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (FileNotFoundError, ProcessLookupError, PermissionError, IndexError, ValueError):
            continue
    return out


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for child, parent in _parents().items():
        children.setdefault(parent, []).append(child)
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def env_values(name: str):
    """(pid, value) of ``name`` in the exec environment of every live process but this one: the one scan
    of /proc environments (this run's marker, the torchrun launcher's)."""
    prefix = f"{name}=".encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                values = [kv[len(prefix):] for kv in f.read().split(b"\0") if kv.startswith(prefix)]
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if values and start_time(int(entry)) is not None:
            yield int(entry), values[0].decode(errors="replace")


def marked(run_id: str) -> list[int]:
    """Live processes whose exec environment carries this run's id. The marker is the path of run ids
    from the outermost command down (``<gate>/<shard>``): a shard's reaper ends its own processes, never
    a sibling shard's, and the outer command's reaper ends them all."""
    return [pid for pid, value in env_values(RUN_MARKER) if run_id in value.split("/")]


def survivors(run_id: str, *, group: int | None = None, parent: int | None = None) -> list[int]:
    """Live processes of a run: carrying its id, in process group ``group``, or children of ``parent``
    (the three ways a leftover can be found; a fault test asks for all of them)."""
    found = set(marked(run_id))
    for pid, ppid in _parents().items():
        if start_time(pid) is None or pid == os.getpid():
            continue
        with contextlib.suppress(ProcessLookupError):
            if (group is not None and os.getpgid(pid) == group) or (parent is not None and ppid == parent):
                found.add(pid)
    return sorted(found)


def run_id_of(scratch: Path) -> str:
    """The run id in a scratch folder's name (``muon-run-<id>-<random>``)."""
    return Path(scratch).name[len(SCRATCH_PREFIX):].split("-")[0]


# --------------------------------------------------------------------------------------------------
# ending processes


def _signal_all(targets: dict[int, int], sig: int) -> None:
    for pid, started in targets.items():
        if start_time(pid) != started:
            continue  # gone, or the pid now belongs to someone else
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if os.getpgid(pid) == pid:
                os.killpg(pid, sig)  # a rank leads its own session: take its helpers too
            os.kill(pid, sig)


def end_processes(targets: dict[int, int], grace_s: float = TERM_GRACE_S) -> None:
    """SIGTERM, then SIGKILL after ``grace_s`` for whatever is left; ``targets``: pid -> start time."""
    _signal_all(targets, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(start_time(p) == s for p, s in targets.items()):
        time.sleep(0.05)
    _signal_all(targets, signal.SIGKILL)


def _identities(pids) -> dict[int, int]:
    return {p: s for p in pids if (s := start_time(p)) is not None}


def reap(run_id: str, scratch: Path, owner: int, watch) -> None:
    """The reaper's whole life: record the owner's descendants until ``watch`` (the pipe) closes, then
    end every recorded or marked process of the run and remove its scratch folder."""
    import select  # late: only the reaper process needs it

    seen: dict[int, int] = {}
    try:  # the owner's children from before the command (a pytest worker's rank pools) are not the run's
        before = {int(k): v for k, v in json.loads((scratch / "before").read_text()).items()}
    except (OSError, ValueError):
        before = {}
    owner_started = start_time(owner)
    while owner_started is not None and start_time(owner) == owner_started:
        ready, _, _ = select.select([watch], [], [], SNAPSHOT_EVERY_S)
        if ready and not os.read(watch.fileno(), 4096):
            break  # EOF: the owner ended, however it ended (a forked child may hold the pipe: the poll above)
        seen.update(_identities(descendants(owner)))
    seen.update(_identities(descendants(owner)))
    seen.update(_identities(marked(run_id)))
    seen.pop(os.getpid(), None)
    end_processes({p: t for p, t in seen.items() if before.get(p) != t})
    shutil.rmtree(scratch, ignore_errors=True)


# --------------------------------------------------------------------------------------------------
# the command's side


def _owner_alive(folder: Path) -> bool:
    try:
        owner = json.loads((folder / "owner").read_text())
    except (OSError, ValueError):
        # no owner file yet: a folder being set up, unless it is old
        return time.time() - folder.stat().st_mtime < 60
    return start_time(int(owner["pid"])) == owner["start"]


def clean_stale(base: Path | None = None) -> list[Path]:
    """Scratch folders of commands that died without their reaper (the machine restarted, the reaper
    was killed too): end the processes still marked with their run id and remove the folders."""
    base = Path(base or tempfile.gettempdir())
    cleaned = []
    for folder in sorted(base.glob(SCRATCH_PREFIX + "*")):
        with contextlib.suppress(OSError):
            if not folder.is_dir() or _owner_alive(folder):
                continue
            end_processes(_identities(marked(run_id_of(folder))))
            shutil.rmtree(folder, ignore_errors=True)
            cleaned.append(folder)
    return cleaned


def _raise_interrupted(signum, _frame) -> None:
    # a second signal ends the command at once (the reaper still cleans up)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    raise Interrupted(signum)


@contextlib.contextmanager
def command_scope():
    """Run a command with a run id, a scratch TMPDIR, a reaper and SIGTERM/SIGINT as ``Interrupted``.

    Yields the scratch folder. A nested command (a shard started by ``--jobs``) gets its own id, scratch
    folder (inside the outer one) and reaper; its marker extends the outer one (``marked``)."""
    base = Path(os.environ.get("MUON_HARNESS_SCRATCH_BASE") or tempfile.gettempdir())
    clean_stale(base)
    run_id = uuid.uuid4().hex[:12]
    marker = "/".join(filter(None, [os.environ.get(RUN_MARKER), run_id]))
    if os.environ.get(RUN_MARKER):
        # nested (a --jobs shard, a compare's gate): a short name, since unix socket paths under it (torch's
        # pymp listeners) must stay under 108 bytes, three scopes deep included; the outer folder owns it
        scratch = base / f"n{run_id[:8]}"
        scratch.mkdir()
    else:
        scratch = Path(tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{run_id}-", dir=base))
    (scratch / "owner").write_text(json.dumps({"pid": os.getpid(), "start": start_time(os.getpid())}))
    (scratch / "before").write_text(json.dumps(_identities(descendants(os.getpid()))))
    saved_tmp, saved_handlers = tempfile.tempdir, {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    read_end, write_end = os.pipe()
    reaper = _start_reaper(run_id, scratch, read_end)
    os.close(read_end)
    tempfile.tempdir = str(scratch)
    for s in saved_handlers:
        signal.signal(s, _raise_interrupted)
    try:
        with buildenv.environ({RUN_MARKER: marker, "TMPDIR": str(scratch)}):
            yield scratch
    finally:
        for s, h in saved_handlers.items():
            signal.signal(s, h)
        tempfile.tempdir = saved_tmp
        os.close(write_end)  # the reaper's signal: end what is left, remove the scratch folder
        with contextlib.suppress(subprocess.TimeoutExpired):
            reaper.wait(timeout=TERM_GRACE_S + 5)


def _start_reaper(run_id: str, scratch: Path, read_end: int) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != RUN_MARKER}  # the reaper is not one of the run's
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2]),
                                                      env.get("PYTHONPATH")]))
    return subprocess.Popen([sys.executable, "-m", "harness.launch.lifecycle", run_id, str(scratch),
                             str(os.getpid())], stdin=read_end, env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, close_fds=True)


def set_parent_death_signal(sig: int = signal.SIGTERM) -> None:
    """For ``preexec_fn``: the child gets ``sig`` when the process that started it dies."""
    import ctypes  # late: only in the child, between fork and exec

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG


if __name__ == "__main__":
    # the reaper: python -m harness.launch.lifecycle RUN_ID SCRATCH OWNER_PID, the pipe on stdin
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    reap(sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), sys.stdin)
