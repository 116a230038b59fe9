"""``mutate --engine cosmic-ray --tree PATH``: source mutation of another DeepSpeed tree's Muon code.

Why a second interpreter: a mutant is judged by importing the mutated copy of DeepSpeed in the ranks,
and the ranks run with the harness's interpreter's packages; the tree under mutation is installed in its
own venv (``scripts/deepspeed_venv.sh``, as ``compare`` makes it), so the driver runs again there, with
``scope.TREE_ENV`` naming the tree's package. Everything downstream keys on that variable: the scope is
derived from the tree's source (``scope.for_tree``), the copy, coverage map and sessions live in a state
folder of their own (``workspace.state_dir``), the ledger file is named for the tree, and 0.19.8's
equivalents do not apply (``equivalents.load``). The candidate cases are the same as on 0.19.8; the
tree's deselections (``harness.env.versions``) leave a case without a usable baseline, so it judges nothing.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

from harness.env import buildenv
from harness.selfcheck.source_mutation import scope


class TreeInputError(ValueError):
    """A ``--tree`` that names nothing this can mutate: said before anything runs (exit 2)."""


def checkout_of(path: str) -> Path:
    """The source checkout ``path`` names (its root, or its ``deepspeed`` package folder)."""
    p = Path(path).expanduser().resolve()
    if p.name == "deepspeed" and (p.parent / "setup.py").is_file():
        p = p.parent
    if not ((p / "setup.py").is_file() and (p / "deepspeed" / "runtime").is_dir()):
        raise TreeInputError(f"--tree {path}: not a DeepSpeed source checkout (no setup.py + deepspeed/runtime/)")
    if not scope.for_tree(str(p / "deepspeed")):
        raise TreeInputError(f"--tree {path}: no Muon code found in {', '.join(scope.files(scope.SCOPE))}")
    return p


def problem(args) -> str | None:
    """What is wrong with ``--tree`` and the options beside it (None: nothing)."""
    if args.tree is None:
        return None
    if args.column != "stock":
        return "--tree judges the stock column only (the patched runtime is written against 0.19.8)"
    if args.distributor != "local":
        return "--tree runs the local distributor only (an HTTP worker has neither the tree nor its venv)"
    try:
        checkout_of(args.tree)
    except TreeInputError as exc:
        return str(exc)
    return None


def runs_here(checkout: Path) -> bool:
    """Whether this interpreter imports the tree's own package (else the run moves to the tree's venv)."""
    from harness.selfcheck.source_mutation import workspace

    try:
        return workspace.installed_deepspeed().resolve() == (checkout / "deepspeed").resolve()
    except RuntimeError:
        return False


def interpreter(checkout: Path) -> Path:
    """The tree's venv's Python, set up once (``scripts/deepspeed_venv.sh``), with the coverage.py the
    ``mutation`` extra pins (the coverage map runs it on the ranks; that script installs no extras)."""
    script = buildenv.PROJECT_ROOT / "scripts" / "deepspeed_venv.sh"
    out = subprocess.run(["bash", str(script), str(checkout)], check=True, stdout=subprocess.PIPE, text=True).stdout
    python = Path(out.strip().splitlines()[-1]) / "bin" / "python"
    if subprocess.run([str(python), "-c", "import coverage"], capture_output=True).returncode:
        extras = tomllib.loads((buildenv.PROJECT_ROOT / "pyproject.toml").read_text())["project"]
        pins = extras["optional-dependencies"]["mutation"]
        subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *pins], check=True)
    return python


def forwarded(args) -> list[str]:
    """The command line of this run, rebuilt from its parsed options (the same run, in another interpreter):
    the source-mutation engine's options as the parser lists them (``engine_options``: flag, dest, default,
    the argparse action's kind)."""
    out = ["mutate", "--engine", "cosmic-ray"] + ([f"--only={args.only}"] if args.only else [])
    for flag, dest, default, kind in args.engine_options["cosmic-ray"]:
        value = getattr(args, dest)
        if value == default:
            continue
        if kind == "_StoreTrueAction":
            out.append(flag)
        elif kind == "_AppendAction":
            out += [f"{flag}={v}" for v in value]
        elif kind == "BooleanOptionalAction":
            out.append(flag if value else "--no-" + flag[2:])
        else:
            out.append(f"{flag}={value}")
    return out


def run_in_tree(args, checkout: Path) -> int:
    """Run this mutate command again in the tree's venv; its exit status."""
    if os.environ.get(scope.TREE_ENV):
        print(f"error: {sys.executable} was to import the tree at {checkout} and imports another DeepSpeed",
              file=sys.stderr)
        return 2
    python = interpreter(checkout)
    env = dict(os.environ, PYTHONPATH=str(buildenv.PROJECT_ROOT), **{scope.TREE_ENV: str(checkout / "deepspeed")})
    env.pop("MUON_HARNESS_DS_AS", None)  # the tree is judged as what its probes say, never as a release it names
    cmd = [str(python), "-m", "harness", *forwarded(args)]
    print("mutate: in the tree's venv: " + " ".join(cmd), flush=True)
    return subprocess.run(cmd, env=env, cwd=buildenv.PROJECT_ROOT).returncode
