"""Departures of DeepSpeed's Muon from Muon as defined (``harness.registry.departures``) and their measurement
on a run (``harness.judge.departures``), on hand-built trajectories whose numbers are known: every expected
value is computed here by another route (a closed form, a scalar Newton-Schulz map, a rounding) than the
one the judge takes, so a wrong formula, unit or shape in the judge fails. No DeepSpeed rank runs.
"""
from __future__ import annotations

import ast
import dataclasses
import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from harness.case import dsconfig, schedule_lrs
from harness.case.spec import Case, ParamShape, canonical_json, ds_config
from harness.case.trajectory import ParamStep, StepRecord, Trajectory
from harness.env import device
from harness.judge import departures as J
from harness.models import roles
from harness.registry import departures as R
from harness.registry import docs
from oracles.newton_schulz import muon_direction, phi

W, B = "layer.weight", "layer.bias"  # a Muon matrix and an Adam vector


def _case(cfg: dict, params=((W, (6, 3)), (B, (6,))), **kw) -> Case:
    return Case("t", tuple(ParamShape(n, s) for n, s in params), canonical_json(cfg), **kw)


def _cfg(**kw) -> dict:
    return json.loads(ds_config(stage=1, **kw))


def _orthogonal(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """An exactly orthogonal matrix (orthonormal columns or rows) times Muon's aspect scale: ||.||_F is
    sqrt(rows/cols if rows > cols else 1) * sqrt(min(rows, cols)) by construction."""
    q, _ = np.linalg.qr(np.random.default_rng(seed).standard_normal((max(rows, cols), min(rows, cols))))
    q = q if rows >= cols else q.T
    return q * math.sqrt(max(1.0, rows / cols))


def _step(step=1, *, norm=None, params=None, group_lr=None, skipped=False, scale=1.0) -> StepRecord:
    return StepRecord(step, scale, scale, skipped, norm, 1, params=params or {}, group_lr=group_lr or {})


def _findings(case, traj, **kw):
    return J.findings(case, traj, departures=R.DEPARTURES, **kw)


def _by_id(found) -> dict:
    return {f.id: f for f in found}


# ------------------------------------------------------------------------------------------------
# MUON-CLIP


def test_clip_factor_at_run_and_real_shapes_and_the_textbook_factor():
    c, S = 0.5, 4.0  # the gradients carry a loss scale of 4, as fp16 gradients do
    rng = np.random.default_rng(1)
    O = _orthogonal(6, 3)
    g_w, g_b = rng.standard_normal((6, 3)), rng.standard_normal(6)
    adam_sq = float(np.sum(g_b ** 2))
    N = math.sqrt(2.0 * 3.0 + adam_sq)  # ||O||^2 = s^2 min = (6/3) * 3, plus Adam's true-unit gradient
    params = {W: ParamStep(master=g_w, model=g_w, grad=g_w * S, grad_scale=S, momentum=g_w, update=O),
              B: ParamStep(master=g_b, model=g_b, grad=g_b * S, grad_scale=S)}
    traj = Trajectory("t", {}, [_step(norm=N, params=params)], muon_params=(W,))
    case = _case(_cfg(clip=c))
    real = {W: (4096, 1024), B: (4096,)}
    f = _by_id(_findings(case, traj, real_shapes=real))["MUON-CLIP"]
    row = f.detail["steps"][0]
    assert row["factor"] == pytest.approx(c / (N + 1e-6), rel=1e-12)
    # textbook: the raw gradients' norm in true units
    assert row["textbook_factor"] == pytest.approx(c / (math.sqrt(np.sum(g_w ** 2) + adam_sq) + 1e-6), rel=1e-12)
    # real shapes: an exactly orthogonal update (rho 1) of 4096x1024 has ||O|| = 2 * 32; Adam's squared
    # norm grows with the element count, 4096/6
    real_norm = math.sqrt(64.0 ** 2 + adam_sq * 4096 / 6)
    assert row["rho"][W] == pytest.approx(1.0, rel=1e-12)
    assert row["real_factor"] == pytest.approx(c / (real_norm + 1e-6), rel=1e-12)
    assert "gradient_clipping 0.5" in f.magnitude and "real shapes" in f.magnitude


def test_the_real_shape_estimate_at_the_run_shapes_is_the_captured_norm():
    rng = np.random.default_rng(2)
    O = rng.standard_normal((5, 7))  # not orthogonal: rho is whatever it measures
    g_b = rng.standard_normal(5)
    params = {W: ParamStep(master=O, model=O, grad=O, momentum=O, update=O),
              B: ParamStep(master=g_b, model=g_b, grad=g_b)}
    own = math.sqrt(np.sum(O ** 2) + np.sum(g_b ** 2))
    traj = Trajectory("t", {}, [_step(norm=own, params=params)], muon_params=(W,))
    case = _case(_cfg(clip=0.1), params=((W, (5, 7)), (B, (5,))))
    row = J.clip_finding(case, traj, {W: (5, 7), B: (5,)})[1]["steps"][0]
    assert row["real_norm"] == pytest.approx(own, rel=1e-12)
    assert row["real_factor"] == pytest.approx(row["factor"], rel=1e-9)


def test_no_clip_finding_with_clipping_off():
    case = _case(_cfg(clip=0.0))
    assert not R.clip_acts_on_update(case)
    traj = Trajectory("t", {}, [_step(norm=3.0)], muon_params=(W,))
    assert "MUON-CLIP" not in _by_id(_findings(case, traj))


def test_a_config_without_the_key_is_judged_at_deepspeeds_default():
    cfg = _cfg(clip=0.25)
    del cfg["gradient_clipping"]
    case = _case(cfg)
    default = dsconfig.defaults().get("gradient_clipping")
    assert case.ds.gradient_clipping == default and "default" in case.ds.source("gradient_clipping")
    traj = Trajectory("t", {}, [_step(norm=3.0)], muon_params=(W,))
    found = _by_id(_findings(case, traj))
    assert ("MUON-CLIP" in found) == (default > 0)
    if default > 0:
        assert found["MUON-CLIP"].detail["gradient_clipping"] == default
        assert found["MUON-CLIP"].detail["steps"][0]["factor"] == pytest.approx(default / (3.0 + 1e-6))


def test_the_bf16_optimizer_route_clips_raw_gradients_so_no_clip_departure():
    cfg = _cfg(clip=1.0, dtype="bf16")
    cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    assert _case(cfg).ds.bf16_optimizer_route and not R.clip_acts_on_update(_case(cfg))


def test_a_step_without_a_reported_norm_is_not_measured():
    traj = Trajectory("t", {}, [_step(norm=None)], muon_params=(W,))
    magnitude, detail = J.clip_finding(_case(_cfg(clip=1.0)), traj)
    assert magnitude.startswith(J.NOT_MEASURED) and "factor" not in detail["steps"][0]


# ------------------------------------------------------------------------------------------------
# MUON-SCHED-LR and MUON-PLAIN-LR


def test_which_schedules_broadcast_one_lr():
    peak = {"warmup_max_lr": 1e-3}
    assert schedule_lrs.broadcast_lrs({"type": "WarmupLR", "params": peak}) == peak
    assert schedule_lrs.broadcast_lrs({"type": "WarmupLR", "params": {"warmup_num_steps": 5}}) == {}
    assert schedule_lrs.broadcast_lrs({"type": "WarmupLR", "params": {"warmup_max_lr": [0.02, 1e-3]}}) == {}
    # WarmupDecayLR's default peak is DeepSpeed's, read from its source
    decay = schedule_lrs.broadcast_lrs({"type": "WarmupDecayLR", "params": {"total_num_steps": 9}})
    assert decay == {"warmup_max_lr": schedule_lrs.schedule_default("WarmupDecayLR", "warmup_max_lr")} and decay
    assert schedule_lrs.broadcast_lrs({"type": "WarmupCosineLR", "params": {"total_num_steps": 9}}) == {}
    assert schedule_lrs.broadcast_lrs({"type": "StepLR", "params": {"step_size": 1}}) == {}


def _deepspeed_broadcasts() -> dict[str, set]:
    """Per DeepSpeed schedule class, the ``__init__`` arguments its body broadcasts to every group: passed to
    ``_format_param`` (directly or through a helper taking the same name) or listed in ``[x] * len(...)``;
    a class broadcasting nothing itself inherits its base's. Momentum arguments are left out."""
    path = Path(importlib.util.find_spec("deepspeed").submodule_search_locations[0]) / "runtime" / "lr_schedules.py"
    classes = {n.name: n for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef)}

    def own(cls) -> set:
        names = set()
        for node in ast.walk(cls):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "_format_param":
                names |= {a.id for a in node.args if isinstance(a, ast.Name)}
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult) and isinstance(node.left, ast.List):
                names |= {e.id for e in node.left.elts if isinstance(e, ast.Name)}
        return {n for n in names if "lr" in n and "mom" not in n}

    out = {}
    for name, cls in classes.items():
        found = own(cls)
        for base in (b.id for b in cls.bases if isinstance(b, ast.Name) and b.id in classes):
            found = found or own(classes[base])
        out[name] = found
    return out


def test_the_broadcast_table_matches_deepspeeds_source():
    ds = _deepspeed_broadcasts()
    for kind in ("WarmupLR", "WarmupDecayLR", "LRRangeTest", "OneCycle", "WarmupCosineLR"):
        assert ds[kind] == set(schedule_lrs.BROADCAST_LR_PARAMS.get(kind, ())), kind


def test_scheduled_lrs_against_the_configured_ones():
    muon_lr, adam_lr, peak = 0.02, 1e-3, 5e-4
    cfg = _cfg(lr=muon_lr, adam_lr=adam_lr)
    cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_max_lr": peak, "warmup_num_steps": 2}}
    case = _case(cfg)
    lrs = [{"muon-params": 0.0, "adam-params": 0.0}, {"muon-params": peak, "adam-params": peak}]
    traj = Trajectory("t", {}, [_step(i + 1, group_lr=g) for i, g in enumerate(lrs)], muon_params=(W,))
    f = _by_id(_findings(case, traj))["MUON-SCHED-LR"]
    last = {r["group"]: r for r in f.detail["steps"] if r["step"] == 2}
    assert last["muon-params"]["ratio"] == pytest.approx(peak / muon_lr)
    assert last["adam-params"]["ratio"] == pytest.approx(peak / adam_lr)
    assert f.detail["muon_to_adam"][-1] == pytest.approx({"step": 2, "used": 1.0, "configured": muon_lr / adam_lr})
    # the line shows the last step both halves ran at a non-zero lr, and the number every group was given
    lrs.append({"muon-params": 0.0, "adam-params": 0.0})
    traj = Trajectory("t", {}, [_step(i + 1, group_lr=g) for i, g in enumerate(lrs)], muon_params=(W,))
    line = _by_id(_findings(case, traj))["MUON-SCHED-LR"].magnitude
    assert "at step 2:" in line and f"warmup_max_lr {peak:g}" in line
    assert "MUON-PLAIN-LR" not in _by_id(_findings(case, traj))  # adam_lr is given


def test_a_schedule_that_keeps_each_groups_lr_is_no_departure():
    cfg = _cfg()
    cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": 2}}
    assert not R.scheduler_broadcasts_lr(_case(cfg))


def test_a_plain_lr_reaches_the_adam_half():
    cfg = _cfg(lr=0.03)
    del cfg["optimizer"]["params"]["adam_lr"]
    case = _case(cfg)
    assert R.plain_lr_reaches_adam(case)
    traj = Trajectory("t", {}, [_step(group_lr={"muon-params": 0.03, "adam-params": 0.03})], muon_params=(W,))
    f = _by_id(_findings(case, traj))["MUON-PLAIN-LR"]
    assert f.detail["adam_lr"] == 0.03 and [r["lr"] for r in f.detail["steps"]] == [0.03]
    assert f.detail["deepspeed_adam_default"] == dsconfig.defaults().get("adam.lr")
    # no group lrs recorded: said, not invented
    magnitude, _ = J.plain_lr_finding(case, Trajectory("t", {}, [_step()], muon_params=(W,)))
    assert magnitude.startswith(J.NOT_MEASURED)
    # adam_lr given: gone
    assert not R.plain_lr_reaches_adam(_case(_cfg(lr=0.03, adam_lr=1e-3)))


# ------------------------------------------------------------------------------------------------
# MUON-BY-NAME


def test_gpt2_embeddings_and_tied_head_go_to_muon_by_name():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=32, n_positions=8, n_embd=8, n_layer=1, n_head=2,
                                  tie_word_embeddings=True)
    module = transformers.GPT2LMHeadModel(cfg)
    embedding_weights = {id(m.weight) for m in module.modules() if isinstance(m, nn.Embedding)}
    expected = {n for n, p in module.named_parameters() if id(p) in embedding_weights}
    assert expected == {"transformer.wte.weight", "transformer.wpe.weight"}  # what the model itself names
    found = roles.misrouted(module)
    assert set(found) == expected
    assert any("lm_head.weight" in why for why in found["transformer.wte.weight"])  # tied and the output head
    case = _case(_cfg(), params=[(n, tuple(p.shape)) for n, p in module.named_parameters()])
    f = _by_id(_findings(case, Trajectory("t", {}, []), module=module))["MUON-BY-NAME"]
    assert {p["name"] for p in f.detail["params"]} == expected


class _HeadFirst(nn.Module):
    """Registers its output head before the body and an embedding named so DeepSpeed keeps it on Adam."""

    def __init__(self):
        super().__init__()
        self.classifier = nn.Linear(4, 3)
        self.embed = nn.Embedding(10, 4)
        self.body = nn.Linear(4, 4)

    def forward(self, ids):
        return self.classifier(torch.tanh(self.body(self.embed(ids)))).sum()


def test_the_output_head_is_found_by_the_forward_not_by_registration():
    m = _HeadFirst()
    assert roles.output_projection(m, {"ids": torch.tensor([1, 2])})[0] == "classifier"
    assert roles.output_projection(m)[0] == "body"  # registration order, no batch to trace
    assert set(roles.misrouted(m, {"ids": torch.tensor([1, 2])})) == {"classifier.weight"}  # "embed": Adam


def test_a_shapes_case_has_no_roles_to_read():
    case = _case(_cfg())
    assert not R.muon_by_name(case)
    assert "MUON-BY-NAME" not in _by_id(_findings(case, Trajectory("t", {}, [])))


# ------------------------------------------------------------------------------------------------
# MUON-TP-SHARD


Q = "layers.0.self_attn.q_proj.weight"


def _tp_case() -> Case:
    cfg = _cfg()
    cfg["tensor_parallel"] = {"autotp_size": 2}
    return _case(cfg, params=((Q, (4, 8)),))


def _tp_traj(U: np.ndarray) -> Trajectory:
    ps = ParamStep(master=U, model=U, grad=U, momentum=U, update=U)  # U = (1-b) U + b U
    return Trajectory("t", {}, [_step(params={Q: ps})], muon_params=(Q,))


def test_shard_wise_against_whole_on_orthonormal_rows():
    """Rows orthonormal: both Newton-Schulz runs keep the direction (cosine 1), and each singular value
    1/sqrt(rows) of the whole (1/sqrt(rows/2) of a shard) becomes phi_5 of it: the norm ratio is the
    scalar map's ratio."""
    U = _orthogonal(4, 8, seed=3)
    case = _tp_case()
    assert R.autotp_shards(case)
    row = _by_id(_findings(case, _tp_traj(U)))["MUON-TP-SHARD"].detail["steps"][0]
    assert row["cosine"] == pytest.approx(1.0, abs=1e-12)
    assert row["norm_ratio"] == pytest.approx(phi(1 / math.sqrt(2)) / phi(1 / 2), rel=1e-6)


def test_shard_wise_differs_on_a_general_matrix():
    U = np.random.default_rng(4).standard_normal((4, 8))
    row = J.tp_finding(_tp_case(), _tp_traj(U))[1]["steps"][0]
    assert row["cosine"] < 1 - 1e-3


def test_tp_without_the_whole_matrix_is_not_measured():
    ps = ParamStep(master=np.zeros((4, 8)), model=np.zeros((4, 8)), grad=None)
    traj = Trajectory("t", {}, [_step(params={Q: ps})], muon_params=(Q,))
    magnitude, detail = J.tp_finding(_tp_case(), traj)
    assert magnitude.startswith(J.NOT_MEASURED) and Q in magnitude and detail["steps"] == []


# ------------------------------------------------------------------------------------------------
# MUON-NS16


def test_ns16_error_is_the_error_of_the_captured_update():
    rng = np.random.default_rng(5)
    g, m = rng.standard_normal((6, 3)), rng.standard_normal((6, 3))
    beta = 0.9
    U = (1 - beta) * g + beta * m
    exact = muon_direction(torch.from_numpy(U), "gram").numpy()
    rounded = torch.from_numpy(exact).to(torch.bfloat16).double().numpy()
    want = np.linalg.norm(rounded - exact) / np.linalg.norm(exact)
    case = _case(_cfg(momentum=beta))
    assert R.ns_in_16_bit(case) == device.half_support()[0]  # DeepSpeed's default ns_method is gram
    # the gradient as the offload paths hand it over (times the loss scale), the momentum in true units
    S = 256.0
    ps = ParamStep(master=g, model=g, grad=g * S, grad_scale=S, momentum=m, update=rounded)
    row = J.ns16_finding(case, Trajectory("t", {}, [_step(params={W: ps})], muon_params=(W,)))[1]["steps"][0]
    assert row["relative_frobenius"] == pytest.approx(want, rel=1e-6) and want > 1e-4


def test_ns16_without_the_momentum_is_not_measured_and_float64_ns_is_no_departure():
    g = np.ones((6, 3))
    traj = Trajectory("t", {}, [_step(params={W: ParamStep(master=g, model=g, grad=g, update=g)})], muon_params=(W,))
    magnitude, _ = J.ns16_finding(_case(_cfg()), traj)
    assert magnitude.startswith(J.NOT_MEASURED) and W in magnitude
    assert not R.ns_in_16_bit(_case(_cfg(), ns_dtype="float64"))
    assert R.ns_in_16_bit(_case(_cfg(ns_method="standard"))) == device.half_support()[1]


# ------------------------------------------------------------------------------------------------
# the registry and its page


def test_every_departure_is_measured_and_named_once():
    assert set(J._MEASURES) == set(R.BY_ID) and len(R.BY_ID) == len(R.DEPARTURES)
    unknown = dataclasses.replace(R.DEPARTURES[0], id="MUON-UNMEASURED")
    with pytest.raises(ValueError, match="MUON-UNMEASURED"):
        J.findings(_case(_cfg()), Trajectory("t", {}, []), departures=(unknown,))
    for d in R.DEPARTURES:
        assert all(u.startswith("deepspeedai/DeepSpeed#") and u.split("#")[1].isdigit() for u in d.upstream)


def test_every_detail_is_strict_json():
    cfg = _cfg(clip=0.5, lr=0.02)
    del cfg["optimizer"]["params"]["adam_lr"]
    cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-3}}
    zero = np.zeros((6, 3))  # a zero update: no finite relative error, said so
    params = {W: ParamStep(master=zero, model=zero, grad=zero, momentum=zero, update=zero),
              B: ParamStep(master=np.ones(6), model=np.ones(6), grad=np.ones(6))}
    traj = Trajectory("t", {}, [_step(norm=2.0, params=params, group_lr={"muon-params": 0.0, "adam-params": 0.0})],
                      muon_params=(W,))
    found = _findings(_case(cfg), traj, real_shapes={W: (60, 30), B: (60,)})
    assert {"MUON-CLIP", "MUON-SCHED-LR", "MUON-PLAIN-LR"} <= {f.id for f in found}
    for f in found:
        json.dumps(f.detail, allow_nan=False)
        assert "\n" not in f.magnitude


def test_nothing_applies_to_a_case_of_muon_as_defined():
    """No clip, no schedule, both lrs given, no AutoTP, float64 Newton-Schulz, a shapes case."""
    case = _case(_cfg(clip=0.0), ns_dtype="float64")
    assert _findings(case, Trajectory("t", {}, [])) == []


def test_the_departures_page_carries_the_generated_table():
    table = docs.departures_table()
    rows = [line.split(" | ")[0].lstrip("| ") for line in table.splitlines()[2:2 + len(R.DEPARTURES)]]
    assert rows == [d.id for d in R.DEPARTURES]
    assert "docs/departures.md" not in docs.stale_files()
    with pytest.raises(ValueError, match="departures:begin"):
        docs.departures_with_table("# no table\n")
