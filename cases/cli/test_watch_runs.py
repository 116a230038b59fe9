"""``python -m harness watch`` on a plain DeepSpeed loop (``cases/cli/watch_loop.py``: ZeRO-2, Muon, gloo,
CPU) launched by ``torchrun --nproc_per_node 2`` and by the ``deepspeed`` launcher, as a user launches it.

* bf16 with the bundled fixes applied by the script itself passes (exit 0); stock, the divergence is
  named as the registered bug whose model matches (exit 1), a bug the registry lists for the pipeline;
* the trained weights are bit-identical with and without watch (the capture reads, it never writes);
* a catalogued mutant installed in the ranks (``--mutant``) makes watch exit 1 naming the tensor, the
  step and the rank;
* two local "nodes" (``torchrun --nnodes 2``) share one records folder and are judged.

Each run starts two ranks and the watch parent (~35 s on two loaded cores).
"""
from __future__ import annotations

import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from harness.env import buildenv
from harness.registry.bugs import bugs_for
from harness.watch import records

from cases.cli._watch_run import TIMEOUT_S, user_env, verdict_line, watch

LOOP = str(Path(__file__).with_name("watch_loop.py"))

pytestmark = pytest.mark.pipeline


def torchrun(*script_args: str, nproc: int = 2) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), LOOP,
            *script_args]


@pytest.fixture(scope="module")
def patched_run(tmp_path_factory):
    """The bf16 loop with the fixes the script applies, watched for 2 of its 4 steps, weights saved."""
    tmp = tmp_path_factory.mktemp("watch-patched")
    res = watch(tmp / "records", torchrun("--dtype", "bf16", "--patched", "--save", str(tmp / "watched.pt")),
                "--steps", "2")
    return tmp, res


def test_patched_runtime_passes(patched_run):
    _, res = patched_run
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-3000:]
    assert verdict_line(res).startswith("verdict (patched): PASS")


def test_weights_are_bit_identical_with_and_without_watch(patched_run):
    tmp, res = patched_run
    assert res.returncode == 0
    plain = subprocess.run(torchrun("--dtype", "bf16", "--patched", "--save", str(tmp / "plain.pt")),
                           env=user_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert plain.returncode == 0, plain.stderr[-3000:]
    watched, unwatched = torch.load(tmp / "watched.pt"), torch.load(tmp / "plain.pt")
    assert watched.keys() == unwatched.keys() and watched
    differ = [n for n in watched if not torch.equal(watched[n], unwatched[n])]
    assert differ == [], f"watching changed the trained weights of {differ}"


def test_stock_divergence_is_named_as_the_registered_bug(tmp_path):
    res = watch(tmp_path, torchrun("--dtype", "bf16"), "--steps", "2")
    assert res.returncode == 1, res.stdout[-4000:] + res.stderr[-3000:]
    named = re.findall(r"known stock DeepSpeed bug (DSM-\d+)", verdict_line(res))
    registered = {b.id for b in bugs_for(records.load(tmp_path, "x").case)}
    assert named and set(named) <= registered, (named, registered)


def test_a_broken_muon_path_is_named_by_tensor_step_and_rank(tmp_path):
    res = watch(tmp_path, torchrun(), "--steps", "2", "--mutant", "partition-slice-muon")
    assert res.returncode == 1, res.stdout[-4000:] + res.stderr[-3000:]
    run = records.load(tmp_path, "x")
    straddling = next(n for n, why in run.reasons.items() if "straddling" in why)
    first = next(ln for ln in res.stdout.splitlines() if ln.startswith("first divergence:"))
    assert re.match(rf"first divergence: {re.escape(straddling)} \w+ at step 1, rank \d+", first), first


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_deepspeed_launcher_is_watched(tmp_path):
    launcher = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port",
                str(_free_port()), LOOP, "--patched"]
    res = watch(tmp_path, launcher, "--steps", "2")
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-3000:]
    assert verdict_line(res).startswith("verdict (patched): PASS")


def test_two_local_nodes_share_one_records_folder(tmp_path):
    port = str(_free_port())
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node),
               "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", port, LOOP, "--patched"]
        argv = [sys.executable, "-m", "harness", "watch", "--out", str(tmp_path), "--no-report", "--steps", "2",
                "--", *cmd]
        procs.append(subprocess.Popen(argv, env=user_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, cwd=buildenv.PROJECT_ROOT))
    outs = [p.communicate(timeout=TIMEOUT_S) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, out[-3000:] + err[-3000:]
        assert "verdict (patched): PASS" in out
    assert sorted(f.name for f in records.rank_files(tmp_path)) == ["rank0.pkl", "rank1.pkl"]


def test_stop_after_ends_the_training_at_the_last_watched_step(tmp_path):
    saved = tmp_path / "weights.pt"
    res = watch(tmp_path / "records", torchrun("--save", str(saved)), "--steps", "1", "--stop-after")
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-3000:]
    assert len(records.load(tmp_path / "records", "x").trajectory.steps) == 1
    assert not saved.exists()  # the script's own end (after all its steps) never came


def test_a_script_that_installs_the_capture_itself_is_judged_with_judge(tmp_path):
    folder = tmp_path / "records"
    script = tmp_path / "train.py"
    script.write_text("import runpy, sys\nfrom harness.rank import watch_hook\n"
                      f"watch_hook.install(out={str(folder)!r}, steps=2)\n"
                      f"sys.argv = [{LOOP!r}, '--patched']\nrunpy.run_path({LOOP!r}, run_name='__main__')\n")
    ran = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          str(script)], env=user_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert ran.returncode == 0, ran.stderr[-3000:]
    res = subprocess.run([sys.executable, "-m", "harness", "watch", "--judge", str(folder), "--no-report"],
                         env=user_env(), capture_output=True, text=True, timeout=TIMEOUT_S, cwd=buildenv.PROJECT_ROOT)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-3000:]
    assert verdict_line(res).startswith("verdict (patched): PASS")


def test_param_groups_of_the_scripts_own_give_no_verdict_rather_than_a_false_one(tmp_path):
    """The judged case holds one setting per half; a script's own param groups (two weight decays here)
    are said and exit 3, never judged against the wrong settings."""
    res = watch(tmp_path, torchrun("--own-groups"), "--steps", "1")
    assert res.returncode == 3, res.stdout[-4000:] + res.stderr[-3000:]
    assert "param groups of your own" in res.stdout + res.stderr
