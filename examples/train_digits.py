"""Train a small CNN on scikit-learn's 8x8 handwritten digits (bundled with
scikit-learn, nothing is downloaded) with fastconv.nn: forward, backward and
SGD in numpy + fastconv.

    python examples/train_digits.py              # fastconv
    python examples/train_digits.py --torch      # and the same CNN in PyTorch

The data are split 80/20 (stratified, seeded) and the test split is never
trained on.  With --torch, PyTorch trains the same network from the same
initial weights on the same batches, for a seconds-per-epoch comparison;
torch is imported only then.
"""
import argparse
import math
import time

import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from fastconv import nn


def load_data(seed):
    """(x_train, x_test, y_train, y_test): NHWC float32 images in [0, 1]."""
    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[..., None]  # (N, 8, 8, 1)
    return train_test_split(images, digits.target, test_size=0.2, stratify=digits.target,
                            random_state=seed)


def build_cnn(seed):
    """8x8x1 -> conv 32 -> conv 64 -> 2x2 max pool -> linear 10."""
    rng = np.random.default_rng(seed)
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1, rng=rng), nn.BatchNorm2d(32), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1, rng=rng), nn.BatchNorm2d(64), nn.ReLU(),
        nn.MaxPool2d(2), nn.Flatten(), nn.Linear(4 * 4 * 64, 10, rng=rng))


class FastconvTrainer:
    name = "fastconv"

    def __init__(self, model, x_train, x_test, lr, momentum, weight_decay):
        self.model, self.x_train, self.x_test = model, x_train, x_test
        self.loss_fn = nn.CrossEntropyLoss()
        self.optimizer = nn.SGD(model.parameters(), lr=lr, momentum=momentum,
                                weight_decay=weight_decay)

    def set_lr(self, lr):
        self.optimizer.lr = lr

    def train_step(self, batch, labels):
        """One SGD step on x_train[batch]: (loss, logits)."""
        self.model.train()
        logits = self.model(self.x_train[batch])
        loss = self.loss_fn(logits, labels)
        self.optimizer.zero_grad()
        self.model.backward(self.loss_fn.backward())
        self.optimizer.step()
        return loss, logits

    def test_logits(self):
        self.model.eval()
        with nn.no_grad():
            return self.model(self.x_test)


class TorchTrainer:
    """The same CNN, initial weights and optimizer in PyTorch (NCHW)."""
    name = "torch"

    def __init__(self, model, x_train, x_test, lr, momentum, weight_decay):
        import torch

        class FlattenNHWC(torch.nn.Module):
            # fastconv's Flatten order, so that the Linear weights carry over.
            def forward(self, x):
                return x.permute(0, 2, 3, 1).flatten(1)

        self.torch = torch
        self.model = torch.nn.Sequential(
            torch.nn.Conv2d(1, 32, 3, padding=1), torch.nn.BatchNorm2d(32), torch.nn.ReLU(),
            torch.nn.Conv2d(32, 64, 3, padding=1), torch.nn.BatchNorm2d(64), torch.nn.ReLU(),
            torch.nn.MaxPool2d(2), FlattenNHWC(), torch.nn.Linear(4 * 4 * 64, 10))
        self.model.load_state_dict({name: torch.from_numpy(value) for name, value
                                    in nn.to_torch_state_dict(model).items()}, strict=False)
        self.x_train, self.x_test = (torch.from_numpy(x).permute(0, 3, 1, 2).contiguous()
                                     for x in (x_train, x_test))
        self.loss_fn = torch.nn.CrossEntropyLoss()
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=lr, momentum=momentum,
                                         weight_decay=weight_decay)

    def set_lr(self, lr):
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def train_step(self, batch, labels):
        self.model.train()
        logits = self.model(self.x_train[self.torch.from_numpy(batch)])
        loss = self.loss_fn(logits, self.torch.from_numpy(labels))
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return loss.item(), logits.detach().numpy()

    def test_logits(self):
        self.model.eval()
        with self.torch.no_grad():
            return self.model(self.x_test).numpy()


class PlainProgress:
    """tqdm's interface, as one line rewritten in place."""

    def __init__(self, iterable, desc):
        self.iterable, self.desc, self.done, self.postfix = iterable, desc, 0, ""

    def __iter__(self):
        for self.done, item in enumerate(self.iterable, 1):
            yield item
        print()

    def set_postfix(self, **values):
        fields = ", ".join(f"{k}={v}" for k, v in values.items())
        print(f"\r{self.desc}: {self.done}/{len(self.iterable)} {fields}", end="", flush=True)


def progress_bar(iterable, desc):
    try:
        from tqdm import tqdm
    except ImportError:
        return PlainProgress(iterable, desc)
    return tqdm(iterable, desc=desc, leave=False)


def fit(trainer, y_train, y_test, epochs, batch_size, lr, seed, show_progress=True, log=print):
    """Train for epochs over seeded shuffles, the learning rate decaying
    from lr to 0 along a half cosine (one value per epoch); returns
    per-epoch lists of mean training loss, training accuracy, test accuracy
    and seconds."""
    history = {"loss": [], "train_accuracy": [], "test_accuracy": [], "seconds": []}
    rng = np.random.default_rng(seed)
    for epoch in range(1, epochs + 1):
        trainer.set_lr(lr * 0.5 * (1 + math.cos(math.pi * (epoch - 1) / epochs)))
        order = rng.permutation(len(y_train))
        starts = range(0, len(order), batch_size)
        if show_progress:
            starts = progress_bar(starts, f"{trainer.name} epoch {epoch}")
        loss_sum = correct = seen = 0
        start_time = time.perf_counter()
        for start in starts:
            batch = order[start:start + batch_size]
            loss, logits = trainer.train_step(batch, y_train[batch])
            loss_sum += loss * len(batch)
            correct += int((logits.argmax(axis=1) == y_train[batch]).sum())
            seen += len(batch)
            if show_progress:
                starts.set_postfix(loss=f"{loss_sum / seen:.4f}", acc=f"{correct / seen:.2%}")
        seconds = time.perf_counter() - start_time
        test_accuracy = float((trainer.test_logits().argmax(axis=1) == y_test).mean())
        for key, value in zip(history, (loss_sum / seen, correct / seen, test_accuracy, seconds)):
            history[key].append(value)
        log(f"{trainer.name} epoch {epoch:2d}: loss {loss_sum / seen:.4f}, "
            f"train acc {correct / seen:.2%}, test acc {test_accuracy:.2%}, {seconds:.2f} s")
    return history


def train(framework="fastconv", epochs=10, batch_size=32, lr=0.02, momentum=0.9,
          weight_decay=5e-4, seed=0, show_progress=True, log=print):
    """Train build_cnn(seed) with fastconv ("fastconv") or PyTorch ("torch");
    returns fit()'s history."""
    x_train, x_test, y_train, y_test = load_data(seed)
    model = build_cnn(seed)
    trainer_class = {"fastconv": FastconvTrainer, "torch": TorchTrainer}[framework]
    trainer = trainer_class(model, x_train, x_test, lr, momentum, weight_decay)
    return fit(trainer, y_train, y_test, epochs, batch_size, lr, seed, show_progress, log)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--torch", action="store_true",
                        help="also train the same CNN with PyTorch and compare epoch times")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)

    frameworks = ["fastconv", "torch"] if args.torch else ["fastconv"]
    results = {}
    for framework in frameworks:
        results[framework] = train(framework, args.epochs, args.batch_size, args.lr,
                                   seed=args.seed, show_progress=not args.no_progress)
    print()
    for framework, history in results.items():
        # The first epoch includes one-off costs (thread start-up, allocations).
        steady = history["seconds"][1:] or history["seconds"]
        which = "median after the first" if len(history["seconds"]) > 1 else "one epoch"
        print(f"{framework:>8}: final test accuracy {history['test_accuracy'][-1]:.2%}, "
              f"{np.median(steady):.3f} s per epoch ({which})")


if __name__ == "__main__":
    main()
