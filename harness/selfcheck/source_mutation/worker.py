"""The engine's test command: judge the mutant currently written into the private copy.

Cosmic Ray applies one mutation to a file of the copy and runs this command in a fresh process, so
the mutated module is imported fresh, by this process and by the ranks of a rank pool of its own
(spawned ranks get this process's ``sys.path``, the copy first). Which lines changed is read by
comparing the copy's scoped files with the installed ones, so the command needs no argument from
the engine and works the same under its local and HTTP distributors.

The mutant runs only against the gate cases that executed a changed line (the coverage map),
cheapest first, and stops at the first kill. Killed means the gate's decision on the column judged
(stock, or patched) changed: a case that passed (or matched its bug model) now fails, errors, or no
longer shows its expected bug. A case timeout is a kill only when the unmutated case took under a
quarter of it. On the patched column a mutant inside a function the patched runtime replaces is not
run at all: it is "replaced by a fix" (``harness.selfcheck.source_mutation.patched``).

Prints one ``MUTATION-RESULT {json}`` line (read back by ``harness.selfcheck.source_mutation.report``); exit
status 1 when killed, 0 otherwise (survived, or not reached: no case executes the line), 3 when the
harness itself failed (the run is not counted as a kill by the report).
"""
from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from pathlib import Path

RESULT_TAG = "MUTATION-RESULT "
# A mutant's case gets 4x its unmutated time (measured under coverage, pool start-up included, so
# already an over-estimate) plus 15 s, at least 45 s: a hang costs little, and a timeout counts as a
# kill only when the unmutated run took under a quarter of it.
TIMEOUT_FACTOR = 4.0
TIMEOUT_PAD_S = 15.0
TIMEOUT_FLOOR_S = 45.0
FAST_FRACTION = 0.25


ZYGOTE_ENV = "MUON_MUTATION_ZYGOTE"  # the socket of harness.selfcheck.source_mutation.zygote



def recv_line(sock: socket.socket) -> bytes:
    """One request or reply of the zygote's protocol: a JSON document ended by a newline (or by the
    peer closing). Both ends (this client, the zygote) read with this, so they agree on where a message stops."""
    data = b""
    while not data.endswith(b"\n"):
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def ask_zygote(path: str, request: dict, timeout: float | None = None) -> dict | None:
    """The record for ``request`` from the server at ``path``; None when no server answers."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(10.0)
            s.connect(path)
            s.settimeout(timeout)
            s.sendall((json.dumps(request) + "\n").encode())
            data = recv_line(s)
    except OSError:
        return None
    return json.loads(data) if data.strip() else None


def _emit(record: dict) -> None:
    print(RESULT_TAG + json.dumps(record, sort_keys=True), flush=True)


def judge_mutant(pristine: Path, copy: Path, cmap_path: Path, column: str = "stock",
                 max_cases: int | None = None) -> dict:
    from harness.case.spec import Case
    from harness.gate.decide import evaluate
    from harness.launch.pool import PoolManager
    from harness.selfcheck.source_mutation import patched, scope
    from harness.selfcheck.source_mutation.selection import CoverageMap, changed_lines

    cmap = CoverageMap.load(cmap_path)
    resolved = scope.resolve(pristine)
    changed: dict[str, list[int]] = {}
    for rel in scope.files():
        a, b = (pristine / rel).read_text(), (copy / rel).read_text()
        if a != b:
            changed[rel] = changed_lines(a, b)
    if not changed:
        return {"status": "no-change", "detail": "the copy equals the installed source"}
    cases: list[str] = []
    where = []
    for rel, lines in changed.items():
        for line in lines:
            fn = scope.owner(resolved, rel, line)
            where.append(f"{rel}:{line}" + (f" ({fn.entry.qualname})" if fn else " (out of scope)"))
        for n in cmap.cases_for(resolved, rel, lines):
            if n not in cases:
                cases.append(n)
    cases.sort(key=lambda n: (cmap.cases[n].seconds, n))
    if column == "patched":
        spans = patched.spans(pristine)
        hit = next((e for rel, lines in changed.items() if (e := patched.replaced_by(spans, rel, lines))), None)
        if hit is not None:
            return patched.record(hit, where)
    if max_cases is not None:
        cases = cases[:max_cases]
    rec = {"where": where, "candidates": cases, "tried": [], "column": column}
    if not cases:
        rec.update(status="not-reached", detail="no candidate case executes " + ", ".join(where))
        return rec
    manager = PoolManager()
    t_all = time.perf_counter()
    try:
        for name in cases:
            info = cmap.cases[name]
            timeout = max(TIMEOUT_FLOOR_S, TIMEOUT_FACTOR * info.seconds + TIMEOUT_PAD_S)
            case = Case.from_json(info.case_json).replace(timeout_s=timeout)
            t0 = time.perf_counter()
            o = evaluate(case, column, manager)
            secs = time.perf_counter() - t0
            first = (o.message or "").strip().splitlines()[:1]
            rec["tried"].append({"case": name, "status": o.status, "seconds": round(secs, 2)})
            if o.status in ("passed", "xfailed"):
                continue
            timed_out = "timed out after" in (o.message or "")
            if timed_out and info.seconds > FAST_FRACTION * timeout:
                rec["tried"][-1]["note"] = "timeout not counted: the unmutated case is not fast"
                continue
            rec.update(status="killed", by=name, how=o.status + (" (timeout)" if timed_out else ""),
                       detail=(first[0] if first else "")[:300])
            return rec
        rec.update(status="survived", nearest=cases[0],
                   detail=f"{len(cases)} case(s) executed the line and still "
                          f"{'/'.join(sorted({t['status'] for t in rec['tried']}))}")
        return rec
    finally:
        rec["seconds"] = round(time.perf_counter() - t_all, 2)
        manager.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.selfcheck.source_mutation.worker",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--site", required=True, help="the folder holding the mutated copy's deepspeed package")
    ap.add_argument("--pristine", required=True, help="the installed (unmutated) deepspeed package folder")
    ap.add_argument("--map", required=True, help="the coverage map (coverage.json)")
    ap.add_argument("--column", default="stock", choices=("stock", "patched"))
    ap.add_argument("--max-cases", type=int, default=None)
    args = ap.parse_args(argv)
    import os

    server = os.environ.get(ZYGOTE_ENV)
    if server:  # a warm judging process (harness.selfcheck.source_mutation.zygote): forward, print its answer
        rec = ask_zygote(server, {"site": args.site, "pristine": args.pristine, "map": args.map,
                                  "column": args.column, "max_cases": args.max_cases})
        if rec is not None:
            _emit(rec)
            return {"killed": 1, "harness-error": 3}.get(rec.get("status"), 0)
        print(f"zygote at {server} did not answer: judging in this process", file=sys.stderr)
    try:
        from harness.env import buildenv
        from harness.selfcheck.source_mutation import workspace

        buildenv.apply_base_env()
        pristine = Path(args.pristine)
        site = Path(args.site)
        workspace.clear_scoped_bytecode(site / "deepspeed")
        workspace.use_copy(site)
        rec = judge_mutant(pristine, site / "deepspeed", Path(args.map), args.column, args.max_cases)
    except Exception as exc:  # the harness failed, not the mutant: reported, never counted as a kill
        import traceback

        traceback.print_exc()
        _emit({"status": "harness-error", "detail": f"{type(exc).__name__}: {exc}"[:300]})
        return 3
    _emit(rec)
    return 1 if rec["status"] == "killed" else 0


if __name__ == "__main__":
    sys.exit(main())
