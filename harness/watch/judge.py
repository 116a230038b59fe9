"""A watched run judged by the harness's own judge: every step replayed by the float64 oracle from
DeepSpeed's own previous state (teacher forcing), each quantity under the same tolerance model, and the
decision (passed, a known bug's model matched, diverged) taken by the gate's own code.

Two things differ from a case the harness built, and both are stated in the verdict's notes:

* No model to differentiate: the gradient reference of each step is the mean of the ranks' own
  micro-batch gradients as the hooks read them (``RecordedGradients``, in the place the module oracle of
  a real model takes). What DeepSpeed does with them from there on (averaging, loss-scale units, the
  accumulation window, Muon, clipping, the masters) is judged as for any case; the backward itself is not.
* A watched subset: the oracle steps only the watched parameters, in the full model's layout (partition,
  region, Newton-Schulz calls per rank). The global norm needs every parameter: where some are not
  watched, the clip takes DeepSpeed's own reported norm (``shared_norm``, as a model-parallel replica
  takes rank 0's) and the norm itself is not judged.
"""
from __future__ import annotations

from dataclasses import replace

import oracles
from harness.gate import decide
from harness.judge import checks, verdict
from harness.judge.compare import missing
from harness.registry.bugs import bugs_for
from harness.watch.records import WatchedRun
from oracles import replay

NOT_JUDGED_PARTIAL = ("global_norm",)


class RecordedGradients:
    """The module oracle's place in the judge, filled from the recording: ``gradients`` is each rank's
    micro-batch gradients, the allowance the reduction's alone (these are the very values DeepSpeed
    reduced), and there are no buffers to compare."""

    def __init__(self, grads: dict):
        self.grads = grads

    def gradients(self, step: int, lp_weights: dict, scale: float):
        return [[dict(g) for g in rank] for rank in self.grads[step]]

    def grad_allowance(self, name: str, base: oracles.Allowance) -> oracles.Allowance:
        return base

    def check_buffers(self, rec, add) -> None:
        return None


def _reported_true_norm(rec, conv: oracles.Conventions) -> float | None:
    """DeepSpeed's reported norm in the units ``oracles.step``'s ``shared_norm`` takes (true units)."""
    if rec.global_norm is None:
        return None
    return float(rec.global_norm) / (rec.loss_scale if conv.reported_norm == "raw" else 1.0)


class WatchJudge:
    """``verdict.judge``'s signature over one watched run, for ``harness.gate.decide``."""

    def __init__(self, run: WatchedRun):
        self.run = run

    def __call__(self, case, traj, *, conventions: oracles.Conventions | None = None, mode: str | None = None,
                 keep_maps: bool = True) -> verdict.Verdict:
        mode = mode or self.mode(case)
        try:
            return self._judge(case, traj, conventions or verdict.INTENDED, mode, keep_maps)
        except checks.Uncaptured as exc:
            v = verdict.Verdict(case, mode)
            v.checks.append(missing(case.name, "<case>", "capture", 0, str(exc)))
            return v

    def mode(self, case) -> str:
        """The emulation of DeepSpeed's 16-bit Newton-Schulz is bit-exact on the CPU only: ranks that ran
        on an accelerator are judged with the derived 16-bit allowance ("exact" mode) instead."""
        mode = verdict.comparison_mode(case)
        return "exact" if mode == "emulated" and self.run.device != "cpu" else mode

    def _run_view(self, case, conv, mode: str, keep_maps: bool, v: verdict.Verdict) -> checks.Run:
        full = self.run.full
        sc, sc_full = verdict.step_config(case), verdict.step_config(full)
        layout = verdict.layout_for(full, sc_full)
        spec = {p.name: p for p in sc.params}
        calls = verdict.expected_muon_calls(full, replace(sc_full, params=sc.params), layout)
        return checks.Run(case, conv, mode, sc, spec, case.name,
                          checks.add_check(v.checks, case.name, checks.OracleLayout(layout), spec, keep_maps),
                          v.checks, v.notes, mo=RecordedGradients(self.run.grads),
                          reports_norm=verdict.reports_global_norm(case),
                          norm_disabled=verdict.grad_norm_disabled(case),
                          muon_calls=replay.muon_calls(conv, calls))

    def _judge(self, case, traj, conv, mode: str, keep_maps: bool) -> verdict.Verdict:
        v = verdict.Verdict(case, mode)
        run = self._run_view(case, conv, mode, keep_maps, v)
        state = oracles.initial_state(run.sc, checks.start_weights(case, traj, conv), conv)
        prev = None
        partial = self.run.partial
        for rec in traj.steps:
            norm_of = {rec.step: _reported_true_norm(rec, conv)} if partial else None
            state, _ = verdict._judge_step(run, traj, rec, prev, state, list(range(case.dp_size)), 0, norm_of)
            prev = rec
        if partial:
            v.checks[:] = [c for c in v.checks if c.quantity not in NOT_JUDGED_PARTIAL]
            v.notes.append(f"{len(case.params)} of {len(self.run.full.params)} parameters watched: the clip "
                           "took DeepSpeed's reported global norm, which is not judged (--params '*' judges it)")
        v.notes.append("gradient reference: the ranks' own micro-batch gradients (the backward is not judged)")
        if self.run.device != "cpu" and mode == "exact":
            v.notes.append(f"ranks ran on {self.run.device}: Newton-Schulz judged with the derived 16-bit allowance "
                           "(its emulation is bit-exact on the CPU only)")
        return v


def decide_run(run: WatchedRun) -> decide.Outcome:
    """The gate's decision on the watched run, in the column its fixes put it in: patched where the
    bundled fixes were active in the ranks, stock otherwise (and then a known bug's model may explain a
    divergence)."""
    column = "patched" if run.fixes else "stock"
    case = run.case.replace(patched=column == "patched")
    return decide.decide_captured(case, column, run.trajectory, WatchJudge(run))


def known_bugs(run: WatchedRun) -> list:
    return bugs_for(run.case, patched=bool(run.fixes))
