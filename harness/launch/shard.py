"""Deterministic, cost-balanced shards of the gate, so N machines can each run one part.

Why it looks the way it does: a shard must be a pure function of (case names, recorded costs, K, N)
so that N machines that never talk to each other agree on who runs what, and every case runs on
exactly one of them. Cases are balanced on the seconds each took when last measured
(``data/case_times.json``, written by ``python -m harness bench --gate``), because case costs
differ by two orders of magnitude (a compiled or NVMe case against a tiny ZeRO-1 one): splitting by
count would leave one machine with all the expensive work. A case the table does not know yet (a
new path) is costed by :func:`estimate` from what drives its cost, so a stale table degrades the
balance, never the partition.

Greedy longest-processing-time: cases sorted by cost (name as tie-break), each given to the shard
with the least work so far (lowest index as tie-break). Its makespan is within 4/3 of the best.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence
import shutil

TIMES_PATH = Path(__file__).resolve().parents[1] / "data" / "case_times.json"


@dataclass(frozen=True)
class Shard:
    index: int  # 1-based, as users write it: --shard 1/4
    count: int

    @classmethod
    def parse(cls, text: str) -> "Shard":
        m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text or "")
        if not m:
            raise ValueError(f"--shard takes K/N with 1 <= K <= N (e.g. 2/4), not {text!r}")
        k, n = int(m.group(1)), int(m.group(2))
        if n < 1 or not 1 <= k <= n:
            raise ValueError(f"--shard {text}: K/N needs N >= 1 and K between 1 and N")
        return cls(k, n)

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


def _table(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        return {}


def load_times(path: Path = TIMES_PATH) -> dict[str, float]:
    """Recorded seconds per case name (both columns together); empty when never measured."""
    table = _table(path)
    return {str(k): float(v) for k, v in table["cases"].items()} if table else {}


def load_selfcheck_times(path: Path = TIMES_PATH) -> dict[str, float]:
    """Recorded seconds of each mutation self-check ("patched", "stock") of the gate; empty when never
    measured."""
    return {str(k): float(v) for k, v in _table(path).get("selfchecks", {}).items()}


def estimate(case) -> float:
    """Seconds a case is expected to take (both columns), from what drives its cost: ranks, steps,
    and the expensive paths (NVMe swapping of >= 1 MiB matrices, compiled Newton-Schulz, resume)."""
    base = 0.6 + 0.25 * case.world_size
    s = base * max(case.steps, 1) / 3.0
    if case.offload == "nvme":
        s *= 4.0
    if case.compiled:
        s += 60.0
    if case.checkpoint_at is not None:
        s *= 2.0
    return s


def costs_for(cases: Sequence, times: dict[str, float] | None = None) -> dict[str, float]:
    times = load_times() if times is None else times
    return {c.name: times.get(c.name, estimate(c)) for c in cases}


def assign(costs: dict[str, float], count: int, start: Sequence[float] = ()) -> list[list[str]]:
    """Partition names into ``count`` lists of near-equal total cost (LPT, deterministic). ``start``:
    work each shard has besides these names (the gate's mutation self-checks run after a shard's cases),
    so that the shards end together rather than their cases."""
    loads = [float(x) for x in start] + [0.0] * (count - len(start))
    shards: list[list[str]] = [[] for _ in range(count)]
    for name in sorted(costs, key=lambda n: (-costs[n], n)):
        i = min(range(count), key=lambda j: (loads[j], j))
        shards[i].append(name)
        loads[i] += costs[name]
    return shards


def select(cases: Sequence, shard: Shard, times: dict[str, float] | None = None, start: Sequence[float] = ()) -> list:
    """The cases of one shard, in their original order (``start``: as in :func:`assign`)."""
    mine = set(assign(costs_for(cases, times), shard.count, start)[shard.index - 1])
    return [c for c in cases if c.name in mine]


def taken_from_the_end(cases: Sequence, shard: Shard, parts: list[list[str]]) -> list:
    """The other shards' cases in the order a shard that has run out of its own work takes them: each
    other shard's from the end of its list (what its owner would reach last), the shards in turn.
    ``parts``: the split the shards were given (:func:`assign`)."""
    order = {c.name: i for i, c in enumerate(cases)}
    queues = [sorted(parts[k], key=order.__getitem__) for k in range(shard.count) if k != shard.index - 1]
    by_name = {c.name: c for c in cases}
    out = []
    while any(queues):
        for q in queues:
            if q:
                out.append(by_name[q.pop()])
    return out


CLAIMS = ".claims"  # in the results folder of a --jobs run, while its shards run


def claim(root: Path, key: str) -> bool:
    """Whether this process may run ``key`` (a case-column): the first of the local shards to ask gets it.
    An O_EXCL file in the results folder, so two shards never judge the same case-column while a shard
    with time left takes the others' untouched work."""
    folder = Path(root) / CLAIMS
    folder.mkdir(parents=True, exist_ok=True)
    try:
        os.close(os.open(folder / hashlib.sha1(key.encode()).hexdigest(), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def clear_claims(root: Path) -> None:
    shutil.rmtree(Path(root) / CLAIMS, ignore_errors=True)


def select_names(names: Iterable[str], costs: dict[str, float], shard: Shard) -> set[str]:
    """The same split for things that are not cases (pytest node ids), given their costs."""
    names = list(names)
    return set(assign({n: costs.get(n, 0.5) for n in names}, shard.count)[shard.index - 1])


def write_times(seconds: dict[str, float], command: str, path: Path = TIMES_PATH,
                selfchecks: dict[str, float] | None = None) -> None:
    """Store measured seconds per case (summed over columns) and per self-check for the next split.
    Merged into the table already there: a run of a slice (``--only``, one shard's folder) refreshes
    the cases it measured and must not erase the costs of the others, or the next split balances on
    guesses."""
    merged = load_times(path)
    merged.update(seconds)
    checks = load_selfcheck_times(path)
    checks.update(selfchecks or {})
    data = {"measured_by": command, "cases": {k: round(v, 3) for k, v in sorted(merged.items())}}
    if checks:
        data["selfchecks"] = {k: round(v, 1) for k, v in sorted(checks.items())}
    Path(path).write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


def merge_results(sources: Sequence[Path], dest: Path) -> Path:
    """One results folder holding every shard's outcomes, maps and stored extras (the kill matrix,
    the environment), for one report with one verdict. Files are renamed per source so that two
    shards' writers never overwrite each other; a case-column present in two folders keeps the
    later folder's record (``results.load_records``: last record per key wins)."""

    dest = Path(dest)
    if dest.exists():
        shutil.rmtree(dest)
    (dest / "maps").mkdir(parents=True)
    for i, src in enumerate(Path(s) for s in sources):
        tag = f"s{i + 1}"
        for path in sorted(src.glob("results-*.jsonl")) + sorted(src.glob("results-*.jsonl.gz")):  # plain or compacted
            shutil.copyfile(path, dest / f"results-{tag}-{path.name[len('results-'):]}")
        for prefix in ("extra-", "run-"):  # stored extras, and the plans that say what the runs meant to judge
            for path in sorted(src.glob(prefix + "*.json")):
                shutil.copyfile(path, dest / f"{prefix}{tag}-{path.name[len(prefix):]}")
        for path in sorted((src / "maps").glob("*.npz")) if (src / "maps").is_dir() else []:
            shutil.copyfile(path, dest / "maps" / path.name)
    return dest
