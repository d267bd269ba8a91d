"""composites/resample.py: nearest-exact upsampling decided by its cost at the call's sizes (the generic signature,
each op's grid in bench/size_grids.py), equal to the per-sample loop either way."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import func

import registry
from registry.core import selector
from registry.store import evidence
from tests.per_sample import autograd_grad, loop


@pytest.fixture(autouse=True)
def _empty_store() -> None:
    """A new user's: nothing measured here, so the shipped reference costs decide."""
    evidence.set_entries(())
    evidence.set_profiles(())
    selector.clear_cache()


def _doubled(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.interpolate(x[None], scale_factor=2, mode="nearest-exact").sin().sum()


@pytest.mark.parametrize(("batch", "spatial", "expected"), [(4, 2, "native"), (64, 1, "functional"),
                                                           (256, 3, "functional")])
def test_upsampling_per_sample_gradients_by_cost(batch: int, spatial: int, expected: str) -> None:
    """A few small samples: vmap's loop over PyTorch's kernel (faster in the shipped costs); many: the composite."""
    x = torch.randn(batch, 2, *(4,) * spatial, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # vmap's loop, where cost chose it
        with registry.use(record=True) as block:
            got = func.vmap(func.grad(_doubled))(x)
    assert {d.composite for d in block.decisions if d.op == f"_upsample_nearest_exact{spatial}d"} == {expected}
    torch.testing.assert_close(got, loop(lambda sample: autograd_grad(_doubled, sample), x))


def test_larger_samples_than_measured_keep_the_rules() -> None:
    """The grids measured up to about 2,000 elements a sample: a larger one is decided by the rules (the composite)."""
    decision = registry.select("_upsample_nearest_exact2d", stack="vmap", batched=["input"],
                               shapes={"input": (1, 2, 64, 64)}, batch_size=4)
    assert decision.composite == registry.select("_upsample_nearest_exact2d", stack="vmap", batched=["input"],
                                                 policy="rules").composite == "functional"
    assert "at this size" not in decision.reason
