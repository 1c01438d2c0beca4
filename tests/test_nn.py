"""fastconv.nn and fastconv.models: every layer's backward against central
differences and against PyTorch autograd (float64), BatchNorm statistics,
SGD against torch.optim.SGD, state_dict / save / load, PyTorch weight
loading, BatchNorm folding, and a whole ResNet-18 training step against
PyTorch."""
import importlib.util
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch

import fastconv
from fastconv import models, nn

REPO = pathlib.Path(fastconv.__file__).resolve().parents[1]
F64 = np.float64


def load_example(name):
    """An examples/ script imported as a module (its main() is not run)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def randn(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape)


def nchw(x):
    """NHWC numpy array -> NCHW tensor (other ranks unchanged)."""
    t = torch.from_numpy(np.ascontiguousarray(x))
    return t.permute(0, 3, 1, 2) if t.dim() == 4 else t


def nhwc(t):
    """NCHW tensor -> NHWC numpy array (other ranks unchanged)."""
    t = t.detach()
    return (t.permute(0, 2, 3, 1) if t.dim() == 4 else t).numpy()


def torch_copy(module, torch_module):
    """torch_module with module's parameters and buffers."""
    state = {k: torch.from_numpy(v) for k, v in nn.to_torch_state_dict(module).items()}
    torch_module.load_state_dict(state, strict=False)
    return torch_module


def grads_in_torch_layout(module):
    axes = nn._torch_layout_axes(module)
    return {name: (p.grad.transpose(np.argsort(axes[name])) if name in axes else p.grad)
            for name, p in module.named_parameters()}


# ------------------------------------------------------- layers under test

class Case:
    """A fastconv layer, the PyTorch module computing the same function
    (None if there is none to compare with), and an input shape (NHWC)."""

    def __init__(self, name, make, make_torch, shape, train=True):
        self.name, self.make, self.make_torch = name, make, make_torch
        self.shape, self.train = shape, train

    def __repr__(self):
        return self.name


class TorchBasicBlock(torch.nn.Module):
    """Created lazily from examples/export_torch_resnet18.py."""

    def __new__(cls, *args):
        return load_example("export_torch_resnet18").BasicBlock(*args).double()


def _bn_with_statistics(num_features, affine=True):
    bn = nn.BatchNorm2d(num_features, affine=affine, dtype=F64)
    bn.running_mean[:] = randn(num_features, seed=5) * 0.3
    bn.running_var[:] = 0.5 + np.random.default_rng(6).random(num_features)
    if affine:
        bn.weight.data[:] = 1 + randn(num_features, seed=7) * 0.2
        bn.bias.data[:] = randn(num_features, seed=8) * 0.2
    return bn


T = torch.nn
CASES = [
    Case("conv-stride2-pad1", lambda: nn.Conv2d(3, 4, 3, 2, 1, dtype=F64, rng=1),
         lambda: T.Conv2d(3, 4, 3, 2, 1).double(), (2, 7, 6, 3)),
    Case("conv-same-dilated-groups-nobias",
         lambda: nn.Conv2d(4, 6, (3, 2), 1, "same", 2, 2, bias=False, dtype=F64, rng=2),
         lambda: T.Conv2d(4, 6, (3, 2), 1, "same", 2, 2, bias=False).double(), (2, 7, 6, 4)),
    Case("conv-reflect", lambda: nn.Conv2d(3, 4, 3, padding=(1, 2), padding_mode="reflect",
                                           dtype=F64, rng=3),
         lambda: T.Conv2d(3, 4, 3, padding=(1, 2), padding_mode="reflect").double(),
         (2, 5, 6, 3)),
    Case("conv-circular-depthwise", lambda: nn.Conv2d(4, 8, 3, padding=1, groups=4,
                                                      padding_mode="circular", dtype=F64, rng=4),
         lambda: T.Conv2d(4, 8, 3, padding=1, groups=4, padding_mode="circular").double(),
         (2, 5, 5, 4)),
    Case("conv-transpose", lambda: nn.ConvTranspose2d(4, 6, 3, 2, 1, 1, groups=2,
                                                      dtype=F64, rng=5),
         lambda: T.ConvTranspose2d(4, 6, 3, 2, 1, 1, groups=2).double(), (2, 4, 3, 4)),
    Case("linear", lambda: nn.Linear(5, 3, dtype=F64, rng=6),
         lambda: T.Linear(5, 3).double(), (4, 5)),
    Case("linear-3d-input-nobias", lambda: nn.Linear(5, 3, bias=False, dtype=F64, rng=7),
         lambda: T.Linear(5, 3, bias=False).double(), (2, 3, 5)),
    Case("relu", nn.ReLU, T.ReLU, (2, 4, 5, 3)),
    Case("relu6", nn.ReLU6, T.ReLU6, (2, 4, 5, 3)),
    Case("maxpool-3-2-1", lambda: nn.MaxPool2d(3, 2, 1), lambda: T.MaxPool2d(3, 2, 1),
         (2, 7, 6, 3)),
    Case("maxpool-2", lambda: nn.MaxPool2d(2), lambda: T.MaxPool2d(2), (2, 6, 5, 3)),
    Case("maxpool-dilated", lambda: nn.MaxPool2d(2, 1, 1, dilation=2),
         lambda: T.MaxPool2d(2, 1, 1, dilation=2), (1, 5, 6, 2)),
    Case("avgpool-3-2-1", lambda: nn.AvgPool2d(3, 2, 1), lambda: T.AvgPool2d(3, 2, 1),
         (2, 7, 6, 3)),
    Case("avgpool-exclude-pad",
         lambda: nn.AvgPool2d((3, 2), (2, 1), (1, 1), count_include_pad=False),
         lambda: T.AvgPool2d((3, 2), (2, 1), (1, 1), count_include_pad=False), (2, 7, 6, 3)),
    # ceil_mode: last windows that overhang the bottom/right padding (3x3/2
    # padded by 1 over 8 rows: 5 windows, not 4), their divisors, and one
    # that would start in the bottom padding and is dropped (2x2/2 padded
    # by 1 over 5 rows: 3 windows, not 4).
    Case("maxpool-ceil", lambda: nn.MaxPool2d(3, 2, 1, ceil_mode=True),
         lambda: T.MaxPool2d(3, 2, 1, ceil_mode=True), (2, 8, 6, 3)),
    Case("maxpool-ceil-dilated", lambda: nn.MaxPool2d((2, 3), (3, 2), (1, 0), 2, ceil_mode=True),
         lambda: T.MaxPool2d((2, 3), (3, 2), (1, 0), 2, ceil_mode=True), (2, 9, 8, 2)),
    Case("avgpool-ceil", lambda: nn.AvgPool2d(3, 2, 1, True),
         lambda: T.AvgPool2d(3, 2, 1, True), (2, 8, 6, 3)),
    Case("avgpool-ceil-exclude-pad", lambda: nn.AvgPool2d((3, 2), 2, (1, 0), True, False),
         lambda: T.AvgPool2d((3, 2), 2, (1, 0), True, False), (2, 8, 7, 3)),
    Case("avgpool-divisor-override", lambda: nn.AvgPool2d(2, 2, 1, True, divisor_override=3),
         lambda: T.AvgPool2d(2, 2, 1, True, divisor_override=3), (2, 5, 6, 2)),
    # ceil_mode where the stride passes the kernel (no overhang: the last
    # pixel is in no window) and where the kernel is wider than the input
    # (one window that overhangs it; found by fuzzing against torch).
    Case("avgpool-ceil-stride-past-kernel", lambda: nn.AvgPool2d((1, 2), (1, 3), ceil_mode=True),
         lambda: T.AvgPool2d((1, 2), (1, 3), ceil_mode=True), (2, 3, 6, 2)),
    Case("maxpool-ceil-kernel-past-input", lambda: nn.MaxPool2d((2, 4), ceil_mode=True),
         lambda: T.MaxPool2d((2, 4), ceil_mode=True), (2, 3, 3, 2)),
    Case("avgpool-ceil-kernel-past-input", lambda: nn.AvgPool2d((2, 4), 2, (0, 1), True),
         lambda: T.AvgPool2d((2, 4), 2, (0, 1), True), (2, 3, 1, 2)),
    Case("adaptive-avgpool-1", lambda: nn.AdaptiveAvgPool2d(1),
         lambda: T.AdaptiveAvgPool2d(1), (2, 5, 4, 3)),
    Case("adaptive-avgpool-overlapping", lambda: nn.AdaptiveAvgPool2d((3, 4)),
         lambda: T.AdaptiveAvgPool2d((3, 4)), (2, 7, 5, 2)),
    Case("batchnorm-train", lambda: _bn_with_statistics(3),
         lambda: T.BatchNorm2d(3).double(), (4, 3, 5, 3)),
    Case("batchnorm-train-no-affine", lambda: _bn_with_statistics(3, affine=False),
         lambda: T.BatchNorm2d(3, affine=False).double(), (4, 3, 5, 3)),
    Case("batchnorm-eval", lambda: _bn_with_statistics(3),
         lambda: T.BatchNorm2d(3).double(), (4, 3, 5, 3), train=False),
    Case("flatten", nn.Flatten, None, (2, 3, 4, 2)),
    Case("basic-block-projection",
         lambda: nn.BasicBlock(4, 6, 2, nn.BasicBlock.projection(4, 6, 2, dtype=F64, rng=8),
                               dtype=F64, rng=9),
         lambda: TorchBasicBlock(4, 6, 2), (2, 6, 5, 4)),
    Case("basic-block-identity-eval", lambda: nn.BasicBlock(4, 4, dtype=F64, rng=10),
         lambda: TorchBasicBlock(4, 4), (2, 5, 5, 4), train=False),
    Case("sequential", lambda: nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1, dtype=F64, rng=11), nn.BatchNorm2d(4, dtype=F64),
        nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(16, 3, dtype=F64, rng=12)),
        None, (3, 4, 4, 2)),
]


def central_difference(f, array, coords, eps=1e-6):
    """d f() / d array at the flat coordinates coords (array is perturbed
    in place and restored)."""
    flat = array.reshape(-1)
    grads = []
    for i in coords:
        saved = flat[i]
        flat[i] = saved + eps
        up = f()
        flat[i] = saved - eps
        down = f()
        flat[i] = saved
        grads.append((up - down) / (2 * eps))
    return np.array(grads)


def some_coords(size, rng, at_most=24):
    return rng.choice(size, min(size, at_most), replace=False)


@pytest.mark.parametrize("case", CASES, ids=repr)
def test_backward_matches_central_differences(case):
    layer = case.make().train(case.train)
    x = randn(*case.shape, seed=1)
    weights = randn(*layer(x).shape, seed=2)  # the loss is sum(weights * layer(x))

    def loss():
        return float((layer(x) * weights).sum())

    layer.zero_grad()
    loss()
    grad_x = layer.backward(weights)
    analytic = {name: p.grad.copy() for name, p in layer.named_parameters()}
    rng = np.random.default_rng(3)
    coords = some_coords(x.size, rng)
    np.testing.assert_allclose(grad_x.reshape(-1)[coords],
                               central_difference(loss, x, coords), rtol=1e-5, atol=1e-7)
    for name, param in layer.named_parameters():
        coords = some_coords(param.data.size, rng)
        np.testing.assert_allclose(analytic[name].reshape(-1)[coords],
                                   central_difference(loss, param.data, coords),
                                   rtol=1e-5, atol=1e-7, err_msg=name)


@pytest.mark.parametrize("case", [c for c in CASES if c.make_torch], ids=repr)
def test_forward_and_backward_match_torch(case):
    layer = case.make().train(case.train)
    reference = torch_copy(layer, case.make_torch()).train(case.train)
    x = randn(*case.shape, seed=1)
    x_torch = nchw(x).requires_grad_()
    y_torch = reference(x_torch)
    y = layer(x)
    np.testing.assert_allclose(y, nhwc(y_torch), rtol=1e-10, atol=1e-12)

    grad_y = randn(*y.shape, seed=2)
    y_torch.backward(nchw(grad_y))
    np.testing.assert_allclose(layer.backward(grad_y), nhwc(x_torch.grad),
                               rtol=1e-9, atol=1e-11)
    torch_grads = dict(reference.named_parameters())
    for name, grad in grads_in_torch_layout(layer).items():
        np.testing.assert_allclose(grad, torch_grads[name].grad.numpy(), rtol=1e-9, atol=1e-11,
                                   err_msg=name)
    # Training-mode BatchNorms updated their running statistics alike.
    torch_state = reference.state_dict()
    for name, value in layer.named_buffers():
        np.testing.assert_allclose(value, torch_state[name].numpy(), rtol=1e-12, err_msg=name)


def test_cross_entropy_matches_torch():
    logits, labels = randn(6, 4), np.array([0, 3, 1, 1, 2, 0])
    loss_fn = nn.CrossEntropyLoss()
    logits_torch = torch.from_numpy(logits).requires_grad_()
    loss_torch = torch.nn.functional.cross_entropy(logits_torch, torch.from_numpy(labels))
    loss_torch.backward()
    assert loss_fn(logits, labels) == pytest.approx(loss_torch.item(), rel=1e-12)
    np.testing.assert_allclose(loss_fn.backward(), logits_torch.grad.numpy(), rtol=1e-12)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("ignore_index, labels", [
    (-100, [0, -100, 3, 1, -100, 2]),   # torch's default ignore_index
    (1, [0, 3, 1, 1, 2, 0]),            # a class index, ignored
    (-100, [-100] * 6),                 # every row ignored: mean is NaN
    (-100, [0, 3, 1, 1, 2, 0]),
])
def test_cross_entropy_ignore_index_and_reduction_match_torch(ignore_index, labels, reduction):
    logits, labels = randn(6, 4, seed=3), np.array(labels)
    loss_fn = nn.CrossEntropyLoss(ignore_index=ignore_index, reduction=reduction)
    logits_torch = torch.from_numpy(logits).requires_grad_()
    loss_torch = torch.nn.functional.cross_entropy(
        logits_torch, torch.from_numpy(labels), ignore_index=ignore_index, reduction=reduction)
    grad_output = randn(6, seed=4) if reduction == "none" else 0.7
    loss_torch.backward(torch.from_numpy(np.asarray(grad_output)))
    loss = loss_fn(logits, labels)
    np.testing.assert_allclose(loss, loss_torch.detach().numpy(), rtol=1e-12)
    assert np.isnan(loss).any() == (reduction == "mean" and (labels == ignore_index).all())
    np.testing.assert_allclose(loss_fn.backward(grad_output), logits_torch.grad.numpy(),
                               rtol=1e-12, atol=1e-300)
    assert "ignore_index" in repr(loss_fn)
    if reduction == "none":
        with pytest.raises(ValueError, match="^grad_output must be a scalar or 6 values"):
            loss_fn.backward(np.ones(5))
    with pytest.raises(TypeError, match="^ignore_index must be an integer"):
        nn.CrossEntropyLoss(ignore_index=1.5)


def test_float32_layers_compute_in_float32():
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, rng=0), nn.BatchNorm2d(4), nn.ReLU(),
                          nn.AvgPool2d(2), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(4, 2, rng=1))
    x = randn(2, 6, 6, 3).astype(np.float32)
    y = model(x)
    assert y.dtype == np.float32
    assert model.backward(np.ones_like(y)).dtype == np.float32
    assert all(p.grad.dtype == np.float32 for p in model.parameters())
    reference = model.astype(F64)(x.astype(F64))
    np.testing.assert_allclose(y, reference, rtol=1e-4, atol=1e-5)


def test_maxpool_ties_and_nan_follow_torch():
    x = np.zeros((1, 4, 4, 1))
    x[0, 1, 2, 0] = np.nan
    layer, reference = nn.MaxPool2d(2), torch.nn.MaxPool2d(2)
    x_torch = nchw(x).requires_grad_()
    y_torch = reference(x_torch)
    np.testing.assert_array_equal(layer(x), nhwc(y_torch))
    y_torch.backward(torch.ones_like(y_torch))
    np.testing.assert_array_equal(layer.backward(np.ones((1, 2, 2, 1))), nhwc(x_torch.grad))
    with pytest.raises(ValueError, match="grad_output"):
        layer.backward(np.ones((1, 2, 3, 1)))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_maxpool_window_of_only_minus_inf_starting_in_the_padding(dtype):
    """A window whose values are all -inf and whose first tap is padding:
    torch gives its gradient to the window's first pixel inside the image;
    fastconv gave it to tap 0, the padding, and lost it (found by fuzzing
    against torch)."""
    x = np.full((2, 3, 4, 3), -np.inf, dtype)
    x[0, 2, 0, 0] = 1.0
    x[1, 0, 3, 2] = np.nan
    for args in (((1, 2), (1, 2), (0, 1)), (3, 2, 1), ((2, 3), 1, (1, 1))):
        layer, reference = nn.MaxPool2d(*args), torch.nn.MaxPool2d(*args)
        x_torch = nchw(x).requires_grad_()
        y_torch = reference(x_torch)
        y = layer(x)
        np.testing.assert_array_equal(y, nhwc(y_torch))
        grad = randn(*y.shape, seed=3).astype(dtype)
        y_torch.backward(nchw(grad))
        np.testing.assert_array_equal(layer.backward(grad), nhwc(x_torch.grad))


@pytest.mark.parametrize("kernel, stride, padding", [(3, 2, 1), (2, 2, 0)])
@pytest.mark.parametrize("N", [1, 4])
def test_maxpool_backward_on_two_threads_matches_torch(kernel, stride, padding, N, request):
    """Large enough for 2 threads: overlapping windows (3x3/2) split by
    image, disjoint ones (2x2/2) by output row; against torch's gradient."""
    previous = fastconv.get_num_threads()
    request.addfinalizer(lambda: fastconv.set_num_threads(previous))
    fastconv.set_num_threads(2)
    x = randn(N, 56, 55, 64, seed=N).astype(np.float32)
    layer, reference = nn.MaxPool2d(kernel, stride, padding), torch.nn.MaxPool2d(kernel, stride,
                                                                                 padding)
    x_torch = nchw(x).requires_grad_()
    y_torch = reference(x_torch)
    np.testing.assert_array_equal(layer(x), nhwc(y_torch))
    grad = randn(*layer(x).shape, seed=7).astype(np.float32)
    y_torch.backward(nchw(grad))
    np.testing.assert_allclose(layer.backward(grad), nhwc(x_torch.grad), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kernel, stride, padding, dilation", [
    (3, 2, 1, 1), (2, 2, 0, 1), (3, 1, 1, 2), ((3, 2), (1, 2), (1, 0), 1), (1, 1, 0, 1),
    (2, 3, 0, 1), (9, 2, 4, 1)])                     # 81 taps
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("view", ["contiguous", "strided", "reversed"])
@pytest.mark.parametrize("channels", [21, 75])
@pytest.mark.parametrize("ceil_mode", [False, True])
def test_maxpool_kernel_equals_the_numpy_definition(kernel, stride, padding, dilation, dtype,
                                                    view, channels, ceil_mode):
    """The compiled max pool (fastconv._kernels max_pool2d and its
    backward) against the numpy formulation it replaced, bit for bit,
    values and winning taps (the gradient to rounding): ties (many equal
    values, +0 and -0), NaN, -inf and inf (windows of only -inf: their
    first tap inside the image wins, as in torch), odd sizes, views.  The
    inference pass (no winners) equals the training pass bit for bit; 75
    channels reach their blocks of four vectors and their one-vector and
    scalar tails on every ISA build."""
    rng = np.random.default_rng(2)
    base = rng.integers(-3, 3, (3, 11, 13, channels)).astype(dtype)   # many ties
    base[rng.random(base.shape) < 0.1] = -0.0
    base[0, 2, 3, 1] = np.nan
    base[1, 4, 4, 2] = -np.inf
    base[2, 5, 6, 3] = np.inf
    base[1, 7, 2, :] = np.nan                        # a whole pixel of NaN
    base[0, :3, :3, 4::66] = -np.inf                 # windows of nothing but -inf
    x = {"contiguous": base, "strided": base[:, ::2, 1::2, :17],
         "reversed": base[:, ::-1, ::-1]}[view]
    layer = nn.MaxPool2d(kernel, stride, padding, dilation, ceil_mode=ceil_mode)
    expected = layer._forward_numpy(x)
    winner_expected = layer._saved_for_backward()["winner"]
    got = layer(x)
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(layer._saved_for_backward()["winner"], winner_expected)
    # The backward kernel against the numpy adjoint (a masked copy and a
    # strided add per tap): bit for bit where windows are disjoint; a pixel
    # in several windows sums its values in another order there, so to
    # rounding.
    grad = rng.standard_normal(got.shape).astype(dtype)
    disjoint = all(s >= (k - 1) * d + 1 for s, k, d in zip(layer.stride, layer.kernel_size,
                                                          layer.dilation))
    tol = (dict(rtol=0, atol=0) if disjoint else dict(rtol=1e-6, atol=1e-6)
           if dtype == np.float32 else dict(rtol=1e-14, atol=1e-14))
    np.testing.assert_allclose(layer.backward(grad), layer._input_grad(
        x.shape, (np.where(winner_expected == t, grad, 0) for t in range(
            layer.kernel_size[0] * layer.kernel_size[1])), dtype), **tol)
    with nn.no_grad():
        inference = layer(x)
    np.testing.assert_array_equal(inference, expected)
    # numpy's maximum keeps either zero of a +0/-0 tie; fastconv's two
    # passes both keep the earlier tap's, bit for bit.
    bits = np.uint32 if dtype == np.float32 else np.uint64
    np.testing.assert_array_equal(inference.view(bits), got.view(bits))
    assert layer(x[:0]).shape == (0, *expected.shape[1:])



# ---------------------------------------------------------- batch norm

def test_batchnorm_running_statistics_and_eval_match_torch():
    bn, reference = nn.BatchNorm2d(5, momentum=0.3), torch.nn.BatchNorm2d(5, momentum=0.3)
    for step in range(4):
        x = (randn(8, 4, 3, 5, seed=step) * 3 + 2).astype(np.float32)
        np.testing.assert_allclose(bn(x), nhwc(reference(nchw(x))), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(bn.running_mean, reference.running_mean.numpy(), rtol=1e-5)
    np.testing.assert_allclose(bn.running_var, reference.running_var.numpy(), rtol=1e-5)
    bn.eval(), reference.eval()
    x = randn(2, 3, 3, 5, seed=9).astype(np.float32)
    np.testing.assert_allclose(bn(x), nhwc(reference(nchw(x))), rtol=1e-5, atol=1e-6)


def test_batchnorm_cumulative_average_matches_torch():
    """momentum=None: the running statistics are the average over the
    training batches so far (torch's cumulative moving average), and the
    count survives load_torch_state_dict, so training continues alike."""
    bn, reference = nn.BatchNorm2d(5, momentum=None), torch.nn.BatchNorm2d(5, momentum=None)
    for step in range(4):
        x = (randn(6 + step, 4, 3, 5, seed=step) * (step + 1) + step).astype(np.float32)
        np.testing.assert_allclose(bn(x), nhwc(reference(nchw(x))), rtol=1e-4, atol=1e-5)
    assert bn.num_batches_tracked == int(reference.num_batches_tracked) == 4
    np.testing.assert_allclose(bn.running_mean, reference.running_mean.numpy(), rtol=1e-5)
    np.testing.assert_allclose(bn.running_var, reference.running_var.numpy(), rtol=1e-5)
    resumed = nn.load_torch_state_dict(nn.BatchNorm2d(5, momentum=None), reference.state_dict())
    assert resumed.num_batches_tracked == 4
    x = (randn(3, 4, 3, 5, seed=11) * 5 - 2).astype(np.float32)
    resumed(x), reference(nchw(x))
    np.testing.assert_allclose(resumed.running_mean, reference.running_mean.numpy(), rtol=1e-5)
    np.testing.assert_allclose(resumed.running_var, reference.running_var.numpy(), rtol=1e-5)
    assert resumed.num_batches_tracked == 5
    resumed.eval(), reference.eval()
    x = randn(2, 3, 3, 5, seed=9).astype(np.float32)
    np.testing.assert_allclose(resumed(x), nhwc(reference(nchw(x))), rtol=1e-5, atol=1e-6)


def test_batchnorm_without_running_statistics_uses_batch_statistics_in_eval():
    bn = nn.BatchNorm2d(3, track_running_stats=False, dtype=F64).eval()
    y = bn(randn(4, 3, 3, 3) * 5 + 1)
    np.testing.assert_allclose(y.mean(axis=(0, 1, 2)), 0, atol=1e-12)
    assert "running_mean" not in bn.state_dict()


def _batchnorm_step(bn, x, grad):
    """y, grad_x and the parameter gradients of a training step of bn."""
    bn.zero_grad()
    y = bn(x)
    grad_x = bn.backward(grad)
    return y, grad_x, {name: p.grad.copy() for name, p in bn.named_parameters()}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape, view", [
    ((3, 11, 13, 75), "contiguous"),    # 429 pixels: a block of 256 and a short one
    ((5, 20, 30, 7), "reversed"),       # 3000 pixels, a negative-stride view
    ((2, 5, 7, 1), "contiguous"), ((1, 1, 2, 129), "contiguous"),
    ((4, 9, 10, 6), "channel-slice")])  # channels not contiguous
@pytest.mark.parametrize("affine", [True, False])
def test_batchnorm_training_step_matches_torch(dtype, shape, view, affine):
    """The compiled batch norm (channel sums in float64, the normalisation
    and the input gradient in one pass each) against torch in float64:
    output, gradients and running statistics, odd channel counts (vector
    tails), pixel counts across the 256-pixel summing blocks, views; inputs
    centred at 100 with a spread of 3, where a mean rounded to float32
    before the subtraction would lose digits."""
    rng = np.random.default_rng(4)
    n, h, w, c = shape
    base = rng.standard_normal((n, h, w, 2 * c if view == "channel-slice" else c)) * 3 + 100
    x = {"contiguous": base, "reversed": base[:, ::-1, ::-1],
         "channel-slice": base[..., ::2]}[view].astype(dtype)
    bn = nn.BatchNorm2d(c, momentum=0.2, affine=affine, dtype=dtype)
    if affine:
        bn.weight.data[:] = 1 + rng.standard_normal(c) * 0.3
        bn.bias.data[:] = rng.standard_normal(c)
    reference = torch_copy(bn, torch.nn.BatchNorm2d(c, momentum=0.2, affine=affine).double())
    grad = rng.standard_normal((n, h, w, c)).astype(dtype)
    y, grad_x, grads = _batchnorm_step(bn, x, grad)
    x_torch = nchw(x.astype(F64)).requires_grad_()
    y_torch = reference(x_torch)
    y_torch.backward(nchw(grad.astype(F64)))
    tol = dict(rtol=2e-5, atol=2e-5) if dtype == np.float32 else dict(rtol=1e-10, atol=1e-10)
    assert y.dtype == grad_x.dtype == dtype
    np.testing.assert_allclose(y, nhwc(y_torch), **tol)
    np.testing.assert_allclose(grad_x, nhwc(x_torch.grad), **tol)
    for name, p in reference.named_parameters():
        np.testing.assert_allclose(grads[name], p.grad.numpy(), **tol, err_msg=name)
    for name, value in bn.named_buffers():
        np.testing.assert_allclose(value, reference.state_dict()[name].numpy(), rtol=1e-6,
                                   err_msg=name)


def test_batchnorm_does_not_depend_on_the_thread_count(request):
    """Sums in fixed 256-pixel blocks, added in block order: one thread and
    two give the same bits (540,672 elements, enough for two threads)."""
    previous = fastconv.get_num_threads()
    request.addfinalizer(lambda: fastconv.set_num_threads(previous))
    x = (randn(4, 64, 64, 33, seed=5) * 2 + 7).astype(np.float32)
    grad = randn(4, 64, 64, 33, seed=6).astype(np.float32)
    steps = []
    for threads in (1, 2):
        fastconv.set_num_threads(threads)
        bn = nn.BatchNorm2d(33)
        bn.weight.data[:] = np.linspace(0.5, 1.5, 33)
        steps.append((*_batchnorm_step(bn, x, grad), bn.running_mean, bn.running_var))
    (y1, gx1, g1, m1, v1), (y2, gx2, g2, m2, v2) = steps
    for a, b in [(y1, y2), (gx1, gx2), (g1["weight"], g2["weight"]), (g1["bias"], g2["bias"]),
                 (m1, m2), (v1, v2)]:
        np.testing.assert_array_equal(a, b)


def test_batchnorm_numpy_path_and_views_agree_with_the_kernels():
    """float16 (which the kernels do not take) runs the numpy definition:
    a training step equals the float32 kernels' to float16 rounding.  In
    eval mode a transposed x and grad (not contiguous) give what their
    contiguous copies give, bit for bit."""
    rng = np.random.default_rng(12)
    x = rng.standard_normal((3, 6, 5, 7)) * 2 + 1
    grad = rng.standard_normal(x.shape)
    steps = {}
    for dtype in (np.float32, np.float16):
        bn = nn.BatchNorm2d(7, dtype=dtype)
        bn.weight.data[:] = np.linspace(0.5, 1.5, 7)
        y, grad_x, grads = _batchnorm_step(bn, x.astype(dtype), grad.astype(dtype))
        assert y.dtype == grad_x.dtype == dtype
        steps[dtype] = (y, grad_x, grads["weight"], grads["bias"], bn.running_var)
    for half, single in zip(steps[np.float16], steps[np.float32]):
        np.testing.assert_allclose(half.astype(np.float32), single, rtol=2e-2, atol=2e-2)
    bn.astype(np.float32).eval()
    view, grad_view = x.astype(np.float32).transpose(0, 2, 1, 3), grad.astype(
        np.float32).transpose(0, 2, 1, 3)
    assert not view.flags.c_contiguous
    results = []
    for images, g in ((view, grad_view), (view.copy(), grad_view.copy())):
        results.append(_batchnorm_step(bn, images, g))
    for a, b in zip(results[0][:2], results[1][:2]):
        np.testing.assert_array_equal(a, b)
    for name in ("weight", "bias"):
        np.testing.assert_array_equal(results[0][2][name], results[1][2][name])


def test_batchnorm_empty_batch_and_single_value_follow_torch():
    """An empty batch leaves the running statistics alone (torch does);
    one value per channel cannot give batch statistics (torch raises)."""
    for dtype in (np.float32, np.float16):
        bn = nn.BatchNorm2d(3, dtype=dtype)
        y = bn(np.zeros((0, 4, 4, 3), dtype))
        assert y.shape == (0, 4, 4, 3)
        assert bn.backward(np.zeros((0, 4, 4, 3), dtype)).shape == (0, 4, 4, 3)
        np.testing.assert_array_equal(bn.running_mean, 0)
        np.testing.assert_array_equal(bn.running_var, 1)
        with pytest.raises(ValueError, match="more than one value per channel"):
            bn(np.ones((1, 1, 1, 3), dtype))
    with pytest.raises(ValueError):
        torch.nn.BatchNorm2d(3)(torch.ones(1, 3, 1, 1))


@pytest.mark.parametrize("call, match", [
    (lambda: nn.BatchNorm2d(3)(np.ones((2, 6, 6, 4), np.float32)), r"^x must have 3 values"),
    (lambda: nn.BatchNorm2d(3).eval()(np.ones((2, 6, 6, 4), np.float32)),
     r"^x must have 3 values"),
    (lambda: nn.Linear(5, 3)(np.ones((2, 4), np.float32)), r"^x must have 5 values"),
    (lambda: nn.MaxPool2d(2)(np.ones((6, 6, 4), np.float32)), r"^x must be 4-D"),
    (lambda: nn.AvgPool2d(2)(np.ones((6, 6, 4), np.float32)), r"^x must be 4-D"),
    (lambda: nn.AdaptiveAvgPool2d(1)(np.ones((6, 6, 4), np.float32)), r"^x must be 4-D"),
    (lambda: nn.CrossEntropyLoss()(np.zeros(3), np.array([0])), r"^logits must be 2-D"),
    (lambda: nn.CrossEntropyLoss()(np.zeros((2, 3)), np.array([0])), r"^labels must be 2"),
    (lambda: nn.CrossEntropyLoss()(np.zeros((2, 3)), np.array([0.0, 1.0])),
     r"^labels must be 2"),
    # torch raises for -1 (and ignores -100, its ignore_index): numpy's
    # indexing took them as classes counted from the end (found by fuzzing)
    (lambda: nn.CrossEntropyLoss()(np.zeros((2, 3)), np.array([0, -1])),
     r"^labels must be class indices in \[0, 3\) or ignore_index \(-100\)"),
    (lambda: nn.CrossEntropyLoss(ignore_index=-1)(np.zeros((1, 150)), np.array([-100])),
     r"^labels must be class indices"),
    (lambda: nn.CrossEntropyLoss(reduction="avg"), r"^reduction must be"),
    (lambda: nn.CrossEntropyLoss()(np.zeros((2, 3)), np.array([0, 3])),
     r"^labels must be class indices"),
])
def test_layer_errors_name_the_input(call, match):
    """Mismatched inputs raise a ValueError naming the input and the layer,
    not numpy's broadcasting or reshape errors from inside the layer."""
    with pytest.raises(ValueError, match=match):
        call()


# ------------------------------------------------------------------ SGD

@pytest.mark.parametrize("options", [dict(momentum=0.9, weight_decay=1e-2),
                                     dict(momentum=0.8, dampening=0.3),
                                     dict(momentum=0.9, nesterov=True, weight_decay=5e-3),
                                     dict()], ids=str)
def test_sgd_matches_torch(options):
    model = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1, dtype=F64, rng=0),
                          nn.BatchNorm2d(4, dtype=F64), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(4, 3, dtype=F64, rng=1))
    reference = torch_copy(model, torch.nn.Sequential(
        torch.nn.Conv2d(2, 4, 3, padding=1), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(4, 3)).double())
    optimizer = nn.SGD(model.parameters(), lr=0.1, **options)
    torch_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, **options)
    loss_fn = nn.CrossEntropyLoss()
    for step in range(5):
        x, labels = randn(4, 5, 5, 2, seed=step), np.arange(4) % 3
        optimizer.zero_grad()
        loss = loss_fn(model(x), labels)
        model.backward(loss_fn.backward())
        optimizer.step()
        torch_optimizer.zero_grad()
        torch_loss = torch.nn.functional.cross_entropy(reference(nchw(x)),
                                                       torch.from_numpy(labels))
        torch_loss.backward()
        torch_optimizer.step()
        assert loss == pytest.approx(torch_loss.item(), rel=1e-10)
    for name, value in nn.to_torch_state_dict(model).items():
        np.testing.assert_allclose(value, reference.state_dict()[name].numpy(),
                                   rtol=1e-9, atol=1e-12, err_msg=name)


def test_gradients_accumulate_until_zero_grad():
    layer = nn.Linear(3, 2, dtype=F64, rng=0)
    x, g = randn(4, 3), randn(4, 2)
    layer(x)
    layer.backward(g)
    once = layer.weight.grad.copy()
    layer(x)
    layer.backward(g)
    np.testing.assert_allclose(layer.weight.grad, 2 * once)
    layer.zero_grad()
    assert layer.weight.grad is None and layer.bias.grad is None


def test_sgd_rejects_bad_settings():
    with pytest.raises(ValueError, match="nesterov"):
        nn.SGD([], lr=0.1, nesterov=True)
    with pytest.raises(ValueError):
        nn.SGD([], lr=-1)


# --------------------------------------------------- init, modes, state

def test_kaiming_init_is_seeded_and_scaled():
    a = nn.Conv2d(64, 128, 3, rng=0)
    b = nn.Conv2d(64, 128, 3, rng=np.random.default_rng(0))
    np.testing.assert_array_equal(a.weight.data, b.weight.data)
    assert a.weight.shape == (128, 3, 3, 64) and a.weight.dtype == np.float32
    assert a.weight.data.std() == pytest.approx(np.sqrt(2 / (64 * 9)), rel=0.02)
    assert not a.bias.data.any()
    grouped = nn.Conv2d(64, 128, 3, groups=4, rng=1)
    assert grouped.weight.data.std() == pytest.approx(np.sqrt(2 / (16 * 9)), rel=0.02)
    linear = nn.Linear(1000, 500, rng=2)
    assert linear.weight.data.std() == pytest.approx(np.sqrt(2 / 1000), rel=0.02)
    assert not np.array_equal(nn.Linear(10, 10, rng=1).weight.data,
                              nn.Linear(10, 10, rng=2).weight.data)


def test_train_eval_and_no_grad():
    model = models.resnet18(num_classes=10, rng=0)
    assert all(m.training for _, m in model.named_modules())
    model.eval()
    assert not any(m.training for _, m in model.named_modules())
    with nn.no_grad():
        model(randn(1, 32, 32, 3).astype(np.float32))
    with pytest.raises(RuntimeError, match="no_grad"):
        model.backward(np.ones((1, 10), np.float32))


def test_state_dict_names_follow_pytorch():
    model = models.resnet18(rng=0)
    reference = load_example("export_torch_resnet18").ResNet18()
    torch_keys = [k for k in reference.state_dict() if not k.endswith("num_batches_tracked")]
    assert list(model.state_dict()) == torch_keys
    assert sum(p.data.size for p in model.parameters()) == 11_689_512


def test_save_load_round_trip(tmp_path):
    model = models.resnet18(num_classes=10, rng=0)
    model.train()
    model(randn(2, 32, 32, 3).astype(np.float32))  # non-trivial running statistics
    model.save(tmp_path / "model.npz")
    restored = models.resnet18(num_classes=10, rng=1).load(tmp_path / "model.npz")
    for (name, a), (_, b) in zip(model.state_dict().items(), restored.state_dict().items()):
        np.testing.assert_array_equal(a, b, err_msg=name)
    x = randn(1, 32, 32, 3, seed=4).astype(np.float32)
    np.testing.assert_array_equal(model.eval()(x), restored.eval()(x))


def test_load_state_dict_errors():
    model = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm2d(2))
    state = model.state_dict()
    with pytest.raises(KeyError, match="missing keys \\['1.running_var'\\]"):
        model.load_state_dict({k: v for k, v in state.items() if k != "1.running_var"})
    with pytest.raises(KeyError, match="unexpected keys \\['extra'\\]"):
        model.load_state_dict({**state, "extra": np.zeros(1)})
    with pytest.raises(ValueError, match="0.weight has shape"):
        model.load_state_dict({**state, "0.weight": np.zeros((3, 2))})
    model.load_state_dict({"0.bias": np.array([1.0, 2.0])}, strict=False)
    np.testing.assert_array_equal(model[0].bias.data, [1, 2])
    assert model[0].bias.dtype == np.float32


# ------------------------------------------------------ PyTorch weights

def _random_torch_resnet18(num_classes):
    export = load_example("export_torch_resnet18")
    torch.manual_seed(0)
    reference = export.ResNet18(num_classes)
    export.randomize_batchnorms(reference, 32, seed=0)
    return reference.double()


def test_load_torch_state_dict_from_tensors_arrays_and_npz(tmp_path):
    reference = _random_torch_resnet18(10).float()
    state = reference.state_dict()
    np.savez(tmp_path / "weights.npz", **{k: v.numpy() for k, v in state.items()})
    x = randn(2, 40, 36, 3).astype(np.float32)
    with torch.no_grad():
        expected = reference(nchw(x)).numpy()
    sources = [state, {k: v.numpy() for k, v in state.items()}, tmp_path / "weights.npz",
               str(tmp_path / "weights.npz")]
    for source in sources:
        model = nn.load_torch_state_dict(models.resnet18(num_classes=10), source).eval()
        np.testing.assert_allclose(model(x), expected, rtol=1e-4, atol=1e-4 * abs(expected).max())
    round_trip = nn.to_torch_state_dict(model)
    for name, value in round_trip.items():
        np.testing.assert_array_equal(value, state[name].numpy(), err_msg=name)


def test_load_torch_state_dict_maps_transposed_conv_weights():
    reference = torch.nn.Sequential(torch.nn.ConvTranspose2d(4, 6, 3, 2, groups=2),
                                    torch.nn.Conv2d(6, 2, 2)).double()
    model = nn.Sequential(nn.ConvTranspose2d(4, 6, 3, 2, groups=2, dtype=F64),
                          nn.Conv2d(6, 2, 2, dtype=F64))
    nn.load_torch_state_dict(model, reference.state_dict())
    x = randn(2, 3, 4, 4)
    np.testing.assert_allclose(model(x), nhwc(reference(nchw(x))), rtol=1e-12)
    with pytest.raises(ValueError, match="0.weight must be 4-D"):
        nn.load_torch_state_dict(model, {**reference.state_dict(), "0.weight": np.zeros(3)})


def test_resnet18_training_step_matches_torch():
    """Train-mode forward, backward into every parameter, and one SGD step
    of the whole network, against PyTorch in float64."""
    reference = _random_torch_resnet18(10).train()
    model = nn.load_torch_state_dict(models.resnet18(num_classes=10, dtype=F64),
                                     reference.state_dict())
    x, labels = randn(2, 32, 32, 3, seed=1), np.array([3, 7])
    loss_fn = nn.CrossEntropyLoss()
    loss = loss_fn(model(x), labels)
    model.backward(loss_fn.backward())
    nn.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4).step()
    torch_loss = torch.nn.functional.cross_entropy(reference(nchw(x)), torch.from_numpy(labels))
    torch_loss.backward()
    torch_grads = {name: p.grad.numpy() for name, p in reference.named_parameters()}
    torch.optim.SGD(reference.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4).step()
    assert loss == pytest.approx(torch_loss.item(), rel=1e-10)
    for name, grad in grads_in_torch_layout(model).items():
        np.testing.assert_allclose(grad, torch_grads[name], rtol=1e-7,
                                   atol=1e-9 * abs(torch_grads[name]).max(), err_msg=name)
    for name, value in nn.to_torch_state_dict(model).items():
        expected = reference.state_dict()[name].numpy()
        np.testing.assert_allclose(value, expected, rtol=1e-7, atol=1e-9 * abs(expected).max(),
                                   err_msg=name)


# ---------------------------------------------------------- BN folding

def test_fold_batchnorm_matches_eval_mode():
    for bias in (False, True):
        conv = nn.Conv2d(3, 5, 3, 2, 1, bias=bias, dtype=F64, rng=0)
        if bias:
            conv.bias.data[:] = randn(5, seed=1)
        bn = _bn_with_statistics(5).eval()
        x = randn(2, 7, 6, 3, seed=2)
        folded = nn.fold_batchnorm(conv, bn)
        np.testing.assert_allclose(folded(x), bn(conv(x)), rtol=1e-12, atol=1e-12)
        assert folded.weight is not conv.weight  # the original is untouched
    with pytest.raises(TypeError):
        nn.fold_batchnorm(bn, conv)


def test_fold_batchnorms_in_a_resnet():
    model = nn.load_torch_state_dict(models.resnet18(num_classes=10, dtype=F64),
                                     _random_torch_resnet18(10).state_dict()).eval()
    x = randn(2, 32, 32, 3)
    expected = model(x)
    nn.fold_batchnorms(model)
    remaining = [name for name, m in model.named_modules() if isinstance(m, nn.BatchNorm2d)]
    assert remaining == []
    assert "layer2.0.downsample.0.bias" in model.state_dict()
    np.testing.assert_allclose(model(x), expected, rtol=1e-10, atol=1e-10 * abs(expected).max())


# ------------------------------------------------------------ no torch

def test_fastconv_nn_and_models_do_not_import_torch():
    code = ("import sys, fastconv, fastconv.nn, fastconv.models; "
            "fastconv.models.resnet18(num_classes=2); print('torch' in sys.modules)")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    result = subprocess.run([sys.executable, "-c", code], env=env, cwd=str(REPO),
                            capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip() == "False"


def test_prepack_matches_and_is_dropped_when_weights_may_change():
    rng = np.random.default_rng(5)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, rng=1), nn.ReLU(),
                          nn.Conv2d(8, 4, 3, stride=2, groups=2, rng=2))
    x = rng.standard_normal((2, 9, 9, 3)).astype(np.float32)
    model.eval()
    expected = model(x)
    nn.prepack(model)
    assert all(m._packed is not None for m in (model[0], model[2]))
    np.testing.assert_array_equal(model(x), expected)
    # New weights through load_state_dict: the packs must not outlive them.
    state = {k: v * 2 for k, v in model.state_dict().items()}
    model.load_state_dict(state)
    assert model[0]._packed is None
    fresh = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, rng=7), nn.ReLU(),
                          nn.Conv2d(8, 4, 3, stride=2, groups=2, rng=8))
    fresh.load_state_dict(state)
    fresh.eval()
    np.testing.assert_array_equal(model(x), fresh(x))
    assert not np.allclose(model(x), expected)
    nn.prepack(model)
    model.train()
    assert model[0]._packed is None and model[2]._packed is None
    # A cast too: the float32 packs would refuse float64 images (found by
    # fuzzing: "weight has dtype float32").
    model.eval()
    nn.prepack(model)
    model.astype(np.float64)
    assert model[0]._packed is None
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(model(x64), fresh.astype(np.float64)(x64), rtol=1e-12)


def test_basic_block_fused_residual_matches_and_keeps_its_backward():
    """After fold_batchnorms + prepack, an eval BasicBlock adds its shortcut
    and applies relu2 in conv2's epilogue: the same result as the separate
    add and ReLU (projection shortcut too), and a backward through it still
    gives the unfused block's gradient."""
    rng = np.random.default_rng(8)
    for block in (nn.BasicBlock(16, 16, rng=1),
                  nn.BasicBlock(8, 16, 2, nn.BasicBlock.projection(8, 16, 2, rng=2), rng=3)):
        x = rng.standard_normal((2, 12, 12, block.conv1.in_channels)).astype(np.float32)
        for bn in (block.bn1, block.bn2):
            bn.running_mean[...] = rng.standard_normal(16)
            bn.running_var[...] = rng.random(16) + 0.5
        block.eval()
        nn.fold_batchnorms(block)
        expected = block(x)
        grad_out = rng.standard_normal(expected.shape).astype(np.float32)
        expected_grad = block.backward(grad_out)
        nn.prepack(block)
        assert block._residual_fused
        got = block(x)
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
        assert (got >= 0).all() and (got == 0).any()
        np.testing.assert_allclose(block.backward(grad_out), expected_grad, rtol=1e-4,
                                   atol=1e-4)


def test_relu6_clamps_both_ends_and_fuses_into_the_conv():
    """ReLU6 against torch over inputs well past 6 (values, gradient zero
    outside (0, 6); NaN kept, its gradient 0: torch's is 0 in its vector
    loop and passes through in its scalar tail), and prepack's fusion of it
    into the conv before it (activation "relu6" in the epilogue) against
    the unfused model."""
    x = randn(2, 4, 5, 3, seed=3) * 8
    layer, x_torch = nn.ReLU6(), nchw(x).requires_grad_()
    y_torch = torch.nn.ReLU6()(x_torch)
    y = layer(x)
    np.testing.assert_array_equal(y, nhwc(y_torch))
    assert (y == 6).any() and (y == 0).any()
    grad = randn(*x.shape, seed=4)
    y_torch.backward(nchw(grad))
    np.testing.assert_array_equal(layer.backward(grad), nhwc(x_torch.grad))
    assert np.isnan(layer(np.full(3, np.nan))).all()
    np.testing.assert_array_equal(layer.backward(np.ones(3)), 0)
    rng = np.random.default_rng(9)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, rng=1), nn.ReLU6(),
                          nn.Conv2d(8, 8, 3, padding=1, groups=8, rng=2), nn.ReLU6())
    images = (rng.standard_normal((2, 9, 9, 3)) * 6).astype(np.float32)
    model.eval()
    expected = model(images)
    assert (expected == 6).any()
    nn.prepack(model)
    assert model[1]._fused and model[3]._fused
    assert model[0]._packed.activation == model[2]._packed.activation == "relu6"
    np.testing.assert_allclose(model(images), expected, rtol=1e-5, atol=1e-5)


def test_prepack_fuses_conv_relu_and_undoes_it_safely():
    """prepack fuses a ReLU fed straight by a conv (through a folded
    batchnorm) into the conv's epilogue; train(), load_state_dict and
    fold_batchnorms undo it, so no ReLU is ever skipped for a conv that
    does not apply it."""
    rng = np.random.default_rng(6)
    block = nn.BasicBlock(16, 16, rng=3)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, rng=4), nn.BatchNorm2d(16), nn.ReLU(),
                          block)
    for bn in (model[1], block.bn1, block.bn2):
        bn.running_mean[...] = rng.standard_normal(16)
        bn.running_var[...] = rng.random(16) + 0.5
    x = rng.standard_normal((2, 12, 12, 3)).astype(np.float32)
    model.eval()
    expected = model(x)
    nn.prepack(model)                                  # BN not folded: nothing to fuse
    assert not model[2]._fused and not block.relu1._fused
    nn.fold_batchnorms(model)
    assert model[0]._packed is None                   # folding drops the packs
    nn.prepack(model)
    assert model[2]._fused and block.relu1._fused and not block.relu2._fused
    assert model[0]._packed.activation == "relu" and block.conv1._packed.activation == "relu"
    assert block.conv2._packed.activation is None
    np.testing.assert_allclose(model(x), expected, rtol=1e-4, atol=1e-4)
    nn.fold_batchnorms(model)                          # nothing left to fold; still drops
    assert not model[2]._fused and model[0]._packed is None
    np.testing.assert_allclose(model(x), expected, rtol=1e-4, atol=1e-4)
    nn.prepack(model)
    assert block._residual_fused                      # bn2 folded: relu2(conv2 + x) fused
    model.train()
    assert not model[2]._fused and not block.relu1._fused and not block._residual_fused
