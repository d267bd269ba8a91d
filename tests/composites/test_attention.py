"""scaled_dot_product_attention inside ``use()``: each composite (and the default choice) under vmap, vmap(grad), jacrev
and jacfwd against a per-sample loop of native PyTorch outside any transform, with boolean and additive masks (per
sample and shared), is_causal, scale, grouped-query attention, 2-, 3- and 4-d samples; no fallback to vmap's
per-sample loop; dropout under vmap's randomness modes; the fused kernel's own overloads; native's errors."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812 - PyTorch's own spelling
from torch import func

import registry

OP = "scaled_dot_product_attention"
BATCH = 3
TOLERANCE = {"rtol": 1e-4, "atol": 2e-5}


def _fallbacks(caught: list) -> list[str]:
    return [str(w.message) for w in caught if "There is a performance drop" in str(w.message)]


FUSED = ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_flash_attention_for_cpu_"
         "backward")


def _unexpected_fallbacks(caught: list, pin: str | None) -> list[str]:
    """vmap's loops other than native's own: under auto, native's loop over the fused kernel is a choice by cost at
    small sizes (registry/core/cost.py), so only a pinned composite must run without any."""
    return [m for m in _fallbacks(caught)
            if pin is not None or m.split("batching rule for ")[1].split(".")[0] not in FUSED]


@dataclass(frozen=True)
class Case:
    """Per-sample shapes of query, key and value, the mask (``per_sample``: batched like them, else shared) and the
    keyword arguments of the call."""

    name: str
    query: tuple[int, ...]
    key: tuple[int, ...]
    mask: str = "none"  # none | bool | float | padding
    per_sample_mask: bool = True
    kwargs: dict[str, Any] = field(default_factory=dict)


CASES = [
    Case("4d", (1, 2, 5, 8), (1, 2, 6, 8)),
    Case("3d", (2, 5, 8), (2, 6, 8)),
    Case("2d", (5, 8), (6, 8)),
    Case("bool-per-sample", (1, 2, 5, 8), (1, 2, 6, 8), "bool"),
    Case("bool-shared", (1, 2, 5, 8), (1, 2, 6, 8), "bool", per_sample_mask=False),
    Case("float-per-sample", (1, 2, 5, 8), (1, 2, 6, 8), "float"),
    Case("float-shared", (2, 5, 8), (2, 6, 8), "float", per_sample_mask=False),
    Case("padding", (1, 2, 5, 8), (1, 2, 6, 8), "padding"),
    Case("causal", (1, 2, 6, 8), (1, 2, 6, 8), kwargs={"is_causal": True}),
    Case("causal-rectangular", (1, 2, 4, 8), (1, 2, 7, 8), kwargs={"is_causal": True}),
    Case("scale", (1, 2, 5, 8), (1, 2, 6, 8), "bool", kwargs={"scale": 0.3}),
    Case("negative-scale", (2, 5, 8), (2, 6, 8), kwargs={"scale": -0.7}),
    Case("gqa", (1, 4, 5, 8), (1, 2, 6, 8), "padding", kwargs={"enable_gqa": True}),
]


def _mask(case: Case, generator: torch.Generator) -> torch.Tensor | None:
    length, source = case.query[-2], case.key[-2]
    lead = (BATCH,) if case.per_sample_mask else ()
    if case.mask == "bool":
        mask = torch.rand(*lead, 1, length, source, generator=generator) > 0.4
        mask[..., 0] = True  # every row keeps a column
        mask[..., 1, :] = False  # and one row is fully masked: zeros natively
        return mask
    if case.mask == "float":
        return torch.randn(*lead, 1, length, source, generator=generator)
    if case.mask == "padding":  # a key padding mask, per sample: the last positions are padding
        keep = torch.ones(*lead, 1, 1, source, dtype=torch.bool)
        keep[..., source - 2:] = False
        if lead:
            keep[0, ..., source - 1] = True
        return keep
    return None


def _inputs(case: Case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(BATCH, *case.query, generator=generator)
    key = torch.randn(BATCH, *case.key, generator=generator)
    value = torch.randn(BATCH, *case.key, generator=generator)
    return query, key, value, _mask(case, generator)


def _attention(case: Case) -> Callable[..., torch.Tensor]:
    def attention(query, key, value, mask):
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, **case.kwargs)

    return attention


def _sample(tensor: torch.Tensor | None, b: int, case: Case, is_mask: bool = False) -> torch.Tensor | None:
    if tensor is None or (is_mask and not case.per_sample_mask):
        return tensor
    return tensor[b]


def _mask_dim(case: Case, mask: torch.Tensor | None) -> int | None:
    return 0 if mask is not None and case.per_sample_mask else None


def _loop_values(case: Case, query, key, value, mask) -> torch.Tensor:
    attention = _attention(case)
    return torch.stack([attention(query[b], key[b], value[b], _sample(mask, b, case, True)) for b in range(BATCH)])


def _weights(case: Case) -> torch.Tensor:
    return torch.randn((*case.query[:-1], case.key[-1]), generator=torch.Generator().manual_seed(1))


def _loop_grads(case: Case, query, key, value, mask, with_mask: bool) -> tuple[torch.Tensor, ...]:
    attention, weights = _attention(case), _weights(case)
    grads = []
    for b in range(BATCH):
        leaves = [t[b].clone().requires_grad_() for t in (query, key, value)]
        sample_mask = _sample(mask, b, case, True)
        if with_mask:
            sample_mask = sample_mask.clone().requires_grad_()
            leaves.append(sample_mask)
        loss = (attention(*leaves[:3], sample_mask) * weights).sum()
        grads.append(torch.autograd.grad(loss, leaves))
    return tuple(torch.stack(each) for each in zip(*grads, strict=True))


PINS = [None, "functional", "primitive"]


def _use(pin: str | None) -> registry.use:
    return registry.use(pins={OP: pin} if pin else None)


def _ids(value: Any) -> str:
    return value.name if isinstance(value, Case) else str(value or "auto")


@pytest.mark.parametrize("pin", PINS, ids=_ids)
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_vmap_equals_the_native_loop(case: Case, pin: str | None, fallback_warnings: list) -> None:
    query, key, value, mask = _inputs(case)
    with _use(pin):
        out = func.vmap(_attention(case), in_dims=(0, 0, 0, _mask_dim(case, mask)))(query, key, value, mask)
    assert _unexpected_fallbacks(fallback_warnings, pin) == []
    torch.testing.assert_close(out, _loop_values(case, query, key, value, mask), **TOLERANCE)


@pytest.mark.parametrize("pin", PINS, ids=_ids)
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_vmap_grad_equals_the_native_loop(case: Case, pin: str | None, fallback_warnings: list) -> None:
    query, key, value, mask = _inputs(case)
    with_mask = case.mask == "float" and case.per_sample_mask  # a learned additive bias: its gradient too
    attention, weights = _attention(case), _weights(case)

    def loss(q, k, v, m):
        return (attention(q, k, v, m) * weights).sum()

    argnums = (0, 1, 2, 3) if with_mask else (0, 1, 2)
    with _use(pin):
        grads = func.vmap(func.grad(loss, argnums=argnums), in_dims=(0, 0, 0, _mask_dim(case, mask)))(
            query, key, value, mask)
    assert _unexpected_fallbacks(fallback_warnings, pin) == []
    expected = _loop_grads(case, query, key, value, mask, with_mask)
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want, **TOLERANCE)


def _native_jacobian(case: Case, query, key, value, mask) -> tuple[torch.Tensor, ...]:
    attention = _attention(case)
    return torch.autograd.functional.jacobian(lambda q, k, v: attention(q, k, v, mask), (query, key, value))


@pytest.mark.parametrize("transform", ["jacrev", "jacfwd"])
@pytest.mark.parametrize("pin", PINS, ids=_ids)
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_jacobians_equal_natives_outside_transforms(case: Case, pin: str | None, transform: str,
                                                    fallback_warnings: list) -> None:
    query, key, value, mask = (_sample(t, 0, case, i == 3) for i, t in enumerate(_inputs(case)))
    attention = _attention(case)
    jacobian = getattr(func, transform)
    with _use(pin):
        got = jacobian(lambda q, k, v: attention(q, k, v, mask), argnums=(0, 1, 2))(query, key, value)
    assert _unexpected_fallbacks(fallback_warnings, pin) == []
    for each, want in zip(got, _native_jacobian(case, query, key, value, mask), strict=True):
        torch.testing.assert_close(each, want, **TOLERANCE)


def test_hessian_takes_the_functional_composite_where_native_raises() -> None:
    query, key, value, _ = _inputs(CASES[0])
    query, key, value = query[0].double(), key[0].double(), value[0].double()

    def energy(q):
        return F.scaled_dot_product_attention(q, key, value).pow(2).sum()

    with pytest.raises(RuntimeError, match="forward AD with _scaled_dot_product_flash_attention_for_cpu"):
        func.hessian(energy)(query)
    with registry.use():
        hessian = func.hessian(energy)(query)
    assert registry.select(OP, stack="vmap(jvp(grad))").composite == "functional"
    leaf = query.clone()
    expected = torch.autograd.functional.hessian(
        lambda q: registry.composites(OP)["functional"].fn(q, key, value).pow(2).sum(), leaf)
    torch.testing.assert_close(hessian, expected)


# --- what auto picks, and the rules behind it --------------------------------------------------------------------


@pytest.mark.parametrize(("stack", "kind"), [
    ("", "native"), ("grad", "native"), ("vmap", "primitive"), ("vmap(grad)", "primitive"),
    ("vmap(jvp)", "primitive"), ("jvp", "functional"), ("grad(grad)", "functional"),
    ("vmap(jvp(grad))", "functional"), ("functionalize", "native"), ("vmap(functionalize)", "functional"),
])
def test_auto_picks_per_stack(stack: str, kind: str) -> None:
    assert registry.select(OP, stack=stack).kind == kind


def test_native_loops_under_vmap_over_4d_samples(fallback_warnings: list) -> None:
    # The evidence behind native's rule: natively 4-d samples take the fused kernel, which vmap loops over.
    query, key, value, _ = _inputs(CASES[0])
    bias = torch.zeros(BATCH, 1, 1, 5, 6)
    func.vmap(func.grad(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m).sum()))(
        query, key, value, bias)
    looped = {m.split("batching rule for ")[1].split(".")[0] for m in _fallbacks(fallback_warnings)}
    assert looped == {"aten::_scaled_dot_product_flash_attention_for_cpu",
                      "aten::_scaled_dot_product_flash_attention_for_cpu_backward"}


# --- dropout under vmap's randomness modes -----------------------------------------------------------------------


def _dropout(query, key, value):
    return F.scaled_dot_product_attention(query, key, value, dropout_p=0.4)


@pytest.mark.parametrize("pin", PINS, ids=_ids)
def test_dropout_refused_where_randomness_is_error(pin: str | None) -> None:
    query, key, value, _ = _inputs(CASES[0])
    with _use(pin), pytest.raises(RuntimeError, match="called random operation while in randomness error mode"):
        func.vmap(_dropout)(query, key, value)


@pytest.mark.parametrize("pin", PINS, ids=_ids)
def test_dropout_same_randomness_draws_one_mask_as_a_sample_does(pin: str | None) -> None:
    query, key, value, _ = _inputs(CASES[0])
    torch.manual_seed(7)
    with _use(pin):
        out = func.vmap(_dropout, randomness="same")(query, key, value)
    for b in range(BATCH):
        torch.manual_seed(7)
        torch.testing.assert_close(out[b], _dropout(query[b], key[b], value[b]), **TOLERANCE)


@pytest.mark.parametrize("pin", PINS, ids=_ids)
def test_dropout_different_randomness_equals_natives_draw(pin: str | None) -> None:
    query, key, value, _ = _inputs(CASES[1])  # 3-d samples: natively the math path, batched, one draw
    torch.manual_seed(11)
    native = func.vmap(_dropout, randomness="different")(query, key, value)
    torch.manual_seed(11)
    with _use(pin):
        out = func.vmap(_dropout, randomness="different")(query, key, value)
    torch.testing.assert_close(out, native, **TOLERANCE)
    assert not torch.allclose(out[0], out[1])  # each sample has its own mask


# --- the fused kernel's own overloads, called directly ---------------------------------------------------------------


def test_flash_overloads_under_vmap_fold_the_batch(fallback_warnings: list) -> None:
    query, key, value, mask = _inputs(CASES[5])
    bias = mask.unsqueeze(1)  # (B, 1, 1, L, S): the kernel's 4-d samples
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu

    def forward(q, k, v, m):
        return flash(q, k, v, attn_mask=m)[0]

    with registry.use(pins={OP: "primitive"}):  # auto may keep native's loop at this size, by cost
        out = func.vmap(forward)(query, key, value, bias)
        grads = func.vmap(func.grad(lambda q, k, v, m: forward(q, k, v, m).sum(), argnums=(0, 1, 2)))(
            query, key, value, bias)
    assert _fallbacks(fallback_warnings) == []
    torch.testing.assert_close(out, torch.stack([forward(*(t[b] for t in (query, key, value, bias)))
                                                 for b in range(BATCH)]), **TOLERANCE)
    for b in range(BATCH):
        leaves = [t[b].clone().requires_grad_() for t in (query, key, value)]
        expected = torch.autograd.grad(forward(*leaves, bias[b]).sum(), leaves)
        for got, want in zip(grads, expected, strict=True):
            torch.testing.assert_close(got[b], want, **TOLERANCE)


# --- native's errors ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pin", ["functional", "primitive"])
@pytest.mark.parametrize(("call", "message"), [
    (lambda q, k, v: F.scaled_dot_product_attention(q, k.double(), v),
     "Expected query, key, and value to have the same dtype, but got query.dtype: float key.dtype: double and "
     "value.dtype: float instead."),
    (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(5, 6, dtype=torch.int64)),
     "Expected attn_mask dtype to be bool or float or to match query dtype, but got attn_mask.dtype: long int and  "
     "query.dtype: float instead."),
    (lambda q, k, v: F.scaled_dot_product_attention(q[:, :1].expand(1, 3, 5, 8), k, v, enable_gqa=True),
     "Number of heads in key and value must divide the number of heads in "),
])
def test_errors_are_natives(call, message: str, pin: str) -> None:
    query, key, value = _inputs(CASES[0])[:3]
    with pytest.raises(RuntimeError) as native:
        call(query[0], key[0], value[0])
    assert message in str(native.value)
    with registry.use(pins={OP: pin}), pytest.raises(RuntimeError) as routed:
        func.vmap(call)(query, key, value)
    assert message in str(routed.value)
