"""What a rank's traceback says was raised, and where: one reading of Python's traceback text, for crash
bugs and DeepSpeed's refusals (``raised_in``, a signature match) and for the judges that need more.

Why it matters: a config DeepSpeed refuses inside ``deepspeed.initialize`` (a check its config classes do
not make) reaches the ranks and fails there; ``check`` must tell that apart from a crash in a step, since
the first is the user's config being refused (exit 2) and the second a run that failed (exit 3).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import PurePath

_FRAME = re.compile(r'^\s*File "(?P<path>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)\s*$')
_EXC = re.compile(r"^(?P<etype>[A-Za-z_][\w.]*)(?::\s?(?P<msg>.*))?$")


@dataclass(frozen=True)
class Frame:
    path: str
    line: int
    func: str

    @property
    def in_deepspeed(self) -> bool:
        """A frame of the ``deepspeed`` package itself (an installed release or a source checkout)."""
        return "deepspeed" in PurePath(self.path).parts[:-1]

    @property
    def where(self) -> str:
        """``file.py:function``, the form the refusals registry names frames in."""
        return f"{PurePath(self.path).name}:{self.func}"


@dataclass(frozen=True)
class Raised:
    etype: str  # as the traceback's last line names it (``deepspeed.x.MyError`` stays qualified)
    message: str  # its first line
    frames: tuple[Frame, ...]  # outermost first, of the last traceback block (the exception that ended it)

    @property
    def innermost(self) -> Frame | None:
        return self.frames[-1] if self.frames else None

    def passed_through(self, file: str, func: str) -> bool:
        return any(f.func == func and PurePath(f.path).as_posix().endswith(file) for f in self.frames)


def last_raise(text: str) -> Raised | None:
    """The exception a traceback ends in, with the frames of its own block (a chained exception's
    "During handling ..." blocks before it are not its frames); None when ``text`` holds no traceback."""
    lines = text.splitlines()
    starts = [i for i, ln in enumerate(lines) if ln.startswith("Traceback (most recent call last):")]
    if not starts:
        return None
    frames, etype, message = [], None, ""
    for ln in lines[starts[-1] + 1:]:
        m = _FRAME.match(ln)
        if m:
            frames.append(Frame(m["path"], int(m["line"]), m["func"]))
            continue
        if ln.startswith((" ", "\t")) or not ln.strip():
            continue  # a frame's source line or its ^^^ markers
        e = _EXC.match(ln)
        if e and frames:
            etype, message = e["etype"], (e["msg"] or "").strip()
            break
    if etype is None:
        return None
    return Raised(etype, message, tuple(frames))


def refused_at_initialize(text: str) -> Raised | None:
    """The exception, where DeepSpeed itself raised it while ``deepspeed.initialize`` ran: its innermost
    frame is DeepSpeed's and ``initialize`` of ``deepspeed/__init__.py`` is on the stack. A raise in the
    harness's own code (capture, the patched runtime) is not DeepSpeed refusing the config."""
    r = last_raise(text)
    if r is None or r.innermost is None or not r.innermost.in_deepspeed:
        return None
    return r if r.passed_through("deepspeed/__init__.py", "initialize") else None


def raised_in(traceback: str, etype: str, fragment: str, func: str, file: str | None = None) -> bool:
    """Does a rank's traceback end in ``etype`` with ``fragment`` in its message, raised through ``func``
    (in ``file``, when given)? One reading of a traceback for crash bugs and DeepSpeed's own refusals."""
    lines = traceback.strip().splitlines()
    # (a bare ``assert`` ends the traceback with the type alone)
    last = [line for line in lines if line.startswith(etype + ":") or line.strip() == etype]
    if not (last and fragment in last[-1]):
        return False
    if file is None:
        return f"in {func}" in traceback
    return any(file in line and line.rstrip().endswith(f"in {func}") for line in lines)
