"""The second computation each reported departure is held to (``harness.judge.departure_pins``), on
hand-built runs (Newton-Schulz forced to float64, ``Case.ns_dtype``, except where MUON-NS16 is the
point): one that behaves as DeepSpeed does passes, and one where DeepSpeed hid the departure
(clipped nothing, ran each half at its own lr, ran Newton-Schulz in float64) while the report says
otherwise fails, as does a claim the findings do not meet. No DeepSpeed rank runs."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from cases.harness.test_departures import B, W, _case, _cfg, _findings, _step
from harness.case.trajectory import ParamStep, Trajectory
from harness.catalog.departures import BROADCAST, OWN
from harness.env import device
from harness.judge import departure_pins as P
from harness.judge.departures import NOT_MEASURED, Finding
from oracles import clipping, schedules
from oracles.emulate import emulated_direction
from oracles.newton_schulz import muon_direction

RNG = np.random.default_rng(3)
LRS = {"muon-params": 0.02, "adam-params": 1e-3}


def _f32(a) -> np.ndarray:
    return np.asarray(a, np.float32).astype(np.float64)


def _clip_run(clip: float, norm: float, applied_factor: float | None) -> Trajectory:
    """One step of a Muon matrix at lr 0.02: the masters move by ``applied_factor`` x lr x O (fp32), the
    reported norm is ``norm``. ``applied_factor`` None: the factor DeepSpeed's clip applies to ``norm``."""
    theta, O = _f32(RNG.standard_normal((6, 3))), _f32(RNG.standard_normal((6, 3)))
    f = 1.0 / clipping.clip_coefficient(norm, clip) if applied_factor is None else applied_factor
    after = _f32(theta - LRS["muon-params"] * f * O)
    bias = _f32(RNG.standard_normal(6))
    params = {W: ParamStep(master=after, model=after, grad=None, update=O), B: ParamStep(master=bias, model=bias,
                                                                                         grad=None)}
    return Trajectory("t", {W: theta, B: bias}, [_step(1, norm=norm, params=params, group_lr=LRS)], muon_params=(W,))


def test_the_clip_factor_is_held_to_the_one_the_masters_moved_by():
    case = _case(_cfg(clip=0.05), ns_dtype="float64")
    honest = _clip_run(0.05, 2.5, None)
    assert P.problems(case, honest, _findings(case, honest), ("MUON-CLIP",)) == []
    hidden = _clip_run(0.05, 2.5, 1.0)  # the step was not clipped, the reported norm says it was
    wrong = P.problems(case, hidden, _findings(case, hidden), ("MUON-CLIP",))
    assert len(wrong) == 1 and wrong[0].startswith("MUON-CLIP: step 1, layer.weight: the masters moved by 1.0000")


def test_a_claim_the_findings_do_not_meet_is_a_problem():
    case = _case(_cfg(clip=0.05), ns_dtype="float64")
    run = _clip_run(0.05, 2.5, None)
    found = _findings(case, run)
    assert P.problems(case, run, found, ()) == ["MUON-CLIP was reported but does not apply to this case"]
    assert P.problems(case, run, found, ("MUON-CLIP", "MUON-SCHED-LR")) == [
        "MUON-SCHED-LR applies to this case but was not reported"]


def test_a_finding_without_data_or_without_a_second_computation_is_a_problem():
    case = _case(_cfg(), ns_dtype="float64")
    run = _clip_run(0.05, 2.5, None)
    blind = Finding("MUON-CLIP", "t", NOT_MEASURED + "no norm", "", {})
    assert P.problems(case, run, [blind], ("MUON-CLIP",)) == [f"MUON-CLIP: {NOT_MEASURED}no norm"]
    new = Finding("MUON-NEW", "t", "0.9", "", {})  # a departure declared without a pin
    assert "no second computation" in P.problems(case, run, [new], ("MUON-NEW",))[0]


def _sched_run(schedule: dict, steps: int = 3) -> Trajectory:
    """Steps whose groups ran at what ``schedule`` gives each half's configured lr (muon_lr 0.02, adam_lr 1e-3)."""
    recs = [_step(s, norm=1.0, group_lr={g: schedules.group_lr(schedule, lr, s - 1) for g, lr in LRS.items()})
            for s in range(1, steps + 1)]
    return Trajectory("t", {}, recs, muon_params=(W,))


def test_the_lr_each_half_ran_at_is_held_to_the_schedule_on_the_configs_own_keys():
    case = _case({**_cfg(lr=0.02, adam_lr=1e-3), "scheduler": BROADCAST}, ns_dtype="float64")
    broadcast = _sched_run(BROADCAST)
    assert P.problems(case, broadcast, _findings(case, broadcast), ("MUON-SCHED-LR",)) == []
    own = _sched_run(OWN)  # DeepSpeed kept each half's own lr: the finding's numbers no longer are the schedule's
    wrong = P.problems(case, own, _findings(case, own), ("MUON-SCHED-LR",))
    assert wrong and all("the schedule gives lr" in w for w in wrong)


@pytest.mark.skipif(not device.half_support()[0], reason="gram runs Newton-Schulz in fp16 only with fp16 support")
def test_the_16_bit_error_is_held_to_the_oracles_emulation_of_the_same_inputs():
    case = _case(_cfg(ns_method="gram"))
    beta = case.ds.optimizer.muon.momentum
    g = torch.from_numpy(RNG.standard_normal((6, 3))).float()
    m = torch.from_numpy(RNG.standard_normal((6, 3))).float()
    U = g.lerp(m, beta)

    def run(update) -> Trajectory:
        ps = ParamStep(master=np.zeros((6, 3)), model=np.zeros((6, 3)), grad=g.double().numpy(),
                       momentum=m.double().numpy(), update=update, grad_dtype="float32", momentum_dtype="float32")
        return Trajectory("t", {}, [_step(1, norm=1.0, params={W: ps}, group_lr=LRS)], muon_params=(W,))

    fp16 = run(emulated_direction(U, "gram", out_dtype=torch.float32, conv_aspect="last_two_dims").double().numpy())
    assert P.problems(case, fp16, _findings(case, fp16), ("MUON-NS16",)) == []
    exact = run(muon_direction(U.double(), "gram").float().double().numpy())  # as if run in float64
    wrong = P.problems(case, exact, _findings(case, exact), ("MUON-NS16",))
    assert len(wrong) == 1 and "16-bit Newton-Schulz as the oracle emulates it" in wrong[0]


def test_the_tp_cosine_is_held_to_the_tensor_parallel_judges_own_blocks():
    """A shard-wise update's cosine against the whole matrix's, recomputed with ``tp_verdict``'s block rule; a
    finding whose blocks were cut elsewhere (its number off) fails."""
    import dataclasses

    from harness.catalog.matrix import tp_cases
    from harness.judge.departures import findings
    from harness.registry.departures import DEPARTURES

    case = next(c for c in tp_cases() if c.departs)
    shapes = {p.name: p.shape for p in case.params}
    params = {n: ParamStep(master=np.zeros(s), model=np.zeros(s), grad=RNG.standard_normal(s),
                           momentum=RNG.standard_normal(s), update=np.zeros(s)) for n, s in shapes.items()}
    traj = Trajectory("t", {n: np.zeros(s) for n, s in shapes.items()}, [_step(1, params=params)],
                      muon_params=tuple(shapes))
    tp_only = [d for d in DEPARTURES if d.id == "MUON-TP-SHARD"]
    found = findings(case, traj, departures=tp_only)
    assert found and P.problems(case, traj, found, ("MUON-TP-SHARD",)) == []
    row = found[0].detail["steps"][0]
    off = dataclasses.replace(found[0], detail={**found[0].detail,
                                                "steps": [{**row, "cosine": row["cosine"] - 1e-6}]})
    wrong = P.problems(case, traj, [off], ("MUON-TP-SHARD",))
    assert len(wrong) == 1 and "by the tensor-parallel judge's blocks" in wrong[0]
