"""Python control flow on a batched tensor inside use(): agreeing samples proceed, disagreeing ones name the line."""

from __future__ import annotations

import inspect
import re

import pytest
import torch
from torch import func

import registry
from registry.core import control_flow
from registry.core.batch_split import BatchSplitWarning, SplitShapeError
from registry.core.control_flow import BooleanMaskError

X = torch.tensor([[1.0, -2.0, 3.0], [-1.0, 0.5, 0.0], [2.0, 2.0, -0.5]])
PYTORCH_BOOL = "vmap: It looks like you're attempting to use a Tensor in some data-dependent control flow"
PYTORCH_ITEM = "vmap: It looks like you're calling .item() on a Tensor"


def scale_if_positive_total(t: torch.Tensor) -> torch.Tensor:
    if t.abs().sum() > 0:  # every sample of X has a positive total: the same branch everywhere
        return t * 2
    return t


def branch_on_sign(t: torch.Tensor) -> torch.Tensor:
    if t.sum() > 0:  # samples of X disagree
        return t * 2
    return -t


def count_columns(t: torch.Tensor) -> torch.Tensor:
    columns = int((t != 100).sum().item())  # 3 in every sample
    return t[:columns] * columns


def read_first(t: torch.Tensor) -> torch.Tensor:
    return t * t[0].item()  # differs per sample


def _line_of(function, text: str) -> int:
    lines, first = inspect.getsourcelines(function)
    return first + next(i for i, line in enumerate(lines) if text in line)


def _loop(f, batch: torch.Tensor) -> torch.Tensor:
    return torch.stack([f(sample) for sample in batch])


def test_agreeing_bool_proceeds_and_equals_the_loop() -> None:
    with registry.use():
        got = func.vmap(scale_if_positive_total)(X)
    assert torch.equal(got, _loop(scale_if_positive_total, X))


def test_agreeing_item_proceeds_and_equals_the_loop() -> None:
    with registry.use():
        got = func.vmap(count_columns)(X)
    assert torch.equal(got, _loop(count_columns, X))


def test_padding_mask_all_under_vmap_grad() -> None:
    """``if padding_mask.all():`` in a model's masking code, with no padding anywhere, under per-sample gradients."""
    mask = torch.ones(3, 3, dtype=torch.bool)

    def loss(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        if m.all():
            return (x ** 2).sum()
        return (x.masked_fill(~m, 0.0) ** 2).sum()

    with registry.use():
        got = func.vmap(func.grad(loss))(X, mask)
    assert torch.equal(got, 2 * X)


def test_nested_vmap_agrees_across_every_sample() -> None:
    batch = torch.stack([X, X + 10])
    with registry.use():
        got = func.vmap(func.vmap(scale_if_positive_total))(batch)
    assert torch.equal(got, batch * 2)


def shorten_if_positive(t: torch.Tensor) -> torch.Tensor:
    if t.sum() > 0:  # samples of X disagree
        return t[:2]
    return t


def test_disagreeing_bool_splits_and_equals_the_loop() -> None:
    """The level runs once per group of agreeing samples (tests/registry/core/test_batch_split.py tests it all)."""
    with registry.use(), pytest.warns(BatchSplitWarning):
        got = func.vmap(branch_on_sign)(X)
    assert torch.equal(got, _loop(branch_on_sign, X))


def test_disagreeing_bool_names_the_line_and_torch_where() -> None:
    """Where the groups' outputs differ in shape, the level cannot be one tensor: the error says where and why."""
    with registry.use(), pytest.raises(SplitShapeError) as raised:
        func.vmap(shorten_if_positive)(X)
    line = _line_of(shorten_if_positive, "if t.sum() > 0")
    assert str(raised.value).startswith(
        f"vmap: bool() of a tensor (an `if`, `and`, `or`, `not` or `while` on it) at {__file__}:{line} "
        "(`if t.sum() > 0:  # samples of X disagree`) needs one Python value, but the samples of the vmapped batch "
        "disagree (2 of 3 are True), so no single branch or number is right for all of them; compute both branches "
        "and pick per sample with a mask instead of an `if`: torch.where(cond, if_true, if_false) (or "
        "x.masked_fill(~cond, value)), keeping cond a tensor (the batch was split where the samples disagree, but the "
        "groups' outputs still differ in shape")


def test_disagreeing_item_splits_and_equals_the_loop() -> None:
    with registry.use():
        got = func.vmap(read_first)(X)
    assert torch.equal(got, _loop(read_first, X))


def read_first_count(t: torch.Tensor) -> torch.Tensor:
    return t[: int(t[0].item()) + 2]  # differs per sample, and so does the shape


def test_disagreeing_item_names_the_line_and_the_values() -> None:
    with registry.use(), pytest.raises(SplitShapeError) as raised:
        func.vmap(read_first_count)(X)
    line = _line_of(read_first_count, "t[0].item()")
    text = str(raised.value)
    assert text.startswith(f"vmap: .item() of a tensor (or float(), int()) at {__file__}:{line} ")
    assert "disagree (values 1, -1, 2)" in text
    assert "keep the value a tensor instead of a Python number" in text


def test_outside_use_pytorch_says_what_it_says() -> None:
    with pytest.raises(RuntimeError, match=PYTORCH_BOOL):
        func.vmap(scale_if_positive_total)(X)
    with pytest.raises(RuntimeError, match=re.escape(PYTORCH_ITEM)):
        func.vmap(count_columns)(X)


def test_policy_native_routes_nothing() -> None:
    with registry.use(policy="native"), pytest.raises(RuntimeError, match=PYTORCH_BOOL):
        func.vmap(scale_if_positive_total)(X)


def test_unbatched_and_eager_calls_run_pytorch() -> None:
    shared = torch.tensor(2.0)
    with registry.use():
        assert torch.equal(func.vmap(lambda t: t * shared.item())(X), X * 2)
        assert torch.equal(func.grad(lambda t: (t * t.sum().item()).sum())(X[0]), torch.full((3,), 2.0))
        assert bool(X.sum() > 0) is True


def test_samples_reads_every_level_and_batch_dimension() -> None:
    """samples() flattens the batch in the order the levels nest (outer major), whatever the batch dims."""
    batch = torch.arange(24.0).reshape(2, 3, 4)  # outer vmap over dim 2, inner over dim 0
    seen: list[torch.Tensor] = []

    def inner(t: torch.Tensor) -> torch.Tensor:
        found = control_flow.samples(t)
        assert found is not None
        seen.append(found)
        return t

    func.vmap(func.vmap(inner, in_dims=0), in_dims=2)(batch)
    expected = torch.stack([batch[i, :, k] for k in range(4) for i in range(2)])
    assert torch.equal(seen[0], expected)


# --- boolean-mask indexing -------------------------------------------------------------------------------------------

def select_positive(t: torch.Tensor) -> torch.Tensor:
    return t[t > 0]


def zero_negative(t: torch.Tensor) -> torch.Tensor:
    return t.clone().index_put_((t < 0,), torch.zeros(()))


@pytest.mark.parametrize(("f", "text", "error"), [(select_positive, "return t[t > 0]", SplitShapeError),
                                                  (zero_negative, "return t.clone().index_put_((t < 0,), "
                                                                  "torch.zeros(()))", BooleanMaskError)],
                         ids=["read", "write"])
def test_boolean_mask_indexing_names_the_line_and_the_fixed_shape_forms(f, text: str, error: type) -> None:
    """A read whose per-sample shapes differ at the end of the function; an explicit index_put_ with a batched mask
    (``x[mask] = v`` runs: tests/registry/core/test_mask_writes.py)."""
    with registry.use(), pytest.raises(error) as raised:
        func.vmap(f)(X)
    assert str(raised.value).startswith(
        f"vmap: boolean-mask indexing at {__file__}:{_line_of(f, text)} (`{text}`) returns a shape that depends on the "
        "values of a batched mask, so it cannot be batched (each sample would select a different number of "
        "elements). Keep the shape fixed: torch.where(mask, x, fill)")


def test_boolean_mask_inside_vmap_grad() -> None:
    with registry.use():
        got = func.vmap(func.grad(lambda t: (select_positive(t) ** 2).sum()))(X)
    assert torch.equal(got, torch.where(X > 0, 2 * X, torch.zeros_like(X)))


def test_shared_mask_still_indexes() -> None:
    mask = torch.tensor([True, False, True])
    with registry.use():
        assert torch.equal(func.vmap(lambda t: t[mask])(X), X[:, mask])
