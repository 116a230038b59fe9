"""Small user-facing promises: warm-up says what it builds, bad case JSON is exit 2 with a message,
``check`` names the fix for the case's own stage, and the gate's parent does not hold on to outcomes."""
from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
import types
import weakref
from pathlib import Path

import numpy as np
import pytest

from harness.gate import decide as gate
from harness.cli import main_job
from harness.launch import warmup
from harness.case.spec import Case
from harness.case.scenarios import pipeline_case

ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------------------------
# warm-up


def test_warmup_says_each_op_before_building_it_then_its_time(monkeypatch):
    events = []

    class Builder:
        def __init__(self, name):
            self.NAME = name.replace("Builder", "").lower()

        def is_compatible(self, verbose=True):
            return True

        def load(self, verbose=False):
            events.append(("load", self.NAME))

        def cxx_args(self):
            return ["-O3", "-g", "-march=native"]

        def sources(self):
            return ["csrc/op.cpp"]  # one unit: no precompiled header

    accel = types.SimpleNamespace(create_op_builder=Builder)
    import deepspeed.accelerator

    flags = []
    monkeypatch.setattr(deepspeed.accelerator, "get_accelerator", lambda: accel)
    monkeypatch.setattr(warmup.buildenv, "builder_key", lambda b, deps=(): flags.append(b.cxx_args()) or "k")
    monkeypatch.setattr(warmup.buildenv, "ensure_op", lambda name, key, build: build() or "built")
    secs = warmup.build_ops(("CPUAdamBuilder", "AsyncIOBuilder"), say=lambda m: events.append(("say", m)))
    assert set(secs) == {"cpuadam", "asyncio"}
    kinds = [k if k == "load" else ("start" if m.endswith("...") else "ready") for k, m in events]
    assert kinds == ["start", "load", "ready", "start", "load", "ready"], events
    assert "CPUAdamBuilder" in events[0][1] and "ready in" in events[2][1]
    assert flags == [["-O3", "-march=native"]] * 2  # keyed, and so built, without debug info


def test_warmup_builds_in_lanes_that_cover_every_op_once(monkeypatch):
    """Where the machine has the cores, the default warm-up is ``LANES`` side by side: every op in
    exactly one lane, async_io after pin_memory (it loads that build), the compile cache in one lane."""
    cmds = []

    class Proc:
        def __init__(self, cmd):
            cmds.append(cmd)

        def wait(self):
            return 0

        def poll(self):
            return 0

    monkeypatch.setattr(warmup.subprocess, "Popen", Proc)
    assert warmup.build_in_lanes(skip_compile=False) == 0
    lanes = [c[c.index("--ops") + 1].split(",") for c in cmds]
    assert sorted(op for lane in lanes for op in lane) == sorted(warmup.OPS)
    pin = next(lane for lane in lanes if "AsyncIOBuilder" in lane)
    assert pin.index("PinMemoryBuilder") < pin.index("AsyncIOBuilder")
    assert sum("--skip-compile" not in c for c in cmds) == 1 and all("--lane" in c for c in cmds)


def test_warmup_counts_torchs_own_deprecation_warnings_and_shows_the_rest(monkeypatch):
    """The compile cache's fill raised a dozen identical ``FutureWarning`` blocks from inside torch's
    inductor and ``DeprecationWarning`` blocks from torch's jit: one line counts and names them; a
    warning from anywhere else, a deprecation included, is still shown."""
    import warnings

    def fill():
        for _ in range(3):
            warnings.warn_explicit("deprecated", FutureWarning, "/x/site-packages/torch/_inductor/lowering.py", 2352)
        warnings.warn_explicit("script_method", DeprecationWarning, "/x/site-packages/torch/jit/_script.py", 365)
        warnings.warn_explicit("yours", UserWarning, "/work/model.py", 7)
        warnings.warn_explicit("old api", DeprecationWarning, "/work/model.py", 9)

    said, shown = [], []
    monkeypatch.setattr(warmup.compiled, "warm_compiled_muon_update", fill)
    monkeypatch.setattr(warmup.warnings, "showwarning", lambda msg, cat, f, n, *a: shown.append((str(msg), cat)))
    warmup.fill_compile_cache(say=said.append)
    assert said == ["warmup: 4 deprecation warning(s) raised inside torch itself filtered "
                    "(DeprecationWarning _script.py:365, FutureWarning lowering.py:2352)"]
    assert shown == [("yours", UserWarning), ("old api", DeprecationWarning)]


def test_warmup_probes_the_cpu_once_and_serves_the_answer_to_its_op_keys(monkeypatch, tmp_path):
    """DeepSpeed's ``cxx_args`` asks py-cpuinfo twice per op (a subprocess each time); after the
    warm-up's one probe, those asks, and the ranks' (the file), get the stored answer."""
    import cpuinfo
    import cpuinfo.cpuinfo as inner

    probes = []

    def probe():
        probes.append(1)
        return {"arch": "X86_64", "flags": ["avx512f"]}

    monkeypatch.setattr(cpuinfo, "get_cpu_info", probe)
    monkeypatch.setattr(inner, "get_cpu_info", probe)
    monkeypatch.setattr(warmup.buildenv, "cpuinfo_cache", lambda: tmp_path / "cpuinfo.json")
    info = warmup.fill_cpuinfo_cache()
    assert cpuinfo.get_cpu_info() == inner.get_cpu_info() == info
    assert len(probes) == 1 and json.loads((tmp_path / "cpuinfo.json").read_text()) == info


def test_warmup_fills_the_compile_cache_once_per_key(monkeypatch, tmp_path):
    """A second warm-up of the same key leaves a filled cache alone; a new key (another torch, another
    DeepSpeed muon_update, other warm shapes) fills it again; a fill that raises leaves no stamp."""
    fills, said = [], []
    key = ["k1"]
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setattr(warmup.compiled, "warm_key", lambda: key[0])
    monkeypatch.setattr(warmup.compiled, "warm_compiled_muon_update", lambda: fills.append(key[0]))
    assert warmup.ensure_compile_cache(say=said.append) == "filled"
    assert warmup.ensure_compile_cache(say=said.append) == "present"
    assert fills == ["k1"] and said[-1] == "warmup: torch.compile cache for muon_update present (key k1)"
    key[0] = "k2"
    assert warmup.ensure_compile_cache(say=said.append) == "filled" and fills == ["k1", "k2"]

    def broken():
        raise RuntimeError("inductor failed")

    key[0] = "k3"
    monkeypatch.setattr(warmup.compiled, "warm_compiled_muon_update", broken)
    with pytest.raises(RuntimeError, match="inductor failed"):
        warmup.ensure_compile_cache(say=said.append)
    assert not warmup.compiled.warm_stamp("k3").exists() and warmup.compiled.warm_stamp("k2").exists()


def test_warmup_compile_key_names_torch_and_deepspeeds_muon_source(monkeypatch):
    """The key changes with the torch version and with DeepSpeed's ``original_muon`` source."""
    import inspect

    import torch

    base = warmup.compiled.warm_key()
    assert warmup.compiled.warm_key() == base
    monkeypatch.setattr(torch, "__version__", torch.__version__ + "+other")
    assert warmup.compiled.warm_key() != base
    monkeypatch.undo()
    real = inspect.getsource
    monkeypatch.setattr(inspect, "getsource",
                        lambda obj: real(obj) + ("#changed" if getattr(obj, "__name__", "").endswith("original_muon")
                                                 else ""))
    assert warmup.compiled.warm_key() != base


def test_warmup_compile_key_names_the_inductor_settings_of_the_base_env(monkeypatch):
    """A setting that shapes inductor's compile command shapes its cache keys: a cache filled under
    another one is not this one's."""
    base = warmup.compiled.warm_key()
    env = warmup.buildenv.base_env()
    changed = dict(env, TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS="1")
    monkeypatch.setattr(warmup.compiled.buildenv, "base_env", lambda: changed)
    assert warmup.compiled.warm_key() != base


def test_warmup_prints_a_total(monkeypatch, capsys):
    monkeypatch.setattr(warmup.buildenv, "clear_stale_locks", lambda max_age_s: [])
    monkeypatch.setattr(warmup.buildenv, "apply_base_env", lambda extra=None: None)
    monkeypatch.setattr(warmup, "fill_cpuinfo_cache", lambda: {})
    monkeypatch.setattr(warmup, "build_ops", lambda: {"a": 1.0, "b": 2.0})
    monkeypatch.setattr(warmup, "lanes_fit", lambda: 1)  # one process: the lanes have their own test
    assert warmup.main(["--skip-compile"]) == 0
    out = capsys.readouterr().out
    assert "warmup: done in" in out and "2 ops: 3.0s" in out


# ------------------------------------------------------------------------------------------------
# bad case JSON: exit 2 and a message naming the cause


def _case_json(change: dict) -> str:
    """A valid case's JSON with ``change`` applied (a None value deletes the key)."""
    d = json.loads(pipeline_case(1, "none", "fp32", 1).to_json())
    for k, v in change.items():
        if v is None:
            del d[k]
        else:
            d[k] = v
    return json.dumps(d)


@pytest.mark.parametrize("change, says", [
    ({"world_size": 0}, "world_size 0"),
    ({"steps": -1}, "steps -1"),
    ({"params": None}, "params"),
    ({"bogus": 1}, "unknown field(s) bogus"),
])
def test_from_json_names_what_is_wrong(change, says):
    with pytest.raises(ValueError) as e:
        Case.from_json(_case_json(change))
    assert says in str(e.value)


def test_from_json_names_a_parameter_without_shape():
    d = json.loads(_case_json({}))
    d["params"][1] = {"name": "x"}
    with pytest.raises(ValueError, match=r"params\[1\] lacks shape"):
        Case.from_json(json.dumps(d))


def test_from_json_round_trips():
    c = pipeline_case(3, "cpu", "bf16", 2)
    assert Case.from_json(c.to_json()) == c


def test_unused_parameters_round_trip_and_leave_other_cases_json_alone():
    c = pipeline_case(3, "cpu", "bf16", 2)
    assert "unused" not in json.loads(c.to_json())  # stored coverage and baselines keep their keys
    u = c.replace(unused=(("layer1.bias", 2),))
    assert Case.from_json(u.to_json()) == u


@pytest.mark.parametrize("change", [{"offload": "cpu"}, {"client": True}])
def test_fused_adam_fails_needs_a_path_that_builds_fused_adam(change):
    if "offload" in change:
        c = pipeline_case(1, "cpu", "fp32", 2)
    else:
        from harness.catalog.matrix import non_muon_cases

        c = next(x for x in non_muon_cases() if x.client_optimizer is not None)
    with pytest.raises(ValueError, match="fused_adam_fails needs Muon without optimizer offload"):
        c.replace(fused_adam_fails=True)
    ok = pipeline_case(1, "none", "fp32", 2).replace(fused_adam_fails=True)
    assert Case.from_json(ok.to_json()) == ok and "fused_adam_fails" not in json.loads(c.to_json())


@pytest.mark.parametrize("unused, says", [
    ((("nope", 2),), "a parameter of the case"),
    ((("layer1.bias", 3),), "a step from 1 to 2"),  # pipeline_case runs 2 steps
    ((("layer1.bias", 0),), "a step from 1 to 2"),
    (tuple((p, 2) for p in ("layer0.weight", "layer0.bias", "layer1.weight", "layer1.bias")), "no loss"),
])
def test_unused_parameters_are_checked_before_any_rank_starts(unused, says):
    with pytest.raises(ValueError, match=says):
        pipeline_case(1, "none", "fp32", 2).replace(unused=unused)


@pytest.mark.parametrize("change, says", [({"world_size": 0}, "world_size 0"),
                                          ({"params": None}, "missing field(s) params")])
def test_run_with_a_bad_case_exits_2_without_a_traceback(change, says):
    r = subprocess.run([sys.executable, "-m", "harness", "run", "--case", _case_json(change)], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stdout + r.stderr
    assert says in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_mutate_takes_its_own_options():
    """``python -m harness mutate --only X --mutant M`` reaches the kill matrix (no case matches here,
    so nothing runs; the table still prints)."""
    r = subprocess.run([sys.executable, "-m", "harness", "mutate", "--only", "no-such-case", "--mutant",
                        "fp16-momentum"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert "unrecognized arguments" not in r.stderr, r.stderr
    assert "kill rate: 0/1" in r.stdout and "(0 cases" in r.stdout, r.stdout + r.stderr


# ------------------------------------------------------------------------------------------------
# check names the fix for the case's stage


@pytest.mark.parametrize("stage, fix", [(1, "z12-fp32-muon-state"), (2, "z12-fp32-muon-state"),
                                        (3, "z3-fp32-muon-state")])
def test_check_names_the_dsm001_fix_of_the_stage(stage, fix):
    from harness.cli.check import known_bug_info

    info = {b["id"]: b for b in known_bug_info(pipeline_case(stage, "none", "bf16", 2))}
    assert info["DSM-001"]["fix"] == fix and info["DSM-001"]["fixed_by_patched"] is True


def test_fixes_for_filters_by_stage():
    from harness import fixes

    assert set(fixes.fixes_for("DSM-001")) == {"z12-fp32-muon-state", "z3-fp32-muon-state"}
    assert fixes.fixes_for("DSM-009", 3) == ["z3-fp32-muon-state"]  # one of several bugs the fix removes
    assert fixes.fixes_for("DSM-009", 1) == []
    assert fixes.fixes_for("DSM-003", 1) == fixes.fixes_for("DSM-003", 3) != []


# ------------------------------------------------------------------------------------------------
# the gate's parent keeps no failing outcome


def test_run_gate_drops_each_outcome_before_the_next(monkeypatch, tmp_path):
    """Every case fails with a 'trajectory' of 8 MB; by the time the next case is evaluated the
    previous outcome (and with it the trajectory) must be gone: only its message is kept."""
    cases = [pipeline_case(1, "none", "fp32", 1).replace(name=f"c{i}") for i in range(12)]
    alive: list[weakref.ref] = []
    leaked = []

    class Blob:  # weakref-able stand-in for a trajectory
        def __init__(self):
            self.data = np.ones(1 << 20)

    def fake_evaluate(case, column, manager):
        gc.collect()
        leaked.append(sum(r() is not None for r in alive))
        blob = Blob()
        alive.append(weakref.ref(blob))
        return gate.Outcome(case=case, column=column, status="failed", bug_ids=[], message=f"{case.name} diverged",
                            seconds=0.0, trajectory=blob)

    monkeypatch.setattr(main_job, "evaluate", fake_evaluate)
    monkeypatch.setattr("harness.catalog.matrix.gate_cases", lambda full: cases)
    monkeypatch.setattr(main_job, "PoolManager", lambda: types.SimpleNamespace(close=lambda: None))
    monkeypatch.setattr(main_job, "_render", lambda *a, **k: None)
    rc = main_job.run_gate(report=str(tmp_path / "gate.html"), quiet=True, mutate=False)
    assert rc == 1
    assert len(leaked) == 2 * len(cases)
    assert max(leaked) == 0, leaked
    from harness.report import results

    assert len(results.load_records(tmp_path / "gate-results")) == 2 * len(cases)  # all on disk


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="torch starts one thread on one core either way")
def test_the_command_line_keeps_torch_on_one_thread_before_anything_imports_it():
    """The gate's parent judges between its ranks' runs and forks its rank pools only at one OpenMP
    thread (``harness.launch.pool._fork_is_safe``). ``python -m harness`` once imported torch (through
    ``harness.cli.check``'s options) before it set OMP_NUM_THREADS, so torch took every core: the judge
    contended with the ranks and every pool was spawned (a crashing stock case 17-20 s instead of 2.6 s)."""
    script = ("import sys\nfrom harness.__main__ import main\nrc = main(['gate', '--jobs', '0'])\n"
              "import torch\nfrom harness.launch.pool import _fork_is_safe\n"
              "print(torch.get_num_threads(), _fork_is_safe(False), rc)\n")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.stdout.split()[-3:] == ["1", "True", "2"], proc.stdout + proc.stderr


def test_python_dash_m_harness_check_keeps_torch_on_one_thread_too():
    """``python -m harness.cli.check`` (the module run directly) imports torch through its own imports
    before ``main`` runs; the base environment must be in place by then (bad input: exit 2 before any
    rank starts, then the torch it imported is asked)."""
    script = ("import runpy, sys\nsys.argv = ['check', '--ds-config', 'no-such-config.json']\n"
              "try:\n    runpy.run_module('harness.cli.check', run_name='__main__')\n"
              "except SystemExit as e:\n    rc = e.code\n"
              "import torch\nprint(torch.get_num_threads(), rc)\n")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.stdout.split()[-2:] == ["1", "2"], proc.stdout + proc.stderr


def test_a_long_op_build_says_it_is_still_running():
    """A cold async_io build is minutes without output of its own; the warm-up beats while it runs."""
    said: list[str] = []
    with warmup.heartbeat("op async_io", said.append, every_s=0.05):
        time.sleep(0.3)
    n = len(said)
    assert n >= 3 and all(s.startswith("warmup: op async_io still running, ") for s in said)
    time.sleep(0.15)
    assert len(said) == n  # and stops when the build ends
