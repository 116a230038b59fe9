"""Where DeepSpeed's internals differ between trees, how the capture reaches them.

Why one record: ``harness.rank.capture`` reads DeepSpeed's own objects (the ``muon_update`` it calls, the
momentum buffers, the swapper fields). Those moved between releases; each difference is one field here,
answered by a probe of the tree's source (``harness.env.tree``), so capture.py keeps one code path and
asks this module only for the names that changed.
"""
from __future__ import annotations

from dataclasses import dataclass

from harness.env import tree


@dataclass(frozen=True)
class Adapter:
    # Modules that bind ``muon_update`` at import (``from ...original_muon import muon_update`` at module
    # level: 0.18.9-0.19.7), so replacing ``original_muon.muon_update`` does not reach their calls: the
    # recorder wraps each module's own binding too (``tree.muon_bindings``).
    muon_bindings: tuple[str, ...] = ()
    # How ZeRO-3 names the process group a parameter is partitioned over: "method" (the optimizer's
    # ``_get_param_partition_group(p)``, 0.19.3 on) or "attribute" (``p.ds_process_group``, falling back to
    # the optimizer's ``dp_process_group``: what that method returns where it exists).
    z3_partition_group: str = "method"
    # How the optimizer's param groups are named: "name" (each group's own ``name``: "muon-params" /
    # "adam-params", 0.19.2 on) or "use_muon" (no name: the name is derived from the flag).
    group_names: str = "name"
    # Which entry of BF16_Optimizer's gradient list holds a parameter's gradient: "attribute" (the
    # parameter's ``_index_in_param_group``, which 0.19.8 sets to its place in the group, bf16_optimizer.py
    # :353-355) or "group_position" (0.18.9-0.19.7: ``_index_in_param_group`` counts only the parameters
    # with a fragment on this rank, mixed_precision_linkage.py ``_init_lp_to_hp_mapping`` (0.19.6 :47),
    # while the list BF16_Optimizer links, ``fp32_groups_gradient_dict[i]`` (0.19.6 bf16_optimizer.py:268),
    # holds every parameter of the group: the entry is the parameter's place in ``bf16_groups[i]``).
    bf16_grad_index: str = "attribute"
    # Path kinds (``capture.PathInfo.kind``) on which the tree steps the Muon matrices without calling
    # ``muon_update``, so their gradient is read before the step as Adam's is (0.19.6 muon_optimizer.py:61-67
    # moves the Muon group by lr times its gradient).
    muon_grads_before_step: tuple[str, ...] = ()


def adapter_for(caps=None) -> Adapter:
    """The adapter of a tree (default: the installed DeepSpeed), from its probes."""
    k = caps if caps is not None else tree.capabilities()
    return Adapter(k["muon_bindings"], k["z3_partition_group"], k["group_names"], k["bf16_grad_index"],
                   k["muon_grads_before_step"])


def z3_partition_group(opt, p):
    """The process group ZeRO-3 partitions ``p`` over, as the installed release exposes it."""
    if adapter_for().z3_partition_group == "method":
        return opt._get_param_partition_group(p)  # INTERNAL (0.19.3+)
    return getattr(p, "ds_process_group", opt.dp_process_group)  # INTERNAL (<= 0.19.2)


def group_name(group: dict, index: int) -> str:
    """The name the harness knows an optimizer param group by ("muon-params" / "adam-params", or
    "group<i>-..." for several incoming groups): the group's own name, or on releases that name none,
    the one its ``use_muon`` flag stands for (those releases build one Muon and one Adam group)."""
    if adapter_for().group_names == "use_muon" and "name" not in group and "use_muon" in group:
        return "muon-params" if group["use_muon"] else "adam-params"
    return str(group.get("name", index))


def bf16_grad_index(opt, p) -> int | None:
    """Where BF16_Optimizer's gradient list (``get_lp_grad_fragment``'s argument) holds ``p``'s gradient
    (None: ``p`` has no fragment on this rank, so no entry is read)."""
    if p._hp_mapping is None:  # INTERNAL: None when p has nothing in this rank's partition
        return None
    if adapter_for().bf16_grad_index == "attribute":
        return p._index_in_param_group  # INTERNAL: 0.19.8 sets it to p's place in its group
    group = opt.bf16_groups[p._hp_mapping.param_group_index]  # INTERNAL: the group's low-precision params
    return next(j for j, q in enumerate(group) if q is p)


def muon_grads_before_step(kind: str) -> bool:
    """Whether, on path ``kind``, the Muon matrices' gradient is read before the step (the release steps
    them without ``muon_update``, so no call hands it over)."""
    return kind in adapter_for().muon_grads_before_step
