"""``resnet-ee``: a BranchyNet-style ResNet for Fashion-MNIST, with its stock counterpart.

Six residual blocks (16, 16, 32, 32, 64, 64 channels; stride 2 at blocks 3
and 5: 28x28 -> 14x14 -> 7x7), a branch after blocks 1-5 and the final head
after block 6. A branch is BranchyNet's small side network: 3x3 conv to 16
channels, ReLU, 7x7 average pooling (to 4x4, 2x2 or 1x1), linear to 10 classes. The
state across a cut is one tensor, ``features`` [C, H, W], whose shape changes
with the block (``ModelCard.state_shapes``).
"""

from __future__ import annotations

import torch
from torch import nn

from e3.core.spec import ModelCard, TensorSpec
from e3.models.api import EarlyExitModel

__all__ = ["ResNetEE", "CHANNELS"]

CHANNELS = (16, 16, 32, 32, 64, 64)
STRIDES = (1, 1, 2, 1, 2, 1)


class _Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential() if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


class _Branch(nn.Module):
    def __init__(self, cin: int, side: int, num_classes: int):
        super().__init__()
        self.conv = nn.Conv2d(cin, 16, 3, 1, 1)
        # A fixed 7x7 average pool (28 -> 4x4, 14 -> 2x2, 7 -> 1x1): ONNX cannot export
        # adaptive pooling to sizes that do not divide the input.
        self.pool = nn.AvgPool2d(7)
        self.fc = nn.Linear(16 * (side // 7) ** 2, num_classes)

    def forward(self, x):
        return self.fc(torch.flatten(self.pool(torch.relu(self.conv(x))), 1))


class _Head(nn.Module):
    def __init__(self, cin: int, num_classes: int):
        super().__init__()
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x):
        return self.fc(x.mean(dim=(2, 3)))


class ResNetEE(EarlyExitModel):
    """Input ``pixels`` FP32 [1, 28, 28] (normalised); state ``features`` FP32 [C, H, W]."""

    def __init__(self, name: str, exit_rule: dict, ramps: tuple[int, ...] = (1, 2, 3, 4, 5), num_classes: int = 10):
        super().__init__()
        self.stem_conv = nn.Sequential(nn.Conv2d(1, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
        cins = (16, *CHANNELS[:-1])
        self.blocks = nn.ModuleList(_Block(a, b, s) for a, b, s in zip(cins, CHANNELS, STRIDES))
        sizes, side = [28], 28
        for s in STRIDES:
            side //= s
            sizes.append(side)
        self.ramps = nn.ModuleDict({str(k): _Branch(CHANNELS[k - 1], sizes[k], num_classes) for k in ramps})
        self.head = _Head(CHANNELS[-1], num_classes)
        shapes = {0: ((16, 28, 28),), **{k: ((CHANNELS[k - 1], sizes[k], sizes[k]),) for k in range(1, 7)}}
        self.card = ModelCard(
            name=name, num_blocks=6, ramp_blocks=tuple(ramps), num_classes=num_classes,
            inputs=(TensorSpec("pixels", "FP32", (1, 28, 28)),),
            state=(TensorSpec("features", "FP32", shapes[0][0]),), exit_rule=dict(exit_rule),
            max_batch_size=64, state_shapes=shapes)

    def stem(self, pixels):
        return (self.stem_conv(pixels),)

    def block(self, k, features):
        return (self.blocks[k - 1](features),)

    def ramp(self, k, features):
        return self.head(features) if k == self.card.num_blocks else self.ramps[str(k)](features)

    def example_inputs(self, n, seed=0):
        g = torch.Generator().manual_seed(seed)
        return (torch.randn(n, 1, 28, 28, generator=g),)
