"""Layers, losses and an optimizer for NHWC networks, on fastconv's kernels
and numpy alone (no autograd: every layer implements its own backward).

Conventions
-----------
* Images are NHWC: ``(N, H, W, C)``.  Conv weights are ``(OC, KH, KW, C/groups)``
  (PyTorch's OIHW with the channel axis last); transposed-conv weights are
  ``(C_in, KH, KW, C_out/groups)``; Linear weights are ``(out_features,
  in_features)`` exactly as in PyTorch (the product reads the transpose in
  place, so keeping PyTorch's layout costs nothing and needs no conversion).
* ``layer(x)`` runs ``forward`` and remembers what ``backward`` needs;
  ``layer.backward(grad_output)`` returns the gradient with respect to the
  input and *adds* the parameter gradients to ``param.grad`` (as PyTorch
  does; ``zero_grad()`` resets them).  Each forward overwrites what the
  previous one saved, so a layer object appears once per network (use two
  ``ReLU()`` objects, not one called twice).  What is saved are references,
  not copies: do not modify a layer's input or output in place before its
  backward.  Under ``with no_grad():`` nothing is saved, which is what
  inference wants.
* Parameters are :class:`Parameter` objects (``.data``, ``.grad``).
  Attributes holding a Parameter or a Module are found automatically (in
  assignment order), which gives PyTorch's state_dict key names:
  ``conv1.weight``, ``layer1.0.bn1.running_mean``, ``fc.bias``...
* Every layer computes in the dtype of its parameters (``dtype=`` argument,
  float32 by default); feed it inputs of that dtype.

Example::

    import numpy as np
    from fastconv import nn

    model = nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1, rng=0), nn.BatchNorm2d(16), nn.ReLU(),
        nn.MaxPool2d(2), nn.Flatten(), nn.Linear(16 * 4 * 4, 10, rng=1))
    loss_fn = nn.CrossEntropyLoss()
    optimizer = nn.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)

    optimizer.zero_grad()
    loss = loss_fn(model(images), labels)          # images: (N, 8, 8, 1) float32
    model.backward(loss_fn.backward())
    optimizer.step()

    model.eval()
    with nn.no_grad():
        predictions = model(images).argmax(axis=1)
    model.save("digits.npz")
"""
import contextlib
import contextvars
import copy
import itertools
import math
import numbers
import os

import numpy as np

from . import _args, _dispatch
from ._threads import get_num_threads
from .conv import (PackedConv2d, conv2d, conv2d_backward, conv_transpose2d,
                   conv_transpose2d_backward)
from .gemm import dgemm, sgemm

__all__ = [
    "Parameter", "Module", "no_grad",
    "Conv2d", "ConvTranspose2d", "Linear", "ReLU", "ReLU6", "MaxPool2d", "AvgPool2d",
    "AdaptiveAvgPool2d", "BatchNorm2d", "Flatten", "Identity", "Sequential", "BasicBlock",
    "CrossEntropyLoss", "SGD",
    "fold_batchnorm", "fold_batchnorms", "prepack", "load_torch_state_dict",
    "to_torch_state_dict",
]


# ------------------------------------------------------------------ basics

class Parameter:
    """A trainable array and the gradient accumulated for it (None until a
    backward pass reaches it)."""
    __slots__ = ("data", "grad")

    def __init__(self, data):
        self.data = data
        self.grad = None

    @property
    def shape(self):
        return self.data.shape

    @property
    def dtype(self):
        return self.data.dtype

    def accumulate(self, grad):
        # The layers hand over freshly allocated gradients, so the first one
        # is kept as is and later ones are added into it in place.
        if self.grad is None:
            self.grad = grad
        else:
            self.grad += grad

    def __repr__(self):
        return f"Parameter(shape={self.shape}, dtype={self.dtype})"


_grad_enabled = contextvars.ContextVar("fastconv_nn_grad_enabled", default=True)


@contextlib.contextmanager
def no_grad():
    """Within this block layers save nothing for backward (inference needs
    no memory for activations); BatchNorm2d in training mode still updates
    its running statistics, as in PyTorch."""
    token = _grad_enabled.set(False)
    try:
        yield
    finally:
        _grad_enabled.reset(token)


def _join(prefix, name):
    return f"{prefix}.{name}" if prefix else name


def _check_input(x, layer, ndim=None, channels=None):
    """x as an ndarray; a ValueError naming x and the layer where its
    rank (ndim, None: any) or last axis (channels, None: any) is not the
    layer's."""
    x = np.asarray(x)
    if ndim is not None and x.ndim != ndim:
        raise ValueError(f"x must be {ndim}-D for {layer}; got shape {x.shape}")
    if channels is not None and (x.ndim == 0 or x.shape[-1] != channels):
        raise ValueError(f"x must have {channels} values along its last axis for {layer}; "
                         f"got shape {x.shape}")
    return x


def _rng(rng):
    """np.random.Generator from a seed, a Generator, or None (fresh entropy)."""
    return np.random.default_rng(rng)


def _kaiming_normal(shape, fan_in, dtype, rng):
    # He et al. 2015: std = sqrt(2 / fan_in) keeps the variance of ReLU
    # activations constant from layer to layer.
    return (_rng(rng).standard_normal(shape) * math.sqrt(2.0 / fan_in)).astype(dtype)


def _gemm(dtype):
    return sgemm if np.dtype(dtype) == np.float32 else dgemm


class Module:
    """Base class: parameter/child discovery, modes, gradients, state."""

    #: names of plain-array attributes that belong in the state_dict
    #: (BatchNorm's running statistics).
    _buffer_names = ()
    #: PyTorch stores some weights with other axis orders: for a parameter
    #: name, the transpose taking PyTorch's layout to this layer's.
    _from_torch_axes = {}

    training = True
    _saved = None

    def __call__(self, *args):
        return self.forward(*args)

    def forward(self, x):
        raise NotImplementedError

    def backward(self, grad_output):
        raise NotImplementedError

    # ------------------------------------------------ saving for backward

    def _save_for_backward(self, **arrays):
        self._saved = arrays if _grad_enabled.get() else None

    def _saved_for_backward(self):
        if self._saved is None:
            raise RuntimeError(f"{type(self).__name__}.backward() needs a forward() run "
                               "outside no_grad() first")
        return self._saved

    # ------------------------------------------------------- structure

    def named_children(self):
        """(name, module) for each direct sub-module, in assignment order."""
        return [(name, value) for name, value in vars(self).items() if isinstance(value, Module)]

    def named_modules(self, prefix=""):
        """(dotted name, module) for this module (named prefix) and every
        descendant, parents before children."""
        yield prefix, self
        for name, child in self.named_children():
            yield from child.named_modules(_join(prefix, name))

    def _own_parameters(self):
        return [(name, value) for name, value in vars(self).items()
                if isinstance(value, Parameter)]

    def _own_buffers(self):
        return [(name, getattr(self, name)) for name in self._buffer_names
                if getattr(self, name) is not None]

    def _own_state(self):
        parameters = [(name, param.data) for name, param in self._own_parameters()]
        return parameters + self._own_buffers()

    def _named(self, own):
        """(dotted name, item) for the items own(module) lists, over this
        module and its descendants."""
        for prefix, module in self.named_modules():
            for name, item in own(module):
                yield _join(prefix, name), item

    def named_parameters(self):
        """(dotted name, Parameter) for every parameter, PyTorch's names."""
        return self._named(Module._own_parameters)

    def parameters(self):
        """Every Parameter (give these to the optimizer)."""
        return [param for _, param in self.named_parameters()]

    def named_buffers(self):
        return self._named(Module._own_buffers)

    def _conv_bn_pairs(self):
        """(conv name, batchnorm name) pairs of children where forward feeds
        the conv's output straight into the batchnorm: what fold_batchnorms
        may fold.  Only the module's own forward knows its data flow."""
        return ()

    def _conv_relu_pairs(self):
        """(conv name, ReLU name) pairs of children where forward feeds the
        conv's output straight into the ReLU (through Identity at most):
        what prepack may fuse into one kernel call."""
        return ()

    # --------------------------------------------------------- modes etc.

    def train(self, mode=True):
        for _, module in self.named_modules():
            module.training = mode
            if mode:
                module._drop_packed_weights()
        return self

    def _drop_packed_weights(self):
        """Forget weights packed by prepack() (they may be about to change)."""

    def eval(self):
        return self.train(False)

    def zero_grad(self):
        for param in self.parameters():
            param.grad = None

    def astype(self, dtype):
        """Cast every parameter and buffer to dtype, in place; returns self.
        Drops what prepack() did: its packs hold the old dtype's weights."""
        for _, module in self.named_modules():
            for _, param in module._own_parameters():
                param.data = param.data.astype(dtype)
                param.grad = None
            for name, buffer in module._own_buffers():
                setattr(module, name, buffer.astype(dtype))
            module._drop_packed_weights()
        return self

    # ------------------------------------------------------------ state

    def state_dict(self):
        """{dotted name: array} of parameters and buffers (the arrays
        themselves, not copies), named as PyTorch names them."""
        return dict(self._named(Module._own_state))

    def load_state_dict(self, state_dict, strict=True):
        """Copy arrays into the parameters and buffers, in place and cast to
        their dtype.  With strict, missing or unexpected keys are an error;
        a shape mismatch always is."""
        targets = self.state_dict()
        if strict:
            missing = [k for k in targets if k not in state_dict]
            unexpected = [k for k in state_dict if k not in targets]
            if missing or unexpected:
                raise KeyError(f"load_state_dict: missing keys {missing}, "
                               f"unexpected keys {unexpected}")
        updates = [(name, target, np.asarray(state_dict[name]))
                   for name, target in targets.items() if name in state_dict]
        for name, target, value in updates:  # check everything before changing anything
            if value.shape != target.shape:
                raise ValueError(f"load_state_dict: {name} has shape {value.shape}, "
                                 f"the module expects {target.shape}")
        for _, target, value in updates:
            target[...] = value
        for _, module in self.named_modules():
            module._drop_packed_weights()

    def save(self, path):
        """Write the state_dict to an .npz file."""
        np.savez(path, **self.state_dict())

    def load(self, path):
        """Load a state_dict written by save()."""
        with np.load(path) as archive:
            self.load_state_dict({name: archive[name] for name in archive.files})
        return self

    # ------------------------------------------------------------- repr

    def extra_repr(self):
        return ""

    def __repr__(self):
        children = self.named_children()
        if not children:
            return f"{type(self).__name__}({self.extra_repr()})"
        lines = [f"  ({name}): " + repr(child).replace("\n", "\n  ") for name, child in children]
        return f"{type(self).__name__}(\n" + "\n".join(lines) + "\n)"


# ------------------------------------------------------------ convolutions

class _Conv(Module):
    """What Conv2d and ConvTranspose2d share: Kaiming-normal weight with
    fan_in = in_channels/groups * KH * KW, zero bias, and forward/backward
    through a fastconv function pair."""
    _from_torch_axes = {"weight": (0, 2, 3, 1)}  # kernel axes before the channel axis
    _forward_function = _backward_function = None  # set by the subclasses

    def __init__(self, in_channels, out_channels, kernel_size, stride, padding, dilation,
                 groups, bias, dtype, rng):
        kh, kw = _args.positive_pair(kernel_size, "kernel_size")
        groups = _args.positive_int(groups, "groups")
        if in_channels % groups or out_channels % groups:
            raise ValueError(f"groups={groups} must divide in_channels={in_channels} "
                             f"and out_channels={out_channels}")
        self.in_channels, self.out_channels = in_channels, out_channels
        self.kernel_size, self.padding, self.groups = (kh, kw), padding, groups
        self.stride = _args.positive_pair(stride, "stride")
        self.dilation = _args.positive_pair(dilation, "dilation")
        fan_in = in_channels // groups * kh * kw
        self.weight = Parameter(_kaiming_normal(self._weight_shape(), fan_in, dtype, rng))
        self.bias = Parameter(np.zeros(out_channels, dtype)) if bias else None

    def forward(self, x):
        self._save_for_backward(x=x)
        bias = None if self.bias is None else self.bias.data
        return self._forward_function(x, self.weight.data, bias, **self._geometry())

    def backward(self, grad_output):
        x = self._saved_for_backward()["x"]
        grad_x, grad_w, grad_b = self._backward_function(
            grad_output, x, self.weight.data, **self._geometry(),
            output_mask=(True, True, self.bias is not None))
        self.weight.accumulate(grad_w)
        if self.bias is not None:
            self.bias.accumulate(grad_b)
        return grad_x

    def extra_repr(self):
        geometry = ", ".join(f"{k}={v!r}" for k, v in self._geometry().items())
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
                f"{geometry}, bias={self.bias is not None}")


class Conv2d(_Conv):
    """2-D convolution of NHWC images, torch.nn.Conv2d's arguments.

    weight: (out_channels, KH, KW, in_channels/groups) (PyTorch's OIHW with
    the channel axis last), Kaiming normal (std = sqrt(2 / fan_in), fan_in =
    in_channels/groups * KH * KW); bias zero.  padding: any form
    fastconv.conv2d takes (int, pair, per-side pairs, "valid", "same");
    padding_mode: zeros/reflect/replicate/circular.  rng: seed or numpy
    Generator for the initial weights.
    """
    _forward_function = staticmethod(conv2d)
    _backward_function = staticmethod(conv2d_backward)

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0,
                 dilation=1, groups=1, bias=True, padding_mode="zeros", *,
                 dtype=np.float32, rng=None):
        self.padding_mode = _args.choice(padding_mode, "padding_mode", _args.PADDING_MODES)
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation,
                         groups, bias, dtype, rng)

    def _weight_shape(self):
        return (self.out_channels, *self.kernel_size, self.in_channels // self.groups)

    def _geometry(self):
        return dict(stride=self.stride, padding=self.padding, dilation=self.dilation,
                    groups=self.groups, padding_mode=self.padding_mode)

    def forward(self, x):
        packed = getattr(self, "_packed", None)
        if packed is None or self.training:
            return super().forward(x)
        self._save_for_backward(x=x)
        return packed(x)

    def _drop_packed_weights(self):
        self._packed = None


class ConvTranspose2d(_Conv):
    """2-D transposed convolution of NHWC images, torch.nn.ConvTranspose2d's
    arguments (zero padding only, as in PyTorch).

    weight: (in_channels, KH, KW, out_channels/groups) (PyTorch's (in,
    out/groups, KH, KW) with the channel axis last).  Kaiming normal with
    fan_in = in_channels/groups * KH * KW, the number of inputs each output
    sums at stride 1; bias zero.
    """
    _forward_function = staticmethod(conv_transpose2d)
    _backward_function = staticmethod(conv_transpose2d_backward)

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0,
                 output_padding=0, groups=1, bias=True, dilation=1, *,
                 dtype=np.float32, rng=None):
        self.output_padding = _args.int_pair(output_padding, "output_padding")
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation,
                         groups, bias, dtype, rng)

    def _weight_shape(self):
        return (self.in_channels, *self.kernel_size, self.out_channels // self.groups)

    def _geometry(self):
        return dict(stride=self.stride, padding=self.padding,
                    output_padding=self.output_padding, groups=self.groups,
                    dilation=self.dilation)


# ------------------------------------------------------------------ linear

class Linear(Module):
    """y = x @ weight.T + bias on fastconv's GEMM.

    weight: (out_features, in_features), PyTorch's layout (loads without
    conversion).  x: (..., in_features).  Kaiming normal (fan_in =
    in_features), zero bias.
    """

    def __init__(self, in_features, out_features, bias=True, *, dtype=np.float32, rng=None):
        self.in_features, self.out_features = in_features, out_features
        self.weight = Parameter(_kaiming_normal((out_features, in_features), in_features,
                                                dtype, rng))
        self.bias = Parameter(np.zeros(out_features, dtype)) if bias else None

    def forward(self, x):
        x = _check_input(x, self, channels=self.in_features)
        rows = x.reshape(-1, self.in_features)
        self._save_for_backward(rows=rows, in_shape=x.shape)
        y = _gemm(self.weight.dtype)(1.0, rows, self.weight.data, trans_b=True)
        if self.bias is not None:
            y += self.bias.data
        return y.reshape(*x.shape[:-1], self.out_features)

    def backward(self, grad_output):
        saved = self._saved_for_backward()
        gemm = _gemm(self.weight.dtype)
        grad_rows = np.asarray(grad_output).reshape(-1, self.out_features)
        self.weight.accumulate(gemm(1.0, grad_rows, saved["rows"], trans_a=True))
        if self.bias is not None:
            self.bias.accumulate(grad_rows.sum(axis=0))
        return gemm(1.0, grad_rows, self.weight.data).reshape(saved["in_shape"])

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}")


# -------------------------------------------------------- simple layers

class ReLU(Module):
    #: The conv epilogue's name for this function (fastconv.conv2d's
    #: activation=), which prepack() fuses into the conv before it.
    activation = "relu"
    #: Set by prepack() when the conv before applies this ReLU in its
    #: kernel's epilogue; then, in eval mode, forward passes x through.
    _fused = False

    def forward(self, x):
        y = x if self._fused and not self.training else self._function(x)
        self._save_for_backward(y=y)  # y > 0 where the input was
        return y

    @staticmethod
    def _function(x):
        return np.maximum(x, 0)

    def backward(self, grad_output):
        return grad_output * (self._saved_for_backward()["y"] > 0)

    def _drop_packed_weights(self):
        self._fused = False


class ReLU6(ReLU):
    """min(max(x, 0), 6), torch.nn.ReLU6 (MobileNet's activation); like
    ReLU, prepack() fuses it into a conv that feeds it.  The gradient flows
    where 0 < x < 6, not at NaN (like ReLU's; torch's varies there)."""
    activation = "relu6"

    @staticmethod
    def _function(x):
        return np.minimum(np.maximum(x, 0), 6)

    def backward(self, grad_output):
        y = self._saved_for_backward()["y"]
        return grad_output * ((y > 0) & (y < 6))


class Identity(Module):
    def forward(self, x):
        return x

    def backward(self, grad_output):
        return grad_output


class Flatten(Module):
    """(N, H, W, C) -> (N, H*W*C), in NHWC order.  PyTorch flattens NCHW as
    C*H*W: a Linear after a Flatten of a map larger than 1x1 needs its
    input columns permuted to take PyTorch weights."""

    def forward(self, x):
        self._save_for_backward(in_shape=x.shape)
        return x.reshape(x.shape[0], -1)

    def backward(self, grad_output):
        return grad_output.reshape(self._saved_for_backward()["in_shape"])


# ----------------------------------------------------------------- pooling

def _pool_pads(in_hw, kernel, stride, padding, dilation, ceil_mode):
    """((top, bottom), (left, right)) of a pool's padded input: padding on
    every side, and with ceil_mode the bottom/right overhang of a last
    window that runs past it (torch's rule: a window that starts inside the
    image or its top/left padding counts, even where the kernel is larger
    than the padded input)."""
    pads = []
    for size, k, s, p, d in zip(in_hw, kernel, stride, padding, dilation):
        extra = 0
        span = (k - 1) * d + 1
        if ceil_mode:
            out = -(-(size + 2 * p - span) // s) + 1
            if (out - 1) * s >= size + p:
                out -= 1
            # At most 0 where stride > kernel leaves the last pixels out.
            extra = max(0, (out - 1) * s + span - (size + 2 * p)) if out > 0 else 0
        pads.append((p, p + extra))
    return tuple(pads)


def _tap_windows(kernel, stride, dilation, out_hw):
    """For each kernel tap, the index of the padded-input pixels it reads,
    one per output pixel.  Pooling loops over these KH*KW taps, each a
    whole-batch strided slice, never over pixels."""
    (kh, kw), (sh, sw), (dh, dw), (oh, ow) = kernel, stride, dilation, out_hw
    for i in range(kh):
        for j in range(kw):
            yield (slice(None), slice(i * dh, i * dh + sh * (oh - 1) + 1, sh),
                   slice(j * dw, j * dw + sw * (ow - 1) + 1, sw))


def _pad_hw(x, pads, value):
    if pads == ((0, 0), (0, 0)):
        return x
    return np.pad(x, ((0, 0), *pads, (0, 0)), constant_values=value)


def _crop_hw(x, pads, in_hw):
    (top, _), (left, _) = pads
    return x[:, top:top + in_hw[0], left:left + in_hw[1]]


class _Pool2d(Module):
    def __init__(self, kernel_size, stride=None, padding=0, dilation=1, *, ceil_mode=False):
        self.kernel_size = _args.positive_pair(kernel_size, "kernel_size")
        self.stride = self.kernel_size if stride is None else _args.positive_pair(stride, "stride")
        self.padding = _args.int_pair(padding, "padding")
        self.dilation = _args.positive_pair(dilation, "dilation")
        if any(2 * p > k for p, k in zip(self.padding, self.kernel_size)):
            raise ValueError(f"padding {self.padding} must be at most half the kernel "
                             f"size {self.kernel_size}")
        self.ceil_mode = bool(ceil_mode)

    def _pads(self, in_hw):
        return _pool_pads(in_hw, self.kernel_size, self.stride, self.padding, self.dilation,
                          self.ceil_mode)

    def _windows(self, in_hw):
        """(output (OH, OW), _tap_windows for it)."""
        out_hw = _args.conv_output_hw(in_hw, self.kernel_size, self.stride, self._pads(in_hw),
                                      self.dilation, "kernel_size")
        return out_hw, _tap_windows(self.kernel_size, self.stride, self.dilation, out_hw)

    def _input_grad(self, in_shape, window_grads, dtype):
        """The adjoint of reading the windows: window_grads gives, tap by tap,
        the gradient of what that tap read; returns the input's gradient."""
        n, h, w, c = in_shape
        pads = self._pads((h, w))
        grad_padded = np.zeros((n, h + sum(pads[0]), w + sum(pads[1]), c), dtype)
        _, windows = self._windows((h, w))
        for window, grad in zip(windows, window_grads):
            # One tap's windows read distinct pixels, so this += never adds
            # twice into one element.
            grad_padded[window] += grad
        return _crop_hw(grad_padded, pads, (h, w))

    def extra_repr(self):
        return (f"kernel_size={self.kernel_size}, stride={self.stride}, "
                f"padding={self.padding}" + (", ceil_mode=True" if self.ceil_mode else ""))


class MaxPool2d(_Pool2d):
    """Max over KH x KW windows of NHWC images (torch.nn.MaxPool2d without
    return_indices; ceil_mode keyword-only): padding is -inf, ties go to
    the first tap in row-major order, a window of nothing but -inf to its
    first tap inside the image (its gradient with it, as torch's), NaN
    propagates.  stride defaults to kernel_size."""

    def forward(self, x):
        x = _check_input(x, self, ndim=4)
        if x.dtype not in (np.float32, np.float64):
            return self._forward_numpy(x)
        out_hw, _ = self._windows(x.shape[1:3])
        best = np.empty((x.shape[0], *out_hw, x.shape[3]), x.dtype)
        # Which tap won, for backward only (inference skips it).
        winner = np.empty(best.shape, np.uint16) if _grad_enabled.get() else None
        x = x if x.shape[3] <= 1 or x.strides[3] == x.itemsize else np.ascontiguousarray(x)
        _dispatch.kernels.max_pool2d(x, best, winner, self.kernel_size, self.stride,
                                     self.dilation, self.padding, get_num_threads())
        self._save_for_backward(winner=winner, in_shape=x.shape)
        return best

    def _forward_numpy(self, x):
        # Other dtypes: the max over KH*KW strided views of a padded copy.
        pads = self._pads(x.shape[1:3])
        padded = _pad_hw(x, pads, -np.inf)
        _, windows = self._windows(x.shape[1:3])
        best = padded[next(windows)].copy()
        # Which tap won, for backward only (inference skips it).
        winner = np.zeros(best.shape, np.uint16) if _grad_enabled.get() else None
        for tap, window in enumerate(windows, start=1):
            values = padded[window]
            if winner is not None:
                winner[(values > best) | np.isnan(values)] = tap
            np.maximum(best, values, out=best)  # propagates NaN
        if winner is not None:
            # Where no tap beat tap 0, which may be padding: the first tap
            # inside the image.
            inside = _pad_hw(np.ones((1, *x.shape[1:3], 1), np.uint8), pads, 0)
            first = np.zeros((1, *best.shape[1:3], 1), np.uint16)
            found = np.zeros(first.shape, bool)
            for tap, window in enumerate(self._windows(x.shape[1:3])[1]):
                new = ~found & (inside[window] > 0)
                first[new] = tap
                found |= new
            winner = np.where(winner == 0, first, winner)
        self._save_for_backward(winner=winner, in_shape=x.shape)
        return best

    def backward(self, grad_output):
        saved = self._saved_for_backward()
        winner, taps = saved["winner"], self.kernel_size[0] * self.kernel_size[1]
        grad_output = np.asarray(grad_output)
        if grad_output.shape != winner.shape:
            raise ValueError(f"grad_output must have the forward output's shape "
                             f"{winner.shape}; got {grad_output.shape}")
        if grad_output.dtype in (np.float32, np.float64):
            # Each value onto the pixel its winner read, in one pass (the
            # numpy adjoint below, a masked copy and a strided add per tap,
            # took ~13 % of train_digits.py's epoch).
            dx = np.zeros(saved["in_shape"], grad_output.dtype)
            _dispatch.kernels.max_pool2d_backward(
                np.ascontiguousarray(grad_output), np.ascontiguousarray(winner), dx,
                self.kernel_size, self.stride, self.dilation, self.padding, get_num_threads())
            return dx
        return self._input_grad(saved["in_shape"],
                                (np.where(winner == tap, grad_output, 0) for tap in range(taps)),
                                grad_output.dtype)

    def extra_repr(self):
        return super().extra_repr() + f", dilation={self.dilation}"


class AvgPool2d(_Pool2d):
    """Mean over KH x KW windows of NHWC images, torch.nn.AvgPool2d's
    arguments in its order.  count_include_pad: whether zero padding counts
    in the divisor (the overhang of ceil_mode's last windows never does);
    divisor_override: a fixed divisor instead.  stride defaults to
    kernel_size."""

    def __init__(self, kernel_size, stride=None, padding=0, ceil_mode=False,
                 count_include_pad=True, divisor_override=None):
        super().__init__(kernel_size, stride, padding, ceil_mode=ceil_mode)
        self.count_include_pad = bool(count_include_pad)
        self.divisor_override = (None if divisor_override is None else
                                 _args.positive_int(divisor_override, "divisor_override"))

    def _divisor(self, in_hw, dtype):
        """How many pixels each window averages: a scalar, or (OH, OW, 1)
        where windows differ (padding not counted, or ceil_mode's last
        windows, which count the padding but not what lies past it)."""
        if self.divisor_override is not None:
            return np.asarray(self.divisor_override, dtype)
        if self.count_include_pad and not self.ceil_mode:
            return np.asarray(self.kernel_size[0] * self.kernel_size[1], dtype)
        out_hw, _ = self._windows(in_hw)
        counts = []  # per axis: the window's overlap with what it averages
        for size, out, k, s, p in zip(in_hw, out_hw, self.kernel_size, self.stride, self.padding):
            start = np.arange(out) * s - p
            if self.count_include_pad:
                counts.append(np.minimum(start + k, size + p) - start)
            else:
                counts.append(np.clip(start + k, 0, size) - np.clip(start, 0, size))
        return np.multiply.outer(*counts)[..., None].astype(dtype)

    def forward(self, x):
        x = _check_input(x, self, ndim=4)
        padded = _pad_hw(x, self._pads(x.shape[1:3]), 0)
        _, windows = self._windows(x.shape[1:3])
        total = padded[next(windows)].copy()
        for window in windows:
            total += padded[window]
        self._save_for_backward(in_shape=x.shape)
        return total / self._divisor(x.shape[1:3], x.dtype)

    def backward(self, grad_output):
        in_shape = self._saved_for_backward()["in_shape"]
        share = grad_output / self._divisor(in_shape[1:3], grad_output.dtype)
        return self._input_grad(in_shape, itertools.repeat(share), grad_output.dtype)

    def extra_repr(self):
        return (super().extra_repr() + f", count_include_pad={self.count_include_pad}"
                + ("" if self.divisor_override is None
                   else f", divisor_override={self.divisor_override}"))


def _adaptive_pool_matrix(size, out, dtype):
    """(out, size) matrix averaging PyTorch's adaptive bins: output i covers
    input [floor(i*size/out), ceil((i+1)*size/out))."""
    i = np.arange(out)
    start = i * size // out
    end = -(-(i + 1) * size // out)
    pixel = np.arange(size)
    inside = (pixel >= start[:, None]) & (pixel < end[:, None])
    return (inside / (end - start)[:, None]).astype(dtype)


class AdaptiveAvgPool2d(Module):
    """Average NHWC images down to output_size (int or (OH, OW)), with
    PyTorch's bins.  Averaging is separable: rows then columns, each a
    small averaging matrix, which covers overlapping bins too."""

    def __init__(self, output_size):
        self.output_size = _args.positive_pair(output_size, "output_size")

    def _matrices(self, in_hw, dtype):
        return [_adaptive_pool_matrix(size, out, dtype)
                for size, out in zip(in_hw, self.output_size)]

    def forward(self, x):
        x = _check_input(x, self, ndim=4)
        self._save_for_backward(in_shape=x.shape)
        if self.output_size == (1, 1):
            # Global average pooling (every ResNet's head): one reduction.
            return x.mean(axis=(1, 2), keepdims=True)
        rows, cols = self._matrices(x.shape[1:3], x.dtype)
        return np.einsum("ih,nhwc,jw->nijc", rows, x, cols, optimize=True)

    def backward(self, grad_output):
        in_shape = self._saved_for_backward()["in_shape"]
        rows, cols = self._matrices(in_shape[1:3], grad_output.dtype)
        return np.einsum("ih,nijc,jw->nhwc", rows, grad_output, cols, optimize=True)

    def extra_repr(self):
        return f"output_size={self.output_size}"


# ----------------------------------------------------------- batch norm

class BatchNorm2d(Module):
    """Batch normalisation over the channel (last) axis of NHWC images,
    torch.nn.BatchNorm2d semantics.

    Training: normalise by the batch mean and biased variance, and update
    running_mean / running_var (unbiased variance) as (1 - momentum) *
    running + momentum * batch; momentum=None takes the cumulative average
    instead (momentum 1 / num_batches_tracked, the training batches counted
    so far; load_torch_state_dict sets the count, this module's own
    state_dict and save() do not keep it).  Evaluation: normalise by the
    running statistics (by the batch's if track_running_stats is False).
    Statistics and parameter gradients are summed in float64 whatever the
    dtype: float32 sums over many pixels lose digits.
    """
    _buffer_names = ("running_mean", "running_var")

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True,
                 track_running_stats=True, *, dtype=np.float32):
        self.num_features, self.eps, self.momentum = num_features, eps, momentum
        self.weight = Parameter(np.ones(num_features, dtype)) if affine else None
        self.bias = Parameter(np.zeros(num_features, dtype)) if affine else None
        self.running_mean = np.zeros(num_features, dtype) if track_running_stats else None
        self.running_var = np.ones(num_features, dtype) if track_running_stats else None
        self.num_batches_tracked = 0 if track_running_stats else None

    def _running_inv_std(self):
        return 1.0 / np.sqrt(self.running_var.astype(np.float64) + self.eps)

    def inference_scale_shift(self):
        """float64 per-channel (scale, shift) such that eval-mode output is
        x * scale + shift."""
        inv_std = self._running_inv_std()
        scale = inv_std if self.weight is None else inv_std * self.weight.data
        shift = -self.running_mean * scale
        return scale, shift if self.bias is None else shift + self.bias.data

    def forward(self, x):
        x = _check_input(x, self, channels=self.num_features)
        if not self.training and self.running_mean is not None:
            return self._forward_running_stats(x)
        if x.ndim and math.prod(x.shape[:-1]) == 1:
            raise ValueError(f"BatchNorm2d: batch statistics need more than one value per "
                             f"channel; got input shape {x.shape}")
        if x.dtype not in (np.float32, np.float64) or (
                self.weight is not None and self.weight.dtype != x.dtype):
            return self._forward_numpy(x)
        rows = np.ascontiguousarray(x).reshape(-1, self.num_features)
        count, nt = rows.shape[0], get_num_threads()
        kernels = _dispatch.kernels
        s1, s2 = np.empty(self.num_features), np.empty(self.num_features)
        kernels.channel_sums(rows, None, None, s1, s2, nt)
        mean = s1 / max(count, 1)
        kernels.channel_sums(rows, None, mean, s1, s2, nt)
        var = s1 / max(count, 1)
        inv_std = self._update_statistics(mean, var, count)
        normalized = np.empty_like(rows)
        y = None if self.weight is None else np.empty_like(rows)
        kernels.batchnorm_normalize(rows, mean, inv_std, normalized,
                                    None if y is None else self.weight.data,
                                    None if y is None else self.bias.data, y, nt)
        normalized = normalized.reshape(x.shape)
        self._save_for_backward(normalized=normalized, inv_std=inv_std, batch_stats=True)
        return normalized if y is None else y.reshape(x.shape)

    def _update_statistics(self, mean, var, count):
        """Training: the running statistics take the batch's mean and
        (unbiased) variance by momentum (an empty batch leaves them, as in
        torch, but is counted, as torch counts it).  Returns the batch's
        1/std."""
        if self.training and self.running_mean is not None:
            self.num_batches_tracked += 1
        if self.training and self.running_mean is not None and count:
            m = 1.0 / self.num_batches_tracked if self.momentum is None else self.momentum
            unbiased_var = var * count / max(count - 1, 1)
            self.running_mean[...] = (1 - m) * self.running_mean + m * mean
            self.running_var[...] = (1 - m) * self.running_var + m * unbiased_var
        return 1.0 / np.sqrt(var + self.eps)

    def _forward_numpy(self, x):
        # Other dtypes than the kernels' float32/float64, or x and weight apart.
        pixels = x.reshape(-1, self.num_features)
        count = pixels.shape[0]
        mean = pixels.sum(axis=0, dtype=np.float64) / max(count, 1)
        centered = x - mean.astype(x.dtype)
        var = (np.square(centered).reshape(pixels.shape).sum(axis=0, dtype=np.float64)
               / max(count, 1))
        inv_std = self._update_statistics(mean, var, count)
        normalized = centered
        normalized *= inv_std.astype(x.dtype)
        self._save_for_backward(normalized=normalized, inv_std=inv_std, batch_stats=True)
        if self.weight is None:
            return normalized
        return normalized * self.weight.data + self.bias.data

    def _forward_running_stats(self, x):
        scale, shift = self.inference_scale_shift()
        scale = scale.astype(x.dtype)
        self._save_for_backward(x=x, scale=scale, batch_stats=False)
        y = x * scale
        y += shift.astype(x.dtype)
        return y

    def _affine_grads(self, grad_rows, normalized_rows):
        """Per-channel sum(grad) and sum(grad * normalized) in float64;
        these are the bias and weight gradients."""
        if grad_rows.dtype in (np.float32, np.float64) and normalized_rows.dtype == grad_rows.dtype:
            grad_sum = np.empty(self.num_features)
            grad_dot_normalized = np.empty(self.num_features)
            _dispatch.kernels.channel_sums(grad_rows, normalized_rows, None, grad_sum,
                                           grad_dot_normalized, get_num_threads())
        else:
            grad_sum = grad_rows.sum(axis=0, dtype=np.float64)
            grad_dot_normalized = np.einsum("pc,pc->c", grad_rows, normalized_rows,
                                            dtype=np.float64)
        if self.weight is not None:
            self.weight.accumulate(grad_dot_normalized.astype(self.weight.dtype))
            self.bias.accumulate(grad_sum.astype(self.bias.dtype))
        return grad_sum, grad_dot_normalized

    def backward(self, grad_output):
        saved = self._saved_for_backward()
        grad_output = np.asarray(grad_output)
        # Contiguous once, for both passes of the kernels (normalized is).
        grad_rows = np.ascontiguousarray(grad_output).reshape(-1, self.num_features)
        dtype = grad_output.dtype
        if not saved["batch_stats"]:  # a fixed affine map per channel
            if self.weight is not None:
                inv_std = self._running_inv_std().astype(dtype)
                normalized = (saved["x"] - self.running_mean) * inv_std
                self._affine_grads(grad_rows,
                                   np.ascontiguousarray(normalized).reshape(grad_rows.shape))
            return grad_output * saved["scale"]
        normalized, inv_std = saved["normalized"], saved["inv_std"]
        count = grad_rows.shape[0]
        normalized_rows = normalized.reshape(grad_rows.shape)
        grad_sum, grad_dot_normalized = self._affine_grads(grad_rows, normalized_rows)
        gamma = 1.0 if self.weight is None else self.weight.data.astype(np.float64)
        # The gradient of gamma * (x - mean) / std, with mean and std taken
        # over the batch: remove the gradient's per-channel mean and its
        # projection on the normalised input, then scale.
        grad_mean = (grad_sum / max(count, 1)).astype(dtype)
        projection = (grad_dot_normalized / max(count, 1)).astype(dtype)
        scale = np.broadcast_to(gamma * inv_std, (self.num_features,)).astype(dtype)
        if dtype in (np.float32, np.float64) and normalized.dtype == dtype:
            grad_x = np.empty(grad_rows.shape, dtype)
            _dispatch.kernels.batchnorm_input_grad(grad_rows, normalized_rows, grad_mean,
                                                   projection, scale, grad_x, get_num_threads())
            return grad_x.reshape(grad_output.shape)
        grad_x = grad_output - grad_mean
        grad_x -= normalized * projection
        grad_x *= scale
        return grad_x

    def extra_repr(self):
        return (f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, "
                f"affine={self.weight is not None}, "
                f"track_running_stats={self.running_mean is not None}")


# ------------------------------------------------------------- containers

class Sequential(Module):
    """Runs its layers in order; backward runs their backwards in reverse.

    Sequential(a, b, c) names the children "0", "1", "2" (PyTorch's
    state_dict keys); Sequential({"conv1": a, "bn1": b}) names them by the
    dict's keys, in its order.
    """

    def __init__(self, *layers):
        if len(layers) == 1 and isinstance(layers[0], dict):
            named = layers[0].items()
        else:
            named = ((str(i), layer) for i, layer in enumerate(layers))
        for name, layer in named:
            self.append(layer, name)

    def append(self, layer, name=None):
        if not isinstance(layer, Module):
            raise TypeError(f"Sequential takes Modules; got {type(layer).__name__}")
        setattr(self, str(len(self)) if name is None else name, layer)
        return self

    def __len__(self):
        return len(self.named_children())

    def __iter__(self):
        return iter([layer for _, layer in self.named_children()])

    def __getitem__(self, index):
        return list(self)[index]

    def forward(self, x):
        for layer in self:
            x = layer(x)
        return x

    def backward(self, grad_output):
        for layer in reversed(list(self)):
            grad_output = layer.backward(grad_output)
        return grad_output

    def _conv_bn_pairs(self):
        children = self.named_children()
        return [(conv_name, bn_name)
                for (conv_name, conv), (bn_name, bn) in zip(children, children[1:])
                if isinstance(conv, Conv2d) and isinstance(bn, BatchNorm2d)]

    def _conv_relu_pairs(self):
        children = [(name, layer) for name, layer in self.named_children()
                    if not isinstance(layer, Identity)]
        return [(conv_name, relu_name)
                for (conv_name, conv), (relu_name, relu) in zip(children, children[1:])
                if isinstance(conv, Conv2d) and isinstance(relu, ReLU)]


class BasicBlock(Module):
    """ResNet-18/34's residual block (He et al. 2016), PyTorch's names:

        relu2(bn2(conv2(relu1(bn1(conv1(x))))) + shortcut(x))

    conv1 is 3x3 with the given stride, conv2 3x3, both without bias.
    shortcut is x, or downsample(x) when a downsample module is given (see
    BasicBlock.projection, needed when stride > 1 or the channels change).
    """

    def __init__(self, in_channels, out_channels, stride=1, downsample=None, *,
                 dtype=np.float32, rng=None):
        rng = _rng(rng)
        self.conv1 = Conv2d(in_channels, out_channels, 3, stride, 1, bias=False,
                            dtype=dtype, rng=rng)
        self.bn1 = BatchNorm2d(out_channels, dtype=dtype)
        self.relu1 = ReLU()
        self.conv2 = Conv2d(out_channels, out_channels, 3, 1, 1, bias=False,
                            dtype=dtype, rng=rng)
        self.bn2 = BatchNorm2d(out_channels, dtype=dtype)
        self.downsample = downsample
        self.relu2 = ReLU()

    @staticmethod
    def projection(in_channels, out_channels, stride=1, *, dtype=np.float32, rng=None):
        """The usual downsample: 1x1 conv (no bias) with the block's stride
        and a BatchNorm2d, as Sequential children "0" and "1"."""
        return Sequential(Conv2d(in_channels, out_channels, 1, stride, bias=False,
                                 dtype=dtype, rng=rng),
                          BatchNorm2d(out_channels, dtype=dtype))

    #: Set by prepack() when bn2 is folded away: in eval mode conv2 then
    #: adds the shortcut and applies relu2 in its kernel's epilogue (no sum
    #: array, no add and relu passes over it).
    _residual_fused = False

    def forward(self, x):
        shortcut = x if self.downsample is None else self.downsample(x)
        out = self.relu1(self.bn1(self.conv1(x)))
        packed = getattr(self.conv2, "_packed", None)
        if self._residual_fused and packed is not None and not self.training:
            self.conv2._save_for_backward(x=out)
            y = packed(out, residual=shortcut, activation="relu")
            self.relu2._save_for_backward(y=y)
            return y
        return self.relu2(self.bn2(self.conv2(out)) + shortcut)

    def _drop_packed_weights(self):
        self._residual_fused = False

    def backward(self, grad_output):
        grad_sum = self.relu2.backward(grad_output)
        grad = self.bn2.backward(grad_sum)
        grad = self.relu1.backward(self.conv2.backward(grad))
        grad_x = self.conv1.backward(self.bn1.backward(grad))
        grad_x += grad_sum if self.downsample is None else self.downsample.backward(grad_sum)
        return grad_x

    def _conv_bn_pairs(self):
        return [("conv1", "bn1"), ("conv2", "bn2")]

    def _conv_relu_pairs(self):
        # relu1(bn1(conv1(x))): straight through once bn1 is folded away.
        return [("conv1", "relu1")] if isinstance(self.bn1, Identity) else []


# ------------------------------------------------------------------- loss

class CrossEntropyLoss(Module):
    """Cross-entropy of (N, classes) logits against integer labels
    (torch.nn.CrossEntropyLoss): reduction "mean" (over the rows not
    ignored: NaN if all are), "sum" or "none" (one loss per row, 0 where
    ignored); rows whose label is ignore_index add nothing, to the loss or
    to the gradient.  loss(logits, labels) returns a float ("none": an (N,)
    array); backward(grad_output) returns the gradient with respect to the
    logits (grad_output: a scalar, or for "none" one per row)."""

    def __init__(self, ignore_index=-100, reduction="mean"):
        if reduction not in ("mean", "sum", "none"):
            raise ValueError(f"reduction must be 'mean', 'sum' or 'none'; got {reduction!r}")
        if isinstance(ignore_index, bool) or not isinstance(ignore_index, numbers.Integral):
            raise TypeError(f"ignore_index must be an integer; got {ignore_index!r}")
        self.ignore_index, self.reduction = int(ignore_index), reduction

    def forward(self, logits, labels):
        logits, labels = np.asarray(logits), np.asarray(labels)
        if logits.ndim != 2:
            raise ValueError(f"logits must be 2-D (N, classes); got shape {logits.shape}")
        if labels.shape != logits.shape[:1] or (labels.size and labels.dtype.kind not in "iu"):
            raise ValueError(f"labels must be {logits.shape[0]} integers (one per row of "
                             f"logits); got shape {labels.shape}, dtype {labels.dtype}")
        kept = labels != self.ignore_index
        classes = labels[kept]
        if classes.size and (classes.min() < 0 or classes.max() >= logits.shape[1]):
            raise ValueError(f"labels must be class indices in [0, {logits.shape[1]}) or "
                             f"ignore_index ({self.ignore_index}); got values from "
                             f"{classes.min()} to {classes.max()}")
        shifted = logits - logits.max(axis=1, keepdims=True)  # exp cannot overflow
        log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
        rows = np.flatnonzero(kept)
        self._save_for_backward(log_probs=log_probs, rows=rows, classes=classes)
        losses = -log_probs[rows, classes]
        if self.reduction == "none":
            out = np.zeros(len(labels), log_probs.dtype)
            out[rows] = losses
            return out
        if self.reduction == "sum":
            return float(losses.sum())
        return float(losses.mean()) if rows.size else float("nan")

    def backward(self, grad_output=1.0):
        saved = self._saved_for_backward()
        rows, classes = saved["rows"], saved["classes"]
        grad = np.zeros_like(saved["log_probs"])
        grad[rows] = np.exp(saved["log_probs"][rows])
        grad[rows, classes] -= 1
        if self.reduction == "none":
            grad_output = np.asarray(grad_output, grad.dtype)
            if grad_output.size not in (1, len(grad)):
                raise ValueError(f"grad_output must be a scalar or {len(grad)} values (one "
                                 f"per row); got shape {grad_output.shape}")
            grad *= grad_output.reshape(-1, 1)
        elif self.reduction == "mean":
            if rows.size:
                grad *= grad_output / rows.size
        else:
            grad *= grad_output
        return grad

    def extra_repr(self):
        return f"ignore_index={self.ignore_index}, reduction={self.reduction!r}"


# -------------------------------------------------------------- optimizer

class SGD:
    """Stochastic gradient descent with torch.optim.SGD's semantics:

        g = grad + weight_decay * param
        v = g (first step), then v = momentum * v + (1 - dampening) * g
        step = g + momentum * v if nesterov else v   (g if momentum == 0)
        param -= lr * step

    params: Parameters (module.parameters()); those without a gradient are
    skipped.  lr may be changed between steps.
    """

    def __init__(self, params, lr, momentum=0.0, dampening=0.0, weight_decay=0.0,
                 nesterov=False):
        if lr < 0 or momentum < 0 or weight_decay < 0:
            raise ValueError("lr, momentum and weight_decay must be non-negative")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("nesterov needs momentum > 0 and dampening = 0")
        self.params = list(params)
        self.lr, self.momentum, self.dampening = lr, momentum, dampening
        self.weight_decay, self.nesterov = weight_decay, nesterov
        self._velocity = [None] * len(self.params)

    def zero_grad(self):
        for param in self.params:
            param.grad = None

    def step(self):
        for i, param in enumerate(self.params):
            if param.grad is None:
                continue
            step = param.grad
            if self.weight_decay:
                step = step + self.weight_decay * param.data
            if self.momentum:
                velocity = self._velocity[i]
                if velocity is None:
                    velocity = self._velocity[i] = np.array(step, copy=True)
                else:
                    velocity *= self.momentum
                    velocity += (1 - self.dampening) * step
                step = step + self.momentum * velocity if self.nesterov else velocity
            param.data -= self.lr * step


# -------------------------------------------------- batchnorm folding

def fold_batchnorm(conv, bn):
    """A new Conv2d computing ``bn(conv(x))`` for bn in eval mode: the
    running statistics and affine parameters become a per-output-channel
    scale of the weight and a bias.  conv and bn are left unchanged."""
    if not isinstance(conv, Conv2d) or not isinstance(bn, BatchNorm2d):
        raise TypeError("fold_batchnorm takes a Conv2d and a BatchNorm2d")
    if bn.running_mean is None:
        raise ValueError("fold_batchnorm needs a BatchNorm2d with running statistics")
    if bn.num_features != conv.out_channels:
        raise ValueError(f"BatchNorm2d has {bn.num_features} features, the conv "
                         f"{conv.out_channels} output channels")
    scale, shift = bn.inference_scale_shift()
    dtype = conv.weight.dtype
    folded = copy.copy(conv)  # same geometry; fresh parameters, nothing saved
    folded._saved = None
    folded._drop_packed_weights()
    folded.weight = Parameter((conv.weight.data * scale[:, None, None, None]).astype(dtype))
    bias = shift if conv.bias is None else conv.bias.data * scale + shift
    folded.bias = Parameter(bias.astype(dtype))
    return folded


def prepack(model, algorithm="auto"):
    """Pack the weights of every Conv2d in model once for fastconv's
    kernels (fastconv.PackedConv2d: GEMM panels, or Winograd-domain filters
    for 3x3 stride-1 layers), for inference: in eval mode each call then
    skips repacking them, which for a deep layer at batch 1 costs about as
    much as the convolution.  A ReLU or ReLU6 that directly follows a conv
    (after fold_batchnorms, also conv -> batchnorm -> ReLU) is fused into
    the conv's kernel epilogue, applied while each output tile is in
    cache; so is a BasicBlock's relu2(conv2(.) + shortcut) once bn2 is
    folded.  The packs and fusions are dropped by train(), load_state_dict()
    and astype(); after changing weights any other way (an optimizer step in
    eval mode), call prepack again.  algorithm: "auto", or "tune" to time
    the algorithms at each conv's first call with an input shape (see
    PackedConv2d).  Returns model."""
    algorithm = _args.choice(algorithm, "algorithm", ("auto", "tune"))
    fused = {}    # id(conv) -> the activation its epilogue applies
    for _, module in model.named_modules():
        for conv_name, relu_name in module._conv_relu_pairs():
            relu = getattr(module, relu_name)
            fused[id(getattr(module, conv_name))] = relu.activation
            relu._fused = True
    for _, module in model.named_modules():
        if isinstance(module, Conv2d):
            bias = None if module.bias is None else module.bias.data
            module._packed = PackedConv2d(module.weight.data, bias, **module._geometry(),
                                          activation=fused.get(id(module)),
                                          algorithm=algorithm)
        elif isinstance(module, BasicBlock) and isinstance(module.bn2, Identity):
            module._residual_fused = True
    return model


def fold_batchnorms(model):
    """Fold every BatchNorm2d that directly follows a Conv2d (consecutive
    Sequential children, BasicBlock's conv/bn pairs) into the conv, in
    place; the batchnorms become Identity.  For inference: the result
    computes what model computes in eval mode, one pass over memory
    cheaper per convolution.  Drops what prepack() did (call it after).
    Returns model."""
    for _, module in list(model.named_modules()):
        for conv_name, bn_name in module._conv_bn_pairs():
            conv, bn = getattr(module, conv_name), getattr(module, bn_name)
            if (isinstance(conv, Conv2d) and isinstance(bn, BatchNorm2d)
                    and bn.running_mean is not None):
                setattr(module, conv_name, fold_batchnorm(conv, bn))
                setattr(module, bn_name, Identity())
    for _, module in model.named_modules():
        module._drop_packed_weights()     # a ReLU fused into a replaced conv
    return model


# ----------------------------------------------------- PyTorch weights

def _torch_layout_axes(module):
    """{state_dict key: axes taking PyTorch's layout to ours} for the
    parameters whose layouts differ."""
    return {_join(prefix, name): axes
            for prefix, child in module.named_modules()
            for name, axes in child._from_torch_axes.items()}


def _as_numpy(value):
    # Duck-typed so that fastconv never imports torch: a tensor is detached
    # and moved to the CPU before numpy reads it.
    if hasattr(value, "detach"):
        value = value.detach().cpu()
    return np.asarray(value)


def load_torch_state_dict(module, state_dict, strict=True):
    """Load PyTorch weights into a fastconv.nn module of the same structure.

    state_dict: a PyTorch state_dict (tensors or numpy arrays), any mapping
    of the same keys, or the path of an .npz holding one.  Keys are
    PyTorch's (``conv1.weight``, ``bn1.running_var``, ``layer1.0.conv2.weight``,
    ``fc.bias``...), which this module's own state_dict keys match when it
    is built like the PyTorch model (children named and ordered alike;
    Sequential children by index).  Conv weights are transposed from OIHW
    to OHWI (transposed convs from (I, O/g, KH, KW) to (I, KH, KW, O/g));
    Linear and BatchNorm tensors load as they are; BatchNorm's
    ``num_batches_tracked`` sets its count of training batches (which
    momentum=None averages over; absent, the count is left).  Values are
    cast to the module's dtype.  Returns module.

    Example (the exporting side needs torch, the loading side does not)::

        # with torch:
        np.savez("resnet18.npz", **{k: v.numpy() for k, v in torch_model.state_dict().items()})
        # without torch:
        from fastconv import models, nn
        model = nn.load_torch_state_dict(models.resnet18(), "resnet18.npz").eval()
        logits = model(images_nhwc)

    Flatten is NHWC-ordered: a Linear fed by a flattened map larger than
    1x1 needs its weight columns permuted from PyTorch's (C, H, W) order.
    """
    if isinstance(state_dict, (str, os.PathLike)):
        with np.load(state_dict) as archive:
            state = {name: archive[name] for name in archive.files}
    else:
        state = {name: _as_numpy(value) for name, value in state_dict.items()}
    counts = {name.rpartition(".")[0]: int(value) for name, value in state.items()
              if name.rsplit(".", 1)[-1] == "num_batches_tracked"}
    state = {name: value for name, value in state.items()
             if name.rsplit(".", 1)[-1] != "num_batches_tracked"}
    for name, axes in _torch_layout_axes(module).items():
        if name in state:
            if state[name].ndim != len(axes):
                raise ValueError(f"load_torch_state_dict: {name} must be {len(axes)}-D; "
                                 f"got shape {state[name].shape}")
            state[name] = state[name].transpose(axes)
    module.load_state_dict(state, strict=strict)
    for prefix, child in module.named_modules():
        if prefix in counts and getattr(child, "num_batches_tracked", None) is not None:
            child.num_batches_tracked = counts[prefix]
    return module


def to_torch_state_dict(module):
    """The module's state_dict as contiguous numpy arrays in PyTorch's
    layouts (the inverse of load_torch_state_dict): pass it through
    torch.from_numpy to load a PyTorch model of the same structure."""
    axes = _torch_layout_axes(module)
    return {name: np.ascontiguousarray(value.transpose(np.argsort(axes[name]))
                                       if name in axes else value)
            for name, value in module.state_dict().items()}
