"""Whole convolutional models under torch.func, as a DP-SGD user writes them: per-sample gradients of a CNN with
GroupNorm (RGB input, a strided and a dilated convolution, with and without biases) through
``torch.func.functional_call`` under ``vmap(grad)`` inside ``use()``, against a per-sample ``torch.autograd`` loop
outside any transform; and an ensemble (``vmap`` over stacked weights), where every weight is batched."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, stack_module_state, vmap

import registry

SAMPLES, CLASSES = 4, 5


def _cnn(bias: bool) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=bias), nn.GroupNorm(2, 8), nn.ReLU(), nn.AvgPool2d(2),
        nn.Conv2d(8, 12, 3, stride=2, padding=2, dilation=2, bias=bias), nn.GroupNorm(3, 12), nn.ReLU(),
        nn.Conv2d(12, 4, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, CLASSES)).double()


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    images = torch.randn(SAMPLES, 3, 12, 12, dtype=torch.float64, generator=generator)
    return images, torch.randint(0, CLASSES, (SAMPLES,), generator=generator)


@pytest.mark.parametrize("bias", (True, False), ids=("bias", "no-bias"))
def test_cnn_per_sample_gradients_equal_the_loop(bias: bool) -> None:
    model = _cnn(bias)
    images, labels = _data()
    params = {name: p.detach() for name, p in model.named_parameters()}

    def loss(p: dict[str, torch.Tensor], image: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        logits = functional_call(model, p, (image.unsqueeze(0),))
        return nn.functional.cross_entropy(logits, label.unsqueeze(0))

    loop = [torch.autograd.grad(nn.functional.cross_entropy(model(images[i:i + 1]), labels[i:i + 1]),
                                list(model.parameters())) for i in range(SAMPLES)]
    with registry.use():
        got = vmap(grad(loss), in_dims=(None, 0, 0))(params, images, labels)
    for index, name in enumerate(params):
        torch.testing.assert_close(got[name], torch.stack([row[index] for row in loop]))


def test_cnn_ensemble_equals_each_model() -> None:
    models = [_cnn(True) for _ in range(3)]
    for offset, model in enumerate(models):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.1 * offset)
    weights, buffers = stack_module_state(models)
    images, labels = _data()
    base = copy.deepcopy(models[0]).to("meta")

    def loss(p: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> torch.Tensor:
        return nn.functional.cross_entropy(functional_call(base, (p, b), (images,)), labels)

    expected = [torch.autograd.grad(nn.functional.cross_entropy(m(images), labels), list(m.parameters()))
                for m in models]
    with registry.use():
        got = vmap(grad(loss))(weights, buffers)
    for index, name in enumerate(weights):
        torch.testing.assert_close(got[name], torch.stack([row[index] for row in expected]))
