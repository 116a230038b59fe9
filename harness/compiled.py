"""The compiled path, as users run it: DeepSpeed decorates ``muon_update`` with torch.compile.

Compiled Newton-Schulz rounds differently from eager (inductor fuses the elementwise ops in fp32),
so it gets its own, small set of cases, each in fresh ranks (``PoolManager`` never reuses a
compiled pool). Warming fills inductor's on-disk FX-graph cache for the shapes those cases use.
"""
from __future__ import annotations

# Shapes the compiled subset uses (harness.scenarios.TINY_PARAMS); dtype per precision path.
WARM_SHAPES = ((6, 5), (7, 3))


def warm_compiled_muon_update() -> None:
    import torch
    from deepspeed.runtime.zero.muon import original_muon

    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for shape in WARM_SHAPES:
            for ns_method in ("gram", "standard"):
                grad = torch.randn(shape).to(dtype)
                momentum = torch.zeros(shape, dtype=dtype)
                original_muon.muon_update(grad, momentum, 0.95, ns_method=ns_method)
