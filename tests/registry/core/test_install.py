"""``install()`` / ``uninstall()``: the registry takes everything it put into PyTorch out again, and back."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch._functorch.apis as functorch_apis  # noqa: PLC2701 - functorch's internals have no public API
import torch._functorch.eager_transforms as eager_transforms  # noqa: PLC2701 - functorch's internals have no public API
import torch._functorch.vmap as functorch_vmap  # noqa: PLC2701
from torch import func

import registry
from registry.core import functionalization, transform_calls
from registry.core.context import DISPATCH_KEY
from registry.core.ops import ORIGINAL
from registry.core.routing import ROUTER

pytestmark = pytest.mark.usefixtures("routing_backend")

# A covered overload (and its Autograd-key kernel), a dynamic-shape refusal, control flow's, a fresh-buffer region's,
# the boolean-mask index's.
OVERLOADS = ("aten::index_fill.int_Tensor", "aten::nonzero", "aten::is_nonzero", "aten::item", "aten::empty_like",
             "aten::index.Tensor")
PYTORCH_SETITEM = torch.Tensor.__setitem__  # collected before any use() in this process patches it
TRANSFORM_IMPLEMENTATIONS = ("grad_and_value_impl", "_vjp_with_argnums", "_jvp_with_argnums")
PACKAGE = Path(registry.__file__).parent


def _wrapped_here(name: str) -> bool:
    """Whether functorch's ``name`` is one of our wrappers (the out= retry's, jvp's kernel registration's)."""
    return Path(getattr(eager_transforms, name).__code__.co_filename).is_relative_to(PACKAGE)


def _native_front_kernel(name: str) -> bool:
    """Whether the kernel at the functorch front key is PyTorch's own (DynamicLayer.cpp's fallthrough)."""
    return "DynamicLayer.cpp" in repr(torch.library.get_kernel(name, DISPATCH_KEY))


def _index_fill_value_grads() -> torch.Tensor:
    """vmap(grad) of index_fill with a negative index and a tensor value: PyTorch's derivative raises."""
    x = torch.randn(3, 4, 3, dtype=torch.float64)
    value = torch.tensor(2.0, dtype=torch.float64)

    def loss(row: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return (row.index_fill(0, torch.tensor([-1]), v) ** 2).sum()

    return func.vmap(func.grad(loss, argnums=1), in_dims=(0, None))(x, value)


@pytest.fixture
def uninstalled() -> Iterator[None]:
    with registry.use():  # something routed first, and a write functionalized (the fresh-buffer regions' kernels)
        _index_fill_value_grads()
        func.vmap(lambda v: torch.zeros(5).index_fill_(0, torch.tensor([1]), v))(torch.randn(3))
        func.vmap(lambda row: row[row > 0].sum())(torch.tensor([[1.0, -1.0], [2.0, 3.0]]))  # the mask kernel
    assert not _native_front_kernel("aten::empty_like")
    assert not _native_front_kernel("aten::index.Tensor") and torch.Tensor.__setitem__ is not PYTORCH_SETITEM
    registry.uninstall()
    try:
        yield
    finally:
        registry.install()


def test_uninstall_gives_pytorch_back(uninstalled: None) -> None:
    assert torch.Tensor.contiguous is ORIGINAL.Tensor.contiguous
    assert torch.Tensor.__setitem__ is PYTORCH_SETITEM
    assert functorch_vmap._flat_vmap is functionalization.PYTORCH_FLAT_VMAP
    assert functorch_apis.vmap_impl is transform_calls.PYTORCH_VMAP_IMPL
    assert not any(_wrapped_here(name) for name in TRANSFORM_IMPLEMENTATIONS)
    assert all(_native_front_kernel(name) for name in OVERLOADS)
    assert _native_front_kernel("aten::mul.out")  # the out= kernels' (the C++ backend's, with its routing kernels)
    assert "registry" not in torch._C._dispatch_dump("aten::index_fill.int_Tensor")  # the Autograd key's too
    assert not ROUTER.decisions and (ROUTER.cpp is None or ROUTER.cpp.size() == 0)
    with pytest.raises(RuntimeError, match="out of bounds"):  # PyTorch's own failure, as without the registry
        _index_fill_value_grads()
    with registry.use(record=True) as run:  # use() blocks route nothing until install()
        with pytest.raises(RuntimeError, match="out of bounds"):
            _index_fill_value_grads()
        with pytest.raises(RuntimeError, match="NYI: querying is_contiguous"):  # the contiguous wrapper is gone
            func.vmap(lambda r: r.contiguous(memory_format=torch.channels_last))(torch.randn(3, 2, 3, 4, 5))
        with pytest.raises(RuntimeError, match="is not possible because there exists"):  # so is the retry
            func.vmap(lambda v: torch.zeros(5).index_fill_(0, torch.tensor([1]), v))(torch.randn(3))
    assert run.decisions == []


def test_install_again_routes_again(uninstalled: None) -> None:
    registry.install()
    assert torch.Tensor.contiguous is not ORIGINAL.Tensor.contiguous
    assert not any(_native_front_kernel(name) for name in OVERLOADS[:4])  # empty_like's: at its first retry
    with registry.use(record=True) as run:
        grads = _index_fill_value_grads()
    torch.testing.assert_close(grads, torch.full((3,), 12.0, dtype=torch.float64))  # 2 * value * 3 filled rows
    assert run.calls == {"index_fill.int_Tensor": 1}


def test_transform_wrappers_by_backend(routing_backend: str) -> None:
    """The C++ backend registers the out= kernels with its routing kernels, so vjp's implementation stays PyTorch's
    own and grad's is transform_calls' lean one, without the retry; on the Python backend they retry an out= refusal.
    jvp's is wrapped on both (its in-place kernels are registered at the first jvp)."""
    registry.install()
    wrapped = {name for name in TRANSFORM_IMPLEMENTATIONS if _wrapped_here(name)}
    assert wrapped == (set(TRANSFORM_IMPLEMENTATIONS) if routing_backend == "python"
                       else {"_jvp_with_argnums", "grad_and_value_impl"})
    if routing_backend == "cpp":
        assert eager_transforms.grad_and_value_impl == transform_calls.PATCH.grad_and_value_impl
    if routing_backend == "cpp":
        assert not _native_front_kernel("aten::mul.out")
