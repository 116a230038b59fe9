"""The one list of DeepSpeed 0.19.8 code that decides a Muon step, and its line ranges.

Why by function and not by file: ``stage3.py`` and ``stage_1_and_2.py`` are mostly code Muon never
touches (parameter fetching, hooks, bucketing for Adam-only models); mutating all of it would count
survivors that say nothing about Muon and dilute the score. Each entry names one function by its
qualified name; its line range is resolved from the AST of the installed source, so the list does
not rot when a line number moves, and an entry that no longer resolves is an error, not a silent gap.

``part="muon"`` keeps only the statements of a long function that mention Muon (constructors of
hundreds of lines whose Muon part is a dozen statements): every line of a simple statement whose
text mentions ``muon``, and the header line of a compound statement whose header does. The rest of
such a function is plumbing for every optimizer, which other tests of DeepSpeed own.

Standard library only: the mutation engine's own virtual environment imports this module too.
"""
from __future__ import annotations

import ast
import functools
import os
from dataclasses import dataclass
from pathlib import Path

# The DeepSpeed package folder of another tree (``mutate --engine cosmic-ray --tree``): set by the driver, read
# by every process of the run (session builder, workers, zygote), so that they all scope that tree's code.
TREE_ENV = "MUON_MUTATION_TREE"


@dataclass(frozen=True)
class Scoped:
    file: str  # relative to the deepspeed package folder
    qualname: str  # Class.method or function
    part: str = "all"  # "all" or "muon" (only the statements that mention Muon)
    why: str = ""


_S12 = "runtime/zero/stage_1_and_2.py"
_S3 = "runtime/zero/stage3.py"
_ENG = "runtime/engine.py"
_BF16 = "runtime/bf16_optimizer.py"
_OM = "runtime/zero/muon/original_muon.py"
_MO = "runtime/zero/muon/muon_optimizer.py"
_PSW = "runtime/swap_tensor/partitioned_optimizer_swapper.py"
_PIPE = "runtime/swap_tensor/pipelined_optimizer_swapper.py"

SCOPE: tuple[Scoped, ...] = (
    # muon_update, the Newton-Schulz iterations and the optimizers built on them
    Scoped(_OM, "ns_compute_dtype", why="the Newton-Schulz compute dtype"),
    Scoped(_OM, "zeropower_via_newtonschulz5", why="standard quintic Newton-Schulz"),
    Scoped(_OM, "zeropower_via_gram_newtonschulz", why="gram Newton-Schulz"),
    Scoped(_OM, "_aspect_ratio_scale"),
    Scoped(_OM, "_per_head_orthogonalize"),
    Scoped(_OM, "muon_update"),
    Scoped(_OM, "adam_update", why="the auxiliary Adam of MuonWithAuxAdam"),
    Scoped(_OM, "MuonWithAuxAdam.__init__"),
    Scoped(_OM, "MuonWithAuxAdam.step"),
    Scoped(_MO, "MuonWithAuxAdam.__init__"),
    Scoped(_MO, "MuonWithAuxAdam.load_state_dict", why="checkpoint state"),
    Scoped(_MO, "MuonWithAuxAdam.step"),
    # optimizer flags (which parameters are Muon) in deepspeed/__init__.py
    Scoped("__init__.py", "_per_head_muon_meta"),
    Scoped("__init__.py", "_attention_head_count"),
    Scoped("__init__.py", "set_optimizer_flags"),
    Scoped("__init__.py", "resolve_per_head_muon_after_sharding"),
    # the engine's group handling
    Scoped(_ENG, "DeepSpeedEngine.__init__", "muon"),
    Scoped(_ENG, "DeepSpeedEngine.zero_save_muon_momentum_buffer_in_memory"),
    Scoped(_ENG, "DeepSpeedEngine.get_optimizer_configuration"),
    Scoped(_ENG, "DeepSpeedEngine._muon_half_defaults"),
    Scoped(_ENG, "DeepSpeedEngine._muon_param_groups"),
    Scoped(_ENG, "DeepSpeedEngine._configure_basic_optimizer"),
    Scoped(_ENG, "DeepSpeedEngine._configure_zero_optimizer", "muon"),
    # ZeRO-1/2: momentum, gather/scatter, padding, offload, clipping norm, loss scaling
    Scoped(_S12, "DeepSpeedZeroOptimizer.__init__", "muon"),
    Scoped(_S12, "DeepSpeedZeroOptimizer._use_compact_grad_partition_buffer"),
    Scoped(_S12, "DeepSpeedZeroOptimizer.average_tensor", "muon"),
    Scoped(_S12, "DeepSpeedZeroOptimizer._muon_all_gather_partitions"),
    Scoped(_S12, "DeepSpeedZeroOptimizer._muon_param_batches"),
    Scoped(_S12, "DeepSpeedZeroOptimizer._apply_muon_updates_cpu_offload"),
    Scoped(_S12, "DeepSpeedZeroOptimizer.get_flat_partition"),
    Scoped(_S12, "DeepSpeedZeroOptimizer._is_muon_group"),
    Scoped(_S12, "DeepSpeedZeroOptimizer._muon_update_lacks_loss_scale"),
    Scoped(_S12, "DeepSpeedZeroOptimizer._muon_momentum_buffer"),
    Scoped(_S12, "DeepSpeedZeroOptimizer._get_flat_partition_unpadded"),
    Scoped(_S12, "DeepSpeedZeroOptimizer.scaled_global_norm"),
    Scoped(_S12, "DeepSpeedZeroOptimizer._muon_staging_momentum"),
    Scoped(_S12, "DeepSpeedZeroOptimizer._commit_muon_momentum"),
    Scoped(_S12, "DeepSpeedZeroOptimizer.step"),
    # ZeRO-3: the same, per sub-group, with the NVMe swapper
    Scoped(_S3, "DeepSpeedZeroOptimizer_Stage3.__init__", "muon"),
    Scoped(_S3, "DeepSpeedZeroOptimizer_Stage3._create_fp16_partitions_with_defragmentation", "muon"),
    Scoped(_S3, "DeepSpeedZeroOptimizer_Stage3._create_momentum_buffer"),
    Scoped(_S3, "DeepSpeedZeroOptimizer_Stage3._create_fp32_partitions", "muon"),
    Scoped(_S3, "DeepSpeedZeroOptimizer_Stage3._optimizer_step"),
    Scoped(_S3, "DeepSpeedZeroOptimizer_Stage3.initialize_optimizer_states", "muon"),
    Scoped(_S3, "DeepSpeedZeroOptimizer_Stage3._muon_update_sub_group"),
    Scoped(_S3, "DeepSpeedZeroOptimizer_Stage3._apply_muon_to_accumulated_grads"),
    Scoped(_S3, "DeepSpeedZeroOptimizer_Stage3._partitioned_buffers_all_gather", "muon"),
    Scoped(_S3, "DeepSpeedZeroOptimizer_Stage3._muon_update_lacks_loss_scale"),
    Scoped(_S3, "DeepSpeedZeroOptimizer_Stage3._get_norm_groups"),
    Scoped(_S3, "DeepSpeedZeroOptimizer_Stage3._apply_muon_updates_cpu_offload"),
    Scoped(_S3, "DeepSpeedZeroOptimizer_Stage3.step"),
    # the BF16_Optimizer route
    Scoped(_BF16, "BF16_Optimizer._build_muon_exchange_layout"),
    Scoped(_BF16, "BF16_Optimizer._prepare_muon_updates"),
    Scoped(_BF16, "BF16_Optimizer.step", "muon"),
    # the swapper code the ZeRO-3 Muon path calls (momentum swap-in/out)
    Scoped(_PSW, "PartitionedOptimizerSwapper.swap_in_optimizer_state"),
    Scoped(_PSW, "PartitionedOptimizerSwapper.swap_out_optimizer_state"),
    Scoped(_PIPE, "PipelinedOptimizerSwapper.swap_in_optimizer_state"),
    Scoped(_PIPE, "PipelinedOptimizerSwapper.swap_out_optimizer_state"),
)


# Functions of 0.19.8's files that the rule of ``for_tree`` would take and the list above leaves out: the
# same judgement then holds on another tree (``for_tree`` of 0.19.8 is the list above, a test says so).
LEFT_OUT: dict[str, str] = {
    f"{_OM}:Muon.step": "the upstream distributed Muon class: DeepSpeed never builds it",
    f"{_OM}:SingleDeviceMuon.step": "the upstream single-device Muon class: DeepSpeed never builds it",
    f"{_OM}:SingleDeviceMuonWithAuxAdam.__init__": "the upstream single-device class: DeepSpeed never builds it",
    f"{_OM}:SingleDeviceMuonWithAuxAdam.step": "the upstream single-device class: DeepSpeed never builds it",
    f"{_S3}:DeepSpeedZeroOptimizer_Stage3.destroy": "teardown: frees buffers after the last step",
    f"{_S3}:DeepSpeedZeroOptimizer_Stage3._clear_muon_allgather_buffers": "teardown: frees the gather cache",
    f"{_S12}:DeepSpeedZeroOptimizer.destroy": "teardown: frees buffers after the last step",
    f"{_S12}:DeepSpeedZeroOptimizer._clear_muon_allgather_buffers": "teardown: frees the gather cache",
    f"{_BF16}:BF16_Optimizer.__init__": "the BF16_Optimizer's Muon refusals and layout list; the layout "
                                        "itself (_build_muon_exchange_layout) is listed",
    f"{_BF16}:BF16_Optimizer._setup_for_real_optimizer": "the same constructor code, split out",
    "__init__.py:_report_per_head_tagging": "a log line and a refusal of per_head_muon that tagged nothing",
}


# Why the candidate cases never execute a scoped function (the report prints it beside the function).
NOT_REACHED_WHY = {
    "__init__.py:_per_head_muon_meta": "per-head tagging from an HF model.config (optimizer param per_head_muon): "
                                       "only the *-dsheads cases take DeepSpeed's own route (harness.rank.ds_run."
                                       "head_config); every other case sets muon_num_heads itself",
    "__init__.py:_attention_head_count": "no caller in DeepSpeed 0.19.8: set_optimizer_flags calls "
                                         "_resolve_attention_head_count directly (__init__.py:376)",
    "__init__.py:resolve_per_head_muon_after_sharding": "called only under AutoTP tensor parallelism "
                                                        "(engine.py:595-604, autotp_size > 1): only the *-autotp "
                                                        "cases (harness.rank.tp_case) run it",
    "runtime/zero/muon/original_muon.py:MuonWithAuxAdam.step": "the base class's step: DeepSpeed's own "
                                                               "MuonWithAuxAdam (muon_optimizer.py) overrides it",
    "runtime/zero/muon/original_muon.py:adam_update": "called only by the overridden base-class step",
}


@dataclass(frozen=True)
class Resolved:
    """One scoped function in one source: the lines whose mutants count, and its whole extent."""
    entry: Scoped
    first: int  # the def line (1-based, decorators excluded)
    last: int
    body_first: int  # the first line of the body: lines first..body_first-1 are the signature
    lines: frozenset[int]  # the lines whose mutants are in scope
    # (first, last) lines of each statement head inside the body that spans several lines (a condition or
    # call continued over lines): line coverage marks only the lines it evaluated, so a test whose second
    # operand short-circuited leaves its continuation line unexecuted although a mutant there matters
    heads: tuple[tuple[int, int], ...] = ()

    @property
    def name(self) -> str:
        return f"{self.entry.file}:{self.entry.qualname}"


class ScopeError(LookupError):
    pass


def _find(tree: ast.Module, qualname: str):
    node = tree
    for part in qualname.split("."):
        hit = [n for n in ast.iter_child_nodes(node)
               if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name == part]
        if not hit:
            return None
        node = hit[-1]  # a later definition shadows an earlier one, as at run time
    return node if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None


def _muon_lines(fn, lines: list[str]) -> set[int]:
    out: set[int] = set()
    for node in ast.walk(fn):
        if not isinstance(node, ast.stmt) or node is fn:
            continue
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.stmt):
            # a compound statement: its header only (the lines before its first body statement)
            span = range(node.lineno, body[0].lineno)
        else:
            span = range(node.lineno, (node.end_lineno or node.lineno) + 1)
        if any("muon" in lines[i - 1].lower() for i in span):
            out.update(span)
    return out


def resolve_file(ds_root: Path, rel: str, entries) -> list[Resolved]:
    text = (Path(ds_root) / rel).read_text()
    tree = ast.parse(text)
    lines = text.splitlines()
    out = []
    for e in entries:
        fn = _find(tree, e.qualname)
        if fn is None:
            raise ScopeError(f"{rel}: no function {e.qualname!r} (harness/selfcheck/source_mutation/scope.py is stale "
                             f"for this DeepSpeed)")
        last = fn.end_lineno or fn.lineno
        body_first = fn.body[0].lineno
        if isinstance(fn.body[0], ast.Expr) and isinstance(getattr(fn.body[0], "value", None), ast.Constant):
            body_first = fn.body[1].lineno if len(fn.body) > 1 else last + 1  # skip the docstring
        if e.part == "all":
            sel = set(range(fn.lineno, last + 1))
        elif e.part == "muon":
            sel = _muon_lines(fn, lines)
        else:
            raise ScopeError(f"{e.qualname}: unknown part {e.part!r}")
        # never a docstring or a comment-only line: no mutation operator applies there anyway
        out.append(Resolved(e, fn.lineno, last, body_first, frozenset(sel), _multiline_heads(fn)))
    return out


def _multiline_heads(fn) -> tuple[tuple[int, int], ...]:
    """The statements of ``fn``'s body whose head (a simple statement whole; a compound one up to its
    body) spans several lines."""
    out = []
    for node in ast.walk(fn):
        if node is fn or not isinstance(node, ast.stmt):
            continue
        body = getattr(node, "body", None)
        end = body[0].lineno - 1 if isinstance(body, list) and body and isinstance(body[0], ast.stmt) else (
            node.end_lineno or node.lineno)
        if end > node.lineno:
            out.append((node.lineno, end))
    return tuple(sorted(out))


def resolve(ds_root: Path, scope=None) -> list[Resolved]:
    """Every scoped function of the DeepSpeed package at ``ds_root`` with its lines (default: the active scope)."""
    scope = active() if scope is None else scope
    by_file: dict[str, list[Scoped]] = {}
    for e in scope:
        by_file.setdefault(e.file, []).append(e)
    out: list[Resolved] = []
    for rel, entries in by_file.items():
        out.extend(resolve_file(ds_root, rel, entries))
    return out


def owner(resolved: list[Resolved], rel: str, line: int) -> Resolved | None:
    """The scoped function whose selected lines hold ``line`` of file ``rel`` (None: out of scope)."""
    for r in resolved:
        if r.entry.file == rel and line in r.lines:
            return r
    return None


def files(scope=None) -> list[str]:
    return sorted({e.file for e in (active() if scope is None else scope)})


def active() -> tuple[Scoped, ...]:
    """The scope of this run: 0.19.8's list, or the one derived for the tree ``TREE_ENV`` names."""
    root = os.environ.get(TREE_ENV)
    return for_tree(str(Path(root).resolve())) if root else SCOPE


def _defs(node, prefix: str = ""):
    """(qualified name, node) of every function of a module and of its classes, nested functions excluded."""
    for n in ast.iter_child_nodes(node):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + n.name, n
        elif isinstance(n, ast.ClassDef):
            yield from _defs(n, prefix + n.name + ".")


def _calls_muon_update(fn) -> bool:
    return any(isinstance(c, ast.Call) and "muon_update" in (getattr(c.func, "id", None), getattr(c.func, "attr", None))
               for c in ast.walk(fn))


@functools.cache
def for_tree(ds_root: str) -> tuple[Scoped, ...]:
    """The Muon code of a DeepSpeed tree the list above was not written for (a pull request on an older base):
    why derived and not hand-listed: a hand list written after seeing the tree's code is a list tuned on it,
    and its figure would no longer be a first run. In 0.19.8's files, from the tree's own AST: every entry of
    ``SCOPE`` the tree still defines (with its part); every other function whose name says Muon or that calls
    ``muon_update``, whole; every other function whose text mentions Muon, its Muon statements only; none of
    ``LEFT_OUT``. A function the tree defines twice counts once (the later definition, as ``_find`` resolves it)."""
    root = Path(ds_root)
    out: list[Scoped] = []
    for rel in files(SCOPE):
        path = root / rel
        if not path.is_file():
            continue
        text = path.read_text()
        tree = ast.parse(text)
        lines = text.splitlines()
        listed = {e.qualname: e for e in SCOPE if e.file == rel and _find(tree, e.qualname) is not None}
        seen: set[str] = set()
        for qual, fn in _defs(tree):
            if qual in seen:
                continue
            seen.add(qual)
            if qual in listed:
                out.append(listed[qual])
            elif f"{rel}:{qual}" in LEFT_OUT:
                continue
            elif "muon" in fn.name.lower() or _calls_muon_update(fn):
                out.append(Scoped(rel, qual, "all", why="tree: named for Muon or calls muon_update"))
            elif _muon_lines(fn, lines):
                out.append(Scoped(rel, qual, "muon", why="tree: mentions Muon"))
    return tuple(out)
