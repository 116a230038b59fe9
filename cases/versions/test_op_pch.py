"""The precompiled-header compiler front of op builds (``harness.env.pch``): a unit compiled through it
reads the ``.gch`` built once per flag set, and gets the object a plain compile gives. A small standard
header stands in for torch's (whose ``.gch`` takes ~50 s to build); the front is run as ninja runs it."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness.env import pch

CXX = shutil.which("c++") or shutil.which("g++")
pytestmark = pytest.mark.skipif(CXX is None, reason="no C++ compiler on this machine")
UNIT = "#include <vector>\nint total(const std::vector<int>& v) { int s = 0; for (int x : v) s += x; return s; }\n"


def test_compile_parts_keeps_the_shaping_options_and_passes_other_commands_through():
    cmd = ["-MMD", "-MF", "a.o.d", "-DTORCH_EXTENSION_NAME=op", "-isystem", "/inc", "-O0", "-c", "/src/a.cpp",
           "-o", "a.o", "-fPIC"]
    assert pch.compile_parts(cmd) == (["-DTORCH_EXTENSION_NAME=op", "-isystem", "/inc", "-O0", "-fPIC"], "/src/a.cpp")
    assert pch.compile_parts(["a.o", "b.o", "-shared", "-o", "op.so"]) is None  # the link
    assert pch.compile_parts(["-v"]) is None
    assert pch.compile_parts(["-x", "c++-header", "-c", "h.h"]) is None


def _front(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, **{pch.CXX_ENV: CXX, pch.DIR_ENV: str(tmp_path / "pch"), pch.HEADER_ENV: "vector"})
    return subprocess.run([sys.executable, pch.__file__, *args], env=env, capture_output=True, text=True,
                          cwd=tmp_path, timeout=120)


def _symbols(obj: Path) -> list[str]:
    listed = subprocess.run(["nm", "-C", str(obj)], capture_output=True, text=True, check=True)
    return sorted(listed.stdout.splitlines())


def test_units_read_one_gch_per_flag_set_and_get_the_plain_compile_s_object(tmp_path):
    for name in ("a", "b"):
        (tmp_path / f"{name}.cpp").write_text(UNIT.replace("total", f"total_{name}"))
    flags = ["-O2", "-std=c++17", "-fPIC"]
    for name in ("a", "b"):
        done = _front(tmp_path, "-MMD", "-MF", f"{name}.o.d", *flags, "-H", "-c", str(tmp_path / f"{name}.cpp"),
                      "-o", str(tmp_path / f"{name}.o"))
        assert done.returncode == 0, done.stderr
        assert any(line.startswith("! ") and line.endswith(".gch") for line in done.stderr.splitlines()), done.stderr
    assert len(list((tmp_path / "pch").glob("*/precompiled.h.gch"))) == 1
    subprocess.run([CXX, *flags, "-c", str(tmp_path / "a.cpp"), "-o", str(tmp_path / "plain.o")], check=True)
    assert _symbols(tmp_path / "a.o") == _symbols(tmp_path / "plain.o")
    other = _front(tmp_path, "-O0", "-std=c++17", "-fPIC", "-c", str(tmp_path / "a.cpp"), "-o", str(tmp_path / "c.o"))
    assert other.returncode == 0, other.stderr
    assert len(list((tmp_path / "pch").glob("*/precompiled.h.gch"))) == 2  # other options, another .gch


def test_a_header_that_cannot_be_precompiled_leaves_the_unit_compiling_without(tmp_path, monkeypatch):
    (tmp_path / "a.cpp").write_text(UNIT)
    monkeypatch.setenv(pch.HEADER_ENV, "no/such/header.h")
    env = dict(os.environ, **{pch.CXX_ENV: CXX, pch.DIR_ENV: str(tmp_path / "pch")})
    done = subprocess.run([sys.executable, pch.__file__, "-O0", "-c", str(tmp_path / "a.cpp"), "-o",
                           str(tmp_path / "a.o")], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and (tmp_path / "a.o").exists(), done.stderr
    assert "pch: no precompiled header" in done.stderr


def test_the_build_context_sets_cxx_for_many_units_only_and_removes_the_gch(tmp_path, monkeypatch):
    from harness.env import buildenv

    class Builder:
        def __init__(self, n):
            self.n = n

        def sources(self):
            return [f"csrc/u{i}.cpp" for i in range(self.n)]

    monkeypatch.delenv("CXX", raising=False)
    with buildenv.precompiled_header(Builder(buildenv.PCH_MIN_UNITS - 1), tmp_path):
        assert "CXX" not in os.environ
    with buildenv.precompiled_header(Builder(buildenv.PCH_MIN_UNITS), tmp_path):
        front = Path(os.environ["CXX"])
        assert "g++" in front.name and os.access(front, os.X_OK)
        assert os.environ[pch.CXX_ENV] == "c++" and os.environ[pch.DIR_ENV] == str(tmp_path / "pch")
    assert "CXX" not in os.environ and not (tmp_path / "pch").exists()
