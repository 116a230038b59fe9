"""A model factory as a user writes one, in a folder of its own (not importable from the repository):
an ``nn.Embedding`` (``embed``), a hidden layer and an output projection named ``out_proj`` -- a 2-D weight without
``lm_head`` in its name, which DeepSpeed therefore puts on Muon."""
from __future__ import annotations

from pathlib import Path

MODULE = "user_tiny_lm"
SOURCE = '''
import torch
from torch import nn
from torch.nn import functional as F

VOCAB, D = 32, 16


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.hidden = nn.Linear(D, D)
        self.out_proj = nn.Linear(D, VOCAB, bias=False)

    def forward(self, input_ids, labels):
        logits = self.out_proj(torch.tanh(self.hidden(self.embed(input_ids))))
        return F.cross_entropy(logits.float().reshape(-1, VOCAB), labels.reshape(-1))


def factory(seed):
    torch.manual_seed(seed)
    module = TinyLM()

    def batch(rank, step, micro):
        g = torch.Generator().manual_seed(seed * 1000003 + rank * 1009 + step * 31 + micro)
        ids = torch.randint(0, VOCAB, (2, 6), generator=g)
        return {"input_ids": ids, "labels": torch.roll(ids, -1, dims=1)}

    return module, batch


def broken_oserror(seed):
    raise OSError("weights.bin: no such file")


def broken_keyerror(seed):
    raise KeyError("hidden_size")
'''


def write(folder: Path, module: str = MODULE) -> str:
    """Write the module into ``folder`` as ``module``; returns its ``--model`` argument."""
    (folder / f"{module}.py").write_text(SOURCE)
    return f"{module}:factory"
