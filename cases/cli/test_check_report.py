"""What ``check`` shows a user beside the verdict: the report leads with the CLI's own verdict (not the
gate's "as expected"), the resolved values, the rewrites and the parameter table; the model listing
says which parameter went to Muon and why; the reproducer runs from anywhere."""
from __future__ import annotations

import shlex
import sys

from cases.cli._plan import plan
from harness.cli import check
from harness.judge import verdict
from harness.report.html import build_html


def _cfg(**top) -> dict:
    cfg = {"optimizer": {"type": "Muon", "params": {"lr": 0.02}}, "zero_optimization": {"stage": 2},
           "train_micro_batch_size_per_gpu": 1}
    cfg.update(top)
    return cfg


def _user_plan(tmp_path, monkeypatch, module: str = "user_tiny_lm"):
    from cases.cli import _user_model

    monkeypatch.syspath_prepend(str(tmp_path))
    return plan(tmp_path, _cfg(), "--model", _user_model.write(tmp_path, module))


def test_the_model_listing_names_each_parameter_with_muon_or_adam_and_why(tmp_path, monkeypatch):
    p = _user_plan(tmp_path, monkeypatch)
    rows = {name: (opt, why) for name, _, opt, why in check.param_rows(p.case)}
    assert rows["out_proj.weight"] == ("Muon", "2-D and no 'embed' or 'lm_head' in its name: Muon")
    assert rows["embed.weight"] == ("Adam", "its name contains 'embed': Adam, whatever its shape")
    assert rows["hidden.bias"] == ("Adam", "1-D: Adam")
    listing = "\n".join(check._plan_lines(p, []))
    assert "out_proj.weight" in listing and "2-D and no 'embed' or 'lm_head' in its name: Muon" in listing


def test_the_reproducer_names_the_interpreter_and_the_users_module_folder(tmp_path, monkeypatch):
    p = _user_plan(tmp_path, monkeypatch, module="user_tiny_lm_reproduced")  # not imported from elsewhere yet
    words = shlex.split(verdict.reproduce_command(p.case))
    env, python = words[0], words[1]
    assert python == sys.executable and python.startswith("/")
    assert env.startswith("PYTHONPATH=") and str(tmp_path.resolve()) in env.split("=", 1)[1].split(":")
    assert words[2:5] == ["-m", "harness", "run"]
    builtin = verdict.reproduce_command(p.case.replace(model="moe"))
    assert str(tmp_path) not in builtin


def test_the_check_report_leads_with_the_clis_verdict(tmp_path):
    from harness.case.spec import Case, ParamShape, canonical_json
    from harness.cli.check_plan import Plan
    from harness.gate.decide import Outcome

    cfg = _cfg(fp16={"enabled": True})
    case = Case(name="c", params=(ParamShape("w", (8, 4)), ParamShape("embed.weight", (8, 4))),
                ds_config=canonical_json(cfg))
    o = Outcome(case, "stock", "xfailed", ["DSM-001"], "m", 1.0)  # the gate calls a known bug "as expected"
    result = check.CheckResult(Plan(str(tmp_path / "my.json"), case, [], [], 1.0, notes=["batch sizes rewritten"]),
                               ["stock"], {"stock": o}, check.known_bug_info(case), None, None, "r")
    facts = check.report_facts(result)
    assert facts["exit_code"] == 1 and facts["verdict_lines"][0].startswith("verdict: DIVERGED")
    page = build_html([], lambda key: {}, extra={"check": facts})
    assert "all outcomes as expected" not in page and "<span class='vword'>PASS" not in page
    assert "class='verdict fail'" in page and "verdict: DIVERGED" in page
    assert str(tmp_path / "my.json") in page and "batch sizes rewritten" in page
    assert "<td>gradient_clipping</td>" in page and "default</td>" in page
    assert "<td>embed.weight</td><td>8x4</td><td>Adam</td>" in page
