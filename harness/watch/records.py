"""The ranks' files of one watched run (``harness.rank.watch_capture``) as what the judge reads: the case
(the watched parameters, the resolved config, the world size), the full model's case (for its layout), the
trajectory assembled exactly as the harness's own ranks assemble theirs, and each step's local gradients.
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from harness.case.spec import Case
from harness.case.trajectory import Trajectory
from harness.rank import capture
from harness.rank.watch_capture import FORMAT


class RecordsError(RuntimeError):
    """The folder holds no complete watched run (a rank missing, a capture that failed on a rank)."""


class RanksMissing(RecordsError):
    """Some ranks' files are not (yet) in the folder: another node's, on a folder the nodes share."""


@dataclass
class WatchedRun:
    case: Case  # the watched parameters
    full: Case  # every trainable parameter: the layout the watched ones sit in
    trajectory: Trajectory
    grads: dict  # step -> [rank][micro] {name: float64 tensor}: each micro-batch's own gradient, true units
    reasons: dict  # watched name -> why
    dropped: list
    timing: list  # per rank, per step: {"capture_s", "step_s", "window_s"}
    file_bytes: list  # per rank
    fixes: list
    mutant: str | None
    path: str
    device: str = "cpu"  # the accelerator the ranks ran on
    notes: list = field(default_factory=list)

    @property
    def partial(self) -> bool:
        return len(self.case.params) < len(self.full.params)


def rank_files(folder: Path) -> list[Path]:
    return sorted(Path(folder).glob("rank*.pkl"), key=lambda p: int(p.stem[4:]))


def load(folder: Path, name: str) -> WatchedRun:
    """Every rank's file, checked for completeness and agreement, assembled into one run named ``name``."""
    files = rank_files(folder)
    if not files:
        raise RecordsError(f"no rank file in {folder}: the command never reached deepspeed.initialize with the "
                           "capture installed, or ended before the watched steps")
    data = [pickle.loads(f.read_bytes()) for f in files]
    errors = [f"rank {d['rank']}: {d['error'].strip().splitlines()[-1]}" for d in data if d.get("error")]
    if errors:
        raise RecordsError("the capture failed on " + "; ".join(errors) + f" (full tracebacks in {folder})")
    bad = [d["rank"] for d in data if d.get("format") != FORMAT]
    world = data[0]["world_size"]
    ranks = sorted(d["rank"] for d in data)
    if not bad and set(ranks) < set(range(world)):
        raise RanksMissing(f"records of ranks {ranks} of world size {world} in {folder}")
    if bad or ranks != list(range(world)):
        raise RecordsError(f"rank files of ranks {ranks} for world size {world} in {folder}"
                           + (f"; of another format: {bad}" if bad else ""))
    cases = {d["case"] for d in data}
    if len(cases) != 1 or len({len(d["steps"]) for d in data}) != 1:
        raise RecordsError("the ranks watched different parameters or steps")
    case = Case.from_json(data[0]["case"]).replace(name=name)
    full = Case.from_json(data[0]["full"]).replace(name=name)
    traj = _trajectory(case, data)
    grads = {s: _step_grads(case, data, i) for i, s in enumerate(r.step for r in traj.steps)}
    return WatchedRun(case, full, traj, grads, data[0]["reasons"], data[0]["dropped"],
                      [d["timing"] for d in data], [f.stat().st_size for f in files], data[0]["fixes"],
                      data[0]["mutant"], data[0]["path"], data[0].get("device", "cpu"))


def _trajectory(case: Case, data: list[dict]) -> Trajectory:
    tags = data[0]["tags"]
    traj = Trajectory(case_name=case.name, initial=capture.resolve_all([d["initial"] for d in data], case,
                                                                         "initial master"),
                      muon_params=tuple(p.name for p in case.params if tags.get(p.name)))
    traj.steps = [capture.assemble_step(case, [d["steps"][i] for d in data]) for i in range(len(data[0]["steps"]))]
    return traj


def _step_grads(case: Case, data: list[dict], i: int) -> list:
    """[rank][micro] {name: tensor}: the hooks' raw gradients times the step's factor (GAS / loss scale),
    an exact power-of-two rescale where GAS is one; a micro-batch that gave a parameter no gradient gives
    it DeepSpeed's zero."""
    out = []
    gas = case.grad_accum
    for d in data:
        rec = d["steps"][i]
        k = float(rec["grad_factor"])
        micro = []
        for mu in range(gas):
            g = {}
            for p in case.params:
                got = rec["local_grads"].get(p.name, [])
                a = got[mu] if mu < len(got) else np.zeros(p.shape)
                g[p.name] = torch.from_numpy(np.asarray(a, dtype=np.float64).reshape(p.shape) * k)
            micro.append(g)
        out.append(micro)
    return out
