"""A small ResNet-style conv net in plain torch (no torchvision: its PyPI wheels do not install beside
this torch build). What it exercises: 4-D conv kernels (stock DeepSpeed 0.19.8 tags them Muon and
crashes in ``muon_update``, DSM-012), BatchNorm weights/biases (1-D, Adam) and BatchNorm running
statistics (buffers that change every forward, on every rank from its own data), a strided block
with a 1x1 downsample, and a linear classifier.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from harness.models import ModelSpec
from harness.models._data import generator, seeded_init

CLASSES = 10
BATCH = 4  # images per micro-batch and rank
SIZE = 8  # 8x8 RGB


class Norm(nn.BatchNorm2d):
    """BatchNorm computed in float32 whatever the activations' dtype, as mixed-precision recipes keep
    their norms. Needed on CPU: DeepSpeed casts parameters to bf16 but keeps buffers (the running
    statistics) in fp32 (``engine.py`` ``_cast_module_mixed_precision``), and torch's CPU batch_norm
    rejects a bf16 weight next to fp32 statistics."""

    def forward(self, x):
        ct = torch.promote_types(x.dtype, torch.float32)  # float32, or float64 in the oracle's copy
        w = None if self.weight is None else self.weight.to(ct)
        b = None if self.bias is None else self.bias.to(ct)
        mean, var = self.running_mean.to(ct), self.running_var.to(ct)  # copies only if dtypes differ
        y = F.batch_norm(x.to(ct), mean, var, w, b, self.training, self.momentum, self.eps)
        if self.training and mean is not self.running_mean:  # statistics held in another dtype
            with torch.no_grad():
                self.running_mean.copy_(mean)
                self.running_var.copy_(var)
        if self.training:
            self.num_batches_tracked.add_(1)  # as nn.BatchNorm2d.forward counts batches
        return y.to(x.dtype)


class Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = Norm(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = Norm(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), Norm(cout))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + (x if self.down is None else self.down(x)))


class ResNet(nn.Module):
    def __init__(self, width: int = 8):
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1, bias=False)
        self.bn = Norm(width)
        self.layer1 = Block(width, width, 1)
        self.layer2 = Block(width, 2 * width, 2)
        self.fc = nn.Linear(2 * width, CLASSES)

    def forward(self, x, y):
        h = F.relu(self.bn(self.stem(x)))
        h = self.layer2(self.layer1(h))
        logits = self.fc(h.mean(dim=(2, 3)))
        return F.cross_entropy(logits.float(), y)


def resnet(seed: int) -> ModelSpec:
    seeded_init(seed, 0x4E5)
    module = ResNet()

    def batch(rank: int, step: int, micro: int) -> dict:
        g = generator(seed, 0x4E5B, rank, step, micro)
        return {"x": torch.randn(BATCH, 3, SIZE, SIZE, generator=g),
                "y": torch.randint(0, CLASSES, (BATCH,), generator=g)}

    return ModelSpec(module, batch)
