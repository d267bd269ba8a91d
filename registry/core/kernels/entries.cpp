// The entry ops of the fused primitives' cpp_op composites (composites/cpp_ops.py):
// multicomposite::masked_fill.Scalar and .Tensor, multicomposite::index_fill.int_Scalar and .int_Tensor take the
// arguments of aten's overloads of the same names, multicomposite::masked_scatter.entry aten::masked_scatter's. The
// composites are these ops, so the C++ routing calls them where a decision picks the cpp_op composite
// (register(..., redirect=)): a routed call runs no Python.
//
// Each does what the composite did in Python before it: the arguments of the common case are adapted (a Scalar value
// as a 0-d tensor of self's dtype, a value tensor cast to it; a 0-d or 1-d index_fill viewed as 1-d at dim 0; self
// and mask broadcast to one shape for masked_scatter) and passed to multicomposite::fill, index_fill or
// masked_scatter (fused_ops.cpp), whose autograd and batching kernels do the work.
// NOTE: arguments PyTorch rejects, and the rare path of a complex value for a real tensor (refused only where its
// imaginary part is not 0, a data check), go to PyTorch's own op instead. It raises its own error, or computes the
// result. No second copy of its messages, and no Python: inside a routed call the routing's busy flag passes that
// call straight to PyTorch's kernel.

#include <ATen/ATen.h>
#include <ATen/ExpandUtils.h>
#include <ATen/WrapDimUtils.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <vector>

namespace multicomposite_fused {  // fused_ops.cpp

const c10::TypedOperatorHandle<at::Tensor(const std::optional<at::Tensor>&, const at::Tensor&,
                                          const std::optional<at::Tensor>&)>&
fill_op();
const c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t)>&
scatter_op();

}  // namespace multicomposite_fused

namespace {

using at::Tensor;
using multicomposite_fused::fill_op;
using multicomposite_fused::scatter_op;

const c10::TypedOperatorHandle<Tensor(const Tensor&, int64_t, const Tensor&, const std::optional<Tensor>&)>&
index_fill_op() {
  static const auto handle = c10::Dispatcher::singleton()
                                 .findSchemaOrThrow("multicomposite::index_fill", "")
                                 .typed<Tensor(const Tensor&, int64_t, const Tensor&, const std::optional<Tensor>&)>();
  return handle;
}

// Whether shapes `a` and `b` broadcast against each other.
bool broadcastable(at::IntArrayRef a, at::IntArrayRef b) {
  for (size_t i = 1; i <= std::min(a.size(), b.size()); ++i) {
    const int64_t x = a[a.size() - i], y = b[b.size() - i];
    if (x != y && x != 1 && y != 1) return false;
  }
  return true;
}

// A complex value for a real, non-bool tensor: PyTorch's op decides (it refuses a value whose imaginary part is not 0).
bool complex_into_real(bool value_is_complex, const Tensor& self) {
  return value_is_complex && !self.is_complex() && self.scalar_type() != at::kBool;
}

bool same_device_or_cpu_scalar(const Tensor& value, const Tensor& self) {
  return value.is_cpu() || value.device() == self.device();
}

// `value` as the 0-d tensor of self's dtype and device that the fused ops take.
Tensor value_like(const Tensor& value, const Tensor& self) {
  if (value.scalar_type() == self.scalar_type() && value.device() == self.device()) return value;
  return value.to(self.device(), self.scalar_type());
}

Tensor value_like(const at::Scalar& value, const Tensor& self) {
  return at::scalar_tensor(value, self.options().requires_grad(false));
}

// --- masked_fill -------------------------------------------------------------------------------------------------

bool masked_fill_takes(const Tensor& self, const Tensor& mask) {
  return mask.scalar_type() == at::kBool && ((mask.is_cpu() && self.is_cpu()) || mask.device() == self.device()) &&
         broadcastable(mask.sizes(), self.sizes());
}

Tensor masked_fill_tensor(const Tensor& self, const Tensor& mask, const Tensor& value) {
  if (!masked_fill_takes(self, mask) || value.dim() != 0 || !same_device_or_cpu_scalar(value, self) ||
      complex_into_real(value.is_complex(), self)) {
    return at::masked_fill(self, mask, value);
  }
  return fill_op().call(self, mask, value_like(value, self));
}

Tensor masked_fill_scalar(const Tensor& self, const Tensor& mask, const at::Scalar& value) {
  if (!masked_fill_takes(self, mask) || complex_into_real(value.isComplex(), self)) {
    return at::masked_fill(self, mask, value);
  }
  return fill_op().call(self, mask, value_like(value, self));
}

// --- index_fill --------------------------------------------------------------------------------------------------

bool index_fill_takes(const Tensor& self, int64_t dim, const Tensor& index) {
  const int64_t rank = std::max<int64_t>(self.dim(), 1);
  return index.scalar_type() == at::kLong && index.dim() <= 1 && -rank <= dim && dim < rank &&
         ((self.is_cpu() && index.is_cpu()) || index.device() == self.device());
}

// multicomposite::index_fill on self viewed with dim made non-negative (0-d and 1-d: as 1-d at dim 0), the result
// in self's shape and, as PyTorch's clone-then-fill gives it, with self's strides.
Tensor index_fill_rank1(const Tensor& self, int64_t dim, const Tensor& index, const Tensor& value) {
  const bool flat = self.dim() <= 1;
  const Tensor filled = index_fill_op()
                            .call(flat ? self.reshape({-1}) : self, flat ? 0 : at::maybe_wrap_dim(dim, self.dim()),
                                  index.reshape({-1}), value)
                            .reshape(self.sizes());
  if (filled.sizes() != self.sizes() || self.is_contiguous()) return filled;
  return at::empty_like(self).copy_(filled);
}

Tensor index_fill_tensor(const Tensor& self, int64_t dim, const Tensor& index, const Tensor& value) {
  if (!index_fill_takes(self, dim, index) || value.dim() != 0 || complex_into_real(value.is_complex(), self)) {
    return at::index_fill(self, dim, index, value);
  }
  return index_fill_rank1(self, dim, index, value_like(value, self));
}

Tensor index_fill_scalar(const Tensor& self, int64_t dim, const Tensor& index, const at::Scalar& value) {
  if (!index_fill_takes(self, dim, index) || complex_into_real(value.isComplex(), self)) {
    return at::index_fill(self, dim, index, value);
  }
  return index_fill_rank1(self, dim, index, value_like(value, self));
}

// --- masked_scatter ----------------------------------------------------------------------------------------------

// A source with fewer elements than the mask has Trues is data: multicomposite::masked_scatter's kernels reject it.
Tensor masked_scatter_entry(const Tensor& self, const Tensor& mask, const Tensor& source) {
  if (self.scalar_type() != source.scalar_type() || mask.scalar_type() != at::kBool ||
      !broadcastable(mask.sizes(), self.sizes())) {
    return at::masked_scatter(self, mask, source);
  }
  if (mask.sizes() == self.sizes()) return scatter_op().call(self, mask, source, 0);
  const std::vector<int64_t> shape = at::infer_size(self.sizes(), mask.sizes());
  return scatter_op().call(self.expand(shape), mask.expand(shape), source, 0);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(multicomposite, m) {
  m.def("masked_fill.Scalar(Tensor self, Tensor mask, Scalar value) -> Tensor");
  m.def("masked_fill.Tensor(Tensor self, Tensor mask, Tensor value) -> Tensor");
  m.def("index_fill.int_Scalar(Tensor self, int dim, Tensor index, Scalar value) -> Tensor");
  m.def("index_fill.int_Tensor(Tensor self, int dim, Tensor index, Tensor value) -> Tensor");
  m.def("masked_scatter.entry(Tensor self, Tensor mask, Tensor source) -> Tensor");
}

namespace {

void impl_entries(torch::Library& m) {
  m.impl("masked_fill.Scalar", masked_fill_scalar);
  m.impl("masked_fill.Tensor", masked_fill_tensor);
  m.impl("index_fill.int_Scalar", index_fill_scalar);
  m.impl("index_fill.int_Tensor", index_fill_tensor);
  m.impl("masked_scatter.entry", masked_scatter_entry);
}

}  // namespace

// Decomposed everywhere into the ops above, under vmap too (as index_fill itself, fused_ops.cpp): their autograd and
// batching kernels are the entries'.
TORCH_LIBRARY_IMPL(multicomposite, CompositeImplicitAutograd, m) { impl_entries(m); }
TORCH_LIBRARY_IMPL(multicomposite, FuncTorchBatched, m) { impl_entries(m); }
