"""A judging process kept warm across mutants: torch and the harness imported once, one fork per mutant.

Where a judged mutant's time went (``python -m harness mutate --engine cosmic-ray``, 2 shared cores,
load 13, README "Source mutation"): the worker's interpreter start and imports ~12.6 s, the rank
pool's start ~13.3 s, the first case on fresh ranks ~4.8 s, every further case 0.1-0.5 s (NVMe cases
20-40 s). The cases themselves are a few percent. The imports are the same for every mutant and
touch nothing DeepSpeed: this process does them once (never importing DeepSpeed, which must come
fresh from the mutated copy) and forks a child per request; the child imports DeepSpeed from the
copy, starts its own rank pool (new processes per mutant, so a mutant never leaks into the next)
and judges exactly as ``harness.selfcheck.source_mutation.worker`` does in a fresh process. Its ranks are
forked from it (``RankPool.START_METHOD = "fork"``: torch inherited, DeepSpeed imported in the rank
from the copy), the child itself running torch on one thread so that no OpenMP team exists at a fork.

Protocol: one JSON request line on a unix socket (the worker's arguments), one JSON record line
back. The engine's test command stays ``python -m harness.selfcheck.source_mutation.worker ...``; with
``MUON_MUTATION_ZYGOTE`` naming a live socket it forwards there and only prints the answer, and
without one (or when the socket does not answer) it judges in its own process, so the HTTP
distributor's workers and a crashed server lose nothing but time.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import traceback
from pathlib import Path

# The client half (the engine's test command forwards here) lives in the worker, which this imports.
from harness.selfcheck.source_mutation.worker import ZYGOTE_ENV as SOCKET_ENV  # noqa: F401
from harness.selfcheck.source_mutation.worker import ask_zygote as ask  # noqa: F401
from harness.selfcheck.source_mutation.worker import recv_line


def _judge_in_child(request: dict) -> dict:
    import torch

    from harness.launch.pool import RankPool
    from harness.selfcheck.source_mutation import workspace
    from harness.selfcheck.source_mutation.worker import judge_mutant

    # One thread: no OpenMP team ever starts in this process, so forking ranks from it is safe; the
    # ranks then inherit torch instead of importing it (RankPool.START_METHOD).
    torch.set_num_threads(1)
    if request.get("fork_ranks", True):
        RankPool.START_METHOD = "fork"

    site = Path(request["site"])
    workspace.clear_scoped_bytecode(site / "deepspeed")
    workspace.use_copy(site)
    return judge_mutant(Path(request["pristine"]), site / "deepspeed", Path(request["map"]),
                        request.get("column", "stock"), request.get("max_cases"))


def serve(path: str, log: str) -> None:
    """Accept requests one at a time until killed; each is judged in a forked child."""
    from harness.env import buildenv

    buildenv.apply_base_env()
    import torch  # noqa: F401 - the point: imported once, inherited by every child

    import harness.case.spec  # noqa: F401
    import harness.gate.decide  # noqa: F401
    import harness.launch.pool  # noqa: F401
    import harness.selfcheck.source_mutation.worker  # noqa: F401

    if "deepspeed" in sys.modules:
        raise RuntimeError("the zygote imported deepspeed: a child would judge the unmutated module")
    if os.path.exists(path):
        os.unlink(path)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(4)
    print(f"zygote: serving on {path}", flush=True)
    while True:
        conn, _ = srv.accept()
        with conn:
            data = recv_line(conn)
            try:
                request = json.loads(data)
            except ValueError:
                continue
            rfd, wfd = os.pipe()
            pid = os.fork()
            if pid == 0:  # child: judge, write the record, never return into the server loop
                srv.close()
                os.close(rfd)
                code = 0
                try:
                    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                    os.dup2(fd, 1)
                    os.dup2(fd, 2)
                    rec = _judge_in_child(request)
                except BaseException as exc:  # the harness failed, not the mutant
                    traceback.print_exc()
                    rec = {"status": "harness-error", "detail": f"{type(exc).__name__}: {exc}"[:300]}
                    code = 3
                try:
                    os.write(wfd, (json.dumps(rec, sort_keys=True) + "\n").encode())
                finally:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(code)
            os.close(wfd)
            with os.fdopen(rfd, "rb") as r:
                answer = r.readline()  # not read(): a leftover rank would hold the pipe open
            os.waitpid(pid, 0)
            if not answer.strip():
                answer = (json.dumps({"status": "harness-error", "detail": "the zygote's child died without a "
                                      "record (see its log)"}) + "\n").encode()
            try:
                conn.sendall(answer)
            except OSError:
                pass


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m harness.selfcheck.source_mutation.zygote")
    ap.add_argument("--socket", required=True)
    ap.add_argument("--log", required=True)
    args = ap.parse_args(argv)
    serve(args.socket, args.log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
