"""What every launcher promises (the rank pool, torchrun mode, anything a test builds): run one case on
its ranks and hand back rank 0's result, or raise a ``CaseFailure`` saying which rank failed and why.

``harness.gate.decide.evaluate``, the kill matrix and ``check`` take any ``Launcher``; the pool
(``harness.launch.pool.PoolManager``) and ``harness.launch.torchrun.TorchrunManager`` are the two there are.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from harness.case.spec import Case

DEFAULT_ENTRY = "harness.rank.ds_run:run_case_on_rank"


class Launcher(Protocol):
    def run(self, case: Case, entry: str = DEFAULT_ENTRY) -> CaseOutcome:
        """Run ``entry(case, rank, world_size, workdir)`` on ``case.world_size`` ranks."""
        ...

    def close(self) -> None:
        """Stop every rank this launcher started."""
        ...


class CaseFailure(Exception):
    """A case did not produce a result; carries what a user needs to see why."""

    def __init__(self, case_name: str, message: str, details: str = ""):
        self.case_name = case_name
        self.details = details
        super().__init__(f"case {case_name!r}: {message}" + (f"\n{details}" if details else ""))


class RankFailed(CaseFailure):
    def __init__(self, case_name: str, rank: int, tb: str):
        self.rank = rank
        super().__init__(case_name, f"rank {rank} raised", tb)


class RankRefused(RankFailed):
    """Every rank raised the patched runtime's ``Refusal`` for the case: a failure to the judge like any
    ``RankFailed``, but the pool keeps its ranks."""


class RankDied(CaseFailure):
    def __init__(self, case_name: str, rank: int, exitcode, log_tail: str):
        self.rank = rank
        self.exitcode = exitcode
        super().__init__(case_name, f"rank {rank} died with exit code {exitcode}", log_tail)


class CaseTimeout(CaseFailure):
    def __init__(self, case_name: str, timeout_s: float, stacks: dict[int, str]):
        self.stacks = stacks
        body = "\n".join(f"--- rank {r} stack ---\n{s or '(no stack dumped)'}" for r, s in sorted(stacks.items()))
        super().__init__(case_name, f"timed out after {timeout_s:.0f}s; ranks killed", body)


@dataclass
class CaseOutcome:
    result: object  # rank 0's return value (a Trajectory for real cases)
    seconds: float  # wall time seen by the parent, shipping included
    rank_seconds: list[float]  # time inside the case function, per rank
