"""Batch norm and instance norm under vmap: what happens to the running statistics, which the generic coverage test
cannot see (it compares outputs, and gives every call fresh copies of the running statistics).

The reference is always a Python loop over the samples, calling PyTorch's own op outside any transform, each sample
on its own copy of the running statistics:
- running statistics batched like the input: sample b's slice must equal what sample b's call leaves in its copy;
- running statistics shared (not batched): ``batch_mean`` (the default inside use()) leaves the mean over the
  samples of what each call leaves in its copy; pinning ``native`` raises, as PyTorch does outside use().
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import func

import registry
from registry.core.recording import Run
from registry.core.selector import SelectionError

MOMENTUM = 0.1
EPS = 1e-5
SAMPLES, N, C, L = 3, 4, 5, 6
PYTORCH_ERROR = ("Batch norm got a batched tensor as input while the running_mean or running_var, which will be "
                 "updated in place, were not batched.")


def _inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(SAMPLES, N, C, L, generator=generator, dtype=torch.float64) * 2 + 0.5
    running_mean = torch.randn(C, generator=generator, dtype=torch.float64)
    running_var = torch.rand(C, generator=generator, dtype=torch.float64) + 0.5
    return x, running_mean, running_var


def _norm(op: str):
    if op == "batch_norm":
        return lambda x, rm, rv: F.batch_norm(x, rm, rv, training=True, momentum=MOMENTUM, eps=EPS)
    return lambda x, rm, rv: F.instance_norm(x, rm, rv, use_input_stats=True, momentum=MOMENTUM, eps=EPS)


def _per_sample_loop(op: str, x: torch.Tensor, running_mean: torch.Tensor, running_var: torch.Tensor):
    """(outputs, each sample's running mean after its call, each sample's running var): native, no transform."""
    outputs, means, variances = [], [], []
    for b in range(x.shape[0]):
        rm, rv = running_mean.clone(), running_var.clone()
        outputs.append(_norm(op)(x[b], rm, rv))
        means.append(rm)
        variances.append(rv)
    return torch.stack(outputs), torch.stack(means), torch.stack(variances)


@pytest.mark.parametrize("op", ["batch_norm", "instance_norm"])
def test_pytorch_refuses_shared_running_statistics_outside_use(op: str) -> None:
    x, rm, rv = _inputs()
    with pytest.raises(RuntimeError) as raised:
        func.vmap(_norm(op), in_dims=(0, None, None))(x, rm, rv)
    assert str(raised.value).startswith(PYTORCH_ERROR)


@pytest.mark.parametrize("op", ["batch_norm", "instance_norm"])
def test_default_updates_shared_running_statistics_with_the_batch_mean(op: str) -> None:
    x, rm, rv = _inputs()
    expected, means, variances = _per_sample_loop(op, x, rm, rv)
    with registry.use():
        out = func.vmap(_norm(op), in_dims=(0, None, None))(x, rm, rv)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(rm, means.mean(0))
    torch.testing.assert_close(rv, variances.mean(0))
    # The batch mean is not what any one sample leaves: the test can tell the two apart.
    assert not torch.allclose(rm, means[0])


@pytest.mark.parametrize("op", ["batch_norm", "instance_norm"])
def test_batched_running_statistics_get_each_samples_own_update(op: str) -> None:
    x, rm, rv = _inputs(1)
    expected, means, variances = _per_sample_loop(op, x, rm, rv)
    for pins in ({}, {op: "batch_mean"}, {op: "native"}):
        batched_mean, batched_var = rm.expand(SAMPLES, C).clone(), rv.expand(SAMPLES, C).clone()
        with registry.use(pins=pins):
            out = func.vmap(_norm(op))(x, batched_mean, batched_var)
        torch.testing.assert_close(out, expected)
        torch.testing.assert_close(batched_mean, means)
        torch.testing.assert_close(batched_var, variances)


@pytest.mark.parametrize("op", ["batch_norm", "instance_norm"])
def test_pinning_native_keeps_pytorchs_refusal(op: str) -> None:
    x, rm, rv = _inputs()
    before = rm.clone()
    with registry.use(pins={op: "native"}), pytest.raises(SelectionError) as raised:
        func.vmap(_norm(op), in_dims=(0, None, None))(x, rm, rv)
    assert str(raised.value) == (
        f"select({op}): pinned composite native (native) is not valid under vmap with input batched: error, "
        f"{PYTORCH_ERROR[:-1]} (PyTorch's batching rule; in training mode); valid choices: batch_mean")
    assert torch.equal(rm, before)


def test_default_decision_names_the_composite_and_why() -> None:
    decision = registry.select("batch_norm", stack="vmap", batched=["input"],
                               tensors=["input", "weight", "bias", "running_mean", "running_var"], policy="rules")
    assert (decision.composite, decision.kind) == ("batch_mean", "functional")
    assert registry.select("batch_norm", stack="vmap", batched=["input", "running_mean", "running_var"],
                           tensors=["input", "running_mean", "running_var"], policy="rules").kind == "native"
    assert registry.select("batch_norm", stack="grad", tensors=["input", "running_mean", "running_var"],
                           policy="rules").kind == "native"


def test_per_sample_gradients_update_shared_running_statistics_once() -> None:
    """vmap(grad): the forward runs once per vmap call, so the running statistics get one batch-mean update; the
    per-sample gradients equal a loop of native autograd."""
    x, rm, rv = _inputs(2)
    weight = torch.linspace(0.5, 1.5, C, dtype=torch.float64)

    def loss(sample: torch.Tensor, running_mean: torch.Tensor, running_var: torch.Tensor) -> torch.Tensor:
        out = F.batch_norm(sample, running_mean, running_var, weight, training=True, momentum=MOMENTUM, eps=EPS)
        return (out ** 3).sum()

    expected_grads, means, variances = [], [], []
    for b in range(SAMPLES):
        sample, m, v = x[b].clone().requires_grad_(), rm.clone(), rv.clone()
        expected_grads.append(torch.autograd.grad(loss(sample, m, v), sample)[0])
        means.append(m)
        variances.append(v)
    with registry.use():
        grads = func.vmap(func.grad(loss), in_dims=(0, None, None))(x, rm, rv)
    torch.testing.assert_close(grads, torch.stack(expected_grads))
    torch.testing.assert_close(rm, torch.stack(means).mean(0))
    torch.testing.assert_close(rv, torch.stack(variances).mean(0))


def test_forward_mode_and_nested_vmap_reduce_over_every_unbatched_level() -> None:
    x, rm, rv = _inputs(3)
    tangents = torch.randn_like(x)
    expected, means, variances = _per_sample_loop("batch_norm", x, rm, rv)
    with registry.use():
        out, _ = func.vmap(lambda s, t: func.jvp(lambda u: _norm("batch_norm")(u, rm, rv), (s,), (t,)))(x, tangents)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(rm, means.mean(0))
    torch.testing.assert_close(rv, variances.mean(0))

    x, rm, rv = _inputs(4)
    grid = x.reshape(1, SAMPLES, N, C, L).expand(2, SAMPLES, N, C, L) * torch.tensor([1.0, 2.0]).double().reshape(
        2, 1, 1, 1, 1)
    _, means, variances = _per_sample_loop("batch_norm", grid.reshape(2 * SAMPLES, N, C, L), rm, rv)
    with registry.use():
        func.vmap(func.vmap(_norm("batch_norm"), in_dims=(0, None, None)), in_dims=(0, None, None))(grid, rm, rv)
    torch.testing.assert_close(rm, means.mean(0))
    torch.testing.assert_close(rv, variances.mean(0))


def test_evaluation_mode_reads_shared_running_statistics_and_leaves_them() -> None:
    x, rm, rv = _inputs(5)
    before_mean, before_var = rm.clone(), rv.clone()
    expected = torch.stack([F.batch_norm(x[b], rm, rv, training=False, eps=EPS) for b in range(SAMPLES)])
    with registry.use():
        out = func.vmap(lambda s: F.batch_norm(s, rm, rv, training=False, eps=EPS))(x)
    torch.testing.assert_close(out, expected)
    assert torch.equal(rm, before_mean) and torch.equal(rv, before_var)


# --- group norm: the C++ op under one reverse level, PyTorch's op wherever the backward is differentiated again -----


def _group_norm_model() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.GroupNorm(2, 8), torch.nn.ReLU(),
                                torch.nn.Flatten(), torch.nn.Linear(8 * 6 * 6, 4)).double()
    return model, torch.randn(5, 3, 8, 8, dtype=torch.float64)


def _sample_loss(model: torch.nn.Module):
    def loss(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return func.functional_call(model, params, (x.unsqueeze(0),)).square().sum()

    return loss


def _group_norm_decisions(run: Run) -> set[tuple[tuple[str, ...], str]]:
    return {(d.stack, d.kind) for d in run.decisions if d.op == "native_group_norm"}


def test_per_sample_gradients_through_group_norm_run_the_cpp_op_and_equal_the_loop() -> None:
    model, x = _group_norm_model()
    params = {name: p.detach() for name, p in model.named_parameters()}
    loss = _sample_loss(model)
    loop = [func.grad(loss)(params, x[b]) for b in range(x.shape[0])]
    with registry.use(record=True) as run:
        got = func.vmap(func.grad(loss), in_dims=(None, 0))(params, x)
    assert _group_norm_decisions(run) == {(("vmap", "grad"), "cpp_op")}
    for name in params:
        torch.testing.assert_close(got[name], torch.stack([each[name] for each in loop]))


def test_group_norm_differentiated_again_stays_pytorchs() -> None:
    """grad(vmap(grad)) and vmap(hessian) differentiate the backward: the C++ op's backward has no derivative, so
    PyTorch's op runs there, with PyTorch's values."""
    model, x = _group_norm_model()
    params = {name: p.detach() for name, p in model.named_parameters()}
    loss = _sample_loss(model)

    def meta(p: dict[str, torch.Tensor]) -> torch.Tensor:
        return sum(g.square().sum() for g in func.vmap(func.grad(loss), in_dims=(None, 0))(p, x).values())

    def input_loss(sample: torch.Tensor) -> torch.Tensor:
        return loss(params, sample)

    expected_meta, expected_hessian = func.grad(meta)(params), func.vmap(func.hessian(input_loss))(x[:2])
    with registry.use(record=True) as run:
        got_meta, got_hessian = func.grad(meta)(params), func.vmap(func.hessian(input_loss))(x[:2])
    assert {kind for _, kind in _group_norm_decisions(run)} == {"native"}
    for name in params:
        torch.testing.assert_close(got_meta[name], expected_meta[name])
    torch.testing.assert_close(got_hessian, expected_hessian)


def test_eager_autograd_through_per_sample_gradients_of_group_norm() -> None:
    """Parameters that require grad outside the transforms: eager autograd records the whole per-sample-gradient
    computation and differentiates it again; the composite runs PyTorch's op there."""
    model, x = _group_norm_model()
    params = dict(model.named_parameters())
    loss = _sample_loss(model)

    def penalty() -> tuple[torch.Tensor, ...]:
        grads = func.vmap(func.grad(loss), in_dims=(None, 0))(params, x)
        return torch.autograd.grad(sum(g.square().sum() for g in grads.values()), list(params.values()))

    expected = penalty()
    with registry.use():
        got = penalty()
    for each, want in zip(got, expected, strict=True):
        torch.testing.assert_close(each, want)


def test_group_norm_statistics_are_differentiable() -> None:
    """The mean and rstd outputs of native_group_norm carry gradients and tangents, as PyTorch's do."""
    torch.manual_seed(0)
    x = torch.randn(3, 2, 6, 5, dtype=torch.float64)
    weight, bias = torch.randn(6, dtype=torch.float64), torch.randn(6, dtype=torch.float64)

    def every_output(sample: torch.Tensor) -> torch.Tensor:
        out, mean, rstd = torch.ops.aten.native_group_norm(sample, weight, bias, 2, 6, 5, 3, 1e-5)
        return out.sum() + (mean * 3).sum() + (rstd ** 2).sum()

    expected_grad = func.vmap(func.grad(every_output))(x)
    expected_jvp = func.vmap(lambda s, t: func.jvp(every_output, (s,), (t,))[1])(x, x.flip(0))
    with registry.use(pins={"native_group_norm": "cpp_op"}):
        got_grad = func.vmap(func.grad(every_output))(x)
        got_jvp = func.vmap(lambda s, t: func.jvp(every_output, (s,), (t,))[1])(x, x.flip(0))
    torch.testing.assert_close(got_grad, expected_grad)
    torch.testing.assert_close(got_jvp, expected_jvp)
