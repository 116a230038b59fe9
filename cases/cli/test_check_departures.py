"""``check`` reports Muon as defined apart from DeepSpeed's intended reference: each departure that applies,
measured on the run, in the text, ``--json`` and the report; ``--strict-muon`` makes one exit 1. The
shipped ``examples/departure_*.json`` each show exactly their departure, and the Hugging Face template
shows what a user of it needs to know (zero-lr steps, the clip on the Muon update at scaled and real
shapes, the lr each half ran at)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cases.cli.test_check_exits import LR, _result, _traj
from harness.cli import check
from harness.judge.departures import Finding
from harness.report.html import build_html

ROOT = Path(__file__).resolve().parents[2]
CLIP = Finding("MUON-CLIP", "gradient clipping acts on the orthogonalised update", "the clip scaled by 0.1",
               '"gradient_clipping": 0', {"steps": []})


def _with(departures, strict: bool):
    o, result = _result(_traj([(False, LR, ("w", "b"))] * 3))
    result.departures, result.strict_muon = departures, strict
    return result


@pytest.mark.parametrize("found, strict, code", [([], False, 0), ([], True, 0), ([CLIP], False, 0), ([CLIP], True, 1)])
def test_a_departure_changes_the_exit_code_only_under_strict_muon(found, strict, code):
    result = _with(found, strict)
    assert result.exit_code == code
    lines = [line for line, essential in result.text_lines() if essential]
    muon = next(line for line in lines if line.startswith("muon as defined: "))
    assert ("DEPARTS in 1 way(s) (MUON-CLIP)" in muon) == bool(found)
    js = result.to_json()
    assert [d["id"] for d in js["departures"]] == [f.id for f in found] and js["strict_muon"] == strict
    assert js["exit_code"] == code


def test_the_report_shows_the_departures_apart_from_the_verdict():
    facts = check.report_facts(_with([CLIP], False))
    page = build_html([], lambda key: {}, extra={"check": facts})
    assert "Muon as defined (a second reference" in page and "<td>MUON-CLIP</td>" in page
    assert "the clip scaled by 0.1" in page and "DEPARTS in 1 way(s)" in page


def _check_json(*args: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "harness", "check", "--json", "--no-report", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    return json.loads(proc.stdout)


EXAMPLES = {"departure_clip.json": ["MUON-CLIP"], "departure_sched_lr.json": ["MUON-SCHED-LR"],
            "departure_plain_lr.json": ["MUON-PLAIN-LR"], "departure_ns16.json": []}


@pytest.mark.pipeline
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_each_departure_example_shows_exactly_its_departure_beside_16_bit_newton_schulz(name):
    from harness.env import device

    cfg = json.loads((ROOT / "examples" / name).read_text())
    method = cfg["optimizer"]["params"].get("ns_method", "gram")
    half = device.half_support()[0 if method == "gram" else 1]
    r = _check_json("--ds-config", str(ROOT / "examples" / name))
    assert (r["verdict"], r["exit_code"]) == ("pass", 0), r["message"]
    assert [d["id"] for d in r["departures"]] == EXAMPLES[name] + ["MUON-NS16"] * half
    assert all(not d["magnitude"].startswith("not measured") for d in r["departures"])
    assert r["as_defined"]["steps"] and not r["as_defined"]["missing"]


@pytest.mark.pipeline
def test_the_hf_zero2_template_names_zero_lr_steps_the_clip_at_both_shapes_and_each_halfs_lr():
    r = _check_json("--ds-config", str(ROOT / "examples" / "hf_zero2_muon.json"), "--trainer-arg", "bf16=true",
                    "--trainer-arg", "learning_rate=0.02", "--trainer-arg", "warmup_steps=2",
                    "--trainer-arg", "max_steps=10")
    deps = {d["id"]: d for d in r["departures"]}
    assert r["basis"]["lr_zero"] and set(r["basis"]["lr_zero"]) <= {str(s) for s in r["basis"]["applied"]}
    rows = [s for s in deps["MUON-CLIP"]["detail"]["steps"] if "factor" in s]
    assert rows and all(0 < s["factor"] <= 1 and 0 < s["real_factor"] <= s["factor"] for s in rows)
    lrs = deps["MUON-SCHED-LR"]["detail"]["steps"]
    assert {s["half"] for s in lrs} == {"muon", "adam"} and all("lr" in s and "configured" in s for s in lrs)
    assert "at the real shapes" in deps["MUON-CLIP"]["magnitude"]


@pytest.mark.pipeline
def test_check_model_gpt2_names_the_embeddings_deepspeed_puts_on_muon():
    from harness.catalog.models import available_models

    if "gpt2" not in available_models():
        pytest.skip("the models extra (transformers) is not installed")
    r = _check_json("--ds-config", str(ROOT / "examples" / "model_gpt2_zero1_bf16_hf_auto.json"), "--model", "gpt2",
                    "--trainer-arg", "bf16=true")
    from torch import nn

    from harness import models

    module = models.build_spec("gpt2", 0).module
    embeddings = {f"{n}.weight" for n, m in module.named_modules() if isinstance(m, nn.Embedding)
                  and "embed" not in n.lower() and "lm_head" not in n.lower()}  # DeepSpeed's name rule: Muon
    names = {p["name"] for d in r["departures"] if d["id"] == "MUON-BY-NAME" for p in d["detail"]["params"]}
    assert embeddings and embeddings <= names
