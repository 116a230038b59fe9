"""``python -m harness check`` end to end, in a subprocess (it starts ranks of its own).

* the three shipped example configs (``examples/``): exit codes, verdicts, the known bug named;
* six kinds of bad input, each refused with exit 2 and a message saying what is wrong, before any
  rank starts.

The example runs use small ``--shapes`` and two steps: what they check is the CLI's decision, not
the numerics of big matrices (the scale rule has its own tests in ``test_check_units.py``).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
SMALL = ["--shapes", "96x64,64x200", "--steps", "2"]


def run_cli(*args, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "harness", "check", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


# ------------------------------------------------------------------------------------------------
# bad input: exit 2, a clear message, no rank started


def _bad(tmp_path, cfg, *extra):
    p = tmp_path / "config.json"
    p.write_text(cfg if isinstance(cfg, str) else json.dumps(cfg))
    r = run_cli("--ds-config", p, "--no-report", *extra, timeout=180)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "start" not in r.stdout  # refused before any rank was started
    return r.stderr


def _example(name: str) -> dict:
    return json.loads((EXAMPLES / name).read_text())


def test_bad_invalid_json(tmp_path):
    err = _bad(tmp_path, '{\n  "train_batch_size": 8,\n  "optimizer": {"type": "Muon",}\n}\n')
    assert "invalid JSON at line 3, column 32" in err


def test_bad_key_deepspeed_rejects(tmp_path):
    cfg = _example("zero1_fp32.json")
    cfg["zero_optimization"]["stagee"] = 2  # a typo DeepSpeed's pydantic model refuses
    err = _bad(tmp_path, cfg)
    assert "DeepSpeed rejects the config" in err and "zero_optimization.stagee" in err
    assert "Extra inputs are not permitted" in err


def test_bad_optimizer_not_muon(tmp_path):
    cfg = _example("zero1_fp32.json")
    cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}
    err = _bad(tmp_path, cfg, "--json")
    assert "optimizer.type is 'AdamW', not Muon" in err


def test_bad_nvme_path_not_writable(tmp_path):
    unwritable = Path("/sys/kernel")  # sysfs is read-only here, even for root
    probe = subprocess.run(["mkdir", str(unwritable / "muon-probe")], capture_output=True)
    if probe.returncode == 0:
        subprocess.run(["rmdir", str(unwritable / "muon-probe")])
        pytest.skip("/sys/kernel is writable on this machine")
    cfg = _example("zero3_fp16_nvme_clip.json")
    cfg["zero_optimization"]["offload_optimizer"]["nvme_path"] = str(unwritable)
    err = _bad(tmp_path, cfg)
    assert "zero_optimization.offload_optimizer.nvme_path" in err and "not writable" in err


def test_bad_world_size(tmp_path):
    err = _bad(tmp_path, _example("zero1_fp32.json"), "--world-size", "64")
    assert "--world-size 64: this machine cannot host it" in err
    err = _bad(tmp_path, _example("zero1_fp32.json"), "--world-size", "0")
    assert "--world-size 0" in err


def test_bad_shapes(tmp_path):
    err = _bad(tmp_path, _example("zero1_fp32.json"), "--shapes", "4096x4096,4096xabc")
    assert "malformed --shapes: entry 2 '4096xabc'" in err


def test_bad_input_json_mode_prints_one_object(tmp_path):
    p = tmp_path / "c.json"
    p.write_text("[1, 2")
    r = run_cli("--ds-config", p, "--json", timeout=120)
    assert r.returncode == 2
    out = json.loads(r.stdout)
    assert out["verdict"] == "bad_input" and "invalid JSON" in out["message"]


# ------------------------------------------------------------------------------------------------
# the shipped examples


@pytest.mark.pipeline
def test_example_zero1_fp32_passes_via_torchrun_with_json_and_report(tmp_path):
    report = tmp_path / "check.html"
    # three steps: its WarmupLR (log, from 0) runs the first two at lr 0, so two would judge no weight moving
    r = run_cli("--ds-config", EXAMPLES / "zero1_fp32.json", *SMALL, "--steps", "3", "--launcher", "torchrun",
                "--json", "--report", report)
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout)  # stdout holds exactly one JSON object
    assert out["verdict"] == "pass" and out["status"] == "passed" and out["launcher"] == "torchrun"
    assert out["pipeline"]["stage"] == 1 and out["pipeline"]["dtype"] == "fp32"
    assert set(out["worst_ratio"]) >= {"grad", "momentum", "update", "master", "model"}
    assert all(isinstance(v, float) and v <= 1.0 for v in out["worst_ratio"].values())
    assert out["reproduce"].startswith(f"PYTHONPATH={ROOT} {sys.executable} -m harness run --case ")
    assert any("batch sizes rewritten for the harness's world size 2" in n for n in out["rewrites"])
    assert any("scheduler WarmupLR kept" in n for n in out["rewrites"])
    # train_batch_size 64 (for 8 ranks) -> micro 8 x accumulation 1 x 2 ranks
    assert json.loads(out["reproduce"].split("--case ", 1)[1].strip("'"))["ds_config"]["train_batch_size"] == 16
    assert out["report"] == str(report) and report.exists()
    assert "per quantity" in r.stderr and "step 2:" in r.stderr  # human progress went to stderr


@pytest.mark.pipeline
def test_example_zero2_bf16_cpu_offload_passes_quietly():
    r = run_cli("--ds-config", EXAMPLES / "zero2_bf16_cpu_offload.json", *SMALL, "--no-report", "-q")
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()  # -q: the two references' verdicts and the report line, nothing else
    assert len(lines) == 3, r.stdout
    assert lines[0].startswith("muon as defined: ")
    assert lines[1].startswith("verdict: PASS: every quantity within tolerance")
    assert lines[2] == "report: none (--no-report)"


@pytest.mark.pipeline
def test_example_zero3_fp16_nvme_clip_hits_dsm001():
    r = run_cli("--ds-config", EXAMPLES / "zero3_fp16_nvme_clip.json", *SMALL, "--world-size", "1", "--no-report")
    assert r.returncode == 1, r.stdout + r.stderr
    verdict = [ln for ln in r.stdout.splitlines() if ln.startswith("verdict:")]
    assert verdict and "DIVERGED" in verdict[0] and "DSM-001" in verdict[0], r.stdout
    assert "known stock DeepSpeed bug DSM-001" in verdict[0]
    # progress and per-quantity verdicts
    assert "ZeRO-3, offload nvme, fp16, accumulation 4, clipping 1.0, world size 1, 2 steps" in r.stdout
    assert "[1/1] stock: check-zero3_fp16_nvme_clip-z3-nvme-fp16-ws1 start" in r.stdout
    assert "    step 1: " in r.stdout and "    step 2: " in r.stdout
    assert "check-zero3_fp16_nvme_clip-z3-nvme-fp16-ws1 done in" in r.stdout
    for q in ("grad", "update", "master", "model", "global_norm", "loss_scale"):
        assert f"    {q} " in r.stdout
    assert "momentum           DIVERGED" in r.stdout
    assert "MiB moved to/from the swap folder" in r.stdout  # it really swapped
    assert "nvme_path not given: a private swap folder per case" in r.stdout


@pytest.mark.pipeline
def test_example_zero3_fp16_nvme_clip_patched():
    r = run_cli("--ds-config", EXAMPLES / "zero3_fp16_nvme_clip.json", *SMALL, "--world-size", "1", "--no-report",
                "--patched", "--json")
    out = json.loads(r.stdout)
    stock, patched = out["columns"]["stock"], out["columns"]["patched"]
    assert stock["status"] == "xfailed" and "DSM-001" in stock["bug_ids"]
    assert "DSM-001" in r.stderr
    assert patched["status"] in ("passed", "xpassed"), r.stderr
    assert r.returncode == 0 and out["verdict"] == "pass"
    assert out["patched_changes_verdict"] is True
    assert "the bundled fixes CHANGE the verdict" in r.stderr
    dsm = [b for b in out["known_bugs"] if b["id"] == "DSM-001"]
    assert dsm and dsm[0]["observed_fixed_by_patched"] is True
