"""A C++ compiler front for op builds with many translation units: torch's extension header is
compiled once per flag set (a GCC precompiled header) and every translation unit reads it instead of
parsing it again.

Why: each of async_io's dozen translation units spends most of its compile parsing torch's headers
(docs/measurements.md, "precompiled torch header"). GCC uses ``H.gch`` for ``-include H`` when the
``.gch`` was built with the same options; with other options it reads ``H`` itself, so a stale or
foreign ``.gch`` costs time, never a different object. The header goes first in each unit, before
the unit's own standard headers; no op source defines a macro before its includes, so nothing it
declares changes.

ninja runs this file as ``$cxx`` (``CXX``, a launcher script; see ``buildenv.precompiled_header``).
Standard library only: it starts once per compile, outside the harness's import path.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

CXX_ENV = "MUON_HARNESS_PCH_CXX"  # the compiler this front calls (CXX as it was, else c++)
DIR_ENV = "MUON_HARNESS_PCH_DIR"  # where the .gch files of this build go
HEADER_ENV = "MUON_HARNESS_PCH_HEADER"  # the header precompiled (tests name a small one)
DEFAULT_HEADER = "torch/extension.h"
SOURCE_SUFFIXES = (".cpp", ".cc", ".cxx")


def compile_parts(argv: list[str]) -> tuple[list[str], str] | None:
    """(the options that shape a compile, the source) of a ``-c`` compile of one C++ source, else
    None (a link, ``-v``, a version query: passed through as they are). The dependency file and the
    output are left out: they differ per unit and do not shape the header."""
    if "-c" not in argv or "-x" in argv:
        return None
    at = argv.index("-c")
    if at + 1 == len(argv) or not argv[at + 1].endswith(SOURCE_SUFFIXES):
        return None
    flags, skip = [], False
    for i, arg in enumerate(argv):
        if skip or i in (at, at + 1) or arg == "-MMD":
            skip = False
        elif arg in ("-o", "-MF"):
            skip = True
        else:
            flags.append(arg)
    return flags, argv[at + 1]


def header_for(cxx: str, flags: list[str], folder: Path, include: str) -> Path:
    """The header to ``-include``, its ``.gch`` built under a lock by the first unit that needs it
    (ninja runs several units at once; the others wait rather than build it again)."""
    key = hashlib.sha256(json.dumps([cxx, include, flags]).encode()).hexdigest()[:16]
    where = folder / key
    where.mkdir(parents=True, exist_ok=True)
    header = where / "precompiled.h"
    gch = where / "precompiled.h.gch"
    with open(where / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not gch.exists():
            header.write_text(f"#include <{include}>\n")
            tmp = where / f".precompiled.h.gch.{os.getpid()}"
            subprocess.run([cxx, *flags, "-x", "c++-header", str(header), "-o", str(tmp)], check=True)
            os.replace(tmp, gch)
    return header


def main(argv: list[str]) -> int:
    cxx = os.environ.get(CXX_ENV) or "c++"
    folder = os.environ.get(DIR_ENV)
    parts = compile_parts(argv)
    if folder and parts:
        flags, _ = parts
        try:
            header = header_for(cxx, flags, Path(folder), os.environ.get(HEADER_ENV) or DEFAULT_HEADER)
        except (OSError, subprocess.CalledProcessError) as exc:  # the unit still compiles, only slower
            print(f"pch: no precompiled header ({exc}); compiling without", file=sys.stderr)
        else:
            argv = ["-include", str(header), *argv]
    os.execvp(cxx, [cxx, *argv])
    return 127  # not reached: exec replaces this process


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
