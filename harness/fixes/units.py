"""Loss-scale units of the Muon momentum (the ``muon-momentum-scale-units`` fix, DSM-004): the fix's
name and the helpers that bring a stored momentum into the units of the current loss scale.

A leaf module (it imports only ``_registry``) so that the patched ``get_flat_partition`` (``z12``),
``_muon_update_sub_group`` (``z3``), ``muon_update`` (``muon``) and the fix's declaration in
``scaler`` all name the fix from one place without importing each other. The why of the fix is in
``scaler``'s docstring.
"""
from __future__ import annotations

from harness.fixes._registry import active

UNITS = "muon-momentum-scale-units"

# Per Muon group / sub-group: the loss scale the stored momentum is in. Kept on the loss scaler object,
# which ZeRO-1/2 and ZeRO-3 checkpoints pickle whole (LOSS_SCALER), so it survives a resume.
_UNITS_OF = "_dsm_momentum_scale"


def _units(self) -> dict:
    return self.loss_scaler.__dict__.setdefault(_UNITS_OF, {})


def _rescale(buffers, ratio: float) -> None:
    seen = set()
    for b in buffers:
        if b is None or b.numel() == 0:
            continue
        key = (b.data_ptr(), b.numel())
        if key in seen:
            continue
        seen.add(key)
        b.mul_(ratio)


def sync_z12_group(self, g: int) -> None:
    """Bring ZeRO-1/2 Muon group ``g``'s committed momentum into units of the current loss scale (called
    by the patched ``get_flat_partition`` just before Muon stages and updates it)."""
    if not active(UNITS) or getattr(self, "cpu_offload", False):
        return
    S = float(self.loss_scale)
    units = _units(self)
    prev = units.get(g)
    if prev is not None and prev != S and prev > 0:
        flat = self.optimizer.param_groups[g]["params"][0]
        _rescale([self.optimizer.state.get(flat, {}).get("momentum_buffer")], S / prev)
    units[g] = S


def sync_z3(self) -> None:
    """Bring every ZeRO-3 Muon sub-group's momentum into units of the current loss scale (called at the
    start of ``step``, before Muon and whether or not the step is later skipped)."""
    if not active(UNITS) or not getattr(self, "use_muon", False) or self.offload_optimizer:
        return
    S = float(self.loss_scale)
    units = _units(self)
    inmem = getattr(self, "muon_momentum_buffer_partitioned_groups_flat", None) or {}
    for i, uses in enumerate(self.sub_groups_using_muon):
        if not uses:
            continue
        prev = units.get(i)
        if prev is not None and prev != S and prev > 0:
            _rescale([self.optimizer.state.get(self.fp32_partitioned_groups_flat[i], {}).get("momentum_buffer"),
                      inmem.get(i)], S / prev)
        units[i] = S
