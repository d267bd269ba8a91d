"""``embedding_renorm_`` (``F.embedding(..., max_norm=...)``) under vmap: outputs, gradients and the weight's final
state against a per-sample loop of PyTorch's own op outside any transform, the samples renorming one weight in turn
(shared weight) or each its own (batched weight)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch.func import grad, jacfwd, jacrev, vmap

import registry

ROWS, DIM, SAMPLES, LOOKUPS, MAX_NORM = 10, 4, 3, 5, 1.0
FALLBACK = "There is a performance drop"
PYTORCH_ERROR = "vmap: aten::embedding_renorm_(self, *extra_args) is not possible"


def _weight(seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(ROWS, DIM, generator=generator, dtype=torch.float64) * 2


def _indices(seed: int = 0) -> torch.Tensor:
    # Every sample looks up rows above max_norm, some rows shared by samples, one row twice in a sample.
    generator = torch.Generator().manual_seed(seed)
    found = torch.randint(0, ROWS, (SAMPLES, LOOKUPS), generator=generator)
    found[:, 0] = 3
    found[0, 1] = found[0, 2]
    return found


def _embed(indices: torch.Tensor, weight: torch.Tensor, norm_type: float = 2.0) -> torch.Tensor:
    return F.embedding(indices, weight, max_norm=MAX_NORM, norm_type=norm_type)


def _loss(weight: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    return _embed(indices, weight).pow(3).sum()


def _no_fallback(run):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch._C._functorch._set_vmap_fallback_warning_enabled(True)
        try:
            result = run()
        finally:
            torch._C._functorch._set_vmap_fallback_warning_enabled(False)
    assert [str(w.message) for w in caught if FALLBACK in str(w.message)] == []
    return result


def _shared_loop(weight: torch.Tensor, indices: torch.Tensor):
    """Outputs and per-sample gradients, the samples one after another renorming the one weight (which is left
    changed, as by a loop over the batch with one nn.Embedding)."""
    outputs, grads = [], []
    for b in range(indices.shape[0]):
        outputs.append(_embed(indices[b], weight).clone())
        leaf = weight.clone().requires_grad_()
        grads.append(torch.autograd.grad(_loss(leaf, indices[b]), leaf)[0])
    return torch.stack(outputs), torch.stack(grads)


def test_pytorch_refuses_a_shared_weight_outside_use() -> None:
    weight, indices = _weight(), _indices()
    before = weight.clone()
    with pytest.raises(RuntimeError, match=PYTORCH_ERROR.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*")):
        vmap(lambda i: _embed(i, weight))(indices)
    with pytest.raises(RuntimeError, match="is not possible"):
        vmap(grad(_loss), in_dims=(None, 0))(weight, indices)
    assert torch.equal(weight, before)


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.5])
def test_shared_weight_under_vmap_equals_the_loop(norm_type: float) -> None:
    weight, indices = _weight(1), _indices(1)
    looped = weight.clone()
    expected = torch.stack([_embed(indices[b], looped, norm_type).clone() for b in range(SAMPLES)])
    with registry.use():
        got = _no_fallback(lambda: vmap(lambda i: _embed(i, weight, norm_type))(indices))
    torch.testing.assert_close(got, expected)
    # The weight ends as the loop leaves it: every looked-up row renormed once, the others untouched.
    torch.testing.assert_close(weight, looped, rtol=0, atol=1e-15)
    untouched = torch.ones(ROWS, dtype=torch.bool)
    untouched[indices.reshape(-1)] = False
    assert torch.equal(weight[untouched], _weight(1)[untouched])
    assert (torch.linalg.vector_norm(weight[indices.reshape(-1)], ord=norm_type, dim=-1) <= MAX_NORM).all()


def test_per_sample_gradients_with_a_shared_weight_equal_the_loop() -> None:
    weight, indices = _weight(2), _indices(2)
    looped = weight.clone()
    _, expected = _shared_loop(looped, indices)
    with registry.use():
        got = _no_fallback(lambda: vmap(grad(_loss), in_dims=(None, 0))(weight, indices))
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(weight, looped, rtol=0, atol=1e-15)


def test_a_weight_captured_from_outside_grad_is_renormed_like_the_loop() -> None:
    """PyTorch refuses an in-place write into a tensor captured by grad; the renorm is not differentiated, and the
    loop writes it."""
    weight, indices, scale = _weight(3), _indices(3), torch.tensor(1.5, dtype=torch.float64)
    looped = weight.clone()
    expected = []
    for b in range(SAMPLES):
        leaf = scale.clone().requires_grad_()
        expected.append(torch.autograd.grad((_embed(indices[b], looped) * leaf).pow(2).sum(), leaf)[0])
    with registry.use():
        got = vmap(grad(lambda s, i: (_embed(i, weight) * s).pow(2).sum()), in_dims=(None, 0))(scale, indices)
    torch.testing.assert_close(got, torch.stack(expected))
    torch.testing.assert_close(weight, looped, rtol=0, atol=1e-15)


def test_batched_weights_renorm_each_samples_own_rows() -> None:
    """One weight per sample (an ensemble): PyTorch loops; inside use() each slice gets its own rows, vectorized."""
    scales = torch.tensor([1.0, 0.3, 2.0], dtype=torch.float64).reshape(SAMPLES, 1, 1)
    indices = _indices(4)
    for shared_indices in (False, True):
        weights = (_weight(4) * scales).contiguous()
        run = (lambda: vmap(lambda v: _embed(indices[0], v))(weights)) if shared_indices else (  # noqa: B023
            lambda: vmap(_embed)(indices, weights))  # noqa: B023
        looped = weights.clone()
        rows = (lambda b: indices[0]) if shared_indices else (lambda b: indices[b])
        expected = torch.stack([_embed(rows(b), looped[b]) for b in range(SAMPLES)])
        with registry.use():
            got = _no_fallback(run)
        torch.testing.assert_close(got, expected)
        torch.testing.assert_close(weights, looped)


def test_nested_vmap_ensemble_of_weights_over_samples() -> None:
    """vmap over two models' weights, then over the samples: each model's weight gets every sample's rows."""
    indices = _indices(5)
    weights = (_weight(5) * torch.tensor([1.0, 0.4], dtype=torch.float64).reshape(2, 1, 1)).contiguous()
    looped = weights.clone()
    expected = torch.stack([torch.stack([_embed(indices[b], looped[m]).clone() for b in range(SAMPLES)])
                            for m in range(2)])
    with registry.use():
        got = _no_fallback(lambda: vmap(lambda w: vmap(lambda i: _embed(i, w))(indices))(weights))
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(weights, looped)


def test_outside_vmap_pytorchs_own_op_runs() -> None:
    weight, indices = _weight(6), _indices(6)
    looped = weight.clone()
    expected = torch.autograd.functional.jacobian(lambda w: _embed(indices[0], w), looped.clone())
    _embed(indices[0], looped)
    assert registry.select("embedding_renorm_", stack="grad", policy="rules").kind == "native"
    assert registry.select("embedding_renorm_", stack="vmap", batched=["indices"], policy="rules").composite == \
        "union_rows"
    assert registry.select("embedding_renorm_", stack="vmap", batched=["self", "indices"],
                           policy="rules").composite == "union_rows"
    with registry.use():
        got = jacrev(lambda w: _embed(indices[0], w))(weight)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(weight, looped)


def test_bad_input_says_what_to_fix() -> None:
    weight = _weight()
    with registry.use(), pytest.raises(TypeError, match="embedding_renorm_: indices must be int32 or int64"):
        vmap(lambda i: torch.embedding_renorm_(weight, i, 1.0, 2.0))(torch.zeros(SAMPLES, 2))


def test_forward_mode_per_sample_jacobians_equal_the_loop() -> None:
    """vmap over jacfwd in the weight, the indices batched: natively refused, inside use() the loop's Jacobians."""
    weight, indices = _weight(7), _indices(7)
    looped = weight.clone()
    expected = []
    for b in range(SAMPLES):
        _embed(indices[b], looped)  # the renorm happens before the lookup, outside autograd, as in the loop
        expected.append(torch.autograd.functional.jacobian(lambda w, b=b: _embed(indices[b], w), looped.clone()))
    run = lambda: vmap(lambda i: jacfwd(lambda w: _embed(i, w))(weight))(indices)  # noqa: E731
    with pytest.raises(RuntimeError, match="is not possible"):
        run()
    weight = _weight(7)
    with registry.use():
        got = _no_fallback(run)
    torch.testing.assert_close(got, torch.stack(expected))
    torch.testing.assert_close(weight, looped, rtol=0, atol=1e-15)
