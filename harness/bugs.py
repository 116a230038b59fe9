"""Stock DeepSpeed 0.19.8 bugs the harness has confirmed, each with the cases it affects.

A pipeline case on stock DeepSpeed that a bug's ``trigger`` selects is a strict xfail carrying the
bug id -- but only for divergences in the quantities the bug explains (``quantities``): any other
divergence in the same case is a plain failure. A bug whose trigger selects a case that then
passes is an XPASS, which strict mode turns into a failure: the registry must stay exact.

``fix`` names the entry of ``harness.patched_runtime`` that removes the bug (None: no fix yet).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from harness.case import Case


@dataclass(frozen=True)
class Bug:
    id: str
    title: str
    symptom: str
    trigger: Callable[[Case], bool]
    quantities: frozenset  # quantities it may make diverge ("swap" = NVMe never touched)
    where: str  # the DeepSpeed 0.19.8 code responsible
    fix: str | None = None


def _half(c: Case) -> bool:
    return c.dtype in ("fp16", "bf16")


def _z3_inmem(c: Case) -> bool:
    return bool(c.config.get("zero_optimization", {}).get("save_muon_momentum_buffer_in_memory"))


WEIGHTS = frozenset({"momentum", "update", "master", "model", "global_norm"})

BUGS: tuple[Bug, ...] = (
    Bug(
        id="DSM-001",
        title="Muon momentum kept in 16 bit",
        symptom="For fp16/bf16 models the Muon momentum buffer, and the gradient and Nesterov blend fed to "
                "Newton-Schulz, are stored in the model/communication dtype, so every step rounds the "
                "momentum to fp16/bf16 (bf16 drops increments below 2^-9 relative).",
        trigger=lambda c: _half(c) and (c.stage == 3 or c.offload == "none"),
        quantities=WEIGHTS,
        where="stage_1_and_2.py _muon_momentum_buffer (buffer follows the grad dtype); "
              "stage3.py _create_momentum_buffer (communication_data_type)",
    ),
    Bug(
        id="DSM-002",
        title="ZeRO-1/2 accept NVMe optimizer offload and silently run CPU offload",
        symptom="offload_optimizer.device=nvme at stage 1/2 never writes to the swap folder; the user "
                "believes the optimizer state is on NVMe.",
        trigger=lambda c: c.offload == "nvme" and c.stage in (1, 2),
        quantities=frozenset({"swap"}),
        where="stage_1_and_2.py __init__ (cpu_offload = device in (cpu, nvme))",
    ),
)

BY_ID = {b.id: b for b in BUGS}


def bugs_for(case: Case, *, patched: bool = False) -> list[Bug]:
    """The bugs a case is expected to hit; with ``patched``, only those the patched runtime can't fix."""
    hits = [b for b in BUGS if b.trigger(case)]
    if patched:
        from harness import patched_runtime

        fixed = set(patched_runtime.fix_names())
        hits = [b for b in hits if b.fix is None or b.fix not in fixed]
    return hits
