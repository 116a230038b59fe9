"""Where DeepSpeed 0.19.8's Muon departs, by design, from Muon as its authors and ``torch.optim.Muon`` define it.

Why a registry beside the bugs: ``check`` compares DeepSpeed with what DeepSpeed *intends* (the oracle's
``Conventions`` defaults), so a PASS says the run computed DeepSpeed's Muon. Muon as defined (Keller
Jordan's ``muon.py``, ``torch.optim.Muon``) orthogonalises each hidden weight matrix whole with
Newton-Schulz, scales the update by ``sqrt(max(1, rows/cols))`` and by the lr configured for its half, does
not clip after orthogonalising, and leaves embeddings, output heads and vectors to Adam. Where DeepSpeed
chose otherwise, a user reading PASS as "my Muon training is right" is misled; each such choice is
declared here once, with the knob by which the Muon-as-defined reference differs (``switch``), the config
change that removes it and how ``harness.judge.departures`` measures it on a run. docs/departures.md's table
is generated from these entries (``python -m harness.registry.docs``).

Facts only: ``applies`` is a pure function of the case's typed config view (``Case.ds``) and params (a
schedule's broadcast lrs: ``harness.case.schedule_lrs``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from harness.case.schedule_lrs import broadcast_lrs
from harness.case.spec import Case
from harness.env import device
from harness.models import roles

UPSTREAM = "deepspeedai/DeepSpeed#"


@dataclass(frozen=True)
class Departure:
    id: str
    title: str
    upstream: tuple[str, ...]  # "deepspeedai/DeepSpeed#NNNN"
    switch: str  # the oracle's knob (a ``Conventions`` field or other) where Muon as defined differs
    removed_by: str  # the config change that removes it, or why none in the config and what does
    measured_as: str  # what ``harness.judge.departures`` reports for it
    applies: Callable[[Case], bool]  # from ``case.ds`` and ``case.params``; its docstring is the docs' "applies when"


# ------------------------------------------------------------------------------------------------
# when each applies


def _ns_methods(c: Case) -> set[str]:
    """The Newton-Schulz methods the case's Muon matrices run: the config's (DeepSpeed's default where it
    gives none, from the view), and any user group's own."""
    base = c.ds.optimizer.muon.ns_method or "standard"  # None: a release without ns_method runs the standard one
    return {base} | {g.ns_method for g in c.groups if g.ns_method}


def clip_acts_on_update(c: Case) -> bool:
    """gradient_clipping (DeepSpeed's default where the config leaves it out) is above 0 on a ZeRO stage that
    takes the clip norm over the Muon updates: not stage 0 and not the BF16_Optimizer route, which clip the
    raw gradients (DSM-016, DSM-013)."""
    return (c.runs_muon and c.ds.gradient_clipping > 0 and c.ds.zero.stage >= 1
            and not c.ds.bf16_optimizer_route)


def scheduler_broadcasts_lr(c: Case) -> bool:
    """The run's lr schedule (the config's, or a client scheduler) sets a non-zero lr from one number for
    every param group (``broadcast_lrs``)."""
    return c.runs_muon and bool(broadcast_lrs(c.schedule))


def plain_lr_reaches_adam(c: Case) -> bool:
    """The config gives the optimizer a plain ``lr`` and no ``adam_lr`` (the view resolves the Adam half's
    lr from ``lr``), and the model has a parameter on the Adam half."""
    return (c.runs_muon and c.ds.source("optimizer.adam.lr").endswith("(optimizer.params.lr)")
            and any(not p.uses_muon for p in c.params))


def muon_by_name(c: Case) -> bool:
    """The case runs a real module (``Case.model``) with a matrix that Muon's definition keeps on Adam (an
    embedding, a weight tied to one, the output projection) and DeepSpeed's name rule tags Muon
    (``harness.models.roles.model_misrouted``)."""
    if not (c.runs_muon and c.model):
        return False
    return bool(roles.model_misrouted(c.model, c.seed))


def autotp_shards(c: Case) -> bool:
    """tensor_parallel.autotp_size is above 1 (the view's ``tp_size``)."""
    return c.runs_muon and c.ds.tp_size > 1


def ns_in_16_bit(c: Case) -> bool:
    """Newton-Schulz runs in fp16 (ns_method "gram") or bf16 ("standard"), with DeepSpeed's default ns_method
    from the view, where the ranks' accelerator reports that dtype (``harness.env.device.half_support``),
    unless the harness forces it to float64 (``Case.ns_dtype``)."""
    if not c.runs_muon or c.ns_dtype is not None:
        return False
    fp16, bf16 = device.half_support()
    return any((fp16 if m == "gram" else bf16) for m in _ns_methods(c))


# ------------------------------------------------------------------------------------------------
# the departures

DEPARTURES: tuple[Departure, ...] = (
    Departure(
        id="MUON-CLIP",
        title="gradient clipping acts on the orthogonalised update",
        upstream=(UPSTREAM + "8439", UPSTREAM + "7776"),
        switch="`Conventions.clip_norm_source`: \"muon_update\" (DeepSpeed: the global norm over each Muon "
               "parameter's update O, times the loss scale, and the Adam gradients; 1/k scales the Muon step and "
               "Adam's gradient) against \"gradient\" (the raw gradients' norm, clipped before the momentum)",
        removed_by="`\"gradient_clipping\": 0` (DeepSpeed's default is not 0: a config without the key clips)",
        measured_as="per applied step, the factor 1/k = 1/max(1, (N + 1e-6)/c) the clip applied to the Muon update "
                    "(N the reported norm), the same factor estimated at the user's unscaled shapes, and the factor "
                    "clipping the raw gradient norm would have applied",
        applies=clip_acts_on_update,
    ),
    Departure(
        id="MUON-SCHED-LR",
        title="a DeepSpeed lr schedule overrides muon_lr and adam_lr",
        upstream=(UPSTREAM + "7713",),
        switch="the peak/floor `oracles.schedules.group_lr` takes: one number for every param group against each "
               "half's own configured lr",
        removed_by="each lr-setting schedule parameter as a list, one lr per DeepSpeed param group in its order (the "
                   "Muon half, then the Adam half, per incoming group); for WarmupLR, `warmup_max_lr` left out and "
                   "`warmup_min_lr` 0 (each group warms up to its own lr). WarmupDecayLR's `warmup_max_lr` defaults "
                   "to a number, so leaving it out does not help; WarmupCosineLR and torch's multiplicative "
                   "schedules scale each group's own lr",
        measured_as="per step, the lr each half's group used against the lr configured for that half, and the "
                    "Muon:Adam lr ratio used against the one configured",
        applies=scheduler_broadcasts_lr,
    ),
    Departure(
        id="MUON-PLAIN-LR",
        title="the config's plain lr reaches the Adam half",
        upstream=(),
        switch="`StepConfig.adam_lr`: the config's `lr` (DeepSpeed resolves the Adam half's lr from `adam_lr`, "
               "else `lr`) against Adam's own lr",
        removed_by="`adam_lr` (and `muon_lr`) in the optimizer params",
        measured_as="per step, the lr the Adam half's groups used against DeepSpeed's own Adam default and the "
                    "Muon half's lr",
        applies=plain_lr_reaches_adam,
    ),
    Departure(
        id="MUON-BY-NAME",
        title="Muon chosen by parameter name: embeddings and output heads go to Muon",
        upstream=(),
        switch="`ParamSpec.use_muon` from `oracles.layout.deepspeed_uses_muon` (two or more dims and no \"embed\" "
               "or \"lm_head\" in the name) against the module's roles (`harness.models.roles.adam_by_definition`)",
        removed_by="no config key: DeepSpeed overwrites any `use_muon` set before `deepspeed.initialize`. Renaming "
                   "the module so that the parameter's name holds \"embed\" or \"lm_head\" moves it to Adam",
        measured_as="the parameters on Muon that Muon's definition keeps on Adam, each with why (an nn.Embedding "
                    "weight, tied to one, the output projection)",
        applies=muon_by_name,
    ),
    Departure(
        id="MUON-TP-SHARD",
        title="AutoTP orthogonalises each tensor-parallel shard on its own",
        upstream=(UPSTREAM + "8437",),
        switch="the block Newton-Schulz runs on (`harness.judge.tp_verdict.shard_of`: each rank's row or column "
               "block) against the whole matrix",
        removed_by="`tensor_parallel.autotp_size` 1 (or left out); no setting orthogonalises the whole matrix "
                   "under AutoTP",
        measured_as="per sharded Muon matrix and step, the cosine and the Frobenius norm ratio of the shard-wise "
                    "update against the whole matrix's, both float64 Newton-Schulz of the run's own Muon input",
        applies=autotp_shards,
    ),
    Departure(
        id="MUON-NS16",
        title="Newton-Schulz runs in 16 bit",
        upstream=(),
        switch="the Newton-Schulz compute dtype (`oracles.emulate.ns_compute_dtype`: fp16 for \"gram\", bf16 for "
               "\"standard\") against float64 (`Case.ns_dtype`; `oracles.muon_as_defined`)",
        removed_by="no config key: both methods run in 16 bit wherever the accelerator supports it. Keller Jordan's "
                   "reference and torch.optim.Muon run it in bf16 too, for speed; `ns_method` \"gram\" (fp16, "
                   "DeepSpeed's default) carries 3 more mantissa bits than \"standard\" (bf16)",
        measured_as="per Muon matrix and applied step, the relative Frobenius error of DeepSpeed's update against "
                    "float64 Newton-Schulz of the same input (rebuilt from the captured gradient and momentum)",
        applies=ns_in_16_bit,
    ),
)

BY_ID = {d.id: d for d in DEPARTURES}
