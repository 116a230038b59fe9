"""Which model cases the gate runs (``harness.catalog.matrix.model_cases`` calls ``gate_model_cases``).

CI covering subset, at world size 2, 2 steps: every built-in model on every stage variant (ZeRO-1,
ZeRO-2, ZeRO-3, ZeRO-3 under ``zero.Init``), and every model and every stage variant meets every
(dtype, offload) pair of {fp32, bf16} x {none, cpu}: a 4x4 Latin square (model i, variant j gets pair
(i + j) mod 4), 16 cases. ``--full``: the whole product (288 cases), models x variants x {fp32, bf16, fp16} x
{none, cpu} x world sizes {1, 2, 3}, with gradient accumulation and clipping cycling as in the
synthetic grid.

The language models need ``transformers`` (the ``models`` extra); without it they are left out and
``missing_extra_note`` says so.
"""
from __future__ import annotations

import itertools

from harness import models
from harness.case.scenarios import pipeline_case

VARIANTS = ((1, False), (2, False), (3, False), (3, True))  # (stage, zero.Init)
PAIRS = (("fp32", "none"), ("bf16", "none"), ("fp32", "cpu"), ("bf16", "cpu"))
STEPS = 2
CLIP = 0.05
# "standard" (bf16 Newton-Schulz) for the model cases: the synthetic matrix already runs both methods
# on every path, and the bf16 iteration is the one whose dtype no accelerator changes (harness.env.device).
NS_METHOD = "standard"


def available_models() -> list[str]:
    have = models.transformers_available()
    return [m for m in models.BUILTIN if have or m not in models.NEEDS_TRANSFORMERS]


def missing_extra_note() -> str | None:
    if models.transformers_available():
        return None
    return (f"model cases {', '.join(models.NEEDS_TRANSFORMERS)} deselected: they need the 'transformers' package "
            f"({models.EXTRA_HINT})")


def synthetic_zero_init_cases() -> list:
    """The synthetic model built under zero.Init, ZeRO-3 without and with CPU offload. (NVMe is left
    out: with zero.Init the NVMe-swapped matrix's gradient diverges on stock and patched alike, not
    yet explained; reproducer in the issue-14 report.)"""

    return [pipeline_case(3, off, "fp32", 2, steps=STEPS, ns_method=NS_METHOD).replace(
        zero_init=True, name=f"z3-{off}-fp32-ws2-{NS_METHOD}-zinit") for off in ("none", "cpu")]


def stage0_conv_cases() -> list:
    """The conv net without ZeRO (fp32, two ranks): ``MuonWithAuxAdam.step`` itself orthogonalizes the
    whole 4-D filters there (muon_optimizer.py, its ``p.dim() >= 2`` branch), the one path where a
    conv weight reaches ``muon_update`` unflattened; the variants above are all ZeRO, which hands
    Muon flat partitions. ~1 case; added for the source-mutation scope (the expert-group flag on
    that call changes only 4-D weights)."""
    return [models.model_case("resnet", 0, "none", "fp32", 2, steps=STEPS, ns_method=NS_METHOD)]


def gate_model_cases(full: bool = False) -> list:
    out = synthetic_zero_init_cases() + stage0_conv_cases()
    names = available_models()
    order = list(models.BUILTIN)
    if not full:
        for m in names:
            i = order.index(m)
            for j, (stage, zinit) in enumerate(VARIANTS):
                dt, off = PAIRS[(i + j) % len(PAIRS)]
                out.append(models.model_case(m, stage, off, dt, 2, zero_init=zinit, steps=STEPS, ns_method=NS_METHOD))
        return out
    k = 0
    for m, (stage, zinit), dt, off, ws in itertools.product(names, VARIANTS, ("fp32", "bf16", "fp16"),
                                                           ("none", "cpu"), (1, 2, 3)):
        ga = (1, 2)[k % 2]
        clip = (0.0, CLIP)[(k // 2) % 2]
        k += 1
        out.append(models.model_case(m, stage, off, dt, ws, zero_init=zinit, steps=STEPS, grad_accum=ga, clip=clip,
                                     ns_method=NS_METHOD))
    return out


def kill_cases() -> list:
    """The model case the mutation self-check adds: the plain-torch MoE LM (embeddings, lm_head, 3-D
    experts, parameter groups) on ZeRO-3 under zero.Init, which every model mutant must fail."""
    return [models.model_case("moe", 3, "none", "fp32", 2, zero_init=True, steps=STEPS, ns_method=NS_METHOD)]
