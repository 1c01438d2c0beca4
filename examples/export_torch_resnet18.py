"""Build ResNet-18 in PyTorch by hand (no torchvision, nothing downloaded)
and write its state_dict as an .npz that examples/resnet18_infer.py loads
without torch.

    python examples/export_torch_resnet18.py resnet18.npz --reference ref.npz

Weights are random (seeded) unless --state-dict gives a torch.save()d
state_dict with torchvision's key names (e.g. resnet18-f37072fd.pth).
Random weights get random BatchNorm affine parameters and running
statistics calibrated on random images, so that activations stay in a
realistic range through all 18 layers.  --reference also writes a seeded
NHWC image batch and the logits PyTorch computes for it.
"""
import argparse

import numpy as np
import torch
from torch import nn


class BasicBlock(nn.Module):
    def __init__(self, in_channels, out_channels, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.downsample = None
        if stride != 1 or in_channels != out_channels:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride, bias=False),
                nn.BatchNorm2d(out_channels))

    def forward(self, x):
        shortcut = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + shortcut)


class ResNet18(nn.Module):
    """torchvision.models.resnet18's structure and state_dict keys."""

    def __init__(self, num_classes=1000):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        in_channels = 64
        for stage in range(4):
            out_channels = 64 << stage
            stride = 1 if stage == 0 else 2
            setattr(self, f"layer{stage + 1}", nn.Sequential(
                BasicBlock(in_channels, out_channels, stride),
                BasicBlock(out_channels, out_channels)))
            in_channels = out_channels
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(512, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


@torch.no_grad()
def randomize_batchnorms(model, image_size, seed):
    """Non-trivial BN affine parameters, and running statistics measured on
    random images (a cumulative average over a few batches)."""
    generator = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.weight.uniform_(0.5, 1.5, generator=generator)
            m.bias.normal_(0.0, 0.1, generator=generator)
            m.momentum = None  # cumulative average
    model.train()
    for _ in range(3):
        model(torch.randn(4, 3, image_size, image_size, generator=generator))
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.momentum = 0.1
    model.eval()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="where to write the weights (.npz)")
    parser.add_argument("--state-dict", help="a torch.save()d ResNet-18 state_dict to export "
                        "instead of random weights")
    parser.add_argument("--num-classes", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reference", help="also write images (NHWC) and PyTorch's logits "
                        "for them to this .npz")
    parser.add_argument("--batch", type=int, default=1, help="reference batch size")
    parser.add_argument("--image-size", type=int, default=224, help="reference image size")
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    model = ResNet18(args.num_classes)
    if args.state_dict:
        model.load_state_dict(torch.load(args.state_dict, map_location="cpu"))
        model.eval()
    else:
        randomize_batchnorms(model, min(args.image_size, 64), args.seed)
    np.savez(args.out, **{name: tensor.numpy() for name, tensor in model.state_dict().items()})
    print(f"wrote {args.out}: {sum(p.numel() for p in model.parameters()):,} parameters")

    if args.reference:
        rng = np.random.default_rng(args.seed)
        images = rng.standard_normal((args.batch, args.image_size, args.image_size, 3),
                                     dtype=np.float32)
        with torch.no_grad():
            logits = model(torch.from_numpy(images).permute(0, 3, 1, 2)).numpy()
        np.savez(args.reference, images=images, logits=logits)
        print(f"wrote {args.reference}: images {images.shape} (NHWC), logits {logits.shape}")


if __name__ == "__main__":
    main()
