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

import importlib.util

from harness.case import dsconfig
from harness.env import tree

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
# what the tree under test accepts: config adaptation and refusals by design, each decided by a probe of
# the tree's source (``harness.env.tree``), never by its version string


def _zero(cfg: dict) -> dsconfig.Zero:
    return dsconfig.resolve(cfg).zero


def _offloads_optimizer(cfg: dict) -> bool:
    return _zero(cfg).offload_optimizer.device != "none"


@dataclass(frozen=True)
class ConfigRule:
    """A config change a tree needs for a case to mean what it means on 0.19.8.

    ``on(caps)``: the tree needs it (``tree.Capabilities``); ``applies(case, cfg)`` -> bool; ``change(cfg)``
    edits the parsed config in place. Only rules that do not change the mathematics are allowed here (the
    oracle is the same for every tree)."""

    name: str
    why: str
    on: object
    applies: object
    change: object


@dataclass(frozen=True)
class Refusal:
    """A combination a tree refuses by design (raises, or has no such feature): ``on(caps, case)`` says the
    tree lacks it; the case is deselected there, showing ``reason`` (the tree's own words where it has them)
    and, where given, ``detail(caps, case)`` (what the tree lacks for this case, or what its probe found)."""

    name: str
    reason: str
    on: object
    applies: object
    detail: object = None


def _set_reduce_scatter_off(cfg: dict) -> None:
    cfg.setdefault("zero_optimization", {})["reduce_scatter"] = False


CONFIG_RULES: tuple[ConfigRule, ...] = (
    # 0.19.3-0.19.7 stage_1_and_2.py (0.19.7: lines 244-246) raise "Muon with reduce scatter does not support
    # optimizer offload ...". reduce_scatter only picks the collective that averages the gradient, so turning
    # it off keeps the case's mathematics.
    ConfigRule("z12-offload-reduce-scatter-off",
               "this tree refuses Muon with reduce_scatter and optimizer offload on ZeRO-1/2",
               lambda k: k["refuses_reduce_scatter_with_offload"],
               lambda c, cfg: _zero(cfg).stage in (1, 2) and _offloads_optimizer(cfg)
               and _zero(cfg).reduce_scatter and c.runs_muon,
               _set_reduce_scatter_off),
    # A muon_update without ns_method (0.18.9 original_muon.py:66) always runs the standard quintic; cases
    # that ask for "standard" mean exactly that.
    ConfigRule("drop-ns-method-key", "this tree has no ns_method option (standard Newton-Schulz only)",
               lambda k: "ns_method" not in k["muon_update_params"],
               lambda c, cfg: "ns_method" in dsconfig.resolve(cfg).optimizer.params,
               lambda cfg: cfg["optimizer"]["params"].pop("ns_method")),
)


def _ns_methods(case, cfg: dict, default: str) -> set:
    ds = dsconfig.resolve(cfg)  # the config's own choice; ``default`` is the tree's
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


# The Muon all-gather cache entry (length, index of the byte count) the gather cases' caps are sized for
# (harness.catalog.matrix GATHER_CAPS, Z3_EVICT_CAPS: 0.19.8's two buffers and the byte count, both stages)
GATHER_ENTRY_SIZED_FOR = (3, 2)


def chunked_gathers(case) -> bool:
    """Whether a case claims chunked Muon all-gathers (``harness.rank.gather_cache`` counts them): the gather caps
    on ZeRO-1/2 with optimizer offload (nvme runs as cpu there, DSM-002), where 0.19.8 chunks."""
    return case.allgather_caps is not None and case.stage in (1, 2) and case.offload != "none"


def _entry_probe(case) -> str:
    return f"muon_allgather_entry({'z3' if case.stage == 3 else 'z12'})"


def _unread(k, probe: str) -> str | None:
    """What an undecided probe says (``tree.Undecided``: "probe NAME: why"); None where it answered."""
    try:
        k[probe]
    except tree.Undecided as exc:
        return str(exc)
    return None


# zero_optimization keys the harness sets that older trees' DeepSpeedZeroConfig forbids (pydantic
# extra_forbidden at initialize: measured, 0.19.6 z2-none-fp16-ws2-nonorm-overflow)
NEWER_ZERO_KEYS = ("compute_grad_norm", "parameter_alignment", "save_muon_momentum_buffer_in_memory")


def _missing_zero_keys(k, cfg: dict) -> list[str]:
    ds = dsconfig.resolve(cfg)
    return [key for key in NEWER_ZERO_KEYS if ds.given(f"zero_optimization.{key}")
            and key not in k["zero_config_fields"]]


REFUSALS: tuple[Refusal, ...] = (
    # 0.18.9-0.19.1 engine.py _configure_basic_optimizer (0.18.9: lines 1748-1753) read ``p.use_muon`` of
    # every item of model_parameters: a param-group dict raises AttributeError.
    Refusal("param-group-dicts-with-muon",
            "this tree's Muon takes a flat parameter list: param-group dicts raise AttributeError "
            "\"'dict' object has no attribute 'use_muon'\" (engine.py _configure_basic_optimizer)",
            lambda k, c: not k["takes_group_dicts"],
            lambda c, cfg: c.runs_muon and _passes_group_dicts(c)),
    Refusal("per-head-muon", "per-head Muon (a parameter's muon_num_heads): this tree's muon_update orthogonalizes the "
            "whole matrix (no usable num_heads)",
            lambda k, c: not k["per_head_muon"], lambda c, cfg: any(p.num_heads for p in c.params)),
    # 0.19.7 engine.py:2334/2371 _check_muon_can_reach_its_parameters raises ZeRORuntimeException.
    Refusal("bf16-optimizer-route",
            "Muon cannot be used with the BF16_Optimizer, which this configuration selects: bf16 with "
            "grad_accum_dtype fp32 at ZeRO stage 1 (the tree's own ZeRORuntimeException)",
            lambda k, c: k["refuses_bf16_optimizer_route"],
            lambda c, cfg: c.runs_muon and dsconfig.resolve(cfg).bf16_optimizer_route),
    # The high-precision-NS mode (``Case.ns_dtype``) replaces the ``ns_compute_dtype`` hook (0.19.8);
    # without it the dtype is picked inline and float64 cannot be asked for without editing DeepSpeed.
    Refusal("ns-compute-dtype-hook",
            "this tree picks the Newton-Schulz compute dtype inline (original_muon.py zeropower_via_*); there is "
            "no ns_compute_dtype to force float64 through",
            lambda k, c: not k["ns_compute_dtype_hook"], lambda c, cfg: c.ns_dtype is not None),
    # MUON-NS16's size is held to the oracle's bit-faithful emulation of the tree's 16-bit Newton-Schulz
    # (harness.judge.departure_pins): only where the emulation follows the tree's operation order.
    Refusal("ns16-departure-emulation",
            "this tree's 16-bit Newton-Schulz does not follow the oracle's emulated operation order, so the size of "
            "MUON-NS16 has no bit-faithful second computation here",
            lambda k, c: not k["ns_order_emulated"], lambda c, cfg: "MUON-NS16" in (c.departs or ())),
    # The Muon all-gather cache (``Case.allgather_caps``, checked by harness.rank.gather_cache).
    Refusal("muon-allgather-cache", "this tree's ZeRO optimizer keeps no Muon all-gather cache "
            "(_muon_allgather_buffers)",
            lambda k, c: not k["muon_allgather_cache(z3)" if c.stage == 3 else "muon_allgather_cache(z12)"],
            lambda c, cfg: c.allgather_caps is not None),
    # The watch sums each cache entry's byte count where the tree's source keeps it (0.19.8: a 3-tuple's last;
    # DeepSpeed PR #8464's ZeRO-3: a 4-tuple's); entries the probe cannot read are not read with another layout.
    Refusal("muon-allgather-entry", "this tree stores its Muon all-gather cache entries in a shape the harness "
            "does not read",
            lambda k, c: _unread(k, _entry_probe(c)) is not None,
            lambda c, cfg: c.allgather_caps is not None,
            lambda k, c: _unread(k, _entry_probe(c))),
    # A case that claims eviction (Case.allgather_evicts) has a cap sized to hold one entry of 0.19.8's layout
    # (matrix.Z3_EVICT_CAPS, GATHER_CAPS); an entry of more buffers (PR #8464's ZeRO-3 keeps three) may not fit.
    Refusal("muon-allgather-evict-sizes", "the case's cache cap is sized to hold one entry of 0.19.8's layout "
            f"(local, gathered, bytes: {GATHER_ENTRY_SIZED_FOR}); this tree stores another, so its eviction claim "
            "does not carry over",
            lambda k, c: k[_entry_probe(c)] not in (None, GATHER_ENTRY_SIZED_FOR),
            lambda c, cfg: c.allgather_caps is not None and c.allgather_evicts,
            lambda k, c: f"probe {_entry_probe(c)}: {k[_entry_probe(c)]}"),
    # The ZeRO-1/2 offload gather cases claim chunked gathers (chunked_gathers) with buffer and cache sizes
    # chosen for chunks (matrix.GATHER_CAPS); DeepSpeed PR #8464's rebuilt file gathers a batch in one call.
    Refusal("muon-allgather-chunks", "this tree's ZeRO-1/2 all-gathers a Muon batch in one call, without chunks "
            "(probe muon_allgather_chunked(z12): no all-gather in a loop in _muon_all_gather_partitions); the case's "
            "buffer and cache sizes are chosen for chunked gathers",
            lambda k, c: not k["muon_allgather_chunked(z12)"],
            lambda c, cfg: chunked_gathers(c)),
    Refusal("zero-config-key", "this tree's DeepSpeedZeroConfig has no such field (it rejects the key)",
            lambda k, c: bool(_missing_zero_keys(k, json.loads(c.ds_config))),
            lambda c, cfg: True,
            lambda k, c: "zero_optimization." + ", ".join(_missing_zero_keys(k, json.loads(c.ds_config)))),
    # Without managed_gradient_accumulation an engine keeps counting micro-steps, so the once-a-window step()
    # of an unmanaged case would never reach its boundary (matrix.unmanaged_cases).
    Refusal("unmanaged-gradient-accumulation",
            "this tree has no managed_gradient_accumulation option (the client-owned accumulation boundary)",
            lambda k, c: not k["managed_gradient_accumulation"],
            lambda c, cfg: dsconfig.resolve(cfg).managed_gradient_accumulation is False),
    # 0.19.4's engine.py _do_sanity_check (:1653) asserts it (measured); 0.19.5 lifted it.
    Refusal("unmanaged-with-offload",
            "managed_gradient_accumulation false with optimizer offload is refused by this tree's own "
            "sanity check (engine.py _do_sanity_check)",
            lambda k, c: k["refuses_unmanaged_with_offload"],
            lambda c, cfg: dsconfig.resolve(cfg).managed_gradient_accumulation is False
            and _offloads_optimizer(cfg)),
    Refusal("gram-newton-schulz", "this tree has no Gram Newton-Schulz (ns_method 'gram'); it runs the standard "
            "quintic only",
            lambda k, c: "gram" not in k["ns_methods"],
            lambda c, cfg: c.runs_muon and "gram" in _ns_methods(c, cfg, "standard")),
)


@dataclass(frozen=True)
class Adapted:
    case: object  # the case to run (config adapted), or None when deselected
    changes: tuple[str, ...] = ()  # names of the ConfigRules applied
    deselected: str | None = None  # the reason, when the tree refuses the combination by design


def caps_of(caps=None):
    """The capabilities asked about (default: the installed tree's)."""
    return caps if caps is not None else tree.capabilities()


def refuses(name: str, caps=None, case=None) -> bool:
    """Whether the tree (default: the installed one) lacks what the refusal ``name`` is about."""
    r = next(r for r in REFUSALS if r.name == name)
    return bool(r.on(caps_of(caps), case))


def adapt(case, caps=None) -> Adapted:
    """The case as the tree under test needs it: the ONE place a case's config is adapted per tree. Pure:
    the probes are read once, the case is not changed in place. An undecided probe raises
    ``tree.Undecided`` (the case then cannot be judged)."""
    from harness.case.spec import canonical_json  # late: keeps this module torch-free at import

    k = caps_of(caps)
    cfg = json.loads(case.ds_config)
    for r in REFUSALS:
        if r.applies(case, cfg) and r.on(k, case):
            why = f"{r.reason}: {r.detail(k, case)}" if r.detail is not None else r.reason
            return Adapted(None, (), f"deselected on DeepSpeed {installed().label if caps is None else k.root}: "
                                     f"{why} ({r.name})")
    applied = []
    for rule in CONFIG_RULES:
        if rule.applies(case, cfg) and rule.on(k):
            rule.change(cfg)
            applied.append(rule.name)
    if not applied:
        return Adapted(case)
    return Adapted(case.replace(ds_config=canonical_json(cfg)), tuple(applied))


def has_ns_method(caps=None) -> bool:
    """Whether Muon takes an ``ns_method`` (0.18.9's muon_update has no such argument)."""
    return "ns_method" in caps_of(caps)["muon_update_params"]


def default_ns_method(caps=None) -> str:
    """The Newton-Schulz method a Muon group without ``ns_method`` runs: ``muon_update``'s default (0.19.7
    original_muon.py ``ns_method="gram"``), the standard quintic where it has none. Judging a 0.18.9 run
    against gram's fp16 allowance instead held its bf16 standard Newton-Schulz to an 8x tighter bound
    (measured by 84925e7: 1.01-1.06x "over")."""
    return caps_of(caps)["default_ns_method"]


def ns_order_emulated(caps=None) -> bool:
    """Whether the oracle's bit-exact 16-bit Newton-Schulz emulation (``oracles.emulate``) follows this
    tree's operation order: only where both iterations are 0.19.8's code (``tree.EMULATED_NS``; before
    0.19.8 the gram iteration casts ``G`` to fp16 and then normalises). Other trees are judged in
    ``exact`` mode: float64 Newton-Schulz with the derived 16-bit NS tolerance (as the compiled subset is)."""
    return caps_of(caps)["ns_order_emulated"]


def muon_after_scale_update(stage: int, offload: bool, caps=None) -> bool:
    """Whether the tree's ZeRO ``stage`` runs Muon, on the unscaled gradient, after the loss-scale update on this
    path (``tree.muon_after_scale_update``: DSM-003's variant). A tree whose ``step`` the probe cannot find
    does not, as far as it can tell: the variant is a candidate model, never an excuse on its own."""
    try:
        return bool(caps_of(caps)[f"muon_after_scale_update(z{3 if stage == 3 else 12},"
                                  f"{'offload' if offload else 'none'})"])
    except tree.Undecided:
        return False


def z3_muon_placement(offload: bool, caps=None) -> str:
    """Where ZeRO-3 runs Muon on a path: "reduce" (inside the gradient reduce, one rank per matrix, once
    per micro-batch: ``_apply_distributed_muon_update``) or "step" (0.19.8's: in the optimizer step)."""
    return caps_of(caps)["z3_muon_placement(offload)" if offload else "z3_muon_placement(none)"]


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
        excuse = ("a tree no gate run measured: no measured bug excuses; each divergence is tried against every "
                  "registered bug's model and crash (named only where one matches at full strength; a bug without "
                  "a model only where the tree's source shows its mechanism), the rest fail")
    else:
        excuse = f"judged with the bugs measured on {rel}"
    cols = "stock and patched columns" if patched_applies() else \
        "stock column only (the patched runtime is written against 0.19.8)"
    return f"DeepSpeed {inst.label} at {inst.location}: {excuse}; {cols}"
