"""Where DeepSpeed's internals differ between releases, how the capture reaches them.

Why a table: ``harness.capture`` reads DeepSpeed's own objects (the ``muon_update`` it calls, the
momentum buffers, the swapper fields). Those moved between releases; each difference is one entry
here, keyed by a version range, so capture.py keeps one code path and asks this module only for the
names that changed. Every entry is a fact read from that release's source (file:line given).
"""
from __future__ import annotations

from dataclasses import dataclass

from harness import versions


@dataclass(frozen=True)
class Adapter:
    lo: str | None  # first release it applies to (inclusive; None: any older)
    hi: str | None  # first release it no longer applies to
    # Modules that bind ``muon_update`` at import (``from ...original_muon import muon_update`` at module
    # level), so replacing ``original_muon.muon_update`` does not reach their calls: the recorder wraps
    # each module's own binding too.
    muon_bindings: tuple[str, ...] = ()
    note: str = ""


ADAPTERS: tuple[Adapter, ...] = (
    # <= 0.19.7: stage_1_and_2.py:39 and stage3.py:50 import muon_update at module level (0.19.8 imports
    # it inside get_flat_partition / _muon_update_sub_group / _apply_muon_updates_cpu_offload).
    Adapter(None, "0.19.8", ("deepspeed.runtime.zero.stage_1_and_2", "deepspeed.runtime.zero.stage3"),
            "muon_update bound at import by the ZeRO-1/2 and ZeRO-3 optimizers"),
    Adapter("0.19.8", None, (), "muon_update imported at each call site (the layout the capture was written on)"),
)


def adapter_for(version: str | None = None) -> Adapter:
    """The adapter of ``version`` (default: the installed DeepSpeed); exactly one range holds it."""
    version = version or versions.installed().version
    hits = [a for a in ADAPTERS if versions.in_range(version, a.lo, a.hi)]
    if len(hits) != 1:
        raise RuntimeError(f"capture adapters: {len(hits)} ranges hold DeepSpeed {version} (must be exactly one)")
    return hits[0]
