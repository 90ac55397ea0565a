"""A small ResNet for the whole-model benchmark: 15 BatchNorm layers, CIFAR-sized input."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["SmallResNet"]


class _BasicBlock(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class SmallResNet(nn.Module):
    """ResNet-style CNN for 32x32 images (like ResNet-14 for CIFAR), with torch BatchNorm2d.

    A 16-channel stem, three stages of two basic blocks (16, 32 and 64 channels, the
    last two downsampling with a projection shortcut), global pooling and a linear
    classifier: 15 BatchNorm2d layers.

    Args:
        num_classes: outputs of the classifier. Default: 10
        widths: channels of the three stages. Default: ``(16, 32, 64)``

    Shape:
        - Input: :math:`(N, 3, H, W)`
        - Output: :math:`(N, \\text{num\\_classes})`

    Examples::

        >>> SmallResNet()(torch.randn(8, 3, 32, 32)).shape
        torch.Size([8, 10])
    """

    def __init__(self, num_classes: int = 10, widths: tuple[int, int, int] = (16, 32, 64)) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, widths[0], 3, 1, 1, bias=False),
            nn.BatchNorm2d(widths[0]),
            nn.ReLU(inplace=True),
        )
        blocks = []
        in_channels = widths[0]
        for stage, width in enumerate(widths):
            for index in range(2):
                stride = 2 if stage > 0 and index == 0 else 1
                blocks.append(_BasicBlock(in_channels, width, stride))
                in_channels = width
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Sequential(
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(in_channels, num_classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)))
