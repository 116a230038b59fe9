"""The case kind "DeepSpeed must refuse this config" (harness.registry.refusals) as the gate decides it,
without ranks: a launcher stands in for DeepSpeed and either raises a rank's traceback or runs.

The rank-level check (DeepSpeed 0.19.8 really refuses, and a DeepSpeed whose guard is negated is
caught) is ``python -m harness gate --only=rs-refused --no-mutate`` and the source mutant
``runtime/zero/stage3.py:360:11 core/AddNot#13`` (README, "Source mutation ...")."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from harness.registry import refusals
from harness.gate.decide import evaluate
from harness.launch.launcher import RankFailed
from harness.catalog.matrix import ds_refusal_cases, gate_cases

DS_FILE = "/site/deepspeed/runtime/zero/stage3.py"


def _tb(message: str, file: str = DS_FILE, func: str = "__init__", etype: str = "ValueError") -> str:
    return ("Traceback (most recent call last):\n"
            '  File "/site/deepspeed/runtime/engine.py", line 2760, in _configure_zero_optimizer\n'
            "    optimizer = DeepSpeedZeroOptimizer_Stage3(\n"
            f'  File "{file}", line 360, in {func}\n'
            "    raise ValueError(...)\n"
            f"{etype}: {message}\n")


class FakeLauncher:
    def __init__(self, tb: str | None):
        self.tb, self.ran = tb, 0

    def run(self, case, entry=None):
        self.ran += 1
        if self.tb is not None:
            raise RankFailed(case.name, 0, self.tb)
        return SimpleNamespace(result=None)

    def close(self):
        pass


def _case():
    return next(c for c in ds_refusal_cases() if c.name.endswith("-rs-refused"))


def test_each_refusal_case_expects_exactly_one_refusal():
    got = {c.name: [r.name for r in refusals.expected(c)] for c in ds_refusal_cases()}
    assert got == {"z3-none-fp32-ws2-rs-refused": ["z3-muon-reduce-scatter"],
                   "z3-none-fp32-ws2-qg-refused": ["z3-muon-all2all"],
                   "z1-none-fp32-ws2-heads3d-refused": ["per-head-not-2d"],
                   "z1-none-fp32-ws2-heads8by3-refused": ["per-head-indivisible"],
                   "z3-none-fp32-ws2-betas-refused": ["z3-muon-group-betas"],
                   "z3-none-fp32-ws2-betas-fall-refused": ["z3-muon-group-betas"],
                   "z1-none-bf16-ws2-bf16opt-conv-refused": ["bf16opt-muon-not-2d"],
                   "z1-none-fp32-ws2-clip0.05-nonorm-clip-refused": ["no-norm-with-clipping"],
                   "z2-cpu-fp32-ws2-nonorm-offload-refused": ["no-norm-with-offload"],
                   "z1-none-bf16-ws2-bf16opt-nonorm-refused": ["no-norm-on-bf16-optimizer"],
                   "z2-none-fp32-ws2-prescale-refused": ["z2-prescale-with-reduce-scatter"]}
    others = [c.name for c in gate_cases() if refusals.expected(c) and not c.name.endswith("-refused")]
    assert others == [], f"gate cases DeepSpeed would refuse outside the refusals group: {others}"


def test_the_exact_refusal_passes_on_both_columns():
    msg = "Muon and reduce scatter cannot be used together"
    for column in ("stock", "patched"):
        o = evaluate(_case(), column, FakeLauncher(_tb(msg)))
        assert (o.status, o.strength) == ("passed", "refusal"), o.message


def test_running_the_config_fails_with_a_reproducer():
    o = evaluate(_case(), "stock", FakeLauncher(None))
    assert o.status == "failed"
    assert "must refuse" in o.message and "reproduce:" in o.message


def test_another_error_or_frame_is_not_the_refusal():
    msg = "Muon and reduce scatter cannot be used together"
    for tb in (_tb("Muon and all2all process group cannot be used together"),
               _tb(msg, func="step"), _tb(msg, file="/site/deepspeed/runtime/zero/stage_1_and_2.py"),
               _tb(msg, etype="RuntimeError")):
        o = evaluate(_case(), "stock", FakeLauncher(tb))
        assert o.status == "error", (tb, o.status)


def test_the_refusals_were_read_from_the_installed_source():
    """Each fragment is DeepSpeed's own message, raised in the function the entry names (an
    AssertionError by an ``assert`` there)."""
    import ast

    from harness.selfcheck.source_mutation import workspace

    for r in refusals.REFUSALS:
        file, _, func = r.frame.partition(":")
        path = next(Path(workspace.installed_deepspeed()).rglob(file))
        tree = ast.parse(path.read_text())
        nodes = [n for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == func for n in ast.walk(f)]
        raised = [ast.unparse(n.exc) for n in nodes if isinstance(n, ast.Raise) and n.exc is not None]
        raised += [f"AssertionError({ast.unparse(n.msg)})" for n in nodes if isinstance(n, ast.Assert) and n.msg]
        assert any(x.startswith(f"{r.etype}(") and r.fragment in x for x in raised), (r.name, raised)
