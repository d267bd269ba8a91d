// Whether torch.func.grad's backward may run without create_graph (registry/core/first_order_grad.py decides with it).
//
// create_graph only matters where something differentiates the gradients again. Inside grad, below the vmap levels
// the caller has checked, that can be (1) eager autograd below every transform, which records where a tensor it
// tracks (requires_grad below the wrappers) took part in the forward, or (2) code in the graph that runs during the
// backward and may use tensors the forward never touched: a Python node (an autograd.Function, whose backward is
// arbitrary Python), or a hook on a node or a tensor. A built-in node's backward uses its saved tensors and the
// incoming gradient only, and every saved tensor is an input or an output of an op of the forward, so with (2)
// excluded (1) is seen on the differentiated outputs: if none of them requires grad below the wrappers, nothing the
// backward computes can be recorded there.

#include <ATen/ATen.h>
#include <ATen/functorch/BatchedTensorImpl.h>
#include <ATen/functorch/DynamicLayer.h>
#include <ATen/functorch/TensorWrapper.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <typeinfo>
#include <unordered_set>
#include <vector>

namespace {

using torch::autograd::Node;

// `t` below every functorch wrapper (grad's TensorWrapper, vmap's BatchedTensor): what eager autograd sees.
at::Tensor below_wrappers(at::Tensor t) {
  for (;;) {
    if (const auto* wrapper = at::functorch::maybeGetTensorWrapper(t)) {
      t = wrapper->value();
    } else if (const auto* batched = at::functorch::maybeGetBatchedImpl(t)) {
      t = batched->value();
    } else {
      return t;
    }
  }
}

// NOTE: a Python node is recognised by the name of its dynamic type, not by dynamic_cast: libtorch_python does not
// export PyNode's type_info (dynamic_cast<PyNode*> leaves an undefined symbol at load), while the name is read from
// the node's own vtable. The mangled name is the Itanium C++ ABI's, which gcc and clang on Linux and macOS use.
constexpr const char* kPyNode = "N5torch8autograd6PyNodeE";

bool is_python_node(const Node& node) { return std::strcmp(typeid(node).name(), kPyNode) == 0; }

// Code of the user's that the engine runs around this node: hooks on it, on its outputs' tensors, retain_grad.
bool runs_hooks(Node& node) {
  return !node.pre_hooks().empty() || !node.tensor_pre_hooks().empty() || !node.retains_grad_hooks().empty() ||
         !node.post_hooks().empty() || node.tensor_post_acc_grad_hooks() != nullptr;
}

}  // namespace

// Whether the innermost functorch level is grad with only vmap levels below it (vmap(grad), vmap(vmap(grad)), grad
// alone): no level below grad that could record its backward. Read from functorch's C++ stack: building the Python
// interpreter objects for it cost about 5.7 us a grad call (measured), this a few nanoseconds.
bool grad_over_vmaps_only() {
  const auto& stack = at::functorch::getDynamicLayerStack();
  if (stack.empty() || stack.back().key() != at::functorch::TransformType::Grad) {
    return false;
  }
  for (size_t i = 0; i + 1 < stack.size(); ++i) {
    if (stack[i].key() != at::functorch::TransformType::Vmap) {
      return false;
    }
  }
  return true;
}

// True where grad_over_vmaps_only, no differentiated output requires grad below the wrappers and the graph behind
// them holds only built-in nodes without hooks: then nothing can differentiate the backward's results again. Walks
// every node once (about 20 ns a node).
bool backward_is_first_order(const std::vector<at::Tensor>& outputs) {
  if (!grad_over_vmaps_only()) {
    return false;
  }
  std::vector<Node*> pending;
  for (const at::Tensor& output : outputs) {
    if (!output.defined()) {
      continue;
    }
    const at::Tensor base = below_wrappers(output);
    // NOTE: an empty batch (a vmap over no samples) keeps create_graph: without it PyTorch's nodes pick their
    // first-order backward kernels, and functorch's batching rules of some of them (native_group_norm_backward)
    // reject a batch of none where the twice-differentiable formulas' ops take it.
    if (base.requires_grad() || base.numel() == 0) {
      return false;
    }
    if (const auto& node = output.grad_fn()) {
      pending.push_back(node.get());
    } else if (output.requires_grad()) {
      return false;  // a leaf differentiated as itself: its hooks are on its accumulator, kept simple
    }
  }
  std::unordered_set<Node*> seen;
  while (!pending.empty()) {
    Node* node = pending.back();
    pending.pop_back();
    if (!seen.insert(node).second) {
      continue;
    }
    if (is_python_node(*node) || runs_hooks(*node)) {
      return false;
    }
    for (const auto& edge : node->next_edges()) {
      if (edge.function) {
        pending.push_back(edge.function.get());
      }
    }
  }
  return true;
}

// NOTE [first-order backward below the grad level]: where the backward is first-order (backward_is_first_order),
// nothing records at the grad level while it runs, yet every op of every node still passes through grad's
// interpreter: the saved tensors and the incoming gradients are grad's wrappers, so each op is unwrapped, called
// through the levels below and its results wrapped again, one boxed call more per op than the vmap level alone
// costs. Measured on a 2-core x86_64, one thread, under vmap(grad) at batch 4: a mul's node 19 us against 4 us for
// the mul forward. So the engine runs with grad's level set aside: taken off functorch's stack and marked not alive
// for the call, its wrappers are what functorch calls dead (its front fallback unwraps a dead wrapper before the
// level below sees it, as for a wrapper that escaped its grad), and each op is the vmap level's alone. The gradients
// come back as the level below's tensors (functorch's _unwrap_for_grad passes them through). The engine copies the
// thread's functorch state when the call starts, so every node sees the stack without the level. The level goes back
// (alive, on top of the stack) however the call ends.
//
// NOTE [decompositions while grad's level is set aside]: with grad's level in place, an op of a node's backward that
// PyTorch implements as a composite of other ops (CompositeImplicitAutograd: affine_grid_generator_backward, the
// backward of F.affine_grid) decomposes at grad's level, where its autograd kernel is that composite, and its parts
// reach the vmap level, which has batching rules for them. Set aside, the op itself reaches the vmap level, and where
// functorch has no rule of its own for it, its fallback runs the op once per sample (bench.programs' resampling:
// 1.29 ms against 0.97 with the level in place, and 1.14 natively). So every functional aten op that is such a
// composite, with no autograd kernel and no batching rule of its own, gets a kernel at the vmap level's key that
// runs the composite while a backward runs with the level set aside (what grad's level did) and functorch's fallback
// otherwise (what runs without use()).
namespace {

thread_local bool tls_grad_level_set_aside = false;

class GradLevelSetAside {
 public:
  GradLevelSetAside() : layer_(at::functorch::popDynamicLayer()), was_set_aside_(tls_grad_level_set_aside) {
    layer_.interpreter().set_is_alive(false);
    tls_grad_level_set_aside = true;
  }
  ~GradLevelSetAside() {
    tls_grad_level_set_aside = was_set_aside_;
    layer_.interpreter().set_is_alive(true);
    at::functorch::pushDynamicLayer(std::move(layer_));
  }
  GradLevelSetAside(const GradLevelSetAside&) = delete;
  GradLevelSetAside& operator=(const GradLevelSetAside&) = delete;

 private:
  at::functorch::DynamicLayer layer_;
  bool was_set_aside_;
};

// The vmap level's kernel of such a composite op (the NOTE above).
class DecomposedWhileSetAside final : public c10::OperatorKernel {
 public:
  DecomposedWhileSetAside(c10::SafeKernelFunction fallback, c10::SafeKernelFunction composite)
      : fallback_(std::move(fallback)), composite_(std::move(composite)) {}

  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet keyset, torch::jit::Stack* stack) {
    if (tls_grad_level_set_aside) {
      return composite_.callBoxed(op, keyset, stack);
    }
    fallback_.callBoxed(op, keyset, stack);
  }

 private:
  c10::SafeKernelFunction fallback_;   // functorch's loop over the samples
  c10::SafeKernelFunction composite_;  // the op's CompositeImplicitAutograd kernel
};

// Whether `op` is a functional aten op whose only implementation is a composite of other ops, with no batching rule
// of functorch's (or ours) at the vmap level.
bool decomposes_at_grad_level(const c10::OperatorHandle& op) {
  using c10::DispatchKey;
  if (!op.hasSchema() || op.operator_name().name.rfind("aten::", 0) != 0 ||
      !op.hasKernelForDispatchKey(DispatchKey::CompositeImplicitAutograd)) {
    return false;
  }
  for (const DispatchKey key : {DispatchKey::FuncTorchBatched, DispatchKey::FuncTorchBatchedDecomposition,
                                DispatchKey::Autograd, DispatchKey::AutogradCPU, DispatchKey::AutogradOther}) {
    if (op.hasKernelForDispatchKey(key)) return false;
  }
  for (const auto& argument : op.schema().arguments()) {  // in place or out=: functorch's own handling of writes
    if (argument.alias_info() != nullptr && argument.alias_info()->isWrite()) return false;
  }
  return true;
}

}  // namespace

// Register DecomposedWhileSetAside for every such op into `library` (the C++ routing's, an IMPL library of aten);
// returns how many. Called with the batching rules, after functorch's Python decompositions are registered.
size_t register_set_aside_decompositions(torch::Library& library) {
  size_t registered = 0;
  for (const c10::OperatorName& name : c10::Dispatcher::singleton().getAllOpNames()) {
    const auto op = c10::Dispatcher::singleton().findOp(name);
    if (!op || !decomposes_at_grad_level(*op)) continue;
    std::string unqualified = name.name.substr(6);  // "aten::"
    if (!name.overload_name.empty()) unqualified += "." + name.overload_name;
    library.impl(unqualified.c_str(),
                 torch::dispatch(c10::DispatchKey::FuncTorchBatched,
                                 torch::CppFunction::makeFromBoxedFunctor(std::make_unique<DecomposedWhileSetAside>(
                                     op->getComputedKernelForDispatchKey(c10::DispatchKey::FuncTorchBatched),
                                     op->getComputedKernelForDispatchKey(c10::DispatchKey::AutogradCPU)))));
    ++registered;
  }
  return registered;
}

// The gradients of `outputs` (grad_outputs: their cotangents) with respect to `inputs`, first-order, with the grad
// level set aside where the outputs are on the CPU (the NOTEs above; a device's nodes run on the engine's device
// threads, which tls_grad_level_set_aside does not reach: there the level stays); an input the outputs do not depend
// on gets an undefined tensor. The caller has checked backward_is_first_order.
std::vector<at::Tensor> first_order_gradients(const std::vector<at::Tensor>& outputs,
                                              const std::vector<at::Tensor>& grad_outputs,
                                              const std::vector<at::Tensor>& inputs) {
  TORCH_CHECK(grad_over_vmaps_only(), "first_order_gradients runs inside grad with only vmap levels below it");
  std::optional<GradLevelSetAside> aside;
  if (std::all_of(outputs.begin(), outputs.end(), [](const at::Tensor& out) { return out.device().is_cpu(); })) {
    aside.emplace();
  }
  return torch::autograd::grad(outputs, inputs, grad_outputs, /*retain_graph=*/false, /*create_graph=*/false,
                               /*allow_unused=*/true);
}
