"""The compiled path, as users run it: DeepSpeed decorates ``muon_update`` with torch.compile.

Compiled Newton-Schulz rounds differently from eager (inductor fuses the elementwise ops in fp32),
so it gets its own set of cases (``harness.catalog.matrix.compiled_cases``), each starting from a fresh
dynamo state (``harness.launch.pool._fresh_dynamo`` in reused compiled ranks): ``hpns`` cases force the
Newton-Schulz compute dtype to float64 so the compiled plumbing is judged to fp32 round-off,
``exact`` cases keep DeepSpeed's 16-bit Newton-Schulz. Warming fills inductor's on-disk FX-graph
cache for the shapes, input dtypes and Newton-Schulz dtypes those cases use, in both call orders
(the first shape compiles static, the second recompiles with dynamic sizes), so a case pays dynamo's
tracing, not inductor's code generation.
"""
from __future__ import annotations

import hashlib
import inspect
import os
import sys
from pathlib import Path

from harness.env import buildenv, versions

# Shapes the compiled subset uses (harness.case.scenarios.TINY_PARAMS); dtype per precision path.
WARM_SHAPES = ((6, 5), (7, 3))


def keep_precompiled_headers() -> None:
    """Put inductor's precompiled header beside the compile cache, where the next run finds it.

    inductor keeps it under ``tempfile.gettempdir()`` (``codecache._HEADER_DIR``, computed at import),
    which in a rank is the run's scratch folder: every run compiled the header again (cc1plus, ~6 s of
    the first compiled case per process tree) though every kernel it serves was already cached. Turning
    the header off instead made a cold fill of the cache 1.6x slower (docs/measurements.md, "precompiled
    header"). The header only adds includes; its file name is a hash of its preprocessed text, flags and
    compiler, so a stale one is never used. A torch without the attribute keeps its own place."""
    import torch._inductor.codecache as codecache  # late: torch, and only where a case compiles

    if hasattr(codecache, "_HEADER_DIR"):
        codecache._HEADER_DIR = str(Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]) / "precompiled_headers")
        codecache._HEADER_LOCK_DIR = os.path.join(codecache._HEADER_DIR, "locks")


def warm_compiled_muon_update() -> None:
    """One fresh dynamo per (Newton-Schulz dtype, gradient dtype): dynamo's recompile limit would
    otherwise silently fall back to eager part way through, leaving those graphs uncached. The
    momentum has the gradient's dtype (``momentum.lerp(grad)`` requires it); the gate's compiled cases
    use gram Newton-Schulz."""
    import torch  # late: keeps this module torch-free at import
    from deepspeed.runtime.zero.muon import original_muon  # late: DeepSpeed, rank side

    from harness.rank.ds_run import force_ns_dtype  # late: keeps this module numpy-free at import

    keep_precompiled_headers()
    combos = [(d, d) for d in (torch.float32, torch.float16, torch.bfloat16)]  # lerp needs equal dtypes
    # float64 Newton-Schulz only where the release has the hook that forces it (its cases are deselected
    # elsewhere: on 0.19.6 this warm-up raised AttributeError on ``ns_compute_dtype``)
    hpns = () if versions.refuses("ns-compute-dtype-hook") else ("float64",)
    # 0.18.9's muon_update takes no ns_method (the warm-up raised TypeError there; measured at ab24026)
    ns = {"ns_method": "gram"} if versions.has_ns_method() else {}
    for ns_dtype in (None, *hpns):
        with force_ns_dtype(ns_dtype):
            for dtype, mom_dtype in combos:
                torch._dynamo.reset()
                for shape in WARM_SHAPES:
                    grad = torch.randn(shape).to(dtype)
                    momentum = torch.zeros(shape, dtype=mom_dtype)
                    original_muon.muon_update(grad, momentum, 0.95, **ns)


def warm_key() -> str:
    """What a filled cache was filled from: torch, Python, DeepSpeed's ``original_muon`` source, this
    module (the shapes, dtypes and call orders), the Newton-Schulz dtype hook and the inductor settings
    of ``buildenv.base_env`` (they shape the compile command, so its cache keys). inductor keys its own
    entries on the graph; this key only says whether warming again could add one."""
    import torch  # late: keeps this module torch-free at import
    from deepspeed.runtime.zero.muon import original_muon  # late: DeepSpeed, rank side

    from harness.rank.ds_run import force_ns_dtype  # late: keeps this module numpy-free at import

    inductor = sorted(f"{k}={v}" for k, v in buildenv.base_env().items()
                      if k.startswith("TORCHINDUCTOR_") and k != "TORCHINDUCTOR_CACHE_DIR")
    parts = (torch.__version__, sys.version, inspect.getsource(original_muon), inspect.getsource(sys.modules[__name__]),
             inspect.getsource(force_ns_dtype), *inductor)
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def warm_stamp(key: str) -> Path:
    """Written into inductor's cache folder once a warm-up of ``key`` has filled it, so removing the
    cache removes the stamp with it. The warm-up sets ``TORCHINDUCTOR_CACHE_DIR`` (``buildenv.base_env``)."""
    return Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]) / f"muon-harness-warm-{key}"
