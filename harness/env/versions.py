"""Which DeepSpeed the harness is running against, and what that release accepts.

Why one module: the oracle does not depend on the DeepSpeed version, but the configs DeepSpeed
accepts, the bugs it has and the patched runtime's fixes do. The version facts that are not about one
bug live here (config adaptation, refusals by design, the releases a gate run was made on); the releases
each bug was measured on are its registry entry's (``harness.registry.bugs.excuses`` reads them).

The installed version is read from the package metadata, never by importing DeepSpeed (the parent
process and the build cache key need it before any rank starts). A *source checkout* is DeepSpeed
installed editable (or from a git tree): its version string is whatever its ``version.txt`` says plus
a local tag, and it is treated as an unseen release unless ``MUON_HARNESS_DS_AS`` names the release
it should be judged as.
"""
from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from harness.case import dsconfig
import importlib.util

# Releases the harness was run on (PyPI sdists); README "DeepSpeed versions" gives each one's result.
RELEASES = ("0.18.9", "0.19.0", "0.19.1", "0.19.2", "0.19.3", "0.19.4", "0.19.5", "0.19.6", "0.19.7", "0.19.8")
PINNED = "0.19.8"  # the release the oracles' conventions, the docs and the patched runtime are written against


def parse(v: str) -> tuple[int, int, int]:
    """``"0.19.7"`` / ``"0.19.9+a1b2c3"`` / ``"0.19.9.dev0"`` -> (0, 19, 7): the release part only."""
    head = v.split("+", 1)[0]
    parts = []
    for p in head.split(".")[:3]:
        digits = "".join(ch for ch in p if ch.isdigit()) if not p.isdigit() else p
        if not digits:
            break
        parts.append(int(digits))
        if not p.isdigit():
            break
    while len(parts) < 3:
        parts.append(0)
    return tuple(parts)  # type: ignore[return-value]


@dataclass(frozen=True)
class Installed:
    version: str  # as the package metadata says it
    source_checkout: bool  # installed editable / from a source tree rather than a release sdist or wheel
    location: str  # where the package lives

    @property
    def release(self) -> str | None:
        """The known release this installation is judged as (None: unseen; the stock column then runs
        without any bug excuse). ``MUON_HARNESS_DS_AS`` overrides it for a source checkout."""
        forced = os.environ.get("MUON_HARNESS_DS_AS")
        if forced:
            return forced
        if self.source_checkout:
            return None
        return self.version if self.version in RELEASES else None

    @property
    def label(self) -> str:
        return f"{self.version} (source checkout)" if self.source_checkout else self.version

    @property
    def key(self) -> tuple[int, int, int]:
        return parse(self.version)


@functools.cache
def installed() -> Installed:
    """The DeepSpeed the current interpreter would import."""
    try:
        dist = metadata.distribution("deepspeed")
    except metadata.PackageNotFoundError as exc:
        raise RuntimeError("DeepSpeed is not installed in this interpreter "
                           "(bash scripts/run.sh installs it; --deepspeed VERSION|PATH picks another)") from exc
    source = False
    location = str(dist.locate_file(""))
    direct = dist.read_text("direct_url.json")
    if direct:
        info = json.loads(direct)
        source = bool(info.get("dir_info", {}).get("editable")) or info.get("url", "").startswith("file://") and \
            Path(info["url"][len("file://"):]).is_dir()
        if source:
            location = info["url"][len("file://"):]
    if "+" in dist.version or "dev" in dist.version:
        source = True
    if not source:
        _check_metadata_matches_import(dist)
    return Installed(dist.version, source, location)


def _check_metadata_matches_import(dist) -> None:
    """The version is read from the first ``deepspeed`` metadata on the path; the package imported is
    the first ``deepspeed`` package on the path. A release tree put first on ``PYTHONPATH`` (an
    extracted sdist, with its ``deepspeed.egg-info``) shadows an installed one consistently; a
    package without metadata of its own would be judged as some other release: refuse that."""

    spec = importlib.util.find_spec("deepspeed")
    if spec is None or not spec.origin:
        return
    imported = Path(spec.origin).resolve().parent
    described = Path(str(dist.locate_file("deepspeed"))).resolve()
    if imported != described:
        raise RuntimeError(f"DeepSpeed {dist.version}'s metadata describes {described}, but `import deepspeed` "
                           f"loads {imported}: put the release's own metadata (an sdist's deepspeed.egg-info) "
                           f"beside the package, or install it (scripts/deepspeed_venv.sh)")


def in_range(version: str, lo: str | None = None, hi: str | None = None) -> bool:
    """``lo <= version < hi`` by release number (either bound may be None)."""
    k = parse(version)
    return (lo is None or k >= parse(lo)) and (hi is None or k < parse(hi))


# ------------------------------------------------------------------------------------------------
# what each release accepts: config adaptation and refusals by design


def _zero(cfg: dict) -> dsconfig.Zero:
    return dsconfig.resolve(cfg).zero


def _offloads_optimizer(cfg: dict) -> bool:
    return _zero(cfg).offload_optimizer.device != "none"


@dataclass(frozen=True)
class ConfigRule:
    """A config change one version range needs for a case to mean what it means on 0.19.8.

    ``applies(case, cfg)`` -> bool; ``change(cfg)`` edits the parsed config in place. Only rules that do
    not change the mathematics are allowed here (the oracle is version-independent)."""

    name: str
    lo: str | None
    hi: str | None
    why: str
    applies: object
    change: object


@dataclass(frozen=True)
class Refusal:
    """A combination a version range refuses by design (raises, or has no such feature): the case is
    deselected on those releases, showing ``reason`` (the release's own words where it has them)."""

    name: str
    lo: str | None
    hi: str | None
    reason: str
    applies: object


def _set_reduce_scatter_off(cfg: dict) -> None:
    cfg.setdefault("zero_optimization", {})["reduce_scatter"] = False


CONFIG_RULES: tuple[ConfigRule, ...] = (
    # 0.19.3-0.19.7 stage_1_and_2.py (0.19.7: lines 244-246) raise "Muon with reduce scatter does not support
    # optimizer offload because offload retains only partition slices; disable reduce scatter or optimizer
    # offload". The
    # harness's ZeRO-1/2 offload configs leave reduce_scatter at its default (True); reduce_scatter only
    # picks the collective that averages the gradient, so turning it off keeps the case's mathematics.
    ConfigRule("z12-offload-reduce-scatter-off", "0.19.3", "0.19.8",
               "this release refuses Muon with reduce_scatter and optimizer offload on ZeRO-1/2",
               lambda c, cfg: _zero(cfg).stage in (1, 2) and _offloads_optimizer(cfg)
               and _zero(cfg).reduce_scatter and c.runs_muon,
               _set_reduce_scatter_off),
    # Before 0.19.0 Muon has no ns_method (0.18.9 original_muon.py:66 muon_update(grad, momentum, beta,
    # ns_steps, nesterov): always the standard quintic); cases that ask for "standard" mean exactly that.
    ConfigRule("drop-ns-method-key", None, "0.19.0",
               "this release has no ns_method option (standard Newton-Schulz only)",
               lambda c, cfg: "ns_method" in dsconfig.resolve(cfg).optimizer.params,
               lambda cfg: cfg["optimizer"]["params"].pop("ns_method")),
)


def has_ns_method(version: str | None = None) -> bool:
    """Whether Muon takes an ``ns_method`` (from 0.19.0; 0.18.9's muon_update has no such argument)."""
    return in_range(version or installed().version, "0.19.0", None)


def default_ns_method(version: str | None = None) -> str:
    """The Newton-Schulz method a Muon group without ``ns_method`` runs: "gram" from 0.19.0 (0.19.7
    original_muon.py muon_update's ``ns_method="gram"``), the standard quintic before (0.18.9 has no other).
    Judging a 0.18.9 run against gram's fp16 allowance instead held its bf16 standard Newton-Schulz to an
    8x tighter bound (measured by 84925e7: 1.01-1.06x "over")."""
    return "gram" if has_ns_method(version) else "standard"


def _ns_methods(case, cfg: dict, default: str) -> set:
    ds = dsconfig.resolve(cfg)  # the config's own choice; ``default`` is the release's being asked about
    if ds.given("optimizer.muon.ns_method"):
        default = ds.optimizer.muon.ns_method
    return {default} | {g.ns_method for g in case.groups if g.ns_method}

@functools.cache
def _model_declares_groups(model: str, seed: int) -> bool:
    from harness import models  # late: keeps this module torch-free at import

    return bool(models.build_spec(model, seed).param_groups)


def _passes_group_dicts(case) -> bool:
    """Whether ``deepspeed.initialize`` gets param-group dicts (``harness.rank.ds_run.model_parameters``): the
    case's own groups, or the groups a model case's factory declares."""
    return bool(case.groups) or bool(case.model) and _model_declares_groups(case.model, case.seed)


REFUSALS: tuple[Refusal, ...] = (
    # 0.18.9-0.19.1 engine.py _configure_basic_optimizer (0.18.9: lines 1748-1753) read ``p.use_muon`` of
    # every item of model_parameters: a param-group dict raises AttributeError "'dict' object has no attribute
    # 'use_muon'". 0.19.2 flattens the dicts (DSM-104), 0.19.7 splits each group.
    Refusal("param-group-dicts-with-muon", None, "0.19.2",
            "this release's Muon takes a flat parameter list: param-group dicts raise AttributeError "
            "\"'dict' object has no attribute 'use_muon'\" (engine.py _configure_basic_optimizer)",
            lambda c, cfg: c.runs_muon and _passes_group_dicts(c)),
    Refusal("per-head-muon", None, "0.19.8",
            "per-head Muon (a parameter's muon_num_heads) reached muon_update in 0.19.8; this release "
            "orthogonalizes the whole matrix",
            lambda c, cfg: any(p.num_heads for p in c.params)),
    # 0.19.7 engine.py:2334/2371 _check_muon_can_reach_its_parameters raises ZeRORuntimeException "Muon cannot
    # be used with the BF16_Optimizer, which this configuration selects ..." (only 0.19.7 has the check).
    Refusal("bf16-optimizer-route", "0.19.7", "0.19.8",
            "Muon cannot be used with the BF16_Optimizer, which this configuration selects: bf16 with "
            "grad_accum_dtype fp32 at ZeRO stage 1 (the release's own ZeRORuntimeException)",
            lambda c, cfg: c.runs_muon and dsconfig.resolve(cfg).bf16_optimizer_route),
    # 0.19.8 original_muon.py looks the Newton-Schulz compute dtype up through ``ns_compute_dtype`` at call
    # time, the hook the high-precision-NS mode (``Case.ns_dtype``, ``-compiled-hpns``) replaces; 0.18.9-0.19.7
    # pick it inline from the accelerator (0.19.7 original_muon.py:50 bf16 / :90 fp16, else fp32), so float64
    # Newton-Schulz cannot be asked for there without editing DeepSpeed.
    Refusal("ns-compute-dtype-hook", None, "0.19.8",
            "this release picks the Newton-Schulz compute dtype inline (original_muon.py zeropower_via_*: bf16/fp16 "
            "where the accelerator supports it); there is no ns_compute_dtype to force float64 through",
            lambda c, cfg: c.ns_dtype is not None),
    # The Muon all-gather cache (``Case.allgather_caps`` sets its byte limits, harness.rank.gather_cache checks it)
    # is 0.19.8's (stage_1_and_2.py:408-411 _muon_allgather_*); 0.18.9-0.19.7 have none to cap or check.
    Refusal("muon-allgather-cache", None, "0.19.8",
            "this release has no Muon all-gather cache (stage_1_and_2.py _muon_allgather_buffers arrived in 0.19.8)",
            lambda c, cfg: c.allgather_caps is not None),
    # zero_optimization.compute_grad_norm (skip the norm when there is no clipping) arrived in 0.19.7 (its
    # runtime/zero/config.py); 0.18.9-0.19.6's DeepSpeedZeroConfig forbids unknown keys (pydantic
    # extra_forbidden at initialize: measured, 0.19.6 z2-none-fp16-ws2-nonorm-overflow).
    Refusal("compute-grad-norm-key", None, "0.19.7",
            "this release has no zero_optimization.compute_grad_norm option (its DeepSpeedZeroConfig rejects the key)",
            lambda c, cfg: dsconfig.resolve(cfg).given("zero_optimization.compute_grad_norm")),
    # managed_gradient_accumulation (runtime/constants.py, engine.py) arrived in 0.19.4; an older engine ignores
    # the key and keeps counting micro-steps, so the once-a-window step() of an unmanaged case would never
    # reach its boundary (matrix.unmanaged_cases).
    Refusal("unmanaged-gradient-accumulation", None, "0.19.4",
            "this release has no managed_gradient_accumulation option (the client-owned accumulation "
            "boundary arrived in 0.19.4)",
            lambda c, cfg: dsconfig.resolve(cfg).managed_gradient_accumulation is False),
    # 0.19.4's engine.py _do_sanity_check (:1653) asserts "managed_gradient_accumulation=False is not supported
    # with ZeRO optimizer state offload" (measured); 0.19.5 lifted it.
    Refusal("unmanaged-with-offload", "0.19.4", "0.19.5",
            "managed_gradient_accumulation false with optimizer offload is refused by this release's own "
            "sanity check (engine.py _do_sanity_check)",
            lambda c, cfg: dsconfig.resolve(cfg).managed_gradient_accumulation is False
            and _offloads_optimizer(cfg)),
    Refusal("gram-newton-schulz", None, "0.19.0",
            "Gram Newton-Schulz (ns_method 'gram') arrived in 0.19.0; this release runs the standard quintic only",
            lambda c, cfg: c.runs_muon and "gram" in _ns_methods(c, cfg, default_ns_method("0.18.9"))),
)


@dataclass(frozen=True)
class Adapted:
    case: object  # the case to run (config adapted), or None when deselected
    changes: tuple[str, ...] = ()  # names of the ConfigRules applied
    deselected: str | None = None  # the reason, when the release refuses the combination by design


def refuses(name: str, version: str | None = None) -> bool:
    """Whether ``version`` (default: the installed DeepSpeed) lies in the range of the refusal ``name``."""
    r = next(r for r in REFUSALS if r.name == name)
    return in_range(version or installed().version, r.lo, r.hi)


def adapt(case, version: str | None = None) -> Adapted:
    """The case as the installed (or given) DeepSpeed needs it: the ONE place a case's config is
    adapted per release. Pure: the version is read once, the case is not changed in place."""
    from harness.case.spec import canonical_json  # late: keeps this module torch-free at import

    version = version or installed().version
    cfg = json.loads(case.ds_config)
    for r in REFUSALS:
        if in_range(version, r.lo, r.hi) and r.applies(case, cfg):
            return Adapted(None, (), f"deselected on DeepSpeed {version}: {r.reason} ({r.name})")
    applied = []
    for rule in CONFIG_RULES:
        if in_range(version, rule.lo, rule.hi) and rule.applies(case, cfg):
            rule.change(cfg)
            applied.append(rule.name)
    if not applied:
        return Adapted(case)
    return Adapted(case.replace(ds_config=canonical_json(cfg)), tuple(applied))


def ns_order_emulated(version: str | None = None) -> bool:
    """Whether the oracle's bit-exact 16-bit Newton-Schulz emulation (``oracles.emulate``) follows this
    release's operation order. Before 0.19.8 the gram iteration casts ``G`` to fp16 and then normalises
    (0.19.7 original_muon.py:89-97); 0.19.8 normalises first (in fp32 for an fp16 input) and then casts,
    which is the order emulated. Other releases are judged in ``exact`` mode: float64 Newton-Schulz with
    the derived 16-bit NS tolerance (as the compiled subset is)."""
    return in_range(version or installed().version, "0.19.8", None)


def z3_distributed_muon(version: str | None = None) -> bool:
    """Before 0.19.8 ZeRO-3 runs Muon inside the gradient reduce, dealing the Muon matrices out one per
    rank (0.18.9-0.19.7 stage3.py ``_apply_distributed_muon_update``), with or without offload: one
    ``muon_update`` per matrix per step in all. 0.19.8 runs it in the optimizer step."""
    return not in_range(version or installed().version, "0.19.8", None)


# ------------------------------------------------------------------------------------------------
# the releases the gate was run on (which bugs each one showed: each registry entry's ``releases``,
# harness.registry.bugs)

# Releases a gate run was made on (so a bug without a measurement there is reported, not silently
# ignored): release -> the slice that was run (README "DeepSpeed versions").
MEASURED: dict[str, str] = {
    "0.19.8": "the whole gate (both columns)",
    "0.19.7": "stock column, MUON_HARNESS_MEASURE=1: the ws2 base grid and ZeRO-1/2 NVMe (30 cases), then the "
              "slices z0-, -overflow, -growth, -groups, sched, gad32, comm32",
    "0.18.9": "stock column, MUON_HARNESS_MEASURE=1, the optimizer-offload slice (--only=-cpu-; gram and per-head "
              "cases deselected)",
}
MEASURED.update({r: "python -m harness.cli.measure_release --slice base-ws2 (18 cases, stock column)"
                 for r in ("0.19.0", "0.19.1", "0.19.2", "0.19.3", "0.19.4", "0.19.5", "0.19.6")})
MEASURED["0.19.5"] = ("the base-ws2 slice, then the whole CI gate, stock column "
                      "(measured by 0a82c31), its failures re-measured "
                      "by name (measure_release --slice gate --names ... --exclude-absent)")
MEASURED["0.19.3"] = ("the base-ws2 slice, then the whole CI gate, stock column "
                      "(measured by 3d30036), its failures re-measured "
                      "by name (measure_release --slice gate --names ... --exclude-absent)")
MEASURED["0.19.4"] = ("the base-ws2 slice, then the whole CI gate, stock column "
                      "(measured by 3d30036), its failures re-measured "
                      "by name (measure_release --slice gate --names ... --exclude-absent)")
MEASURED["0.19.6"] = ("the base-ws2 slice, then the whole CI gate, stock column "
                      "(measured by 9c7be3c), its failures re-measured "
                      "by name (measure_release --slice gate --names ... --exclude-absent)")
for _rel in ("0.19.0", "0.19.1", "0.19.2"):
    MEASURED[_rel] = ("the base-ws2 slice, then the whole CI gate, stock column "
                      "(measured by 82179af), its failures re-measured "
                      "by name (measure_release --slice gate --names ... --exclude-absent)")


def judged_as() -> str | None:
    """The release whose measured bug table applies to the installed DeepSpeed (None: unseen)."""
    rel = installed().release
    return rel if rel in MEASURED else None


def patched_applies() -> bool:
    """The patched runtime's fixes were written against (and hash-checked on) one release: its column
    runs only there and is absent elsewhere."""
    from harness.fixes._registry import EXPECTED_DEEPSPEED  # late: keeps this module torch-free at import

    inst = installed()
    return not inst.source_checkout and inst.version == EXPECTED_DEEPSPEED


def banner() -> str:
    """One line for the gate's output and the report: what is being judged, and how."""
    inst = installed()
    rel = judged_as()
    if os.environ.get("MUON_HARNESS_MEASURE") == "1":
        excuse = "MEASURING: every registered bug is a candidate excuse (xfailed: it shows; xpassed: it does not)"
    elif rel is None:
        excuse = ("an unseen release: the stock column runs with NO bug excuses (every divergence fails; "
                  "attribute each to a bug id or report it as a new finding)")
    else:
        excuse = f"judged with the bugs measured on {rel}"
    cols = "stock and patched columns" if patched_applies() else \
        "stock column only (the patched runtime is written against 0.19.8)"
    return f"DeepSpeed {inst.label} at {inst.location}: {excuse}; {cols}"
