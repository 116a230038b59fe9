"""Profiles, runner and bookkeeping of the Hypothesis fuzz tests (``cases/fuzz``).

Profiles
--------
``ci`` (default), ``dev``, ``nightly``; chosen by ``MUON_FUZZ_PROFILE`` or, failing that, by
``--hypothesis-profile`` (``dev`` / ``nightly`` / ``ci``). They live in Hypothesis' registry as
``muon-fuzz-<name>`` and apply only to the fuzz tests (through :func:`fuzz_settings`), so selecting
one never changes the settings of the other Hypothesis tests of the suite: the plain names ``dev``
and ``nightly`` are registered as aliases of Hypothesis' ``default`` profile only so that
``--hypothesis-profile dev`` is accepted, and ``ci`` is Hypothesis' built-in one.

``--hypothesis-profile`` is resolved by Hypothesis' pytest plugin at configure time, before
``cases/fuzz/conftest.py`` is imported unless pytest is pointed at ``cases/fuzz`` itself; for
``pytest -m fuzz --hypothesis-profile nightly`` from the root, the root ``conftest.py`` must load the
fuzz plugin (``pytest_plugins = [..., "cases.fuzz.plugin"]``). ``MUON_FUZZ_PROFILE`` always works.

``ci`` is derandomised with a fixed seed rather than ``derandomize=True``: Hypothesis makes
``derandomize=True`` imply ``database=None``, and the point of the example database
(``.cache/hypothesis``, git-ignored) is that a failure found once -- by a nightly run, say -- is
replayed first by every later run, ``ci`` included. Every profile draws from the same strategy, so
a stored example means the same case under each of them.
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from hypothesis import HealthCheck, Phase, event, note, seed, settings, target
from hypothesis.database import DirectoryBasedExampleDatabase

ROOT = Path(__file__).resolve().parents[2]
DATABASE_DIR = ROOT / ".cache" / "hypothesis"
WORST_DIR = ROOT / ".cache" / "fuzz-worst"
PROFILE_ENV = "MUON_FUZZ_PROFILE"
PROFILE_NAMES = ("ci", "dev", "nightly")
CI_SEED = 20240607  # the ci profile's fixed seed (see module doc)
TARGET_LABEL = "worst normalised error (verdict.worst_ratio)"
TARGET_CAP = 1e12  # hypothesis.target needs a finite score; a non-finite divergence scores this


@dataclass(frozen=True)
class FuzzProfile:
    name: str
    settings: settings
    seed: int | None  # fixed generation seed (derandomised), or None for a fresh one per run


def _database() -> DirectoryBasedExampleDatabase:
    return DirectoryBasedExampleDatabase(str(DATABASE_DIR))


_SLOW_OK = [HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large]

_PROFILES = {
    # Bounded for CI (2 cores, shared with the rest of the suite): see the report for its wall time.
    "ci": dict(max_examples=60, deadline=None, print_blob=True, suppress_health_check=_SLOW_OK,
               report_multiple_bugs=False),
    "dev": dict(max_examples=300, deadline=None, print_blob=True, suppress_health_check=_SLOW_OK),
    "nightly": dict(max_examples=5000, deadline=None, print_blob=True, suppress_health_check=_SLOW_OK),
}
_SEEDS = {"ci": CI_SEED, "dev": None, "nightly": None}


def _register() -> None:
    default = settings.get_profile("default")
    for name, kw in _PROFILES.items():
        settings.register_profile(f"muon-fuzz-{name}", parent=default, database=_database(), **kw)
    for alias in ("dev", "nightly"):
        try:
            settings.get_profile(alias)
        except Exception:  # not registered by anyone else: make --hypothesis-profile accept it
            settings.register_profile(alias, parent=default)


_register()


def active_profile_name() -> str:
    env = os.environ.get(PROFILE_ENV, "").strip()
    if env:
        if env not in PROFILE_NAMES:
            raise ValueError(f"{PROFILE_ENV}={env!r}: the fuzz profiles are {', '.join(PROFILE_NAMES)}")
        return env
    try:
        current = settings.get_current_profile_name()
    except AssertionError:
        current = "default"
    return current if current in PROFILE_NAMES else "ci"


def active_profile() -> FuzzProfile:
    name = active_profile_name()
    return FuzzProfile(name, settings.get_profile(f"muon-fuzz-{name}"), _SEEDS[name])


def fuzz_settings(test=None, **overrides):
    """Decorator: the active fuzz profile's settings (and, for ``ci``, its fixed seed)."""
    prof = active_profile()

    def apply(fn):
        fn = settings(prof.settings, **overrides)(fn)
        if prof.seed is not None:
            fn = seed(prof.seed)(fn)
        return fn

    return apply(test) if test is not None else apply


def search_settings(**overrides) -> settings:
    """Settings for a ``hypothesis.find`` search under the active profile (no database, no explain)."""
    prof = active_profile()
    kw = dict(database=None, phases=[Phase.explicit, Phase.generate, Phase.target, Phase.shrink])
    kw.update(overrides)
    return settings(prof.settings, **kw)


# --------------------------------------------------------------------------------------------------
# running and judging one case


def finite_score(x: float) -> float:
    return min(x, TARGET_CAP) if math.isfinite(x) else TARGET_CAP


def reproducer(case) -> str:
    from harness.verdict import reproduce_command

    return (f"reproduce outside Hypothesis:\n  {reproduce_command(case)}\n"
            f"case JSON:\n  {case.to_json()}")


@dataclass
class Worst:
    """The case with the largest normalised error seen in one search (which Hypothesis' shrinking
    would otherwise replace by the simplest failing case)."""

    ratio: float = -1.0
    case: object = None
    summary: str = ""
    examples: int = 0
    failures: int = 0
    started: float = field(default_factory=time.monotonic)

    def update(self, case, ratio: float, summary: str) -> None:
        self.examples += 1
        if ratio > 1.0:
            self.failures += 1
        if ratio > self.ratio:
            self.ratio, self.case, self.summary = ratio, case, summary

    def describe(self) -> str:
        if self.case is None:
            return "no case judged"
        return (f"worst normalised error {self.ratio:.4g} over {self.examples} judged cases "
                f"({self.failures} out of tolerance): {self.summary}\n{reproducer(self.case)}")

    def as_dict(self, test: str, profile: str) -> dict:
        return {"test": test, "profile": profile, "ratio": self.ratio, "examples": self.examples,
                "failures": self.failures, "summary": self.summary, "seconds": time.monotonic() - self.started,
                "case": json.loads(self.case.to_json()) if self.case is not None else None}

    def save(self, test: str, profile: str) -> Path | None:
        if self.case is None:
            return None
        WORST_DIR.mkdir(parents=True, exist_ok=True)
        path = WORST_DIR / f"{test}-{profile}.json"
        path.write_text(json.dumps(self.as_dict(test, profile), indent=1, sort_keys=True))
        return path


TRACKERS: dict[str, Worst] = {}  # test name -> its Worst, read by conftest's report hook


def tracker(test: str) -> Worst:
    return TRACKERS.setdefault(test, Worst())


class CaseCrashed(AssertionError):
    """A drawn case did not produce a trajectory (a rank raised, died or hung)."""


def run_case(pool_manager, case, entry: str | None = None):
    """Run ``case`` on the pool (optionally through another rank entry point); a crash becomes an
    AssertionError carrying the reproducer."""
    from harness.pool import CaseFailure

    try:
        outcome = pool_manager.run(case) if entry is None else pool_manager.run(case, entry)
    except CaseFailure as exc:
        text = str(exc)
        if len(text) > 6000:
            text = text[:2000] + "\n...\n" + text[-4000:]
        raise CaseCrashed(f"{case.name}: the case crashed\n{text}\n{reproducer(case)}") from None
    return outcome.result


def verdict_summary(v) -> str:
    """One line: the verdict's headline, and for a failure its first divergence."""
    lines = v.message(limit=1).splitlines()
    if v.passed or len(lines) < 2:
        return lines[0]
    return f"{lines[0]}; first: {lines[1].split(': ', 1)[-1]}"


def judge_case(pool_manager, case, entry: str | None = None):
    from harness.verdict import judge

    traj = run_case(pool_manager, case, entry)
    return judge(case, traj, keep_maps=False)


def record_events(case) -> None:
    from cases.strategies import case_events

    for e in case_events(case):
        event(e)


def check_case(pool_manager, case, worst: Worst, *, entry: str | None = None) -> None:
    """The body of a fuzz example: run, judge, target the worst error, fail with a reproducer."""
    record_events(case)
    note(reproducer(case))
    try:
        v = judge_case(pool_manager, case, entry)
    except CaseCrashed:
        worst.update(case, math.inf, f"{case.name}: crashed")
        target(TARGET_CAP, label=TARGET_LABEL)
        raise
    ratio = v.worst_ratio
    worst.update(case, ratio, verdict_summary(v))
    target(finite_score(ratio), label=TARGET_LABEL)
    if not v.passed:
        runtime = "patched runtime" if case.patched else "stock DeepSpeed"
        raise AssertionError(
            f"divergence on a path with no catalogued bug ({runtime})\n{v.message()}\n{reproducer(case)}\n"
            f"--- for comparison, {worst.describe()}")
