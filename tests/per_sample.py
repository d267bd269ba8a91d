"""The per-sample references the transform tests compare with, outside any transform: a Python loop over the batch,
a gradient by torch.autograd.grad, a Jacobian and a Hessian by torch.autograd.functional."""

from __future__ import annotations

from collections.abc import Callable

import torch


def loop(f: Callable[[torch.Tensor], torch.Tensor], batch: torch.Tensor) -> torch.Tensor:
    return torch.stack([f(sample) for sample in batch])


def autograd_grad(loss: Callable[[torch.Tensor], torch.Tensor], value: torch.Tensor) -> torch.Tensor:
    leaf = value.detach().clone().requires_grad_()
    return torch.autograd.grad(loss(leaf), leaf)[0]


def jacobian(f: Callable[[torch.Tensor], torch.Tensor], value: torch.Tensor) -> torch.Tensor:
    return torch.autograd.functional.jacobian(f, value)


def hessian(loss: Callable[[torch.Tensor], torch.Tensor], value: torch.Tensor) -> torch.Tensor:
    return torch.autograd.functional.hessian(loss, value)
