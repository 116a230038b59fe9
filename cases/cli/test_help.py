"""``python -m harness ... --help`` answers without torch or DeepSpeed, and documents every option.

Asked in a fresh interpreter each time: the modules a ``--help`` imported are read from that
interpreter's ``sys.modules`` (a property of the import graph, not a timing), so a handler's heavy
import hoisted to a module top fails here on any machine, however fast.
"""
from __future__ import annotations

import argparse
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
    assert set(subcommands()) == {"gate", "run", "bench", "report", "mutate", "gpu", "check"}


@pytest.mark.parametrize("args", [[]] + [[name] for name in sorted(subcommands())], ids=lambda a: a[0] if a else "top")
def test_help_imports_neither_torch_nor_deepspeed(args):
    got, text, _ = _probe([*args, "--help"])
    assert got["code"] == 0, text
    assert got["heavy"] == [], f"{' '.join(args)} --help imported {got['heavy']}"
    assert "usage: python -m harness" in text and "exit codes:" in text
    assert "``" not in text  # plain text, no reStructuredText markup


@pytest.mark.parametrize("name", sorted(subcommands()))
def test_every_option_has_help(name):
    sp = subcommands()[name]
    missing = [a.option_strings or [a.dest] for a in sp._actions
               if a.help != argparse.SUPPRESS and not (a.help or "").strip()]
    assert missing == [], f"{name}: options without help: {missing}"
    assert sum(bool(a.option_strings) for a in sp._actions) > 1  # more than -h: the options were read


def test_every_subcommand_lists_exit_codes_0_and_2():
    for name, sp in subcommands().items():
        codes = [line.split()[0] for line in sp.epilog.splitlines()[1:] if line.startswith("  ") and
                 line.split()[0].isdigit()]
        assert codes[0] == "0" and "2" in codes, (name, sp.epilog)


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
