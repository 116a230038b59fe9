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

from hypothesis import HealthCheck, Phase, event, given, note, seed, settings, target
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


WORLD_SIZES_ENV = "MUON_FUZZ_WORLD_SIZES"  # e.g. "2" or "1,2": restrict the drawn world sizes (throughput runs)
MAX_EXAMPLES_ENV = "MUON_FUZZ_MAX_EXAMPLES"  # override the profile's budget (throughput runs)


def world_sizes(default: tuple[int, ...]) -> tuple[int, ...]:
    raw = os.environ.get(WORLD_SIZES_ENV, "").strip()
    if not raw:
        return default
    got = tuple(int(x) for x in raw.split(","))
    bad = [w for w in got if w not in default]
    if bad:
        raise ValueError(f"{WORLD_SIZES_ENV}={raw!r}: world sizes must be among {default}")
    return got


def fuzz_settings(test=None, *, ci: dict | None = None, **overrides):
    """Decorator: the active fuzz profile's settings (and, for ``ci``, its fixed seed). ``ci``: settings for
    the ci profile alone, for a test whose examples cost too much for the profile's shared budget; an
    explicit ``MUON_FUZZ_MAX_EXAMPLES`` or override still wins."""
    prof = active_profile()
    kw = dict(ci or {}) if prof.name == "ci" else {}
    if os.environ.get(MAX_EXAMPLES_ENV, "").strip():
        kw["max_examples"] = int(os.environ[MAX_EXAMPLES_ENV])
    kw.update(overrides)

    def apply(fn):
        fn = settings(prof.settings, **kw)(fn)
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


def draw(strategy, n: int, suppress=(HealthCheck.too_slow,)) -> list:
    """``n`` derandomised draws of ``strategy`` (generation only, no database): what a test of the strategy
    itself inspects. ``suppress``: the health checks the caller's strategy is known to trip."""
    got: list = []

    @settings(max_examples=n, derandomize=True, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(suppress))
    @given(strategy)
    def collect(example):
        got.append(example)

    collect()
    return got


def finite_score(x: float) -> float:
    return min(x, TARGET_CAP) if math.isfinite(x) else TARGET_CAP


def reproducer(case) -> str:
    from harness.judge.verdict import reproduce_command

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
    # Where the time goes (seconds): the ranks running cases, the parent starting rank pools (and
    # shipping), judging trajectories, and -- by difference -- Hypothesis itself (generation,
    # database, bookkeeping). Cases judged after the first failure are Hypothesis shrinking it.
    run_s: float = 0.0
    startup_s: float = 0.0
    judge_s: float = 0.0
    pools_started: int = 0
    shrink_examples: int = 0
    shrink_s: float = 0.0
    by_world_size: dict = field(default_factory=dict)  # ws -> [cases, seconds in run + start-up + judge]
    test: str = ""  # set by :func:`tracker`; with it the record is also saved every CHECKPOINT_S
    last_saved: float = field(default_factory=time.monotonic)

    def update(self, case, ratio: float, summary: str) -> None:
        self.examples += 1
        if self.failures:
            self.shrink_examples += 1
        if ratio > 1.0:
            self.failures += 1
        if ratio > self.ratio:
            self.ratio, self.case, self.summary = ratio, case, summary
        if self.test and time.monotonic() - self.last_saved > CHECKPOINT_S:
            # a time-bounded run (nightly under ``timeout``) is killed, not finished: keep its record
            self.save(self.test, active_profile_name())
            self.last_saved = time.monotonic()

    def timed(self, case, run_s: float, startup_s: float, judge_s: float, new_pool: bool) -> None:
        self.run_s += run_s
        self.startup_s += startup_s
        self.judge_s += judge_s
        self.pools_started += int(new_pool)
        if self.failures:
            self.shrink_s += run_s + startup_s + judge_s
        row = self.by_world_size.setdefault(case.world_size, [0, 0.0])
        row[0] += 1
        row[1] += run_s + startup_s + judge_s

    def split(self) -> dict:
        wall = time.monotonic() - self.started
        per_min = 60.0 * self.examples / wall if wall > 0 else 0.0
        return {"wall_s": wall, "judged_per_min": per_min, "run_s": self.run_s, "startup_s": self.startup_s,
                "judge_s": self.judge_s, "hypothesis_s": max(0.0, wall - self.run_s - self.startup_s - self.judge_s),
                "pools_started": self.pools_started, "shrink_examples": self.shrink_examples,
                "shrink_s": self.shrink_s,
                "by_world_size": {str(k): {"cases": v[0], "s_per_case": v[1] / v[0]}
                                  for k, v in sorted(self.by_world_size.items())}}

    def describe_split(self) -> str:
        d = self.split()
        ws = ", ".join(f"ws{k}: {v['cases']} cases at {v['s_per_case']:.2f}s" for k, v in d["by_world_size"].items())
        return (f"{self.examples} judged in {d['wall_s']:.0f}s = {d['judged_per_min']:.1f}/min; time: running "
                f"{d['run_s']:.0f}s, rank start-up {d['startup_s']:.0f}s ({d['pools_started']} pools), judging "
                f"{d['judge_s']:.0f}s, Hypothesis {d['hypothesis_s']:.0f}s; shrinking {d['shrink_examples']} cases "
                f"in {d['shrink_s']:.0f}s; per world size (run+start-up+judge): {ws}")

    def describe(self) -> str:
        if self.case is None:
            return "no case judged"
        return (f"worst normalised error {self.ratio:.4g} over {self.examples} judged cases "
                f"({self.failures} out of tolerance): {self.summary}\n{reproducer(self.case)}")

    def as_dict(self, test: str, profile: str) -> dict:
        return {"test": test, "profile": profile, "ratio": self.ratio, "examples": self.examples,
                "failures": self.failures, "summary": self.summary, "seconds": time.monotonic() - self.started,
                "case": json.loads(self.case.to_json()) if self.case is not None else None,
                "split": self.split(), "split_text": self.describe_split()}

    def save(self, test: str, profile: str) -> Path | None:
        if self.case is None:
            return None
        WORST_DIR.mkdir(parents=True, exist_ok=True)
        path = WORST_DIR / f"{test}-{profile}.json"
        path.write_text(json.dumps(self.as_dict(test, profile), indent=1, sort_keys=True))
        return path


TRACKERS: dict[str, Worst] = {}  # test name -> its Worst, read by conftest's report hook


CHECKPOINT_S = 30.0


def tracker(test: str) -> Worst:
    return TRACKERS.setdefault(test, Worst(test=test))


class CaseCrashed(AssertionError):
    """A drawn case did not produce a trajectory (a rank raised, died or hung)."""


def run_case(pool_manager, case, entry: str | None = None, worst: Worst | None = None):
    """Run ``case`` on the pool (optionally through another rank entry point); a crash becomes an
    AssertionError carrying the reproducer. With ``worst``, the time split is recorded there."""
    from harness.launch.pool import CaseFailure

    key = (case.world_size, case.compiled)
    pools = getattr(pool_manager, "pools", {})
    new_pool = key not in pools or pools[key].broken
    t0 = time.perf_counter()
    try:
        outcome = pool_manager.run(case) if entry is None else pool_manager.run(case, entry)
        if worst is not None:
            wall = time.perf_counter() - t0
            worst.timed(case, outcome.seconds, wall - outcome.seconds, 0.0, new_pool)
    except CaseFailure as exc:
        if worst is not None:
            worst.timed(case, time.perf_counter() - t0, 0.0, 0.0, new_pool)
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


def judge_case(pool_manager, case, entry: str | None = None, worst: Worst | None = None):
    from harness.judge.verdict import judge

    traj = run_case(pool_manager, case, entry, worst)
    t0 = time.perf_counter()
    v = judge(case, traj, keep_maps=False)
    if worst is not None:
        worst.judge_s += time.perf_counter() - t0
        if worst.failures:
            worst.shrink_s += time.perf_counter() - t0
    return v


def record_events(case) -> None:
    from cases.strategies import case_events

    for e in case_events(case):
        event(e)


def check_case(pool_manager, case, worst: Worst, *, entry: str | None = None) -> None:
    """The body of a fuzz example: run, judge, target the worst error, fail with a reproducer."""
    record_events(case)
    note(reproducer(case))
    try:
        v = judge_case(pool_manager, case, entry, worst)
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
