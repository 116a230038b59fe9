"""Which lr-setting parameters of a learning-rate schedule hand every param group one number.

Why it matters for Muon: DeepSpeed splits each incoming param group into a Muon half and an Adam half with
their own lr (``muon_lr``, ``adam_lr``), and a schedule that sets an lr from one number gives both halves
that number (deepspeedai/DeepSpeed#7713). Whether a schedule does depends on the parameter's value as the
engine builds the schedule: given in the config, else the class's default. Those defaults are read from the
installed DeepSpeed's ``runtime/lr_schedules.py`` with ``ast`` (importing it imports all of DeepSpeed, as
``harness.case.dsconfig`` explains) and from torch's signatures, never written down here.
"""
from __future__ import annotations

import ast
import functools
import importlib.util
import inspect
from pathlib import Path

import torch


# Per schedule type, the parameters that set an lr and are broadcast to every param group when given as
# one number (DeepSpeed ``lr_schedules.py`` ``_format_param``; ``LRRangeTest`` builds the list itself;
# torch ``lr_scheduler.py`` ``_format_param``; a cosine schedule's ``eta_min`` is one floor for every
# group). ``cases/harness/test_departures.py`` checks DeepSpeed's entries against its source. Schedules
# absent here (``WarmupCosineLR``, ``StepLR``, ``ExponentialLR``, ...) scale each group's own lr.
BROADCAST_LR_PARAMS = {
    "WarmupLR": ("warmup_min_lr", "warmup_max_lr"),
    "WarmupDecayLR": ("warmup_min_lr", "warmup_max_lr"),
    "LRRangeTest": ("lr_range_test_min_lr",),
    "OneCycle": ("cycle_min_lr", "cycle_max_lr"),
    "OneCycleLR": ("max_lr",),
    "CyclicLR": ("base_lr", "max_lr"),
    "CosineAnnealingLR": ("eta_min",),
    "CosineAnnealingWarmRestarts": ("eta_min",),
}
REQUIRED = object()  # a scheduler argument without a default


@functools.cache
def _deepspeed_schedule_defaults() -> dict[str, dict[str, object]]:
    """Class -> ``__init__`` argument -> default, of the installed DeepSpeed's ``runtime/lr_schedules.py``
    (read with ``ast``: importing it imports all of DeepSpeed). Empty where DeepSpeed is not installed."""
    spec = importlib.util.find_spec("deepspeed")
    if spec is None or not spec.submodule_search_locations:
        return {}
    path = Path(list(spec.submodule_search_locations)[0]) / "runtime" / "lr_schedules.py"
    out: dict[str, dict[str, object]] = {}
    for cls in (n for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef)):
        init = next((f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"), None)
        if init is None:
            continue
        args = init.args.args
        defaults = [REQUIRED] * (len(args) - len(init.args.defaults)) + [
            _literal_or_required(d) for d in init.args.defaults]
        out[cls.name] = {a.arg: d for a, d in zip(args, defaults)}
    return out


def _literal_or_required(node):
    try:
        return ast.literal_eval(node)
    except ValueError:
        return REQUIRED


def schedule_default(kind: str, param: str):
    """The default of ``param`` of schedule ``kind`` as the engine builds it: DeepSpeed's class where
    ``lr_schedules`` has one of that name (``engine.py`` ``_scheduler_from_config``), else torch's."""
    ds = _deepspeed_schedule_defaults()
    if kind in ds:
        return ds[kind].get(param, REQUIRED)
    cls = getattr(torch.optim.lr_scheduler, kind, None)
    p = inspect.signature(cls.__init__).parameters.get(param) if cls is not None else None
    return REQUIRED if p is None or p.default is inspect.Parameter.empty else p.default


def broadcast_lrs(schedule: dict | None) -> dict[str, float]:
    """The lr-setting parameters of ``schedule`` (given, else their default) that hand every param group one
    non-zero lr: a number, not a per-group list. A zero floor leaves each group's own lr scaled, and
    ``WarmupLR``'s ``warmup_max_lr`` left out (None) warms each group to its own lr."""
    if not schedule:
        return {}
    kind, params = schedule.get("type"), schedule.get("params") or {}
    out = {}
    for name in BROADCAST_LR_PARAMS.get(kind, ()):
        v = params.get(name, schedule_default(kind, name))
        if v is REQUIRED or v is None or isinstance(v, (list, tuple, str, bool)):
            continue
        if float(v) != 0.0:
            out[name] = float(v)
    return out
