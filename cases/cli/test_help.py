"""``python -m harness ... --help`` answers without torch or DeepSpeed, and documents every option.

Asked in a fresh interpreter each time: the modules a ``--help`` imported are read from that
interpreter's ``sys.modules`` (a property of the import graph, not a timing), so a handler's heavy
import hoisted to a module top fails here on any machine, however fast.
"""
from __future__ import annotations

import argparse
import signal
import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness.cli import parser

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "deepspeed")
PROBE = """\
import json, sys
from harness.cli.main import main
try:
    main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
print(json.dumps({"code": code, "heavy": sorted(m for m in %r if m in sys.modules)}))
""" % (HEAVY,)


def subcommands() -> dict[str, argparse.ArgumentParser]:
    [sub] = [a for a in parser.build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def _probe(args: list[str]) -> tuple[dict, str, str]:
    """(exit code and heavy modules imported, the help text, stderr) of ``python -m harness ARGS``."""
    proc = subprocess.run([sys.executable, "-c", PROBE, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    *text, last = proc.stdout.rstrip("\n").split("\n")
    return json.loads(last), "\n".join(text), proc.stderr


def test_the_tree_has_every_subcommand():
    assert set(subcommands()) == {"gate", "run", "compare", "bench", "report", "mutate", "gpu", "check", "watch"}


@pytest.mark.parametrize("args", [[]] + [[name] for name in sorted(subcommands())], ids=lambda a: a[0] if a else "top")
def test_help_imports_neither_torch_nor_deepspeed(args):
    got, text, _ = _probe([*args, "--help"])
    assert got["code"] == 0, text
    assert got["heavy"] == [], f"{' '.join(args)} --help imported {got['heavy']}"
    assert "usage: python -m harness" in text and "exit codes:" in text
    assert "``" not in text  # plain text, no reStructuredText markup


def without_help(ap: argparse.ArgumentParser, path: str = "python -m harness") -> list[str]:
    """Every argument of ``ap`` and of the parsers under it (any depth) with no help text: options,
    positionals, and each subcommand's one-line summary. A hidden option (``SUPPRESS``) is not shown."""
    out = []
    for a in ap._actions:
        name = "/".join(a.option_strings) or a.dest
        if a.help != argparse.SUPPRESS and not (a.help or "").strip():
            out.append(f"{path} {name}")
        if isinstance(a, argparse._SubParsersAction):
            summaries = {c.dest: c.help for c in a._choices_actions}
            for cmd, sp in a.choices.items():
                if not (summaries.get(cmd) or "").strip():
                    out.append(f"{path} {cmd} (no summary in the command list)")
                out += without_help(sp, f"{path} {cmd}")
    return out


def test_every_argument_of_the_tree_has_help():
    assert without_help(parser.build_parser()) == []
    n = sum(len(sp._actions) for sp in subcommands().values())
    assert n > 60  # the walk reached every subcommand's options (about 80 in all)


def test_the_walk_finds_an_argument_without_help():
    ap = argparse.ArgumentParser(prog="p")
    ap.add_argument("--described", help="has help")
    ap.add_argument("--bare")
    sub = ap.add_subparsers(dest="cmd", help="the command")
    inner = sub.add_parser("inner")  # no summary either
    inner.add_argument("target")
    inner.add_argument("--hidden", help=argparse.SUPPRESS)
    assert without_help(ap, "p") == ["p --bare", "p inner (no summary in the command list)", "p inner target"]


def test_every_subcommand_lists_exit_codes_0_and_2():
    for name, sp in subcommands().items():
        codes = [line.split()[0] for line in sp.epilog.splitlines()[1:] if line.startswith("  ") and
                 line.split()[0].isdigit()]
        assert codes[0] == "0" and "2" in codes, (name, sp.epilog)


def listed_codes(sp: argparse.ArgumentParser) -> dict[int, str]:
    """The exit codes a subcommand's --help lists, each with its (unwrapped) text."""
    out: dict[int, str] = {}
    code = None
    for line in sp.epilog.splitlines()[1:]:
        head = line.split()[0] if line.strip() else ""
        if line.startswith("  ") and not line.startswith("   ") and head.isdigit():
            code = int(head)
            out[code] = line.strip()[len(head):].strip()
        elif code is not None:
            out[code] += " " + line.strip()
    return out


def _huge_case() -> str:
    from harness.case.scenarios import pipeline_case

    d = json.loads(pipeline_case(1, "none", world_size=2, steps=1).to_json())
    d["world_size"] = 4096
    return json.dumps(d)


# (argv, the code the handler returns, words of that code's listed reason): each a bad input the handler
# refuses before any rank starts, so the listed codes are checked against what the code really returns.
BAD_INPUTS = [
    (["gate", "--shard", "3"], 2, "--shard not K/N"),
    (["gate", "--jobs", "0"], 2, "--jobs below 1"),
    (["gate", "--jobs", "2", "--shard", "1/2"], 2, "or with --shard"),
    (["run", "--case-file", "{tmp}/absent.json"], 2, "the case file cannot be read"),
    (["run", "--case", "{{not json"], 2, "not a valid case"),
    (["run", "--case", "{huge}"], 2, "a world size this machine cannot host"),
    (["report", "{tmp}/absent"], 2, "a results folder does not exist"),
    (["bench", "--from-results", "{tmp}"], 2, "no gate outcomes stored in DIR"),
    (["mutate", "--case", "no-such-case"], 2, "an unknown --case"),
    (["mutate", "--engine", "cosmic-ray", "--sample", "0"], 2, "--sample below 1"),
    (["mutate", "--engine", "cosmic-ray", "--distributor", "http"], 2, "--distributor http without --worker-url"),
    (["gpu", "--world-sizes", "1,x"], 2, "a malformed value"),
    (["check", "--ds-config", "{tmp}/absent.json"], 2, "bad input, or a config DeepSpeed refuses"),
]


@pytest.mark.parametrize("argv, code, reason", BAD_INPUTS, ids=lambda x: " ".join(x) if isinstance(x, list) else "")
def test_a_bad_input_exits_with_the_code_and_reason_its_help_lists(argv, code, reason, tmp_path, capsys):
    from harness.cli.main import main

    args = [a.format(tmp=tmp_path, huge=_huge_case() if "{huge}" in a else "") for a in argv]
    try:
        got = main(args)
    except SystemExit as exc:  # argparse's own usage error
        got = exc.code
    listed = listed_codes(subcommands()[argv[0]])
    assert got == code, capsys.readouterr()
    assert code in listed and reason in listed[code], f"{argv[0]} --help lists {listed}"


def test_the_cuda_refusal_of_gpu_is_its_listed_code_2(capsys):
    import torch

    from harness.cli.main import main

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible: gpu would run")
    assert main(["gpu", "--accelerator", "cuda"]) == 2
    assert "no CUDA device" in listed_codes(subcommands()["gpu"])[2]


def test_every_listed_exit_code_of_a_handler_is_one_it_returns():
    """The codes each subcommand lists are exactly 0, 1, 2, check's and watch's 3 and 4, the incomplete folder's 4
    of gate, report and compare (a side's gate incomplete), and 130/143 of a stopped command (every one
    but report, which starts no process): a listed code no handler returns, or a handler's code that is
    not listed, fails here."""
    from harness.cli import check
    from harness.launch.lifecycle import Interrupted

    stopped = {Interrupted(signal.SIGINT).exit_code, Interrupted(signal.SIGTERM).exit_code}
    for name, sp in subcommands().items():
        want = {0, 1, 2} | ({check.EXIT_RUN_FAILED, check.EXIT_CANNOT_JUDGE} if name in ("check", "watch") else set())
        want |= {4} if name in ("gate", "report", "compare") else set()
        want |= set() if name == "report" else stopped
        assert set(listed_codes(sp)) == want, (name, listed_codes(sp))
        if name != "check":
            assert "raised an exception" in listed_codes(sp)[1], name  # Python's exit 1 for an uncaught one


def test_check_exit_codes_are_those_check_returns():
    from harness.cli import check  # the real constants (this imports torch, in this process only)

    listed = [int(c.split()[0]) for c in parser.CHECK_EXIT_CODES]
    assert listed == [check.EXIT_OK, check.EXIT_DIVERGED, check.EXIT_BAD_INPUT, check.EXIT_RUN_FAILED,
                      check.EXIT_CANNOT_JUDGE]


@pytest.mark.parametrize("args, says", [(["--sample", "3"], "--sample needs --engine cosmic-ray"),
                                        (["--engine", "cosmic-ray", "--stock"], "--stock needs no --engine")])
def test_an_option_of_the_other_mutate_engine_is_bad_input(args, says):
    got, _, err = _probe(["mutate", *args])
    assert got["code"] == 2 and got["heavy"] == [], err
    assert says in err, err


def test_an_installed_copy_answers_help_without_its_dependencies(tmp_path):
    """``pip install .`` (not editable) must carry every subpackage and data file, and each ``--help`` must
    answer before DeepSpeed is looked for: installed without dependencies into a folder and run with the
    site packages off (``-S``), so neither torch, numpy nor DeepSpeed can be found."""
    target = tmp_path / "site"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                          "--target", str(target), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert pip.returncode == 0, pip.stderr
    for data in ("harness/data/equivalents.txt", "harness/data/case_times.json", "harness/report/static/report.css"):
        assert (target / data).is_file(), f"{data} is missing from the installed copy"
    env = {"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"}
    for cmd in ["", *subcommands()]:
        args = [sys.executable, "-S", "-m", "harness", *([cmd] if cmd else []), "--help"]
        proc = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0 and "usage: python -m harness" in proc.stdout, (cmd, proc.stderr[-2000:])
