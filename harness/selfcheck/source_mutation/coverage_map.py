"""Record, once, which candidate gate cases execute each scoped line of the (unmutated) copy.

The ranks run coverage.py around the ordinary case entry (``COVERED_ENTRY``), measuring only the
scoped files of the copy; the parent judges each case with the gate's own decision
(``harness.gate.decide.evaluate``, stock column), so the map also says which cases are usable baselines
(passed, or an xfail that matched its bug model) and how long each took unmutated.

The candidate cases are the mutation self-check's kill cases (every stage, offload none/cpu, every
dtype, accumulation, clipping, per-head, checkpoint resume, stage 0, user groups, a schedule, the
BF16_Optimizer route, a real model under zero.Init) and the gate cases that reach what those do not:
NVMe with both swappers, in-memory ZeRO-3 momentum, overflow and growth, a padding layout of the sweep.
"""
from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

from harness.launch.launcher import DEFAULT_ENTRY
from harness.selfcheck.source_mutation import scope, workspace
from harness.selfcheck.source_mutation.selection import CaseInfo, CoverageMap

COVERAGE_DIR_ENV = "MUON_MUTATION_COVERAGE_DIR"
COVERED_ENTRY = "harness.selfcheck.source_mutation.coverage_map:run_case_covered"

# Gate cases added to the kill cases (harness.selfcheck.kill_matrix.default_kill_cases): names from
# harness.catalog.matrix.
EXTRA_GATE_CASES = (
    "z1-none-bf16-ws2-ga2-clip0.05-standard", "z3-cpu-bf16-ws2-heads", "z1-none-fp16-ws2-overflow",
    "z1-cpu-fp16-ws2-growth",  # harness.selfcheck.kill_matrix.STOCK_KILL_CASES
    "z1-nvme-part-fp32-ws2", "z2-nvme-part-fp32-ws2-clip0.05", "z3-nvme-part-fp32-ws2",
    "z3-nvme-pipe-fp16-ws2-standard", "z3-none-fp16-ws2-inmem", "z3-nvme-part-fp32-ws2-inmem",
    "sweep-z1-none-ws2-L0", "sweep-z3-none-ws2-L0-standard",
    "z1-none-bf16-ws2-ga2-clip0.05-gad32",  # the BF16_Optimizer route exchanges split matrices only at ws >= 2
    "z1-cpu-fp32-ws2-gather",  # each matrix in 4 all-gather chunks: offsets within a matrix past its first chunk
    "resnet-z0-none-fp32-ws2-standard",  # a 4-D Muon weight stepped by MuonWithAuxAdam itself (no ZeRO)
    "z2-none-fp16-ws2-nonorm-overflow",  # compute_grad_norm false: only check_overflow finds the overflow
    "z1-none-bf16-ws3-clip0.05-gad32",  # the BF16_Optimizer exchange: a matrix starting inside a middle partition
    "z3-none-fp32-ws3-manysmall",  # square Muon matrices (3x3) under gram Newton-Schulz
    "z1-none-fp32-ws2-tallheads",  # per-head blocks taller than wide: transposed and back
    "z1-none-fp32-ws2-defaults",  # no optimizer params: MuonWithAuxAdam's own defaults (momentum 0.95, ...)
    # managed_gradient_accumulation false: the reduction (stage 0/1) or finalize (2/3, offload) inside step()
    "z0-none-fp32-ws2-ga2-unmanaged", "z1-none-fp16-ws2-ga2-unmanaged", "z1-cpu-bf16-ws2-ga2-unmanaged",
    "z2-none-fp32-ws2-ga2-unmanaged", "z2-cpu-fp16-ws2-ga2-unmanaged", "z3-none-bf16-ws2-ga2-unmanaged",
    "z3-cpu-fp32-ws2-ga2-unmanaged",
    # a layer left out of step 2 (Case.unused): zero gradients at stage 0 and ZeRO-1/2, DSM-023 elsewhere
    "z0-none-fp32-ws2-skiplayer", "z1-none-fp32-ws2-skiplayer", "z1-cpu-fp32-ws2-skiplayer",
    "z2-none-fp32-ws2-skiplayer", "z2-cpu-fp32-ws2-skiplayer", "z3-none-fp32-ws2-skiplayer",
    "z3-cpu-fp32-ws2-skiplayer", "z1-cpu-fp32-ws2-ga2-unmanaged-skiplayer", "z2-cpu-fp32-ws2-ga2-unmanaged-skiplayer",
    "z3-nvme-part-fp32-ws2-skiplayer",
    # FusedAdam fails to build: Muon's inline Adam (muon_optimizer.py's fallback, original_muon.adam_update)
    "z0-none-fp32-ws2-inlineadam", "z1-none-bf16-ws2-ga2-inlineadam", "z2-none-fp16-ws2-inlineadam",
    "z3-none-fp32-ws2-wd-inlineadam", "z1-none-fp32-ws2-l2-inlineadam",
    "z1-none-fp32-ws2-knob-align", "z2-none-fp16-ws2-ga2-knob-align",  # parameter_alignment: padded get_flat_partition
    "moe-ep-z1-none-fp32-ws2-standard", "moe-ep-z3-cpu-fp32-ws2-standard",  # experts tagged is_expert_group
    # gate cases made candidates for the stock run's not-reached list: the chunked gather at one rank (ZeRO-1/2
    # offload), and ZeRO-2 offload with fp32 gradient accumulation under bf16 (the compact gradient buffer test)
    "z1-cpu-fp16-ws1", "z2-cpu-bf16-ws2-knob-gad32",
    "z2-cpu-fp32-ws2-square",  # an offload Muon partition past 256 elements (int identity no longer tracks ==)
    "z1-none-bf16-ws3-bitsplit-gad32",  # BF16_Optimizer: a split matrix only the split test's floor divisions find
    "z1-none-fp32-ws2-defaults-torchadam",  # ... with torch's AdamW as the auxiliary Adam (any weight decay applies)
    "z1-none-fp32-ws2-dsheads", "z3-none-fp32-ws2-dsheads",  # DeepSpeed's own per-head tagging (per_head_muon)
    "z0-none-fp32-ws2-conv3d",  # a 5-D Muon weight: only 4-D filters are reshaped to a matrix
    "z1-none-fp32-ws2-mom0.3",  # momentum below 0.5: 1 - beta and 1 % beta differ
    "resnet-z3-none-fp32-ws2-standard",  # ZeRO-3, no offload: muon_update with its default is_expert_group
    "z1-none-fp32-ws2-tinygrad", "z1-none-fp32-ws2-standard-tinygrad",  # update norms << the NS epsilon 1e-7
    "z3-none-fp32-ws2-rs-refused", "z3-none-fp32-ws2-qg-refused",  # configs DeepSpeed must refuse (registry.refusals)
    "z1-none-fp32-ws2-heads3d-refused", "z1-none-fp32-ws2-heads8by3-refused",  # per-head inputs it must refuse
    "z1-none-fp32-ws2-square",  # a 260 x 260 matrix and square head blocks: the gram kernel's square branch
    "z1-none-fp32-ws2-autotp", "z2-none-fp32-ws2-autotp",  # AutoTP shards: per-head counts re-resolved per shard
    "z1-none-fp32-ws2-autotp-linattn",  # a listed linear-attention module: its own head geometry, not the config's
    "z1-none-fp32-ws2-autotp-noheads",  # AutoTP without per_head_muon: nothing to re-resolve after sharding
    "z1-none-fp32-ws2-autotp-cut-refused",  # every shard cuts a head: DeepSpeed must refuse per-head Muon
    "z2-cpu-fp32-ws2-standard-heads",  # per-head Muon with standard Newton-Schulz: the per-head kernel choice
    "z2-none-fp32-ws2-adamw", "z1-none-fp32-ws2-client-adamw",  # not Muon: no parameter may take Muon's route
    "z1-cpu-fp32-ws2-oneelem",  # one rank holds a single element of a Muon matrix (offload share copy)
    "z1-none-bf16-ws2-oneelem-gad32",  # the same layout on the BF16_Optimizer route (its split-matrix test)
    "z1-none-fp16-ws2-scale2", "z3-cpu-fp16-ws2-scale2",  # fp16 at a loss scale of 2 (the Muon rescale's test)
    "z3-none-fp32-ws2-onematrix",  # one parameter per group (ZeRO-3 reads a group's first parameter)
    "sweep-z3-none-ws3-L1-clip0.05-standard",  # ZeRO-3's Muon deal with a last round of one matrix at 3 ranks
    "z1-none-fp32-ws2-autotp-gqa-cut",  # AutoTP: the first tagged projection dropped, a later one kept
    "z1-none-fp32-ws2-overflow",  # fp32 overflow: the invalid-norm test alone must skip the step
    "z3-cpu-fp32-ws2-groups", "z3-none-bf16-ws2-groups",  # two Muon param groups under ZeRO-3, offload and not
    "z3-none-fp32-ws2-betas-refused",  # ZeRO-3 must refuse Muon groups of different momentum
    "z3-none-fp32-ws2-betas-fall-refused",  # ... falling as well as rising (a "<" for "!=" refuses only rises)
    # some rank holds none of a group (ZeRO-1/2: all padding) or of a matrix (ZeRO-3: its share starts past it)
    "z1-none-fp32-ws4-emptyshare", "z2-cpu-fp32-ws4-emptyshare", "z3-none-fp32-ws4-emptyshare",
    "z3-cpu-fp32-ws4-emptyshare", "z1-none-fp16-ws4-emptyshare",  # ... and an fp16 Muon group norm below 1
    "z3-none-fp16-ws2-onerow",  # the fp16 Muon norm below 1 on ZeRO-3
    "z3-none-fp32-ws3-onematrix",  # a round of one matrix at three ranks: rank 2 has none to orthogonalise
    "z1-none-bf16-ws2-aligned-gad32",  # BF16_Optimizer: every Muon matrix ends on a partition boundary
    "z2-cpu-fp32-ws2-conv2d", "z3-cpu-fp32-ws2-conv2d",  # a 4-D Muon weight on the offload paths (expert default)
    "z1-none-bf16-ws2-emptyshare-gad32",  # BF16_Optimizer: a split matrix whose last element starts a partition
    "z1-none-bf16-ws3-spanning-gad32",  # BF16_Optimizer: a matrix over three ranks (two pieces received)
    "z1-cpu-fp32-ws2-gather-pack",  # two matrices packed behind each other in one chunked gather batch
    "z1-cpu-fp32-ws2-gather-nocache", "z3-none-fp32-ws2-gather-nocache",  # a gather-cache cap of 0 bytes
    "z2-cpu-fp32-ws2-gather-oneelem",  # a gather budget below one element per rank: one-element chunks
    "z3-cpu-fp32-ws2-inmem",  # ZeRO-3 offload with the Muon momentum kept in memory
    "z1-none-fp16-ws2-subnormal",  # fp16 gradients stored as subnormals (judged with the subnormal term)
    "z1-none-fp32-ws2-groups-loose",  # bare tensors beside a group dict: DeepSpeed's loose group
    "z3-none-fp32-ws2-betas-equal",  # two Muon groups setting the same momentum: accepted (equality, not identity)
    "z1-none-bf16-ws2-onesquare-gad32",  # BF16_Optimizer: one split matrix alone in its group
    # gate cases that kill survivors once they are candidates: Muon after an Adam group on ZeRO-2 offload, an
    # overflow on ZeRO-1 offload (its CPU buffers reset) and on ZeRO-3 (the scale updated once a step)
    "z2-cpu-fp16-ws2-groups", "z1-cpu-fp16-ws2-overflow", "z3-none-fp16-ws2-overflow",
    "z1-none-fp32-ws2-auxl2", "z2-cpu-fp32-ws2-auxl2",  # Muon's auxiliary Adam told adam_w_mode false (L2)
    "z1-none-fp32-ws2-conv2d-unpadded",  # a 4-D weight in a Muon group without padding (the unpadded path)
    "z1-none-bf16-ws2-groups-gad32",  # two user groups on the BF16_Optimizer route
    "z3-nvme-part-fp32-ws1-bigadam",  # a swapped Adam sub-group: three tensors (and DSM-022)
    "z3-nvme-pipe-fp32-ws1-bigadam",  # two swapped sub-groups on the pipelined swapper: its prefetch (DSM-024)
    "z2-cpu-fp16-ws2-scale2", "z3-none-fp16-ws2-scale2",  # the rescale's test at a scale of 2, two more paths
    # a static loss scale of 0.5: every "scale != 1.0" test of the Muon rescale, against "scale > 1.0"
    "z1-none-fp16-ws2-static0.5", "z2-cpu-fp16-ws2-static0.5", "z3-none-fp16-ws2-static0.5",
    "z3-cpu-fp16-ws2-static0.5",
    # the Adam-mode rule's three corners: "Adam" with adam_w_mode false (L2), "Adam" at its default and
    # "AdamW" with adam_w_mode false (both decoupled; engine.py picks the mode from the name and the flag)
    "z2-none-fp32-ws2-adam-l2", "z2-none-fp32-ws2-adam", "z1-none-fp32-ws2-adamw-wmodeoff",
)


CASES_ENV = "MUON_MUTATION_CASES"  # comma-separated case names: a smaller candidate set (the CI sample)


def candidate_cases() -> list:
    from harness.selfcheck.kill_matrix import default_kill_cases
    from harness.catalog.matrix import gate_cases

    by_name = {c.name: c for c in gate_cases()}
    out = list(default_kill_cases())
    only = [n.strip() for n in os.environ.get(CASES_ENV, "").split(",") if n.strip()]
    if only:
        pool = {c.name: c for c in out} | by_name
        unknown = [n for n in only if n not in pool]
        if unknown:
            raise ValueError(f"{CASES_ENV}: unknown case(s) {unknown}; names come from the kill cases "
                             f"(harness.selfcheck.kill_matrix.default_kill_cases) and the gate "
                             f"(harness.catalog.matrix)")
        return [pool[n] for n in only]
    have = {c.name for c in out}
    for n in EXTRA_GATE_CASES:
        if n in by_name and n not in have:
            out.append(by_name[n])
            have.add(n)
    return out


def run_case_covered(case, rank: int, world_size: int, workdir: Path):
    """The ordinary rank entry under coverage.py, restricted to the copy's scoped files."""
    import importlib

    import coverage

    out = Path(os.environ[COVERAGE_DIR_ENV])
    root = workspace.copy_root()
    cov = coverage.Coverage(data_file=str(out / f"{case.name}.rank{rank}.cov"),
                            include=[str(root / rel) for rel in scope.files()], config_file=False, branch=False)
    module_name, _, func_name = DEFAULT_ENTRY.partition(":")
    func = getattr(importlib.import_module(module_name), func_name)
    cov.start()
    try:
        return func(case, rank, world_size, workdir)
    finally:
        cov.stop()
        cov.save()


class EntryLauncher:
    """A launcher that runs every case through a fixed rank entry (``harness.launch.launcher.Launcher``)."""

    def __init__(self, inner, entry: str):
        self.inner, self.entry = inner, entry

    def run(self, case, entry: str = DEFAULT_ENTRY):
        return self.inner.run(case, self.entry)

    def close(self) -> None:
        self.inner.close()


def source_digest() -> str:
    """Of the installed (never mutated) scoped source and the scope list: the copy's scoped files
    change under the engine while it runs."""
    root = workspace.installed_deepspeed()
    h = hashlib.sha256()
    for rel in scope.files():
        h.update(rel.encode() + (root / rel).read_bytes())
    for e in scope.active():
        h.update(repr(e).encode())
    return h.hexdigest()[:16]


def _column_tag(column: str) -> str:
    """The stock column's files keep their first names; the patched column's are apart: the patched
    runtime replaces functions, so the lines a case executes and its baseline status differ."""
    return "" if column == "stock" else f"-{column}"


def store_path(column: str = "stock") -> Path:
    """Every case ever recorded for this source and scope: a new candidate case costs its own run only."""
    return workspace.state_dir() / f"coverage-{source_digest()}-all{_column_tag(column)}.json"


def map_path(cases, column: str = "stock") -> Path:
    """The map of one candidate set (what the worker reads: it selects among these cases only)."""
    h = hashlib.sha256(source_digest().encode())
    for c in cases:
        h.update(c.to_json().encode())
    return workspace.state_dir() / f"coverage-{h.hexdigest()[:16]}{_column_tag(column)}.json"


def record(cases, progress=print, column: str = "stock") -> CoverageMap:
    """Run each case once under coverage on the copy, on ``column``, and return their map. The process
    must already import DeepSpeed from the copy (``workspace.use_copy``)."""
    import coverage

    from harness.gate.decide import evaluate
    from harness.launch.pool import PoolManager

    root = workspace.copy_root()
    out = workspace.state_dir() / "coverage-data"
    if out.exists():
        import shutil

        shutil.rmtree(out)
    out.mkdir(parents=True)
    os.environ[COVERAGE_DIR_ENV] = str(out)
    cmap = CoverageMap(lines={}, cases={}, scope_digest=source_digest())
    manager = PoolManager()
    launcher = EntryLauncher(manager, COVERED_ENTRY)
    try:
        for c in cases:
            t0 = time.perf_counter()
            o = evaluate(c, column, launcher)
            secs = time.perf_counter() - t0
            cmap.cases[c.name] = CaseInfo(c.name, round(secs, 2), o.status, c.world_size, c.to_json())
            progress(f"coverage: {c.name}: {o.status} in {secs:.1f} s")
            for r in range(c.world_size):
                f = out / f"{c.name}.rank{r}.cov"
                if not f.exists():
                    continue
                data = coverage.CoverageData(basename=str(f))
                data.read()
                for measured in data.measured_files():
                    rel = str(Path(measured).relative_to(root))
                    bucket = cmap.lines.setdefault(rel, {})
                    for line in data.lines(measured) or ():
                        names = bucket.setdefault(line, [])
                        if c.name not in names:
                            names.append(c.name)
    finally:
        manager.close()
    return cmap


def _merge(into: CoverageMap, other: CoverageMap) -> None:
    into.cases.update(other.cases)
    for rel, lines in other.lines.items():
        bucket = into.lines.setdefault(rel, {})
        for line, names in lines.items():
            bucket.setdefault(line, [])
            bucket[line] = sorted(set(bucket[line]) | set(names))


def restrict(cmap: CoverageMap, names) -> CoverageMap:
    keep = set(names)
    lines = {rel: {ln: [n for n in ns if n in keep] for ln, ns in ls.items()} for rel, ls in cmap.lines.items()}
    lines = {rel: {ln: ns for ln, ns in ls.items() if ns} for rel, ls in lines.items()}
    return CoverageMap(lines=lines, cases={n: c for n, c in cmap.cases.items() if n in keep},
                       scope_digest=cmap.scope_digest)


def load_or_record(progress=print, column: str = "stock") -> tuple[CoverageMap, Path]:
    """The map of the candidate cases on ``column``, recording only the cases the store does not hold
    yet (a case whose definition changed, or that errored, counts as new); returns it and the path it
    was written to."""
    cases = candidate_cases()
    store_file = store_path(column)
    store = CoverageMap.load(store_file) if store_file.exists() else CoverageMap({}, {}, source_digest())
    # A case recorded as an error is recorded again: its error was most likely the environment's (a
    # copy without metadata, a killed run), and kept it would leave every mutant it covers unreached.
    missing = [c for c in cases if c.name not in store.cases or store.cases[c.name].case_json != c.to_json()
               or store.cases[c.name].status == "error"]
    if missing:
        progress(f"coverage: recording {len(missing)} case(s) not in {store_file.name}")
        stale = {c.name for c in missing}
        store = restrict(store, [n for n in store.cases if n not in stale])
        _merge(store, record(missing, progress, column))
        store.dump(store_file)
    cmap = restrict(store, [c.name for c in cases])
    path = map_path(cases, column)
    cmap.dump(path)
    return cmap, path
