"""``F.embedding(..., max_norm=...)`` and ``nn.Embedding(max_norm=...)`` under torch.func inside ``use()``: outputs
and gradients against a per-sample loop of PyTorch's own ops outside any transform, each sample on a fresh clone of
the weight (so that the loop's writes do not reach another sample); a weight shared by the samples left unwritten
(values and version), a batched weight (an ensemble) renormed in each sample's own slice."""

from __future__ import annotations

import copy
import gc
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn
from torch.func import functional_call, functionalize, grad, jacfwd, jacrev, vmap

import registry
from composites import embedding
from registry.core import selector

ROWS, DIM, SAMPLES, LOOKUPS, MAX_NORM = 10, 4, 3, 5, 1.0
FALLBACK = "There is a performance drop"
PYTORCH_ERROR = "vmap: aten::embedding_renorm_(self, *extra_args) is not possible"
NORM_TYPES = [2.0, 1.0, 3.5]
PADDING = [None, 3]  # row 3 is looked up by every sample, and is above max_norm


def _weight(seed: int = 0, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(ROWS, DIM, generator=generator, dtype=torch.float64) * 2).to(dtype)


def _indices(seed: int = 0) -> torch.Tensor:
    # Every sample looks up rows above max_norm; row 3 in every sample (repeated across samples), one row twice in
    # sample 0 (repeated within a sample).
    generator = torch.Generator().manual_seed(seed)
    found = torch.randint(0, ROWS, (SAMPLES, LOOKUPS), generator=generator)
    found[:, 0] = 3
    found[0, 1] = found[0, 2]
    return found


def _embed(indices: torch.Tensor, weight: torch.Tensor, norm_type: float = 2.0,
           padding_idx: int | None = None) -> torch.Tensor:
    return F.embedding(indices, weight, padding_idx=padding_idx, max_norm=MAX_NORM, norm_type=norm_type)


def _loss(weight: torch.Tensor, indices: torch.Tensor, norm_type: float = 2.0,
          padding_idx: int | None = None) -> torch.Tensor:
    return _embed(indices, weight, norm_type, padding_idx).pow(3).sum()


def _fallbacks(caught: list) -> list[str]:
    return [str(w.message) for w in caught if FALLBACK in str(w.message)]


def _unchanged(weight: torch.Tensor, before: torch.Tensor, version: int) -> None:
    assert torch.equal(weight, before)
    assert weight._version == version


def _loop(weight: torch.Tensor, indices: torch.Tensor, norm_type: float = 2.0, padding_idx: int | None = None,
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Outputs and per-sample gradients, each sample on a fresh clone of the weight."""
    outputs, grads = [], []
    for b in range(indices.shape[0]):
        outputs.append(_embed(indices[b], weight.clone(), norm_type, padding_idx))
        leaf = weight.clone().requires_grad_()
        grads.append(torch.autograd.grad(_loss(leaf, indices[b], norm_type, padding_idx), leaf)[0])
    return torch.stack(outputs), torch.stack(grads)


def _loop_jacobians(weight: torch.Tensor, indices: torch.Tensor, norm_type: float = 2.0) -> torch.Tensor:
    return torch.stack([torch.autograd.functional.jacobian(lambda w, b=b: _embed(indices[b], w, norm_type),
                                                           weight.clone()) for b in range(indices.shape[0])])


def test_pytorch_refuses_a_shared_weight_outside_use() -> None:
    weight, indices = _weight(), _indices()
    before = weight.clone()
    with pytest.raises(RuntimeError, match=PYTORCH_ERROR.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*")):
        vmap(lambda i: _embed(i, weight))(indices)
    with pytest.raises(RuntimeError, match="is not possible"):
        vmap(grad(_loss), in_dims=(None, 0))(weight, indices)
    with pytest.raises(RuntimeError, match="is not possible"):
        vmap(lambda i: jacfwd(lambda w: _embed(i, w))(weight))(indices)
    assert torch.equal(weight, before)


@pytest.mark.parametrize("padding_idx", PADDING)
@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_shared_weight_under_vmap_reads_each_samples_rows_renormed(norm_type: float, padding_idx: int | None,
                                                                  fallback_warnings: list) -> None:
    weight, indices = _weight(1), _indices(1)
    before, version = weight.clone(), weight._version
    expected, _ = _loop(weight, indices, norm_type, padding_idx)
    with registry.use():
        got = vmap(lambda i: _embed(i, weight, norm_type, padding_idx))(indices)
    assert _fallbacks(fallback_warnings) == []
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    # Renormed, each sample its own rows: every looked-up row above max_norm has norm max_norm * n / (n + 1e-7).
    norms = torch.linalg.vector_norm(got, ord=norm_type, dim=-1)
    original = torch.linalg.vector_norm(before[indices], ord=norm_type, dim=-1)
    assert ((norms < MAX_NORM) | (original <= MAX_NORM)).all() and (original > MAX_NORM).any()
    _unchanged(weight, before, version)


@pytest.mark.parametrize("padding_idx", PADDING)
@pytest.mark.parametrize("norm_type", [2.0, 1.0])
def test_per_sample_gradients_with_a_shared_weight_equal_the_loop(norm_type: float, padding_idx: int | None,
                                                                 fallback_warnings: list) -> None:
    weight, indices = _weight(2), _indices(2)
    before, version = weight.clone(), weight._version
    expected_outputs, expected = _loop(weight, indices, norm_type, padding_idx)
    with registry.use():
        got = vmap(grad(_loss), in_dims=(None, 0, None, None))(weight, indices, norm_type, padding_idx)
        outputs = vmap(lambda i: _embed(i, weight, norm_type, padding_idx))(indices)
    assert _fallbacks(fallback_warnings) == []
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    torch.testing.assert_close(outputs, expected_outputs, rtol=0, atol=0)
    if padding_idx is not None:
        assert (got[:, padding_idx] == 0).all()
    # PyTorch's renorm is not differentiated: the gradient is 3 * renormed rows ** 2, index_added.
    assert not torch.equal(got, vmap(grad(lambda w, i: w[i].pow(3).sum()), in_dims=(None, 0))(weight, indices))
    _unchanged(weight, before, version)


@pytest.mark.parametrize("norm_type", [2.0, 1.0])
def test_per_sample_jacobians_equal_the_loop(norm_type: float, fallback_warnings: list) -> None:
    """jacrev and jacfwd in the weight, per sample (vmap over them) and over a vmapped function (vmap inside)."""
    weight, indices = _weight(3), _indices(3)
    before, version = weight.clone(), weight._version
    expected = _loop_jacobians(weight, indices, norm_type)
    with registry.use():
        got = {
            "vmap(jacrev)": vmap(lambda i: jacrev(lambda w: _embed(i, w, norm_type))(weight))(indices),
            "vmap(jacfwd)": vmap(lambda i: jacfwd(lambda w: _embed(i, w, norm_type))(weight))(indices),
            "jacrev(vmap)": jacrev(lambda w: vmap(lambda i: _embed(i, w, norm_type))(indices))(weight),
            "jacfwd(vmap)": jacfwd(lambda w: vmap(lambda i: _embed(i, w, norm_type))(indices))(weight),
        }
    assert _fallbacks(fallback_warnings) == []
    for name, jacobians in got.items():
        torch.testing.assert_close(jacobians, expected, rtol=0, atol=0, msg=lambda m, name=name: f"{name}: {m}")
    _unchanged(weight, before, version)


def test_float32_rows_are_pytorchs_kernel_values(fallback_warnings: list) -> None:
    weight, indices = _weight(4, torch.float32), _indices(4)
    before, version = weight.clone(), weight._version
    expected, expected_grads = _loop(weight, indices)
    with registry.use():
        got = vmap(lambda i: _embed(i, weight))(indices)
        grads = vmap(grad(_loss), in_dims=(None, 0))(weight, indices)
    assert _fallbacks(fallback_warnings) == []
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    torch.testing.assert_close(grads, expected_grads, rtol=0, atol=0)
    _unchanged(weight, before, version)


def test_autograd_outside_vmap_sums_the_loops_gradients() -> None:
    """A weight that requires grad, looked up under vmap and differentiated by eager autograd outside it."""
    weight, indices = _weight(14).requires_grad_(), _indices(14)
    before, version = weight.detach().clone(), weight._version
    outputs, grads = _loop(weight.detach(), indices)
    with registry.use():
        got = vmap(lambda i: _embed(i, weight))(indices)
        got.pow(3).sum().backward()
    torch.testing.assert_close(got.detach(), outputs, rtol=0, atol=0)
    torch.testing.assert_close(weight.grad, grads.sum(0))
    _unchanged(weight.detach(), before, version)


def test_a_weight_captured_from_outside_grad_is_left_unwritten() -> None:
    """PyTorch refuses an in-place write into a tensor captured by grad; inside use() there is none to refuse."""
    weight, indices, scale = _weight(5), _indices(5), torch.tensor(1.5, dtype=torch.float64)
    before, version = weight.clone(), weight._version
    expected = []
    for b in range(SAMPLES):
        leaf = scale.clone().requires_grad_()
        expected.append(torch.autograd.grad((_embed(indices[b], weight.clone()) * leaf).pow(2).sum(), leaf)[0])
    with registry.use():
        got = vmap(grad(lambda s, i: (_embed(i, weight) * s).pow(2).sum()), in_dims=(None, 0))(scale, indices)
    torch.testing.assert_close(got, torch.stack(expected), rtol=0, atol=0)
    _unchanged(weight, before, version)


def test_two_lookups_of_one_weight_equal_the_loop() -> None:
    """Per sample, as the loop runs them on one clone: two max_norm lookups with other indices, the same indices
    twice, then a plain lookup with the indices a max_norm lookup renormed (it reads those rows renormed)."""
    weight, indices, others = _weight(6), _indices(6), _indices(7)

    def lookups(i: torch.Tensor, j: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.cat([_embed(i, w), _embed(j, w), _embed(i, w), torch.embedding(w, i)])

    before, version = weight.clone(), weight._version
    expected = torch.stack([lookups(indices[b], others[b], weight.clone()) for b in range(SAMPLES)])
    with registry.use():
        got = vmap(lookups, in_dims=(0, 0, None))(indices, others, weight)
        gradients = vmap(grad(lambda w, i, j: lookups(i, j, w).pow(3).sum()), in_dims=(None, 0, 0))(
            weight, indices, others)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    expected_gradients = []
    for b in range(SAMPLES):
        leaf = weight.clone().requires_grad_()
        expected_gradients.append(torch.autograd.grad(lookups(indices[b], others[b], leaf).pow(3).sum(), leaf)[0])
    torch.testing.assert_close(gradients, torch.stack(expected_gradients), rtol=0, atol=0)
    _unchanged(weight, before, version)


def test_functionalized_and_compiled_lookups_equal_the_loop() -> None:
    """Under vmap(functionalize), under the automatic functionalization of a write into a fresh buffer, and under
    torch.compile (whose tracing sees fake and functional tensors): PyTorch raises for all three, use() reads the
    loop's rows."""
    weight, indices = _weight(13), _indices(13)
    before, version = weight.clone(), weight._version

    def scattered(i: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.zeros(ROWS, DIM, dtype=w.dtype).index_add_(0, i, _embed(i, w))

    expected = torch.stack([_embed(indices[b], weight.clone()) for b in range(SAMPLES)])
    expected_scattered = torch.stack([scattered(indices[b], weight.clone()) for b in range(SAMPLES)])
    runs = {
        "vmap(functionalize)": lambda: vmap(functionalize(lambda i: _embed(i, weight)))(indices),
        "fresh buffer": lambda: vmap(lambda i: scattered(i, weight))(indices),
        "compile": lambda: torch.compile(vmap(lambda i: _embed(i, weight)), backend="aot_eager",
                                         fullgraph=True)(indices),
    }
    for name, run in runs.items():
        refusal = "mutating a non-functional tensor" if name == "vmap(functionalize)" else "is not possible"
        with pytest.raises(Exception, match=refusal):
            run()
        with registry.use():
            got = run()
        want = expected_scattered if name == "fresh buffer" else expected
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=lambda m, name=name: f"{name}: {m}")
        _unchanged(weight, before, version)
    torch._dynamo.reset()


def test_no_record_outlives_the_transformed_call() -> None:
    """A renorm no lookup reads (embedding_renorm_ called alone) writes nothing and leaves nothing behind: a later
    lookup of the weight, in another transformed call, reads the rows as they are."""
    weight, indices = _weight(8), _indices(8)
    before, version = weight.clone(), weight._version
    with registry.use():
        vmap(lambda i: torch.embedding_renorm_(weight, i, MAX_NORM, 2.0))(indices)
        vmap(lambda i: _embed(i, weight))(indices)
        gc.collect()
        assert not embedding._records.by_indices
        got = vmap(lambda i: torch.embedding(weight, i))(indices)
    torch.testing.assert_close(got, before[indices], rtol=0, atol=0)
    _unchanged(weight, before, version)


def test_batched_weights_renorm_each_samples_own_rows(fallback_warnings: list) -> None:
    """One weight per sample (an ensemble): PyTorch loops; inside use() each slice gets its own rows, vectorized, in
    place, as a loop over the members writes each member's weight."""
    scales = torch.tensor([1.0, 0.3, 2.0], dtype=torch.float64).reshape(SAMPLES, 1, 1)
    indices = _indices(9)
    for shared_indices in (False, True):
        weights = (_weight(9) * scales).contiguous()
        run = (lambda: vmap(lambda v: _embed(indices[0], v))(weights)) if shared_indices else (  # noqa: B023
            lambda: vmap(_embed)(indices, weights))  # noqa: B023
        looped = weights.clone()
        rows = (lambda b: indices[0]) if shared_indices else (lambda b: indices[b])
        expected = torch.stack([_embed(rows(b), looped[b]) for b in range(SAMPLES)])
        with registry.use():
            got = run()
        assert _fallbacks(fallback_warnings) == []
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
        torch.testing.assert_close(weights, looped, rtol=0, atol=0)


def test_nested_vmap_ensemble_of_weights_over_samples(fallback_warnings: list) -> None:
    """vmap over two models' weights, then over the samples: each model's weight is shared by the samples, so none
    is written; each (model, sample) reads its own rows renormed."""
    indices = _indices(10)
    weights = (_weight(10) * torch.tensor([1.0, 0.4], dtype=torch.float64).reshape(2, 1, 1)).contiguous()
    before, version = weights.clone(), weights._version
    expected = torch.stack([torch.stack([_embed(indices[b], weights[m].clone()) for b in range(SAMPLES)])
                            for m in range(2)])
    with registry.use():
        got = vmap(lambda w: vmap(lambda i: _embed(i, w))(indices))(weights)
        swapped = vmap(lambda i: vmap(lambda w: _embed(i, w))(weights))(indices)
    assert _fallbacks(fallback_warnings) == []
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    torch.testing.assert_close(swapped, expected.transpose(0, 1), rtol=0, atol=0)
    _unchanged(weights, before, version)


def test_outside_vmap_pytorchs_own_op_runs() -> None:
    """Outside any transform and under grad alone (jacrev's forward) PyTorch's op runs, writing as natively."""
    weight, indices = _weight(11), _indices(11)
    looped = weight.clone()
    expected = torch.autograd.functional.jacobian(lambda w: _embed(indices[0], w), looped.clone())
    _embed(indices[0], looped)
    assert registry.select("embedding_renorm_", stack="grad", policy="rules").kind == "native"
    assert registry.select("embedding_renorm_", stack="vmap", batched=["indices"], policy="rules").composite == \
        "per_sample"
    assert registry.select("embedding_renorm_", stack="vmap", batched=["self", "indices"],
                           policy="rules").composite == "per_sample"
    assert registry.select("embedding", stack="vmap,grad", batched=["indices"], policy="rules").composite == \
        "reads_recorded_renorm"
    assert registry.select("embedding", stack="vmap", batched=["weight", "indices"], policy="rules").kind == "native"
    assert registry.select("embedding", stack="grad", policy="rules").kind == "native"
    with registry.use():
        got = jacrev(lambda w: _embed(indices[0], w))(weight)
        eager = weight.clone()
        _embed(indices[1], eager)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(weight, looped)
    reference = weight.clone()
    _embed(indices[1], reference)
    assert torch.equal(eager, reference) and not torch.equal(eager, weight)


def test_bad_input_says_what_to_fix() -> None:
    weight = _weight()
    with registry.use(), pytest.raises(TypeError, match="embedding_renorm_: indices must be int32 or int64"):
        vmap(lambda i: torch.embedding_renorm_(weight, i, 1.0, 2.0))(torch.zeros(SAMPLES, 2))
    with registry.use(), pytest.raises(ValueError, match=r"embedding_renorm_: self must be 2-D"):
        vmap(lambda i: torch.embedding_renorm_(weight[0], i, 1.0, 2.0))(torch.zeros(SAMPLES, 2, dtype=torch.long))


class _Tagger(nn.Module):
    """nn.Embedding(max_norm=...) with padding, then a linear head: the module a user writes."""

    def __init__(self, norm_type: float) -> None:
        super().__init__()
        self.embedding = nn.Embedding(ROWS, DIM, max_norm=MAX_NORM, norm_type=norm_type, padding_idx=0)
        self.head = nn.Linear(DIM, 2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(tokens)).sum()


def _module_loop(model: nn.Module, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per sample, a fresh copy of the module, native autograd."""
    grads = []
    for b in range(tokens.shape[0]):
        fresh = copy.deepcopy(model)
        fresh(tokens[b]).backward()
        grads.append({name: p.grad for name, p in fresh.named_parameters()})
    return {name: torch.stack([g[name] for g in grads]) for name in grads[0]}


@pytest.mark.parametrize("norm_type", [2.0, 1.0])
def test_module_per_sample_gradients_through_functional_call(norm_type: float, fallback_warnings: list) -> None:
    torch.manual_seed(12)
    model = _Tagger(norm_type).double()
    with torch.no_grad():
        model.embedding.weight.mul_(3)
    tokens = _indices(12)
    tokens[1, 1] = 0  # the padding row
    expected = _module_loop(model, tokens)
    params = {name: p.detach() for name, p in model.named_parameters()}
    before, version = params["embedding.weight"].clone(), model.embedding.weight._version
    step: Callable[[], dict[str, torch.Tensor]] = lambda: vmap(  # noqa: E731
        grad(lambda p, t: functional_call(model, p, (t,))), in_dims=(None, 0))(params, tokens)
    with pytest.raises(RuntimeError, match="embedding_renorm_"):
        step()
    fallback_warnings.clear()  # PyTorch's own attempt falls back before it raises
    with registry.use():
        got = step()
    assert _fallbacks(fallback_warnings) == []
    assert set(got) == set(expected)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-12, atol=1e-12, msg=lambda m, name=name: f"{name}: {m}")
    assert (got["embedding.weight"][:, 0] == 0).all()
    _unchanged(model.embedding.weight, before, version)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_embedding_bag_with_max_norm_reads_the_recorded_renorm(mode: str) -> None:
    # F.embedding_bag(max_norm=...) renorms, then embedding_bag looks the rows up: under vmap with the weight shared,
    # the renorm is recorded and embedding_bag's composite reads it (it read the unrenormed rows, silently).
    weight, indices = _weight(), _indices().reshape(SAMPLES, -1)
    offsets = torch.tensor([0, 2])

    def bag(w: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        return F.embedding_bag(i, w, offsets, max_norm=MAX_NORM, mode=mode)

    def bag_loss(w: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        return bag(w, i).pow(3).sum()

    expected = torch.stack([bag(weight.clone(), indices[b]) for b in range(SAMPLES)])
    expected_grads = []
    for b in range(SAMPLES):
        leaf = weight.clone().requires_grad_()
        expected_grads.append(torch.autograd.grad(bag_loss(leaf, indices[b]), leaf)[0])
    before, version = weight.clone(), weight._version
    with registry.use():
        outputs = vmap(bag, in_dims=(None, 0))(weight, indices)
        grads = vmap(grad(bag_loss), in_dims=(None, 0))(weight, indices)
    torch.testing.assert_close(outputs, expected)
    torch.testing.assert_close(grads, torch.stack(expected_grads))
    _unchanged(weight, before, version)


def test_until_a_renorm_is_recorded_the_lookup_is_pytorchs_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """With batched indices and a shared weight, no lookup can read a recorded renorm before embedding_renorm_ has
    recorded one: PyTorch's embedding runs (no Python frame); the first record drops the decisions, and the lookup
    then reads it."""
    monkeypatch.setattr(embedding, "_recording", embedding._Recording())
    selector.clear_cache()
    before = registry.select("embedding", stack="vmap,grad", batched=["indices"], dtype="float32")
    assert before.composite == "native"
    weight = torch.randn(10, 4) * 3
    ids = torch.tensor([[1, 2], [2, 3], [7, 7]])
    lookup = vmap(grad(lambda w, i: F.embedding(i, w).square().sum()), in_dims=(None, 0))
    with registry.use():
        plain = lookup(weight, ids)
    torch.testing.assert_close(plain, torch.stack([2 * torch.zeros_like(weight).index_add(0, i, weight[i])
                                                   for i in ids]))
    renormed = vmap(lambda w, i: F.embedding(i, w, max_norm=1.0), in_dims=(None, 0))
    with registry.use():
        got = renormed(weight, ids)
    assert embedding._recording.seen
    after = registry.select("embedding", stack="vmap,grad", batched=["indices"], dtype="float32")
    assert after.composite == "reads_recorded_renorm"
    for b, i in enumerate(ids):
        torch.testing.assert_close(got[b], F.embedding(i, weight.clone(), max_norm=1.0))
