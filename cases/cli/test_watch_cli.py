"""``python -m harness watch`` without ranks: bad input exits 2 before anything starts, the default watched
set is the one its reasons say (read back against the oracle's layout), the memory bound holds, an
incomplete records folder gives no verdict, and the capture's bootstrap leaves a process that never
imports DeepSpeed alone."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

import oracles
from harness.case.spec import Case, ParamShape, ds_config
from harness.cli import main, parser
from harness.env import buildenv
from harness.launch import lifecycle
from harness.rank import watch_capture, watch_hook, watch_select
from harness.watch import records
from oracles.layout import zero3_padded_tail


@pytest.mark.parametrize("argv", [
    ["watch"],
    ["watch", "--"],
    ["watch", "--steps", "0", "--", "python", "train.py"],
    ["watch", "--steps", str(parser.WATCH_MAX_STEPS + 1), "--", "python", "train.py"],
    ["watch", "--steps", "two", "--", "python", "train.py"],
    ["watch", "--max-mib", "0", "--", "python", "train.py"],
    ["watch", "--judge", "somewhere", "--", "python", "train.py"],
])
def test_bad_input_is_a_usage_error(argv):
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(argv)
    assert exc.value.code == 2


def test_an_unknown_mutant_exits_2_before_the_command_runs(tmp_path, capsys):
    marker = tmp_path / "ran"
    code = main.main(["watch", "--out", str(tmp_path / "out"), "--mutant", "no-such-mutant", "--",
                      sys.executable, "-c", f"open({str(marker)!r}, 'w')"])
    assert code == 2
    assert "unknown mutant" in capsys.readouterr().err
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_the_command_after_the_separator_is_kept_whole():
    command = ["torchrun", "--nproc_per_node", "2", "t.py", "--steps", "9"]
    args = parser.parse_args(["watch", "--steps", "2", "--", *command])
    assert args.steps == 2 and args.command == command


def _case(shapes, stage: int, world: int = 2, **zero) -> Case:
    params = tuple(ParamShape(f"p{i}.{'weight' if len(s) > 1 else 'bias'}", s) for i, s in enumerate(shapes))
    return Case(name="sel", params=params, world_size=world, steps=3,
                ds_config=ds_config(stage=stage, world_size=world, extra_zero=zero or None))


def test_default_z12_picks_are_what_their_reasons_say():
    case = _case([(24, 20), (24,), (15, 24), (15,), (7, 15), (7,)], stage=2)
    layout = watch_select.layout_of(case)
    picks = watch_select.default_picks(case)
    straddling = [n for n, why in picks.items() if "straddling" in why]
    padded = [n for n, why in picks.items() if "padded tail" in why]
    assert straddling and padded, picks
    assert len(oracles.param_slices(layout, straddling[0])) > 1
    last = [pl for pl in layout.placements if pl.group == oracles.placement(layout, padded[0]).group][-1]
    assert last.name == padded[0] and layout.group_numel[last.group] > layout.group_data_end[last.group]
    assert any(len(p.shape) == 1 for p in case.params if p.name in picks)


def test_default_z3_picks_name_a_padded_tail_and_a_subgroup_pair():
    case = _case([(24, 20), (24,), (15, 24), (15,), (7, 15), (7,)], stage=3, world=2, sub_group_size=300)
    layout = watch_select.layout_of(case)
    picks = watch_select.default_picks(case)
    tail = next(n for n, why in picks.items() if "padded tail" in why)
    assert zero3_padded_tail(next(p.numel for p in case.params if p.name == tail), 2) is not None
    first = next(n for n, why in picks.items() if why == "first parameter of a sub-group")
    other = next(n for n, why in picks.items() if why == "non-first parameter of a sub-group")
    group = {pl.name: pl.group for pl in layout.placements}
    assert group[first] == group[other]
    assert [pl.name for pl in layout.placements if pl.group == group[first]][0] == first


def test_the_memory_bound_leaves_out_what_does_not_fit():
    case = _case([(24, 20), (24,), (15, 24), (15,)], stage=2)
    costs = {p.name: watch_select.bytes_per_rank(p.numel, case.steps, 2) for p in case.params}
    bound = costs["p0.weight"] + costs["p1.bias"]
    kept, dropped = watch_select.select(case, ("*",), bound, 2)
    assert sum(costs[n] for n in kept) <= bound
    assert set(kept) | set(dropped) == set(costs) and dropped
    assert watch_select.select(case, ("p2.*",), 1e12, 2)[0].keys() == {"p2.weight"}


def test_records_of_missing_ranks_give_no_verdict(tmp_path):
    with pytest.raises(records.RecordsError, match="no rank file"):
        records.load(tmp_path, "x")
    settings = watch_hook.Settings(out=str(tmp_path))
    watch_capture.write_rank_file(settings, 1, {"world_size": 2, "error": None, "steps": []})
    with pytest.raises(records.RanksMissing):
        records.load(tmp_path, "x")
    watch_capture.write_rank_file(settings, 0, {"world_size": 2, "error": "Traceback\nValueError: boom\n"})
    with pytest.raises(records.RecordsError, match="rank 0: ValueError: boom"):
        records.load(tmp_path, "x")


def test_the_bootstrap_leaves_a_process_without_deepspeed_alone(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(watch_hook.BOOT_DIR), str(buildenv.PROJECT_ROOT)]),
               **{watch_hook.ENV: watch_hook.Settings(out=str(tmp_path)).to_env()})
    code = ("import sys; import harness.rank.watch_hook as h; "
            "print(h._STATE['settings'] is not None, 'deepspeed' in sys.modules, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "False", "False"]


def test_a_signal_ends_watch_and_everything_its_command_started(tmp_path):
    pids = tmp_path / "pids"
    body = ("import os, subprocess, sys, time; "
            "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True); "
            f"open({str(pids)!r}, 'w').write(f'{{os.getpid()}} {{c.pid}}'); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-m", "harness", "watch", "--out", str(tmp_path / "out"), "--",
                             sys.executable, "-c", body], cwd=buildenv.PROJECT_ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (pids.exists() and len(pids.read_text().split()) == 2) and time.monotonic() < deadline:
        time.sleep(0.2)
    started = [int(p) for p in pids.read_text().split()]
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM, err
    time.sleep(1.0)
    assert [p for p in started if lifecycle.start_time(p) is not None] == [], "the command outlived watch"
