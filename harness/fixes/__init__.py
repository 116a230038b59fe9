"""Fixes for confirmed Muon/ZeRO bugs of DeepSpeed 0.19.8, installable into a plain training script.

    from harness.fixes import apply
    apply()                      # before deepspeed.initialize(...)
    engine, *_ = deepspeed.initialize(...)

``apply(names=None)`` installs every fix (or the named ones) and returns the names now active;
``remove(names=None)`` restores stock behaviour (all, or the named fixes); ``applied()`` lists the active
fixes; ``fix_names()`` lists all fixes; ``FIXES`` maps a name to its ``Fix`` (the bug ids it removes, the
DeepSpeed functions it replaces). ``describe()`` prints that table; what each bug is lives in the registry
(``python -m harness.registry.docs`` writes docs/bugs.md, one entry per bug with its fix).

Guards: ``apply`` refuses (``PatchedRuntimeError``) on a DeepSpeed other than 0.19.8, and before it
replaces a function it checks the function's source hash against 0.19.8's, so it never overwrites
code it was not written against (another patch, a mutant, a different build). It is idempotent:
applying twice changes nothing, and a partially failed ``apply`` rolls back what it installed.

The fixes act in the rank processes, at the Python level only; they do not change DeepSpeed's files.
Engines already built keep working with whatever is installed at the time of each call.
"""
from __future__ import annotations

from harness.fixes import bf16opt, ckpt, muon, overflow, scaler, swapin, z0, z3, z12, z12offload
from harness.fixes._registry import (ACTIVE, EXPECTED_DEEPSPEED, Fix, PatchedRuntimeError, Target, _LOCK, check_version,
                                     install_target, installed_keys, prime_source_hashes, source_hash,
                                     uninstall_target, verify)

__all__ = ["apply", "remove", "applied", "fix_names", "fixes_for", "FIXES", "Fix", "PatchedRuntimeError", "describe",
           "EXPECTED_DEEPSPEED", "source_hash"]

_ORDER = (z12.FIXES + z3.FIXES + scaler.FIXES + ckpt.FIXES + muon.FIXES + z0.FIXES + bf16opt.FIXES + swapin.FIXES
          + overflow.FIXES + z12offload.FIXES)
FIXES: dict[str, Fix] = {f.name: f for f in _ORDER}


def fix_names() -> list[str]:
    return list(FIXES)


_STAGE_MODULES = {"deepspeed.runtime.zero.stage_1_and_2": (1, 2), "deepspeed.runtime.zero.stage3": (3,)}


def fixes_for(bug_id: str, stage: int | None = None) -> list[str]:
    """The fixes that remove ``bug_id``, restricted to those
    that act on ZeRO ``stage`` when given: a fix whose every target lives in one stage's module does
    nothing for the other stages (DSM-001 has a ZeRO-1/2 and a ZeRO-3 fix)."""
    out = []
    for f in _ORDER:
        if bug_id not in f.bugs:
            continue
        stages = {s for t in f.targets for s in _STAGE_MODULES.get(t.module, (1, 2, 3))}
        if stage is None or stage in stages:
            out.append(f.name)
    return out


def applied() -> list[str]:
    return [n for n in FIXES if n in ACTIVE]


def _needed_targets(names) -> dict[str, Target]:
    out = {}
    for n in names:
        for t in FIXES[n].targets:
            out[t.key] = t
    return out


def prime() -> int:
    """Hash every function the fixes guard, in the process that forks the ranks (``prime_source_hashes``)."""
    return prime_source_hashes(_needed_targets(FIXES).values())


def apply(names=None) -> list[str]:
    """Install the fixes ``names`` (default: all). Returns the active fix names."""
    names = list(FIXES) if names is None else [names] if isinstance(names, str) else list(names)
    unknown = [n for n in names if n not in FIXES]
    if unknown:
        raise KeyError(f"unknown fix(es) {unknown}; known: {list(FIXES)}")
    with _LOCK:
        check_version()
        targets = _needed_targets(names)
        before = set(installed_keys())
        for t in targets.values():  # verify everything before touching anything
            if t.key not in before:
                verify(t)
        try:
            for t in targets.values():
                install_target(t)
        except Exception:
            for key in set(installed_keys()) - before:
                uninstall_target(key)
            raise
        ACTIVE.update(names)
        return applied()


def remove(names=None) -> list[str]:
    """Deactivate ``names`` (default: all) and restore every function no active fix still needs."""
    with _LOCK:
        names = list(ACTIVE) if names is None else [names] if isinstance(names, str) else list(names)
        for n in names:
            ACTIVE.discard(n)
        still = _needed_targets(ACTIVE)
        for key in installed_keys():
            if key not in still:
                uninstall_target(key)
        return applied()


def describe() -> str:
    lines = []
    for f in FIXES.values():
        state = "active" if f.name in ACTIVE else "inactive"
        lines.append(f"{f.name} [{', '.join(f.bugs)}] ({state})")
        lines.append(f"    changes: {f.summary}")
        lines.append("    replaces: " + ", ".join(f.replaces))
        if f.notes:
            lines.append(f"    notes: {f.notes}")
    return "\n".join(lines)
