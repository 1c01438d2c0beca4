"""fastconv.torch: Conv2dFunction under torch.autograd.gradcheck, gradient
masks, non-contiguous tensors, FastConv2d as a drop-in for nn.Conv2d
(outputs, training, state_dict)."""
import copy

import numpy as np
import pytest
import torch

import fastconv.torch as fastconv_torch
from fastconv.torch import Conv2dFunction, FastConv2d, conv2d_function

GEOMETRIES = [
    dict(),
    dict(stride=2, padding=1),
    dict(stride=(2, 1), padding=(0, 2), dilation=(1, 2)),
    dict(padding="same", dilation=2),
    dict(padding="valid", groups=2),
    dict(padding=1, groups=4),                      # depthwise
    dict(padding=(1, 2), padding_mode="reflect"),
    dict(padding=1, padding_mode="replicate", stride=2),
    dict(padding="same", padding_mode="circular", groups=2),
]


def conv_args(kwargs):
    """(stride, padding, dilation, groups, padding_mode) with nn.Conv2d's defaults."""
    return (kwargs.get("stride", 1), kwargs.get("padding", 0), kwargs.get("dilation", 1),
            kwargs.get("groups", 1), kwargs.get("padding_mode", "zeros"))


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("kwargs", GEOMETRIES, ids=str)
def test_gradcheck_float64(kwargs, bias):
    gen = torch.Generator().manual_seed(0)
    groups = kwargs.get("groups", 1)
    x = torch.randn(2, 4, 6, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    weight = torch.randn(4, 4 // groups, 3, 2, dtype=torch.float64, generator=gen,
                         requires_grad=True)
    b = torch.randn(4, dtype=torch.float64, generator=gen, requires_grad=True) if bias else None
    inputs = (x, weight, b)
    assert torch.autograd.gradcheck(
        lambda x, w, b: Conv2dFunction.apply(x, w, b, *conv_args(kwargs)), inputs)
    expected = torch.nn.functional.conv2d(
        torch.nn.functional.pad(x, _torch_pads(kwargs, x.shape[2:], weight.shape[2:]),
                                mode=_torch_pad_mode(kwargs)), weight, b,
        kwargs.get("stride", 1), 0, kwargs.get("dilation", 1), groups)
    torch.testing.assert_close(Conv2dFunction.apply(x, weight, b, *conv_args(kwargs)), expected)


def _torch_pad_mode(kwargs):
    mode = kwargs.get("padding_mode", "zeros")
    return "constant" if mode == "zeros" else mode


def _torch_pads(kwargs, hw, kernel):
    """F.pad's (left, right, top, bottom) for nn.Conv2d's padding argument."""
    padding, dilation = kwargs.get("padding", 0), kwargs.get("dilation", 1)
    dilation = (dilation, dilation) if isinstance(dilation, int) else dilation
    if padding == "valid":
        return (0, 0, 0, 0)
    if padding == "same":  # stride 1 only, like PyTorch
        totals = [d * (k - 1) for d, k in zip(dilation, kernel)]
        (th, tw) = totals
        return (tw // 2, tw - tw // 2, th // 2, th - th // 2)
    ph, pw = (padding, padding) if isinstance(padding, int) else padding
    return (pw, pw, ph, ph)


@pytest.mark.parametrize("wanted", [(True, False, False), (False, True, False),
                                    (False, False, True), (True, True, False)], ids=str)
def test_only_requested_gradients_are_computed(wanted, monkeypatch):
    masks = []
    real_backward = fastconv_torch.conv2d_backward

    def spy(*args, output_mask, **kwargs):
        masks.append(output_mask)
        return real_backward(*args, output_mask=output_mask, **kwargs)

    monkeypatch.setattr(fastconv_torch, "conv2d_backward", spy)
    gen = torch.Generator().manual_seed(1)
    tensors = [torch.randn(2, 3, 5, 5, dtype=torch.float64, generator=gen),
               torch.randn(4, 3, 3, 3, dtype=torch.float64, generator=gen),
               torch.randn(4, dtype=torch.float64, generator=gen)]
    for tensor, want in zip(tensors, wanted):
        tensor.requires_grad_(want)
    conv2d_function(*tensors, padding=1).square().sum().backward()
    assert masks == [wanted]
    reference = [t.detach().clone().requires_grad_(w) for t, w in zip(tensors, wanted)]
    torch.nn.functional.conv2d(*reference, padding=1).square().sum().backward()
    for tensor, ref, want in zip(tensors, reference, wanted):
        if want:
            torch.testing.assert_close(tensor.grad, ref.grad)
        else:
            assert tensor.grad is None


def test_non_contiguous_tensors():
    gen = torch.Generator().manual_seed(2)

    def randn(*shape):
        return torch.randn(*shape, dtype=torch.float64, generator=gen)

    inputs = {
        "channels_last": randn(2, 9, 11, 4).permute(0, 3, 1, 2),
        "every_other": randn(2, 8, 9, 12)[:, ::2, :, 1::2],
        "transposed_hw": randn(2, 4, 11, 9).transpose(2, 3),
        "channel_slice": randn(2, 6, 9, 9)[:, 1:5],
    }
    for name, x in inputs.items():
        x = x.requires_grad_()
        w = randn(3, 3, 4, 5).permute(3, 2, 0, 1).requires_grad_()  # (5, 4, 3, 3)
        assert not x.is_contiguous() and not w.is_contiguous()
        assert torch.autograd.gradcheck(lambda x, w: conv2d_function(x, w, None, 2, 1),
                                        (x, w)), name
        torch.testing.assert_close(conv2d_function(x, w, None, 2, 1),
                                   torch.nn.functional.conv2d(x, w, None, 2, 1))


def test_expanded_grad_output():
    # y.sum().backward() hands backward a zero-stride (expanded) gradient.
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64, generator=gen, requires_grad=True)
    w = torch.randn(4, 3, 3, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    conv2d_function(x, w, None, 1, 1).sum().backward()
    x_ref, w_ref = (t.detach().clone().requires_grad_() for t in (x, w))
    torch.nn.functional.conv2d(x_ref, w_ref, None, 1, 1).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)
    torch.testing.assert_close(w.grad, w_ref.grad)


@pytest.mark.parametrize("kwargs", GEOMETRIES, ids=str)
def test_fastconv2d_matches_nn_conv2d_in_float32(kwargs):
    torch.manual_seed(3)
    reference = torch.nn.Conv2d(4, 8, 3, **kwargs)
    conv = FastConv2d(4, 8, 3, **kwargs)
    conv.load_state_dict(reference.state_dict())
    x = torch.randn(3, 4, 10, 9)
    x_ref = x.clone().requires_grad_()
    x = x.requires_grad_()
    y, y_ref = conv(x), reference(x_ref)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    grad = torch.randn(y.shape)
    y.backward(grad)
    y_ref.backward(grad)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(conv.weight.grad, reference.weight.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(conv.bias.grad, reference.bias.grad, rtol=1e-4, atol=1e-4)


def test_unbatched_input():
    conv = FastConv2d(2, 3, 3, padding=1).double()
    x = torch.randn(2, 5, 5, dtype=torch.float64)
    torch.testing.assert_close(conv(x), torch.nn.Conv2d.forward(conv, x))


def test_state_dict_round_trip():
    torch.manual_seed(4)
    reference = torch.nn.Conv2d(3, 6, (3, 5), stride=2, padding=(1, 2), groups=3,
                                padding_mode="reflect")
    conv = FastConv2d(3, 6, (3, 5), stride=2, padding=(1, 2), groups=3, padding_mode="reflect")
    assert list(conv.state_dict()) == list(reference.state_dict()) == ["weight", "bias"]
    conv.load_state_dict(reference.state_dict())
    back = torch.nn.Conv2d(3, 6, (3, 5), stride=2, padding=(1, 2), groups=3,
                           padding_mode="reflect")
    back.load_state_dict(conv.state_dict())
    for name, value in reference.state_dict().items():
        assert torch.equal(back.state_dict()[name], value)
    x = torch.randn(2, 3, 9, 9)
    torch.testing.assert_close(conv(x), reference(x))


def _small_cnn(conv_class):
    return torch.nn.Sequential(
        conv_class(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
        conv_class(8, 8, 3, stride=2, padding=1, groups=2, bias=False), torch.nn.ReLU(),
        conv_class(8, 16, 1), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
        torch.nn.Linear(16, 5))


def _swap_convs(model):
    """A deep copy of model with every nn.Conv2d replaced by a FastConv2d
    holding the same parameters."""
    model = copy.deepcopy(model)
    for name, child in model.named_children():
        if type(child) is torch.nn.Conv2d:
            child.__class__ = FastConv2d  # same attributes, fastconv forward
    return model


def test_small_cnn_trains_identically_with_fastconv2d():
    torch.manual_seed(5)
    reference = _small_cnn(torch.nn.Conv2d)
    model = _swap_convs(reference)
    assert sum(isinstance(m, FastConv2d) for m in model.modules()) == 3
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
                  for m in (reference, model)]
    gen = torch.Generator().manual_seed(6)
    losses = {id(reference): [], id(model): []}
    for step in range(5):
        x = torch.randn(8, 3, 12, 12, generator=gen)
        labels = torch.randint(0, 5, (8,), generator=gen)
        for m, optimizer in zip((reference, model), optimizers):
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(m(x), labels)
            loss.backward()
            optimizer.step()
            losses[id(m)].append(loss.item())
    np.testing.assert_allclose(losses[id(model)], losses[id(reference)], rtol=1e-5)
    assert losses[id(model)][-1] < losses[id(model)][0]
    for (name, p), p_ref in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, p_ref, rtol=1e-4, atol=1e-5, msg=name)


def test_errors():
    conv = FastConv2d(2, 2, 3)
    with pytest.raises(TypeError, match="float32 and float64"):
        conv.half()(torch.randn(1, 2, 5, 5).half())
    with pytest.raises(TypeError, match="dtype"):
        FastConv2d(2, 2, 3)(torch.randn(1, 2, 5, 5, dtype=torch.float64))
