"""The GPU run: a fixed subset of the gate through torchrun mode (NCCL), judged by the same oracle.

``scripts/gpu.sh`` installs what is missing and calls ``python -m harness gpu``; this module picks the
cases, launches them and decides them with ``harness.gate.decide.evaluate`` like every other column.

Why these comparison modes: the default ``emulated`` mode reproduces DeepSpeed's 16-bit eager
Newton-Schulz bit for bit *as the CPU computes it*; cuBLAS accumulates a bf16/fp16 matmul in fp32 in
its own order, so that emulation does not hold on a GPU. The eager GPU cases therefore run in
``hpns`` mode (Newton-Schulz compute dtype forced to float64: the rest of the plumbing -- reduction,
partitioning, momentum, master update, casts -- is judged to fp32 round-off, which does not depend
on summation order beyond the accumulation-length term the tolerance model already carries), and
the compiled cases in ``exact`` mode with the 16-bit Newton-Schulz allowance, as on the CPU.
TF32 is switched off (``NVIDIA_TF32_OVERRIDE=0``) so an fp32 matmul has fp32's unit round-off, the
one the tolerance model assumes; with TF32 on, the fp32 unit round-off would be 2^-11 and every
fp32 allowance would have to be derived from that instead.

One launch per (column, world size) holds all of its cases, so the ~10 s of torch/DeepSpeed import
is paid a handful of times, not per case; a launch that fails is retried case by case, so one bad
case cannot hide the others.
"""
from __future__ import annotations

import itertools
import os
import sys
import time
from pathlib import Path

from harness.case.spec import Case
from harness.cli.parser import build_parser
from harness.launch.pool import CaseFailure, CaseOutcome
from harness.case.scenarios import pipeline_case
from harness.env import buildenv
import torch
from harness.launch import torchrun

STAGES = (1, 2, 3)
OFFLOADS = ("none", "cpu")
DTYPES = ("fp32", "bf16", "fp16")


def gpu_cases(world_sizes: tuple[int, ...], compiled: bool = True) -> list[Case]:
    """ZeRO-1/2/3 x offload none/cpu x fp32/bf16/fp16 eager at every world size, and one compiled
    case per stage (fp32/bf16 alternating, no offload and CPU offload alternating)."""
    out = []
    for ws in world_sizes:
        for st, off, dt in itertools.product(STAGES, OFFLOADS, DTYPES):
            c = pipeline_case(st, off, dt, ws, steps=3, clip=0.05 if dt == "fp16" else 0.0)
            out.append(c.replace(name=c.name + "-gpu", ns_dtype="float64"))
        if compiled:
            for i, st in enumerate(STAGES):
                c = pipeline_case(st, OFFLOADS[i % 2], ("fp32", "bf16")[i % 2], ws, steps=3)
                out.append(c.replace(name=c.name + "-gpu-compiled", compiled=True, timeout_s=900.0))
    return out


class PrelaunchedManager:
    """``run(case)`` / ``close()`` like ``PoolManager``, answering from trajectories that one torchrun
    launch per world size produced beforehand (``prelaunch``); a case the batch could not produce
    gets its own launch, so its own failure is reported against it."""

    def __init__(self, accelerator: str, root: Path):

        self.single = torchrun.TorchrunManager(accelerator, root=root)
        self.accelerator = self.single.accelerator
        self.root = root
        self.done: dict[str, tuple[object, float]] = {}

    def prelaunch(self, cases: list[Case]) -> None:

        by_ws: dict[tuple[int, bool], list[Case]] = {}
        for c in cases:
            by_ws.setdefault((c.world_size, c.compiled), []).append(c)
        for (ws, _compiled), group in sorted(by_ws.items()):
            t0 = time.perf_counter()
            try:
                trajs = torchrun.run_cases_with_torchrun(group, ws, accelerator=self.accelerator, root=self.root)
            except CaseFailure as exc:
                print(f"gpu: batch launch of {len(group)} ws={ws} case(s) failed; running them one by one\n"
                      f"  {str(exc).splitlines()[0]}", flush=True)
                continue
            each = (time.perf_counter() - t0) / len(group)
            for c, t in zip(group, trajs):
                self.done[c.to_json()] = (t, each)

    def run(self, case: Case, entry: str | None = None) -> CaseOutcome:
        hit = self.done.pop(case.to_json(), None)
        if hit is None:
            return self.single.run(case, entry)
        return CaseOutcome(result=hit[0], seconds=hit[1], rank_seconds=[])

    def close(self) -> None:
        self.single.close()


def main(argv=None) -> int:
    """``python -m harness gpu ARGV``: its options are in the one tree (``harness.cli.parser``)."""
    return run(build_parser().parse_args(["gpu", *(sys.argv[1:] if argv is None else argv)]))


def run(args) -> int:
    """``python -m harness gpu`` with its options parsed."""

    buildenv.apply_base_env()  # the parent's own environment; each launch sets its ranks' (launch_env)

    from harness.report import results  # late: keeps this module numpy-free at import
    from harness.gate.decide import columns, evaluate, record  # late: keeps this module numpy-free at import
    from harness.cli.main_job import environment  # late: keeps this module numpy-free at import
    from harness.report.build import render, save_extra  # late: keeps this module numpy-free at import
    from harness.report.html import BAD_STATUSES  # late: keeps this module numpy-free at import

    if args.accelerator == "cuda" and not torch.cuda.is_available():
        print("error: --accelerator cuda but torch sees no CUDA device (torch "
              f"{torch.__version__}, CUDA build: {torch.version.cuda})", file=sys.stderr)
        return 2
    os.environ.setdefault("NVIDIA_TF32_OVERRIDE", "0")  # see the module doc: fp32 means fp32
    n_gpu = torch.cuda.device_count() if args.accelerator != "cpu" else 2
    sizes = (tuple(int(x) for x in args.world_sizes.split(",")) if args.world_sizes
             else tuple(sorted({1, max(n_gpu, 1)})))
    cases = [c for c in gpu_cases(sizes, compiled=not args.no_compiled) if not args.only or args.only in c.name]
    report = Path(args.report)
    results_dir = report.parent / (report.stem + "-results")
    store = results.ResultStore(results_dir, writer="gpu")
    work = Path(os.environ.get("TMPDIR", "/tmp")) / "muon-gpu-run"
    counts: dict[str, int] = {}
    bad = []
    t0 = time.perf_counter()
    print(f"gpu: {len(cases)} cases x {len(columns())} columns, world sizes {sizes}, accelerator {args.accelerator}",
          flush=True)
    for col in columns():
        manager = PrelaunchedManager(args.accelerator, work)
        try:
            manager.prelaunch([c.replace(patched=col == "patched") for c in cases])
            for case in cases:
                o = evaluate(case, col, manager)
                record(store, o)
                counts[o.status] = counts.get(o.status, 0) + 1
                tag = o.status.upper() + (f" [{', '.join(o.bug_ids)}]" if o.bug_ids else "")
                print(f"{col:7s} {case.name:48s} {tag} ({o.seconds:.1f}s)", flush=True)
                if o.status in BAD_STATUSES:
                    bad.append(o.message)
                o.trajectory = None
        finally:
            manager.close()
    env = environment()
    env.update(accelerator=args.accelerator, gpus=n_gpu,
               gpu_name=torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-",
               cuda=str(torch.version.cuda), tf32_override=os.environ.get("NVIDIA_TF32_OVERRIDE"))
    save_extra(results_dir, {"environment": env, "title": "Muon / DeepSpeed ZeRO on GPU"}, name="gpu")
    render(results_dir, report)
    print(f"\ngpu: {len(cases)} cases x {len(columns())} columns in {time.perf_counter() - t0:.0f}s: "
          + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
    for m in bad:
        print("\n" + m)
    print(f"report: {report}")
    return 1 if bad else 0

