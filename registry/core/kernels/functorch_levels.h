// What the batching rules of every kernel file share about functorch's levels (defined in batch_rules.cpp, except
// batched_at). Listed in kernels/__init__.py's HEADERS, so that a change here rebuilds the extension.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/functorch/BatchedTensorImpl.h>
#include <ATen/functorch/DynamicLayer.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <cstdint>
#include <optional>

namespace multicomposite_functorch {

// Not batched at any vmap level, not wrapped by a grad or jvp level.
bool plain(const at::Tensor& t);

// NOTE [kernels under the last level] in batch_rules.cpp: around a rule's kernels, the keys and the empty stack that
// functorch's back fallback would set for each op, set once.
class BelowLevels {
 public:
  explicit BelowLevels(bool operands_plain);
  ~BelowLevels();
  BelowLevels(const BelowLevels&) = delete;
  BelowLevels& operator=(const BelowLevels&) = delete;

 private:
  std::optional<c10::impl::ForceDispatchKeyGuard> keys_;
  std::optional<at::functorch::DynamicLayer> level_;
};

// A batched tensor's physical value with its batch dimension in front (a movedim is two dispatched calls: skipped
// where the dimension is in front already, as it mostly is).
inline at::Tensor batch_first(const at::functorch::BatchedTensorImpl& batched) {
  return batched.bdim() == 0 ? batched.value() : batched.value().movedim(batched.bdim(), 0);
}

// `t`'s batched implementation at vmap level `level`, or null where `t` is not batched there.
inline const at::functorch::BatchedTensorImpl* batched_at(const at::Tensor& t, int64_t level) {
  const auto* batched = at::functorch::maybeGetBatchedImpl(t);
  return batched != nullptr && batched->level() == level ? batched : nullptr;
}

}  // namespace multicomposite_functorch
