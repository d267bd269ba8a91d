"""The region kernels of automatically functionalized regions (``registry/core/fresh_buffers.py``): a buffer made
inside a region from a tensor outside it is functional, and once the first region has registered the kernels they
run only inside a region on the C++ backend (NOTE [region kernels behind a gate]): every other buffer-making call
under a transform, inside ``use()`` and outside, runs PyTorch's kernel as before any region."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import func

import registry
from registry.core import fresh_buffers
from registry.core.functionalization import FUNCTIONALIZED

pytestmark = pytest.mark.usefixtures("routing_backend")

X = torch.tensor([[0.3, -1.2, 0.8], [1.1, 0.4, -0.6], [-0.9, 0.2, 1.7], [0.05, -0.3, -1.4]], dtype=torch.float64)
WEIGHT = torch.tensor([0.5, -0.25, 2.0], dtype=torch.float64)


@pytest.fixture
def region_kernel_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The region kernels registered afresh (``uninstall`` and ``install`` drop them), each call of one appended by
    its op's name."""
    calls: list[str] = []
    make = fresh_buffers._make_buffer_maker

    def counted(overload: Any, native: Any, local: Any) -> Callable[..., Any]:
        kernel = make(overload, native, local)

        def spy(*args: Any, **kwargs: Any) -> Any:
            calls.append(overload.__name__)
            return kernel(*args, **kwargs)

        return spy

    monkeypatch.setattr(fresh_buffers, "_make_buffer_maker", counted)
    registry.uninstall()
    registry.install()
    FUNCTIONALIZED.clear()
    yield calls
    FUNCTIONALIZED.clear()


def _writes_into_a_buffer_of_the_weight(x: torch.Tensor) -> torch.Tensor:
    """A buffer made from a tensor outside the function (the weight), written with a per-sample value."""
    buffer = WEIGHT.new_zeros(3)
    buffer.copy_(x * WEIGHT)
    return (buffer * x).sum()


def _clones(x: torch.Tensor) -> torch.Tensor:
    return (x.clone() * torch.ones_like(x)).sum()


def test_a_region_makes_the_buffer_functional(region_kernel_calls: list[str]) -> None:
    expected = torch.stack([torch.func.grad(_writes_into_a_buffer_of_the_weight)(sample) for sample in X])
    with registry.use():
        got = func.vmap(func.grad(_writes_into_a_buffer_of_the_weight))(X)
    torch.testing.assert_close(got, expected)
    assert "new_zeros.default" in region_kernel_calls  # the region's buffer went through its kernel


def test_outside_a_region_the_kernels_do_not_run(region_kernel_calls: list[str], routing_backend: str) -> None:
    """After a region registered them: on the C++ backend no region kernel runs for a clone or ones_like under
    vmap(grad), inside use() or outside it; the Python backend's kernels still see every call (and pass it on)."""
    with registry.use():
        func.vmap(func.grad(_writes_into_a_buffer_of_the_weight))(X)
    region_kernel_calls.clear()
    expected = torch.stack([torch.func.grad(_clones)(sample) for sample in X])
    outside = func.vmap(func.grad(_clones))(X)
    with registry.use():
        inside = func.vmap(func.grad(_clones))(X)
    torch.testing.assert_close(outside, expected)
    torch.testing.assert_close(inside, expected)
    if routing_backend == "cpp":
        assert region_kernel_calls == []
    else:
        assert {"clone.default", "ones_like.default"} <= set(region_kernel_calls)


def test_regions_are_counted_per_thread(region_kernel_calls: list[str]) -> None:
    """A region open on one thread does not open the gate on another."""
    import threading

    seen: list[str] = []

    def other_thread() -> None:
        before = len(region_kernel_calls)
        func.vmap(func.grad(_clones))(X)
        seen.extend(region_kernel_calls[before:])

    with registry.use():
        func.vmap(func.grad(_writes_into_a_buffer_of_the_weight))(X)  # registers the kernels
    fresh_buffers.PATCH.push(fresh_buffers.Region(functionalize_level=99, vmap_level=98))  # open here only
    try:
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
    finally:
        fresh_buffers.PATCH.pop()
    if fresh_buffers.PATCH.compiled_registered:
        assert seen == []


def test_a_remembered_function_gets_the_kernels_after_a_backend_switch(routing_backend: str) -> None:
    """A function remembered as needing functionalization runs functionalized from the start; the region kernels go
    with the C++ routing's Library on a switch of backends, and that run registers them again."""
    from registry.core import routing

    other = "python" if routing_backend == "cpp" else "cpp"
    expected = torch.stack([torch.func.grad(_writes_into_a_buffer_of_the_weight)(sample) for sample in X])
    per_sample = func.vmap(func.grad(_writes_into_a_buffer_of_the_weight))
    try:
        for backend in (routing_backend, other, routing_backend):
            routing.set_routing_backend(backend)
            with registry.use():
                torch.testing.assert_close(per_sample(X), expected)
    finally:
        routing.set_routing_backend(routing_backend)
