"""The custom_op kind (registry.core.kinds.CUSTOM_OP), added as one table entry, and its composite of
special_log_ndtr (composites/elementwise.py): a torch.library.custom_op with its own vmap rule, backward and fake
kernel, compared with PyTorch's own op in a per-sample loop outside any transform."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import func

import registry
from registry.core.kinds import KIND, KINDS
from registry.core.registration import RegistrationError, register

FALLBACK = "There is a performance drop"
X = torch.linspace(-6.0, 3.0, 4 * 5, dtype=torch.float64).reshape(4, 5)


def _loop(fn, batch: torch.Tensor) -> torch.Tensor:
    return torch.stack([fn(row) for row in batch])


def _native_grad(row: torch.Tensor) -> torch.Tensor:
    row = row.clone().requires_grad_()
    (torch.special.log_ndtr(row) * torch.arange(1.0, 6.0, dtype=row.dtype)).sum().backward()
    return row.grad


def _loss(fn):
    return lambda row: (fn(row) * torch.arange(1.0, 6.0, dtype=row.dtype)).sum()


def _custom_op():
    return registry.composites("special_log_ndtr")["custom_op"].fn


def test_custom_op_is_one_entry_of_the_kind_table() -> None:
    assert "custom_op" in KINDS and KIND["custom_op"].needs_function == "torch.library.custom_op"
    assert registry.composites("special_log_ndtr")["custom_op"].kind == "custom_op"


def test_under_vmap_it_equals_the_loop_without_a_fallback() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = func.vmap(_custom_op())(X)
    assert [str(w.message) for w in caught if FALLBACK in str(w.message)] == []
    torch.testing.assert_close(out, _loop(torch.special.log_ndtr, X))


def test_its_backward_equals_native_outside_transforms() -> None:
    grads = []
    for row in X:
        leaf = row.clone().requires_grad_()
        _loss(_custom_op())(leaf).backward()
        grads.append(leaf.grad)
    torch.testing.assert_close(torch.stack(grads), _loop(_native_grad, X))


@pytest.mark.parametrize("wrap", ["functionalize", "compile"])
def test_it_is_chosen_where_the_primitive_cannot_run(wrap: str) -> None:
    """functionalize(vmap) and torch.compile(vmap): native loops, the primitive is invalid; the custom op runs."""
    stack = "functionalize,vmap" if wrap == "functionalize" else "compile,vmap"
    decision = registry.select("special_log_ndtr", stack=stack, batched=["self"], dtype="float64")
    assert decision.composite == "custom_op", decision.reason
    f = func.vmap(torch.special.log_ndtr)
    f = func.functionalize(f) if wrap == "functionalize" else torch.compile(f, backend="aot_eager", fullgraph=True)
    with warnings.catch_warnings(record=True) as caught, registry.use(record=True) as run:
        warnings.simplefilter("always")
        out = f(X)
    assert [str(w.message) for w in caught if FALLBACK in str(w.message)] == []
    assert [d.composite for d in run.decisions] == ["custom_op"]
    torch.testing.assert_close(out, _loop(torch.special.log_ndtr, X))
    if wrap == "compile":
        torch._dynamo.reset()


def test_its_rule_is_what_torch_func_does_with_its_autograd() -> None:
    """vmap(grad) and jacrev refuse the custom op's registered autograd (the kind's rule says so, for every op): the
    routing picks another valid composite there, which equals the loop."""
    with pytest.raises(RuntimeError, match="setup_context"):
        func.vmap(func.grad(_loss(_custom_op())))(X)
    with pytest.raises(RuntimeError, match="setup_context"):
        func.jacrev(_custom_op())(X[0])
    for stack in ("vmap,grad", "grad", "vmap,jvp"):
        problem = next(v for v in registry.select("special_log_ndtr", stack=stack).alternatives
                       if v.composite == "custom_op")
        assert not problem.ok and "setup_context" in problem.reason
    with registry.use():
        grads = func.vmap(func.grad(_loss(torch.special.log_ndtr)))(X)
        jacobian = func.jacrev(torch.special.log_ndtr)(X[0])
    torch.testing.assert_close(grads, _loop(_native_grad, X))
    torch.testing.assert_close(jacobian, torch.autograd.functional.jacobian(torch.special.log_ndtr, X[0]))


def test_a_custom_op_composite_names_a_complete_custom_op() -> None:
    def special_log_ndtr_bare(self):
        return self

    with pytest.raises(RegistrationError, match="without its torch.library.custom_op"):
        register("special_log_ndtr", "custom_op", name="bare")(special_log_ndtr_bare)

    @torch.library.custom_op("multicomposite_test::log_ndtr_forward_only", mutates_args=())
    def forward_only(self: torch.Tensor) -> torch.Tensor:
        return torch.special.log_ndtr(self)

    with pytest.raises(RegistrationError, match="lacks register_autograd, register_vmap, register_fake"):
        register("special_log_ndtr", "custom_op", name="forward-only", function=forward_only)(special_log_ndtr_bare)
    assert set(registry.composites("special_log_ndtr")) == {"native", "primitive", "custom_op"}
