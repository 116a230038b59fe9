"""Results stored as data, so a report can be rebuilt without rerunning and several pytest-xdist
workers' results merge into one: one JSON line per case outcome in ``results.jsonl``, and the
element-wise error maps of failing checks in one ``.npz`` per outcome (``maps/<key>.npz``).

Appending a line is atomic enough for concurrent writers (each line is one ``write`` of < PIPE_BUF
only for small records, so every writer appends to its own file ``results-<worker>.jsonl``; readers
merge all of them).
"""
from __future__ import annotations

import gzip
import hashlib
import json
import os
import time
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path

import numpy as np

from harness.case.spec import Case
import oracles
from harness.judge.verdict import layout_for, step_config
from harness.judge.verdict import reproduce_command

STATUSES = ("passed", "failed", "unjudged", "xfailed", "xpassed", "error", "skipped")


@dataclass
class CheckRow:
    """A check as stored: where it was (parameter, quantity, step, rank partition, region) and the one
    divergence record (``oracles.Divergence``, as a dict) or the reason there was nothing to compare.
    The properties are the names the report reads; they all come from ``record``."""
    param: str
    quantity: str
    step: int
    rank: int | None
    region: str | None
    region_counts: dict
    record: dict | None  # the fields of an oracles.Divergence
    problem: str | None = None
    unjudged: str | None = None  # why the quantity could not be judged (``harness.judge.compare.cannot_judge``)

    def _get(self, key: str, missing: float):
        return missing if self.record is None else self.record[key]

    @property
    def worst_ratio(self) -> float:
        return self._get("ratio", 1e308)

    @property
    def error(self) -> float:
        return self._get("abs_error", float("nan"))

    @property
    def allowance(self) -> float:
        return self._get("bound", 0.0)

    @property
    def actual(self) -> float:
        return self._get("actual", float("nan"))

    @property
    def expected(self) -> float:
        return self._get("expected", float("nan"))

    @property
    def n_bad(self) -> int:
        return self._get("n_bad", 1)

    @property
    def numel(self) -> int:
        return self._get("numel", 0)

    @property
    def derivation(self) -> str:
        if self.record is not None:
            return self.record["derivation"]
        return self.problem if self.unjudged is None else f"cannot judge: {self.unjudged}"


def _record_dict(rec) -> dict | None:
    if rec is None:
        return None
    return {k: (_f(v) if isinstance(v, float) else v) for k, v in _fields_of(rec).items()}


def _fields_of(obj) -> dict:
    """A dataclass's fields, one level deep, for ``json.dumps`` to walk (its ``default`` for the nested
    ones). ``asdict`` deep-copies every list and dict of the ~140 checks of a record first: most of
    writing a record, which the gate's parent does once per case-column. The JSON is the same."""
    if is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: getattr(obj, f.name) for f in fields(obj)}
    raise TypeError(f"{type(obj).__name__} is not JSON serializable")


@dataclass
class CaseRecord:
    key: str  # unique per (case, column)
    case_name: str
    column: str  # "stock" | "patched" | mutant name
    status: str
    bug_ids: list[str]
    mode: str
    message: str
    reproduce: str
    case_json: str
    seconds: float
    worst_ratio: float
    checks: list[CheckRow] = field(default_factory=list)  # all failing checks + the worst passing per quantity
    layout: dict = field(default_factory=dict)  # per param: ranks' [start, end) and padded ranges, for drawing
    swapped_bytes: int | None = None
    notes: list[str] = field(default_factory=list)
    time: float = field(default_factory=time.time)
    # "full" (no excuse, or every excuse matched its bug model), "excused" (a bug without a model excused
    # quantities by name), "crash" / "refusal" (an exact exception was the expected result), None
    strength: str | None = None
    # The worst error/allowance against the oracle with the case's bug models switched on, where that
    # judgement decided the status: an xfail matched its bug (its ``worst_ratio`` and ``checks`` are then
    # the intended oracle's, where the bug shows), or a failure diverged beyond what the bug predicts
    # (``worst_ratio`` is then this one too). None where no bug model decided.
    model_ratio: float | None = None
    # [param, quantity, first step] of every quantity that diverged from the intended oracle, whether or not a
    # bug model explains it. Why: a failure beyond a bug model keeps the model's checks, and
    # ``harness.report.compare`` needs all the record failed to tell whether another record fails strictly
    # less. None: no verdict, or a record from before the field (then only the record's own checks are known).
    intended_failed: list[list] | None = None


def strength_line(summary: dict[str, tuple[int, int]]) -> str:
    parts = [f"{col} {k}/{n} = {100.0 * k / n:.0f}%" for col, (k, n) in summary.items() if n]
    return ("judged at full strength (no excuse, or an excuse that matched its bug model; crash/refusal "
            "cases left out): " + ", ".join(parts)) if parts else "judged at full strength: no cases"


def strength_summary(outcomes) -> dict[str, tuple[int, int]]:
    """Per column: (cases judged at full strength, cases that could be) -- crash and refusal cases are
    not numerical checks and are left out of both counts."""
    out: dict[str, list[int]] = {}
    for o in outcomes:
        col, strength = o if isinstance(o, tuple) else (o.column, o.strength)
        if strength in ("crash", "refusal"):
            continue
        tally = out.setdefault(col, [0, 0])
        tally[1] += 1
        tally[0] += strength == "full"
    return {k: (v[0], v[1]) for k, v in out.items()}


def record_key(case: Case, column: str) -> str:
    return hashlib.sha1(f"{column}\0{case.to_json()}".encode()).hexdigest()[:16]


def layout_summary(verdict) -> dict:
    """Per parameter: each rank's slice and the element ranges of each region (for the heatmap)."""

    sc = step_config(verdict.case)
    lay = layout_for(verdict.case, sc)
    out = {}
    for p in sc.params:
        out[p.name] = {
            "shape": list(p.shape),
            "ranks": [[s.rank, s.param_start, s.param_end] for s in oracles.param_slices(lay, p.name)],
            "regions": {k: [list(r) for r in v] for k, v in oracles.region_ranges(lay, p.name).items()},
        }
    return out


def from_verdict(verdict, *, column: str, status: str, bug_ids, seconds: float, message: str | None = None,
                 swapped_bytes: int | None = None, notes=(), strength: str | None = None, model_verdict=None,
                 intended=None) -> tuple[CaseRecord, dict[str, np.ndarray]]:
    """The stored record of a judged outcome. ``model_verdict``: the bug model's verdict where it decided
    the status, whose worst ratio is what the report shows (``CaseRecord.model_ratio``). ``intended``: the
    intended oracle's verdict where ``verdict`` is a bug model's (``CaseRecord.intended_failed``)."""

    rows, maps = [], {}
    best_passing: dict[str, object] = {}
    for c in verdict.checks:
        if c.passed:
            cur = best_passing.get(c.quantity)
            if cur is None or c.worst_ratio > cur.worst_ratio:
                best_passing[c.quantity] = c
            continue
        rows.append(c)
        if c.error_map is not None and c.param != "<step>":
            maps[f"{c.param}|{c.quantity}|{c.step}"] = c.error_map
    rows += list(best_passing.values())
    rec = CaseRecord(
        key=record_key(verdict.case, column), case_name=verdict.case.name, column=column, status=status,
        bug_ids=list(bug_ids), mode=verdict.mode, message=message if message is not None else verdict.message(),
        reproduce=reproduce_command(verdict.case), case_json=verdict.case.to_json(), seconds=seconds,
        worst_ratio=verdict.worst_ratio if verdict.checks else 0.0,
        checks=[CheckRow(c.param, c.quantity, c.step, c.rank, c.region, dict(c.region_counts), _record_dict(c.record),
                         c.problem, c.unjudged) for c in rows],
        layout=layout_summary(verdict) if maps else {},
        swapped_bytes=swapped_bytes, notes=list(notes), strength=strength,
        model_ratio=None if model_verdict is None else _f(model_verdict.worst_ratio if model_verdict.checks else 0.0),
        intended_failed=first_failures((intended or verdict).failures))
    return rec, maps


def first_failures(failures) -> list[list]:
    """[param, quantity, first step] per failing quantity, in a stable order."""
    first: dict[tuple[str, str], int] = {}
    for c in failures:
        key = (c.param, c.quantity)
        first[key] = min(first.get(key, c.step), c.step)
    return [[p, q, s] for (p, q), s in sorted(first.items())]


def error_record(case: Case, *, column: str, message: str, seconds: float, bug_ids=(),
                 status: str = "error", strength: str | None = None) -> CaseRecord:
    """A record for an outcome without a verdict: an error, or a case the patched runtime refused."""

    return CaseRecord(key=record_key(case, column), case_name=case.name, column=column, status=status,
                      bug_ids=list(bug_ids), mode="-", message=message, reproduce=reproduce_command(case),
                      case_json=case.to_json(), seconds=seconds,
                      worst_ratio=float("inf") if status == "error" else 0.0, strength=strength)


def _f(x: float) -> float:
    return float(x) if np.isfinite(x) else (1e308 if x > 0 else -1e308)


MAX_CELLS = 2048  # the cells a heatmap strip draws (a longer map is max-pooled to this many)


def maxpool(ratio: np.ndarray, max_cells: int = MAX_CELLS) -> np.ndarray:
    """Max-pool a flat map to at most ``max_cells`` cells (bin i covers [i*n/c, (i+1)*n/c))."""
    r = np.asarray(ratio, dtype=np.float64).reshape(-1)
    r = np.where(np.isnan(r), np.inf, r)
    n = r.size
    if n <= max_cells:
        return r
    edges = (np.arange(max_cells) * n) // max_cells
    return np.maximum.reduceat(r, edges)


@dataclass(frozen=True)
class PooledMap:
    """A stored element map longer than a heatmap draws: its ``MAX_CELLS`` max-pooled cells, with the
    element count and how many elements were above their allowance. Why: the full map of one large
    model's matrix is megabytes and the report draws only the pooled cells; every number of every check
    stays in the record."""

    cells: np.ndarray
    n: int
    n_bad: int


def map_cells(ratio) -> tuple[np.ndarray, int, int]:
    """(the cells to draw, the element count, the elements above their allowance) of a stored map."""
    if isinstance(ratio, PooledMap):
        return np.asarray(ratio.cells, dtype=np.float64), ratio.n, ratio.n_bad
    flat = np.asarray(ratio, dtype=np.float64).reshape(-1)
    return flat, flat.size, int((flat > 1).sum())


def _stored(maps: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    out = {}
    for k, v in maps.items():
        name = k.replace("/", "_")
        flat = np.asarray(v).reshape(-1)
        if flat.size > MAX_CELLS:
            out[name] = maxpool(flat).astype(np.float32)
            out[name + "#n"] = np.array([flat.size, int((flat > 1).sum())], dtype=np.int64)
        else:
            out[name] = v
    return out


class ResultStore:
    def __init__(self, root: Path, writer: str | None = None):
        self.root = Path(root)
        self.writer = writer or os.environ.get("PYTEST_XDIST_WORKER", "main")
        (self.root / "maps").mkdir(parents=True, exist_ok=True)

    def add(self, rec: CaseRecord, maps: dict[str, np.ndarray] | None = None) -> None:
        if maps:
            np.savez_compressed(self.root / "maps" / f"{rec.key}.npz", **_stored(maps))
        line = json.dumps(_fields_of(rec), sort_keys=True, default=_fields_of)
        path = self.root / f"results-{self.writer}.jsonl"
        with open(path, "ab+") as f:
            f.seek(0, os.SEEK_END)
            if f.tell():
                f.seek(-1, os.SEEK_END)
                torn = f.read(1) != b"\n"  # a writer killed mid-line: the record after it keeps its own line
            else:
                torn = False
            f.write((("\n" if torn else "") + line + "\n").encode())

    def load(self) -> list[CaseRecord]:
        return load_records(self.root)


RECORD_GLOBS = ("results-*.jsonl", "results-*.jsonl.gz")  # a complete folder's are compressed (``compact``)


def record_files(root: Path) -> list[Path]:
    """Every writer's record file under ``root``, plain (a run still writing) or compressed."""
    return sorted(p for g in RECORD_GLOBS for p in Path(root).glob(g))


def record_lines(path: Path) -> list[str]:
    """The lines of one writer's record file, plain or compressed."""
    if path.suffix == ".gz":
        with gzip.open(path, "rt") as f:
            return f.read().splitlines()
    return path.read_text().splitlines()


def load_records(root: Path) -> list[CaseRecord]:
    """All records under ``root`` (every writer's file), last record per key wins."""
    recs: dict[str, CaseRecord] = {}
    for path in record_files(root):
        for line in record_lines(path):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
            except ValueError:
                continue  # the last line of a writer killed mid-write; the case-column counts as not run

            d["checks"] = [CheckRow(**c) for c in d.get("checks", [])]
            rec = CaseRecord(**d)
            recs[rec.key] = rec
    return sorted(recs.values(), key=lambda r: (r.column, r.case_name))


def compact(root: Path) -> tuple[int, int]:
    """Compress a complete folder's record files (``results-<writer>.jsonl.gz``) and drop the self-checks'
    progress notes. Why: the records of a ``--full`` gate are most of its folder and repetitive JSON (every
    check's divergence record, each case's JSON twice), which gzip keeps whole at a fraction of the size
    (docs/measurements.md);
    a folder still being written (or resumed: a resume writes files of its own) stays plain, for the
    progress line's reading by offset. Returns (bytes before, bytes after)."""
    root = Path(root)
    before = after = 0
    for path in sorted(root.glob("results-*.jsonl")):
        gz = path.with_name(path.name + ".gz")
        data = (gzip.decompress(gz.read_bytes()) if gz.exists() else b"") + path.read_bytes()  # appended to since
        tmp = gz.with_name(gz.name + ".tmp")
        with gzip.open(tmp, "wb", compresslevel=6) as f:
            f.write(data)
        tmp.replace(gz)
        path.unlink()
        before, after = before + len(data), after + gz.stat().st_size
    for path in root.glob("selfcheck-*.jsonl"):
        path.unlink()
    return before, after


def load_maps(root: Path, key: str) -> dict[str, np.ndarray]:
    path = Path(root) / "maps" / f"{key}.npz"
    if not path.exists():
        return {}
    with np.load(path) as z:
        return {k: (PooledMap(z[k], int(z[k + "#n"][0]), int(z[k + "#n"][1])) if k + "#n" in z.files else z[k])
                for k in z.files if not k.endswith("#n")}


# --------------------------------------------------------------------------------------------------
# what a run planned, and whether it got there


@dataclass(frozen=True, order=True)
class Planned:
    """One case-column a run set out to judge, by name: the stored record's key hashes the case as it
    ran (adapted to the release, marked patched), which the plan cannot know beforehand; a gate's case
    names are unique."""
    case_name: str
    column: str


@dataclass
class Completeness:
    """A results folder against what the runs that wrote it planned (``run-<writer>.json``). A folder
    without plans (pytest's, or from before plans were written) is taken as complete."""
    planned: int
    judged: int
    missing: list[Planned]
    selfchecks_missing: list[str]
    interrupted: list[str]  # "<writer>: SIGTERM" for every run that was stopped

    @property
    def complete(self) -> bool:
        return not self.missing and not self.selfchecks_missing

    def headline(self, folder: Path) -> str:
        parts = [f"judged {self.judged} of {self.planned} planned case-columns, {len(self.missing)} not run"]
        if self.selfchecks_missing:
            parts.append("mutation self-check(s) not run: " + ", ".join(self.selfchecks_missing))
        return ("INCOMPLETE: " + "; ".join(parts) + f" (finish with: python -m harness gate --resume {folder})")


def note_selfcheck_run(root: Path, writer: str, kind: str, case: str, mutant: str | None, cost: float) -> None:
    """One run of a mutation self-check ended (``selfcheck-<writer>.jsonl``): what the parent's progress
    line counts, with the cost it was planned at, while a shard's self-checks run."""
    line = json.dumps({"check": kind, "case": case, "mutant": mutant, "cost": cost})
    with open(Path(root) / f"selfcheck-{writer}.jsonl", "a") as f:
        f.write(line + "\n")


def _plan_path(root: Path, writer: str) -> Path:
    return Path(root) / f"run-{writer}.json"


def write_plan(root: Path, writer: str, planned: list[Planned], selfchecks: list[str], args: dict) -> None:
    """Before the first case: what this writer will judge, and the arguments that chose it (``--resume``
    reads them back)."""
    Path(root).mkdir(parents=True, exist_ok=True)
    data = {"writer": writer, "args": args, "selfchecks": list(selfchecks), "selfchecks_done": [],
            "completed": False, "interrupted": None, "started": time.time(),
            "planned": [[p.case_name, p.column] for p in planned]}
    _plan_path(root, writer).write_text(json.dumps(data))


def finish_plan(root: Path, writer: str, *, selfchecks_done: list[str], interrupted: str | None) -> None:
    path = _plan_path(root, writer)
    data = json.loads(path.read_text())
    data.update(selfchecks_done=list(selfchecks_done), interrupted=interrupted, completed=interrupted is None,
                ended=time.time())
    path.write_text(json.dumps(data))


def load_plans(root: Path) -> list[dict]:
    plans = []
    for path in sorted(Path(root).glob("run-*.json")):
        try:
            plans.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return plans


def completeness(root: Path, records: list[CaseRecord] | None = None) -> Completeness:
    plans = load_plans(root)
    records = load_records(root) if records is None else records
    judged = {Planned(r.case_name, r.column) for r in records}
    planned = {Planned(*p) for plan in plans for p in plan["planned"]}
    wanted = {s for plan in plans for s in plan["selfchecks"]}
    done = {s for plan in plans for s in plan["selfchecks_done"]}
    return Completeness(
        planned=len(planned), judged=len(judged & planned), missing=sorted(planned - judged),
        selfchecks_missing=sorted(wanted - done),
        interrupted=[f"{plan['writer']}: {plan['interrupted']}" for plan in plans if plan.get("interrupted")])
