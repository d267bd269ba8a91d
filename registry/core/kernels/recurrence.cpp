// multicomposite::lstm_steps / lstm_steps_backward and gru_steps / gru_steps_backward: the recurrences of
// composites/recurrent.py's LSTMRecurrence and GRURecurrence primitives (their forward, and BPTT with the forward
// recomputed) on ordinary CPU tensors.
//
// NOTE: why in C++. The primitive runs its steps on plain tensors, but in Python: about 9 ops a step forward and 30
// backward (the recomputed forward and the gate gradients), each a Python call and a dispatch, about 600 for a
// 16-step layer. Profiled on bench.models' nn.LSTM classifier at batch 4 (16 steps, hidden 64), that Python was most of
// a 3.3 ms step whose floor (PyTorch's fused LSTM kernel over the batch) is 0.6 ms. Here each step is one matrix
// product, the activations over the whole gate block and loops over the rows; the hidden weight's per-sample gradient
// is one batched product over the steps, as in the Python backward. One layer at 4 samples, 16 steps, hidden 64:
// forward 463 -> 112 us, backward 1,704 -> 275 us (one thread). composites/recurrent.py calls these where every
// tensor is an ordinary CPU float or double tensor and the states and the projection share their leading
// (per-sample) dimensions; elsewhere its Python loop.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/functorch/BatchedTensorImpl.h>
#include <ATen/functorch/DynamicLayer.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/library.h>

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace multicomposite_functorch {
bool plain(const at::Tensor& t);  // batch_rules.cpp: not batched, not wrapped by any functorch level
class BelowLevels {  // batch_rules.cpp: NOTE [kernels under the last level]
 public:
  explicit BelowLevels(bool operands_plain);
  ~BelowLevels();
  BelowLevels(const BelowLevels&) = delete;
  BelowLevels& operator=(const BelowLevels&) = delete;

 private:
  std::optional<c10::impl::ForceDispatchKeyGuard> keys_;
  std::optional<at::functorch::DynamicLayer> level_;
};
}  // namespace multicomposite_functorch

namespace {

using at::Tensor;

// The shapes: projected (*lead, T, N, 4H); the states (*lead, N, H); w_hh (4H, H). Rows: the lead dimensions times N.
struct Shape {
  std::vector<int64_t> lead;
  int64_t lead_size = 1, steps = 0, batch = 0, gates = 0, hidden = 0;

  // gate_count: 4 (the LSTM's i, f, g, o) or 3 (the GRU's r, z, n).
  Shape(const Tensor& projected, const Tensor& h0, int64_t gate_count) {
    TORCH_CHECK(projected.dim() >= 3 && h0.dim() == projected.dim() - 1,
                "multicomposite: projected (*lead, T, N, gates * H) and states (*lead, N, H) expected");
    lead.assign(projected.sizes().begin(), projected.sizes().end() - 3);
    for (int64_t size : lead) lead_size *= size;
    steps = projected.size(-3);
    batch = projected.size(-2);
    gates = projected.size(-1);
    hidden = h0.size(-1);
    TORCH_CHECK(gates == gate_count * hidden, "multicomposite: the projection's last size must be ", gate_count,
                " * hidden");
  }
  int64_t rows() const { return lead_size * batch; }
  // (*lead, T, N, W) -> (T, rows, W), contiguous.
  Tensor steps_first(const Tensor& t, int64_t width) const {
    return t.reshape({lead_size, steps, batch, width}).transpose(0, 1).contiguous().view({steps, rows(), width});
  }
  // (T, rows, W) -> (*lead, T, N, W), contiguous.
  Tensor lead_first(const Tensor& t, int64_t width) const {
    std::vector<int64_t> sizes = lead;
    sizes.insert(sizes.end(), {steps, batch, width});
    return t.view({steps, lead_size, batch, width}).transpose(0, 1).contiguous().view(sizes);
  }
  std::vector<int64_t> state_sizes() const {
    std::vector<int64_t> sizes = lead;
    sizes.insert(sizes.end(), {batch, hidden});
    return sizes;
  }
  // The state after the last step taken, (*lead, N, H), from the steps' outputs `out` (T, rows, H).
  Tensor last_state(const Tensor& out, const Tensor& h0_rows, bool reverse) const {
    const Tensor last = steps == 0 ? h0_rows : out[reverse ? 0 : steps - 1];
    return last.clone().view(state_sizes());
  }
  // Each step's previous state, (T, rows, H): h0 before the first step taken, the step before's output after it.
  Tensor previous_states(const Tensor& out, const Tensor& h0_rows, bool reverse) const {
    Tensor previous = at::empty_like(out);
    for (int64_t position = 0; position < steps; ++position) {
      const int64_t t = reverse ? steps - 1 - position : position;
      previous[t].copy_(position == 0 ? h0_rows : out[reverse ? t + 1 : t - 1]);
    }
    return previous;
  }
  // (T, rows, W) -> (lead, T * N, W): each sample's rows over every step, for one product per sample.
  Tensor per_sample(const Tensor& t, int64_t width) const {
    return t.view({steps, lead_size, batch, width}).transpose(0, 1).reshape({lead_size, steps * batch, width});
  }
};

// The steps in order (or reversed): out (T, rows, H) holds each step's h; `c` (rows, H) is updated in place. Where
// `kept` is given, each step's activated gates (i, f, g, o; (T, rows, 4H)), its previous c and tanh of its new c
// ((T, rows, H) each) are kept for the backward.
// NOTE: the activations run as PyTorch's vectorized kernels over the whole gate block (sigmoid_, tanh_out): a
// scalar exp or tanh per element in the loop made a step 16.7 us at 4 x 256 gates. g's tanh is taken as
// 2 sigmoid(2x) - 1, so that one sigmoid_ covers the four gates.
struct Kept {
  Tensor gates, c_before, tanh_c;
};

template <typename T>
void run_steps(const Shape& shape, const Tensor& projected_steps, const Tensor& h0_rows, Tensor& c, const Tensor& w_t,
               bool reverse, Tensor& out, Kept* kept) {
  const int64_t rows = shape.rows(), hidden = shape.hidden, gates_width = shape.gates;
  Tensor h = h0_rows;
  const Tensor scratch = kept != nullptr ? Tensor() : at::empty({rows, gates_width}, c.options());
  for (int64_t position = 0; position < shape.steps; ++position) {
    const int64_t t = reverse ? shape.steps - 1 - position : position;
    Tensor gates = kept != nullptr ? kept->gates[t] : scratch;
    at::addmm_out(gates, projected_steps[t], h, w_t);
    T* g_ptr = gates.data_ptr<T>();
    for (int64_t r = 0; r < rows; ++r) {
      T* g_pre = g_ptr + r * gates_width + 2 * hidden;
      for (int64_t j = 0; j < hidden; ++j) g_pre[j] *= T(2);
    }
    gates.sigmoid_();
    T* c_ptr = c.data_ptr<T>();
    T* before_ptr = kept != nullptr ? kept->c_before[t].data_ptr<T>() : nullptr;
    for (int64_t r = 0; r < rows; ++r) {
      T* row = g_ptr + r * gates_width;
      for (int64_t j = 0; j < hidden; ++j) {
        const T i = row[j], f = row[hidden + j], g = T(2) * row[2 * hidden + j] - T(1);
        row[2 * hidden + j] = g;
        const T c_prev = c_ptr[r * hidden + j];
        if (before_ptr != nullptr) before_ptr[r * hidden + j] = c_prev;
        c_ptr[r * hidden + j] = f * c_prev + i * g;
      }
    }
    Tensor h_next = out[t];
    Tensor tanh_c = kept != nullptr ? kept->tanh_c[t] : h_next;
    at::tanh_out(tanh_c, c);
    const T* tanh_ptr = tanh_c.const_data_ptr<T>();
    T* h_ptr = h_next.data_ptr<T>();
    for (int64_t r = 0; r < rows; ++r) {
      const T* o = g_ptr + r * gates_width + 3 * hidden;
      for (int64_t j = 0; j < hidden; ++j) h_ptr[r * hidden + j] = o[j] * tanh_ptr[r * hidden + j];
    }
    h = h_next;
  }
}

// The recurrences' preconditions (composites/recurrent.py's _cpp_steps checks them before calling): CPU tensors of
// one dtype, a 2-d hidden weight, a 1-d hidden bias or none. The shapes are Shape's.
void check_inputs(const char* op, std::initializer_list<Tensor> tensors, const Tensor& w_hh,
                  const std::optional<Tensor>& b_hh = std::nullopt) {
  TORCH_CHECK(w_hh.dim() == 2 && (!b_hh.has_value() || b_hh->dim() == 1), op,
              ": a 2-d hidden weight and a 1-d hidden bias or none expected");
  std::vector<Tensor> all(tensors);
  all.push_back(w_hh);
  if (b_hh.has_value()) all.push_back(*b_hh);
  for (const Tensor& t : all) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == w_hh.scalar_type(), op, " runs on CPU tensors of one dtype");
  }
}

std::tuple<Tensor, Tensor, Tensor> lstm_steps(const Tensor& projected, const Tensor& h0, const Tensor& c0,
                                              const Tensor& w_hh, bool reverse) {
  check_inputs("multicomposite::lstm_steps", {projected, h0, c0}, w_hh);
  TORCH_CHECK(h0.sizes() == c0.sizes(), "multicomposite::lstm_steps: h0 and c0 of one shape expected");
  at::AutoDispatchBelowADInplaceOrView below;  // ordinary tensors, called where nothing records
  const Shape shape(projected, h0, 4);
  const Tensor steps = shape.steps_first(projected, shape.gates);
  const Tensor h_rows = h0.reshape({shape.rows(), shape.hidden}).contiguous();
  Tensor c = c0.reshape({shape.rows(), shape.hidden}).clone(at::MemoryFormat::Contiguous);
  Tensor out = at::empty({shape.steps, shape.rows(), shape.hidden}, h0.options());
  const Tensor w_t = w_hh.t();
  AT_DISPATCH_FLOATING_TYPES(projected.scalar_type(), "multicomposite::lstm_steps", [&] {
    run_steps<scalar_t>(shape, steps, h_rows, c, w_t, reverse, out, nullptr);
  });
  return {shape.lead_first(out, shape.hidden), shape.last_state(out, h_rows, reverse), c.view(shape.state_sizes())};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> lstm_steps_backward(const Tensor& projected, const Tensor& h0,
                                                               const Tensor& c0, const Tensor& w_hh,
                                                               const Tensor& d_out, const Tensor& d_h,
                                                               const Tensor& d_c, bool reverse) {
  check_inputs("multicomposite::lstm_steps_backward", {projected, h0, c0, d_out, d_h, d_c}, w_hh);
  TORCH_CHECK(h0.sizes() == c0.sizes(), "multicomposite::lstm_steps_backward: h0 and c0 of one shape expected");
  at::AutoDispatchBelowADInplaceOrView below;  // ordinary tensors, called where nothing records
  const Shape shape(projected, h0, 4);
  const int64_t rows = shape.rows(), hidden = shape.hidden, width = shape.gates, steps_count = shape.steps;
  const Tensor steps = shape.steps_first(projected, width);
  const Tensor h_rows = h0.reshape({rows, hidden}).contiguous();
  Tensor c = c0.reshape({rows, hidden}).clone(at::MemoryFormat::Contiguous);
  Tensor out = at::empty({steps_count, rows, hidden}, h0.options());
  Kept kept{at::empty({steps_count, rows, width}, h0.options()), at::empty({steps_count, rows, hidden}, h0.options()),
            at::empty({steps_count, rows, hidden}, h0.options())};
  const Tensor w_t = w_hh.t();
  const Tensor d_out_steps = shape.steps_first(d_out, hidden);
  Tensor dh = d_h.reshape({rows, hidden}).clone(at::MemoryFormat::Contiguous);
  Tensor dc = d_c.reshape({rows, hidden}).clone(at::MemoryFormat::Contiguous);
  Tensor d_gates = at::empty({steps_count, rows, width}, h0.options());
  const Tensor w = w_hh.contiguous();
  AT_DISPATCH_FLOATING_TYPES(projected.scalar_type(), "multicomposite::lstm_steps_backward", [&] {
    run_steps<scalar_t>(shape, steps, h_rows, c, w_t, reverse, out, &kept);
    for (int64_t position = 0; position < steps_count; ++position) {  // the forward's steps, last first
      const int64_t t = reverse ? position : steps_count - 1 - position;
      dh.add_(d_out_steps[t]);
      const scalar_t* k_ptr = kept.gates[t].const_data_ptr<scalar_t>();
      const scalar_t* before_ptr = kept.c_before[t].const_data_ptr<scalar_t>();
      const scalar_t* tanh_ptr = kept.tanh_c[t].const_data_ptr<scalar_t>();
      const scalar_t* dh_ptr = dh.const_data_ptr<scalar_t>();
      scalar_t* dc_ptr = dc.data_ptr<scalar_t>();
      scalar_t* dg_ptr = d_gates[t].data_ptr<scalar_t>();
      for (int64_t r = 0; r < rows; ++r) {
        const scalar_t* k = k_ptr + r * width;
        scalar_t* dg = dg_ptr + r * width;
        for (int64_t j = 0; j < hidden; ++j) {
          const scalar_t i = k[j], f = k[hidden + j], g = k[2 * hidden + j], o = k[3 * hidden + j];
          const scalar_t c_prev = before_ptr[r * hidden + j];
          const scalar_t tanh_c = tanh_ptr[r * hidden + j];
          const scalar_t d_hj = dh_ptr[r * hidden + j];
          const scalar_t d_o = d_hj * tanh_c;
          const scalar_t d_cj = dc_ptr[r * hidden + j] + d_hj * o * (scalar_t(1) - tanh_c * tanh_c);
          dg[j] = d_cj * g * i * (scalar_t(1) - i);
          dg[hidden + j] = d_cj * c_prev * f * (scalar_t(1) - f);
          dg[2 * hidden + j] = d_cj * i * (scalar_t(1) - g * g);
          dg[3 * hidden + j] = d_o * o * (scalar_t(1) - o);
          dc_ptr[r * hidden + j] = d_cj * f;
        }
      }
      dh = at::mm(d_gates[t], w);
    }
  });
  // Each sample's hidden-weight gradient: its steps' gate gradients times the states they multiplied, summed over
  // the steps and rows, as one batched product over the lead dimensions.
  const Tensor previous = shape.previous_states(out, h_rows, reverse);
  Tensor d_w = at::bmm(shape.per_sample(d_gates, width).transpose(1, 2), shape.per_sample(previous, hidden));
  std::vector<int64_t> w_sizes = shape.lead;
  w_sizes.insert(w_sizes.end(), {width, hidden});
  return {shape.lead_first(d_gates, width), dh.view(shape.state_sizes()), dc.view(shape.state_sizes()),
          d_w.view(w_sizes)};
}

// --- the GRU's recurrence (composites/recurrent.py's GRURecurrence), PyTorch's formulas ------------------------
//
// Each step: the hidden product (plus the hidden bias) in one addmm, the reset and update gates' pre-activations and
// one sigmoid_ over both, the new gate's pre-activation and one tanh_, and h' = (h - n) z + n. Kept for the
// backward: each step's hidden product and its activated gates (r, z, n).
template <typename T>
void run_gru_steps(const Shape& shape, const Tensor& projected_steps, const Tensor& h0_rows,
                   const std::optional<Tensor>& b_hh, const Tensor& w_t, bool reverse, Tensor& out, Tensor* kept_hw,
                   Tensor* kept_gates) {
  const int64_t rows = shape.rows(), hidden = shape.hidden, width = shape.gates;
  Tensor h = h0_rows;
  const Tensor scratch_hw = kept_hw != nullptr ? Tensor() : at::empty({rows, width}, h0_rows.options());
  const Tensor scratch_gates = kept_gates != nullptr ? Tensor() : at::empty({rows, width}, h0_rows.options());
  for (int64_t position = 0; position < shape.steps; ++position) {
    const int64_t t = reverse ? shape.steps - 1 - position : position;
    Tensor hw = kept_hw != nullptr ? (*kept_hw)[t] : scratch_hw;
    Tensor gates = kept_gates != nullptr ? (*kept_gates)[t] : scratch_gates;
    if (b_hh.has_value()) {
      at::addmm_out(hw, *b_hh, h, w_t);
    } else {
      at::mm_out(hw, h, w_t);
    }
    const T* x_ptr = projected_steps[t].const_data_ptr<T>();
    const T* hw_ptr = hw.const_data_ptr<T>();
    T* g_ptr = gates.data_ptr<T>();
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t j = 0; j < 2 * hidden; ++j) g_ptr[r * width + j] = x_ptr[r * width + j] + hw_ptr[r * width + j];
    }
    gates.narrow(1, 0, 2 * hidden).sigmoid_();
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t base = r * width;
      for (int64_t j = 0; j < hidden; ++j) {
        g_ptr[base + 2 * hidden + j] = x_ptr[base + 2 * hidden + j] + g_ptr[base + j] * hw_ptr[base + 2 * hidden + j];
      }
    }
    gates.narrow(1, 2 * hidden, hidden).tanh_();
    Tensor h_next = out[t];
    const T* h_ptr = h.const_data_ptr<T>();
    T* next_ptr = h_next.data_ptr<T>();
    for (int64_t r = 0; r < rows; ++r) {
      const T* g = g_ptr + r * width;
      for (int64_t j = 0; j < hidden; ++j) {
        const T z = g[hidden + j], n = g[2 * hidden + j];
        next_ptr[r * hidden + j] = (h_ptr[r * hidden + j] - n) * z + n;
      }
    }
    h = h_next;
  }
}

std::tuple<Tensor, Tensor> gru_steps(const Tensor& projected, const Tensor& h0, const Tensor& w_hh,
                                     const std::optional<Tensor>& b_hh, bool reverse) {
  check_inputs("multicomposite::gru_steps", {projected, h0}, w_hh, b_hh);
  at::AutoDispatchBelowADInplaceOrView below;  // ordinary tensors, called where nothing records
  const Shape shape(projected, h0, 3);
  const Tensor steps = shape.steps_first(projected, shape.gates);
  const Tensor h_rows = h0.reshape({shape.rows(), shape.hidden}).contiguous();
  Tensor out = at::empty({shape.steps, shape.rows(), shape.hidden}, h0.options());
  const Tensor w_t = w_hh.t();
  AT_DISPATCH_FLOATING_TYPES(projected.scalar_type(), "multicomposite::gru_steps", [&] {
    run_gru_steps<scalar_t>(shape, steps, h_rows, b_hh, w_t, reverse, out, nullptr, nullptr);
  });
  return {shape.lead_first(out, shape.hidden), shape.last_state(out, h_rows, reverse)};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> gru_steps_backward(const Tensor& projected, const Tensor& h0,
                                                              const Tensor& w_hh, const std::optional<Tensor>& b_hh,
                                                              const Tensor& d_out, const Tensor& d_h, bool reverse) {
  check_inputs("multicomposite::gru_steps_backward", {projected, h0, d_out, d_h}, w_hh, b_hh);
  at::AutoDispatchBelowADInplaceOrView below;  // ordinary tensors, called where nothing records
  const Shape shape(projected, h0, 3);
  const int64_t rows = shape.rows(), hidden = shape.hidden, width = shape.gates, steps_count = shape.steps;
  const Tensor steps = shape.steps_first(projected, width);
  const Tensor h_rows = h0.reshape({rows, hidden}).contiguous();
  Tensor out = at::empty({steps_count, rows, hidden}, h0.options());
  Tensor kept_hw = at::empty({steps_count, rows, width}, h0.options());
  Tensor kept_gates = at::empty({steps_count, rows, width}, h0.options());
  const Tensor w_t = w_hh.t();
  const Tensor w = w_hh.contiguous();
  const Tensor d_out_steps = shape.steps_first(d_out, hidden);
  Tensor dh = d_h.reshape({rows, hidden}).clone(at::MemoryFormat::Contiguous);
  Tensor d_inputs = at::empty({steps_count, rows, width}, h0.options());
  Tensor d_hidden = at::empty({steps_count, rows, width}, h0.options());
  Tensor previous;
  AT_DISPATCH_FLOATING_TYPES(projected.scalar_type(), "multicomposite::gru_steps_backward", [&] {
    run_gru_steps<scalar_t>(shape, steps, h_rows, b_hh, w_t, reverse, out, &kept_hw, &kept_gates);
    previous = shape.previous_states(out, h_rows, reverse);
    for (int64_t position = 0; position < steps_count; ++position) {  // the forward's steps, last first
      const int64_t t = reverse ? position : steps_count - 1 - position;
      dh.add_(d_out_steps[t]);
      const scalar_t* hw_ptr = kept_hw[t].const_data_ptr<scalar_t>();
      const scalar_t* g_ptr = kept_gates[t].const_data_ptr<scalar_t>();
      const scalar_t* hp_ptr = previous[t].const_data_ptr<scalar_t>();
      scalar_t* dh_ptr = dh.data_ptr<scalar_t>();
      scalar_t* di_ptr = d_inputs[t].data_ptr<scalar_t>();
      scalar_t* dw_ptr = d_hidden[t].data_ptr<scalar_t>();
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t base = r * width;
        for (int64_t j = 0; j < hidden; ++j) {
          const scalar_t reset = g_ptr[base + j], update = g_ptr[base + hidden + j], n = g_ptr[base + 2 * hidden + j];
          const scalar_t d = dh_ptr[r * hidden + j];
          const scalar_t d_new = d * (scalar_t(1) - update) * (scalar_t(1) - n * n);
          const scalar_t d_update = d * (hp_ptr[r * hidden + j] - n) * update * (scalar_t(1) - update);
          const scalar_t d_reset = d_new * hw_ptr[base + 2 * hidden + j] * reset * (scalar_t(1) - reset);
          di_ptr[base + j] = d_reset;
          di_ptr[base + hidden + j] = d_update;
          di_ptr[base + 2 * hidden + j] = d_new;
          dw_ptr[base + j] = d_reset;
          dw_ptr[base + hidden + j] = d_update;
          dw_ptr[base + 2 * hidden + j] = d_new * reset;
          dh_ptr[r * hidden + j] = d * update;
        }
      }
      dh.add_(at::mm(d_hidden[t], w));
    }
  });
  const Tensor hidden_rows = shape.per_sample(d_hidden, width);
  Tensor d_w = at::bmm(hidden_rows.transpose(1, 2), shape.per_sample(previous, hidden));
  Tensor d_b = hidden_rows.sum(1);
  std::vector<int64_t> w_sizes = shape.lead, b_sizes = shape.lead;
  w_sizes.insert(w_sizes.end(), {width, hidden});
  b_sizes.push_back(width);
  return {shape.lead_first(d_inputs, width), dh.view(shape.state_sizes()), d_w.view(w_sizes), d_b.view(b_sizes)};
}


// --- the recurrences as ops: one autograd node, batching rules ----------------------------------------------------
//
// NOTE [recurrence ops]: composites/recurrent.py's LSTMRecurrence and GRURecurrence primitives run under vmap(grad)
// through Python at every level: the single-level autograd.Function (forward, setup_context, backward), the vmap rule
// with its moves of the batch dimensions, and the same again for the backward primitive; profiled on bench.models'
// nn.LSTM classifier at batch 4, that Python was about a third of the recurrence's time around its steps.
// multicomposite::lstm_recurrence and gru_recurrence are the same recurrences as ops: the steps above as their
// kernel, one node (RecurrenceBackward) whose backward is lstm_steps_backward or gru_steps_backward, and batching
// rules that put each level's batch dimension in front as one more leading dimension (Shape's lead) of one call.
// The hidden weight and bias must not be batched (the primitives take an ensemble's); composites/recurrent.py calls
// the ops only where they are not, under vmap and grad levels alone (the primitives have no forward AD). The backward
// ops have no derivative, as the primitives' backward has none: where grad mode is on and an input requires grad,
// their outputs get an error node that raises if something differentiates them.

using torch::autograd::variable_list;
using multicomposite_functorch::BelowLevels;
using multicomposite_functorch::plain;

// `t`'s batched implementation at vmap level `level`, or null where `t` is not batched there.
const at::functorch::BatchedTensorImpl* batched_at(const Tensor& t, int64_t level) {
  const auto* batched = at::functorch::maybeGetBatchedImpl(t);
  return batched != nullptr && batched->level() == level ? batched : nullptr;
}

// A batching rule's view of its level: the level, its batch size, and each operand with the level's batch dimension
// in front (an operand not batched there expanded to the batch size, as the primitives' vmap rules do).
struct Level {
  int64_t id = 0, batch = 0;

  Level(const char* op) {
    const auto layer = at::functorch::maybeCurrentDynamicLayer();
    TORCH_INTERNAL_ASSERT(layer.has_value(), op, "'s batching rule ran outside vmap");
    id = layer->layerId();
    batch = layer->batchSize().guard_int(__FILE__, __LINE__);
  }
  bool batched(const Tensor& t) const { return batched_at(t, id) != nullptr; }
  bool batched(const std::optional<Tensor>& t) const { return t.has_value() && batched(*t); }
  Tensor front(const Tensor& t) const {
    if (const auto* b = batched_at(t, id)) return b->bdim() == 0 ? b->value() : b->value().movedim(b->bdim(), 0);
    std::vector<int64_t> sizes{batch};
    sizes.insert(sizes.end(), t.sizes().begin(), t.sizes().end());
    return t.expand(sizes);
  }
  Tensor wrap(const Tensor& t) const { return at::functorch::makeBatched(t, 0, id); }
  // The weights are the same for every sample: the ops take no batched weight (the NOTE above).
  void check_weights(const char* op, const Tensor& w_hh, const std::optional<Tensor>& b_hh = std::nullopt) const {
    TORCH_CHECK(!batched(w_hh) && !batched(b_hh), op, " takes a hidden weight and bias that vmap does not batch; "
                "composites/recurrent.py's recurrence primitives take batched ones (an ensemble's)");
  }
};

using LstmSignature = std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                                         bool);
using LstmBackwardSignature = std::tuple<Tensor, Tensor, Tensor, Tensor>(
    const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, bool);
using GruSignature = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                                const std::optional<Tensor>&, bool);
using GruBackwardSignature = std::tuple<Tensor, Tensor, Tensor, Tensor>(
    const Tensor&, const Tensor&, const Tensor&, const std::optional<Tensor>&, const Tensor&, const Tensor&, bool);

const c10::TypedOperatorHandle<LstmSignature>& lstm_recurrence_op() {
  static const auto handle =
      c10::Dispatcher::singleton().findSchemaOrThrow("multicomposite::lstm_recurrence", "").typed<LstmSignature>();
  return handle;
}
const c10::TypedOperatorHandle<LstmBackwardSignature>& lstm_backward_op() {
  static const auto handle = c10::Dispatcher::singleton()
                                 .findSchemaOrThrow("multicomposite::lstm_steps_backward", "")
                                 .typed<LstmBackwardSignature>();
  return handle;
}
const c10::TypedOperatorHandle<GruSignature>& gru_recurrence_op() {
  static const auto handle =
      c10::Dispatcher::singleton().findSchemaOrThrow("multicomposite::gru_recurrence", "").typed<GruSignature>();
  return handle;
}
const c10::TypedOperatorHandle<GruBackwardSignature>& gru_backward_op() {
  static const auto handle = c10::Dispatcher::singleton()
                                 .findSchemaOrThrow("multicomposite::gru_steps_backward", "")
                                 .typed<GruBackwardSignature>();
  return handle;
}

// The recurrence's node: its saved inputs, and the backward op of its recurrence (BPTT with the forward recomputed).
struct RecurrenceBackward : public torch::autograd::Node {
  bool lstm = true, reverse = false, has_bias = false;
  torch::autograd::SavedVariable projected, h0, c0, w_hh, b_hh;

  variable_list apply(variable_list&& grads) override {
    const Tensor p = projected.unpack(), h = h0.unpack(), w = w_hh.unpack();
    std::vector<int64_t> out_sizes = p.sizes().vec();
    out_sizes.back() = h.size(-1);
    const Tensor d_out = grads[0].defined() ? grads[0] : at::zeros(out_sizes, p.options());
    const Tensor d_h = grads[1].defined() ? grads[1] : at::zeros_like(h);
    if (lstm) {
      const Tensor c = c0.unpack();
      const Tensor d_c = grads[2].defined() ? grads[2] : at::zeros_like(c);
      auto [d_p, d_h0, d_c0, d_w] = lstm_backward_op().call(p, h, c, w, d_out, d_h, d_c, reverse);
      return {d_p, d_h0, d_c0, d_w};
    }
    const std::optional<Tensor> b = has_bias ? std::optional<Tensor>(b_hh.unpack()) : std::nullopt;
    auto [d_p, d_h0, d_w, d_b] = gru_backward_op().call(p, h, w, b, d_out, d_h, reverse);
    return {d_p, d_h0, d_w, has_bias ? d_b : Tensor()};
  }
  std::string name() const override {
    return lstm ? "multicomposite::LSTMRecurrenceBackward" : "multicomposite::GRURecurrenceBackward";
  }
  void release_variables() override {
    projected.reset_data();
    h0.reset_data();
    c0.reset_data();
    w_hh.reset_data();
    b_hh.reset_data();
  }
};

bool has_tangent(const Tensor& t) { return t.defined() && t._fw_grad(/*level=*/0).defined(); }

// The node's shapes (one sequence: what composites/recurrent.py passes at the level that records), and no forward-AD
// tangent on any input (the recurrences have no forward AD: checked whether or not a node is made).
void check_no_tangent(const char* op, std::initializer_list<Tensor> inputs) {
  for (const Tensor& t : inputs) {
    TORCH_CHECK(!has_tangent(t), op, " has no forward AD; the selector picks the unrolled composite under jvp and "
                "jacfwd");
  }
}

void check_recorded(const char* op, const Tensor& projected, const Tensor& h0, const Tensor& w_hh) {
  TORCH_CHECK(projected.dim() == 3 && h0.dim() == 2 && w_hh.dim() == 2, op,
              " records a node for one sequence of (steps, batch, gates) with states (batch, hidden); "
              "composites/recurrent.py's primitives take others");
}

std::tuple<Tensor, Tensor, Tensor> lstm_recurrence_autograd(const Tensor& projected, const Tensor& h0,
                                                            const Tensor& c0, const Tensor& w_hh, bool reverse) {
  check_no_tangent("multicomposite::lstm_recurrence", {projected, h0, c0, w_hh});
  c10::intrusive_ptr<RecurrenceBackward> node;
  if (torch::autograd::compute_requires_grad(projected, h0, c0, w_hh)) {
    check_recorded("multicomposite::lstm_recurrence", projected, h0, w_hh);
    node = c10::make_intrusive<RecurrenceBackward>();
    node->set_next_edges(torch::autograd::collect_next_edges(projected, h0, c0, w_hh));
    node->reverse = reverse;
    node->projected = torch::autograd::SavedVariable(projected, false);
    node->h0 = torch::autograd::SavedVariable(h0, false);
    node->c0 = torch::autograd::SavedVariable(c0, false);
    node->w_hh = torch::autograd::SavedVariable(w_hh, false);
  }
  std::tuple<Tensor, Tensor, Tensor> result;
  {
    at::AutoDispatchBelowADInplaceOrView below;
    result = lstm_recurrence_op().call(projected, h0, c0, w_hh, reverse);
  }
  if (node) {
    torch::autograd::set_history(std::get<0>(result), node);
    torch::autograd::set_history(std::get<1>(result), node);
    torch::autograd::set_history(std::get<2>(result), node);
  }
  return result;
}

std::tuple<Tensor, Tensor> gru_recurrence_autograd(const Tensor& projected, const Tensor& h0, const Tensor& w_hh,
                                                   const std::optional<Tensor>& b_hh, bool reverse) {
  check_no_tangent("multicomposite::gru_recurrence", {projected, h0, w_hh, b_hh.value_or(Tensor())});
  c10::intrusive_ptr<RecurrenceBackward> node;
  if (torch::autograd::compute_requires_grad(projected, h0, w_hh, b_hh)) {
    check_recorded("multicomposite::gru_recurrence", projected, h0, w_hh);
    node = c10::make_intrusive<RecurrenceBackward>();
    node->set_next_edges(torch::autograd::collect_next_edges(projected, h0, w_hh, b_hh));
    node->lstm = false;
    node->reverse = reverse;
    node->has_bias = b_hh.has_value() && b_hh->defined();
    node->projected = torch::autograd::SavedVariable(projected, false);
    node->h0 = torch::autograd::SavedVariable(h0, false);
    node->w_hh = torch::autograd::SavedVariable(w_hh, false);
    if (node->has_bias) node->b_hh = torch::autograd::SavedVariable(*b_hh, false);
  }
  std::tuple<Tensor, Tensor> result;
  {
    at::AutoDispatchBelowADInplaceOrView below;
    result = gru_recurrence_op().call(projected, h0, w_hh, b_hh, reverse);
  }
  if (node) {
    torch::autograd::set_history(std::get<0>(result), node);
    torch::autograd::set_history(std::get<1>(result), node);
  }
  return result;
}

// The backward ops where autograd sees them: computed below it; where grad mode is on and an input requires grad,
// the outputs get an error node (the NOTE above).
template <typename Outputs, typename... Inputs>
void no_derivative(const char* op, const Outputs& outputs, const Inputs&... inputs) {
  if (!at::GradMode::is_enabled() || !torch::autograd::compute_requires_grad(inputs...)) return;
  auto node = c10::make_intrusive<torch::autograd::Error>(
      std::string(op) + " has no derivative: the recurrence primitives have a first derivative only; the selector "
      "picks the unrolled composite for hessian and grad of grad",
      torch::autograd::collect_next_edges(inputs...));
  std::apply([&](const auto&... each) { (torch::autograd::set_history(each, node), ...); }, outputs);
}

std::tuple<Tensor, Tensor, Tensor, Tensor> lstm_backward_autograd(const Tensor& projected, const Tensor& h0,
                                                                  const Tensor& c0, const Tensor& w_hh,
                                                                  const Tensor& d_out, const Tensor& d_h,
                                                                  const Tensor& d_c, bool reverse) {
  std::tuple<Tensor, Tensor, Tensor, Tensor> result;
  {
    at::AutoDispatchBelowADInplaceOrView below;
    result = lstm_backward_op().call(projected, h0, c0, w_hh, d_out, d_h, d_c, reverse);
  }
  no_derivative("multicomposite::lstm_steps_backward", result, projected, h0, c0, w_hh, d_out, d_h, d_c);
  return result;
}

std::tuple<Tensor, Tensor, Tensor, Tensor> gru_backward_autograd(const Tensor& projected, const Tensor& h0,
                                                                 const Tensor& w_hh,
                                                                 const std::optional<Tensor>& b_hh,
                                                                 const Tensor& d_out, const Tensor& d_h,
                                                                 bool reverse) {
  std::tuple<Tensor, Tensor, Tensor, Tensor> result;
  {
    at::AutoDispatchBelowADInplaceOrView below;
    result = gru_backward_op().call(projected, h0, w_hh, b_hh, d_out, d_h, reverse);
  }
  no_derivative("multicomposite::gru_steps_backward", result, projected, h0, w_hh, b_hh, d_out, d_h);
  return result;
}

// The batching rules: each level's batch dimension in front of every sequence and state operand (the kernels take
// any number of leading dimensions), one call one level down, every output batched at 0. Where no operand is batched
// at this level the call goes down as it is.
std::tuple<Tensor, Tensor, Tensor> lstm_recurrence_batched(const Tensor& projected, const Tensor& h0,
                                                           const Tensor& c0, const Tensor& w_hh, bool reverse) {
  const Level level("multicomposite::lstm_recurrence");
  level.check_weights("multicomposite::lstm_recurrence", w_hh);
  c10::impl::ExcludeDispatchKeyGuard guard(c10::DispatchKey::FuncTorchBatched);
  if (!level.batched(projected) && !level.batched(h0) && !level.batched(c0)) {
    return lstm_recurrence_op().call(projected, h0, c0, w_hh, reverse);
  }
  const Tensor p = level.front(projected), h = level.front(h0), c = level.front(c0);
  const BelowLevels below(plain(p) && plain(h) && plain(c) && plain(w_hh));
  auto [out, h_n, c_n] = lstm_recurrence_op().call(p, h, c, w_hh, reverse);
  return {level.wrap(out), level.wrap(h_n), level.wrap(c_n)};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> lstm_backward_batched(const Tensor& projected, const Tensor& h0,
                                                                 const Tensor& c0, const Tensor& w_hh,
                                                                 const Tensor& d_out, const Tensor& d_h,
                                                                 const Tensor& d_c, bool reverse) {
  const Level level("multicomposite::lstm_steps_backward");
  level.check_weights("multicomposite::lstm_steps_backward", w_hh);
  c10::impl::ExcludeDispatchKeyGuard guard(c10::DispatchKey::FuncTorchBatched);
  if (!level.batched(projected) && !level.batched(h0) && !level.batched(c0) && !level.batched(d_out) &&
      !level.batched(d_h) && !level.batched(d_c)) {
    return lstm_backward_op().call(projected, h0, c0, w_hh, d_out, d_h, d_c, reverse);
  }
  const Tensor p = level.front(projected), h = level.front(h0), c = level.front(c0);
  const Tensor g_out = level.front(d_out), g_h = level.front(d_h), g_c = level.front(d_c);
  const BelowLevels below(plain(p) && plain(h) && plain(c) && plain(w_hh) && plain(g_out) && plain(g_h) &&
                          plain(g_c));
  auto [d_p, d_h0, d_c0, d_w] = lstm_backward_op().call(p, h, c, w_hh, g_out, g_h, g_c, reverse);
  return {level.wrap(d_p), level.wrap(d_h0), level.wrap(d_c0), level.wrap(d_w)};
}

std::tuple<Tensor, Tensor> gru_recurrence_batched(const Tensor& projected, const Tensor& h0, const Tensor& w_hh,
                                                  const std::optional<Tensor>& b_hh, bool reverse) {
  const Level level("multicomposite::gru_recurrence");
  level.check_weights("multicomposite::gru_recurrence", w_hh, b_hh);
  c10::impl::ExcludeDispatchKeyGuard guard(c10::DispatchKey::FuncTorchBatched);
  if (!level.batched(projected) && !level.batched(h0)) {
    return gru_recurrence_op().call(projected, h0, w_hh, b_hh, reverse);
  }
  const Tensor p = level.front(projected), h = level.front(h0);
  const BelowLevels below(plain(p) && plain(h) && plain(w_hh) && (!b_hh.has_value() || plain(*b_hh)));
  auto [out, h_n] = gru_recurrence_op().call(p, h, w_hh, b_hh, reverse);
  return {level.wrap(out), level.wrap(h_n)};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> gru_backward_batched(const Tensor& projected, const Tensor& h0,
                                                                const Tensor& w_hh, const std::optional<Tensor>& b_hh,
                                                                const Tensor& d_out, const Tensor& d_h,
                                                                bool reverse) {
  const Level level("multicomposite::gru_steps_backward");
  level.check_weights("multicomposite::gru_steps_backward", w_hh, b_hh);
  c10::impl::ExcludeDispatchKeyGuard guard(c10::DispatchKey::FuncTorchBatched);
  if (!level.batched(projected) && !level.batched(h0) && !level.batched(d_out) && !level.batched(d_h)) {
    return gru_backward_op().call(projected, h0, w_hh, b_hh, d_out, d_h, reverse);
  }
  const Tensor p = level.front(projected), h = level.front(h0), g_out = level.front(d_out), g_h = level.front(d_h);
  const BelowLevels below(plain(p) && plain(h) && plain(w_hh) && (!b_hh.has_value() || plain(*b_hh)) &&
                          plain(g_out) && plain(g_h));
  auto [d_p, d_h0, d_w, d_b] = gru_backward_op().call(p, h, w_hh, b_hh, g_out, g_h, reverse);
  return {level.wrap(d_p), level.wrap(d_h0), level.wrap(d_w), d_b.defined() ? level.wrap(d_b) : d_b};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(multicomposite, m) {
  // composites/recurrent.py's LSTMRecurrence on ordinary CPU tensors: (outputs, h_T, c_T).
  m.def("lstm_steps(Tensor projected, Tensor h0, Tensor c0, Tensor w_hh, bool reverse) -> (Tensor, Tensor, Tensor)");
  // Its backward (BPTT, the forward recomputed): (d_projected, d_h0, d_c0, d_w_hh per lead index).
  m.def("lstm_steps_backward(Tensor projected, Tensor h0, Tensor c0, Tensor w_hh, Tensor d_out, Tensor d_h, "
        "Tensor d_c, bool reverse) -> (Tensor, Tensor, Tensor, Tensor)");
  // composites/recurrent.py's GRURecurrence: (outputs, h_T), and its backward (d_projected, d_h0, d_w_hh, d_b_hh).
  m.def("gru_steps(Tensor projected, Tensor h0, Tensor w_hh, Tensor? b_hh, bool reverse) -> (Tensor, Tensor)");
  m.def("gru_steps_backward(Tensor projected, Tensor h0, Tensor w_hh, Tensor? b_hh, Tensor d_out, Tensor d_h, "
        "bool reverse) -> (Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_FRAGMENT(multicomposite, m) {
  // The same recurrences as ops with their own node and batching rules (NOTE [recurrence ops]).
  m.def("lstm_recurrence(Tensor projected, Tensor h0, Tensor c0, Tensor w_hh, bool reverse) -> "
        "(Tensor, Tensor, Tensor)");
  m.def("gru_recurrence(Tensor projected, Tensor h0, Tensor w_hh, Tensor? b_hh, bool reverse) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(multicomposite, CompositeExplicitAutograd, m) {
  m.impl("lstm_recurrence", lstm_steps);
  m.impl("gru_recurrence", gru_steps);
  m.impl("lstm_steps", lstm_steps);
  m.impl("lstm_steps_backward", lstm_steps_backward);
  m.impl("gru_steps", gru_steps);
  m.impl("gru_steps_backward", gru_steps_backward);
}

TORCH_LIBRARY_IMPL(multicomposite, Autograd, m) {
  m.impl("lstm_recurrence", lstm_recurrence_autograd);
  m.impl("gru_recurrence", gru_recurrence_autograd);
  m.impl("lstm_steps_backward", lstm_backward_autograd);
  m.impl("gru_steps_backward", gru_backward_autograd);
}

TORCH_LIBRARY_IMPL(multicomposite, FuncTorchBatched, m) {
  m.impl("lstm_recurrence", lstm_recurrence_batched);
  m.impl("gru_recurrence", gru_recurrence_batched);
  m.impl("lstm_steps_backward", lstm_backward_batched);
  m.impl("gru_steps_backward", gru_backward_batched);
}
