"""PyTorch bridge: fastconv's convolution as a torch.autograd.Function and a
drop-in torch.nn.Conv2d.  Importing this module imports torch; nothing else
in fastconv does.

    from fastconv.torch import FastConv2d
    conv = FastConv2d(16, 32, 3, padding=1)    # torch.nn.Conv2d's arguments
    y = conv(x)                                # x: (N, C, H, W) CPU tensor

Tensors are shared with numpy, not copied: inputs are read in place (any
strides), and outputs and gradients come back as NCHW tensors over NHWC
(channels_last) memory, which is what fastconv computes.
"""
import torch
from torch.autograd.function import once_differentiable

from .conv import conv2d, conv2d_backward

__all__ = ["Conv2dFunction", "FastConv2d", "conv2d_function"]

_DTYPES = (torch.float32, torch.float64)


def _as_numpy(tensor, name):
    if tensor.device.type != "cpu":
        raise ValueError(f"fastconv runs on the CPU; {name} is on {tensor.device}")
    if tensor.dtype not in _DTYPES:
        raise TypeError(f"fastconv supports float32 and float64; {name} is {tensor.dtype}")
    # .numpy() keeps the strides; fastconv copies only what its kernels
    # cannot read in place.
    return tensor.detach().numpy()


def _as_tensor(array):
    return None if array is None else torch.from_numpy(array)


class Conv2dFunction(torch.autograd.Function):
    """torch.nn.functional.conv2d computed by fastconv (NCHW, float32 or
    float64, CPU).  apply(x, weight, bias, stride, padding, dilation,
    groups, padding_mode); bias may be None.  Only the gradients autograd
    asks for are computed.  First derivatives only."""

    @staticmethod
    def forward(ctx, x, weight, bias, stride, padding, dilation, groups, padding_mode):
        geometry = dict(stride=stride, padding=padding, dilation=dilation, groups=groups,
                        padding_mode=padding_mode, layout="NCHW")
        ctx.geometry = geometry
        ctx.has_bias = bias is not None
        ctx.save_for_backward(x, weight)
        y = conv2d(_as_numpy(x, "input"), _as_numpy(weight, "weight"),
                   None if bias is None else _as_numpy(bias, "bias"), **geometry)
        return torch.from_numpy(y)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        want_input, want_weight, want_bias = ctx.needs_input_grad[:3]
        grads = conv2d_backward(_as_numpy(grad_output, "grad_output"), _as_numpy(x, "input"),
                                _as_numpy(weight, "weight"), **ctx.geometry,
                                output_mask=(want_input, want_weight,
                                             want_bias and ctx.has_bias))
        # One gradient per forward argument; the geometry gets None.
        return (*map(_as_tensor, grads), None, None, None, None, None)


def conv2d_function(x, weight, bias=None, stride=1, padding=0, dilation=1, groups=1,
                    padding_mode="zeros"):
    """Conv2dFunction.apply with torch.nn.functional.conv2d's defaults (plus
    padding_mode, which fastconv applies itself)."""
    return Conv2dFunction.apply(x, weight, bias, stride, padding, dilation, groups,
                                padding_mode)


class FastConv2d(torch.nn.Conv2d):
    """torch.nn.Conv2d computed by fastconv: same constructor, parameters,
    initialisation and state_dict keys, so either loads the other's
    state_dict.  CPU, float32/float64; (N, C, H, W) or unbatched (C, H, W)
    input."""

    def forward(self, input):
        batched = input.dim() == 4
        x = input if batched else input.unsqueeze(0)
        y = conv2d_function(x, self.weight, self.bias, self.stride, self.padding,
                            self.dilation, self.groups, self.padding_mode)
        return y if batched else y.squeeze(0)
