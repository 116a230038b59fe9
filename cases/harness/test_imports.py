"""The import graph of ``harness`` and ``oracles`` is a DAG whose stages import only downward.

A cycle is how rank-side and parent-side code end up sharing modules (``ds_run -> patches ->
known_bugs -> pool -> ds_run`` was one) and how a name ends up copied because it "can't be
imported". The graph is read statically (``ast``), every ``import`` counted wherever it stands: an
import deferred into a function body still closes the cycle the day somebody hoists it.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("harness", "oracles")


def modules(root: Path = ROOT) -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for f in sorted((root / pkg).rglob("*.py")):
            parts = list(f.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = f
    return out


def _resolve(name: str, mods) -> str | None:
    """The innermost module of ours that ``name`` (a module or module.attribute) lies in."""
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, f in mods.items():
        package = m if f.name == "__init__.py" else m.rpartition(".")[0]
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    src = ".".join(base + ([node.module] if node.module else []))
                else:
                    src = node.module or ""
                targets = [f"{src}.{a.name}" for a in node.names]  # a submodule, or an attribute of src
            for t in targets:
                dep = _resolve(t, mods)
                if dep and dep != m:
                    graph[m].add(dep)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None (iterative depth-first search)."""
    WHITE, GREY, BLACK = 0, 1, 2
    colour = dict.fromkeys(graph, WHITE)
    for start in sorted(graph):
        if colour[start] != WHITE:
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        colour[start] = GREY
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                colour[path.pop()] = BLACK
                stack.pop()
            elif colour[nxt] == GREY:
                return path[path.index(nxt):] + [nxt]
            elif colour[nxt] == WHITE:
                colour[nxt] = GREY
                path.append(nxt)
                stack.append(iter(sorted(graph[nxt])))
    return None


def test_import_graph_has_no_cycle():
    graph = import_graph(modules())
    assert sum(len(v) for v in graph.values()) > 50  # the graph was really read
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_known_edges_are_seen():
    graph = import_graph(modules())
    assert "harness.rank.patches" in graph["harness.rank.ds_run"]
    assert "harness.launch.pool" in graph["harness.selfcheck.kill_matrix"]  # a function-level import counts
    assert "oracles.loss_scaler" in graph["oracles.step"]  # a relative import counts


@pytest.mark.parametrize("files, cycle", [
    ({"harness/__init__.py": "", "harness/a.py": "from harness import b\n",
      "harness/b.py": "def f():\n    from harness.a import x\n"}, ["harness.a", "harness.b", "harness.a"]),
    ({"harness/__init__.py": "", "harness/a.py": "from . import b\n", "harness/b.py": "import harness.a\n"},
     ["harness.a", "harness.b", "harness.a"]),
    ({"harness/__init__.py": "", "harness/a.py": "from harness import b\n", "harness/b.py": "import os\n"}, None),
])
def test_cycle_detection_names_the_cycle(tmp_path, files, cycle):
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    (tmp_path / "oracles").mkdir()
    assert find_cycle(import_graph(modules(tmp_path))) == cycle


def test_ranks_start_in_one_place():
    """Every launcher's ranks join their process group through ``harness.rank.bootstrap.bootstrap_rank``;
    a second copy of the start-up is how the pool and torchrun mode drift apart. (The plain training
    script of ``cases/patched`` is a user's script, on purpose.)"""
    callers = []
    for f in sorted(ROOT.glob("harness/**/*.py")) + sorted(ROOT.glob("cases/**/*.py")):
        if f.name == "plain_training.py":
            continue
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "init_process_group":
                callers.append(str(f.relative_to(ROOT)))
    assert callers == ["harness/rank/bootstrap.py"], callers


def declared_layers(doc: Path = ROOT / "docs" / "design.md") -> list[str]:
    """The layer order as docs/design.md states it: one line, ``Layers, bottom first: a, b, ...``."""
    for line in doc.read_text().splitlines():
        if line.startswith("Layers, bottom first:"):
            return [w.strip() for w in line.partition(":")[2].split(",")]
    raise AssertionError(f"{doc} has no 'Layers, bottom first:' line")


def layer_of(module: str) -> str:
    parts = module.split(".")
    return parts[0] if parts[0] == "oracles" else (parts[1] if len(parts) > 1 else "harness")


def upward_imports(graph: dict[str, set[str]], layers: list[str]) -> list[str]:
    rank = {name: i for i, name in enumerate(layers)}
    out = []
    for m, deps in sorted(graph.items()):
        for d in sorted(deps):
            lm, ld = layer_of(m), layer_of(d)
            if lm in rank and ld in rank and rank[ld] > rank[lm]:
                out.append(f"{m} ({lm}) imports {d} ({ld})")
    return out


def test_every_package_has_a_layer():
    layers = declared_layers()
    packages = {p.name for p in (ROOT / "harness").iterdir() if (p / "__init__.py").exists()} - {"data"}
    assert packages - set(layers) == set(), "packages without a layer in docs/design.md"
    assert set(layers) - packages - {"oracles"} == set(), "layers in docs/design.md without a package"


def test_stages_import_only_downward():
    violations = upward_imports(import_graph(modules()), declared_layers())
    assert violations == [], "imports that run up the layer order of docs/design.md:\n" + "\n".join(violations)


def test_an_upward_import_is_caught(tmp_path):
    (tmp_path / "harness" / "case").mkdir(parents=True)
    (tmp_path / "harness" / "cli").mkdir()
    for f in ("harness/__init__.py", "harness/case/__init__.py", "harness/cli/__init__.py", "harness/cli/main.py"):
        (tmp_path / f).write_text("")
    (tmp_path / "oracles").mkdir()
    (tmp_path / "harness" / "case" / "spec.py").write_text("def f():\n    from harness.cli import main\n")
    graph = import_graph(modules(tmp_path))
    assert upward_imports(graph, ["oracles", "case", "cli"]) == [
        "harness.case.spec (case) imports harness.cli.main (cli)"]
