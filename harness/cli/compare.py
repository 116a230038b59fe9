"""``python -m harness compare --base A --head B``: the same gate on two DeepSpeed trees, classified.

Each side is a release (``0.19.7``: its PyPI sdist in a venv of its own), a source checkout (a folder
with ``setup.py`` and ``deepspeed/``), a commit of a git repository (``REPO@COMMIT``: its files extracted
once into the cache), or ``installed`` (this interpreter's DeepSpeed). Venvs and op builds come from
``scripts/deepspeed_venv.sh`` and the op cache, shared by content. Each side's gate runs in that side's
interpreter with this checkout's harness, stock column only, into ``OUT/base-results`` and
``OUT/head-results``; the cases a side failed without a bug that explains it at full strength run once more
in a fresh gate process (``OUT/base-rerun-results``, ``OUT/head-rerun-results``); ``harness.report.compare``
classifies; ``OUT/summary.md`` and ``OUT/compare.html`` hold the answer. ``--merge DIR...`` joins the OUT
folders of a sharded run (a CI job matrix) instead.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from harness.env import buildenv
from harness.launch.shard import Shard, merge_results
from harness.report import compare as classify
from harness.report.results import Planned, load_plans, record_files, write_plan

RELEASE = re.compile(r"^\d+\.\d+\.\d+$")
# What a DeepSpeed install needs from a source tree (the rest of a repository is not extracted)
TREE_PATHS = ("deepspeed", "csrc", "op_builder", "accelerator", "setup.py", "version.txt", "requirements", "bin",
              "MANIFEST.in", "README.md", "LICENSE", "setup.cfg", "build_win.bat")


class CompareInputError(ValueError):
    """A side that names no DeepSpeed the harness can set up: said before anything runs (exit 2)."""


@dataclass(frozen=True)
class Side:
    role: str  # "base" | "head"
    spec: str  # as given
    kind: str  # "installed" | "release" | "checkout" | "commit"


def parse_side(role: str, spec: str) -> Side:
    if spec == "installed":
        return Side(role, spec, "installed")
    if RELEASE.match(spec):
        return Side(role, spec, "release")
    repo, at, commit = spec.rpartition("@")
    if at and repo and Path(repo).exists() and re.fullmatch(r"[0-9a-fA-F]{7,40}", commit):
        return Side(role, spec, "commit")
    p = Path(spec)
    if p.is_dir():
        if not ((p / "setup.py").is_file() and (p / "deepspeed").is_dir()):
            raise CompareInputError(f"--{role} {spec}: not a DeepSpeed source checkout (no setup.py + deepspeed/)")
        return Side(role, spec, "checkout")
    raise CompareInputError(f"--{role} {spec}: give a release (0.19.7), a source checkout's folder, "
                            f"REPO@COMMIT (a git repository and a commit in it), or 'installed'")


def _extract(repo: str, commit: str) -> Path:
    """A commit's DeepSpeed files, once, under the cache (``git archive`` of the install's paths)."""
    full = subprocess.run(["git", "-C", repo, "rev-parse", "--verify", commit + "^{commit}"], check=True,
                          capture_output=True, text=True).stdout.strip()
    dest = buildenv.cache_root() / "trees" / full[:16]
    if (dest / "setup.py").is_file():
        return dest
    dest.mkdir(parents=True, exist_ok=True)
    listed = subprocess.run(["git", "-C", repo, "ls-tree", "--name-only", full], check=True, capture_output=True,
                            text=True).stdout.split()
    paths = [p for p in TREE_PATHS if p in listed]
    archive = subprocess.Popen(["git", "-C", repo, "archive", full, *paths], stdout=subprocess.PIPE)
    subprocess.run(["tar", "-x", "-C", str(dest)], stdin=archive.stdout, check=True)
    if archive.wait() != 0:
        raise CompareInputError(f"{repo}@{commit}: git archive failed")
    return dest


def interpreter(side: Side) -> str:
    """The Python that imports the side's DeepSpeed (set up once: ``scripts/deepspeed_venv.sh``)."""
    if side.kind == "installed":
        return sys.executable
    spec = side.spec
    if side.kind == "commit":
        repo, _, commit = spec.rpartition("@")
        spec = str(_extract(repo, commit))
    script = buildenv.PROJECT_ROOT / "scripts" / "deepspeed_venv.sh"
    print(f"compare: setting up the {side.role} tree {side.spec}", flush=True)
    out = subprocess.run(["bash", str(script), spec], check=True, stdout=subprocess.PIPE, text=True).stdout
    return str(Path(out.strip().splitlines()[-1]) / "bin" / "python")


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(buildenv.PROJECT_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH")
                                                                       else []))
    env.pop("MUON_HARNESS_DS_AS", None)  # each tree is judged as what its probes say, never as a release it names
    return env


def label(python: str) -> str:
    """What the tree says it is (version and location), for compare.json."""
    code = ("from harness.env import versions; i = versions.installed(); print(f'{i.label} at {i.location}')")
    return subprocess.run([python, "-c", code], check=True, capture_output=True, text=True, env=_env(),
                          cwd=buildenv.PROJECT_ROOT).stdout.strip()


def _name(side: Side, parts: int) -> str:
    if side.kind == "release":
        return side.spec
    if side.kind == "installed":
        return "installed"
    repo, _, commit = side.spec.rpartition("@") if side.kind == "commit" else (side.spec, "", "")
    path = "/".join(Path(repo).resolve().parts[-parts:])
    return f"{path}@{commit[:12]}" if commit else path


def side_names(sides: list[Side]) -> dict[str, str]:
    """Each side by what it is: a release, a checkout's folder, REPO@COMMIT; more of a path where the last
    component alone would name both sides alike. Why not the version DeepSpeed reports: a source tree says
    "0.19.6+unknown" whatever it holds."""
    for parts in (1, 2, 3):
        names = {s.role: _name(s, parts) for s in sides}
        if len(set(names.values())) == len(sides):
            return names
    return {s.role: f"{_name(s, 3)} ({s.role})" for s in sides}


def run_side(python: str, results: Path, gate_args: list[str]) -> int:
    subprocess.run([python, "-m", "harness.launch.warmup", "--skip-compile"], check=True, env=_env(),
                   cwd=buildenv.PROJECT_ROOT)
    cmd = [python, "-m", "harness", "gate", "--no-mutate", "--column", "stock", "--no-report",
           "--results", str(results), *gate_args]
    print("compare: " + " ".join(cmd), flush=True)
    return subprocess.run(cmd, env=_env(), cwd=buildenv.PROJECT_ROOT).returncode


def rerun_side(python: str, results: Path, again: Path) -> None:
    """Run once more, in a fresh gate process (a fresh rank pool, the same seed), every case the side failed
    without a bug that explains it at full strength: a plan naming exactly those case-columns, which the
    gate's ``--resume`` judges. Why: an intermittent failure (DSM-125) must not read as a fix or a regression."""
    names = sorted(n for n, r in classify.side_records(results).items() if classify.needs_rerun(r))
    plans = load_plans(results)
    if not names or not plans:
        return
    args = dict(plans[0]["args"], mutate=False, column="stock", shuffle=None)
    write_plan(again, "compare", [Planned(n, "stock") for n in names], [], args)
    cmd = [python, "-m", "harness", "gate", "--no-report", "--resume", str(again)]
    print(f"compare: rerunning {len(names)} case(s): " + " ".join(cmd), flush=True)
    rc = subprocess.run(cmd, env=_env(), cwd=buildenv.PROJECT_ROOT).returncode
    if rc not in (0, 1):
        print(f"compare: the rerun ended with exit {rc}; cases it did not judge count as not rerun", file=sys.stderr)


def command_of(specs: dict, gate_args: list[str]) -> str:
    """The compare command that, given ``--only=CASE``, reruns one case on both trees as this run did."""
    keep = [a for a in gate_args if a == "--full"]
    if "--seed" in gate_args and gate_args[gate_args.index("--seed") + 1] != "0":
        keep += ["--seed", gate_args[gate_args.index("--seed") + 1]]
    return " ".join(["bash scripts/run.sh compare", "--base", shlex.quote(specs["base"]), "--head",
                     shlex.quote(specs["head"]), *keep])


def write(out: Path, base_results: Path, head_results: Path, labels: dict, command: str | None = None) -> int:
    try:
        rows = classify.compare(base_results, head_results, out / "base-rerun-results", out / "head-rerun-results")
    except FileNotFoundError as exc:  # a side judged nothing: there is no comparison to make
        print(f"compare: {exc}", file=sys.stderr)
        return 4
    md = classify.summary(rows, labels["base"], labels["head"], command)
    (out / "summary.md").write_text(md)
    (out / "compare.html").write_text(classify.render_html(rows, labels["base"], labels["head"], md))
    print(md)
    print(f"compare: {out / 'summary.md'}, {out / 'compare.html'}")
    return 1 if any(r.cls == "regressed" for r in rows) else 0


def run(base: str, head: str, out: Path, gate_args: list[str], rerun: bool = True) -> int:
    sides = [parse_side("base", base), parse_side("head", head)]  # every input error before anything runs
    out.mkdir(parents=True, exist_ok=True)
    labels, specs = side_names(sides), {s.role: s.spec for s in sides}
    command = command_of(specs, gate_args)
    trees = {}
    for side in sides:
        python = interpreter(side)
        trees[side.role] = label(python)
        (out / "compare.json").write_text(json.dumps({"labels": labels, "trees": trees, "specs": specs,
                                                      "command": command, "gate_args": gate_args}, indent=1))
        results = out / f"{side.role}-results"
        rc = run_side(python, results, gate_args)
        judged = bool(record_files(results))
        if rc not in (0, 1) or not judged:  # 1: the gate found failures, which is what is being compared
            print(f"compare: the {side.role} gate ended with exit {rc}"
                  + ("" if judged else ", judging nothing"), file=sys.stderr)
            return rc if rc not in (0, 1) else 4
        again = out / f"{side.role}-rerun-results"
        shutil.rmtree(again, ignore_errors=True)  # an earlier run's reruns are not this run's
        if rerun:
            rerun_side(python, results, again)
    return write(out, out / "base-results", out / "head-results", labels, command)


def merge(parts: list[Path], out: Path) -> int:
    """Join the OUT folders of ``--shard K/N`` runs (each with its base-/head-results, their reruns and
    compare.json)."""
    missing = [str(p) for p in parts if not (p / "compare.json").is_file()]
    if missing:
        raise CompareInputError(f"--merge: no compare.json in {', '.join(missing)} (not a compare OUT folder)")
    meta = [json.loads((p / "compare.json").read_text()) for p in parts]
    labels = [m["labels"] for m in meta]
    if any(lab != labels[0] for lab in labels):
        raise CompareInputError(f"--merge: the shards compared different trees: {labels}")
    out.mkdir(parents=True, exist_ok=True)
    merged = {role: merge_results([p / f"{role}-results" for p in parts], out / f"{role}-results")
              for role in ("base", "head")}
    for role in ("base", "head"):
        again = [p / f"{role}-rerun-results" for p in parts if (p / f"{role}-rerun-results").is_dir()]
        shutil.rmtree(out / f"{role}-rerun-results", ignore_errors=True)
        if again:
            merge_results(again, out / f"{role}-rerun-results")
    command = meta[0].get("command")
    (out / "compare.json").write_text(json.dumps({"labels": labels[0], "trees": meta[0].get("trees"),
                                                  "command": command, "merged_from": [str(p) for p in parts]}))
    return write(out, merged["base"], merged["head"], labels[0], command)


def gate_args_of(args) -> list[str]:
    extra = ["--seed", str(args.seed)]
    if args.full:
        extra.append("--full")
    if args.only:
        extra.append(f"--only={args.only}")  # one token: a filter may start with "-"
    if args.shard:
        Shard.parse(args.shard)  # raises ValueError: an input error
        extra += ["--shard", args.shard]
    elif args.jobs > 1:
        extra += ["--jobs", str(args.jobs)]
    return extra
