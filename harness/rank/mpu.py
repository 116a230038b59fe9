"""A model-parallel grid handed to ``deepspeed.initialize(mpu=...)``, so that ZeRO runs over a
data-parallel group smaller than the world (``Case.model_parallel``).

The layout is Megatron's: the ``model_parallel`` consecutive ranks ``[i*mp, (i+1)*mp)`` form a
model-parallel group, and the ranks with the same model-parallel index ``k`` (``k, k+mp, ...``) form
the data-parallel group ZeRO partitions over. Nothing in the synthetic model is actually split:
each model-parallel index is an independent data-parallel run of ``world_size // mp`` ranks, fed its
own data (``harness.case.synthetic.batch_data`` keys on the global rank), so a collective taken over WORLD
instead of the data-parallel group mixes two runs and changes numbers.

The object implements the part of the Megatron ``mpu`` interface DeepSpeed 0.19.8 reads
(``utils/bwc.py``, ``utils/groups.py``, the ZeRO optimizers): model-parallel and data-parallel group,
rank and world size, and the data-parallel group's ranks. Its groups are created once per process and
grid shape (``tdist.new_group`` is collective: every rank runs the same cases in the same order, so
every rank creates them at the same point) and reused by later cases.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as tdist


def grid_ranks(world_size: int, model_parallel: int) -> tuple[list[list[int]], list[list[int]]]:
    """(model-parallel groups, data-parallel groups) as lists of global ranks."""
    if model_parallel < 1 or world_size % model_parallel:
        raise ValueError(f"world size {world_size} is not a multiple of model_parallel {model_parallel}")
    mp_groups = [list(range(i, i + model_parallel)) for i in range(0, world_size, model_parallel)]
    dp_groups = [list(range(k, world_size, model_parallel)) for k in range(model_parallel)]
    return mp_groups, dp_groups


@dataclass
class GridMpu:
    world_size: int
    model_parallel: int
    rank: int
    mp_group: object
    dp_group: object
    dp_ranks: tuple[int, ...]

    def get_model_parallel_group(self):
        return self.mp_group

    def get_model_parallel_rank(self) -> int:
        return self.rank % self.model_parallel

    def get_model_parallel_world_size(self) -> int:
        return self.model_parallel

    def get_data_parallel_group(self):
        return self.dp_group

    def get_data_parallel_rank(self) -> int:
        return self.rank // self.model_parallel

    def get_data_parallel_world_size(self) -> int:
        return self.world_size // self.model_parallel

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(self.dp_ranks)


_GRIDS: dict[tuple[int, int], GridMpu] = {}


def grid_mpu(model_parallel: int) -> GridMpu:
    """This rank's ``GridMpu`` over the default group (created on first use; collective then)."""
    world, rank = tdist.get_world_size(), tdist.get_rank()
    key = (world, model_parallel)
    if key not in _GRIDS:
        mp_groups, dp_groups = grid_ranks(world, model_parallel)
        mine_mp = mine_dp = None
        for ranks in mp_groups:
            g = tdist.new_group(ranks)
            if rank in ranks:
                mine_mp = g
        for ranks in dp_groups:
            g = tdist.new_group(ranks)
            if rank in ranks:
                mine_dp, dp_ranks = g, tuple(ranks)
        _GRIDS[key] = GridMpu(world, model_parallel, rank, mine_mp, mine_dp, dp_ranks)
    return _GRIDS[key]
