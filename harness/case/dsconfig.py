"""The one typed view of a DeepSpeed config: every value the harness reads, resolved as the installed
DeepSpeed resolves it, each with where it came from.

Why one view: a config key the user left out takes DeepSpeed's default, and that default is a fact of
the installed release, not of the reader. Read through scattered ``.get(key, default)`` chains, each
reader carried its own guess, and one was wrong (``gradient_clipping`` defaults to 1.0, not off), so a
config without the key was judged against an unclipped oracle.

Why ``ast``: the defaults are read from the installed package's source files (found through
``importlib.util.find_spec``, never imported). ``import deepspeed.runtime.constants`` imports the whole
``deepspeed`` package -- torch, accelerator detection and its logging -- about 5 s on this machine
(measured 2026-12-01), which ``python -m harness --help`` and the parent process must not pay. Parsing
the source files (the defaults' files, runtime/engine.py for ``torch_adam``, and the config modules
whose keys ``unknown_keys`` checks against) has no side effects and runs once per release
(``defaults``): 0.8-1.1 s for the first call, measured 2026-12-01 with time.perf_counter on this
machine's 2 cores at load average 10 (0.10-0.15 s before engine.py and the config modules were read).
``cases/harness/test_dsconfig.py`` checks the parsed values against DeepSpeed's own objects. A key
the installed release does not document (an older release without it) resolves to None with the
source "not documented by DeepSpeed X", never to a value of ours.
"""
from __future__ import annotations

import ast
import difflib
import functools
import importlib.util
import json
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

# The one dtype-alias table: DeepSpeed's DtypeEnum (runtime/config.py) names each dtype these ways
# (lower-cased; "torch." prefixes dropped). cases/harness/test_dsconfig.py checks it against DtypeEnum.
DTYPE_ALIASES = {"fp32": ("fp32", "float32", "float"), "fp16": ("fp16", "float16", "half"),
                 "bf16": ("bf16", "bfloat16")}
_ALIAS = {a: name for name, aliases in DTYPE_ALIASES.items() for a in aliases}

# Where each default lives in a release's source: dotted config key -> (file, how to find it). "const"
# is a module-level NAME = literal; "field" an annotated field of a pydantic config class; "muon" the
# ``group.get(key, default)`` of one half in MuonWithAuxAdam.__init__. Several places: the first that
# documents the key wins (older releases kept the fp16 defaults in constants.py only).
_FP16_FIELDS = ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
                "consecutive_hysteresis", "min_loss_scale")
_ZERO_FIELDS = ("stage", "contiguous_gradients", "reduce_scatter", "reduce_bucket_size", "sub_group_size",
                "parameter_alignment", "compute_grad_norm", "save_muon_momentum_buffer_in_memory",
                "zero_quantized_gradients")
_OFFLOAD_FIELDS = {"offload_optimizer": ("DeepSpeedZeroOffloadOptimizerConfig",
                                         ("device", "buffer_count", "pipeline_read", "pipeline_write")),
                   "offload_param": ("DeepSpeedZeroOffloadParamConfig", ("device", "buffer_count"))}
_CONSTS = {"gradient_clipping": "GRADIENT_CLIPPING_DEFAULT",
           "communication_data_type": "COMMUNICATION_DATA_TYPE_DEFAULT",
           "data_types.grad_accum_dtype": "GRAD_ACCUM_DTYPE_DEFAULT",
           "managed_gradient_accumulation": "MANAGED_GRADIENT_ACCUMULATION_DEFAULT",
           "prescale_gradients": "PRESCALE_GRADIENTS_DEFAULT",
           "fp16.enabled": "FP16_ENABLED_DEFAULT", "bf16.enabled": "BFLOAT16_ENABLED_DEFAULT"}
_FP16_CONSTS = {"loss_scale": "FP16_LOSS_SCALE_DEFAULT", "initial_scale_power": "FP16_INITIAL_SCALE_POWER_DEFAULT",
                "loss_scale_window": "FP16_LOSS_SCALE_WINDOW_DEFAULT", "hysteresis": "FP16_HYSTERESIS_DEFAULT",
                "consecutive_hysteresis": "FP16_CONSECUTIVE_HYSTERESIS_DEFAULT",
                "min_loss_scale": "FP16_MIN_LOSS_SCALE_DEFAULT"}


def _places() -> dict[str, list[tuple[str, str, str]]]:
    """dotted key -> [(file under the package, kind, name)], in the order they are tried."""
    out: dict[str, list] = {k: [("runtime/constants.py", "const", v)] for k, v in _CONSTS.items()}
    for f in _FP16_FIELDS:
        out[f"fp16.{f}"] = [("runtime/precision_config.py", "field", f"DeepSpeedFP16Config.{f}"),
                            ("runtime/constants.py", "const", _FP16_CONSTS[f])]
    out["fp16.enabled"].insert(0, ("runtime/precision_config.py", "field", "DeepSpeedFP16Config.enabled"))
    out["bf16.enabled"].insert(0, ("runtime/precision_config.py", "field", "DeepSpeedBF16Config.enabled"))
    for f in _ZERO_FIELDS:
        out[f"zero_optimization.{f}"] = [("runtime/zero/config.py", "field", f"DeepSpeedZeroConfig.{f}")]
    for sec, (cls, fields) in _OFFLOAD_FIELDS.items():
        for f in fields:
            out[f"zero_optimization.{sec}.{f}"] = [("runtime/zero/offload_config.py", "field", f"{cls}.{f}")]
    for half, keys in (("muon", ("lr", "momentum", "weight_decay", "ns_method")),
                       ("adam", ("lr", "betas", "eps", "weight_decay"))):
        for k in keys:
            out[f"{half}.{k}"] = [("runtime/zero/muon/original_muon.py", "muon", f"{half}.{k}")]
    out["optimizer.params.adam_w_mode"] = [("runtime/config.py", "const", "ADAM_W_MODE_DEFAULT")]
    # opt-in flags DeepSpeed reads with a literal fallback at the point of use, not through a constant
    out["optimizer.params.per_head_muon"] = [("__init__.py", "call", "set_optimizer_flags.get(per_head_muon)")]
    out["optimizer.params.torch_adam"] = [("runtime/engine.py", "call", f"{f}.pop(TORCH_ADAM_PARAM)")
                                          for f in ("get_optimizer_configuration", "_configure_basic_optimizer")]
    out["tensor_parallel.autotp_size"] = [("runtime/tensor_parallel/config.py", "field",
                                           "TPTrainingConfig.autotp_size")]
    out["aio.block_size"] = [("runtime/swap_tensor/constants.py", "const", "AIO_BLOCK_SIZE_DEFAULT")]
    return out


UNDOCUMENTED = object()  # what ``Defaults.get`` returns for a key the release does not document


class _Opaque(Exception):
    """A default that is an expression rather than a literal: not read as a value."""


def _literal(node):
    """A default expression's value: a literal, ``Field(default, ...)`` or ``pp_int(x)`` around one."""
    try:
        return ast.literal_eval(node)
    except ValueError:
        pass
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        if node.func.id == "pp_int" and node.args:
            return int(_literal(node.args[0]))
        if node.func.id == "Field":
            arg = node.args[0] if node.args else next((k.value for k in node.keywords if k.arg == "default"), None)
            if arg is not None:
                return _literal(arg)
    raise _Opaque(ast.dump(node))


def _read_tree(tree: ast.Module) -> dict[tuple[str, str], object]:
    """Every module-level default of one source file, keyed by (kind, name) as in ``_places``; besides,
    each class's field names and aliases (("keys", class))."""
    out: dict[tuple[str, str], object] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            with _skip_opaque():
                out[("const", node.targets[0].id)] = _literal(node.value)
        elif isinstance(node, ast.ClassDef):
            out[("keys", node.name)] = _class_keys(node)
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) and item.value is not None:
                    with _skip_opaque():
                        out[("field", f"{node.name}.{item.target.id}")] = _literal(item.value)
            if node.name == "MuonWithAuxAdam":
                out.update(_muon_defaults(node))
    return out


def _class_keys(cls: ast.ClassDef) -> tuple[str, ...]:
    """A pydantic config class's field names and their ``Field(alias=...)`` names: the keys it accepts
    (DeepSpeedConfigModel sets ``populate_by_name``, so both)."""
    keys = []
    for item in cls.body:
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            keys.append(item.target.id)
            if isinstance(item.value, ast.Call):
                keys += [k.value.value for k in item.value.keywords
                         if k.arg == "alias" and isinstance(k.value, ast.Constant)]
    return tuple(keys)


def _call_default(tree: ast.Module, spec: str):
    """``spec`` "function.method(KEY)": the default of ``x.method(KEY, default)`` inside the module-level
    function or method ``function``; KEY a string literal or a constant's name. UNDOCUMENTED if none."""
    func, _, rest = spec.partition(".")
    method, _, key = rest.rstrip(")").partition("(")
    tops = [n for n in tree.body if isinstance(n, ast.ClassDef)]
    defs = [n for n in tree.body + [m for c in tops for m in c.body]
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == func]
    for node in (n for d in defs for n in ast.walk(d)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == method
                and len(node.args) == 2 and key in (getattr(node.args[0], "value", None),
                                                    getattr(node.args[0], "id", None))):
            with _skip_opaque():
                return _literal(node.args[1])
    return UNDOCUMENTED


class _skip_opaque:
    def __enter__(self):
        return self

    def __exit__(self, etype, exc, tb):
        return etype is _Opaque


def _muon_defaults(cls: ast.ClassDef) -> dict:
    """``group.get(key, default)`` in the two branches of ``if group["use_muon"]`` in ``__init__``."""
    init = next((f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"), None)
    branch = next((n for n in ast.walk(init) if isinstance(n, ast.If) and "use_muon" in ast.unparse(n.test)),
                  None) if init else None
    out = {}
    for half, body in (("muon", branch.body if branch else []), ("adam", branch.orelse if branch else [])):
        for node in (n for stmt in body for n in ast.walk(stmt)):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                    and len(node.args) == 2 and isinstance(node.args[0], ast.Constant)):
                with _skip_opaque():
                    out[("muon", f"{half}.{node.args[0].value}")] = _literal(node.args[1])
    return out


# The sections whose keys the view checks, and the pydantic class of the release that reads each (the
# top level has no class: ``_top_level_keys``).
_SECTION_CLASSES = {"zero_optimization": ("runtime/zero/config.py", "DeepSpeedZeroConfig"),
                    "fp16": ("runtime/precision_config.py", "DeepSpeedFP16Config"),
                    "bf16": ("runtime/precision_config.py", "DeepSpeedBF16Config"),
                    "bfloat16": ("runtime/precision_config.py", "DeepSpeedBF16Config"),
                    "zero_optimization.offload_optimizer": ("runtime/zero/offload_config.py",
                                                            "DeepSpeedZeroOffloadOptimizerConfig"),
                    "zero_optimization.offload_param": ("runtime/zero/offload_config.py",
                                                        "DeepSpeedZeroOffloadParamConfig")}


@dataclass(frozen=True)
class Defaults:
    """The documented defaults of one DeepSpeed release, by dotted config key; ``read_by``: the kind of
    place (``_places``) each was found in, which says how DeepSpeed parses a value given for it (a
    pydantic "field" is validated, the rest is used as written); ``known``: section ("" the top level)
    -> the keys the release reads there (empty: not read, and then nothing is reported unknown)."""

    release: str
    values: tuple[tuple[str, object], ...]
    read_by: tuple[tuple[str, str], ...] = ()
    known: tuple[tuple[str, frozenset], ...] = ()

    def get(self, key: str):
        return dict(self.values).get(key, UNDOCUMENTED)

    def kind(self, key: str) -> str | None:
        return dict(self.read_by).get(key)

    def known_keys(self, section: str) -> frozenset:
        return dict(self.known).get(section, frozenset())


class _Files:
    """The source files of one DeepSpeed package, each parsed once, each question of it asked once."""

    def __init__(self, root: Path):
        self.root, self.trees, self.read = root, {}, {}

    def tree(self, rel: str) -> ast.Module | None:
        if rel not in self.trees:
            path = self.root / rel
            self.trees[rel] = ast.parse(path.read_text()) if path.is_file() else None
        return self.trees[rel]

    def value(self, rel: str, kind: str, name: str):
        """The default ``_places`` names, or UNDOCUMENTED."""
        tree = self.tree(rel)
        if tree is None:
            return UNDOCUMENTED
        if kind == "call":
            return _call_default(tree, name)
        if rel not in self.read:
            self.read[rel] = _read_tree(tree)
        return self.read[rel].get((kind, name), UNDOCUMENTED)

    def strings(self, rel: str) -> frozenset:
        tree = self.tree(rel)
        return frozenset() if tree is None else frozenset(
            n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and n.value.isidentifier())


def _imported(files: _Files, rel: str) -> list[str]:
    """The package's own modules ``rel`` imports (relative, or absolute under ``deepspeed``), as files."""
    tree, out = files.tree(rel), []
    for node in ast.walk(tree) if tree is not None else ():
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            base = Path(rel).parent
            for _ in range(node.level - 1):
                base = base.parent
        elif (node.module or "").split(".")[0] == "deepspeed":
            base = Path()
            node = ast.ImportFrom(module=node.module.partition(".")[2], names=node.names, level=0)
        else:
            continue
        mod = base.joinpath(*node.module.split(".")) if node.module else base
        # the module itself, or (``from . import x``) the submodules it names
        for m in [mod] * bool(node.module) + [mod / a.name for a in node.names]:
            cand = next((c for c in (Path(f"{m}.py"), m / "__init__.py") if (files.root / c).is_file()), None)
            if cand is not None:
                out.append(cand.as_posix())
    return out


def _config_module(rel: str) -> bool:
    """A module that holds config keys or reads a config section: constants, ``*config``, a package's
    ``__init__`` re-exporting one."""
    name = Path(rel).name
    return name in ("constants.py", "__init__.py") or name.endswith("config.py")


def _top_level_keys(files: _Files) -> frozenset:
    """Every key DeepSpeedConfig (runtime/config.py) can read at the top level: the identifier-like strings
    of that file and of the config modules it imports, three levels deep (its constants files, the
    section readers such as ``get_tensor_parallel_config``). A superset: some of those strings are no
    key, which can only hide a misspelling that happens to be one of them."""
    seen, todo = set(), ["runtime/config.py"]
    for _depth in range(4):
        todo = [f for f in dict.fromkeys(todo) if f not in seen and _config_module(f)]
        seen.update(todo)
        todo = [g for f in todo for g in _imported(files, f)]
    return frozenset().union(*(files.strings(f) for f in seen))


def _known(files: _Files) -> tuple[tuple[str, frozenset], ...]:
    out = [("", _top_level_keys(files))]
    for sec, (rel, cls) in _SECTION_CLASSES.items():
        keys = files.value(rel, "keys", cls)
        out.append((sec, frozenset(() if keys is UNDOCUMENTED else keys)))
    return tuple((sec, keys) for sec, keys in out if keys)


@functools.cache
def defaults_of(package_dir: str, release: str) -> Defaults:
    """The defaults the DeepSpeed package at ``package_dir`` documents (cached per release and place)."""
    files = _Files(Path(package_dir))
    values, read_by = [], []
    for key, places in _places().items():
        for rel, kind, name in places:
            v = files.value(rel, kind, name)
            if v is not UNDOCUMENTED:
                values.append((key, tuple(v) if isinstance(v, list) else v))
                read_by.append((key, kind))
                break
    return Defaults(release, tuple(values), tuple(read_by), _known(files))


@functools.cache
def defaults() -> Defaults:
    """The installed DeepSpeed's defaults, read at first use (never at import)."""
    spec = importlib.util.find_spec("deepspeed")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("DeepSpeed is not installed in this interpreter: its config defaults cannot be read")
    try:
        release = metadata.version("deepspeed")
    except metadata.PackageNotFoundError:
        release = "(no package metadata)"
    return defaults_of(str(list(spec.submodule_search_locations)[0]), release)


def canonical_dtype(value) -> str | None:
    """A dtype name as DeepSpeed accepts it (DtypeEnum's aliases) -> "fp32"/"fp16"/"bf16"; None stays
    None, and a name DeepSpeed does not know is returned lower-cased, for its own validation to name."""
    if value is None:
        return None
    v = str(value).lower().removeprefix("torch.")
    return _ALIAS.get(v, v)


# ------------------------------------------------------------------------------------------------
# the view


@dataclass(frozen=True)
class Setting:
    """One resolved value: its dotted key, the value the view holds and where it came from ("config",
    "DeepSpeed X default", "not documented by DeepSpeed X")."""

    key: str
    value: object
    source: str


@dataclass(frozen=True)
class UnknownKey:
    """A key of the config the installed release does not read there (DeepSpeed ignores an unknown
    top-level key silently), with the closest key it does read (None: nothing close)."""

    key: str  # dotted, from the top level
    closest: str | None


def unknown_keys(cfg: dict, d: Defaults) -> tuple[UnknownKey, ...]:
    """The config's keys, at the top level and in the sections of ``_SECTION_CLASSES``, that release
    ``d`` does not know; a section whose known keys could not be read is not judged."""
    out = []
    for section in ("", *_SECTION_CLASSES):
        given = cfg
        for part in section.split(".") if section else ():
            given = _section(given, part)
        known = d.known_keys(section)
        if not known or not isinstance(given, dict):
            continue
        for k in sorted(str(k) for k in given if str(k) not in known):
            close = difflib.get_close_matches(k, sorted(known), n=1)
            out.append(UnknownKey(f"{section}.{k}" if section else k,
                                  (f"{section}.{close[0]}" if section else close[0]) if close else None))
    return tuple(out)


@dataclass(frozen=True)
class Offload:
    """``zero_optimization.offload_optimizer`` / ``offload_param`` (device "none" when the section is absent)."""

    device: str
    nvme_path: str | None = None
    buffer_count: int | None = None
    pipeline_read: bool = False
    pipeline_write: bool = False

    @property
    def pipelined(self) -> bool:
        return bool(self.pipeline_read or self.pipeline_write)


@dataclass(frozen=True)
class Zero:
    stage: int
    contiguous_gradients: bool
    reduce_scatter: bool
    reduce_bucket_size: int
    sub_group_size: int
    parameter_alignment: bool
    compute_grad_norm: bool | None  # None: the release has no such option
    save_muon_momentum_buffer_in_memory: bool | None
    zero_quantized_gradients: bool
    offload_optimizer: Offload
    offload_param: Offload


@dataclass(frozen=True)
class LossScaler:
    """The fp16 section's loss-scaler settings (``loss_scale`` 0: dynamic)."""

    loss_scale: float
    initial_scale_power: int
    loss_scale_window: int
    hysteresis: int
    min_loss_scale: float
    consecutive_hysteresis: bool

    @property
    def dynamic(self) -> bool:
        return not self.loss_scale


@dataclass(frozen=True)
class MuonHalf:
    lr: float
    momentum: float
    weight_decay: float
    ns_method: str | None  # None: the release has no ns_method (standard Newton-Schulz only)


@dataclass(frozen=True)
class AdamHalf:
    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float


@dataclass(frozen=True)
class Optimizer:
    type: str | None  # as the config names it; None: no optimizer section
    params_json: str  # the section's params as written, for optimizers other than Muon
    muon: MuonHalf
    adam: AdamHalf
    # None: the release has no such option
    adam_w_mode: bool | None
    per_head_muon: bool | None
    torch_adam: bool | None

    @property
    def kind(self) -> str | None:
        return self.type.lower() if isinstance(self.type, str) else None

    @property
    def params(self) -> dict:
        return json.loads(self.params_json)


@dataclass(frozen=True)
class DSConfig:
    """One DeepSpeed config as DeepSpeed resolves it; ``settings`` lists each value read with its source."""

    release: str
    zero: Zero
    model_dtype: str  # fp32 / fp16 / bf16
    grad_accum_dtype: str  # data_types.grad_accum_dtype; DeepSpeed's default (None) is the model dtype
    communication_data_type: str  # DeepSpeed's default (None) is the model dtype
    fp16: LossScaler
    gradient_clipping: float
    gradient_accumulation_steps: int | None  # None: not resolvable (``Setting.source`` says why)
    managed_gradient_accumulation: bool | None  # None: the release has no such option
    prescale_gradients: bool  # divide by the data-parallel size before the all-reduce (stage 0's), not after
    optimizer: Optimizer
    aio_block_size: int
    autotp_size: int  # tensor_parallel.autotp_size as DeepSpeed holds it (0: AutoTP off); see ``tp_size``
    scheduler_json: str | None
    settings: tuple[Setting, ...]
    unknown_keys: tuple[UnknownKey, ...] = ()

    @classmethod
    def of(cls, case) -> "DSConfig":
        """The view of a case's config (cached by its canonical JSON text and data-parallel size)."""
        return _of_text(case.ds_config, case.dp_size)

    @property
    def scheduler(self) -> dict | None:
        return None if self.scheduler_json is None else json.loads(self.scheduler_json)

    @property
    def offload(self) -> str:
        """Where the optimizer state lives as DeepSpeed builds it. Only a ZeRO optimizer reads
        ``offload_optimizer`` (engine.py ``_configure_zero_optimizer``; Muon's basic optimizer at stage 0 is
        built without it), so at stage 0 the section is accepted and ignored: no offload, no swap."""
        return self.zero.offload_optimizer.device if self.zero.stage > 0 else "none"

    @property
    def bf16_optimizer_route(self) -> bool:
        """DeepSpeed's own test (engine.py ``_do_optimizer_sanity_check``, 0.18.9 to 0.19.8): a bf16 model
        with fp32 gradient accumulation at ZeRO-1, unless the optimizer is offloaded to the CPU
        (``zero_cpu_offload`` asks for device "cpu" only), runs BF16_Optimizer, not the ZeRO optimizer."""
        return (self.zero.stage == 1 and self.model_dtype == "bf16" and self.grad_accum_dtype == "fp32"
                and self.zero.offload_optimizer.device != "cpu")

    @property
    def tp_size(self) -> int:
        """The tensor-parallel world AutoTP shards over: engine.py takes ``max(autotp_size, 1)`` (0, the
        default, is AutoTP off: one rank) and shards only when ``autotp_size() > 1``."""
        return max(1, self.autotp_size or 0)

    @property
    def names_muon(self) -> bool:
        """Whether the config's optimizer is Muon. No optimizer section is DeepSpeed's
        ``OPTIMIZER_TYPE_DEFAULT`` (None): no optimizer of the config's, so not Muon."""
        return self.optimizer.kind == "muon"

    def source(self, key: str) -> str:
        return next(s.source for s in self.settings if s.key == key)

    def given(self, key: str) -> bool:
        """Whether the config itself sets ``key`` (under any of the names DeepSpeed reads it by)."""
        return self.source(key).startswith("config")


def resolve(config: dict, world_size: int | None = None) -> DSConfig:
    """The view of a parsed config dict; ``world_size`` (data-parallel) only derives the accumulation
    steps of a config that gives both batch sizes but not the steps."""
    return _of_text(json.dumps(config, sort_keys=True, separators=(",", ":")), world_size)


@functools.lru_cache(maxsize=4096)
def _of_text(text: str, world_size: int | None = None) -> DSConfig:
    return _Resolver(json.loads(text), defaults(), world_size).view()


def _section(d, key: str) -> dict:
    v = d.get(key) if isinstance(d, dict) else None
    return v if isinstance(v, dict) else {}


def _convert(key: str, value, conv):
    if value is None or conv is None:
        return value
    try:
        return conv(value)
    except (TypeError, ValueError):
        raise ValueError(f"{key}: {value!r} is not a {getattr(conv, 'what', conv.__name__)}") from None


@functools.cache
def _pydantic(kind: type):
    """How DeepSpeed's config classes (``DeepSpeedConfigModel``, pydantic, lax mode) parse a field of type
    ``kind``: pydantic's own validator, so "3" and 3.0 are stage 3 and "yes" is true exactly where
    DeepSpeed takes them so, and what it refuses the view refuses."""
    import pydantic  # late: DeepSpeed's dependency; ``python -m harness --help`` runs without it

    adapter = pydantic.TypeAdapter(kind)

    def parse(v):
        return adapter.validate_python(v)

    parse.what = {bool: "boolean (DeepSpeed's config classes take true/false, 1/0, yes/no, on/off, t/f, y/n)",
                  int: "whole number (DeepSpeed's config classes take 3, 3.0, \"3\")",
                  float: "number (DeepSpeed's config classes take 0.5, \"0.5\")"}[kind]
    return parse


def _raw_bool(v) -> bool:
    """A boolean DeepSpeed reads unparsed (``get_scalar_param``, ``dict.get``/``pop``) and tests by truth:
    a string there is true whatever it says, so the view takes only what means one thing."""
    if isinstance(v, bool) or (isinstance(v, int) and v in (0, 1)):
        return bool(v)
    raise ValueError(v)


_raw_bool.what = ("JSON boolean (DeepSpeed uses this key as written, without parsing: any string, "
                  "\"false\" too, counts as true there)")


def _pair(v) -> tuple[float, float]:
    if not isinstance(v, (list, tuple)) or len(v) != 2:
        raise ValueError(v)
    return float(v[0]), float(v[1])


class _Resolver:
    """Reads one config against one release's defaults, noting each value's source."""

    def __init__(self, cfg: dict, d: Defaults, world_size: int | None = None):
        self.cfg, self.d, self.world_size = cfg, d, world_size
        self.label = f"DeepSpeed {d.release}"
        self.settings: list[Setting] = []

    def take(self, key: str, given: dict, names, conv=None, default_key: str | None = None,
             path: str | None = None):
        """``given[name]`` for the first of ``names`` the config sets, else the release's default of
        ``default_key`` (``key``); None where the release documents none. ``path``: where ``given`` sits
        in the config (default: ``key``'s parent), for the key a message names."""
        path = key.rpartition(".")[0] if path is None else path
        field = self.d.kind(default_key or key) == "field"
        if conv in (bool, int, float) and field:  # parsed as DeepSpeed parses it: validated by pydantic
            conv = _pydantic(conv)
        elif conv is bool:  # used as written
            conv = _raw_bool
        for name in (names,) if isinstance(names, str) else names:
            if given.get(name) is not None:
                written = f"{path}.{name}" if path else name
                where = "" if written == key else f" ({written})"
                return self.note(key, _convert(written, given[name], conv), "config" + where)
        v = self.d.get(default_key or key)
        if v is UNDOCUMENTED:
            return self.note(key, None, f"not documented by {self.label}")
        return self.note(key, _convert(key, v, conv), f"{self.label} default")

    def note(self, key: str, value, source: str):
        self.settings.append(Setting(key, value, source))
        return value

    def dtype(self, key: str, given: dict, name: str, model_dtype: str) -> str:
        """A dtype key whose DeepSpeed default (None) means the model dtype (engine.py
        ``communication_data_type`` / ``get_data_types``)."""
        v = self.take(key, given, name)
        last = self.settings[-1]
        if v is None:
            self.settings[-1] = Setting(key, model_dtype, last.source + " (None: the model dtype)")
            return model_dtype
        self.settings[-1] = Setting(key, canonical_dtype(v), last.source)
        return canonical_dtype(v)

    def offload(self, z: dict, sec: str) -> Offload:
        o, k = _section(z, sec), f"zero_optimization.{sec}"
        pipe = sec == "offload_optimizer"
        return Offload(device=str(self.take(f"{k}.device", o, "device") or "none"),
                       nvme_path=o.get("nvme_path"),
                       buffer_count=self.take(f"{k}.buffer_count", o, "buffer_count", int),
                       pipeline_read=bool(pipe and self.take(f"{k}.pipeline_read", o, "pipeline_read", bool)),
                       pipeline_write=bool(pipe and self.take(f"{k}.pipeline_write", o, "pipeline_write", bool)))

    def zero(self) -> Zero:
        z = _section(self.cfg, "zero_optimization")
        conv = {"stage": int, "reduce_bucket_size": int, "sub_group_size": int}
        vals = {f: self.take(f"zero_optimization.{f}", z, f, conv.get(f, bool)) for f in _ZERO_FIELDS}
        return Zero(**vals, offload_optimizer=self.offload(z, "offload_optimizer"),
                    offload_param=self.offload(z, "offload_param"))

    def scaler(self) -> LossScaler:
        f = _section(self.cfg, "fp16")
        conv = {"loss_scale": float, "initial_scale_power": int, "loss_scale_window": int, "hysteresis": int,
                "min_loss_scale": float, "consecutive_hysteresis": bool}
        return LossScaler(**{k: self.take(f"fp16.{k}", f, k, conv[k]) for k in _FP16_FIELDS})

    def optimizer(self) -> Optimizer:
        o = _section(self.cfg, "optimizer")
        p, P = _section(o, "params"), "optimizer.params"
        muon = MuonHalf(lr=self.take("optimizer.muon.lr", p, ("muon_lr", "lr"), float, "muon.lr", P),
                        momentum=self.take("optimizer.muon.momentum", p, "momentum", float, "muon.momentum", P),
                        weight_decay=self.take("optimizer.muon.weight_decay", p, "weight_decay", float,
                                               "muon.weight_decay", P),
                        ns_method=self.take("optimizer.muon.ns_method", p, "ns_method", str, "muon.ns_method", P))
        adam = AdamHalf(lr=self.take("optimizer.adam.lr", p, ("adam_lr", "lr"), float, "adam.lr", P),
                        betas=self.take("optimizer.adam.betas", p, "betas", _pair, "adam.betas", P),
                        eps=self.take("optimizer.adam.eps", p, "eps", float, "adam.eps", P),
                        weight_decay=self.take("optimizer.adam.weight_decay", p, "weight_decay", float,
                                               "adam.weight_decay", P))
        flags = {f: self.take(f"{P}.{f}", p, f, bool) for f in ("adam_w_mode", "per_head_muon", "torch_adam")}
        return Optimizer(type=o.get("type"), params_json=json.dumps(p, sort_keys=True), muon=muon, adam=adam,
                         **flags)

    def accumulation(self) -> int | None:
        """DeepSpeed's batch rule (config.py ``_set_batch_related_parameters``): the steps given; else
        ``train_batch_size // micro // world`` when both batch sizes are, which needs the data-parallel
        world size (None, said so, without one); else 1 when one batch size is; else DeepSpeed refuses."""
        cfg, key, rule = self.cfg, "gradient_accumulation_steps", f"{self.label} batch rule"
        if cfg.get(key) is not None and cfg[key] != "auto":
            return self.note(key, _convert(key, cfg[key], int), "config")
        tb, mb = (cfg.get(k) for k in ("train_batch_size", "train_micro_batch_size_per_gpu"))
        tb, mb = (None if v is None or v == "auto" else _convert(k, v, int)
                  for k, v in (("train_batch_size", tb), ("train_micro_batch_size_per_gpu", mb)))
        if tb is not None and mb is not None:
            if not self.world_size:
                return self.note(key, None, f"unresolved: {rule} is train_batch_size // (micro x data-parallel "
                                            "world size), and no world size was given")
            steps = tb // mb // self.world_size
            return self.note(key, steps or None, f"{rule}: train_batch_size // (micro x world {self.world_size})"
                             + ("" if steps else " is 0, which DeepSpeed refuses"))
        if tb is not None or mb is not None:
            return self.note(key, 1, f"{rule}: 1 (one batch size given)")
        return self.note(key, None, f"{rule}: neither batch size given, which DeepSpeed refuses")

    def view(self) -> DSConfig:
        cfg = self.cfg
        fp16_on = bool(self.take("fp16.enabled", _section(cfg, "fp16"), "enabled", bool))
        bf = _section(cfg, "bf16") or _section(cfg, "bfloat16")  # "bfloat16": DeepSpeed's older key, still read
        bf16_on = bool(self.take("bf16.enabled", bf, "enabled", bool))
        model = "fp16" if fp16_on else "bf16" if bf16_on else "fp32"
        sched = cfg.get("scheduler")
        return DSConfig(
            release=self.d.release, zero=self.zero(), model_dtype=model,
            grad_accum_dtype=self.dtype("data_types.grad_accum_dtype", _section(cfg, "data_types"),
                                        "grad_accum_dtype", model),
            communication_data_type=self.dtype("communication_data_type", cfg, "communication_data_type", model),
            fp16=self.scaler(), gradient_clipping=self.take("gradient_clipping", cfg, "gradient_clipping", float),
            gradient_accumulation_steps=self.accumulation(),
            managed_gradient_accumulation=self.take("managed_gradient_accumulation", cfg,
                                                    "managed_gradient_accumulation", bool),
            prescale_gradients=bool(self.take("prescale_gradients", cfg, "prescale_gradients", bool)),
            optimizer=self.optimizer(),
            aio_block_size=self.take("aio.block_size", _section(cfg, "aio"), "block_size", int),
            autotp_size=self.take("tensor_parallel.autotp_size", _section(cfg, "tensor_parallel"), "autotp_size",
                                  int),
            scheduler_json=None if sched is None else json.dumps(sched, sort_keys=True),
            settings=tuple(self.settings), unknown_keys=unknown_keys(cfg, self.d))
