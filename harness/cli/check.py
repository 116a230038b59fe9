"""``python -m harness check``: check *your* DeepSpeed config against the oracle.

Usage::

    python -m harness check --ds-config my_config.json [--shapes 4096x4096,4096x11008,...]
                            [--world-size N] [--steps K] [--seed S] [--report out.html | --no-report]
                            [--patched] [--launcher pool|torchrun] [--accelerator auto|cpu|cuda]
                            [--timeout SECONDS] [-q] [--json]

The config is taken as it is -- ZeRO stage, offload, precision, clipping, accumulation, Muon
parameters -- and run on a small synthetic model with the given matrix shapes (each matrix gets an
Adam-side bias vector of its row count; a 1-D entry in ``--shapes`` is an Adam vector of its own)
against the float64 oracle, through the gate's own decision (``harness.gate.decide.evaluate``). It prints a
verdict per quantity, the known stock DeepSpeed bugs that explain a divergence, the report path and
the command that reruns exactly this case.

Exit codes: 0 within tolerance; 1 diverged (including divergences a known stock DeepSpeed bug
explains -- your config is affected); 2 bad input, or a config DeepSpeed refuses (never a pass: your
training would crash at start-up), reported before any rank starts where ``harness.registry.refusals``
knows the refusal, else as soon as ``deepspeed.initialize`` raised it; 3 the run itself
failed (a rank raised, died or timed out: no verdict; a known stock bug that crashes, e.g. DSM-012, is
named); 4 cannot judge: nothing diverged, but a quantity DeepSpeed produced has no finite reference
(the message names the step, the tensor and the loss scale), or no applied step moved a weight (every
step skipped on overflow or applied at lr 0), so the verdict is not a pass. Every verdict line says
what it rests on: applied, skipped and zero-lr steps, and the steps at which weights moved. With
``--patched`` both the stock and the patched column run, the output says whether the bundled fixes
change the verdict, and the exit code is the patched column's (what you get with the fixes).

Scale-down rule (``harness.cli.check_shapes.scale_shapes``)
-------------------------------------------------------
A model whose largest tensor exceeds ``MAX_TENSOR_NUMEL`` (65,536 elements, 256x256) or whose total
exceeds ``MAX_TOTAL_NUMEL`` (262,144) is scaled down by one common element factor

    f = min(1, MAX_TENSOR_NUMEL / max numel, MAX_TOTAL_NUMEL / total numel)

Each dimension ``d`` of a ``k``-dimensional tensor becomes the value ``d'`` nearest to ``d * f**(1/k)``
with ``d' == d (mod 2W)`` (``W`` the harness world size), ``min(d, MIN_DIM) <= d' <= d`` (``MIN_DIM``
= 8). Consequences, all checked by ``cases/cli/test_check_units.py``:

* aspect ratios are kept (to one step of ``2W`` per dimension); relative sizes of the tensors too;
* ``numel mod 2W`` of every tensor is kept (a product of dimensions congruent mod ``2W`` is congruent),
  hence ``numel mod W``: a tensor divisible by the world size stays divisible, a padded one keeps its
  padding length -- ZeRO-3 pads each parameter to a multiple of ``W`` -- and the total of each
  optimizer group keeps its residue mod ``2W`` -- ZeRO-1/2 pad the flat group to a multiple of ``2W``;
* which ZeRO-3 partitions hold padding (ranks ``r`` with ``(r+1) * ceil(n/W) > n``) is the same as
  for the original shape: a tensor where that would differ (only possible for very small ones) gets
  its largest dimension grown by ``2W`` steps until it matches (the original always does);
* not kept: where a partition cut falls inside a tensor, and so which tensors straddle a cut in the
  ZeRO-1/2 flat buffer -- that depends on absolute sizes. Shapes within budget are run unscaled.

ZeRO-3 with NVMe offload swaps only sub-groups of at least 1 MiB per rank (``harness.case.nvme``); when the
scaled model has none, a swap-sized matrix (``harness.case.nvme.nvme_matrix``) is added and the output says
so. An explicit ``sub_group_size`` is multiplied by ``f``, so sub-group cuts scale with the model.

What is rewritten in the config (always said in the output)
-----------------------------------------------------------
* batch sizes, for the harness's world size: ``gradient_accumulation_steps`` is kept (it is what
  changes the numerics; derived as DeepSpeed would at the harness's world size when only
  ``train_batch_size`` and the micro batch are given, else 1), ``train_micro_batch_size_per_gpu`` is
  kept (1 if absent; the synthetic data has its own rows), and
  ``train_batch_size = micro x accumulation x W``. ``"auto"`` counts as absent;
* NVMe ``nvme_path`` (optimizer and parameter offload): absent -> a private swap folder per case;
  given -> it must be an existing, writable directory (else bad input), and each run uses a fresh
  private sub-folder of it, removed afterwards;
* ``scheduler`` kept (the oracle computes each group's lr per step, ``oracles.schedules``; a schedule
  it cannot compute is bad input); monitors and profilers (tensorboard, wandb, csv_monitor, comet,
  flops_profiler, comms_logger) and
  ``elasticity`` disabled; ``optimizer.params.per_head_muon`` removed (the synthetic model has no
  attention module for DeepSpeed to tag); ``steps_per_print`` / ``wall_clock_breakdown`` silenced.

Bad input (exit 2, before any rank starts; ``harness.cli.check_plan.validate``)
--------------------------------------------------------------------------
* the file: unreadable, not strict JSON (line and column), not an object, duplicate keys (DeepSpeed
  rejects them too);
* ``--shapes`` malformed (which entry), ``--world-size`` outside ``1 .. min(8, 2 x cpu_count)`` (for
  CUDA: the number of visible GPUs), ``--steps`` outside 1..50;
* optimizer missing or not Muon;
* DeepSpeed's own validation: ``deepspeed.runtime.config.DeepSpeedConfig`` on the rewritten config
  (its pydantic models reject unknown keys and bad values: the message names the key; values are read
  as those models read them, so ``"stage": "3"`` is stage 3), ``ns_method`` not gram/standard,
  ``max_grad_norm`` in the optimizer params, non-numeric optimizer hyper-parameters or
  ``gradient_clipping``;
* the Muon-specific refusals DeepSpeed only makes inside ``deepspeed.initialize``, each as
  ``harness.registry.refusals`` declares it (ZeRO-3 with ``reduce_scatter``, on by default: "Muon and
  reduce scatter cannot be used together"; ZeRO-3 with ``zero_quantized_gradients``; ...): "DeepSpeed
  0.19.8 refuses this config: <its words> (<file>:<function>); to run it: <the change>";
* outside what the harness covers: ZeRO stage 0 / no ``zero_optimization``;
* an NVMe path that is not an existing writable directory;
* ``--launcher pool`` with ``--accelerator cuda`` (the pool runs CPU ranks).

Launchers: ``pool`` (default; CPU ranks over gloo, ``harness.launch.pool``) or ``torchrun``
(``harness.launch.torchrun``: ``torch.distributed.run`` with ``env://`` and the accelerator's backend, nccl
on CUDA). Progress: a line when each case starts and ends, then one line per step once the case's
trajectory arrives (the ranks hand the whole trajectory back at the end). ``-q`` prints only the
verdict and report lines; ``--json`` prints exactly one JSON object on stdout (everything else,
DeepSpeed's logging included, goes to stderr).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from harness.env import buildenv

if __name__ == "__main__":
    # Run as ``python -m harness.cli.check``: the imports below reach torch (harness.case.spec -> oracles), which
    # reads OMP_NUM_THREADS once, at import; ``main`` would set it too late (the parent then judges on
    # every core and never forks its rank pools). ``python -m harness check`` sets it in its own main.
    buildenv.apply_base_env()

from harness.case.nvme import swap_expected  # noqa: E402
from harness.case.spec import Case, canonical_json  # noqa: E402
from harness.cli.check_config import BadInput, ModelFailed, Refused  # noqa: E402
from harness.cli.check_plan import Plan, validate  # noqa: E402
from harness.cli.check_shapes import _fmt_shape, build_params, padded_ranks  # noqa: E402
from harness.cli.parser import add_check_arguments  # noqa: E402
from harness.judge import as_defined
from harness.judge import departures as departure_judge
from harness.judge.verdict import reproduce_command
from harness.registry.departures import DEPARTURES
from oracles.tolerance import ratio_text

from harness.cli.check_verdict import (EXIT_BAD_INPUT, EXIT_CANNOT_JUDGE, EXIT_DIVERGED, EXIT_OK,  # noqa: E402
                                       EXIT_RUN_FAILED, basis, refusal_sentence, steps_past_warmup, user_exit)

VERDICT_WORDS = {EXIT_OK: "pass", EXIT_DIVERGED: "diverged", EXIT_BAD_INPUT: "refused", EXIT_RUN_FAILED: "error",
                 EXIT_CANNOT_JUDGE: "cannot judge"}
QUANTITY_ORDER = ("grad", "momentum", "update", "master", "model", "global_norm", "loss_scale",
                  "loss_scale_after", "skipped", "muon_calls", "swap")


# --------------------------------------------------------------------------------------------------
# running and reporting


class _Out:
    """Human output: stdout normally, stderr under --json, nothing but verdict lines under -q."""

    def __init__(self, quiet: bool, stream):
        self.quiet = quiet
        self.stream = stream

    def __call__(self, msg: str = "", *, essential: bool = False) -> None:
        if self.quiet and not essential:
            return
        print(msg, file=self.stream, flush=True)


def _record_json(check) -> dict | None:
    """The one divergence record (``oracles.Divergence``) as JSON (non-finite numbers as strings)."""
    from dataclasses import asdict

    if check.record is None:
        return None
    return {k: (_finite(v) if isinstance(v, float) else v) for k, v in asdict(check.record).items()}


def _finite(x):
    if x is None:
        return None
    x = float(x)
    if math.isfinite(x):
        return x
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")


_ratio_txt = ratio_text  # the report's and the judge's way of writing a ratio ("> 1e30" past meaning)


def worst_by_quantity(outcome) -> dict[str, float]:
    """Worst ratio per compared quantity (a check that cannot be judged has none: ``_unjudged_by_quantity``)."""
    out: dict[str, float] = {}
    if outcome.verdict is not None:
        for c in outcome.verdict.checks:
            if c.unjudged is None:
                out[c.quantity] = max(out.get(c.quantity, 0.0), c.worst_ratio)
    return out


def _unjudged_by_quantity(outcome) -> dict[str, list]:
    out: dict[str, list] = {}
    if outcome.verdict is not None:
        for c in outcome.verdict.unjudged:
            out.setdefault(c.quantity, []).append(c)
    return out


def _first_fail_by_quantity(outcome) -> dict[str, object]:
    firsts = {}
    if outcome.verdict is not None:
        for c in sorted(outcome.verdict.failures, key=lambda c: (c.step, -c.worst_ratio)):
            firsts.setdefault(c.quantity, c)
    return firsts


def _step_lines(outcome) -> list[str]:
    traj, verdict = outcome.trajectory, outcome.verdict
    if traj is None or verdict is None:
        return []
    lines = []
    for rec in traj.steps:
        unjudged = [c for c in verdict.unjudged if c.step == rec.step]
        checks = [c for c in verdict.checks if c.step == rec.step and c.unjudged is None]
        worst = max(checks, key=lambda c: c.worst_ratio, default=None)
        loss = sum(rec.losses) / len(rec.losses) if rec.losses else float("nan")
        parts = [f"loss {loss:.5g}", f"loss scale {rec.loss_scale:g}"]
        if rec.skipped:
            parts.append("SKIPPED (overflow)")
        if rec.global_norm is not None:
            parts.append(f"global norm {rec.global_norm:.4g}")
        if rec.swap_bytes_written or rec.swap_bytes_read:
            parts.append(f"swap {rec.swap_bytes_written / 2**20:.1f}/{rec.swap_bytes_read / 2**20:.1f} MiB w/r")
        if worst is not None:
            bad = sum(1 for c in checks if not c.passed)
            parts.append(f"worst {_ratio_txt(worst.worst_ratio)}x allowance ({worst.param} {worst.quantity})"
                         + (f", {bad} of {len(checks)} checks out of tolerance" if bad else ", all within tolerance"))
        if unjudged:
            parts.append(f"CANNOT JUDGE {len(unjudged)} captured quantity(ies): "
                         + ", ".join(f"{c.param} {c.quantity}" for c in unjudged))
        lines.append(f"    step {rec.step}: " + ", ".join(parts))
    return lines


def _status_text(o) -> str:
    if refusal_sentence(o) is not None:
        return "REFUSED (exit 2: this config does not run)"
    if user_exit(o) == EXIT_CANNOT_JUDGE and o.status in ("passed", "xpassed"):
        return "CANNOT JUDGE"
    if o.status == "passed":
        return "PASS"
    if o.status == "xpassed" and o.column == "patched":
        return f"PASS (the bundled fixes remove {', '.join(o.bug_ids)}, which the bug registry lists as unfixed)"
    if o.status == "xpassed":
        return f"PASS (known bug {', '.join(o.bug_ids)} was expected on this pipeline but did not show)"
    if o.status == "xfailed":
        return f"DIVERGED (known stock DeepSpeed bug {', '.join(o.bug_ids)})"
    if o.status == "failed":
        return "DIVERGED" + (f" (beyond known bug {', '.join(o.bug_ids)})" if o.bug_ids else "")
    if o.status == "unjudged":
        return "CANNOT JUDGE" + (f" (known stock DeepSpeed bug {', '.join(o.bug_ids)} matched elsewhere)"
                                 if o.bug_ids else "")
    return "ERROR (the run failed; no verdict)"


def _trim_message(msg: str, max_lines: int = 24) -> str:
    """The gate's message without its per-failure reproducer lines (printed once, at the end)."""
    lines = [ln for ln in msg.splitlines() if not ln.strip().startswith("reproduce: ")]
    if len(lines) > max_lines:
        lines = lines[:max_lines] + [f"... ({len(lines) - max_lines} more lines in the report)"]
    return "\n".join(lines)


def known_bug_info(case: Case) -> list[dict]:
    from harness import fixes as patched_runtime
    from harness.registry.bugs import bugs_for

    out = []
    for b in bugs_for(case):
        # the fix that acts on this case's stage (DSM-001 has one for ZeRO-1/2 and one for ZeRO-3)
        fixes = patched_runtime.fixes_for(b.id, case.stage)
        fix = " + ".join(fixes or b.fixed_by) or None
        out.append({"id": b.id, "title": b.title, "symptom": b.symptom, "where": b.where, "fix": fix,
                    "fixed_by_patched": bool(fixes)})
    return out


def _bug_sentence(b: dict) -> str:
    observed = b.get("observed_fixed_by_patched")
    if observed is not None:
        fix = "--patched FIXES it (observed in this run)" if observed else "--patched does NOT fix it (observed)"
    elif b["fixed_by_patched"]:
        fix = f"fixed by --patched (bundled fix {b['fix']!r})"
    else:
        fix = ("not listed as fixed by the bundled fixes" if b["fix"] is None
               else f"its fix {b['fix']!r} is not in this patched runtime") + "; run with --patched to see"
    return f"{b['id']} ({b['title']}): {fix}"


def _pipeline_text(case: Case) -> str:
    clip = case.ds.gradient_clipping
    return (f"ZeRO-{case.stage}, offload {case.offload}, {case.dtype}, accumulation {case.grad_accum}, "
            f"clipping {clip if clip else 'off'}, world size {case.world_size}, {case.steps} steps")


def _shown(s, ds) -> bool:
    """Whether a resolved setting bears on this pipeline: the loss scaler only with fp16, the swapper and
    aio only with NVMe, parameter offload only at ZeRO-3."""
    if s.key.startswith("fp16.") and s.key != "fp16.enabled":
        return ds.model_dtype == "fp16"
    if s.key.startswith("zero_optimization.offload_param."):
        return ds.zero.stage == 3
    if s.key.startswith(("zero_optimization.offload_optimizer.", "aio.")) and not s.key.endswith(".device"):
        return ds.offload == "nvme"
    return True


def resolved_lines(case: Case) -> list[str]:
    """The values the run and its oracle take from the config, each with its source (``config``, or the
    installed DeepSpeed's documented default)."""
    ds = case.ds
    return [f"    {s.key} = {s.value!r}  ({s.source})" for s in ds.settings if _shown(s, ds)]


def param_rows(case: Case) -> list[tuple[str, str, str, str]]:
    """(name, shape, "Muon"/"Adam", why) per parameter of the case, in model order: a user sees which of
    their parameters DeepSpeed put on Muon (``oracles.layout.deepspeed_uses_muon``) and why."""
    from oracles.layout import deepspeed_muon_reason

    return [(p.name, _fmt_shape(p.shape), "Muon" if p.uses_muon else "Adam", deepspeed_muon_reason(p.name, p.shape))
            for p in case.params]


def unknown_key_lines(case: Case) -> list[str]:
    """A warning for each key of the config the installed DeepSpeed does not know: DeepSpeed ignores an
    unknown top-level key without a word, so a misspelt ``gradient_clipping`` runs at the default."""
    return [f"  warning: {u.key} is no key DeepSpeed {case.ds.release} reads"
            + (f" (did you mean {u.closest}?)" if u.closest else "") for u in case.ds.unknown_keys]


@contextlib.contextmanager
def _stdout_to_stderr():
    """--json: fd 1 carries only the final JSON object; anything else printed (DeepSpeed's logger, C
    extensions) lands on stderr. Yields a file for the JSON."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    real = os.fdopen(saved, "w")
    try:
        yield real
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        real.close()


def _columns_case(plan: Plan, column: str, uid: str) -> tuple[Case, list[Path]]:
    """The case one column runs: the user's writable NVMe path gets a fresh private sub-folder."""
    if not plan.nvme_user_dirs:
        return plan.case, []
    cfg = plan.case.config
    made = []
    zero = cfg["zero_optimization"]
    for key, base in plan.nvme_user_dirs.items():
        sec = key.split(".", 1)[1]
        sub = base / f"muon-harness-{uid}-{column}-{sec}"
        zero[sec]["nvme_path"] = str(sub)
        made.append(sub)
    return plan.case.replace(ds_config=canonical_json(cfg)), made


def _report(outcomes, report: str | None, extra: dict):
    if report is None:
        return None, "--no-report"
    from harness.gate import decide as gate
    from harness.report import results
    from harness.report.build import render, save_extra

    report_path = Path(report)
    results_dir = report_path.with_name(report_path.stem + "-results")
    shutil.rmtree(results_dir, ignore_errors=True)
    try:
        store = results.ResultStore(results_dir, writer="check")
        for o in outcomes:
            gate.record(store, o)
        save_extra(results_dir, extra, name="check")  # a rebuilt report (python -m harness report) leads alike
        out = render(results_dir, report_path, extra=extra)
        return str(out or report_path), None
    except Exception as exc:  # a broken report must not change the verdict
        return None, f"report failed: {type(exc).__name__}: {exc}"


def run_check(args) -> int:
    """Plan, run, print. Every exit prints its cause in one line (and one JSON object under --json):
    bad input exits 2 before any rank; a model factory that raised, or the harness itself breaking, exits
    3 (no verdict, never "diverged")."""
    json_mode = bool(args.json)
    with contextlib.ExitStack() as stack:
        json_out = stack.enter_context(_stdout_to_stderr()) if json_mode else None
        out = _Out(args.quiet, sys.stderr if json_mode else sys.stdout)
        try:
            plan = validate(args)
            code, result = _execute(plan, args, out)
        except BadInput as exc:
            word = "refused" if isinstance(exc, Refused) else "bad_input"
            code, result = EXIT_BAD_INPUT, _failure_json(args, word, EXIT_BAD_INPUT, str(exc))
        except ModelFailed as exc:
            code, result = EXIT_RUN_FAILED, _failure_json(args, "error", EXIT_RUN_FAILED, str(exc))
        except Exception as exc:  # the harness itself broke: no verdict, never "diverged"
            import traceback

            traceback.print_exc(file=sys.stderr)
            code, result = EXIT_RUN_FAILED, _failure_json(args, "error", EXIT_RUN_FAILED,
                                                          f"{type(exc).__name__}: {exc}")
        if code in (EXIT_BAD_INPUT, EXIT_RUN_FAILED) and "status" not in result:
            print(f"error: {result['message']}", file=sys.stderr, flush=True)
        if json_out:
            json_out.write(json.dumps(result) + "\n")
        return code


def _basis_json(o) -> dict | None:
    b = basis(o)
    if b is None:
        return None
    return {"asked": b.asked, "applied": list(b.applied), "skipped": list(b.skipped),
            "lr_zero": {str(s): list(gs) for s, gs in b.lr_zero}, "lr_captured": b.lr_captured,
            "moved": list(b.moved), "muon_moved": list(b.muon_moved), "text": b.text(),
            "cannot_judge": b.empty_reason()}


def _failure_json(args, verdict: str, code: int, message: str) -> dict:
    return {"config": args.ds_config, "verdict": verdict, "exit_code": code, "message": message}


def _plan_lines(plan: Plan, bugs: list[dict]) -> list[str]:
    """What is about to run: the pipeline, the (scaled) model, the config rewrites, the known bugs."""
    case = plan.case
    lines = [f"harness check: {plan.config_path}",
             f"  pipeline: {_pipeline_text(case)}; launcher {plan.launcher} ({plan.accelerator})"]
    if plan.factor < 1.0:
        lines.append(f"  model scaled down (element factor {plan.factor:.3g}; the rule: python -m harness check "
                     f"--help), world size {case.world_size}:")
    else:
        lines.append(f"  model (within budget, unscaled), world size {case.world_size}:")
    W = case.world_size
    for a, b in zip(plan.requested, plan.run_shapes):
        na, nb = math.prod(a), math.prod(b)
        lines.append(f"    {_fmt_shape(a):>14s} -> {_fmt_shape(b):<12s} numel mod {W}: {na % W} -> {nb % W}; "
                     f"ZeRO-3 padded partitions {list(padded_ranks(na, W)) or 'none'} -> "
                     f"{list(padded_ranks(nb, W)) or 'none'}")
    n_muon = sum(1 for p in case.params if p.uses_muon)
    lines.append(f"    {len(case.params)} tensors: {n_muon} on Muon, {len(case.params) - n_muon} on Adam "
                 "(DeepSpeed's rule, per parameter):")
    lines += [f"      {name:40s} {shape:>12s}  {opt:4s}  {why}" for name, shape, opt, why in param_rows(case)]
    lines.append("  resolved settings (value, and where it comes from):")
    lines += resolved_lines(case)
    lines.append("  config rewritten for the harness:")
    lines += [f"    - {n}" for n in plan.notes]
    if bugs:
        lines.append("  known stock DeepSpeed bug(s) on this pipeline: " + "; ".join(_bug_sentence(b) for b in bugs))
    return lines


def _launcher(plan: Plan):
    """The launcher for the plan, and the line that says what it starts."""
    W = plan.case.world_size
    if plan.launcher == "torchrun":
        from harness.launch.torchrun import TorchrunManager

        return TorchrunManager(plan.accelerator), f"  starting {W} rank(s) with torchrun ({plan.accelerator}) per case"
    from harness.launch.pool import PoolManager

    return PoolManager(), f"  starting {W} CPU rank(s) (the first start imports torch and DeepSpeed)"


def _run_columns(plan: Plan, columns: list[str], out: _Out) -> dict:
    """Run the case in each column through the gate's decision; progress goes to ``out``."""
    from harness.gate.decide import evaluate

    manager, starting = _launcher(plan)
    out(starting)
    uid = uuid.uuid4().hex[:8]
    outcomes = {}
    made_dirs: list[Path] = []
    try:
        for i, col in enumerate(columns, 1):
            c, made = _columns_case(plan, col, uid)
            made_dirs += made
            out(f"[{i}/{len(columns)}] {col}: {c.name} start")
            o = _without_unmatched_bugs(evaluate(c, col, manager))
            outcomes[col] = o
            for line in _step_lines(o):
                out(line)
            out(f"[{i}/{len(columns)}] {col}: {c.name} done in {o.seconds:.1f}s: {_status_text(o)}")
    finally:
        manager.close()
        for d in made_dirs:
            shutil.rmtree(d, ignore_errors=True)
    return outcomes


def skipped_steps(o) -> list[int]:
    """The steps of the outcome's run that DeepSpeed skipped (fp16 overflow)."""
    b = basis(o)
    return [] if b is None else list(b.skipped)


def basis_text(o) -> str:
    """What a verdict rests on (``check_verdict.Basis``), and where nothing of the update reached a weight,
    why and how to get a judgement: a skipped step judges the skip and the loss scale, a step at lr 0 the
    update but not its application, so "within tolerance" over them is a weaker statement than it reads."""
    b = basis(o)
    if b is None:
        return ""
    text = f" [{b.text()}]"
    empty = b.empty_reason()
    if empty:
        more = steps_past_warmup(o.case, b) if b.lr_zero else None
        text += (f" CANNOT JUDGE: {empty}; "
                 + (f"run past the zero-lr warm-up: --steps {more}" if more else
                    "raise --steps, or lower fp16.initial_scale_power" if b.skipped else "check the schedule's lr"))
    return text


def _swap_text(o) -> str:
    """The swap folder's bytes against DeepSpeed's swap rule for the case (``harness.case.nvme.swap_expected``)."""
    moved = o.swapped_bytes > 0
    if swap_expected(o.case):
        return f"{o.swapped_bytes / 2**20:.1f} MiB moved to/from the swap folder" if moved else \
            "NOTHING written to the swap folder"
    return (f"{o.swapped_bytes / 2**20:.1f} MiB moved, but no sub-group reaches DeepSpeed's swap threshold"
            if moved else "nothing swapped, as DeepSpeed's swap threshold says for this model")


def swap_not_exercised_text(case: Case) -> str:
    """A pass on ZeRO-3 NVMe whose model has no sub-group at the swap threshold covers the offload path
    without the swap path: the verdict says so (the plan said why and what to pass)."""
    if case.offload != "nvme" or swap_expected(case):
        return ""
    return " [NVMe swapping not exercised: no sub-group of this model reaches the swap threshold; see the plan]"


def _without_unmatched_bugs(o):
    """An error outcome names no bug: the gate lists on it every bug the pipeline triggers, but a run
    that died matched none of them (a crash bug whose signature matched is an xfailed outcome), so a
    numerical bug id on it would blame the crash on that bug, in the output and in the report."""
    from dataclasses import replace

    return replace(o, bug_ids=[]) if o.status == "error" else o


@dataclass
class CheckResult:
    """What one ``check`` found: the plan, each column's outcome (``harness.gate.decide.Outcome``), the known
    bugs on the pipeline and the report written. ``text_lines`` and ``to_json`` render it."""

    plan: Plan
    columns: list[str]
    outcomes: dict
    bugs: list[dict]
    report_path: str | None
    report_note: str | None
    reproduce: str
    departures: list = field(default_factory=list)  # harness.judge.departures.Finding, on the decisive run
    strict_muon: bool = False  # --strict-muon: a departure from Muon as defined exits 1
    as_defined: dict | None = None  # harness.judge.as_defined.gap on the decisive run: all departures together

    @property
    def decisive(self):
        return self.outcomes[self.columns[-1]]

    @property
    def exit_code(self) -> int:
        code = user_exit(self.decisive)
        return EXIT_DIVERGED if code == EXIT_OK and self.strict_muon and self.departures else code

    @property
    def patched(self) -> bool:
        return "patched" in self.outcomes

    @property
    def patched_changes_verdict(self) -> bool | None:
        if not self.patched:
            return None
        return user_exit(self.outcomes["stock"]) != user_exit(self.outcomes["patched"])

    def per_quantity(self, col: str) -> tuple[dict, dict]:
        """(worst ratio, first failing check) per quantity of column ``col``; ``swap``: inf when an NVMe
        case wrote nothing to its swap folder."""
        o = self.outcomes[col]
        worst = worst_by_quantity(o)
        if o.swapped_bytes is not None:
            worst["swap"] = 0.0 if (o.swapped_bytes > 0) == swap_expected(o.case) else float("inf")
        return worst, _first_fail_by_quantity(o)

    def text_lines(self) -> list[tuple[str, bool]]:
        """The summary after the run, as (line, essential) pairs: ``-q`` prints only essential ones."""
        lines: list[tuple[str, bool]] = []

        def add(msg: str, essential: bool = False) -> None:
            lines.append((msg, essential))

        for col, o in self.outcomes.items():
            if o.verdict is None:
                continue
            worst, firsts = self.per_quantity(col)
            unjudged = _unjudged_by_quantity(o)
            add(f"  {col}: per quantity, worst |error| / allowance over all parameters and steps (<= 1 is within "
                "tolerance):")
            for q in sorted(set(worst) | set(unjudged),
                            key=lambda q: QUANTITY_ORDER.index(q) if q in QUANTITY_ORDER else 99):
                if q in unjudged:
                    cs = unjudged[q]
                    judged_txt = f"; the other checks {_ratio_txt(worst[q])}x at worst" if q in worst else ""
                    add(f"    {q:18s} CANNOT JUDGE {len(cs)} at step(s) {sorted({c.step for c in cs})} "
                        f"({', '.join(sorted({c.param for c in cs}))}){judged_txt}")
                    continue
                if q == "swap":
                    add(f"    {'swap':18s} {'ok' if worst[q] == 0.0 else 'DIVERGED':9s} {_swap_text(o)}")
                    continue
                first = firsts.get(q)
                where = f"  first at step {first.step}, {first.param}" if first else ""
                add(f"    {q:18s} {'DIVERGED' if first else 'ok':9s} {_ratio_txt(worst[q]):>9s}x{where}")
        if self.patched:
            s, p = self.outcomes["stock"], self.outcomes["patched"]
            add(f"  --patched: stock {_status_text(s)} -> patched {_status_text(p)}: the bundled fixes "
                + ("CHANGE the verdict" if self.patched_changes_verdict else "do not change the verdict"))
        for line in departure_lines(self.departures, self.strict_muon, self.as_defined):
            add(*line)
        for col in self.columns:
            o = self.outcomes[col]
            line = _status_text(o)
            if o.status == "xfailed":
                line = "DIVERGED: the divergence is known stock DeepSpeed bug " + "; ".join(
                    _bug_sentence(b) for b in self.bugs if b["id"] in o.bug_ids)
            elif refusal_sentence(o) is not None:
                line += ": " + refusal_sentence(o)
            elif o.status == "passed" and o.verdict is not None and user_exit(o) == EXIT_OK:
                line += f": every quantity within tolerance (worst {_ratio_txt(o.verdict.worst_ratio)}x its allowance)"
            elif o.status == "error":
                line += ": " + (o.message.splitlines()[0] if o.message else "")
            elif o.status == "unjudged" and o.verdict is not None:
                line += ": " + "; ".join(c.unjudged for c in o.verdict.unjudged)
            label = "verdict" if not self.patched else f"verdict ({col})"
            add(f"{label}: {line}{basis_text(o)}{swap_not_exercised_text(o.case)}", True)
        decisive = self.decisive
        if decisive.status == "error" and decisive.message:
            tail = decisive.message.splitlines()[-15:]
            add("  ...\n  " + "\n  ".join(tail))
        elif decisive.status != "passed" and decisive.message:
            add("  " + _trim_message(decisive.message).replace("\n", "\n  "))
        add(f"report: {self.report_path}" if self.report_path else f"report: none ({self.report_note})", True)
        add(f"reproduce: {self.reproduce}")
        if any(self.plan.nvme_user_dirs):
            add("  (the reproducer names the private swap sub-folder this run used; it is created again on rerun)")
        return lines

    def to_json(self) -> dict:
        plan, case, decisive = self.plan, self.plan.case, self.decisive
        code = self.exit_code
        worst, _ = self.per_quantity(self.columns[-1])
        first = decisive.verdict.first if decisive.verdict is not None else None
        return {
            "verdict": VERDICT_WORDS[code],
            "exit_code": code,
            "status": decisive.status,
            "column": self.columns[-1],
            "config": plan.config_path,
            "case": decisive.case.name,
            "pipeline": {"stage": case.stage, "offload": case.offload, "dtype": case.dtype,
                         "gradient_accumulation_steps": case.grad_accum,
                         "gradient_clipping": case.ds.gradient_clipping,
                         "world_size": case.world_size, "steps": case.steps},
            "launcher": plan.launcher,
            "accelerator": plan.accelerator,
            "shapes": {"requested": [list(s) for s in plan.requested], "run": [list(s) for s in plan.run_shapes],
                       "element_factor": plan.factor, "params": [[p.name, list(p.shape)] for p in case.params]},
            "rewrites": plan.notes,
            "resolved": {s.key: {"value": list(s.value) if isinstance(s.value, tuple) else s.value,
                                 "source": s.source} for s in case.ds.settings},
            "unknown_keys": [{"key": u.key, "closest": u.closest} for u in case.ds.unknown_keys],
            "skipped_steps": skipped_steps(decisive),
            "basis": _basis_json(decisive),
            "refused": refusal_sentence(decisive),
            "worst_ratio": {q: _finite(v) for q, v in worst.items()},
            "first_divergence": None if first is None else {
                "param": first.param, "quantity": first.quantity, "step": first.step,
                "ratio": _finite(first.worst_ratio), "rank": first.rank, "region": first.region,
                "record": _record_json(first), "problem": first.problem},
            "cannot_judge": [] if decisive.verdict is None else [
                {"param": c.param, "quantity": c.quantity, "step": c.step, "reason": c.unjudged}
                for c in decisive.verdict.unjudged],
            "bug_ids": list(decisive.bug_ids) if decisive.status in ("xfailed", "failed", "xpassed", "unjudged")
            else [],
            "known_bugs": [{k: b.get(k) for k in ("id", "title", "fix", "fixed_by_patched",
                                                   "observed_fixed_by_patched")} for b in self.bugs],
            "columns": {col: {"status": o.status, "bug_ids": list(o.bug_ids), "seconds": round(o.seconds, 3),
                              "worst_ratio": {q: _finite(v) for q, v in self.per_quantity(col)[0].items()},
                              "swapped_bytes": o.swapped_bytes}
                        for col, o in self.outcomes.items()},
            "patched_changes_verdict": self.patched_changes_verdict,
            "strict_muon": self.strict_muon,
            "as_defined": self.as_defined,
            "departures": [{"id": f.id, "title": f.title, "magnitude": f.magnitude, "removed_by": f.removed_by,
                            "detail": f.detail} for f in self.departures],
            "report": self.report_path,
            "report_note": self.report_note,
            "reproduce": self.reproduce,
            "message": decisive.message,
        }


def departure_lines(found: list, strict: bool, gap: dict | None = None) -> list[tuple[str, bool]]:
    """Muon as defined, the second reference, reported apart from DeepSpeed's intended one: each departure
    that applies with its size on this run and the change that removes it (docs/departures.md), and how far
    DeepSpeed's steps are from Muon's as defined with all of them together."""
    effect = "exit 1 (--strict-muon)" if strict else "the exit code does not count them (--strict-muon does)"
    whole = [(f"  against Muon as defined, step by step: {gap['summary']}", False)] if gap else []
    if not found:
        return whole + [("muon as defined: no departure of DeepSpeed's Muon from Muon as defined applies to this run",
                         True)]
    lines = [(f"  Muon as defined (a second reference; DeepSpeed intends these, so {effect}; docs/departures.md):",
              False)] + whole
    for f in found:
        lines += [(f"    {f.id} {f.title}: {f.magnitude}", False), (f"      removed by: {f.removed_by}", False)]
    lines.append((f"muon as defined: DEPARTS in {len(found)} way(s) ({', '.join(f.id for f in found)}); "
                  + ("exit 1 under --strict-muon" if strict else "not counted in the exit code"), True))
    return lines


def measure_departures(plan: Plan, o) -> list:
    """The departures that apply, measured on the run (none where it produced no trajectory). The sizes at
    the user's own shapes are estimated from the run's scaled ones (``plan.requested`` -> ``run_shapes``,
    named as ``build_params`` names both)."""
    if o.trajectory is None or refusal_sentence(o) is not None:
        return []
    real = {} if plan.case.model else {
        a.name: a.shape for a, b in zip(build_params(plan.requested), build_params(plan.run_shapes))
        if a.name == b.name}
    return departure_judge.findings(o.case, o.trajectory, departures=DEPARTURES, real_shapes=real or None)


def measure_as_defined(o) -> dict | None:
    """All departures together, step by step (``harness.judge.as_defined``); None where nothing ran."""
    if o.trajectory is None or refusal_sentence(o) is not None or not o.trajectory.muon_params:
        return None
    return as_defined.gap(o.case, o.trajectory)


def check(plan: Plan, *, patched: bool, report: str | None, no_report: bool, out: _Out,
          strict_muon: bool = False) -> CheckResult:
    """Run a validated plan (stock, and patched when asked), write the report, return the result.
    Progress goes to ``out`` as it happens; the summary is the result's to render."""
    from harness.cli.main_job import environment

    bugs = known_bug_info(plan.case)
    for line in _plan_lines(plan, bugs):
        out(line)
    for line in unknown_key_lines(plan.case):
        out(line, essential=True)
    columns = ["stock", "patched"] if patched else ["stock"]
    t_all = time.perf_counter()
    outcomes = _run_columns(plan, columns, out)
    if patched:
        s, p = outcomes["stock"], outcomes["patched"]
        for b in bugs:
            if b["id"] in s.bug_ids and s.status == "xfailed":
                b["observed_fixed_by_patched"] = user_exit(p) == EXIT_OK
    decisive = outcomes[columns[-1]]
    result = CheckResult(plan, columns, outcomes, bugs, None, None, reproduce_command(decisive.case),
                         measure_departures(plan, decisive), strict_muon, measure_as_defined(decisive))
    extra = {"environment": environment(), "check": report_facts(result), "elapsed_s": time.perf_counter() - t_all}
    if report is None and not no_report:
        report = str(buildenv.PROJECT_ROOT / "reports" / f"{decisive.case.name}.html")
    result.report_path, result.report_note = _report(list(outcomes.values()), None if no_report else report, extra)
    return result


def report_facts(result: CheckResult) -> dict:
    """What the check's report leads with (``harness.report.html``): the verdict exactly as the CLI
    prints it, the config, each resolved value with its source, the rewrites and the parameter table."""
    case = result.plan.case
    return {"config": str(Path(result.plan.config_path).resolve()),
            "exit_code": result.exit_code,
            "verdict_lines": [line for line, _ in result.text_lines() if line.startswith("verdict")],
            "resolved": [[s.key, repr(s.value), s.source] for s in case.ds.settings if _shown(s, case.ds)],
            "unknown_keys": unknown_key_lines(case),
            "notes": result.plan.notes,
            "params": [list(row) for row in param_rows(case)],
            "departures": [[f.id, f.title, f.magnitude, f.removed_by] for f in result.departures],
            "departure_lines": [line.strip() for line, essential in departure_lines(
                result.departures, result.strict_muon, result.as_defined) if essential or "step by step" in line],
            "shapes": [_fmt_shape(s) for s in result.plan.run_shapes]}


def _execute(plan: Plan, args, out: _Out) -> tuple[int, dict]:
    result = check(plan, patched=args.patched, report=args.report, no_report=args.no_report, out=out,
                   strict_muon=getattr(args, "strict_muon", False))
    for line, essential in result.text_lines():
        out(line, essential=essential)
    return result.exit_code, result.to_json()


# --------------------------------------------------------------------------------------------------
# command line


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness check", description=__doc__.splitlines()[0],
                                 epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_check_arguments(ap)
    args = ap.parse_args(argv)
    buildenv.apply_base_env()
    return run_check(args)


if __name__ == "__main__":
    sys.exit(main())
