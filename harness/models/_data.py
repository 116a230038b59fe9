"""Deterministic per-(seed, rank, step, micro) generators for the built-in models' batches."""
from __future__ import annotations

import torch

from harness.case.synthetic import _generator


def generator(seed: int, tag: int, rank: int, step: int, micro: int) -> torch.Generator:
    return _generator(seed, tag, rank, step, micro)


def seeded_init(seed: int, tag: int) -> None:
    """Seed torch's global RNG for a module's own initialisation (``nn.Linear`` etc. draw from it)."""
    torch.manual_seed(generator(seed, tag, 0, 0, 0).initial_seed())
