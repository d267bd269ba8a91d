"""The random state a retry starts from: saved and put back, by the compiled kernels and by PyTorch's tensor alike."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from registry.core import kernels, random_state


def _draws() -> list[torch.Tensor]:
    # Scalar normal draws use the generator's cached second Box-Muller sample; the others the Mersenne Twister's words.
    return [torch.rand(7), torch.randn(3), torch.randn(1, dtype=torch.float64), torch.randint(0, 1000, (5,)),
            torch.randn(700), torch.bernoulli(torch.full((9,), 0.5))]


def _equal(first: list[torch.Tensor], second: list[torch.Tensor]) -> bool:
    return all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


@pytest.fixture(params=["compiled", "pytorch"])
def saver(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "compiled":
        request.getfixturevalue("compiled_kernels")
    else:
        monkeypatch.setattr(kernels, "loaded", lambda: None)
    return request.param


def test_restore_draws_again_what_was_drawn_after_save(saver: str) -> None:
    torch.manual_seed(11)
    torch.randn(1)  # leaves a cached normal sample: saved and put back with the engine
    saved = random_state.save()
    assert isinstance(saved[0], torch.Tensor) == (saver == "pytorch")
    first = _draws()
    random_state.restore(saved)
    assert _equal(_draws(), first)


def test_saves_nest(saver: str) -> None:
    """vmap(grad) saves at both levels: putting back the inner state leaves the outer one intact."""
    torch.manual_seed(5)
    outer = random_state.save()
    before_inner = _draws()
    inner = random_state.save()
    after_inner = _draws()
    random_state.restore(inner)
    assert _equal(_draws(), after_inner)
    random_state.restore(outer)
    assert _equal(_draws(), before_inner)


@pytest.mark.usefixtures("compiled_kernels")
def test_the_compiled_save_matches_pytorchs_state() -> None:
    """What the compiled kernels put back is the state torch.get_rng_state() describes, byte for byte."""
    torch.manual_seed(3)
    torch.randn(1)
    expected = torch.get_rng_state()
    saved = random_state.save()
    _draws()
    random_state.restore(saved)
    assert torch.equal(torch.get_rng_state(), expected)


def test_a_foreign_object_is_refused_by_the_compiled_restore(compiled_kernels: ModuleType) -> None:
    before = torch.get_rng_state()
    with pytest.raises(ValueError, match="PyCapsule"):
        compiled_kernels.restore_cpu_random_state(object())
    assert torch.equal(torch.get_rng_state(), before)


def test_cuda_is_not_consulted_on_a_cpu_build(monkeypatch: pytest.MonkeyPatch) -> None:
    if random_state.CUDA_BUILT:
        pytest.skip("this torch has CUDA")

    def initialized() -> bool:
        raise AssertionError("torch.cuda.is_initialized() read on a CPU build")

    monkeypatch.setattr(torch.cuda, "is_initialized", initialized)
    assert random_state.save()[1] is None
