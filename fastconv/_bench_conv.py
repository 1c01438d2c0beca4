"""Convolution and ResNet-18 parts of ``python -m fastconv bench``, and what
benchmarks/bench_conv.py and bench_resnet18.py share with it: layer shapes,
the numpy im2col reference convolution, a one-line progress indicator and
the ratio bar chart.

Needs numpy only.  torch (a second reference) and matplotlib (``--plot``)
are used when they are importable; fastconv never requires them.
"""
import contextlib
import math
import os
import sys
import time
from typing import NamedTuple

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from . import _bench
from .conv import conv2d

# --------------------------------------------------------------- layers


class ConvSpec(NamedTuple):
    """A square convolution of an NHWC batch: symmetric zero padding, the
    same stride and dilation on both axes; weight (out_c, k, k, in_c/groups)."""
    name: str
    hw: int
    in_c: int
    out_c: int
    kernel: int
    stride: int = 1
    padding: int = 0
    dilation: int = 1
    groups: int = 1

    @property
    def out_hw(self):
        span = self.dilation * (self.kernel - 1) + 1
        return (self.hw + 2 * self.padding - span) // self.stride + 1

    @property
    def depthwise(self):
        return self.groups == self.in_c and self.in_c > 1

    def flops(self, batch):
        """2 * multiply-adds of the forward pass (each gradient costs the same)."""
        return (2.0 * batch * self.out_hw ** 2 * self.out_c * self.kernel ** 2
                * (self.in_c // self.groups))

    def output_bytes(self, batch, itemsize=4):
        return batch * self.out_hw ** 2 * self.out_c * itemsize

    def conv_kwargs(self):
        return dict(stride=self.stride, padding=self.padding, dilation=self.dilation,
                    groups=self.groups)

    def arrays(self, batch, seed=0, dtype=np.float32):
        """Seeded (x NHWC, weight (OC, KH, KW, C/groups), grad_output NHWC):
        the same for every process that asks (the benchmark's workers)."""
        rng = np.random.default_rng([seed, batch, self.hw, self.in_c, self.out_c, self.kernel,
                                     self.stride, self.dilation, self.groups])
        x = rng.standard_normal((batch, self.hw, self.hw, self.in_c), dtype=dtype)
        fan_in = self.kernel ** 2 * (self.in_c // self.groups)
        w = rng.standard_normal((self.out_c, self.kernel, self.kernel, self.in_c // self.groups),
                                dtype=dtype) * dtype(math.sqrt(2.0 / fan_in))
        dy = rng.standard_normal((batch, self.out_hw, self.out_hw, self.out_c), dtype=dtype)
        return x, w, dy


#: A few layers for ``python -m fastconv bench`` (batch 1).
QUICK_CONV_LAYERS = (
    ConvSpec("resnet conv1 7x7/2 3->64", 224, 3, 64, 7, 2, 3),
    ConvSpec("resnet 3x3 64->64 @56", 56, 64, 64, 3, 1, 1),
    ConvSpec("resnet 3x3 256->256 @14", 14, 256, 256, 3, 1, 1),
    ConvSpec("resnet 1x1 64->256 @56", 56, 64, 256, 1),
    ConvSpec("mobilenetv2 dw 3x3 32 @112", 112, 32, 32, 3, 1, 1, groups=32),
)


# ------------------------------------------------------- numpy reference

def numpy_conv2d(x, w, stride=1, padding=0, dilation=1, groups=1):
    """Textbook NHWC convolution in numpy: the im2col patch matrix from
    sliding_window_view + reshape (one copy), then np.matmul (numpy's BLAS).
    x (N, H, W, C), w (OC, KH, KW, C/groups); returns (N, OH, OW, OC)."""
    N, H, W, C = x.shape
    OC, KH, KW, Cg = w.shape
    if padding:
        x = np.pad(x, ((0, 0), (padding, padding), (padding, padding), (0, 0)))
    span_h, span_w = dilation * (KH - 1) + 1, dilation * (KW - 1) + 1
    # (N, OH, OW, C, KH, KW) view of every window
    windows = sliding_window_view(x, (span_h, span_w), axis=(1, 2))
    windows = windows[:, ::stride, ::stride, :, ::dilation, ::dilation]
    OH, OW = windows.shape[1:3]
    M = N * OH * OW
    if groups == 1:
        cols = windows.transpose(0, 1, 2, 4, 5, 3).reshape(M, KH * KW * C)
        return np.matmul(cols, w.reshape(OC, -1).T).reshape(N, OH, OW, OC)
    G, OCg = groups, OC // groups
    cols = (windows.reshape(N, OH, OW, G, Cg, KH, KW).transpose(3, 0, 1, 2, 5, 6, 4)
            .reshape(G, M, KH * KW * Cg))
    y = np.matmul(cols, w.reshape(G, OCg, KH * KW * Cg).transpose(0, 2, 1))   # (G, M, OCg)
    return y.transpose(1, 0, 2).reshape(N, OH, OW, OC)


# ------------------------------------------------------- torch helpers

@contextlib.contextmanager
def torch_inference(n):
    """torch on n threads, autograd off."""
    import torch
    with _bench.torch_threads(n), torch.inference_mode():
        yield


def torch_conv_call(torch, spec, x, w, channels_last):
    """Zero-argument torch.nn.functional.conv2d call on NCHW tensors of x
    and w (contiguous NCHW, or channels_last memory), and those tensors."""
    xt = torch.from_numpy(x).permute(0, 3, 1, 2)
    wt = torch.from_numpy(w).permute(0, 3, 1, 2)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    xt, wt = xt.contiguous(memory_format=fmt), wt.contiguous(memory_format=fmt)
    kwargs = spec.conv_kwargs()
    conv = torch.nn.functional.conv2d
    return (lambda: conv(xt, wt, None, **kwargs)), xt, wt


def torch_resnet18(torch):
    """torchvision's ResNet-18 structure in plain torch.nn, with the
    state_dict keys of fastconv.models.resnet18 (so that
    fastconv.nn.to_torch_state_dict loads into it)."""
    tnn = torch.nn

    class Block(tnn.Module):
        def __init__(self, cin, cout, stride):
            super().__init__()
            self.conv1 = tnn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.bn1 = tnn.BatchNorm2d(cout)
            self.conv2 = tnn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.bn2 = tnn.BatchNorm2d(cout)
            self.downsample = None
            if stride != 1 or cin != cout:
                self.downsample = tnn.Sequential(tnn.Conv2d(cin, cout, 1, stride, bias=False),
                                                 tnn.BatchNorm2d(cout))

        def forward(self, x):
            shortcut = x if self.downsample is None else self.downsample(x)
            out = torch.relu(self.bn1(self.conv1(x)))
            return torch.relu(self.bn2(self.conv2(out)) + shortcut)

    class ResNet18(tnn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = tnn.Conv2d(3, 64, 7, 2, 3, bias=False)
            self.bn1 = tnn.BatchNorm2d(64)
            self.maxpool = tnn.MaxPool2d(3, 2, 1)
            cin = 64
            for stage in range(4):
                cout = 64 << stage
                stride = 1 if stage == 0 else 2
                setattr(self, f"layer{stage + 1}",
                        tnn.Sequential(Block(cin, cout, stride), Block(cout, cout, 1)))
                cin = cout
            self.fc = tnn.Linear(512, 1000)

        def forward(self, x):
            x = self.maxpool(torch.relu(self.bn1(self.conv1(x))))
            x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
            return self.fc(torch.flatten(x.mean((2, 3)), 1))

    return ResNet18()


# ------------------------------------------------------- progress line

class Progress:
    """One status line on stderr, rewritten in place (only on a terminal:
    in a log it would be noise)."""

    def __init__(self, total, stream=None, enabled=None):
        self.total, self.done = total, 0
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.start = time.perf_counter()
        self._width = 0

    def step(self, label):
        """Announce the next item (``label``) and count the previous one done."""
        self.done += 1
        if self.enabled:
            text = (f"[{min(self.done, self.total)}/{self.total} "
                    f"{time.perf_counter() - self.start:4.0f} s] {label}")[:100]
            self.stream.write("\r" + text.ljust(self._width))
            self.stream.flush()
            self._width = len(text)

    def clear(self):
        if self.enabled and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self.stream.flush()
            self._width = 0


# ------------------------------------------------------- python -m fastconv bench

def cpu_count():
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def _numpy_threads_or_all(n):
    try:
        return _bench.numpy_threads(n)
    except ImportError:   # no threadpoolctl: OpenBLAS runs on all CPUs
        return contextlib.nullcontext()


def conv_comparison(use_torch=True, budget=0.15, rounds=2, pause=0.15, progress=None,
                    ratios=None):
    """Print fastconv.conv2d vs the numpy im2col reference (and torch
    channels_last) GFLOPS for QUICK_CONV_LAYERS at batch 1, on all CPUs.
    Appends (label, {other: fastconv/other}) to ``ratios``.  Returns True
    when every fastconv result matched the reference."""
    threads = cpu_count()
    torch = _bench.import_torch() if use_torch else None
    names = ["fastconv", "numpy im2col"] + (["torch CL"] if torch is not None else [])
    headers = ["layer", "HxW", "C->OC"] + names + [f"x {n}" for n in names[1:]] + ["rel err"]
    rows = []
    worst = 0.0
    for spec in QUICK_CONV_LAYERS:
        if progress is not None:
            progress.step(f"conv2d {spec.name}")
        x, w, _ = spec.arrays(1)
        kwargs = spec.conv_kwargs()
        calls = {"fastconv": (lambda: _bench.fastconv_threads(threads),
                              lambda: conv2d(x, w, None, **kwargs)),
                 "numpy im2col": (lambda: _numpy_threads_or_all(threads),
                                  lambda: numpy_conv2d(x, w, **kwargs))}
        if torch is not None:
            call, _, _ = torch_conv_call(torch, spec, x, w, channels_last=True)
            calls["torch CL"] = (lambda: torch_inference(threads), call)
        with _bench.fastconv_threads(threads):
            error = _bench.max_relative_error(conv2d(x, w, None, **kwargs),
                                              numpy_conv2d(x, w, **kwargs))
        worst = max(worst, error)
        blocks = [_bench.Block(name, enter, fn) for name, (enter, fn) in calls.items()]
        times = _bench.run_rounds(blocks, rounds=rounds, budget=budget, min_reps=4, pause=pause)
        rate = {name: spec.flops(1) / t.median / 1e9 for name, t in times.items()}
        x_other = {name: rate["fastconv"] / rate[name] for name in names[1:]}
        if ratios is not None:   # keyed like the GEMM table's ratios, for the plot
            ratios.append((f"conv {spec.name}", {name.split()[0]: x for name, x in x_other.items()}))
        rows.append([spec.name, f"{spec.hw}x{spec.hw}", f"{spec.in_c}->{spec.out_c}"]
                    + [f"{rate[n]:.1f}" for n in names] + [f"{x_other[n]:.2f}" for n in names[1:]]
                    + [f"{error:.1e}"])
    if progress is not None:
        progress.clear()
    print(f"\nconv2d, batch 1, float32, NHWC, {threads} threads: GFLOPS (median); "
          f"x = fastconv / other (> 1: fastconv faster)"
          + ("; torch CL = torch channels_last" if torch is not None else "") + "\n")
    print(_bench.format_table(headers, rows))
    print(f"\nlargest relative error of fastconv vs the numpy reference: {worst:.1e}")
    return worst < 1e-4


def resnet18_comparison(use_torch=True, budget=0.6, rounds=2, pause=0.2, progress=None,
                        ratios=None, image_size=224):
    """Print ResNet-18 inference latency at batch 1 (random weights, eval
    mode, batchnorms folded, weights prepacked): fastconv.nn vs torch
    (channels_last) when installed.  Appends ("ResNet-18", {...}) to
    ``ratios`` (fastconv speed / torch speed).  Returns True when the logits
    agree."""
    from . import models, nn
    threads = cpu_count()
    torch = _bench.import_torch() if use_torch else None
    if progress is not None:
        progress.step("ResNet-18: building")
    model = models.resnet18(rng=0).eval()
    torch_state = nn.to_torch_state_dict(model) if torch is not None else None
    nn.prepack(nn.fold_batchnorms(model))
    x = np.random.default_rng(1).standard_normal((1, image_size, image_size, 3),
                                                 dtype=np.float32)

    def fastconv_call():
        with nn.no_grad():
            return model(x)

    calls = {"fastconv": (lambda: _bench.fastconv_threads(threads), fastconv_call)}
    ok, error = True, None
    with _bench.fastconv_threads(threads):
        logits = fastconv_call()
    if torch is not None:
        tmodel = torch_resnet18(torch)
        tmodel.load_state_dict({k: torch.from_numpy(v) for k, v in torch_state.items()},
                               strict=False)
        tmodel = tmodel.eval().to(memory_format=torch.channels_last)
        xt = torch.from_numpy(x).permute(0, 3, 1, 2).contiguous(
            memory_format=torch.channels_last)
        calls["torch CL"] = (lambda: torch_inference(threads), lambda: tmodel(xt))
        with torch_inference(threads):
            expected = tmodel(xt).numpy()
        error = _bench.max_relative_error(logits, expected)
        ok = error < 1e-3
    if progress is not None:
        progress.step("ResNet-18: timing")
    blocks = [_bench.Block(name, enter, fn) for name, (enter, fn) in calls.items()]
    times = _bench.run_rounds(blocks, rounds=rounds, budget=budget, min_reps=4, pause=pause)
    if progress is not None:
        progress.clear()
    print(f"\nResNet-18 inference, batch 1, {image_size}x{image_size}, {threads} threads "
          f"(fastconv.nn: batchnorms folded, weights prepacked)\n")
    headers = ["system", "ms (median)", "ms (best)", "images/s"]
    rows = [[name, f"{t.median * 1e3:.1f}", f"{t.best * 1e3:.1f}", f"{1 / t.median:.1f}"]
            for name, t in times.items()]
    print(_bench.format_table(headers, rows))
    if "torch CL" in times:
        ratio = times["fastconv"].median / times["torch CL"].median
        print(f"latency fastconv / torch channels_last: {ratio:.2f} (< 1: fastconv faster); "
              f"logits max rel err {error:.1e}")
        if ratios is not None:
            ratios.append(("ResNet-18 b1", {"torch": 1 / ratio}))
    return ok


def plot_ratios(path, ratios):
    """Horizontal bar chart of fastconv / other speed ratios (log scale, 1 =
    parity).  ratios: [(label, {other: ratio})].  Returns False, with a
    message, when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"--plot: matplotlib is not installed, {path} not written "
              f"(pip install matplotlib)")
        return False
    others = sorted({name for _, r in ratios for name in r})
    labels = [label for label, _ in ratios]
    height = 0.8 / max(1, len(others))
    fig, ax = plt.subplots(figsize=(9, 0.25 * len(labels) * max(1, len(others)) + 1.5))
    for i, other in enumerate(others):
        ys = [row - 0.4 + height * (i + 0.5) for row in range(len(labels))]
        values = np.array([r.get(other, float("nan")) for _, r in ratios])
        # bars grow from parity (1) to the ratio: right = fastconv faster
        ax.barh(ys, values - 1.0, left=1.0, height=height, label=f"fastconv / {other}")
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xscale("log")
    from matplotlib.ticker import FormatStrFormatter
    ax.xaxis.set_major_formatter(FormatStrFormatter("%g"))
    ax.xaxis.set_minor_formatter(FormatStrFormatter("%g"))
    ax.set_yticks(range(len(labels)))
    ax.set_yticklabels(labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("speed ratio (> 1: fastconv faster)")
    ax.set_title(f"fastconv vs others on this machine ({cpu_count()} CPUs); numpy = OpenBLAS "
                 f"GEMM / im2col + matmul conv,\ntorch = matmul / channels_last conv and "
                 f"ResNet-18", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"plot written to {path}")
    return True
