// The routing kernels of use() in C++ (registry/core/routing_cpp.py registers them; registry/core/routing.py
// explains the routing itself).
//
// One boxed kernel per covered aten overload at FuncTorchDynamicLayerFrontMode (and at Autograd for the overloads
// whose eager derivative PyTorch gets wrong). Per call, without the GIL:
//   - no use() frame on this thread, or this thread is inside a call a kernel already decided: PyTorch's own kernel;
//   - otherwise a decision key (overload, frame, functorch layers, grad mode, and per tensor argument its position,
//     dtype, device, requires_grad, size bucket and wrapper levels) is looked up in one table: a native decision runs
//     PyTorch's own kernel, and a decision for an op of ours in C++ that takes the call's arguments as they are (a
//     cpp_op composite declared with ``redirect``) calls that op. Only a miss (Python decides and the answer is
//     stored) or a composite decision (the composite is Python) takes the GIL.
//   - while something traces (a Python dispatch mode or subclass is in the keyset: torch.compile, make_fx) or shapes
//     are symbolic, the whole call goes to the Python kernel, which records what torch.compile baked in.
// The frame is an int that use() sets on enter and exit; Python keeps the frames themselves.

#include <ATen/FunctionalTensorWrapper.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/functorch/BatchedTensorImpl.h>
#include <ATen/functorch/DynamicLayer.h>
#include <ATen/functorch/TensorWrapper.h>
#include <c10/util/Exception.h>
#include <c10/util/SmallVector.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/csrc/utils/tensor_memoryformats.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace py = pybind11;

bool make_batched_buffer(const c10::OperatorHandle& op, torch::jit::Stack* stack, bool has_template,
                         int64_t region_level, int64_t limit);  // fresh_buffers.cpp

namespace {

// What a decision says about one call.
enum Code : int64_t {
  kPass = 0,    // PyTorch's own kernel, not decided (policy "native", no autograd where only it matters)
  kNative = 1,  // decided native: PyTorch's own kernel with the busy flag set
  kRun = 2,     // a Python callable (the composite, or what adapts the call to it)
  kMiss = 3,
  kOp = 4,  // an op of our own in C++ taking the overload's arguments as they are (a cpp_op composite): no Python
};

thread_local int64_t tls_frame = 0;  // the id of the innermost use() frame of this thread; 0 outside use()
// Set in a frame's id where its policy is "native" (routing.py's Frame.cpp_id): PyTorch's own kernels and batching
// rules throughout, batch_rules.cpp's included.
constexpr long long kNativePolicyBit = 1LL << 40;
thread_local bool tls_native_policy = false;  // the innermost use() frame's policy is "native"
thread_local bool tls_record = false;  // the innermost frame records (use(record=True)): Python kernels, whole
thread_local bool tls_busy = false;  // inside a call a kernel decided: the layers below reach the kernel again
thread_local std::vector<int64_t> tls_key;  // scratch: building the key allocates nothing on a hit
// The regions open on this thread, functionalized or batched-buffers (registry/core/fresh_buffers.py:
// set_open_regions).
thread_local int64_t tls_open_regions = 0;
// The vmap level of the innermost region where it is a batched-buffers region whose buffers are made in C++
// (fresh_buffers.cpp), -1 otherwise; the largest buffer such a region batches, in elements over the batch.
thread_local int64_t tls_batched_region_level = -1;
thread_local int64_t tls_batched_buffer_limit = 0;

struct BusyGuard {
  bool saved;
  BusyGuard() : saved(tls_busy) { tls_busy = true; }
  ~BusyGuard() { tls_busy = saved; }
};

// How an argument becomes a Python object: IValues keep dtypes, layouts and memory formats as ints.
enum Convert : int { kGeneric, kDtype, kLayout, kMemoryFormat };

struct Argument {
  py::str name;
  bool kwarg_only;
  Convert convert;
  std::optional<c10::IValue> default_value;
};

struct Overload {
  int64_t id;
  std::string name;
  c10::DispatchKey key;
  std::optional<c10::SafeKernelFunction> native;  // PyTorch's kernel at the key, captured before overriding
  py::object decide;  // (*args, **kwargs) -> 0 | 1 | callable: the decision of a call, on a miss
  py::object slow;    // (keyset, *args, **kwargs) -> result: the Python kernel, for calls made while tracing
  std::vector<Argument> arguments;
  // An in-place overload (its first argument written: index_add_): a redirect calls its op's in-place twin where it
  // has one, else computes the result out of place and copies it into that argument, as registry.core.runners.runner
  // does in Python.
  bool inplace = false;
};

// Never freed: the dispatcher may hold a kernel until the process ends, and freeing a py::object needs the GIL.
std::vector<Overload*> overloads;

struct KeyHash {
  size_t operator()(const std::vector<int64_t>& key) const noexcept {
    uint64_t h = 1469598103934665603ull;
    for (int64_t v : key) {
      h ^= static_cast<uint64_t>(v);
      h *= 1099511628211ull;
    }
    return static_cast<size_t>(h);
  }
};

// Whether the op's first argument is written (an in-place op: index_add_).
bool writes_first(const c10::FunctionSchema& schema) {
  const auto& arguments = schema.arguments();
  return !arguments.empty() && arguments[0].alias_info() != nullptr && arguments[0].alias_info()->isWrite();
}

// An op of ours a cpp_op composite names, and its in-place twin (multicomposite::index_add_.entry for
// multicomposite::index_add.entry: the name with "_", the same overload and argument count, its first argument
// written), or none.
struct Redirect {
  c10::OperatorHandle op;
  std::optional<c10::OperatorHandle> inplace;
};

struct Entry {
  int64_t code;
  PyObject* run;  // a strong reference for kRun, released (with the GIL) when the table is cleared
  const Redirect* redirect = nullptr;  // for kOp: the op the call goes to (redirect_of: never freed)
};

// The redirect of the op named `name`, with its overload after a dot ("multicomposite::linear",
// "multicomposite::masked_fill.Scalar"), kept for the process: an entry points at it.
const Redirect* redirect_of(const std::string& name) {
  static std::mutex mutex;
  static auto* redirects = new std::unordered_map<std::string, std::unique_ptr<Redirect>>();
  std::lock_guard<std::mutex> guard(mutex);
  auto& redirect = (*redirects)[name];
  if (!redirect) {
    const size_t dot = name.find('.');
    const std::string base = name.substr(0, dot), overload = dot == std::string::npos ? "" : name.substr(dot + 1);
    const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow(base.c_str(), overload.c_str());
    auto twin = c10::Dispatcher::singleton().findOp({base + "_", overload});
    if (twin && !(twin->hasSchema() && writes_first(twin->schema()) &&
                  twin->schema().arguments().size() == op.schema().arguments().size())) {
      twin.reset();
    }
    redirect = std::make_unique<Redirect>(Redirect{op, twin});
  }
  return redirect.get();
}

// Whether `self` is written under functionalization (a functionalize level on functorch's stack, or a functional
// tensor): functionalization refuses an op of ours whose output aliases an input, so an in-place redirect copies there.
bool functionalizing(const at::Tensor& self) {
  if (at::functionalization::impl::isFunctionalTensor(self)) return true;
  for (const auto& layer : at::functorch::getDynamicLayerStack()) {
    if (layer.key() == at::functorch::TransformType::Functionalize) return true;
  }
  return false;
}

std::mutex table_mutex;
std::unordered_map<std::vector<int64_t>, Entry, KeyHash> table;
std::atomic<uint64_t> epoch{0};  // bumped on every clear: a kRun entry read before it is stale after it
// At most this many entries (the router's capacity, set_capacity): a key holds caller-supplied values (sizes, dtypes,
// levels), so an unbounded table would grow with every program. A full table is dropped whole and refills.
size_t capacity = SIZE_MAX;

// Empty the table and start a new epoch; returns the callables it held, to be released with the GIL and without
// the mutex (releasing one may run Python, which may route a call, which takes the mutex).
std::vector<PyObject*> drop_table() {
  std::vector<PyObject*> released;
  epoch.fetch_add(1);
  for (auto& [key, entry] : table) {
    if (entry.run != nullptr) {
      released.push_back(entry.run);
    }
  }
  table.clear();
  return released;
}

bool traced(c10::DispatchKeySet keyset) {
  return keyset.has(c10::DispatchKey::Python) || keyset.has(c10::DispatchKey::PythonTLSSnapshot);
}

int64_t bit_length(int64_t n) {
  return n <= 0 ? 0 : 64 - __builtin_clzll(static_cast<unsigned long long>(n));
}

bool is_default(const Argument& argument, const c10::IValue& value) {
  return argument.default_value.has_value() && c10::_fastEqualsForContainer(value, *argument.default_value);
}

// One tensor argument at position i into tls_key; false when the call must go to Python whole (symbolic shapes).
bool push_tensor(const at::Tensor& tensor, size_t i, bool* wrapped) {
  auto& key = tls_key;
  if (!tensor.defined()) {
    return true;
  }
  const c10::TensorImpl* impl = tensor.unsafeGetTensorImpl();
  if (impl->is_wrapped_number()) {
    *wrapped = true;
    return true;
  }
  if (impl->has_symbolic_sizes_strides()) {
    return false;
  }
  key.push_back(-16 - static_cast<int64_t>(i));
  key.push_back((static_cast<int64_t>(tensor.scalar_type()) << 16) |
                (static_cast<int64_t>(tensor.device().type()) << 1) | (tensor.requires_grad() ? 1 : 0));
  key.push_back(bit_length(tensor.numel()));
  // The size bucket (registry.core.context.size_key): each per-sample dimension's bit length, and below each
  // vmap level its batch size's; decisions by cost (registry.core.cost) differ between buckets.
  for (int64_t size : tensor.sizes()) {
    key.push_back(-1024 - bit_length(size));
  }
  const at::Tensor* current = &tensor;
  while (true) {
    if (auto* batched = at::functorch::maybeGetBatchedImpl(*current)) {
      key.push_back(batched->level() * 2);
      key.push_back(-2048 - bit_length(batched->value().size(batched->bdim())));
      current = &batched->value();
    } else if (auto* wrapper = at::functorch::maybeGetTensorWrapper(*current)) {
      key.push_back(wrapper->level().value_or(-1) * 2 + 1);
      current = &wrapper->value();
    } else {
      break;
    }
  }
  return true;
}

// The key of this call into tls_key; false when the call must go to Python whole (symbolic shapes).
// wrapped: a wrapped number (the 0-d tensor C++ makes of a Python scalar) is an argument: PyTorch's kernel.
bool build_key(const Overload& o, const c10::IValue* args, size_t count, bool* wrapped) {
  auto& key = tls_key;
  key.clear();
  key.push_back(o.id);
  key.push_back(tls_frame);
  for (const auto& layer : at::functorch::getDynamicLayerStack()) {
    key.push_back(layer.layerId() * 8 + static_cast<int64_t>(layer.key()));
  }
  key.push_back(at::GradMode::is_enabled() ? -2 : -3);
  for (size_t i = 0; i < count; ++i) {
    if (args[i].isTensor()) {
      if (!push_tensor(args[i].toTensor(), i, wrapped)) {
        return false;
      }
      if (*wrapped) {
        return true;
      }
      continue;
    }
    if (args[i].isTensorList()) {
      // NOTE: each tensor of a Tensor[] (lstm_cell's hx = [h, c]) is in the key as a tensor argument is: a rule may
      // read whether h is batched (routing.py's _tensor_args), and a decision kept for one must not serve the other.
      for (const c10::IValue& element : args[i].toListRef()) {
        if (!push_tensor(element.toTensor(), i, wrapped)) {
          return false;
        }
      }
      if (*wrapped) {
        return true;
      }
      continue;
    }
    // An argument away from its default (memory_format): rules may read it (Context.given).
    if (!is_default(o.arguments[i], args[i])) {
      key.push_back(-4096 - static_cast<int64_t>(i));
    }
  }
  return true;
}

py::object to_python(const Argument& argument, const c10::IValue& value) {
  if (value.isNone()) {
    return py::none();
  }
  if (value.isTensor()) {
    // The tensor's own Python object (what toPyObject returns too, through more code); a wrapped number becomes a
    // Python number there: it goes the general way.
    const at::Tensor& tensor = value.toTensor();
    if (tensor.defined() && !tensor.unsafeGetTensorImpl()->is_wrapped_number()) {
      return py::reinterpret_steal<py::object>(THPVariable_Wrap(tensor));
    }
  }
  switch (argument.convert) {
    case kDtype:
      return py::reinterpret_borrow<py::object>(
          reinterpret_cast<PyObject*>(torch::getTHPDtype(static_cast<c10::ScalarType>(value.toInt()))));
    case kLayout:
      return py::reinterpret_borrow<py::object>(
          reinterpret_cast<PyObject*>(torch::getTHPLayout(static_cast<c10::Layout>(value.toInt()))));
    case kMemoryFormat:
      return py::reinterpret_borrow<py::object>(
          torch::utils::getTHPMemoryFormat(static_cast<c10::MemoryFormat>(value.toInt())));
    default:
      return torch::jit::toPyObject(value);
  }
}

// The call as Python sees it from a torch.library kernel: positional arguments up to the last one not at its
// default, keyword-only ones by name where not at their default. Held as a vectorcall's argument array, so that a
// call builds no tuple, dict or list; slot 0 holds the keyset for the Python kernel (which takes it first), and is
// left empty for a composite or a decider (which the vectorcall may then use, PY_VECTORCALL_ARGUMENTS_OFFSET).
class PythonArguments {
 public:
  PythonArguments(const Overload& o, const c10::IValue* args, const c10::DispatchKeySet* keyset) {
    const size_t count = o.arguments.size();
    size_t positional = 0;
    while (positional < count && !o.arguments[positional].kwarg_only) {
      ++positional;
    }
    size_t last = positional;
    while (last > 0 && is_default(o.arguments[last - 1], args[last - 1])) {
      --last;
    }
    values_.reserve(count + 1);
    values_.push_back(keyset != nullptr ? py::cast(*keyset) : py::object());
    for (size_t i = 0; i < last; ++i) {
      values_.push_back(to_python(o.arguments[i], args[i]));
    }
    nargs_ = values_.size() - 1;
    size_t keywords = 0;
    for (size_t i = positional; i < count; ++i) {
      keywords += is_default(o.arguments[i], args[i]) ? 0 : 1;
    }
    if (keywords > 0) {
      py::tuple names(keywords);
      size_t k = 0;
      for (size_t i = positional; i < count; ++i) {
        if (!is_default(o.arguments[i], args[i])) {
          names[k++] = o.arguments[i].name;
          values_.push_back(to_python(o.arguments[i], args[i]));
        }
      }
      kwnames_ = std::move(names);
    }
    pointers_.reserve(values_.size());
    for (const auto& value : values_) {
      pointers_.push_back(value.ptr());
    }
  }

  // fn(keyset, *args, **kwargs) where a keyset was given, else fn(*args, **kwargs); raises what fn raised.
  py::object call(const py::handle& fn) {
    const bool keyset = values_[0].ptr() != nullptr;
    PyObject* kwnames = kwnames_ ? kwnames_.ptr() : nullptr;
    PyObject* out = keyset ? PyObject_Vectorcall(fn.ptr(), pointers_.data(), nargs_ + 1, kwnames)
                           : PyObject_Vectorcall(fn.ptr(), pointers_.data() + 1,
                                                 nargs_ | PY_VECTORCALL_ARGUMENTS_OFFSET, kwnames);
    if (out == nullptr) {
      throw py::error_already_set();
    }
    return py::reinterpret_steal<py::object>(out);
  }

 private:
  // On the stack for the arities of aten's schemas (no allocation per call).
  c10::SmallVector<py::object, 12> values_;  // what the pointers point at, held alive for the call
  c10::SmallVector<PyObject*, 12> pointers_;
  size_t nargs_ = 0;  // positional arguments after the keyset slot
  py::object kwnames_;
};

void push_result(const c10::OperatorHandle& op, torch::jit::Stack* stack, const py::object& out) {
  const auto& returns = op.schema().returns();
  if (returns.size() == 1) {
    if (returns[0].type()->kind() == c10::TypeKind::TensorType && THPVariable_Check(out.ptr())) {
      torch::jit::push(stack, THPVariable_Unpack(out.ptr()));  // what toIValue does for a Tensor, with less code
      return;
    }
    torch::jit::push(stack, torch::jit::toIValue(out, returns[0].type()));
    return;
  }
  auto items = py::cast<py::sequence>(out);
  TORCH_CHECK(items.size() == returns.size(), "multicomposite: a composite of ", op.schema().name(), " returned ",
              items.size(), " values where the schema has ", returns.size());
  for (size_t i = 0; i < returns.size(); ++i) {
    torch::jit::push(stack, torch::jit::toIValue(items[i], returns[i].type()));
  }
}

// Call the Python kernel with the keyset and this call's arguments (holding the GIL), and put its result on the
// stack.
void call_python(const Overload& o, const py::object& fn, const c10::OperatorHandle& op, c10::DispatchKeySet keyset,
                 torch::jit::Stack* stack) {
  const size_t count = o.arguments.size();
  py::gil_scoped_acquire gil;
  PythonArguments arguments(o, &(*stack)[stack->size() - count], &keyset);
  py::object out;
  {
    BusyGuard busy;
    out = arguments.call(fn);
  }
  torch::jit::drop(*stack, count);
  push_result(op, stack, out);
}

// Called holding the GIL.
void store(std::vector<int64_t> key, int64_t code, PyObject* run, uint64_t seen,
           const Redirect* redirect = nullptr) {
  std::vector<PyObject*> released;
  {
    std::lock_guard<std::mutex> guard(table_mutex);
    if (epoch.load() != seen) {
      return;  // the evidence changed while Python decided: this answer may be stale
    }
    if (table.size() >= capacity) {
      released = drop_table();
    }
    if (run != nullptr) {
      Py_INCREF(run);
    }
    auto [it, inserted] = table.emplace(std::move(key), Entry{code, run, redirect});
    if (!inserted && run != nullptr) {
      released.push_back(run);
    }
  }
  for (PyObject* each : released) {
    Py_DECREF(each);
  }
}

class RoutingKernel final : public c10::OperatorKernel {
 public:
  explicit RoutingKernel(Overload* overload) : overload_(overload) {}

  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet keyset, torch::jit::Stack* stack) {
    Overload& o = *overload_;
    if (tls_frame == 0 || tls_busy) {
      if (tls_frame == 0 && !tls_busy && traced(keyset)) {
        return call_python(o, o.slow, op, keyset, stack);  // torch.compile records a trace outside use()
      }
      return o.native->callBoxed(op, keyset, stack);
    }
    if (tls_record || traced(keyset)) {  // recording, or a trace: the Python kernel records what it decides
      return call_python(o, o.slow, op, keyset, stack);
    }
    const size_t count = o.arguments.size();
    const c10::IValue* args = &(*stack)[stack->size() - count];
    bool wrapped = false;
    if (!build_key(o, args, count, &wrapped)) {
      return call_python(o, o.slow, op, keyset, stack);
    }
    if (wrapped) {
      return o.native->callBoxed(op, keyset, stack);
    }
    Entry entry{kMiss, nullptr};
    uint64_t seen;
    {
      std::lock_guard<std::mutex> guard(table_mutex);
      seen = epoch.load();
      auto found = table.find(tls_key);
      if (found != table.end()) {
        entry = found->second;
      }
    }
    if (entry.code == kPass) {
      return o.native->callBoxed(op, keyset, stack);
    }
    if (entry.code == kNative) {
      BusyGuard busy;
      return o.native->callBoxed(op, keyset, stack);
    }
    if (entry.code == kOp) {
      BusyGuard busy;
      return call_redirect(*entry.redirect, stack);
    }
    decide_and_run(op, keyset, stack, entry, seen);
  }

  // The op of ours a cpp_op composite names, on the call's arguments; for an in-place overload, its in-place twin
  // where it has one (one call and one autograd node: no copy) and nothing functionalizes, else out of place and then
  // copied into self, which is the result (the Python runner's args[0].copy_(composite(...))).
  void call_redirect(const Redirect& redirect, torch::jit::Stack* stack) {
    if (!overload_->inplace) {
      return redirect.op.callBoxed(stack);
    }
    at::Tensor self = (*stack)[stack->size() - overload_->arguments.size()].toTensor();
    if (redirect.inplace && !functionalizing(self)) {
      return redirect.inplace->callBoxed(stack);
    }
    redirect.op.callBoxed(stack);
    const at::Tensor result = torch::jit::pop(*stack).toTensor();
    self.copy_(result);
    torch::jit::push(*stack, std::move(self));
  }

 private:
  void decide_and_run(const c10::OperatorHandle& op, c10::DispatchKeySet keyset, torch::jit::Stack* stack,
                      Entry entry, uint64_t seen) {
    Overload& o = *overload_;
    const size_t count = o.arguments.size();
    int64_t code;
    const Redirect* redirect = nullptr;
    {
      py::gil_scoped_acquire gil;
      PythonArguments arguments(o, &(*stack)[stack->size() - count], nullptr);
      py::object run;
      if (entry.code == kRun && epoch.load() == seen) {
        run = py::reinterpret_borrow<py::object>(entry.run);  // still alive: clearing takes the GIL we hold
        code = kRun;
      } else {
        std::vector<int64_t> key = tls_key;  // Python may route other calls, which reuse the scratch key
        py::object decided = arguments.call(o.decide);
        if (PyLong_Check(decided.ptr())) {
          code = decided.cast<int64_t>();
          TORCH_CHECK(code == kPass || code == kNative, "multicomposite: a decision returned the code ", code);
          store(std::move(key), code, nullptr, seen);
        } else if (PyUnicode_Check(decided.ptr())) {  // the name of an op of ours that takes the call as it is
          code = kOp;
          redirect = redirect_of(decided.cast<std::string>());
          store(std::move(key), code, nullptr, seen, redirect);
        } else {
          code = kRun;
          run = decided;
          store(std::move(key), code, run.ptr(), seen);
        }
      }
      if (code == kRun) {
        py::object out;
        {
          BusyGuard busy;
          out = arguments.call(run);
        }
        torch::jit::drop(*stack, count);
        push_result(op, stack, out);
        return;
      }
    }
    if (code == kPass) {
      return o.native->callBoxed(op, keyset, stack);
    }
    BusyGuard busy;
    if (code == kOp) {
      return call_redirect(*redirect, stack);
    }
    o.native->callBoxed(op, keyset, stack);
  }

  Overload* overload_;
};

// NOTE: the region kernels (registry/core/fresh_buffers.py) act only inside an automatically functionalized region,
// but once the first region has registered them they sit at the front key of every buffer-making op (clone,
// ones_like, new_zeros, ...) for every transform in the process, inside use() and outside it: as Python kernels
// there, every clone under vmap(grad) cost 7.2 us instead of 3.1, every ones_like 9.1 instead of 2.8 (measured, one
// thread). This kernel calls the Python one only while a region is open on this thread, and PyTorch's kernel at
// the key (captured when it was registered) otherwise.
// Inside a batched-buffers region the buffer-making ops need no Python: fresh_buffers.cpp makes the buffer batched
// where the region batches it, and PyTorch's kernel runs everywhere else (NOTE [batched buffers in C++]).
enum class BufferRole : int64_t {
  kOther = 0,     // never batched (clone, copy): PyTorch's kernel in a batched-buffers region
  kFactory = 1,   // zeros, ones, empty, full: no tensor argument
  kTemplate = 2,  // the *_like and new_* ops: the first argument is the tensor they take shape or options from
};

class RegionKernel final : public c10::OperatorKernel {
 public:
  RegionKernel(Overload* overload, BufferRole role) : overload_(overload), role_(role) {}

  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet keyset, torch::jit::Stack* stack) {
    if (tls_open_regions == 0) {
      return overload_->native->callBoxed(op, keyset, stack);
    }
    if (tls_batched_region_level >= 0) {
      if (role_ != BufferRole::kOther &&
          make_batched_buffer(op, stack, role_ == BufferRole::kTemplate, tls_batched_region_level,
                              tls_batched_buffer_limit)) {
        return;
      }
      return overload_->native->callBoxed(op, keyset, stack);
    }
    call_python(*overload_, overload_->slow, op, keyset, stack);
  }

 private:
  Overload* overload_;
  BufferRole role_;
};

// What makes the Python kernel of an out= overload from its name ("mul.out"), at its first call inside use():
// registry.core.out_arguments. Never freed, like the overloads.
py::object* out_factory = nullptr;
bool out_kernels_registered = false;  // since the Library was made
bool batch_rules_registered = false;  // since the Library was made

// The kernel of an out= overload (registry/core/out_arguments.py says why they exist): registered with the routing
// kernels, so that no transform has to find out first, from PyTorch's refusal, that a program passes out=. Outside
// use() or inside a decided call: PyTorch's own kernel, without the GIL. Otherwise the overload's Python kernel: its
// result, or NotImplemented for PyTorch's own kernel (policy native, no functional twin). The busy flag stays as it
// is while the Python kernel runs: the functional twin it calls is a call like any other, routed where covered.
class OutKernel final : public c10::OperatorKernel {
 public:
  explicit OutKernel(Overload* overload) : overload_(overload) {}

  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet keyset, torch::jit::Stack* stack) {
    Overload& o = *overload_;
    if (tls_frame == 0 || tls_busy) {
      return o.native->callBoxed(op, keyset, stack);
    }
    const size_t count = o.arguments.size();
    {
      py::gil_scoped_acquire gil;
      if (!o.slow) {
        o.slow = (*out_factory)(o.name);
      }
      PythonArguments arguments(o, &(*stack)[stack->size() - count], nullptr);
      py::object out = arguments.call(o.slow);
      if (out.ptr() != Py_NotImplemented) {
        torch::jit::drop(*stack, count);
        push_result(op, stack, out);
        return;
      }
    }
    o.native->callBoxed(op, keyset, stack);
  }

 private:
  Overload* overload_;
};

Convert convert_of(const c10::TypePtr& type) {
  c10::TypePtr inner = type;
  if (auto optional = type->cast<c10::OptionalType>()) {
    inner = optional->getElementType();
  }
  switch (inner->kind()) {
    case c10::TypeKind::ScalarTypeType:
      return kDtype;
    case c10::TypeKind::LayoutType:
      return kLayout;
    case c10::TypeKind::MemoryFormatType:
      return kMemoryFormat;
    default:
      return kGeneric;
  }
}

c10::DispatchKey parse_key(const std::string& name) {
  if (name == "FuncTorchDynamicLayerFrontMode") {
    return c10::DispatchKey::FuncTorchDynamicLayerFrontMode;
  }
  if (name == "Autograd") {
    return c10::DispatchKey::Autograd;
  }
  TORCH_CHECK(false, "multicomposite: routing kernels go at FuncTorchDynamicLayerFrontMode or Autograd, not ", name);
}

// Drop a warning: "Overriding a previously registered kernel" is what registering here means.
struct QuietHandler : public c10::WarningHandler {
  void process(const c10::Warning&) override {}
};

// The Library that holds every kernel: destroying it unregisters them (switching to the Python kernels).
std::unique_ptr<torch::Library> library;

torch::Library& routing_library() {
  if (!library) {
    library = std::make_unique<torch::Library>(torch::Library::IMPL, "aten", std::nullopt, __FILE__, __LINE__);
  }
  return *library;
}

Overload* new_overload(const std::string& name, const c10::OperatorHandle& handle, c10::DispatchKey key,
                       c10::DispatchKey native_key) {
  auto* o = new Overload();
  o->id = static_cast<int64_t>(overloads.size()) + 1;
  o->name = name;
  o->key = key;
  o->native = handle.getComputedKernelForDispatchKey(native_key);
  o->inplace = writes_first(handle.schema());
  for (const auto& argument : handle.schema().arguments()) {
    o->arguments.push_back(Argument{py::str(argument.name()), argument.kwarg_only(),
                                    convert_of(argument.real_type()), argument.default_value()});
  }
  overloads.push_back(o);
  return o;
}

// The overload of aten named `name` (packet.overload), its kernel at `key` to be registered over PyTorch's at
// `native_key`.
Overload* aten_overload(const std::string& name, c10::DispatchKey key, c10::DispatchKey native_key) {
  const auto dot = name.find('.');
  const std::string packet = name.substr(0, dot);
  const std::string overload_name = dot == std::string::npos ? "" : name.substr(dot + 1);
  auto handle = c10::Dispatcher::singleton().findSchemaOrThrow(("aten::" + packet).c_str(), overload_name.c_str());
  return new_overload(name, handle, key, native_key);
}

// `kernel` into the routing Library at the overload's key (over PyTorch's: the warning that says so is dropped).
template <class Kernel>
void register_kernel(const Overload& o, std::unique_ptr<Kernel> kernel) {
  QuietHandler quiet;
  c10::WarningUtils::WarningHandlerGuard guard(&quiet);
  routing_library().impl(o.name.c_str(),
                         torch::dispatch(o.key, torch::CppFunction::makeFromBoxedFunctor(std::move(kernel))));
}

// Register the out= kernel of every aten overload with out arguments and no kernel at the front key (a routed
// overload keeps its routing kernel); returns how many.
size_t register_out_kernels(py::object factory) {
  if (out_factory == nullptr) {
    out_factory = new py::object();
  }
  *out_factory = std::move(factory);
  constexpr auto key = c10::DispatchKey::FuncTorchDynamicLayerFrontMode;
  auto& dispatcher = c10::Dispatcher::singleton();
  QuietHandler quiet;
  c10::WarningUtils::WarningHandlerGuard guard(&quiet);
  size_t registered = 0;
  for (const auto& op_name : dispatcher.getAllOpNames()) {
    if (op_name.name.rfind("aten::", 0) != 0) {
      continue;
    }
    auto handle = dispatcher.findSchema(op_name);
    if (!handle.has_value() || !handle->hasSchema() || handle->hasKernelForDispatchKey(key)) {
      continue;
    }
    const auto& arguments = handle->schema().arguments();
    if (std::none_of(arguments.begin(), arguments.end(), [](const c10::Argument& a) { return a.is_out(); })) {
      continue;
    }
    std::string name = op_name.name.substr(6);
    if (!op_name.overload_name.empty()) {
      name += "." + op_name.overload_name;
    }
    Overload* o = new_overload(name, *handle, key, key);
    routing_library().impl(name.c_str(), torch::dispatch(key, torch::CppFunction::makeFromBoxedFunctor(
                                                                  std::make_unique<OutKernel>(o))));
    ++registered;
  }
  out_kernels_registered = true;
  return registered;
}

PyObject* set_frame(PyObject* /*self*/, PyObject* arg) {
  const long long frame = PyLong_AsLongLong(arg);
  if (frame == -1 && PyErr_Occurred()) {
    return nullptr;
  }
  tls_record = frame < 0;
  const long long id = frame < 0 ? -frame : frame;
  tls_native_policy = (id & kNativePolicyBit) != 0;
  tls_frame = id & ~kNativePolicyBit;
  Py_RETURN_NONE;
}

PyObject* busy(PyObject* /*self*/, PyObject* /*unused*/) { return PyBool_FromLong(tls_busy); }

PyMethodDef set_frame_method = {"set_frame", set_frame, METH_O,
                                "The innermost use() frame of this thread (0: none; negative: its id, and it records)"};
PyMethodDef busy_method = {"busy", busy, METH_NOARGS, "Whether this thread is inside a call a kernel decided"};

}  // namespace

// batch_rules.cpp's rules apply inside use() only, under a policy other than "native".
bool batch_rules_apply() { return tls_frame != 0 && !tls_native_policy; }

void bind_random_state(py::module& m);  // random_state.cpp
size_t register_batch_rules(torch::Library& library);  // batch_rules.cpp
bool backward_is_first_order(const std::vector<at::Tensor>& outputs);  // first_order.cpp
std::vector<at::Tensor> first_order_gradients(const std::vector<at::Tensor>& outputs,
                                              const std::vector<at::Tensor>& grad_outputs,
                                              const std::vector<at::Tensor>& inputs);  // first_order.cpp
void set_batch_rules_enabled(bool enabled);            // batch_rules.cpp
void set_below_levels_enabled(bool enabled);           // batch_rules.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "multicomposite's routing kernels at FuncTorchDynamicLayerFrontMode";
  bind_random_state(m);
  m.def(
      "register",
      [](const std::string& name, const std::string& key_name, const std::string& native_key_name,
         py::object decide, py::object slow) {
        Overload* o = aten_overload(name, parse_key(key_name), c10::parseDispatchKey(native_key_name));
        o->decide = std::move(decide);
        o->slow = std::move(slow);
        register_kernel(*o, std::make_unique<RoutingKernel>(o));
      },
      "Register the routing kernel of one aten overload (packet.overload) at a key, over PyTorch's kernel at "
      "native_key");
  m.def(
      "register_region_kernel",
      [](const std::string& name, py::object kernel, int64_t role) {
        constexpr auto key = c10::DispatchKey::FuncTorchDynamicLayerFrontMode;
        TORCH_CHECK(role >= 0 && role <= 2, "register_region_kernel: role is 0 (other), 1 (factory) or 2 (template), "
                    "not ", role);
        Overload* o = aten_overload(name, key, key);
        o->slow = std::move(kernel);
        register_kernel(*o, std::make_unique<RegionKernel>(o, static_cast<BufferRole>(role)));
      },
      py::arg("name"), py::arg("kernel"), py::arg("role"),
      "Register a region kernel of one aten overload at the front key: kernel(keyset, *args, **kwargs) while a region "
      "is open on the calling thread, PyTorch's kernel there otherwise (the NOTE above RegionKernel); role: how a "
      "batched-buffers region's C++ treats it (0 other, 1 factory, 2 takes a template tensor first)");
  m.def(
      "set_open_regions",
      [](int64_t count, int64_t batched_level, int64_t limit) {
        tls_open_regions = count;
        tls_batched_region_level = batched_level;
        tls_batched_buffer_limit = limit;
      },
      py::arg("count"), py::arg("batched_level") = -1, py::arg("limit") = 0,
      "How many regions (functionalized or batched-buffers) are open on this thread (the region kernels' gate); "
      "batched_level: the innermost region's vmap level where it is a batched-buffers region whose buffers C++ makes "
      "(-1: none), limit: the most elements over the batch such a buffer may have");
  m.def("registered", []() { return static_cast<bool>(library); }, "Whether the kernels are registered");
  m.def("register_out", &register_out_kernels,
        "Register the out= kernel of every aten out= overload without a kernel at the front key; factory(name) "
        "makes an overload's Python kernel ((*args, **kwargs) -> result, or NotImplemented for PyTorch's own)");
  m.def("out_registered", []() { return out_kernels_registered; }, "Whether the out= kernels are registered");
  m.def(
      "register_batch_rules",
      []() {
        QuietHandler quiet;
        c10::WarningUtils::WarningHandlerGuard guard(&quiet);
        const size_t registered = register_batch_rules(routing_library());
        batch_rules_registered = true;
        return registered;
      },
      "Register the C++ batching rules of batch_rules.cpp (over functorch's Python decompositions, which must be "
      "registered first); returns how many");
  m.def("backward_is_first_order", &backward_is_first_order, py::arg("outputs"),
        "Whether grad is the innermost functorch level with only vmap levels below it and nothing below the "
        "functorch wrappers can differentiate a backward of these outputs again (first_order.cpp)");
  m.def("first_order_gradients", &first_order_gradients, py::arg("outputs"), py::arg("grad_outputs"),
        py::arg("inputs"), py::call_guard<py::gil_scoped_release>(),
        "The first-order gradients of outputs with respect to inputs with the grad level set aside while the engine "
        "runs (first_order.cpp's NOTE); undefined (None) where an input is unused");
  m.def("batch_rules_registered", []() { return batch_rules_registered; },
        "Whether the C++ batching rules are registered");
  m.def("set_batch_rules_enabled", &set_batch_rules_enabled,
        "Off: the C++ batching rules run the kernels they override, inside use() too (a benchmark's baseline)");
  m.def("set_below_levels_enabled", &set_below_levels_enabled,
        "Off: every op a C++ batching rule calls goes through functorch's back fallback, under the last level too "
        "(batch_rules.cpp: NOTE [kernels under the last level]; a benchmark's baseline)");
  m.def(
      "unregister_all",
      []() {
        library.reset();
        out_kernels_registered = false;
        batch_rules_registered = false;
      },
      "Unregister every kernel (the Python kernels can then be registered in their place)");
  // NOTE: set_frame and busy are plain CPython functions, not m.def's: every use() block calls set_frame twice, and
  // pybind11's dispatcher (argument casters, overload resolution) costs about 40 ns a call over a METH_O function,
  // most of what a `with use(): pass` block would cost more than the module-global routing before the Registry object.
  m.add_object("set_frame", py::reinterpret_steal<py::object>(PyCFunction_NewEx(&set_frame_method, nullptr, nullptr)));
  m.add_object("busy", py::reinterpret_steal<py::object>(PyCFunction_NewEx(&busy_method, nullptr, nullptr)));
  m.def("frame", []() { return tls_frame; });
  m.def(
      "clear",
      []() {
        std::vector<PyObject*> released;
        {
          std::lock_guard<std::mutex> guard(table_mutex);
          released = drop_table();
        }
        for (PyObject* run : released) {
          Py_DECREF(run);  // the GIL is held: this is called from Python
        }
      },
      "Forget every stored decision (the evidence changed)");
  m.def("size", []() {
    std::lock_guard<std::mutex> guard(table_mutex);
    return table.size();
  });
  m.def(
      "set_capacity", [](size_t n) { capacity = n; }, "The most entries the table holds before it is dropped whole");
}
