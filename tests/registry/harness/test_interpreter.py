"""The interpreter's reference differentiates an argument that is a pytree of tensors (a dict of parameters), as
torch.func does, and loops over a batched pytree argument."""

from __future__ import annotations

import torch

from registry.harness import interpreter


def _f(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return (torch.tanh(x @ params["w"]) + params["b"]).pow(2).sum()


def _params() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {"w": torch.randn(3, 2, generator=generator, dtype=torch.float64),
            "b": torch.randn(2, generator=generator, dtype=torch.float64)}


def test_vmap_grad_of_a_dict_of_parameters_equals_torch_func() -> None:
    x = torch.randn(5, 3, dtype=torch.float64)
    layout = interpreter.Layout(in_dims=((None, 0),), wrt=0, loss=lambda y: y)
    expected = interpreter.transformed(("vmap", "grad"), _f, layout)(_params(), x)
    got = interpreter.reference(("vmap", "grad"), _f, layout)(_params(), x)
    assert sorted(got) == ["b", "w"] and got["w"].shape == (5, 3, 2)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name])


def test_jacrev_of_a_dict_and_a_batched_dict() -> None:
    def g(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ params["w"]) + params["b"]

    x = torch.randn(3, dtype=torch.float64)
    layout = interpreter.Layout(wrt=0)
    expected = interpreter.transformed(("jacrev",), g, layout)(_params(), x)
    got = interpreter.reference(("jacrev",), g, layout)(_params(), x)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name])
    ensemble = {name: torch.stack([p, 2 * p]) for name, p in _params().items()}  # two models, batched at 0
    layout = interpreter.Layout(in_dims=((0, None),), wrt=0, loss=lambda y: y)
    expected = interpreter.transformed(("vmap", "grad"), _f, layout)(ensemble, x)
    got = interpreter.reference(("vmap", "grad"), _f, layout)(ensemble, x)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name])
