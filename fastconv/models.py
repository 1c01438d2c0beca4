"""Reference networks built from fastconv.nn (NHWC), with PyTorch's
state_dict names so that torchvision-style weights load through
fastconv.nn.load_torch_state_dict."""
from collections import OrderedDict

import numpy as np

from . import nn

__all__ = ["ResNet", "resnet18"]


class ResNet(nn.Sequential):
    """ResNet with BasicBlocks (He et al. 2016), laid out as torchvision's:

        conv1 (7x7/2) -> bn1 -> relu -> maxpool (3x3/2) -> layer1..layer4
        -> avgpool (global) -> flatten -> fc

    layer{i} is a Sequential of blocks_per_stage[i-1] BasicBlocks with
    64, 128, 256, 512 channels; the first block of layers 2-4 halves the
    resolution and has a 1x1-conv projection shortcut ("downsample").
    Input: (N, H, W, 3) images, H and W at least 32; output (N, num_classes).
    """

    def __init__(self, blocks_per_stage, num_classes=1000, *, dtype=np.float32, rng=None):
        rng = np.random.default_rng(rng)
        layers = OrderedDict(
            conv1=nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False, dtype=dtype, rng=rng),
            bn1=nn.BatchNorm2d(64, dtype=dtype),
            relu=nn.ReLU(),
            maxpool=nn.MaxPool2d(3, stride=2, padding=1))
        in_channels = 64
        for stage, blocks in enumerate(blocks_per_stage):
            out_channels = 64 << stage
            stride = 1 if stage == 0 else 2
            stage_blocks = []
            for block in range(blocks):
                downsample = None
                if block == 0 and (stride != 1 or in_channels != out_channels):
                    downsample = nn.BasicBlock.projection(in_channels, out_channels, stride,
                                                          dtype=dtype, rng=rng)
                stage_blocks.append(nn.BasicBlock(in_channels, out_channels,
                                                  stride if block == 0 else 1, downsample,
                                                  dtype=dtype, rng=rng))
                in_channels = out_channels
            layers[f"layer{stage + 1}"] = nn.Sequential(*stage_blocks)
        layers["avgpool"] = nn.AdaptiveAvgPool2d(1)
        layers["flatten"] = nn.Flatten()
        layers["fc"] = nn.Linear(in_channels, num_classes, dtype=dtype, rng=rng)
        super().__init__(layers)


def resnet18(num_classes=1000, *, dtype=np.float32, rng=None):
    """ResNet-18: two BasicBlocks per stage, 11.7M parameters at 1000 classes."""
    return ResNet((2, 2, 2, 2), num_classes, dtype=dtype, rng=rng)
