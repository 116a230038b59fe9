"""The rank side of ``python -m harness watch``: wrap ``deepspeed.initialize`` in a user's own process so
the first optimizer steps of the engine it returns are recorded (``harness.rank.watch_capture``).

Two ways in, one mechanism:

* ``python -m harness watch ... -- CMD`` puts ``harness/rank/watch_boot`` first on ``PYTHONPATH``; its
  ``sitecustomize`` calls ``install_from_env()`` in every Python process the command starts (the launcher
  and each rank), reading the settings from ``MUON_HARNESS_WATCH``.
* A script calls ``install(out=..., steps=...)`` itself, before ``deepspeed.initialize``, as it would call
  ``harness.fixes.apply()``; the parent then judges the folder (``python -m harness watch --judge DIR``).

This module imports neither torch nor DeepSpeed: a launcher process (torchrun, the ``deepspeed`` runner)
imports it too, and must not pay for either. DeepSpeed is wrapped when it is imported (a meta-path
finder), so a process that never imports it is left as it was.
"""
from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

ENV = "MUON_HARNESS_WATCH"  # the settings as JSON (``Settings``)
BOOT_DIR = Path(__file__).resolve().parent / "watch_boot"
DEFAULT_STEPS = 3
DEFAULT_MAX_MIB = 512


@dataclass(frozen=True)
class Settings:
    """What a rank records and where it writes it. ``params``: fnmatch globs of parameter names (empty:
    the default set, ``harness.rank.watch_select``); ``max_mib``: the capture's memory bound per rank;
    ``mutant``: a catalogued mutant installed around the engine (the test of a broken Muon path);
    ``preload_ops``: the command uses the harness's own op cache, whose built ops the ranks then import
    straight from their ``.so`` as the harness's ranks do (``runtime_state.preload_built_ops``): DeepSpeed's
    JIT load relinks a shared cache's ``.so`` in place, and a rank of another process loading it then
    aborts."""

    out: str
    steps: int = DEFAULT_STEPS
    params: tuple[str, ...] = ()
    max_mib: float = DEFAULT_MAX_MIB
    stop_after: bool = False
    patched: bool = False
    mutant: str | None = None
    preload_ops: bool = False

    def to_env(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_env(cls, text: str) -> "Settings":
        d = json.loads(text)
        d["params"] = tuple(d.get("params") or ())
        return cls(**d)


_STATE: dict = {"settings": None, "wrapped": False, "engines": 0}


def install(settings: Settings | None = None, **kwargs) -> Settings:
    """Record the first ``steps`` optimizer steps of the next engine ``deepspeed.initialize`` builds in
    this process. Idempotent: a second call only replaces the settings."""
    settings = settings or Settings(**kwargs)
    if settings.steps < 1:
        raise ValueError(f"steps {settings.steps!r}: must be >= 1")
    _STATE["settings"] = settings
    ds = sys.modules.get("deepspeed")
    if ds is not None and hasattr(ds, "initialize"):
        _wrap(ds)
    elif not any(isinstance(f, _DeepSpeedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _DeepSpeedFinder())
    return settings


def install_from_env() -> Settings | None:
    """``install`` with the settings ``python -m harness watch`` put in the environment (None: not watched)."""
    text = os.environ.get(ENV)
    if not text:
        return None
    return install(Settings.from_env(text))


class _DeepSpeedFinder(importlib.abc.MetaPathFinder):
    """Wraps ``deepspeed.initialize`` as soon as ``deepspeed`` has executed, before any caller can bind it
    (``from deepspeed import initialize`` then gets the wrapper). It stays on ``sys.meta_path`` until the
    module really executes: a ``find_spec("deepspeed")`` that only asks whether DeepSpeed is installed
    (transformers and accelerate do) must not use it up."""

    def __init__(self):
        self.busy = False

    def find_spec(self, name, path, target=None):
        if name != "deepspeed" or self.busy:
            return None
        self.busy = True
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self.busy = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        inner = spec.loader.exec_module

        def exec_module(module):
            inner(module)
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            _wrap(module)

        spec.loader.exec_module = exec_module
        return spec


def _wrap(ds) -> None:
    if _STATE["wrapped"] or getattr(ds.initialize, "_muon_watch", False):
        return
    original = ds.initialize

    @functools.wraps(original)
    def initialize(*args, **kwargs):
        settings = _STATE["settings"]
        if settings is None or _STATE["engines"]:
            return original(*args, **kwargs)
        _STATE["engines"] += 1
        from harness.rank import watch_capture  # late: torch and DeepSpeed, only in a process that trains

        return watch_capture.initialize_watched(original, settings, args, kwargs)

    initialize._muon_watch = True
    ds.initialize = initialize
    _STATE["wrapped"] = True
    settings = _STATE["settings"]
    if settings is not None and settings.preload_ops:
        from harness.rank import runtime_state  # late: reaches DeepSpeed's op builders, only once it is imported

        try:
            runtime_state.preload_built_ops()
        except Exception:  # best effort: DeepSpeed's own load still finds every op
            pass


def chain_sitecustomize(own_file: str) -> None:
    """Run the ``sitecustomize`` that ours shadows (a virtual environment's or a distribution's), so the
    command starts exactly as it would unwatched."""
    own = Path(own_file).resolve().parent
    rest = [p for p in sys.path if p and Path(p).resolve() != own]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
