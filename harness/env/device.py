"""What the device the ranks run on supports, as far as it changes what DeepSpeed computes.

The CPU fp16 stand-in: DeepSpeed's CPU accelerator refuses fp16 models ("Type fp16 is not supported
on your device", engine.py:2003) on CPUs without oneDNN fp16 kernels (AMD EPYC and older Intel
parts), which would leave every fp16 path -- dynamic loss scaling, overflow skips, growth steps,
and the bugs that live there -- unchecked on such a machine. The CPU ranks exist to stand in for
accelerators, and every fp16-capable accelerator DeepSpeed supports (CUDA from sm 7.0) reports fp16;
torch's CPU fp16 kernels are correct, only slower. So on such a CPU the ranks report fp16 support
(:func:`install_cpu_fp16_standin`), DeepSpeed takes its fp16 paths and its fp16 Newton-Schulz as on
a GPU, and the oracle is told the same. ``MUON_HARNESS_NATIVE_FP16=1`` turns the stand-in off
(DeepSpeed then refuses fp16 cases and runs the gram iteration in fp32, and the oracle follows).

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
    import torch  # late: keeps this module torch-free at import

    accel = accelerator or os.environ.get("DS_ACCELERATOR", "cpu")
    if accel == "cuda" and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return (major, minor) >= (7, 0), (major, minor) >= (8, 0)
    return cpu_fp16_native() or cpu_fp16_standin(), True


def cpu_fp16_native() -> bool:
    """Whether this CPU has the oneDNN fp16 kernels DeepSpeed's CPU accelerator asks for."""
    import torch  # late: keeps this module torch-free at import

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):
        return False


def cpu_fp16_standin() -> bool:
    return os.environ.get("MUON_HARNESS_NATIVE_FP16", "0") != "1" and not cpu_fp16_native()


def install_cpu_fp16_standin() -> bool:
    """In a rank on the CPU accelerator: report fp16 support where the CPU lacks oneDNN fp16
    kernels (see the module doc). Returns whether the stand-in is active."""
    if os.environ.get("DS_ACCELERATOR", "cpu") != "cpu" or not cpu_fp16_standin():
        return False
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator  # late: DeepSpeed, rank side

    CPU_Accelerator.is_fp16_supported = lambda self: True
    return True
