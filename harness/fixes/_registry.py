"""The machinery behind ``harness.fixes``: version guard, source-hash guard, install/restore.

A *fix* is a named behaviour change tied to the registered bugs it removes (by id only: what each bug is,
and how a fix joins it, is the registry's to say, ``harness.registry``). It needs one or more *targets*: a
DeepSpeed function (module attribute or class attribute) replaced by a patched version. Several
fixes may share a target (one patched ``_muon_update_sub_group`` carries both the fp32-state fix and
the per-group ``ns_method`` fix); a target is installed while at least one fix that needs it is
active, and every patched function asks ``active(name)`` for each behaviour it adds, falling back
to stock behaviour otherwise. So any subset of fixes can be applied, and ``remove()`` puts back the
exact objects that were there before.

Before a target is replaced, the source of the function currently installed there is hashed
(sha256 of its dedented source, looking through decorators such as ``instrument_w_nvtx`` that do
not set ``__wrapped__``) and compared with the hash recorded from DeepSpeed 0.19.8. A mismatch means
somebody (another patch, a different build) changed the function; the fix then refuses instead of
silently replacing code it was not written against.
"""
from __future__ import annotations

import hashlib
import importlib
import inspect
import textwrap
import threading
from dataclasses import dataclass
from typing import Callable

EXPECTED_DEEPSPEED = "0.19.8"

_LOCK = threading.RLock()
ACTIVE: set[str] = set()  # names of active fixes (read by the patched functions)
_INSTALLED: dict[str, tuple[object, str, object]] = {}  # target key -> (owner, attr, original)
_MARK = "__dsm_patched_runtime__"


class PatchedRuntimeError(RuntimeError):
    """The patched runtime refuses to install (wrong DeepSpeed version, unexpected source)."""


class Refusal(ValueError):
    """A config a fix declines to run (its bug has no correct behaviour there), raised from the config
    alone, so on every rank at the same point and before the optimizer's first collective: the ranks
    stay fit for the next case (``harness.launch.pool`` keeps them instead of starting new ones)."""


def active(name: str) -> bool:
    return name in ACTIVE


# Loss scale carried by the gradient the next ``muon_update`` call receives (set by the patched
# non-offload call sites while ``muon-momentum-scale-units`` is active; read by the patched
# ``muon_update``). A plain global: DeepSpeed calls Muon from the training thread only.
MUON_INPUT_SCALE: list = [None]


class muon_input_scale:
    def __init__(self, scale):
        self.scale = scale

    def __enter__(self):
        self.prev = MUON_INPUT_SCALE[0]
        MUON_INPUT_SCALE[0] = self.scale
        return self

    def __exit__(self, *exc):
        MUON_INPUT_SCALE[0] = self.prev
        return False


@dataclass(frozen=True)
class Target:
    """One DeepSpeed function a fix replaces."""

    module: str  # "deepspeed.runtime.zero.stage3"
    qualname: str  # "DeepSpeedZeroOptimizer_Stage3._muon_update_sub_group" or "muon_update"
    sha256_16: str  # first 16 hex digits of sha256(dedented source) in DeepSpeed 0.19.8
    make: Callable[[object], object]  # original -> replacement

    @property
    def key(self) -> str:
        return f"{self.module}.{self.qualname}"

    def owner_and_attr(self):
        mod = importlib.import_module(self.module)
        parts = self.qualname.split(".")
        owner = mod
        for p in parts[:-1]:
            owner = getattr(owner, p)
        return owner, parts[-1]


@dataclass(frozen=True)
class Fix:
    name: str
    bugs: tuple[str, ...]  # the registered bug ids this change removes (harness.registry.bugs holds their text)
    targets: tuple[Target, ...]
    notes: str = ""  # about the change itself (how it acts, what it costs), never the bug's symptom
    summary: str = ""  # what it changes, in a line: docs/patched-runtime.md's table is generated from it

    @property
    def replaces(self) -> tuple[str, ...]:
        return tuple(t.key for t in self.targets)


def _innermost(fn, name: str):
    """Look through decorators to the function that carries the real source."""
    seen = set()
    cur = fn
    while id(cur) not in seen:
        seen.add(id(cur))
        if hasattr(cur, "__wrapped__"):
            cur = cur.__wrapped__
            continue
        code = getattr(cur, "__code__", None)
        if code is not None and code.co_name != name and cur.__closure__:
            inner = [c.cell_contents for c in cur.__closure__
                     if callable(getattr(c, "cell_contents", None))
                     and getattr(c.cell_contents, "__name__", "") == name]
            if inner:
                cur = inner[0]
                continue
        break
    return cur


# code object -> (that object, its source hash). Every patched case checks every target before it
# installs the fix (twice: ``apply`` and ``install_target``); reading the source back through
# ``inspect`` tokenizes DeepSpeed's files each time, ~0.15 s per case per rank, most of a patched
# case's engine build. A code object's source cannot change under it: a mutant or another patch is
# a new function object with its own code, hashed on first sight (the entry holds the object, so its
# id is never reused), and a mutated copy of DeepSpeed is imported by a fresh process.
_HASHED: dict[int, tuple[object, str]] = {}


def source_hash(fn, name: str | None = None) -> str:
    name = name or getattr(fn, "__name__", "")
    inner = _innermost(fn, name)
    code = getattr(inner, "__code__", None)
    hit = _HASHED.get(id(code)) if code is not None else None
    if hit is not None and hit[0] is code:
        return hit[1]
    digest = hashlib.sha256(textwrap.dedent(inspect.getsource(inner)).encode()).hexdigest()[:16]
    if code is not None:
        _HASHED[id(code)] = (code, digest)
    return digest


def prime_source_hashes(targets) -> int:
    """Hash the function installed at each target now, so that every rank a parent forks afterwards
    finds it in ``_HASHED`` instead of tokenizing DeepSpeed's files again on its first patched case
    (~0.1 s per rank start, and the gate starts a pool afresh after each crashing case). Returns how
    many were hashed. A target this DeepSpeed lacks is skipped: ``verify`` reports it where it matters."""
    n = 0
    for t in targets:
        try:
            _owner, attr, cur = _current(t)
            source_hash(cur, attr)
        except Exception:  # an older release: a missing module or attribute, or no source to read
            continue
        n += 1
    return n


def check_version() -> str:
    import deepspeed  # late: DeepSpeed, rank side

    v = getattr(deepspeed, "__version__", "?")
    if v != EXPECTED_DEEPSPEED:
        raise PatchedRuntimeError(
            f"harness.fixes was written against DeepSpeed {EXPECTED_DEEPSPEED} and refuses to patch "
            f"DeepSpeed {v}: the functions it replaces may differ. Check whether the bugs are fixed upstream "
            f"in {v}, and re-derive the patches if not.")
    return v


def _current(target: Target):
    owner, attr = target.owner_and_attr()
    cur = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
    return owner, attr, cur


def verify(target: Target) -> None:
    """Raise unless the function now installed at ``target`` is stock 0.19.8 (or already ours)."""
    owner, attr, cur = _current(target)
    if getattr(cur, _MARK, None) == target.key:
        return
    got = source_hash(cur, attr)
    if got != target.sha256_16:
        raise PatchedRuntimeError(
            f"{target.key}: source hash {got} differs from DeepSpeed {EXPECTED_DEEPSPEED}'s {target.sha256_16}; "
            "it was modified (another patch, a mutant, or a different build), so the fix is not applied")


def install_target(target: Target) -> None:
    if target.key in _INSTALLED:
        return
    owner, attr, cur = _current(target)
    verify(target)
    new = target.make(cur)
    setattr(new, _MARK, target.key)
    setattr(owner, attr, new)
    _INSTALLED[target.key] = (owner, attr, cur)


def uninstall_target(key: str) -> None:
    owner, attr, orig = _INSTALLED.pop(key)
    setattr(owner, attr, orig)


def installed_keys() -> list[str]:
    return list(_INSTALLED)
