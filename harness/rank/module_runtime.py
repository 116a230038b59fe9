"""The rank side of a model case: build the module (optionally under ``deepspeed.zero.Init``), feed
its micro-batches, read its buffers. Called from ``harness.rank.ds_run`` only when ``case.model`` is set.
"""
from __future__ import annotations

import contextlib

import numpy as np
import torch

from harness import models
from harness.case.synthetic import MODEL_DTYPES
import torch.distributed as tdist

VARIANT_SEED_STRIDE = 7919  # a checkpoint-resume case loads into a model built from another seed


@contextlib.contextmanager
def zero_init(case, cfg: dict):
    """``deepspeed.zero.Init`` with the case's config when ``case.zero_init``; else nothing."""
    if not case.zero_init:
        yield
        return
    import deepspeed  # late: DeepSpeed, rank side

    # zero.Init reads the world size while parsing the config, before it would set up deepspeed.comm
    # itself; a training script (or the HF Trainer) has called deepspeed.init_distributed by then.
    # It wraps the harness's existing process group, as deepspeed.initialize would.
    deepspeed.init_distributed(dist_backend=tdist.get_backend())
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        yield


def load_full(module: torch.nn.Module, weights: dict, buffers: dict) -> None:
    """Copy full float32 values into every parameter and buffer of ``module``; a ZeRO-3 partitioned
    parameter is gathered, written on rank 0 and re-partitioned (``GatheredParameters``)."""
    import deepspeed  # late: DeepSpeed, rank side

    for n, p in module.named_parameters():
        with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
            with torch.no_grad():
                p.data.copy_(weights[n].to(p.dtype))
    for n, b in module.named_buffers():
        with torch.no_grad():
            b.copy_(buffers[n].to(b.dtype))


def build_module(case, cfg: dict, variant: int = 0):
    """(module, model_parameters, spec). Under ``zero_init`` the module is constructed inside
    ``zero.Init`` (every parameter a partitioned placeholder from its module's ``__init__`` on), then
    loaded with the weights the same factory gives outside it, so both routes start from the same
    values whatever the model's own init does with placeholders."""
    seed = case.seed + VARIANT_SEED_STRIDE * variant
    spec = models.build_spec(case.model, seed)
    if case.zero_init:
        ref = spec.module
        weights = {n: p.detach().clone() for n, p in ref.named_parameters()}
        buffers = {n: b.detach().clone() for n, b in ref.named_buffers()}
        groups = spec.param_groups  # by name, decided on the full-shape module
        with zero_init(case, cfg):
            spec = models.build_spec(case.model, seed)
        spec.param_groups = groups
        load_full(spec.module, weights, buffers)
    names = [n for n, _ in spec.module.named_parameters()]
    if names != [p.name for p in case.params]:
        raise RuntimeError(f"case {case.name!r}: the module's parameters {names[:6]}... are not the case's "
                           f"{[p.name for p in case.params][:6]}... (built from another factory or version?)")
    spec.module.train()
    return spec.module, models.model_parameters(spec), spec


def feeder(case, spec):
    """``forward(engine, rank, step, micro) -> loss``: the micro-batch in the model dtype through the engine."""
    dtype = MODEL_DTYPES[case.dtype]

    def forward(engine, rank: int, step: int, micro: int) -> torch.Tensor:
        return models.loss_of(engine(**models.batch_in(spec.batch(rank, step, micro), dtype)))

    return forward


def read_buffers(module: torch.nn.Module) -> dict[str, np.ndarray]:
    """This rank's buffers (float64 copies; buffers are never partitioned)."""
    return {n: b.detach().to(torch.float64).cpu().numpy().copy() for n, b in module.named_buffers()}
