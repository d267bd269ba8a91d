// multicomposite::linear: aten::linear as one op with one autograd node and one batching rule (the cpp_op composite
// of linear, with its op and its rules, in composites/linear.py).
//
// NOTE: why an op of our own. aten::linear is CompositeImplicitAutograd: under torch.func's grad it decomposes at
// the grad level into t, view (or reshape), addmm or matmul and add, each recorded as a node of its own and each
// batched on its own one level below, forward and backward. Under vmap(grad) a per-sample-gradient step of a
// LoRA-adapted decoder makes about 20 such calls a layer. This op records one node (LinearBackward below) and folds
// the batch into the rows in one call of PyTorch's linear where only the input is batched (an ensemble's batched
// weight runs aten's linear on the batched tensors, as without the op). Where grad mode is on, the backward is this
// op again and aten ops (cat, mm, sum_to_size), so it differentiates again where autograd records it; the
// forward-AD tangent is aten's linear of the tangents.
//
// NOTE: the backward where nothing records it (first-order grad: registry/core/first_order_grad.py). The input's
// gradient is this op again (the output gradient's rows times the weight, folded under vmap as the forward is), and
// the weight's is multicomposite::linear_weight_grad, whose batching rule forms each sample's gradient as one
// batched product, or as a broadcasting multiply where a sample is one row (an outer product: bmm with a contracted
// size of 1 runs a general matrix product per sample). linear_weight_grad has no derivative: where grad mode is on
// (create_graph, something differentiates the backward again) aten's mm runs instead.
//
// NOTE: a weight used by several calls (a recurrence: opacus's DPLSTM applies its gate layers at every time step).
// Autograd sums the gradients a tensor gets from several nodes, and out of place under torch.func: the engine adds in
// place only into tensors that are not "subclass-like", and functorch's wrappers are. Under vmap(grad) a weight used
// at T steps got T per-sample gradients (B, out, in) and T - 1 sums of them (half of the DPLSTM's step at batch 64).
// So the weight's gradient is formed by one node per weight and graph (WeightGradient below): every call's node
// hands it the call's output gradient, and it forms the weight's gradient once from all the calls' rows, one
// product per sample over the T steps. The engine runs it after every node that feeds it (its dependencies), and a
// call whose node did not run (not on the path of this backward) gives no rows.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/functorch/BatchedTensorImpl.h>
#include <ATen/functorch/DynamicLayer.h>
#include <ATen/functorch/TensorWrapper.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/library.h>

#include "functorch_levels.h"

#include <algorithm>
#include <cstdint>
#include <functional>
#include <iterator>
#include <numeric>
#include <tuple>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#endif

namespace multicomposite_pool {
at::Tensor empty(at::IntArrayRef sizes, const at::TensorOptions& options);  // output_pool.cpp
bool streams(int64_t bytes);  // output_pool.cpp: whether a write of `bytes` takes streaming stores
}

namespace {

using at::Tensor;
using multicomposite_functorch::BelowLevels;
using multicomposite_functorch::batch_first;
using multicomposite_functorch::batched_at;
using multicomposite_functorch::plain;
using torch::autograd::variable_list;

bool present(const std::optional<Tensor>& t) { return t.has_value() && t->defined(); }



Tensor linear_aten(const Tensor& input, const Tensor& weight, const std::optional<Tensor>& bias) {
  return at::linear(input, weight, bias);
}

const c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, const std::optional<Tensor>&)>& linear_op() {
  static const auto handle = c10::Dispatcher::singleton()
                                 .findSchemaOrThrow("multicomposite::linear", "")
                                 .typed<Tensor(const Tensor&, const Tensor&, const std::optional<Tensor>&)>();
  return handle;
}

// The number of rows of `t` taken as (rows, t.size(-1)): every dimension but the last (one for a 1-d input). The
// size is spelled out: an empty input has no -1 to infer.
int64_t rows_of(const Tensor& t) {
  int64_t rows = 1;
  for (int64_t d = 0; d + 1 < t.dim(); ++d) rows *= t.size(d);
  return rows;
}

void check_shapes(const Tensor& input, const Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && input.dim() >= 1,
              "multicomposite::linear takes a 2-d weight and an input of at least one dimension (got weight of ",
              weight.dim(), " and input of ", input.dim(), " dimensions); call torch.nn.functional.linear for others");
}

// Every row's output gradient times its input, summed over the rows: (out, rows) x (rows, in).
Tensor weight_grad_aten(const Tensor& grad, const Tensor& input) {
  const int64_t rows = rows_of(input);
  return at::mm(grad.reshape({rows, grad.size(-1)}).t(), input.reshape({rows, input.size(-1)}));
}

const c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&)>& weight_grad_op() {
  static const auto handle = c10::Dispatcher::singleton()
                                 .findSchemaOrThrow("multicomposite::linear_weight_grad", "")
                                 .typed<Tensor(const Tensor&, const Tensor&)>();
  return handle;
}

// NOTE: one-row samples' outer products with streaming stores (output_pool.cpp's NOTE). A per-sample weight gradient
// of a one-row sample is out[b, o, :] = g[b, o] * x[b, :]: B * out rows written once and not read back within the
// step. Written with ordinary stores (TensorIterator's broadcasting mul) each line of the output is first read into
// the cache and the cache then written back, about 17 GB/s on one core: 1.0 ms of the 128-256-256-10 MLP's 2.7 ms
// step at batch 64 was the 16.7 MB product, against 0.37 ms for the same multiply in a loop whose output stays in the
// cache. Streamed in float32 where multicomposite_pool::streams says so; the values are the same multiplies, bit for
// bit.
#if defined(__GNUC__) && defined(__x86_64__)
__attribute__((target("avx2"))) void stream_outer_rows(const float* g, const float* x, float* product,
                                                        int64_t begin, int64_t end, int64_t out, int64_t in) {
  for (int64_t row = begin; row < end; ++row) {  // row = b * out + o
    const float scale = g[row];
    const float* x_row = x + (row / out) * in;
    float* target = product + row * in;
    int64_t i = 0;
    for (; i < in && (reinterpret_cast<uintptr_t>(target + i) & 31) != 0; ++i) target[i] = scale * x_row[i];
    const __m256 scales = _mm256_set1_ps(scale);
    for (; i + 8 <= in; i += 8) _mm256_stream_ps(target + i, _mm256_mul_ps(scales, _mm256_loadu_ps(x_row + i)));
    for (; i < in; ++i) target[i] = scale * x_row[i];
  }
  _mm_sfence();  // the streamed lines are visible to every core before the product is used
}

#endif

// `product` (B, out, in) = each sample's g (B, out) times its x (B, in), as an outer product; g and x contiguous.
void outer_products(Tensor& product, const Tensor& g, const Tensor& x) {
#if defined(__GNUC__) && defined(__x86_64__)
  if (product.scalar_type() == at::kFloat && product.device().is_cpu() &&
      multicomposite_pool::streams(product.numel() * static_cast<int64_t>(sizeof(float)))) {
    const int64_t batch = product.size(0), out = product.size(1), in = product.size(2);
    const float* g_data = g.const_data_ptr<float>();
    const float* x_data = x.const_data_ptr<float>();
    float* target = product.mutable_data_ptr<float>();
    const int64_t grain = std::max<int64_t>(1, at::internal::GRAIN_SIZE / std::max<int64_t>(in, 1));
    at::parallel_for(0, batch * out, grain, [&](int64_t begin, int64_t end) {
      stream_outer_rows(g_data, x_data, target, begin, end, out, in);
    });
    return;
  }
#endif
  at::mul_out(product, g.unsqueeze(2), x.unsqueeze(1));
}

// Called only where grad mode is off (LinearBackward's NOTE): nothing records, so there is no node to make.
Tensor weight_grad_autograd(const Tensor& grad, const Tensor& input) {
  TORCH_CHECK(!(at::GradMode::is_enabled() && torch::autograd::compute_requires_grad(grad, input)),
              "multicomposite::linear_weight_grad has no derivative; differentiate aten::mm instead");
  at::AutoDispatchBelowADInplaceOrView below;
  return weight_grad_op().call(grad, input);
}

// Under vmap with either batched at this level (per-sample weight gradients): each sample's (out, rows) x (rows, in)
// as one bmm, or where a sample is one row, each sample's outer product as one broadcasting multiply. A side not
// batched is shared by the samples (an LSTM's initial hidden state, zeros; a loss linear in the output): the same rows
// for every sample. aten's mm there multiplies (B * out, 1) x (1, in) with a contracted size of 1: 0.44 ms of the
// DPLSTM's 5.9 ms step at batch 16 was that product for the first step's zero hidden state (profiled).
Tensor weight_grad_batched(const Tensor& grad, const Tensor& input) {
  const auto layer = at::functorch::maybeCurrentDynamicLayer();
  TORCH_INTERNAL_ASSERT(layer.has_value(), "multicomposite::linear_weight_grad's batching rule ran outside vmap");
  const int64_t level = layer->layerId();
  const auto* grad_batched = batched_at(grad, level);
  const auto* input_batched = batched_at(input, level);
  if ((grad_batched == nullptr && input_batched == nullptr) || grad.scalar_type() != input.scalar_type()) {
    return weight_grad_aten(grad, input);
  }
  const int64_t rows = rows_of(input), out = grad.size(-1), in = input.size(-1);
  c10::impl::ExcludeDispatchKeyGuard guard(c10::DispatchKey::FuncTorchBatched);
  const int64_t batch = grad_batched != nullptr ? grad_batched->value().size(grad_batched->bdim())
                                                : input_batched->value().size(input_batched->bdim());
  const auto sample_rows = [&](const at::functorch::BatchedTensorImpl* batched, const Tensor& t, int64_t width) {
    return batched != nullptr ? batch_first(*batched).reshape({batch, rows, width})
                              : t.reshape({1, rows, width}).expand({batch, rows, width});
  };
  const Tensor g_rows = sample_rows(grad_batched, grad, out), x_rows = sample_rows(input_batched, input, in);
  if (!plain(g_rows) || !plain(x_rows)) {
    // Still batched at an outer vmap level (vmap(vmap(grad))) or wrapped by an outer grad: out-of-place ops, which
    // each level batches (an out= write into an ordinary tensor cannot take them).
    const Tensor product = rows == 1 ? g_rows.transpose(1, 2).contiguous() * x_rows.contiguous()
                                     : at::bmm(g_rows.transpose(1, 2), x_rows);
    return at::functorch::makeBatched(product, 0, level);
  }
  // NOTE: one-row samples multiply contiguous operands. The batch often is not the outermost dimension in memory
  // here (the output gradient comes out of movedim), and TensorIterator then orders the broadcast's loops by the
  // operands' strides: the (B, out, in) product ran 10x slower than over contiguous copies of the two small operands
  // (3.7 ms against 0.37 ms at 64 x 256 x 256).
  // The product is written into the output pool's memory (output_pool.cpp: kept mapped from one step to the next).
  const BelowLevels below(true);  // both operands ordinary (above)
  Tensor product = multicomposite_pool::empty({batch, out, in}, g_rows.options());
  if (rows == 1) {
    outer_products(product, g_rows.reshape({batch, out}).contiguous(), x_rows.reshape({batch, in}).contiguous());
  } else {
    at::bmm_out(product, g_rows.transpose(1, 2), x_rows);
  }
  return at::functorch::makeBatched(product, 0, level);
}

// `t` as (rows, t.size(-1)); as it is where it is that already (a reshape is a dispatched call at every level).
Tensor as_rows(const Tensor& t) { return t.dim() == 2 ? t : t.reshape({rows_of(t), t.size(-1)}); }

// The weight's gradient from the output gradient's rows and the input's: linear_weight_grad, or aten's mm where
// grad mode is on (the NOTE above).
Tensor weight_grad(const Tensor& grad, const Tensor& input) {
  return at::GradMode::is_enabled() ? weight_grad_aten(grad, input) : weight_grad_op().call(grad, input);
}

// The weight's gradient over every call of the op that uses it in one graph (the NOTE above): input k is call k's
// output gradient, and call k's input is kept here (the call's own node does not need it).
struct WeightGradient : public torch::autograd::Node {
  std::vector<torch::autograd::SavedVariable> inputs;
  std::vector<size_t> consumed;  // the inputs the last run read: what release_variables may free

  variable_list apply(variable_list&& grads) override {
    std::vector<Tensor> grad_rows, input_rows;
    consumed.clear();
    for (size_t k = 0; k < grads.size(); ++k) {
      if (!grads[k].defined()) continue;
      consumed.push_back(k);
      grad_rows.push_back(grads[k]);
      input_rows.push_back(inputs[k].unpack());
    }
    if (grad_rows.empty()) return {Tensor()};
    if (grad_rows.size() == 1) return {weight_grad(grad_rows[0], input_rows[0])};  // one call: its rows as they are
    for (size_t k = 0; k < grad_rows.size(); ++k) {  // every call's rows, (rows, out) and (rows, in), one after another
      grad_rows[k] = as_rows(grad_rows[k]);
      input_rows[k] = as_rows(input_rows[k]);
    }
    return {weight_grad(at::cat(grad_rows, 0), at::cat(input_rows, 0))};
  }
  std::string name() const override { return "multicomposite::LinearWeightGradient"; }
  // Only the calls this run read: a call of another graph that shares this node (the same weight, a graph not yet
  // differentiated) keeps its input for that graph's backward.
  void release_variables() override {
    for (size_t k : consumed) inputs[k].reset_data();
  }
};

// The weight gradient nodes of this thread's graphs, by the edge they feed (the weight's own gradient edge): a call
// whose weight has a live node joins it. A node lives as long as the graph that holds it; an entry whose node is gone
// is replaced.
struct EdgeKey {
  const torch::autograd::Node* function;
  uint32_t input_nr;
  bool operator==(const EdgeKey& other) const { return function == other.function && input_nr == other.input_nr; }
};
struct EdgeKeyHash {
  size_t operator()(const EdgeKey& key) const noexcept {
    return std::hash<const void*>()(key.function) ^ (static_cast<size_t>(key.input_nr) << 1);
  }
};
thread_local std::unordered_map<EdgeKey, c10::weak_intrusive_ptr<WeightGradient>, EdgeKeyHash> weight_gradients;

// The weight gradient node that `edge` (a weight's gradient edge) gets its gradient from in this graph, made where
// there is none.
c10::intrusive_ptr<WeightGradient> weight_gradient_for(const torch::autograd::Edge& edge) {
  const EdgeKey key{edge.function.get(), edge.input_nr};
  auto found = weight_gradients.find(key);
  if (found != weight_gradients.end()) {
    if (auto live = found->second.lock()) return live;  // alive: it holds the edge, so the key is that edge still
  }
  if (weight_gradients.size() >= 4096) {  // forget the nodes that are gone
    for (auto it = weight_gradients.begin(); it != weight_gradients.end();) {
      it = it->second.expired() ? weight_gradients.erase(it) : std::next(it);
    }
  }
  auto made = c10::make_intrusive<WeightGradient>();
  made->set_next_edges({edge});
  weight_gradients.insert_or_assign(key, c10::weak_intrusive_ptr<WeightGradient>(made));
  return made;
}

// PyTorch's linear of ordinary `rows` (a batch in front) and `weight`, the batch folded into the rows.
// NOTE: a batch that is not outermost in memory (vmap over a later dimension) leaves `rows` a permuted view, and
// PyTorch's linear then multiplies it as a bmm of one-row products against the expanded weight. Its rows copied
// into one (rows, in) matrix make it one addmm.
Tensor linear_rows(const Tensor& rows, const Tensor& weight, const std::optional<Tensor>& bias) {
  if (rows.dim() <= 2 || rows.is_contiguous()) return at::linear(rows, weight, bias);
  std::vector<int64_t> sizes = rows.sizes().vec();
  sizes.back() = weight.size(0);
  return at::linear(rows.reshape({-1, rows.size(-1)}), weight, bias).view(sizes);
}

// --- the first-order backward's input and bias gradients in one op ---------------------------------------------
//
// NOTE: where nothing records the backward (grad mode off: first-order grad, or eager autograd without
// create_graph), LinearBackward's input gradient (the output gradient's rows times the weight) and bias gradient
// (the output gradient summed to the bias's shape) are one call of multicomposite::linear_backward. Through
// vmap(grad) every dispatched call crosses both levels (each a TensorWrapper and a BatchedTensor made and unwrapped,
// about 2.5 us for a view); the separate calls were three a layer (the weight's t, this op's linear, the bias's
// reshape), and a recurrence (opacus's DPLSTM: two gate layers at each of 16 steps) makes them at every step. Under
// vmap the rule runs them on the physical tensors under the last level (NOTE [kernels under the last level]).

// The bias's gradient from the output gradient: its values where it holds exactly the bias's elements (one row: a
// reshape is a view where sum_to_size sums over size-1 dimensions, 15-24 us a call under vmap(grad), profiled on the
// MLP of bench.models at batch 4), its sum to the bias's shape elsewhere.
Tensor bias_grad(const Tensor& grad, at::IntArrayRef bias_sizes) {
  return grad.sym_numel() == static_cast<int64_t>(c10::multiply_integers(bias_sizes)) ? grad.reshape(bias_sizes)
                                                                                        : grad.sum_to_size(bias_sizes);
}

std::tuple<Tensor, Tensor> linear_backward_aten(const Tensor& grad, const Tensor& weight, bool input_grad,
                                                at::OptionalIntArrayRef bias_sizes) {
  return {input_grad ? at::linear(grad, weight.t()) : Tensor(),
          bias_sizes.has_value() ? bias_grad(grad, *bias_sizes) : Tensor()};
}

const c10::TypedOperatorHandle<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, bool, at::OptionalIntArrayRef)>&
linear_backward_op() {
  static const auto handle =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("multicomposite::linear_backward", "")
          .typed<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, bool, at::OptionalIntArrayRef)>();
  return handle;
}

// Called only where grad mode is off (the NOTE above): nothing records, so there is no node to make.
std::tuple<Tensor, Tensor> linear_backward_autograd(const Tensor& grad, const Tensor& weight, bool input_grad,
                                                    at::OptionalIntArrayRef bias_sizes) {
  TORCH_CHECK(!(at::GradMode::is_enabled() && torch::autograd::compute_requires_grad(grad, weight)),
              "multicomposite::linear_backward has no derivative; differentiate multicomposite::linear's backward "
              "with grad mode on instead");
  at::AutoDispatchBelowADInplaceOrView below;
  return linear_backward_op().call(grad, weight, input_grad, bias_sizes);
}

// Under vmap with the output gradient batched at this level and the weight not (per-sample gradients): the rows of
// every sample times the weight in one product, and each sample's bias gradient from its rows (a view where a sample
// is one row). Elsewhere (an ensemble's batched weight, a bias of another shape than (out)) aten's ops on the batched
// tensors, as LinearBackward ran them before this op.
std::tuple<Tensor, Tensor> linear_backward_batched(const Tensor& grad, const Tensor& weight, bool input_grad,
                                                   at::OptionalIntArrayRef bias_sizes) {
  const auto layer = at::functorch::maybeCurrentDynamicLayer();
  TORCH_INTERNAL_ASSERT(layer.has_value(), "multicomposite::linear_backward's batching rule ran outside vmap");
  const int64_t level = layer->layerId();
  const auto* batched = batched_at(grad, level);
  const bool bias_is_rows =
      !bias_sizes.has_value() || (bias_sizes->size() == 1 && (*bias_sizes)[0] == grad.size(-1));
  if (batched == nullptr || batched_at(weight, level) != nullptr || !bias_is_rows) {
    return linear_backward_aten(grad, weight, input_grad, bias_sizes);
  }
  c10::impl::ExcludeDispatchKeyGuard guard(c10::DispatchKey::FuncTorchBatched);
  const Tensor rows = batch_first(*batched);  // (batch, ..., out)
  const BelowLevels below(plain(rows) && plain(weight));
  Tensor grad_input, grad_bias;
  if (input_grad) grad_input = at::functorch::makeBatched(linear_rows(rows, weight.t(), std::nullopt), 0, level);
  if (bias_sizes.has_value()) {
    // Each sample's rows summed (sum_to_size's reduction, per sample); a sample of one row is its own gradient.
    const int64_t batch = rows.size(0), out = rows.size(-1);
    if (rows.dim() == 2) {
      grad_bias = rows;
    } else if (rows.numel() == batch * out) {
      grad_bias = rows.reshape({batch, out});
    } else {
      std::vector<int64_t> dims(rows.dim() - 2);
      std::iota(dims.begin(), dims.end(), 1);
      grad_bias = rows.sum(dims);
    }
    grad_bias = at::functorch::makeBatched(grad_bias, 0, level);
  }
  return {grad_input, grad_bias};
}

Tensor tangent_of(const Tensor& t) { return t._fw_grad(/*level=*/0); }

struct LinearBackward : public torch::autograd::Node {
  torch::autograd::SavedVariable weight;
  std::vector<int64_t> bias_sizes;
  bool has_bias = false;

  variable_list apply(variable_list&& grads) override {
    const Tensor& grad = grads[0];
    const bool want_input = task_should_compute_output(0);
    const bool want_weight = task_should_compute_output(1);
    const bool want_bias = has_bias && task_should_compute_output(2);
    if (!grad.defined() || !(want_input || want_weight || want_bias)) return {Tensor(), Tensor(), Tensor()};
    Tensor grad_input, grad_weight, grad_bias;
    const Tensor w = weight.unpack();
    if (want_weight) grad_weight = grad;  // to the weight's WeightGradient node, which forms the gradient
    if (!want_input && !want_bias) return {grad_input, grad_weight, grad_bias};
    if (!at::GradMode::is_enabled() && !tangent_of(grad).defined() && !tangent_of(w).defined()) {
      // Nothing records: one call (the NOTE above linear_backward_aten).
      std::tie(grad_input, grad_bias) = linear_backward_op().call(
          grad, w, want_input, want_bias ? at::OptionalIntArrayRef(bias_sizes) : at::OptionalIntArrayRef());
      return {grad_input, grad_weight, grad_bias};
    }
    // The output gradient's rows times the weight: this op again (one node where autograd records, one folded call
    // under vmap).
    if (want_input) grad_input = linear_op().call(grad, w.t(), std::nullopt);
    if (want_bias) grad_bias = bias_grad(grad, bias_sizes);
    return {grad_input, grad_weight, grad_bias};
  }
  std::string name() const override { return "multicomposite::LinearBackward"; }
  void release_variables() override { weight.reset_data(); }
};

// The forward-AD tangent of linear(x, w, b): linear(dx, w) + linear(x, dw) + db, in aten ops (so that it batches and
// differentiates as they do), from the primals (a tangent computed from a tensor that has one would carry one itself).
void set_tangent(const Tensor& out, const Tensor& input, const Tensor& weight, const std::optional<Tensor>& bias,
                 const Tensor& dx, const Tensor& dw, const Tensor& db) {
  const Tensor x = input._fw_primal(/*level=*/0), w = weight._fw_primal(/*level=*/0);
  Tensor tangent;
  if (dx.defined()) tangent = at::linear(dx, w);
  if (dw.defined()) {
    const Tensor term = at::linear(x, dw);
    tangent = tangent.defined() ? tangent + term : term;
  }
  if (db.defined()) tangent = tangent.defined() ? tangent + db : db;
  out._set_fw_grad(tangent.expand(out.sizes()).contiguous(), /*level=*/0, false);
}

Tensor linear_autograd(const Tensor& input, const Tensor& weight, const std::optional<Tensor>& bias) {
  check_shapes(input, weight);
  c10::intrusive_ptr<LinearBackward> node;
  if (torch::autograd::compute_requires_grad(input, weight, bias)) {
    node = c10::make_intrusive<LinearBackward>();
    node->set_next_edges(torch::autograd::collect_next_edges(input, weight, bias));
    node->has_bias = present(bias);
    if (node->has_bias) node->bias_sizes = bias->sizes().vec();
  }
  Tensor out;
  {
    at::AutoDispatchBelowADInplaceOrView below;
    out = linear_op().call(input, weight, bias);
  }
  if (node) {
    node->weight = torch::autograd::SavedVariable(weight, /*is_output=*/false);
    const torch::autograd::Edge& weight_edge = node->next_edge(1);
    if (weight_edge.is_valid()) {  // the weight's gradient goes through its WeightGradient node (the NOTE above)
      auto gradient = weight_gradient_for(weight_edge);
      const uint32_t slot = gradient->add_input_metadata(out);
      gradient->inputs.emplace_back(input, /*is_output=*/false);
      node->set_next_edge(1, torch::autograd::Edge(std::move(gradient), slot));
    }
    torch::autograd::set_history(out, node);
  }
  const Tensor dx = tangent_of(input), dw = tangent_of(weight), db = present(bias) ? tangent_of(*bias) : Tensor();
  if (dx.defined() || dw.defined() || db.defined()) set_tangent(out, input, weight, bias, dx, dw, db);
  return out;
}

// Under vmap: where the input alone is batched at this level, its batch dimension goes in front and PyTorch's linear
// runs once on the physical tensor (the batch is more rows); elsewhere aten's linear on the batched tensors, whose
// decomposition batches as it does without this op.
Tensor linear_batched(const Tensor& input, const Tensor& weight, const std::optional<Tensor>& bias) {
  const auto layer = at::functorch::maybeCurrentDynamicLayer();
  TORCH_INTERNAL_ASSERT(layer.has_value(), "multicomposite::linear's batching rule ran outside vmap");
  const int64_t level = layer->layerId();
  const auto* batched = batched_at(input, level);
  if (batched == nullptr || batched_at(weight, level) != nullptr || (present(bias) && batched_at(*bias, level))) {
    return at::linear(input, weight, bias);
  }
  c10::impl::ExcludeDispatchKeyGuard guard(c10::DispatchKey::FuncTorchBatched);
  const BelowLevels below(plain(batched->value()) && plain(weight) && (!present(bias) || plain(*bias)));
  return at::functorch::makeBatched(linear_rows(batch_first(*batched), weight, bias), 0, level);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(multicomposite, m) {
  m.def("linear(Tensor input, Tensor weight, Tensor? bias) -> Tensor");
  // The weight gradient of linear: grad (..., out) and input (..., in) over the same rows -> (out, in).
  m.def("linear_weight_grad(Tensor grad, Tensor input) -> Tensor");
  // The input's gradient (where input_grad) and the bias's (where bias_sizes) of linear from the output gradient,
  // where nothing records the backward; an output not asked for is undefined.
  m.def("linear_backward(Tensor grad, Tensor weight, bool input_grad, int[]? bias_sizes) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(multicomposite, CompositeExplicitAutograd, m) {
  m.impl("linear", linear_aten);
  m.impl("linear_weight_grad", weight_grad_aten);
  m.impl("linear_backward", linear_backward_aten);
}

TORCH_LIBRARY_IMPL(multicomposite, Autograd, m) {
  m.impl("linear", linear_autograd);
  m.impl("linear_weight_grad", weight_grad_autograd);
  m.impl("linear_backward", linear_backward_autograd);
}

TORCH_LIBRARY_IMPL(multicomposite, FuncTorchBatched, m) {
  m.impl("linear", linear_batched);
  m.impl("linear_weight_grad", weight_grad_batched);
  m.impl("linear_backward", linear_backward_batched);
}
