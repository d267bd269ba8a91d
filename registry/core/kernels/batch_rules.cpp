// Batching rules in C++ over functorch's slower ones, inside use() only (registry/core/batch_rules.py registers them):
//
// - nll_loss_forward and nll_loss_backward, what every classifier's cross_entropy reaches under vmap(grad). functorch
//   registers torch._decomp's Python decompositions of these at FuncTorchBatched
//   (torch/_functorch/predispatch.py, lazy_load_decompositions): about ten aten ops from Python a call, forward and
//   backward. The loss is a function of each row, so a batch of B samples of N rows is one call on B * N rows with
//   reduction "none", reduced per sample afterwards. Autograd, forward AD and the double backward stay aten's own
//   (NllLossBackward0 and its derivatives call these ops again, which reach the rule again at their vmap level).
// - native_group_norm and native_group_norm_backward: functorch's rules normalize without the affine parameters and
//   apply them as two more batched passes, and form the backward's weight gradient from whole batched temporaries.
//   Group norm is per sample, so the batch folds into N: PyTorch's kernel once (the affine parameters inside it),
//   each sample's weight and bias gradients from two per-channel sums.
// - convolution_backward, under per-sample gradients of a 2-d convolution with few input channels (an image model's
//   first layer): functorch's rule forms the B weight gradients as one grouped convolution_backward (groups = B, each
//   group as wide as the input), slow where that width is small; the rule runs one convolution with the input's
//   channels and the batch swapped instead.
// - _scaled_dot_product_flash_attention_for_cpu and its _backward (F.scaled_dot_product_attention on 4-d CPU
//   inputs): functorch has no rule for either, so vmap loops over the samples; attention is per (n, head), so the
//   batch folds into N and each is one call.
// - index.Tensor and index_put (x[index] and its backward) with one integer index batched with the tensor: one
//   gather_rows and one add_rows over the folded rows (the rows section below; rows.cpp's NOTE [rows ops]).
//
// Each rule decides on the logical shapes before anything dispatches and runs the kernel it overrides where its fold
// does not hold (nothing batched at this level, a batched weight, shapes or dtypes the kernel refuses, an empty
// input), and under use(policy="native"). The kernels go into the
// C++ routing's Library (routing.cpp's register_batch_rules): they are destroyed with it (uninstall, a switch to the
// Python backend), and what they override is then PyTorch's again. Outside use() they run the kernel they override
// (captured when registered), so PyTorch's results outside use() are unchanged.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/functorch/BatchedTensorImpl.h>
#include <ATen/functorch/DynamicLayer.h>
#include <ATen/functorch/TensorWrapper.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include "functorch_levels.h"

#include <algorithm>
#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <vector>

bool batch_rules_apply();  // routing.cpp: inside use() under a policy other than "native"

namespace multicomposite_rows {  // rows.cpp
at::Tensor folded_rows(const at::Tensor& index, int64_t rows, int64_t batch, bool indexing);
bool readable(const at::Tensor& t);  // includes: on the CPU
bool integral_index(const at::Tensor& index);
const c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&)>& gather_rows_op();
const c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&)>& add_rows_op();
}

namespace multicomposite_functorch {
// Whether `t` is an ordinary tensor: not batched at any vmap level, not wrapped by a grad or jvp level (an outer
// vmap's operand, a hessian's weight differentiated at a level below this one). PyTorch's kernels must not see such
// a tensor beside ordinary ones, an out= or in-place write into an ordinary tensor cannot take one, and it has no
// data to read. linear.cpp's rule checks the same.
bool plain(const at::Tensor& t) {
  return at::functorch::maybeGetBatchedImpl(t) == nullptr && at::functorch::maybeGetTensorWrapper(t) == nullptr;
}

// NOTE [kernels under the last level]: a batching rule runs inside functorch's vmap interpreter, which excludes from
// the thread's dispatch keys everything between functorch's front and back keys (autograd, autocast, ADInplaceOrView,
// the conjugate bit...). Every op the rule calls (its kernel, and every op that kernel calls: at::zeros, empty,
// transposes) then goes through functorch's DynamicLayerBackMode fallback, which restores the keys saved when the
// call entered the level, pops the level, re-dispatches, and pushes the level back (DynamicLayer.cpp's
// dynamicLayerBackFallback). Where this vmap level is the only one on the stack (the levels above it have handed the
// call down: vmap's, and vmap(grad)'s outer level) and every tensor the rule hands on is ordinary (not batched, not
// wrapped), the rule does that once around its kernels instead of once per op: the same keys, the same empty stack,
// so each op runs as it would have after the fallback (eager autograd records what it would have recorded, autocast
// casts what it would have cast). Measured: the CPU flash attention backward's three 32 KB at::zeros took 14-17 us
// each inside the rule, against 1-2 us outside; 30 us of a 0.41 ms vmap(grad) of one attention. Anywhere else (a
// level below, an operand batched or wrapped) nothing changes. Declared in functorch_levels.h, which every kernel
// file with batching rules includes.

// Off: each op a rule calls goes through functorch's back fallback (bench.below_levels' baseline).
std::atomic<bool> below_levels_enabled{true};

BelowLevels::BelowLevels(bool operands_plain) {
  const auto& layers = at::functorch::getDynamicLayerStack();
  if (operands_plain && layers.size() == 1 && below_levels_enabled.load(std::memory_order_relaxed)) {
    keys_.emplace(layers.back().interpreter().getSavedLocalDispatchKeySet());
    level_.emplace(at::functorch::popDynamicLayer());  // the last level: also takes functorch's keys out
  }
}

BelowLevels::~BelowLevels() {
  if (level_.has_value()) {
    at::functorch::pushDynamicLayer(std::move(*level_));
  }
}
}  // namespace multicomposite_functorch

namespace multicomposite_pool {
at::Tensor empty(at::IntArrayRef sizes, const at::TensorOptions& options);  // output_pool.cpp
void zero(at::Tensor& t);  // output_pool.cpp: zero_(), with streaming stores for large blocks
}

namespace {

// Off: every rule runs the kernel it overrides, inside use() too (bench.batch_rules times both ways in one process).
std::atomic<bool> rules_enabled{true};

bool rules_apply() { return batch_rules_apply() && rules_enabled.load(std::memory_order_relaxed); }

using at::Tensor;
using multicomposite_functorch::BelowLevels;
using multicomposite_functorch::plain;

constexpr int64_t kNone = 0, kMean = 1, kSum = 2;  // at::Reduction

struct Physical {
  Tensor value;  // batch dimension first where batched; as is where not
  bool batched = false;
};

// `t`'s batched implementation at `level`, or null where `t` is not batched there.
const at::functorch::BatchedTensorImpl* batched_impl_at(const Tensor& t, int64_t level) {
  const auto* batched = at::functorch::maybeGetBatchedImpl(t);
  return batched != nullptr && batched->level() == level ? batched : nullptr;
}

Physical unwrap(const Tensor& t, int64_t level) {
  if (const auto* batched = batched_impl_at(t, level)) {
    // movedim is two dispatched calls even where the batch is already in front (as linear.cpp's batch_first)
    const int64_t bdim = batched->bdim();
    return {bdim == 0 ? batched->value() : batched->value().movedim(bdim, 0), true};
  }
  return {t, false};
}

// `p` with the batch dimension in front: batched as is, unbatched expanded to (batch, ...).
Tensor with_batch(const Physical& p, int64_t batch) {
  if (p.batched) {
    return p.value;
  }
  std::vector<int64_t> shape{batch};
  shape.insert(shape.end(), p.value.sizes().begin(), p.value.sizes().end());
  return p.value.expand(shape);
}

int64_t current_level() {
  const auto layer = at::functorch::maybeCurrentDynamicLayer();
  return layer.has_value() ? layer->layerId() : -1;
}

bool batched_at(const Tensor& t, int64_t level) { return batched_impl_at(t, level) != nullptr; }

bool batched_at(const std::optional<Tensor>& t, int64_t level) { return t.has_value() && batched_at(*t, level); }

bool present(const std::optional<Tensor>& t) { return t.has_value() && t->defined(); }

// Whether `t`'s physical value at `level` (its value where batched there, itself where not) is an ordinary tensor.
// Checked before a rule excludes FuncTorchBatched: a rule that declines runs the kernel it overrides as it was
// called, and functorch's own rule must see the Batched key of the levels below.
bool plain_at(const Tensor& t, int64_t level) {
  const auto* batched = batched_impl_at(t, level);
  return plain(batched != nullptr ? batched->value() : t);
}

// Whether every tensor among the op's arguments on `stack` is, at `level`, ordinary once unbatched (plain_at).
bool arguments_plain(const c10::OperatorHandle& op, const torch::jit::Stack& stack, int64_t level) {
  const size_t count = op.schema().arguments().size();
  for (size_t i = stack.size() - count; i < stack.size(); ++i) {
    const c10::IValue& argument = stack[i];
    if (argument.isTensor() && !plain_at(argument.toTensor(), level)) {
      return false;
    }
  }
  return true;
}

// Whether `t` holds no element, its batch dimension at `level` counted (vmap over 0 samples included): an empty
// call runs the kernel a rule overrides, whatever it does with it.
bool empty_at(const Tensor& t, int64_t level) {
  const auto* batched = batched_impl_at(t, level);
  return (batched != nullptr ? batched->value() : t).numel() == 0;
}

// The logical shapes the fold takes: self (N, C) with target (N,), or self (C,) with target (): nll_loss_forward's.
bool foldable(int64_t self_rank, int64_t target_rank) {
  return (self_rank == 2 && target_rank == 1) || (self_rank == 1 && target_rank == 0);
}

// What the fold hands PyTorch's kernel and the decomposition it overrides takes alike: a Long target (the
// decomposition gathers with any integer index, the kernel takes Long or Byte only) and a weight of one entry per
// class (the decomposition's check raises its own error). Anything else runs the decomposition, as outside use().
bool as_kernel_takes(const Tensor& self, const Tensor& target, const std::optional<Tensor>& weight) {
  return target.scalar_type() == at::kLong &&
         (!present(weight) || weight->numel() == self.size(-1));
}

// An int or SymInt argument as an int (the schemas' SymInts are concrete here: no tracing reaches these rules).
int64_t int_of(const c10::IValue& value) {
  return value.isInt() ? value.toInt() : value.toSymInt().guard_int(__FILE__, __LINE__);
}

// Rows of one sample: (N, C) -> N rows; (C,) -> one row. nll_loss_forward takes 1-d or 2-d inputs only.
struct Rows {
  int64_t batch;
  int64_t rows;       // per sample
  bool one_row;       // the logical input is 1-d: (C,), target ()
  Tensor self_rows;   // (batch * rows, C)
  Tensor target_rows;  // (batch * rows,)
};

// Physical self (B, N, C) or (B, C) and target (B, N) or (B,): their logical shapes passed `foldable`.
Rows fold(const Physical& self, const Physical& target) {
  const int64_t batch = self.batched ? self.value.size(0) : target.value.size(0);
  const Tensor s = with_batch(self, batch), t = with_batch(target, batch);
  const bool one_row = s.dim() == 2;
  const int64_t rows = one_row ? 1 : s.size(1);
  return Rows{batch, rows, one_row, s.reshape({batch * rows, s.size(-1)}), t.reshape({batch * rows})};
}

// Without class weights, on the CPU in float or double with int64 targets: each sample's sum of its rows' losses
// (divided by its count of kept targets where `mean`) and that count, in one pass over the rows. The same through
// batched ops (below) is ne, to, two sums and a div: about 25 us of the MLP's 0.6 ms per-sample step at batch 4,
// profiled, for four numbers.
// Only on ordinary data nothing records: not wrapped by a level below (jacrev(vmap)), not differentiated by eager
// autograd or forward AD outside the transforms (those see the batched ops).
bool reduces_in_one_pass(const Tensor& per_row, const Tensor& target_rows, const std::optional<Tensor>& weight) {
  return !present(weight) && plain(per_row) && plain(target_rows) && !per_row.requires_grad() &&
         !per_row._fw_grad(/*level=*/0).defined() && per_row.device().is_cpu() && per_row.is_contiguous() &&
         (per_row.scalar_type() == at::kFloat || per_row.scalar_type() == at::kDouble) &&
         target_rows.scalar_type() == at::kLong && target_rows.dim() == 1;
}

std::pair<Tensor, Tensor> reduce_in_one_pass(const Tensor& per_row, const Tensor& target_rows, int64_t batch,
                                             int64_t rows, int64_t ignore_index, bool mean) {
  Tensor output = at::empty({batch}, per_row.options()), weights = at::empty({batch}, per_row.options());
  const int64_t* target = target_rows.const_data_ptr<int64_t>();
  const int64_t stride = target_rows.stride(0);
  AT_DISPATCH_FLOATING_TYPES(per_row.scalar_type(), "multicomposite_nll_reduce", [&] {
    const scalar_t* loss = per_row.const_data_ptr<scalar_t>();
    scalar_t* out = output.mutable_data_ptr<scalar_t>();
    scalar_t* kept = weights.mutable_data_ptr<scalar_t>();
    for (int64_t b = 0; b < batch; ++b) {
      scalar_t sum = 0, count = 0;
      for (int64_t r = b * rows; r < (b + 1) * rows; ++r) {
        sum += loss[r];  // an ignored row's loss is 0 (the kernel's)
        count += target[r * stride] != ignore_index ? scalar_t(1) : scalar_t(0);
      }
      out[b] = mean ? sum / count : sum;
      kept[b] = count;
    }
  });
  return {output, weights};
}

// The input gradient's physical shape: (B, C) for 1-d samples, (B, N, C) for 2-d ones.
std::vector<int64_t> grad_shape(const Rows& r) {
  std::vector<int64_t> shape{r.batch};
  if (!r.one_row) {
    shape.push_back(r.rows);
  }
  shape.push_back(r.self_rows.size(-1));
  return shape;
}

// nll_loss_backward of a reduced loss without class weights, on ordinary CPU data (reduces_in_one_pass' terms): the
// (B * N, C) gradient is zero but at each kept row's target, where it is minus the sample's output gradient (over
// its count of kept targets where `mean`), written in one pass. The batched ops it replaces (a div, reshape and
// expand, a zero scalar, the kernel) cost about 25 us of the MLP's per-sample step at batch 4, profiled. Undefined
// where it does not apply or a target is out of range (the kernel's path raises PyTorch's error).
Tensor scatter_in_one_pass(const Tensor& grad, const Tensor& total, const Rows& r, const std::optional<Tensor>& weight,
                           int64_t ignore_index, bool mean) {
  const Tensor& self_rows = r.self_rows;
  if (!reduces_in_one_pass(grad, r.target_rows, weight) || !plain(total) || !plain(self_rows) ||
      total.requires_grad() || grad.scalar_type() != self_rows.scalar_type() ||
      total.scalar_type() != self_rows.scalar_type() || grad.dim() != 1 || total.dim() != 1) {
    return Tensor();
  }
  const int64_t classes = self_rows.size(-1);
  const int64_t* target = r.target_rows.const_data_ptr<int64_t>();
  const int64_t target_stride = r.target_rows.stride(0);
  for (int64_t row = 0; row < r.batch * r.rows; ++row) {
    const int64_t t = target[row * target_stride];
    if (t != ignore_index && (t < 0 || t >= classes)) {
      return Tensor();
    }
  }
  Tensor out = at::zeros({r.batch * r.rows, classes}, self_rows.options());
  AT_DISPATCH_FLOATING_TYPES(out.scalar_type(), "multicomposite_nll_backward", [&] {
    const scalar_t* g = grad.const_data_ptr<scalar_t>();
    const scalar_t* w = total.const_data_ptr<scalar_t>();
    const int64_t g_stride = grad.stride(0), w_stride = total.stride(0);
    scalar_t* o = out.mutable_data_ptr<scalar_t>();
    for (int64_t b = 0; b < r.batch; ++b) {
      const scalar_t value = mean ? -g[b * g_stride] / w[b * w_stride] : -g[b * g_stride];
      for (int64_t row = b * r.rows; row < (b + 1) * r.rows; ++row) {
        const int64_t t = target[row * target_stride];
        if (t != ignore_index) o[row * classes + t] = value;
      }
    }
  });
  return out;
}

// Each sample's total weight: the weights of its rows' targets (1 each without weights), 0 where ignored.
Tensor total_weight(const Rows& r, const std::optional<Tensor>& weight, int64_t ignore_index, const Tensor& like) {
  const Tensor keep = r.target_rows.ne(ignore_index);
  Tensor per_row;
  if (present(weight)) {
    per_row = weight->index_select(0, at::where(keep, r.target_rows, 0)).mul(keep);
  } else {
    per_row = keep.to(like.scalar_type());
  }
  return per_row.view({r.batch, r.rows}).sum(1);
}

class BatchRule : public c10::OperatorKernel {
 public:
  explicit BatchRule(c10::SafeKernelFunction overridden) : overridden_(std::move(overridden)) {}

 protected:
  c10::SafeKernelFunction overridden_;  // what ran at FuncTorchBatched before: outside use(), and what we decline
};

// nll_loss_forward(Tensor self, Tensor target, Tensor? weight, int reduction, SymInt ignore_index) -> (Tensor, Tensor)
class NllLossForward final : public BatchRule {
 public:
  using BatchRule::BatchRule;

  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet keyset, torch::jit::Stack* stack) {
    if (!rules_apply()) {
      return overridden_.callBoxed(op, keyset, stack);
    }
    const size_t n = stack->size();
    const Tensor self = (*stack)[n - 5].toTensor(), target = (*stack)[n - 4].toTensor();
    const auto weight = (*stack)[n - 3].toOptional<Tensor>();
    const int64_t reduction = (*stack)[n - 2].toInt();
    const int64_t ignore_index = int_of((*stack)[n - 1]);
    const int64_t level = current_level();
    // Decided on the logical shapes before anything dispatches: what this rule declines runs the kernel it
    // overrides, as a batching rule (FuncTorchBatched not yet excluded).
    if (level < 0 || !(batched_at(self, level) || batched_at(target, level)) || batched_at(weight, level) ||
        reduction < kNone || reduction > kSum || !foldable(self.dim(), target.dim()) ||
        !as_kernel_takes(self, target, weight) || empty_at(self, level) || empty_at(target, level)) {
      return overridden_.callBoxed(op, keyset, stack);
    }
    c10::impl::ExcludeDispatchKeyGuard guard(c10::DispatchKey::FuncTorchBatched);
    const BelowLevels below(arguments_plain(op, *stack, level));
    const Physical s = unwrap(self, level), t = unwrap(target, level);
    const Rows r = fold(s, t);
    const Tensor per_row = std::get<0>(at::nll_loss_forward(r.self_rows, r.target_rows, weight, kNone, ignore_index));
    Tensor output, weights;
    if (reduction == kNone) {
      output = r.one_row ? per_row : per_row.view({r.batch, r.rows});
      // As the decomposition (and aten): a 2-d input's total weight is 0 without a reduction.
      weights = r.one_row ? total_weight(r, weight, ignore_index, r.self_rows) : at::zeros({}, r.self_rows.options());
    } else if (reduces_in_one_pass(per_row, r.target_rows, weight)) {
      std::tie(output, weights) =
          reduce_in_one_pass(per_row, r.target_rows, r.batch, r.rows, ignore_index, reduction == kMean);
    } else {
      weights = total_weight(r, weight, ignore_index, r.self_rows);
      output = per_row.view({r.batch, r.rows}).sum(1);
      if (reduction == kMean) {
        output = output.div(weights);
      }
    }
    torch::jit::drop(*stack, 5);
    torch::jit::push(*stack, at::functorch::makeBatched(output, 0, level),
                     weights.dim() == 0 ? weights : at::functorch::makeBatched(weights, 0, level));
  }
};

// nll_loss_backward(Tensor grad_output, Tensor self, Tensor target, Tensor? weight, int reduction,
//                   SymInt ignore_index, Tensor total_weight) -> Tensor
class NllLossBackward final : public BatchRule {
 public:
  using BatchRule::BatchRule;

  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet keyset, torch::jit::Stack* stack) {
    if (!rules_apply()) {
      return overridden_.callBoxed(op, keyset, stack);
    }
    const size_t n = stack->size();
    const Tensor grad = (*stack)[n - 7].toTensor(), self = (*stack)[n - 6].toTensor();
    const Tensor target = (*stack)[n - 5].toTensor();
    const auto weight = (*stack)[n - 4].toOptional<Tensor>();
    const int64_t reduction = (*stack)[n - 3].toInt();
    const int64_t ignore_index = int_of((*stack)[n - 2]);
    const Tensor total = (*stack)[n - 1].toTensor();
    const int64_t level = current_level();
    if (level < 0 ||
        !(batched_at(grad, level) || batched_at(self, level) || batched_at(target, level) ||
          batched_at(total, level)) ||
        batched_at(weight, level) || reduction < kNone || reduction > kSum || !foldable(self.dim(), target.dim()) ||
        !as_kernel_takes(self, target, weight) || empty_at(self, level) || empty_at(target, level)) {
      return overridden_.callBoxed(op, keyset, stack);
    }
    c10::impl::ExcludeDispatchKeyGuard guard(c10::DispatchKey::FuncTorchBatched);
    const BelowLevels below(arguments_plain(op, *stack, level));
    const Physical g = unwrap(grad, level), s = unwrap(self, level), t = unwrap(target, level);
    const Physical w = unwrap(total, level);
    const int64_t batch = g.batched ? g.value.size(0) : s.batched ? s.value.size(0) : t.batched ? t.value.size(0)
                                                                                           : w.value.size(0);
    const Rows r = fold({with_batch(s, batch), true}, {with_batch(t, batch), true});
    if (reduction != kNone) {
      const Tensor written = scatter_in_one_pass(with_batch(g, r.batch), with_batch(w, r.batch), r, weight,
                                                 ignore_index, reduction == kMean);
      if (written.defined()) {
        torch::jit::drop(*stack, 7);
        torch::jit::push(*stack, at::functorch::makeBatched(written.view(grad_shape(r)), 0, level));
        return;
      }
    }
    // Each row's output gradient: its own (no reduction), else its sample's, divided by the sample's total weight
    // for the mean (as aten's backward does, 0/0 included).
    Tensor per_row = with_batch(g, r.batch);
    if (reduction == kMean) {
      per_row = per_row.div(with_batch(w, r.batch));
    }
    per_row = reduction == kNone ? per_row.reshape({r.batch * r.rows})
                                 : per_row.reshape({r.batch, 1}).expand({r.batch, r.rows}).reshape({r.batch * r.rows});
    const Tensor grad_rows = at::nll_loss_backward(per_row, r.self_rows, r.target_rows, weight, kNone, ignore_index,
                                                   at::zeros({}, r.self_rows.options()));
    torch::jit::drop(*stack, 7);
    torch::jit::push(*stack, at::functorch::makeBatched(grad_rows.view(grad_shape(r)), 0, level));
  }
};

// --- group norm: the batch folded into the samples' N, the affine parameters inside PyTorch's kernel ---------------

// (B, N, C, *) -> (B * N, C, *)
Tensor fold_samples(const Tensor& t) {
  std::vector<int64_t> shape{t.size(0) * t.size(1)};
  shape.insert(shape.end(), t.sizes().begin() + 2, t.sizes().end());
  return t.reshape(shape);
}

// (B * N, ...) -> (B, N, ...)
Tensor unfold_samples(const Tensor& t, int64_t batch) {
  std::vector<int64_t> shape{batch, t.size(0) / batch};
  shape.insert(shape.end(), t.sizes().begin() + 1, t.sizes().end());
  return t.view(shape);
}

// ds[k, c] = sum over HxW of dy[k, c, :] * x[k, c, :]. On contiguous CPU float and double, one loop over the rows
// with no temporary: a product tensor of the input's size is fresh memory at every step (about 1 ms of page faults
// for 4 MiB here, more than the group norm's own backward kernel); elsewhere (other devices and dtypes, a tensor
// with functorch wrappers left) a product and a sum.
Tensor row_dots(const Tensor& dy, const Tensor& x) {
  // Storage: a tensor still batched at an outer vmap level (vmap(jacrev)) or wrapped by an outer grad has none.
  const bool loop = plain(dy) && plain(x) && dy.device().is_cpu() && dy.is_contiguous() &&
                    x.is_contiguous() &&
                    dy.scalar_type() == x.scalar_type() &&
                    (dy.scalar_type() == at::kFloat || dy.scalar_type() == at::kDouble);
  if (!loop) {
    return dy.mul(x).sum(-1);
  }
  const int64_t rows = dy.size(0) * dy.size(1), length = dy.size(2);
  Tensor out = at::empty({dy.size(0), dy.size(1)}, dy.options());
  AT_DISPATCH_FLOATING_TYPES(dy.scalar_type(), "multicomposite_row_dots", [&] {
    const scalar_t* a = dy.const_data_ptr<scalar_t>();
    const scalar_t* b = x.const_data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    const int64_t grain = std::max<int64_t>(1, at::internal::GRAIN_SIZE / std::max<int64_t>(length, 1));
    at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* pa = a + r * length;
        const scalar_t* pb = b + r * length;
        // Eight sums in double (wider than float, as PyTorch's CPU reductions of float accumulate): independent
        // chains, so the adds do not wait on each other (one chain is a serial dependence the compiler may not
        // reorder without -ffast-math).
        double sums[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        int64_t i = 0;
        for (; i + 8 <= length; i += 8) {
          for (int j = 0; j < 8; ++j) sums[j] += static_cast<double>(pa[i + j]) * static_cast<double>(pb[i + j]);
        }
        double sum = ((sums[0] + sums[1]) + (sums[2] + sums[3])) + ((sums[4] + sums[5]) + (sums[6] + sums[7]));
        for (; i < length; ++i) sum += static_cast<double>(pa[i]) * static_cast<double>(pb[i]);
        o[r] = static_cast<scalar_t>(sum);
      }
    });
  });
  return out;
}

// native_group_norm(Tensor input, Tensor? weight, Tensor? bias, SymInt N, SymInt C, SymInt HxW, int group,
//                   float eps) -> (Tensor, Tensor, Tensor)
// functorch's rule normalizes without the affine parameters and applies them after, as two more passes of batched
// ops; PyTorch's kernel applies them in its one pass, which is what runs here.
class GroupNorm final : public BatchRule {
 public:
  using BatchRule::BatchRule;

  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet keyset, torch::jit::Stack* stack) {
    if (!rules_apply()) {
      return overridden_.callBoxed(op, keyset, stack);
    }
    const size_t n = stack->size();
    const Tensor input = (*stack)[n - 8].toTensor();
    const auto weight = (*stack)[n - 7].toOptional<Tensor>(), bias = (*stack)[n - 6].toOptional<Tensor>();
    const int64_t level = current_level();
    const bool has_weight = present(weight), has_bias = present(bias);
    // A bias without a weight stays functorch's: PyTorch's double-backward formula of native_group_norm fails on it
    // (infinitely_differentiable_native_group_norm_backward), a path functorch's rule, with the bias added apart,
    // never takes.
    if (level < 0 || !batched_at(input, level) || batched_at(weight, level) || batched_at(bias, level) ||
        input.dim() < 2 || (has_bias && !has_weight) || empty_at(input, level)) {
      return overridden_.callBoxed(op, keyset, stack);
    }
    const int64_t samples = int_of((*stack)[n - 5]), channels = int_of((*stack)[n - 4]);
    const int64_t inner = int_of((*stack)[n - 3]), group = (*stack)[n - 2].toInt();
    const double eps = (*stack)[n - 1].toDouble();
    c10::impl::ExcludeDispatchKeyGuard guard(c10::DispatchKey::FuncTorchBatched);
    const BelowLevels below(arguments_plain(op, *stack, level));
    const Tensor x = unwrap(input, level).value;  // (B, N, C, *)
    const int64_t batch = x.size(0);
    auto [y, mean, rstd] = at::native_group_norm(fold_samples(x).contiguous(), weight, bias, batch * samples,
                                                 channels, inner, group, eps);
    torch::jit::drop(*stack, 8);
    torch::jit::push(*stack, at::functorch::makeBatched(unfold_samples(y, batch), 0, level),
                     at::functorch::makeBatched(unfold_samples(mean, batch), 0, level),
                     at::functorch::makeBatched(unfold_samples(rstd, batch), 0, level));
  }
};

// native_group_norm_backward(Tensor grad_out, Tensor input, Tensor mean, Tensor rstd, Tensor? weight, SymInt N,
//                            SymInt C, SymInt HxW, int group, bool[3] output_mask) -> (Tensor, Tensor, Tensor)
// The input's gradient from PyTorch's kernel over the folded samples (the weight inside it); each sample's weight and
// bias gradients from two per-channel sums, ds = sum(dy * x) and db = sum(dy) over each sample's N and HxW:
// grad_weight = (ds - db * mean) * rstd per group, grad_bias = db. functorch's rule forms the normalized input, its
// product with dy and dy * weight as whole batched tensors first.
class GroupNormBackward final : public BatchRule {
 public:
  using BatchRule::BatchRule;

  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet keyset, torch::jit::Stack* stack) {
    if (!rules_apply()) {
      return overridden_.callBoxed(op, keyset, stack);
    }
    const size_t n = stack->size();
    const Tensor grad = (*stack)[n - 10].toTensor(), input = (*stack)[n - 9].toTensor();
    const Tensor mean = (*stack)[n - 8].toTensor(), rstd = (*stack)[n - 7].toTensor();
    const auto weight = (*stack)[n - 6].toOptional<Tensor>();
    const int64_t level = current_level();
    if (level < 0 || !(batched_at(grad, level) || batched_at(input, level)) || batched_at(weight, level) ||
        input.dim() < 2 || empty_at(input, level) || empty_at(grad, level)) {
      return overridden_.callBoxed(op, keyset, stack);
    }
    const int64_t samples = int_of((*stack)[n - 5]), channels = int_of((*stack)[n - 4]);
    const int64_t inner = int_of((*stack)[n - 3]), group = (*stack)[n - 2].toInt();
    const auto mask = (*stack)[n - 1].toBoolList();
    const bool want_input = mask.get(0), want_weight = mask.get(1) && present(weight);
    const bool want_bias = mask.get(2);
    c10::impl::ExcludeDispatchKeyGuard guard(c10::DispatchKey::FuncTorchBatched);
    const BelowLevels below(arguments_plain(op, *stack, level));
    const Physical g = unwrap(grad, level), x = unwrap(input, level), m = unwrap(mean, level),
                   r = unwrap(rstd, level);
    const int64_t batch = g.batched ? g.value.size(0) : x.value.size(0);
    const int64_t rows = batch * samples;
    // Contiguous: PyTorch's CPU kernel reads the statistics by their data pointers, and an unbatched operand's fold is
    // a stride-0 view of its expansion.
    const Tensor dy = fold_samples(with_batch(g, batch)).to(x.value.scalar_type()).contiguous();
    const Tensor xs = fold_samples(with_batch(x, batch)).contiguous();
    const Tensor mu = fold_samples(with_batch(m, batch)).contiguous();  // (B*N, G)
    const Tensor sigma = fold_samples(with_batch(r, batch)).contiguous();
    Tensor grad_input, grad_weight, grad_bias;
    if (want_input) {
      grad_input = std::get<0>(at::native_group_norm_backward(dy, xs, mu, sigma, weight, rows, channels, inner, group,
                                                              {true, false, false}));
      grad_input = unfold_samples(grad_input, batch);
    }
    if (want_weight || want_bias) {
      const Tensor dy3 = dy.reshape({rows, channels, inner});
      const Tensor db = dy3.sum(-1);  // (B*N, C)
      if (want_bias) {
        grad_bias = db.view({batch, samples, channels}).sum(1).to(present(weight) ? weight->scalar_type()
                                                                                  : dy.scalar_type());
      }
      if (want_weight) {
        const Tensor ds = row_dots(dy3, xs.reshape({rows, channels, inner}));  // (B*N, C)
        const int64_t per_group = channels / group;
        const auto stats = [&](const Tensor& t) {  // (B*N, G) -> (B*N, C), each group's value on its channels
          return t.view({rows, group, 1}).expand({rows, group, per_group}).reshape({rows, channels});
        };
        grad_weight = (ds - db * stats(mu)).mul(stats(sigma)).view({batch, samples, channels}).sum(1)
                          .to(weight->scalar_type());
      }
    }
    torch::jit::drop(*stack, 10);
    const auto batched = [&](const Tensor& t) { return t.defined() ? at::functorch::makeBatched(t, 0, level) : t; };
    torch::jit::push(*stack, batched(grad_input), batched(grad_weight), batched(grad_bias));
  }
};

// --- layer norm: the backward over the folded samples, the weight inside PyTorch's kernel ------------------------

// Each sample's weight and bias gradients of a layer norm over its `rows` rows of `width`:
//   grad_weight[b, n] = sum over m of dy[b, m, n] * (x[b, m, n] - mean[b, m]) * rstd[b, m]
//   grad_bias[b, n]   = sum over m of dy[b, m, n]
// One pass over dy and x, no temporary of their size, the sums in double (as row_dots). Contiguous CPU float or
// double, every operand of one dtype (the caller checks); the samples split over PyTorch's intra-op threads.
// `shape` is (batch, the normalized shape): the gradients are made in it, not viewed into it (an op's outputs are
// not views of each other or of anything).
std::pair<Tensor, Tensor> layer_norm_parameter_grads(const Tensor& dy, const Tensor& x, const Tensor& mean,
                                                     const Tensor& rstd, at::IntArrayRef shape, int64_t rows,
                                                     bool want_weight, bool want_bias) {
  const int64_t batch = shape[0], width = c10::multiply_integers(shape.begin() + 1, shape.end());
  Tensor grad_weight = want_weight ? at::empty(shape, dy.options()) : Tensor();
  Tensor grad_bias = want_bias ? at::empty(shape, dy.options()) : Tensor();
  AT_DISPATCH_FLOATING_TYPES(dy.scalar_type(), "multicomposite_layer_norm_parameter_grads", [&] {
    const scalar_t* g = dy.const_data_ptr<scalar_t>();
    const scalar_t* in = x.const_data_ptr<scalar_t>();
    const scalar_t* mu = mean.const_data_ptr<scalar_t>();
    const scalar_t* sigma = rstd.const_data_ptr<scalar_t>();
    scalar_t* gw = want_weight ? grad_weight.mutable_data_ptr<scalar_t>() : nullptr;
    scalar_t* gb = want_bias ? grad_bias.mutable_data_ptr<scalar_t>() : nullptr;
    const int64_t grain = std::max<int64_t>(1, at::internal::GRAIN_SIZE / std::max<int64_t>(rows * width, 1));
    at::parallel_for(0, batch, grain, [&](int64_t begin, int64_t end) {
      std::vector<double> weight_sums(static_cast<size_t>(width)), bias_sums(static_cast<size_t>(width));
      for (int64_t b = begin; b < end; ++b) {
        std::fill(weight_sums.begin(), weight_sums.end(), 0.0);
        std::fill(bias_sums.begin(), bias_sums.end(), 0.0);
        for (int64_t m = 0; m < rows; ++m) {
          const int64_t row = b * rows + m;
          const scalar_t* dy_row = g + row * width;
          const scalar_t* x_row = in + row * width;
          const double scale = static_cast<double>(sigma[row]);
          const double shift = -static_cast<double>(mu[row]) * scale;  // x_hat = x * scale + shift
          for (int64_t n = 0; n < width; ++n) {
            const double d = static_cast<double>(dy_row[n]);
            weight_sums[n] += d * (static_cast<double>(x_row[n]) * scale + shift);
            bias_sums[n] += d;
          }
        }
        for (int64_t n = 0; n < width; ++n) {
          if (gw != nullptr) gw[b * width + n] = static_cast<scalar_t>(weight_sums[n]);
          if (gb != nullptr) gb[b * width + n] = static_cast<scalar_t>(bias_sums[n]);
        }
      }
    });
  });
  return {grad_weight, grad_bias};
}

// native_layer_norm_backward(Tensor grad_out, Tensor input, SymInt[] normalized_shape, Tensor mean, Tensor rstd,
//                            Tensor? weight, Tensor? bias, bool[3] output_mask) -> (Tensor, Tensor, Tensor)
// functorch's rule multiplies the output gradient by the weight as a batched op of its own, calls PyTorch's kernel
// without the weight, and forms each sample's weight gradient from whole batched temporaries, (x - mean) * rstd * dy,
// before summing them: under vmap(grad) of a transformer, every layer norm of every step. Layer norm is per row, so
// the batch is more rows: PyTorch's kernel once with the weight inside it for the input's gradient, and each sample's
// weight and bias gradients from one pass (layer_norm_parameter_grads). A batched weight or bias (an ensemble), other
// devices and dtypes, operands still wrapped by an outer level and empty inputs stay functorch's.
class LayerNormBackward final : public BatchRule {
 public:
  using BatchRule::BatchRule;

  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet keyset, torch::jit::Stack* stack) {
    if (!rules_apply()) {
      return overridden_.callBoxed(op, keyset, stack);
    }
    const size_t n = stack->size();
    const Tensor grad = (*stack)[n - 8].toTensor(), input = (*stack)[n - 7].toTensor();
    const Tensor mean = (*stack)[n - 5].toTensor(), rstd = (*stack)[n - 4].toTensor();
    const auto weight = (*stack)[n - 3].toOptional<Tensor>(), bias = (*stack)[n - 2].toOptional<Tensor>();
    const int64_t level = current_level();
    if (level < 0 || !(batched_at(grad, level) || batched_at(input, level)) || batched_at(weight, level) ||
        batched_at(bias, level) || empty_at(input, level) || empty_at(grad, level) || !input.device().is_cpu() ||
        !(input.scalar_type() == at::kFloat || input.scalar_type() == at::kDouble)) {
      return overridden_.callBoxed(op, keyset, stack);
    }
    const auto dtype = input.scalar_type();
    for (const Tensor& t : {grad, mean, rstd}) {
      if (t.scalar_type() != dtype) return overridden_.callBoxed(op, keyset, stack);
    }
    for (const auto& t : {weight, bias}) {
      if (present(t) && t->scalar_type() != dtype) return overridden_.callBoxed(op, keyset, stack);
    }
    for (const Tensor& t : {grad, input, mean, rstd}) {
      if (!plain_at(t, level)) return overridden_.callBoxed(op, keyset, stack);
    }
    for (const auto& t : {weight, bias}) {
      if (present(t) && !plain(*t)) return overridden_.callBoxed(op, keyset, stack);
    }
    std::vector<int64_t> normalized;
    for (const auto& size : (*stack)[n - 6].toListRef()) normalized.push_back(int_of(size));
    const auto mask = (*stack)[n - 1].toBoolList();
    c10::impl::ExcludeDispatchKeyGuard guard(c10::DispatchKey::FuncTorchBatched);
    const BelowLevels below(arguments_plain(op, *stack, level));
    const Physical g = unwrap(grad, level), x = unwrap(input, level), m = unwrap(mean, level),
                   r = unwrap(rstd, level);
    const int64_t batch = g.batched ? g.value.size(0) : x.value.size(0);
    const Tensor dy = with_batch(g, batch).contiguous(), xs = with_batch(x, batch).contiguous();
    const Tensor mu = with_batch(m, batch).contiguous(), sigma = with_batch(r, batch).contiguous();
    const bool want_weight = mask.get(1) && present(weight), want_bias = mask.get(2) && present(bias);
    Tensor grad_input, grad_weight, grad_bias;
    if (mask.get(0)) {
      grad_input = std::get<0>(at::native_layer_norm_backward(dy, xs, normalized, mu, sigma, weight, bias,
                                                              {true, false, false}));
    }
    if (want_weight || want_bias) {
      std::vector<int64_t> shape{batch};
      shape.insert(shape.end(), normalized.begin(), normalized.end());
      const int64_t rows = xs.numel() / c10::multiply_integers(shape);
      std::tie(grad_weight, grad_bias) = layer_norm_parameter_grads(dy, xs, mu, sigma, shape, rows, want_weight,
                                                                    want_bias);
    }
    torch::jit::drop(*stack, 8);
    const auto batched = [&](const Tensor& t) { return t.defined() ? at::functorch::makeBatched(t, 0, level) : t; };
    torch::jit::push(*stack, batched(grad_input), batched(grad_weight), batched(grad_bias));
  }
};

// --- convolution: each sample's weight gradient as one convolution with the channels and the batch swapped ---------

// Below this many input channels the swapped convolution beats functorch's grouped one (BatchRulesConvolution.cpp
// forms the B weight gradients as one convolution_backward with groups = B, each group `channels` wide, and
// PyTorch's CPU kernels for a weight gradient vectorize over channels). Measured on 2-core x86_64, torch 2.13.0,
// 3x3 kernels, batch 4 / 16 / 64, one thread: 3 channels (an image model's first layer) 0.39 / 1.40 / 6.6 ms
// grouped against 0.11 / 0.90 / 3.9 ms swapped; 16 channels 0.16 / 0.55 / 2.3 ms grouped against 0.15 / 1.8 /
// 7.7 ms swapped.
constexpr int64_t kSwapMaxChannels = 8;

// convolution_backward(Tensor grad_output, Tensor input, Tensor weight, SymInt[]? bias_sizes, SymInt[] stride,
//                      SymInt[] padding, SymInt[] dilation, bool transposed, SymInt[] output_padding, SymInt groups,
//                      bool[3] output_mask) -> (Tensor, Tensor, Tensor)
// Under vmap(grad) of a model whose weights are shared by the samples (per-sample gradients: the weight unbatched,
// the input and the output's gradient batched), sample b's weight gradient is
//   dW_b[o, c, i, j] = sum over n, h, w of dY_b[n, o, h, w] * X_b[n, c, h * stride + i * dilation - padding],
// a 2-d convolution of X_b with dY_b as its kernel, with stride and dilation trading places. With the input's
// channels as that convolution's batch and the B samples as its groups, the B weight gradients are one call:
//   input (C, B * N, H, W), weight (B * O, N, Ho, Wo), groups B -> (C, B * O, >= kH, >= kW).
// The input's gradient is PyTorch's kernel once over the folded samples (the weight is shared), as functorch's rule
// computes it; the bias's gradient a sum. Transposed and grouped convolutions, other ranks, a batched weight, wide
// inputs and devices other than the CPU stay functorch's.
class ConvolutionBackward final : public BatchRule {
 public:
  using BatchRule::BatchRule;

  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet keyset, torch::jit::Stack* stack) {
    if (!rules_apply()) {
      return overridden_.callBoxed(op, keyset, stack);
    }
    const size_t n = stack->size();
    const Tensor grad = (*stack)[n - 11].toTensor(), input = (*stack)[n - 10].toTensor();
    const Tensor weight = (*stack)[n - 9].toTensor();
    const bool transposed = (*stack)[n - 4].toBool();
    const int64_t groups = int_of((*stack)[n - 2]);
    const auto mask = (*stack)[n - 1].toBoolList();
    const int64_t level = current_level();
    if (level < 0 || !batched_at(grad, level) || !batched_at(input, level) || batched_at(weight, level) ||
        transposed || groups != 1 || !mask.get(1) || input.dim() != 4 || grad.dim() != 4 || weight.dim() != 4 ||
        input.size(1) >= kSwapMaxChannels || !input.device().is_cpu() || !at::isFloatingType(input.scalar_type()) ||
        grad.scalar_type() != input.scalar_type() || weight.scalar_type() != input.scalar_type() ||
        empty_at(input, level) || empty_at(grad, level)) {
      return overridden_.callBoxed(op, keyset, stack);
    }
    const auto ints = [](const c10::IValue& value) {
      std::vector<int64_t> out;
      for (const c10::IValue& item : value.toListRef()) {
        out.push_back(int_of(item));
      }
      return out;
    };
    const auto bias_sizes = (*stack)[n - 8];
    const std::vector<int64_t> stride = ints((*stack)[n - 7]), padding = ints((*stack)[n - 6]);
    const std::vector<int64_t> dilation = ints((*stack)[n - 5]), output_padding = ints((*stack)[n - 3]);
    if (stride.size() != 2 || padding.size() != 2 || dilation.size() != 2) {
      return overridden_.callBoxed(op, keyset, stack);
    }
    c10::impl::ExcludeDispatchKeyGuard guard(c10::DispatchKey::FuncTorchBatched);
    const BelowLevels below(arguments_plain(op, *stack, level));
    const Tensor dy = unwrap(grad, level).value, x = unwrap(input, level).value;  // (B, N, O, Ho, Wo), (B, N, C, H, W)
    const int64_t batch = x.size(0), samples = x.size(1), channels = x.size(2);
    const int64_t outputs = dy.size(2), kernel_h = weight.size(2), kernel_w = weight.size(3);
    Tensor grad_input, grad_bias;
    if (mask.get(0)) {
      grad_input = std::get<0>(at::convolution_backward(
          fold_samples(dy), fold_samples(x), weight, std::nullopt, stride, padding, dilation, false, output_padding,
          1, {true, false, false}));
      grad_input = unfold_samples(grad_input, batch);
    }
    const Tensor swapped_input = x.permute({2, 0, 1, 3, 4}).reshape({channels, batch * samples, x.size(3), x.size(4)});
    const Tensor swapped_kernel = dy.permute({0, 2, 1, 3, 4}).reshape({batch * outputs, samples, dy.size(3),
                                                                         dy.size(4)});
    const Tensor full = at::convolution(swapped_input, swapped_kernel, std::nullopt, /*stride=*/dilation, padding,
                                        /*dilation=*/stride, false, {0, 0}, batch);
    const Tensor grad_weight = full.narrow(2, 0, kernel_h).narrow(3, 0, kernel_w)
                                   .view({channels, batch, outputs, kernel_h, kernel_w})
                                   .permute({1, 2, 0, 3, 4}).contiguous();
    if (mask.get(2) && !bias_sizes.isNone()) {
      grad_bias = dy.sum({1, 3, 4});
    }
    torch::jit::drop(*stack, 11);
    const auto batched = [&](const Tensor& t) { return t.defined() ? at::functorch::makeBatched(t, 0, level) : t; };
    torch::jit::push(*stack, batched(grad_input), batched(grad_weight), batched(grad_bias));
  }
};

// --- embedding: each sample's weight gradient written once into memory kept between steps ---------------------

// embedding_dense_backward(Tensor grad_output, Tensor indices, SymInt num_weights, SymInt padding_idx,
//                          bool scale_grad_by_freq) -> Tensor
// Under vmap(grad) of a model whose embedding the samples share (per-sample gradients: the indices batched), each
// sample's gradient is a (num_weights, D) table, zero but for the rows the sample looked up. functorch's rule offsets
// each sample's indices by b * num_weights and calls PyTorch's kernel once on B * num_weights rows, which makes its
// output with at::zeros: B tables of fresh memory at every step (82 MB for a 5,000 x 64 table at batch 64), every
// page faulted in and zeroed by the kernel before the table is zeroed again and added into. Measured on the
// embedding + LayerNorm classifier at batch 64, one thread: 35.8 ms a step, against 5.0 ms where glibc keeps its
// heap (MALLOC_TRIM_THRESHOLD_ and MALLOC_MMAP_THRESHOLD_ raised). The rule does the same arithmetic, offset indices
// and one index_add_ over the rows, into the output pool's memory (output_pool.cpp), and zeroes the padding row of
// each sample as functorch's rule does. Gradients scaled by frequency, unbatched indices (a batched output gradient
// alone is one call of the kernel on wider rows) and empty inputs stay functorch's.
class EmbeddingDenseBackward final : public BatchRule {
 public:
  using BatchRule::BatchRule;

  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet keyset, torch::jit::Stack* stack) {
    if (!rules_apply()) {
      return overridden_.callBoxed(op, keyset, stack);
    }
    const size_t n = stack->size();
    const Tensor grad = (*stack)[n - 5].toTensor(), indices = (*stack)[n - 4].toTensor();
    const bool scale_grad_by_freq = (*stack)[n - 1].toBool();
    const int64_t level = current_level();
    const auto index_type = indices.scalar_type();
    // Logical shapes: the output gradient is the indices' shape and D.
    if (level < 0 || scale_grad_by_freq || !batched_at(indices, level) || grad.dim() != indices.dim() + 1 ||
        (index_type != at::kLong && index_type != at::kInt) || !at::isFloatingType(grad.scalar_type()) ||
        empty_at(indices, level) || empty_at(grad, level)) {
      return overridden_.callBoxed(op, keyset, stack);
    }
    if (!plain_at(grad, level) || !plain_at(indices, level)) {
      return overridden_.callBoxed(op, keyset, stack);
    }
    const int64_t num_weights = int_of((*stack)[n - 3]), padding_idx = int_of((*stack)[n - 2]);
    c10::impl::ExcludeDispatchKeyGuard guard(c10::DispatchKey::FuncTorchBatched);
    const BelowLevels below(arguments_plain(op, *stack, level));
    const Physical g = unwrap(grad, level), idx = unwrap(indices, level);
    const int64_t batch = idx.value.size(0), width = grad.size(-1);
    const Tensor rows = with_batch(g, batch).reshape({-1, width});  // (B * looked-up rows, D)
    const Tensor offsets = at::arange(batch, idx.value.options()).mul_(num_weights).view({batch, 1});
    const Tensor flat = (idx.value.reshape({batch, -1}) + offsets).reshape({-1});
    Tensor tables = multicomposite_pool::empty({batch * num_weights, width}, rows.options());
    multicomposite_pool::zero(tables);
    tables.index_add_(0, flat, rows);
    tables = tables.view({batch, num_weights, width});
    if (padding_idx >= 0) {
      tables.select(1, padding_idx).zero_();
    }
    torch::jit::drop(*stack, 5);
    torch::jit::push(*stack, at::functorch::makeBatched(tables, 0, level));
  }
};

// --- attention: the CPU flash kernel's backward over the folded samples ------------------------------------------

// Where a fold of attention's operands holds: query, key, value (and the backward's gradient and output) 4-d and
// nonempty, on the CPU; a mask, where present, of any rank that broadcasts (fold_mask lines it up). Dropout never
// reaches these kernels on the CPU (F.scaled_dot_product_attention takes the math path for it, which batches), and
// the rules decline it anyway: the kernel would draw one random state for all samples.
bool attention_folds(const std::vector<Tensor>& tensors, const std::optional<Tensor>& mask, double dropout_p,
                     int64_t level) {
  bool any_batched = batched_at(mask, level);
  for (const Tensor& t : tensors) {
    if (!t.defined() || t.dim() != 4 || empty_at(t, level)) {
      return false;
    }
    any_batched = any_batched || batched_at(t, level);
  }
  const bool mask_folds = !present(mask) || (mask->dim() <= 4 && !empty_at(*mask, level));
  return any_batched && mask_folds && dropout_p == 0.0 && tensors[0].device().is_cpu();
}

// The vmap batch size at `level` of the first operand batched there.
int64_t batch_of(const std::vector<Tensor>& tensors, const std::optional<Tensor>& mask, int64_t level) {
  for (const Tensor& t : tensors) {
    if (const auto* batched = batched_impl_at(t, level)) {
      return batched->value().size(batched->bdim());
    }
  }
  const auto* batched = batched_impl_at(*mask, level);
  return batched->value().size(batched->bdim());
}

// (B, N, ...) physical -> (B * N, ...); an unbatched operand is expanded first (each sample sees the same one).
Tensor fold_operand(const Tensor& t, int64_t level, int64_t batch) {
  return fold_samples(with_batch(unwrap(t, level), batch));
}

// The mask as a 4-d (B * N, ...) operand: its logical dimensions padded in front to four and its first one expanded
// to the query's N, so that each of the folded rows is paired with its own (a mask broadcasts over what it lacks).
std::optional<Tensor> fold_mask(const std::optional<Tensor>& mask, int64_t level, int64_t batch, int64_t samples) {
  if (!present(mask)) {
    return std::nullopt;
  }
  const Physical p = unwrap(*mask, level);
  Tensor m = with_batch(p, batch);  // (B, *logical)
  while (m.dim() < 5) {
    m = m.unsqueeze(1);
  }
  std::vector<int64_t> shape(m.sizes().begin(), m.sizes().end());
  shape[1] = samples;
  return fold_samples(m.expand(shape));
}

// _scaled_dot_product_flash_attention_for_cpu(Tensor query, Tensor key, Tensor value, float dropout_p=0.,
//     bool is_causal=False, *, Tensor? attn_mask=None, float? scale=None) -> (Tensor output, Tensor logsumexp)
// The fused CPU kernel (what F.scaled_dot_product_attention runs on 4-d CPU inputs without dropout) has no batching
// rule in functorch: vmap runs it once per sample and stacks the results. Attention is per (n, head), so B samples
// of N are one call on B * N.
class FlashAttention final : public BatchRule {
 public:
  using BatchRule::BatchRule;

  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet keyset, torch::jit::Stack* stack) {
    if (!rules_apply()) {
      return overridden_.callBoxed(op, keyset, stack);
    }
    const size_t n = stack->size();
    const Tensor query = (*stack)[n - 7].toTensor(), key = (*stack)[n - 6].toTensor();
    const Tensor value = (*stack)[n - 5].toTensor();
    const double dropout_p = (*stack)[n - 4].toDouble();
    const bool is_causal = (*stack)[n - 3].toBool();
    const auto mask = (*stack)[n - 2].toOptional<Tensor>();
    const auto scale = (*stack)[n - 1].toOptional<double>();
    const int64_t level = current_level();
    const std::vector<Tensor> tensors{query, key, value};
    if (level < 0 || !attention_folds(tensors, mask, dropout_p, level)) {
      return overridden_.callBoxed(op, keyset, stack);
    }
    c10::impl::ExcludeDispatchKeyGuard guard(c10::DispatchKey::FuncTorchBatched);
    const BelowLevels below(arguments_plain(op, *stack, level));
    const int64_t batch = batch_of(tensors, mask, level);
    auto [output, logsumexp] = at::_scaled_dot_product_flash_attention_for_cpu(
        fold_operand(query, level, batch), fold_operand(key, level, batch), fold_operand(value, level, batch),
        dropout_p, is_causal, fold_mask(mask, level, batch, query.size(0)), scale);
    torch::jit::drop(*stack, 7);
    torch::jit::push(*stack, at::functorch::makeBatched(unfold_samples(output, batch), 0, level),
                     at::functorch::makeBatched(unfold_samples(logsumexp, batch), 0, level));
  }
};

// _scaled_dot_product_flash_attention_for_cpu_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value,
//     Tensor out, Tensor logsumexp, float dropout_p, bool is_causal, *, Tensor? attn_mask=None, float? scale=None)
//     -> (Tensor grad_query, Tensor grad_key, Tensor grad_value)
// Without a batching rule vmap runs it once per sample, as the forward (0.5 ms of a LoRA decoder's 8 ms step at
// batch 4); folded like the forward, whose rule above is also why `out` and `logsumexp` come in batched.
class FlashAttentionBackward final : public BatchRule {
 public:
  using BatchRule::BatchRule;

  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet keyset, torch::jit::Stack* stack) {
    if (!rules_apply()) {
      return overridden_.callBoxed(op, keyset, stack);
    }
    const size_t n = stack->size();
    const Tensor grad = (*stack)[n - 10].toTensor(), query = (*stack)[n - 9].toTensor();
    const Tensor key = (*stack)[n - 8].toTensor(), value = (*stack)[n - 7].toTensor();
    const Tensor out = (*stack)[n - 6].toTensor(), logsumexp = (*stack)[n - 5].toTensor();
    const double dropout_p = (*stack)[n - 4].toDouble();
    const bool is_causal = (*stack)[n - 3].toBool();
    const auto mask = (*stack)[n - 2].toOptional<Tensor>();
    const auto scale = (*stack)[n - 1].toOptional<double>();
    const int64_t level = current_level();
    const std::vector<Tensor> tensors{query, key, value, grad, out};
    if (level < 0 || !attention_folds(tensors, mask, dropout_p, level) || !logsumexp.defined() ||
        logsumexp.dim() != 3) {
      return overridden_.callBoxed(op, keyset, stack);
    }
    c10::impl::ExcludeDispatchKeyGuard guard(c10::DispatchKey::FuncTorchBatched);
    const BelowLevels below(arguments_plain(op, *stack, level));
    const int64_t batch = batch_of(tensors, mask, level);
    auto [grad_query, grad_key, grad_value] = at::_scaled_dot_product_flash_attention_for_cpu_backward(
        fold_operand(grad, level, batch), fold_operand(query, level, batch), fold_operand(key, level, batch),
        fold_operand(value, level, batch), fold_operand(out, level, batch),
        fold_operand(logsumexp, level, batch).contiguous(), dropout_p, is_causal,
        fold_mask(mask, level, batch, query.size(0)), scale);
    torch::jit::drop(*stack, 10);
    const auto batched = [&](const Tensor& t) {
      return at::functorch::makeBatched(unfold_samples(t, batch), 0, level);
    };
    torch::jit::push(*stack, batched(grad_query), batched(grad_key), batched(grad_value));
  }
};

// --- rows: x[index] and its backward's index_put with one integer index (NOTE [rows ops] in rows.cpp) ----------
//
// functorch's rules batch x[index], where self and index are both batched, as advanced indexing with a second,
// arange index over the batch, and the backward's index_put(zeros, [index], grad, accumulate=True) the same way.
// Folded, sample b's row r is row b * rows + r of one tensor: one multicomposite::gather_rows forward and one
// multicomposite::add_rows backward (rows.cpp), each over every sample's rows at once. Only where both the
// tensor and its one integer index on the first dimension are batched at this level and ordinary below it (a shared
// index, a mask, several indices: functorch's rule, which is fine there).

// The one integer index of `indices` where it indexes the first dimension alone and is batched at `level`.
const at::functorch::BatchedTensorImpl* row_index_at(const c10::List<std::optional<Tensor>>& indices, int64_t level) {
  if (indices.size() != 1) return nullptr;
  const std::optional<Tensor> index = indices.get(0);
  if (!index.has_value() || !index->defined() || !multicomposite_rows::integral_index(*index)) {
    return nullptr;
  }
  const auto* batched = batched_impl_at(*index, level);
  return batched != nullptr && multicomposite_rows::readable(batched->value()) ? batched : nullptr;
}

// Whether the rows rules take `self` with the one integer index of `indices`: both batched at `level`, self an
// ordinary CPU tensor of at least one dimension below it.
bool rows_fold(const Tensor& self, const c10::List<std::optional<Tensor>>& indices, int64_t level) {
  if (level < 0 || self.dim() < 1 || !self.device().is_cpu() || row_index_at(indices, level) == nullptr) {
    return false;
  }
  const auto* batched = batched_impl_at(self, level);
  return batched != nullptr && plain(batched->value());
}

// The physical self (batch, rows, *rest), folded as (batch * rows, *rest), and the flat rows of its index in it.
struct FoldedRows {
  Tensor self;    // (batch, rows, *rest)
  Tensor index;   // (batch, *index)
  Tensor flat;    // (batch * index.numel()), each b * rows + the sample's row
  int64_t batch;
  int64_t rows;

  FoldedRows(const Tensor& logical_self, const Tensor& logical_index, int64_t level)
      : self(unwrap(logical_self, level).value), index(unwrap(logical_index, level).value),
        batch(self.size(0)), rows(self.size(1)) {
    flat = multicomposite_rows::folded_rows(index, rows, batch, /*indexing=*/true);
  }

  Tensor folded_self() const {
    std::vector<int64_t> sizes = self.sizes().vec();
    sizes.erase(sizes.begin());
    sizes[0] = batch * rows;
    return self.reshape(sizes);
  }

  // (*index, *rest): the shape of what the index gathers, or of the values it scatters.
  std::vector<int64_t> gathered() const {
    std::vector<int64_t> sizes = index.sizes().vec();
    sizes.insert(sizes.end(), self.sizes().begin() + 2, self.sizes().end());
    return sizes;
  }
};

// index.Tensor(Tensor self, Tensor?[] indices) -> Tensor
class IndexRows final : public BatchRule {
 public:
  using BatchRule::BatchRule;

  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet keyset, torch::jit::Stack* stack) {
    if (!rules_apply()) {
      return overridden_.callBoxed(op, keyset, stack);
    }
    const size_t n = stack->size();
    const Tensor self = (*stack)[n - 2].toTensor();
    const auto indices = (*stack)[n - 1].to<c10::List<std::optional<Tensor>>>();
    const int64_t level = current_level();
    if (!rows_fold(self, indices, level)) {
      return overridden_.callBoxed(op, keyset, stack);
    }
    c10::impl::ExcludeDispatchKeyGuard guard(c10::DispatchKey::FuncTorchBatched);
    const FoldedRows folded(self, indices.get(0).value(), level);
    Tensor out;
    {
      const BelowLevels below(true);
      out = multicomposite_rows::gather_rows_op().call(folded.folded_self(), folded.flat);
    }
    torch::jit::drop(*stack, 2);
    torch::jit::push(*stack, at::functorch::makeBatched(out.view(folded.gathered()), 0, level));
  }
};

// index_put(Tensor self, Tensor?[] indices, Tensor values, bool accumulate=False) -> Tensor, with accumulate: what
// x[index]'s backward calls (into zeros) under torch.func's grad.
class IndexPutRows final : public BatchRule {
 public:
  using BatchRule::BatchRule;

  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet keyset, torch::jit::Stack* stack) {
    if (!rules_apply()) {
      return overridden_.callBoxed(op, keyset, stack);
    }
    const size_t n = stack->size();
    const Tensor self = (*stack)[n - 4].toTensor();
    const auto indices = (*stack)[n - 3].to<c10::List<std::optional<Tensor>>>();
    const Tensor values = (*stack)[n - 2].toTensor();
    const bool accumulate = (*stack)[n - 1].toBool();
    const int64_t level = current_level();
    const auto* values_batched = level < 0 ? nullptr : batched_impl_at(values, level);
    if (!accumulate || !rows_fold(self, indices, level) || values_batched == nullptr ||
        values.scalar_type() != self.scalar_type() || !plain(values_batched->value())) {
      return overridden_.callBoxed(op, keyset, stack);
    }
    // values of exactly the gathered shape: (*index, *self.shape[1:]) (a broadcast value is functorch's).
    std::vector<int64_t> gathered = indices.get(0).value().sizes().vec();
    gathered.insert(gathered.end(), self.sizes().begin() + 1, self.sizes().end());
    if (values.sizes() != at::IntArrayRef(gathered)) {
      return overridden_.callBoxed(op, keyset, stack);
    }
    c10::impl::ExcludeDispatchKeyGuard guard(c10::DispatchKey::FuncTorchBatched);
    const FoldedRows folded(self, indices.get(0).value(), level);
    const Tensor values_p = unwrap(values, level).value;
    std::vector<int64_t> value_rows = {folded.flat.numel()};
    value_rows.insert(value_rows.end(), folded.self.sizes().begin() + 2, folded.self.sizes().end());
    Tensor out;
    {
      const BelowLevels below(true);
      out = multicomposite_rows::add_rows_op()
                .call(folded.folded_self(), values_p.reshape(value_rows), folded.flat)
                .view(folded.self.sizes());
    }
    torch::jit::drop(*stack, 4);
    torch::jit::push(*stack, at::functorch::makeBatched(out, 0, level));
  }
};

template <typename Rule>
void override_batched(torch::Library& library, const char* name, const char* overload = "") {
  constexpr auto key = c10::DispatchKey::FuncTorchBatched;
  const auto handle = c10::Dispatcher::singleton().findSchemaOrThrow(name, overload);
  auto overridden = handle.getComputedKernelForDispatchKey(key);
  std::string unqualified = std::string(name).substr(6);  // "aten::"
  if (*overload != '\0') unqualified += std::string(".") + overload;
  library.impl(unqualified.c_str(),
               torch::dispatch(key, torch::CppFunction::makeFromBoxedFunctor(std::make_unique<Rule>(overridden))));
}

}  // namespace

void set_batch_rules_enabled(bool enabled) { rules_enabled.store(enabled); }

void set_below_levels_enabled(bool enabled) { multicomposite_functorch::below_levels_enabled.store(enabled); }

size_t register_set_aside_decompositions(torch::Library& library);  // first_order.cpp

// Register the rules into `library` (the C++ routing's), and first_order.cpp's kernels of the composites that
// decompose while grad's level is set aside; returns how many. The decompositions they override must be registered
// first (torch._functorch.predispatch.lazy_load_decompositions), or they would override these.
size_t register_batch_rules(torch::Library& library) {
  override_batched<NllLossForward>(library, "aten::nll_loss_forward");
  override_batched<NllLossBackward>(library, "aten::nll_loss_backward");
  override_batched<GroupNorm>(library, "aten::native_group_norm");
  override_batched<GroupNormBackward>(library, "aten::native_group_norm_backward");
  override_batched<ConvolutionBackward>(library, "aten::convolution_backward");
  override_batched<FlashAttention>(library, "aten::_scaled_dot_product_flash_attention_for_cpu");
  override_batched<FlashAttentionBackward>(library, "aten::_scaled_dot_product_flash_attention_for_cpu_backward");
  override_batched<EmbeddingDenseBackward>(library, "aten::embedding_dense_backward");
  override_batched<LayerNormBackward>(library, "aten::native_layer_norm_backward");
  override_batched<IndexRows>(library, "aten::index", "Tensor");
  override_batched<IndexPutRows>(library, "aten::index_put");
  return 11 + register_set_aside_decompositions(library);
}
