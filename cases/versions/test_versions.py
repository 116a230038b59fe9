"""The version layer: what each DeepSpeed release accepts, which bugs it has (as measured), how the
capture reaches it. Pure: no ranks, under a second. Each test fails if the table it guards drifts
(a bug without a measured row, a release two adapters claim, a refusal that no longer deselects)."""
from __future__ import annotations

import json

import pytest

from harness.rank import capture_adapters
from harness.env import versions
from harness.registry import bugs as registry
from harness.registry.bugs import BUGS, HISTORICAL
from harness.case.scenarios import pipeline_case
from harness.case.spec import ParamShape
from harness.env import tree

from cases.versions.trees import caps

ALL_BUGS = BUGS + HISTORICAL


def test_every_registered_bug_has_a_measured_row():
    ids = [b.id for b in ALL_BUGS]
    assert len(ids) == len(set(ids)), "a bug id is registered twice"
    missing = sorted(set(ids) - set(registry.AFFECTED))
    assert not missing, f"bugs without a row of measured releases (Bug.releases): {missing}"
    stale = sorted(set(registry.AFFECTED) - set(ids))
    assert not stale, f"AFFECTED rows for bugs nobody registered: {stale}"


def test_rows_name_only_known_measured_releases():
    for bug, row in registry.AFFECTED.items():
        for rel in row:
            assert rel in versions.RELEASES, f"{bug}: {rel} is not a release the harness knows"
            assert rel in versions.MEASURED, f"{bug}: {rel} claims a measurement, but no gate run on it is recorded"


def test_the_pinned_release_has_every_0198_bug_and_none_of_the_historical_ones():
    assert all(registry.excuses(b.id, "0.19.8") for b in BUGS)
    assert not any(registry.excuses(b.id, "0.19.8") for b in HISTORICAL)


def test_an_unseen_release_excuses_nothing(monkeypatch):
    monkeypatch.setattr(versions, "installed", lambda: versions.Installed("0.20.3", False, "/x"))
    assert versions.judged_as() is None
    assert not any(registry.excuses(b.id) for b in ALL_BUGS)
    assert "no measured bug excuses" in versions.banner()
    assert not versions.patched_applies()


def test_a_source_checkout_is_unseen_unless_told(monkeypatch):
    src = versions.Installed("0.19.9+abc123", True, "/src/DeepSpeed")
    monkeypatch.setattr(versions, "installed", lambda: src)
    assert versions.judged_as() is None and not versions.patched_applies()
    monkeypatch.setenv("MUON_HARNESS_DS_AS", "0.19.8")
    assert versions.judged_as() == "0.19.8"


@pytest.mark.parametrize("text,want", [("0.19.7", (0, 19, 7)), ("0.19.9+a1b2", (0, 19, 9)),
                                       ("0.20.0.dev0", (0, 20, 0)), ("0.18", (0, 18, 0))])
def test_parse(text, want):
    assert versions.parse(text) == want


def test_0197_turns_reduce_scatter_off_for_z12_offload_and_nothing_else():
    case = pipeline_case(1, "cpu", "fp32", 2)
    a = versions.adapt(case, caps("0.19.7"))
    assert a.changes == ("z12-offload-reduce-scatter-off",)
    assert json.loads(a.case.ds_config)["zero_optimization"]["reduce_scatter"] is False
    # the mathematics of the case is untouched: only the collective changes
    assert a.case.params == case.params and a.case.name == case.name
    assert versions.adapt(case, caps("0.19.8")).case is case
    assert versions.adapt(pipeline_case(1, "none", "fp32", 2), caps("0.19.7")).changes == ()
    assert versions.adapt(pipeline_case(3, "cpu", "fp32", 2), caps("0.19.7")).changes == ()


def test_per_head_muon_is_deselected_with_the_reason_before_0198():
    case = pipeline_case(2, "none", "fp32", 2, params=(ParamShape("w.weight", (8, 4), 2), ParamShape("b", (8,))))
    a = versions.adapt(case, caps("0.19.7"))
    assert a.case is None and "per-head Muon" in a.deselected and "0.19.7" in a.deselected
    assert versions.adapt(case, caps("0.19.8")).case is case


@pytest.mark.parametrize("release", versions.RELEASES)
def test_every_release_tree_answers_every_probe(release):
    """No probe is undecided on a release the harness knows (an undecided one makes its cases "cannot
    judge"), and the capture's adapter is built from them."""
    k = caps(release)
    assert not k.undecided(), k.undecided()
    capture_adapters.adapter_for(k)


def test_installed_release_is_read_without_importing_deepspeed():
    import sys

    had = "deepspeed" in sys.modules
    versions.installed.cache_clear()
    inst = versions.installed()
    assert inst.version and versions.parse(inst.version) >= (0, 18, 0)
    if not had:
        assert "deepspeed" not in sys.modules


def test_before_0190_gram_is_deselected_and_standard_runs_without_the_key():
    gram = pipeline_case(1, "none", "fp32", 2)
    a = versions.adapt(gram, caps("0.18.9"))
    assert a.case is None and "Gram" in a.deselected
    std = pipeline_case(1, "none", "fp32", 2, ns_method="standard")
    b = versions.adapt(std, caps("0.18.9"))
    assert "ns_method" not in json.loads(b.case.ds_config)["optimizer"]["params"]
    assert versions.adapt(std, caps("0.19.0")).case is std


def test_reduce_scatter_rule_covers_exactly_the_releases_that_refuse():
    case = pipeline_case(2, "cpu", "fp32", 2)
    got = [r for r in versions.RELEASES if versions.adapt(case, caps(r)).changes]
    assert got == ["0.19.3", "0.19.4", "0.19.5", "0.19.6", "0.19.7"]


def test_0197_refuses_the_bf16_optimizer_route_and_no_other_release_does():
    from harness.catalog.matrix import bf16opt_cases

    gad = [c for c in bf16opt_cases(False) if c.name.endswith("-gad32")]
    assert gad
    for c in gad:
        assert "BF16_Optimizer" in versions.adapt(c, caps("0.19.7")).deselected
        assert versions.adapt(c, caps("0.19.8")).case is c and versions.adapt(c, caps("0.19.6")).case is c


def test_a_deepspeed_package_without_its_own_metadata_is_refused(tmp_path):
    """A bare ``deepspeed`` package first on the path would be judged as the installed release's version
    (its metadata is the only one found): the harness names the mismatch instead."""
    import subprocess
    import sys

    (tmp_path / "deepspeed").mkdir()
    (tmp_path / "deepspeed" / "__init__.py").write_text("")
    from harness.env import buildenv

    out = subprocess.run([sys.executable, "-c", "from harness.env import versions; versions.installed()"],
                         env={"PYTHONPATH": f"{tmp_path}:{buildenv.PROJECT_ROOT}", "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "import deepspeed` loads" in out.stderr and str(tmp_path) in out.stderr


def test_param_group_dicts_with_muon_are_refused_before_0192():
    from harness.catalog.matrix import groups_cases

    grouped = next(c for c in groups_cases(False) if c.groups)
    for rel in ("0.18.9", "0.19.0", "0.19.1"):
        a = versions.adapt(grouped, caps(rel))
        assert a.case is None and "param-group dicts" in a.deselected, rel
    assert versions.adapt(grouped, caps("0.19.2")).case is not None
    assert versions.adapt(pipeline_case(1, "none", "fp32", 2, ns_method="standard"), caps("0.18.9")).case is not None


def test_a_model_that_declares_groups_is_refused_before_0192_and_one_that_does_not_is_not():
    from harness.models import model_case

    moe = model_case("moe", 2, world_size=2)  # its factory declares parameter groups
    assert "param-group dicts" in versions.adapt(moe, caps("0.19.1")).deselected
    assert versions.adapt(moe, caps("0.19.2")).case is not None
    plain = model_case("resnet", 2, world_size=2)  # no groups: a flat parameter list
    assert versions.adapt(plain, caps("0.19.1")).case is not None


@pytest.mark.parametrize("release,group,want", [
    ("0.18.9", {"use_muon": True, "lr": 1.0}, "muon-params"),
    ("0.19.1", {"use_muon": False, "lr": 1.0}, "adam-params"),
    ("0.19.2", {"use_muon": True, "name": "muon-params"}, "muon-params"),
    ("0.19.8", {"use_muon": True, "name": "group1-muon-params"}, "group1-muon-params"),
    ("0.19.8", {"lr": 1.0}, "0"),
])
def test_group_names_per_release(monkeypatch, release, group, want):
    k = caps(release)
    monkeypatch.setattr(tree, "capabilities", lambda root=None: k)
    assert capture_adapters.group_name(group, 0) == want


@pytest.mark.parametrize("field, value, reason", [("ns_dtype", "float64", "ns_compute_dtype"),
                                                 ("allgather_caps", (96, 128), "all-gather cache")])
def test_0198_only_hooks_are_deselected_before_0198(field, value, reason):
    """The high-precision-NS mode and the all-gather cache checks need what only 0.19.8 has: deselected
    (with the reason) on every older release, run on 0.19.8, and the plain case runs everywhere."""
    plain = pipeline_case(1, "none", "fp32", 2, ns_method="standard")
    case = plain.replace(**{field: value})
    for rel in versions.RELEASES[:-1]:
        a = versions.adapt(case, caps(rel))
        assert a.case is None and reason in a.deselected and rel in a.deselected
        assert versions.adapt(plain, caps(rel)).case is not None
    assert versions.adapt(case, caps("0.19.8")).case is case


def test_without_a_muon_group_only_bugs_outside_muon_code_are_expected(monkeypatch):
    """DSM-116 (zero.Init before 0.19.7): no parameter is tagged Muon, so the distributed Muon crash (DSM-102) and
    the 16-bit Muon momentum (DSM-001) cannot show; the same case without zero.Init still expects them."""
    from harness.registry.bugs import bugs_for

    monkeypatch.setenv("MUON_HARNESS_MEASURE", "1")  # every registered bug a candidate
    plain = pipeline_case(3, "none", "bf16", 2, ns_method="standard")
    zinit = plain.replace(name=plain.name + "-zinit", zero_init=True)
    assert {"DSM-102", "DSM-001"} <= {b.id for b in bugs_for(plain)}
    ids = {b.id for b in bugs_for(zinit)}
    assert "DSM-116" in ids and not ids & {"DSM-102", "DSM-001"}, ids


@pytest.mark.parametrize("release, want", [("0.18.9", "standard"), ("0.19.0", "gram"), ("0.19.8", "gram")])
def test_the_oracle_runs_the_releases_default_newton_schulz_when_the_key_is_absent(monkeypatch, release, want):
    """0.18.9 has no ns_method (the key is dropped for it) and runs the standard quintic: judging it as gram
    held its bf16 Newton-Schulz to gram's fp16 allowance (measured at 84925e7)."""
    from harness.judge import verdict

    from harness.case import dsconfig

    k = caps(release)
    monkeypatch.setattr(versions, "installed", lambda: versions.Installed(release, False, "/x"))
    monkeypatch.setattr(tree, "capabilities", lambda root=None: k)
    if release == "0.18.9":  # its MuonWithAuxAdam documents no ns_method default (the view reads the source)
        d = dsconfig.defaults()
        old = dsconfig.Defaults(release, tuple(kv for kv in d.values if kv[0] != "muon.ns_method"))
        monkeypatch.setattr(dsconfig, "defaults", lambda: old)
    dsconfig._of_text.cache_clear()
    try:
        case = pipeline_case(3, "none", "fp32", 1, ns_method="standard")
        adapted = versions.adapt(case).case
        assert verdict.step_config(adapted).ns_method == (want if release == "0.18.9" else "standard")
        bare = json.loads(case.ds_config)
        bare["optimizer"]["params"].pop("ns_method")
        assert verdict.step_config(case.replace(ds_config=json.dumps(bare))).ns_method == want
    finally:
        dsconfig._of_text.cache_clear()


def test_compute_grad_norm_is_deselected_before_0197_only():
    case = pipeline_case(2, "none", "fp16", 2, ns_method="standard", extra_zero={"compute_grad_norm": False})
    assert versions.adapt(case, caps("0.19.6")).case is None
    assert "compute_grad_norm" in versions.adapt(case, caps("0.19.6")).deselected
    assert versions.adapt(case, caps("0.19.7")).case is not None


def test_measure_release_names_must_all_be_gate_cases(monkeypatch, tmp_path):
    """A re-measure by name refuses, before any rank starts, a name the gate does not have (a typo would
    otherwise silently measure fewer cases than the run being triaged)."""
    from harness.cli import measure_release

    monkeypatch.setenv("MUON_HARNESS_MEASURE", "0")
    monkeypatch.setenv("MUON_HARNESS_MEASURE_EXCLUDE", "")
    names = tmp_path / "names"
    names.write_text("z1-none-fp32-ws1\nno-such-case\n")
    with pytest.raises(SystemExit, match="no-such-case"):
        measure_release.main(["--slice", "gate", "--names", str(names), "--exclude-absent"])


def test_release_rules_ask_whether_muon_runs_not_whether_a_matrix_is_muon_shaped():
    """A non-Muon optimizer on Muon-shaped matrices runs no Muon, so no rule about Muon's paths applies."""
    muon = pipeline_case(1, "cpu", "fp32", 2)
    cfg = muon.config
    cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}
    adamw = muon.replace(ds_config=json.dumps(cfg))
    assert any(p.uses_muon for p in adamw.params) and not adamw.runs_muon
    assert versions.adapt(muon, caps("0.19.7")).changes == ("z12-offload-reduce-scatter-off",)
    assert versions.adapt(adamw, caps("0.19.7")).changes == ()


# what each release's own source says, read by hand from its files (the probes must read the same)
PLACEMENT = {"0.18.9": ("reduce", "reduce"), "0.19.3": ("reduce", "reduce"), "0.19.7": ("reduce", "reduce"),
             "0.19.8": ("step", "step")}


@pytest.mark.parametrize("release", sorted(PLACEMENT))
def test_zero3_muon_placement_is_read_from_the_source(release):
    """0.18.9-0.19.7 run ZeRO-3's Muon in the gradient reduce (stage3.py ``_apply_distributed_muon_update``,
    offload or not); 0.19.8 in the step (``_muon_update_sub_group``, ``_apply_muon_updates_cpu_offload``)."""
    k = caps(release)
    assert (versions.z3_muon_placement(False, k), versions.z3_muon_placement(True, k)) == PLACEMENT[release]
    assert k["z12_offload_runs_muon"] is (release == "0.19.8")  # DSM-101: before 0.19.8 no offload Muon


def test_a_tree_that_matches_no_known_shape_cannot_be_judged(tmp_path):
    """A ZeRO-3 optimizer that calls muon_update from a function no probe knows: the placement probe says
    so by name, and a ZeRO-3 case is "cannot judge" rather than a DeepSpeed failure."""
    zero = tmp_path / "deepspeed" / "runtime" / "zero"
    zero.mkdir(parents=True)
    (zero / "stage3.py").write_text("class DeepSpeedZeroOptimizer_Stage3:\n    def _somewhere_new(self):\n"
                                    "        muon_update(1, 2)\n")
    k = tree.capabilities(str(tmp_path / "deepspeed"))
    with pytest.raises(tree.Undecided, match=r"z3_muon_placement\(none\).*_somewhere_new"):
        versions.z3_muon_placement(False, k)
    assert "z3_muon_placement(offload)" in k.undecided()


def test_on_an_unmeasured_tree_bugs_are_tried_by_model_and_named_by_source(monkeypatch):
    """On a tree no gate run measured: a modelled bug of any release is a candidate where it triggers (tried,
    never expected); an unmodelled one is expected only where the tree's source shows its mechanism
    (DSM-101: no muon_update on the ZeRO-1/2 offload path)."""
    monkeypatch.setattr(versions, "installed", lambda: versions.Installed("0.19.6+abc", True, "/src"))
    offload = pipeline_case(1, "cpu", "fp16", 2, ns_method="standard")
    trees = {release: caps(release) for release in ("0.19.6", "0.19.8")}  # before capabilities is replaced
    for release, present in (("0.19.6", True), ("0.19.8", False)):
        k = trees[release]
        monkeypatch.setattr(tree, "capabilities", lambda root=None, k=k: k)
        expected = {b.id for b in registry.bugs_for(offload)}
        assert ("DSM-101" in expected) is present, (release, expected)
        plain = pipeline_case(1, "none", "fp16", 2, ns_method="standard")
        tried = {b.id for b in registry.candidates_for(plain)}
        assert "DSM-108" in tried and not tried & {b.id for b in registry.bugs_for(plain)}  # tried, not assumed
        assert all(b.model is not None or b.crash is not None for b in registry.candidates_for(plain))


def test_a_frames_file_name_gives_its_package_path_once_and_an_unknown_name_says_where_to_add_it():
    assert tree.package_path("stage3.py") == tree.STAGE3[0]
    assert tree.package_path("original_muon.py") == tree.MUON_FN
    with pytest.raises(KeyError, match="tree._KNOWN_FILES"):
        tree.package_path("stage_2.py")
