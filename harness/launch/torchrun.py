"""Launch mode for real clusters: the ranks are started by ``torchrun`` (or the ``deepspeed``
launcher) with ``env://`` rendezvous and whatever accelerator is present, instead of by the CPU rank
pool (``harness.launch.pool``). The case and result formats are the same -- a ``Case`` in, a pickled
``Trajectory`` out -- only the process launch and the communication backend change, so the oracle,
the comparison and the gate decision (``harness.gate.decide.evaluate``) apply unchanged.

Two halves:

* **Rank side** -- ``python -m harness.launch.torchrun --case-file case.json --out result.pkl`` is what
  every rank runs. It reads ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` from the launcher's environment,
  sets the harness environment for its accelerator (``launch_env``), calls
  ``torch.distributed.init_process_group(backend, init_method="env://")`` with the backend of the
  accelerator (gloo on CPU, nccl on CUDA), then runs every case of the file through
  ``harness.rank.ds_run.run_case_on_rank``; rank 0 pickles the Trajectory (or, for a case file holding a
  JSON list of cases, the list of Trajectories) atomically into ``--out``. Each rank writes its
  output to ``<log-dir>/rank<R>.log``, its traceback to ``rank<R>.error`` when it raises, and
  ``rank<R>.done`` when it finished; a case that outlives its ``timeout_s`` has every Python stack of
  the rank dumped into the log (faulthandler) and the rank exits, which makes the launcher stop the
  others. Also accepts ``--local_rank`` (the ``deepspeed`` launcher passes it) and ignores it.

* **Parent side** -- ``run_with_torchrun(case, nproc) -> Trajectory`` (and ``run_cases_with_torchrun``
  for several cases in one launch, which pays the process start and the torch/DeepSpeed import once)
  writes the case file, builds ``python -m torch.distributed.run --standalone --nproc_per_node N -m
  harness.launch.torchrun ...`` (``torchrun_command``), runs it in its own session with a deadline, and on
  failure raises the pool's exceptions (``RankFailed`` / ``RankDied`` / ``CaseTimeout``, all
  ``CaseFailure``) naming the rank that failed first, with its traceback and log tail.
  ``TorchrunManager`` has the ``run(case)`` / ``close()`` shape of ``PoolManager``, so
  ``harness.gate.decide.evaluate(case, column, TorchrunManager(...))`` works as is.

Environment (``launch_env``): the harness's base environment (``harness.env.buildenv.base_env``:
extension cache, eager mode, one OpenMP thread, ...) with ``DS_ACCELERATOR`` chosen by the launch
mode: ``cpu`` forces DeepSpeed's CPU accelerator (as the pool does); ``cuda`` sets
``DS_ACCELERATOR=cuda`` and a separate JIT extension cache (``<cache>-cuda``: CUDA builds of
``cpu_adam``/``fused_adam`` must not share a folder with the CPU builds); ``auto`` resolves to
``cuda`` when ``torch.cuda.is_available()`` and to ``cpu`` otherwise. Only ``cpu`` ever forces the
CPU accelerator.

Several nodes: run on every node (same case file, ``N`` nodes x ``P`` processes = ``Case.world_size``)::

    python -m torch.distributed.run --nnodes N --nproc_per_node P --rdzv-backend c10d \\
        --rdzv-endpoint HOST:PORT --rdzv-id JOB -m harness.launch.torchrun --case-file case.json --out result.pkl

(``torchrun_command(..., nnodes=N, rdzv_endpoint="HOST:PORT")`` prints exactly that), or with the
DeepSpeed launcher: ``deepspeed --num_gpus P --module harness.launch.torchrun --case-file case.json --out
result.pkl``. The result lands on the node of global rank 0; judge it with ``python -m harness check``
on the same case, or ``harness.judge.verdict.judge(case, trajectory)``. ``--workdir`` (NVMe swap files,
checkpoints) must be the same path on every rank of a node; the default is ``<out>.work``.

CUDA: the rank side moves each synthetic batch to the accelerator's current device (the shared model
code builds it on the CPU). Everything else -- capture, comparison -- copies to the CPU itself. This
path has not run on a GPU yet (no GPU machine was available to this project); the CPU/gloo path is
tested (``cases/cli/test_torchrun.py``: bit-identical trajectories to the pool's).
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from dataclasses import dataclass
from pathlib import Path

from harness.env import buildenv
from harness.launch import lifecycle
from harness.rank.bootstrap import apply_fault, bootstrap_rank, redirect_output, set_parent_death_signal
from harness.case.spec import Case
from harness.launch.launcher import DEFAULT_ENTRY, CaseFailure, CaseOutcome, CaseTimeout, RankDied, RankFailed
import torch
import threading
import torch.distributed as dist

ENTRY_MODULE = "harness.launch.torchrun"
PARENT_PID_VAR = "MUON_HARNESS_PARENT_PID"  # the harness process a launch belongs to (rank_main watches it)
MARKER = "MUON_HARNESS_TORCHRUN"  # in every rank's environment: lets tests prove nothing is left behind
ACCELERATORS = ("auto", "cpu", "cuda")
BACKENDS = {"cpu": "gloo", "cuda": "nccl"}
STARTUP_S = float(os.environ.get("MUON_HARNESS_TORCHRUN_STARTUP", "300"))  # launcher + imports + rendezvous
KILL_GRACE_S = 10.0
TIMEOUT_MARK = "Timeout ("  # faulthandler's header when dump_traceback_later fires


# --------------------------------------------------------------------------------------------------
# environment


def detect_accelerator() -> str:
    """``cuda`` when torch sees a CUDA device, else ``cpu``."""

    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_accelerator(accelerator: str | None) -> str:
    if accelerator in (None, "auto"):
        return detect_accelerator()
    if accelerator not in BACKENDS:
        raise ValueError(f"unknown accelerator {accelerator!r}; expected one of {ACCELERATORS}")
    return accelerator


def launch_env(accelerator: str) -> dict[str, str]:
    """The environment a rank of this launch mode needs, before torch/DeepSpeed are imported.

    ``accelerator`` must be resolved (``cpu`` or ``cuda``)."""
    if accelerator not in BACKENDS:
        raise ValueError(f"launch_env needs a resolved accelerator (cpu/cuda), got {accelerator!r}")
    env = buildenv.base_env()
    if accelerator == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
    else:
        env["DS_ACCELERATOR"] = accelerator
        env["TORCH_EXTENSIONS_DIR"] = str(buildenv.extensions_dir()) + f"-{accelerator}"
    return env


def backend_for(accelerator: str) -> str:
    return BACKENDS[accelerator]


# --------------------------------------------------------------------------------------------------
# case files


def write_case_file(path: Path, cases: list[Case] | Case) -> Path:
    """One case as a JSON object, several as a JSON list (``Case.to_json`` each)."""
    path = Path(path)
    if isinstance(cases, Case):
        path.write_text(cases.to_json())
    else:
        path.write_text("[" + ",\n".join(c.to_json() for c in cases) + "]")
    return path


def read_case_file(path: Path) -> tuple[list[Case], bool]:
    """(cases, was_a_list)."""
    data = json.loads(Path(path).read_text())
    if isinstance(data, list):
        return [Case.from_json(json.dumps(d)) for d in data], True
    return [Case.from_json(json.dumps(data))], False


# --------------------------------------------------------------------------------------------------
# rank side


def _exit_when_orphaned(poll_s: float = 1.0) -> None:
    """End this rank once the harness process that launched it is gone. The parent-death signal
    alone is not enough: torchrun's agent may start a rank from a helper thread (that signal follows
    the thread, not the process), and a rank still importing torch when its launcher dies has no
    parent left to compare with. So the launching harness process names itself
    (``PARENT_PID_VAR``) and the rank polls for it."""

    watched = int(os.environ.get(PARENT_PID_VAR, "0") or 0)
    parent = os.getppid()

    def gone() -> bool:
        if watched > 0:
            try:
                os.kill(watched, 0)
            except ProcessLookupError:
                return True
            except PermissionError:
                return False
            return False
        return os.getppid() != parent

    def watch():
        while not gone():
            time.sleep(poll_s)
        os._exit(70)

    threading.Thread(target=watch, name="orphan-watch", daemon=True).start()


def _batches_on_device(device) -> None:
    """Non-CPU accelerators: ``harness.case.synthetic.batch_data`` builds CPU tensors; the engine's module is
    on ``device``. Wrap it in this rank process only (the parent's oracle keeps the CPU version)."""
    from harness.case import synthetic  # late: keeps this module numpy-free at import

    orig = synthetic.batch_data
    if getattr(orig, "_on_device", None) == str(device):
        return

    def batch_data(case, rank, step, micro, dtype=None):
        out = orig(case, rank, step, micro, dtype)
        return {n: {k: t.to(device) for k, t in d.items()} for n, d in out.items()}

    batch_data._on_device = str(device)
    synthetic.batch_data = batch_data


def _log(msg: str) -> None:
    print(f"[harness.launch.torchrun {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _rank_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m harness.launch.torchrun",
                                 description="per-rank entry: run case(s) under torchrun / the deepspeed launcher")
    ap.add_argument("--case-file", required=True, help="a Case as JSON (or a JSON list of cases)")
    ap.add_argument("--out", required=True, help="rank 0 pickles the Trajectory (list for a list) here")
    ap.add_argument("--workdir", default=None, help="per-case scratch (NVMe swap, checkpoints); default <out>.work")
    ap.add_argument("--log-dir", default=None, help="rank<R>.log / .error / .done; default <out>.logs")
    ap.add_argument("--accelerator", choices=ACCELERATORS, default=None,
                    help="default: $DS_ACCELERATOR if set, else auto-detect")
    ap.add_argument("--no-redirect", action="store_true", help="keep output on the launcher's console")
    ap.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return ap


def _rank_accelerator(given: str | None) -> str:
    accel = given
    if accel is None:  # the parent passes it; a hand-started launch may have set DS_ACCELERATOR
        accel = os.environ.get("DS_ACCELERATOR") if os.environ.get("DS_ACCELERATOR") in BACKENDS else "auto"
    return detect_accelerator() if accel == "auto" else accel


@dataclass
class _Stage:
    """What a rank is doing, for its ``.error`` file: a case's name, ``<start-up>`` or ``<shut-down>``."""

    name: str = "<start-up>"


def _run_cases_on_rank(cases: list[Case], rank: int, world: int, local_rank: int, accel: str, workdir: Path,
                       logf, stage: _Stage) -> list:
    """Join the process group and run each case, each under its own faulthandler deadline."""

    device = None
    if accel == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    _log(f"rank {rank}/{world} (local {local_rank}) accelerator {accel}, backend {backend_for(accel)}")
    bootstrap_rank(rank, world, backend=backend_for(accel), init_method="env://", cpu=accel == "cpu")
    from harness.rank import ds_run  # rank side: imports DeepSpeed

    if device is not None:
        _batches_on_device(device)
    results = []
    for i, case in enumerate(cases):
        stage.name = case.name
        if case.world_size != world:
            raise ValueError(f"case {case.name!r} is for world size {case.world_size}, "
                             f"but the launcher started {world} ranks")
        _log(f"case {i + 1}/{len(cases)} {case.name} start")
        faulthandler.dump_traceback_later(case.timeout_s, repeat=False, file=logf, exit=True)
        t0 = time.perf_counter()
        apply_fault(case, rank)  # test-only fault injection, the pool's semantics
        traj = ds_run.run_case_on_rank(case, rank, world, workdir / f"case{i}")
        faulthandler.cancel_dump_traceback_later()
        _log(f"case {i + 1}/{len(cases)} {case.name} done in {time.perf_counter() - t0:.2f}s")
        results.append(traj)
    return results


def _ship(results: list, was_list: bool, out: Path, rank: int) -> None:
    """After every rank is done: rank 0 pickles the trajectories (atomically: the parent may be reading)."""

    dist.barrier()
    if rank == 0:
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        with open(tmp, "wb") as f:
            pickle.dump(results if was_list else results[0], f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, out)


def _exit(code: int) -> None:
    """Skip interpreter teardown (gloo/NCCL and DeepSpeed destructors can block), as the pool does."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def rank_main(argv=None) -> int:
    args = _rank_parser().parse_args(argv)
    for var in ("RANK", "WORLD_SIZE"):
        if var not in os.environ:
            print(f"error: ${var} is not set: start this module with torchrun or the deepspeed launcher",
                  file=sys.stderr)
            return 2
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", args.local_rank if args.local_rank is not None else rank))
    out = Path(args.out)
    log_dir = Path(args.log_dir) if args.log_dir else out.with_name(out.name + ".logs")
    workdir = Path(args.workdir) if args.workdir else out.with_name(out.name + ".work")
    log_dir.mkdir(parents=True, exist_ok=True)
    accel = _rank_accelerator(args.accelerator)
    os.environ.update(launch_env(accel))
    os.environ.setdefault("LOCAL_RANK", str(local_rank))

    set_parent_death_signal()
    _exit_when_orphaned()
    logf = sys.stderr if args.no_redirect else redirect_output(log_dir / f"rank{rank}.log")
    faulthandler.enable(file=logf, all_threads=True)
    stage = _Stage()
    try:
        cases, was_list = read_case_file(Path(args.case_file))
        results = _run_cases_on_rank(cases, rank, world, local_rank, accel, workdir, logf, stage)
        stage.name = "<shut-down>"
        _ship(results, was_list, out, rank)
        if local_rank == 0 and args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
        (log_dir / f"rank{rank}.done").write_text("ok\n")
    except BaseException:
        tb = traceback.format_exc()
        print(tb, flush=True)
        try:
            (log_dir / f"rank{rank}.error").write_text(f"case: {stage.name}\n{tb}")
        except OSError:
            pass
        _exit(1)
    _exit(0)


# --------------------------------------------------------------------------------------------------
# parent side


def torchrun_command(case_file, out, nproc: int, *, accelerator: str = "cpu", log_dir=None, workdir=None,
                     nnodes: int = 1, rdzv_endpoint: str | None = None, rdzv_id: str | None = None,
                     python: str = sys.executable) -> list[str]:
    """The launcher command line. Single node: ``--standalone``; several: c10d rendezvous at
    ``rdzv_endpoint`` (run the same command on every node)."""
    cmd = [python, "-m", "torch.distributed.run"]
    if nnodes == 1 and rdzv_endpoint is None:
        cmd.append("--standalone")
    else:
        if rdzv_endpoint is None:
            raise ValueError("several nodes need rdzv_endpoint='HOST:PORT'")
        cmd += ["--nnodes", str(nnodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv_endpoint,
                "--rdzv-id", rdzv_id or "muon-harness"]
    cmd += ["--nproc_per_node", str(nproc), "--max-restarts", "0", "-m", ENTRY_MODULE,
            "--case-file", str(case_file), "--out", str(out), "--accelerator", accelerator]
    if log_dir is not None:
        cmd += ["--log-dir", str(log_dir)]
    if workdir is not None:
        cmd += ["--workdir", str(workdir)]
    return cmd


def marked_processes(uid: str) -> list[int]:
    """PIDs (not zombies) whose environment carries ``MUON_HARNESS_TORCHRUN=uid``."""
    return [pid for pid, value in lifecycle.env_values(MARKER) if value == uid]


def _kill(proc: subprocess.Popen, uid: str) -> None:
    """Stop the launcher (it stops its workers on SIGTERM), then SIGKILL anything of this launch left."""
    for sig, wait_s in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(timeout=wait_s)
            break
        except subprocess.TimeoutExpired:
            continue
    # Workers run in sessions of their own (torch's subprocess handler); they also carry a
    # parent-death signal, but make sure.
    for _ in range(3):
        pids = marked_processes(uid)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.5)


def _tail(path: Path, chars: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except FileNotFoundError:
        return ""


def _case_of(log: str, default: str) -> str:
    started = re.findall(r"case \d+/\d+ (\S+) start", log)
    return started[-1] if started else default


def _diagnose(log_dir: Path, nproc: int, launcher_log: str, default_case: str) -> CaseFailure:
    """Which rank failed first, and why, from the rank files and the launcher's summary."""
    errors = sorted(log_dir.glob("rank*.error"), key=lambda p: p.stat().st_mtime)
    logs = {r: _tail(log_dir / f"rank{r}.log", 100_000) for r in range(nproc)}
    timed_out = [r for r, text in logs.items() if TIMEOUT_MARK in text]
    if timed_out:
        stacks = {r: logs[r][logs[r].rfind(TIMEOUT_MARK):][-6000:] if r in timed_out else logs[r][-2000:]
                  for r in range(nproc)}
        name = _case_of(logs[timed_out[0]], default_case)
        m = re.search(r"Timeout \((\d+):(\d+):(\d+)", logs[timed_out[0]])
        secs = int(m.group(1)) * 3600 + int(m.group(2)) * 60 + int(m.group(3)) if m else float("nan")
        return CaseTimeout(name, secs, stacks)
    if errors:
        first = errors[0]
        rank = int(re.search(r"rank(\d+)\.error", first.name).group(1))
        text = first.read_text(errors="replace")
        name = text.splitlines()[0].removeprefix("case: ").strip() if text.startswith("case: ") else default_case
        return RankFailed(name, rank, text + "\n--- log tail ---\n" + logs.get(rank, "")[-3000:])
    # No traceback: a rank died (signal, os._exit, OOM). The launcher's summary names the root cause.
    rank, code = None, None
    m = re.search(r"Root Cause.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", launcher_log, re.S)
    if m:
        rank, code = int(m.group(1)), int(m.group(2))
    else:
        missing = [r for r in range(nproc) if not (log_dir / f"rank{r}.done").exists()]
        rank = missing[0] if missing else 0
    log = logs.get(rank, "")
    return RankDied(_case_of(log, default_case), rank, code,
                    log[-3000:] + "\n--- launcher output ---\n" + launcher_log[-3000:])


def run_cases_with_torchrun(cases: list[Case], nproc: int | None = None, *, accelerator: str = "cpu",
                            timeout_s: float | None = None, root: Path | None = None, keep: bool = False,
                            python: str = sys.executable, uid: str | None = None) -> list:
    """Launch ``torchrun`` once for ``cases`` (all of the same world size) and return their
    Trajectories in order. Raises ``CaseFailure`` subclasses naming the failed rank."""
    if not cases:
        return []
    nproc = nproc or cases[0].world_size
    bad = [c.name for c in cases if c.world_size != nproc]
    if bad:
        raise ValueError(f"cases {bad} are not for world size {nproc}")
    accel = resolve_accelerator(accelerator)
    uid = uid or uuid.uuid4().hex[:12]  # MUON_HARNESS_TORCHRUN value of this launch's processes
    base = Path(root) if root else Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix=f"muon-torchrun-ws{nproc}-", dir=base))
    case_file = write_case_file(run_dir / "cases.json", list(cases))
    out = run_dir / "result.pkl"
    log_dir = run_dir / "logs"
    log_dir.mkdir()
    cmd = torchrun_command(case_file, out, nproc, accelerator=accel, log_dir=log_dir,
                           workdir=run_dir / "work", python=python)
    env = dict(os.environ)
    env.update(launch_env(accel))
    env[MARKER] = uid
    env[PARENT_PID_VAR] = str(os.getpid())
    env["PYTHONPATH"] = os.pathsep.join([str(buildenv.PROJECT_ROOT)] + (
        [env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    deadline_s = timeout_s if timeout_s is not None else STARTUP_S + sum(c.timeout_s for c in cases) + 30
    launcher_log_path = log_dir / "torchrun.log"
    name = cases[0].name if len(cases) == 1 else f"{cases[0].name} (+{len(cases) - 1} more)"
    try:
        with open(launcher_log_path, "w") as launcher_log:
            launcher_log.write("$ " + " ".join(cmd) + "\n")
            launcher_log.flush()
            proc = subprocess.Popen(cmd, cwd=str(buildenv.PROJECT_ROOT), env=env, stdout=launcher_log,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                    # A parent killed from outside (a CI timeout) takes the launcher with
                                    # it; the ranks follow their launcher the same way (rank_main).
                                    preexec_fn=set_parent_death_signal)
            try:
                rc = proc.wait(timeout=deadline_s)
            except subprocess.TimeoutExpired:
                _kill(proc, uid)
                stacks = {r: _tail(log_dir / f"rank{r}.log", 3000) for r in range(nproc)}
                raise CaseTimeout(_case_of(stacks.get(0, ""), name), deadline_s, stacks) from None
            except BaseException:
                _kill(proc, uid)
                raise
        leftovers = marked_processes(uid)
        if leftovers:
            _kill(proc, uid)
        if rc != 0 or not out.exists():
            raise _diagnose(log_dir, nproc, _tail(launcher_log_path, 20_000), name)
        with open(out, "rb") as f:
            result = pickle.load(f)
        return result
    finally:
        if not keep:
            shutil.rmtree(run_dir, ignore_errors=True)


def run_with_torchrun(case: Case, nproc: int | None = None, **kw):
    """One case through ``torchrun``: the Trajectory rank 0 captured (what the pool returns)."""
    return run_cases_with_torchrun([case], nproc or case.world_size, **kw)[0]


class TorchrunManager:
    """A ``harness.launch.launcher.Launcher`` over torchrun launches, so ``harness.gate.decide.evaluate`` runs a case
    through torchrun unchanged. One launch per case."""

    def __init__(self, accelerator: str = "cpu", root: Path | None = None):
        self.accelerator = resolve_accelerator(accelerator)
        self.root = root

    def run(self, case: Case, entry: str | None = None) -> CaseOutcome:
        if entry not in (None, DEFAULT_ENTRY):
            raise ValueError("the torchrun launch mode runs harness.rank.ds_run:run_case_on_rank only")
        t0 = time.perf_counter()
        traj = run_with_torchrun(case, case.world_size, accelerator=self.accelerator, root=self.root)
        return CaseOutcome(result=traj, seconds=time.perf_counter() - t0, rank_seconds=[])

    def close(self) -> None:
        pass


if __name__ == "__main__":
    sys.exit(rank_main())
