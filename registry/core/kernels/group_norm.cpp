// multicomposite::group_norm: aten::native_group_norm with a first-order backward node of its own (the cpp_op
// composite of native_group_norm, with its op and its rules, in composites/normalization.py).
//
// NOTE: why an op of our own. Under torch.func's grad, autograd runs with create_graph, so PyTorch's node of
// native_group_norm computes its backward by infinitely_differentiable_native_group_norm_backward, about a dozen
// whole-tensor ops, each batched under vmap(grad) on its own (on a CNN with GroupNorm at batch 64 two group norms'
// backward were 14 ms of a 45 ms per-sample-gradient step). This op's node calls aten::native_group_norm_backward
// once instead, which batch_rules.cpp folds over the batch into one call of PyTorch's kernel plus two per-channel
// sums. native_group_norm_backward has no derivative of its own, so a second derivative through this node raises
// PyTorch's "derivative for aten::native_group_norm_backward is not implemented"; the composite's rule keeps it to
// stacks with one level that differentiates (vmap(grad), vmap(jacrev), grad, vmap(jvp), jacfwd), where nothing
// differentiates the backward again. The forward-AD tangents are formulas in aten ops (set_tangents). The mean and
// rstd outputs are differentiable, as aten's are.
//
// Forward: PyTorch's own native_group_norm (CompositeExplicitAutograd), and under vmap that op again on the batched
// tensors (FuncTorchBatched decomposes into it, so batch_rules.cpp's rule or functorch's folds it).

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/library.h>

#include <optional>
#include <vector>
#include <string>
#include <tuple>

namespace {

using at::Tensor;
using torch::autograd::variable_list;
using Triple = std::tuple<Tensor, Tensor, Tensor>;

bool present(const std::optional<Tensor>& t) { return t.has_value() && t->defined(); }

Triple group_norm_aten(const Tensor& input, const std::optional<Tensor>& weight, const std::optional<Tensor>& bias,
                       int64_t samples, int64_t channels, int64_t inner, int64_t group, double eps) {
  return at::native_group_norm(input, weight, bias, samples, channels, inner, group, eps);
}

const c10::TypedOperatorHandle<Triple(const Tensor&, const std::optional<Tensor>&, const std::optional<Tensor>&,
                                      int64_t, int64_t, int64_t, int64_t, double)>&
group_norm_op() {
  static const auto handle = c10::Dispatcher::singleton()
                                 .findSchemaOrThrow("multicomposite::group_norm", "")
                                 .typed<Triple(const Tensor&, const std::optional<Tensor>&,
                                               const std::optional<Tensor>&, int64_t, int64_t, int64_t, int64_t,
                                               double)>();
  return handle;
}

// Each sample's rows, as (N, G, D * HxW): what a group's mean and rstd are taken over (the last size spelled out:
// an empty input has no -1 to infer).
Tensor grouped(const Tensor& t, int64_t samples, int64_t channels, int64_t inner, int64_t group) {
  return t.reshape({samples, group, channels / group * inner});
}

struct GroupNormBackward : public torch::autograd::Node {
  torch::autograd::SavedVariable input, weight, mean, rstd;  // mean and rstd: outputs of this node
  int64_t samples = 0, channels = 0, inner = 0, group = 0;
  bool has_weight = false, has_bias = false;

  variable_list apply(variable_list&& grads) override {
    const Tensor &grad = grads[0], &grad_mean = grads[1], &grad_rstd = grads[2];
    const bool want_input = task_should_compute_output(0);
    const bool want_weight = has_weight && task_should_compute_output(1) && grad.defined();
    const bool want_bias = has_bias && task_should_compute_output(2) && grad.defined();
    const bool from_stats = want_input && (grad_mean.defined() || grad_rstd.defined());
    if (!(want_input || want_weight || want_bias)) return {Tensor(), Tensor(), Tensor()};
    const Tensor x = input.unpack(), w = has_weight ? weight.unpack() : Tensor();
    const Tensor mu = mean.unpack(getptr()), sigma = rstd.unpack(getptr());
    Tensor grad_input, grad_weight, grad_bias;
    if (grad.defined()) {
      std::tie(grad_input, grad_weight, grad_bias) = at::native_group_norm_backward(
          grad, x, mu, sigma, has_weight ? std::optional<Tensor>(w) : std::nullopt, samples, channels, inner, group,
          {want_input, want_weight, want_bias});
    }
    if (from_stats) {
      // Through the statistics themselves (a loss that reads them): d mean / dx = 1 / M and
      // d rstd / dx = -rstd^3 (x - mean) / M over each group's M = D * HxW elements.
      const Tensor xg = grouped(x, samples, channels, inner, group);
      const double count = static_cast<double>(xg.size(-1));
      Tensor extra;
      if (grad_mean.defined()) extra = grad_mean.unsqueeze(-1).div(count).expand_as(xg);
      if (grad_rstd.defined()) {
        const Tensor term = grad_rstd.mul(sigma.pow(3)).unsqueeze(-1).mul(xg - mu.unsqueeze(-1)).div(-count);
        extra = extra.defined() ? extra + term : term;
      }
      extra = extra.reshape(x.sizes());
      grad_input = grad_input.defined() ? grad_input + extra : extra;
    }
    return {grad_input, grad_weight, grad_bias};
  }
  std::string name() const override { return "multicomposite::GroupNormBackward"; }
  void release_variables() override {
    input.reset_data();
    weight.reset_data();
    mean.reset_data();
    rstd.reset_data();
  }
};

Tensor tangent_of(const std::optional<Tensor>& t) {
  return present(t) ? t->_fw_grad(/*level=*/0) : Tensor();
}

// The forward-AD tangents of (out, mean, rstd) from those of input, weight and bias, in aten ops (so that they
// batch and differentiate as those do): with x_hat = (x - mean) * rstd over each group,
//   d mean = mean_g(dx), d rstd = -rstd^2 * mean_g(x_hat * dx), d x_hat = rstd * (dx - d mean) + x_hat * d rstd / rstd,
//   d out = d x_hat * w + x_hat * dw + db.
void set_tangents(const Triple& result, const Tensor& input_dual, const std::optional<Tensor>& weight_dual,
                  const Tensor& dx, const Tensor& dw, const Tensor& db, int64_t samples, int64_t channels,
                  int64_t inner, int64_t group) {
  const auto& [out, mean, rstd] = result;
  // The primals: a tangent computed from a tensor that has one would carry one itself, which PyTorch refuses.
  const Tensor input = input_dual._fw_primal(/*level=*/0);
  const std::optional<Tensor> weight =
      present(weight_dual) ? std::optional<Tensor>(weight_dual->_fw_primal(/*level=*/0)) : std::nullopt;
  const Tensor xg = grouped(input, samples, channels, inner, group);
  const Tensor mu = mean.unsqueeze(-1), sigma = rstd.unsqueeze(-1);
  const Tensor x_hat = (xg - mu) * sigma;
  Tensor d_out, d_mean, d_rstd;
  if (dx.defined()) {
    const Tensor dxg = grouped(dx, samples, channels, inner, group);
    d_mean = dxg.mean(-1);
    d_rstd = -(rstd * rstd) * (x_hat * dxg).mean(-1);
    d_out = (sigma * (dxg - d_mean.unsqueeze(-1)) + x_hat * (d_rstd / rstd).unsqueeze(-1)).reshape(input.sizes());
  }
  // The affine part per channel: (N, C, HxW...) with the weight's and bias's (C) broadcast over dim 1.
  std::vector<int64_t> per_channel(input.dim(), 1);
  per_channel[1] = input.size(1);
  if (d_out.defined() && present(weight)) d_out = d_out * weight->reshape(per_channel);
  if (dw.defined()) {
    const Tensor term = x_hat.reshape(input.sizes()) * dw.reshape(per_channel);
    d_out = d_out.defined() ? d_out + term : term;
  }
  if (db.defined()) {
    const Tensor term = db.reshape(per_channel).expand(input.sizes());
    d_out = d_out.defined() ? d_out + term : term;
  }
  if (d_out.defined()) out._set_fw_grad(d_out.expand(out.sizes()).contiguous(), /*level=*/0, false);
  if (d_mean.defined()) mean._set_fw_grad(d_mean.reshape(mean.sizes()), /*level=*/0, false);
  if (d_rstd.defined()) rstd._set_fw_grad(d_rstd.reshape(rstd.sizes()), /*level=*/0, false);
}

Triple group_norm_autograd(const Tensor& input, const std::optional<Tensor>& weight,
                           const std::optional<Tensor>& bias, int64_t samples, int64_t channels, int64_t inner,
                           int64_t group, double eps) {
  c10::intrusive_ptr<GroupNormBackward> node;
  if (torch::autograd::compute_requires_grad(input, weight, bias)) {
    node = c10::make_intrusive<GroupNormBackward>();
    node->set_next_edges(torch::autograd::collect_next_edges(input, weight, bias));
    node->samples = samples;
    node->channels = channels;
    node->inner = inner;
    node->group = group;
    node->has_weight = present(weight);
    node->has_bias = present(bias);
  }
  Triple result;
  {
    at::AutoDispatchBelowADInplaceOrView below;
    result = group_norm_op().call(input, weight, bias, samples, channels, inner, group, eps);
  }
  if (node) {
    node->input = torch::autograd::SavedVariable(input, /*is_output=*/false);
    if (node->has_weight) node->weight = torch::autograd::SavedVariable(*weight, /*is_output=*/false);
    torch::autograd::set_history(std::get<0>(result), node);
    torch::autograd::set_history(std::get<1>(result), node);
    torch::autograd::set_history(std::get<2>(result), node);
    node->mean = torch::autograd::SavedVariable(std::get<1>(result), /*is_output=*/true);
    node->rstd = torch::autograd::SavedVariable(std::get<2>(result), /*is_output=*/true);
  }
  const Tensor dx = tangent_of(input), dw = tangent_of(weight), db = tangent_of(bias);
  if (dx.defined() || dw.defined() || db.defined()) {
    set_tangents(result, input, weight, dx, dw, db, samples, channels, inner, group);
  }
  return result;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(multicomposite, m) {
  m.def("group_norm(Tensor input, Tensor? weight, Tensor? bias, int N, int C, int HxW, int group, float eps) -> "
        "(Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(multicomposite, CompositeExplicitAutograd, m) { m.impl("group_norm", group_norm_aten); }

TORCH_LIBRARY_IMPL(multicomposite, Autograd, m) { m.impl("group_norm", group_norm_autograd); }

// Under vmap the op is aten's native_group_norm on the batched tensors: its batching rule folds the batch.
TORCH_LIBRARY_IMPL(multicomposite, FuncTorchBatched, m) { m.impl("group_norm", group_norm_aten); }
