"""Named, reusable case builders shared by the tests, the benchmark and the CLI.

The default model is deliberately awkward for ZeRO: a Muon matrix whose element count is odd (so a
world size of 2 pads the final partition), one with a prime count that straddles a partition
boundary, and Adam-side vectors next to them.
"""
from __future__ import annotations

from harness.case.spec import Case, ParamShape, ds_config
from harness.case.nvme import nvme_matrix

TINY_PARAMS = (
    ParamShape("layer0.weight", (6, 5)),  # 30 elements
    ParamShape("layer0.bias", (6,)),
    ParamShape("layer1.weight", (7, 3)),  # 21: odd, so ZeRO pads it at W=2 and W=4
    ParamShape("layer1.bias", (7,)),
)



def nvme_params(world_size: int) -> tuple[ParamShape, ...]:
    """DeepSpeed only swaps a sub-group whose per-rank partition is >= MIN_AIO_BYTES (1 MiB); anything
    smaller silently stays in memory, so the NVMe cases carry one matrix big enough per rank."""

    return TINY_PARAMS + (nvme_matrix(world_size),)


def pipeline_name(stage: int, offload: str, dtype: str, world_size: int, swapper: str = "partitioned", **extra) -> str:
    parts = [f"z{stage}", offload if offload != "nvme" else f"nvme-{swapper[:4]}", dtype, f"ws{world_size}"]
    # Only knobs off their defaults appear, so names stay readable in test ids and reports.
    if extra.get("grad_accum", 1) != 1:
        parts.append(f"ga{extra['grad_accum']}")
    if extra.get("clip", 0.0):
        parts.append(f"clip{extra['clip']:g}")
    if extra.get("ns_method", "gram") != "gram":
        parts.append(extra["ns_method"])
    return "-".join(parts)


def pipeline_case(stage: int, offload: str = "none", dtype: str = "fp32", world_size: int = 1, *,
                  steps: int = 2, seed: int = 0, swapper: str = "partitioned", params=None, **cfg) -> Case:
    if params is None:
        params = nvme_params(world_size) if offload == "nvme" else TINY_PARAMS
    name = pipeline_name(stage, offload, dtype, world_size, swapper if offload == "nvme" else "partitioned",
                         **{k: v for k, v in cfg.items() if k in ("grad_accum", "clip", "ns_method")})
    return Case(
        name=name,
        params=tuple(params),
        ds_config=ds_config(stage=stage, dtype=dtype, offload=offload, swapper=swapper, world_size=world_size, **cfg),
        world_size=world_size,
        steps=steps,
        seed=seed,
    )
