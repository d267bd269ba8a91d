// The fused primitives as C++ ops (composites/cpp_ops.py registers the composites that call them; the cpp_op kind in
// registry/core/kinds.py says where they are valid): multicomposite::fill, masked_scatter, masked_gather and
// index_fill, each with
//   - a CPU kernel: one pass over the data on the values' bits (exact: NaN payloads, infinities, -0.0), and a
//     CompositeExplicitAutograd kernel of aten ops for every other device (and Meta);
//   - an Autograd kernel that records a backward node (as aten's own do) whose backward calls these ops again
//     through the dispatcher, so it is differentiable (jacrev, hessian) and batched by the rules below, and that
//     sets the forward-AD tangent from the same ops (jvp, jacfwd);
//   - a FuncTorchBatched kernel (the batching rule): the batch dimension moved to the front, the op called once on
//     the unwrapped tensors with one more leading batch dimension.
// A call under vmap(grad) runs these three and aten's views, with no Python frame.

#include <ATen/ATen.h>
#include <ATen/TensorIterator.h>
#include <ATen/functorch/BatchedTensorImpl.h>
#include <ATen/functorch/DynamicLayer.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

namespace {

using at::Tensor;
using torch::autograd::variable_list;

// --- the dispatcher's handles of our ops (calls go through every key: autograd, batching, the backend) ----------

const c10::TypedOperatorHandle<Tensor(const std::optional<Tensor>&, const Tensor&, const std::optional<Tensor>&)>&
fill_op() {
  static const auto handle = c10::Dispatcher::singleton()
                                 .findSchemaOrThrow("multicomposite::fill", "")
                                 .typed<Tensor(const std::optional<Tensor>&, const Tensor&,
                                               const std::optional<Tensor>&)>();
  return handle;
}

const c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, const Tensor&, int64_t)>& scatter_op() {
  static const auto handle = c10::Dispatcher::singleton()
                                 .findSchemaOrThrow("multicomposite::masked_scatter", "")
                                 .typed<Tensor(const Tensor&, const Tensor&, const Tensor&, int64_t)>();
  return handle;
}

const c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, at::IntArrayRef, int64_t)>& gather_op() {
  static const auto handle = c10::Dispatcher::singleton()
                                 .findSchemaOrThrow("multicomposite::masked_gather", "")
                                 .typed<Tensor(const Tensor&, const Tensor&, at::IntArrayRef, int64_t)>();
  return handle;
}

const c10::TypedOperatorHandle<Tensor(const Tensor&, int64_t, const Tensor&, const std::optional<Tensor>&)>&
index_fill_op() {
  static const auto handle = c10::Dispatcher::singleton()
                                 .findSchemaOrThrow("multicomposite::index_fill", "")
                                 .typed<Tensor(const Tensor&, int64_t, const Tensor&, const std::optional<Tensor>&)>();
  return handle;
}

Tensor select_call(const std::optional<Tensor>& self, const Tensor& mask, const std::optional<Tensor>& value) {
  return fill_op().call(self, mask, value);
}

bool present(const std::optional<Tensor>& t) { return t.has_value() && t->defined(); }

// --- CPU kernels: one pass, on the bits ----------------------------------------------------------------------------

template <typename T>
void select_loop(char** data, const int64_t* strides, int64_t n) {
  // out = b ^ ((a ^ b) & -mask): branchless, so gcc vectorizes the contiguous cases.
  char* out = data[0];
  const char* mask = data[1];
  const char* a = data[2];
  const char* b = data[3];
  constexpr int64_t size = sizeof(T);
  if (strides[0] == size && strides[1] == 1) {
    T* __restrict__ o = reinterpret_cast<T*>(out);
    const uint8_t* __restrict__ m = reinterpret_cast<const uint8_t*>(mask);
    if (strides[2] == size && strides[3] == size) {
      const T* __restrict__ ap = reinterpret_cast<const T*>(a);
      const T* __restrict__ bp = reinterpret_cast<const T*>(b);
      for (int64_t i = 0; i < n; ++i) o[i] = bp[i] ^ ((ap[i] ^ bp[i]) & static_cast<T>(0 - static_cast<T>(m[i])));
      return;
    }
    if (strides[2] == 0 && strides[3] == size) {
      T av;
      std::memcpy(&av, a, size);
      const T* __restrict__ bp = reinterpret_cast<const T*>(b);
      for (int64_t i = 0; i < n; ++i) o[i] = bp[i] ^ ((av ^ bp[i]) & static_cast<T>(0 - static_cast<T>(m[i])));
      return;
    }
    if (strides[2] == size && strides[3] == 0) {
      T bv;
      std::memcpy(&bv, b, size);
      const T* __restrict__ ap = reinterpret_cast<const T*>(a);
      for (int64_t i = 0; i < n; ++i) o[i] = bv ^ ((ap[i] ^ bv) & static_cast<T>(0 - static_cast<T>(m[i])));
      return;
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    T av, bv;
    std::memcpy(&av, a + i * strides[2], size);
    std::memcpy(&bv, b + i * strides[3], size);
    const uint8_t m = *reinterpret_cast<const uint8_t*>(mask + i * strides[1]);
    const T o = bv ^ ((av ^ bv) & static_cast<T>(0 - static_cast<T>(m)));
    std::memcpy(out + i * strides[0], &o, size);
  }
}

// The value a None stands for: a zero of like's dtype (a 0-d tensor, which broadcasts with stride 0).
Tensor or_zero(const std::optional<Tensor>& t, const at::TensorOptions& like) {
  return t.has_value() && t->defined() ? *t : at::zeros({}, like);
}

at::TensorOptions options_of(const std::optional<Tensor>& self, const std::optional<Tensor>& value,
                             const Tensor& mask) {
  const bool has_self = self.has_value() && self->defined();
  const bool has_value = value.has_value() && value->defined();
  TORCH_CHECK(has_self || has_value, "multicomposite::fill: self and value are both None; give at least one");
  const Tensor& like = has_self ? *self : *value;
  if (has_self && has_value) {
    TORCH_CHECK(self->scalar_type() == value->scalar_type(), "multicomposite::fill: self is ", self->scalar_type(),
                " and value ", value->scalar_type(), "; cast value to self's dtype first");
  }
  TORCH_CHECK(mask.scalar_type() == at::kBool, "multicomposite::fill: mask must be bool, not ", mask.scalar_type());
  return like.options();
}

std::vector<int64_t> fill_shape(const std::optional<Tensor>& self, const Tensor& mask,
                                const std::optional<Tensor>& value) {
  std::vector<int64_t> shape(mask.sizes().begin(), mask.sizes().end());
  for (const auto* t : {&self, &value}) {
    if (t->has_value() && (*t)->defined()) {
      shape = at::infer_size((*t)->sizes(), shape);
    }
  }
  return shape;
}

// The aten form of fill, for other devices, Meta, and dtypes without an integer of their size (complex128).
Tensor fill_aten(const std::optional<Tensor>& self, const Tensor& mask, const std::optional<Tensor>& value) {
  const auto options = options_of(self, value, mask);
  return at::where(mask, or_zero(value, options), or_zero(self, options))
      .expand(fill_shape(self, mask, value))
      .contiguous();
}

Tensor fill_cpu(const std::optional<Tensor>& self, const Tensor& mask, const std::optional<Tensor>& value) {
  const auto options = options_of(self, value, mask);
  const int64_t size = c10::elementSize(options.dtype().toScalarType());
  const Tensor a = or_zero(value, options);
  const Tensor b = or_zero(self, options);
  if ((size != 1 && size != 2 && size != 4 && size != 8) || a.is_neg() || b.is_neg() || a.is_conj() || b.is_conj() ||
      a._is_zerotensor() || b._is_zerotensor()) {
    return fill_aten(self, mask, value);
  }
  Tensor out = at::empty(fill_shape(self, mask, value), options);
  auto iter = at::TensorIteratorConfig()
                  .add_output(out)
                  .add_const_input(mask)
                  .add_const_input(a)
                  .add_const_input(b)
                  .check_all_same_dtype(false)
                  .resize_outputs(false)
                  .build();
  switch (size) {
    case 1:
      iter.for_each(select_loop<uint8_t>);
      break;
    case 2:
      iter.for_each(select_loop<uint16_t>);
      break;
    case 4:
      iter.for_each(select_loop<uint32_t>);
      break;
    default:
      iter.for_each(select_loop<uint64_t>);
  }
  return out;
}

int64_t leading(at::IntArrayRef shape, int64_t batch_ndim) {
  int64_t rows = 1;
  for (int64_t d = 0; d < batch_ndim; ++d) rows *= shape[d];
  return rows;
}

void check_scatter(const Tensor& self, const Tensor& mask, const Tensor& source, int64_t batch_ndim) {
  TORCH_CHECK(self.sizes() == mask.sizes(), "multicomposite::masked_scatter: mask has shape ", mask.sizes(),
              " and self ", self.sizes(), "; expand both to one shape first");
  TORCH_CHECK(mask.scalar_type() == at::kBool, "multicomposite::masked_scatter: mask must be bool");
  TORCH_CHECK(self.scalar_type() == source.scalar_type(), "multicomposite::masked_scatter: self is ",
              self.scalar_type(), " and source ", source.scalar_type(), "; give them one dtype");
  TORCH_CHECK(batch_ndim >= 0 && batch_ndim <= self.dim() && batch_ndim <= source.dim(),
              "multicomposite::masked_scatter: batch_ndim ", batch_ndim, " exceeds the tensors' dimensions");
}

[[noreturn]] void too_few_sources() {
  TORCH_CHECK(false, "masked_scatter: the mask has more Trues than source has elements; give each sample a source "
                     "with at least as many elements as its mask has Trues");
}

template <typename T>
int64_t scatter_rows(const uint8_t* mask, const T* self, const T* src, T* out, int64_t rows, int64_t cols,
                     int64_t src_cols) {
  int64_t bad = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* __restrict__ m = mask + r * cols;
    const T* __restrict__ s = self + r * cols;
    const T* __restrict__ sr = src + r * src_cols;
    T* __restrict__ o = out + r * cols;
    int64_t k = 0;
    for (int64_t c = 0; c < cols; ++c) {
      const T keep = static_cast<T>(0 - static_cast<T>(m[c]));
      const int64_t at = k < src_cols ? k : 0;
      o[c] = s[c] ^ ((sr[at] ^ s[c]) & keep);
      k += m[c];
    }
    bad += k > src_cols;
  }
  return bad;
}

// The eager form (other devices, Meta, complex128): the running count of Trues picks each position's source element.
Tensor scatter_aten(const Tensor& self, const Tensor& mask, const Tensor& source, int64_t batch_ndim) {
  check_scatter(self, mask, source, batch_ndim);
  std::vector<int64_t> lead(self.sizes().begin(), self.sizes().begin() + batch_ndim);
  auto flat_shape = lead;
  flat_shape.push_back(-1);
  const Tensor flat_source = source.reshape(flat_shape);
  const Tensor position = mask.reshape(flat_shape).cumsum(-1);
  const Tensor padded = at::constant_pad_nd(flat_source, {1, 0});
  if (!mask.is_meta() && position.numel() > 0 &&
      (position.select(-1, -1) > flat_source.size(-1)).any().item<bool>()) {
    too_few_sources();
  }
  const Tensor placed = padded.gather(-1, position.clamp_max(flat_source.size(-1))).reshape(self.sizes());
  return at::where(mask, placed, self).contiguous();
}

Tensor scatter_cpu(const Tensor& self_in, const Tensor& mask_in, const Tensor& source_in, int64_t batch_ndim) {
  check_scatter(self_in, mask_in, source_in, batch_ndim);
  const int64_t size = self_in.element_size();
  if ((size != 1 && size != 2 && size != 4 && size != 8) || self_in.is_neg() || source_in.is_neg() ||
      self_in.is_conj() || source_in.is_conj() || self_in._is_zerotensor() || source_in._is_zerotensor()) {
    return scatter_aten(self_in, mask_in, source_in, batch_ndim);
  }
  const Tensor self = self_in.contiguous();
  const Tensor mask = mask_in.contiguous();
  const Tensor source = source_in.contiguous();
  const int64_t rows = leading(self.sizes(), batch_ndim);
  Tensor out = at::empty(self.sizes(), self.options());
  if (rows == 0 || self.numel() == 0) {
    return out;
  }
  const int64_t cols = self.numel() / rows;
  const int64_t src_cols = source.numel() / rows;
  if (src_cols == 0) {
    if (mask.any().item<bool>()) too_few_sources();
    out.copy_(self);
    return out;
  }
  const auto* m = mask.const_data_ptr<bool>();
  const auto* mp = reinterpret_cast<const uint8_t*>(m);
  int64_t bad = 0;
  switch (size) {
    case 1:
      bad = scatter_rows(mp, static_cast<const uint8_t*>(self.const_data_ptr()),
                         static_cast<const uint8_t*>(source.const_data_ptr()), static_cast<uint8_t*>(out.data_ptr()),
                         rows, cols, src_cols);
      break;
    case 2:
      bad = scatter_rows(mp, static_cast<const uint16_t*>(self.const_data_ptr()),
                         static_cast<const uint16_t*>(source.const_data_ptr()), static_cast<uint16_t*>(out.data_ptr()),
                         rows, cols, src_cols);
      break;
    case 4:
      bad = scatter_rows(mp, static_cast<const uint32_t*>(self.const_data_ptr()),
                         static_cast<const uint32_t*>(source.const_data_ptr()), static_cast<uint32_t*>(out.data_ptr()),
                         rows, cols, src_cols);
      break;
    default:
      bad = scatter_rows(mp, static_cast<const uint64_t*>(self.const_data_ptr()),
                         static_cast<const uint64_t*>(source.const_data_ptr()), static_cast<uint64_t*>(out.data_ptr()),
                         rows, cols, src_cols);
  }
  if (bad > 0) too_few_sources();
  return out;
}

template <typename T>
void gather_rows(const uint8_t* mask, const T* values, T* out, int64_t rows, int64_t cols, int64_t out_cols) {
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* m = mask + r * cols;
    const T* v = values + r * cols;
    T* o = out + r * out_cols;
    int64_t k = 0;
    for (int64_t c = 0; c < cols && k < out_cols; ++c) {
      o[k] = v[c];
      k += m[c];
    }
    // The last slot written may hold a False position's value (written, then not counted): clear what is not a pick.
    for (int64_t j = k; j < out_cols; ++j) o[j] = 0;
  }
}

int64_t trailing(at::IntArrayRef shape, int64_t batch_ndim) {
  int64_t n = 1;
  for (size_t d = static_cast<size_t>(batch_ndim); d < shape.size(); ++d) n *= shape[d];
  return n;
}

void check_gather(const Tensor& values, const Tensor& mask, at::IntArrayRef source_shape, int64_t batch_ndim) {
  TORCH_CHECK(values.sizes() == mask.sizes(), "multicomposite::masked_gather: mask has shape ", mask.sizes(),
              " and values ", values.sizes(), "; expand both to one shape first");
  TORCH_CHECK(batch_ndim >= 0 && batch_ndim <= values.dim() && batch_ndim <= static_cast<int64_t>(source_shape.size()),
              "multicomposite::masked_gather: batch_ndim ", batch_ndim, " exceeds the shapes' dimensions");
}

Tensor gather_aten(const Tensor& values, const Tensor& mask, at::IntArrayRef source_shape, int64_t batch_ndim) {
  check_gather(values, mask, source_shape, batch_ndim);
  std::vector<int64_t> lead(values.sizes().begin(), values.sizes().begin() + batch_ndim);
  auto flat = lead;
  flat.push_back(-1);
  const int64_t size = trailing(source_shape, batch_ndim);
  const Tensor flat_mask = mask.reshape(flat);
  const Tensor position = at::where(flat_mask, flat_mask.cumsum(-1) - 1, size).clamp_max(size);
  const Tensor picked = at::where(mask, values, at::zeros({}, values.options())).reshape(flat);
  auto padded_shape = lead;
  padded_shape.push_back(size + 1);
  const Tensor out = at::zeros(padded_shape, values.options()).scatter_add(-1, position, picked);
  return out.narrow(-1, 0, size).reshape(source_shape).contiguous();
}

Tensor gather_cpu(const Tensor& values_in, const Tensor& mask_in, at::IntArrayRef source_shape, int64_t batch_ndim) {
  check_gather(values_in, mask_in, source_shape, batch_ndim);
  const int64_t size = values_in.element_size();
  if ((size != 1 && size != 2 && size != 4 && size != 8) || values_in.is_neg() || values_in.is_conj() ||
      values_in._is_zerotensor()) {
    return gather_aten(values_in, mask_in, source_shape, batch_ndim);
  }
  const Tensor values = values_in.contiguous();
  const Tensor mask = mask_in.contiguous();
  Tensor out = at::empty(source_shape, values.options());
  const int64_t rows = leading(values.sizes(), batch_ndim);
  const int64_t out_cols = trailing(source_shape, batch_ndim);
  TORCH_CHECK(leading(source_shape, batch_ndim) == rows, "multicomposite::masked_gather: source_shape ", source_shape,
              " has other batch dimensions than values ", values.sizes());
  if (rows == 0 || out_cols == 0) {
    return out;
  }
  const int64_t cols = values.numel() / rows;
  if (cols == 0) {
    return out.zero_();
  }
  const auto* mp = reinterpret_cast<const uint8_t*>(mask.const_data_ptr<bool>());
  switch (size) {
    case 1:
      gather_rows(mp, static_cast<const uint8_t*>(values.const_data_ptr()), static_cast<uint8_t*>(out.data_ptr()),
                  rows, cols, out_cols);
      break;
    case 2:
      gather_rows(mp, static_cast<const uint16_t*>(values.const_data_ptr()), static_cast<uint16_t*>(out.data_ptr()),
                  rows, cols, out_cols);
      break;
    case 4:
      gather_rows(mp, static_cast<const uint32_t*>(values.const_data_ptr()), static_cast<uint32_t*>(out.data_ptr()),
                  rows, cols, out_cols);
      break;
    default:
      gather_rows(mp, static_cast<const uint64_t*>(values.const_data_ptr()), static_cast<uint64_t*>(out.data_ptr()),
                  rows, cols, out_cols);
  }
  return out;
}

// self with value (0 for None) at index (1-d, non-negative) along dim: one index_copy of the expanded value.
Tensor index_fill_kernel(const Tensor& self, int64_t dim, const Tensor& index, const std::optional<Tensor>& value) {
  TORCH_CHECK(self.dim() >= 1 && dim >= 0 && dim < self.dim(), "multicomposite::index_fill: dim ", dim,
              " is out of range for a tensor of ", self.dim(), " dimensions (view a 0-d self as 1-d first)");
  std::vector<int64_t> shape(self.sizes().begin(), self.sizes().end());
  shape[dim] = index.numel();
  const Tensor filler = present(value) ? value->expand(shape) : at::zeros({}, self.options()).expand(shape);
  return at::index_copy(self, dim, index, filler);
}

// --- autograd: a backward node per op, as aten's own autograd kernels make them --------------------------------
// (torch::autograd::Function refuses to run under any functorch transform: "cannot use C++ torch::autograd::Function
// with functorch transforms".) Each node's backward calls the ops again through the dispatcher, so it is
// differentiable (jacrev of jacrev, hessian) and batched by the rules below; each kernel also sets the forward-AD
// tangent from the same ops (jvp, jacfwd).

std::vector<int64_t> shape_of(const Tensor& t) { return std::vector<int64_t>(t.sizes().begin(), t.sizes().end()); }

std::optional<Tensor> tangent(const std::optional<Tensor>& t) {
  if (!present(t)) return std::nullopt;
  Tensor grad = t->_fw_grad(/*level=*/0);
  return grad.defined() ? std::optional<Tensor>(grad) : std::nullopt;
}

// The tangent of an output, of the output's shape (a tangent made from fewer inputs may broadcast to less).
void set_tangent(const Tensor& result, Tensor grad) {
  if (grad.sizes() != result.sizes()) {
    grad = grad.expand(result.sizes()).contiguous();
  }
  result._set_fw_grad(grad, /*level=*/0, /*is_inplace_op=*/false);
}

Tensor zeros_of(at::IntArrayRef shape, const Tensor& like) { return at::zeros(shape, like.options()); }

struct FillBackward : public torch::autograd::Node {
  Tensor mask;
  std::optional<std::vector<int64_t>> self_shape, value_shape;  // none where the input is None

  variable_list apply(variable_list&& grads) override {
    const Tensor& grad = grads[0];
    Tensor grad_self, grad_value;
    if (grad.defined() && self_shape && task_should_compute_output(0)) {
      grad_self = select_call(grad, mask, std::nullopt).sum_to_size(*self_shape);
    }
    if (grad.defined() && value_shape && task_should_compute_output(1)) {
      grad_value = select_call(std::nullopt, mask, grad).sum_to_size(*value_shape);
    }
    return {grad_self, grad_value};
  }
  std::string name() const override { return "multicomposite::FillBackward"; }
  void release_variables() override { mask.reset(); }
};

struct ScatterBackward : public torch::autograd::Node {
  Tensor mask;
  std::vector<int64_t> source_shape;
  int64_t batch_ndim = 0;

  variable_list apply(variable_list&& grads) override {
    const Tensor& grad = grads[0];
    Tensor grad_self, grad_source;
    if (grad.defined() && task_should_compute_output(0)) {
      grad_self = select_call(grad, mask, std::nullopt);
    }
    if (grad.defined() && task_should_compute_output(1)) {
      grad_source = gather_op().call(grad, mask, source_shape, batch_ndim);
    }
    return {grad_self, grad_source};
  }
  std::string name() const override { return "multicomposite::MaskedScatterBackward"; }
  void release_variables() override { mask.reset(); }
};

struct GatherBackward : public torch::autograd::Node {
  Tensor mask;
  std::vector<int64_t> values_shape;
  int64_t batch_ndim = 0;

  variable_list apply(variable_list&& grads) override {
    const Tensor& grad = grads[0];
    Tensor grad_values;
    if (grad.defined() && task_should_compute_output(0)) {
      grad_values = scatter_op().call(zeros_of(values_shape, grad), mask, grad, batch_ndim);
    }
    return {grad_values};
  }
  std::string name() const override { return "multicomposite::MaskedGatherBackward"; }
  void release_variables() override { mask.reset(); }
};

// A bool mask, broadcastable to a tensor of `rank` dimensions, True at index (non-negative) along dim of `size`.
Tensor index_mask(const Tensor& index, int64_t dim, int64_t size, int64_t rank) {
  const Tensor hits = at::zeros({size}, index.options().dtype(at::kBool)).scatter(0, index.reshape({-1}), true);
  std::vector<int64_t> shape(static_cast<size_t>(std::max<int64_t>(rank - dim, 1)), 1);
  shape[0] = size;
  return hits.reshape(shape);
}

struct IndexFillBackward : public torch::autograd::Node {
  Tensor index;
  int64_t dim = 0, size = 0, rank = 0;
  std::optional<std::vector<int64_t>> value_shape;

  variable_list apply(variable_list&& grads) override {
    const Tensor& grad = grads[0];
    Tensor grad_self, grad_value;
    if (grad.defined() && task_should_compute_output(0)) {
      grad_self = index_fill_op().call(grad, dim, index, std::nullopt);
    }
    if (grad.defined() && value_shape && task_should_compute_output(1)) {
      // At the index's mask, not index_select: a repeated index fills once.
      grad_value = select_call(std::nullopt, index_mask(index, dim, size, rank), grad).sum_to_size(*value_shape);
    }
    return {grad_self, grad_value};
  }
  std::string name() const override { return "multicomposite::IndexFillBackward"; }
  void release_variables() override { index.reset(); }
};

std::optional<std::vector<int64_t>> maybe_shape(const std::optional<Tensor>& t) {
  return present(t) ? std::optional<std::vector<int64_t>>(shape_of(*t)) : std::nullopt;
}

Tensor fill_autograd(const std::optional<Tensor>& self, const Tensor& mask, const std::optional<Tensor>& value) {
  c10::intrusive_ptr<FillBackward> node;
  if (torch::autograd::compute_requires_grad(self, value)) {
    node = c10::make_intrusive<FillBackward>();
    node->set_next_edges(torch::autograd::collect_next_edges(self, value));
    node->mask = mask;
    node->self_shape = maybe_shape(self);
    node->value_shape = maybe_shape(value);
  }
  Tensor result;
  {
    at::AutoDispatchBelowADInplaceOrView below;
    result = select_call(self, mask, value);
  }
  if (node) torch::autograd::set_history(result, node);
  const auto self_t = tangent(self), value_t = tangent(value);
  if (self_t || value_t) set_tangent(result, select_call(self_t, mask, value_t));
  return result;
}

Tensor scatter_autograd(const Tensor& self, const Tensor& mask, const Tensor& source, int64_t batch_ndim) {
  c10::intrusive_ptr<ScatterBackward> node;
  if (torch::autograd::compute_requires_grad(self, source)) {
    node = c10::make_intrusive<ScatterBackward>();
    node->set_next_edges(torch::autograd::collect_next_edges(self, source));
    node->mask = mask;
    node->source_shape = shape_of(source);
    node->batch_ndim = batch_ndim;
  }
  Tensor result;
  {
    at::AutoDispatchBelowADInplaceOrView below;
    result = scatter_op().call(self, mask, source, batch_ndim);
  }
  if (node) torch::autograd::set_history(result, node);
  const auto self_t = tangent(self), source_t = tangent(source);
  if (self_t || source_t) {
    const Tensor& like = self_t ? *self_t : *source_t;
    set_tangent(result, scatter_op().call(self_t ? *self_t : zeros_of(self.sizes(), like), mask,
                                          source_t ? *source_t : zeros_of(source.sizes(), like), batch_ndim));
  }
  return result;
}

Tensor gather_autograd(const Tensor& values, const Tensor& mask, at::IntArrayRef source_shape, int64_t batch_ndim) {
  c10::intrusive_ptr<GatherBackward> node;
  if (torch::autograd::compute_requires_grad(values)) {
    node = c10::make_intrusive<GatherBackward>();
    node->set_next_edges(torch::autograd::collect_next_edges(values));
    node->mask = mask;
    node->values_shape = shape_of(values);
    node->batch_ndim = batch_ndim;
  }
  Tensor result;
  {
    at::AutoDispatchBelowADInplaceOrView below;
    result = gather_op().call(values, mask, source_shape, batch_ndim);
  }
  if (node) torch::autograd::set_history(result, node);
  if (const auto values_t = tangent(values)) {
    set_tangent(result, gather_op().call(*values_t, mask, source_shape, batch_ndim));
  }
  return result;
}

Tensor index_fill_autograd(const Tensor& self, int64_t dim, const Tensor& index, const std::optional<Tensor>& value) {
  c10::intrusive_ptr<IndexFillBackward> node;
  if (torch::autograd::compute_requires_grad(self, value)) {
    node = c10::make_intrusive<IndexFillBackward>();
    node->set_next_edges(torch::autograd::collect_next_edges(self, value));
    node->index = index;
    node->dim = dim;
    node->size = self.size(dim);
    node->rank = self.dim();
    node->value_shape = maybe_shape(value);
  }
  Tensor result;
  {
    at::AutoDispatchBelowADInplaceOrView below;
    result = index_fill_op().call(self, dim, index, value);
  }
  if (node) torch::autograd::set_history(result, node);
  const auto self_t = tangent(self), value_t = tangent(value);
  if (self_t || value_t) {
    set_tangent(result, index_fill_op().call(self_t ? *self_t : zeros_of(self.sizes(), *value_t), dim, index,
                                             value_t));
  }
  return result;
}

// --- batching rules: the batch dimension to the front, the op once over the batch ---------------------------------

struct Unwrapped {
  Tensor value;  // the physical tensor (undefined for a None)
  bool batched = false;
  int64_t rank = 0;  // its logical number of dimensions
};

Unwrapped unwrap(const std::optional<Tensor>& t, int64_t level) {
  if (!present(t)) {
    return {};
  }
  if (auto* batched = at::functorch::maybeGetBatchedImpl(*t); batched != nullptr && batched->level() == level) {
    return {batched->value().movedim(batched->bdim(), 0), true, batched->value().dim() - 1};
  }
  return {*t, false, t->dim()};
}

// Batched: (B, 1, ..., 1, logical shape) with `rank` logical dimensions; unbatched: as is, or expanded to (B, ...)
// where `expand` (ops whose arguments all need the batch dimension).
Tensor batch_first(const Unwrapped& u, int64_t rank, int64_t batch, bool expand) {
  if (!u.value.defined()) {
    return u.value;
  }
  Tensor t = u.value;
  if (!u.batched) {
    if (!expand) {
      return t;
    }
    std::vector<int64_t> shape{batch};
    shape.insert(shape.end(), t.sizes().begin(), t.sizes().end());
    t = t.expand(shape);
  }
  for (int64_t r = u.rank; r < rank; ++r) {
    t = t.unsqueeze(1);
  }
  return t;
}

int64_t current_level() {
  const auto layer = at::functorch::maybeCurrentDynamicLayer();
  TORCH_INTERNAL_ASSERT(layer.has_value(), "multicomposite: a batching rule ran outside vmap");
  return layer->layerId();
}

int64_t batch_size(std::initializer_list<const Unwrapped*> all) {
  for (const auto* u : all) {
    if (u->batched) return u->value.size(0);
  }
  return -1;
}

std::optional<Tensor> maybe(const Tensor& t) { return t.defined() ? std::optional<Tensor>(t) : std::nullopt; }

Tensor fill_batched(const std::optional<Tensor>& self, const Tensor& mask, const std::optional<Tensor>& value) {
  c10::impl::ExcludeDispatchKeyGuard guard(c10::DispatchKey::FuncTorchBatched);
  const int64_t level = current_level();
  const auto s = unwrap(self, level), m = unwrap(mask, level), v = unwrap(value, level);
  const int64_t batch = batch_size({&s, &m, &v});
  if (batch < 0) {
    return select_call(self, mask, value);
  }
  const int64_t rank = std::max({s.rank, m.rank, v.rank});
  const Tensor out = select_call(maybe(batch_first(s, rank, batch, false)), batch_first(m, rank, batch, false),
                          maybe(batch_first(v, rank, batch, false)));
  // Unbatched operands of the full rank broadcast against the batch dimension only where one is batched: the result
  // has it in front.
  return at::functorch::makeBatched(out, 0, level);
}

Tensor scatter_batched(const Tensor& self, const Tensor& mask, const Tensor& source, int64_t batch_ndim) {
  c10::impl::ExcludeDispatchKeyGuard guard(c10::DispatchKey::FuncTorchBatched);
  const int64_t level = current_level();
  const auto s = unwrap(self, level), m = unwrap(mask, level), src = unwrap(source, level);
  const int64_t batch = batch_size({&s, &m, &src});
  if (batch < 0) {
    return scatter_op().call(self, mask, source, batch_ndim);
  }
  const Tensor out = scatter_op().call(batch_first(s, s.rank, batch, true), batch_first(m, m.rank, batch, true),
                                       batch_first(src, src.rank, batch, true), batch_ndim + 1);
  return at::functorch::makeBatched(out, 0, level);
}

Tensor gather_batched(const Tensor& values, const Tensor& mask, at::IntArrayRef source_shape, int64_t batch_ndim) {
  c10::impl::ExcludeDispatchKeyGuard guard(c10::DispatchKey::FuncTorchBatched);
  const int64_t level = current_level();
  const auto v = unwrap(values, level), m = unwrap(mask, level);
  const int64_t batch = batch_size({&v, &m});
  if (batch < 0) {
    return gather_op().call(values, mask, source_shape, batch_ndim);
  }
  std::vector<int64_t> shape{batch};
  shape.insert(shape.end(), source_shape.begin(), source_shape.end());
  const Tensor out = gather_op().call(batch_first(v, v.rank, batch, true), batch_first(m, m.rank, batch, true), shape,
                                      batch_ndim + 1);
  return at::functorch::makeBatched(out, 0, level);
}

Tensor index_fill_batched(const Tensor& self, int64_t dim, const Tensor& index, const std::optional<Tensor>& value) {
  c10::impl::ExcludeDispatchKeyGuard guard(c10::DispatchKey::FuncTorchBatched);
  const int64_t level = current_level();
  const auto s = unwrap(self, level), i = unwrap(index, level), v = unwrap(value, level);
  const int64_t batch = batch_size({&s, &i, &v});
  if (batch < 0) {
    return index_fill_op().call(self, dim, index, value);
  }
  const int64_t rank = s.rank;
  if (i.batched) {
    // A batched index: a fill at each sample's mask of the index along dim, shaped (B, 1 x dim, size, 1 ...).
    const int64_t size = s.value.size(s.batched ? dim + 1 : dim);
    const Tensor flat_index = i.value.reshape({batch, -1});
    const Tensor hits = at::zeros({batch, size}, flat_index.options().dtype(at::kBool)).scatter(1, flat_index, true);
    std::vector<int64_t> shape(static_cast<size_t>(rank + 1), 1);
    shape[0] = batch;
    shape[static_cast<size_t>(dim + 1)] = size;
    const Tensor out = select_call(batch_first(s, rank, batch, true), hits.reshape(shape),
                            maybe(batch_first(v, rank, batch, false)));
    return at::functorch::makeBatched(out, 0, level);
  }
  const Tensor out = index_fill_op().call(batch_first(s, rank, batch, true), dim + 1, i.value,
                                          maybe(batch_first(v, rank, batch, false)));
  return at::functorch::makeBatched(out, 0, level);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(multicomposite, m) {
  m.def("fill(Tensor? self, Tensor mask, Tensor? value) -> Tensor");
  m.def("masked_scatter(Tensor self, Tensor mask, Tensor source, int batch_ndim) -> Tensor");
  m.def("masked_gather(Tensor values, Tensor mask, int[] source_shape, int batch_ndim) -> Tensor");
  m.def("index_fill(Tensor self, int dim, Tensor index, Tensor? value) -> Tensor");
}

TORCH_LIBRARY_IMPL(multicomposite, CPU, m) {
  m.impl("fill", fill_cpu);
  m.impl("masked_scatter", scatter_cpu);
  m.impl("masked_gather", gather_cpu);
}

TORCH_LIBRARY_IMPL(multicomposite, CompositeExplicitAutograd, m) {
  m.impl("fill", fill_aten);
  m.impl("masked_scatter", scatter_aten);
  m.impl("masked_gather", gather_aten);
  m.impl("index_fill", index_fill_kernel);
}

TORCH_LIBRARY_IMPL(multicomposite, Autograd, m) {
  m.impl("fill", fill_autograd);
  m.impl("masked_scatter", scatter_autograd);
  m.impl("masked_gather", gather_autograd);
  m.impl("index_fill", index_fill_autograd);
}

TORCH_LIBRARY_IMPL(multicomposite, FuncTorchBatched, m) {
  m.impl("fill", fill_batched);
  m.impl("masked_scatter", scatter_batched);
  m.impl("masked_gather", gather_batched);
  m.impl("index_fill", index_fill_batched);
}
