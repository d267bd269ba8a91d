"""Composites of the elementwise family: ops that broadcast their tensor arguments and compute each output element
from the matching input elements, but have no batching rule in PyTorch 2.13 (``special.*_polynomial_*``,
``special.log_ndtr``, ``special.airy_ai``), or a derivative rule that functorch gets wrong (``special.entr``).

The generic family is JAX's ``defbroadcasting``: ``broadcasting(...)`` makes, once per op, a primitive
(``torch.autograd.Function``) whose vmap rule calls PyTorch's own kernel on the physical tensors, batch dimension
first and every tensor padded to the same logical rank, so that the op runs once over the whole batch; its backward
and jvp apply the op's derivative formula (the one in PyTorch's ``derivatives.yaml``), and an op that PyTorch does
not differentiate gets an output that does not require grad, as natively.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.autograd import Function

from composites.checks import check_dim
from registry.core import rules
from registry.core.context import vmap_active
from registry.core.cost import batch_and_numel
from registry.core.kinds import LazyCustomOp
from registry.core.primitive import apply, batch_first
from registry.core.registration import define_op, register
from registry.core.rules import Problem

aten = torch.ops.aten

# A partial derivative of an elementwise op: (the op's arguments, its output) -> d output / d that argument.
Partial = Callable[[Sequence[Any], torch.Tensor], torch.Tensor]


# --- the generic family ------------------------------------------------------------------------------------------


def _logical_dtype(args: Sequence[Any], in_dims: Sequence[int | None]) -> torch.dtype | None:
    """The dtype PyTorch's type promotion gives the op's tensor arguments as vmap presents them (logical shapes).

    Promotion ranks a 0-d tensor below a dimensioned one: a batched 0-d argument is dimensioned physically, so the
    physical call alone would promote differently (float32 input, 0-d float64 argument: float32 natively).
    """
    proxies = []
    for value, dim in zip(args, in_dims, strict=True):
        if isinstance(value, torch.Tensor):
            logical_rank = value.dim() - (dim is not None)
            proxies.append(torch.empty((1,) * min(logical_rank, 1), dtype=value.dtype))
    if len(proxies) < 2:
        return None
    dtype = torch.result_type(proxies[0], proxies[1])
    for proxy in proxies[2:]:
        dtype = torch.promote_types(dtype, proxy.dtype)
    return dtype


def batch_broadcast(info: Any, in_dims: Sequence[int | None], args: Sequence[Any], *,
                    promote: bool = True) -> list[Any]:
    """The arguments of a broadcasting op at one vmap level, as physical tensors the op broadcasts right: batched
    tensors with their batch dimension first and singleton dimensions after it up to the largest logical rank,
    unbatched ones as they are (they broadcast against the batch dimension), cast to the logical promoted dtype
    (unless ``promote`` is False: ops such as isclose that require equal dtypes keep raising as natively)."""
    ranks = [value.dim() - (dim is not None) for value, dim in zip(args, in_dims, strict=True)
             if isinstance(value, torch.Tensor)]
    rank = max(ranks, default=0)
    dtype = _logical_dtype(args, in_dims) if promote else None
    moved = []
    for value, dim in zip(args, in_dims, strict=True):
        if isinstance(value, torch.Tensor):
            if dim is not None:
                value = value.movedim(dim, 0)
                value = value.reshape((value.shape[0],) + (1,) * (rank - value.dim() + 1) + value.shape[1:])
            if dtype is not None and value.dtype != dtype and not value.dtype.is_complex:
                value = value.to(dtype)
        moved.append(value)
    return moved


def broadcasting(name: str, call: Callable[..., torch.Tensor], *, partials: dict[int, Partial] | None = None,
                 jvp_zero_tangent_is_zero: bool = False, promote: bool = True) -> type[Function]:
    """A primitive for the broadcasting elementwise op ``call`` (PyTorch's own kernel).

    ``partials``: argument position -> its partial derivative (PyTorch's formula); None for an op PyTorch does not
    differentiate (its output is marked non-differentiable). ``jvp_zero_tangent_is_zero``: a zero tangent gives a zero
    output tangent even where the partial is nan or inf, as reverse mode gives a zero cotangent to the other
    elements; functorch's jacfwd pushes one-hot tangents, which otherwise spread one element's nan to every column.
    """

    def forward(*args: Any) -> torch.Tensor:
        return call(*args)

    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        if partials is None:
            ctx.mark_non_differentiable(output)
            return
        positions = tuple(i for i, value in enumerate(inputs) if isinstance(value, torch.Tensor))
        ctx.positions = positions
        ctx.others = tuple(None if i in positions else value for i, value in enumerate(inputs))
        ctx.shapes = tuple(value.shape if isinstance(value, torch.Tensor) else None for value in inputs)
        ctx.save_for_backward(*(inputs[i] for i in positions), output)
        ctx.save_for_forward(*(inputs[i] for i in positions), output)

    def _restored(ctx: Any) -> tuple[list[Any], torch.Tensor]:
        *tensors, output = ctx.saved_tensors
        args = list(ctx.others)
        for position, tensor in zip(ctx.positions, tensors, strict=True):
            args[position] = tensor
        return args, output

    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if partials is None:
            raise RuntimeError(f"the derivative for '{name}' is not implemented.")
        args, output = _restored(ctx)
        grads: list[torch.Tensor | None] = [None] * len(args)
        for position, partial in partials.items():
            if position < len(args) and ctx.needs_input_grad[position]:
                grads[position] = (grad * partial(args, output)).sum_to_size(ctx.shapes[position])
        return tuple(grads)

    def jvp(ctx: Any, *tangents: torch.Tensor | None) -> torch.Tensor:
        if partials is None:
            raise RuntimeError(f"the derivative for '{name}' is not implemented.")
        args, output = _restored(ctx)
        total: torch.Tensor | None = None
        for position, partial in partials.items():
            tangent = tangents[position] if position < len(tangents) else None
            if tangent is None:
                continue
            term = tangent * partial(args, output)
            if jvp_zero_tangent_is_zero:
                term = torch.where(tangent == 0, torch.zeros((), dtype=term.dtype), term)
            total = term if total is None else total + term
        return total if total is not None else torch.zeros_like(output)

    def vmap(info: Any, in_dims: tuple[int | None, ...], *args: Any) -> tuple[torch.Tensor, int]:
        return apply(primitive, *batch_broadcast(info, in_dims, args, promote=promote)), 0

    primitive = type(f"Broadcasting_{name}", (Function,), {
        "__doc__": f"{name}, elementwise: PyTorch's own kernel once over the whole batch under vmap.",
        "__module__": __name__, "generate_vmap_rule": False,
        "forward": staticmethod(forward), "setup_context": staticmethod(setup_context),
        "backward": staticmethod(backward), "jvp": staticmethod(jvp), "vmap": staticmethod(vmap),
    })
    return primitive


def register_broadcasting(op: str, overload: str, call: Callable[..., torch.Tensor], *,
                          partials: dict[int, Partial] | None = None, jvp_zero_tangent_is_zero: bool = False,
                          promote: bool = True) -> type[Function]:
    """Register ``broadcasting(...)`` as ``op``'s primitive composite, with the schema's parameters."""
    primitive = broadcasting(op, call, partials=partials, jvp_zero_tangent_is_zero=jvp_zero_tangent_is_zero,
                             promote=promote)
    schema = getattr(getattr(aten, op), overload or "default")._schema
    parameters = [inspect.Parameter(arg.name, inspect.Parameter.KEYWORD_ONLY if arg.kwarg_only
                                    else inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                    default=arg.default_value if arg.has_default_value() else inspect.Parameter.empty)
                  for arg in schema.arguments if arg.name != "out"]
    signature = inspect.Signature(parameters)

    def composite(*args: Any, **kwargs: Any) -> torch.Tensor:
        if len(args) == len(parameters):  # the dispatcher's usual call: every argument positional
            return apply(primitive, *args)
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return apply(primitive, *bound.arguments.values())

    composite.__signature__ = signature  # type: ignore[attr-defined]
    composite.__name__ = f"{op}_primitive"
    composite.__doc__ = (f"{primitive.__name__}: PyTorch's own {op} kernel, called once on the whole batch under "
                         "vmap (batch dimensions aligned), with the op's derivative formula as backward and jvp.")
    register(op, "primitive", function=primitive)(composite)
    return primitive


_vmap_and_jvp = rules.under_vmap_with("jvp")


# --- the ops -----------------------------------------------------------------------------------------------------
#
# The orthogonal polynomials take (x, n) and broadcast them; PyTorch does not differentiate them (the output does
# not require grad), and none has a batching rule.

POLYNOMIALS = (
    "chebyshev_polynomial_t", "chebyshev_polynomial_u", "chebyshev_polynomial_v", "chebyshev_polynomial_w",
    "shifted_chebyshev_polynomial_t", "shifted_chebyshev_polynomial_u", "shifted_chebyshev_polynomial_v",
    "shifted_chebyshev_polynomial_w", "hermite_polynomial_h", "hermite_polynomial_he", "laguerre_polynomial_l",
    "legendre_polynomial_p",
)

for _polynomial in POLYNOMIALS:
    define_op(f"special_{_polynomial}", "", tensors=("x", "n"), doc=f"the {_polynomial.replace('_', ' ')} of degree "
              "n at x, elementwise", opinfo=(f"special.{_polynomial}",), inplace=False,
              rules={"native": rules.no_batching_rule(f"aten::special_{_polynomial}")},
              sizes=batch_and_numel)  # NOTE: vmap's loop beats the primitive over a few small samples: by cost
    # The public function, not the aten packet: the packet resolves a Python-number n by trying the Tensor overload
    # first, and the failed match formats every argument into its error message (30 ms for 64,000 elements).
    register_broadcasting(f"special_{_polynomial}", "", getattr(torch.special, _polynomial))

define_op("special_airy_ai", "", tensors=("x",), doc="the Airy function Ai at x, elementwise",
          opinfo=("special.airy_ai",), inplace=False, rules={"native": rules.no_batching_rule("aten::special_airy_ai")},
          sizes=batch_and_numel)  # NOTE: vmap's loop beats the primitive over a few small samples: by cost
register_broadcasting("special_airy_ai", "", aten.special_airy_ai)

define_op("special_log_ndtr", "", tensors=("self",), doc="log of the standard normal CDF at self, elementwise",
          opinfo=("special.log_ndtr",), inplace=False,
          rules={"native": rules.no_batching_rule("aten::special_log_ndtr")},
          sizes=batch_and_numel)  # NOTE: vmap's loop beats the primitive over a few small samples: by cost
# derivatives.yaml: grad / sqrt(2 pi) * exp(-(result + self^2 / 2))
register_broadcasting("special_log_ndtr", "", aten.special_log_ndtr, partials={
    0: lambda args, out: (out + args[0].pow(2) / 2).neg().exp() / math.sqrt(2 * math.pi)})


def _define_log_ndtr() -> Any:
    """``multicomposite::special_log_ndtr``: PyTorch's own kernel as one dispatcher op, with its own vmap rule (the
    kernel once over the physical batch), backward (derivatives.yaml's formula) and fake kernel (torch.compile)."""

    @torch.library.custom_op("multicomposite::special_log_ndtr", mutates_args=())
    def log_ndtr(self: torch.Tensor) -> torch.Tensor:
        return aten.special_log_ndtr(self)  # below every transform, on the plain tensor

    @log_ndtr.register_fake
    def _(self: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(self, dtype=self.dtype if self.is_floating_point() else torch.get_default_dtype())

    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        ctx.save_for_backward(inputs[0], output)

    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        self, out = ctx.saved_tensors
        return grad * (out + self.pow(2) / 2).neg().exp() / math.sqrt(2 * math.pi)

    log_ndtr.register_autograd(backward, setup_context=setup_context)
    log_ndtr.register_vmap(lambda info, in_dims, self: (log_ndtr(self), in_dims[0]))
    return log_ndtr


LOG_NDTR = LazyCustomOp("multicomposite::special_log_ndtr", _define_log_ndtr, op="special_log_ndtr")


@register("special_log_ndtr", "custom_op", function=LOG_NDTR)
def special_log_ndtr_custom_op(self):
    """multicomposite::special_log_ndtr: PyTorch's kernel once over the whole batch under vmap, as one dispatcher
    op that functionalize and torch.compile keep whole (where the primitive cannot run)."""
    return LOG_NDTR.get()(self)


def _entr_native(ctx: Any) -> Problem | None:
    if _vmap_and_jvp(ctx):
        return Problem("mismatch", "entr's forward-AD formula multiplies the tangent by -(1 + log x), nan for x < 0: "
                                   "jacfwd's one-hot tangents spread that nan to every column (0 * nan), where "
                                   "reverse mode gives those elements a zero derivative")
    return None


define_op("special_entr", "", tensors=("self",), doc="-self * log(self), elementwise (0 at 0, -inf below)",
          opinfo=("special.entr",), inplace=False, rules={"native": _entr_native})
# derivatives.yaml: grad * (-(1 + self.log()))
register_broadcasting("special_entr", "", aten.special_entr, partials={0: lambda args, out: -(1 + args[0].log())},
                      jvp_zero_tangent_is_zero=True)


# --- comparisons: isclose, isin ----------------------------------------------------------------------------------

define_op("isclose", "", tensors=("self", "other"), doc="whether self and other are close, elementwise",
          opinfo=("isclose",), inplace=False, rules={"native": rules.no_batching_rule("aten::isclose")})
# isclose requires equal dtypes: no promotion, so a mixed call raises as natively.
register_broadcasting("isclose", "", aten.isclose, promote=False)


def _sorted_membership(elements: torch.Tensor, test_elements: torch.Tensor) -> torch.Tensor:
    """Per batch row b, whether each of ``elements[b]`` is among ``test_elements[b]`` (both (batch, n), same
    dtype): a sort and a binary search, which batch (isin's own kernel does not, and a broadcast comparison costs
    n * m). NaN is sorted last and never equals itself, as in isin."""
    if test_elements.shape[1] == 0:
        return torch.zeros(elements.shape, dtype=torch.bool, device=elements.device)
    ordered = test_elements.sort(-1).values
    position = torch.searchsorted(ordered, elements).clamp_max(ordered.shape[1] - 1)
    return ordered.gather(1, position) == elements


class IsIn(Function):
    """isin(elements, test_elements) with its own vmap rule: PyTorch's kernel once over the batch where only the
    elements are batched, a batched sort and binary search where the test elements are. Not differentiable."""

    generate_vmap_rule = False

    @staticmethod
    def forward(elements: Any, test_elements: Any, assume_unique: bool, invert: bool) -> torch.Tensor:
        return torch.isin(elements, test_elements, assume_unique=assume_unique, invert=invert)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        ctx.mark_non_differentiable(output)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, ...]:
        raise RuntimeError("the derivative for 'isin' is not implemented.")

    @staticmethod
    def jvp(ctx: Any, *tangents: Any) -> torch.Tensor:
        raise RuntimeError("the derivative for 'isin' is not implemented.")

    @staticmethod
    def vmap(info: Any, in_dims: tuple[int | None, ...], elements: Any, test_elements: Any, assume_unique: bool,
             invert: bool) -> tuple[torch.Tensor, int]:
        if in_dims[1] is None:  # a test set shared by every sample: isin itself, once over the whole batch
            return apply(IsIn, elements.movedim(in_dims[0], 0), test_elements, assume_unique, invert), 0
        dtype = _logical_dtype((elements, test_elements), in_dims[:2]) if isinstance(elements, torch.Tensor) else None
        test = test_elements.movedim(in_dims[1], 0)
        if not isinstance(elements, torch.Tensor):
            elements = torch.tensor(elements, dtype=test.dtype, device=test.device)  # scalar: promotion as isin's
        dtype = dtype or torch.result_type(elements, test)
        (elements,) = batch_first(info, in_dims[:1], elements)
        shape = elements.shape
        found = _sorted_membership(elements.reshape(info.batch_size, -1).to(dtype),
                                   test.reshape(info.batch_size, -1).to(dtype)).reshape(shape)
        return (~found if invert else found), 0


define_op("isin", "Tensor_Tensor", tensors=("elements", "test_elements"),
          doc="whether each of elements is among test_elements", opinfo=("isin",), inplace=False,
          rules={"native": rules.no_batching_rule("aten::isin")},
          sizes=batch_and_numel)  # NOTE: vmap's loop beats the primitive over a few small samples: by cost


@register("isin", "primitive", function=IsIn)
def isin_primitive(elements, test_elements, *, assume_unique=False, invert=False):
    """IsIn: isin's own kernel once over the batch, or a batched sort and binary search for batched test
    elements."""
    return apply(IsIn, elements, test_elements, assume_unique, invert)


# --- conversions, normalizations, gates ---------------------------------------------------------------------------

define_op("chalf", "", tensors=("self",), doc="self as complex32", opinfo=("chalf",), inplace=False,
          rules={"native": rules.no_batching_rule("aten::chalf")})


@register("chalf", "functional")
def chalf_functional(self, *, memory_format=None):
    """_to_copy to complex32, which batches (chalf is a CompositeExplicit wrapper of it without a batching rule)."""
    if memory_format not in (None, torch.preserve_format, torch.contiguous_format):
        # _to_copy's batching rule applies a channels_last format to the batched tensor (one dimension more):
        # PyTorch's own chalf, which loops per sample, where the format fits each sample.
        return aten.chalf(self, memory_format=memory_format)
    return aten._to_copy(self, dtype=torch.complex32, memory_format=memory_format)


define_op("renorm", "", tensors=("self",), doc="self with each slice along dim rescaled to p-norm at most maxnorm",
          opinfo=("renorm",), inplace=False, rules={"native": rules.no_batching_rule("aten::renorm")},
          sizes=batch_and_numel)  # NOTE: vmap's loop beats the composite over a few small samples: by cost


@register("renorm", "functional")
def renorm_functional(self, p, dim, maxnorm):
    """self * where(norm > maxnorm, maxnorm / (norm + 1e-7), 1), the norm over every dimension but dim (as
    PyTorch's kernel and torch._refs.renorm compute it)."""
    if isinstance(p, complex) or isinstance(maxnorm, complex):
        raise RuntimeError("renorm: p and maxnorm must be real-valued")
    if not p > 0:
        raise RuntimeError("renorm: non-positive-norm not supported")
    if maxnorm < 0:
        raise RuntimeError(f"renorm: expected maxnorm to be >= 0 but got {maxnorm}")
    if self.dim() <= 1:
        raise RuntimeError(f"renorm: input needs at least 2 dimensions, got {self.dim()} dimensions")
    check_dim(self, dim)
    reduce = [d for d in range(self.dim()) if d != dim % self.dim()]
    accumulate = torch.float32 if self.dtype in (torch.float16, torch.bfloat16) else self.dtype
    norm = torch.linalg.vector_norm(self, p, reduce, keepdim=True, dtype=accumulate)
    factor = torch.where(norm > maxnorm, maxnorm / (norm + 1e-7), torch.ones((), dtype=norm.dtype))
    return self * factor.to(self.dtype)


define_op("glu", "", tensors=("self",), doc="first half of self along dim times the sigmoid of the second half",
          opinfo=("nn.functional.glu",), inplace=False,
          rules={"native": rules.forward_ad_without_batching_rule("aten::glu_jvp")})


@register("glu", "functional")
def glu_functional(self, dim=-1):
    """a * sigmoid(b) for the two halves a, b of self along dim: its forward AD is that of mul and sigmoid, which
    batch (glu's own, glu_jvp, does not)."""
    if self.dim() == 0:
        raise RuntimeError("glu does not support scalars because halving size must be even")
    size = self.shape[dim]
    if size % 2:
        wrapped = dim % self.dim()
        raise RuntimeError(f"Halving dimension must be even, but dimension {wrapped} is size {size}")
    half = size // 2
    return self.narrow(dim, 0, half) * torch.sigmoid(self.narrow(dim, half, half))


# --- rrelu: a random activation ------------------------------------------------------------------------------------
# aten::rrelu decomposes to rrelu_with_noise, which has no batching rule (vmap raises "we do not yet support
# aten::rrelu"), and neither has its backward, rrelu_with_noise_backward (vmap(grad), jacrev). Its output is self times
# a noise tensor that is also its derivative, so the functional composite computes the noise and multiplies: backward
# and forward AD are those of a multiply, which batch.


define_op("rrelu", "", tensors=("self",), doc="self where positive, else self times a slope drawn uniformly from "
          "[lower, upper] (training) or their mean (eval)", opinfo=("nn.functional.rrelu",),
          rules={"native": rules.first_of(
              rules.no_batching_rule("aten::rrelu_with_noise", status="error"),
              rules.backward_without_batching_rule("aten::rrelu_with_noise_backward"))})


@register("rrelu", "functional")
def rrelu_functional(self, lower=0.125, upper=1.0 / 3.0, training=False, generator=None):
    """self * noise. In eval the noise is 1 where self > 0 and the mean slope elsewhere (leaky_relu's values). In
    training, outside vmap, it is the native op's own draw (rrelu_with_noise_functional: the same generator calls, so
    the same values as native for a seed); under vmap it is a random op of vmap's (randomness='error' refuses as for
    any random op, 'same' and 'different' draw as asked)."""
    if lower > upper:  # native's check, in its words, in eval too
        raise RuntimeError("Lower bound should be less than or equal to the upper bound")
    if not training:
        # The slope as a tensor of self's dtype: two Python numbers in torch.where would make a float32 tensor.
        slope = torch.full((), (lower + upper) / 2, dtype=self.dtype, device=self.device)
        return self * torch.where(self > 0, 1.0, slope)
    if not vmap_active():
        _, noise = torch.ops.aten.rrelu_with_noise_functional(self.detach(), torch.empty_like(self.detach()), lower,
                                                              upper, True, generator=generator)
        return self * noise
    draws = torch.rand(self.shape, dtype=self.dtype, device=self.device, generator=generator)
    return self * torch.where(self <= 0, lower + (upper - lower) * draws, 1.0)
