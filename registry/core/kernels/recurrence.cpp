// multicomposite::lstm_recurrence and gru_recurrence: the LSTM's and the GRU's recurrence over one direction, as
// ops with their own autograd node and batching rule (NOTE [recurrence ops] below); on ordinary CPU tensors they are
// also the forward of composites/recurrent.py's LSTMRecurrence and GRURecurrence primitives, whose BPTT (the forward
// recomputed) is lstm_steps_backward / gru_steps_backward.
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

#include "functorch_levels.h"

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace {

using at::Tensor;

// The shapes: projected (*lead, T, N, 4H); the states (*lead, N, H); w_hh (4H, H). Rows: the lead dimensions times N.
struct Shape {
  std::vector<int64_t> lead;
  int64_t lead_size = 1, steps = 0, batch = 0, gates = 0, hidden = 0;

  // gate_count: 4 (the LSTM's i, f, g, o) or 3 (the GRU's r, z, n). `sequence` is the projection (*lead, T, N,
  // gates * H), or with `steps_first` a tensor kept by a forward, (T, *lead, N, gates * H).
  Shape(const Tensor& sequence, const Tensor& h0, int64_t gate_count, bool steps_first = false) {
    TORCH_CHECK(sequence.dim() >= 3 && h0.dim() == sequence.dim() - 1,
                "multicomposite: projected (*lead, T, N, gates * H) and states (*lead, N, H) expected");
    const auto sizes = sequence.sizes();
    lead.assign(sizes.begin() + (steps_first ? 1 : 0), sizes.end() - (steps_first ? 2 : 3));
    for (int64_t size : lead) lead_size *= size;
    steps = steps_first ? sizes[0] : sizes[sizes.size() - 3];
    batch = sequence.size(-2);
    gates = sequence.size(-1);
    hidden = h0.size(-1);
    TORCH_CHECK(gates == gate_count * hidden, "multicomposite: the projection's last size must be ", gate_count,
                " * hidden");
    TORCH_CHECK(h0.sizes() == at::IntArrayRef(state_sizes()),
                "multicomposite: the states must have the projection's leading and batch sizes, (*lead, N, H)");
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
  // (T, rows, W) viewed as (T, *lead, N, W): how a forward hands its kept steps to the backward.
  Tensor steps_view(const Tensor& t, int64_t width) const {
    std::vector<int64_t> sizes{steps};
    sizes.insert(sizes.end(), lead.begin(), lead.end());
    sizes.insert(sizes.end(), {batch, width});
    return t.view(sizes);
  }
  // A kept (T, *lead, N, W) tensor as (T, rows, W), contiguous.
  Tensor steps_rows(const Tensor& t, int64_t width) const { return t.reshape({steps, rows(), width}).contiguous(); }
  // The state after the last step taken, (*lead, N, H), from the steps' outputs `out` (T, rows, H).
  Tensor last_state(const Tensor& out, const Tensor& h0_rows, bool reverse) const {
    const Tensor last = steps == 0 ? h0_rows : out[reverse ? 0 : steps - 1];
    return last.clone().view(state_sizes());
  }
  // Each step's previous state, (T, rows, H): h0 before the first step taken, the step before's output after it.
  Tensor previous_states(const Tensor& out, const Tensor& h0_rows, bool reverse) const {
    Tensor previous = at::empty_like(out);
    if (steps == 0) return previous;
    previous.narrow(0, reverse ? 0 : 1, steps - 1).copy_(out.narrow(0, reverse ? 1 : 0, steps - 1));
    previous[reverse ? steps - 1 : 0].copy_(h0_rows);
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
  check_inputs("multicomposite::lstm_recurrence", {projected, h0, c0}, w_hh);
  TORCH_CHECK(h0.sizes() == c0.sizes(), "multicomposite::lstm_recurrence: h0 and c0 of one shape expected");
  at::AutoDispatchBelowADInplaceOrView below;  // ordinary tensors, called where nothing records
  const Shape shape(projected, h0, 4);
  const Tensor steps = shape.steps_first(projected, shape.gates);
  const Tensor h_rows = h0.reshape({shape.rows(), shape.hidden}).contiguous();
  Tensor c = c0.reshape({shape.rows(), shape.hidden}).clone(at::MemoryFormat::Contiguous);
  Tensor out = at::empty({shape.steps, shape.rows(), shape.hidden}, h0.options());
  const Tensor w_t = w_hh.t();
  AT_DISPATCH_FLOATING_TYPES(projected.scalar_type(), "multicomposite::lstm_recurrence", [&] {
    run_steps<scalar_t>(shape, steps, h_rows, c, w_t, reverse, out, nullptr);
  });
  return {shape.lead_first(out, shape.hidden), shape.last_state(out, h_rows, reverse), c.view(shape.state_sizes())};
}

// BPTT over kept steps (`kept` and the steps' outputs `out`, (T, rows, .)): (d_projected (*lead, T, N, 4H), d_h0,
// d_c0, d_w_hh per lead index).
std::tuple<Tensor, Tensor, Tensor, Tensor> lstm_walk_back(const Shape& shape, const Kept& kept, const Tensor& out,
                                                          const Tensor& h_rows, const Tensor& w_hh,
                                                          const Tensor& d_out, const Tensor& d_h, const Tensor& d_c,
                                                          bool reverse) {
  const int64_t rows = shape.rows(), hidden = shape.hidden, width = shape.gates, steps_count = shape.steps;
  const Tensor d_out_steps = shape.steps_first(d_out, hidden);
  Tensor dh = d_h.reshape({rows, hidden}).clone(at::MemoryFormat::Contiguous);
  Tensor dc = d_c.reshape({rows, hidden}).clone(at::MemoryFormat::Contiguous);
  Tensor d_gates = at::empty({steps_count, rows, width}, h_rows.options());
  const Tensor w = w_hh.contiguous();
  AT_DISPATCH_FLOATING_TYPES(h_rows.scalar_type(), "multicomposite::lstm_walk_back", [&] {
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

// The steps with their activations kept: run_steps' outputs in (T, rows, .) buffers.
struct LstmForward {
  Tensor h_rows, c, out;
  Kept kept;
};

LstmForward lstm_forward_keeping(const Shape& shape, const Tensor& projected, const Tensor& h0, const Tensor& c0,
                                 const Tensor& w_hh, bool reverse) {
  const int64_t rows = shape.rows(), hidden = shape.hidden, width = shape.gates, steps_count = shape.steps;
  const auto options = h0.options();
  LstmForward forward{h0.reshape({rows, hidden}).contiguous(),
                      c0.reshape({rows, hidden}).clone(at::MemoryFormat::Contiguous),
                      at::empty({steps_count, rows, hidden}, options),
                      Kept{at::empty({steps_count, rows, width}, options), at::empty({steps_count, rows, hidden}, options),
                           at::empty({steps_count, rows, hidden}, options)}};
  const Tensor steps = shape.steps_first(projected, width);
  const Tensor w_t = w_hh.t();
  AT_DISPATCH_FLOATING_TYPES(projected.scalar_type(), "multicomposite::lstm_forward_keeping", [&] {
    run_steps<scalar_t>(shape, steps, forward.h_rows, forward.c, w_t, reverse, forward.out, &forward.kept);
  });
  return forward;
}

std::tuple<Tensor, Tensor, Tensor, Tensor> lstm_steps_backward(const Tensor& projected, const Tensor& h0,
                                                               const Tensor& c0, const Tensor& w_hh,
                                                               const Tensor& d_out, const Tensor& d_h,
                                                               const Tensor& d_c, bool reverse) {
  check_inputs("multicomposite::lstm_steps_backward", {projected, h0, c0, d_out, d_h, d_c}, w_hh);
  TORCH_CHECK(h0.sizes() == c0.sizes(), "multicomposite::lstm_steps_backward: h0 and c0 of one shape expected");
  at::AutoDispatchBelowADInplaceOrView below;  // ordinary tensors, called where nothing records
  const Shape shape(projected, h0, 4);
  const LstmForward forward = lstm_forward_keeping(shape, projected, h0, c0, w_hh, reverse);
  return lstm_walk_back(shape, forward.kept, forward.out, forward.h_rows, w_hh, d_out, d_h, d_c, reverse);
}

// The forward that keeps its activations for the backward (NOTE [kept activations]): the outputs, and the steps'
// gates, cell states before each step, tanh of the new cell states and outputs, (T, *lead, N, .) each.
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> lstm_recurrence_keeping(
    const Tensor& projected, const Tensor& h0, const Tensor& c0, const Tensor& w_hh, bool reverse) {
  check_inputs("multicomposite::lstm_recurrence_keeping", {projected, h0, c0}, w_hh);
  TORCH_CHECK(h0.sizes() == c0.sizes(), "multicomposite::lstm_recurrence_keeping: h0 and c0 of one shape expected");
  at::AutoDispatchBelowADInplaceOrView below;  // ordinary tensors, called where nothing records
  const Shape shape(projected, h0, 4);
  const LstmForward forward = lstm_forward_keeping(shape, projected, h0, c0, w_hh, reverse);
  const int64_t hidden = shape.hidden;
  return {shape.lead_first(forward.out, hidden), shape.last_state(forward.out, forward.h_rows, reverse),
          forward.c.view(shape.state_sizes()), shape.steps_view(forward.kept.gates, shape.gates),
          shape.steps_view(forward.kept.c_before, hidden), shape.steps_view(forward.kept.tanh_c, hidden),
          shape.steps_view(forward.out, hidden)};
}

// BPTT from what lstm_recurrence_keeping kept: (d_projected, d_h0, d_c0, d_w_hh per lead index).
std::tuple<Tensor, Tensor, Tensor, Tensor> lstm_recurrence_backward(
    const Tensor& h0, const Tensor& w_hh, const Tensor& steps_gates, const Tensor& steps_c, const Tensor& steps_tanh_c,
    const Tensor& steps_out, const Tensor& d_out, const Tensor& d_h, const Tensor& d_c, bool reverse) {
  check_inputs("multicomposite::lstm_recurrence_backward",
               {h0, steps_gates, steps_c, steps_tanh_c, steps_out, d_out, d_h, d_c}, w_hh);
  at::AutoDispatchBelowADInplaceOrView below;  // ordinary tensors, called where nothing records
  const Shape shape(steps_gates, h0, 4, /*steps_first=*/true);
  const int64_t hidden = shape.hidden;
  const Kept kept{shape.steps_rows(steps_gates, shape.gates), shape.steps_rows(steps_c, hidden),
                  shape.steps_rows(steps_tanh_c, hidden)};
  return lstm_walk_back(shape, kept, shape.steps_rows(steps_out, hidden), h0.reshape({shape.rows(), hidden}),
                        w_hh, d_out, d_h, d_c, reverse);
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
  check_inputs("multicomposite::gru_recurrence", {projected, h0}, w_hh, b_hh);
  at::AutoDispatchBelowADInplaceOrView below;  // ordinary tensors, called where nothing records
  const Shape shape(projected, h0, 3);
  const Tensor steps = shape.steps_first(projected, shape.gates);
  const Tensor h_rows = h0.reshape({shape.rows(), shape.hidden}).contiguous();
  Tensor out = at::empty({shape.steps, shape.rows(), shape.hidden}, h0.options());
  const Tensor w_t = w_hh.t();
  AT_DISPATCH_FLOATING_TYPES(projected.scalar_type(), "multicomposite::gru_recurrence", [&] {
    run_gru_steps<scalar_t>(shape, steps, h_rows, b_hh, w_t, reverse, out, nullptr, nullptr);
  });
  return {shape.lead_first(out, shape.hidden), shape.last_state(out, h_rows, reverse)};
}

// The GRU's steps with their hidden products and activated gates kept, in (T, rows, .) buffers.
struct GruForward {
  Tensor h_rows, out, hw, gates;
};

GruForward gru_forward_keeping(const Shape& shape, const Tensor& projected, const Tensor& h0, const Tensor& w_hh,
                               const std::optional<Tensor>& b_hh, bool reverse) {
  const int64_t rows = shape.rows(), hidden = shape.hidden, width = shape.gates, steps_count = shape.steps;
  const auto options = h0.options();
  GruForward forward{h0.reshape({rows, hidden}).contiguous(), at::empty({steps_count, rows, hidden}, options),
                     at::empty({steps_count, rows, width}, options), at::empty({steps_count, rows, width}, options)};
  const Tensor steps = shape.steps_first(projected, width);
  const Tensor w_t = w_hh.t();
  AT_DISPATCH_FLOATING_TYPES(projected.scalar_type(), "multicomposite::gru_forward_keeping", [&] {
    run_gru_steps<scalar_t>(shape, steps, forward.h_rows, b_hh, w_t, reverse, forward.out, &forward.hw,
                            &forward.gates);
  });
  return forward;
}

// BPTT over kept steps: (d_projected (*lead, T, N, 3H), d_h0, d_w_hh and d_b_hh per lead index).
std::tuple<Tensor, Tensor, Tensor, Tensor> gru_walk_back(const Shape& shape, const GruForward& kept,
                                                         const Tensor& w_hh, const Tensor& d_out, const Tensor& d_h,
                                                         bool reverse) {
  const int64_t rows = shape.rows(), hidden = shape.hidden, width = shape.gates, steps_count = shape.steps;
  const auto options = kept.h_rows.options();
  const Tensor w = w_hh.contiguous();
  const Tensor d_out_steps = shape.steps_first(d_out, hidden);
  Tensor dh = d_h.reshape({rows, hidden}).clone(at::MemoryFormat::Contiguous);
  Tensor d_inputs = at::empty({steps_count, rows, width}, options);
  Tensor d_hidden = at::empty({steps_count, rows, width}, options);
  const Tensor previous = shape.previous_states(kept.out, kept.h_rows, reverse);
  AT_DISPATCH_FLOATING_TYPES(kept.h_rows.scalar_type(), "multicomposite::gru_walk_back", [&] {
    for (int64_t position = 0; position < steps_count; ++position) {  // the forward's steps, last first
      const int64_t t = reverse ? position : steps_count - 1 - position;
      dh.add_(d_out_steps[t]);
      const scalar_t* hw_ptr = kept.hw[t].const_data_ptr<scalar_t>();
      const scalar_t* g_ptr = kept.gates[t].const_data_ptr<scalar_t>();
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

std::tuple<Tensor, Tensor, Tensor, Tensor> gru_steps_backward(const Tensor& projected, const Tensor& h0,
                                                              const Tensor& w_hh, const std::optional<Tensor>& b_hh,
                                                              const Tensor& d_out, const Tensor& d_h, bool reverse) {
  check_inputs("multicomposite::gru_steps_backward", {projected, h0, d_out, d_h}, w_hh, b_hh);
  at::AutoDispatchBelowADInplaceOrView below;  // ordinary tensors, called where nothing records
  const Shape shape(projected, h0, 3);
  return gru_walk_back(shape, gru_forward_keeping(shape, projected, h0, w_hh, b_hh, reverse), w_hh, d_out, d_h,
                       reverse);
}

// The GRU's forward that keeps its hidden products, activated gates and outputs, (T, *lead, N, .) each.
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> gru_recurrence_keeping(const Tensor& projected, const Tensor& h0,
                                                                          const Tensor& w_hh,
                                                                          const std::optional<Tensor>& b_hh,
                                                                          bool reverse) {
  check_inputs("multicomposite::gru_recurrence_keeping", {projected, h0}, w_hh, b_hh);
  at::AutoDispatchBelowADInplaceOrView below;  // ordinary tensors, called where nothing records
  const Shape shape(projected, h0, 3);
  const GruForward forward = gru_forward_keeping(shape, projected, h0, w_hh, b_hh, reverse);
  return {shape.lead_first(forward.out, shape.hidden), shape.last_state(forward.out, forward.h_rows, reverse),
          shape.steps_view(forward.hw, shape.gates), shape.steps_view(forward.gates, shape.gates),
          shape.steps_view(forward.out, shape.hidden)};
}

// BPTT from what gru_recurrence_keeping kept: (d_projected, d_h0, d_w_hh, d_b_hh per lead index).
std::tuple<Tensor, Tensor, Tensor, Tensor> gru_recurrence_backward(const Tensor& h0, const Tensor& w_hh,
                                                                   const Tensor& steps_hw, const Tensor& steps_gates,
                                                                   const Tensor& steps_out, const Tensor& d_out,
                                                                   const Tensor& d_h, bool reverse) {
  check_inputs("multicomposite::gru_recurrence_backward", {h0, steps_hw, steps_gates, steps_out, d_out, d_h}, w_hh);
  at::AutoDispatchBelowADInplaceOrView below;  // ordinary tensors, called where nothing records
  const Shape shape(steps_gates, h0, 3, /*steps_first=*/true);
  const GruForward kept{h0.reshape({shape.rows(), shape.hidden}), shape.steps_rows(steps_out, shape.hidden),
                        shape.steps_rows(steps_hw, shape.gates), shape.steps_rows(steps_gates, shape.gates)};
  return gru_walk_back(shape, kept, w_hh, d_out, d_h, reverse);
}

// --- the recurrences as ops: one autograd node, batching rules ----------------------------------------------------
//
// NOTE [recurrence ops]: composites/recurrent.py's LSTMRecurrence and GRURecurrence primitives run under vmap(grad)
// through Python at every level: the single-level autograd.Function (forward, setup_context, backward), the vmap rule
// with its moves of the batch dimensions, and the same again for the backward primitive. multicomposite::
// lstm_recurrence and gru_recurrence are the same recurrences as ops: the steps above as their kernel, one node
// (RecurrenceBackward) whose backward is lstm_recurrence_backward or gru_recurrence_backward, and one batching rule
// (fold_batch) that puts each level's batch dimension in front as one more leading dimension (Shape's lead) of one
// call. Measured on bench.models' nn.LSTM classifier at batch 4 (one thread): the step 1.68 -> 1.12 ms. The hidden
// weight and bias must not be batched (the primitives take an ensemble's); composites/recurrent.py calls the ops only
// where they are not, under vmap and grad levels alone (the primitives have no forward AD). The backward ops have no
// derivative, as the primitives' backward has none: where grad mode is on and an input requires grad, their outputs
// get an error node that raises if something differentiates them.
//
// NOTE [kept activations]: where the forward records a node, it runs lstm_recurrence_keeping (gru_...) instead,
// which hands the steps' activations to the node (the gates, the cell states, tanh of them, the outputs: (T, *lead,
// N, .) each, views of the buffers the steps wrote), and the backward walks them back without recomputing the
// forward, as PyTorch's own LSTM backward does with its workspace.

using torch::autograd::variable_list;
using multicomposite_functorch::BelowLevels;
using multicomposite_functorch::batched_at;
using multicomposite_functorch::plain;


// Where an operand of the ops carries the batch, by its name in the schema: the weights (w_hh, b_hh) carry none (the
// NOTE above); the kept steps (steps_*) are (T, *lead, N, .), their batch after the steps; every other tensor
// (*lead, ...), its batch in front.
enum class Carries { nothing, front, after_steps };

Carries carries(const std::string& name) {
  if (name.rfind("w_", 0) == 0 || name.rfind("b_", 0) == 0) return Carries::nothing;
  return name.rfind("steps_", 0) == 0 ? Carries::after_steps : Carries::front;
}

// The batching rule of every recurrence op: each operand with this level's batch dimension where `carries` puts it
// (an operand not batched here expanded to the batch size there, as the primitives' vmap rules do), one call one
// level down, each output batched where its name puts it. Where no operand is batched here the call goes down as it
// is.
void fold_batch(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const auto layer = at::functorch::maybeCurrentDynamicLayer();
  TORCH_INTERNAL_ASSERT(layer.has_value(), schema.name(), "'s batching rule ran outside vmap");
  const int64_t level = layer->layerId();
  const int64_t batch = layer->batchSize().guard_int(__FILE__, __LINE__);
  const auto& arguments = schema.arguments();
  const size_t first = stack->size() - arguments.size();
  bool batched = false;
  for (size_t i = 0; i < arguments.size(); ++i) {
    const c10::IValue& value = (*stack)[first + i];
    if (!value.isTensor()) continue;
    const bool here = batched_at(value.toTensor(), level) != nullptr;
    TORCH_CHECK(!(here && carries(arguments[i].name()) == Carries::nothing), schema.name(),
                " takes a hidden weight and bias that vmap does not batch; composites/recurrent.py's recurrence "
                "primitives take batched ones (an ensemble's)");
    batched = batched || here;
  }
  c10::impl::ExcludeDispatchKeyGuard guard(c10::DispatchKey::FuncTorchBatched);
  if (!batched) {
    op.callBoxed(stack);
    return;
  }
  bool operands_plain = true;
  for (size_t i = 0; i < arguments.size(); ++i) {
    c10::IValue& value = (*stack)[first + i];
    if (!value.isTensor()) continue;
    Tensor t = value.toTensor();
    const Carries where = carries(arguments[i].name());
    if (where != Carries::nothing) {
      const int64_t position = where == Carries::front ? 0 : 1;
      if (const auto* b = batched_at(t, level)) {
        t = b->bdim() == position ? b->value() : b->value().movedim(b->bdim(), position);
      } else {
        std::vector<int64_t> sizes = t.sizes().vec();
        sizes.insert(sizes.begin() + position, batch);
        t = t.unsqueeze(position).expand(sizes);
      }
      value = t;
    }
    operands_plain = operands_plain && plain(t);
  }
  {
    const BelowLevels below(operands_plain);
    op.callBoxed(stack);
  }
  const auto& returns = schema.returns();
  const size_t outputs = stack->size() - returns.size();
  for (size_t i = 0; i < returns.size(); ++i) {
    c10::IValue& value = (*stack)[outputs + i];
    if (!value.isTensor() || !value.toTensor().defined()) continue;
    const int64_t position = carries(returns[i].name()) == Carries::after_steps ? 1 : 0;
    value = at::functorch::makeBatched(value.toTensor(), position, level);
  }
}

// The backward ops (and the keeping forwards) where autograd sees them: computed below it; where grad mode is on and
// an input requires grad, the outputs get an error node (the NOTE above).
void no_derivative(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  std::vector<Tensor> inputs;
  for (const c10::IValue& value : torch::jit::last(*stack, schema.arguments().size())) {
    if (value.isTensor() && value.toTensor().defined()) inputs.push_back(value.toTensor());
  }
  const bool recorded = at::GradMode::is_enabled() &&
                        std::any_of(inputs.begin(), inputs.end(), [](const Tensor& t) { return t.requires_grad(); });
  {
    at::AutoDispatchBelowADInplaceOrView below;
    op.callBoxed(stack);
  }
  if (!recorded) return;
  auto node = c10::make_intrusive<torch::autograd::Error>(
      schema.name() + " has no derivative: the recurrence primitives have a first derivative only; the selector "
      "picks the unrolled composite for hessian and grad of grad",
      torch::autograd::collect_next_edges(at::ArrayRef<Tensor>(inputs)));
  for (const c10::IValue& value : torch::jit::last(*stack, schema.returns().size())) {
    if (value.isTensor() && value.toTensor().defined()) torch::autograd::set_history(value.toTensor(), node);
  }
}

template <typename Signature>
const c10::TypedOperatorHandle<Signature>& typed_op(const char* name) {
  // One handle per Signature: each op below has a signature of its own.
  static const auto handle = c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
  return handle;
}

using LstmSignature = std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                                         bool);
using LstmKeepingSignature = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>(
    const Tensor&, const Tensor&, const Tensor&, const Tensor&, bool);
using LstmBackwardSignature = std::tuple<Tensor, Tensor, Tensor, Tensor>(
    const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
    const Tensor&, const Tensor&, bool);
using GruSignature = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                                const std::optional<Tensor>&, bool);
using GruKeepingSignature = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor>(
    const Tensor&, const Tensor&, const Tensor&, const std::optional<Tensor>&, bool);
using GruBackwardSignature = std::tuple<Tensor, Tensor, Tensor, Tensor>(
    const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, bool);

// The recurrence's node: h0, the hidden weight and what the forward kept (NOTE [kept activations]).
struct RecurrenceBackward : public torch::autograd::Node {
  bool lstm = true, reverse = false, has_bias = false;
  torch::autograd::SavedVariable h0, w_hh;
  std::vector<torch::autograd::SavedVariable> kept;  // steps_* of the keeping forward, in its order

  variable_list apply(variable_list&& grads) override {
    const Tensor h = h0.unpack(), w = w_hh.unpack();
    std::vector<Tensor> steps;
    for (auto& each : kept) steps.push_back(each.unpack());
    const Tensor& steps_out = steps.back();
    std::vector<int64_t> out_sizes(steps_out.sizes().begin() + 1, steps_out.sizes().end() - 2);  // lead
    out_sizes.insert(out_sizes.end(), {steps_out.size(0), steps_out.size(-2), steps_out.size(-1)});
    const Tensor d_out = grads[0].defined() ? grads[0] : at::zeros(out_sizes, h.options());
    const Tensor d_h = grads[1].defined() ? grads[1] : at::zeros_like(h);
    if (lstm) {
      const Tensor d_c = grads[2].defined() ? grads[2] : at::zeros_like(h);
      auto [d_p, d_h0, d_c0, d_w] = typed_op<LstmBackwardSignature>("multicomposite::lstm_recurrence_backward")
                                        .call(h, w, steps[0], steps[1], steps[2], steps[3], d_out, d_h, d_c, reverse);
      return {d_p, d_h0, d_c0, d_w};
    }
    auto [d_p, d_h0, d_w, d_b] = typed_op<GruBackwardSignature>("multicomposite::gru_recurrence_backward")
                                     .call(h, w, steps[0], steps[1], steps[2], d_out, d_h, reverse);
    return {d_p, d_h0, d_w, has_bias ? d_b : Tensor()};
  }
  std::string name() const override {
    return lstm ? "multicomposite::LSTMRecurrenceBackward" : "multicomposite::GRURecurrenceBackward";
  }
  void release_variables() override {
    h0.reset_data();
    w_hh.reset_data();
    kept.clear();
  }
};

bool has_tangent(const Tensor& t) { return t.defined() && t._fw_grad(/*level=*/0).defined(); }

// No forward-AD tangent on any input (the recurrences have no forward AD: checked whether or not a node is made),
// and where a node is made, one sequence (what composites/recurrent.py passes at the level that records).
void check_recordable(const char* op, std::initializer_list<Tensor> inputs, bool recorded) {
  for (const Tensor& t : inputs) {
    TORCH_CHECK(!has_tangent(t), op, " has no forward AD; the selector picks the unrolled composite under jvp and "
                "jacfwd");
  }
  const Tensor& projected = *inputs.begin();
  TORCH_CHECK(!recorded || projected.dim() == 3, op, " records a node for one sequence of (steps, batch, gates); "
              "composites/recurrent.py's primitives take others");
}

c10::intrusive_ptr<RecurrenceBackward> make_node(bool lstm, bool reverse, const Tensor& h0, const Tensor& w_hh) {
  auto node = c10::make_intrusive<RecurrenceBackward>();
  node->lstm = lstm;
  node->reverse = reverse;
  node->h0 = torch::autograd::SavedVariable(h0, false);
  node->w_hh = torch::autograd::SavedVariable(w_hh, false);
  return node;
}

// The keeping forward's kept outputs (at `Index...`) into the node.
template <typename Outputs, size_t... Index>
void keep(RecurrenceBackward& node, const Outputs& outputs, std::index_sequence<Index...>) {
  (node.kept.emplace_back(std::get<Index>(outputs), false), ...);
}

std::tuple<Tensor, Tensor, Tensor> lstm_recurrence_autograd(const Tensor& projected, const Tensor& h0,
                                                            const Tensor& c0, const Tensor& w_hh, bool reverse) {
  const bool recorded = torch::autograd::compute_requires_grad(projected, h0, c0, w_hh);
  check_recordable("multicomposite::lstm_recurrence", {projected, h0, c0, w_hh}, recorded);
  at::AutoDispatchBelowADInplaceOrView below;
  if (!recorded) {
    return typed_op<LstmSignature>("multicomposite::lstm_recurrence").call(projected, h0, c0, w_hh, reverse);
  }
  const auto outputs = typed_op<LstmKeepingSignature>("multicomposite::lstm_recurrence_keeping")
                           .call(projected, h0, c0, w_hh, reverse);
  auto node = make_node(true, reverse, h0, w_hh);
  node->set_next_edges(torch::autograd::collect_next_edges(projected, h0, c0, w_hh));
  keep(*node, outputs, std::index_sequence<3, 4, 5, 6>{});
  const std::tuple<Tensor, Tensor, Tensor> result{std::get<0>(outputs), std::get<1>(outputs), std::get<2>(outputs)};
  std::apply([&](const auto&... each) { (torch::autograd::set_history(each, node), ...); }, result);
  return result;
}

std::tuple<Tensor, Tensor> gru_recurrence_autograd(const Tensor& projected, const Tensor& h0, const Tensor& w_hh,
                                                   const std::optional<Tensor>& b_hh, bool reverse) {
  const bool recorded = torch::autograd::compute_requires_grad(projected, h0, w_hh, b_hh);
  check_recordable("multicomposite::gru_recurrence", {projected, h0, w_hh, b_hh.value_or(Tensor())}, recorded);
  at::AutoDispatchBelowADInplaceOrView below;
  if (!recorded) {
    return typed_op<GruSignature>("multicomposite::gru_recurrence").call(projected, h0, w_hh, b_hh, reverse);
  }
  const auto outputs = typed_op<GruKeepingSignature>("multicomposite::gru_recurrence_keeping")
                           .call(projected, h0, w_hh, b_hh, reverse);
  auto node = make_node(false, reverse, h0, w_hh);
  node->has_bias = b_hh.has_value() && b_hh->defined();
  node->set_next_edges(torch::autograd::collect_next_edges(projected, h0, w_hh, b_hh));
  keep(*node, outputs, std::index_sequence<2, 3, 4>{});
  const std::tuple<Tensor, Tensor> result{std::get<0>(outputs), std::get<1>(outputs)};
  std::apply([&](const auto&... each) { (torch::autograd::set_history(each, node), ...); }, result);
  return result;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(multicomposite, m) {
  // composites/recurrent.py's LSTMRecurrence's backward on ordinary CPU tensors (BPTT, the forward recomputed):
  // (d_projected, d_h0, d_c0, d_w_hh per lead index).
  m.def("lstm_steps_backward(Tensor projected, Tensor h0, Tensor c0, Tensor w_hh, Tensor d_out, Tensor d_h, "
        "Tensor d_c, bool reverse) -> (Tensor, Tensor, Tensor, Tensor)");
  // GRURecurrence's: (d_projected, d_h0, d_w_hh, d_b_hh per lead index).
  m.def("gru_steps_backward(Tensor projected, Tensor h0, Tensor w_hh, Tensor? b_hh, Tensor d_out, Tensor d_h, "
        "bool reverse) -> (Tensor, Tensor, Tensor, Tensor)");
  // The recurrences, (outputs, h_T[, c_T]), as ops with their own node and batching rule (NOTE [recurrence ops]),
  // the forwards that keep their activations, and the backwards from them (NOTE [kept activations]).
  m.def("lstm_recurrence(Tensor projected, Tensor h0, Tensor c0, Tensor w_hh, bool reverse) -> "
        "(Tensor, Tensor, Tensor)");
  m.def("lstm_recurrence_keeping(Tensor projected, Tensor h0, Tensor c0, Tensor w_hh, bool reverse) -> (Tensor out, "
        "Tensor h_n, Tensor c_n, Tensor steps_gates, Tensor steps_c, Tensor steps_tanh_c, Tensor steps_out)");
  m.def("lstm_recurrence_backward(Tensor h0, Tensor w_hh, Tensor steps_gates, Tensor steps_c, Tensor steps_tanh_c, "
        "Tensor steps_out, Tensor d_out, Tensor d_h, Tensor d_c, bool reverse) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("gru_recurrence(Tensor projected, Tensor h0, Tensor w_hh, Tensor? b_hh, bool reverse) -> (Tensor, Tensor)");
  m.def("gru_recurrence_keeping(Tensor projected, Tensor h0, Tensor w_hh, Tensor? b_hh, bool reverse) -> (Tensor out, "
        "Tensor h_n, Tensor steps_hw, Tensor steps_gates, Tensor steps_out)");
  m.def("gru_recurrence_backward(Tensor h0, Tensor w_hh, Tensor steps_hw, Tensor steps_gates, Tensor steps_out, "
        "Tensor d_out, Tensor d_h, bool reverse) -> (Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(multicomposite, CompositeExplicitAutograd, m) {
  m.impl("lstm_steps_backward", lstm_steps_backward);
  m.impl("gru_steps_backward", gru_steps_backward);
  m.impl("lstm_recurrence", lstm_steps);
  m.impl("lstm_recurrence_keeping", lstm_recurrence_keeping);
  m.impl("lstm_recurrence_backward", lstm_recurrence_backward);
  m.impl("gru_recurrence", gru_steps);
  m.impl("gru_recurrence_keeping", gru_recurrence_keeping);
  m.impl("gru_recurrence_backward", gru_recurrence_backward);
}

TORCH_LIBRARY_IMPL(multicomposite, Autograd, m) {
  m.impl("lstm_recurrence", lstm_recurrence_autograd);
  m.impl("gru_recurrence", gru_recurrence_autograd);
  for (const char* name : {"lstm_steps_backward", "gru_steps_backward", "lstm_recurrence_keeping",
                           "lstm_recurrence_backward", "gru_recurrence_keeping", "gru_recurrence_backward"}) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&no_derivative>());
  }
}

TORCH_LIBRARY_IMPL(multicomposite, FuncTorchBatched, m) {
  for (const char* name : {"lstm_recurrence", "lstm_recurrence_keeping", "lstm_recurrence_backward",
                           "lstm_steps_backward", "gru_recurrence", "gru_recurrence_keeping",
                           "gru_recurrence_backward", "gru_steps_backward"}) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&fold_batch>());
  }
}
