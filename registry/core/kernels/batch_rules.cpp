// Batching rules in C++ for aten ops whose only vmap rule is a Python decomposition: nll_loss_forward and
// nll_loss_backward, what every classifier's cross_entropy reaches under vmap(grad).
//
// functorch registers torch._decomp's Python decompositions of these at FuncTorchBatched
// (torch/_functorch/predispatch.py, lazy_load_decompositions): under vmap(grad) each cross-entropy call runs about
// ten aten ops from Python, each through vmap's batch rules, in its forward and again in its backward. The loss is a
// function of each row (one sample's rows under vmap), so a batch of B samples of N rows is one call on B * N rows
// with reduction "none", reduced per sample afterwards: the rule below makes that one call of PyTorch's own kernel.
// Autograd, forward AD and the double backward stay aten's own (NllLossBackward0 and its derivatives call these ops
// again, which reach the rule again at their vmap level).
//
// The kernels go into the C++ routing's Library (routing.cpp's register_batch_rules): they are destroyed with it
// (uninstall, a switch to the Python backend), and the decomposition they override is then PyTorch's again. Outside
// use() they run the kernel they override (captured when registered), so PyTorch outside use() is unchanged.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/functorch/BatchedTensorImpl.h>
#include <ATen/functorch/DynamicLayer.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

int64_t routing_frame();  // routing.cpp: the innermost use() frame of this thread, 0 outside use()

namespace {

using at::Tensor;

constexpr int64_t kNone = 0, kMean = 1, kSum = 2;  // at::Reduction

struct Physical {
  Tensor value;  // batch dimension first where batched; as is where not
  bool batched = false;
};

Physical unwrap(const Tensor& t, int64_t level) {
  if (auto* batched = at::functorch::maybeGetBatchedImpl(t); batched != nullptr && batched->level() == level) {
    return {batched->value().movedim(batched->bdim(), 0), true};
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

bool batched_at(const Tensor& t, int64_t level) {
  const auto* batched = at::functorch::maybeGetBatchedImpl(t);
  return batched != nullptr && batched->level() == level;
}

bool batched_at(const std::optional<Tensor>& t, int64_t level) { return t.has_value() && batched_at(*t, level); }

// The logical shapes the fold takes: self (N, C) with target (N,), or self (C,) with target (): nll_loss_forward's.
bool foldable(int64_t self_rank, int64_t target_rank) {
  return (self_rank == 2 && target_rank == 1) || (self_rank == 1 && target_rank == 0);
}

int64_t ignore_index_of(const c10::IValue& value) {
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

// Each sample's total weight: the weights of its rows' targets (1 each without weights), 0 where ignored.
Tensor total_weight(const Rows& r, const std::optional<Tensor>& weight, int64_t ignore_index, const Tensor& like) {
  const Tensor keep = r.target_rows.ne(ignore_index);
  Tensor per_row;
  if (weight.has_value() && weight->defined()) {
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
    if (routing_frame() == 0) {
      return overridden_.callBoxed(op, keyset, stack);
    }
    const size_t n = stack->size();
    const Tensor self = (*stack)[n - 5].toTensor(), target = (*stack)[n - 4].toTensor();
    const auto weight = (*stack)[n - 3].toOptional<Tensor>();
    const int64_t reduction = (*stack)[n - 2].toInt();
    const int64_t ignore_index = ignore_index_of((*stack)[n - 1]);
    const int64_t level = current_level();
    // Decided on the logical shapes before anything dispatches: what this rule declines runs the kernel it
    // overrides, as a batching rule (FuncTorchBatched not yet excluded).
    if (level < 0 || !(batched_at(self, level) || batched_at(target, level)) || batched_at(weight, level) ||
        reduction < kNone || reduction > kSum || !foldable(self.dim(), target.dim())) {
      return overridden_.callBoxed(op, keyset, stack);
    }
    c10::impl::ExcludeDispatchKeyGuard guard(c10::DispatchKey::FuncTorchBatched);
    const Physical s = unwrap(self, level), t = unwrap(target, level);
    const Rows r = fold(s, t);
    const Tensor per_row = std::get<0>(at::nll_loss_forward(r.self_rows, r.target_rows, weight, kNone, ignore_index));
    Tensor output, weights;
    if (reduction == kNone) {
      output = r.one_row ? per_row : per_row.view({r.batch, r.rows});
      // As the decomposition (and aten): a 2-d input's total weight is 0 without a reduction.
      weights = r.one_row ? total_weight(r, weight, ignore_index, r.self_rows) : at::zeros({}, r.self_rows.options());
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
    if (routing_frame() == 0) {
      return overridden_.callBoxed(op, keyset, stack);
    }
    const size_t n = stack->size();
    const Tensor grad = (*stack)[n - 7].toTensor(), self = (*stack)[n - 6].toTensor();
    const Tensor target = (*stack)[n - 5].toTensor();
    const auto weight = (*stack)[n - 4].toOptional<Tensor>();
    const int64_t reduction = (*stack)[n - 3].toInt();
    const int64_t ignore_index = ignore_index_of((*stack)[n - 2]);
    const Tensor total = (*stack)[n - 1].toTensor();
    const int64_t level = current_level();
    if (level < 0 ||
        !(batched_at(grad, level) || batched_at(self, level) || batched_at(target, level) ||
          batched_at(total, level)) ||
        batched_at(weight, level) || reduction < kNone || reduction > kSum || !foldable(self.dim(), target.dim())) {
      return overridden_.callBoxed(op, keyset, stack);
    }
    c10::impl::ExcludeDispatchKeyGuard guard(c10::DispatchKey::FuncTorchBatched);
    const Physical g = unwrap(grad, level), s = unwrap(self, level), t = unwrap(target, level);
    const Physical w = unwrap(total, level);
    const int64_t batch = g.batched ? g.value.size(0) : s.batched ? s.value.size(0) : t.batched ? t.value.size(0)
                                                                                           : w.value.size(0);
    const Rows r = fold({with_batch(s, batch), true}, {with_batch(t, batch), true});
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
    std::vector<int64_t> shape{r.batch};
    if (!r.one_row) {
      shape.push_back(r.rows);
    }
    shape.push_back(r.self_rows.size(-1));
    torch::jit::drop(*stack, 7);
    torch::jit::push(*stack, at::functorch::makeBatched(grad_rows.view(shape), 0, level));
  }
};

template <typename Rule>
void override_batched(torch::Library& library, const char* name) {
  constexpr auto key = c10::DispatchKey::FuncTorchBatched;
  const auto handle = c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
  auto overridden = handle.getComputedKernelForDispatchKey(key);
  const std::string unqualified = std::string(name).substr(6);  // "aten::"
  library.impl(unqualified.c_str(),
               torch::dispatch(key, torch::CppFunction::makeFromBoxedFunctor(std::make_unique<Rule>(overridden))));
}

}  // namespace

// Register the rules into `library` (the C++ routing's); returns how many. The decompositions they override must
// be registered first (torch._functorch.predispatch.lazy_load_decompositions), or they would override these.
size_t register_batch_rules(torch::Library& library) {
  override_batched<NllLossForward>(library, "aten::nll_loss_forward");
  override_batched<NllLossBackward>(library, "aten::nll_loss_backward");
  return 2;
}
