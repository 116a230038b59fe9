"""A plain DeepSpeed training loop as a user writes one (no harness machinery unless ``--patched``), for
``python -m harness watch`` to run unchanged under ``torchrun`` or the ``deepspeed`` launcher.

    torchrun --nproc_per_node 2 cases/cli/watch_loop.py [--stage 2] [--dtype fp32|bf16] [--steps 4]
                                                       [--gas 2] [--patched] [--save weights.pt]

The model's shapes put, at world size 2 under ZeRO-1/2, the first Muon matrix across the partition
boundary and the last one in front of the group's padding (945 Muon elements, padded to 948); its data
are fixed per rank. ``--save`` writes every fp32 master after the last step (rank 0), so two runs can be
compared bit for bit.
"""
from __future__ import annotations

import argparse

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.utils import safe_get_full_fp32_param


def config(stage: int, dtype: str, gas: int) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": gas,
           "optimizer": {"type": "Muon", "params": {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.01}},
           "zero_optimization": {"stage": stage}, "gradient_clipping": 1.0, "steps_per_print": 10**9}
    if stage == 3:
        cfg["zero_optimization"]["reduce_scatter"] = False
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.Sequential(torch.nn.Linear(20, 24), torch.nn.Tanh(), torch.nn.Linear(24, 15),
                                          torch.nn.Tanh(), torch.nn.Linear(15, 7))

    def forward(self, x):
        return self.layers(x)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--gas", type=int, default=2)
    ap.add_argument("--patched", action="store_true")
    ap.add_argument("--save", default=None)
    ap.add_argument("--own-groups", action="store_true", help="two param groups of the script's own")
    ap.add_argument("--local_rank", type=int, default=0)  # the deepspeed launcher passes it
    args = ap.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    if args.patched:
        from harness.fixes import apply

        apply()
    torch.manual_seed(0)
    model = Net()
    params = list(model.parameters())
    if args.own_groups:
        params = [{"params": params[:2], "weight_decay": 0.1}, {"params": params[2:], "weight_decay": 0.0}]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=params,
                                      config=config(args.stage, args.dtype, args.gas))
    dtype = next(engine.module.parameters()).dtype
    data = torch.Generator().manual_seed(1000 + dist.get_rank())
    for _ in range(args.steps * args.gas):
        x = torch.randn(4, 20, generator=data).to(dtype)
        y = torch.randn(4, 7, generator=data).to(dtype)
        loss = ((engine(x).float() - y.float()) ** 2).mean()
        engine.backward(loss)
        engine.step()
    masters = {n: safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters()}
    if args.save and dist.get_rank() == 0:
        torch.save(masters, args.save)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
