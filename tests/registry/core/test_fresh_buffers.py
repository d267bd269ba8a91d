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


def test_a_region_makes_the_buffer_functional(region_kernel_calls: list[str], batching_fails: dict[str, bool]) -> None:
    """Where the level cannot run with its buffers batched, it runs functionalized, the weight's buffer made
    functional by the region's kernel."""
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


# --- batched fresh buffers (NOTE [batched fresh buffers] in registry/core/functionalization.py) -------------------

INDEX = torch.tensor([[0, 2, 2], [1, 1, 0], [2, 0, 1], [0, 0, 0]])  # each sample's own scatter targets


def _aggregates(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """A graph library's aggregation: per-sample values into ``torch.zeros`` and ``new_zeros`` of an outside
    tensor, then a degree from ``torch.ones``, as message-passing layers write them."""
    out = torch.zeros(3, dtype=x.dtype).index_add_(0, index, x * WEIGHT)
    degree = WEIGHT.new_zeros(3).scatter_add_(0, index, torch.ones(3, dtype=x.dtype))
    return (out / degree.clamp(min=1) * torch.full((3,), 2.0, dtype=x.dtype)).square().sum()


def _loop_gradients(loss: Callable[..., torch.Tensor], *samples: torch.Tensor) -> torch.Tensor:
    rows = []
    for b in range(X.shape[0]):
        x = samples[0][b].clone().requires_grad_()
        rows.append(torch.autograd.grad(loss(x, *(s[b] for s in samples[1:])), x)[0])
    return torch.stack(rows)


@pytest.fixture
def remembered() -> Iterator[Any]:
    """The default registry's functionalization patch, forgetting what it remembered before and after the test."""
    from registry.core import functionalization

    patch = functionalization.PATCH
    with patch.remembering_apart():
        yield patch


def test_writes_into_fresh_buffers_run_with_the_buffers_batched(remembered: Any,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """vmap(grad) of the aggregation inside use(): the level runs with its fresh buffers batched, not functionalized
    (functionalize never called), remembered so, and every call equals the loop."""
    from registry.core import functionalization

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("functionalize called")

    monkeypatch.setattr(functionalization, "functionalize", refuse)
    want = _loop_gradients(_aggregates, X, INDEX)
    with registry.use():
        for _ in range(2):  # the retry, then the remembered run
            torch.testing.assert_close(func.vmap(func.grad(_aggregates))(X, INDEX), want)
    assert remembered.batched_buffers and remembered.batched_buffers <= remembered.functionalized


def test_batched_buffers_under_plain_vmap_and_nested_vmap_equal_the_loop(remembered: Any) -> None:
    """The values (no grad level) and an inner vmap level's buffers (vmap of vmap): each sample's own."""
    want = torch.stack([_aggregates(X[b], INDEX[b]) for b in range(X.shape[0])])
    pairs = torch.stack([X, X.flip(0)]), torch.stack([INDEX, INDEX.flip(0)])
    with registry.use():
        torch.testing.assert_close(func.vmap(_aggregates)(X, INDEX), want)
        nested = func.vmap(func.vmap(_aggregates))(*pairs)
    torch.testing.assert_close(nested, torch.stack([want, want.flip(0)]))
    # Batched at both levels by the inner one's retry: nothing fell back to functionalization.
    assert remembered.batched_buffers and remembered.batched_buffers == remembered.functionalized


@pytest.fixture
def batching_fails(monkeypatch: pytest.MonkeyPatch) -> dict[str, bool]:
    """While ``["now"]`` is true, making a batched buffer raises (a stand-in for whatever a function does that a
    batched buffer cannot take): the Python kernels make the buffers, on the C++ backend too."""
    fails = {"now": True}
    make = fresh_buffers._batched_buffer
    monkeypatch.setattr(fresh_buffers.PATCH, "buffers_in_cpp", False)

    def maybe_failing(*args: Any, **kwargs: Any) -> Any:
        if fails["now"]:
            raise RuntimeError("a batched buffer cannot be used here")
        return make(*args, **kwargs)

    monkeypatch.setattr(fresh_buffers, "_batched_buffer", maybe_failing)
    return fails


def test_a_level_that_fails_with_its_buffers_batched_runs_functionalized(remembered: Any,
                                                                         batching_fails: dict[str, bool]) -> None:
    """The batched run fails: the level runs functionalized, as before, and is remembered as functionalized, not
    batched."""
    want = _loop_gradients(_aggregates, X, INDEX)
    with registry.use():
        torch.testing.assert_close(func.vmap(func.grad(_aggregates))(X, INDEX), want)
    assert remembered.functionalized and not remembered.batched_buffers


def test_a_remembered_batched_function_that_fails_later_moves_to_functionalized(
        remembered: Any, batching_fails: dict[str, bool]) -> None:
    """A later call that fails with its buffers batched runs functionalized, and so does every one after it."""
    want = _loop_gradients(_aggregates, X, INDEX)
    batching_fails["now"] = False
    with registry.use():
        torch.testing.assert_close(func.vmap(func.grad(_aggregates))(X, INDEX), want)
        assert remembered.batched_buffers
        batching_fails["now"] = True
        torch.testing.assert_close(func.vmap(func.grad(_aggregates))(X, INDEX), want)
        assert not remembered.batched_buffers and remembered.functionalized
        torch.testing.assert_close(func.vmap(func.grad(_aggregates))(X, INDEX), want)


def test_a_buffer_read_as_a_number_stays_batched(remembered: Any) -> None:
    """A batched buffer read with .item() (the same value for every sample) runs batched, as use()'s vmap reads a
    value the samples agree on."""

    def loss(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(3, dtype=x.dtype).index_add_(0, index, x)
        return (out * torch.zeros(1, dtype=x.dtype).add_(2.0).item()).square().sum()

    want = _loop_gradients(loss, X, INDEX)
    with registry.use():
        torch.testing.assert_close(func.vmap(func.grad(loss))(X, INDEX), want)
    assert remembered.batched_buffers


def test_a_buffer_over_the_limit_is_not_batched(remembered: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A buffer larger than BATCHED_BUFFER_LIMIT over the batch is made as the function makes it: the write into it
    sends the level to functionalization."""
    monkeypatch.setattr(fresh_buffers, "BATCHED_BUFFER_LIMIT", 4)
    want = _loop_gradients(_aggregates, X, INDEX)
    with registry.use():
        torch.testing.assert_close(func.vmap(func.grad(_aggregates))(X, INDEX), want)
    assert remembered.functionalized and not remembered.batched_buffers


class _Cube(torch.autograd.Function):
    """A user's autograd.Function: functionalize cannot run one ("NYI: Functionalize rule for
    custom_function_call")."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:
        return x * x * x

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return 3 * x * x * grad


def test_a_write_beside_an_autograd_function_runs_with_its_buffers_batched(remembered: Any) -> None:
    """A write into a fresh buffer of what a torch.autograd.Function returns: functionalized, the level could not
    run (the retry raised); with the buffers batched it runs and equals the loop."""

    def loss(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return torch.zeros(3, dtype=x.dtype).index_add_(0, index, _Cube.apply(x)).square().sum()

    want = _loop_gradients(loss, X, INDEX)
    with registry.use():
        torch.testing.assert_close(func.vmap(func.grad(loss))(X, INDEX), want)
    assert remembered.batched_buffers


def test_batched_buffers_are_made_in_cpp(region_kernel_calls: list[str], remembered: Any, routing_backend: str,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """On the C++ backend a batched-buffers region's buffers are made without Python (NOTE [batched buffers in C++]
    in kernels/fresh_buffers.cpp): neither a region kernel nor ``_batched_buffer`` runs, first call and remembered,
    and the gradients equal the loop's; on the Python backend the Python kernels make them."""
    made_in_python: list[str] = []
    make = fresh_buffers._batched_buffer

    def counted(overload: Any, *args: Any, **kwargs: Any) -> Any:
        made_in_python.append(overload.__name__)
        return make(overload, *args, **kwargs)

    monkeypatch.setattr(fresh_buffers, "_batched_buffer", counted)
    want = _loop_gradients(_aggregates, X, INDEX)
    with registry.use():
        for _ in range(2):
            torch.testing.assert_close(func.vmap(func.grad(_aggregates))(X, INDEX), want)
    assert remembered.batched_buffers and remembered.batched_buffers == remembered.functionalized
    if routing_backend == "cpp":
        assert made_in_python == []
        assert region_kernel_calls == []
    else:
        assert {"zeros.default", "new_zeros.default"} <= set(made_in_python)


def test_buffers_made_in_cpp_follow_the_rule(remembered: Any) -> None:
    """The C++ rule's cases, each equal to the loop: nested vmap (a buffer batched at both levels), a buffer made
    from a template batched at an outer level (its batching rule decides), jacrev over the batched level (a grad level
    outside the vmap: functionalized), and a buffer made under an inner vmap of the function (not the region's)."""
    x2 = torch.stack([X, X.flip(0)])
    index2 = torch.stack([INDEX, INDEX.flip(0)])
    with registry.use():
        torch.testing.assert_close(func.vmap(func.vmap(func.grad(_aggregates)))(x2, index2),
                                   torch.stack([_loop_gradients(_aggregates, x2[i], index2[i]) for i in range(2)]))

    def from_template(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(x).index_add_(0, index, x * WEIGHT).square().sum()

    with registry.use():
        torch.testing.assert_close(func.vmap(func.grad(from_template))(X, INDEX),
                                   _loop_gradients(from_template, X, INDEX))

    def batched_losses(x: torch.Tensor) -> torch.Tensor:
        return func.vmap(_aggregates)(x, INDEX)

    want = torch.autograd.functional.jacobian(lambda x: torch.stack([_aggregates(x[b], INDEX[b]) for b in range(4)]), X)
    with registry.use():
        torch.testing.assert_close(func.jacrev(batched_losses)(X), want)

    def inner_vmap(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        rows = func.vmap(lambda i: torch.zeros(3, dtype=x.dtype).index_add_(0, i, x * WEIGHT))(index.expand(2, 3))
        return rows.square().sum()

    with registry.use():
        torch.testing.assert_close(func.vmap(func.grad(inner_vmap))(X, INDEX), _loop_gradients(inner_vmap, X, INDEX))
