"""What the device the ranks run on supports, as far as it changes what DeepSpeed computes.

DeepSpeed picks the Newton-Schulz compute dtype from its accelerator's fp16/bf16 support
(``oracles.emulate.ns_compute_dtype``). That support is a fact about the hardware, read here from
torch the way DeepSpeed's accelerators read it (the CPU accelerator: oneDNN's fp16 kernels, bf16
always; CUDA: compute capability 7.0 for fp16 and 8.0 for bf16), never from DeepSpeed's own state.
The pool's ranks run on this machine, so the parent's answer is theirs.
"""
from __future__ import annotations

import functools
import os


@functools.lru_cache(maxsize=None)
def half_support(accelerator: str | None = None) -> tuple[bool, bool]:
    """``(fp16, bf16)`` support of the accelerator the ranks use (``DS_ACCELERATOR``, default cpu)."""
    import torch

    accel = accelerator or os.environ.get("DS_ACCELERATOR", "cpu")
    if accel == "cuda" and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return (major, minor) >= (7, 0), (major, minor) >= (8, 0)
    try:
        fp16 = bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):
        fp16 = False
    return fp16, True
