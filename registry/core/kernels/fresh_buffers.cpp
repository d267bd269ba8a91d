// A batched-buffers region's buffers, made in C++ (registry/core/fresh_buffers.py: BatchedRegion, _batched_buffer;
// registry/core/functionalization.py: NOTE [batched fresh buffers]).
//
// NOTE [batched buffers in C++]: inside a batched-buffers region every buffer the function makes at the vmap level
// (torch.zeros, ones, empty, full, and the *_like / new_* ops of a tensor no vmap level batches) is made batched: one
// copy of its value per sample, batched at the region's vmap level and every vmap level outside it, wrapped at each
// grad or jvp level inside it. Every other call in the region (a template batched at some level, a call a layer below
// makes, clone) runs PyTorch's kernel. As a Python kernel behind routing.cpp's RegionKernel gate, each such call
// took the GIL and ran a Python function: a graph network's per-sample-gradient step makes about ten buffers and
// their gradients' buffers per step, 30-50 us each under vmap(grad) (profiled, one thread). Here the same rule runs
// without the GIL; fresh_buffers.py's Python kernel remains the Python routing backend's, and the rule is the same.

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/functorch/BatchedTensorImpl.h>
#include <ATen/functorch/DynamicLayer.h>
#include <ATen/functorch/TensorWrapper.h>
#include <c10/util/SmallVector.h>
#include <torch/csrc/jit/runtime/operator.h>

#include <cstdint>
#include <vector>

namespace {

using at::functorch::DynamicLayer;
using at::functorch::TransformType;

// Whether `t`, or a tensor it wraps, is batched at some vmap level.
bool batched_anywhere(const at::Tensor& t) {
  at::Tensor current = t;
  while (true) {
    if (at::functorch::maybeGetBatchedImpl(current) != nullptr) {
      return true;
    }
    auto* wrapper = at::functorch::maybeGetTensorWrapper(current);
    if (wrapper == nullptr) {
      return false;
    }
    current = wrapper->value();
  }
}

// The ordinary tensor under `t`'s grad and jvp wrappers (it is batched nowhere: batched_anywhere said so).
at::Tensor innermost(const at::Tensor& t) {
  at::Tensor current = t;
  while (auto* wrapper = at::functorch::maybeGetTensorWrapper(current)) {
    current = wrapper->value();
  }
  return current;
}

// Every functorch level off the stack while it lives (ops run on ordinary tensors, as before any transform), then
// back in order: fresh_buffers.py's _below_every_level.
class BelowEveryLevel {
 public:
  BelowEveryLevel() {
    while (!at::functorch::getDynamicLayerStack().empty()) {
      saved_.push_back(at::functorch::popDynamicLayer());
    }
  }
  ~BelowEveryLevel() {
    for (auto layer = saved_.rbegin(); layer != saved_.rend(); ++layer) {
      at::functorch::pushDynamicLayer(std::move(*layer));
    }
  }
  BelowEveryLevel(const BelowEveryLevel&) = delete;
  BelowEveryLevel& operator=(const BelowEveryLevel&) = delete;

 private:
  std::vector<DynamicLayer> saved_;
};

bool differentiating(TransformType key) { return key == TransformType::Grad || key == TransformType::Jvp; }

}  // namespace

// The buffer `op` makes from the arguments on `stack`, batched for the region at vmap level `region_level` (the
// NOTE above), in place of the arguments; false, the stack untouched, where it is not batched: a call a layer below
// makes (not the function's own, at or above the level), a template batched at some level (its batching rule
// decides), a grad or jvp level outside the region's vmap, another transform on the stack, a buffer over `limit`
// elements over the batch. `has_template`: the op's first argument is the tensor it takes its shape or options from.
bool make_batched_buffer(const c10::OperatorHandle& op, torch::jit::Stack* stack, bool has_template,
                         int64_t region_level, int64_t limit) {
  const auto& layers = at::functorch::getDynamicLayerStack();
  if (layers.empty() || layers.back().layerId() < region_level) {
    return false;
  }
  const size_t count = op.schema().arguments().size();
  const size_t first = stack->size() - count;
  if (has_template && batched_anywhere((*stack)[first].toTensor())) {
    return false;
  }
  // The levels, outermost first (while a level handles a call, the levels above it are off the stack).
  c10::SmallVector<std::pair<TransformType, int64_t>, 4> levels;
  c10::SmallVector<int64_t, 4> sizes;
  for (const auto& layer : layers) {
    const TransformType key = layer.key();
    const int64_t level = layer.layerId();
    if (key == TransformType::Vmap && level <= region_level) {
      sizes.push_back(layer.batchSize().guard_int(__FILE__, __LINE__));
      levels.emplace_back(key, level);
    } else if (differentiating(key) && level >= region_level) {
      levels.emplace_back(key, level);
    } else if (key != TransformType::Vmap) {
      return false;  // another transform, or a grad or jvp level outside the region's vmap
    }
  }
  at::Tensor made;
  {
    BelowEveryLevel below;
    torch::jit::Stack arguments(stack->begin() + static_cast<std::ptrdiff_t>(first), stack->end());
    if (has_template) {
      arguments[0] = innermost(arguments[0].toTensor());
    }
    op.callBoxed(arguments);
    made = arguments[0].toTensor();
    int64_t samples = 1;
    for (const int64_t size : sizes) {
      samples *= size;
    }
    if (made.numel() * samples > limit) {
      return false;
    }
    c10::SmallVector<int64_t, 8> expanded(sizes.begin(), sizes.end());
    expanded.append(made.sizes().begin(), made.sizes().end());
    made = made.expand(expanded).clone(at::MemoryFormat::Contiguous);
  }
  // Batched at each vmap level, outermost first; wrapped at each grad or jvp level between the region's vmap and
  // this call, as the function's own buffer would be (a tensor a level did not wrap is one captured from outside
  // it, which it refuses to write).
  for (const auto& [key, level] : levels) {
    made = key == TransformType::Vmap ? at::functorch::addBatchDim(made, 0, level)
                                      : at::functorch::makeTensorWrapper(made, level);
  }
  torch::jit::drop(*stack, count);
  torch::jit::push(*stack, std::move(made));
  return true;
}
