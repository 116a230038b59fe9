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
import re
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
SWAP_PART = ("runtime/swap_tensor/partitioned_optimizer_swapper.py", "PartitionedOptimizerSwapper")
SWAP_PIPE = ("runtime/swap_tensor/pipelined_optimizer_swapper.py", "PipelinedOptimizerSwapper")
SWAP_INFO = ("runtime/swap_tensor/optimizer_utils.py", "OptimizerStateSwapInfo")
# the CPU build of FusedAdam, as an sdist or checkout holds it (beside the package) or a wheel (under ops/)
CPU_FUSED_ADAM = ("ops/csrc/cpu/adam/fused_adam.cpp", "../csrc/cpu/adam/fused_adam.cpp")
_KNOWN_FILES = (STAGE3[0], STAGE12[0], MUON_OPT[0], BF16_OPT[0], ENGINE[0], MUON_FN, ZERO_CONFIG[0], PACKAGE_INIT,
                SWAP_PART[0], SWAP_PIPE[0], SWAP_INFO[0])


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


def muon_allgather_entry(t: Tree, stage: int) -> tuple[int, int] | None:
    """How the stage's Muon all-gather cache stores an entry: (its length, the index of its byte count), read
    where the optimizer stores a tuple into ``_muon_allgather_buffers`` and adds one of the tuple's names to
    ``_muon_allgather_buffer_bytes`` (0.19.8: ``(local, gathered, bytes)``; DeepSpeed PR #8464's ZeRO-3:
    ``(local, reduce, rearrange, bytes)``). The gather watch (``harness.rank.gather_cache``) sums the bytes
    there, so a tree that stores entries another way must not be read with another tree's index. None: no
    cache; undecided: entries stored in no shape this reads (the gather cases are then deselected)."""
    name = f"muon_allgather_entry({'z3' if stage == 3 else 'z12'})"
    if not muon_allgather_cache(t, stage):
        return None
    where = STAGE3 if stage == 3 else STAGE12
    layouts = set()
    for fn in (n for n in t.cls(*where).body if isinstance(n, ast.FunctionDef)):
        counted = {n.value.id for n in ast.walk(fn) if isinstance(n, ast.AugAssign) and isinstance(n.op, ast.Add)
                   and isinstance(n.target, ast.Attribute) and n.target.attr == "_muon_allgather_buffer_bytes"
                   and isinstance(n.value, ast.Name)}
        for n in ast.walk(fn):
            if isinstance(n, ast.Assign) and isinstance(n.value, ast.Tuple) and any(
                    isinstance(x, ast.Subscript) and isinstance(x.value, ast.Attribute)
                    and x.value.attr == "_muon_allgather_buffers" for x in n.targets):
                at = [i for i, e in enumerate(n.value.elts) if isinstance(e, ast.Name) and e.id in counted]
                layouts.add((len(n.value.elts), at[0]) if len(at) == 1 else None)
    if len(layouts) != 1 or None in layouts:
        raise Undecided(name, f"{where[0]} stores its Muon all-gather cache entries in no shape the probe reads "
                              f"(a tuple into _muon_allgather_buffers[...] whose one name is added to "
                              f"_muon_allgather_buffer_bytes): {sorted(layouts, key=str) or 'none found'}")
    return layouts.pop()


def muon_allgather_chunked(t: Tree) -> bool:
    """Whether ZeRO-1/2's Muon gather (``_muon_all_gather_partitions``) issues its all-gather inside a loop, one
    per chunk of at most ``_muon_allgather_max_buffer_bytes`` (0.19.8), rather than once for the whole batch
    (DeepSpeed PR #8464's rebuilt file). The chunked-gather cases' buffer and cache sizes are chosen for chunks
    (``harness.catalog.matrix.GATHER_CAPS``); on a tree that gathers in one call they claim what it lacks."""
    fn = t.method(STAGE12, "_muon_all_gather_partitions")
    if fn is None:
        return False
    return any(_calls(loop, "all_gather_into_tensor") or _calls(loop, "all_gather")
               for loop in ast.walk(fn) if isinstance(loop, (ast.For, ast.While)))


# ------------------------------------------------------------------------------------------------
# the order of calls a step makes (for the loss-scale update against Muon)

_SCALE_UPDATES = frozenset({"_update_scale", "update_scale"})
_WALK_DEPTH = 6


def _called_name(call: ast.Call) -> str | None:
    return getattr(call.func, "attr", None) or getattr(call.func, "id", None)


def _calls_in_order(node: ast.AST) -> list[ast.Call]:
    return sorted((n for n in ast.walk(node) if isinstance(n, ast.Call)), key=lambda n: (n.lineno, n.col_offset))


def _truth(test: ast.expr, bound: dict) -> bool | None:
    """The value of an ``if`` test from ``bound`` (a parameter's name, or ``self.<attr>``); None: not known."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        v = _truth(test.operand, bound)
        return None if v is None else not v
    key = test.id if isinstance(test, ast.Name) else (
        f"self.{test.attr}" if isinstance(test, ast.Attribute) and getattr(test.value, "id", None) == "self" else None)
    if key in bound:
        return bool(bound[key])
    if isinstance(test, ast.BoolOp):
        vals = [_truth(v, bound) for v in test.values]
        stop = isinstance(test.op, ast.Or)  # the value that decides an ``or`` (True) or an ``and`` (False)
        if stop in vals:
            return stop
        if all(v is (not stop) for v in vals):
            return not stop
    return None


def _walk_calls(stmts: list, bound: dict):
    """The calls a block makes, in source order: an ``if`` whose test ``bound`` decides takes its one branch,
    and a taken branch that returns ends the block; nested definitions are left out (they run when called)."""
    for s in stmts:
        if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        if isinstance(s, ast.If):
            yield from _calls_in_order(s.test)
            taken = _truth(s.test, bound)
            branch = s.body if taken else s.orelse
            for block in ([s.body, s.orelse] if taken is None else [branch]):
                yield from _walk_calls(block, bound)
            if taken is not None and branch and isinstance(branch[-1], (ast.Return, ast.Raise)):
                return
            continue
        blocks = [getattr(s, f, None) or [] for f in ("body", "orelse", "finalbody")]
        blocks += [h.body for h in getattr(s, "handlers", [])]
        if any(blocks):
            for head in (getattr(s, "iter", None), getattr(s, "test", None), *getattr(s, "items", [])):
                if head is not None:
                    yield from _calls_in_order(head)
            for block in blocks:
                yield from _walk_calls(block, bound)
            continue
        yield from _calls_in_order(s)
        if isinstance(s, (ast.Return, ast.Raise)):
            return


def _bound_args(fn: ast.FunctionDef, call: ast.Call) -> dict:
    """The parameters of ``fn`` a call binds to constants (its literal arguments, else the literal defaults)."""
    names = [a.arg for a in fn.args.args]
    out = {n: d.value for n, d in zip(names[len(names) - len(fn.args.defaults):], fn.args.defaults)
           if isinstance(d, ast.Constant)}
    given = list(zip(names[1:] if names[:1] == ["self"] else names, call.args))
    given += [(k.arg, k.value) for k in call.keywords if k.arg]
    for n, v in given:
        if isinstance(v, ast.Constant):
            out[n] = v.value
        else:
            out.pop(n, None)
    return out


def _events(t: Tree, where: tuple[str, str], fn: ast.FunctionDef, muon: frozenset, bound: dict, stack: tuple,
            memo: dict) -> tuple[str, ...]:
    """In source order, "scale" for each loss-scale update and "muon" for each call of a ``muon`` method that
    ``fn`` reaches through the class's own methods (``self.name(...)``)."""
    key = (fn.name, tuple(sorted(bound.items(), key=str)))
    if key in memo:
        return memo[key]
    out: list[str] = []
    for call in _walk_calls(fn.body, bound):
        name = _called_name(call)
        if name in _SCALE_UPDATES:
            out.append("scale")
        elif name in muon:
            out.append("muon")
        elif (isinstance(call.func, ast.Attribute) and getattr(call.func.value, "id", None) == "self"
              and name not in stack and len(stack) < _WALK_DEPTH):
            callee = t.method(where, name)
            if callee is not None:
                scope = {k: v for k, v in bound.items() if k.startswith("self.")} | _bound_args(callee, call)
                out += _events(t, where, callee, muon, scope, stack + (name,), memo)
    memo[key] = tuple(out)
    return memo[key]


def muon_after_scale_update(t: Tree, stage: int, offload: bool) -> bool:
    """Whether the stage's ``step`` on this path (optimizer offload or not) reaches the method that runs Muon on
    the unscaled gradient (it calls ``muon_update`` and reads ``loss_scale``) only after it has updated the loss
    scale (``_update_scale``): Muon then unscales by the new scale, and on a growth step reads half its gradient
    (DSM-003's variant: DeepSpeed PR #8464's ``_apply_muon_updates_cpu_offload``, after ``_update_scale`` on
    ZeRO-1/2 and from ``_get_norm_groups`` on ZeRO-3). Calls are followed through the class's own methods in
    source order; an ``if`` on the offload flag (``cpu_offload``, ``offload_optimizer``) or on a parameter the
    call binds to a constant takes its one branch (0.19.8's ``update_scale=False``)."""
    where = STAGE3 if stage == 3 else STAGE12
    name = f"muon_after_scale_update(z{3 if stage == 3 else 12},{'offload' if offload else 'none'})"
    c, step = t.cls(*where), t.method(where, "step")
    if c is None or step is None:
        raise Undecided(name, f"no {where[1]}.step in {where[0]}")
    muon = frozenset(f.name for f in c.body if isinstance(f, ast.FunctionDef) and _calls(f, "muon_update")
                     and "loss_scale" in _attrs(f))
    bound = {"self.cpu_offload": offload, "self.offload_optimizer": offload}
    order = _events(t, where, step, muon, bound, ("step",), {})
    return "muon" in order and "scale" in order and order.index("scale") < order.index("muon")


def aux_adam_takes_mode(t: Tree) -> bool:
    """Whether ``MuonWithAuxAdam`` takes ``adam_w_mode`` (0.19.6 on: it builds its auxiliary Adam, FusedAdam or
    the CPU Adam, in that mode). Before, its Adam is inline (``adam_update``) and decays decoupled on every
    path, offload included, whatever the config asks (DSM-124)."""
    if t.cls(*MUON_OPT) is None:
        raise Undecided("aux_adam_takes_mode", f"no class {MUON_OPT[1]} in {MUON_OPT[0]}")
    init = t.method(MUON_OPT, "__init__")
    return init is not None and "adam_w_mode" in {a.arg for a in init.args.args + init.args.kwonlyargs}


def cpu_fused_adam_one_mode(t: Tree) -> bool:
    """Whether the CPU build of FusedAdam (``csrc/cpu/adam/fused_adam.cpp``) steps every call with the one
    optimizer it made at first use (``ds_adam_step(0, ...)``), so its ``mode`` argument (AdamW or L2) is never
    read (before 0.19.6: DSM-124); 0.19.6 keeps one optimizer per mode (``ds_adam_step(optimizer_id, ...)``).
    Read as text: the file is C++, beside the package (an sdist, a checkout) or under ``ops/`` (a wheel)."""
    for rel in CPU_FUSED_ADAM:
        path = t.root / rel
        if path.is_file():
            text = path.read_text()
            if "ds_adam_step" not in text:
                raise Undecided("cpu_fused_adam_one_mode", f"{rel} calls no ds_adam_step")
            return re.search(r"ds_adam_step\(\s*0\s*,", text) is not None
    raise Undecided("cpu_fused_adam_one_mode", f"no {' or '.join(CPU_FUSED_ADAM)} under {t.root}")


def z12_buckets_by_type_string(t: Tree) -> bool:
    """Whether ZeRO-1/2's ``split_half_float_double`` buckets gradients by comparing ``t.type()`` with strings
    built from the accelerator's device name ("torch.cpu.FloatTensor", which no CPU tensor's ``type()`` is)
    rather than by dtype: without contiguous gradients ``buffered_reduce_fallback`` then all-reduces nothing on
    the CPU accelerator (DSM-115). A tree without the function buckets no other way this reads: False."""
    fn = t.function(STAGE12[0], "split_half_float_double")
    return fn is not None and any(isinstance(n, ast.Call) and _called_name(n) == "type" and not n.args
                                  for n in ast.walk(fn))


def muon_update_guards_nonfinite(t: Tree) -> bool:
    """Whether ``muon_update`` keeps a non-finite gradient out of the momentum (0.19.7 on: ``torch.isfinite``
    of the gradient picks the old momentum) rather than folding it in before the loss scaler skips the step
    (``momentum.lerp_`` unconditionally: DSM-118)."""
    fn = t.function(MUON_FN, "muon_update")
    if fn is None:
        raise Undecided("muon_update_guards_nonfinite", f"no function muon_update in {MUON_FN}")
    return _calls(fn, "isfinite")


def swap_gradient_views(t: Tree, pipelined: bool) -> bool:
    """Whether the NVMe optimizer swapper reads each swapped gradient into a view of the gradient buffer at the
    gradient's offset (``narrow(0, grad.offset, grad.length)``): the partitioned swapper in
    ``_swap_in_pinned_gradients``, the pipelined one through ``OptimizerStateSwapInfo.get_swap_gradient_buffers``
    from its ``_swap_in_optimizer_state``. An aio read into such a view at a nonzero offset moves nothing on the
    CPU build (DSM-021, DSM-022, DSM-024; DSM-123 where Muon's update is written back through it)."""
    if pipelined:
        reader = t.method(SWAP_PIPE, "_swap_in_optimizer_state")
        fn = t.method(SWAP_INFO, "get_swap_gradient_buffers")
        if reader is None or not _calls(reader, "get_swap_gradient_buffers"):
            return False
    else:
        fn = t.method(SWAP_PART, "_swap_in_pinned_gradients")
    return fn is not None and any(_called_name(n) == "narrow" and any(
        isinstance(a, ast.Attribute) and a.attr == "offset" for a in n.args)
        for n in ast.walk(fn) if isinstance(n, ast.Call))


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
    "muon_allgather_entry(z12)": lambda t: muon_allgather_entry(t, 1),
    "muon_allgather_entry(z3)": lambda t: muon_allgather_entry(t, 3),
    "muon_allgather_chunked(z12)": muon_allgather_chunked,
    **{f"muon_after_scale_update(z{12 if st == 1 else 3},{'offload' if off else 'none'})":
       (lambda t, st=st, off=off: muon_after_scale_update(t, st, off)) for st in (1, 3) for off in (False, True)},
    "aux_adam_takes_mode": aux_adam_takes_mode,
    "cpu_fused_adam_one_mode": cpu_fused_adam_one_mode,
    "z12_buckets_by_type_string": z12_buckets_by_type_string,
    "muon_update_guards_nonfinite": muon_update_guards_nonfinite,
    "swap_gradient_views(partitioned)": lambda t: swap_gradient_views(t, False),
    "swap_gradient_views(pipelined)": lambda t: swap_gradient_views(t, True),
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
