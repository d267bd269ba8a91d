// The fused primitives as C++ ops (composites/cpp_ops.py registers the composites that call them; the cpp_op kind in
// registry/core/kinds.py says where they are valid): multicomposite::fill, masked_scatter, masked_gather and
// index_fill, and the fused backward ops fill_backward and masked_scatter_backward, each with
//   - a CPU kernel: one pass over the data (on the values' bits where it only moves them: exact for NaN payloads,
//     infinities, -0.0), its loops compiled for AVX2 and for any x86-64 (the loader picks one for the CPU), and a
//     CompositeExplicitAutograd kernel of aten ops for every other device (and Meta);
//   - an Autograd kernel that records a backward node (as aten's own do) whose backward calls these ops again
//     through the dispatcher, so it is differentiable (jacrev, hessian) and batched by the rules below, and that
//     sets the forward-AD tangent from the same ops (jvp, jacfwd);
//   - a FuncTorchBatched kernel (the batching rule): the batch dimension moved to the front, the op called once on
//     the unwrapped tensors with one more leading batch dimension.
// index_fill is fill at a mask of the index (multicomposite::index_mask, which checks the bounds and folds negative
// indices), decomposed for autograd and vmap alike. A call under vmap(grad) runs these and aten's views, with no
// Python frame; its backward reads the output gradient once (fill_backward, masked_scatter_backward).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/TensorIterator.h>
#include <ATen/functorch/BatchedTensorImpl.h>
#include <ATen/functorch/DynamicLayer.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/library.h>

#include "functorch_levels.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

// The hot loops, compiled twice (gcc's function multiversioning): for AVX2 and for any x86-64; the dynamic loader
// picks the one the CPU runs, so the build in the cache stays portable. Their bodies are templates inlined into
// each clone (so that each is vectorized for the clone's instruction set).
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define MC_HOT __attribute__((target_clones("avx2", "default")))
#else
#define MC_HOT
#endif
#if defined(__GNUC__)
#define MC_INLINE __attribute__((always_inline)) inline
#else
#define MC_INLINE inline
#endif
// masked_scatter's and masked_gather's row walks (a running count of Trues: no loop gcc vectorizes) in AVX2 where the
// CPU has it, chosen at run time.
#if defined(__GNUC__) && defined(__x86_64__)
#define MC_AVX2 1
#include <immintrin.h>
#endif

// One multiversioned instance of a bit-moving kernel template per element size (name_u8 ... name_u64), and the one
// of an element size.
#define MC_BY_SIZE(ret, name, params, args)                  \
  MC_HOT ret name##_u8 params { return name<uint8_t> args; }   \
  MC_HOT ret name##_u16 params { return name<uint16_t> args; } \
  MC_HOT ret name##_u32 params { return name<uint32_t> args; } \
  MC_HOT ret name##_u64 params { return name<uint64_t> args; }
#define MC_PICK(name, size) pick(size, name##_u8, name##_u16, name##_u32, name##_u64)

// The handles of the ops that entries.cpp calls too (declared there), outside this file's anonymous namespace.
namespace multicomposite_fused {

using at::Tensor;

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

}  // namespace multicomposite_fused

namespace {

using at::Tensor;
using multicomposite_functorch::BelowLevels;
using multicomposite_fused::fill_op;
using multicomposite_fused::scatter_op;
using torch::autograd::variable_list;

template <typename F>
F pick(int64_t size, F f1, F f2, F f4, F f8) {
  switch (size) {
    case 1:
      return f1;
    case 2:
      return f2;
    case 4:
      return f4;
    default:
      return f8;
  }
}

// Whether the bit kernels can run on these tensors: an element size with an integer of its size, and no lazy
// negation, conjugation or zero tensor (whose values are not in memory).
bool bit_movable(std::initializer_list<const Tensor*> all) {
  for (const auto* t : all) {
    if (!t->defined()) continue;
    const int64_t size = t->element_size();
    if ((size != 1 && size != 2 && size != 4 && size != 8) || t->is_neg() || t->is_conj() || t->_is_zerotensor()) {
      return false;
    }
  }
  return true;
}

// Rows [0, rows) of `cols` elements each, in chunks over PyTorch's intra-op threads: `run(begin, end)` per chunk, a
// chunk at least at::internal::GRAIN_SIZE elements (as TensorIterator's loops split, so one thread takes a small
// tensor whole). NOTE: the row kernels below were single-threaded; with two threads the aten ops of the functional
// composites ran a 256 x 1,000 step on both cores and overtook them.
template <typename F>
void over_rows(int64_t rows, int64_t cols, const F& run) {
  const int64_t grain = std::max<int64_t>(1, at::internal::GRAIN_SIZE / std::max<int64_t>(cols, 1));
  at::parallel_for(0, rows, grain, run);
}

// `base` advanced by `elements` elements of `size` bytes.
template <typename P>
P* advanced(P* base, int64_t elements, int64_t size) {
  using Byte = std::conditional_t<std::is_const_v<P>, const char, char>;
  return base == nullptr ? nullptr
                         : reinterpret_cast<P*>(reinterpret_cast<Byte*>(base) + elements * size);
}

// --- the dispatcher's handles of our ops (calls go through every key: autograd, batching, the backend) ----------

using Pair = std::tuple<Tensor, Tensor>;

const c10::TypedOperatorHandle<Pair(const Tensor&, const Tensor&, at::OptionalIntArrayRef, std::array<bool, 2>)>&
fill_backward_op() {
  static const auto handle =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("multicomposite::fill_backward", "")
          .typed<Pair(const Tensor&, const Tensor&, at::OptionalIntArrayRef, std::array<bool, 2>)>();
  return handle;
}

const c10::TypedOperatorHandle<Pair(const Tensor&, const Tensor&, at::IntArrayRef, int64_t, std::array<bool, 2>)>&
scatter_backward_op() {
  static const auto handle =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("multicomposite::masked_scatter_backward", "")
          .typed<Pair(const Tensor&, const Tensor&, at::IntArrayRef, int64_t, std::array<bool, 2>)>();
  return handle;
}

const c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, at::IntArrayRef, int64_t)>& gather_op() {
  static const auto handle = c10::Dispatcher::singleton()
                                 .findSchemaOrThrow("multicomposite::masked_gather", "")
                                 .typed<Tensor(const Tensor&, const Tensor&, at::IntArrayRef, int64_t)>();
  return handle;
}

const c10::TypedOperatorHandle<Tensor(const Tensor&, int64_t, int64_t)>& index_mask_op() {
  static const auto handle = c10::Dispatcher::singleton()
                                 .findSchemaOrThrow("multicomposite::index_mask", "")
                                 .typed<Tensor(const Tensor&, int64_t, int64_t)>();
  return handle;
}

Tensor select_call(const std::optional<Tensor>& self, const Tensor& mask, const std::optional<Tensor>& value) {
  return fill_op().call(self, mask, value);
}

bool present(const std::optional<Tensor>& t) { return t.has_value() && t->defined(); }

// --- CPU kernels: one pass, on the bits ----------------------------------------------------------------------------

template <typename T>
MC_INLINE void select_loop(char** data, const int64_t* strides, int64_t n) {
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

MC_BY_SIZE(void, select_loop, (char** data, const int64_t* strides, int64_t n), (data, strides, n))

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
  const Tensor a = or_zero(value, options);
  const Tensor b = or_zero(self, options);
  if (!bit_movable({&a, &b})) {
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
  iter.for_each(MC_PICK(select_loop, a.element_size()));
  return out;
}

// fill's backward, the output gradient read once: (where(mask, 0, grad), where(mask, grad, 0) summed to
// value_shape), each where output_mask asks for it. The CPU kernel sums rows: the value's shape must be the leading
// dimensions of the gradient's, then ones (a value per sample, or one value); else the aten form.

void check_fill_backward(const Tensor& grad, const Tensor& mask) {
  TORCH_CHECK(mask.scalar_type() == at::kBool, "multicomposite::fill_backward: mask must be bool, not ",
              mask.scalar_type());
}

Pair fill_backward_aten(const Tensor& grad, const Tensor& mask, at::OptionalIntArrayRef value_shape,
                        std::array<bool, 2> output_mask) {
  check_fill_backward(grad, mask);
  Tensor grad_self, grad_value;
  if (output_mask[0]) grad_self = fill_aten(grad, mask, std::nullopt);
  if (output_mask[1] && value_shape.has_value()) {
    grad_value = fill_aten(std::nullopt, mask, grad).sum_to_size(*value_shape).contiguous();
  }
  return {grad_self, grad_value};
}

// Per row: self's gradient (the gradient where the mask is False, +0 where True) and the sum of the gradient where
// it is True, in lanes of T summed in double every block of columns (so that gcc vectorizes the sum and a long row
// keeps its precision). B: the unsigned integer of T's size.
template <typename T, typename B, bool Store, bool Sum>
MC_INLINE void fill_backward_rows(const uint8_t* mask, const int64_t* mask_offsets, const T* grad, T* grad_self,
                                  T* sums, int64_t rows, int64_t cols) {
  constexpr int64_t lanes = 64 / sizeof(T);
  constexpr int64_t block = 1024;
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* __restrict__ m = mask + mask_offsets[r];
    const B* __restrict__ g = reinterpret_cast<const B*>(grad + r * cols);
    B* __restrict__ q = Store ? reinterpret_cast<B*>(grad_self + r * cols) : nullptr;
    double total = 0;
    for (int64_t start = 0; start < cols; start += block) {
      const int64_t stop = std::min(cols, start + block);
      T acc[lanes] = {};
      int64_t c = start;
      for (; c + lanes <= stop; c += lanes) {
        for (int64_t j = 0; j < lanes; ++j) {
          const B keep = static_cast<B>(0 - static_cast<B>(m[c + j]));
          const B x = g[c + j];
          if (Store) q[c + j] = x & ~keep;
          if (Sum) {
            const B picked = x & keep;
            T value;
            std::memcpy(&value, &picked, sizeof(T));
            acc[j] += value;
          }
        }
      }
      for (; c < stop; ++c) {
        const B keep = static_cast<B>(0 - static_cast<B>(m[c]));
        const B x = g[c];
        if (Store) q[c] = x & ~keep;
        if (Sum) {
          const B picked = x & keep;
          T value;
          std::memcpy(&value, &picked, sizeof(T));
          acc[0] += value;
        }
      }
      if (Sum) {
        for (int64_t j = 0; j < lanes; ++j) total += static_cast<double>(acc[j]);
      }
    }
    if (Sum) sums[r] = static_cast<T>(total);
  }
}

template <typename T, typename B>
MC_INLINE void fill_backward_kernel(const uint8_t* mask, const int64_t* mask_offsets, const T* grad, T* grad_self,
                                    T* sums, int64_t rows, int64_t cols) {
  if (grad_self != nullptr && sums != nullptr) {
    fill_backward_rows<T, B, true, true>(mask, mask_offsets, grad, grad_self, sums, rows, cols);
  } else if (grad_self != nullptr) {
    fill_backward_rows<T, B, true, false>(mask, mask_offsets, grad, grad_self, sums, rows, cols);
  } else {
    fill_backward_rows<T, B, false, true>(mask, mask_offsets, grad, grad_self, sums, rows, cols);
  }
}

MC_HOT void fill_backward_f32(const uint8_t* mask, const int64_t* mask_offsets, const float* grad, float* grad_self,
                              float* sums, int64_t rows, int64_t cols) {
  fill_backward_kernel<float, uint32_t>(mask, mask_offsets, grad, grad_self, sums, rows, cols);
}

MC_HOT void fill_backward_f64(const uint8_t* mask, const int64_t* mask_offsets, const double* grad,
                              double* grad_self, double* sums, int64_t rows, int64_t cols) {
  fill_backward_kernel<double, uint64_t>(mask, mask_offsets, grad, grad_self, sums, rows, cols);
}

// Whether dimensions [from, end) of t are laid out contiguously (size-1 dimensions aside).
bool trailing_contiguous(const Tensor& t, int64_t from) {
  int64_t expected = 1;
  for (int64_t d = t.dim() - 1; d >= from; --d) {
    if (t.size(d) != 1 && t.stride(d) != expected) return false;
    expected *= t.size(d);
  }
  return true;
}

Pair fill_backward_cpu(const Tensor& grad_in, const Tensor& mask_in, at::OptionalIntArrayRef value_shape,
                       std::array<bool, 2> output_mask) {
  check_fill_backward(grad_in, mask_in);
  const bool want_self = output_mask[0], want_value = output_mask[1] && value_shape.has_value();
  const auto shape = at::infer_size(grad_in.sizes(), mask_in.sizes());
  const int64_t rank = static_cast<int64_t>(shape.size());
  const auto dtype = grad_in.scalar_type();
  if ((!want_self && !want_value) || rank == 0 || (dtype != at::kFloat && dtype != at::kDouble) ||
      grad_in.is_neg() || grad_in._is_zerotensor() || c10::multiply_integers(shape) == 0) {
    return fill_backward_aten(grad_in, mask_in, value_shape, output_mask);
  }
  // Rows: the leading k dimensions, the value's where its gradient is asked for (then ones).
  int64_t k = rank - 1;
  std::vector<int64_t> target;
  if (want_value) {
    const auto v = *value_shape;
    if (static_cast<int64_t>(v.size()) > rank) return fill_backward_aten(grad_in, mask_in, value_shape, output_mask);
    target.assign(static_cast<size_t>(rank - static_cast<int64_t>(v.size())), 1);
    target.insert(target.end(), v.begin(), v.end());
    k = rank;
    while (k > 0 && target[k - 1] == 1) --k;
    for (int64_t d = 0; d < k; ++d) {
      if (target[d] != shape[d]) return fill_backward_aten(grad_in, mask_in, value_shape, output_mask);
    }
    if (k == rank) return fill_backward_aten(grad_in, mask_in, value_shape, output_mask);  // nothing to sum
  }
  Tensor mask = mask_in.expand(shape);
  if (!want_value && mask.is_contiguous()) k = 0;
  if (!trailing_contiguous(mask, k)) mask = mask.contiguous();
  const Tensor grad = grad_in.expand(shape).contiguous();
  int64_t rows = 1;
  for (int64_t d = 0; d < k; ++d) rows *= shape[d];
  const int64_t cols = grad.numel() / rows;
  // Each row's first mask element (a broadcast mask repeats its rows: stride 0).
  std::vector<int64_t> offsets(static_cast<size_t>(rows), 0);
  std::vector<int64_t> at(static_cast<size_t>(k), 0);
  for (int64_t r = 1; r < rows; ++r) {
    int64_t d = k - 1;
    while (++at[d] == shape[d]) at[d--] = 0;
    int64_t offset = 0;
    for (int64_t e = 0; e < k; ++e) offset += at[e] * mask.stride(e);
    offsets[r] = offset;
  }
  Tensor grad_self = want_self ? at::empty(shape, grad.options()) : Tensor();
  Tensor grad_value = want_value ? at::empty(target, grad.options()) : Tensor();
  const auto* m = reinterpret_cast<const uint8_t*>(mask.const_data_ptr<bool>());
  const auto kernel = [&](auto* g, auto* self_out, auto* sums, auto run) {
    if (rows == 1 && sums == nullptr) {  // one row (a contiguous mask): split its elements
      at::parallel_for(0, cols, at::internal::GRAIN_SIZE, [&](int64_t begin, int64_t end) {
        const int64_t zero = 0;
        run(m + begin, &zero, g + begin, self_out == nullptr ? nullptr : self_out + begin, nullptr, 1, end - begin);
      });
      return;
    }
    over_rows(rows, cols, [&](int64_t begin, int64_t end) {
      run(m, offsets.data() + begin, g + begin * cols, self_out == nullptr ? nullptr : self_out + begin * cols,
          sums == nullptr ? nullptr : sums + begin, end - begin, cols);
    });
  };
  if (dtype == at::kFloat) {
    kernel(grad.const_data_ptr<float>(), want_self ? grad_self.mutable_data_ptr<float>() : nullptr,
           want_value ? grad_value.mutable_data_ptr<float>() : nullptr, fill_backward_f32);
  } else {
    kernel(grad.const_data_ptr<double>(), want_self ? grad_self.mutable_data_ptr<double>() : nullptr,
           want_value ? grad_value.mutable_data_ptr<double>() : nullptr, fill_backward_f64);
  }
  if (want_value) grad_value = grad_value.view(*value_shape);
  return {grad_self, grad_value};
}

int64_t leading(at::IntArrayRef shape, int64_t batch_ndim) {
  int64_t rows = 1;
  for (int64_t d = 0; d < batch_ndim; ++d) rows *= shape[d];
  return rows;
}

int64_t trailing(at::IntArrayRef shape, int64_t batch_ndim) {
  int64_t n = 1;
  for (size_t d = static_cast<size_t>(batch_ndim); d < shape.size(); ++d) n *= shape[d];
  return n;
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

#ifdef MC_AVX2
// A step of W = 32 / sizeof(T) elements (8 of 4 bytes, 4 of 8 bytes): the step's mask bits index a table of 32-bit
// lane permutations; compress moves the Trues' elements to the front in order (gather), expand moves the next
// elements of the source to the Trues' lanes (scatter).
struct LaneTables {
  alignas(32) int32_t compress4[256][8];
  alignas(32) int32_t expand4[256][8];
  alignas(32) int32_t compress8[16][8];
  alignas(32) int32_t expand8[16][8];

  LaneTables() {
    for (int bits = 0; bits < 256; ++bits) {
      int k = 0;
      for (int j = 0; j < 8; ++j) compress4[bits][j] = 0;
      for (int j = 0; j < 8; ++j) {
        if (bits >> j & 1) compress4[bits][k++] = j;
      }
      k = 0;
      for (int j = 0; j < 8; ++j) expand4[bits][j] = (bits >> j & 1) ? k++ : 0;
    }
    for (int bits = 0; bits < 16; ++bits) {
      int k = 0;
      for (int j = 0; j < 8; ++j) compress8[bits][j] = 0;
      for (int j = 0; j < 4; ++j) {
        if (bits >> j & 1) {
          compress8[bits][2 * k] = 2 * j;
          compress8[bits][2 * k + 1] = 2 * j + 1;
          ++k;
        }
      }
      k = 0;
      for (int j = 0; j < 4; ++j) {
        const int at = (bits >> j & 1) ? k++ : 0;
        expand8[bits][2 * j] = 2 * at;
        expand8[bits][2 * j + 1] = 2 * at + 1;
      }
    }
  }
};

const LaneTables& lane_tables() {
  static const LaneTables tables;
  return tables;
}

bool has_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2");
  return yes;
}

// The step's mask as lanes of T's width (all ones where True) and as bits.
template <typename T>
__attribute__((target("avx2"))) inline __m256i step_lanes(const uint8_t* m) {
  if constexpr (sizeof(T) == 4) {
    const __m256i lanes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(m)));
    return _mm256_cmpgt_epi32(lanes, _mm256_setzero_si256());
  } else {
    uint32_t word;
    std::memcpy(&word, m, 4);
    const __m256i lanes = _mm256_cvtepu8_epi64(_mm_cvtsi32_si128(static_cast<int>(word)));
    return _mm256_cmpgt_epi64(lanes, _mm256_setzero_si256());
  }
}

template <typename T>
__attribute__((target("avx2"))) inline int step_bits(__m256i lanes) {
  if constexpr (sizeof(T) == 4) {
    return _mm256_movemask_ps(_mm256_castsi256_ps(lanes));
  } else {
    return _mm256_movemask_pd(_mm256_castsi256_pd(lanes));
  }
}

template <typename T>
__attribute__((target("avx2"))) inline const int32_t* compress_of(int bits) {
  return sizeof(T) == 4 ? lane_tables().compress4[bits] : lane_tables().compress8[bits];
}

template <typename T>
__attribute__((target("avx2"))) inline const int32_t* expand_of(int bits) {
  return sizeof(T) == 4 ? lane_tables().expand4[bits] : lane_tables().expand8[bits];
}

// One row of masked_gather: o[k] = v[c] at the k-th True, for k < out_cols; returns the count written. A step
// stores W elements at o + k, so steps run while k + W <= out_cols; the rest one at a time.
template <typename T>
__attribute__((target("avx2"))) int64_t gather_row_avx2(const uint8_t* m, const T* v, T* o, int64_t cols,
                                                         int64_t out_cols) {
  constexpr int64_t width = 32 / sizeof(T);
  int64_t k = 0, c = 0;
  for (; c + width <= cols && k + width <= out_cols; c += width) {
    const int bits = step_bits<T>(step_lanes<T>(m + c));
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + c));
    const __m256i order = _mm256_load_si256(reinterpret_cast<const __m256i*>(compress_of<T>(bits)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + k), _mm256_permutevar8x32_epi32(x, order));
    k += __builtin_popcount(static_cast<unsigned>(bits));
  }
  for (; c < cols && k < out_cols; ++c) {
    o[k] = v[c];
    k += m[c];
  }
  return k;
}

// One row of masked_scatter: o[c] = the next source element where the mask is True, else s[c]; returns the row's
// count of Trues (more than src_cols: the caller raises). A step loads W source elements at src + k, so steps run
// while k + W <= src_cols; the rest one at a time.
template <typename T>
__attribute__((target("avx2"))) int64_t scatter_row_avx2(const uint8_t* m, const T* s, const T* src, T* o,
                                                          int64_t cols, int64_t src_cols) {
  constexpr int64_t width = 32 / sizeof(T);
  int64_t k = 0, c = 0;
  for (; c + width <= cols && k + width <= src_cols; c += width) {
    const __m256i keep = step_lanes<T>(m + c);
    const int bits = step_bits<T>(keep);
    const __m256i next = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + k));
    const __m256i order = _mm256_load_si256(reinterpret_cast<const __m256i*>(expand_of<T>(bits)));
    const __m256i self = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + c));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + c),
                        _mm256_blendv_epi8(self, _mm256_permutevar8x32_epi32(next, order), keep));
    k += __builtin_popcount(static_cast<unsigned>(bits));
  }
  for (; c < cols; ++c) {
    const T keep = static_cast<T>(0 - static_cast<T>(m[c]));
    const int64_t at = k < src_cols ? k : 0;
    o[c] = s[c] ^ ((src[at] ^ s[c]) & keep);
    k += m[c];
  }
  return k;
}
#endif

template <typename T>
MC_INLINE int64_t scatter_rows(const uint8_t* mask, const void* self_, const void* src_, void* out_, int64_t rows,
                               int64_t cols, int64_t src_cols) {
  const T* self = static_cast<const T*>(self_);
  const T* src = static_cast<const T*>(src_);
  T* out = static_cast<T*>(out_);
  int64_t bad = 0;
#ifdef MC_AVX2
  if constexpr (sizeof(T) >= 4) {
    if (has_avx2()) {
      for (int64_t r = 0; r < rows; ++r) {
        bad += scatter_row_avx2<T>(mask + r * cols, self + r * cols, src + r * src_cols, out + r * cols, cols,
                                   src_cols) > src_cols;
      }
      return bad;
    }
  }
#endif
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

MC_BY_SIZE(int64_t, scatter_rows,
           (const uint8_t* mask, const void* self, const void* src, void* out, int64_t rows, int64_t cols,
            int64_t src_cols),
           (mask, self, src, out, rows, cols, src_cols))

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
  if (!bit_movable({&self_in, &source_in})) {
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
  const auto* m = reinterpret_cast<const uint8_t*>(mask.const_data_ptr<bool>());
  const auto rows_kernel = MC_PICK(scatter_rows, self.element_size());
  const int64_t size = self.element_size();
  std::atomic<int64_t> bad{0};
  over_rows(rows, cols, [&](int64_t begin, int64_t end) {
    bad += rows_kernel(m + begin * cols, advanced(self.const_data_ptr(), begin * cols, size),
                       advanced(source.const_data_ptr(), begin * src_cols, size),
                       advanced(out.data_ptr(), begin * cols, size), end - begin, cols, src_cols);
  });
  if (bad.load() > 0) too_few_sources();
  return out;
}

template <typename T>
MC_INLINE void gather_rows(const uint8_t* mask, const void* values_, void* out_, int64_t rows, int64_t cols,
                           int64_t out_cols) {
  const T* values = static_cast<const T*>(values_);
  T* out = static_cast<T*>(out_);
#ifdef MC_AVX2
  if constexpr (sizeof(T) >= 4) {
    if (has_avx2()) {
      for (int64_t r = 0; r < rows; ++r) {
        T* o = out + r * out_cols;
        // As below: a step's lanes after its Trues are not picks; what the row's last step left there is cleared.
        for (int64_t j = gather_row_avx2<T>(mask + r * cols, values + r * cols, o, cols, out_cols); j < out_cols; ++j) {
          o[j] = 0;
        }
      }
      return;
    }
  }
#endif
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* __restrict__ m = mask + r * cols;
    const T* __restrict__ v = values + r * cols;
    T* __restrict__ o = out + r * out_cols;
    int64_t k = 0;
    for (int64_t c = 0; c < cols && k < out_cols; ++c) {
      o[k] = v[c];
      k += m[c];
    }
    // The last slot written may hold a False position's value (written, then not counted): clear what is not a pick.
    for (int64_t j = k; j < out_cols; ++j) o[j] = 0;
  }
}

MC_BY_SIZE(void, gather_rows,
           (const uint8_t* mask, const void* values, void* out, int64_t rows, int64_t cols, int64_t out_cols),
           (mask, values, out, rows, cols, out_cols))

// masked_scatter's backward in one walk of each row: self's gradient (the gradient where the mask is False) and
// source's (the gradient at the k-th True, zeros after the last).
template <typename T>
MC_INLINE void scatter_backward_rows(const uint8_t* mask, const void* grad_, void* grad_self_, void* grad_source_,
                                     int64_t rows, int64_t cols, int64_t out_cols) {
  const T* grad = static_cast<const T*>(grad_);
  T* grad_self = static_cast<T*>(grad_self_);
  T* grad_source = static_cast<T*>(grad_source_);
#ifdef MC_AVX2
  if constexpr (sizeof(T) >= 4) {
    if (has_avx2()) {
      for (int64_t r = 0; r < rows; ++r) {
        const uint8_t* __restrict__ m = mask + r * cols;
        const T* __restrict__ g = grad + r * cols;
        T* __restrict__ q = grad_self + r * cols;
        T* o = grad_source + r * out_cols;
        // The row's source gradient, then its self gradient from the row still in cache.
        for (int64_t j = gather_row_avx2<T>(m, g, o, cols, out_cols); j < out_cols; ++j) o[j] = 0;
        for (int64_t c = 0; c < cols; ++c) q[c] = g[c] & static_cast<T>(static_cast<T>(m[c]) - 1);
      }
      return;
    }
  }
#endif
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* __restrict__ m = mask + r * cols;
    const T* __restrict__ g = grad + r * cols;
    T* __restrict__ q = grad_self + r * cols;
    T* __restrict__ o = grad_source + r * out_cols;
    int64_t k = 0, c = 0;
    for (; c < cols && k < out_cols; ++c) {
      const T x = g[c];
      q[c] = x & static_cast<T>(static_cast<T>(m[c]) - 1);
      o[k] = x;
      k += m[c];
    }
    for (; c < cols; ++c) q[c] = g[c] & static_cast<T>(static_cast<T>(m[c]) - 1);
    for (int64_t j = k; j < out_cols; ++j) o[j] = 0;  // as gather_rows: the last slot written may not be a pick
  }
}

MC_BY_SIZE(void, scatter_backward_rows,
           (const uint8_t* mask, const void* grad, void* grad_self, void* grad_source, int64_t rows, int64_t cols,
            int64_t out_cols),
           (mask, grad, grad_self, grad_source, rows, cols, out_cols))

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
  if (!bit_movable({&values_in})) {
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
  const auto* m = reinterpret_cast<const uint8_t*>(mask.const_data_ptr<bool>());
  const auto rows_kernel = MC_PICK(gather_rows, values.element_size());
  const int64_t size = values.element_size();
  over_rows(rows, cols, [&](int64_t begin, int64_t end) {
    rows_kernel(m + begin * cols, advanced(values.const_data_ptr(), begin * cols, size),
                advanced(out.data_ptr(), begin * out_cols, size), end - begin, cols, out_cols);
  });
  return out;
}

// masked_scatter's backward: (where(mask, 0, grad), masked_gather(grad, mask, source_shape, batch_ndim)), each where
// output_mask asks for it; both from one walk of the gradient on CPU.
Pair scatter_backward_aten(const Tensor& grad, const Tensor& mask, at::IntArrayRef source_shape, int64_t batch_ndim,
                           std::array<bool, 2> output_mask) {
  Tensor grad_self, grad_source;
  if (output_mask[0]) grad_self = fill_aten(grad, mask, std::nullopt);
  if (output_mask[1]) grad_source = gather_aten(grad, mask, source_shape, batch_ndim);
  return {grad_self, grad_source};
}

Pair scatter_backward_cpu(const Tensor& grad_in, const Tensor& mask_in, at::IntArrayRef source_shape,
                          int64_t batch_ndim, std::array<bool, 2> output_mask) {
  check_gather(grad_in, mask_in, source_shape, batch_ndim);
  if (!output_mask[0] || !output_mask[1] || !bit_movable({&grad_in})) {
    return {output_mask[0] ? fill_cpu(grad_in, mask_in, std::nullopt) : Tensor(),
            output_mask[1] ? gather_cpu(grad_in, mask_in, source_shape, batch_ndim) : Tensor()};
  }
  const Tensor grad = grad_in.contiguous();
  const Tensor mask = mask_in.contiguous();
  Tensor grad_self = at::empty(grad.sizes(), grad.options());
  Tensor grad_source = at::empty(source_shape, grad.options());
  const int64_t rows = leading(grad.sizes(), batch_ndim);
  const int64_t out_cols = trailing(source_shape, batch_ndim);
  TORCH_CHECK(leading(source_shape, batch_ndim) == rows, "multicomposite::masked_scatter_backward: source_shape ",
              source_shape, " has other batch dimensions than grad ", grad.sizes());
  if (rows == 0 || grad.numel() == 0) {
    grad_source.zero_();
    return {grad_self, grad_source};
  }
  const int64_t cols = grad.numel() / rows;
  const auto* m = reinterpret_cast<const uint8_t*>(mask.const_data_ptr<bool>());
  const auto rows_kernel = MC_PICK(scatter_backward_rows, grad.element_size());
  const int64_t size = grad.element_size();
  over_rows(rows, cols, [&](int64_t begin, int64_t end) {
    rows_kernel(m + begin * cols, advanced(grad.const_data_ptr(), begin * cols, size),
                advanced(grad_self.data_ptr(), begin * cols, size),
                advanced(grad_source.data_ptr(), begin * out_cols, size), end - begin, cols, out_cols);
  });
  return {grad_self, grad_source};
}

// index_fill's mask: True at each index along a dimension of `size`, per row of the index's first batch_ndim
// dimensions (shape: those, then size). Indices lie in [-size, size), as native's; a negative one counts from the end.
[[noreturn]] void index_out_of_bounds(int64_t index, int64_t size) {
  TORCH_CHECK_INDEX(false, "index_fill(): index ", index, " is out of bounds for a dimension of size ", size,
                    ": every index must lie in [", -size, ", ", size, ")");
}

std::vector<int64_t> index_mask_shape(const Tensor& index, int64_t size, int64_t batch_ndim) {
  TORCH_CHECK(batch_ndim >= 0 && batch_ndim <= index.dim(), "multicomposite::index_mask: batch_ndim ", batch_ndim,
              " exceeds the index's ", index.dim(), " dimensions");
  TORCH_CHECK(index.scalar_type() == at::kLong, "multicomposite::index_mask: the index must be int64, not ",
              index.scalar_type());
  std::vector<int64_t> shape(index.sizes().begin(), index.sizes().begin() + batch_ndim);
  shape.push_back(size);
  return shape;
}

Tensor index_mask_aten(const Tensor& index, int64_t size, int64_t batch_ndim) {
  const auto shape = index_mask_shape(index, size, batch_ndim);
  const int64_t rows = leading(index.sizes(), batch_ndim);
  if (rows == 0) return at::zeros(shape, index.options().dtype(at::kBool));
  const Tensor flat = index.reshape({rows, -1});
  if (!index.is_meta() && flat.numel() > 0) {
    const auto low = flat.min().item<int64_t>(), high = flat.max().item<int64_t>();
    if (low < -size) index_out_of_bounds(low, size);
    if (high >= size) index_out_of_bounds(high, size);
  }
  // Shifted by size, every index lands in [0, 2 * size); the two halves are then folded onto one.
  const Tensor hits = at::zeros({rows, 2 * size}, index.options().dtype(at::kBool)).scatter(1, flat + size, true);
  return hits.reshape({rows, 2, size}).any(1).reshape(shape);
}

Tensor index_mask_cpu(const Tensor& index_in, int64_t size, int64_t batch_ndim) {
  const auto shape = index_mask_shape(index_in, size, batch_ndim);
  const Tensor index = index_in.contiguous();
  Tensor out = at::zeros(shape, index.options().dtype(at::kBool));
  const int64_t rows = leading(index.sizes(), batch_ndim);
  if (rows == 0) return out;
  const int64_t count = index.numel() / rows;
  const int64_t* idx = index.const_data_ptr<int64_t>();
  bool* hits = out.mutable_data_ptr<bool>();
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < count; ++j) {
      const int64_t i = idx[r * count + j];
      if (i < -size || i >= size) index_out_of_bounds(i, size);
      hits[r * size + (i < 0 ? i + size : i)] = true;
    }
  }
  return out;
}

// index_fill: self with value (0 for None) at index along dim, as fill at the index's mask (broadcast along the
// dimensions after dim). Decomposed for autograd and vmap alike: fill and index_mask carry their own kernels.
Tensor index_fill_composite(const Tensor& self, int64_t dim, const Tensor& index, const std::optional<Tensor>& value) {
  TORCH_CHECK(self.dim() >= 1 && dim >= 0 && dim < self.dim(), "multicomposite::index_fill: dim ", dim,
              " is out of range for a tensor of ", self.dim(), " dimensions (view a 0-d self as 1-d first)");
  const int64_t size = self.size(dim);
  std::vector<int64_t> shape(static_cast<size_t>(self.dim() - dim), 1);
  shape[0] = size;
  const Tensor filled = select_call(self, index_mask_op().call(index, size, 0).reshape(shape), value);
  return filled.sizes() == self.sizes() ? filled : filled.expand(self.sizes()).contiguous();
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
  if (!result.defined() || !grad.defined()) return;
  if (grad.sizes() != result.sizes()) {
    grad = grad.expand(result.sizes()).contiguous();
  }
  result._set_fw_grad(grad, /*level=*/0, /*is_inplace_op=*/false);
}

Tensor zeros_of(at::IntArrayRef shape, const Tensor& like) { return at::zeros(shape, like.options()); }

// The node's history on each output of a two-output op, numbered by position (an output not computed keeps its
// slot, as aten's nodes number them).
void set_histories(const Pair& outputs, const c10::intrusive_ptr<torch::autograd::Node>& node) {
  for (const Tensor* output : {&std::get<0>(outputs), &std::get<1>(outputs)}) {
    if (output->defined()) {
      torch::autograd::set_history(*output, node);
    } else {
      node->add_input_metadata(torch::autograd::Node::undefined_input());
    }
  }
}

struct FillBackward : public torch::autograd::Node {
  Tensor mask;
  std::optional<std::vector<int64_t>> self_shape, value_shape;  // none where the input is None

  variable_list apply(variable_list&& grads) override {
    const Tensor& grad = grads[0];
    const bool want_self = grad.defined() && self_shape && task_should_compute_output(0);
    const bool want_value = grad.defined() && value_shape && task_should_compute_output(1);
    if (!want_self && !want_value) return {Tensor(), Tensor()};
    // Both gradients from one read of grad: self's where the mask is False, the value's summed where it is True.
    auto [grad_self, grad_value] =
        fill_backward_op().call(grad, mask, want_value ? at::OptionalIntArrayRef(*value_shape) : std::nullopt,
                                {want_self, want_value});
    if (grad_self.defined() && grad_self.sizes() != at::IntArrayRef(*self_shape)) {
      grad_self = grad_self.sum_to_size(*self_shape);
    }
    return {grad_self, grad_value};
  }
  std::string name() const override { return "multicomposite::FillBackward"; }
  void release_variables() override { mask.reset(); }
};

// fill_backward's own backward: where(mask, grad of the value's gradient, grad of self's), which is fill.
struct FillBackwardBackward : public torch::autograd::Node {
  Tensor mask;
  std::vector<int64_t> grad_shape;

  variable_list apply(variable_list&& grads) override {
    const Tensor &grad_self = grads[0], &grad_value = grads[1];
    if ((!grad_self.defined() && !grad_value.defined()) || !task_should_compute_output(0)) return {Tensor()};
    Tensor out = select_call(maybe_defined(grad_self), mask, maybe_defined(grad_value));
    // Of the outputs' shape (only the value's gradient may broadcast to less), then summed to grad's where the mask
    // broadcast it to more.
    const auto full = at::infer_size(grad_shape, mask.sizes());
    if (out.sizes() != at::IntArrayRef(full)) out = out.expand(full).contiguous();
    if (out.sizes() != at::IntArrayRef(grad_shape)) out = out.sum_to_size(grad_shape);
    return {out};
  }
  static std::optional<Tensor> maybe_defined(const Tensor& t) {
    return t.defined() ? std::optional<Tensor>(t) : std::nullopt;
  }
  std::string name() const override { return "multicomposite::FillBackwardBackward"; }
  void release_variables() override { mask.reset(); }
};

struct ScatterBackward : public torch::autograd::Node {
  Tensor mask;
  std::vector<int64_t> source_shape;
  int64_t batch_ndim = 0;

  variable_list apply(variable_list&& grads) override {
    const Tensor& grad = grads[0];
    const bool want_self = grad.defined() && task_should_compute_output(0);
    const bool want_source = grad.defined() && task_should_compute_output(1);
    if (!want_self && !want_source) return {Tensor(), Tensor()};
    auto [grad_self, grad_source] =
        scatter_backward_op().call(grad, mask, source_shape, batch_ndim, {want_self, want_source});
    return {grad_self, grad_source};
  }
  std::string name() const override { return "multicomposite::MaskedScatterBackward"; }
  void release_variables() override { mask.reset(); }
};

// masked_scatter_backward's own backward: the source's gradient scattered over self's at the mask, which is
// masked_scatter.
struct ScatterBackwardBackward : public torch::autograd::Node {
  Tensor mask;
  std::vector<int64_t> grad_shape, source_shape;
  int64_t batch_ndim = 0;

  variable_list apply(variable_list&& grads) override {
    const Tensor &grad_self = grads[0], &grad_source = grads[1];
    if ((!grad_self.defined() && !grad_source.defined()) || !task_should_compute_output(0)) return {Tensor()};
    const Tensor& like = grad_self.defined() ? grad_self : grad_source;
    return {scatter_op().call(grad_self.defined() ? grad_self : zeros_of(grad_shape, like), mask,
                              grad_source.defined() ? grad_source : zeros_of(source_shape, like), batch_ndim)};
  }
  std::string name() const override { return "multicomposite::MaskedScatterBackwardBackward"; }
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

Pair fill_backward_autograd(const Tensor& grad, const Tensor& mask, at::OptionalIntArrayRef value_shape,
                            std::array<bool, 2> output_mask) {
  c10::intrusive_ptr<FillBackwardBackward> node;
  if (torch::autograd::compute_requires_grad(grad)) {
    node = c10::make_intrusive<FillBackwardBackward>();
    node->set_next_edges(torch::autograd::collect_next_edges(grad));
    node->mask = mask;
    node->grad_shape = shape_of(grad);
  }
  Pair result;
  {
    at::AutoDispatchBelowADInplaceOrView below;
    result = fill_backward_op().call(grad, mask, value_shape, output_mask);
  }
  if (node) set_histories(result, node);
  if (const auto grad_t = tangent(grad)) {  // linear in grad: the same op on its tangent
    const auto [self_t, value_t] = fill_backward_op().call(*grad_t, mask, value_shape, output_mask);
    set_tangent(std::get<0>(result), self_t);
    set_tangent(std::get<1>(result), value_t);
  }
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

Pair scatter_backward_autograd(const Tensor& grad, const Tensor& mask, at::IntArrayRef source_shape,
                               int64_t batch_ndim, std::array<bool, 2> output_mask) {
  c10::intrusive_ptr<ScatterBackwardBackward> node;
  if (torch::autograd::compute_requires_grad(grad)) {
    node = c10::make_intrusive<ScatterBackwardBackward>();
    node->set_next_edges(torch::autograd::collect_next_edges(grad));
    node->mask = mask;
    node->grad_shape = shape_of(grad);
    node->source_shape = std::vector<int64_t>(source_shape.begin(), source_shape.end());
    node->batch_ndim = batch_ndim;
  }
  Pair result;
  {
    at::AutoDispatchBelowADInplaceOrView below;
    result = scatter_backward_op().call(grad, mask, source_shape, batch_ndim, output_mask);
  }
  if (node) set_histories(result, node);
  if (const auto grad_t = tangent(grad)) {  // linear in grad: the same op on its tangent
    const auto [self_t, source_t] = scatter_backward_op().call(*grad_t, mask, source_shape, batch_ndim, output_mask);
    set_tangent(std::get<0>(result), self_t);
    set_tangent(std::get<1>(result), source_t);
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

// The mask is not differentiable (bool): below autograd, with no node.
Tensor index_mask_autograd(const Tensor& index, int64_t size, int64_t batch_ndim) {
  at::AutoDispatchBelowADInplaceOrView below;
  return index_mask_op().call(index, size, batch_ndim);
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
    const int64_t bdim = batched->bdim();  // movedim is two dispatched calls even where the batch is in front
    return {bdim == 0 ? batched->value() : batched->value().movedim(bdim, 0), true, batched->value().dim() - 1};
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

// Whether every operand, unbatched at this level, is an ordinary tensor (a None is).
bool all_plain(std::initializer_list<const Unwrapped*> all) {
  for (const auto* u : all) {
    if (u->value.defined() && !multicomposite_functorch::plain(u->value)) return false;
  }
  return true;
}

int64_t batch_size(std::initializer_list<const Unwrapped*> all) {
  for (const auto* u : all) {
    if (u->batched) return u->value.size(0);
  }
  return -1;
}

std::optional<Tensor> maybe(const Tensor& t) { return t.defined() ? std::optional<Tensor>(t) : std::nullopt; }

Tensor batched_or_none(const Tensor& t, int64_t level) {
  return t.defined() ? at::functorch::makeBatched(t, 0, level) : t;
}

Tensor fill_batched(const std::optional<Tensor>& self, const Tensor& mask, const std::optional<Tensor>& value) {
  c10::impl::ExcludeDispatchKeyGuard guard(c10::DispatchKey::FuncTorchBatched);
  const int64_t level = current_level();
  const auto s = unwrap(self, level), m = unwrap(mask, level), v = unwrap(value, level);
  const int64_t batch = batch_size({&s, &m, &v});
  if (batch < 0) {
    return select_call(self, mask, value);
  }
  const BelowLevels below(all_plain({&s, &m, &v}));
  const int64_t rank = std::max({s.rank, m.rank, v.rank});
  const Tensor out = select_call(maybe(batch_first(s, rank, batch, false)), batch_first(m, rank, batch, false),
                                 maybe(batch_first(v, rank, batch, false)));
  // Unbatched operands of the full rank broadcast against the batch dimension only where one is batched: the result
  // has it in front.
  return at::functorch::makeBatched(out, 0, level);
}

Pair fill_backward_batched(const Tensor& grad, const Tensor& mask, at::OptionalIntArrayRef value_shape,
                           std::array<bool, 2> output_mask) {
  c10::impl::ExcludeDispatchKeyGuard guard(c10::DispatchKey::FuncTorchBatched);
  const int64_t level = current_level();
  const auto g = unwrap(grad, level), m = unwrap(mask, level);
  const int64_t batch = batch_size({&g, &m});
  if (batch < 0) {
    return fill_backward_op().call(grad, mask, value_shape, output_mask);
  }
  const BelowLevels below(all_plain({&g, &m}));
  const int64_t rank = std::max(g.rank, m.rank);
  // The value's gradient per sample: summed to (B, 1, ..., 1, value_shape) over the gradient's rank, then viewed as
  // (B, value_shape).
  std::optional<std::vector<int64_t>> physical;
  std::vector<int64_t> logical{batch};
  if (value_shape.has_value()) {
    const auto v = *value_shape;
    TORCH_CHECK(static_cast<int64_t>(v.size()) <= rank, "multicomposite::fill_backward: value_shape ", v,
                " has more dimensions than the gradient");
    physical = std::vector<int64_t>{batch};
    physical->insert(physical->end(), static_cast<size_t>(rank - static_cast<int64_t>(v.size())), 1);
    physical->insert(physical->end(), v.begin(), v.end());
    logical.insert(logical.end(), v.begin(), v.end());
  }
  auto [grad_self, grad_value] = fill_backward_op().call(
      batch_first(g, rank, batch, true), batch_first(m, rank, batch, false),
      physical ? at::OptionalIntArrayRef(*physical) : std::nullopt, output_mask);
  if (grad_value.defined()) grad_value = grad_value.reshape(logical);
  return {batched_or_none(grad_self, level), batched_or_none(grad_value, level)};
}

Tensor scatter_batched(const Tensor& self, const Tensor& mask, const Tensor& source, int64_t batch_ndim) {
  c10::impl::ExcludeDispatchKeyGuard guard(c10::DispatchKey::FuncTorchBatched);
  const int64_t level = current_level();
  const auto s = unwrap(self, level), m = unwrap(mask, level), src = unwrap(source, level);
  const int64_t batch = batch_size({&s, &m, &src});
  if (batch < 0) {
    return scatter_op().call(self, mask, source, batch_ndim);
  }
  const BelowLevels below(all_plain({&s, &m, &src}));
  const Tensor out = scatter_op().call(batch_first(s, s.rank, batch, true), batch_first(m, m.rank, batch, true),
                                       batch_first(src, src.rank, batch, true), batch_ndim + 1);
  return at::functorch::makeBatched(out, 0, level);
}

Pair scatter_backward_batched(const Tensor& grad, const Tensor& mask, at::IntArrayRef source_shape,
                              int64_t batch_ndim, std::array<bool, 2> output_mask) {
  c10::impl::ExcludeDispatchKeyGuard guard(c10::DispatchKey::FuncTorchBatched);
  const int64_t level = current_level();
  const auto g = unwrap(grad, level), m = unwrap(mask, level);
  const int64_t batch = batch_size({&g, &m});
  if (batch < 0) {
    return scatter_backward_op().call(grad, mask, source_shape, batch_ndim, output_mask);
  }
  const BelowLevels below(all_plain({&g, &m}));
  std::vector<int64_t> shape{batch};
  shape.insert(shape.end(), source_shape.begin(), source_shape.end());
  const auto [grad_self, grad_source] =
      scatter_backward_op().call(batch_first(g, g.rank, batch, true), batch_first(m, m.rank, batch, true), shape,
                                 batch_ndim + 1, output_mask);
  return {batched_or_none(grad_self, level), batched_or_none(grad_source, level)};
}

Tensor gather_batched(const Tensor& values, const Tensor& mask, at::IntArrayRef source_shape, int64_t batch_ndim) {
  c10::impl::ExcludeDispatchKeyGuard guard(c10::DispatchKey::FuncTorchBatched);
  const int64_t level = current_level();
  const auto v = unwrap(values, level), m = unwrap(mask, level);
  const int64_t batch = batch_size({&v, &m});
  if (batch < 0) {
    return gather_op().call(values, mask, source_shape, batch_ndim);
  }
  const BelowLevels below(all_plain({&v, &m}));
  std::vector<int64_t> shape{batch};
  shape.insert(shape.end(), source_shape.begin(), source_shape.end());
  const Tensor out = gather_op().call(batch_first(v, v.rank, batch, true), batch_first(m, m.rank, batch, true), shape,
                                      batch_ndim + 1);
  return at::functorch::makeBatched(out, 0, level);
}

Tensor index_mask_batched(const Tensor& index, int64_t size, int64_t batch_ndim) {
  c10::impl::ExcludeDispatchKeyGuard guard(c10::DispatchKey::FuncTorchBatched);
  const int64_t level = current_level();
  const auto i = unwrap(index, level);
  if (!i.batched) {
    return index_mask_op().call(index, size, batch_ndim);
  }
  const BelowLevels below(all_plain({&i}));
  return at::functorch::makeBatched(index_mask_op().call(i.value, size, batch_ndim + 1), 0, level);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(multicomposite, m) {
  m.def("fill(Tensor? self, Tensor mask, Tensor? value) -> Tensor");
  m.def("fill_backward(Tensor grad, Tensor mask, int[]? value_shape, bool[2] output_mask) -> (Tensor, Tensor)");
  m.def("masked_scatter(Tensor self, Tensor mask, Tensor source, int batch_ndim) -> Tensor");
  m.def(
      "masked_scatter_backward(Tensor grad, Tensor mask, int[] source_shape, int batch_ndim, bool[2] output_mask) -> "
      "(Tensor, Tensor)");
  m.def("masked_gather(Tensor values, Tensor mask, int[] source_shape, int batch_ndim) -> Tensor");
  m.def("index_mask(Tensor index, int size, int batch_ndim) -> Tensor");
  m.def("index_fill(Tensor self, int dim, Tensor index, Tensor? value) -> Tensor");
}

TORCH_LIBRARY_IMPL(multicomposite, CPU, m) {
  m.impl("fill", fill_cpu);
  m.impl("fill_backward", fill_backward_cpu);
  m.impl("masked_scatter", scatter_cpu);
  m.impl("masked_scatter_backward", scatter_backward_cpu);
  m.impl("masked_gather", gather_cpu);
  m.impl("index_mask", index_mask_cpu);
}

TORCH_LIBRARY_IMPL(multicomposite, CompositeExplicitAutograd, m) {
  m.impl("fill", fill_aten);
  m.impl("fill_backward", fill_backward_aten);
  m.impl("masked_scatter", scatter_aten);
  m.impl("masked_scatter_backward", scatter_backward_aten);
  m.impl("masked_gather", gather_aten);
  m.impl("index_mask", index_mask_aten);
}

// index_fill decomposes into index_mask and fill everywhere (aten's OP_DECOMPOSE does the same for vmap): their
// autograd and batching kernels are index_fill's.
TORCH_LIBRARY_IMPL(multicomposite, CompositeImplicitAutograd, m) { m.impl("index_fill", index_fill_composite); }

TORCH_LIBRARY_IMPL(multicomposite, Autograd, m) {
  m.impl("fill", fill_autograd);
  m.impl("fill_backward", fill_backward_autograd);
  m.impl("masked_scatter", scatter_autograd);
  m.impl("masked_scatter_backward", scatter_backward_autograd);
  m.impl("masked_gather", gather_autograd);
  m.impl("index_mask", index_mask_autograd);
}

TORCH_LIBRARY_IMPL(multicomposite, FuncTorchBatched, m) {
  m.impl("fill", fill_batched);
  m.impl("fill_backward", fill_backward_batched);
  m.impl("masked_scatter", scatter_batched);
  m.impl("masked_scatter_backward", scatter_backward_batched);
  m.impl("masked_gather", gather_batched);
  m.impl("index_mask", index_mask_batched);
  m.impl("index_fill", index_fill_composite);
}
