"""Input checks that make every composite reject what PyTorch's own op rejects, with the same exception type and
(where it is cheap to rebuild) the same message.

Each ``check_<op>`` runs at the top of a non-native composite, before any work. The checks read only metadata
(dtype, device, rank, shape), never data (but on the rare path of a complex value for a real tensor), so they cost
a few attribute reads on the hot path and work unchanged on
the tensors ``torch.func`` transforms pass in: under ``vmap`` a tensor's shape and rank are its per-sample (logical)
ones, which is exactly what native checks per sample. Checks that need data (an index out of range, a source with
fewer elements than the mask has Trues) are left to the kernels the composites call, which check them in the same
pass that does the work; ``index_out_of_bounds`` and ``source_too_small`` turn such a kernel error into native's
exception.
"""

from __future__ import annotations

from typing import Any, NoReturn

import torch

# c10::ScalarType names, as native messages print a dtype in most checks.
_SCALAR_TYPE_NAMES: dict[torch.dtype, str] = {
    torch.bool: "Bool", torch.uint8: "Byte", torch.int8: "Char", torch.int16: "Short", torch.int32: "Int",
    torch.int64: "Long", torch.float16: "Half", torch.bfloat16: "BFloat16", torch.float32: "Float",
    torch.float64: "Double", torch.complex64: "ComplexFloat", torch.complex128: "ComplexDouble",
}
# C++ type names, as native prints a dtype where it formats a caffe2::TypeMeta or a C++ type.
_CPP_TYPE_NAMES: dict[torch.dtype, str] = {
    torch.bool: "bool", torch.uint8: "unsigned char", torch.int8: "signed char", torch.int16: "short int",
    torch.int32: "int", torch.int64: "long int", torch.float16: "c10::Half", torch.bfloat16: "c10::BFloat16",
    torch.float32: "float", torch.float64: "double", torch.complex64: "c10::complex<float>",
    torch.complex128: "c10::complex<double>",
}
# The C++ type a Scalar is converted to, as in "value cannot be converted to type int64_t without overflow".
_SCALAR_CONVERSION_NAMES: dict[torch.dtype, str] = {
    **_CPP_TYPE_NAMES, torch.int8: "int8_t", torch.int16: "int16_t", torch.int32: "int", torch.int64: "int64_t",
    torch.uint8: "uint8_t",
}
_LAYOUT_NAMES: dict[torch.layout, str] = {torch.strided: "Strided", torch.sparse_coo: "Sparse"}
_CHANNELS_LAST_RANK: dict[torch.memory_format, tuple[int, str]] = {
    torch.channels_last: (4, "channels_last"),
    torch.channels_last_3d: (5, "channels_last_3d"),
}


def scalar_type_name(dtype: torch.dtype) -> str:
    return _SCALAR_TYPE_NAMES.get(dtype, str(dtype))


def _sizes(tensor: torch.Tensor) -> str:
    return "[" + ", ".join(str(size) for size in tensor.shape) + "]"


def check_dim(tensor: torch.Tensor, dim: int) -> None:
    """``dim`` must name a dimension of ``tensor`` (a 0-d tensor has one, as in native's ``maybe_wrap_dim``)."""
    rank = tensor.dim() or 1
    if not -rank <= dim < rank:
        raise IndexError(f"Dimension out of range (expected to be in range of [{-rank}, {rank - 1}], but got {dim})")


def _same_device(op: str, self: torch.Tensor, index: torch.Tensor, source: torch.Tensor) -> None:
    if index.device != self.device or source.device != self.device:
        raise RuntimeError(
            f"{op}(): self, index and source expected to be in the same device, but got (self) {self.device}, "
            f"(index) {index.device}, and (source) {source.device}"
        )


def _real_value(op_message: str, self: torch.Tensor, value: Any) -> None:
    """A complex value with an imaginary part cannot fill a real (non-bool) tensor: native refuses to drop it.

    A data check, on the rare path only (a complex value for a real tensor). A value batched under vmap cannot steer
    Python, so there the check runs inside a kernel: index_select's own bounds check rejects index 1 (an imaginary
    part) into a one-element tensor, in every sample.
    """
    if isinstance(value, torch.Tensor):
        if not value.is_complex() or self.is_complex() or self.dtype == torch.bool:
            return
        try:
            imaginary = bool(value.imag != 0)
        except RuntimeError:  # batched under vmap
            try:
                torch.zeros(1, device=value.device).index_select(0, (value.imag != 0).reshape(1).long())
            except (IndexError, RuntimeError) as error:
                raise RuntimeError(_conversion_message(op_message, self)) from error
            return
    elif isinstance(value, complex) and not self.is_complex() and self.dtype != torch.bool:
        imaginary = value.imag != 0
    else:
        return
    if imaginary:
        raise RuntimeError(_conversion_message(op_message, self))


def _conversion_message(op_message: str, self: torch.Tensor) -> str:
    return op_message.format(type=_SCALAR_CONVERSION_NAMES.get(self.dtype, str(self.dtype)))


def check_broadcast(op: str, mask: torch.Tensor, self: torch.Tensor) -> None:
    """``mask`` and ``self`` broadcast against each other (native's ``expand_outplace``), with native's message."""
    if mask.shape == self.shape:
        return
    rank = max(mask.dim(), self.dim())
    for dim in range(rank - 1, -1, -1):
        offset = rank - 1 - dim
        mask_size = mask.shape[mask.dim() - 1 - offset] if offset < mask.dim() else 1
        self_size = self.shape[self.dim() - 1 - offset] if offset < self.dim() else 1
        if mask_size != self_size and mask_size != 1 and self_size != 1:
            raise RuntimeError(
                f"The size of tensor a ({mask_size}) must match the size of tensor b ({self_size}) at non-singleton "
                f"dimension {dim}"
            )


# --- index family --------------------------------------------------------------------------------------------------


def _other_dims_match(self_shape: torch.Size, source_shape: torch.Size, dim: int) -> bool:
    """Whether the shapes agree in every dimension but ``dim`` (equal ranks), or exactly (either one 0-d).

    Indexes the sizes one by one: slicing a torch.Size builds a new one in Python (0.4 us a slice)."""
    rank = len(self_shape)
    if not rank or not source_shape:
        return self_shape == source_shape
    if len(source_shape) != rank:
        return False
    for d in range(rank):
        if d != dim and self_shape[d] != source_shape[d]:
            return False
    return True


def check_index_add(self: torch.Tensor, dim: int, index: torch.Tensor, source: torch.Tensor, alpha: Any) -> None:
    """What ``index_add`` rejects: native's meta function (``index_func_meta_impl``), in its order."""
    self_shape, source_shape = self.shape, source.shape
    rank = len(self_shape) or 1
    if not -rank <= dim < rank:
        check_dim(self, dim)
    if index.dim() > 1:
        raise IndexError(
            f"index_add_(): Index is supposed to be a vector, but got dim: {index.dim()} with type: "
            f"{scalar_type_name(index.dtype)} and size: {_sizes(index)}"
        )
    index_dtype = index.dtype
    if index_dtype is not torch.int64 and index_dtype is not torch.int32:
        raise RuntimeError(
            f"index_add_(): Expected dtype int32/int64 for index but got: {scalar_type_name(index.dtype)}"
        )
    if source.dtype != self.dtype:
        raise RuntimeError(
            f"index_add_(): self ({scalar_type_name(self.dtype)}) and source ({scalar_type_name(source.dtype)}) "
            "must have the same scalar type"
        )
    wrapped = dim % rank
    count = index.numel()
    if not source_shape:
        if count != 1:  # native reads source.size(dim) to format its message, which raises on a 0-d source
            raise IndexError(f"Dimension specified as {dim} but tensor has no dimensions")
    elif len(source_shape) > wrapped and count != source_shape[wrapped]:
        raise RuntimeError(
            f"index_add_(): Number of indices ({count}) should be equal to source.size(dim): "
            f"({source_shape[wrapped]}), for dim: {wrapped}"
        )
    if not _other_dims_match(self_shape, source_shape, wrapped):
        raise RuntimeError(
            "source tensor shape must match self tensor shape, excluding the specified dimension. "
            f"Got self.shape = {_sizes(self)} source.shape = {_sizes(source)}"
        )
    if not (self.is_cpu and index.is_cpu and source.is_cpu):  # reading .device builds a torch.device: 0.6 us
        _same_device("index_add", self, index, source)
    if alpha.__class__ is complex:
        _real_value("value cannot be converted to type {type} without overflow", self, alpha)


def native_alpha(self: torch.Tensor, alpha: Any) -> Any:
    """``alpha`` as native applies it: converted to self's type first, so a float alpha truncates for an integer
    tensor (2.5 adds 2 * source) instead of promoting source to float."""
    if alpha.__class__ is float and not (self.is_floating_point() or self.is_complex()):
        return bool(alpha) if self.dtype == torch.bool else int(alpha)
    return alpha


def _slices_match(self_shape: torch.Size, source_shape: torch.Size, dim: int) -> bool:
    """Whether the shapes without ``dim`` agree (index_copy's slice shapes; a 0-d shape's slice is empty)."""
    if len(self_shape) == len(source_shape):
        return _other_dims_match(self_shape, source_shape, dim) if self_shape else True
    # One of them 0-d (equal ranks otherwise, checked before): the other's slice must be empty too.
    return len(self_shape) <= 1 and len(source_shape) <= 1


def check_index_copy(self: torch.Tensor, dim: int, index: torch.Tensor, source: torch.Tensor) -> None:
    """What ``index_copy`` rejects: native's meta function, in its order."""
    self_shape, source_shape = self.shape, source.shape
    rank = len(self_shape) or 1
    if not -rank <= dim < rank:
        check_dim(self, dim)
    if index.dim() > 1:
        raise IndexError(f"index_copy_(): Index should have dimension 1 or 0 (got {index.dim()})")
    count = index.numel()
    if not source_shape and count != 1:
        raise IndexError(f"index_copy_(): When source is scalar, index should have one element (got {count})")
    if len(source_shape) != len(self_shape) and source_shape and self_shape:
        raise IndexError(
            "index_copy_(): When source and destination are not scalars, their dimensionality must match. "
            f"Source dimensionality ({source.dim()}), destination dimensionality ({self.dim()})"
        )
    if index.dtype != torch.int64:
        raise RuntimeError(f"index_copy_(): Expected a long tensor for index, but got {scalar_type_name(index.dtype)}")
    if source.dtype != self.dtype:
        raise RuntimeError(
            "index_copy_(): self and source expected to have the same dtype, but got (self) "
            f"{scalar_type_name(self.dtype)} and (source) {scalar_type_name(source.dtype)}"
        )
    if not (self.is_cpu and index.is_cpu and source.is_cpu):  # reading .device builds a torch.device: 0.6 us
        _same_device("index_copy", self, index, source)
    wrapped = dim % rank
    if not _slices_match(self_shape, source_shape, wrapped):
        self_slice = [size for d, size in enumerate(self_shape) if d != wrapped]
        source_slice = [size for d, size in enumerate(source_shape) if d != wrapped]
        raise RuntimeError(
            "index_copy_(): Source/destination tensor must have same slice shapes. Destination slice shape: "
            f"{' '.join(map(str, self_slice))} at dimension {wrapped} and source slice shape: "
            f"{' '.join(map(str, source_slice))} at dimension 0."
        )
    if source_shape and count != source_shape[wrapped]:
        raise IndexError(
            f"index_copy_(): Number of indices ({count}) should be equal to source.size(dim) ({source_shape[wrapped]})"
        )


def check_index_fill(self: torch.Tensor, dim: int, index: torch.Tensor, value: Any) -> None:
    """What ``index_fill`` rejects: native's ``index_fill_`` (Tensor, then Scalar overload), in its order."""
    value_is_tensor = isinstance(value, torch.Tensor)
    if value_is_tensor and value.dim():
        raise RuntimeError(
            f"index_fill_ only supports a 0-dimensional value tensor, but got tensor with {value.dim()} dimension(s)."
        )
    if index.dtype != torch.int64:
        raise IndexError("index_fill_(): Expected dtype int64 for index.")
    if value.is_complex() if value_is_tensor else value.__class__ is complex:
        _real_value("index_fill_(): Converting complex Scalar to non-complex type is not supported", self, value)
    rank = self.dim() or 1
    if not -rank <= dim < rank:
        check_dim(self, dim)
    if index.dim() > 1:
        raise RuntimeError("Index has to be a vector/scalar")
    if not (self.is_cpu and index.is_cpu) and index.device != self.device:
        raise RuntimeError(
            f"index_fill(): self and index expected to be in the same device, but got (self) {self.device} and "
            f"(index) {index.device}"
        )


def index_out_of_bounds(op: str, dim: int, size: int, error: RuntimeError, *, negative: bool = False) -> NoReturn:
    """Re-raise a kernel's bounds error (``scatter``: RuntimeError) as the IndexError native ``op`` raises; any other
    error unchanged. ``negative``: whether the op accepts indices from -size (index_fill) or from 0 (index_copy)."""
    if "out of bounds" not in str(error):
        raise error
    raise IndexError(
        f"{op}(): index out of bounds for dimension {dim} with size {size}: every index must lie in "
        f"[{-size if negative else 0}, {size})"
    ) from error


# --- masked family -------------------------------------------------------------------------------------------------


def check_masked_fill(self: torch.Tensor, mask: torch.Tensor, value: Any) -> None:
    """What ``masked_fill`` rejects: a mask that is not bool, on another device or that does not broadcast with self;
    a value tensor with dimensions or on another device (a CPU scalar may fill an accelerator's tensor); a complex
    value for a real tensor."""
    if isinstance(value, torch.Tensor):
        if value.dim():
            raise RuntimeError(
                f"masked_fill_ only supports a 0-dimensional value tensor, but got tensor with {value.dim()} "
                "dimension(s)."
            )
        if not value.is_cpu and value.device != self.device:  # a CPU scalar may fill any device's tensor
            raise RuntimeError("Expected `value` to be on same device as `a`")
        if value.is_complex():
            _real_value("value cannot be converted to type {type} without overflow", self, value)
    elif value.__class__ is complex:
        _real_value("value cannot be converted to type {type} without overflow", self, value)
    if mask.dtype != torch.bool:
        raise RuntimeError(
            "masked_fill_ only supports boolean masks, but got mask with dtype "
            f"{_CPP_TYPE_NAMES.get(mask.dtype, str(mask.dtype))}"
        )
    if not (mask.is_cpu and self.is_cpu) and mask.device != self.device:
        raise RuntimeError(
            f"masked_fill(): expected mask on {self.device}, the device of self, but got {mask.device}"
        )
    if mask.shape != self.shape:
        check_broadcast("masked_fill", mask, self)


def check_masked_scatter(self: torch.Tensor, mask: torch.Tensor, source: torch.Tensor) -> None:
    """What ``masked_scatter`` rejects before reading data: a source of another dtype, a mask that is not bool (uint8
    masks included: native has removed them). A source with fewer elements than the mask has Trues is data: the
    composites' own kernels reject it."""
    if self.dtype != source.dtype:
        raise RuntimeError(
            "masked_scatter: expected self and source to have same dtypes but got"
            f"{scalar_type_name(self.dtype)} and {scalar_type_name(source.dtype)}"
        )
    if mask.dtype != torch.bool:
        raise RuntimeError(
            f"masked_scatter_ only supports boolean masks, but got mask with dtype {scalar_type_name(mask.dtype)}"
        )
    if mask.shape != self.shape:
        check_broadcast("masked_scatter", mask, self)


def source_too_small(error: RuntimeError) -> NoReturn:
    """Re-raise a gather's bounds error in masked_scatter's source as native's error; any other error unchanged."""
    if "out of bounds" not in str(error):
        raise error
    raise RuntimeError("Number of elements of source < number of ones in mask") from error


# --- memory family -------------------------------------------------------------------------------------------------


def _memory_format_rank(self: torch.Tensor, memory_format: Any) -> None:
    required = _CHANNELS_LAST_RANK.get(memory_format)
    if required is not None and self.dim() != required[0]:
        raise RuntimeError(f"required rank {required[0]} tensor to use {required[1]} format")


def check_contiguous(self: torch.Tensor, memory_format: Any) -> None:
    """What ``contiguous`` rejects: ``preserve_format`` and a channels-last format for a tensor of another rank."""
    if memory_format is torch.preserve_format:
        raise RuntimeError("preserve memory format is unsupported by the contiguous operator")
    _memory_format_rank(self, memory_format)


def check_to(self: torch.Tensor, layout: Any, memory_format: Any) -> None:
    """What ``to`` rejects: another layout, and a channels-last format for a tensor of another rank."""
    if layout is not None and layout != self.layout:
        raise RuntimeError(
            "to(options) doesn't support converting to a different layout, but got self.layout being "
            f"{_LAYOUT_NAMES.get(self.layout, str(self.layout))} and options.layout set as "
            f"{_LAYOUT_NAMES.get(layout, str(layout))}"
        )
    _memory_format_rank(self, memory_format)
