// The CPU generator's state saved and put back without a tensor (registry/core/random_state.py uses these).
//
// A transform that may run again (registry/core/out_arguments.py's retry, vmap's in
// registry/core/functionalization.py) saves the random state before every run, so that the run again draws what the
// first drew. torch.get_rng_state() builds a 5 KB byte tensor each time, widening the Mersenne Twister's 624 words
// one by one (about 9,600 instructions a call under callgrind, two fifths of what a routed vmap(grad) call inside
// use() cost over the tree before the Registry object); copying the engine itself is one memcpy. The saved state is
// a capsule that owns its copy, so saves nest (vmap(grad) saves at both levels) and go with the garbage collector
// like any object.

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/Generator.h>
#include <torch/csrc/utils/pybind.h>

#include <mutex>
#include <optional>

namespace {

constexpr const char* kCapsuleName = "multicomposite.cpu_random_state";

struct CpuRandomState {
  at::mt19937 engine;
  std::optional<float> next_float_normal;    // Box-Muller's second sample, which the next normal draw returns
  std::optional<double> next_double_normal;
};

void release(PyObject* capsule) {
  delete static_cast<CpuRandomState*>(PyCapsule_GetPointer(capsule, kCapsuleName));
}

py::object save() {
  at::Generator generator = at::detail::getDefaultCPUGenerator();
  auto* impl = at::check_generator<at::CPUGeneratorImpl>(generator);
  CpuRandomState* state = nullptr;
  {
    std::lock_guard<std::mutex> lock(generator.mutex());
    state = new CpuRandomState{impl->engine(), impl->next_float_normal_sample(), impl->next_double_normal_sample()};
  }
  PyObject* capsule = PyCapsule_New(state, kCapsuleName, release);
  if (capsule == nullptr) {
    delete state;
    throw py::error_already_set();
  }
  return py::reinterpret_steal<py::object>(capsule);
}

void restore(const py::object& saved) {
  auto* state = static_cast<CpuRandomState*>(PyCapsule_GetPointer(saved.ptr(), kCapsuleName));
  if (state == nullptr) {
    throw py::error_already_set();  // not a state save() returned: PyCapsule_GetPointer set a ValueError
  }
  at::Generator generator = at::detail::getDefaultCPUGenerator();
  auto* impl = at::check_generator<at::CPUGeneratorImpl>(generator);
  std::lock_guard<std::mutex> lock(generator.mutex());
  impl->set_engine(state->engine);
  impl->set_next_float_normal_sample(state->next_float_normal);
  impl->set_next_double_normal_sample(state->next_double_normal);
}

}  // namespace

void bind_random_state(py::module& m) {
  m.def("save_cpu_random_state", &save, "The default CPU generator's state, as an opaque object");
  m.def("restore_cpu_random_state", &restore, "Put back a state save_cpu_random_state returned");
}
