"""What a ``check`` verdict rests on, and the verdict a user may read from it.

The gate's statuses answer "did DeepSpeed do what it intends on this case?"; a user reads ``check``'s
PASS as "my Muon training is right". Two gate outcomes say less than that and are never a pass here:

* a refusal -- the gate passes a case DeepSpeed refuses as it must; for a user, the training crashes at
  start-up. Exit 2 with DeepSpeed's words, as bad input is (``check_plan.refuse_as_deepspeed_would`` stops
  most before any rank; what only ``deepspeed.initialize`` refuses is read from the rank's traceback);
* a run in which no applied step moved a weight (every step skipped on overflow, or applied at lr 0,
  as the Hugging Face templates' ``warmup_min_lr: "auto"`` = 0 makes the first step) -- nothing of the
  update was judged against a weight. Exit 4, "cannot judge", with the reason and how to get a judgement.

Every verdict line says what it rests on (``Basis.text``): applied steps, skipped steps, steps at lr 0.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from harness.judge.raised import refused_at_initialize
from oracles import schedules

EXIT_OK, EXIT_DIVERGED, EXIT_BAD_INPUT, EXIT_RUN_FAILED, EXIT_CANNOT_JUDGE = 0, 1, 2, 3, 4


def _steps(xs) -> str:
    xs = list(xs)
    return ("step " if len(xs) == 1 else "steps ") + ", ".join(map(str, xs))


@dataclass(frozen=True)
class Basis:
    """The applied, skipped and zero-lr steps of one run, and the applied steps that moved a weight
    (a master differs from the one before it, bit for bit: measured, not inferred from the lr)."""

    asked: int
    skipped: tuple[int, ...]
    applied: tuple[int, ...]
    lr_zero: tuple[tuple[int, tuple[str, ...]], ...]  # applied step -> its param groups at lr 0
    lr_captured: bool  # False: the run recorded no group lr (a check without data says so)
    moved: tuple[int, ...]  # applied steps at which some weight moved
    muon_moved: tuple[int, ...]  # ... at which some Muon matrix moved
    has_muon: bool

    def text(self) -> str:
        parts = [f"{len(self.applied)} applied step(s) of {self.asked}"]
        if self.skipped:
            parts.append(f"{len(self.skipped)} skipped on overflow ({_steps(self.skipped)})")
        if self.lr_zero:
            parts.append("; ".join(f"{_steps([s])} at lr 0 ({', '.join(gs)})" for s, gs in self.lr_zero))
        elif not self.lr_captured:
            parts.append("the groups' lr was not captured")
        parts.append(f"weights moved at {len(self.moved)} ({_steps(self.moved)})" if self.moved
                     else "no weight moved")
        if self.has_muon and self.moved and self.muon_moved != self.moved:
            parts.append(f"Muon matrices moved at {len(self.muon_moved)}"
                         + (f" ({_steps(self.muon_moved)})" if self.muon_moved else ""))
        return "rests on " + ", ".join(parts)

    def empty_reason(self) -> str | None:
        """Why nothing of the Muon step was judged against a weight, or None when something was."""
        why = []
        if self.skipped:
            why.append(f"{_steps(self.skipped)} skipped on overflow")
        if self.lr_zero:
            why.append(f"{_steps(s for s, _ in self.lr_zero)} applied at lr 0")
        because = f" ({'; '.join(why)})" if why else ""
        if not self.moved:
            return f"no applied step changed any weight{because}, so no update was judged against a weight"
        if self.has_muon and not self.muon_moved:
            return (f"no applied step changed a Muon matrix{because}: Muon's step was never applied to a weight "
                    "(only the Adam half moved)")
        return None


def basis(o) -> Basis | None:
    """The basis of an outcome that ran (None: no trajectory)."""
    traj = o.trajectory
    if traj is None or not getattr(traj, "steps", None):
        return None
    muon = set(traj.muon_params)
    prev = dict(traj.initial)
    applied, skipped, lr_zero, moved, muon_moved = [], [], [], [], []
    captured = True
    for rec in traj.steps:
        changed = set()
        for name, ps in rec.params.items():
            if name in prev and not np.array_equal(prev[name], ps.master):
                changed.add(name)
            prev[name] = ps.master
        if rec.skipped:
            skipped.append(rec.step)
            continue
        applied.append(rec.step)
        captured &= bool(rec.group_lr)
        zero = tuple(sorted(g for g, lr in rec.group_lr.items() if lr == 0))
        if zero:
            lr_zero.append((rec.step, zero))
        if changed:
            moved.append(rec.step)
        if changed & muon:
            muon_moved.append(rec.step)
    return Basis(o.case.steps, tuple(skipped), tuple(applied), tuple(lr_zero), captured, tuple(moved),
                 tuple(muon_moved), bool(muon))


def steps_past_warmup(case, b: Basis) -> int | None:
    """``--steps`` that gives Muon at least one applied step at lr > 0 under the config's schedule, the
    skips of this run counted in; None where the schedule never leaves 0 within 1000 steps."""
    lr = case.ds.optimizer.muon.lr
    first = next((n for n in range(1000) if schedules.group_lr(case.ds.scheduler, lr, n) > 0), None)
    return None if first is None else len(b.skipped) + first + 1


def refusal_sentence(o) -> str | None:
    """The line to print when DeepSpeed (or, in the patched column, the bundled fixes) refused the config:
    the gate's refusal outcome, or an error raised by DeepSpeed inside ``deepspeed.initialize``."""
    if o.strength == "refusal":
        head = o.message.splitlines()[0] if o.message else ""
        who = "the bundled fixes refuse" if o.refused else f"DeepSpeed {o.case.ds.release} refuses"
        return f"{who} this config: {head.partition(': ')[2] or head}"
    if o.status == "error" and o.message:
        r = refused_at_initialize(o.message)
        if r is not None:
            return (f"DeepSpeed {o.case.ds.release} refuses this config: {r.etype}: {r.message} "
                    f"({r.innermost.where}), raised inside deepspeed.initialize")
    return None


def user_exit(o) -> int:
    """The exit code a user gets for one column's outcome."""
    if refusal_sentence(o) is not None:
        return EXIT_BAD_INPUT
    if o.status in ("passed", "xpassed"):
        b = basis(o)
        return EXIT_CANNOT_JUDGE if b is not None and b.empty_reason() else EXIT_OK
    if o.status in ("xfailed", "failed"):
        return EXIT_DIVERGED
    if o.status == "unjudged":
        return EXIT_CANNOT_JUDGE
    return EXIT_RUN_FAILED
