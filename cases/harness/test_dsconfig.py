"""The typed view of a DeepSpeed config (``harness.case.dsconfig``): its defaults are the installed
release's own, the oracle is told them, and nothing in the harness reads the config around it.

The expected defaults are taken at test time from DeepSpeed's own objects (its pydantic config
classes, ``DeepSpeedConfig`` on an empty config, its constants, ``MuonWithAuxAdam``'s groups), never
written down here, so the test follows the installed release.
"""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from harness.case import dsconfig
from harness.case.scenarios import pipeline_case
from harness.case.spec import canonical_json

ROOT = Path(__file__).resolve().parents[2]
EMPTY = {"train_batch_size": 1, "train_micro_batch_size_per_gpu": 1}


@pytest.fixture(scope="module")
def ds_objects():
    from deepspeed.runtime import constants
    from deepspeed.runtime.config import ADAM_W_MODE_DEFAULT, DeepSpeedConfig
    from deepspeed.runtime.swap_tensor import constants as aio
    from deepspeed.runtime.zero.offload_config import (DeepSpeedZeroOffloadOptimizerConfig,
                                                       DeepSpeedZeroOffloadParamConfig)

    return dict(config=DeepSpeedConfig(dict(EMPTY)), constants=constants, adam_w_mode=ADAM_W_MODE_DEFAULT,
                aio_block=aio.AIO_BLOCK_SIZE_DEFAULT, off_opt=DeepSpeedZeroOffloadOptimizerConfig(),
                off_param=DeepSpeedZeroOffloadParamConfig())


def test_defaults_are_what_deepspeed_yields_for_an_empty_config(ds_objects):
    v = dsconfig.resolve(EMPTY)
    ref = ds_objects["config"]
    z, zc = v.zero, ref.zero_config
    assert (z.stage, z.contiguous_gradients, z.reduce_scatter, z.reduce_bucket_size, z.sub_group_size,
            z.parameter_alignment, z.compute_grad_norm, z.save_muon_momentum_buffer_in_memory,
            z.zero_quantized_gradients) == (
        int(zc.stage), zc.contiguous_gradients, zc.reduce_scatter, zc.reduce_bucket_size, zc.sub_group_size,
        zc.parameter_alignment, zc.compute_grad_norm, zc.save_muon_momentum_buffer_in_memory,
        zc.zero_quantized_gradients)
    for mine, theirs in ((z.offload_optimizer, ds_objects["off_opt"]), (z.offload_param, ds_objects["off_param"])):
        # an unset device stays the field's plain default (pydantic does not coerce defaults to the enum)
        assert mine.device == getattr(theirs.device, "value", theirs.device)
        assert mine.buffer_count == theirs.buffer_count
    assert (z.offload_optimizer.pipeline_read, z.offload_optimizer.pipeline_write) == (
        ds_objects["off_opt"].pipeline_read, ds_objects["off_opt"].pipeline_write)
    f, rf = v.fp16, ref.float16_config
    assert (f.loss_scale, f.initial_scale_power, f.loss_scale_window, f.hysteresis, f.min_loss_scale,
            f.consecutive_hysteresis) == (rf.loss_scale, rf.initial_scale_power, rf.loss_scale_window,
                                          rf.hysteresis, rf.min_loss_scale, rf.consecutive_hysteresis)
    assert v.model_dtype == "fp32" and not ref.float16_config.enabled and not ref.bfloat16_config.enabled
    assert v.gradient_clipping == ref.gradient_clipping
    assert ref.communication_data_type is None and v.communication_data_type == v.model_dtype
    assert ref.grad_accum_dtype is None and v.grad_accum_dtype == v.model_dtype
    assert v.managed_gradient_accumulation == ds_objects["constants"].MANAGED_GRADIENT_ACCUMULATION_DEFAULT
    assert v.optimizer.adam_w_mode == ds_objects["adam_w_mode"]
    assert v.aio_block_size == ds_objects["aio_block"]


def test_muon_defaults_are_muon_with_aux_adams(ds_objects):
    import torch
    from deepspeed.runtime.zero.muon.original_muon import MuonWithAuxAdam

    opt = MuonWithAuxAdam([{"params": [torch.zeros(2, 2)], "use_muon": True},
                           {"params": [torch.zeros(2)], "use_muon": False}])
    muon, adam = opt.param_groups
    v = dsconfig.resolve({"optimizer": {"type": "Muon"}}).optimizer
    assert (v.muon.lr, v.muon.momentum, v.muon.weight_decay, v.muon.ns_method) == (
        muon["lr"], muon["momentum"], muon["weight_decay"], muon["ns_method"])
    assert (v.adam.lr, v.adam.betas, v.adam.eps, v.adam.weight_decay) == (
        adam["lr"], tuple(adam["betas"]), adam["eps"], adam["weight_decay"])


def test_sources_name_the_config_or_the_installed_release():
    release = metadata.version("deepspeed")
    v = dsconfig.resolve({"gradient_clipping": 0.0, "optimizer": {"params": {"lr": 0.1}}})
    assert v.source("gradient_clipping") == "config"
    assert v.source("optimizer.muon.lr") == "config (optimizer.params.lr)" and v.optimizer.muon.lr == 0.1
    assert v.source("fp16.hysteresis") == f"DeepSpeed {release} default"
    assert v.source("communication_data_type") == f"DeepSpeed {release} default (None: the model dtype)"


def test_a_key_the_release_does_not_document_is_reported_not_invented(tmp_path):
    (tmp_path / "runtime").mkdir()
    (tmp_path / "runtime" / "constants.py").write_text("MANAGED_GRADIENT_ACCUMULATION_DEFAULT = True\n")
    old = dsconfig.defaults_of(str(tmp_path), "0.0.1")
    v = dsconfig._Resolver({}, old).view()
    assert v.gradient_clipping is None and v.zero.stage is None
    assert v.source("gradient_clipping") == "not documented by DeepSpeed 0.0.1"
    assert v.managed_gradient_accumulation is True


def _without_clipping(clip=None):
    c = pipeline_case(1, "none", "fp32", 2, steps=2)
    cfg = c.config
    del cfg["gradient_clipping"]
    if clip is not None:
        cfg["gradient_clipping"] = clip
    cfg["scheduler"] = {"type": "WarmupCosineLR", "params": {"total_num_steps": 4, "warmup_num_steps": 1}}
    return c.replace(ds_config=canonical_json(cfg))


def test_the_oracle_clips_at_the_release_default_when_the_key_is_absent():
    from deepspeed.runtime.constants import GRADIENT_CLIPPING_DEFAULT

    from harness.judge.verdict import step_config

    assert step_config(_without_clipping()).gradient_clipping == float(GRADIENT_CLIPPING_DEFAULT)
    assert step_config(_without_clipping(0)).gradient_clipping == 0.0
    assert step_config(_without_clipping(0.25)).gradient_clipping == 0.25


def test_step_config_takes_every_value_from_the_view():
    from harness.judge.verdict import step_config

    cfg = {"zero_optimization": {"stage": 2}, "fp16": {"enabled": True, "hysteresis": 5},
           "optimizer": {"type": "Muon", "params": {"muon_lr": 0.03, "adam_lr": 0.004, "momentum": 0.8}}}
    c = pipeline_case(2, "none", "fp16", 1).replace(ds_config=canonical_json(cfg))
    sc, v = step_config(c), c.ds
    assert (sc.muon_lr, sc.adam_lr, sc.momentum, sc.betas, sc.eps, sc.weight_decay, sc.gradient_clipping) == (
        0.03, 0.004, 0.8, v.optimizer.adam.betas, v.optimizer.adam.eps, v.optimizer.muon.weight_decay,
        v.gradient_clipping)
    assert (sc.loss_scaler.hysteresis, sc.loss_scaler.loss_scale_window, sc.loss_scaler.initial_scale_power) == (
        5, v.fp16.loss_scale_window, v.fp16.initial_scale_power)


def test_one_dtype_table_and_it_is_deepspeeds():
    from deepspeed.runtime.config import DtypeEnum

    theirs: dict[str, set] = {}
    for alias, member in DtypeEnum._value2member_map_.items():
        if isinstance(alias, str) and member.name in dsconfig.DTYPE_ALIASES:
            theirs.setdefault(member.name, set()).add(alias.lower().removeprefix("torch."))
    assert {k: set(v) for k, v in dsconfig.DTYPE_ALIASES.items()} == theirs
    assert dsconfig.canonical_dtype("torch.bfloat16") == "bf16" and dsconfig.canonical_dtype("half") == "fp16"
    aliases = {a for v in dsconfig.DTYPE_ALIASES.values() for a in v} - set(dsconfig.DTYPE_ALIASES)
    found = [(f, n.lineno) for f, tree in _harness_trees() for n in ast.walk(tree)
             if isinstance(n, ast.Constant) and n.value in aliases and f not in DTYPE_TABLE_EXCEPTIONS]
    assert not found, f"a dtype alias outside harness/case/dsconfig.py (a second table?): {found}"


# Files that name a dtype alias for another reason than reading a config: each with why.
DTYPE_TABLE_EXCEPTIONS = {
    "harness/case/dsconfig.py": "the table itself",
    "harness/rank/ds_run.py": "NS_DTYPES: Case.ns_dtype's torch dtype names (float64 Newton-Schulz), no config key",
    "harness/judge/departures.py": "\"half\" names the optimizer's Muon or Adam half (a row's key), no dtype",
}

# Sections and top-level keys of the DeepSpeed config that only the view reads.
SECTIONS = {"zero_optimization", "fp16", "bf16", "bfloat16", "data_types", "communication_data_type",
            "gradient_clipping", "optimizer", "aio", "scheduler", "tensor_parallel", "gradient_accumulation_steps",
            "managed_gradient_accumulation"}

# (file, function) that touch a section raw, each with why it is no reader the view could serve.
RAW_EXCEPTIONS = {
    ("harness/case/dsconfig.py", "*"): "the view itself",
    ("harness/catalog/matrix.py", "*"): "case builders: copy a section to write a variant of it",
    ("harness/case/hf_auto.py", "resolve"): "fills the user's \"auto\" values in place from TrainingArguments",
    ("harness/case/hf_auto.py", "_num_training_steps"): "reads a concrete total_num_steps beside the \"auto\" ones, "
                                                        "before the config can be resolved",
    ("harness/case/hf_auto.py", "_check_schedule"): "validates the scheduler section just filled from \"auto\"",
    ("harness/cli/check_plan.py", "_rewrite"): "rewrites the user's config for the harness (an explicit "
                                               "sub_group_size scaled, per_head_muon removed)",
    ("harness/cli/check.py", "_columns_case"): "writes the private NVMe sub-folder into the user's section",
    ("harness/cli/check_config.py", "check_optimizer"): "validates the shape and types the user wrote",
    ("harness/cli/check_config.py", "check_zero"): "validates the shape and types the user wrote",
    ("harness/cli/check_config.py", "_nvme_sections"): "hands out the user's NVMe sections for rewriting",
    ("harness/cli/check_config.py", "deepspeed_validate"): "makes the probe's batch sizes consistent (writes "
                                                           "train_batch_size from the rewritten, explicit ones)",
    ("harness/env/versions.py", "<lambda>"): "drop-ns-method-key's change: removes the key from the config",
    ("harness/catalog/space.py", "config_of"): "case builder: writes a covering-array row's config, the NVMe "
                                               "placeholder into the offload sections it set",
    ("harness/catalog/departures.py", "_plain_lr"): "case builder: removes muon_lr and adam_lr to write the "
                                                    "plain-lr variant",
    ("harness/judge/departure_pins.py", "_raw_params"): "the second computation of a departure's size reads the "
                                                        "config's own lr keys, on purpose not the view the "
                                                        "finding resolved them through",
    ("harness/report/html.py", "_stage"): "the stored record's JSON: its ds_config handed to the view",
}


def _harness_trees():
    for f in sorted((ROOT / "harness").rglob("*.py")):
        yield str(f.relative_to(ROOT)), ast.parse(f.read_text())


def raw_reads(rel: str, tree: ast.AST) -> list[tuple[str, int, str]]:
    """(function, line, section) of each ``x.get("<section>"...)``, ``x["<section>"]`` read and
    ``"<section>" in x`` in a module."""
    out = []

    def visit(node, func):
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else (
                "<lambda>" if isinstance(child, ast.Lambda) else func)
            key = None
            if (isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute) and child.func.attr == "get"
                    and child.args and isinstance(child.args[0], ast.Constant)):
                key = child.args[0].value
            elif isinstance(child, ast.Subscript) and isinstance(child.ctx, ast.Load) and isinstance(
                    child.slice, ast.Constant):
                key = child.slice.value
            elif (isinstance(child, ast.Compare) and isinstance(child.left, ast.Constant)
                  and any(isinstance(op, (ast.In, ast.NotIn)) for op in child.ops)):
                key = child.left.value
            if key in SECTIONS:
                out.append((func, child.lineno, key))
            visit(child, name)

    visit(tree, "<module>")
    return [r for r in out if (rel, "*") not in RAW_EXCEPTIONS and (rel, r[0]) not in RAW_EXCEPTIONS]


def test_no_reader_goes_around_the_view():
    found = [(rel, *r) for rel, tree in _harness_trees() for r in raw_reads(rel, tree)]
    assert not found, "raw config reads outside harness/case/dsconfig.py (read it through Case.ds / " \
                      f"dsconfig.resolve, or list the exception with its reason): {found}"


def test_the_scan_sees_each_kind_of_raw_read():
    src = ("def f(c):\n    a = c.config.get('gradient_clipping', 0.0)\n    b = cfg['zero_optimization']\n"
           "    return 'fp16' in cfg\n")
    assert [(fn, key) for fn, _, key in raw_reads("harness/x.py", ast.parse(src))] == [
        ("f", "gradient_clipping"), ("f", "zero_optimization"), ("f", "fp16")]


def test_help_reads_no_defaults_and_imports_no_deepspeed():
    code = ("import sys; import harness.cli.main; from harness.case import dsconfig; "
            "print(json.dumps([dsconfig.defaults.cache_info().currsize, 'deepspeed' in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", "import json; " + code], capture_output=True, text=True, cwd=ROOT,
                         check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [0, False]


def _fake_release(tmp_path, files: dict[str, str]) -> dsconfig.Defaults:
    """The defaults of a fake DeepSpeed package holding only ``files`` (path -> source)."""
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return dsconfig.defaults_of(str(tmp_path), "0.0.2")


def test_an_option_the_release_lacks_is_none_not_false(tmp_path):
    old = _fake_release(tmp_path, {"runtime/constants.py": "GRADIENT_CLIPPING_DEFAULT = 1.0\n"})
    v = dsconfig._Resolver({}, old).view()
    for key, value in (("managed_gradient_accumulation", v.managed_gradient_accumulation),
                       ("optimizer.params.adam_w_mode", v.optimizer.adam_w_mode),
                       ("optimizer.params.per_head_muon", v.optimizer.per_head_muon),
                       ("optimizer.params.torch_adam", v.optimizer.torch_adam)):
        assert value is None and v.source(key) == "not documented by DeepSpeed 0.0.2", key
    # what the config gives is still read, documented or not
    given = dsconfig._Resolver({"managed_gradient_accumulation": False}, old).view()
    assert given.managed_gradient_accumulation is False and given.source("managed_gradient_accumulation") == "config"


def test_opt_in_flags_and_autotp_are_read_from_the_release(tmp_path):
    from deepspeed.runtime.tensor_parallel.config import TPTrainingConfig

    release = metadata.version("deepspeed")
    v = dsconfig.resolve(EMPTY)
    assert v.autotp_size == TPTrainingConfig().autotp_size and v.tp_size == max(1, TPTrainingConfig().autotp_size)
    for key in ("optimizer.params.per_head_muon", "optimizer.params.torch_adam", "tensor_parallel.autotp_size"):
        assert v.source(key) == f"DeepSpeed {release} default", key
    # a release whose fallbacks differ is read as it is: the values come from its source, not from here
    other = _fake_release(tmp_path, {
        "__init__.py": "def set_optimizer_flags(c, m):\n    return c.get('per_head_muon', True)\n",
        "runtime/engine.py": "class E:\n    def get_optimizer_configuration(self, p):\n"
                             "        return p.pop(TORCH_ADAM_PARAM, True)\n",
        "runtime/tensor_parallel/config.py": "class TPTrainingConfig:\n    autotp_size: int = 4\n"})
    w = dsconfig._Resolver({}, other).view()
    assert (w.optimizer.per_head_muon, w.optimizer.torch_adam, w.autotp_size, w.tp_size) == (True, True, 4, 4)


def _deepspeed_steps(tb, mb, world):
    """gradient_accumulation_steps as DeepSpeedConfig's own batch rule derives it at ``world`` ranks."""
    from deepspeed.runtime.config import DeepSpeedConfig

    ref = DeepSpeedConfig({"train_batch_size": tb, "train_micro_batch_size_per_gpu": mb})
    ref.world_size, ref.gradient_accumulation_steps = world, None
    ref.train_batch_size, ref.train_micro_batch_size_per_gpu = tb, mb
    ref._set_batch_related_parameters()
    return ref.gradient_accumulation_steps


def test_accumulation_steps_need_the_world_size_when_derived():
    cfg = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 1}
    v = dsconfig.resolve(cfg)
    assert v.gradient_accumulation_steps is None
    assert v.source("gradient_accumulation_steps").startswith("unresolved")
    for world in (1, 2, 4):
        assert dsconfig.resolve(cfg, world).gradient_accumulation_steps == _deepspeed_steps(8, 1, world)
    c = pipeline_case(1, "none", "fp32", 2)
    cfg = c.config
    del cfg["gradient_accumulation_steps"]
    cfg["train_batch_size"] = 8
    assert c.replace(ds_config=canonical_json(cfg)).grad_accum == _deepspeed_steps(8, 1, c.dp_size)


STRING_BOOLS = ("true", "false", "False", "TRUE", "1", "0", "yes", "No", "on", "OFF", "t", "f", "y", "n",
                "maybe", "", " true", "2")


@pytest.mark.parametrize("text", STRING_BOOLS)
def test_string_booleans_parse_as_deepspeeds_config_classes_parse_them(text):
    import pydantic
    from deepspeed.runtime.precision_config import DeepSpeedFP16Config

    try:
        want = DeepSpeedFP16Config(enabled=text).enabled
    except pydantic.ValidationError:
        with pytest.raises(ValueError, match="fp16.enabled"):
            dsconfig.resolve({"fp16": {"enabled": text}})
        return
    assert dsconfig.resolve({"fp16": {"enabled": text}}).model_dtype == ("fp16" if want else "fp32")


def test_a_string_for_a_flag_deepspeed_reads_unparsed_is_refused():
    from deepspeed.runtime.config import get_managed_gradient_accumulation

    # DeepSpeed keeps the string, which is true even when it says "false"
    assert get_managed_gradient_accumulation({"managed_gradient_accumulation": "false"})
    with pytest.raises(ValueError, match="managed_gradient_accumulation.*as written"):
        dsconfig.resolve({"managed_gradient_accumulation": "false"})
    assert dsconfig.resolve({"managed_gradient_accumulation": False}).managed_gradient_accumulation is False


def test_no_optimizer_section_is_no_muon():
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.constants import OPTIMIZER_TYPE_DEFAULT

    assert DeepSpeedConfig(dict(EMPTY)).optimizer_name == OPTIMIZER_TYPE_DEFAULT
    v = dsconfig.resolve(EMPTY)
    assert v.optimizer.type == OPTIMIZER_TYPE_DEFAULT and not v.names_muon
    assert dsconfig.resolve({"optimizer": {"type": "muon"}}).names_muon
    c = pipeline_case(1, "none", "fp32", 1)
    assert c.runs_muon
    cfg = c.config
    del cfg["optimizer"]
    assert not c.replace(ds_config=canonical_json(cfg)).runs_muon


def test_unknown_keys_are_listed_with_the_closest_known_one():
    from deepspeed.runtime import constants

    cfg = dict(EMPTY, gradient_cliping=1.0, train_mirco_batch_size_per_gpu=2,
               zero_optimization={"stage": 1, "offload_optimizer": {"device": "cpu", "pin_memroy": True}})
    got = {u.key: u.closest for u in dsconfig.resolve(cfg).unknown_keys}
    assert got == {"gradient_cliping": constants.GRADIENT_CLIPPING,
                   "train_mirco_batch_size_per_gpu": constants.TRAIN_MICRO_BATCH_SIZE_PER_GPU,
                   "zero_optimization.offload_optimizer.pin_memroy": "zero_optimization.offload_optimizer.pin_memory"}


def test_the_known_section_keys_are_the_config_classes_fields_and_aliases():
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.offload_config import (DeepSpeedZeroOffloadOptimizerConfig,
                                                       DeepSpeedZeroOffloadParamConfig)

    d = dsconfig.defaults()
    for section, cls in (("zero_optimization", DeepSpeedZeroConfig), ("fp16", DeepSpeedFP16Config),
                         ("bf16", DeepSpeedBF16Config), ("bfloat16", DeepSpeedBF16Config),
                         ("zero_optimization.offload_optimizer", DeepSpeedZeroOffloadOptimizerConfig),
                         ("zero_optimization.offload_param", DeepSpeedZeroOffloadParamConfig)):
        fields = cls.model_fields
        assert d.known_keys(section) == set(fields) | {f.alias for f in fields.values() if f.alias}, section


@pytest.mark.parametrize("stage,offload,dtype", [(1, "cpu", "fp16"), (2, "none", "bf16"), (3, "nvme", "fp32")])
def test_the_harness_own_configs_have_no_unknown_keys(stage, offload, dtype):
    c = pipeline_case(stage, offload, dtype, 2, grad_accum=2, clip=1.0)
    assert c.ds.unknown_keys == ()


STAGE_SPELLINGS = (3, "3", 3.0, "3.0", " 3", "03", True, 2.5, "three", "", None)


@pytest.mark.parametrize("written", STAGE_SPELLINGS)
def test_a_number_written_another_way_is_read_as_deepspeeds_config_classes_read_it(written):
    """``"stage": "3"`` is stage 3 to DeepSpeed (its pydantic model, lax): the view reads the same value, and
    refuses what DeepSpeed refuses, so a refusal that needs stage 3 is decided on what DeepSpeed will run."""
    import pydantic
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    try:
        want = int(DeepSpeedZeroConfig(**({} if written is None else {"stage": written})).stage)
    except pydantic.ValidationError:
        with pytest.raises(ValueError, match="zero_optimization.stage"):
            dsconfig.resolve({"zero_optimization": {"stage": written}})
        return
    assert dsconfig.resolve({"zero_optimization": {"stage": written}}).zero.stage == want


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_offload_is_where_deepspeed_puts_the_optimizer_state_and_stage_0_puts_it_nowhere(device):
    """Only a ZeRO optimizer reads ``offload_optimizer``: at stage 0 the section is accepted and ignored
    (the pairs family's ``z0-nvme-`` cases swap nothing), so the view's ``offload`` is "none" there, while
    the section itself is kept as written."""
    for stage in (0, 1, 2, 3):
        v = dsconfig.resolve({"zero_optimization": {"stage": stage, "offload_optimizer": {"device": device}}})
        assert v.zero.offload_optimizer.device == device
        assert v.offload == ("none" if stage == 0 else device)
