"""The departure family: for each departure from Muon as defined that a gate run can show
(``harness.registry.departures``), a case where it must be reported with the size a second computation
expects (``harness.judge.departure_pins``), beside cases where it must not be.

Each case claims its departures exactly (``Case.departs``), so one case per departure also pins that
the others stay silent there, and ``...-departs-none`` (no clip, ``adam_lr`` given, no schedule) pins that
a config without any is reported clean. Newton-Schulz runs in 16 bit wherever the ranks support it
(MUON-NS16), so every case but the ``-ns16-`` ones forces it to float64 (``Case.ns_dtype``, a harness
switch, no config key) to show its own departure alone. MUON-TP-SHARD is claimed by the AutoTP cases
(``harness.catalog.matrix.tp_cases``), whose shards ``harness.judge.tp_verdict.whole_trajectory`` puts back
together.
"""
from __future__ import annotations

from harness import models
from harness.case.scenarios import pipeline_case
from harness.case.spec import Case, canonical_json
from harness.catalog.models import CLIP, available_models
from harness.env import device

STEPS = 3
# A linear warm-up from 0 over two steps: step 1 runs at lr 0, steps 2 and 3 at lr > 0 (the clip's factor is
# read off the masters only where a step moved them).
WARMUP = {"warmup_min_lr": 0, "warmup_num_steps": 2, "warmup_type": "linear"}
BROADCAST = {"type": "WarmupLR", "params": {**WARMUP, "warmup_max_lr": 0.01}}  # one peak for both halves
OWN = {"type": "WarmupLR", "params": dict(WARMUP)}  # each half warms up to its own lr


def _claim(c: Case, tag: str, *ids: str, **top) -> Case:
    """``c`` claiming exactly ``ids``; Newton-Schulz in float64 unless the claim is MUON-NS16's."""
    cfg = {**c.config, **top}
    exact = None if "MUON-NS16" in ids or tag.startswith("ns16") else "float64"
    return c.replace(name=f"{c.name}-departs-{tag}", ds_config=canonical_json(cfg), departs=tuple(ids),
                     ns_dtype=exact)


def _plain_lr(c: Case) -> Case:
    """The optimizer given ``lr`` alone (no ``muon_lr``, no ``adam_lr``), as most user configs give it."""
    cfg = c.config
    params = cfg["optimizer"]["params"]
    for key in ("muon_lr", "adam_lr"):
        params.pop(key, None)
    return c.replace(ds_config=canonical_json(cfg))


def departure_cases(full: bool = False) -> list[Case]:
    """The same cases in CI and ``--full`` (each pins a fact of the reporting, not a path)."""
    plain = pipeline_case(1, "none", "fp32", 2, steps=STEPS, ns_method="standard")
    z2 = pipeline_case(2, "none", "fp32", 2, steps=STEPS, ns_method="standard")
    gram = pipeline_case(1, "none", "fp32", 2, steps=STEPS, ns_method="gram")
    fp16, bf16 = device.half_support()  # gram runs in fp16, standard in bf16, where the ranks support it
    out = [_claim(plain, "none"),
           _claim(pipeline_case(1, "none", "fp32", 2, steps=STEPS, ns_method="standard", clip=CLIP), "clip",
                  "MUON-CLIP"),
           _claim(z2, "sched", "MUON-SCHED-LR", scheduler=BROADCAST),
           _claim(z2, "sched-own", scheduler=OWN),
           _claim(_plain_lr(plain), "plain-lr", "MUON-PLAIN-LR"),
           _claim(gram, "ns16-gram", *(("MUON-NS16",) if fp16 else ())),
           _claim(plain, "ns16-standard", *(("MUON-NS16",) if bf16 else ()))]
    if "gpt2" in available_models():  # transformers (the models extra): GPT-2's token and position embeddings
        gpt2 = models.model_case("gpt2", 1, "none", "fp32", 2, steps=STEPS, ns_method="standard")
        out.append(_claim(gpt2, "by-name", "MUON-BY-NAME"))
    return out
