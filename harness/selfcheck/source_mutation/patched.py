"""The patched column of source mutation: which mutants sit in a function the patched runtime replaces.

``harness.fixes`` swaps some DeepSpeed functions for fixed versions, after comparing each
one's source with DeepSpeed 0.19.8's byte for byte (``_registry.verify``): a mutant inside such a
function makes the patched runtime refuse to install (every patched case would error), and the
mutated code would not run there anyway. Such a mutant is **replaced by a fix**: not judged on the
patched column, counted apart with the function and the fixes that replace it. Every other mutant is
judged on the patched column by the gate's own decision, as on stock.

The spans (decorators included: the hash reads them) are resolved from the AST of the installed
source by ``spans`` (which imports the patched runtime's registry, so the judging interpreter only)
and written to a JSON file that the engine's stdlib-only session builder reads with ``load`` and
``replaced_by``, so those mutants get their result when the session is built, without a worker.
"""
from __future__ import annotations

import ast
import json
from pathlib import Path

from harness.selfcheck.source_mutation import scope

STATUS = "replaced-by-fix"


def _rel(module: str) -> str:
    parts = module.split(".")
    if parts[0] != "deepspeed":
        raise ValueError(f"{module}: not a deepspeed module")
    return "/".join(parts[1:]) + ".py" if len(parts) > 1 else "__init__.py"


def spans(ds_root: Path) -> list[dict]:
    """Every function the patched runtime replaces: file (relative to the package), qualified name,
    first and last line (decorators included), the fixes that need it."""
    from harness import fixes  # late: keeps this module torch-free at import

    by_key: dict[str, dict] = {}
    for fix in fixes.FIXES.values():
        for t in fix.targets:
            e = by_key.setdefault(t.key, {"file": _rel(t.module), "qualname": t.qualname, "fixes": []})
            e["fixes"].append(fix.name)
    trees: dict[str, ast.Module] = {}
    out = []
    for e in by_key.values():
        path = Path(ds_root) / e["file"]
        if not path.exists():
            continue  # a replaced function outside the files any scoped function lives in
        tree = trees.setdefault(e["file"], ast.parse(path.read_text()))
        fn = scope._find(tree, e["qualname"])
        if fn is None and _imported(tree, e["qualname"]):
            continue  # a module's binding of a function defined elsewhere: its own target has the lines
        if fn is None:
            raise scope.ScopeError(f"{e['file']}: the patched runtime replaces {e['qualname']!r}, not found")
        first = min([fn.lineno] + [d.lineno for d in fn.decorator_list])
        out.append({**e, "first": first, "last": fn.end_lineno or fn.lineno, "fixes": sorted(set(e["fixes"]))})
    return sorted(out, key=lambda e: (e["file"], e["first"]))


def _imported(tree: ast.Module, name: str) -> bool:
    """Is ``name`` bound in the module by an import (``from .original_muon import muon_update``)?"""
    return any(isinstance(node, ast.ImportFrom) and any((a.asname or a.name) == name for a in node.names)
               for node in ast.walk(tree))


def dump(items: list[dict], path: Path) -> None:
    Path(path).write_text(json.dumps(items, indent=1))


def load(path: Path | str | None) -> list[dict]:
    return [] if not path else json.loads(Path(path).read_text())


def replaced_by(items: list[dict], rel: str, lines) -> dict | None:
    """The replaced function holding any of ``lines`` of ``rel`` (None: the patched runtime runs it)."""
    for line in lines:
        for e in items:
            if e["file"] == rel and e["first"] <= line <= e["last"]:
                return e
    return None


def record(e: dict, where: list[str]) -> dict:
    """The worker's result record of a replaced mutant."""
    return {"status": STATUS, "where": where, "replaced": f"{e['file']}:{e['qualname']}", "fixes": e["fixes"],
            "detail": f"the patched runtime replaces (or wraps) {e['qualname']} for fix(es) {', '.join(e['fixes'])} "
                      f"and refuses to install over a source that differs from DeepSpeed 0.19.8's"}
