// multicomposite::gather_rows, scatter_rows, add_rows and add_rows_: a tensor's rows at an index (x[index]), rows
// summed into a new tensor by an index (what index_add into zeros sums), and rows summed into a copy of a tensor or
// into the tensor itself (index_add, index_add_), each one op with one autograd node, a forward-AD tangent and one
// batching rule; and the entries of the cpp_op composites of aten::index_add (composites/index.py) and
// aten::scatter_add (composites/reduce.py), out of place and in place, which take aten's arguments. x[index] and its
// backward's index_put reach them through batching rules (batch_rules.cpp's rows section), inside use().
//
// NOTE [rows ops]: why ops of our own. Message passing (graph networks: a node's features at each edge's source,
// h[row]; each edge's message summed at its target, out.index_add_(0, col, message)) gathers and scatters rows by an
// index that every sample has its own of. Under vmap(grad), functorch batches x[index] as advanced indexing with a
// second, arange index over the batch (aten::index, a TensorIterator over both), and its backward as index_put_ with
// accumulate into new zeros, batched the same way; index_add's rule loops over the samples (composites/index.py's
// NOTE [index_add's batched index]); the scatter_add composite's backward is gather with an expanded index. In
// bench.models' graph network at batch 64 these were about half of the per-sample-gradient step (profiled: index
// 0.39 ms, index_put 0.30 ms, gather 0.20 ms of 2.1 ms). Here every call is one op: its batching rule folds each
// level's batch into the rows (sample b's row r is row b * rows + r, checked and offset in one pass over the index),
// and its kernel copies or adds whole rows; the backward of each is the other.
//
// add_rows (self plus the summed rows) is scatter_rows and an add as one op: under vmap(grad) each op is a call
// through both levels forward and a node backward, and the entries' index_add and scatter_add, and x[index]'s
// backward (index_put with accumulate into zeros), are each one call and one node (AddRowsBackward: the output's
// gradient for self, gather_rows of it for the source) instead of two. add_rows_ writes into self, recorded as
// PyTorch's in-place ops are (self's history rebased onto the node): the in-place entries (index_add_ and
// scatter_add_ routed to the cpp_op composites: routing.cpp's call_redirect calls them) are one call and one node,
// where out of place and a copy_ into self were two of each. In bench.models' graph network (three such calls a step)
// the per-sample-gradient step at batch 4 went from 1.19 to 1.05 ms with both (measured with the below-grad backward
// of first_order.cpp; one thread, thread CPU time).

#include <ATen/ATen.h>
#include <ATen/FunctionalTensorWrapper.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/functorch/BatchedTensorImpl.h>
#include <ATen/functorch/DynamicLayer.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/irange.h>
#include <torch/csrc/autograd/VariableTypeUtils.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/library.h>

#include "functorch_levels.h"

#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

namespace multicomposite_rows {

using at::Tensor;

const c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&)>& gather_rows_op() {
  static const auto handle = c10::Dispatcher::singleton()
                                 .findSchemaOrThrow("multicomposite::gather_rows", "")
                                 .typed<Tensor(const Tensor&, const Tensor&)>();
  return handle;
}

const c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, int64_t)>& scatter_rows_op() {
  static const auto handle = c10::Dispatcher::singleton()
                                 .findSchemaOrThrow("multicomposite::scatter_rows", "")
                                 .typed<Tensor(const Tensor&, const Tensor&, int64_t)>();
  return handle;
}

const c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, const Tensor&)>& add_rows_op() {
  static const auto handle = c10::Dispatcher::singleton()
                                 .findSchemaOrThrow("multicomposite::add_rows", "")
                                 .typed<Tensor(const Tensor&, const Tensor&, const Tensor&)>();
  return handle;
}

const c10::TypedOperatorHandle<Tensor&(Tensor&, const Tensor&, const Tensor&)>& add_rows_inplace_op() {
  static const auto handle = c10::Dispatcher::singleton()
                                 .findSchemaOrThrow("multicomposite::add_rows_", "")
                                 .typed<Tensor&(Tensor&, const Tensor&, const Tensor&)>();
  return handle;
}


bool integral_index(const Tensor& index) {
  return index.scalar_type() == at::kLong || index.scalar_type() == at::kInt;
}

// Whether `t`'s values can be read here: an ordinary CPU tensor with its own memory (not batched or wrapped by a
// functorch level, not a functional tensor, not a Python subclass such as a fake tensor while something traces).
bool readable(const Tensor& t) {
  return multicomposite_functorch::plain(t) && t.device().is_cpu() && t.has_storage() &&
         !at::functionalization::impl::isFunctionalTensor(t) && !t.key_set().has(c10::DispatchKey::Python);
}

// `index` (readable, int64 or int32) as flat int64 rows of a tensor of `batch` blocks of `rows` rows: the element at
// flat position p of block b = p / (numel / batch) becomes b * rows + its value. Indexing (`indexing`: x[index] and
// index_put) counts a negative value from the end, and a value outside [-rows, rows) is its IndexError; the rows
// ops' own kernels take [0, rows) only, as index_add and scatter_add do, and anything else is their RuntimeError.
// The message is PyTorch's either way.
template <typename scalar_t>
void fold_values(const scalar_t* values, int64_t* out, int64_t count, int64_t per_block, int64_t rows,
                 bool indexing) {
  for (int64_t p = 0; p < count; ++p) {
    const int64_t value = static_cast<int64_t>(values[p]);
    const int64_t row = value < 0 && indexing ? value + rows : value;
    if (C10_UNLIKELY(row < 0 || row >= rows)) {
      if (indexing) {
        TORCH_CHECK_INDEX(false, "index ", value, " is out of bounds for dimension 0 with size ", rows);
      }
      TORCH_CHECK(false, "index ", value, " is out of bounds for dimension 0 with size ", rows);
    }
    out[p] = (p / per_block) * rows + row;
  }
}

Tensor folded_rows(const Tensor& index, int64_t rows, int64_t batch, bool indexing) {
  // Made as an ordinary tensor where a batching rule makes it: a factory called there goes down through the levels
  // below, and a grad level among them would wrap it.
  c10::impl::ExcludeDispatchKeyGuard ordinary(c10::DispatchKeySet(
      {c10::DispatchKey::FuncTorchDynamicLayerFrontMode, c10::DispatchKey::FuncTorchDynamicLayerBackMode}));
  TORCH_CHECK(integral_index(index) && readable(index),
              "multicomposite's rows ops take an int64 or int32 CPU index, not ", index.scalar_type(), " on ",
              index.device());
  const Tensor values = index.contiguous();
  const int64_t count = values.numel();
  Tensor out = at::empty({count}, values.options().dtype(at::kLong));
  if (count == 0) return out;
  const int64_t per_block = count / std::max<int64_t>(batch, 1);
  if (values.scalar_type() == at::kLong) {
    fold_values(values.const_data_ptr<int64_t>(), out.mutable_data_ptr<int64_t>(), count, per_block, rows, indexing);
  } else {
    fold_values(values.const_data_ptr<int32_t>(), out.mutable_data_ptr<int64_t>(), count, per_block, rows, indexing);
  }
  return out;
}

}  // namespace multicomposite_rows

namespace {

using at::Tensor;
using multicomposite_rows::folded_rows;
using multicomposite_rows::gather_rows_op;
using multicomposite_rows::integral_index;
using multicomposite_rows::scatter_rows_op;
using multicomposite_rows::add_rows_op;
using multicomposite_rows::add_rows_inplace_op;
using multicomposite_functorch::BelowLevels;
using multicomposite_functorch::batch_first;
using multicomposite_functorch::batched_at;
using multicomposite_functorch::plain;
using torch::autograd::variable_list;

// The sizes of a gather's result: the index's, then the rows' own (`rest`).
std::vector<int64_t> joined(at::IntArrayRef index_sizes, at::IntArrayRef rest) {
  std::vector<int64_t> sizes(index_sizes.begin(), index_sizes.end());
  sizes.insert(sizes.end(), rest.begin(), rest.end());
  return sizes;
}

// --- the kernels on ordinary tensors -------------------------------------------------------------------------------

// self's rows at `flat` (int64, each in [0, self.size(0))), as (flat.numel(), *self.shape[1:]).
Tensor copy_rows(const Tensor& self, const Tensor& flat) {
  if (!self.is_contiguous() || self.is_conj() || self.is_neg()) return at::index_select(self, 0, flat);
  const int64_t count = flat.numel();
  std::vector<int64_t> sizes = self.sizes().vec();
  sizes[0] = count;
  Tensor out = at::empty(sizes, self.options());
  const int64_t bytes = self.numel() == 0 ? 0 : self.nbytes() / self.size(0);
  if (bytes == 0 || count == 0) return out;
  const auto* source = static_cast<const char*>(self.const_data_ptr());
  auto* target = static_cast<char*>(out.mutable_data_ptr());
  const int64_t* rows = flat.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < count; ++i) std::memcpy(target + i * bytes, source + rows[i] * bytes, bytes);
  return out;
}

template <typename scalar_t>
void accumulate_rows(scalar_t* out, const scalar_t* source, const int64_t* rows, int64_t count, int64_t width) {
  for (int64_t i = 0; i < count; ++i) {
    scalar_t* target = out + rows[i] * width;
    const scalar_t* row = source + i * width;
    for (int64_t j = 0; j < width; ++j) target[j] += row[j];
  }
}

// `source`'s rows (flat.numel() of them) added into the rows of `out` (contiguous, of `source`'s dtype, no conjugate
// or negative bit) at `flat`.
void add_rows_into(const Tensor& out, const Tensor& source, const Tensor& flat) {
  const int64_t count = flat.numel();
  const int64_t width = c10::multiply_integers(out.sizes().slice(1));
  if (count == 0 || width == 0) return;
  const Tensor values = source.reshape({count, width}).contiguous();
  const int64_t* positions = flat.const_data_ptr<int64_t>();
  if (source.scalar_type() == at::kFloat && !values.is_conj() && !values.is_neg()) {
    accumulate_rows(out.mutable_data_ptr<float>(), values.const_data_ptr<float>(), positions, count, width);
  } else if (source.scalar_type() == at::kDouble && !values.is_neg()) {
    accumulate_rows(out.mutable_data_ptr<double>(), values.const_data_ptr<double>(), positions, count, width);
  } else {
    out.view({out.size(0), width}).index_add_(0, flat, values);
  }
}

// `source`'s rows (flat.numel() of them, each of shape `rest`) summed into `rows` new rows at `flat`.
Tensor sum_rows(const Tensor& source, const Tensor& flat, int64_t rows, at::IntArrayRef rest) {
  Tensor out = at::zeros(joined({rows}, rest), source.options());
  add_rows_into(out, source, flat);
  return out;
}

Tensor gather_rows_kernel(const Tensor& self, const Tensor& index) {
  TORCH_CHECK(self.dim() >= 1, "multicomposite::gather_rows takes a tensor of at least one dimension");
  const Tensor flat = folded_rows(index, self.size(0), 1, /*indexing=*/false);
  return copy_rows(self, flat).view(joined(index.sizes(), self.sizes().slice(1)));
}

void check_scatter(const Tensor& source, const Tensor& index, int64_t rows) {
  TORCH_CHECK(rows >= 0, "multicomposite::scatter_rows: rows must be non-negative, not ", rows);
  TORCH_CHECK(source.dim() >= index.dim() && source.sizes().slice(0, index.dim()) == index.sizes(),
              "multicomposite::scatter_rows: source's leading dimensions ", source.sizes(),
              " must be the index's ", index.sizes());
}

Tensor scatter_rows_kernel(const Tensor& source, const Tensor& index, int64_t rows) {
  check_scatter(source, index, rows);
  return sum_rows(source, folded_rows(index, rows, 1, /*indexing=*/false), rows, source.sizes().slice(index.dim()));
}

void check_add_rows(const Tensor& self, const Tensor& source, const Tensor& index) {
  TORCH_CHECK(self.dim() >= 1, "multicomposite::add_rows takes a self of at least one dimension");
  TORCH_CHECK(source.scalar_type() == self.scalar_type(), "multicomposite::add_rows: source's dtype ",
              source.scalar_type(), " must be self's, ", self.scalar_type());
  TORCH_CHECK(source.dim() == index.dim() + self.dim() - 1 && source.sizes().slice(0, index.dim()) == index.sizes() &&
                  source.sizes().slice(index.dim()) == self.sizes().slice(1),
              "multicomposite::add_rows: source's shape ", source.sizes(), " must be the index's ", index.sizes(),
              " then the shape of self's rows ", self.sizes().slice(1));
}

// A contiguous copy of self (a conjugate or negative bit resolved: add_rows_into writes plain values) with the
// source's rows added at `flat`.
Tensor with_rows_added(const Tensor& self, const Tensor& source, const Tensor& flat) {
  Tensor out = at::empty(self.sizes(), self.options().memory_format(at::MemoryFormat::Contiguous));
  out.copy_(self);
  add_rows_into(out, source, flat);
  return out;
}

Tensor add_rows_kernel(const Tensor& self, const Tensor& source, const Tensor& index) {
  check_add_rows(self, source, index);
  return with_rows_added(self, source, folded_rows(index, self.size(0), 1, /*indexing=*/false));
}

// In place: into self's own memory where it is contiguous and plain, else through a copy (as index_add_ writes).
Tensor& add_rows_inplace_kernel(Tensor& self, const Tensor& source, const Tensor& index) {
  check_add_rows(self, source, index);
  at::assert_no_overlap(self, source);  // index_add_'s check: a source read while self is written
  const Tensor flat = folded_rows(index, self.size(0), 1, /*indexing=*/false);
  if (self.is_contiguous() && !self.is_conj() && !self.is_neg()) {
    add_rows_into(self, source, flat);
  } else {
    self.copy_(with_rows_added(self, source, flat));
  }
  return self;
}

// --- autograd: each op's backward is the other ----------------------------------------------------------------------

Tensor tangent_of(const Tensor& t) { return t._fw_grad(/*level=*/0); }

struct GatherRowsBackward : public torch::autograd::Node {
  torch::autograd::SavedVariable index;
  int64_t rows = 0;
  variable_list apply(variable_list&& grads) override {
    if (!grads[0].defined() || !task_should_compute_output(0)) return {Tensor()};
    return {scatter_rows_op().call(grads[0], index.unpack(), rows)};
  }
  std::string name() const override { return "multicomposite::GatherRowsBackward"; }
  void release_variables() override { index.reset_data(); }
};

struct ScatterRowsBackward : public torch::autograd::Node {
  torch::autograd::SavedVariable index;
  variable_list apply(variable_list&& grads) override {
    if (!grads[0].defined() || !task_should_compute_output(0)) return {Tensor()};
    return {gather_rows_op().call(grads[0], index.unpack())};
  }
  std::string name() const override { return "multicomposite::ScatterRowsBackward"; }
  void release_variables() override { index.reset_data(); }
};

struct AddRowsBackward : public torch::autograd::Node {
  torch::autograd::SavedVariable index;
  variable_list apply(variable_list&& grads) override {
    variable_list out(2);
    if (!grads[0].defined()) return out;
    if (task_should_compute_output(0)) out[0] = grads[0];
    if (task_should_compute_output(1)) out[1] = gather_rows_op().call(grads[0], index.unpack());
    return out;
  }
  std::string name() const override { return "multicomposite::AddRowsBackward"; }
  void release_variables() override { index.reset_data(); }
};

// The node of a rows op whose differentiable inputs are `inputs` (its edges, in order) and whose backward reads
// `index`; null where none of them requires grad.
template <typename NodeT, typename... Inputs>
c10::intrusive_ptr<NodeT> rows_node(const Tensor& index, const Inputs&... inputs) {
  if (!torch::autograd::compute_requires_grad(inputs...)) return {};
  auto node = c10::make_intrusive<NodeT>();
  node->set_next_edges(torch::autograd::collect_next_edges(inputs...));
  node->index = torch::autograd::SavedVariable(index, /*is_output=*/false);
  return node;
}

Tensor gather_rows_autograd(const Tensor& self, const Tensor& index) {
  const auto node = rows_node<GatherRowsBackward>(index, self);
  if (node) node->rows = self.size(0);
  Tensor out;
  {
    at::AutoDispatchBelowADInplaceOrView below;
    out = gather_rows_op().call(self, index);
  }
  if (node) torch::autograd::set_history(out, node);
  const Tensor tangent = tangent_of(self);
  if (tangent.defined()) out._set_fw_grad(gather_rows_op().call(tangent, index), /*level=*/0, false);
  return out;
}

Tensor scatter_rows_autograd(const Tensor& source, const Tensor& index, int64_t rows) {
  const auto node = rows_node<ScatterRowsBackward>(index, source);
  Tensor out;
  {
    at::AutoDispatchBelowADInplaceOrView below;
    out = scatter_rows_op().call(source, index, rows);
  }
  if (node) torch::autograd::set_history(out, node);
  const Tensor tangent = tangent_of(source);
  if (tangent.defined()) out._set_fw_grad(scatter_rows_op().call(tangent, index, rows), /*level=*/0, false);
  return out;
}

Tensor add_rows_autograd(const Tensor& self, const Tensor& source, const Tensor& index) {
  const auto node = rows_node<AddRowsBackward>(index, self, source);
  Tensor out;
  {
    at::AutoDispatchBelowADInplaceOrView below;
    out = add_rows_op().call(self, source, index);
  }
  if (node) torch::autograd::set_history(out, node);
  const Tensor self_tangent = tangent_of(self);
  const Tensor source_tangent = tangent_of(source);
  if (self_tangent.defined() && source_tangent.defined()) {
    out._set_fw_grad(add_rows_op().call(self_tangent, source_tangent, index), /*level=*/0, false);
  } else if (self_tangent.defined()) {
    out._set_fw_grad(self_tangent.clone(), /*level=*/0, false);
  } else if (source_tangent.defined()) {
    out._set_fw_grad(scatter_rows_op().call(source_tangent, index, self.size(0)), /*level=*/0, false);
  }
  return out;
}

// In place, as PyTorch's own in-place ops record themselves: self's history rebased onto the node (which takes self's
// old history as its first input), its version bumped, its tangent updated where the source has one.
Tensor& add_rows_inplace_autograd(Tensor& self, const Tensor& source, const Tensor& index) {
  torch::autograd::check_inplace(self, torch::autograd::compute_requires_grad(self, source));
  const auto node = rows_node<AddRowsBackward>(index, self, source);  // its edges: self's history before the write
  {
    at::AutoDispatchBelowADInplaceOrView below;
    add_rows_inplace_op().call(self, source, index);
  }
  torch::autograd::increment_version(self);
  if (node) torch::autograd::rebase_history(self, node);
  // The tangent as PyTorch's in-place ops update it: self's own in place (a tangent self has keeps its identity),
  // or, where self has none, the source's rows summed (self's own tangent alone is unchanged by the write).
  const Tensor source_tangent = tangent_of(source);
  if (source_tangent.defined()) {
    Tensor self_tangent = tangent_of(self);
    if (self_tangent.defined()) {
      add_rows_inplace_op().call(self_tangent, source_tangent, index);
    } else {
      self._set_fw_grad(scatter_rows_op().call(source_tangent, index, self.size(0)), /*level=*/0,
                        /*is_inplace_op=*/true);
    }
  }
  return self;
}

// --- batching rules: each level's batch folded into the rows ----------------------------------------------------

int64_t current_level(const char* op) {
  const auto layer = at::functorch::maybeCurrentDynamicLayer();
  TORCH_INTERNAL_ASSERT(layer.has_value(), op, "'s batching rule ran outside vmap");
  return layer->layerId();
}

// The op on physical tensors, dispatched (eager autograd records it where an input requires grad; an outer level
// batches or wraps what it still holds), once under the last level where every operand is ordinary (NOTE [kernels
// under the last level]).
Tensor gather(const Tensor& self, const Tensor& index) {
  const BelowLevels below(plain(self) && plain(index));
  return gather_rows_op().call(self, index);
}

Tensor scatter(const Tensor& source, const Tensor& index, int64_t rows) {
  const BelowLevels below(plain(source) && plain(index));
  return scatter_rows_op().call(source, index, rows);
}

// `logical`'s physical value with the batch in front: its own where it is batched at the level (`batched`), else
// expanded over the level's `batch` samples.
Tensor batch_first_or_expanded(const Tensor& logical, const at::functorch::BatchedTensorImpl* batched, int64_t batch) {
  if (batched != nullptr) return batch_first(*batched);
  std::vector<int64_t> expanded = logical.sizes().vec();
  expanded.insert(expanded.begin(), batch);
  return logical.unsqueeze(0).expand(expanded);
}

Tensor gather_rows_batched(const Tensor& self, const Tensor& index) {
  const int64_t level = current_level("multicomposite::gather_rows");
  const auto* self_batched = batched_at(self, level);
  const auto* index_batched = batched_at(index, level);
  c10::impl::ExcludeDispatchKeyGuard guard(c10::DispatchKey::FuncTorchBatched);
  if (self_batched == nullptr && index_batched == nullptr) {
    return gather_rows_op().call(self, index);  // batched at outer levels only: theirs to batch
  }
  if (index_batched == nullptr) {
    // The samples share the index: gather along the rows with the batch moved behind them.
    const Tensor rows_first = batch_first(*self_batched).movedim(0, 1);
    return at::functorch::makeBatched(gather(rows_first, index), index.dim(), level);
  }
  const Tensor index_p = batch_first(*index_batched);  // (batch, *index)
  if (self_batched == nullptr) return at::functorch::makeBatched(gather(self, index_p), 0, level);
  const Tensor self_p = batch_first(*self_batched);  // (batch, rows, *rest)
  const int64_t batch = self_p.size(0), rows = self_p.size(1);
  if (!multicomposite_rows::readable(index_p)) {
    // Batched at an outer level too, or a functional tensor: its values cannot be read here. Advanced indexing with
    // the batch's arange, which the outer levels batch (functorch's own rule).
    std::vector<int64_t> shape(index_p.dim(), 1);
    shape[0] = batch;
    const Tensor samples = at::arange(batch, index_p.options().dtype(at::kLong)).view(shape);
    return at::functorch::makeBatched(at::index(self_p, {samples, index_p}), 0, level);
  }
  const Tensor flat = folded_rows(index_p, rows, batch, /*indexing=*/false);
  std::vector<int64_t> folded = self_p.sizes().vec();
  folded.erase(folded.begin());
  folded[0] = batch * rows;
  const Tensor out = gather(self_p.reshape(folded), flat);
  return at::functorch::makeBatched(out.view(joined(index_p.sizes(), self_p.sizes().slice(2))), 0, level);
}

Tensor scatter_rows_batched(const Tensor& source, const Tensor& index, int64_t rows) {
  const int64_t level = current_level("multicomposite::scatter_rows");
  const auto* source_batched = batched_at(source, level);
  const auto* index_batched = batched_at(index, level);
  c10::impl::ExcludeDispatchKeyGuard guard(c10::DispatchKey::FuncTorchBatched);
  if (source_batched == nullptr && index_batched == nullptr) {
    return scatter_rows_op().call(source, index, rows);  // batched at outer levels only: theirs to batch
  }
  if (index_batched == nullptr) {
    // The samples share the index: the batch behind the index's dimensions is one more dimension of each row.
    const Tensor moved = batch_first(*source_batched).movedim(0, index.dim());
    return at::functorch::makeBatched(scatter(moved, index, rows), 1, level);
  }
  const Tensor index_p = batch_first(*index_batched);  // (batch, *index)
  const int64_t batch = index_p.size(0);
  const Tensor source_p = batch_first_or_expanded(source, source_batched, batch);
  check_scatter(source_p, index_p, rows);
  const at::IntArrayRef rest = source_p.sizes().slice(index_p.dim());
  if (!multicomposite_rows::readable(index_p)) {
    // Batched at an outer level too, or a functional tensor: its values cannot be read here. scatter_add along the
    // rows with the index expanded over each row (which the outer levels batch; like the kernel, and unlike
    // index_put, it refuses a negative index).
    const int64_t count = index_p.numel() / std::max<int64_t>(batch, 1);
    std::vector<int64_t> index_shape{batch, count}, expanded{batch, count};
    index_shape.insert(index_shape.end(), rest.size(), 1);
    expanded.insert(expanded.end(), rest.begin(), rest.end());
    const Tensor index_rows = index_p.reshape({batch, count}).view(index_shape).expand(expanded);
    const Tensor zeros = at::zeros(joined({batch, rows}, rest), source_p.options());
    return at::functorch::makeBatched(at::scatter_add(zeros, 1, index_rows, source_p.reshape(expanded)), 0, level);
  }
  const Tensor flat = folded_rows(index_p, rows, batch, /*indexing=*/false);
  std::vector<int64_t> folded = joined({flat.numel()}, rest);
  const Tensor out = scatter(source_p.reshape(folded), flat, batch * rows);
  return at::functorch::makeBatched(out.view(joined({batch, rows}, rest)), 0, level);
}

// add_rows where the index is batched at this level and readable: every sample's rows folded into one add_rows;
// otherwise (a shared index, one batched at an outer level too) self plus scatter_rows, whose rule takes both.
Tensor add_rows_batched(const Tensor& self, const Tensor& source, const Tensor& index) {
  const int64_t level = current_level("multicomposite::add_rows");
  const auto* index_batched = batched_at(index, level);
  Tensor index_p;  // (batch, *index)
  if (index_batched != nullptr && multicomposite_rows::readable(index_batched->value())) {
    // Moved as an ordinary tensor: an op called here goes down through the levels below, and a grad or jvp level
    // among them would wrap the view.
    c10::impl::ExcludeDispatchKeyGuard ordinary(c10::DispatchKeySet(
        {c10::DispatchKey::FuncTorchDynamicLayerFrontMode, c10::DispatchKey::FuncTorchDynamicLayerBackMode}));
    index_p = batch_first(*index_batched);
  }
  if (!index_p.defined()) {
    if (batched_at(self, level) == nullptr && batched_at(source, level) == nullptr && index_batched == nullptr) {
      c10::impl::ExcludeDispatchKeyGuard guard(c10::DispatchKey::FuncTorchBatched);
      return add_rows_op().call(self, source, index);  // batched at outer levels only: theirs to batch
    }
    return at::add(self, scatter_rows_op().call(source, index, self.size(0)));
  }
  check_add_rows(self, source, index);  // the logical shapes, as the kernel checks them
  const auto* self_batched = batched_at(self, level);
  const auto* source_batched = batched_at(source, level);
  c10::impl::ExcludeDispatchKeyGuard guard(c10::DispatchKey::FuncTorchBatched);
  const int64_t batch = index_p.size(0);
  const Tensor self_p = batch_first_or_expanded(self, self_batched, batch);        // (batch, rows, *rest)
  const Tensor source_p = batch_first_or_expanded(source, source_batched, batch);  // (batch, *index, *rest)
  const int64_t rows = self_p.size(1);
  const at::IntArrayRef rest = self_p.sizes().slice(2);
  const Tensor flat = folded_rows(index_p, rows, batch, /*indexing=*/false);
  Tensor out;
  {
    const BelowLevels below(plain(self_p) && plain(source_p));
    out = add_rows_op().call(self_p.reshape(joined({batch * rows}, rest)),
                             source_p.reshape(joined({flat.numel()}, rest)), flat);
  }
  return at::functorch::makeBatched(out.view(self_p.sizes()), 0, level);
}

// add_rows_ into a self batched at this level with its batch first, contiguous and ordinary below it, by an index
// batched at this level and readable, from an ordinary source: every sample's rows added in place, folded. Anything
// else is add_rows and a copy_ into self, whose rules take it (copy_'s refuses a write of batched values into a self
// that is not batched, with functorch's message).
Tensor& add_rows_inplace_batched(Tensor& self, const Tensor& source, const Tensor& index) {
  const int64_t level = current_level("multicomposite::add_rows_");
  const auto* self_batched = batched_at(self, level);
  const auto* source_batched = batched_at(source, level);
  const auto* index_batched = batched_at(index, level);
  if (self_batched == nullptr && source_batched == nullptr && index_batched == nullptr) {
    c10::impl::ExcludeDispatchKeyGuard guard(c10::DispatchKey::FuncTorchBatched);
    return add_rows_inplace_op().call(self, source, index);  // batched at outer levels only: theirs to batch
  }
  const bool folds = self_batched != nullptr && self_batched->bdim() == 0 && plain(self_batched->value()) &&
                     self_batched->value().is_contiguous() && index_batched != nullptr &&
                     multicomposite_rows::readable(index_batched->value()) &&
                     (source_batched != nullptr ? plain(source_batched->value()) : plain(source));
  if (!folds) {
    return self.copy_(add_rows_op().call(self, source, index));
  }
  check_add_rows(self, source, index);  // the logical shapes, as the kernel checks them
  c10::impl::ExcludeDispatchKeyGuard guard(c10::DispatchKey::FuncTorchBatched);
  const Tensor self_p = self_batched->value();  // (batch, rows, *rest)
  const int64_t batch = self_p.size(0), rows = self_p.size(1);
  const at::IntArrayRef rest = self_p.sizes().slice(2);
  Tensor index_p, source_p;
  {
    // Moved as ordinary tensors (every operand is one below this level): an op called here would otherwise go down
    // through the levels below, and a grad or jvp level among them would wrap the view.
    c10::impl::ExcludeDispatchKeyGuard ordinary(c10::DispatchKeySet(
        {c10::DispatchKey::FuncTorchDynamicLayerFrontMode, c10::DispatchKey::FuncTorchDynamicLayerBackMode}));
    index_p = batch_first(*index_batched);
    source_p = batch_first_or_expanded(source, source_batched, batch);
  }
  const Tensor flat = folded_rows(index_p, rows, batch, /*indexing=*/false);
  {
    const BelowLevels below(true);
    Tensor folded = self_p.view(joined({batch * rows}, rest));
    add_rows_inplace_op().call(folded, source_p.reshape(joined({flat.numel()}, rest)), flat);
  }
  return self;
}

// --- the entries: aten's arguments, PyTorch's own op where the rows ops do not take them ----------------------------

// Whether index_add's cpp_op takes the call: along the first dimension with alpha 1, a source of self's dtype (not
// bool) and shape, an integer index of at most one dimension, on the CPU, into a self with elements. Anything else
// is aten::index_add's (its checks, its errors; an empty self it returns as it is, whatever the index holds).
bool index_add_takes(const Tensor& self, int64_t dim, const Tensor& index, const Tensor& source,
                     const at::Scalar& alpha) {
  return self.dim() >= 1 && self.numel() > 0 && self.scalar_type() != at::kBool && source.dim() == self.dim() &&
         (dim == 0 || dim == -self.dim()) && index.dim() <= 1 && integral_index(index) && self.device().is_cpu() &&
         index.device().is_cpu() && source.device().is_cpu() && source.scalar_type() == self.scalar_type() &&
         source.size(0) == index.numel() && source.sizes().slice(1) == self.sizes().slice(1) &&
         !alpha.isBoolean() && alpha.equal(1);
}

// A 0-d index as one row (reshape({-1}) of an empty batch under vmap would be ambiguous).
Tensor index_rows(const Tensor& index) { return index.dim() == 1 ? index : index.reshape({1}); }

// index_add along the first dimension with alpha 1: self plus the source's rows summed at the index (add_rows);
// anything else aten::index_add.
Tensor index_add_entry(const Tensor& self, int64_t dim, const Tensor& index, const Tensor& source,
                       const at::Scalar& alpha) {
  if (!index_add_takes(self, dim, index, source, alpha)) return at::index_add(self, dim, index, source, alpha);
  return add_rows_op().call(self, source, index_rows(index));
}

Tensor& index_add_inplace_entry(Tensor& self, int64_t dim, const Tensor& index, const Tensor& source,
                                const at::Scalar& alpha) {
  if (!index_add_takes(self, dim, index, source, alpha)) return self.index_add_(dim, index, source, alpha);
  return add_rows_inplace_op().call(self, source, index_rows(index));
}

// The row index of a scatter_add that add_rows takes: along the first dimension, an index that repeats one row index
// along every other dimension (index.view(-1, 1).expand_as(src): graph libraries' scatter(..., reduce="sum")), of
// src's shape, into a self of src's trailing shape; undefined where aten::scatter_add must run.
Tensor scatter_row_index(const Tensor& self, int64_t dim, const Tensor& index, const Tensor& src) {
  bool takes = self.dim() >= 1 && self.dim() == src.dim() && index.dim() == src.dim() &&
               (dim == 0 || dim == -self.dim()) && self.scalar_type() != at::kBool &&
               src.scalar_type() == self.scalar_type() && index.scalar_type() == at::kLong && self.device().is_cpu() &&
               index.device().is_cpu() && src.device().is_cpu() && src.numel() > 0 && index.sizes() == src.sizes() &&
               self.sizes().slice(1) == src.sizes().slice(1);
  for (int64_t d = 1; takes && d < index.dim(); ++d) takes = index.stride(d) == 0 || index.size(d) == 1;
  if (!takes) return Tensor();
  Tensor rows = index;
  while (rows.dim() > 1) rows = rows.select(-1, 0);
  return rows;
}

Tensor scatter_add_entry(const Tensor& self, int64_t dim, const Tensor& index, const Tensor& src) {
  const Tensor rows = scatter_row_index(self, dim, index, src);
  return rows.defined() ? add_rows_op().call(self, src, rows) : at::scatter_add(self, dim, index, src);
}

Tensor& scatter_add_inplace_entry(Tensor& self, int64_t dim, const Tensor& index, const Tensor& src) {
  const Tensor rows = scatter_row_index(self, dim, index, src);
  return rows.defined() ? add_rows_inplace_op().call(self, src, rows) : self.scatter_add_(dim, index, src);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(multicomposite, m) {
  // self's rows at index (int64 or int32, any shape, negative from the end): (*index.shape, *self.shape[1:]).
  m.def("gather_rows(Tensor self, Tensor index) -> Tensor");
  // source's rows (source.shape = (*index.shape, *rest)) summed into `rows` new rows at index: (rows, *rest).
  m.def("scatter_rows(Tensor source, Tensor index, int rows) -> Tensor");
  // self (rows, *rest) plus source's rows (source.shape = (*index.shape, *rest)) summed at index: (rows, *rest).
  m.def("add_rows(Tensor self, Tensor source, Tensor index) -> Tensor");
  m.def("add_rows_(Tensor(a!) self, Tensor source, Tensor index) -> Tensor(a!)");
  m.def("index_add.entry(Tensor self, int dim, Tensor index, Tensor source, *, Scalar alpha=1) -> Tensor");
  m.def("scatter_add.entry(Tensor self, int dim, Tensor index, Tensor src) -> Tensor");
  // The in-place overloads' entries (what routing.cpp's call_redirect calls for index_add_ and scatter_add_).
  m.def("index_add_.entry(Tensor(a!) self, int dim, Tensor index, Tensor source, *, Scalar alpha=1) -> Tensor(a!)");
  m.def("scatter_add_.entry(Tensor(a!) self, int dim, Tensor index, Tensor src) -> Tensor(a!)");
}

TORCH_LIBRARY_IMPL(multicomposite, CompositeExplicitAutograd, m) {
  m.impl("gather_rows", gather_rows_kernel);
  m.impl("scatter_rows", scatter_rows_kernel);
  m.impl("add_rows", add_rows_kernel);
  m.impl("add_rows_", add_rows_inplace_kernel);
}

TORCH_LIBRARY_IMPL(multicomposite, Autograd, m) {
  m.impl("gather_rows", gather_rows_autograd);
  m.impl("scatter_rows", scatter_rows_autograd);
  m.impl("add_rows", add_rows_autograd);
  m.impl("add_rows_", add_rows_inplace_autograd);
}

TORCH_LIBRARY_IMPL(multicomposite, FuncTorchBatched, m) {
  m.impl("gather_rows", gather_rows_batched);
  m.impl("scatter_rows", scatter_rows_batched);
  m.impl("add_rows", add_rows_batched);
  m.impl("add_rows_", add_rows_inplace_batched);
  // The entries decompose under vmap too (as entries.cpp's): the rows ops' rules batch them.
  m.impl("index_add.entry", index_add_entry);
  m.impl("scatter_add.entry", scatter_add_entry);
  m.impl("index_add_.entry", index_add_inplace_entry);
  m.impl("scatter_add_.entry", scatter_add_inplace_entry);
}

TORCH_LIBRARY_IMPL(multicomposite, CompositeImplicitAutograd, m) {
  m.impl("index_add.entry", index_add_entry);
  m.impl("scatter_add.entry", scatter_add_entry);
  m.impl("index_add_.entry", index_add_inplace_entry);
  m.impl("scatter_add_.entry", scatter_add_inplace_entry);
}
