"""A plain DeepSpeed training script (no harness machinery) that exercises three stock Muon bugs.

    python cases/patched/plain_training.py [--patched] [--harness-ops]

With ``--patched`` it does what a user would do, ``from harness.fixes import apply; apply()``
before ``deepspeed.initialize``. It prints one JSON line with what it observed:

* ``ns_method``: the Newton-Schulz method each Muon parameter was orthogonalised with, ZeRO-3, two Muon
  param groups asking for "gram" and "standard" (DSM-006: stock uses the last group's for both);
* ``momentum_dtype``: the dtype of the Muon momentum ``muon_update`` sees, ZeRO-2 bf16 (DSM-001);
* ``conv``: whether a model with a Conv2d trains a step under ZeRO-2 (DSM-012: stock raises).

It observes ``muon_update``'s arguments through a wrapper installed *after* ``apply()``, the way any
user-side instrumentation would.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def config(stage: int, dtype: str | None = None) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "Muon", "params": {"lr": 0.02, "momentum": 0.95}},
           "zero_optimization": {"stage": stage}, "steps_per_print": 10**9}
    if stage == 3:
        cfg["zero_optimization"]["reduce_scatter"] = False
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def start(patched: bool) -> None:
    """One rank's process group, then what a user of the fixes does before ``deepspeed.initialize``."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(29500 + os.getpid() % 1000))
    import torch
    import torch.distributed as dist

    torch.manual_seed(0)
    tmp = tempfile.mkdtemp(prefix="plain-ds-")
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rdv", rank=0, world_size=1)

    if "--harness-ops" in sys.argv:
        # Not what is observed: the ops the harness's warm-up built, imported as its ranks do. DeepSpeed's
        # JIT load would rebuild them here (minutes) whenever this checkout's venv did not build them.
        sys.path.insert(0, ROOT)
        from harness.rank import runtime_state

        runtime_state.preload_built_ops()

    if patched:
        sys.path.insert(0, ROOT)
        from harness.fixes import apply

        apply()


def train(model, params, cfg: dict, x, steps: int = 2) -> None:
    import deepspeed

    engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=cfg)
    dt = next(engine.module.parameters()).dtype
    for _ in range(steps):
        loss = engine(x.to(dt)).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
    engine.destroy()


def observe(seen: list) -> dict:
    """The three trainings, each read through what ``muon_update`` was called with (``seen``)."""
    import torch

    out = {}
    # DSM-006: two Muon groups with different ns_method under ZeRO-3
    a, b = torch.nn.Linear(8, 6, bias=False), torch.nn.Linear(6, 5, bias=False)
    model = torch.nn.Sequential(a, torch.nn.Tanh(), b)
    seen.clear()
    train(model, [{"params": [a.weight], "ns_method": "gram"}, {"params": [b.weight], "ns_method": "standard"}],
          config(3), torch.randn(4, 8))
    out["ns_method"] = {("first" if s["shape"] == [6, 8] else "second"): s["ns_method"] for s in seen}

    # DSM-001: the momentum dtype Muon works with, ZeRO-2 bf16
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Tanh(), torch.nn.Linear(6, 5))
    seen.clear()
    train(model, model.parameters(), config(2, "bf16"), torch.randn(4, 8))
    out["momentum_dtype"] = sorted({s["momentum_dtype"] for s in seen})

    # DSM-012: a conv model under ZeRO-2
    model = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3), torch.nn.Flatten(), torch.nn.Linear(12, 2))
    try:
        train(model, model.parameters(), config(2), torch.randn(4, 2, 4, 4))
        out["conv"] = "trained"
    except RuntimeError as e:
        out["conv"] = "RuntimeError: " + str(e).splitlines()[0]
    return out


def main() -> None:
    patched = "--patched" in sys.argv
    start(patched)
    import torch.distributed as dist
    from deepspeed.runtime.zero.muon import original_muon

    seen = []
    inner = original_muon.muon_update

    def spy(grad, momentum, *args, **kwargs):
        seen.append({"shape": list(grad.shape), "ns_method": kwargs.get("ns_method"),
                     "momentum_dtype": str(momentum.dtype).replace("torch.", "")})
        return inner(grad, momentum, *args, **kwargs)

    original_muon.muon_update = spy
    out = {"patched": patched, **observe(seen)}
    print("RESULT " + json.dumps(out), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
