"""Where ``Case.patched`` and ``Case.mutant`` take effect, inside every rank around one case
(called only from ``harness.rank.ds_run.case_patches``).

``enter(case)``: if ``case.patched``, apply every fix of ``harness.fixes``; then, if
``case.mutant``, install that mutant of ``harness.registry.mutants`` (on top of the patched runtime, so a
mutant is judged against a clean baseline). ``exit(case)``: undo the mutant, then remove exactly the
fixes ``enter`` activated -- always, and in reverse order, so nothing of a case outlives it.
``enter(case, "fixes")`` and ``enter(case, "mutant")`` do one half each (each paired with its own
``exit``): ``harness.rank.ds_run`` installs the Muon call recorder between them, so a mutant sits between
DeepSpeed and the recorder and the recorder sees what the (mutated) DeepSpeed really passes.
Mutants wrap whatever function is installed (stock or patched) and never replace a function the
patched runtime replaces with stock code.
"""
from __future__ import annotations

from harness.case.spec import Case

_STACK: list[tuple[str, object]] = []  # (case name, undo callable), innermost last


PARTS = ("all", "fixes", "mutant")


def enter(case: Case, part: str = "all") -> None:
    if part not in PARTS:
        raise ValueError(f"part must be one of {PARTS}, got {part!r}")
    undo: list = []
    try:
        if case.patched and part != "mutant":
            from harness import fixes

            before = set(fixes.applied())
            now = set(fixes.apply())
            added = sorted(now - before)
            undo.append(lambda added=added: fixes.remove(added))
        if case.mutant and part != "fixes":
            from harness.registry import mutants

            undo.append(mutants.install(case.mutant))
    except BaseException:
        for u in reversed(undo):
            u()
        raise
    _STACK.append((case.name, undo))


def exit(case: Case) -> None:  # noqa: A001 - the name ds_run expects
    if not _STACK:
        return
    name, undo = _STACK.pop()
    errors = []
    for u in reversed(undo):
        try:
            u()
        except Exception as e:  # keep restoring the rest
            errors.append(e)
    if name != case.name:
        errors.append(RuntimeError(f"patches.exit({case.name!r}) but the innermost entered case is {name!r}"))
    if errors:
        raise errors[0]
