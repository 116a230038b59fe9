"""What the DeepSpeed tree under test does, read from its source rather than its version string.

Why: a reviewer's tree (a pull request on top of some master commit) carries the version string of
the release it branched from and the behaviour of neither. Where Muon runs on each path, which
config keys exist, which names the capture reads: each is decided here by parsing the tree's own
files (``ast``, never importing DeepSpeed, so the parent can decide before any rank starts).
``version.txt`` only labels a run (``harness.env.versions``).

Each probe is a pure function of the parsed tree. A probe that finds none of the shapes it knows
raises ``Undecided`` naming itself; the case that needs it is then "cannot judge: <probe>"
(``harness.gate.decide``), never a DeepSpeed failure. ``python -m harness.env.tree [ROOT]`` prints
every probe's answer for a tree.
"""
from __future__ import annotations

import ast
import functools
import hashlib
import io
import textwrap
import tokenize
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

STAGE3 = ("runtime/zero/stage3.py", "DeepSpeedZeroOptimizer_Stage3")
STAGE12 = ("runtime/zero/stage_1_and_2.py", "DeepSpeedZeroOptimizer")
MUON_OPT = ("runtime/zero/muon/muon_optimizer.py", "MuonWithAuxAdam")
BF16_OPT = ("runtime/bf16_optimizer.py", "BF16_Optimizer")
ENGINE = ("runtime/engine.py", "DeepSpeedEngine")
MUON_FN = "runtime/zero/muon/original_muon.py"
ZERO_CONFIG = ("runtime/zero/config.py", "DeepSpeedZeroConfig")
PACKAGE_INIT = "__init__.py"
_KNOWN_FILES = (STAGE3[0], STAGE12[0], MUON_OPT[0], BF16_OPT[0], ENGINE[0], MUON_FN, ZERO_CONFIG[0], PACKAGE_INIT)


def package_path(file_name: str) -> str:
    """The path in the ``deepspeed`` package of a file the harness reads, from its base name (as a
    traceback's frame names it). The base names of those files are unique."""
    found = [rel for rel in _KNOWN_FILES if Path(rel).name == file_name]
    if len(found) != 1:
        raise KeyError(f"{file_name!r} is not one file the harness reads in DeepSpeed; add it to tree._KNOWN_FILES")
    return found[0]


class Undecided(Exception):
    """A probe found none of the code shapes it knows: the harness cannot read this tree there."""

    def __init__(self, probe: str, why: str):
        super().__init__(f"probe {probe}: {why}")
        self.probe = probe
        self.why = why


@dataclass(frozen=True)
class Tree:
    """One DeepSpeed package directory (the folder holding ``runtime/``)."""

    root: Path

    def module(self, rel: str) -> ast.Module | None:
        return _parsed(str(self.root / rel))

    def cls(self, rel: str, name: str) -> ast.ClassDef | None:
        mod = self.module(rel)
        return next((n for n in mod.body if isinstance(n, ast.ClassDef) and n.name == name), None) if mod else None

    def method(self, where: tuple[str, str], name: str) -> ast.FunctionDef | None:
        c = self.cls(*where)
        return next((n for n in c.body if isinstance(n, ast.FunctionDef) and n.name == name), None) if c else None

    def function(self, rel: str, name: str) -> ast.FunctionDef | None:
        mod = self.module(rel)
        return next((n for n in mod.body if isinstance(n, ast.FunctionDef) and n.name == name), None) if mod else None

    def muon_callers(self, where: tuple[str, str]) -> frozenset[str]:
        """The methods of a class that call ``muon_update`` (by name or attribute)."""
        c = self.cls(*where)
        if c is None:
            return frozenset()
        return frozenset(f.name for f in c.body if isinstance(f, ast.FunctionDef) and _calls(f, "muon_update"))

    def strings(self, rel: str) -> tuple[str, ...]:
        mod = self.module(rel)
        return tuple(n.value for n in ast.walk(mod) if isinstance(n, ast.Constant) and isinstance(n.value, str)) \
            if mod else ()

    def says(self, rel: str, fragment: str) -> bool:
        """Whether a string constant of the file contains ``fragment`` (a tree's own refusal text)."""
        return any(fragment in s for s in self.strings(rel))


@functools.cache
def _parsed(path: str) -> ast.Module | None:
    p = Path(path)
    return ast.parse(p.read_text(), filename=path) if p.is_file() else None


def _calls(node: ast.AST, name: str) -> bool:
    return any(isinstance(c, ast.Call) and name in (getattr(c.func, "id", None), getattr(c.func, "attr", None))
               for c in ast.walk(node))


def _attrs(node: ast.AST) -> set[str]:
    return {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}


def _early_return_guard(fn: ast.FunctionDef) -> ast.expr | None:
    """The test of a leading ``if ...: return`` (after the docstring), if the function has one."""
    body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    if body and isinstance(body[0], ast.If) and len(body[0].body) == 1 and isinstance(body[0].body[0], ast.Return):
        return body[0].test
    return None


def _negated_attrs(test: ast.expr) -> set[str]:
    return {a for n in ast.walk(test) if isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.Not)
            for a in _attrs(n.operand)}


# ------------------------------------------------------------------------------------------------
# probes


def muon_bindings(t: Tree) -> tuple[str, ...]:
    """ZeRO modules that bind ``muon_update`` at import (a module-level ``from ... import muon_update``),
    so replacing ``original_muon.muon_update`` does not reach their calls."""
    out = []
    for rel, mod in ((STAGE12[0], "deepspeed.runtime.zero.stage_1_and_2"),
                     (STAGE3[0], "deepspeed.runtime.zero.stage3")):
        tree = t.module(rel)
        if tree is None:
            raise Undecided("muon_bindings", f"no {rel}")
        if any(isinstance(n, ast.ImportFrom) and any(a.name == "muon_update" for a in n.names) for n in tree.body):
            out.append(mod)
    return tuple(out)


def z3_partition_group(t: Tree) -> str:
    """"method" where ZeRO-3 has ``_get_param_partition_group``, else "attribute" (``p.ds_process_group``)."""
    if t.cls(*STAGE3) is None:
        raise Undecided("z3_partition_group", f"no class {STAGE3[1]} in {STAGE3[0]}")
    return "method" if t.method(STAGE3, "_get_param_partition_group") else "attribute"


def group_names(t: Tree) -> str:
    """"name" where the engine builds its optimizer groups with a ``name`` beside ``use_muon``
    (``dict(params=..., use_muon=..., name=...)``), else "use_muon" (groups told apart by their flag)."""
    mod = t.module(ENGINE[0])
    if mod is None:
        raise Undecided("group_names", f"no {ENGINE[0]}")
    named = any(isinstance(n, ast.Call) and {"use_muon", "name"} <= {k.arg for k in n.keywords}
                for n in ast.walk(mod))
    return "name" if named else "use_muon"


def bf16_grad_index(t: Tree) -> str:
    """"attribute" where BF16_Optimizer sets each parameter's ``_index_in_param_group`` to its place in the
    group, else "group_position" (the capture counts the place itself)."""
    mod = t.module(BF16_OPT[0])
    if mod is None:
        raise Undecided("bf16_grad_index", f"no {BF16_OPT[0]}")
    sets = any(isinstance(n, (ast.Assign, ast.AugAssign)) and any(
        isinstance(x, ast.Attribute) and x.attr == "_index_in_param_group"
        for x in (n.targets if isinstance(n, ast.Assign) else [n.target])) for n in ast.walk(mod))
    return "attribute" if sets else "group_position"


def muon_grads_before_step(t: Tree) -> tuple[str, ...]:
    """Path kinds (``capture.PathInfo.kind``) where the tree steps Muon matrices without ``muon_update``:
    stage 0 when ``MuonWithAuxAdam.step`` calls none, the BF16_Optimizer route when that class calls none."""
    if t.cls(*MUON_OPT) is None:
        raise Undecided("muon_grads_before_step", f"no class {MUON_OPT[1]} in {MUON_OPT[0]}")
    kinds = []
    if "step" not in t.muon_callers(MUON_OPT):
        kinds += ["bf16_opt", "z0"]
    elif not t.muon_callers(BF16_OPT):
        kinds.append("bf16_opt")
    return tuple(sorted(set(kinds)))


def z3_muon_placement(t: Tree, offload: bool) -> str:
    """Where ZeRO-3 runs Muon: "reduce" (inside the gradient reduce, the matrices dealt out one per rank:
    ``_apply_distributed_muon_update``, once per micro-batch), "step" (in the optimizer step after
    accumulation: ``_muon_update_sub_group`` without offload, ``_apply_muon_updates_cpu_offload`` with
    it). A reduce function whose leading guard returns for this path does not count."""
    name = "z3_muon_placement(offload)" if offload else "z3_muon_placement(none)"
    callers = t.muon_callers(STAGE3)
    if t.cls(*STAGE3) is None:
        raise Undecided(name, f"no class {STAGE3[1]} in {STAGE3[0]}")
    if "_apply_distributed_muon_update" in callers:
        guard = _early_return_guard(t.method(STAGE3, "_apply_distributed_muon_update"))
        names = _attrs(guard) if guard is not None else set()
        negated = _negated_attrs(guard) if guard is not None else set()
        skips_offload = "offload_optimizer" in names and "offload_optimizer" not in negated
        skips_none = "offload_optimizer" in negated
        if not (skips_offload if offload else skips_none):
            return "reduce"
    step_fn = "_apply_muon_updates_cpu_offload" if offload else "_muon_update_sub_group"
    if step_fn in callers:
        return "step"
    raise Undecided(name, f"{STAGE3[0]} calls muon_update from {sorted(callers) or 'nothing'}, none of the "
                          f"shapes known for this path (_apply_distributed_muon_update in the reduce, {step_fn})")


def z12_offload_runs_muon(t: Tree) -> bool:
    """Whether ZeRO-1/2 with optimizer offload calls ``muon_update`` at all: only a method of its own
    (``_apply_muon_updates_cpu_offload``) does; ``get_flat_partition`` is not on the offload path."""
    if t.cls(*STAGE12) is None:
        raise Undecided("z12_offload_runs_muon", f"no class {STAGE12[1]} in {STAGE12[0]}")
    return "_apply_muon_updates_cpu_offload" in t.muon_callers(STAGE12)


def muon_update_params(t: Tree) -> dict[str, object]:
    """``muon_update``'s keyword parameters and their defaults (``ast.literal_eval``; None where not a literal)."""
    fn = t.function(MUON_FN, "muon_update")
    if fn is None:
        raise Undecided("muon_update_params", f"no function muon_update in {MUON_FN}")
    args = fn.args.args + fn.args.kwonlyargs
    defaults = [None] * (len(fn.args.args) - len(fn.args.defaults)) + list(fn.args.defaults) + list(fn.args.kw_defaults)
    out = {}
    for a, d in zip(args, defaults):
        try:
            out[a.arg] = ast.literal_eval(d) if d is not None else None
        except ValueError:
            out[a.arg] = None
    return out


def per_head_muon(t: Tree) -> bool:
    """Whether ``muon_update`` orthogonalises per head: it takes ``num_heads`` and does not refuse one
    (a leading ``if num_heads ...: raise``)."""
    fn = t.function(MUON_FN, "muon_update")
    if fn is None or "num_heads" not in muon_update_params(t):
        return False
    body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    refuses = bool(body) and isinstance(body[0], ast.If) and any(isinstance(s, ast.Raise) for s in body[0].body) \
        and "num_heads" in {n.id for n in ast.walk(body[0].test) if isinstance(n, ast.Name)}
    return not refuses


def ns_methods(t: Tree) -> tuple[str, ...]:
    """The Newton-Schulz iterations the tree has: "standard" always, "gram" where it defines one."""
    if t.module(MUON_FN) is None:
        raise Undecided("ns_methods", f"no {MUON_FN}")
    return ("gram", "standard") if t.function(MUON_FN, "zeropower_via_gram_newtonschulz") else ("standard",)


def default_ns_method(t: Tree) -> str:
    """What a Muon group without ``ns_method`` runs: ``muon_update``'s default, "standard" where it has none."""
    params = muon_update_params(t)
    return str(params["ns_method"]) if params.get("ns_method") else "standard"


def ns_compute_dtype_hook(t: Tree) -> bool:
    """Whether the Newton-Schulz compute dtype is looked up through ``ns_compute_dtype`` at call time."""
    return t.function(MUON_FN, "ns_compute_dtype") is not None


# The gram and standard iterations of 0.19.8, as ``ast.dump`` hashes: the oracle's bit-exact 16-bit
# emulation (``oracles.emulate``) follows exactly that operation order, so only a tree whose two
# functions are the same code is judged in ``emulated`` mode; any other is judged in ``exact`` mode
# (float64 Newton-Schulz with the derived 16-bit tolerance), which holds for every operation order.
EMULATED_NS = {"zeropower_via_gram_newtonschulz": "4cd73007a91cbc15", "zeropower_via_newtonschulz5": "f38b45c935ab4ed5"}


def code_hash(t: Tree, rel: str, name: str) -> str | None:
    """A module-level function's code as a hash of its tokens (comments, docstring layout and blank lines
    left out, so the hash is the same on every Python that parses it)."""
    fn = t.function(rel, name)
    if fn is None:
        return None
    text = "\n".join((t.root / rel).read_text().splitlines()[fn.lineno - 1:fn.end_lineno])
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT}
    toks = [tok.string for tok in tokenize.generate_tokens(io.StringIO(textwrap.dedent(text) + "\n").readline)
            if tok.type not in skip]
    return hashlib.sha256("\x00".join(toks).encode()).hexdigest()[:16]


def ns_order_emulated(t: Tree) -> bool:
    return all(code_hash(t, MUON_FN, n) == h for n, h in EMULATED_NS.items())


def zero_config_fields(t: Tree) -> frozenset[str]:
    """The keys ``zero_optimization`` accepts by field name (``DeepSpeedZeroConfig``'s annotated fields)."""
    c = t.cls(*ZERO_CONFIG)
    if c is None:
        raise Undecided("zero_config_fields", f"no class {ZERO_CONFIG[1]} in {ZERO_CONFIG[0]}")
    return frozenset(n.target.id for n in c.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name))


def muon_allgather_cache(t: Tree, stage: int) -> bool:
    """Whether the stage's optimizer keeps a bounded cache of Muon all-gather buffers."""
    where = STAGE3 if stage == 3 else STAGE12
    init = t.method(where, "__init__")
    return init is not None and "_muon_allgather_buffers" in _attrs(init)


def managed_gradient_accumulation(t: Tree) -> bool:
    return t.says("runtime/constants.py", "managed_gradient_accumulation")


def takes_group_dicts(t: Tree) -> bool:
    """Whether the engine's optimizer set-up handles param-group dicts among ``model_parameters``
    (a per-group split, ``_muon_param_groups``, or an ``isinstance(item, dict)`` in
    ``_configure_basic_optimizer``) rather than reading ``p.use_muon`` of every item, which raises for a dict."""
    fn = t.method(ENGINE, "_configure_basic_optimizer")
    if fn is None:
        raise Undecided("takes_group_dicts", f"no {ENGINE[1]}._configure_basic_optimizer in {ENGINE[0]}")
    checks_dict = any(isinstance(n, ast.Call) and getattr(n.func, "id", None) == "isinstance" and len(n.args) == 2
                      and getattr(n.args[1], "id", None) == "dict" for n in ast.walk(fn))
    return t.method(ENGINE, "_muon_param_groups") is not None or checks_dict


def muon_tag_reads_layer_shape(t: Tree) -> bool:
    """Whether ``set_optimizer_flags`` tags Muon parameters by their layer's shape (``ds_shape``, which
    survives ``zero.Init``) rather than by ``p.ndim``, which ``zero.Init`` has made 1-D (DSM-116)."""
    fn = t.function("__init__.py", "set_optimizer_flags")
    if fn is None:
        raise Undecided("muon_tag_reads_layer_shape", "no set_optimizer_flags in deepspeed/__init__.py")
    return "ds_shape" in _attrs(fn) or any(isinstance(n, ast.Constant) and n.value == "ds_shape"
                                          for n in ast.walk(fn)) or _calls(fn, "_layer_shape")


def groups_flattened(t: Tree) -> bool:
    """Whether the engine merges the user's param groups into one Muon and one Adam group: it takes
    group dicts but has no per-group split (``_muon_param_groups``)."""
    return takes_group_dicts(t) and t.method(ENGINE, "_muon_param_groups") is None


# A tree's own refusal texts (the messages it raises), by what they refuse.
REFUSAL_TEXTS = {
    "refuses_reduce_scatter_with_offload": (STAGE12[0], "Muon with reduce scatter does not support optimizer offload"),
    "refuses_bf16_optimizer_route": (ENGINE[0], "Muon cannot be used with the BF16_Optimizer"),
    "refuses_unmanaged_with_offload": (ENGINE[0], "is not supported with ZeRO optimizer state offload"),
}


# ------------------------------------------------------------------------------------------------
# the installed tree


def package_dir() -> Path:
    """The ``deepspeed`` package this interpreter would import (found, not imported)."""
    spec = importlib.util.find_spec("deepspeed")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("DeepSpeed is not installed in this interpreter")
    return Path(next(iter(spec.submodule_search_locations))).resolve()


@functools.cache
def installed() -> Tree:
    return Tree(package_dir())


PROBES = {
    "muon_bindings": muon_bindings,
    "z3_partition_group": z3_partition_group,
    "group_names": group_names,
    "bf16_grad_index": bf16_grad_index,
    "muon_grads_before_step": muon_grads_before_step,
    "z3_muon_placement(none)": lambda t: z3_muon_placement(t, False),
    "z3_muon_placement(offload)": lambda t: z3_muon_placement(t, True),
    "z12_offload_runs_muon": z12_offload_runs_muon,
    "per_head_muon": per_head_muon,
    "muon_update_params": muon_update_params,
    "ns_methods": ns_methods,
    "default_ns_method": default_ns_method,
    "ns_compute_dtype_hook": ns_compute_dtype_hook,
    "ns_order_emulated": ns_order_emulated,
    "muon_allgather_cache(z12)": lambda t: muon_allgather_cache(t, 1),
    "muon_allgather_cache(z3)": lambda t: muon_allgather_cache(t, 3),
    "managed_gradient_accumulation": managed_gradient_accumulation,
    "zero_config_fields": zero_config_fields,
    "takes_group_dicts": takes_group_dicts,
    "groups_flattened": groups_flattened,
    "muon_tag_reads_layer_shape": muon_tag_reads_layer_shape,
    **{k: (lambda t, rel=rel, frag=frag: t.says(rel, frag)) for k, (rel, frag) in REFUSAL_TEXTS.items()},
}


@dataclass(frozen=True)
class Capabilities:
    """Every probe's answer for one tree; an undecided probe raises ``Undecided`` when asked."""

    root: str
    answers: dict

    def __getitem__(self, name: str):
        v = self.answers[name]
        if isinstance(v, Undecided):
            raise v
        return v

    def undecided(self) -> dict[str, str]:
        return {k: v.why for k, v in self.answers.items() if isinstance(v, Undecided)}


def probe_all(t: Tree) -> Capabilities:
    answers = {}
    for name, fn in PROBES.items():
        try:
            answers[name] = fn(t)
        except Undecided as exc:
            answers[name] = exc
    return Capabilities(str(t.root), answers)


@functools.cache
def capabilities(root: str | None = None) -> Capabilities:
    """The probes of the tree at ``root`` (a ``deepspeed`` package folder; default: the installed one)."""
    return probe_all(Tree(Path(root)) if root else installed())


def package_of(path: str) -> str:
    """A source checkout's root or its ``deepspeed`` package folder -> the package folder."""
    p = Path(path).resolve()
    return str(p / "deepspeed") if (p / "deepspeed" / "runtime").is_dir() else str(p)


if __name__ == "__main__":
    caps = capabilities(package_of(sys.argv[1]) if len(sys.argv) > 1 else None)
    print(f"DeepSpeed tree {caps.root}")
    for k, v in caps.answers.items():
        shown = f"UNDECIDED: {v.why}" if isinstance(v, Undecided) else (sorted(v) if isinstance(v, frozenset) else v)
        print(f"  {k:38s} {shown}")
