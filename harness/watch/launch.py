"""Run the user's command as it is, with the capture on its import path, and leave nothing of it running.

The command gets the environment the user called ``watch`` with (not the harness's own: a GPU run must
not be told ``DS_ACCELERATOR=cpu``), plus three things: ``harness/rank/watch_boot`` and the project on
``PYTHONPATH`` (the ``sitecustomize`` that installs the capture in every Python process of the command),
the settings in ``MUON_HARNESS_WATCH``, and the command's run marker (``harness.launch.lifecycle``), by
which the reaper finds every process of it, the launcher's workers in their own sessions included.

It runs in a session of its own, so a Ctrl-C meant for ``watch`` reaches ``watch`` only; ``watch`` then
ends the command's process group (SIGTERM, a grace, SIGKILL) and every marked process left.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess

from harness.env import buildenv
from harness.launch import lifecycle
from harness.rank import watch_hook
from harness.rank.watch_hook import Settings


def command_env(user_env: dict, settings: Settings) -> dict:
    env = dict(user_env)
    paths = [str(watch_hook.BOOT_DIR), str(buildenv.PROJECT_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH")
                                                                      else [])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env[watch_hook.ENV] = settings.to_env()
    if os.environ.get(lifecycle.RUN_MARKER):
        env[lifecycle.RUN_MARKER] = os.environ[lifecycle.RUN_MARKER]
    return env


def _end(proc: subprocess.Popen) -> None:
    for sig, wait_s in ((signal.SIGTERM, lifecycle.TERM_GRACE_S + 3), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def run_command(command: list[str], env: dict, timeout_s: float | None = None) -> int:
    """The command's exit status; on a signal to ``watch`` (``lifecycle.Interrupted``) or the timeout the
    command is ended first, then the exception goes on. Marked processes left behind are ended too."""
    proc = subprocess.Popen(command, env=env, start_new_session=True, stdin=subprocess.DEVNULL,
                            preexec_fn=lifecycle.set_parent_death_signal)
    try:
        rc = proc.wait(timeout=timeout_s)
    except BaseException:
        _end(proc)
        _end_marked()
        raise
    _end_marked()
    return rc


def _end_marked() -> None:
    """Whatever of the command outlived its launcher (a worker in its own session): every process that
    carries this command's own run id (the last of the marker's path)."""
    marker = os.environ.get(lifecycle.RUN_MARKER)
    if not marker:
        return
    left = lifecycle.marked(marker.split("/")[-1])
    lifecycle.end_processes({pid: lifecycle.start_time(pid) for pid in left})
