"""Classify an NHWC image batch with ResNet-18 on fastconv: numpy and
fastconv are the only imports (no torch).

    python examples/export_torch_resnet18.py resnet18.npz --reference ref.npz   # needs torch
    python examples/resnet18_infer.py resnet18.npz --images ref.npz              # does not

weights: an .npz of a PyTorch ResNet-18 state_dict (torchvision's key
names).  --images: an .npy array, or an .npz with an "images" array, of
shape (N, H, W, 3); uint8 images (0-255 RGB) are scaled and normalised with
the ImageNet mean and std, float images are used as given.  Without
--images a seeded random batch is classified.  Prints the top-5 classes of
each image and the time per batch.
"""
import argparse
import sys
import time

import numpy as np

from fastconv import models, nn

IMAGENET_MEAN = np.array([0.485, 0.456, 0.406], np.float32)
IMAGENET_STD = np.array([0.229, 0.224, 0.225], np.float32)


def load_images(path):
    if path.endswith(".npz"):
        with np.load(path) as archive:
            images = archive["images"]
    else:
        images = np.load(path)
    if images.ndim != 4 or images.shape[-1] != 3:
        sys.exit(f"{path}: expected (N, H, W, 3) images, got shape {images.shape}")
    if images.dtype == np.uint8:
        return ((images / np.float32(255) - IMAGENET_MEAN) / IMAGENET_STD).astype(np.float32)
    return images.astype(np.float32, copy=False)


def load_model(weights, fold_bn=True):
    """ResNet-18 (class count read from the weights) in eval mode, its
    batchnorms folded into the convolutions and their weights prepacked."""
    with np.load(weights) as archive:
        state = {name: archive[name] for name in archive.files}
    model = models.resnet18(num_classes=state["fc.weight"].shape[0])
    nn.load_torch_state_dict(model, state)
    model.eval()
    if fold_bn:
        nn.fold_batchnorms(model)
    return nn.prepack(model)  # inference only: pack every conv's weights once


def top_k(logits, k):
    """(classes, probabilities), each (N, k), most probable first."""
    shifted = logits - logits.max(axis=1, keepdims=True)
    probs = np.exp(shifted) / np.exp(shifted).sum(axis=1, keepdims=True)
    classes = np.argsort(-probs, axis=1)[:, :k]
    return classes, np.take_along_axis(probs, classes, axis=1)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("weights", help=".npz of a PyTorch ResNet-18 state_dict")
    parser.add_argument("--images", help=".npy or .npz (key 'images') NHWC batch")
    parser.add_argument("--batch", type=int, default=1, help="random batch size (no --images)")
    parser.add_argument("--image-size", type=int, default=224, help="random image size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--labels", help="text file of class names, one per line")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs after a warm-up")
    parser.add_argument("--no-fold-bn", action="store_true",
                        help="keep BatchNorm layers instead of folding them into the convs")
    parser.add_argument("--save-logits", help="write the logits to this .npy")
    parser.add_argument("--report-torch", action="store_true",
                        help="print whether torch got imported (it must not)")
    args = parser.parse_args(argv)

    model = load_model(args.weights, fold_bn=not args.no_fold_bn)
    if args.images:
        images = load_images(args.images)
    else:
        rng = np.random.default_rng(args.seed)
        images = rng.standard_normal((args.batch, args.image_size, args.image_size, 3),
                                     dtype=np.float32)
    labels = None
    if args.labels:
        with open(args.labels) as f:
            labels = [line.strip() for line in f]

    with nn.no_grad():
        logits = model(images)  # warm-up (first-touch allocations, thread start)
        times = []
        for _ in range(args.repeat):
            start = time.perf_counter()
            logits = model(images)
            times.append(time.perf_counter() - start)

    for n, (classes, probs) in enumerate(zip(*top_k(logits, 5))):
        print(f"image {n}:")
        for c, p in zip(classes, probs):
            name = labels[c] if labels else f"class {c}"
            print(f"  {p:7.2%}  {name}")
    if times:
        print(f"{images.shape[0]} x {images.shape[1]}x{images.shape[2]} images: "
              f"median {1e3 * np.median(times):.1f} ms per batch over {len(times)} runs "
              f"(BatchNorm {'kept' if args.no_fold_bn else 'folded'})")
    if args.save_logits:
        np.save(args.save_logits, logits)
    if args.report_torch:
        print(f"torch in sys.modules: {'torch' in sys.modules}")


if __name__ == "__main__":
    main()
