"""``mutate --engine cosmic-ray --tree PATH``: a tree it cannot mutate is bad input, said before any venv
is made or any case runs; the scope it derives for a tree is, on 0.19.8, the hand-written list (so the
rule carries that list's judgement to a tree it was not written for); the run handed to the tree's venv
is the same run."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from harness.cli.parser import parse_args
from harness.env import buildenv
from harness.selfcheck.source_mutation import scope, tree_run, workspace


def _fake_checkout(root, muon: bool):
    (root / "deepspeed" / "runtime" / "zero" / "muon").mkdir(parents=True)
    (root / "setup.py").write_text("")
    if muon:
        (root / "deepspeed" / "runtime" / "zero" / "muon" / "original_muon.py").write_text(
            "def muon_update(grad, momentum, beta=0.95):\n    return grad\n")
    return root


def _mutate(args, tmp_path):
    # a venv or state folder made by a regression lands in tmp_path, not in the shared cache
    env = dict(os.environ, MUON_HARNESS_VENVS=str(tmp_path / "venvs"), MUON_HARNESS_CACHE=str(tmp_path / "cache"))
    env.pop(scope.TREE_ENV, None)
    return subprocess.run([sys.executable, "-m", "harness", "mutate", "--engine", "cosmic-ray", "--sample", "1",
                           *args], cwd=buildenv.PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("what,extra,says", [
    ("missing", [], "not a DeepSpeed source checkout"),
    ("empty", [], "not a DeepSpeed source checkout"),
    ("no-muon", [], "no Muon code found"),
    ("muon", ["--column", "patched"], "stock column only"),
    ("muon", ["--distributor", "http", "--worker-url", "http://localhost:1"], "local distributor only"),
])
def test_a_tree_it_cannot_mutate_is_bad_input_before_anything_runs(tmp_path, what, extra, says):
    tree = tmp_path / "tree"
    if what == "empty":
        tree.mkdir()
    elif what in ("no-muon", "muon"):
        _fake_checkout(tree, muon=what == "muon")
    r = _mutate(["--tree", str(tree), *extra], tmp_path)
    assert r.returncode == 2, (r.stdout + r.stderr)[-2000:]
    assert "--tree" in r.stderr and says in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "venvs").exists() and not (tmp_path / "cache").exists()


def test_the_derived_scope_of_0_19_8_is_the_hand_written_list():
    derived = scope.for_tree(str(workspace.installed_deepspeed()))
    assert sorted(map(repr, derived)) == sorted(map(repr, scope.SCOPE))


def test_a_tree_scope_keeps_its_own_muon_functions_and_drops_the_left_out(tmp_path):
    root = _fake_checkout(tmp_path / "tree", muon=True) / "deepspeed"
    (root / "runtime" / "zero" / "stage3.py").write_text(
        "class DeepSpeedZeroOptimizer_Stage3:\n"
        "    def _adopt_restored_muon_momentum(self, m):\n        self.m = m\n"
        "    def destroy(self):\n        self.use_muon = None\n"
        "    def plumbing(self):\n        x = 1\n        self.use_muon = x\n")
    got = {(e.file, e.qualname, e.part) for e in scope.for_tree(str(root))}
    assert got == {("runtime/zero/muon/original_muon.py", "muon_update", "all"),
                   ("runtime/zero/stage3.py", "DeepSpeedZeroOptimizer_Stage3._adopt_restored_muon_momentum", "all"),
                   ("runtime/zero/stage3.py", "DeepSpeedZeroOptimizer_Stage3.plumbing", "muon")}


@pytest.mark.parametrize("argv", [
    ["--tree", "/x", "--sample", "40", "--seed", "3", "--only=-overflow", "--no-zygote"],
    ["--tree", "/x", "--fresh", "--retry", "survived,not-reached", "--report", "r.html", "--no-ledger"],
])
def test_the_run_handed_to_the_trees_venv_is_the_same_run(argv):
    given = parse_args(["mutate", "--engine", "cosmic-ray", *argv])
    assert vars(parse_args(tree_run.forwarded(given))) == vars(given)
